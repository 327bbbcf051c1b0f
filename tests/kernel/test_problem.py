"""A call in the kernel's layout (``attnkit._kernel.problem``): the scores of a visit, with what a
call adds to them, against the formula; and the kernel with all of it through ``Chunked``."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from attnkit import attention, masks
from attnkit._kernel import Visit
from attnkit.backends import Chunked
from attnkit.masks import Geometry, Mask
from attnkit.testing import assert_close

from .helpers import CPU, problem, randn


@pytest.mark.parametrize(
    "mask", [None, masks.causal(), masks.sliding_window(2) | masks.documents([5, 6])]
)
def test_through_chunked_with_small_blocks_equals_the_reference(mask: Mask | None) -> None:
    q, k, v = randn(1, 4, 11, 6, seed=5), randn(1, 2, 11, 6, seed=6), randn(1, 2, 11, 6, seed=7)
    bias, sinks = randn(11, 11, seed=8), randn(4, seed=9)
    dout = randn(1, 4, 11, 6, seed=10)
    small = Chunked(block_q=3, block_k=4, fused_rows=None)

    def run(backend: object) -> list[Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias, sinks)]
        qq, kk, vv, b, s = leaves
        out = attention(qq, kk, vv, mask=mask, bias=b, sinks=s, softcap=4.0, backend=backend)
        assert isinstance(out, Tensor)
        return [out, *torch.autograd.grad(out, leaves, dout)]

    for got, want in zip(run(small), run("reference"), strict=True):
        assert_close(got, want)


def _rows(t: Tensor, hkv: int, r0: int, r1: int) -> Tensor:
    """``(N, H, Tq, Tk)`` -> the kernel's query-major rows ``(N * Hkv, rows * G, Tk)`` of queries
    ``r0:r1`` (row ``t * G + g``)."""
    n, h, _, tk = t.shape
    rows = t.view(n, hkv, h // hkv, -1, tk)[:, :, :, r0:r1].transpose(2, 3)
    return rows.reshape(n * hkv, (r1 - r0) * (h // hkv), tk)


@pytest.mark.parametrize(
    "softcap",
    [None, 2.5, 0.5, 1e5],
    ids=["plain", "sigmoid-form", "tanh-form", "tanh-form-cap-in-rows"],
)
def test_the_scores_of_a_visit_are_the_formula_in_base_2_masked_with_minus_inf(
    softcap: float | None,
) -> None:
    # Grouped heads (4 query heads, 2 key heads), the causal diagonal block of queries 4:8 and
    # keys 4:8 (partial: its mask tile applies), rows 1:4 of it, minus a per-row offset.
    q, k, v = randn(1, 4, 8, 6, seed=40), randn(1, 2, 8, 6, seed=41), randn(1, 2, 8, 6, seed=42)
    scale = 0.7
    p = problem(q, k, v, scale, masks.causal(), softcap)
    visit = Visit(ks=4, ke=8, r0=1, r1=4, partial=True)
    qr = p.q_rows(4, 8, factor=p.score_factor())[:, visit.r0 * p.g : visit.r1 * p.g]
    offset = randn(2, 3 * 2, 1, seed=43)
    s, sig, vis = p.scores(qr, 4, visit, offset, None, keep_sigmoid=softcap is not None)

    natural = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * scale
    if softcap is not None:
        natural = softcap * torch.tanh(natural / softcap)
    visible = torch.ones(8, 8, dtype=torch.bool).tril()
    want = (natural / math.log(2.0)).masked_fill(~visible, -math.inf)
    want = _rows(want[..., 4:8], 2, 5, 8) - offset
    assert vis is not None
    assert torch.equal(s == -math.inf, want == -math.inf)
    assert_close(s.masked_fill(s == -math.inf, 0.0), want.masked_fill(want == -math.inf, 0.0))
    assert (sig is None) == (softcap is None)


def test_a_bias_reaches_the_scores_in_base_2_and_a_minus_inf_bias_hides_a_pair() -> None:
    q, k, v = randn(1, 2, 5, 4, seed=44), randn(1, 2, 5, 4, seed=45), randn(1, 2, 5, 4, seed=46)
    bias = randn(1, 2, 5, 5, seed=47)
    bias[0, 1, 2, 3] = -math.inf
    p = problem(q, k, v, 0.5)
    p.bias5 = bias.view(1, 2, 1, 5, 5)
    p.careful = True  # the careful mode counts a -inf bias as masked
    visit = Visit(ks=0, ke=5, r0=0, r1=5, partial=False)
    s, _, vis = p.scores(p.q_rows(0, 5, factor=p.score_factor()), 0, visit, None, None)
    want = _rows((q @ k.transpose(-1, -2) * 0.5 + bias) / math.log(2.0), 2, 0, 5)
    assert_close(s.masked_fill(s == -math.inf, 0.0), want.masked_fill(want == -math.inf, 0.0))
    assert vis is not None
    assert torch.equal(vis.reshape(2, 5, 5), (bias != -math.inf).view(2, 5, 5))


def test_geometry_of_the_problem_is_the_calls() -> None:
    # The rows and sizes the loops read come from the tensors, in the kernel's 5-d layout.
    q, k, v = randn(3, 6, 7, 4, seed=48), randn(3, 2, 9, 4, seed=49), randn(3, 2, 9, 5, seed=50)
    p = problem(q, k, v, 1.0)
    assert (p.n, p.hkv, p.g, p.tq, p.dk, p.tk, p.dv) == (3, 2, 3, 7, 4, 9, 5)
    rows = p.rows(q.view(3, 2, 3, 7, 4), 2, 5)
    assert torch.equal(rows, _rows(q, 2, 2, 5))
    geo = Geometry((3,), 6, 7, 9, CPU)
    assert p.geo == geo
