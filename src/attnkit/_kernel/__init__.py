"""The one blocked online-softmax kernel of attnkit: block plan, forward, backward.

The ``chunked`` backend runs it on a whole call; score terms (relative positions) are computed
inside it tile by tile; ring attention runs it on each pair of shards it holds. One concept per
module:

* :mod:`~attnkit._kernel.plan`: the block plan's types and its grid, which blocks of the scores
  to visit; :mod:`~attnkit._kernel.native_plan`: the grid cut for the native kernel;
  :mod:`~attnkit._kernel.planning`: the one maker of a call's plan, and the plans kept;
* :mod:`~attnkit._kernel.choice`: which kernel serves a call (native or eager, the decode path);
* :mod:`~attnkit._kernel.problem`: one call in the kernel's layout and the scores of a visit;
* :mod:`~attnkit._kernel.forward` and :mod:`~attnkit._kernel.backward`: the online softmax;
* :mod:`~attnkit._kernel.fused`: fully visible stretches through torch's fused CPU kernel;
* :mod:`~attnkit._kernel.merge` and :mod:`~attnkit._kernel.sinks`: parts of a row and sinks,
  combined by log-sum-exp;
* :mod:`~attnkit._kernel.dropout`: dropout's mask, block by block;
* :mod:`~attnkit._kernel.phases`: the kernel's one forward and one backward on a planned call;
* :mod:`~attnkit._kernel.call` and :mod:`~attnkit._kernel.operator`: the kernel on a whole call,
  in eager mode and as an operator in graphs; :mod:`~attnkit._kernel.rect`: on a rectangle of a
  call (ring attention's pairs of shards).
"""

from .backward import Grads, backward, delta_of, folds
from .dropout import draw_seed, dropout_mask
from .forward import forward, sizes, small_scores, zero_offset_safe
from .fused import FUSED_ROWS, fused_serves
from .merge import merge
from .plan import BlockPlan, Plan, QueryBlock, Run, Visit, make_plan, restrict, split_runs
from .problem import Problem, default_blocks, no_autocast
from .sinks import finish, sink_grad

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
