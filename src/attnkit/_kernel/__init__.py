"""The one blocked online-softmax kernel of attnkit: block plan, forward, backward.

The ``chunked`` backend runs it on a whole call; score terms (relative positions) are computed
inside it tile by tile; ring attention runs it on each pair of shards it holds. See
:mod:`attnkit._kernel.softmax` for the algorithm and :mod:`attnkit._kernel.plan` for the block plan.
"""

from .dropout import draw_seed, dropout_mask
from .plan import BlockPlan, Plan, QueryBlock, Run, Visit, make_plan, restrict, split_runs
from .softmax import (
    FUSED_ROWS,
    Grads,
    Problem,
    backward,
    default_blocks,
    delta_of,
    finish,
    folds,
    forward,
    fused_serves,
    merge,
    no_autocast,
    sink_grad,
    sizes,
    small_scores,
    zero_offset_safe,
)

__all__ = [
    "FUSED_ROWS",
    "BlockPlan",
    "Grads",
    "Plan",
    "Problem",
    "QueryBlock",
    "Run",
    "Visit",
    "backward",
    "default_blocks",
    "delta_of",
    "draw_seed",
    "dropout_mask",
    "finish",
    "folds",
    "forward",
    "fused_serves",
    "make_plan",
    "merge",
    "no_autocast",
    "restrict",
    "sink_grad",
    "sizes",
    "small_scores",
    "split_runs",
    "zero_offset_safe",
]
