"""The statistics pass (``attnkit._kernel.stats``) in blocks of a few rows and keys, against the
weights of the formula in float64: every visit of the plan and only those, the ``-inf`` of
partial blocks and of a bias in full blocks, NaN where a masked pair hides it and where a
visible one shows it, and a log-sum-exp that includes sinks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from attnkit import masks
from attnkit._kernel import Problem
from attnkit._kernel.planning import block_plan
from attnkit._kernel.stats import TILE, kernel_stats, stats_blocks
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
