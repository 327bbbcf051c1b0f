"""Which shards of a distributed call meet, and what the ranks send each other: the shard plan.

Each rank holds some chunks of the sequence (its :class:`~attnkit.distributed.layout.Layout`). A
rank's queries *meet* another rank's keys when the call's mask lets some of those queries see
some of those keys. The plan asks the mask once, at the whole call's positions, and every rank
makes the same plan: so each rank knows, without a word to the others, which keys it must send
where and which it will receive. Ranks exchange only the keys that meet: a sliding window over
long shards needs the last keys of one neighbour, packed documents that never cross a shard
boundary need no exchange at all. A key mask that travels with its keys (a dense shard, known only
to its rank) counts as "may see": it never removes an exchange.

The exchanges go in steps by distance: at step ``d`` rank ``r`` sends to ``r + d`` and receives
from ``r - d`` (modulo ``W``), and steps in which no rank sends are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .._kernel import make_plan
from ..masks import EMPTY, FULL, PARTIAL, Geometry, Mask
from .layout import Layout

__all__ = ["UNIT", "ShardPlan", "Step"]

#: Keys are sent in stretches rounded out to multiples of this many keys of a shard.
UNIT = 64

# The picture's characters: a pair of ranks whose every pair may attend, one the mask cuts, none.
_FULL, _PARTIAL, _NONE = "█", "░", "·"


@dataclass(frozen=True)
class Step:
    """One step of a rank's exchanges: the keys ``send`` (local to its shard, ``(start, stop)``)
    go to rank ``send_to``, and those of rank ``recv_from`` arrive (``recv``, local to that
    rank's shard); None where nothing goes that way."""

    distance: int
    send_to: int | None
    send: tuple[int, int] | None
    recv_from: int | None
    recv: tuple[int, int] | None


@dataclass(eq=False)
class ShardPlan:
    """The shard plan of a call of ``geo`` (the whole call) laid out as ``layout``: which ranks'
    queries meet which ranks' keys, and which keys of each shard each rank needs.

    ``mask`` is the call's mask at the whole call's positions, with the parts known to one rank
    only (a key mask that travels) left out or counted as "may see". ``str()`` draws the ranks'
    pairs (rows: the ranks' queries, columns: their keys; ``█`` every pair may attend, ``░`` the
    mask cuts, ``·`` none):

    >>> import torch
    >>> from attnkit import masks
    >>> geo = Geometry((1,), 8, 8192, 8192, torch.device("cpu"))
    >>> print(ShardPlan(masks.sliding_window(256), geo, Layout.contiguous(4)))
    ShardPlan: 4 ranks, 4 chunks of 2048 queries and 2048 keys (contiguous)
    3 of 12 pairs of ranks meet, in 1 step (distance 1); keys sent per rank: 256, 256, 256, 0
    ░···
    ░░··
    ·░░·
    ··░░
    """

    mask: Mask | None
    geo: Geometry
    layout: Layout
    _states: list[list[int]] = field(init=False, repr=False)
    _needs: dict[tuple[int, int], tuple[int, int] | None] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        c = self.layout.count
        self.q_chunk, self.k_chunk = self.geo.q_len // c, self.geo.kv_len // c
        if self.mask is None or not self.geo.q_len or not self.geo.kv_len:
            self._states = [[FULL] * c for _ in range(c)]
        else:
            grid = self.mask.block_states(
                self.geo, (0, self.geo.q_len, self.q_chunk), (0, self.geo.kv_len, self.k_chunk)
            )
            self._states = grid.tolist()
        self._needs = {}

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def chunk_state(self, qc: int, kc: int) -> int:
        """EMPTY, PARTIAL or FULL for query chunk ``qc`` against key chunk ``kc``."""
        return self._states[qc][kc]

    def chunk_states(self) -> Tensor:
        """uint8 ``(C, C)``: :meth:`chunk_state` of every query chunk against every key chunk."""
        return torch.tensor(self._states, dtype=torch.uint8)

    def state(self, dst: int, src: int) -> int:
        """The same for rank ``dst``'s queries against rank ``src``'s keys (the most visible of
        their chunks' states, FULL only when all are)."""
        states = [
            self.chunk_state(qc, kc)
            for qc in self.layout.chunks[dst]
            for kc in self.layout.chunks[src]
        ]
        if all(st == FULL for st in states):
            return FULL
        return EMPTY if all(st == EMPTY for st in states) else PARTIAL

    def needs(self, dst: int, src: int) -> tuple[int, int] | None:
        """The keys of rank ``src``'s shard (``(start, stop)``, local to it) that rank ``dst``'s
        queries may see, rounded out to :data:`UNIT` keys; None when they see none."""
        key = (dst, src)
        if key not in self._needs:
            self._needs[key] = self._find(dst, src)
        return self._needs[key]

    def _find(self, dst: int, src: int) -> tuple[int, int] | None:
        lo, hi = math.inf, -math.inf
        kc_len = self.k_chunk
        for qc in self.layout.chunks[dst]:
            for j, kc in enumerate(self.layout.chunks[src]):
                st = self.chunk_state(qc, kc)
                if st == EMPTY:
                    continue
                a, b = 0, kc_len
                if st != FULL and self.mask is not None:
                    # The keys the chunk's queries see, in units: one query block, unit key blocks.
                    plan = make_plan(
                        self.mask,
                        self.geo,
                        q_start=qc * self.q_chunk,
                        q_len=self.q_chunk,
                        k_start=kc * kc_len,
                        kv_len=kc_len,
                        block_q=self.q_chunk,
                        block_k=UNIT,
                    )
                    visits = [v for qb in plan.blocks for v in qb.visits]
                    if not visits:
                        continue
                    a, b = min(v.ks for v in visits), max(v.ke for v in visits)
                lo, hi = min(lo, j * kc_len + a), max(hi, j * kc_len + b)
        return None if lo >= hi else (int(lo), int(hi))

    def steps(self, rank: int) -> list[Step]:
        """Rank ``rank``'s exchanges, one per step of :meth:`distances` (every rank walks the
        same steps in the same order, which keeps each pair of ranks' messages in one order)."""
        w = self.world_size
        out = []
        for d in self.distances():
            to, frm = (rank + d) % w, (rank - d) % w
            send, recv = self.needs(to, rank), self.needs(rank, frm)
            out.append(
                Step(d, None if send is None else to, send, None if recv is None else frm, recv)
            )
        return out

    def distances(self) -> list[int]:
        """The steps' distances: those at which some rank sends."""
        w = self.world_size
        return [d for d in range(1, w) if any(self.needs((r + d) % w, r) for r in range(w))]

    def keys_sent(self, rank: int) -> int:
        """How many keys of its shard rank ``rank`` sends in one pass."""
        return sum(
            stop - start
            for dst in range(self.world_size)
            if dst != rank and (span := self.needs(dst, rank)) is not None
            for start, stop in [span]
        )

    def describe(self) -> str:
        """Two lines: the chunks, then which pairs of ranks meet and what each rank sends."""
        w = self.world_size
        meet = sum(1 for d in range(w) for s in range(w) if d != s and self.needs(d, s))
        dist = self.distances()
        steps = f"{len(dist)} step{'s' * (len(dist) != 1)}"
        if dist:
            steps += f" (distance{'s' * (len(dist) != 1)} {', '.join(map(str, dist))})"
        sent = ", ".join(str(self.keys_sent(r)) for r in range(w))
        name = {
            Layout.contiguous(w).chunks: "contiguous",
            Layout.zigzag(w).chunks: "zigzag",
        }.get(self.layout.chunks, f"chunks {self.layout.chunks}")
        return (
            f"{w} ranks, {self.layout.count} chunks of {self.q_chunk} queries and "
            f"{self.k_chunk} keys ({name})\n"
            f"{meet} of {w * (w - 1)} pairs of ranks meet, in {steps}; keys sent per rank: {sent}"
        )

    def picture(self, most: int = 64) -> str:
        """The ranks' pairs, one character each, for at most ``most`` ranks."""
        w = self.world_size
        if w > most:
            return f"({w} x {w} pairs of ranks: too many to draw)"
        chars = {FULL: _FULL, EMPTY: _NONE, PARTIAL: _PARTIAL}
        return "\n".join("".join(chars[self.state(d, s)] for s in range(w)) for d in range(w))

    def __str__(self) -> str:
        return f"ShardPlan: {self.describe()}\n{self.picture()}"

    def __repr__(self) -> str:
        return f"ShardPlan({self.describe().replace(chr(10), '; ')})"
