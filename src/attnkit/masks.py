"""Boolean attention masks in attnkit's one convention: **True = this query may attend this key**.

This is the convention of ``torch.nn.functional.scaled_dot_product_attention``. Every helper returns
a bool tensor that broadcasts to the ``(..., H, Tq, Tk)`` scores of :func:`attnkit.attention`;
combine them with :func:`combine_masks` (a logical AND that broadcasts and skips ``None``).

Queries and keys are aligned **bottom-right**: when there are fewer queries than keys (a KV cache, a
streaming chunk), query ``i`` sits at key position ``i + Tk - Tq``. That is what decoding with a
cache needs, and it is the alignment of ``attention(..., causal=True)``.

Shape letters: ``B`` batch, ``Tq`` queries, ``Tk`` keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._checks import check_int
from ._typing import Bool, Int, shape_checked

__all__ = [
    "block_diagonal_mask",
    "causal_mask",
    "combine_masks",
    "padding_mask",
    "sliding_window_mask",
]


def _lengths(name: str, lengths: object) -> list[int]:
    """A sequence of ints >= 0, each checked; a lone int is a TypeError naming ``name``."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(lengths).__name__}")
    return [check_int(f"{name}[]", n, minimum=0) for n in lengths]


def _offsets(q_len: int, kv_len: int | None, device: torch.device | str | None) -> Tensor:
    """``d[i, j] = j - (i + Tk - Tq)``: a key's distance ahead of its bottom-right-aligned query."""
    q_len = check_int("q_len", q_len, minimum=0)
    kv_len = q_len if kv_len is None else check_int("kv_len", kv_len, minimum=0)
    i = torch.arange(q_len, device=device).unsqueeze(-1)
    j = torch.arange(kv_len, device=device)
    return j - (i + kv_len - q_len)


@shape_checked
def causal_mask(
    q_len: int, kv_len: int | None = None, *, device: torch.device | str | None = None
) -> Bool[Tensor, "Tq Tk"]:
    """Causal mask aligned bottom-right: query ``i`` may attend key ``j`` iff ``j <= i + Tk - Tq``.

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
    return _offsets(q_len, kv_len, device) <= 0


@shape_checked
def sliding_window_mask(
    q_len: int,
    kv_len: int | None = None,
    *,
    left: int,
    right: int = 0,
    device: torch.device | str | None = None,
) -> Bool[Tensor, "Tq Tk"]:
    """Local attention: query ``i`` (at key position ``p = i + Tk - Tq``) may attend keys
    ``p - left <= j <= p + right``.

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
    left = check_int("left", left, minimum=0)
    right = check_int("right", right, minimum=0)
    d = _offsets(q_len, kv_len, device)
    return (d >= -left) & (d <= right)


@shape_checked
def padding_mask(
    lengths: Int[Tensor, " B"] | Sequence[int],
    max_len: int | None = None,
    *,
    side: str = "right",
) -> Bool[Tensor, "B 1 1 T"]:
    """Key padding mask from sequence lengths, shaped ``(B, 1, 1, T)`` to broadcast over heads and
    queries. True marks the real tokens.

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
        lens = torch.as_tensor(_lengths("lengths", lengths), dtype=torch.long)
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
    """Mask for packed sequences: the queries of segment ``s`` may attend only the keys of segment
    ``s``. ``kv_lens`` defaults to ``q_lens``; both list the segment lengths in packing order.

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
    q_lens = _lengths("q_lens", q_lens)
    kv_lens = q_lens if kv_lens is None else _lengths("kv_lens", kv_lens)
    if len(q_lens) != len(kv_lens):
        raise ValueError(
            f"q_lens and kv_lens must list as many segments, got {len(q_lens)} and {len(kv_lens)}"
        )
    segments = torch.arange(len(q_lens), device=device)
    q_seg = segments.repeat_interleave(torch.as_tensor(q_lens, dtype=torch.long, device=device))
    kv_seg = segments.repeat_interleave(torch.as_tensor(kv_lens, dtype=torch.long, device=device))
    return q_seg.unsqueeze(-1) == kv_seg


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """AND bool masks together, broadcasting; ``None`` (no mask) is skipped.

    Returns ``None`` when every argument is ``None``.

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
