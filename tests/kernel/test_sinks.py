"""Sinks (``attnkit._kernel.sinks``): folded into the denominator, and their gradient, against the
formula in float64."""

from __future__ import annotations

import torch

from attnkit._kernel import finish, sink_grad
from attnkit.testing import assert_close

from .helpers import formula, randn


def test_finish_folds_the_sinks_into_the_denominator() -> None:
    q, k, v = randn(1, 4, 6, 8, seed=13), randn(1, 2, 6, 8, seed=14), randn(1, 2, 6, 3, seed=15)
    sinks = randn(4, seed=16)
    visible = torch.ones(6, 6, dtype=torch.bool).tril()
    visible[2] = False  # a query with no key: stays 0 with a sink
    plain, plain_lse = formula(q, k, v, 0.5, visible)
    out, lse = finish(
        plain.view(1, 2, 2, 6, 3).clone(), plain_lse.view(1, 2, 2, 6), sinks.view(2, 2)
    )
    want, want_lse = formula(q, k, v, 0.5, visible, sinks=sinks)
    assert_close(out.flatten(1, 2), want)
    assert_close(lse.flatten(1, 2), want_lse)
    assert torch.equal(out[:, :, :, 2], torch.zeros(1, 2, 2, 3, dtype=torch.float64))
    same, same_lse = finish(plain, plain_lse, None)
    assert same is plain
    assert same_lse is plain_lse


def test_sink_grad_is_autograd_of_the_formula() -> None:
    q, k, v = randn(2, 4, 5, 8, seed=17), randn(2, 2, 5, 8, seed=18), randn(2, 2, 5, 3, seed=19)
    sinks, dout = randn(4, seed=20).requires_grad_(), randn(2, 4, 5, 3, seed=21)
    out, lse = formula(q, k, v, 0.3, sinks=sinks)
    (want,) = torch.autograd.grad(out, sinks, dout)
    delta = (dout * out).sum(-1).detach()
    got = sink_grad(
        lse.detach().view(2, 2, 2, 5), delta.view(2, 2, 2, 5), sinks.detach().view(2, 2)
    )
    assert_close(got.flatten(), want)
