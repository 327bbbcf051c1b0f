"""The non-finite screen: whether torch's output follows attnkit's non-finite policy.

torch's kernels do not follow the policy by themselves (a NaN in a masked key reaches the output;
a query whose scores are all NaN gets 0). Outside torch.compile the backend looks at its output:
:func:`screened` is a fast sufficient test (one matrix-vector product), :func:`trustworthy` the
exact one behind it (no NaN/inf, and exact zeros only in rows that the mask or the values
explain). An output that fails is handed to the backend registered as ``chunked``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["empty_rows", "screened", "trustworthy"]

_HALVES = (torch.bfloat16, torch.float16)


def empty_rows(attn_mask: Tensor | None) -> Tensor | None:
    """Bool ``(..., Tq, 1)`` rows with no key they may attend, or None when there are none."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        return ~attn_mask.any(-1, keepdim=True)
    return (attn_mask == float("-inf")).all(-1, keepdim=True)


_SCREEN_WEIGHTS: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}
# Outputs of up to this many rows are screened in float32 (see screened).
_SCREEN_WIDENED_ROWS = 4096


def screened(out: Tensor) -> bool:
    """A fast sufficient test: True when no row holds NaN or inf and no row is all zeros.

    Each row's dot product with a fixed vector of non-zero weights is one matrix-vector product
    (per-row reductions cost several times more, and a decode step reads back a few numbers
    instead of two reductions' results): a non-finite row gives a non-finite product, a zero row
    gives 0. A product that is 0 or overflows for a finite, non-zero row is a false alarm, which
    only sends the caller to the exact test."""
    d = out.size(-1)
    if out.is_contiguous():
        rows = out.view(-1, d)
    elif out.ndim >= 3 and out.transpose(-3, -2).is_contiguous():  # torch's (B, T, H, D) layout
        rows = out.transpose(-3, -2).view(-1, d)
    else:
        return False
    if out.dtype in _HALVES and rows.size(0) <= _SCREEN_WIDENED_ROWS and out.device.type == "cpu":
        # A bfloat16/float16 product right after torch's CPU attention was measured at about a
        # millisecond per decode step on a CPU with AMX, a few microseconds in float32.
        rows = rows.float()
    key = (d, rows.dtype, rows.device)
    weights = _SCREEN_WEIGHTS.get(key)
    if weights is None:
        g = torch.Generator().manual_seed(0)
        w = torch.rand(d, generator=g, dtype=torch.float64).add_(0.5)  # in [0.5, 1.5): never 0
        w = w * torch.where(torch.arange(d) % 2 == 0, 1.0, -1.0).double()
        weights = _SCREEN_WEIGHTS.setdefault(key, w.to(rows.device, rows.dtype))
    products = torch.mv(rows, weights)
    if products.numel() <= 256:  # a decode step: one read of a few numbers
        values = products.tolist()
        return 0.0 not in values and math.isfinite(sum(values))  # a NaN or inf makes the sum one
    low, high = torch.aminmax(products.abs_())
    return bool(low.item() > 0) and math.isfinite(high.item())


def _explained_by_values(
    peaks: Tensor, q: Tensor, k: Tensor, v: Tensor, dropout: bool = False
) -> Tensor:
    """Bool like ``peaks`` ``(..., H, Tq)``: rows whose zero output the inputs explain, when the
    row's query and its head's keys are finite (torch gives 0 for a row of NaN scores too, which
    attnkit's policy makes NaN): its head's values are all 0, or, with dropout, every weight of
    the row was dropped (a legitimate draw, which must not be redrawn)."""
    hkv = k.size(-3)
    finite_k = torch.isfinite(k).flatten(-2).all(-1)  # (..., Hkv)
    head_ok = finite_k if dropout else finite_k & (v == 0).flatten(-2).all(-1)
    head_ok = head_ok.repeat_interleave(q.size(-3) // hkv, dim=-1)  # (..., H)
    return head_ok.unsqueeze(-1) & torch.isfinite(q).all(-1)  # (..., H, Tq)


def trustworthy(
    out: Tensor,
    attn_mask: Tensor | None,
    empty: Tensor | None = None,
    qkv: tuple[Tensor, Tensor, Tensor] | None = None,
    dropout: bool = False,
) -> bool:
    """Whether torch's output follows attnkit's rules: no NaN/inf, and exact zeros only in the rows
    that have no visible key (``empty``, or the rows ``attn_mask`` hides whole) or whose head's
    values are all zero (``qkv`` given). A few small reductions in the common case (a decode
    step's cost). On the meta device there are no values to screen: a shape is all it says."""
    if not out.numel() or out.device.type == "meta":
        return True
    if screened(out):
        return True
    # (..., H, Tq) largest magnitude per row: NaN and inf show, and so does a row of zeros.
    peaks = out.abs().amax(-1)
    low, high = torch.aminmax(peaks)
    if not math.isfinite(high.item()):
        return False
    if low.item() > 0:
        return True
    if empty is None:
        empty = empty_rows(attn_mask)
        empty = None if empty is None else empty.squeeze(-1)
    explained = torch.zeros((), dtype=torch.bool, device=out.device)
    if empty is not None:
        explained = explained | empty
    if qkv is not None:
        explained = explained | _explained_by_values(peaks, *qkv, dropout=dropout)
    # A zero row nothing explains: torch hid a NaN.
    return bool(((peaks == 0) <= explained.expand_as(peaks)).all())
