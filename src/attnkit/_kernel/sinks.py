"""Attention sinks: one logit per head that joins every row's softmax and attends to nothing.

The kernels compute a call without its sinks; :func:`finish` folds them into the output and the
log-sum-exp afterwards, and :func:`sink_grad` gives their gradient from the same two numbers per
row the backward uses.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["finish", "sink_grad"]


def finish(out: Tensor, lse: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """Fold the sinks ``(Hkv, G)`` into a forward's output and log-sum-exp (in place for ``out``).

    A sink joins each row's softmax denominator with its logit and attends to nothing, so the row's
    output shrinks by ``exp(lse - lse_with_sink)``; a row with no visible key stays 0. A ``-inf``
    sink is no sink: a row with no visible key then keeps log-sum-exp ``-inf``.
    """
    if sinks is None:
        return out, lse
    total = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, :, None])
    # exp(-inf - 0) = 0 where both are -inf, not exp(-inf + inf) = NaN
    out.mul_((lse - total.masked_fill(total == float("-inf"), 0.0)).exp_().unsqueeze(-1))
    return out, total


def sink_grad(lse: Tensor, delta: Tensor, sinks: Tensor) -> Tensor:
    """``d loss / d sinks`` ``(Hkv, G)``: each row's sink has probability ``exp(sink - lse)`` and
    value 0, so it moves the output by ``-p_sink * O``: ``-sum_rows p_sink * rowsum(dO * O)``."""
    # A -inf sink of a row with no visible key (lse -inf too) has probability 0, not exp(NaN).
    p_sink = (
        sinks.to(lse.dtype)[None, :, :, None] - lse.masked_fill(lse == float("-inf"), 0.0)
    ).exp_()
    return -(p_sink * delta).sum(dim=(0, 3))
