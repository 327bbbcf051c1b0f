"""Which strategy runs a call across ranks, and why: the ring, the all-to-all over heads, or the
hybrid of the two; :func:`explain` says it, :func:`parallel_attention` runs it.

The choice is by what a rank sends in the forward, the most any rank sends: the ring sends the
keys (and values, and a key mask) that other ranks' queries meet, which the shard plan knows
from the mask; the all-to-all sends ``(W - 1) / W`` of its q, k, v and output whatever the mask.
A short reach (a window, documents within shards) favours the ring, a long one the all-to-all.
Dropout runs on the ring only (the all-to-all's calls would number the pairs they drop by their
own heads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from .._base.checks import check_int
from .._call import AttentionCall
from .._kernel.choice import why_not_native
from .._score_mod import ScoreMod
from ..masks import Mask
from ..scores import RelativePositionTerm, ScoreTerm
from ._args import split_mask, validated, whole_geometry
from ._comm import agree
from .costs import Cost, Hardware, model_costs
from .layout import Layout, layout_of
from .plan import ShardPlan
from .ring import ring_attention, ring_check
from .ulysses import heads_group, ulysses_attention, ulysses_check, whole_world

__all__ = ["STRATEGIES", "Strategy", "cost", "explain", "parallel_attention"]

STRATEGIES = ("auto", "ring", "ulysses", "hybrid")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class Strategy:
    """What :func:`explain` found: the strategy ``chosen`` for the call, each strategy's forward
    bytes per rank (the most any rank sends; None where it cannot serve the call) and reasons,
    the ring's :class:`ShardPlan`, each strategy's modelled :class:`Cost` when :func:`explain`
    was given a ``hardware``, and the report's lines (``str()``)."""

    chosen: str | None
    sent: dict[str, int | None]
    reasons: dict[str, list[str]]
    plan: ShardPlan | None
    lines: list[str] = field(default_factory=list)
    costs: dict[str, Cost | None] = field(default_factory=dict)

    def __str__(self) -> str:
        return "\n".join(self.lines)


def _ring_bytes(call: AttentionCall, plan: ShardPlan, travel: list[Tensor]) -> int:
    """The most keys any rank sends, in bytes of k, v and key masks."""
    itemsize = torch.empty((), dtype=call.dtype).element_size()
    rows = math.prod(call.batch_shape)
    per_key = rows * call.num_kv_heads * (call.qk_dim + call.v_dim) * itemsize
    per_key += sum(t.numel() // t.size(-1) for t in travel)  # bool: one byte each
    return max(plan.keys_sent(r) for r in range(plan.world_size)) * per_key


def _a2a_bytes(call: AttentionCall, u: int) -> int:
    """What one rank sends in the all-to-all among ``u`` ranks: (u - 1) / u of its q, k, v (the
    keys and values repeated to the query heads where theirs do not divide), a position term's
    queries and its output."""
    itemsize = torch.empty((), dtype=call.dtype).element_size()
    rows = math.prod(call.batch_shape)
    kv_heads = call.num_kv_heads if call.num_kv_heads % u == 0 else call.num_heads
    elements = call.num_heads * call.q_len * (call.qk_dim + call.v_dim)
    elements += kv_heads * call.kv_len * (call.qk_dim + call.v_dim)
    if isinstance(call.score_term, RelativePositionTerm):
        elements += call.num_heads * call.q_len * call.score_term.qv.size(-1)
    return rows * elements * itemsize * (u - 1) // u


def _decide(
    call: AttentionCall,
    world: int,
    lay: Layout,
    strategy: str,
    subgroup: bool,
    hardware: Hardware | None = None,
    backward: bool = False,
) -> Strategy:
    structure, travel, _ = split_mask(call.mask, call.kv_len)
    reasons: dict[str, list[str]] = {
        "ring": ring_check(call, lay),
        "ulysses": ulysses_check(call, world, lay),
        "hybrid": ulysses_check(call, world, lay),
    }
    u = heads_group(call.num_heads, call.num_kv_heads, world)
    if u != world:
        reasons["ulysses"].append(
            f"the {call.num_heads} heads do not divide among the {world} ranks (the hybrid "
            f"exchanges heads within groups of {u})"
        )
    if 1 < u < world and subgroup:
        reasons["hybrid"].append("the hybrid runs on the whole world's group only")
    if u in (1, world):
        reasons["hybrid"].append(
            "no head to split among groups of ranks"
            if u == 1
            else f"the {call.num_heads} heads divide among all {world} ranks (Ulysses alone)"
        )
    whole = whole_geometry(call, world)
    if call.device.type == "meta":  # the plan asks the mask, on a device that holds data
        whole = replace(whole, device=torch.device("cpu"))
    plan = ShardPlan(structure, whole, lay) if not reasons["ring"] else None
    sent: dict[str, int | None] = {"ring": None, "ulysses": None, "hybrid": None}
    if plan is not None:
        sent["ring"] = _ring_bytes(call, plan, travel)
    if not reasons["ulysses"]:
        sent["ulysses"] = _a2a_bytes(call, world)
    inner = None
    if not reasons["hybrid"]:
        groups = world // u
        members = Layout(
            tuple(
                tuple(c for m in range(j * u, (j + 1) * u) for c in lay.chunks[m])
                for j in range(groups)
            )
        )
        inner = ShardPlan(structure, whole, members)
        ring_call = _per_group(call, u)
        sent["hybrid"] = _a2a_bytes(call, u) + _ring_bytes(ring_call, inner, travel)
    costs: dict[str, Cost | None] = {}
    if hardware is not None:
        plans = {"ring": plan, "hybrid": inner}
        if not reasons["ulysses"]:
            plans["ulysses"] = plans["whole"] = plan or ShardPlan(structure, whole, lay)
        key_masks = [t.numel() // t.size(-1) for t in travel]
        costs = model_costs(call, world, plans, u, key_masks, hardware, backward)
    able = {name: b for name, b in sent.items() if b is not None}
    if strategy != "auto":
        chosen = strategy if strategy in able else None
    else:
        chosen = min(able, key=lambda name: (able[name], name != "ring")) if able else None
    return Strategy(chosen, sent, reasons, plan, costs=costs)


def _per_group(call: AttentionCall, u: int) -> AttentionCall:
    """The ring's call across groups of ``u`` ranks: ``H / u`` heads, ``u`` times the length."""
    kv = call.num_kv_heads // u if call.num_kv_heads % u == 0 else call.num_heads // u
    return replace(
        call,
        num_heads=call.num_heads // u,
        num_kv_heads=kv,
        q_len=call.q_len * u,
        kv_len=call.kv_len * u,
    )


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} us"


def _lines(
    call: AttentionCall,
    world: int,
    found: Strategy,
    strategy: str,
    hardware: Hardware | None = None,
    backward: bool = False,
) -> list[str]:
    passes = " (forward and backward)" if backward else " (forward)"
    lines = [
        f"attention across {world} ranks, per rank: {call.describe()}",
        f"{strategy} picks: {found.chosen or 'nothing: no strategy can serve the call'}",
    ]
    words = {
        "ring": "keys the other ranks' queries meet (the shard plan below)",
        "ulysses": "(W-1)/W of q, k, v and the output, whatever the mask",
        "hybrid": "an all-to-all within groups of ranks, the ring across them",
    }
    for name in ("ring", "ulysses", "hybrid"):
        b = found.sent[name]
        if b is None:
            lines.append(f"  {name:<8} cannot: {'; '.join(found.reasons[name])}")
            continue
        head = "chosen" if name == found.chosen else "could serve it"
        lines.append(f"  {name:<8} {head}: sends {_size(b)} per rank (forward): {words[name]}")
    if found.costs:
        lines.append(f"modelled per call on {hardware.name if hardware else ''}{passes}:")
        for name, c in found.costs.items():
            if c is not None:
                lines.append(
                    f"  {name:<8} {_time(c.seconds)}: compute {_time(c.compute)}, links "
                    f"{_time(c.communication)} in {c.steps} step{'s' * (c.steps != 1)}, "
                    f"{_time(c.exposed)} not hidden"
                )
    if found.plan is not None:
        lines += ["", str(found.plan)]
    kernel = why_not_native(call) or "native kernel"
    if call.dropout_p and found.chosen == "ring" and kernel == "native kernel":
        kernel = "the eager kernel (dropout across ranks)"
    lines.append(f"each rank's kernel: {kernel}")
    return lines


def explain(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | Mask | None = None,
    bias: ScoreTerm | None = None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    layout: str | Layout = "contiguous",
    strategy: str = "auto",
    world_size: int | None = None,
    group: ProcessGroup | None = None,
    hardware: Hardware | None = None,
    backward: bool = False,
) -> Strategy:
    """Which strategy :func:`parallel_attention` takes for this rank's shards (the arguments
    :func:`~attnkit.distributed.ring_attention` takes), and why: what each strategy would send
    per rank, the ring's shard plan, and the kernel. Runs nothing across the ranks: give
    ``world_size`` (no process group needed; tensors on ``meta`` work), or a ``group`` whose
    size is taken. With a ``hardware`` (such as :data:`attnkit.distributed.GPU_NODES`), it also
    models each strategy's time per call, of the forward or, with ``backward=True``, of both
    passes (see :func:`cost`).

    >>> import torch
    >>> from attnkit import masks
    >>> q = torch.empty(1, 8, 2048, 64, device="meta")   # one rank's shard of 8192 tokens
    >>> print(explain(q, q, q, mask=masks.sliding_window(256), world_size=4))
    attention across 4 ranks, per rank: q (1, 8, 2048, 64), k (1, 8, 2048, 64), v (1, 8, ...
    auto picks: ring
      ring     chosen: sends 1.0 MiB per rank (forward): keys the other ranks' queries meet ...
      ulysses  could serve it: sends 12.0 MiB per rank (forward): (W-1)/W of q, k, v and the ...
      hybrid   cannot: the 8 heads divide among all 4 ranks (Ulysses alone)
    <BLANKLINE>
    ShardPlan: 4 ranks, 4 chunks of 2048 queries and 2048 keys (contiguous)
    3 of 12 pairs of ranks meet, in 1 step (distance 1); keys sent per rank: 256, 256, 256, 0
    ░···
    ░░··
    ·░░·
    ··░░
    each rank's kernel: ...
    """
    if strategy not in STRATEGIES:
        raise ValueError(
            f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}"
        )
    if world_size is None:
        if group is None and not (dist.is_available() and dist.is_initialized()):
            raise ValueError("explain() needs world_size=, or an initialised process group")
        world_size = dist.get_world_size(group)
    world_size = check_int("world_size", world_size)
    if hardware is not None and not isinstance(hardware, Hardware):
        raise TypeError(
            "hardware must be an attnkit.distributed.Hardware (such as GPU_NODES) or None, got "
            f"{type(hardware).__name__}"
        )
    if not isinstance(backward, bool):
        raise TypeError(f"backward must be a bool, got {backward!r}")
    call = validated(
        q, k, v, mask=mask, bias=bias, causal=causal, scale=scale, softcap=softcap, sinks=sinks,
        dropout_p=dropout_p, return_lse=return_lse, score_mod=score_mod, world=world_size,
    )  # fmt: skip
    subgroup = group is not None and not whole_world(group)
    lay = layout_of(layout, world_size)
    found = _decide(call, world_size, lay, strategy, subgroup, hardware, backward)
    found.lines = _lines(call, world_size, found, strategy, hardware, backward)
    return found


def cost(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | Mask | None = None,
    bias: ScoreTerm | None = None,
    causal: bool = False,
    layout: str | Layout = "contiguous",
    world_size: int,
    hardware: Hardware,
    backward: bool = False,
    return_lse: bool = False,
) -> dict[str, Cost | None]:
    """The modelled cost of each strategy for this rank's shards across ``world_size`` ranks
    on ``hardware``: ``{"ring": Cost, "ulysses": Cost | None, "hybrid": Cost | None}``, None where
    the strategy cannot serve the call. Nothing runs; tensors on ``meta`` work.

    Each :class:`~attnkit.distributed.Cost` holds the bytes every rank sends (forward, and
    backward with ``backward=True``), its messages and steps, the busiest rank's arithmetic and
    time on the links, and the modelled seconds of the call, the ring's communication hidden
    behind its arithmetic where it is shorter. The model and its formulas:
    :mod:`attnkit.distributed.costs`.

    >>> import torch
    >>> from attnkit import masks
    >>> from attnkit.distributed import GPU_NODES, cost
    >>> q = torch.empty(1, 32, 8192, 128, dtype=torch.bfloat16, device="meta")
    >>> found = cost(q, q, q, mask=masks.sliding_window(4096), world_size=32, hardware=GPU_NODES)
    >>> [found[s].sent[1] // 2**20 for s in ("ring", "ulysses")]   # MiB rank 1 sends
    [64, 248]
    """
    found = explain(
        q, k, v, mask=mask, bias=bias, causal=causal, return_lse=return_lse, layout=layout,
        world_size=world_size, hardware=hardware, backward=backward,
    )  # fmt: skip
    return found.costs


def parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | Mask | None = None,
    bias: ScoreTerm | None = None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    layout: str | Layout = "contiguous",
    strategy: str = "auto",
    group: ProcessGroup | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`~attnkit.distributed.ring_attention` or
    :func:`~attnkit.distributed.ulysses_attention` (the all-to-all, or its hybrid with the ring),
    whichever sends the least for this call (``strategy="auto"``, see :func:`explain`), or the
    one named. The ranks compare their choices (one small all-gather) before either runs."""
    try:
        found = explain(
            q, k, v, mask=mask, bias=bias, causal=causal, scale=scale, softcap=softcap,
            score_mod=score_mod, sinks=sinks, dropout_p=dropout_p, return_lse=return_lse,
            layout=layout, strategy=strategy, group=group,
        )  # fmt: skip
        if found.chosen is None:
            # The pick and each strategy's reason, not the pick alone.
            lines = [line.strip() for line in str(found).splitlines()[1:5]]
            raise ValueError("parallel_attention: " + "; ".join(lines))
    except (TypeError, ValueError) as error:
        agree(group, "parallel_attention", str(error), {})
        raise
    agree(group, "parallel_attention", None, {"strategy": found.chosen})
    if found.chosen == "ring":
        return ring_attention(
            q, k, v, mask=mask, bias=bias, causal=causal, scale=scale, softcap=softcap,
            score_mod=score_mod, sinks=sinks, dropout_p=dropout_p, return_lse=return_lse,
            layout=layout, group=group,
        )  # fmt: skip
    return ulysses_attention(
        q, k, v, mask=mask, bias=bias, causal=causal, scale=scale, softcap=softcap,
        score_mod=score_mod, sinks=sinks, return_lse=return_lse, layout=layout, group=group,
    )  # fmt: skip
