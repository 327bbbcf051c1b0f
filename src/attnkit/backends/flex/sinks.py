"""Sinks through the log-sum-exp: FlexAttention has no sink, and needs none.

A sink is one more logit per head that every query's softmax shares and no value answers. With
``lse`` the log-sum-exp of a row's scores, the softmax over the scores and the sink gives each key
``exp(s_j) / (exp(lse) + exp(sink))``, the plain weights times ``sigmoid(lse - sink)``: the output
is FlexAttention's times that factor, and the row's log-sum-exp is ``logaddexp(lse, sink)``. A
row with no visible key (``lse = -inf``) keeps output 0; its log-sum-exp is the sink's (``-inf``
for a head whose sink is ``-inf``, no sink).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["fold_sinks"]


def fold_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """``out (B, H, Tq, Dv)`` and ``lse (B, H, Tq)`` of the scores alone, with ``sinks (H,)``
    folded in: the output and log-sum-exp of the softmax that includes each head's sink.
    Differentiable in all three."""
    sink = sinks.to(lse.dtype)[None, :, None]  # (1, H, 1)
    # A row with no visible key is read apart: with a -inf sink, lse - sink would be
    # -inf - -inf = NaN (and its gradients NaN through logaddexp).
    empty = lse == -math.inf
    share = torch.sigmoid(torch.where(empty, -math.inf, lse - sink))  # the keys' share of weight
    folded = (out.to(share.dtype) * share.unsqueeze(-1)).to(out.dtype)
    total = torch.logaddexp(torch.where(empty, 0.0, lse), sink)
    return folded, torch.where(empty, sink.expand_as(lse), total)
