"""merge_attention: a query that no part lets see any key."""

from __future__ import annotations

import math

import torch

import attnkit
from attnkit import masks

NEG_INF = float("-inf")


def test_a_query_no_part_sees_gives_zero_lse_minus_inf_and_zero_gradients() -> None:
    """Keys split in two; query 3 sees none of either half (both parts give it out 0 and lse
    -inf). Merged: out 0 and lse -inf there, finite and zero gradients for it, and the other
    queries equal to the whole call, gradients included."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 3, 10, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 3, 10, 8, dtype=torch.float64, generator=g, requires_grad=True)
    dense = masks.causal().dense(6, 10).reshape(6, 10).clone()  # bottom-right: i sees 0..i+4
    dense[3] = False
    whole = attnkit.attention(q, k, v, mask=dense, backend="reference")
    parts = [
        attnkit.attention(q, k[..., a:b, :], v[..., a:b, :], mask=dense[:, a:b], return_lse=True)
        for a, b in ((0, 4), (4, 10))
    ]
    for _, lse in parts:
        assert bool((lse[..., 3] == NEG_INF).all())
    out, lse = attnkit.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    assert torch.equal(out[..., 3, :], torch.zeros_like(out[..., 3, :]))
    assert bool((lse[..., 3] == NEG_INF).all())
    assert bool(torch.isfinite(lse[..., [0, 1, 2, 4, 5]]).all())
    torch.testing.assert_close(out, whole)
    dout = torch.randn(out.shape, dtype=out.dtype, generator=g)
    dlse = torch.randn(lse.shape, dtype=lse.dtype, generator=g)
    # The lse's -inf entry takes no gradient: only the finite ones are in the loss.
    finite = torch.isfinite(lse)
    got = torch.autograd.grad(
        (out * dout).sum() + (lse.masked_fill(~finite, 0.0) * dlse).sum(), (q, k, v)
    )
    want_lse = torch.logsumexp(
        (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~dense, NEG_INF), -1
    )
    want = torch.autograd.grad(
        (whole * dout).sum() + (want_lse.masked_fill(~finite, 0.0) * dlse).sum(), (q, k, v)
    )
    for a, w in zip(got, want, strict=True):
        assert bool(torch.isfinite(a).all())
        torch.testing.assert_close(a, w)
    assert torch.equal(got[0][..., 3, :], torch.zeros_like(got[0][..., 3, :]))


def test_merging_parts_that_are_all_empty_for_a_row_directly() -> None:
    """The parts as plain tensors: gradients to each out and lse are zero and finite where
    every part's lse is -inf, and out there is exactly 0."""
    g = torch.Generator().manual_seed(1)
    outs = [torch.randn(1, 2, 4, 3, dtype=torch.float64, generator=g) for _ in range(3)]
    lses = [torch.randn(1, 2, 4, dtype=torch.float64, generator=g) for _ in range(3)]
    for i, (o, lse) in enumerate(zip(outs, lses, strict=True)):
        lse[0, 1, 2] = NEG_INF  # nobody sees a key for (head 1, query 2)
        o[0, 1, 2] = 0.0
        if i:
            lse[0, 0, 0] = NEG_INF  # (head 0, query 0): only the first part sees keys
    for t in (*outs, *lses):
        t.requires_grad_()
    out, lse = attnkit.merge_attention(outs, lses)
    assert torch.equal(out[0, 1, 2], torch.zeros(3, dtype=torch.float64))
    assert lse[0, 1, 2] == NEG_INF
    torch.testing.assert_close(out[0, 0, 0], outs[0][0, 0, 0])
    torch.testing.assert_close(lse[0, 0, 0], lses[0][0, 0, 0])
    finite = torch.isfinite(lse)
    loss = out.sum() + lse.masked_fill(~finite, 0.0).sum()
    grads = torch.autograd.grad(loss, (*outs, *lses))
    for d in grads:
        assert bool(torch.isfinite(d).all())
    for d in grads[:3]:
        assert torch.equal(d[0, 1, 2], torch.zeros(3, dtype=torch.float64))
    for d in grads[3:]:
        assert d[0, 1, 2] == 0.0
