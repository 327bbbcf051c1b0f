"""The statistics pass (``attnkit._kernel.stats``) in blocks of a few rows and keys, against the
weights of the formula in float64: every visit of the plan and only those, the ``-inf`` of
partial blocks and of a bias in full blocks, NaN where a masked pair hides it and where a
visible one shows it, and a log-sum-exp that includes sinks. The native pass
(``torch.ops.attnkit.native_stats``) against the float64 reference's weights for every mask
kind, grouped heads, softcap, sinks, a dense bias with ``-inf``, the position term and a bias by
distance, padding, ``Tk = 0`` and rows that see no key; its schema and fake kernel through
``torch.library.opcheck``; and which pass serves a call."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import _native, masks, scores
from attnkit._kernel import Problem
from attnkit._kernel.planning import block_plan, planned
from attnkit._kernel.stats import TILE, kernel_stats, stats_blocks, stats_refusal
from attnkit._native.kernel import native_call
from attnkit.masks import Geometry, Mask, visibility
from attnkit.testing import assert_close

from .helpers import CPU, randn


def weights(
    q: Tensor,
    k: Tensor,
    scale: float,
    visible: Tensor | None = None,
    bias: Tensor | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The weights ``(N, H, Tq, Tk)`` and the natural-log log-sum-exp ``(N, H, Tq)`` (sinks
    included) from the definition, in float64: grouped key heads repeated, masked pairs out."""
    g = q.size(1) // k.size(1)
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    cols = s if sinks is None else torch.cat([s, sinks[:, None, None].expand(*s.shape[:-1], 1)], -1)
    lse = torch.logsumexp(cols, -1)
    w = torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0).unsqueeze(-1))
    return w, lse


def statistics(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    entropy = torch.where(w > 0, -w * w.log(), torch.zeros_like(w)).sum(-1)
    return w.sum(-2), w.amax(-2), entropy


def _visible(mask: Mask | None, n: int, h: int, tq: int, tk: int) -> Tensor | None:
    if mask is None:
        return None
    return mask.tile(Geometry((n,), h, tq, tk, CPU), 0, tq, 0, tk).expand(n, h, tq, tk)


MASKS = [
    pytest.param(None, id="none"),
    pytest.param(masks.causal(), id="causal"),
    pytest.param(masks.sliding_window(3, right=2), id="window"),
    pytest.param(masks.documents([4, 9, 4]), id="documents"),
    pytest.param(masks.key_padding([0, 11]), id="padding-a-row-with-no-keys"),
]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("block", [(4, 4), (3, 5), (64, 64)], ids=str)
def test_stats_equal_the_formula(mask: Mask | None, block: tuple[int, int]) -> None:
    q, k = randn(2, 4, 13, 8, seed=1), randn(2, 2, 17, 8, seed=2)
    w, lse = weights(q, k, 0.4, _visible(mask, 2, 4, 13, 17))
    got = kernel_stats(
        q, k, lse, mask=mask, bias=None, scale=0.4, block_q=block[0], block_k=block[1]
    )
    for a, b in zip(got, statistics(w), strict=True):
        assert_close(a, b, dtype=torch.float64)


def test_a_minus_inf_bias_in_a_full_block_gives_no_nan() -> None:
    # No mask: every block is FULL, and only the bias hides pairs (whole rows, one of them).
    q, k = randn(1, 2, 9, 4, seed=3), randn(1, 2, 10, 4, seed=4)
    bias = randn(1, 2, 9, 10, seed=5)
    bias = bias.masked_fill(bias > 0.5, -math.inf)
    bias[0, 1, 2] = -math.inf
    w, lse = weights(q, k, 0.5, bias=bias)
    got = kernel_stats(q, k, lse, mask=None, bias=bias, scale=0.5, block_q=4, block_k=4)
    for a, b in zip(got, statistics(w), strict=True):
        assert_close(a, b, dtype=torch.float64)
    assert got[2][0, 1, 2] == 0.0


@pytest.mark.parametrize("native", [False, True], ids=["eager", "native"])
@pytest.mark.parametrize("mask", [None, masks.causal()], ids=["full-blocks", "causal"])
def test_a_row_given_an_infinite_log_sum_exp_has_no_weight(native: bool, mask: Mask | None) -> None:
    # lse = +inf or -inf: the weights exp(s - lse) of that row are 0, and so is its entropy
    # (the eager pass took +inf as its offset: t = -inf in a full block, and 0 * -inf NaN).
    if native and not _native.load():
        pytest.skip(f"native: {_native.status()[1]}")
    q, k = randn(1, 2, 6, 4, seed=40), randn(1, 2, 9, 4, seed=41)
    w, lse = weights(q, k, 0.5, _visible(mask, 1, 2, 6, 9))
    lse[0, 0, 1], lse[0, 1, 4] = math.inf, -math.inf
    w[0, 0, 1], w[0, 1, 4] = 0.0, 0.0
    got = kernel_stats(q, k, lse, mask=mask, bias=None, scale=0.5, native=native)
    for a, b in zip(got, statistics(w), strict=True):
        assert_close(a, b, dtype=torch.float64)
    assert got[2][0, 0, 1] == got[2][0, 1, 4] == 0.0


def test_sinks_take_their_share_through_the_log_sum_exp() -> None:
    q, k = randn(1, 2, 7, 4, seed=6), randn(1, 1, 7, 4, seed=7)
    sinks = torch.tensor([1.5, -0.5], dtype=torch.float64)
    mask = masks.causal()
    w, lse = weights(q, k, 0.5, _visible(mask, 1, 2, 7, 7), sinks=sinks)
    mass, top, entropy = kernel_stats(
        q, k, lse, mask=mask, bias=None, scale=0.5, block_q=2, block_k=3
    )
    want = statistics(w)
    for a, b in zip((mass, top, entropy), want, strict=True):
        assert_close(a, b, dtype=torch.float64)
    # every query gives out less than 1: the sink took the rest
    assert float(mass.sum()) < 2 * 7 - 0.5


def test_nan_a_mask_hides_stays_out_and_nan_it_shows_spreads() -> None:
    q, k = randn(1, 1, 6, 4, seed=8), randn(1, 1, 6, 4, seed=9)
    k[0, 0, 5] = math.nan  # the last key: masked for every query but the last
    mask = masks.causal()
    vis = _visible(mask, 1, 1, 6, 6)
    w, lse = weights(q, k.nan_to_num(0.0), 0.5, vis)
    mass, top, entropy = kernel_stats(
        q, k, lse, mask=mask, bias=None, scale=0.5, block_q=2, block_k=2
    )
    assert torch.isnan(entropy[0, 0, 5])
    assert not torch.isnan(entropy[0, 0, :5]).any()
    assert_close(entropy[0, 0, :5], statistics(w)[2][0, 0, :5], dtype=torch.float64)
    # the NaN key's own statistics are NaN; with the log-sum-exp given finite, no other key's
    assert torch.isnan(mass[0, 0, 5])
    assert torch.isnan(top[0, 0, 5])
    assert_close(mass[0, 0, :5], statistics(w)[0][0, 0, :5], dtype=torch.float64)
    # a -inf bias hides a NaN key from every query (the careful mode), whatever the mask
    bias = torch.zeros(1, 1, 6, 6, dtype=torch.float64)
    bias[..., 5] = -math.inf
    w, lse = weights(q, k.nan_to_num(0.0), 0.5, bias=bias)
    got = kernel_stats(q, k, lse, mask=None, bias=bias, scale=0.5, block_q=2, block_k=2)
    for a, b in zip(got, statistics(w), strict=True):
        assert_close(a, b, dtype=torch.float64)


def test_the_pass_visits_exactly_the_plans_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # A narrow window over 96 queries in blocks of 8: most blocks are EMPTY and never computed.
    q, k = randn(1, 1, 96, 4, seed=10), randn(1, 1, 96, 4, seed=11)
    mask = masks.sliding_window(4)
    geo = Geometry((1,), 1, 96, 96, CPU)
    plan = block_plan(visibility(mask, False), geo, native=False, block_q=8, block_k=8)
    seen: list[tuple[int, int]] = []
    scores = Problem.scores

    def counted(self: Problem, qr: Tensor, qs: int, visit, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((qs, visit.ks))
        return scores(self, qr, qs, visit, *args, **kwargs)

    monkeypatch.setattr(Problem, "scores", counted)
    w, lse = weights(q, k, 0.5, _visible(mask, 1, 1, 96, 96))
    got = kernel_stats(q, k, lse, mask=mask, bias=None, scale=0.5, block_q=8, block_k=8)
    assert sorted(seen) == sorted((qb.qs, v.ks) for qb in plan.grid.blocks for v in qb.visits)
    assert len(seen) < plan.grid.total // 3
    for a, b in zip(got, statistics(w), strict=True):
        assert_close(a, b, dtype=torch.float64)


def test_float16_inputs_are_computed_in_float32() -> None:
    q, k = randn(1, 2, 9, 8, seed=12).half(), randn(1, 2, 9, 8, seed=13).half()
    mask = masks.causal()
    w, lse = weights(q.double(), k.double(), 0.3, _visible(mask, 1, 2, 9, 9))
    got = kernel_stats(q, k, lse.float(), mask=mask, bias=None, scale=0.3, block_q=4, block_k=4)
    for a, b in zip(got, statistics(w), strict=True):
        assert a.dtype == torch.float32
        assert_close(a, b, dtype=torch.float32)


@pytest.mark.parametrize(
    ("batch", "heads"), [((1,), 8), ((2,), 32), ((8,), 32), ((), 1), ((4, 4), 64)]
)
def test_the_blocks_keep_a_visits_tile_within_its_budget(
    batch: tuple[int, ...], heads: int
) -> None:
    geo = Geometry(batch, heads, 32768, 32768, CPU)
    bq, bk = stats_blocks(geo)
    assert 16 <= bq <= 512
    assert bq & (bq - 1) == 0  # a power of two
    assert geo.batch * heads * bq * bk <= TILE or bq == 16


# The native pass (torch.ops.attnkit.native_stats): the same statistics, against the float64
# reference's weights, for every modifier the native forward takes.

native_only = pytest.mark.skipif(not _native.load(), reason=f"native: {_native.status()[1]}")

NATIVE_CASES = [
    pytest.param({}, id="none"),
    pytest.param({"mask": masks.causal()}, id="causal"),
    pytest.param({"mask": masks.causal(align="top_left")}, id="causal-top-left"),
    pytest.param({"mask": masks.sliding_window(3, right=2)}, id="window"),
    pytest.param({"mask": masks.documents([4, 9, 4])}, id="documents"),
    pytest.param({"mask": masks.key_padding([0, 11])}, id="padding-a-row-with-no-keys"),
    pytest.param({"mask": masks.from_fn(lambda b, h, i, j: (i + j) % 3 != 0)}, id="tiles"),
    pytest.param({"mask": masks.causal(), "softcap": 1.5}, id="softcap"),
    pytest.param({"mask": masks.causal(), "sinks": True}, id="sinks"),
    pytest.param({"bias": "dense"}, id="dense-bias-with-minus-inf"),
    pytest.param({"mask": masks.causal(), "bias": "position"}, id="position-term"),
    pytest.param({"mask": masks.sliding_window(4), "bias": "distance"}, id="distance-bias"),
]


def _native_case(
    case: dict[str, object], tq: int = 13, tk: int = 17, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """q (2, 4, tq, 8), k (2, 2, tk, 8) (grouped heads) and the case's attention() arguments."""
    q, k = randn(2, 4, tq, 8, seed=21).to(dtype), randn(2, 2, tk, 8, seed=22).to(dtype)
    kw: dict[str, Any] = {key: val for key, val in case.items() if key in ("mask", "softcap")}
    if case.get("sinks"):
        kw["sinks"] = torch.tensor([1.5, -0.5, -math.inf, 0.25], dtype=dtype)
    if case.get("bias") == "dense":
        bias = randn(2, 4, tq, tk, seed=23)
        kw["bias"] = bias.masked_fill(bias > 1.0, -math.inf).to(dtype)
    elif case.get("bias") == "position":
        qv, enc = randn(2, 4, tq, 8, seed=24).to(dtype), randn(4, tq + tk - 1, 8, seed=25).to(dtype)
        kw["bias"] = scores.RelativePositionTerm(qv, enc, 0.3)
    elif case.get("bias") == "distance":
        kw["bias"] = scores.DistanceBias(randn(4, tq + tk - 1, seed=26).to(dtype), first=-(tk - 1))
    return q, k, kw


def _reference(q: Tensor, k: Tensor, kw: dict[str, Any]) -> tuple[Tensor, ...]:
    """The float64 reference's natural-log log-sum-exp (sinks included) and its weights'
    statistics."""
    kw = {key: val.double() if isinstance(val, Tensor) else val for key, val in kw.items()}
    f64 = q.double(), k.double(), k.double()
    out: Any = attnkit.attention(
        *f64, backend="reference", return_weights=True, return_lse=True, scale=0.35, **kw
    )
    return (out[2], *statistics(out[1]))


def _native_stats(
    q: Tensor, k: Tensor, lse: Tensor, kw: dict[str, Any], **blocks: int
) -> tuple[Tensor, Tensor, Tensor]:
    work = torch.promote_types(q.dtype, torch.float32)
    return kernel_stats(
        q,
        k,
        lse.to(work),
        mask=kw.get("mask"),
        bias=kw.get("bias"),
        scale=0.35,
        softcap=kw.get("softcap"),
        native=True,
        **blocks,
    )


@native_only
@pytest.mark.parametrize("case", NATIVE_CASES)
@pytest.mark.parametrize("blocks", [{}, {"block_q": 4, "block_k": 8}], ids=["default", "4x8"])
def test_native_stats_equal_the_reference_weights(
    case: dict[str, object], blocks: dict[str, int]
) -> None:
    q, k, kw = _native_case(case)
    lse, *want = _reference(q, k, kw)
    got = _native_stats(q, k, lse, kw, **blocks)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float64
        assert_close(a, b, dtype=torch.float64)
    if case.get("mask") is not None and "padding" in str(case["mask"]):
        assert not got[2][0].any()  # batch row 0 sees no key
        assert not got[0][0].any()


@native_only
@pytest.mark.parametrize("case", [NATIVE_CASES[1], NATIVE_CASES[7], NATIVE_CASES[10]])
def test_native_float32_stats_are_within_float32_tolerance(case: dict[str, object]) -> None:
    q, k, kw = _native_case(case, tq=70, tk=70, dtype=torch.float32)
    lse, *want = _reference(q, k, kw)
    kw32 = _native_case(case, tq=70, tk=70, dtype=torch.float32)[2]
    for a, b in zip(_native_stats(q, k, lse.float(), kw32), want, strict=True):
        assert a.dtype == torch.float32
        assert_close(a, b, dtype=torch.float32)


@native_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_native_reduced_inputs_are_computed_in_float32(dtype: torch.dtype) -> None:
    case = {"mask": masks.causal(), "bias": "dense"}
    q, k, kw = _native_case(case, dtype=dtype)
    lse, *want = _reference(q, k, kw)  # (of the rounded inputs, in float64)
    # (the log-sum-exp in float32, as attention() returns it for these inputs)
    for a, b in zip(_native_stats(q, k, lse.float(), kw), want, strict=True):
        assert a.dtype == torch.float32
        assert_close(a, b, dtype=torch.float32)


@native_only
@pytest.mark.parametrize(("tq", "tk"), [(5, 0), (0, 5), (0, 0)])
def test_native_stats_of_no_keys_or_no_queries(tq: int, tk: int) -> None:
    q, k = randn(2, 4, tq, 8, seed=1), randn(2, 2, tk, 8, seed=2)
    lse = torch.full((2, 4, tq), -math.inf, dtype=torch.float64)
    mass, top, entropy = _native_stats(q, k, lse, {"mask": masks.causal()})
    assert mass.shape == top.shape == (2, 4, tk)
    assert entropy.shape == (2, 4, tq)
    for t in (mass, top, entropy):
        assert not t.any()


def _op_arguments(case: dict[str, object]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``torch.ops.attnkit.native_stats``'s arguments for a case, as the pass makes them."""
    q, k, kw = _native_case(case, dtype=torch.float32)
    lse = _reference(q, k, kw)[0].float()
    bias = kw.get("bias")
    term = bias if isinstance(bias, scores.ScoreTerm) else None
    geo = Geometry((2,), 4, q.size(-2), k.size(-2), CPU)
    plan = planned(kw.get("mask"), geo, 2, term is not None, 4, 8, native=True)
    softcap = kw.get("softcap")
    call = native_call(plan, geo, scale=0.35, softcap=softcap, dtype=q.dtype, term=term, groups=2)
    q5, k4 = q.reshape(2, 2, 2, q.size(-2), 8), k.contiguous()
    bias5 = bias.reshape(2, 2, 2, q.size(-2), k.size(-2)) if isinstance(bias, Tensor) else None
    args = call.tensors(q5, k4, k4[..., :0], bias5, () if term is None else tuple(term.inputs()))
    return (lse.reshape(2, 2, 2, -1).contiguous(), *args), call.settings()


@native_only
@pytest.mark.parametrize("case", NATIVE_CASES[1::2])
def test_opcheck_native_stats(case: dict[str, object]) -> None:
    args, kwargs = _op_arguments(case)
    torch.library.opcheck(torch.ops.attnkit.native_stats.default, args, kwargs)


@native_only
def test_native_stats_refuses_what_it_cannot_read() -> None:
    args, kwargs = _op_arguments({"mask": masks.causal()})
    with pytest.raises(
        RuntimeError, match=r"lse must be contiguous \(N, Hkv, G, Tq\) = \[2, 2, 2, 13\]"
    ):
        torch.ops.attnkit.native_stats(args[0][..., :5], *args[1:], **kwargs)
    with pytest.raises(RuntimeError, match="the statistics take no dropout"):
        torch.ops.attnkit.native_stats(*args, **{**kwargs, "dropout_p": 0.1})
    with pytest.raises(
        RuntimeError, match="q and k must both be float32 or float64, got q Float and k BFloat16"
    ):
        torch.ops.attnkit.native_stats(*args[:2], args[2].bfloat16(), *args[3:], **kwargs)


@native_only
def test_the_native_pass_serves_what_the_native_forward_takes() -> None:
    q, k = randn(1, 2, 5, 4, seed=1), randn(1, 2, 5, 4, seed=2)
    assert stats_refusal(q, k, None, None) is None
    assert stats_refusal(q, k, scores.DistanceBias(randn(2, 9, seed=3), first=-4), None) is None
    mod = stats_refusal(q, k, None, lambda s, b, h, i, j: s)
    assert mod is not None
    assert "does not fuse a score_mod" in mod
    k[0, 0, 2, 1] = math.inf
    assert stats_refusal(q, k, None, None) == "the eager kernel (non-finite values in q/k)"
