"""What each strategy of a call across ranks costs: bytes, messages, arithmetic and time per rank.

A model, not a measurement. For the ring, the all-to-all over heads (Ulysses) and their hybrid it
counts what every rank sends (the bytes :attr:`attnkit.Dispatch.sent` records, to the byte), the
messages and steps that carry them, and the arithmetic each rank does (the visible pairs of its
queries and keys, in the kernel's blocks), then turns them into seconds with a
:class:`Hardware`: a link's bandwidth and latency (one kind within a node, another between
nodes) and a rank's attention throughput. The ring's timeline is walked step by step as the ring
runs it: each rank computes against the keys it holds while the next block is in flight, so
communication costs time only where it outlasts the arithmetic; the all-to-all's exchanges and
its computation follow one another.

Per rank, with ``W`` ranks, shards of ``t = T / W`` tokens, ``B`` batch rows, ``H`` query and
``Hkv`` key/value heads of ``D`` elements of ``s`` bytes:

* ring, forward: at each step ``d`` a rank sends the keys ``n_d`` of its shard that rank ``r + d``
  meets, ``n_d * B * Hkv * 2D * s`` bytes, one message of latency ``a`` and bandwidth ``b``; it
  computes ``4 * B * H * D * p`` FLOP for ``p`` visible pairs of its queries with each block. Time:
  ``max`` over the steps of what arrives late, plus all of its arithmetic.
* all-to-all: ``(W - 1) / W`` of its q, k, v and output, ``4 * B * H * t * D * s * (W - 1) / W``
  bytes, in ``W - 1`` messages per tensor; the whole sequence's pairs for ``H / W`` heads.
* hybrid: the all-to-all within groups of ``U`` ranks (``U`` divides ``H``), the ring across the
  ``W / U`` groups with ``H / U`` heads of ``U * t`` tokens.
* backward: the ring sends the keys again and the key/value gradients back (in the work dtype),
  the all-to-all the same bytes as its forward; the arithmetic is 2.5 times the forward's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .._call import AttentionCall
from ..masks import EMPTY, FULL, Mask
from ..scores import RelativePositionTerm
from .layout import Layout
from .plan import UNIT, ShardPlan, Step

__all__ = [
    "CPU_GLOO",
    "GPU_NODES",
    "INFINIBAND",
    "NVLINK",
    "Cost",
    "Hardware",
    "Link",
    "model_costs",
]


@dataclass(frozen=True)
class Link:
    """A link between two ranks: ``bandwidth`` in bytes per second in each direction (one
    message gets all of it), ``latency`` in seconds per message."""

    name: str
    bandwidth: float
    latency: float

    def seconds(self, nbytes: int) -> float:
        """One message of ``nbytes``."""
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Hardware:
    """What the model runs on: ``flops``, the attention arithmetic one rank sustains (FLOP/s);
    ``local``, the link between ranks of one node, ``remote`` between nodes (one per rank, as
    with a network card per GPU); ``ranks_per_node`` consecutive ranks share a node;
    ``overhead``, the seconds a call spends on the host whatever its size (planning, launching,
    Python), added once per pass."""

    name: str
    flops: float
    local: Link
    remote: Link
    ranks_per_node: int
    overhead: float = 0.0

    def link(self, a: int, b: int) -> Link:
        same = a // self.ranks_per_node == b // self.ranks_per_node
        return self.local if same else self.remote


#: A node-local GPU link of the NVLink class: 300 GB/s each way between two GPUs, 5 us a message.
NVLINK = Link("NVLink-class", 300e9, 5e-6)
#: An inter-node link of the InfiniBand NDR class, one 400 Gb/s card per GPU: 45 GB/s, 10 us.
INFINIBAND = Link("InfiniBand-class", 45e9, 10e-6)
#: Nodes of 8 GPUs, each sustaining 400 TFLOP/s of attention (about 40% of a current GPU's
#: 16-bit peak), NVLink within a node and InfiniBand between nodes. Assumed figures.
GPU_NODES = Hardware("8-GPU nodes, NVLink + InfiniBand", 400e12, NVLINK, INFINIBAND, 8)
#: CPU processes on one machine exchanging over gloo (loopback TCP), one thread each: what
#: benchmarks/bench_scaling.py measured with 4 ranks on 2 cores (the benchmarks page's machine):
#: a ring step at 0.48 GB/s and 1.5 ms a message, 20 GFLOP/s of attention per rank, 12 ms of host
#: work per pass.
_GLOO = Link("gloo over loopback", 0.48e9, 1.5e-3)
CPU_GLOO = Hardware("CPU processes, gloo", 20e9, _GLOO, _GLOO, 1 << 30, 0.012)


@dataclass(frozen=True)
class Cost:
    """The model of one strategy for one call, per rank.

    ``sent``: forward bytes each rank sends (what :attr:`attnkit.Dispatch.sent` records under
    ``"forward"``), ``sent_backward`` the backward's (empty unless modelled); ``messages``: the
    most messages a rank sends in the forward, ``steps`` the exchanges it waits on one after the
    other; ``compute``: the busiest rank's seconds of arithmetic, ``communication`` its seconds on
    the links (messages back to back); ``seconds``: the modelled call, the last rank's end.
    """

    strategy: str
    sent: tuple[int, ...]
    sent_backward: tuple[int, ...]
    messages: int
    steps: int
    compute: float
    communication: float
    seconds: float

    @property
    def most_sent(self) -> int:
        """The most bytes any rank sends, forward and backward."""
        back = self.sent_backward or (0,) * len(self.sent)
        both = [f + b for f, b in zip(self.sent, back, strict=True)]
        return max(both, default=0)

    @property
    def exposed(self) -> float:
        """Seconds the call spends beyond the busiest rank's arithmetic: communication that
        nothing hides, and waiting for other ranks."""
        return max(0.0, self.seconds - self.compute)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _pair_flops(call: AttentionCall, backward: bool) -> float:
    """FLOP per visible (query, key) pair and head: q.k and p.v forward; the backward computes
    the scores again, dV, dP, dQ and dK."""
    dk, dv = call.qk_dim, call.v_dim
    forward = 2.0 * (dk + dv)
    return forward + (2.0 * (3 * dk + 2 * dv) if backward else 0.0)


def chunk_work(mask: Mask | None, plan: ShardPlan) -> Tensor:
    """``(C, C)`` float64: the (query, key) pairs the kernel computes for each query chunk
    against each key chunk of ``plan``'s layout. A pair of chunks the mask cuts is cut again into
    blocks of at least :data:`UNIT` keys; a block with any visible pair counts whole (the kernel
    computes it whole)."""
    qc, kc = plan.q_chunk, plan.k_chunk
    states = plan.chunk_states()
    work = (states == FULL).double() * (qc * kc)
    if mask is None:
        return work
    bq, bk = max(UNIT, qc // 64), max(UNIT, kc // 64)
    for i, j in (states != FULL).logical_and(states != EMPTY).nonzero().tolist():
        fine = mask.block_states(
            plan.geo, (i * qc, (i + 1) * qc, bq), (j * kc, (j + 1) * kc, bk)
        ).cpu()
        rows = torch.tensor([min(bq, qc - a) for a in range(0, qc, bq)], dtype=torch.float64)
        cols = torch.tensor([min(bk, kc - a) for a in range(0, kc, bk)], dtype=torch.float64)
        work[i, j] = float(((fine != EMPTY).double() * rows[:, None] * cols[None, :]).sum())
    return work


def _rank_work(work: Tensor, layout: Layout) -> Tensor:
    """``(W, W)``: pairs of rank ``dst``'s queries with rank ``src``'s keys."""
    w, c = layout.world_size, layout.count
    owner = torch.zeros(w, c, dtype=torch.float64)
    for r, chunks in enumerate(layout.chunks):
        owner[r, list(chunks)] = 1.0
    return owner @ work @ owner.T


def _steps(plan: ShardPlan, pairs: Tensor) -> list[list[Step]]:
    """``plan.steps(r)`` for every rank, asking the plan only about the pairs of ranks whose
    chunks meet (``pairs > 0``), so that thousands of ranks under a window stay quick."""
    w = plan.world_size
    meet = (pairs > 0).logical_and(~torch.eye(w, dtype=torch.bool))
    found: dict[int, dict[int, tuple[int, int]]] = {}  # distance -> src -> span sent
    for dst, src in meet.nonzero().tolist():
        span = plan.needs(dst, src)
        if span is not None:
            found.setdefault((dst - src) % w, {})[src] = span
    out: list[list[Step]] = [[] for _ in range(w)]
    for d in sorted(found):
        sends = found[d]
        for r in range(w):
            frm = (r - d) % w
            send, recv = sends.get(r), sends.get(frm)
            out[r].append(
                Step(
                    d,
                    None if send is None else (r + d) % w,
                    send,
                    None if recv is None else frm,
                    recv,
                )
            )
    return out


@dataclass
class _Ring:
    """The ring's counts for one call: bytes, steps, per-step arithmetic (seconds)."""

    sent: list[int]
    sent_backward: list[int]
    steps: int
    messages: int
    compute: list[float]  # per rank, forward (+ backward)
    seconds: float
    communication: float


def _ring(
    call: AttentionCall,
    plan: ShardPlan,
    per_key: int,
    hw: Hardware,
    backward: bool,
    physical: list[int],
) -> _Ring:
    """Walk the ring's steps on every rank as :mod:`attnkit.distributed.ring` runs them.

    ``per_key``: bytes of one key's k, v (and key masks); ``physical[r]``: the rank (of the whole
    world) that ring rank ``r`` is, for the links."""
    w = plan.world_size
    rows = math.prod(call.batch_shape) * call.num_heads
    pairs = _rank_work(chunk_work(plan.mask, plan), plan.layout)
    flops_fwd = _pair_flops(call, False) * rows / hw.flops
    flops_bwd = (_pair_flops(call, True) - _pair_flops(call, False)) * rows / hw.flops
    grad_per_key = (
        math.prod(call.batch_shape)
        * call.num_kv_heads
        * (call.qk_dim + call.v_dim)
        * _itemsize(torch.promote_types(call.dtype, torch.float32))
    )
    steps = _steps(plan, pairs)
    n = len(steps[0]) if steps else 0

    def span(s: tuple[int, int] | None) -> int:
        return 0 if s is None else s[1] - s[0]

    def message(a: int, b: int, nbytes: int) -> float:
        return hw.link(physical[a], physical[b]).seconds(nbytes)

    sent = [sum(span(st.send) for st in steps[r]) * per_key for r in range(w)]
    sent_bwd = [0] * w
    comm = [0.0] * w
    messages = max((sum(st.send is not None for st in s) for s in steps), default=0)

    def walk(cost: float, shares: bool) -> list[float]:
        """Each rank's end: its own keys first while step 0 flies, then each step's block."""
        own = [float(pairs[r, r]) * cost for r in range(w)]
        clock, start = own[:], [0.0] * w
        back = [0.0] * w  # when the previous step's returning gradients have landed
        for i in range(n):
            done = start[:]
            for r in range(w):
                st = steps[r][i]
                if st.send_to is not None:
                    t = message(r, st.send_to, span(st.send) * per_key)
                    comm[r] += t
                    done[r] = max(done[r], max(start[r], start[st.send_to]) + t)
                if st.recv_from is not None:
                    t = message(st.recv_from, r, span(st.recv) * per_key)
                    done[r] = max(done[r], max(start[r], start[st.recv_from]) + t)
            for r in range(w):
                st = steps[r][i]
                clock[r] = max(clock[r], done[r])
                start[r] = clock[r]
                if st.recv_from is not None:
                    clock[r] += float(pairs[r, st.recv_from]) * cost
            if shares:  # gradients of the received keys go back while the next step computes
                for r in range(w):
                    st = steps[r][i]
                    clock[r] = max(clock[r], back[r])
                    landed = clock[r]
                    if st.recv_from is not None:
                        nbytes = span(st.recv) * grad_per_key
                        sent_bwd[r] += nbytes
                        t = message(r, st.recv_from, nbytes)
                        comm[r] += t
                        landed = max(landed, clock[r] + t)
                    back[r] = landed
        return [max(c, b) for c, b in zip(clock, back, strict=True)]

    ends = walk(flops_fwd, False)
    compute = [float(pairs[r].sum()) * flops_fwd for r in range(w)]
    if backward:
        sent_bwd = sent[:]  # the keys travel again; walk() adds the gradients going back
        ends = [a + b for a, b in zip(ends, walk(flops_bwd, True), strict=True)]
        compute = [c * (1 + flops_bwd / flops_fwd) for c in compute]
    return _Ring(
        sent, sent_bwd if backward else [], n, messages, compute, max(ends, default=0.0),
        max(comm, default=0.0),
    )  # fmt: skip


def _all_to_all(u: int, first: int, hw: Hardware, nbytes: int) -> float:
    """One all-to-all among ranks ``first .. first + u - 1``, each sending ``nbytes`` in all
    (its own part stays): ``u - 1`` messages, the node-local ones and the others side by side."""
    if u == 1:
        return 0.0
    piece = nbytes // u
    near = sum(1 for m in range(1, u) if hw.link(first, first + m) is hw.local)
    far = u - 1 - near
    return max(near * hw.local.seconds(piece), far * hw.remote.seconds(piece))


def _a2a_tensors(
    call: AttentionCall, u: int, key_masks: list[int]
) -> tuple[list[int], list[int], int]:
    """The bytes of each tensor one rank passes to the all-to-all among ``u`` ranks in the
    forward (q, k, v repeated to the query heads where theirs do not divide, a position term's
    queries, the output, the log-sum-exp) and in the backward (their gradients: the output's,
    then q's, k's, v's and, where it needs one, the position queries'), and what the key masks'
    gather sends."""
    size = _itemsize(call.dtype)
    rows = math.prod(call.batch_shape)
    kv_heads = call.num_kv_heads if call.num_kv_heads % u == 0 else call.num_heads
    t = call.q_len
    tensors = [
        rows * call.num_heads * t * call.qk_dim * size,
        rows * kv_heads * call.kv_len * call.qk_dim * size,
        rows * kv_heads * call.kv_len * call.v_dim * size,
    ]
    backward = tensors[:]
    term = call.score_term
    if isinstance(term, RelativePositionTerm):
        qv = rows * call.num_heads * t * term.qv.size(-1) * size
        tensors.append(qv)
        if term.qv.requires_grad:
            backward.append(qv)
    out = rows * call.num_heads * t * call.v_dim * size
    tensors.append(out)
    backward.append(out)
    if call.return_lse:
        work = torch.promote_types(call.dtype, torch.float32)
        tensors.append(rows * call.num_heads * t * _itemsize(work))
    return tensors, backward, sum(key_masks) * (u - 1)


def _group_call(call: AttentionCall, u: int) -> AttentionCall:
    """The ring's call across groups of ``u`` ranks: ``H / u`` heads, ``u`` times the length."""
    kv = call.num_kv_heads // u if call.num_kv_heads % u == 0 else call.num_heads // u
    return replace(
        call,
        num_heads=call.num_heads // u,
        num_kv_heads=kv,
        q_len=call.q_len * u,
        kv_len=call.kv_len * u,
    )


def _agree(world: int, hw: Hardware) -> float:
    """The ranks' comparison of arguments before anything moves: one small all-gather."""
    if world == 1:
        return 0.0
    link = hw.remote if world > hw.ranks_per_node else hw.local
    return math.ceil(math.log2(world)) * link.latency


def ring_cost(
    call: AttentionCall, plan: ShardPlan, key_masks: list[int], hw: Hardware, backward: bool
) -> Cost:
    """The ring across all ``W`` ranks (``key_masks``: bytes per key of the masks that travel)."""
    rows = math.prod(call.batch_shape)
    per_key = rows * call.num_kv_heads * (call.qk_dim + call.v_dim) * _itemsize(call.dtype)
    per_key += sum(key_masks)
    w = plan.world_size
    r = _ring(call, plan, per_key, hw, backward, list(range(w)))
    host = hw.overhead * (2 if backward else 1)
    return Cost(
        "ring", tuple(r.sent), tuple(r.sent_backward), r.messages, r.steps, max(r.compute),
        r.communication, _agree(w, hw) + host + r.seconds,
    )  # fmt: skip


def a2a_cost(
    call: AttentionCall,
    world: int,
    u: int,
    work: Tensor,
    inner: ShardPlan | None,
    key_masks: list[int],
    hw: Hardware,
    backward: bool,
) -> Cost:
    """The all-to-all among groups of ``u`` consecutive ranks (``u == world``: Ulysses alone),
    with the ring across the groups (``inner``, the groups' shard plan) otherwise. ``work``: the
    whole call's :func:`chunk_work`; ``key_masks``: bytes per key of the masks that travel."""
    tensors, grads, gather = _a2a_tensors(call, u, [m * call.kv_len for m in key_masks])
    if not backward:
        grads = []
    forward = sum(b * (u - 1) // u for b in tensors) + gather
    times = [_all_to_all(u, 0, hw, b) for b in tensors + grads]
    comm = sum(times)
    name = "ulysses" if u == world else "hybrid"
    messages = (u - 1) * (len(tensors) + (1 if gather else 0))
    steps = len(tensors)
    per_flop = _pair_flops(call, backward) * math.prod(call.batch_shape) / hw.flops
    if inner is None:
        compute = float(work.sum()) * per_flop * call.num_heads / u
        seconds = compute
        sent_inner, sent_inner_bwd = [0] * world, [0] * world
    else:
        ring_call = _group_call(call, u)
        rows = math.prod(ring_call.batch_shape)
        per_key = rows * ring_call.num_kv_heads * (call.qk_dim + call.v_dim) * _itemsize(call.dtype)
        per_key += sum(key_masks)
        physical = [j * u for j in range(inner.world_size)]
        r = _ring(ring_call, inner, per_key, hw, backward, physical)
        compute, seconds = max(r.compute), r.seconds
        comm += r.communication
        messages += r.messages
        steps += r.steps
        sent_inner = [r.sent[p // u] for p in range(world)]
        sent_inner_bwd = [r.sent_backward[p // u] if backward else 0 for p in range(world)]
        # The ring's own argument check and the per-group call.
        seconds += _agree(inner.world_size, hw)
    sent = tuple(forward + s for s in sent_inner)
    back = sum(b * (u - 1) // u for b in grads)
    sent_bwd = tuple(back + s for s in sent_inner_bwd) if backward else ()
    host = hw.overhead * (2 if backward else 1)
    total = _agree(world, hw) + host + sum(times) + seconds
    return Cost(name, sent, sent_bwd, messages, steps, compute, comm, total)


def model_costs(
    call: AttentionCall,
    world: int,
    plans: dict[str, ShardPlan | None],
    u: int,
    key_masks: list[int],
    hw: Hardware,
    backward: bool,
) -> dict[str, Cost | None]:
    """Each strategy's :class:`Cost` (None where it cannot serve the call), given its shard
    plans: ``plans["ring"]`` across all ranks, ``plans["whole"]`` the whole call's (for the
    all-to-all's arithmetic), ``plans["hybrid"]`` across groups of ``u`` ranks; a missing plan
    leaves its strategy out."""
    out: dict[str, Cost | None] = {"ring": None, "ulysses": None, "hybrid": None}
    ring, whole, inner = plans.get("ring"), plans.get("whole"), plans.get("hybrid")
    if ring is not None:
        out["ring"] = ring_cost(call, ring, key_masks, hw, backward)
    if whole is not None and "ulysses" in plans:
        work = chunk_work(whole.mask, whole)
        out["ulysses"] = a2a_cost(call, world, world, work, None, key_masks, hw, backward)
    if inner is not None:
        out["hybrid"] = a2a_cost(call, world, u, torch.zeros(()), inner, key_masks, hw, backward)
    return out
