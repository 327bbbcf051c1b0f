"""A call's block plan, made in one place: the grid asked of the mask, cut for the kernel that
runs it, and kept for calls like it.

:func:`block_plan` is the one maker of a :class:`~attnkit._kernel.plan.BlockPlan`: the grid of
:func:`~attnkit._kernel.plan.make_plan` (which blocks are EMPTY, FULL or PARTIAL), with the grid's
own visits for the eager kernel, or cut for the native one (:mod:`attnkit._kernel.native_plan`).
A whole call's plan comes from :func:`planned`, which keeps recent plans; ring attention's pairs
ask :func:`block_plan` for their rectangles of the call.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Hashable

from ..masks import Geometry, Mask
from .native_plan import native_visits
from .plan import BlockPlan, Plan, int64_tensor, make_plan, query_stretch
from .problem import default_blocks

__all__ = ["NATIVE_BLOCKS", "block_plan", "block_sizes", "decode_plan", "planned"]

# The native kernel's default blocks (banded masks, others): its score buffer stays in L2. A
# band's visits are cut at the band's own edges (see attnkit._kernel.native_plan), so its key
# blocks need not be narrow to skip what the band hides.
NATIVE_BLOCKS = {True: (128, 256), False: (128, 256)}


def block_sizes(
    mask: Mask | None, geo: Geometry, groups: int, term: bool, native: bool
) -> tuple[int, int]:
    """The default ``(block_q, block_k)`` of a call: the native kernel's when ``native``, else
    the eager kernel's for its mask's kind (banded or not), heads per group and score term."""
    banded = mask is not None and mask.distances(geo)[1] < math.inf
    return NATIVE_BLOCKS[banded] if native else default_blocks(banded, groups, geo.q_len, term)


def block_plan(
    mask: Mask | None,
    geo: Geometry,
    *,
    native: bool,
    groups: int = 1,
    term: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    rect: tuple[int, int, int, int] | None = None,
) -> BlockPlan:
    """The :class:`~attnkit._kernel.plan.BlockPlan` of a call: its grid (default block sizes of
    :func:`block_sizes` where none are given), its visits cut for the native kernel when
    ``native``, else the grid's own.

    ``rect = (q_start, q_len, k_start, kv_len)``: the plan of that rectangle of the call's scores
    (ring attention's pair of shards), the mask asked at the call's positions; the plan's indices
    are local to the rectangle and its ``shift`` places the rectangle's queries among its keys.
    Default: the whole call."""
    q0, q_len, k0, kv_len = (0, geo.q_len, 0, geo.kv_len) if rect is None else rect
    bq, bk = block_sizes(mask, geo, groups, term, native)
    grid = make_plan(
        mask,
        geo,
        q_start=q0,
        q_len=q_len,
        k_start=k0,
        kv_len=kv_len,
        block_q=block_q or bq,
        block_k=block_k or bk,
    )
    if not native:
        offsets, rows = _grid_visits(grid)
        return BlockPlan(
            q_len=q_len,
            kv_len=kv_len,
            block_q=grid.block_q,
            block_k=grid.block_k,
            offsets=int64_tensor(offsets),
            visits=int64_tensor(rows, 6),
            grid=grid,
            shift=geo.shift + q0 - k0,
        )
    cut = native_visits(mask, geo, grid, (q0, q_len, k0, kv_len))
    return BlockPlan(
        q_len=q_len,
        kv_len=kv_len,
        block_q=grid.block_q,
        block_k=grid.block_k,
        offsets=int64_tensor(cut.offsets),
        visits=int64_tensor(cut.rows, 6),
        grid=grid,
        band=cut.band,
        shift=cut.shift,
        key_ok=cut.key_ok,
        tiles=cut.tiles,
        stretch=query_stretch(mask, geo, grid.block_q),
    )


def _grid_visits(grid: Plan) -> tuple[list[int], list[list[int]]]:
    """``(offsets, rows)``: the grid's own visits (what the eager kernel computes)."""
    rows: list[list[int]] = []
    offsets = [0]
    for qb in grid.blocks:
        rows += [[v.ks, v.ke, v.r0, v.r1, int(v.partial), -1] for v in qb.visits]
        offsets.append(len(rows))
    return offsets, rows


def decode_plan(
    mask: Mask | None, geo: Geometry, block_k: int | None
) -> tuple[Mask | None, int | None]:
    """``(mask, block_k)`` to plan an inference call on the native kernel's decode path with.

    The mask: None where it is a band that hides no pair of this call (causal under one new
    query: every cached key is before it), whose plan would otherwise ask the band about its
    blocks at every step. The key block (unless one is given): every key in one block when no
    key block could be skipped (no mask) or a band cuts its visits at its own edges (see
    :mod:`attnkit._kernel.native_plan`), else None (the default blocks, whose EMPTY ones are
    skipped). The decode path steps through a visit of any length: one visit spares a step of a
    growing cache, whose geometry and so whose plan is new at every step, a plan that grows with
    the cache, and the kernel a break in its prefetching at every block."""
    band = None if mask is None else mask.band
    if band is not None:
        lo, hi = mask.distances(geo)  # type: ignore[union-attr]
        # j - i' over the call's pairs runs from -(Tk - 1) to Tq - 1 (i' bottom-right)
        if lo <= -(geo.kv_len - 1) and hi >= geo.q_len - 1:
            mask = None
    if block_k is None and (mask is None or band is not None):
        block_k = max(geo.kv_len, 1)
    return mask, block_k


# The plans of recent calls (see Mask.plan_key): a training or serving loop calls with one mask
# and one geometry again and again, and making a long call's plan in Python costs a tenth of its
# attention or more. Each entry holds its mask, so a key made of a tensor's id names that tensor.
# At most 16 plans and 2^17 visits in all (a few dozen MiB of Python objects at most).
_PLANS: OrderedDict[Hashable, tuple[Mask | None, BlockPlan, int]] = OrderedDict()
_PLANS_KEPT = 16
_PLANS_VISITS = 1 << 17
_PLANS_LOCK = threading.Lock()
# The visits _PLANS holds (kept as it changes: iterating an OrderedDict hashes every key again).
_PLANS_HELD = [0]


def planned(
    mask: Mask | None,
    geo: Geometry,
    groups: int,
    term: bool,
    block_q: int | None,
    block_k: int | None,
    native: bool,
) -> BlockPlan:
    """The whole call's :func:`block_plan`, from the cache when an earlier call had the same mask
    (by :attr:`Mask.plan_key`) and geometry."""
    mask_key = "no mask" if mask is None else mask.plan_key
    key = None if mask_key is None else (mask_key, geo, groups, term, block_q, block_k, native)
    if key is not None:
        with _PLANS_LOCK:
            hit = _PLANS.get(key)
            if hit is not None:
                _PLANS.move_to_end(key)
                return hit[1]
    plan = block_plan(
        mask, geo, native=native, groups=groups, term=term, block_q=block_q, block_k=block_k
    )
    size = plan.grid.visited
    if key is not None and size <= _PLANS_VISITS:
        with _PLANS_LOCK:
            held = _PLANS_HELD[0] if _PLANS else 0
            made = _PLANS.pop(key, None)  # (made twice: by two threads at once)
            held += size - (0 if made is None else made[2])
            _PLANS[key] = (mask, plan, size)
            while len(_PLANS) > _PLANS_KEPT or held > _PLANS_VISITS:
                held -= _PLANS.popitem(last=False)[1][2]
            _PLANS_HELD[0] = held
    return plan
