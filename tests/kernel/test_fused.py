"""Fully visible stretches through torch's fused CPU kernel (``attnkit._kernel.fused``): which calls
it serves, and a problem whose runs go there against the formula and against the same problem
with none, forward and backward."""

from __future__ import annotations

import pytest
import torch

from attnkit import masks
from attnkit._kernel import backward, delta_of, forward, fused_serves
from attnkit.masks import Geometry
from attnkit.testing import assert_close

from .helpers import CPU, formula, problem, randn


def test_the_fused_kernel_serves_only_plain_scores_in_float32_and_float64_on_cpus() -> None:
    plain = dict(softcap=None, added=False)
    assert fused_serves(CPU, torch.float32, 8, 8, **plain)
    assert fused_serves(CPU, torch.float64, 8, 8, **plain)
    assert not fused_serves(CPU, torch.bfloat16, 8, 8, **plain)
    assert not fused_serves(CPU, torch.float32, 8, 4, **plain)  # Dv != Dk
    assert not fused_serves(torch.device("meta"), torch.float32, 8, 8, **plain)
    assert not fused_serves(CPU, torch.float32, 8, 8, softcap=2.0, added=False)
    assert not fused_serves(CPU, torch.float32, 8, 8, softcap=None, added=True)


@pytest.mark.parametrize(
    "mask", [masks.causal(), masks.documents([12, 12])], ids=["causal", "documents"]
)
def test_runs_through_the_fused_kernel_equal_the_formula(mask: masks.Mask) -> None:
    # 24 queries in blocks of 4, runs of at least 8 rows: the fully visible blocks below the
    # diagonal (or inside each document) go to torch's kernel, the rest to the online softmax,
    # merged by log-sum-exp; the backward adds the runs' share from torch's backward.
    q, k, v = randn(2, 4, 24, 8, seed=60), randn(2, 2, 24, 8, seed=61), randn(2, 2, 24, 8, seed=62)
    dout = randn(2, 4, 24, 8, seed=63)
    fused = problem(q, k, v, 0.3, mask, block=(4, 4), fused_rows=8)
    alone = problem(q, k, v, 0.3, mask, block=(4, 4))
    assert fused.runs
    assert not alone.runs
    geo = Geometry((2,), 4, 24, 24, CPU)
    visible = mask.tile(geo, 0, 24, 0, 24).expand(2, 4, 24, 24)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want, want_lse = formula(*leaves, 0.3, visible)
    want_grads = torch.autograd.grad(want, leaves, dout)
    for p in (fused, alone):
        out5, lse5 = forward(p)
        assert_close(out5.flatten(1, 2), want)
        assert_close(lse5.flatten(1, 2), want_lse)
        dout5 = dout.view(out5.shape)
        grads = backward(
            p, out5, lse5, delta_of(out5, dout5), dout5, bias_grad=False, term_grads=False
        )
        assert_close(grads.dq.flatten(1, 2), want_grads[0])
        assert_close(grads.dk.view(k.shape), want_grads[1])
        assert_close(grads.dv.view(v.shape), want_grads[2])
