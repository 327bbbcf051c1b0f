"""The one blocked online-softmax kernel of attnkit: block plan, forward, backward.

The ``chunked`` backend runs it on a whole call; score terms (relative positions) are computed
inside it tile by tile; ring attention runs it on each pair of shards it holds. See
:mod:`attnkit.kernel.softmax` for the algorithm and :mod:`attnkit.kernel.plan` for the block plan.
"""

from .plan import Plan, QueryBlock, Visit, make_plan
from .softmax import (
    Grads,
    Problem,
    backward,
    default_blocks,
    delta_of,
    finish,
    forward,
    no_autocast,
    sink_grad,
)

__all__ = [
    "Grads",
    "Plan",
    "Problem",
    "QueryBlock",
    "Visit",
    "backward",
    "default_blocks",
    "delta_of",
    "finish",
    "forward",
    "make_plan",
    "no_autocast",
    "sink_grad",
]
