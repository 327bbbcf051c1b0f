"""Packed sequences as a mask: flash-attn's ``cu_seqlens``, each sequence's queries aligned
bottom-right to its own keys.

With as many queries as keys in every sequence this is :func:`attnkit.masks.documents` ANDed
with the band; otherwise :class:`Sequences`, which also serves a KV cache whose rows hold keys of
several lengths (a row is then a sequence).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .._base.checks import one_or
from ..masks import EMPTY, FULL, PARTIAL, Geometry, Mask, band_visibility, documents
from ._args import band, band_mask, lengths_of

__all__ = ["Sequences", "diagonals", "sequences_mask", "varlen_mask"]

_Window = tuple[int | None, int | None]


def _block_range(t: Tensor, start: int, stop: int, block: int) -> tuple[Tensor, Tensor]:
    """Per block of ``block`` columns of ``t[:, start:stop]``: the minimum and the maximum."""
    n = -(-(stop - start) // block)
    part = t[:, start:stop]
    pad = n * block - (stop - start)
    if pad:
        part = torch.cat([part, part[:, -1:].expand(-1, pad)], 1)
    blocks = part.unflatten(1, (n, block))
    return blocks.amin(-1), blocks.amax(-1)  # (rows, n)


class Sequences(Mask):
    """Sequences whose queries and keys are packed separately: query ``i`` may attend key ``j``
    iff both belong to the same sequence and ``lo <= j - diag[i] <= hi``, where ``diag[i]`` is
    the key position of query ``i``'s diagonal (its sequence's queries aligned bottom-right to
    that sequence's keys). ``q_seq`` and ``diag`` are ``(R, Tq)``, ``k_seq`` is ``(R, Tk)``
    (``R`` = 1 or the batch; -1 marks a key no query may attend)."""

    def __init__(
        self, q_seq: Tensor, diag: Tensor, k_seq: Tensor, lo: float, hi: float, what: str
    ) -> None:
        self.q_seq, self.diag, self.k_seq = q_seq, diag, k_seq
        self.lo, self.hi, self.what = lo, hi, what
        self._devices: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}

    def describe(self) -> str:
        return self.what

    def check(self, geo: Geometry, name: str) -> None:
        rows, q_len = self.q_seq.shape
        if (q_len, self.k_seq.size(1)) != (geo.q_len, geo.kv_len) or not one_or(rows, geo.batch):
            raise ValueError(
                f"{name}: {self.describe()} describes {rows} x {q_len} queries x "
                f"{self.k_seq.size(1)} keys, the call has B={geo.batch}, Tq={geo.q_len}, "
                f"Tk={geo.kv_len}"
            )

    def _on(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        if self.q_seq.device == device:
            return self.q_seq, self.diag, self.k_seq
        if device not in self._devices:
            self._devices[device] = (
                self.q_seq.to(device),
                self.diag.to(device),
                self.k_seq.to(device),
            )
        return self._devices[device]

    def tile(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        q_seq, diag, k_seq = self._on(geo.device)
        same = q_seq[:, qs:qe, None] == k_seq[:, None, ks:ke]  # (R, rows, keys)
        j = torch.arange(ks, ke, device=geo.device)
        return (same & band_visibility(diag[:, qs:qe, None], j, self.lo, self.hi)).unsqueeze(1)

    def block_states(
        self, geo: Geometry, q: tuple[int, int, int], k: tuple[int, int, int]
    ) -> Tensor:
        q_seq, diag, k_seq = (t.cpu() for t in self._on(geo.device))
        (q0, q1, bq), (k0, k1, bk) = q, k
        qmin, qmax = (t.unsqueeze(-1) for t in _block_range(q_seq, q0, q1, bq))
        dmin, dmax = (t.unsqueeze(-1) for t in _block_range(diag, q0, q1, bq))
        kmin, kmax = (t.unsqueeze(-2) for t in _block_range(k_seq, k0, k1, bk))
        first = torch.arange(k0, k1, bk)
        last = torch.clamp(first + bk - 1, max=k1 - 1)
        # j - diag over a block pair runs from first - dmax to last - dmin.
        near, far = first - dmax, last - dmin
        empty = (qmax < kmin) | (kmax < qmin) | (kmax < 0) | (far < self.lo) | (near > self.hi)
        one = (qmin == qmax) & (kmin == kmax) & (qmin == kmin) & (kmin >= 0)
        full = one & (near >= self.lo) & (far <= self.hi)
        e, f = empty.all(0), full.all(0)
        return torch.where(e, EMPTY, torch.where(f, FULL, PARTIAL)).to(torch.uint8)


def _sequence_of(lengths: list[int]) -> Tensor:
    """``(sum(lengths),)``: the sequence each packed token belongs to."""
    n = torch.arange(len(lengths))
    return torch.repeat_interleave(n, torch.tensor(lengths, dtype=torch.long))


def diagonals(q_lengths: list[int], k_lengths: list[int]) -> tuple[Tensor, Tensor]:
    """``(sequence, diagonal)`` of each packed query, both ``(total_q,)``: the sequence it belongs
    to, and the packed key position of its diagonal (its sequence's queries aligned bottom-right
    to that sequence's keys)."""
    q_seq = _sequence_of(q_lengths)
    q_end = torch.tensor(q_lengths, dtype=torch.long).cumsum(0)
    k_end = torch.tensor(k_lengths, dtype=torch.long).cumsum(0)
    # Query i of sequence s sits at key position k_end[s] - (q_end[s] - i).
    return q_seq, torch.arange(sum(q_lengths)) + (k_end - q_end)[q_seq]


def sequences_mask(
    q_lengths: list[int], k_lengths: list[int], lo: float, hi: float, device: torch.device
) -> Mask | None:
    """The mask of packed sequences: :func:`~attnkit.masks.documents` (with the band) when every
    sequence has as many queries as keys, else a mask that aligns each sequence on its own."""
    total_q, total_k = sum(q_lengths), sum(k_lengths)
    if q_lengths == k_lengths:
        banded = band_mask(lo, hi, total_q, total_k)
        docs = documents(q_lengths) if len(q_lengths) > 1 else None
        if docs is None or banded is None:
            return docs if banded is None else banded
        return docs & banded
    q_seq, diag = diagonals(q_lengths, k_lengths)
    k_seq = _sequence_of(k_lengths)
    what = f"flash_attn varlen (queries {q_lengths}, keys {k_lengths}; band {lo:g}..{hi:g})"
    return Sequences(
        q_seq[None].to(device), diag[None].to(device), k_seq[None].to(device), lo, hi, what
    )


def varlen_mask(
    cu_seqlens_q: Tensor | Sequence[int],
    cu_seqlens_k: Tensor | Sequence[int] | None = None,
    *,
    causal: bool = False,
    window_size: _Window = (-1, -1),
) -> Mask | None:
    """The mask :func:`flash_attn_varlen_func` applies to packed sequences, for
    :func:`attnkit.attention` over ``(1, H, total_q, D)`` queries and ``(1, Hkv, total_k, D)``
    keys.

    Tokens attend only within their sequence; each sequence's queries are aligned bottom-right to
    its keys, and ``causal``/``window_size`` apply within it as in flash-attn. With the same
    lengths for queries and keys it is ``masks.documents(lengths)`` ANDed with the band; None
    when nothing is masked (one sequence, no band).

    >>> varlen_mask([0, 2, 5], causal=True)
    documents(lengths=[2, 3]) & causal()
    >>> varlen_mask([0, 1, 3], [0, 3, 5], causal=True).dense(3, 5)[0, 0].int()
    tensor([[1, 1, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [0, 0, 0, 1, 1]], dtype=torch.int32)
    """
    lo, hi = band(window_size, causal)
    q_lengths = lengths_of("cu_seqlens_q", cu_seqlens_q, None)
    if cu_seqlens_k is None:
        k_lengths = q_lengths
    else:
        k_lengths = lengths_of("cu_seqlens_k", cu_seqlens_k, None)
    if len(q_lengths) != len(k_lengths):
        raise ValueError(
            f"cu_seqlens_q describes {len(q_lengths)} sequences and cu_seqlens_k "
            f"{len(k_lengths)}: they must describe the same sequences"
        )
    device = cu_seqlens_q.device if isinstance(cu_seqlens_q, Tensor) else torch.device("cpu")
    return sequences_mask(q_lengths, k_lengths, lo, hi, device)
