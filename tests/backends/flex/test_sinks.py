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


def test_a_row_with_no_key_under_a_head_without_sink() -> None:
    # sinks=-inf is no sink for that head; a row with no visible key there has lse = -inf too,
    # and lse - sink was NaN: the output of that row was NaN instead of 0.
    q, k, v = (t.double().requires_grad_() for t in qkv(6, 8))
    sinks = torch.tensor([-float("inf"), 0.5, -1.0, -float("inf")], dtype=torch.float64)
    sinks.requires_grad_()
    mask = masks.key_padding([8, 0])
    kw = {"mask": mask, "sinks": sinks, "return_lse": True}
    with torch.no_grad():
        flex_out, flex_lse = attnkit.attention(q, k, v, backend="flex", **kw)  # type: ignore[call-overload]
    want, want_lse = attnkit.attention(q, k, v, backend="reference", **kw)  # type: ignore[call-overload]
    assert_close(flex_out, want.detach())
    assert_close(flex_lse, want_lse.detach())
    out, lse = attnkit.attention(q, k, v, mask=mask, return_lse=True, backend="reference")
    got, got_lse = fold_sinks(out, lse, sinks)
    assert bool((got[1] == 0).all())
    assert_close(got_lse, want_lse)
    finite = want_lse.isfinite()
    grads = (
        randn(*got.shape, seed=6, dtype=torch.float64),
        torch.where(finite, randn(*lse.shape, seed=7, dtype=torch.float64), 0.0),
    )
    inputs = (q, k, v, sinks)
    for g, e in zip(
        torch.autograd.grad((got, got_lse), inputs, grads),
        torch.autograd.grad((want, want_lse), inputs, grads),
        strict=True,
    ):
        assert bool(g.isfinite().all())
        assert_close(g, e)
