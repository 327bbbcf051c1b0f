"""The online softmax's forward (``attnkit._kernel.forward``) against the formula in float64: masks,
grouped heads and softcap, scores far above the first blocks' offsets, and the one rule for a
query with no visible key."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit import masks
from attnkit._kernel import backward, delta_of, forward
from attnkit.masks import Geometry, Mask, visibility
from attnkit.testing import assert_close

from .helpers import CPU, formula, problem, randn

CASES = [
    pytest.param({}, id="plain"),
    pytest.param({"mask": masks.causal()}, id="causal"),
    pytest.param({"mask": masks.sliding_window(3, right=2)}, id="window"),
    pytest.param({"mask": masks.documents([4, 9, 4])}, id="documents"),
    pytest.param({"mask": masks.causal(), "softcap": 2.5}, id="causal-softcap"),
]


@pytest.mark.parametrize("case", CASES)
def test_forward_of_a_problem_equals_the_formula(case: dict[str, object]) -> None:
    # Grouped-query attention (4 query heads, 2 key heads), Dv != Dk, blocks of 4 x 4 over 17 keys.
    mask = case.get("mask")
    softcap = case.get("softcap")
    assert mask is None or isinstance(mask, Mask)
    assert softcap is None or isinstance(softcap, float)
    q, k, v = randn(2, 4, 17, 8, seed=1), randn(2, 2, 17, 8, seed=2), randn(2, 2, 17, 5, seed=3)
    scale = 0.4
    p = problem(q, k, v, scale, mask, softcap)
    out5, lse5 = forward(p)
    out, lse = out5.flatten(1, 2), lse5.flatten(1, 2)

    geo = Geometry((2,), 4, 17, 17, CPU)
    visible = None if mask is None else mask.tile(geo, 0, 17, 0, 17).expand(2, 4, 17, 17)
    want, want_lse = formula(q, k, v, scale, visible, softcap)
    assert_close(out, want)
    assert_close(lse, want_lse)


def test_scores_far_above_the_first_blocks_take_the_guarded_path() -> None:
    # The first key block's scores are about 0, so the offset is taken as 0; a later block's are
    # 100 higher, 2^144 in float32 overflows to inf: the guard must redo the query block with
    # rescaling, and the result equal the formula.
    q = torch.ones(1, 1, 4, 1)
    k = torch.cat([torch.zeros(4), torch.full((4,), 100.0)]).view(1, 1, 8, 1)
    k = k + randn(1, 1, 8, 1, seed=28, dtype=torch.float32) * 0.1
    v = randn(1, 1, 8, 2, seed=29, dtype=torch.float32)
    out5, lse5 = forward(problem(q, k, v, 1.0, block=(4, 4)))
    want, want_lse = formula(q.double(), k.double(), v.double(), 1.0)
    assert bool(out5.isfinite().all())
    assert_close(out5.flatten(1, 2), want, dtype=torch.float32)
    assert_close(lse5.flatten(1, 2), want_lse, dtype=torch.float32)


def test_a_query_with_no_visible_key_gives_zero_and_minus_inf_with_zero_gradients() -> None:
    q, k, v = randn(1, 2, 7, 4, seed=30), randn(1, 2, 9, 4, seed=31), randn(1, 2, 9, 3, seed=32)
    visible = torch.rand(1, 2, 7, 9, generator=torch.Generator().manual_seed(33)) < 0.6
    visible[0, 0, 1] = False
    visible[0, :, 5] = False
    visible[0, 1, :, 4:] = False
    mask = visibility(visible, False)
    assert mask is not None
    dout = randn(1, 2, 7, 3, seed=34)
    p = problem(q, k, v, 0.5, mask, block=(2, 4))
    out5, lse5 = forward(p)
    out, lse = out5.flatten(1, 2), lse5.flatten(1, 2)
    empty = ~visible.any(-1)
    assert bool(empty.any())
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert bool((lse[empty] == -math.inf).all())
    assert bool(lse[~empty].isfinite().all())
    grads = backward(
        p,
        out5,
        lse5,
        delta_of(out5, dout.view(out5.shape)),
        dout.view(out5.shape),
        bias_grad=False,
        term_grads=False,
    )
    dq = grads.dq.flatten(1, 2)
    assert bool(dq.isfinite().all())
    assert torch.equal(dq[empty], torch.zeros_like(dq[empty]))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want, _ = formula(*leaves, 0.5, visible)
    want_grads = torch.autograd.grad(want, leaves, dout)
    assert_close(out, want)
    assert_close(dq, want_grads[0])
    assert_close(grads.dk.view(k.shape), want_grads[1])
    assert_close(grads.dv.view(v.shape), want_grads[2])
