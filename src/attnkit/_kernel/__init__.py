"""The one blocked online-softmax kernel of attnkit: block plan, forward, backward.

The ``chunked`` backend runs it on a whole call; score terms (relative positions) are computed
inside it tile by tile; ring attention runs it on each pair of shards it holds. See
:mod:`attnkit._kernel.softmax` for the algorithm and :mod:`attnkit._kernel.plan` for the block plan.
"""

from .plan import Plan, QueryBlock, Run, Visit, make_plan, split_runs
from .softmax import (
    FUSED_ROWS,
    Grads,
    Problem,
    backward,
    default_blocks,
    delta_of,
    finish,
    forward,
    fused_serves,
    merge,
    no_autocast,
    sink_grad,
)

__all__ = [
    "FUSED_ROWS",
    "Grads",
    "Plan",
    "Problem",
    "QueryBlock",
    "Run",
    "Visit",
    "backward",
    "default_blocks",
    "delta_of",
    "finish",
    "forward",
    "fused_serves",
    "make_plan",
    "merge",
    "no_autocast",
    "sink_grad",
    "split_runs",
]
