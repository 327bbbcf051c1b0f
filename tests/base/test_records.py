"""made(): a frozen dataclass made without its __init__ equals the one its __init__ makes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from attnkit._base.records import made
from attnkit.masks import Geometry


@dataclass(frozen=True)
class _Plain:
    a: int
    b: str
    c: tuple[int, ...] = (1, 2)
    d: float | None = None


@dataclass(frozen=True)
class _Checked:
    a: int

    def __post_init__(self) -> None:
        if self.a < 0:
            raise ValueError(f"a must be >= 0, got {self.a}")


@dataclass(frozen=True)
class _Listed:
    a: int
    xs: list[int] = field(default_factory=list)


def test_a_made_record_equals_the_one_its_init_makes_defaults_included() -> None:
    got = made(_Plain, a=1, b="x")
    want = _Plain(1, "x")
    assert got == want
    assert hash(got) == hash(want)
    assert repr(got) == repr(want)
    assert vars(got) == vars(want)
    assert dataclasses.asdict(made(_Plain, a=2, b="y", d=0.5)) == {
        "a": 2,
        "b": "y",
        "c": (1, 2),
        "d": 0.5,
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.a = 3  # type: ignore[misc]


def test_a_geometry_made_so_asks_and_hashes_as_the_dataclass_made_one() -> None:
    device = torch.device("cpu")
    got = made(Geometry, batch_shape=(2, 3), heads=4, q_len=5, kv_len=7, device=device)
    want = Geometry((2, 3), 4, 5, 7, device)
    assert got == want
    assert {got: 1}[want] == 1
    assert (got.batch, got.shift, got.dtype) == (6, 2, torch.float32)


def test_a_class_whose_init_does_more_is_made_by_its_init() -> None:
    """A ``__post_init__`` (a check) or a default factory runs as the class says."""
    with pytest.raises(ValueError, match="a must be >= 0, got -1"):
        made(_Checked, a=-1)
    first, second = made(_Listed, a=1), made(_Listed, a=2)
    assert first.xs == []
    assert first.xs is not second.xs  # each its own list, as the factory makes it


def test_a_record_first_made_inside_a_compiled_graph_breaks_nothing() -> None:
    """The first ``made`` of a class inside ``torch.compile(fullgraph=True)`` is its
    ``__init__``: dynamo cannot trace the look at its fields, which would break the graph."""

    @dataclass(frozen=True)
    class Fresh:  # (a class no call has made yet)
        x: torch.Tensor
        k: int = 2

    @torch.compile(fullgraph=True, backend="eager")
    def scaled(x: torch.Tensor) -> torch.Tensor:
        r = made(Fresh, x=x)
        return r.x * r.k

    x = torch.arange(3.0)
    assert torch.equal(scaled(x), x * 2)
    assert made(Fresh, x=x) == Fresh(x)  # (eagerly, afterwards: made without its __init__)
