"""Which positions of the sequence each rank holds: the contiguous and the zigzag layouts.

With ``W`` ranks and a sequence of length ``T``:

* **contiguous**: rank ``r`` holds positions ``[r T/W, (r+1) T/W)``, i.e. ``x.chunk(W, dim)[r]``.
  Under a causal mask rank ``W-1`` attends every key and rank 0 only its own, so the last rank sets
  the pace.
* **zigzag**: the sequence is cut into ``2W`` equal chunks and rank ``r`` holds chunks ``r`` and
  ``2W-1-r``, one early and one late. Every rank then has the same causal work. For ``W = 3``
  (chunks 0..5)::

      rank 0: chunks 0 and 5
      rank 1: chunks 1 and 4
      rank 2: chunks 2 and 3

  :func:`shard_zigzag` cuts a full tensor into this rank's shard and :func:`unshard_zigzag` puts the
  ``W`` shards back in sequence order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .._checks import shape_str
from .._typing import shape_checked

LAYOUTS = ("contiguous", "zigzag")


def _require_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return value


def _check_rank(rank: object, world_size: object) -> tuple[int, int]:
    rank, world_size = _require_int("rank", rank), _require_int("world_size", world_size)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) = [0, {world_size}), got {rank}")
    return rank, world_size


def _check_dim(x: Tensor, dim: object) -> int:
    dim = _require_int("dim", dim)
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim={dim} is out of range for a {x.ndim}-d tensor {shape_str(x.shape)}")
    return dim % x.ndim


@shape_checked
def shard_zigzag(x: Tensor, rank: int, world_size: int, *, dim: int = -2) -> Tensor:
    """Rank ``rank``'s zigzag shard of the full sequence ``x``: chunks ``rank`` and
    ``2 * world_size - 1 - rank`` of ``2 * world_size`` equal chunks along ``dim``, concatenated.

    ``dim`` is the sequence dim: -2 for q, k, v ``(B, H, T, D)``, -1 for a padding mask
    ``(B, 1, 1, T)``. The length must divide into ``2 * world_size`` chunks.

    >>> x = torch.arange(12).view(1, 12, 1)       # T = 12, 2 ranks: 4 chunks of 3
    >>> shard_zigzag(x, 0, 2).flatten().tolist()  # chunks 0 and 3
    [0, 1, 2, 9, 10, 11]
    >>> shard_zigzag(x, 1, 2).flatten().tolist()  # chunks 1 and 2
    [3, 4, 5, 6, 7, 8]
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    rank, world_size = _check_rank(rank, world_size)
    d = _check_dim(x, dim)
    length, chunks = x.size(d), 2 * world_size
    if length % chunks:
        raise ValueError(
            f"the sequence length {length} (dim {dim} of {shape_str(x.shape)}) does not divide "
            f"into 2 * world_size = {chunks} equal chunks; pad it to a multiple of {chunks} and "
            f"mask the padding (attnkit.masks.padding_mask)"
        )
    c = length // chunks
    return torch.cat([x.narrow(d, rank * c, c), x.narrow(d, (chunks - 1 - rank) * c, c)], dim=d)


@shape_checked
def unshard_zigzag(shards: Sequence[Tensor], *, dim: int = -2) -> Tensor:
    """The full sequence from every rank's zigzag shard, in rank order (the inverse of
    :func:`shard_zigzag`); pass the result of ``torch.distributed.all_gather``, for instance.

    >>> x = torch.arange(12).view(1, 12, 1)
    >>> shards = [shard_zigzag(x, r, 3) for r in range(3)]
    >>> bool((unshard_zigzag(shards) == x).all())
    True
    """
    shards = list(shards)
    if not shards or not all(isinstance(s, Tensor) for s in shards):
        raise TypeError("shards must be a non-empty sequence of tensors, one per rank")
    d = _check_dim(shards[0], dim)
    shapes = [tuple(s.shape) for s in shards]
    if len(set(shapes)) != 1:
        raise ValueError(
            "every rank's shard must have the same shape, got "
            + ", ".join(f"rank {r}: {shape_str(s)}" for r, s in enumerate(shapes))
        )
    if shards[0].size(d) % 2:
        raise ValueError(
            f"a zigzag shard holds two equal chunks, so its length along dim {dim} must be even; "
            f"got {shape_str(shards[0].shape)}"
        )
    c = shards[0].size(d) // 2
    early = [s.narrow(d, 0, c) for s in shards]
    late = [s.narrow(d, c, c) for s in reversed(shards)]
    return torch.cat(early + late, dim=d)


def segments(layout: str, rank: int, world_size: int, length: int) -> list[tuple[int, int, int]]:
    """The runs of consecutive positions a rank holds: ``(local start, global start, length)``.

    ``length`` is the rank's local length. Within a shard positions only ever increase, in both
    layouts, which is what lets a rank's own block use a plain causal mask.
    """
    if layout == "contiguous":
        return [(0, rank * length, length)]
    c = length // 2
    return [(0, rank * c, c), (c, (2 * world_size - 1 - rank) * c, c)]
