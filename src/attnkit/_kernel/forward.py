"""The online softmax's forward: exact attention in O(T * block) memory, in PyTorch.

The forward walks the query blocks of a :class:`~attnkit._kernel.plan.Plan` and, within each, the
key blocks the plan visits, keeping a running maximum, sum and weighted sum per query row, so the
``(Tq, Tk)`` scores never exist at once (the FlashAttention recipe; Dao et al., 2022). Each
visit's scores, with everything the call adds to them, come from
:meth:`~attnkit._kernel.problem.Problem.scores`.

* **Lazy rescaling.** The textbook online softmax takes the maximum of every score block and
  rescales the running sums whenever it grows: two extra passes over each block. Here each query row
  keeps a fixed offset ``m`` (the maximum of the first blocks it sees) and later blocks are computed
  directly as ``q k^T - m`` by one ``baddbmm``. Any offset is exact as long as ``exp`` does not
  overflow (it cannot underflow more than with the true maximum, which is >= ``m``). Overflow, of
  the running sum or of the weighted values, is checked for every query block at once at the end of
  the call, and the blocks that overflowed are redone with the textbook rescaling. When every
  offset of a block is small (within ``2^+-32``), the offset is 0 and the subtraction disappears.
* **Decided per call, not per block.** The loops never read a number back to the host: what they
  need is decided once. When ``|q| |k| * scale`` bounds every score of the call within
  ``2^+-32`` (base 2) and nothing is added to the scores, every block takes offset 0 from its
  first key and nothing can overflow (three norms, one read). Otherwise the first block whose rows
  are all reached asks whether its offsets are small, and the others move onto 0 on that answer,
  checked with the overflow at the end.

Fully visible stretches may go to torch's fused kernel (:mod:`~attnkit._kernel.fused`), whose part
of each row is merged with the rest by log-sum-exp.

The single rule for a query with no visible key lives here: its log-sum-exp is ``-inf`` and its
output 0 (the backward reads its log-sum-exp as 0, see :mod:`~attnkit._kernel.backward`). In the
careful mode an output entry is made NaN exactly when a visible key's value is non-finite there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fused import fused_forward
from .merge import merge
from .plan import QueryBlock
from .problem import LN2, LOG2E, ZERO_BITS, Problem, nonfinite

__all__ = ["forward", "sizes", "small_scores", "zero_offset_safe"]

# A running sum at or above this (or inf/NaN) means the lazy offset was too low: redo the block.
_OVERFLOW_GUARD = 2.0**64
# A row that takes offset 0 before it has seen a visible key must end with a sum at least this
# large (its largest score then lies within the zero offset's range).
_TINY_SUM = 2.0**-ZERO_BITS


def zero_offset_safe(p: Problem) -> bool:
    """Whether every block of the call may take offset 0 from its first key: no softcap and nothing
    added to the scores (a score_mod can make any score of bounded q and k unbounded), and
    :func:`small_scores` holds for its q, k and v. One host read."""
    if p.softcap is not None or p.bias5 is not None or p.term is not None or p.careful:
        return False
    if p.modded:
        return False
    if not (p.q5.numel() and p.k3.numel() and p.v3.numel()):
        return False
    q_norm, k_norm, v_max = sizes(p.q5, p.k3, p.v3, p.work).tolist()
    return small_scores(q_norm, k_norm, v_max, p.scale, p.tk, p.work)


def sizes(q: Tensor, k: Tensor, v: Tensor, work: torch.dtype) -> Tensor:
    """The largest row norm (over the last dimension) of non-empty ``q``, ``k`` and ``v``, as one
    tensor of 3 in ``work``, for :func:`small_scores` (a value row's norm bounds its entries): one
    pass over each. Inf or NaN where an input holds inf or NaN (or where a square overflows)."""
    return torch.stack([torch.linalg.vector_norm(t, dim=-1, dtype=work).amax() for t in (q, k, v)])


def small_scores(
    q_norm: float, k_norm: float, v_max: float, scale: float, keys: int, work: torch.dtype
) -> bool:
    """Whether queries and keys of at most these norms give scores (base 2) within
    ``2^+-ZERO_BITS`` (Cauchy-Schwarz: ``|q . k| <= |q| |k|``), and ``keys`` of them, weighting
    values no larger than ``v_max``, sums that stay within ``work``'s range: then offset 0 is
    exact for every row. NaN compares False."""
    bound = abs(scale) * LOG2E * q_norm * k_norm
    return bound <= ZERO_BITS and keys * 2.0**bound * v_max <= torch.finfo(work).max / 4


def _forward_block(
    p: Problem, qb: QueryBlock, mode: str, switch: bool | None = False
) -> tuple[Tensor, Tensor, Tensor | None, bool | None]:
    """Output (normalised) and log-sum-exp of one query block, as rows; for ``mode="lazy"`` a
    bool tensor, whether the lazy offsets were safe (False: redo the block ``"exact"``), and
    whether it moved its offsets onto 0.

    ``"exact"`` is the textbook online softmax (rescale whenever a block's maximum is larger).
    ``"zero"`` takes offset 0 for every key (:func:`zero_offset_safe` holds for the call).
    ``"lazy"`` rescales on the visits that reach rows no earlier visit of the block reached, as
    the plan says, and keeps each row's offset afterwards. A row the plan reached that has seen no
    visible key keeps offset ``-inf``, so any key it sees later makes its sum inf or NaN and fails
    the check.
    Once every row is reached, ``switch`` says whether the offsets move onto 0: ``None`` asks
    (one host read: are they all within ``2^+-32``), True takes it on trust (checked at the end).
    """
    qr_all = p.q_rows(qb.qs, qb.qe, factor=p.score_factor())
    tb = p.term_block(qb, None)
    rows = qr_all.size(1)
    acc = qr_all.new_zeros(qr_all.size(0), rows, p.dv)
    lsum = qr_all.new_zeros(qr_all.size(0), rows, 1)
    zero = mode == "zero"  # offset 0: no subtraction at all
    m = qr_all.new_full((qr_all.size(0), rows, 1), 0.0 if zero else float("-inf"))
    spoiled = qr_all.new_zeros(qr_all.size(0), rows, p.dv) if p.v_bad else None
    # Rows of the block some visit has reached (lazy mode), as the plan says: no data is read.
    reached = bytearray(qb.qe - qb.qs) if mode == "lazy" else None
    switched: bool | None = None
    unsure: list[Tensor] = []  # where the offset 0 taken on trust may have been wrong
    for visit in qb.visits:
        lo, hi = visit.r0 * p.g, visit.r1 * p.g
        step = zero or (reached is not None and reached.find(0, visit.r0, visit.r1) < 0)
        offset = m[:, lo:hi] if step and not zero else None
        s, _, vis = p.scores(qr_all[:, lo:hi], qb.qs, visit, offset, tb)
        vb = p.values(visit.ks, visit.ke)
        if step:
            torch.exp2_(s)
        else:
            m_old = m[:, lo:hi]
            m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
            # Rows that have seen no visible key keep m = -inf (so a later block sets it from its
            # own maximum) but subtract 0: their scores are all -inf and exp(-inf - 0) = 0.
            m_sub = m_new.masked_fill(m_new == float("-inf"), 0.0)
            alpha = torch.exp2_(m_old - m_sub)
            torch.exp2_(s.sub_(m_sub))
            lsum[:, lo:hi].mul_(alpha)
            acc[:, lo:hi].mul_(alpha)
            m[:, lo:hi] = m_new
        lsum[:, lo:hi].add_(s.sum(-1, keepdim=True))
        keep = p.keep(qb.qs, visit)
        acc[:, lo:hi].baddbmm_(s if keep is None else s.mul_(keep), vb)
        if reached is not None and not step:
            reached[visit.r0 : visit.r1] = b"\x01" * (visit.r1 - visit.r0)
            if switch is not False and reached.find(0) < 0:
                # Every row reached: offsets within 2^+-32 move onto 0 (the sums so far with them),
                # so later blocks are exp(q k^T) with no pass to subtract anything. A row that has
                # seen no key yet takes 0 too, and must end with a sum that is not tiny (else its
                # keys may have underflowed): the check at the end redoes the block.
                empty = m == float("-inf")
                offsets = m.masked_fill(empty, 0.0).abs()
                if switch is None:
                    # NaN: False; no rows at all (an empty batch): nothing to switch
                    switch = offsets.numel() > 0 and float(offsets.amax()) <= ZERO_BITS
                if switch:
                    unsure += [~(offsets <= ZERO_BITS), empty]
                    shift = torch.exp2_(m.clone())
                    lsum.mul_(shift)
                    acc.mul_(shift)
                    m.zero_()
                    zero = True
                switched = switch
        if spoiled is not None:
            bad = nonfinite(p.v3[:, visit.ks : visit.ke]).to(p.work)
            spoiled[:, lo:hi].baddbmm_(p.visible(qb.qs, visit, vis), bad)
    safe = None
    if mode == "lazy":
        # The lazy offset was too low if a running sum passed the guard or the weighted values
        # overflowed: one number tells both (NaN/inf in acc makes it NaN, and NaN < guard is false).
        safe = acc.sum().mul_(0.0).add_(lsum.amax() if lsum.numel() else 0.0) < _OVERFLOW_GUARD
        if unsure:
            wrong, empty = unsure
            safe &= ~(wrong | (empty & (lsum < _TINY_SUM))).any()
    empty_rows = lsum == 0  # rows with no key they may attend: output 0, never 0/0
    out = acc.div_(lsum.masked_fill(empty_rows, 1.0))
    if spoiled is not None:
        out.masked_fill_(spoiled > 0, float("nan"))
    # -inf for empty rows: m = -inf (or 0) and log(0) = -inf
    lse = m.add_(lsum.log2_()).mul_(LN2)
    return out, lse, safe, switched


def forward(p: Problem) -> tuple[Tensor, Tensor]:
    """Output ``(B, Hkv, G, Tq, Dv)`` in the work dtype (laid out in memory as ``(B, Tq, H, Dv)``)
    and log-sum-exp ``(B, Hkv, G, Tq)``, ``-inf`` for queries with no visible key. No sinks.

    At most three host reads, whatever the number of blocks: :func:`zero_offset_safe` (unless the
    problem was told); in lazy mode, whether the first block's offsets may move onto 0 (the later
    blocks then do so on trust), and one check of every block at the end (the blocks that fail it
    are redone with the textbook rescaling).
    """
    out = torch.empty(p.n, p.tq, p.hkv, p.g, p.dv, dtype=p.work, device=p.q5.device)
    out = out.permute(0, 2, 3, 1, 4)
    lse = torch.empty(p.n, p.hkv, p.g, p.tq, dtype=p.work, device=p.q5.device)
    if p.runs:
        fused_forward(p, out, lse)
    zero = p.zero_offset if p.zero_offset is not None else zero_offset_safe(p)
    mode = "zero" if zero else "lazy"
    # A softcap's offsets ride on its sigmoid pass for free: they never move onto 0.
    switch: bool | None = None if p.softcap is None else False
    # In lazy mode a fused block's part is merged only once it is known to be exact.
    held: dict[int, tuple[Tensor, Tensor]] = {}
    checks: list[tuple[int, Tensor]] = []
    for i, qb in enumerate(p.blocks):
        if not qb.visits:
            if not qb.fused:
                out[:, :, :, qb.qs : qb.qe] = 0.0
                lse[:, :, :, qb.qs : qb.qe] = float("-inf")
            continue
        o, lse_b, safe, switched = _forward_block(p, qb, mode, switch)
        if switch is None:
            switch = switched
        if safe is not None:
            checks.append((i, safe))
        if qb.fused and safe is not None:
            held[i] = (o, lse_b)
        else:
            _store(p, qb, out, lse, o, lse_b)
    if checks:
        verdicts = torch.stack([safe for _, safe in checks]).tolist()
        for (i, _), fine in zip(checks, verdicts, strict=True):
            if not fine:
                o, lse_b, _, _ = _forward_block(p, p.blocks[i], "exact")
                if i in held:
                    held[i] = (o, lse_b)
                else:
                    _store(p, p.blocks[i], out, lse, o, lse_b)
    for i, (o, lse_b) in held.items():
        _store(p, p.blocks[i], out, lse, o, lse_b)
    return out, lse


def _store(p: Problem, qb: QueryBlock, out: Tensor, lse: Tensor, o: Tensor, lse_b: Tensor) -> None:
    """Write one query block's rows into the output, or merge them with a run's part of them."""
    rows = qb.qe - qb.qs
    o5 = o.view(p.n, p.hkv, rows, p.g, p.dv).transpose(2, 3)
    lse5 = lse_b.view(p.n, p.hkv, rows, p.g).transpose(2, 3)
    if qb.fused:
        merge(out[:, :, :, qb.qs : qb.qe], lse[:, :, :, qb.qs : qb.qe], o5, lse5)
    else:
        out[:, :, :, qb.qs : qb.qe] = o5
        lse[:, :, :, qb.qs : qb.qe] = lse5
