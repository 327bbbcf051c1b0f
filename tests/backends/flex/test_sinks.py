"""Sinks through the log-sum-exp: FlexAttention's output and log-sum-exp of the scores alone, with
the sinks folded in, are the reference's with sinks, and so are their gradients."""

from __future__ import annotations

import torch

import attnkit
from attnkit import masks
from attnkit.backends.flex.sinks import fold_sinks
from attnkit.testing import assert_close

from .helpers import H, qkv, randn


def test_folded_sinks_are_the_references() -> None:
    q, k, v = (t.double().requires_grad_() for t in qkv(10, 16))
    sinks = randn(H, seed=3, dtype=torch.float64).requires_grad_()
    # a row of the second batch row has no visible key: its output stays 0, its lse the sink's
    mask = masks.key_padding([16, 0]) & masks.sliding_window(4)
    out, lse = attnkit.attention(q, k, v, mask=mask, return_lse=True, backend="reference")
    got, got_lse = fold_sinks(out, lse, sinks)
    want, want_lse = attnkit.attention(
        q, k, v, mask=mask, sinks=sinks, return_lse=True, backend="reference"
    )
    assert_close(got, want)
    assert_close(got_lse, want_lse)
    assert bool((got[1] == 0).all())
    grads = (
        randn(*got.shape, seed=4, dtype=torch.float64),
        randn(*lse.shape, seed=5, dtype=torch.float64),
    )
    inputs = (q, k, v, sinks)
    for g, e in zip(
        torch.autograd.grad((got, got_lse), inputs, grads),
        torch.autograd.grad((want, want_lse), inputs, grads),
        strict=True,
    ):
        assert_close(g, e)
