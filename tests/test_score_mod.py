"""Score mods: which captured tensors are found, what is refused, how a tile's result is checked,
which are recognised as a softcap."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import Tensor

from attnkit import _score_mod as score_mod_module
from attnkit._score_mod import (
    apply,
    captured_tensors,
    check_captured,
    check_elementwise,
    distance_bias_of,
    index_tensors,
    softcap_of,
)
from attnkit.masks import Geometry

TABLE = torch.randn(8, requires_grad=True)
FROZEN = torch.randn(8)


def global_mod(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return s + TABLE[h] + FROZEN[h]


class Biased(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(8))

    def forward(self, s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + self.bias[h]

    def mod(self, s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + self.bias[h]


def test_captured_tensors_are_found_where_they_can_be() -> None:
    w = torch.ones(8, requires_grad=True)
    d = torch.ones(8, requires_grad=True)

    def closure(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s * w[h]

    def default(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, d: Tensor = d) -> Tensor:
        return s * d[h]

    def partial(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, p: Tensor) -> Tensor:
        return s * p[h]

    module = Biased()
    assert captured_tensors(closure) == (w,)
    assert captured_tensors(default) == (d,)
    assert captured_tensors(global_mod) == (TABLE,)  # FROZEN needs no gradient
    assert captured_tensors(functools.partial(partial, p=w)) == (w,)
    assert captured_tensors(module) == (module.bias,)
    assert captured_tensors(module.mod) == (module.bias,)
    assert captured_tensors(lambda s, b, h, q, kv: s * 2) == ()


def test_a_hidden_tensor_is_refused_and_a_seen_one_is_not() -> None:
    hidden = torch.ones(3, requires_grad=True)

    def helper() -> Tensor:
        return hidden

    def mod(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + helper()[h]

    with pytest.raises(ValueError, match=r"cannot see \(shapes \(3\)\)"):
        check_captured(mod, captured_tensors(mod), torch.float32, torch.device("cpu"))
    derived = hidden * 2.0  # a non-leaf seen in the closure: its graph is its own business

    def seen(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + derived[h]

    check_captured(seen, captured_tensors(seen), torch.float32, torch.device("cpu"))


def test_a_tiles_result_is_checked_and_broadcast() -> None:
    idx = index_tensors(2, 3, 4, 9, 0, 6, torch.device("cpu"))
    assert [tuple(i.shape) for i in idx] == [(2, 1, 1, 1), (1, 3, 1, 1), (1, 1, 5, 1), (1, 1, 1, 6)]
    assert idx[2].flatten().tolist() == [4, 5, 6, 7, 8]
    s = torch.zeros(2, 3, 5, 6)
    out = apply(lambda s, b, h, q, kv: (q - kv).float(), s, idx)
    assert out.shape == s.shape
    assert torch.equal(out[1, 2], (idx[2] - idx[3]).float()[0, 0])
    with pytest.raises(TypeError, match=r"must return a float tensor .*, got torch.bool"):
        apply(lambda s, b, h, q, kv: q > kv, s, idx)
    with pytest.raises(ValueError, match=r"returned shape \(7\), which does not broadcast"):
        apply(lambda s, b, h, q, kv: torch.zeros(7), s, idx)


def test_a_tile_may_come_back_as_itself_but_not_as_other_scores() -> None:
    """Its input, a view of all of it, or its input written in place is the tile; any other view
    of the tile's memory puts other scores in a score's place."""
    idx = index_tensors(1, 2, 0, 4, 0, 4, torch.device("cpu"))  # a square tile: (1, 2, 4, 4)
    for mod in (
        lambda s, b, h, q, kv: s,
        lambda s, b, h, q, kv: s[...],
        lambda s, b, h, q, kv: s.view_as(s),
        lambda s, b, h, q, kv: s.mul_(2.0),
    ):
        s = torch.arange(32.0).view(1, 2, 4, 4)
        out = apply(mod, s, idx)
        assert out.data_ptr() == s.data_ptr()
    for mod in (
        lambda s, b, h, q, kv: s[..., :1],
        lambda s, b, h, q, kv: s[..., 1:2, :],
        lambda s, b, h, q, kv: s.transpose(-1, -2),  # the tile's shape, other scores
        lambda s, b, h, q, kv: s[:, :1].expand_as(s),
        lambda s, b, h, q, kv: s.view(-1)[:16].view(1, 1, 4, 4),
    ):
        with pytest.raises(ValueError, match=r"returned a view of other scores .*elementwise"):
            apply(mod, torch.zeros(1, 2, 4, 4), idx)


def _geometry(b: int, h: int, tq: int, tk: int) -> Geometry:
    return Geometry((b,), h, tq, tk, torch.device("cpu"), torch.float64)


def test_check_elementwise_keeps_the_answer_for_a_plain_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []

    def counted(*args: object) -> Tensor:
        calls.append(1)
        return apply(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(score_mod_module, "apply", counted)

    def mod(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + FROZEN[h]

    check_elementwise(mod, _geometry(2, 4, 9, 9))
    assert len(calls) == 2  # the tile and its sub-tile
    check_elementwise(mod, _geometry(2, 4, 9, 9))
    assert len(calls) == 2
    check_elementwise(mod, _geometry(1, 4, 9, 9))  # another probe tile: probed again
    assert len(calls) == 4
    check_elementwise(functools.partial(mod), _geometry(2, 4, 9, 9))  # not a plain function
    check_elementwise(functools.partial(mod), _geometry(2, 4, 9, 9))
    assert len(calls) == 8


def test_check_elementwise_on_calls_too_small_to_tell() -> None:
    """On one score every function is elementwise; on one key, a reduction over the keys is
    the score itself, and a reduction over the queries is still seen."""
    check_elementwise(lambda s, b, h, q, kv: s.sum(), _geometry(1, 1, 1, 1))
    check_elementwise(lambda s, b, h, q, kv: s.sum(-1, keepdim=True), _geometry(2, 2, 5, 1))
    with pytest.raises(ValueError, match="not elementwise"):
        check_elementwise(lambda s, b, h, q, kv: s.sum(-2, keepdim=True), _geometry(1, 1, 5, 1))


def test_check_elementwise_draws_nothing_from_the_global_generator() -> None:
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    check_elementwise(lambda s, b, h, q, kv: s * 3.0, _geometry(2, 2, 5, 5))
    assert torch.equal(torch.rand(3), want)


CAP = 20.0
CAP_T = torch.tensor(20.0)
CAP_GRAD = torch.tensor(20.0, requires_grad=True)
OTHER = 21.0


def global_cap(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return CAP * torch.tanh(s / CAP)


def _closure(c: float) -> object:
    return lambda s, b, h, q, kv: torch.tanh(s / c) * c


RECOGNISED: dict[str, tuple[object, float]] = {
    "global": (global_cap, 20.0),
    "closure": (_closure(3.5), 3.5),
    "methods": (lambda s, b, h, q, kv: s.div(CAP).tanh().mul(CAP), 20.0),
    "functions": (lambda s, b, h, q, kv: torch.mul(torch.tanh(torch.div(s, 2)), 2), 2.0),
    "tensor": (lambda s, b, h, q, kv: CAP_T * torch.tanh(s / CAP_T), 20.0),
    "tensor methods": (lambda s, b, h, q, kv: (s / CAP_T).tanh() * CAP_T, 20.0),
    "default": (lambda s, b, h, q, kv, c=5.0: c * torch.tanh(s / c), 5.0),
}

LOOK_ALIKES: dict[str, object] = {
    "two constants": lambda s, b, h, q, kv: CAP * torch.tanh(s / OTHER),
    "tensor needing grad": lambda s, b, h, q, kv: CAP_GRAD * torch.tanh(s / CAP_GRAD),
    "uses q_idx": lambda s, b, h, q, kv: CAP * torch.tanh(s / CAP) + 0 * q,
    "uses h": lambda s, b, h, q, kv: CAP * torch.tanh(s / (CAP + h)),
    "one more op": lambda s, b, h, q, kv: CAP * torch.tanh(s / CAP) * 1.0,
    "reciprocal": lambda s, b, h, q, kv: CAP * torch.tanh(s * (1 / CAP)),
    "branch on a score": lambda s, b, h, q, kv: CAP * torch.tanh(s / CAP) if s.max() < 3 else s,
    "negative c": lambda s, b, h, q, kv: -2.0 * torch.tanh(s / -2.0),
    "per-head c": lambda s, b, h, q, kv: FROZEN[h] * torch.tanh(s / FROZEN[h]),
    "identity": lambda s, b, h, q, kv: s,
    "tanh only": lambda s, b, h, q, kv: torch.tanh(s),
    "partial": functools.partial(lambda s, b, h, q, kv, c: c * torch.tanh(s / c), c=2.0),
    "module": Biased(),
    "calls a Python function": lambda s, b, h, q, kv: global_cap(s, b, h, q, kv),
}


@pytest.mark.parametrize("name", RECOGNISED)
def test_a_softcap_score_mod_is_recognised_in_its_spellings(name: str) -> None:
    fn, cap = RECOGNISED[name]
    assert softcap_of(fn) == cap  # type: ignore[arg-type]
    assert softcap_of(fn) == cap  # type: ignore[arg-type]  # from the cache


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_look_alikes_are_not_recognised(name: str) -> None:
    assert softcap_of(LOOK_ALIKES[name]) is None  # type: ignore[arg-type]


def test_the_cache_follows_what_the_function_reads() -> None:
    c = 2.0
    mod = lambda s, b, h, q, kv: c * torch.tanh(s / c)  # noqa: E731
    assert softcap_of(mod) == 2.0
    c = 4.0  # rebinding the closure's cell
    assert softcap_of(mod) == 4.0
    t = torch.tensor(3.0)
    tmod = lambda s, b, h, q, kv: t * torch.tanh(s / t)  # noqa: E731
    assert softcap_of(tmod) == 3.0
    t.fill_(6.0)  # in place: the tensor's version changes
    assert softcap_of(tmod) == 6.0
    t.requires_grad_()
    assert softcap_of(tmod) is None
    d = 2.0
    half = lambda s, b, h, q, kv: c * torch.tanh(s / d)  # noqa: E731
    assert softcap_of(half) is None
    d = 4.0
    assert softcap_of(half) == 4.0


def test_a_score_mod_without_tanh_is_never_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    traced = []
    monkeypatch.setattr(score_mod_module, "_trace_softcap", lambda fn: traced.append(fn))
    scale = torch.tensor(0.5)
    assert softcap_of(lambda s, b, h, q, kv: s * scale) is None
    scale.mul_(2.0)  # a 0-d tensor written in place each step: no trace per call either
    assert softcap_of(lambda s, b, h, q, kv: s * scale) is None
    assert not traced
    assert softcap_of(lambda s, b, h, q, kv: torch.tanh(s) * scale) is None
    assert len(traced) == 1


TABLE_H = torch.randn(4, 40)


def _distance_mods() -> tuple[dict[str, object], dict[str, object]]:
    """Score_mods that add a function of (b, h, q_idx - kv_idx), and look-alikes that read an
    index some other way."""
    by_distance = {
        "c * (q_idx - kv_idx)": lambda s, b, h, q, kv: s + 0.3 * (q - kv),
        "c * (kv_idx - q_idx)": lambda s, b, h, q, kv: s + 0.3 * (kv - q),
        "table[h, q_idx - kv_idx + 20]": lambda s, b, h, q, kv: s + TABLE_H[h, q - kv + 20],
        "twice the distance": lambda s, b, h, q, kv: s + 0.1 * (q - kv) - 0.2 * (kv - q) ** 2,
        "b and h only": lambda s, b, h, q, kv: s + h - 0.5 * b,
    }
    not_by_distance = {
        "c * (q_idx - 3)": lambda s, b, h, q, kv: s + 0.3 * (q - 3),
        "c * (kv_idx - 3)": lambda s, b, h, q, kv: s + 0.3 * (kv - 3),
        "c * (3 - kv_idx)": lambda s, b, h, q, kv: s + 0.3 * (3 - kv),
        "q_idx alone": lambda s, b, h, q, kv: s + q,
        "kv_idx alone": lambda s, b, h, q, kv: s + 0.1 * kv,
        "q_idx * 2 - kv_idx": lambda s, b, h, q, kv: s + 0.1 * (q * 2 - kv),
        "(q_idx - kv_idx) * q_idx": lambda s, b, h, q, kv: s + 0.01 * (q - kv) * q,
        "|q_idx - 3|": lambda s, b, h, q, kv: s + 0.1 * (q - 3).abs(),
        "table[h, q_idx]": lambda s, b, h, q, kv: s + TABLE_H[h, q],
        "q_idx - kv_idx - 3 (a distance, spelled otherwise)": (
            lambda s, b, h, q, kv: s + 0.1 * ((q - 3) - kv)
        ),
    }
    return by_distance, not_by_distance  # type: ignore[return-value]


BY_DISTANCE, NOT_BY_DISTANCE = _distance_mods()


@pytest.mark.parametrize("name", BY_DISTANCE)
def test_a_bias_by_distance_is_taken_as_one(name: str) -> None:
    mod = BY_DISTANCE[name]
    bias = distance_bias_of(mod, _geometry(2, 4, 9, 13), torch.float64)  # type: ignore[arg-type]
    assert bias is not None
    assert bias.first == -12


@pytest.mark.parametrize("name", NOT_BY_DISTANCE)
def test_a_score_mod_reading_an_index_otherwise_is_no_bias_by_distance(name: str) -> None:
    """Not a function of q_idx - kv_idx as written (``score + c * (q_idx - 3)`` reads q_idx
    alone): a table over distances cannot hold it."""
    mod = NOT_BY_DISTANCE[name]
    assert distance_bias_of(mod, _geometry(2, 4, 9, 13), torch.float64) is None  # type: ignore[arg-type]
