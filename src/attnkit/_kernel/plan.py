"""The block plan: which (query block, key block) pairs of a call to compute, decided once.

A structured mask answers, for a grid of blocks, whether each block is EMPTY (no pair may attend:
skipped), FULL (every pair may: no mask work) or PARTIAL (a bool tile decides). The plan lists, for
every query block, the key blocks to visit and, where the mask can tell, the rows of the query
block that see any key of that block (a causal diagonal block needs only its lower rows). The
forward and the backward walk the same plan, and nothing in either asks the mask again whether a
block is empty.
"""

from __future__ import annotations

import array
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..masks import EMPTY, FULL, Geometry, Mask

__all__ = [
    "BlockPlan",
    "Plan",
    "QueryBlock",
    "Run",
    "Visit",
    "make_plan",
    "query_stretch",
    "restrict",
    "split_runs",
]


@dataclass(frozen=True)
class Visit:
    """Keys ``ks:ke`` (local to the call's key tensor) for rows ``r0:r1`` of a query block;
    ``partial``: the block needs a mask tile."""

    ks: int
    ke: int
    r0: int
    r1: int
    partial: bool


@dataclass(frozen=True)
class QueryBlock:
    """Queries ``qs:qe`` (local to the call's query tensor) and the key blocks they visit."""

    qs: int
    qe: int
    visits: tuple[Visit, ...]
    fused: bool = False  # a Run computes these rows against other keys (see split_runs)

    @property
    def key_range(self) -> tuple[int, int]:
        """The keys the block's visits cover, first to last (``(0, 0)`` when there are none)."""
        if not self.visits:
            return 0, 0
        return self.visits[0].ks, self.visits[-1].ke


@dataclass(frozen=True)
class Plan:
    """The blocks of one call: ``blocks`` per query block, and counts for reports."""

    block_q: int
    block_k: int
    blocks: tuple[QueryBlock, ...]
    total: int  # blocks in the grid
    partial: int  # of which need a tile

    @property
    def visited(self) -> int:
        return sum(len(b.visits) for b in self.blocks)

    def describe(self) -> str:
        return (
            f"{self.visited} of {self.total} blocks of {self.block_q} x {self.block_k} computed, "
            f"{self.partial} with a mask tile"
        )


def make_plan(
    mask: Mask | None,
    geo: Geometry,
    *,
    q_start: int,
    q_len: int,
    k_start: int,
    kv_len: int,
    block_q: int,
    block_k: int,
) -> Plan:
    """The plan for queries ``q_start : q_start + q_len`` against keys ``k_start : k_start +
    kv_len`` of the call ``geo`` (the whole call, unless ring attention computes one shard pair).

    Blocks are cut from the local tensors' first position, so local block ``i`` holds queries
    ``i * block_q ...``; the mask is asked in the call's coordinates. One host synchronisation at
    most (the states are read back once, wherever the mask computed them).
    """
    # A block longer than the sequence is the sequence (a block size may be as large as INT_MAX).
    bq, bk = max(1, min(block_q, q_len)), max(1, min(block_k, kv_len))
    nq, nk = len(range(0, q_len, bq)), len(range(0, kv_len, bk))
    # Per query block: the first key block asked about, and the states from there on.
    strips: list[tuple[int, list[int]]]
    lo, hi = (-math.inf, math.inf) if mask is None else mask.distances(geo)
    if mask is None:
        strips = [(0, [FULL] * nk)] * nq
    elif lo > -math.inf or hi < math.inf:
        # A band (causal, a window): each query block asks only about the key blocks its band can
        # reach, so a long sequence with a window costs O(T) here too, not O(T^2) blocks. The
        # strips are read back together.
        firsts, asked = [], []
        for i in range(nq):
            qs, qe = i * bq + q_start, min((i + 1) * bq, q_len) + q_start
            # Keys j with lo <= j - i' <= hi for some query i' of the block, as local positions.
            first = 0 if lo == -math.inf else qs + geo.shift + int(lo) - k_start
            last = kv_len - 1 if hi == math.inf else qe - 1 + geo.shift + int(hi) - k_start
            j0, j1 = max(0, first) // bk, min(nk - 1, last // bk) if last >= 0 else -1
            if j1 < j0 or first >= kv_len:
                firsts.append((0, 0))
                continue
            keys = (j0 * bk + k_start, min((j1 + 1) * bk, kv_len) + k_start, bk)
            firsts.append((j0, j1 + 1 - j0))
            asked.append(mask.block_states(geo, (qs, qe, bq), keys)[0])
        read = _read(asked)
        strips, at = [], 0
        for j0, width in firsts:
            strips.append((j0, read[at : at + width]))
            at += width
    else:
        grid = mask.block_states(
            geo, (q_start, q_start + q_len, bq), (k_start, k_start + kv_len, bk)
        )
        strips = [(0, row) for row in grid.tolist()]
    blocks = []
    partial = 0
    for i, (j0, states) in enumerate(strips):
        qs, qe = i * bq, min((i + 1) * bq, q_len)
        visits = []
        for j, state in enumerate(states, start=j0):
            if state == EMPTY:
                continue
            ks, ke = j * bk, min((j + 1) * bk, kv_len)
            r0, r1 = (0, qe - qs)
            if mask is not None:
                r0, r1 = mask.visible_rows(
                    geo, qs + q_start, qe + q_start, ks + k_start, ke + k_start
                )
                r0, r1 = max(0, r0), min(qe - qs, r1)
            if r0 >= r1:
                continue
            visits.append(Visit(ks, ke, r0, r1, state != FULL))
            partial += state != FULL
        blocks.append(QueryBlock(qs, qe, tuple(visits)))
    return Plan(bq, bk, tuple(blocks), nq * nk, partial)


# A stretch of the native forward's query ordering holds about this many query rows, over every
# batch row and head: with head sizes of 64 its queries, keys, values, their position term's
# queries and its output are a few MiB, which the last-level cache keeps from head to head.
STRETCH_ROWS = 4096


def query_stretch(mask: Mask | None, geo: Geometry, block_q: int) -> int:
    """The query ordering of a call's forward (:attr:`BlockPlan.stretch`): query blocks per
    stretch, 0 for one stretch.

    A call under a band finite on both sides (a sliding window) reads only the keys near each
    query block, and a long one holds far more than the caches do: taking every head of a few
    query blocks before the next blocks reads each key, and each row of a ``(B, T, H, Dh)``
    projection, from memory once instead of once per head. Any other call runs in one stretch
    (each head's queries in turn reuse all of that head's keys).
    """
    if mask is None or geo.q_len == 0:
        return 0
    lo, hi = mask.distances(geo)
    if math.isinf(lo) or math.isinf(hi):
        return 0
    blocks = len(range(0, geo.q_len, block_q))
    stretch = max(1, STRETCH_ROWS // max(block_q * geo.batch * geo.heads, 1))
    return stretch if stretch < blocks else 0


def restrict(plan: Plan, ks: int, ke: int) -> Plan:
    """The part of ``plan`` against its keys ``ks:ke`` (both on its block grid, or ``ke`` its
    last key), as a plan of its own whose keys start at 0: what :func:`make_plan` gives for those
    keys, without asking the mask again (ring attention's backward computes a forward tile's keys
    in several parts)."""
    blocks, partial = [], 0
    for qb in plan.blocks:
        visits = tuple(
            Visit(v.ks - ks, v.ke - ks, v.r0, v.r1, v.partial)
            for v in qb.visits
            if ks <= v.ks and v.ke <= ke
        )
        partial += sum(v.partial for v in visits)
        blocks.append(QueryBlock(qb.qs, qb.qe, visits))
    bk = max(1, min(plan.block_k, ke - ks))  # clamped to the keys, as make_plan clamps it
    nk = len(range(0, ke - ks, bk))
    return Plan(plan.block_q, bk, tuple(blocks), len(blocks) * nk, partial)


def _read(states: list[Tensor]) -> list[int]:
    """The states of several strips, read back to the host at once, concatenated."""
    if not states:
        return []
    device = states[0].device
    return torch.cat([t.to(device) for t in states]).tolist()


@dataclass(frozen=True)
class Run:
    """Queries ``qs:qe`` against keys ``ks:ke`` (local), every pair visible and full rows: work
    that one call of a fused kernel can do."""

    qs: int
    qe: int
    ks: int
    ke: int


def _full_stretch(qb: QueryBlock) -> tuple[int, int] | None:
    """The longest stretch of consecutive keys whose blocks are FULL for every row of ``qb``."""
    best: tuple[int, int] | None = None
    cur: tuple[int, int] | None = None
    for v in qb.visits:
        if v.partial or v.r0 != 0 or v.r1 != qb.qe - qb.qs:
            cur = None
            continue
        cur = (cur[0], v.ke) if cur is not None and cur[1] == v.ks else (v.ks, v.ke)
        if best is None or cur[1] - cur[0] > best[1] - best[0]:
            best = cur
    return best


def split_runs(plan: Plan, min_rows: int) -> tuple[tuple[Run, ...], tuple[QueryBlock, ...]]:
    """Take fully visible work out of ``plan`` as :class:`Run` s.

    Consecutive query blocks form a run over the keys that are FULL for all of them: blocks join
    while their stretch of FULL keys is the run's, or, until the run holds ``min_rows`` queries (a
    fused kernel's tiles want tall query blocks), while it overlaps the run's (a causal call's
    blocks pair up over the keys before the first one's diagonal). Returns the runs, and the
    plan's query blocks with the visits no run took, marked ``fused`` where a run covers their
    rows (their results are merged with the run's).
    """
    blocks = list(plan.blocks)
    stretches = [_full_stretch(qb) for qb in blocks]
    runs = []
    i = 0
    while i < len(blocks):
        keys = stretches[i]
        j = i
        while keys is not None and j + 1 < len(blocks):
            nxt = stretches[j + 1]
            if nxt is None:
                break
            common = (max(keys[0], nxt[0]), min(keys[1], nxt[1]))
            short = blocks[j].qe - blocks[i].qs < min_rows
            if nxt != keys and not (short and common[0] < common[1]):
                break
            keys, j = common, j + 1
        if keys is not None and blocks[j].qe - blocks[i].qs >= min_rows:
            ks, ke = keys
            runs.append(Run(blocks[i].qs, blocks[j].qe, ks, ke))
            for b in range(i, j + 1):
                rest = tuple(v for v in blocks[b].visits if not (ks <= v.ks and v.ke <= ke))
                blocks[b] = QueryBlock(blocks[b].qs, blocks[b].qe, rest, fused=True)
        i = j + 1
    return tuple(runs), tuple(blocks)


# The drawing's characters: a block the plan computes whole, one a mask decides inside, a skipped
# one.
_FULL, _PARTIAL, _SKIPPED = "█", "░", "·"


def int64_tensor(values: Sequence[int] | Sequence[Sequence[int]], width: int = 0) -> Tensor:
    """An int64 tensor of ``values``, a list of ints, or with ``width`` a list of rows of that
    many ints (as ``(rows, width)``): built through an array, at a fraction of ``torch.tensor``'s
    cost on a list (a plan made for every decode step of a growing cache makes two)."""
    flat: Iterable[int] = (
        itertools.chain.from_iterable(values) if width else values  # type: ignore[arg-type, assignment]
    )
    buffer = array.array("q", flat)
    if not buffer:
        return torch.empty((0, width) if width else (0,), dtype=torch.int64)
    t = torch.frombuffer(buffer, dtype=torch.int64)  # (keeps the array alive)
    return t.view(-1, width) if width else t


@dataclass(frozen=True, eq=False)
class BlockPlan:
    """Which blocks of a call's scores a kernel computes, decided once per call, as tensors:
    what the native kernel's forward and backward read (``torch.ops.attnkit.native_forward``'s
    ``offsets``, ``visits``, ``key_ok`` and ``tiles``), and the block grid the eager kernel walks.

    Query block ``b`` holds queries ``b * block_q`` on; it visits the rows
    ``visits[offsets[b] : offsets[b + 1]]``, each ``(key start, key end, first row, end row,
    partial, tile)``: keys ``ks:ke`` for rows ``r0:r1`` of the block, and whether a mask decides
    pairs inside (``partial``) by the ``band`` ``lo <= j - (i + shift) <= hi``, the per-key flags
    ``key_ok`` ``(B|1, Tk)`` or the bool tile ``tiles[tile]`` ``(B|1, H|1, block_q, block_k)``.
    Visits need not sit on the block grid: a band is cut at its own edges, packed documents into
    one visit per document. ``grid`` is the plan on the grid (EMPTY blocks skipped, FULL ones
    computed without a mask), from which the visits are cut.

    ``stretch`` is the query ordering of the native kernel's forward: it runs ``stretch`` query
    blocks at a time for every batch row and head before the next ``stretch`` blocks, so that
    under a narrow band the keys and queries of a stretch stay in the CPU's caches from one
    head to the next (see :func:`query_stretch`); 0 for one stretch of every query block, each
    head walking all of them in turn.

    ``str()`` draws the grid (one character per block: ``█`` full, ``░`` partial, ``·`` skipped).
    :func:`attnkit._kernel.planning.block_plan` makes one. Get a call's with
    :meth:`attnkit.backends.Chunked.block_plan`:

    >>> import torch, attnkit
    >>> q = torch.randn(1, 2, 512, 16)
    >>> call = attnkit.explain(q, q, q, mask=attnkit.masks.sliding_window(100)).call
    >>> print(attnkit.backends.Chunked(block_q=128, block_k=128).block_plan(call))
    BlockPlan: 4 x 4 blocks of 128 x 128 (Tq=512, Tk=512)
    7 computed, 7 with a mask, in 14 visits (band [-100, 0])
    ░···
    ░░··
    ·░░·
    ··░░
    """

    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    offsets: Tensor  # (nqb + 1,) int64
    visits: Tensor  # (nv, 6) int64
    grid: Plan
    band: tuple[float, float] | None = None
    shift: int = 0
    key_ok: Tensor | None = None
    tiles: Tensor | None = None
    stretch: int = 0

    @property
    def num_visits(self) -> int:
        return int(self.visits.size(0))

    def describe(self) -> str:
        """One line: the grid, what of it is computed, and the visits."""
        g = self.grid
        nq = len(g.blocks)
        nk = g.total // nq if nq else 0
        how = []
        if self.band is not None:
            lo, hi = (int(x) if abs(x) != float("inf") else x for x in self.band)
            how.append(f"band [{lo}, {hi}]")
        if self.key_ok is not None:
            how.append("key flags")
        if self.tiles is not None:
            how.append(f"{self.tiles.size(0)} mask tiles")
        if 0 < self.stretch < nq:
            blocks = "block" if self.stretch == 1 else "blocks"
            how.append(
                f"query ordering: stretches of {self.stretch} query {blocks}, every head of a "
                "stretch before the next"
            )
        extra = f" ({', '.join(how)})" if how else ""
        return (
            f"{nq} x {nk} blocks of {g.block_q} x {g.block_k} (Tq={self.q_len}, Tk={self.kv_len}): "
            f"{g.visited} computed, {g.partial} with a mask, in {self.num_visits} "
            f"visit{'' if self.num_visits == 1 else 's'}{extra}"
        )

    def picture(self, most: int = 64) -> str:
        """The grid, one character per block, for grids of at most ``most`` blocks a side."""
        g = self.grid
        nq = len(g.blocks)
        nk = g.total // nq if nq else 0
        if nq > most or nk > most:
            return f"({nq} x {nk} blocks: too many to draw)"
        lines = []
        for qb in g.blocks:
            row = [_SKIPPED] * nk
            for v in qb.visits:
                row[v.ks // g.block_k] = _PARTIAL if v.partial else _FULL
            lines.append("".join(row))
        return "\n".join(lines)

    def __str__(self) -> str:
        head, _, tail = self.describe().partition(": ")
        return f"BlockPlan: {head}\n{tail}\n{self.picture()}"

    def __repr__(self) -> str:
        return f"BlockPlan({self.describe()})"
