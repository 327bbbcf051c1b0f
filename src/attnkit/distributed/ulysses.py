"""All-to-all over heads (DeepSpeed-Ulysses, Jacobs et al., 2023), and its hybrid with the ring.

Each of the ``W`` ranks holds a shard of the sequence for every head. One all-to-all gives each
rank the whole sequence for ``H / W`` of the heads (queries, keys, values, a position term's
queries); the rank runs :func:`attnkit.attention` on it, a call in one process that takes any
mask, score term or modifier, and a second all-to-all sends each shard of the output back. Every
rank moves ``(W - 1) / W`` of its q, k, v and output, whatever the mask: with a long reach that
is far less than a ring sends, with a short one (a window, documents within shards) far more.

With more ranks than heads (or heads that do not divide by ``W``), the hybrid splits the ranks
into groups of ``U`` consecutive ranks, ``U`` a divisor of both: the all-to-all runs within each
group (every rank then holds its group's part of the sequence for ``H / U`` heads), and ring
attention runs across the ``W / U`` groups, between the ranks that hold the same heads.

Gradients of what every rank holds whole (encodings, a table of distances, sinks, tensors a
``score_mod`` captures) are each rank's share (its heads'), as in ring attention: their sum over
the ranks is the whole call's.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from .._base.shapes import Bool, Float, shape_checked
from .._call import AttentionCall
from .._record import Dispatch, current
from .._score_mod import ScoreMod, captured_tensors, check_captured
from ..backends.base import Backend, CallInputs
from ..masks import Geometry, Mask
from ..scores import DistanceBias, RelativePositionTerm, ScoreTerm
from ._args import Travel, describe, rebuild, split_mask, validated
from ._comm import agree, nbytes, require_group
from .layout import LAYOUTS, Layout, layout_of, length_reasons

__all__ = [
    "UlyssesBackend",
    "heads_group",
    "ulysses_attention",
    "ulysses_check",
    "whole_world",
]


def heads_group(heads: int, kv_heads: int, world: int) -> int:
    """How many consecutive ranks exchange heads: the largest divisor of ``W`` that divides the
    query heads (``W`` itself for Ulysses alone; 1: no head to split, the ring alone)."""
    del kv_heads  # key/value heads that do not divide are repeated to the query heads
    return max(u for u in range(1, world + 1) if world % u == 0 and heads % u == 0)


# --------------------------------------------------------------------------------------------------
# The exchange: sequence shards of every head <-> the whole part of the sequence of some heads


@dataclass(eq=False)
class _Exchange:
    """One all-to-all group: ``group`` of ``size`` ranks (this one is ``rank``), and ``order``,
    the layout that puts the gathered shards in sequence order (None: the members' order)."""

    group: ProcessGroup | None
    size: int
    rank: int
    order: Layout | None
    sent: dict[str, int] = field(default_factory=dict)  # bytes sent, by pass
    record: Dispatch | None = None

    def _count(self, send: Tensor, backward: bool) -> None:
        self.add(nbytes([send]) * (self.size - 1) // self.size, backward)  # its own part stays

    def add(self, moved: int, backward: bool) -> None:
        key = "backward" if backward else "forward"
        self.sent[key] = self.sent.get(key, 0) + moved
        if self.record is not None:
            self.record.sent[key] = self.record.sent.get(key, 0) + moved

    def _all_to_all(self, send: Tensor, backward: bool) -> Tensor:
        self._count(send, backward)
        recv = torch.empty_like(send)
        if self.size == 1:
            recv.copy_(send)
        else:
            dist.all_to_all_single(recv, send, group=self.group)
        return recv

    def to_heads(self, x: Tensor, backward: bool = False) -> Tensor:
        """``(N, H, t, D)`` (this rank's shard, every head) -> ``(N, H / size, size * t, D)``
        (the group's part of the sequence, this rank's heads)."""
        n, h, t, d = x.shape
        u = self.size
        send = x.reshape(n, u, h // u, t, d).transpose(0, 1).contiguous()
        shards = list(self._all_to_all(send, backward).unbind(0))  # each member's shard
        if self.order is not None:
            return self.order.unshard(shards)
        return torch.cat(shards, dim=-2)

    def to_sequence(self, y: Tensor, backward: bool = False) -> Tensor:
        """The inverse of :meth:`to_heads`."""
        n, hl, length, d = y.shape
        u = self.size
        if self.order is not None:
            pieces = [self.order.shard(y, m) for m in range(u)]
        else:
            pieces = list(y.chunk(u, dim=-2))
        got = self._all_to_all(torch.stack(pieces), backward)  # (U, N, Hl, t, D)
        return got.transpose(0, 1).reshape(n, hl * u, length // u, d)


class _ToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, ex: _Exchange) -> Tensor:
        ctx.ex = ex  # type: ignore[attr-defined]
        return ex.to_heads(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.ex.to_sequence(grad.contiguous(), backward=True), None  # type: ignore[attr-defined]


class _ToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, y: Tensor, ex: _Exchange) -> Tensor:
        ctx.ex = ex  # type: ignore[attr-defined]
        return ex.to_sequence(y)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.ex.to_heads(grad.contiguous(), backward=True), None  # type: ignore[attr-defined]


_to_heads: Callable[[Tensor, _Exchange], Tensor] = _ToHeads.apply
_to_sequence: Callable[[Tensor, _Exchange], Tensor] = _ToSequence.apply


def _gather_keys(ex: _Exchange, t: Tensor) -> Tensor:
    """A key mask's shards ``(X, H|1, 1, t)`` of the group's ranks, as the group's part of the
    sequence (no gradient)."""
    if ex.size == 1:
        return t
    shards = [torch.empty_like(t) for _ in range(ex.size)]
    ex.add(nbytes([t]) * (ex.size - 1), backward=False)
    dist.all_gather(shards, t.contiguous(), group=ex.group)
    if ex.order is not None:
        return ex.order.unshard(shards, dim=-1)
    return torch.cat(shards, dim=-1)


# --------------------------------------------------------------------------------------------------
# A rank's heads of what the call adds to the scores


class _Heads(ScoreTerm):
    """A term of all ``H`` heads, read for heads ``h0 : h0 + count`` (a term of one's own: its
    tiles are computed for every head, then cut)."""

    def __init__(self, term: ScoreTerm, h0: int, count: int, heads: int) -> None:
        self.term, self.h0, self.count, self.heads = term, h0, count, heads

    def inputs(self) -> tuple[Tensor, ...]:
        return self.term.inputs()

    def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
        t = self.term.tile(inputs, q_pos, k_pos)
        if t.ndim >= 3 and t.size(-3) == self.heads:
            return t.narrow(-3, self.h0, self.count)
        return t

    def describe(self) -> str:
        return f"{self.term.describe()}, heads {self.h0}..{self.h0 + self.count - 1}"


def _term_heads(
    term: ScoreTerm | None, ex: _Exchange, h0: int, count: int, heads: int
) -> ScoreTerm | None:
    """The call's term for this rank's heads, its position queries gathered like q."""
    if term is None:
        return None
    if isinstance(term, RelativePositionTerm):
        qv = _to_heads(term.qv, ex)
        enc = term.enc.narrow(0, h0, count) if term.enc.size(0) == heads else term.enc
        return RelativePositionTerm(
            qv, enc, term.scale, max_distance=term.max_distance, whole_width=term.whole_width
        )
    if isinstance(term, DistanceBias):
        table = term.table
        if table.ndim >= 2 and table.size(-2) == heads:
            table = table.narrow(-2, h0, count)
        return DistanceBias(table, term.first)
    return _Heads(term, h0, count, heads)


class _MaskHeads(Mask):
    """A mask of all ``H`` heads (one of a function of the head), asked for heads ``h0 : h0 +
    count``: its tiles are the call's, cut to those heads; its block states those of every head
    (sound for any of them)."""

    def __init__(self, mask: Mask, h0: int, count: int, heads: int) -> None:
        self.mask, self.h0, self.count, self.heads = mask, h0, count, heads

    def _geo(self, geo: Geometry) -> Geometry:
        return replace(geo, heads=self.heads)

    def describe(self) -> str:
        return f"{self.mask.describe()} at heads {self.h0}..{self.h0 + self.count - 1}"

    def check(self, geo: Geometry, name: str) -> None:
        self.mask.check(self._geo(geo), name)

    def tile(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        t = self.mask.tile(self._geo(geo), qs, qe, ks, ke)
        return t.narrow(1, self.h0, self.count) if t.size(1) == self.heads else t

    def block_states(
        self, geo: Geometry, q: tuple[int, int, int], k: tuple[int, int, int]
    ) -> Tensor:
        return self.mask.block_states(self._geo(geo), q, k)

    def visible_rows(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> tuple[int, int]:
        return self.mask.visible_rows(self._geo(geo), qs, qe, ks, ke)

    def distances(self, geo: Geometry) -> tuple[float, float]:
        return self.mask.distances(self._geo(geo))

    @property
    def keys_only(self) -> bool:
        return self.mask.keys_only

    @property
    def positional(self) -> bool:
        return self.mask.positional


def _mask_heads(mask: Mask, h0: int, count: int, heads: int) -> Mask | Tensor:
    """A leaf of the call's mask for this rank's heads: a dense tensor cut to them, a band,
    packed documents or key padding as they are (the same for every head), anything else asked
    for every head and cut."""
    t = mask.tensor
    if t is not None:
        return t.narrow(-3, h0, count) if t.ndim >= 3 and t.size(-3) == heads else t
    if mask.band is not None or mask.document_starts() is not None:
        return mask
    if mask.keys_only and not mask.positional:  # key padding: per batch row and key
        return mask
    return _MaskHeads(mask, h0, count, heads)


class _ModHeads:
    """A score_mod of the call, called with this rank's heads: head ``h`` is the call's
    ``h + h0``. The tensors it captures are this object's attributes, where
    :func:`attnkit.attention` finds them (their gradients reach them)."""

    def __init__(self, score_mod: ScoreMod, h0: int) -> None:
        self.score_mod, self.h0 = score_mod, h0
        self.__name__ = getattr(score_mod, "__name__", type(score_mod).__name__)
        for i, t in enumerate(captured_tensors(score_mod)):
            setattr(self, f"captured_{i}", t)

    def __call__(self, s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return self.score_mod(s, b, h + self.h0, i, j)


def _mod_heads(score_mod: ScoreMod | None, h0: int) -> ScoreMod | None:
    if score_mod is None or not h0:
        return score_mod
    return _ModHeads(score_mod, h0)


# --------------------------------------------------------------------------------------------------
# The call


def ulysses_check(
    call: AttentionCall, world: int, layout: str | Layout = "contiguous"
) -> list[str]:
    """Why the all-to-all (with the ring across groups where heads run short) cannot serve a
    call of this rank's shard laid out as ``layout`` (empty when it can)."""
    reasons = length_reasons(call.q_len, call.kv_len, layout)
    if call.bias_shape is not None:
        reasons.append(
            f"a dense bias {call.bias_shape} would need the whole sequence's rows of scores; give "
            "it as a score term evaluated at the whole sequence's positions"
        )
    if call.return_weights:
        reasons.append("no weights: they would be the whole sequence's (Tq, Tk) matrix")
    if call.dropout_p:
        reasons.append(
            "dropout: a rank computing some heads would number the pairs it drops by its own "
            "heads, not the call's; ring_attention draws them at the whole call's positions"
        )
    reasons += split_mask(call.mask, call.kv_len)[2]
    return reasons


_GROUPS: dict[tuple[int, int, int], tuple[ProcessGroup | None, ProcessGroup | None]] = {}
_GROUPS_LOCK = threading.Lock()


def _subgroups(world: int, rank: int, u: int) -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """This rank's all-to-all group (``u`` consecutive ranks) and ring group (the ranks at its
    place in every all-to-all group) of the whole world, made once and kept. Every rank makes
    every group, in one order: groups whose members make them alone can deadlock when they
    overlap."""
    if u == world:
        return None, None
    if u == 1:  # no head to split: the ring alone
        return None, None
    key = (id(dist.group.WORLD), u, rank)
    with _GROUPS_LOCK:
        if key in _GROUPS:
            return _GROUPS[key]
    made: dict[tuple[int, ...], ProcessGroup | None] = {}
    for j in range(world // u):
        members = tuple(range(j * u, (j + 1) * u))
        made[members] = dist.new_group(list(members))
    for i in range(u):
        members = tuple(range(i, world, u))
        made[members] = dist.new_group(list(members))
    heads = made[tuple(range(rank - rank % u, rank - rank % u + u))]
    ring = made[tuple(range(rank % u, world, u))]
    with _GROUPS_LOCK:
        _GROUPS[key] = (heads, ring)
    return heads, ring


def whole_world(group: ProcessGroup | None) -> bool:
    return group is None or dist.get_world_size(group) == dist.get_world_size()


def _ulysses(
    call: AttentionCall,
    inputs: CallInputs,
    *,
    layout: str | Layout,
    group: ProcessGroup | None,
    backend: str | Backend,
) -> Tensor | tuple[Tensor, Tensor]:
    """The all-to-all's work (with the ring across groups), on a call this rank validated."""
    from ..attention import attention
    from .ring import ring_attention

    require_group(group, "ulysses_attention")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    structure, travel, reasons = split_mask(call.mask, call.kv_len)
    term = call.score_term
    description = describe(call, structure, travel, inputs.sinks)
    try:
        lay = layout_of(layout, world)
        description["layout"] = lay.chunks
        reasons += ulysses_check(call, world, lay)
    except ValueError as err:
        reasons.append(str(err))
    u = heads_group(call.num_heads, call.num_kv_heads, world)
    if 1 < u < world and not whole_world(group):
        reasons.append(
            f"the {call.num_heads} heads do not divide among the group's {world} ranks, and the "
            "hybrid (all-to-all within groups of ranks, the ring across them) runs on the whole "
            "world's group only: pass group=None, or use ring_attention"
        )
    agree(
        group,
        "ulysses_attention",
        "; ".join(reasons) or None,
        description,
        shape_fields=("q shape", "k shape", "v shape", "key mask shape"),
    )
    if reasons:
        raise ValueError("ulysses_attention: " + "; ".join(reasons))
    h, hkv = call.num_heads, call.num_kv_heads
    heads_pg, ring_pg = _subgroups(world, rank, u)
    if u == world:
        heads_pg = group
    if u == 1:
        ring_pg = group
    ex = _Exchange(heads_pg, u, rank % u, lay if u == world else None, record=current())
    count, h0 = h // u, (rank % u) * (h // u)
    q, k, v = inputs.q, inputs.k, inputs.v
    batch = q.shape[:-3]
    n = math.prod(batch)
    if hkv % u:  # key/value heads that do not divide: each query head gets its own
        k = k.repeat_interleave(h // hkv, dim=-3)
        v = v.repeat_interleave(h // hkv, dim=-3)
    qh, kh, vh = (_to_heads(t.reshape(n, *t.shape[-3:]), ex) for t in (q, k, v))
    keys = [_gather_keys(ex, t) for t in travel]
    keys = [t.narrow(1, h0, count) if t.size(1) == h else t for t in keys]

    def bind(m: Mask) -> Mask | Tensor:
        return keys[m.index] if isinstance(m, Travel) else _mask_heads(m, h0, count, h)

    mask = None if structure is None else rebuild(structure, bind)  # type: ignore[arg-type]
    bias = _term_heads(term, ex, h0, count, h)
    mod = _mod_heads(call.score_mod, h0)
    sinks = None if inputs.sinks is None else inputs.sinks.narrow(0, h0, count)
    if u == world:
        got = attention(
            qh, kh, vh, mask=mask, bias=bias, scale=call.scale, softcap=call.softcap,
            score_mod=mod, sinks=sinks, return_lse=call.return_lse, backend=backend,
        )  # fmt: skip
    else:
        # The ring across the groups: ring rank j holds group j's chunks, in its members' order.
        ring_layout = Layout(
            tuple(
                tuple(c for m in range(j * u, (j + 1) * u) for c in lay.chunks[m])
                for j in range(world // u)
            )
        )
        got = ring_attention(
            qh, kh, vh, mask=mask, bias=bias, scale=call.scale, softcap=call.softcap,
            score_mod=mod, sinks=sinks, return_lse=call.return_lse, layout=ring_layout,
            group=ring_pg,
        )  # fmt: skip
    out, lse = (got[0], got[1]) if isinstance(got, tuple) else (got, None)
    out = _to_sequence(out, ex).reshape(*batch, h, call.q_len, call.v_dim)  # 0 rows or batch
    if lse is None:
        return out
    return out, _to_sequence(lse.unsqueeze(-1), ex).reshape(*batch, h, call.q_len)


class UlyssesBackend(Backend):
    """The all-to-all over heads as an :func:`attnkit.attention` backend (see
    :func:`ulysses_attention`); never picked by ``auto``. ``backend``: the backend each rank's
    call in one process runs on (default ``"auto"``)."""

    accepts_score_mod = True

    def __init__(
        self,
        *,
        layout: str | Layout = "contiguous",
        group: ProcessGroup | None = None,
        name: str = "ulysses",
        backend: str | Backend = "auto",
    ) -> None:
        if not isinstance(layout, Layout) and (
            not isinstance(layout, str) or layout not in LAYOUTS
        ):
            raise ValueError(
                f"layout must be one of {', '.join(map(repr, LAYOUTS))} or a Layout, got {layout!r}"
            )
        super().__init__(name, auto=False)
        self.layout, self.group, self.backend = layout, group, backend

    def check(self, call: AttentionCall) -> list[str]:
        return ulysses_check(call, 1, self.layout)

    def run(self, call: AttentionCall, inputs: CallInputs) -> Tensor | tuple[Tensor, Tensor]:
        return _ulysses(call, inputs, layout=self.layout, group=self.group, backend=self.backend)

    def __repr__(self) -> str:
        layout = self.layout if isinstance(self.layout, str) else self.layout.chunks
        return f"UlyssesBackend(layout={layout!r})"


@shape_checked
def ulysses_attention(
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
    return_lse: bool = False,
    layout: str | Layout = "contiguous",
    group: ProcessGroup | None = None,
    backend: str | Backend = "auto",
) -> Float[Tensor, "*batch H Tq Dv"] | tuple[Float[Tensor, "*batch H Tq Dv"], Tensor]:
    """Exact attention over a sequence sharded across the ranks of ``group``, by an all-to-all
    over heads (DeepSpeed-Ulysses); with heads that do not divide by the ranks, an all-to-all
    within groups of ranks and the ring across them (see the module docstring).

    It takes :func:`~attnkit.distributed.ring_attention`'s arguments, with the same meaning (q,
    k, v, a dense key mask and a position term's ``qv`` are this rank's shards; masks and score
    terms describe the whole sequence), except ``dropout_p``, which ring_attention takes, and
    ``backend``, the backend of each rank's call in one process. The output (and ``return_lse``'s
    log-sum-exp) is this rank's shard of :func:`attnkit.attention` on the whole sequence, and so
    are the gradients. Grouped-query keys and values whose heads do not divide are repeated to
    the query heads before they move.

    Every rank of the group must make the same calls in the same order; before anything moves,
    the ranks compare their arguments (one small all-gather) and raise together. The bytes a rank
    sent are in its :func:`attnkit.record_dispatch` record (``Dispatch.sent``).
    """
    from ..attention import dispatch, under_autocast

    require_group(group, "ulysses_attention")
    # Under torch.autocast, as attention(): q, k, v and sinks in the autocast dtype, the call
    # itself run with autocast off.
    args, autocast, _ = under_autocast((q, k, v, sinks))
    q, k, v, sinks = args  # type: ignore[assignment]
    world = dist.get_world_size(group)
    try:
        ulysses = UlyssesBackend(layout=layout, group=group, backend=backend)
        call = validated(
            q, k, v, mask=mask, bias=bias, causal=causal, scale=scale, softcap=softcap,
            sinks=sinks, dropout_p=0.0, return_lse=return_lse, score_mod=score_mod, world=world,
        )  # fmt: skip
        layout_of(layout, world)
        reasons = ulysses_check(call, world, layout)
        if reasons:
            raise ValueError("ulysses_attention: " + "; ".join(reasons))
        captured: tuple[Tensor, ...] = ()
        if call.score_mod is not None and torch.is_grad_enabled():
            captured = captured_tensors(call.score_mod)
            check_captured(call.score_mod, captured, call.dtype, call.device)
    except (TypeError, ValueError) as error:
        agree(group, "ulysses_attention", str(error), {})
        raise
    inputs = CallInputs(q, k, v, None, sinks, captured)
    if not autocast:
        return dispatch(call, inputs, ulysses)  # type: ignore[return-value]
    with torch.autocast(q.device.type, enabled=False):
        return dispatch(call, inputs, ulysses)  # type: ignore[return-value]
