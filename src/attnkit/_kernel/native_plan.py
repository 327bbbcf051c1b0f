"""The native kernel's cut of a grid plan: its visits cut where the mask allows, and the mask of
its partial visits in the cheapest form that is exact.

The native kernel reads the same grid (:class:`~attnkit._kernel.plan.Plan`) as the eager one (its
EMPTY blocks are not in it, its FULL blocks do no mask work) and sees a partial block's mask in one
of three forms: a band ``lo <= j - (i + shift) <= hi`` (causal, sliding windows), per-key flags
(key padding), both for a band and key flags joined by ``&``, or else bool tiles asked of the mask
here, once per partial block of the plan. Packed documents (the same in every batch row) need no
mask at all: a block they cut becomes one FULL visit per document in it, its rows and keys
restricted to that document. A band alone is cut at its own edges rather than at key blocks (see
:func:`_band_visits`). :func:`attnkit._kernel.planning.block_plan` makes the
:class:`~attnkit._kernel.plan.BlockPlan` of the cut.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..masks import Geometry, Mask
from .plan import Plan, QueryBlock, Visit

__all__ = ["NativeVisits", "native_visits"]


@dataclass(frozen=True)
class NativeVisits:
    """A grid plan's visits as the native kernel reads them (see
    :class:`~attnkit._kernel.plan.BlockPlan` for each part)."""

    offsets: list[int]  # (nqb + 1,): query block b visits rows[offsets[b] : offsets[b + 1]]
    rows: list[list[int]]  # (ks, ke, r0, r1, partial, tile) each
    band: tuple[float, float] | None
    shift: int  # local query i sits at local key position i + shift
    key_ok: Tensor | None
    tiles: Tensor | None


def native_visits(
    mask: Mask | None, geo: Geometry, grid: Plan, rect: tuple[int, int, int, int]
) -> NativeVisits:
    """The native kernel's visits of ``grid``: cut where the mask allows (see the module's
    docstring), and the mask of its partial visits as a band, key flags or tiles.

    ``rect = (q_start, q_len, k_start, kv_len)``: the grid covers that rectangle of the call's
    scores (made by :func:`~attnkit._kernel.plan.make_plan` with the same starts and lengths),
    as when one process computes its queries against another's keys. The indices are local to
    the rectangle, ``shift`` places its queries among its keys, and the mask is asked at the
    call's positions."""
    q0, _, k0, _ = rect
    shift = geo.shift + q0 - k0  # local query i sits at local key position i + shift
    band, key_ok, tiled = _mask_form(mask, geo, rect)
    # Packed documents need no tiles: a block they cut is one FULL visit per document in it
    # (with a band, such as causal, the band's edges are then its only mask).
    starts = _document_starts(mask, geo) if tiled else None
    if tiled and starts is None:
        band, starts = _documents_and_band(mask, geo)
    tiled = tiled and starts is None
    if starts is not None:
        starts = [s - k0 for s in starts]  # local key positions
    band_only = bool(band) and key_ok is None and not tiled and starts is None
    off = [0]
    rows: list[list[int]] = []
    tiles: list[tuple[Tensor, int, int]] = []  # a partial block's tile, its rows and keys
    for qb in grid.blocks:
        if band_only:
            rows.extend(_band_visits(qb, band, shift, grid.block_k))
            off.append(len(rows))
            continue
        for v in qb.visits:
            tile = -1
            if v.partial and starts is not None:
                for r in _document_visits(v, qb.qs, shift, starts):
                    clipped = _clip_to_band(r, qb.qs, band, shift) if band else r
                    if clipped is not None:
                        rows.append(clipped)
                continue
            if v.partial and tiled and mask is not None:
                tile = len(tiles)
                t = mask.tile(geo, qb.qs + q0, qb.qe + q0, v.ks + k0, v.ke + k0)
                tiles.append(
                    (t.reshape((1,) * (4 - t.ndim) + tuple(t.shape)), qb.qe - qb.qs, v.ke - v.ks)
                )
            rows.append([v.ks, v.ke, v.r0, v.r1, int(v.partial), tile])
        off.append(len(rows))
    return NativeVisits(
        offsets=off,
        rows=rows,
        band=(band[0], band[1]) if band else None,
        shift=shift,
        key_ok=key_ok,
        tiles=_packed_tiles(tiles, grid) if tiles else None,
    )


def _packed_tiles(tiles: list[tuple[Tensor, int, int]], grid: Plan) -> Tensor:
    """The partial blocks' tiles as one ``(tiles, B|1, H|1, block_q, block_k)`` uint8 tensor."""
    tn = max(t.size(0) for t, _, _ in tiles)
    th = max(t.size(1) for t, _, _ in tiles)
    packed = torch.zeros(len(tiles), tn, th, grid.block_q, grid.block_k, dtype=torch.uint8)
    for i, (t, nr, nk) in enumerate(tiles):
        packed[i, :, :, :nr, :nk] = t.expand(tn, th, nr, nk)
    return packed


def _mask_form(
    mask: Mask | None, geo: Geometry, rect: tuple[int, int, int, int]
) -> tuple[list[float], Tensor | None, bool]:
    """``(band, key flags, needs tiles)`` for a mask on the rectangle ``rect = (q_start, q_len,
    k_start, kv_len)`` of the call's scores (see the module's docstring)."""
    q0, nq, k0, nk = rect
    if mask is None or nk == 0 or nq == 0:  # no pair to mask
        return [], None, False
    parts = mask.parts if mask.op == "and" else (mask,)
    bands = [m for m in parts if m.band is not None]
    keyed = [m for m in parts if m.band is None and m.keys_only]
    if len(bands) > 1 or len(bands) + len(keyed) != len(parts):
        return [], None, True
    band: list[float] = []
    if bands:
        lo, hi = bands[0].distances(geo)
        band = [float(lo), float(hi)]
    key_ok = None
    for m in keyed:
        # The first query's tile: a keys-only mask may still differ between heads (a dense
        # (H, 1, Tk) mask), which key flags cannot say.
        t = m.tile(geo, q0, q0 + 1, k0, k0 + nk)
        t = t.reshape((1,) * (4 - t.ndim) + tuple(t.shape))
        if t.size(1) != 1:
            return [], None, True
        flags = t[:, 0, 0, :].expand(t.size(0), nk)
        key_ok = flags if key_ok is None else key_ok & flags
    if key_ok is not None:
        key_ok = key_ok.to(torch.uint8).contiguous()
    return band, key_ok, False


def _document_starts(mask: Mask | None, geo: Geometry) -> list[int] | None:
    """Where documents start (then Tk) when ``mask`` is packed documents, each one run of
    positions, the same in every batch row; else None."""
    if mask is None or mask.op is not None or geo.kv_len == 0 or geo.q_len == 0:
        return None
    starts = mask.document_starts()
    if starts is None or any(row != starts[0] for row in starts[1:]):
        return None
    return starts[0]


def _document_visits(v: Visit, qs: int, shift: int, starts: list[int]) -> list[list[int]]:
    """A partial visit of packed documents as the FULL rectangles of the documents it cuts: the
    rows of query block ``qs`` and the keys that one document holds (query ``i`` is in the
    document of key ``i + shift``)."""
    out = []
    first = max(bisect.bisect_right(starts, v.ks) - 1, 0)
    for d in range(first, len(starts) - 1):
        a, b = starts[d], starts[d + 1]
        if a >= v.ke:
            break
        r0, r1 = max(v.r0, a - shift - qs), min(v.r1, b - shift - qs)
        ks, ke = max(v.ks, a), min(v.ke, b)
        if r0 < r1 and ks < ke:
            out.append([ks, ke, r0, r1, 0, -1])
    return out


def _documents_and_band(mask: Mask | None, geo: Geometry) -> tuple[list[float], list[int] | None]:
    """``(band, document starts)`` when ``mask`` is packed documents (as in
    :func:`_document_starts`) ``&`` one band, else ``([], None)``."""
    if mask is None or mask.op != "and" or len(mask.parts) != 2:
        return [], None
    bands = [m for m in mask.parts if m.band is not None]
    others = [m for m in mask.parts if m.band is None]
    if len(bands) != 1 or len(others) != 1:
        return [], None
    starts = _document_starts(others[0], geo)
    if starts is None:
        return [], None
    lo, hi = bands[0].distances(geo)
    return [float(lo), float(hi)], starts


def _clip_to_band(visit: list[int], qs: int, band: list[float], shift: int) -> list[int] | None:
    """A FULL visit of one document under a band: its rows that see some of its keys, partial
    unless the band holds all its pairs (None: it holds none)."""
    ks, ke, r0, r1, _, _ = visit
    lo, hi = band
    # Row i (diagonal i + shift) sees key j iff lo <= j - (i + shift) <= hi.
    if not math.isinf(hi):
        r0 = max(r0, math.ceil(ks - hi - shift - qs))
    if not math.isinf(lo):
        r1 = min(r1, math.floor(ke - 1 - lo - shift - qs) + 1)
    if r0 >= r1:
        return None
    first, last = qs + r0 + shift, qs + r1 - 1 + shift
    full = ks - last >= lo and ke - 1 - first <= hi
    return [ks, ke, r0, r1, 0 if full else 1, -1]


# Visits of a band are cut at multiples of this many keys where they can be: the kernel's rows
# are then whole vectors (16 float32 lanes of AVX-512), without scalar tails.
_ALIGN = 16


def _band_visits(qb: QueryBlock, band: list[float], shift: int, block_k: int) -> list[list[int]]:
    """A query block's visits under a band alone, cut at the band's own edges instead of at key
    blocks: the keys every row sees as FULL visits of at most ``block_k`` keys, split evenly, and
    the two triangles at the band's edges (each about one block's rows wide) as partial ones,
    cut into stretches of rows (see below), every visit's rows those that see some of its keys;
    the cuts are rounded outwards to multiples of ``_ALIGN`` keys."""
    if not qb.visits:
        return []
    lo, hi = band
    width = math.inf if math.isinf(lo) or math.isinf(hi) else hi - lo + 1  # keys a row may see
    k0, k1 = qb.key_range
    r0 = min(v.r0 for v in qb.visits)
    r1 = max(v.r1 for v in qb.visits)
    i0, i1 = qb.qs + r0 + shift, qb.qs + r1 - 1 + shift  # the rows' diagonals, first and last

    def left(i: int) -> int:  # row i's first visible key, at least k0
        return k0 if math.isinf(lo) else max(k0, math.ceil(i + lo))

    def right(i: int) -> int:  # one past row i's last visible key, at most k1
        return k1 if math.isinf(hi) else min(k1, math.floor(i + hi) + 1)

    def down(x: int) -> int:
        return max(k0, x - x % _ALIGN)

    def up(x: int) -> int:
        return min(k1, x + (-x) % _ALIGN)

    # Keys seen by some row: [first, last); by every row: [full0, full1) (maybe empty).
    first, last = down(left(i0)), up(right(i1))
    full0, full1 = up(max(first, left(i1))), down(min(last, right(i0)))
    if full0 >= full1:
        full0 = full1 = last
    out = []
    for a, b, partial in ((first, full0, 1), (full0, full1, 0), (full1, last, 1)):
        ks = a
        while ks < b:
            pieces = -(-(b - ks) // block_k)  # what is left, in even pieces of <= block_k keys
            ke = ks + -(-(b - ks) // pieces)
            if ke < b and ke - ke % _ALIGN > ks:
                ke -= ke % _ALIGN
            # Rows that see a key of ks:ke: diagonal + hi >= ks and diagonal + lo <= ke - 1.
            lo_row = r0 if math.isinf(hi) else max(r0, math.ceil(ks - hi - shift - qb.qs))
            hi_row = r1 if math.isinf(lo) else min(r1, math.floor(ke - 1 - lo - shift - qb.qs) + 1)
            if not partial or hi_row - lo_row < 2 * _ALIGN:
                if lo_row < hi_row:
                    out.append([ks, ke, lo_row, hi_row, partial, -1])
            else:
                # A triangle: stretches of its rows, each over the keys it sees, which skips
                # most of its masked pairs. Stretches of _ALIGN rows (the keys' alignment) at
                # the finest; fewer for a narrow band, whose rows do too little work to pay for
                # more visits: one stretch per 64 keys of the band's width.
                finest = (hi_row - lo_row) // _ALIGN
                n = finest if math.isinf(width) else int(min(finest, max(2, width // 64)))
                cuts = [lo_row + (hi_row - lo_row) * x // n for x in range(n + 1)]
                for ra, rb in itertools.pairwise(cuts):
                    ka = max(ks, down(left(qb.qs + ra + shift)))
                    kb = min(ke, up(right(qb.qs + rb - 1 + shift)))
                    if ka < kb:
                        out.append([ka, kb, ra, rb, 1, -1])
            ks = ke
    return out
