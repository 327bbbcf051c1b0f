"""Dense masks: bool tensors ``(Tq, Tk)`` (or ``(B, 1, 1, Tk)``) in attnkit's convention, True = may
attend, for code that wants the matrix itself. Re-exported by :mod:`attnkit.masks`; the structured
masks there describe the same patterns without writing them out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .._base.checks import check_int, check_lengths
from .._base.shapes import Bool, Int, shape_checked
from ._blocks import band_visibility

__all__ = [
    "block_diagonal_mask",
    "causal_mask",
    "combine_masks",
    "padding_mask",
    "sliding_window_mask",
]


def _positions(
    q_len: int, kv_len: int | None, device: torch.device | str | None
) -> tuple[Tensor, Tensor]:
    """``(i', j)``: the queries' bottom-right positions ``(Tq, 1)`` and the keys' ``(Tk,)``."""
    q_len = check_int("q_len", q_len, minimum=0)
    kv_len = q_len if kv_len is None else check_int("kv_len", kv_len, minimum=0)
    i = torch.arange(q_len, device=device).unsqueeze(-1) + (kv_len - q_len)
    return i, torch.arange(kv_len, device=device)


@shape_checked
def causal_mask(
    q_len: int, kv_len: int | None = None, *, device: torch.device | str | None = None
) -> Bool[Tensor, "Tq Tk"]:
    """Dense causal mask aligned bottom-right: query ``i`` may attend key ``j`` iff
    ``j <= i + Tk - Tq`` (:func:`causal` without the ``(Tq, Tk)`` tensor).

    ``kv_len`` defaults to ``q_len``. With ``Tq < Tk`` (new tokens after a cache) the last query
    sees every key; with ``Tq > Tk`` the first ``Tq - Tk`` queries see nothing (and attend to
    zeros).

    >>> causal_mask(3).int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
    >>> causal_mask(3, 5).int()  # 3 new queries after 2 cached keys
    tensor([[1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1]], dtype=torch.int32)
    >>> causal_mask(4, 2).int()  # more queries than keys: the first two rows are empty
    tensor([[0, 0],
            [0, 0],
            [1, 0],
            [1, 1]], dtype=torch.int32)
    """
    return band_visibility(*_positions(q_len, kv_len, device), -math.inf, 0)


@shape_checked
def sliding_window_mask(
    q_len: int,
    kv_len: int | None = None,
    *,
    left: int,
    right: int = 0,
    device: torch.device | str | None = None,
) -> Bool[Tensor, "Tq Tk"]:
    """Dense local attention: query ``i`` (at key position ``p = i + Tk - Tq``) may attend keys
    ``p - left <= j <= p + right`` (:func:`sliding_window` without the ``(Tq, Tk)`` tensor).

    ``right=0`` (the default) is causal local attention with a window of ``left + 1`` keys.

    >>> sliding_window_mask(5, left=2).int()
    tensor([[1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [0, 1, 1, 1, 0],
            [0, 0, 1, 1, 1]], dtype=torch.int32)
    >>> sliding_window_mask(3, 5, left=1, right=1).int()
    tensor([[0, 1, 1, 1, 0],
            [0, 0, 1, 1, 1],
            [0, 0, 0, 1, 1]], dtype=torch.int32)
    """
    left = check_int("left", left, minimum=0, saturate=True)
    right = check_int("right", right, minimum=0, saturate=True)
    return band_visibility(*_positions(q_len, kv_len, device), -left, right)


@shape_checked
def padding_mask(
    lengths: Int[Tensor, " B"] | Sequence[int],
    max_len: int | None = None,
    *,
    side: str = "right",
) -> Bool[Tensor, "B 1 1 T"]:
    """Dense key padding mask from sequence lengths, shaped ``(B, 1, 1, T)`` to broadcast over
    heads and queries. True marks the real tokens (:func:`key_padding` is the structured form).

    ``side="right"`` means the padding follows the tokens, ``side="left"`` that it precedes them.
    ``max_len`` defaults to the longest length.

    >>> padding_mask([3, 1, 4])[:, 0, 0].int()
    tensor([[1, 1, 1, 0],
            [1, 0, 0, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    >>> padding_mask([3, 1], max_len=5, side="left")[:, 0, 0].int()
    tensor([[0, 0, 1, 1, 1],
            [0, 0, 0, 0, 1]], dtype=torch.int32)
    """
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
    if isinstance(lengths, Tensor):
        if lengths.ndim != 1 or lengths.is_floating_point() or lengths.dtype == torch.bool:
            raise TypeError(
                f"lengths must be a 1-d integer tensor, got {lengths.dtype} of shape "
                f"{tuple(lengths.shape)}"
            )
        lens = lengths
    else:
        lens = torch.as_tensor(check_lengths("lengths", lengths), dtype=torch.long)
    if lens.numel() and bool((lens < 0).any()):
        raise ValueError(f"lengths must be >= 0, got {lens.tolist()}")
    longest = int(lens.max()) if lens.numel() else 0
    if max_len is None:
        max_len = longest
    elif check_int("max_len", max_len, minimum=0) < longest:
        raise ValueError(f"max_len ({max_len}) is shorter than the longest length ({longest})")
    pos = torch.arange(max_len, device=lens.device)
    if side == "left":
        pos = pos.flip(0)
    return (pos < lens.unsqueeze(-1))[:, None, None, :]


@shape_checked
def block_diagonal_mask(
    q_lens: Sequence[int],
    kv_lens: Sequence[int] | None = None,
    *,
    device: torch.device | str | None = None,
) -> Bool[Tensor, "Tq Tk"]:
    """Dense mask for packed sequences: the queries of segment ``s`` may attend only the keys of
    segment ``s`` (:func:`documents` is the structured form). ``kv_lens`` defaults to ``q_lens``;
    both list the segment lengths in packing order.

    For causal packed sequences, AND it with :func:`causal_mask` (with equal query and key
    segments, the global causal mask is causal within every block).

    >>> block_diagonal_mask([2, 3]).int()
    tensor([[1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 1, 1],
            [0, 0, 1, 1, 1],
            [0, 0, 1, 1, 1]], dtype=torch.int32)
    >>> combine_masks(block_diagonal_mask([2, 3]), causal_mask(5)).int()
    tensor([[1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1]], dtype=torch.int32)
    """
    q_lens = check_lengths("q_lens", q_lens)
    kv_lens = q_lens if kv_lens is None else check_lengths("kv_lens", kv_lens)
    if len(q_lens) != len(kv_lens):
        raise ValueError(
            f"q_lens and kv_lens must list as many segments, got {len(q_lens)} and {len(kv_lens)}"
        )
    segments = torch.arange(len(q_lens), device=device)
    q_seg = segments.repeat_interleave(torch.as_tensor(q_lens, dtype=torch.long, device=device))
    kv_seg = segments.repeat_interleave(torch.as_tensor(kv_lens, dtype=torch.long, device=device))
    return q_seg.unsqueeze(-1) == kv_seg


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """AND dense bool masks together, broadcasting; ``None`` (no mask) is skipped.

    Returns ``None`` when every argument is ``None``. (Structured masks combine with ``&``.)

    >>> combine_masks(causal_mask(3), None, padding_mask([2, 3])).int()[:, 0]
    tensor([[[1, 0, 0],
             [1, 1, 0],
             [1, 1, 0]],
    <BLANKLINE>
            [[1, 0, 0],
             [1, 1, 0],
             [1, 1, 1]]], dtype=torch.int32)
    """
    out: Tensor | None = None
    for i, m in enumerate(masks):
        if m is None:
            continue
        if not isinstance(m, Tensor) or m.dtype != torch.bool:
            got = m.dtype if isinstance(m, Tensor) else type(m).__name__
            raise TypeError(f"combine_masks() takes bool tensors or None; argument {i} is {got}")
        if out is None:
            out = m
            continue
        try:
            torch.broadcast_shapes(out.shape, m.shape)
        except RuntimeError:
            raise ValueError(
                f"combine_masks(): argument {i} of shape {tuple(m.shape)} does not broadcast with "
                f"the masks before it, of shape {tuple(out.shape)}"
            ) from None
        out = out & m
    return out
