"""What masks and score terms are asked about: the call's geometry, and block states.

A structured mask answers questions about a grid of blocks of the ``(Tq, Tk)`` scores without
writing them out; these are the shared pieces of that protocol. The public names are re-exported by
:mod:`attnkit.masks`.

Shape letters: ``B`` batch rows (several batch dims count as one, flattened), ``H`` query heads,
``Tq`` queries, ``Tk`` keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "Geometry",
    "band_visibility",
    "block_edges",
    "block_reduce",
    "states_from",
]

#: Block states of a block plan: no pair of the block may attend, some may, all may.
EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class Geometry:
    """The call a mask or a score term is asked about.

    ``batch_shape`` batch dims (masks and terms see them flattened to ``batch`` rows), ``heads``
    query heads, ``q_len`` queries and ``kv_len`` keys, on ``device``; ``dtype`` is the dtype the
    scores are computed in (float32 for float16/bfloat16/float32 inputs, float64 for float64).
    Block and tile positions are always in these coordinates (ring attention's shards pass their
    global positions).
    """

    batch_shape: tuple[int, ...]
    heads: int
    q_len: int
    kv_len: int
    device: torch.device
    dtype: torch.dtype = torch.float32

    @property
    def batch(self) -> int:
        """The batch dims flattened: ``prod(batch_shape)`` rows."""
        return math.prod(self.batch_shape)

    @property
    def shift(self) -> int:
        """``Tk - Tq``: query ``i`` sits at key position ``i + shift`` (bottom-right)."""
        return self.kv_len - self.q_len

    def q_positions(self, qs: int, qe: int) -> Tensor:
        """``(rows, 1)`` key positions of queries ``qs:qe``: ``i + Tk - Tq`` (bottom-right)."""
        return torch.arange(qs + self.shift, qe + self.shift, device=self.device).unsqueeze(-1)

    def k_positions(self, ks: int, ke: int) -> Tensor:
        """``(1, keys)`` positions of keys ``ks:ke``."""
        return torch.arange(ks, ke, device=self.device).unsqueeze(0)


def band_visibility(i: Tensor, j: Tensor, lo: float, hi: float) -> Tensor:
    """Bool: may a query at key position ``i`` attend key ``j``, i.e. ``lo <= j - i <= hi``.

    ``i`` and ``j`` are int tensors that broadcast (typically ``(rows, 1)`` and ``(keys,)``);
    either bound may be infinite. Causal attention is ``(lo, hi) = (-inf, 0)``, a sliding window
    ``(-left, right)``. Every causal and windowed visibility in attnkit is this one test.
    """
    d = j - i
    vis = d <= hi if hi < math.inf else torch.ones_like(d, dtype=torch.bool)
    if lo > -math.inf:
        vis = vis & (d >= lo)
    return vis


def block_edges(
    start: int, stop: int, block: int, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """First and last (inclusive) positions of the blocks of ``block`` in ``[start, stop)``."""
    first = torch.arange(start, stop, block, device=device)
    last = torch.clamp(first + block - 1, max=stop - 1)
    return first, last


def states_from(empty: Tensor, full: Tensor) -> Tensor:
    """uint8 block states from bool ``empty`` and ``full`` of the same shape."""
    return torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.uint8)


def block_reduce(t: Tensor, start: int, stop: int, block: int, dim: int) -> tuple[Tensor, Tensor]:
    """``(any, all)`` of the bool tensor ``t`` over the blocks of ``[start, stop)`` along ``dim``
    (size ``stop - start`` there, or 1 to broadcast)."""
    n = -(-(stop - start) // block)
    if t.size(dim) == 1:
        shape = list(t.shape)
        shape[dim] = n
        return t.expand(shape), t.expand(shape)
    pad = n * block - (stop - start)
    t = t.movedim(dim, -1)
    anys = torch.nn.functional.pad(t, (0, pad), value=False).unflatten(-1, (n, block)).any(-1)
    alls = torch.nn.functional.pad(t, (0, pad), value=True).unflatten(-1, (n, block)).all(-1)
    return anys.movedim(-1, dim), alls.movedim(-1, dim)
