"""Old spellings: each use warns, naming the new spelling, and does what the new one does; the test
suite turns an unexpected use into an error."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

import attnkit
from attnkit import _deprecated
from attnkit.interop.torch import from_torch_masks

PAD = torch.tensor([[False, False, True]])  # torch's convention: True = padding


def test_a_function_alias_warns_at_the_callers_line_and_returns_the_same() -> None:
    with pytest.warns(DeprecationWarning, match="from_torch_masks") as record:
        got = attnkit.from_torch_masks(key_padding_mask=PAD, num_heads=2)
    (warning,) = record
    assert str(warning.message) == (
        "attnkit.from_torch_masks is deprecated and will be removed in the next release: use "
        "attnkit.interop.torch.from_torch_masks"
    )
    assert warning.filename == __file__
    want = from_torch_masks(key_padding_mask=PAD, num_heads=2)
    assert got[1] is want[1] is None
    assert torch.equal(got[0], want[0])  # type: ignore[arg-type]


def test_the_old_top_level_name_is_not_public_any_more() -> None:
    assert "from_torch_masks" not in attnkit.__all__
    assert attnkit.from_torch_masks.__doc__ == "Deprecated: attnkit.interop.torch.from_torch_masks."


def test_an_old_spelling_used_unexpectedly_fails_the_suite() -> None:
    # pyproject's filterwarnings: attnkit's deprecations are errors wherever the call is made, so
    # the suite and the docs' examples cannot keep using an old spelling by accident.
    with pytest.raises(DeprecationWarning, match=r"use attnkit\.interop\.torch\.from_torch_masks"):
        attnkit.from_torch_masks(key_padding_mask=PAD, num_heads=2)


def test_an_alias_method_is_a_class_method_or_a_method() -> None:
    class Thing:
        def __init__(self, n: int) -> None:
            self.n = n

    def build(n: int) -> Thing:
        return Thing(n)

    def double(thing: Thing, *, by: int = 2) -> int:
        return thing.n * by

    _deprecated.alias_method(Thing, "build", build, "attnkit.build")
    _deprecated.alias_method(Thing, "double", double, "attnkit.double", kind="method")
    with pytest.warns(DeprecationWarning, match=r"^attnkit\.Thing\.build is deprecated"):
        thing = Thing.build(3)  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match=r"^attnkit\.Thing\.double is deprecated.*"):
        assert thing.double(by=5) == 15  # type: ignore[attr-defined]
    assert Thing.build.__qualname__ == "Thing.build"  # type: ignore[attr-defined]


def test_moved_names_warn_on_reading_and_refuse_others() -> None:
    module = types.ModuleType("attnkit.old")
    module.__getattr__ = _deprecated.moved_names(  # type: ignore[method-assign]
        "attnkit.old", {"thing": (lambda: 42, "attnkit.new.thing")}
    )
    with pytest.warns(DeprecationWarning, match=r"^attnkit\.old\.thing is deprecated.*new\.thing"):
        assert module.thing == 42  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match=r"module 'attnkit\.old' has no attribute 'other'"):
            module.other  # type: ignore[attr-defined]  # noqa: B018


def test_the_reference_function_under_the_backends_name_warns_and_computes_the_same() -> None:
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    with pytest.warns(DeprecationWarning, match=r'use attnkit\.attention\(\.\.\., backend="ref'):
        got = attnkit.backends.reference(
            q, q, q, mask=None, bias=None, scale=0.5, softcap=None, sinks=None,
            dropout_p=0.0, return_weights=False,
        )  # fmt: skip
    assert torch.equal(got, attnkit.attention(q, q, q, scale=0.5, backend="reference"))
    assert "reference" not in attnkit.backends.__all__
    assert "Reference" in attnkit.backends.__all__
