"""flash-attn's ``alibi_slopes`` as attnkit's ALiBi: ``-slope * |i + Tk - Tq - j|``.

ALiBi is a bias by distance, and a call's slopes become a
:class:`~attnkit.scores.DistanceBias` (:func:`attnkit.modules.positional.alibi_term`), which the
native kernel reads as it is and no backend writes out as ``(Tq, Tk)``: for :func:`flash_attn_func
<attnkit.flash_attn.flash_attn_func>`, for a KV cache (each row's keys may end before the call's
last: its distances are shifted by as much), and for packed sequences that share their slopes and
their queries' alignment. Packed sequences with a row of slopes each, or whose queries sit at
different distances from the call's bottom-right alignment, give one distance several biases: no
table holds them, and :class:`SequenceALiBi` computes the same formula tile by tile.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..modules.positional import alibi_by_distance, alibi_term
from ..scores import DistanceBias, ScoreTerm
from ._args import slopes_of
from ._varlen import diagonals

__all__ = ["SequenceALiBi", "alibi", "varlen_alibi"]


def alibi(
    alibi_slopes: object,
    heads: int,
    batch: int,
    dtype: torch.dtype,
    q_len: int,
    kv_len: int,
    shifts: list[int] | None = None,
) -> DistanceBias:
    """``alibi_slopes`` ``(H,)`` or ``(B, H)`` (checked) as a bias by distance over a ``(B, H, Tq,
    Tk)`` call; ``shifts``: per batch row, how many keys before the call's last key the row's keys
    end (its queries' diagonal moves left by as much)."""
    slopes = slopes_of(alibi_slopes, heads, batch, dtype)  # (B|1, H)
    shifted = shifts is not None and any(shifts)
    return alibi_term(
        slopes[0] if slopes.size(0) == 1 and not shifted else slopes,
        q_len,
        kv_len,
        shifts=torch.tensor(shifts) if shifted else None,
    )


def varlen_alibi(
    alibi_slopes: object,
    heads: int,
    q_lengths: list[int],
    k_lengths: list[int],
    dtype: torch.dtype,
) -> ScoreTerm:
    """``alibi_slopes`` ``(H,)`` or ``(batch, H)`` (checked) over packed sequences: a bias by
    distance when one shift (the distance of every sequence's queries from the call's bottom-right
    alignment) and one row of slopes serve every sequence that has queries and keys, else a
    :class:`SequenceALiBi`."""
    slopes = slopes_of(alibi_slopes, heads, len(q_lengths), dtype)  # (batch|1, H)
    total_q, total_k = sum(q_lengths), sum(k_lengths)
    # Sequence s's queries sit (Tk - Tq) - (k_end[s] - q_end[s]) keys before the call's alignment.
    shifts, q_end, k_end = set(), 0, 0
    for nq, nk in zip(q_lengths, k_lengths, strict=True):
        q_end, k_end = q_end + nq, k_end + nk
        if nq and nk:
            shifts.add((total_k - total_q) - (k_end - q_end))
    if slopes.size(0) == 1 and len(shifts) <= 1:
        shift = shifts.pop() if shifts else 0
        return alibi_term(
            slopes[0], total_q, total_k, shifts=torch.tensor([shift]) if shift else None
        )
    seq, diag = diagonals(q_lengths, k_lengths)
    per_query = slopes if slopes.size(0) == 1 else slopes[seq.to(slopes.device)]  # (Tq|1, H)
    return SequenceALiBi(per_query, diag, total_k - total_q)


class SequenceALiBi(ScoreTerm):
    """ALiBi of packed sequences, each at its own alignment: ``-slope[h] * |j - diag[i]|``.

    ``slopes`` ``(Tq|1, H)``: each query's (its sequence's) slopes; ``diag`` ``(Tq,)``: the key
    position of each query's diagonal; ``shift`` = ``Tk - Tq`` of the call, which maps the
    positions the kernel hands over back to query indices.
    """

    def __init__(self, slopes: Tensor, diag: Tensor, shift: int) -> None:
        self.slopes, self.diag, self.shift = slopes, diag, shift

    def inputs(self) -> tuple[Tensor, ...]:
        return (self.slopes,)

    def describe(self) -> str:
        return "flash_attn alibi_slopes of packed sequences at their own alignments"

    def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
        (slopes,) = inputs
        i = q_pos[:, 0] - self.shift  # the tile's query indices
        at = self.diag.to(q_pos.device)[i].unsqueeze(-1)  # (rows, 1)
        s = slopes if slopes.size(0) == 1 else slopes[i]  # (rows|1, H)
        bias = alibi_by_distance(s, (k_pos - at).to(slopes.dtype))  # (rows, H, keys)
        return bias.transpose(0, 1)  # (H, rows, keys)
