"""FlexAttention's ``BlockMask`` made from attnkit's block plan.

A call's :class:`~attnkit._kernel.plan.BlockPlan` already says, once per call and kept for calls
like it, which blocks of the scores are EMPTY (skipped), FULL (no mask work) or PARTIAL (the
mask decides pair by pair): torch's ``create_block_mask`` would evaluate the ``mask_mod`` over
every pair again to find the same thing. Here the plan's visits become the block tables
(``kv_num_blocks``, ``kv_indices`` and the full blocks) of ``BlockMask.from_kv_blocks``, laid out
as ``create_block_mask`` lays them out (each query block's listed key blocks in order, then the
others), written on the host from the plan and copied to the device once per plan: no pass over
the mask, no read back from the device.

The plan's grid is made for FlexAttention's blocks (128 x 128 unless told), so its blocks are
the BlockMask's. A plan describes every batch row and head at once (a block is EMPTY when it is
for all of them, FULL when it is for all of them, else PARTIAL), so the BlockMask has one row of
tables, ``(1, 1, ...)``, which FlexAttention broadcasts; the ``mask_mod`` decides per row and head
in the PARTIAL blocks.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from ..._kernel.plan import BlockPlan, Plan
from ..._kernel.planning import planned
from ...masks import Geometry, Mask
from .mask_mod import MaskMod

__all__ = ["BLOCK", "block_mask", "block_tables", "plan_of"]

#: FlexAttention's block of queries and of keys (its kernels' sparse block).
BLOCK = 128

# BlockMasks of recent plans (their tables on a device), by the plan's identity: a plan is kept
# for calls like it by attnkit._kernel.planning, so a training loop finds its BlockMask here.
_MADE: OrderedDict[tuple[int, torch.device], tuple[BlockPlan, Any]] = OrderedDict()
_KEPT = 16
_LOCK = threading.Lock()


def plan_of(mask: Mask, geo: Geometry, groups: int, block: tuple[int, int]) -> BlockPlan:
    """The call's block plan on FlexAttention's blocks (the grid's own visits), kept for calls
    like it."""
    return planned(mask, geo, groups, False, block[0], block[1], False)


def block_tables(
    grid: Plan, kv_len: int, block: tuple[int, int]
) -> tuple[list[int], list[list[int]], list[int], list[list[int]]]:
    """``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)`` of one batch row and
    head, as lists: per query block its PARTIAL key blocks, then its FULL ones, each in order and
    followed by the key blocks not listed (``create_block_mask``'s layout). ``block``:
    FlexAttention's blocks, of which the grid's are those that fit in the call."""
    nk = len(range(0, kv_len, max(grid.block_k, 1)))
    counts: list[int] = []
    rows: list[list[int]] = []
    full_counts: list[int] = []
    full_rows: list[list[int]] = []
    for qb in grid.blocks:
        partial: list[int] = []
        full: list[int] = []
        for v in qb.visits:
            # FULL where every pair of the whole block is visible, as create_block_mask says: a
            # block cut short by the end of the queries or keys is PARTIAL (the kernel then
            # masks its pairs past the end); so is a FULL block whose visit skips rows.
            rows_ = qb.qe - qb.qs
            whole = v.r0 == 0 and v.r1 == rows_ == block[0] and v.ke - v.ks == block[1]
            (partial if v.partial or not whole else full).append(v.ks // grid.block_k)
        for listed, count_to, rows_to in ((partial, counts, rows), (full, full_counts, full_rows)):
            taken = set(listed)
            count_to.append(len(listed))
            rows_to.append(listed + [j for j in range(nk) if j not in taken])
    return counts, rows, full_counts, full_rows


def _made(plan: BlockPlan, device: torch.device, block: tuple[int, int]) -> Any:
    from torch.nn.attention.flex_attention import BlockMask

    counts, rows, full_counts, full_rows = block_tables(plan.grid, plan.kv_len, block)
    nk = len(range(0, plan.kv_len, max(plan.grid.block_k, 1)))

    def table(values: list[int] | list[list[int]], *shape: int) -> Tensor:
        return torch.tensor(values, dtype=torch.int32).reshape(1, 1, *shape).to(device)

    nq = len(counts)
    return BlockMask.from_kv_blocks(
        table(counts, nq),
        table(rows, nq, nk),
        table(full_counts, nq),
        table(full_rows, nq, nk),
        BLOCK_SIZE=block,
        seq_lengths=(plan.q_len, plan.kv_len),
    )


def block_mask(
    mask: Mask,
    geo: Geometry,
    mask_mod: MaskMod,
    *,
    groups: int = 1,
    block: tuple[int, int] = (BLOCK, BLOCK),
) -> Any:
    """torch's ``BlockMask`` of the call ``geo`` under ``mask``, from its plan, with
    ``mask_mod`` (the lowered mask) for the PARTIAL blocks."""
    plan = plan_of(mask, geo, groups, block)
    key = (id(plan), geo.device)
    with _LOCK:
        hit = _MADE.get(key)
        if hit is not None and hit[0] is plan:
            _MADE.move_to_end(key)
            made = hit[1]
        else:
            made = None
    if made is None:
        made = _made(plan, geo.device, block)
        with _LOCK:
            _MADE[key] = (plan, made)
            while len(_MADE) > _KEPT:
                _MADE.popitem(last=False)
    # the tables are the plan's; the mask_mod reads this call's tensors
    out = copy.copy(made)
    out.mask_mod = mask_mod
    return out
