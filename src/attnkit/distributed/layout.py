"""Which positions of the sequence each rank holds: contiguous, zigzag, or any equal chunks.

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
* any other assignment of equal chunks to ranks is a :class:`Layout`; :func:`balance_documents`
  makes one that evens the work of packed documents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .._base.checks import check_int, shape_str
from .._base.shapes import shape_checked

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


@dataclass(frozen=True)
class Layout:
    """Which chunks of a sequence each rank holds: the sequence is cut into ``count`` equal chunks
    and rank ``r`` holds the chunks ``chunks[r]``, in that order, one after the other. Every rank
    holds as many chunks, so every shard has the same length.

    ``Layout.contiguous(W)`` and ``Layout.zigzag(W)`` are the two named layouts; any other
    assignment (chunks in any order, several per rank) is a layout too, for instance one that
    evens the work of packed documents (see :func:`balance_documents`).

    >>> Layout.zigzag(3).chunks
    ((0, 5), (1, 4), (2, 3))
    >>> x = torch.arange(12)
    >>> lay = Layout(((2, 0), (1, 3)))          # rank 0 holds chunks 2 and 0
    >>> [lay.shard(x, r, dim=0).tolist() for r in range(2)]
    [[6, 7, 8, 0, 1, 2], [3, 4, 5, 9, 10, 11]]
    >>> lay.unshard([lay.shard(x, r, dim=0) for r in range(2)], dim=0).tolist() == x.tolist()
    True
    """

    chunks: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        held = [c for rank in self.chunks for c in rank]
        per_rank = {len(rank) for rank in self.chunks}
        if not self.chunks or len(per_rank) != 1 or 0 in per_rank:
            raise ValueError(
                f"a layout gives every rank the same number of chunks (at least one), got "
                f"{[len(rank) for rank in self.chunks]} chunks per rank"
            )
        if sorted(held) != list(range(len(held))):
            raise ValueError(
                f"a layout holds each chunk 0..{len(held) - 1} exactly once, got {self.chunks}"
            )

    @classmethod
    def contiguous(cls, world_size: int) -> Layout:
        """Rank ``r`` holds chunk ``r`` of ``W``: ``x.chunk(W, dim)[r]``."""
        world_size = check_int("world_size", world_size)
        return cls(tuple((r,) for r in range(world_size)))

    @classmethod
    def zigzag(cls, world_size: int) -> Layout:
        """Rank ``r`` holds chunks ``r`` and ``2W-1-r`` of ``2W`` (see :func:`shard_zigzag`)."""
        world_size = check_int("world_size", world_size)
        return cls(tuple((r, 2 * world_size - 1 - r) for r in range(world_size)))

    @property
    def world_size(self) -> int:
        return len(self.chunks)

    @property
    def count(self) -> int:
        """How many chunks the sequence is cut into."""
        return self.world_size * len(self.chunks[0])

    @property
    def per_rank(self) -> int:
        return len(self.chunks[0])

    def owner(self, chunk: int) -> int:
        """The rank that holds ``chunk``."""
        for rank, held in enumerate(self.chunks):
            if chunk in held:
                return rank
        raise ValueError(f"chunk {chunk} is not in {self.chunks}")

    def segments(self, rank: int, length: int) -> list[tuple[int, int, int]]:
        """The runs of consecutive positions rank ``rank`` holds, ``(local start, global start,
        length)``, for a local length ``length``; chunks that follow each other in both orders
        form one run."""
        size = length // self.per_rank
        runs: list[list[int]] = []
        for i, c in enumerate(self.chunks[rank]):
            if (
                runs
                and runs[-1][1] + runs[-1][2] == c * size
                and runs[-1][0] + runs[-1][2] == i * size
            ):
                runs[-1][2] += size
            else:
                runs.append([i * size, c * size, size])
        return [(a, b, n) for a, b, n in runs]

    def _check_length(self, x: Tensor, d: int, dim: int) -> int:
        length = x.size(d)
        if length % self.count:
            raise ValueError(
                f"the sequence length {length} (dim {dim} of {shape_str(x.shape)}) does not divide "
                f"into {self.count} equal chunks; pad it to a multiple of {self.count} and mask "
                "the padding (attnkit.masks.key_padding)"
            )
        return length // self.count

    def shard(self, x: Tensor, rank: int, *, dim: int = -2) -> Tensor:
        """Rank ``rank``'s shard of the whole sequence ``x``: its chunks along ``dim``, in order."""
        rank, _ = _check_rank(rank, self.world_size)
        d = _check_dim(x, dim)
        c = self._check_length(x, d, dim)
        return torch.cat([x.narrow(d, i * c, c) for i in self.chunks[rank]], dim=d)

    def unshard(self, shards: Sequence[Tensor], *, dim: int = -2) -> Tensor:
        """The whole sequence from every rank's shard, in rank order (the inverse of
        :meth:`shard`)."""
        shards = list(shards)
        if len(shards) != self.world_size or not all(isinstance(s, Tensor) for s in shards):
            raise TypeError(f"shards must be {self.world_size} tensors, one per rank")
        d = _check_dim(shards[0], dim)
        shapes = [tuple(s.shape) for s in shards]
        if len(set(shapes)) != 1 or shapes[0][d] % self.per_rank:
            # A shard of another length, or one that does not cut into the rank's chunks,
            # would be read in pieces of the wrong size: rows lost or misplaced.
            raise ValueError(
                f"shards must share one shape whose dim {dim} divides into the {self.per_rank} "
                f"chunks each rank holds, got {', '.join(map(shape_str, shapes))}"
            )
        c = shards[0].size(d) // self.per_rank
        pieces: dict[int, Tensor] = {}
        for rank, shard in enumerate(shards):
            for i, chunk in enumerate(self.chunks[rank]):
                pieces[chunk] = shard.narrow(d, i * c, c)
        return torch.cat([pieces[i] for i in range(self.count)], dim=d)


def length_reasons(q_len: int, kv_len: int, layout: str | Layout) -> list[str]:
    """Why a rank's local lengths cannot be cut into the chunks ``layout`` gives each rank
    (empty when they can)."""
    per_rank = layout.per_rank if isinstance(layout, Layout) else 2 if layout == "zigzag" else 1
    if q_len % per_rank or kv_len % per_rank:
        return [
            f"the layout holds {per_rank} equal chunks per rank, so the local lengths must "
            f"divide by {per_rank}, got Tq={q_len} and Tk={kv_len}; shard with "
            "attnkit.distributed.shard_zigzag or Layout.shard"
        ]
    return []


def layout_of(layout: str | Layout, world_size: int) -> Layout:
    """A layout argument (a name of :data:`LAYOUTS` or a :class:`Layout`) for ``world_size``
    ranks; ``ValueError`` naming both when they do not fit."""
    world_size = check_int("world_size", world_size)
    if isinstance(layout, Layout):
        if layout.world_size != world_size:
            raise ValueError(
                f"the layout has {layout.world_size} ranks but the group has {world_size}"
            )
        return layout
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(
            f"layout must be one of {', '.join(map(repr, LAYOUTS))} or a Layout, got {layout!r}"
        )
    return Layout.contiguous(world_size) if layout == "contiguous" else Layout.zigzag(world_size)


def balance_documents(
    lengths: Sequence[int],
    world_size: int,
    *,
    causal: bool = False,
    chunks_per_rank: int = 4,
) -> Layout:
    """A layout that evens the work of packed documents across ranks: the sequence of
    ``sum(lengths)`` tokens is cut into ``world_size * chunks_per_rank`` equal chunks, and each
    chunk goes, largest work first, to the rank with the least work so far that still has room.

    A chunk's work is the number of (query, key) pairs its queries may attend under
    ``documents(lengths)`` (``& causal()`` with ``causal``): a query of a document of ``n``
    tokens attends ``n`` keys, or its position in the document plus one under causality. One
    long document among short ones makes contiguous shards very uneven; this layout spreads it.

    >>> lay = balance_documents([64, 16, 16, 16, 16], 2, chunks_per_rank=2)
    >>> lay.chunks                  # chunks of 32: the long document's two go to both ranks
    ((0, 2), (1, 3))
    """
    world_size = _require_int("world_size", world_size)
    chunks_per_rank = _require_int("chunks_per_rank", chunks_per_rank)
    if world_size < 1 or chunks_per_rank < 1:
        raise ValueError(
            f"world_size and chunks_per_rank must be >= 1, got {world_size} and {chunks_per_rank}"
        )
    lengths = [_require_int("lengths[i]", n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError(f"lengths must be >= 0, got {lengths}")
    total, count = sum(lengths), world_size * chunks_per_rank
    if total % count:
        raise ValueError(
            f"the documents hold {total} tokens, which do not divide into world_size * "
            f"chunks_per_rank = {count} equal chunks; pad the last document to a multiple of "
            f"{count} tokens"
        )
    # Each token's work: its document's length, or its place in the document under causality.
    per_token = torch.cat(
        [torch.arange(1, n + 1) if causal else torch.full((n,), n) for n in lengths if n]
        or [torch.zeros(0, dtype=torch.long)]
    )
    work = per_token.view(count, -1).sum(1).tolist() if total else [0] * count
    order = sorted(range(count), key=lambda c: (-work[c], c))
    held: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for c in order:
        rank = min(
            (r for r in range(world_size) if len(held[r]) < chunks_per_rank),
            key=lambda r: (load[r], r),
        )
        held[rank].append(c)
        load[rank] += work[c]
    return Layout(tuple(tuple(sorted(h)) for h in held))
