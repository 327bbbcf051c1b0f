"""Dropout without storing its mask: a counter-based generator both kernels evaluate per block.

Pair ``(n, h, i, j)`` (flattened batch row, query head, query, key) of a call with ``H`` heads,
``Tq`` queries and ``Tk`` keys is kept iff the top 24 bits of splitmix64's output for the counter
``c = ((n * H + h) * Tq + i) * Tk + j`` and the call's seed are at least ``p * 2^24``. splitmix64
(Steele, Lea and Flood, 2014) is a counter-based generator: its output at ``c`` is
``mix(seed + (c + 1) * 0x9E3779B97F4A7C15)`` with a fixed bit mixer, so any block of the mask can
be computed on its own, and the backward regenerates the forward's decisions from the seed. The
seed is drawn once per call from torch's default generator, so ``torch.manual_seed`` makes dropout
reproducible. The native kernel (``attnkit/_native/attention.cpp``) computes the same bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["draw_seed", "dropout_mask"]


def _signed(x: int) -> int:
    """A uint64 constant as the int64 torch holds it (integer products wrap around)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(z: Tensor, bits: int) -> Tensor:
    """A logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


_GAMMA = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def draw_seed() -> int:
    """A call's dropout seed, from torch's default generator."""
    return int(torch.randint(-(2**63), 2**63 - 1, ()))


def dropout_mask(
    seed: int,
    p: float,
    shape: tuple[int, int, int, int],
    *,
    queries: tuple[int, int] | None = None,
    keys: tuple[int, int] | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Bool ``(B, H, rows, keys)``: which pairs dropout keeps, for a call of ``shape = (B, H, Tq,
    Tk)``; ``queries``/``keys`` (start, stop) select a block (default: all)."""
    n, h, tq, tk = shape
    q0, q1 = queries or (0, tq)
    k0, k1 = keys or (0, tk)

    def axis(start: int, stop: int, dim: int) -> Tensor:
        t = torch.arange(start, stop, dtype=torch.int64, device=device)
        return t.view([-1 if d == dim else 1 for d in range(4)])

    counter = ((axis(0, n, 0) * h + axis(0, h, 1)) * tq + axis(q0, q1, 2)) * tk + axis(k0, k1, 3)
    z = seed + (counter + 1) * _GAMMA
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return _shr(z, 40) >= int(p * 16777216.0)
