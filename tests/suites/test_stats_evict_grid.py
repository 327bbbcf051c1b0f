"""Attention statistics, eviction and streaming caches, checked as a grid against the float64
reference.

* ``attention_stats``: the column sums, column maxima and row entropies of the reference's
  float64 weights (``attention(..., backend="reference", return_weights=True)``), for every mask
  kind, bias, softcap, sinks, scale, grouped heads both ways, empty sizes, fully masked rows,
  extreme scores, low-precision inputs, a given (or stale) log-sum-exp, the meta device,
  ``torch.compile`` and inputs that need gradients; and the O(T) memory promise at 16k tokens.
* ``keep()``: on contiguous and paged caches (both layouts), float and quantized, latent
  (values a view of the keys): the tokens kept, in time order, with their scales, and attention
  over them equal to the reference over exactly those tokens; every refusal leaves the whole
  state as it was.
* ``StreamingKVCache``: StreamingLLM's sinks and rolling window re-derived here (a query at
  position ``t`` sees tokens ``0 .. S - 1`` and ``t - W + 1 .. t``), against the reference over
  exactly those tokens at every step of long runs, chunks and prompts longer than the cache,
  quantized storage, rotary positions as the docs give them, and a compiled decode step.
"""

from __future__ import annotations

import copy
import math
import resource
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import KVCache, PagedKVCache, StreamingKVCache, attention_stats, masks
from attnkit.caches._quantize import quantize_fp8, quantize_int8
from attnkit.scores import DistanceBias, RelativePositionTerm
from attnkit.testing import assert_close

from ..helpers import LargestTensor, attnkit_checks_only

F64 = torch.float64


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def _double(x: object) -> object:
    return x.double() if isinstance(x, Tensor) and x.is_floating_point() else x


def reference_stats(q: Tensor, k: Tensor, **kw: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Column sums, column maxima and row entropies of the float64 reference's weights
    ``(..., H, Tq, Tk)`` (``per_kv_head``: sums and maxima over each group's query heads)."""
    per_kv = kw.pop("per_kv_head", False)
    kw = {name: _double(value) for name, value in kw.items()}
    _, w = attnkit.attention(
        q.double(), k.double(), k.double(), return_weights=True, backend="reference", **kw
    )
    top = w.amax(-2) if w.size(-2) else w.new_zeros((*w.shape[:-2], w.size(-1)))
    entropy = torch.where(w > 0, -w * w.log(), torch.zeros_like(w)).sum(-1)
    mass = w.sum(-2)
    if per_kv and q.size(-3) != k.size(-3):
        mass = mass.unflatten(-2, (k.size(-3), -1)).sum(-2)
        top = top.unflatten(-2, (k.size(-3), -1)).amax(-2)
    return mass, top, entropy


def check_stats(
    got: attnkit.AttentionStats,
    want: tuple[Tensor, Tensor, Tensor],
    dtype: torch.dtype = torch.float32,
    atol: float | None = None,
) -> None:
    work = torch.promote_types(dtype, torch.float32)
    for name, ref in zip(("key_mass", "key_max", "entropy"), want, strict=True):
        value = getattr(got, name)
        assert value.dtype == work, (name, value.dtype)
        assert value.shape == ref.shape, (name, value.shape, ref.shape)
        if atol is None:
            assert_close(value, ref, dtype=dtype)
        else:
            torch.testing.assert_close(value.double(), ref, atol=atol, rtol=0, msg=name)


# ---------------------------------------------------------------------------------------------
# attention_stats: every mask kind and modifier

B, H, HKV, TQ, TK, D = 2, 4, 2, 23, 37, 8


def _slopes() -> Tensor:
    return attnkit.alibi_slopes(H)


def _index_rows() -> Tensor:
    idx = torch.randint(0, TK, (B, 1, TQ, 5), generator=torch.Generator().manual_seed(3))
    return idx.masked_fill(idx % 4 == 0, -1)  # -1: no key


STATS_CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "none": lambda: {},
    "causal-bottom-right": lambda: {"causal": True},
    "causal-top-left": lambda: {"mask": masks.causal(align="top_left")},
    "sliding-window": lambda: {"mask": masks.sliding_window(5)},
    "sliding-window-both-sides": lambda: {"mask": masks.sliding_window(4, right=3)},
    "documents-lengths": lambda: {"mask": masks.documents([10, 20, 7])},
    "documents-ids": lambda: {
        "mask": masks.documents(ids=torch.tensor([[0] * 12 + [1] * 25, [0] * 30 + [2] * 7]))
    },
    "key-padding-lengths": lambda: {"mask": masks.key_padding([0, 30])},
    "key-padding-tensor": lambda: {"mask": masks.key_padding(torch.tensor([37, 5]))},
    "key-padding-left": lambda: {"mask": masks.key_padding([3, 30], side="left")},
    "chunks": lambda: {"mask": masks.documents([8, 8, 8, 8, 5]) & masks.causal()},
    "prefix-lm": lambda: {"mask": masks.causal() | masks.key_padding([6, 6])},
    "from-fn": lambda: {"mask": masks.from_fn(lambda b, h, i, j: ((i + j + h) % 3 == 0) | (j < b))},
    "key-indices": lambda: {"mask": masks.key_indices(_index_rows())},
    "block-indices": lambda: {
        "mask": masks.block_indices(torch.tensor([[[[0, 3]] * TQ]] * B), block=8) & masks.causal()
    },
    "and": lambda: {"mask": masks.sliding_window(6) & masks.key_padding([20, 37])},
    "or": lambda: {"mask": masks.sliding_window(2) | masks.documents([10, 27])},
    "dense-bool": lambda: {"mask": randn(B, 1, TQ, TK, seed=5) > 0.2},
    "dense-bool-negated": lambda: {"mask": ~masks.causal_mask(TQ, TK)},
    "bias-dense": lambda: {"bias": randn(B, H, TQ, TK, seed=6)},
    "bias-broadcast": lambda: {"bias": randn(H, 1, TK, seed=7), "causal": True},
    "bias-with-minus-inf": lambda: {
        "bias": randn(TQ, TK, seed=8).masked_fill(randn(TQ, TK, seed=9) > 0.8, -math.inf)
    },
    "alibi-dense": lambda: {"bias": attnkit.alibi_bias(H, TQ, TK), "causal": True},
    "alibi-term": lambda: {"bias": attnkit.alibi_term(_slopes(), TQ, TK), "causal": True},
    "distance-bias": lambda: {
        "bias": DistanceBias(randn(H, TQ + TK - 1, seed=10), first=-(TK - 1)),
        "mask": masks.sliding_window(9),
    },
    "transformer-xl-term": lambda: {
        "bias": RelativePositionTerm(
            randn(B, H, TQ, D, seed=11), randn(H, TQ + TK - 1, D, seed=12), 0.3
        ),
        "causal": True,
    },
    "softcap": lambda: {"softcap": 0.7, "causal": True},
    "sinks": lambda: {"sinks": torch.tensor([0.5, -1.0, -math.inf, 3.0]), "causal": True},
    "sinks-padding": lambda: {
        "sinks": torch.tensor([1.0, 2.0, 0.0, -2.0]),
        "mask": masks.key_padding([0, 9]),
    },
    "scale": lambda: {"scale": 0.05},
    "scale-negative": lambda: {"scale": -2.0, "causal": True},
    "score-mod": lambda: {
        "score_mod": lambda s, b, h, i, j: s - 0.2 * (i - j).abs(),
        "causal": True,
    },
}


@pytest.fixture(params=["native", "eager"])
def stats_pass(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The native kernel's pass where it serves the call (when it builds), or the eager loop."""
    if request.param == "eager":
        monkeypatch.setattr(attnkit.stats, "stats_refusal", lambda *a: "the eager kernel (forced)")
    elif not attnkit._native.load():
        pytest.skip(f"native kernel: {attnkit._native.status()[1]}")
    return str(request.param)


@pytest.mark.parametrize("case", list(STATS_CASES))
# (per_kv_head sums the pass's outputs afterwards: one pairing of the two covers both)
@pytest.mark.parametrize(
    ("given_lse", "per_kv_head"),
    [(False, False), (True, True)],
    ids=["lse-pass-per-q-head", "lse-given-per-kv-head"],
)
def test_stats_equal_the_reference_weights(
    case: str, given_lse: bool, per_kv_head: bool, stats_pass: str
) -> None:
    q, k = randn(B, H, TQ, D, seed=1), randn(B, HKV, TK, D, seed=2)
    kw = STATS_CASES[case]()
    lse = None
    if given_lse:
        lse = attnkit.attention(q, k, randn(B, HKV, TK, 3, seed=4), **kw, return_lse=True)[1]
    got = attention_stats(q, k, **kw, lse=lse, per_kv_head=per_kv_head)
    check_stats(got, reference_stats(q, k, **kw, per_kv_head=per_kv_head))


STRIDED: dict[str, Callable[[], tuple[Tensor, Tensor]]] = {
    "k-expanded-along-Tk": lambda: (
        randn(3, 4, 40, D, seed=1),
        randn(3, 2, 1, D, seed=2).expand(-1, -1, 70, -1),
    ),
    "k-expanded-along-batch": lambda: (
        randn(3, 4, 40, D, seed=1),
        randn(1, 2, 70, D, seed=2).expand(3, -1, -1, -1),
    ),
    "k-expanded-along-heads": lambda: (
        randn(3, 4, 40, D, seed=1),
        randn(3, 1, 70, D, seed=2).expand(-1, 2, -1, -1),
    ),
    "q-expanded-along-batch": lambda: (
        randn(1, 4, 40, D, seed=1).expand(3, -1, -1, -1),
        randn(3, 2, 70, D, seed=2),
    ),
    "token-major-views": lambda: (
        randn(3, 40, 4, D, seed=1).transpose(1, 2),
        randn(3, 70, 4, D, seed=2)[:, :, ::2].transpose(1, 2),
    ),
    "every-other-column": lambda: (
        randn(3, 4, 40, 2 * D, seed=1)[..., ::2],
        randn(3, 2, 70, 2 * D, seed=2)[..., 1::2],
    ),
}


@pytest.mark.parametrize("layout", list(STRIDED))
@pytest.mark.parametrize("given_lse", [False, True], ids=["lse-pass", "lse-given"])
def test_strided_and_expanded_inputs(layout: str, given_lse: bool, stats_pass: str) -> None:
    q, k = STRIDED[layout]()
    kw: dict[str, Any] = {"causal": True, "bias": randn(40, 70, seed=3)}
    lse = attnkit.attention(q, k, k, **kw, return_lse=True)[1] if given_lse else None
    check_stats(attention_stats(q, k, **kw, lse=lse), reference_stats(q, k, **kw))


def test_a_sinks_share_is_no_keys_mass() -> None:
    # A sink of logit +40 takes almost all of each row: the keys' mass is what is left.
    q, k = randn(1, 2, 6, D, seed=1), randn(1, 2, 6, D, seed=2)
    sinks = torch.tensor([40.0, -math.inf])
    got = attention_stats(q, k, sinks=sinks)
    assert float(got.key_mass[0, 0].sum()) < 1e-9
    assert_close(got.key_mass[0, 1].sum(), torch.tensor(6.0), dtype=torch.float32)
    check_stats(got, reference_stats(q, k, sinks=sinks))


def test_negating_a_structured_mask_is_refused_in_words() -> None:
    with pytest.raises(TypeError, match=r"~causal\(\): attnkit masks cannot be negated"):
        ~masks.causal()


@pytest.mark.parametrize(
    ("bq", "h", "hkv", "tq", "tk"),
    [(1, 4, 2, 7, 0), (1, 4, 2, 0, 7), (0, 4, 2, 7, 7), (2, 4, 1, 1, 1), (1, 2, 2, 40, 3)],
    ids=["Tk=0", "Tq=0", "B=0", "one-pair", "Tq>Tk"],
)
@pytest.mark.parametrize("given_lse", [False, True])
def test_empty_and_degenerate_sizes(
    bq: int, h: int, hkv: int, tq: int, tk: int, given_lse: bool
) -> None:
    q, k = randn(bq, h, tq, D, seed=1), randn(bq, hkv, tk, D, seed=2)
    kw: dict[str, Any] = {"causal": True, "sinks": torch.zeros(h)}
    lse = attnkit.attention(q, k, k, **kw, return_lse=True)[1] if given_lse else None
    for per_kv in (False, True):
        got = attention_stats(q, k, **kw, lse=lse, per_kv_head=per_kv)
        check_stats(got, reference_stats(q, k, **kw, per_kv_head=per_kv))


def test_fully_masked_rows_give_no_mass_and_entropy_zero_as_documented(stats_pass: str) -> None:
    q, k = randn(2, 2, 5, D, seed=1), randn(2, 2, 9, D, seed=2)
    for kw in (
        {"mask": masks.key_padding([0, 9])},
        {"mask": torch.zeros(5, 9, dtype=torch.bool)},
        {"bias": torch.full((5, 9), -math.inf)},
        {"mask": masks.key_padding([0, 4]), "sinks": torch.tensor([2.0, -1.0])},
    ):
        got = attention_stats(q, k, **kw)  # type: ignore[arg-type]
        assert torch.equal(got.entropy[0], torch.zeros(2, 5))
        assert torch.equal(got.key_mass[0], torch.zeros(2, 9))
        assert torch.equal(got.key_max[0], torch.zeros(2, 9))
        check_stats(got, reference_stats(q, k, **kw))
    doc = attnkit.AttentionStats.__doc__ or ""
    assert "0 for a query with no visible key" in doc
    assert "0 for a key no" in doc


def test_extreme_scores_in_float64_are_exact_to_their_rounding(stats_pass: str) -> None:
    q, k = randn(1, 2, 9, D, seed=1), randn(1, 2, 13, D, seed=2)
    q = q.double() * 1e3  # scores of thousands: one key takes a row's whole weight
    q[0, 0, 0] = 1e6
    # Scores up to ~5e8: a weight exp(s - lse) carries s's own rounding, which is float64's
    # epsilon times the largest score (~1e-7 at scale 100), however s is summed.
    for kw in ({}, {"causal": True}, {"scale": 100.0, "mask": masks.sliding_window(3)}):
        scale = 100.0 if "scale" in kw else D**-0.5
        rounding = torch.finfo(F64).eps * (q @ k.double().mT).abs().max().item() * scale
        got = attention_stats(q, k.double(), **kw)  # type: ignore[arg-type]
        check_stats(got, reference_stats(q, k, **kw), dtype=F64, atol=2 * rounding)


def test_large_float32_scores_stay_within_their_rounding() -> None:
    # float32 scores of ~1e3 carry ~1e-4 of rounding into the exponent: the weights' error
    q, k = randn(1, 2, 9, D, seed=1) * 300, randn(1, 2, 13, D, seed=2)
    got = attention_stats(q, k, causal=True)
    check_stats(got, reference_stats(q, k, causal=True), atol=2e-3)
    assert_close(got.key_mass.sum(-1), torch.full((1, 2), 9.0), dtype=torch.float32)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_against_float64_of_the_same_values(
    dtype: torch.dtype, backend: str
) -> None:
    """float32 statistics of the same values, whichever form computes them (the reference's
    form too: not sums of weights rounded to the inputs' dtype)."""
    q, k = randn(2, 4, 17, D, seed=1, dtype=dtype), randn(2, 2, 17, D, seed=2, dtype=dtype)
    bias = randn(17, 17, seed=3, dtype=dtype)
    sinks = torch.tensor([0.5, 1.0, -1.0, 0.0], dtype=dtype)
    kw: dict[str, Any] = {"causal": True, "bias": bias, "sinks": sinks}
    lse = attnkit.attention(q, k, k, **kw, return_lse=True)[1]
    for given in (None, lse):
        got = attention_stats(q, k, **kw, lse=given, backend=backend)
        check_stats(got, reference_stats(q, k, **kw), torch.float32)


# ---------------------------------------------------------------------------------------------
# attention_stats: the log-sum-exp given


def test_a_wrong_lse_is_refused_in_words() -> None:
    q, k = randn(2, 4, 5, D, seed=1), randn(2, 2, 7, D, seed=2)
    lse = attnkit.attention(q, k, k, return_lse=True)[1]
    want = r"lse must have shape \(\.\.\., H, Tq\) = \(2, 4, 5\) for q \(2, 4, 5, 8\), got "
    shapes = (
        (lse[..., :-1], r"\(2, 4, 4\)"),
        (lse[0], r"\(4, 5\)"),
        (lse[None], r"\(1, 2, 4, 5\)"),
    )
    with attnkit_checks_only():
        for bad, shape in shapes:
            with pytest.raises(ValueError, match=want + shape):
                attention_stats(q, k, lse=bad)
        for bad, got in ((lse.long(), "int64"), (lse.tolist(), "list"), (lse.numpy(), "ndarray")):
            with pytest.raises(TypeError, match=f"lse must be a float tensor .*got {got}"):
                attention_stats(q, k, lse=bad)  # type: ignore[arg-type]


def test_a_stale_lse_scales_each_row_as_documented() -> None:
    """An lse ``c`` larger than the call's (not checked: that would be the pass it saves) gives
    the weights ``exp(s - lse) = w e^-c``: mass and maxima ``e^-c`` times, entropy
    ``e^-c (h + c)``."""
    q, k = randn(1, 2, 6, D, seed=1), randn(1, 2, 6, D, seed=2)
    lse = attnkit.attention(q, k, k, causal=True, return_lse=True)[1]
    shift = torch.tensor([0.0, 1.0, 2.0, -0.5, 3.0, 0.25])  # per query
    fresh = attention_stats(q, k, causal=True, lse=lse)
    stale = attention_stats(q, k, causal=True, lse=lse + shift)
    _, w = attnkit.attention(
        q.double(), k.double(), k.double(), causal=True, return_weights=True, backend="reference"
    )
    w = w * (-shift.double()).exp()[:, None]
    assert_close(stale.key_mass, w.sum(-2), dtype=torch.float32)
    assert_close(stale.key_max, w.amax(-2), dtype=torch.float32)
    want = (-shift).exp() * (fresh.entropy + shift)
    assert_close(stale.entropy, want, dtype=torch.float32)
    assert "not checked" in (attention_stats.__doc__ or "")


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_a_stale_lse_of_minus_inf_gives_the_row_no_weight(backend: str) -> None:
    """As documented: a query given -inf has no weight (the rule of a query with no visible
    key), on the one-pass form and the reference's alike; +inf gives weights e^-inf = 0."""
    q, k = randn(1, 2, 4, D, seed=1), randn(1, 2, 6, D, seed=2)
    lse = attnkit.attention(q, k, k, causal=True, return_lse=True)[1].clone()
    lse[0, 0, 1], lse[0, 1, 2] = -math.inf, math.inf
    got = attention_stats(q, k, causal=True, lse=lse, backend=backend)
    _, w = attnkit.attention(
        q.double(), k.double(), k.double(), causal=True, return_weights=True, backend="reference"
    )
    w[0, 0, 1] = w[0, 1, 2] = 0.0
    assert_close(got.key_mass, w.sum(-2), dtype=torch.float32)
    assert_close(got.key_max, w.amax(-2), dtype=torch.float32)
    assert_close(got.entropy, torch.special.entr(w).sum(-1), dtype=torch.float32)
    assert "given ``-inf`` has no weight" in (attention_stats.__doc__ or "")


def test_tensors_are_required_where_tensors_are_expected() -> None:
    q, k = randn(1, 2, 5, D, seed=1), randn(1, 2, 7, D, seed=2)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"q": q.tolist(), "k": k}, "q must be a torch.Tensor, got list"),
        ({"q": q.numpy(), "k": k}, "q must be a torch.Tensor, got ndarray"),
        ({"q": q, "k": k.numpy()}, "k must be a torch.Tensor, got ndarray"),
        (
            {"q": q, "k": k, "sinks": [0.0, 1.0]},
            r"sinks must be a float tensor \(H,\) or None, got list",
        ),
        (
            {"q": q, "k": k, "mask": np.ones((5, 7), bool)},
            "mask must be a bool tensor .* got ndarray",
        ),
        ({"q": q, "k": k, "bias": np.zeros((5, 7))}, "bias must be a float tensor .* got ndarray"),
    ]
    with attnkit_checks_only():
        for kw, message in cases:
            with pytest.raises(TypeError, match=message):
                attention_stats(**kw)


@pytest.mark.parametrize(
    "kw",
    [
        {"causal": True},
        {"mask": masks.key_padding(torch.tensor([3, 9], device="meta"))},
        {"bias": attnkit.alibi_term(torch.ones(4, device="meta"), 5, 9)},
        {"sinks": "sinks", "per_kv_head": True},
        {"lse": torch.empty(2, 4, 5, device="meta")},
        {"backend": "reference", "causal": True},
    ],
    ids=["causal", "padding", "alibi", "sinks-per-kv", "lse", "reference"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_meta_tensors_give_the_shapes_and_dtype(kw: dict[str, Any], dtype: torch.dtype) -> None:
    q = torch.empty(2, 4, 5, D, device="meta", dtype=dtype)
    k = torch.empty(2, 2, 9, D, device="meta", dtype=dtype)
    if kw.get("sinks") == "sinks":
        kw = {**kw, "sinks": torch.zeros(4, device="meta", dtype=dtype)}
    got = attention_stats(q, k, **kw)
    heads = 2 if kw.get("per_kv_head") else 4
    work = torch.promote_types(dtype, torch.float32)
    for t, shape in (
        (got.key_mass, (2, heads, 9)),
        (got.key_max, (2, heads, 9)),
        (got.entropy, (2, 4, 5)),
    ):
        assert (t.device.type, tuple(t.shape), t.dtype) == ("meta", shape, work)


def test_inputs_that_need_gradients_give_statistics_without_one() -> None:
    q = randn(1, 4, 6, D, seed=1).requires_grad_()
    k = randn(1, 2, 8, D, seed=2).requires_grad_()
    out, lse = attnkit.attention(q, k, k, causal=True, return_lse=True)
    got = attention_stats(q, k, causal=True, lse=lse)
    assert not any(t.requires_grad for t in (got.key_mass, got.key_max, got.entropy))
    check_stats(got, reference_stats(q.detach(), k.detach(), causal=True))
    out.sum().backward()  # the forward's graph is untouched by the pass
    assert q.grad is not None
    assert k.grad is not None
    assert "carry no gradient" in (attention_stats.__doc__ or "")


def test_compiled_calls_run_the_pass_between_graphs_and_fullgraph_refuses_in_words() -> None:
    def f(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        got = attention_stats(q, k, mask=masks.sliding_window(3))
        return got.key_mass * 2, got.entropy + 1

    torch._dynamo.reset()
    try:
        compiled = torch.compile(f, dynamic=True, backend="eager")
        for t in (6, 9):
            q, k = randn(1, 2, t, D, seed=t), randn(1, 2, t, D, seed=t + 1)
            want = reference_stats(q, k, mask=masks.sliding_window(3))
            mass, entropy = compiled(q, k)
            assert_close(mass, want[0] * 2, dtype=torch.float32)
            assert_close(entropy, want[2] + 1, dtype=torch.float32)
        torch._dynamo.reset()  # (else the graphs made above serve the call)
        strict = torch.compile(f, fullgraph=True, dynamic=True, backend="eager")
        with pytest.raises(Exception, match="reads whether q and k are finite"):
            strict(randn(1, 2, 6, D, seed=1), randn(1, 2, 6, D, seed=2))
    finally:
        torch._dynamo.reset()


def test_vmap_is_refused_in_words_and_the_reference_form_runs_there() -> None:
    q, k = randn(3, 1, 2, 5, D, seed=1), randn(3, 1, 2, 7, D, seed=2)
    with pytest.raises(RuntimeError, match=r"torch\.func\.vmap cannot read: give it the batched q"):
        torch.func.vmap(lambda q, k: attention_stats(q, k, causal=True).key_mass)(q, k)
    mapped = torch.func.vmap(
        lambda q, k: attention_stats(q, k, causal=True, backend="reference").key_mass
    )(q, k)
    assert_close(mapped, reference_stats(q, k, causal=True)[0], dtype=torch.float32)


def test_sixteen_thousand_tokens_make_no_scores_sized_tensor() -> None:
    """The O(T) promise at T = 16,384 (one head: a (Tq, Tk) float32 tensor would be 1 GiB): no
    operation makes a tensor of more than T * 16 elements, and the process's peak memory grows
    by far less than the weights' size."""
    t = 16384
    q, k = randn(1, 1, t, 16, seed=1), randn(1, 1, t, 16, seed=2)
    lse = attnkit.attention(q, k, k[..., :0], causal=True, return_lse=True)[1]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with LargestTensor() as seen:
        got = attention_stats(q, k, causal=True, lse=lse)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert seen.largest <= t * 16, seen.largest
    assert grown * 1024 < t * t * 4 // 4, grown
    # every query gives out weight 1; the last key is seen by the last query alone
    assert_close(got.key_mass.sum(), torch.tensor(float(t)), dtype=torch.float32)
    assert_close(got.key_mass[0, 0, -1], got.key_max[0, 0, -1], dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# keep(): eviction on contiguous and paged caches

KINDS = [None, torch.int8, torch.float8_e4m3fn]
KIND_IDS = ["float", "int8", "fp8"]
DV_LATENT = 6  # a latent cache's values: the keys' first 6 columns


def snapshot(cache: object) -> dict[str, object]:
    """Every attribute of a cache, tensors cloned (float8 as bytes), the rest deep-copied."""
    out: dict[str, object] = {}
    items = dict(vars(cache))
    items.update({f"buffer.{n}": t for n, t in items.pop("_buffers", {}).items()})
    for name, value in items.items():
        if name.startswith("_") and ("hooks" in name or name in ("_parameters", "_modules")):
            continue
        if isinstance(value, Tensor):
            out[name] = (
                value.view(torch.uint8).clone() if value.element_size() == 1 else value.clone()
            )
        else:
            out[name] = copy.deepcopy(value)
    return out


def assert_same_state(before: dict[str, object], after: dict[str, object]) -> None:
    assert before.keys() == after.keys()
    for name, value in before.items():
        other = after[name]
        if isinstance(value, Tensor):
            assert isinstance(other, Tensor), name
            assert value.shape == other.shape, name
            assert torch.equal(value, other), name
        else:
            assert value == other, name


def held(cache: KVCache | PagedKVCache, row: int | None = None) -> tuple[Tensor, Tensor]:
    """The tokens a cache holds, as stored (dequantized), float64 copies: a contiguous cache's
    ``(B, Hkv, L, D)``, a paged sequence's ``(1, Hkv, L, D)``."""
    view = cache.view()
    k, v = view.dense(F64) if row is None else view.row(row, F64)
    return k.double().clone(), v.double().clone()  # (a float cache's are views, in its dtype)


def make_contiguous(kv_dtype: torch.dtype | None, latent: bool) -> tuple[KVCache, Tensor, Tensor]:
    """A cache of 2 rows holding 11 tokens (latent: one head whose values are its keys' first
    columns), and the tokens as stored, dequantized ``(B, Hkv, 11, D)``."""
    heads = 1 if latent else 2
    cache = KVCache(
        2, 24, heads, D, DV_LATENT if latent else None, kv_dtype=kv_dtype, values_in_keys=latent
    )
    k = randn(2, heads, 11, D, seed=11) * 2
    cache.update(k, None if latent else randn(2, heads, 11, D, seed=12))
    keys, values = held(cache)
    return cache, keys, values


def make_paged(
    kv_dtype: torch.dtype | None, latent: bool, layout: str
) -> tuple[PagedKVCache, list[tuple[Tensor, Tensor]]]:
    """A pool of pages of 4 holding two sequences of 13 and 6 tokens, and each sequence's tokens
    as stored, dequantized ``(1, Hkv, L, D)``."""
    heads = 1 if latent else 2
    cache = PagedKVCache(
        16,
        4,
        heads,
        D,
        DV_LATENT if latent else None,
        max_seqs=2,
        layout=layout,  # type: ignore[arg-type]
        kv_dtype=kv_dtype,
        values_in_keys=latent,
    )
    cache.schedule([13, 6])
    k = randn(2, heads, 13, D, seed=13) * 2
    cache.stage(k, None if latent else randn(2, heads, 13, D, seed=14))
    cache.commit()
    return cache, [held(cache, n) for n in range(2)]


def chosen(rows: int, heads: int, length: int, kept: int, seed: int) -> Tensor:
    """``(rows, heads, kept)`` distinct tokens per row and head, unsorted."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack(
        [torch.randperm(length, generator=g)[:kept] for _ in range(rows * heads)]
    ).view(rows, heads, kept)


def gathered(t: Tensor, index: Tensor) -> Tensor:
    """``t`` ``(..., Hkv, L, D)`` at the tokens ``index`` ``(..., Hkv, K)``, in time order."""
    at = index.sort(-1).values
    return t.gather(-2, at.unsqueeze(-1).expand(*at.shape, t.size(-1)))


def step_against_reference(
    cache: KVCache | PagedKVCache, keys: list[Tensor], values: list[Tensor], seed: int
) -> Tensor:
    """One decoding step of 4 query heads through the cache against the float64 reference over
    ``keys``/``values`` per row (the tokens the cache should hold) and the new token as stored;
    returns the step's output."""
    heads = keys[0].size(1)
    latent = cache.values_in_keys
    q = randn(len(keys), 4, 1, D, seed=seed)
    new_k = randn(len(keys), heads, 1, D, seed=seed + 1)
    new_v = None if latent else randn(len(keys), heads, 1, D, seed=seed + 2)
    if isinstance(cache, KVCache):
        out = attnkit.attention(q, cache.stage_call(q, new_k, new_v), None)
        cache.commit()
        held_k, held_v = held(cache)
        stored = [(held_k[n : n + 1, :, -1:], held_v[n : n + 1, :, -1:]) for n in range(len(keys))]
    else:
        out, _ = cache.attention(q, new_k, new_v)
        cache.commit()
        stored = [tuple(t[:, :, -1:] for t in held(cache, n)) for n in range(len(keys))]
    for n, (k_n, v_n) in enumerate(zip(keys, values, strict=True)):
        kk = torch.cat([k_n, stored[n][0]], 2)
        vv = torch.cat([v_n, stored[n][1]], 2)
        want = attnkit.attention(q[n : n + 1].double(), kk, vv, backend="reference")
        assert_close(out[n : n + 1], want, dtype=torch.float32)
    return out


@pytest.mark.parametrize("kv_dtype", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("latent", [False, True], ids=["mha", "latent"])
def test_keep_on_a_contiguous_cache(kv_dtype: torch.dtype | None, latent: bool) -> None:
    cache, keys, values = make_contiguous(kv_dtype, latent)
    heads = keys.size(1)
    index = chosen(2, heads, 11, 5, seed=1)
    scales = None if cache.k_scale is None else cache.k_scale.clone()
    cache.keep(index)
    assert (cache.length, cache.position) == (5, 11)  # positions still count every token
    held_k, held_v = held(cache)
    assert torch.equal(held_k, gathered(keys, index))
    assert torch.equal(held_v, gathered(values, index))
    if kv_dtype == torch.int8:  # each token's scale moved with it
        assert scales is not None
        assert cache.k_scale is not None
        assert torch.equal(cache.k_scale[:, :, :5], gathered(scales, index))
    if latent:  # the values are still the keys' first columns, not a copy beside them
        assert cache.v_cache.data_ptr() == cache.k_cache.data_ptr()
        assert cache.v_cache.stride() == cache.k_cache.stride()
        assert cache.v_scale is cache.k_scale
    # cached == uncached: a step over the kept tokens equals the reference over exactly them
    kept_k, kept_v = gathered(keys, index), gathered(values, index)
    if kv_dtype is None:  # and a fresh cache of the same tokens: the same step, the same output
        fresh = KVCache(2, 24, heads, D, DV_LATENT if latent else None, values_in_keys=latent)
        fresh.update(kept_k.float(), None if latent else kept_v.float())
        uncached = step_against_reference(fresh, list(kept_k.split(1)), list(kept_v.split(1)), 20)
    out = step_against_reference(cache, list(kept_k.split(1)), list(kept_v.split(1)), seed=20)
    if kv_dtype is None:
        assert torch.equal(out, uncached)
        assert torch.equal(held(fresh)[0], held(cache)[0])


@pytest.mark.parametrize("kv_dtype", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("order", ["sorted", "reversed"])
def test_keeping_every_token_changes_nothing(kv_dtype: torch.dtype | None, order: str) -> None:
    cache, _, _ = make_contiguous(kv_dtype, False)
    every = torch.arange(11).expand(2, 2, 11)
    before = snapshot(cache)
    cache.keep(every if order == "sorted" else every.flip(-1))
    assert_same_state(before, snapshot(cache))


@pytest.mark.parametrize("kv_dtype", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("latent", [False, True], ids=["mha", "latent"])
@pytest.mark.parametrize("layout", ["flash", "vllm"])
def test_keep_on_a_paged_cache(kv_dtype: torch.dtype | None, latent: bool, layout: str) -> None:
    cache, rows = make_paged(kv_dtype, latent, layout)
    heads = rows[0][0].size(1)
    index = chosen(1, heads, 13, 5, seed=2)[0]
    free = cache.num_free_pages
    assert cache.pages_of(0) == [0, 1, 2, 3]
    cache.keep(0, index)
    assert (cache.lengths, cache.positions) == ([5, 6], [13, 6])
    assert len(cache.pages_of(0)) == 2  # ceil(5 / 4): the other two back in the pool
    assert cache.num_free_pages == free + 2
    kept_k, kept_v = gathered(rows[0][0], index[None]), gathered(rows[0][1], index[None])
    got_k, got_v = held(cache, 0)
    assert torch.equal(got_k, kept_k)
    assert torch.equal(got_v, kept_v)
    assert all(torch.equal(a, b) for a, b in zip(held(cache, 1), rows[1], strict=True))
    if latent:
        assert cache.v_pages.data_ptr() == cache.k_pages.data_ptr()
        assert cache.v_scales is cache.k_scales
    if kv_dtype is None:  # a fresh pool of the same tokens: the same step, the same output
        fresh = PagedKVCache(
            16,
            4,
            heads,
            D,
            DV_LATENT if latent else None,
            max_seqs=2,
            layout=layout,  # type: ignore[arg-type]
            values_in_keys=latent,
        )
        fresh.schedule([5, 6])
        pad = (0, 0, 0, 1)  # row 0's 5 tokens padded to row 1's 6
        k_both = torch.cat([torch.nn.functional.pad(kept_k, pad), rows[1][0]]).float()
        v_both = torch.cat([torch.nn.functional.pad(kept_v, pad), rows[1][1]]).float()
        fresh.stage(k_both, None if latent else v_both)
        fresh.commit()
        uncached = step_against_reference(fresh, [kept_k, rows[1][0]], [kept_v, rows[1][1]], 30)
    out = step_against_reference(cache, [kept_k, rows[1][0]], [kept_v, rows[1][1]], seed=30)
    if kv_dtype is None:
        assert_close(out, uncached.double(), dtype=torch.float32)
    # keep everything, then nothing: the sequence empties and takes a new first write
    cache.keep(1, torch.arange(7).expand(heads, 7))
    assert cache.lengths == [6, 7]
    cache.keep(0, torch.zeros(heads, 0, dtype=torch.long))
    assert (cache.lengths, cache.pages_of(0), cache.positions) == ([0, 7], [], [14, 7])
    other = held(cache, 1)
    step_against_reference(cache, [kept_k[:, :, :0], other[0]], [kept_v[:, :, :0], other[1]], 40)


@pytest.mark.parametrize("layout", ["flash", "vllm"])
def test_a_float8_sequence_grows_again_after_keep_with_its_scale(layout: str) -> None:
    """After keep, new pages come from the pool: the tokens written there are read with the
    sequence's scale (within float8's rounding of the values given)."""
    cache, _ = make_paged(torch.float8_e5m2, False, layout)
    cache.keep(0, chosen(1, 2, 13, 2, seed=3)[0])
    new = randn(2, 2, 9, D, seed=50)
    cache.schedule([9, 0])
    cache.stage(new, new)
    cache.commit()
    got = held(cache, 0)[0][:, :, 2:]
    torch.testing.assert_close(got, new[:1].double(), atol=0.1, rtol=0.13)


@pytest.mark.parametrize("layout", ["flash", "vllm"])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["float", "int8"])
def test_keep_through_pages_interleaved_with_other_sequences(
    layout: str, kv_dtype: torch.dtype | None
) -> None:
    """Sequences that grew a token at a time side by side, one freed and taken again: their
    pages interleave in the pool, and keep moves tokens through the block table alone."""
    cache = PagedKVCache(20, 2, 2, D, max_seqs=3, layout=layout, kv_dtype=kv_dtype)  # type: ignore[arg-type]
    with torch.no_grad():
        for i in range(12):
            if i == 9:
                cache.free(2)
            cache.schedule([1, i % 2, 1])
            x = randn(3, 2, 1, D, seed=100 + i)
            cache.stage(x, x)
            cache.commit()
    pages = cache.pages_of(0)
    assert pages != sorted(pages) or pages != list(range(pages[0], pages[0] + len(pages)))
    rows = [held(cache, n) for n in range(3)]
    index = torch.tensor([[11, 0, 3, 5, 8], [7, 6, 1, 2, 10]])
    cache.keep(0, index)
    for got, was in zip(held(cache, 0), rows[0], strict=True):
        assert torch.equal(got, gathered(was, index[None]))
    for n in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(held(cache, n), rows[n], strict=True))
    assert len(cache.pages_of(0)) == 3


def test_a_float8_cache_kept_to_nothing_takes_a_new_scale() -> None:
    """As documented: a float8 cache's scale is set by the first write after it is empty."""
    cache, _, _ = make_contiguous(torch.float8_e4m3fn, False)
    cache.keep(torch.zeros(2, 2, 0, dtype=torch.long))
    big = randn(2, 2, 3, D, seed=70) * 500  # far beyond the first tokens' range
    cache.update(big, big)
    got, _ = held(cache)
    torch.testing.assert_close(got, big.double(), atol=0.0, rtol=0.07)


BAD_INDICES: list[tuple[Callable[[int, int], object], type[Exception], str]] = [
    (lambda h, n: [[0, 1]] * h, TypeError, "must be an integer tensor, got list"),
    (lambda h, n: torch.zeros(h, 2), TypeError, "must be an integer tensor, got float32"),
    (
        lambda h, n: torch.ones(h, 2, dtype=torch.bool),
        TypeError,
        "must be an integer tensor, got bool",
    ),
    (lambda h, n: torch.zeros(h + 1, 2, dtype=torch.long), ValueError, r"must have shape"),
    (
        lambda h, n: torch.arange(n + 1).expand(h, n + 1),
        ValueError,
        "keeps {n1} tokens of a row",
    ),
    (lambda h, n: torch.tensor([[0, n]] * h), ValueError, "must be from 0 to {last}.*got {n}"),
    (lambda h, n: torch.tensor([[-1, 2]] * h), ValueError, "must be from 0 to {last}.*got -1"),
    (lambda h, n: torch.tensor([[3, 1, 3]] * h), ValueError, "keeps token 3 twice"),
    (lambda h, n: torch.zeros(h, 2, dtype=torch.long, device="meta"), ValueError, "on meta"),
]


@pytest.mark.parametrize("bad", range(len(BAD_INDICES)))
@pytest.mark.parametrize("cache_kind", ["contiguous", "paged-flash", "paged-vllm"])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["float", "int8"])
def test_a_refused_keep_changes_nothing(
    bad: int, cache_kind: str, kv_dtype: torch.dtype | None
) -> None:
    make, error, message = BAD_INDICES[bad]
    if cache_kind == "contiguous":
        cache, _keys, _ = make_contiguous(kv_dtype, False)
        n, indices = 11, make(2, 11)
        if isinstance(indices, Tensor) and indices.ndim == 2:
            indices = indices.expand(2, *indices.shape)
        cache.stage(randn(2, 2, 3, D, seed=60), randn(2, 2, 3, D, seed=61))  # a stage pending

        def keep() -> None:
            cache.keep(indices)  # type: ignore[arg-type]
    else:
        cache, _ = make_paged(kv_dtype, False, cache_kind.split("-")[1])  # type: ignore[assignment]
        n, indices = 13, make(2, 13)
        cache.stage(randn(2, 2, 3, D, seed=60), randn(2, 2, 3, D, seed=61))

        def keep() -> None:
            cache.keep(0, indices)  # type: ignore[call-arg, arg-type]

    before = snapshot(cache)
    message = (
        message.replace("{n1}", str(n + 1)).replace("{last}", str(n - 1)).replace("{n}", str(n))
    )
    with attnkit_checks_only(), pytest.raises(error, match=message):
        keep()
    assert_same_state(before, snapshot(cache))


# ---------------------------------------------------------------------------------------------
# StreamingKVCache: StreamingLLM's sinks and window


def streaming_visible(start: int, new: int, seen: int, sinks: int, window: int) -> Tensor:
    """StreamingLLM's rule, from the paper's description: the query at position ``t`` sees the
    first ``sinks`` tokens and the ``window`` latest up to itself, ``t - window + 1 .. t``.
    ``(new, seen)`` for queries ``start .. start + new - 1`` over tokens ``0 .. seen - 1``."""
    t = torch.arange(start, start + new)[:, None]
    j = torch.arange(seen)[None, :]
    return (j <= t) & ((j < sinks) | (j > t - window))


def stored_form(
    x: Tensor, kv_dtype: torch.dtype | None, scale: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Tokens as a streaming cache of ``kv_dtype`` stores them, dequantized as attnkit reads
    them (``k.float() * k_scale``), in float64, and the float8 scale of the cache (set by its
    first write)."""
    if kv_dtype is None:
        return x.double(), None
    if kv_dtype == torch.int8:
        xq, s = quantize_int8(x)
        return (xq.float() * s).double(), None
    xq, s = quantize_fp8(x, kv_dtype, scale=scale)
    return (xq.float() * s).double(), s


def run_streaming(
    sinks: int,
    window: int,
    chunks: list[int],
    *,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> StreamingKVCache:
    """Feed ``chunks`` of tokens through a cache (2 rows, 4 query heads over 2 key/value heads)
    and check every output against the float64 reference over exactly the tokens StreamingLLM
    keeps for each query; the cache's memory never moves or grows."""
    cache = StreamingKVCache(
        2, 2, D, sink_tokens=sinks, window=window, dtype=dtype, kv_dtype=kv_dtype
    )
    memory = [(t.data_ptr(), t.shape) for t in (cache.k_cache, cache.v_cache)]
    keys: list[Tensor] = []
    values: list[Tensor] = []
    scales: list[Tensor | None] = [None, None]
    start = 0
    for i, n in enumerate(chunks):
        q = randn(2, 4, n, D, seed=seed + 3 * i, dtype=dtype)
        k = randn(2, 2, n, D, seed=seed + 3 * i + 1, dtype=dtype) * 2
        v = randn(2, 2, n, D, seed=seed + 3 * i + 2, dtype=dtype)
        out, lse = cache.attention(q, k, v)
        for store, x, at in ((keys, k, 0), (values, v, 1)):
            form, scale = stored_form(x, kv_dtype, scales[at])
            scales[at] = scales[at] if scales[at] is not None else scale
            store.append(form.to(dtype).double())
        kk, vv = torch.cat(keys, 2), torch.cat(values, 2)
        allowed = streaming_visible(start, n, kk.size(2), sinks, window)
        want, want_lse = attnkit.attention(
            q.double(), kk, vv, mask=allowed, backend="reference", return_lse=True
        )
        assert_close(out, want, dtype=dtype)
        assert_close(lse, want_lse, dtype=dtype)
        start += n
        assert (cache.position, cache.length) == (start, min(start, sinks + window))
        assert [(t.data_ptr(), t.shape) for t in (cache.k_cache, cache.v_cache)] == memory
    return cache


SINKS_AND_WINDOWS = [(4, 8), (0, 5), (3, 1), (1, 1), (0, 1), (6, 3)]


@pytest.mark.parametrize(("sinks", "window"), SINKS_AND_WINDOWS)
def test_decoding_three_caches_long_keeps_the_sinks_and_the_window(sinks: int, window: int) -> None:
    run_streaming(sinks, window, [1] * (3 * (sinks + window)))


@pytest.mark.parametrize(("sinks", "window"), SINKS_AND_WINDOWS)
def test_prompts_longer_than_the_cache_and_chunks_longer_than_the_window(
    sinks: int, window: int
) -> None:
    size = sinks + window
    run_streaming(sinks, window, [2 * size + 3] + [1] * size + [window + 2, 1, size + 1, 1])
    run_streaming(sinks, window, [max(1, sinks // 2), 1, window + 1, 1, 3, 2 * window, 1])


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_dtypes_and_stored_formats_against_the_tokens_as_stored(
    dtype: torch.dtype, kv_dtype: torch.dtype | None
) -> None:
    run_streaming(2, 4, [7, 1, 1, 5, 1, 1, 1, 9, 1, 1], dtype=dtype, kv_dtype=kv_dtype)


def test_scale_softcap_and_sink_logits_of_a_streaming_call() -> None:
    """The call's own modifiers apply over the kept tokens: scale, softcap and gpt-oss's sink
    logits (which take weight without a value, unlike the cache's sink tokens)."""
    cache = StreamingKVCache(1, 2, D, sink_tokens=2, window=3, kv_dtype=torch.int8)
    logits = torch.tensor([0.5, -1.0, 2.0, 0.0])
    keys: list[Tensor] = []
    values: list[Tensor] = []
    start = 0
    for i, n in enumerate([4, 1, 1, 1, 6, 1, 2, 1, 1]):
        q, k, v = (randn(1, h, n, D, seed=10 * i + j) for j, h in enumerate((4, 2, 2)))
        keys.append(stored_form(k, torch.int8, None)[0])
        values.append(stored_form(v, torch.int8, None)[0])
        out, lse = cache.attention(q, k, v, scale=0.3, softcap=2.0, sinks=logits)
        kk, vv = torch.cat(keys, 2), torch.cat(values, 2)
        want, want_lse = attnkit.attention(
            q.double(),
            kk,
            vv,
            mask=streaming_visible(start, n, kk.size(2), 2, 3),
            scale=0.3,
            softcap=2.0,
            sinks=logits.double(),
            backend="reference",
            return_lse=True,
        )
        assert_close(out, want, dtype=torch.float32)
        assert_close(lse, want_lse, dtype=torch.float32)
        start += n


def test_rewinding_a_chunk_gives_back_what_it_wrote_over() -> None:
    cache = run_streaming(1, 2, [3, 1, 1])
    before = [t.clone() for t in (cache.k_cache, cache.v_cache)]
    x = randn(2, 2, 4, D, seed=80)
    cache.attention(randn(2, 4, 4, D, seed=81), x, x)
    cache.rewind(5)
    assert cache.position == 5
    assert all(
        torch.equal(a, b) for a, b in zip(before, (cache.k_cache, cache.v_cache), strict=True)
    )
    with pytest.raises(ValueError, match=r"cannot rewind to position 3: .* go back to position 4"):
        cache.rewind(3)


def test_memory_stays_flat_over_a_long_run() -> None:
    """Every tensor the cache holds keeps its size over 40 caches' worth of steps."""
    cache = StreamingKVCache(1, 1, 4, sink_tokens=2, window=3, kv_dtype=torch.int8)

    def held_bytes() -> int:
        return sum(
            t.untyped_storage().nbytes() for t in vars(cache).values() if isinstance(t, Tensor)
        )

    x = torch.randn(1, 1, 1, 4)
    cache.attention(x, x, x)
    first = held_bytes()
    for _ in range(200):
        cache.attention(x, x, x)
        assert held_bytes() == first
    assert (cache.position, cache.length) == (201, 5)


def test_a_window_of_zero_or_negative_sinks_are_refused_in_words() -> None:
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        StreamingKVCache(1, 1, 4, sink_tokens=2, window=0)
    with pytest.raises(ValueError, match="sink_tokens must be >= 0, got -1"):
        StreamingKVCache(1, 1, 4, sink_tokens=-1, window=2)


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_reset_starts_a_new_stream(kv_dtype: torch.dtype | None) -> None:
    cache = run_streaming(2, 3, [9, 1, 1], kv_dtype=kv_dtype)
    cache.reset()
    assert (cache.position, cache.length) == (0, 0)
    # a stream of much larger values: a float8 cache takes a new scale from its first write
    big = randn(2, 2, 4, D, seed=90) * 300
    q = randn(2, 4, 4, D, seed=91)
    out, _ = cache.attention(q, big, big)
    form, _ = stored_form(big, kv_dtype, None)
    want = attnkit.attention(
        q.double(), form, form, mask=streaming_visible(0, 4, 4, 2, 3), backend="reference"
    )
    assert_close(out, want, dtype=torch.float32)


def test_a_refused_call_changes_nothing_a_later_query_sees() -> None:
    cache = run_streaming(2, 3, [7, 1])
    before = [t.clone() for t in (cache.k_cache, cache.v_cache)]
    with pytest.raises((TypeError, ValueError)):
        cache.attention(
            torch.randn(2, 4, 3, D), torch.randn(2, 2, 3, D).double(), torch.randn(2, 2, 3, D)
        )
    with pytest.raises(ValueError, match="q brings 2 queries but k and v 3 new tokens"):
        cache.attention(torch.randn(2, 4, 2, D), torch.randn(2, 2, 3, D), torch.randn(2, 2, 3, D))
    assert cache.position == 8
    assert all(
        torch.equal(a, b) for a, b in zip(before, (cache.k_cache, cache.v_cache), strict=True)
    )


def test_rotary_positions_are_the_sequence_positions_as_documented() -> None:
    """A module with rotary embeddings decoding through the cache rotates each key at its own
    position in the sequence (``offset = cache.position``), not at its slot: its outputs equal
    the module over the whole sequence with the sinks-or-window mask."""
    torch.manual_seed(0)
    m = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2, rotary=attnkit.RotaryEmbedding(4)).eval()
    sinks, window, steps = 2, 3, 14
    x = torch.randn(1, steps, 16, dtype=F64)
    m = m.double()
    cache = StreamingKVCache(1, 2, 4, sink_tokens=sinks, window=window, dtype=F64)
    with torch.no_grad():
        full = m(x, mask=streaming_visible(0, steps, steps, sinks, window))
        got = [m(x[:, :8], cache=cache, causal=True)]  # a prompt longer than S + W
        got += [m(x[:, i : i + 1], cache=cache, causal=True) for i in range(8, steps)]
    assert_close(torch.cat(got, 1), full, dtype=F64)


def test_a_compiled_decode_step_is_one_graph_once_the_ring_is_full() -> None:
    """torch.compile(fullgraph=True, dynamic=True) of a decode step, the cache an argument: the
    outputs equal the reference over the kept tokens at every step, and the graphs are one per
    phase of the cache (sinks filling, window filling, ring full), not one per step."""

    def step(cache: StreamingKVCache, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return cache.attention(q, k, v)[0]

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        # (backend "eager": dynamo's graphs and guards are what is checked, without their compile)
        compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="eager")
        cache = StreamingKVCache(1, 2, D, sink_tokens=1, window=2)
        keys: list[Tensor] = []
        values: list[Tensor] = []
        stats = torch._dynamo.utils.counters["stats"]
        full = 0
        for i in range(6):
            q, k, v = (
                randn(1, 4, 1, D, seed=3 * i),
                randn(1, 2, 1, D, seed=3 * i + 1),
                randn(1, 2, 1, D, seed=3 * i + 2),
            )
            keys.append(k.double())
            values.append(v.double())
            out = compiled(cache, q, k, v)
            kk, vv = torch.cat(keys, 2), torch.cat(values, 2)
            want = attnkit.attention(
                q.double(), kk, vv, mask=streaming_visible(i, 1, i + 1, 1, 2), backend="reference"
            )
            assert_close(out, want, dtype=torch.float32)
            if i == 3:  # the ring is full from position 3 on (S + W = 3)
                full = stats["unique_graphs"]
        assert 0 < full <= 4, full
        assert stats["unique_graphs"] == full  # no graph made for the steps after
    finally:
        torch._dynamo.reset()
