"""Gradients of packed projections without copies.

A self-attention layer computes q, k and v in one GEMM and splits its output by columns. torch's
backward of that split concatenates the three gradients: a copy of the whole projection output
per step. Here the attention backward writes its gradients into one tensor laid out as the
projection output (``joint_grads``), and the split's backward (``split_packed``) recognises them
as that tensor's columns and returns it as it is; anything else is concatenated as torch does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .._base.transforms import transforms_active

__all__ = ["columns_of", "joint_grads", "split_packed"]


def columns_of(t: Tensor, base: Tensor) -> tuple[int, int] | None:
    """``(first, width)`` when ``t`` holds exactly columns ``first : first + width`` of every row
    of the contiguous ``base`` seen as ``(rows, base.size(-1))``, in any order of its dimensions
    (a ``(B, H, T, D)`` head view of ``(B, T, H * D)`` columns, say); None otherwise."""
    if not base.is_contiguous() or base.dim() == 0 or t.numel() == 0:
        return None
    if t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        return None
    width_all = base.size(-1)
    rows = base.numel() // max(width_all, 1)
    dims = sorted(
        ((s, n) for n, s in zip(t.shape, t.stride(), strict=True) if n != 1), reverse=True
    )
    merged: list[tuple[int, int]] = []  # (stride, size), outermost first
    for s, n in dims:
        if merged and merged[-1][0] == s * n:
            merged[-1] = (s, merged[-1][1] * n)
        else:
            merged.append((s, n))
    if not merged or merged[-1][0] != 1:
        return None
    width = merged[-1][1]
    if len(merged) == 1 and width == base.numel() and rows > 1:
        width = width_all  # whole rows: they merged into one run
        outer_ok = True
    elif len(merged) == 1:
        outer_ok = rows == 1
    else:
        outer_ok = len(merged) == 2 and merged[0] == (width_all, rows)
    first = int(t.storage_offset() - base.storage_offset())
    if not outer_ok or not 0 <= first <= width_all - width:
        return None
    return first, int(width)


def joint_grads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """New tensors for the gradients of q, k and v that are views of one new tensor laid out as
    the one q, k and v are views of, at their strides and offsets, when they are disjoint column
    stretches of one contiguous tensor (a packed projection's output); else None. The caller
    must write every element of the three. Never under torch.func's transforms, whose wrapped
    tensors have no storage to compare."""
    if transforms_active():
        return None
    base = q._base
    if base is None or k._base is not base or v._base is not base:
        return None
    if not (q.dtype == k.dtype == v.dtype == base.dtype):
        return None
    cols = [columns_of(t, base) for t in (q, k, v)]
    if any(c is None for c in cols):
        return None
    spans = sorted(c for c in cols if c is not None)
    if any(a[0] + a[1] > b[0] for a, b in itertools.pairwise(spans)):
        return None  # overlapping views (q, k and v one tensor, say): their gradients add up
    buf = torch.empty_like(base)
    at = base.storage_offset()
    q_, k_, v_ = (buf.as_strided(t.shape, t.stride(), t.storage_offset() - at) for t in (q, k, v))
    return q_, k_, v_


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: Tensor, sizes: Sequence[int]
    ) -> tuple[Tensor, ...]:
        ctx.sizes = tuple(sizes)  # type: ignore[attr-defined]
        ctx.shape = x.shape  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)
        return tuple(x.split_with_sizes(list(sizes), dim=-1))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, *grads: Tensor | None
    ) -> tuple[Tensor | None, None]:
        sizes: tuple[int, ...] = ctx.sizes  # type: ignore[attr-defined]
        shape: torch.Size = ctx.shape  # type: ignore[attr-defined]
        whole = _whole(grads, sizes, shape)
        if whole is not None:
            return whole, None
        if all(g is None for g in grads):
            return None, None
        ref = next(g for g in grads if g is not None)
        parts = [
            g if g is not None else ref.new_zeros((*shape[:-1], n))
            for g, n in zip(grads, sizes, strict=True)
        ]
        return torch.cat(parts, dim=-1), None


def _whole(
    grads: Sequence[Tensor | None], sizes: Sequence[int], shape: torch.Size
) -> Tensor | None:
    """The tensor of ``shape`` whose consecutive column stretches the gradients are, or None."""
    first = grads[0]
    # While torch.compile traces the backward, views are the graph's to plan (and a traced
    # storage offset is not a value): the gradients are concatenated there.
    if first is None or first._base is None or torch.compiler.is_compiling():
        return None
    whole = first._base  # (a view of) the tensor split: linear() may have made it 2-d
    if whole.numel() != shape.numel() or whole.size(-1) != shape[-1]:
        return None
    if not whole.is_contiguous() or whole.storage_offset() != 0:
        return None
    start = 0
    for g, n in zip(grads, sizes, strict=True):
        if g is None or g._base is not whole or columns_of(g, whole) != (start, n):
            return None
        if g.shape != (*shape[:-1], n):
            return None
        start += n
    return whole.view(shape)


# Function.apply is untyped in torch; give it its type once.
_apply_split: Callable[..., tuple[Tensor, ...]] = _Split.apply


def split_packed(x: Tensor, sizes: Sequence[int]) -> tuple[Tensor, ...]:
    """``x.split(sizes, dim=-1)``, whose backward returns the gradients as they are when they are
    already one tensor's consecutive columns (see ``joint_grads``), instead of concatenating them.
    """
    # (under torch.func's transforms, the plain split: its gradient is theirs to form)
    if not (torch.is_grad_enabled() and x.requires_grad) or transforms_active():
        return tuple(x.split_with_sizes(list(sizes), dim=-1))
    return _apply_split(x, tuple(sizes))
