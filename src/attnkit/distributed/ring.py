"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Each of the ``W`` ranks holds an equal shard of q, k and v, laid out by a
:class:`~attnkit.distributed.layout.Layout`. The mask, the score term and the positions are the
whole sequence's: every rank evaluates them at its shards' positions in it. Each rank computes its
queries against its own keys and against the keys of every other rank its queries meet (the
:class:`~attnkit.distributed.plan.ShardPlan` says which, the same on every rank); keys travel
point to point, only where they are seen, the next block in flight while the current one is
computed (Liu et al., 2023, "Ring Attention with Blockwise Transformers", with the ring cut down
to the pairs the mask leaves). Each pair of shards is a rectangle of the whole call's scores
that the kernel runs as it runs any rectangle of a call (:mod:`attnkit._kernel.rect`: its own
block plan, the native operator or, where one process would take it, the eager kernel), and the
pairs' outputs merge through their log-sum-exp in the work dtype.

The backward walks the same exchanges: the keys come again, each pair's query gradients stay
home, and its key/value gradients go back to the keys' owner. The forward's block plans are kept
for it, so no mask is asked twice.

Gradients of the tensors every rank holds whole (a position term's encodings, a table of
distances, the sinks, tensors a ``score_mod`` captures) are each rank's share, from its own
queries: their sum over the ranks is the whole call's gradient, as for every parameter upstream
of the shards (all-reduce them, as for the projections' weights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from .._base.checks import check_int, shape_str
from .._base.finite import finite
from .._base.shapes import Bool, Float, shape_checked
from .._call import AttentionCall
from .._kernel import FUSED_ROWS, delta_of, draw_seed, finish, folds, merge, sink_grad, sizes
from .._kernel.rect import RectSettings, per_query, rect_settings
from .._record import Dispatch, current, note_kernel
from .._score_mod import ScoreMod, captured_tensors, check_captured
from ..backends.base import Backend, CallInputs
from ..masks import Mask
from ..scores import RelativePositionTerm, ScoreTerm
from ._args import Travel, describe, rebuild, split_mask, term_reasons, validated, whole_geometry
from ._comm import Peers, Pending, agree, require_group
from ._pair import (
    PairPlan,
    Rect,
    ShardKeys,
    backward_pair,
    forward_pair,
    kernel_shape,
    plan_pair,
    work_dtype,
)
from .layout import LAYOUTS, Layout, layout_of, length_reasons
from .plan import ShardPlan

__all__ = ["RingBackend", "ring_attention", "ring_check"]


# --------------------------------------------------------------------------------------------------
# The mask: what every rank evaluates, and the key masks that travel


def _bind(structure: Mask | None, blocks: list[Tensor], rect: Rect) -> Mask | None:
    """The call's mask for one pair: each traveling key mask as the block's, at the whole call's
    key positions (the block's key ``rect.lk`` sits at ``rect.gk``)."""
    if structure is None or not blocks:
        return structure

    def leaf(m: Mask) -> Mask:
        if isinstance(m, Travel):
            return ShardKeys(blocks[m.index], rect.gk - rect.lk)
        return m

    return rebuild(structure, leaf)


# --------------------------------------------------------------------------------------------------
# One call across the ranks


@dataclass(eq=False)
class _Run:
    """One call's state on this rank: its settings, shard plan and exchanges, and the pairs'
    plans (made in the forward, read by the backward)."""

    s: RectSettings
    peers: Peers
    shards: ShardPlan
    layout: Layout
    structure: Mask | None
    travel: list[Tensor]
    q_len: int  # local lengths
    kv_len: int
    n_term: int
    record: Dispatch | None
    plans: dict[tuple[int, Rect], PairPlan | None] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.peers.rank

    def rects(self, src: int, lo: int, hi: int) -> list[Rect]:
        """This rank's queries against rank ``src``'s keys ``lo:hi`` (local to its shard), one
        rectangle per run of positions on either side."""
        out = []
        for lq, gq, nq in self.layout.segments(self.rank, self.q_len):
            for lk, gk, nk in self.layout.segments(src, self.kv_len):
                a, b = max(lk, lo), min(lk + nk, hi)
                if a < b:
                    out.append(Rect(lq, gq, nq, a - lo, gk + a - lk, b - a))
        return out

    def walk(
        self,
        own: list[Tensor],
        compute: Callable[[int, int, list[Tensor]], list[Tensor] | None],
        shares: Callable[[int, int, list[Tensor]], None] | None = None,
    ) -> None:
        """Compute against this rank's own keys, then against each block the shard plan brings,
        the next block in flight meanwhile. ``own``: ``[k4, v4, *key masks]`` of this rank.

        ``compute(src, lo, block)`` gets the keys ``lo:`` of rank ``src``'s shard; with
        ``shares`` (the backward), what it returns goes back to ``src`` and what the ranks that
        received this rank's keys return arrives as ``shares(lo, hi, tensors)``."""
        steps = self.shards.steps(self.rank)

        def start(i: int) -> Pending:
            st = steps[i]
            send = []
            if st.send is not None:
                a, b = st.send
                send = [t[:, :, a:b] for t in own[:2]] + [m[..., a:b] for m in own[2:]]
            likes = []
            if st.recv is not None:
                a, b = st.recv
                likes = [t[:, :, : b - a] for t in own[:2]] + [m[..., : b - a] for m in own[2:]]
            return self.peers.exchange(st.send_to, send, st.recv_from, likes)

        ahead = [start(0)] if steps else []  # the next step's exchange, in flight
        back: tuple[Pending, tuple[int, int] | None] | None = None  # returning shares, in flight
        compute(self.rank, 0, own)
        for i, st in enumerate(steps):
            got = ahead.pop().wait()
            if i + 1 < len(steps):
                ahead.append(start(i + 1))
            out = None
            if st.recv_from is not None and st.recv is not None:
                out = compute(st.recv_from, st.recv[0], got)
            del got
            if shares is None:
                continue
            likes = []
            if st.send is not None:
                a, b = st.send
                likes = [t[:, :, : b - a].to(self.s.geo.dtype) for t in own[:2]]
            ret = st.recv_from if out is not None else None
            flight = self.peers.exchange(ret, out or [], st.send_to, likes, tag=1)
            if back is not None:
                _land(back, shares)
            back = (flight, st.send)
        if back is not None and shares is not None:
            _land(back, shares)


def _land(
    back: tuple[Pending, tuple[int, int] | None],
    shares: Callable[[int, int, list[Tensor]], None],
) -> None:
    flight, span = back
    got = flight.wait()
    if got and span is not None:
        shares(span[0], span[1], got)


def _forward(
    run: _Run, q: Tensor, k: Tensor, v: Tensor, extras: tuple[Tensor, ...]
) -> tuple[Tensor, Tensor]:
    """Output ``(N, Hkv, G, Tq, Dv)`` and log-sum-exp ``(N, Hkv, G, Tq)`` in the work dtype
    (``-inf`` for queries that see no key anywhere, whose output is 0); the pairs' plans kept."""
    s = run.s
    n, hkv, g = kernel_shape(q, v)
    q5 = q.reshape(n, hkv, g, run.q_len, q.size(-1))
    k4 = k.reshape(n, hkv, run.kv_len, k.size(-1))
    v4 = v.reshape(n, hkv, run.kv_len, v.size(-1))
    work = work_dtype(q.dtype)
    out = q.new_zeros(n, hkv, g, run.q_len, v.size(-1), dtype=work)
    lse = q.new_full((n, hkv, g, run.q_len), float("-inf"), dtype=work)
    terms, mods = extras[: run.n_term], extras[run.n_term :]

    def compute(src: int, lo: int, block: list[Tensor]) -> None:
        kb, vb, *masks = block
        for rect in run.rects(src, lo, lo + kb.size(2)):
            p = plan_pair(s, _bind(run.structure, masks, rect), rect, terms)
            run.plans[src, rect] = p
            if p is None:
                continue
            o, o_lse = forward_pair(s, p, q5, kb, vb, terms, mods)
            rows = slice(rect.lq, rect.lq + rect.nq)
            merge(out[:, :, :, rows], lse[:, :, :, rows], o, o_lse)

    run.walk([k4, v4, *run.travel], compute)
    return out, lse


def _backward(
    run: _Run,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    extras: tuple[Tensor, ...],
    rows: tuple[Tensor, Tensor, Tensor, Tensor],
    needs: tuple[bool, ...],
) -> tuple[Tensor, Tensor, Tensor, list[Tensor | None]]:
    """Gradients of the local q, k, v (kernel layout, work dtype) and of ``extras`` (this rank's
    share), given the call's final ``rows = (out, lse, delta, dout)``."""
    s = run.s
    n, hkv, g = kernel_shape(q, v)
    q5 = q.reshape(n, hkv, g, run.q_len, q.size(-1))
    k4 = k.reshape(n, hkv, run.kv_len, k.size(-1))
    v4 = v.reshape(n, hkv, run.kv_len, v.size(-1))
    work = work_dtype(q.dtype)
    dq = torch.zeros(q5.shape, dtype=work, device=q.device)
    dk = torch.zeros(k4.shape, dtype=work, device=q.device)
    dv = torch.zeros(v4.shape, dtype=work, device=q.device)
    terms, mods = extras[: run.n_term], extras[run.n_term :]
    term_needs = tuple(needs[: run.n_term])
    rowed = per_query(s.term)
    dextra: list[Tensor | None] = [None] * len(extras)
    fold = False if s.native else folds(rows[1], s.softcap)

    def add(i: int, d: Tensor | None, rect: Rect) -> None:
        if d is None:
            return
        target = dextra[i]
        if target is None:
            target = dextra[i] = torch.zeros(extras[i].shape, dtype=d.dtype, device=d.device)
        if i < run.n_term and rowed[i]:
            target[:, :, rect.lq : rect.lq + rect.nq] += d
        else:
            target += d

    def compute(src: int, lo: int, block: list[Tensor]) -> list[Tensor]:
        kb, vb = block[0], block[1]
        dkb = torch.zeros(kb.shape, dtype=work, device=q.device)
        dvb = torch.zeros(vb.shape, dtype=work, device=q.device)
        for rect in run.rects(src, lo, lo + kb.size(2)):
            p = run.plans[src, rect]
            if p is None:
                continue
            gr = backward_pair(s, p, q5, kb, vb, terms, mods, rows, term_needs, fold)
            dq[:, :, :, rect.lq : rect.lq + rect.nq] += gr.dq
            dkb[:, :, rect.lk : rect.lk + rect.nk] += gr.dk
            dvb[:, :, rect.lk : rect.lk + rect.nk] += gr.dv
            for i, d in enumerate([*gr.dterm, *gr.dmod]):
                add(i, d, rect)
        return [dkb, dvb]

    def shares(lo: int, hi: int, got: list[Tensor]) -> None:
        dk[:, :, lo:hi] += got[0]
        dv[:, :, lo:hi] += got[1]

    def own(src: int, lo: int, block: list[Tensor]) -> list[Tensor] | None:
        if src == run.rank:
            dko, dvo = compute(src, lo, block)
            dk.add_(dko)
            dv.add_(dvo)
            return None
        return compute(src, lo, block)

    run.walk([k4, v4, *run.travel], own, shares)
    return dq, dk, dv, dextra


class _RingFunction(torch.autograd.Function):
    """The ring's one autograd node per call: its forward runs the kernel's forward phase on each
    pair of shards (:func:`attnkit._kernel.rect.forward_rect`) and merges them, its backward the
    kernel's backward phase on each pair (:func:`attnkit._kernel.rect.backward_rect`).

    One node for the call, not one per pair: a pair's key and value gradients belong to the
    rank that sent it the keys, and the backward sends them back around the ring while the next
    block of keys is in flight. Autograd nodes per pair could route those gradients only through
    differentiable sends and receives; here the walk schedules the exchanges itself."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        run: _Run,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        sinks: Tensor | None,
        *extras: Tensor,
    ) -> tuple[Tensor, Tensor]:
        _, hkv, g = kernel_shape(q, v)
        before = run.peers.sent
        out5, lse = _forward(run, q, k, v, extras)
        if run.record is not None:
            run.record.sent["forward"] = run.peers.sent - before
        out5, lse = finish(out5, lse, None if sinks is None else sinks.view(hkv, g))
        out = out5.reshape(*q.shape[:-1], v.size(-1)).to(q.dtype)
        # O before rounding, for the backward's rowsum(dO * O) (see attnkit._kernel.delta_of).
        ctx.save_for_backward(q, k, v, out5, lse, *([] if sinks is None else [sinks]), *extras)
        ctx.run = run  # type: ignore[attr-defined]
        ctx.has_sinks = sinks is not None  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)
        return out, lse.reshape(q.shape[:-1]).clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dout: Tensor | None, dlse: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        run: _Run = ctx.run  # type: ignore[attr-defined]
        q, k, v, out5, lse, *rest = ctx.saved_tensors  # type: ignore[attr-defined]
        sinks = rest.pop(0) if ctx.has_sinks else None  # type: ignore[attr-defined]
        extras = tuple(rest)
        _, hkv, g = kernel_shape(q, v)
        dout5 = out5.new_zeros(out5.shape) if dout is None else dout.reshape(out5.shape)
        delta = delta_of(out5, dout5)
        if dlse is not None:
            delta = delta - dlse.reshape(lse.shape).to(delta.dtype)
        needs = ctx.needs_input_grad[5:]  # type: ignore[attr-defined]
        before = run.peers.sent
        dq, dk, dv, dextra = _backward(
            run, q, k, v, extras, (out5, lse, delta, dout5.to(out5.dtype)), tuple(needs)
        )
        if run.record is not None:
            run.record.sent["backward"] = run.peers.sent - before
        dsinks = None
        if sinks is not None:
            dsinks = sink_grad(lse, delta, sinks.view(hkv, g)).reshape(sinks.shape).to(sinks.dtype)
        dextras = [
            None if d is None or not need else d.to(t.dtype)
            for d, t, need in zip(dextra, extras, needs, strict=True)
        ]
        return (
            None,
            dq.reshape(q.shape).to(q.dtype),
            dk.reshape(k.shape).to(k.dtype),
            dv.reshape(v.shape).to(v.dtype),
            dsinks,
            *dextras,
        )


# Function.apply is untyped in torch; give it its type once.
_apply: Callable[..., tuple[Tensor, Tensor]] = _RingFunction.apply


# --------------------------------------------------------------------------------------------------
# What a ring call takes, and the call itself


def ring_check(call: AttentionCall, layout: Layout | str = "contiguous") -> list[str]:
    """Why ring attention cannot serve a call (empty when it can)."""
    reasons = []
    if call.bias_shape is not None:
        reasons.append(
            f"a dense bias {shape_str(call.bias_shape)} would need the whole sequence's rows of "
            "scores; give it as a score term evaluated at the whole sequence's positions "
            "(attnkit.scores.DistanceBias, RelativePositionTerm or a ScoreTerm of your own)"
        )
    if call.return_weights:
        reasons.append("no weights: they would be the whole sequence's (Tq, Tk) matrix")
    if isinstance(call.score_term, RelativePositionTerm) and call.score_term.legacy:
        reasons += term_reasons(call.score_term, call.geometry, 0)
    reasons += length_reasons(call.q_len, call.kv_len, layout)
    reasons += split_mask(call.mask, call.kv_len)[2]
    return reasons


def _facts(
    q: Tensor, k: Tensor, v: Tensor, term_inputs: tuple[Tensor, ...], dropout_p: float
) -> tuple[bool, float, float, float, int]:
    """What this rank knows that the others need: whether its q, k, v (and the term's inputs)
    are finite, their largest norms, and a dropout seed drawn as one process would draw it."""
    ok = finite(q, k, v, *term_inputs)
    norms = [0.0, 0.0, 0.0]
    if ok and q.numel() and k.numel() and v.numel():
        norms = sizes(q, k, v, work_dtype(q.dtype)).tolist()
    seed = draw_seed() if dropout_p else 0
    return ok, norms[0], norms[1], norms[2], seed


def _settings(
    call: AttentionCall,
    world: int,
    facts: list[tuple[bool, float, float, float, int]],
    rank: int,
    blocks: tuple[int | None, int | None],
    fused_rows: int | None,
    native: bool,
) -> RectSettings:
    """The kernel's choice for the call's pairs, from every rank's facts alike."""
    return rect_settings(
        call,
        whole_geometry(call, world),
        finite=all(f[0] for f in facts),
        norms=(facts[rank][1], max(f[2] for f in facts), max(f[3] for f in facts)),
        seed=facts[0][4],
        blocks=blocks,
        fused_rows=fused_rows,
        native=native,
        off="the eager kernel (RingBackend(native=False))",
    )


def _ring(
    call: AttentionCall,
    inputs: CallInputs,
    *,
    layout: str | Layout,
    group: ProcessGroup | None,
    blocks: tuple[int | None, int | None],
    fused_rows: int | None,
    native: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """The ring backend's work, on a call this rank has validated (its mask the whole
    sequence's, its dense key masks this rank's shard)."""
    require_group(group, "ring_attention")
    q, k, v = inputs.q, inputs.k, inputs.v
    world = dist.get_world_size(group)
    structure, travel, reasons = split_mask(call.mask, call.kv_len)
    term = call.score_term
    term_inputs = () if term is None else tuple(term.inputs())
    description = describe(call, structure, travel, inputs.sinks)
    try:
        lay = layout_of(layout, world)
        description["layout"] = lay.chunks
        reasons += ring_check(call, lay)
    except ValueError as err:
        reasons.append(str(err))
    facts = _facts(q, k, v, term_inputs, call.dropout_p)
    everyone = agree(
        group,
        "ring_attention",
        "; ".join(reasons) or None,
        description,
        shape_fields=("q shape", "k shape", "v shape", "key mask shape"),
        facts=facts,
    )
    if reasons:
        raise ValueError("ring_attention: " + "; ".join(reasons))
    peers = Peers(group)
    s = _settings(call, world, everyone, peers.rank, blocks, fused_rows, native)  # type: ignore[arg-type]
    note_kernel(s.kernel)
    run = _Run(
        s=s,
        peers=peers,
        shards=ShardPlan(structure, s.geo, lay),
        layout=lay,
        structure=structure,
        travel=travel,
        q_len=call.q_len,
        kv_len=call.kv_len,
        n_term=len(term_inputs),
        record=current(),
    )
    out, lse = _apply(run, q, k, v, inputs.sinks, *term_inputs, *inputs.captured)
    return (out, lse) if call.return_lse else out


class RingBackend(Backend):
    """Ring attention as an :func:`attnkit.attention` backend: q, k, v and a dense key mask are
    this rank's shards of a sequence laid out as ``layout`` across ``group``; structured masks
    and score terms describe the whole sequence. Never picked by ``auto``.

    ``block_q`` and ``block_k`` are the kernel's block sizes (default: the native kernel's, or
    the eager kernel's where it runs); ``fused_rows`` when fully visible work goes to torch's fused
    CPU kernel in the eager kernel, as in :class:`attnkit.backends.Chunked`; ``native=False``
    runs the eager kernel on every pair.

    Through :func:`attnkit.attention` a call's mask is checked against the shard's shapes, so
    masks that carry the whole sequence's lengths (``documents``, ``key_padding``) go through
    :func:`ring_attention`, which checks them against the whole sequence.
    """

    accepts_score_mod = True

    def __init__(
        self,
        *,
        layout: str | Layout = "contiguous",
        group: ProcessGroup | None = None,
        name: str = "ring",
        block_q: int | None = None,
        block_k: int | None = None,
        fused_rows: int | None = FUSED_ROWS,
        native: bool = True,
    ) -> None:
        if not isinstance(layout, Layout) and (
            not isinstance(layout, str) or layout not in LAYOUTS
        ):
            raise ValueError(
                f"layout must be one of {', '.join(map(repr, LAYOUTS))} or a Layout, got {layout!r}"
            )
        if not isinstance(native, bool):
            raise TypeError(f"native must be a bool, got {native!r}")
        blocks = (
            None if block_q is None else check_int("block_q", block_q),
            None if block_k is None else check_int("block_k", block_k),
        )
        fused = None if fused_rows is None else check_int("fused_rows", fused_rows)
        super().__init__(name, auto=False)
        self.layout, self.group, self.native = layout, group, native
        self._blocks, self._fused_rows = blocks, fused

    def check(self, call: AttentionCall) -> list[str]:
        return ring_check(call, self.layout)

    def notes(self, call: AttentionCall) -> list[str]:
        """The shard plan (which ranks' queries meet which ranks' keys, what each sends), when a
        process group tells the world size; nothing on ``meta`` tensors."""
        if call.device.type == "meta" or not (dist.is_available() and dist.is_initialized()):
            return []
        world = dist.get_world_size(self.group)
        structure, _, reasons = split_mask(call.mask, call.kv_len)
        if reasons:
            return []
        plan = ShardPlan(structure, whole_geometry(call, world), layout_of(self.layout, world))
        return [f"shard plan: {line}" for line in plan.describe().splitlines()]

    def run(self, call: AttentionCall, inputs: CallInputs) -> Tensor | tuple[Tensor, Tensor]:
        return _ring(
            call,
            inputs,
            layout=self.layout,
            group=self.group,
            blocks=self._blocks,
            fused_rows=self._fused_rows,
            native=self.native,
        )

    def __repr__(self) -> str:
        layout = self.layout if isinstance(self.layout, str) else self.layout.chunks
        return f"RingBackend(layout={layout!r})"


@shape_checked
def ring_attention(
    q: Float[Tensor, "*batch H Tq Dk"],
    k: Float[Tensor, "*batch Hkv Tk Dk"],
    v: Float[Tensor, "*batch Hkv Tk Dv"],
    *,
    mask: Bool[Tensor, "*#mb #Tk"] | Mask | None = None,
    bias: ScoreTerm | None = None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    sinks: Float[Tensor, " H"] | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    layout: str | Layout = "contiguous",
    group: ProcessGroup | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> Float[Tensor, "*batch H Tq Dv"] | tuple[Float[Tensor, "*batch H Tq Dv"], Tensor]:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Every rank calls it with its own shard; the output is this rank's shard of what
    :func:`attnkit.attention` gives on the whole sequence with the same arguments, and so are the
    gradients. The arguments are :func:`attnkit.attention`'s, under the same names:

    Args:
        q: this rank's queries ``(..., H, Tq, Dk)``; ``Tq = T / W`` for ``W`` ranks.
        k: this rank's keys ``(..., Hkv, Tk, Dk)`` (grouped-query attention when ``Hkv < H``).
        v: this rank's values ``(..., Hkv, Tk, Dv)``.
        mask: True = may attend. Structured masks describe the *whole* sequence and every rank
            evaluates them at its shard's positions in it: :func:`~attnkit.masks.causal` (either
            alignment), :func:`~attnkit.masks.sliding_window` (left and right reach),
            :func:`~attnkit.masks.documents` with lengths over all ``T`` tokens,
            :func:`~attnkit.masks.key_padding` with the whole sequence's lengths,
            :func:`~attnkit.masks.from_fn` at global positions, combined with ``&`` and ``|``. A
            bool tensor is this rank's shard of a key mask, ``(..., 1, Tk)`` (the shard of
            :func:`attnkit.masks.padding_mask`); it travels with its keys, and may be combined
            with structured masks. A query with no key it may attend gets output 0, never NaN.
        bias: a score term evaluated at the whole sequence's positions:
            :class:`~attnkit.scores.DistanceBias` (ALiBi: :func:`attnkit.alibi_term`) with a table
            of the whole sequence's distances, Transformer-XL's
            :class:`~attnkit.scores.RelativePositionTerm` with ``qv`` this rank's rows ``(B, H,
            Tq, Dh)`` (sharded like q) and ``enc`` the whole table of encodings on every rank
            (replicated; ``max_distance`` defaults to the whole sequence's ``T - 1``), or a
            :class:`~attnkit.scores.ScoreTerm` of your own, whose inputs are the same on every
            rank. A dense bias tensor is refused.
        causal: ``causal()`` of the whole sequence.
        scale, softcap, sinks: as in :func:`attnkit.attention`.
        score_mod: as in :func:`attnkit.attention`, called with the whole sequence's indices.
        dropout_p: as in :func:`attnkit.attention`: each pair's decision is drawn from its
            position in the whole call, with a seed drawn on every rank and taken from the first,
            so it equals the call in one process after the same ``torch.manual_seed``.
        return_lse: also return this rank's natural-log log-sum-exp ``(..., H, Tq)``.
        layout: which positions each rank holds: ``"contiguous"`` (rank ``r`` holds the ``r``-th
            of ``W`` equal slices, ``x.chunk(W, dim)[r]``), ``"zigzag"`` (chunks ``r`` and
            ``2W-1-r`` of ``2W``, from :func:`attnkit.distributed.shard_zigzag`, which gives every
            rank the same causal work), or a :class:`~attnkit.distributed.Layout`. q, k, v and a
            dense key mask share it; the output follows it.
        group: the process group; default the whole world.
        block_q, block_k: the kernel's block sizes.

    Returns:
        This rank's output ``(..., H, Tq, Dv)`` in q's dtype; with ``return_lse``, also its
        log-sum-exp in the work dtype.

    Every rank of the group must make the same calls in the same order, forward and backward.
    Before any keys travel, the ranks compare their arguments (one small all-gather), so a rank
    with bad arguments, or shapes, dtypes, masks or flags that differ between ranks, raise on
    every rank instead of leaving the others waiting. Ranks send each other only the keys whose
    queries meet (see :class:`~attnkit.distributed.ShardPlan`); the bytes a rank sent are in its
    :func:`attnkit.record_dispatch` record (``Dispatch.sent``). Gradients of inputs every rank
    holds whole (encodings, a distance table, sinks) are this rank's share: their sum over the
    ranks is the whole call's.

    Raises:
        RuntimeError: no initialised process group.
        TypeError, ValueError: bad arguments on any rank, or arguments that differ between ranks.

    Shape legend: ``...`` batch dims, ``H`` query heads, ``Hkv`` key/value heads, ``Tq``/``Tk``
    this rank's query/key count, ``Dk`` query/key size, ``Dv`` value size, ``Dh`` the position
    term's size.
    """
    from ..attention import dispatch, under_autocast

    require_group(group, "ring_attention")
    # Under torch.autocast, as attention(): q, k, v and sinks in the autocast dtype, the call
    # itself run with autocast off.
    args, autocast, _ = under_autocast((q, k, v, sinks))
    q, k, v, sinks = args  # type: ignore[assignment]
    world = dist.get_world_size(group)
    try:
        backend = RingBackend(layout=layout, group=group, block_q=block_q, block_k=block_k)
        call = validated(
            q, k, v, mask=mask, bias=bias, causal=causal, scale=scale, softcap=softcap,
            sinks=sinks, dropout_p=dropout_p, return_lse=return_lse, score_mod=score_mod,
            world=world,
        )  # fmt: skip
        reasons = ring_check(call, layout_of(layout, world))
        if reasons:
            raise ValueError("ring_attention: " + "; ".join(reasons))
        captured: tuple[Tensor, ...] = ()
        if call.score_mod is not None and torch.is_grad_enabled():
            captured = captured_tensors(call.score_mod)
            check_captured(call.score_mod, captured, call.dtype, call.device)
    except (TypeError, ValueError) as error:
        agree(group, "ring_attention", str(error), {})  # the other ranks raise too, then so do we
        raise
    # The call is validated once, here; the dispatcher runs it across the ranks.
    inputs = CallInputs(q, k, v, None, sinks, captured)
    if not autocast:
        return dispatch(call, inputs, backend)  # type: ignore[return-value]
    with torch.autocast(q.device.type, enabled=False):
        return dispatch(call, inputs, backend)  # type: ignore[return-value]
