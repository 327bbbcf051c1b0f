"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Each of the ``W`` ranks holds an equal shard of q, k and v. The k/v shards travel around the ring
(rank ``r`` sends to ``r + 1`` and receives from ``r - 1``) while each rank attends its queries to
the block it holds, so after ``W`` steps every query has met every key and no rank has held more
than two k/v shards at once (Liu et al., 2023, "Ring Attention with Blockwise Transformers"). Each
step runs attnkit's kernel (:mod:`attnkit._kernel`) tile by tile (a few kernel blocks of queries by
a few of keys), with the call's mask evaluated at the tile's global positions; each tile's output
and log-sum-exp are merged into a running pair in float32, the online softmax one level up. Causal
tiles above the diagonal are never computed.

The backward goes around the ring again. Given the *final* output and log-sum-exp, the chunked
kernel's backward yields each block's exact share of the gradients: the query gradients stay home,
and the key/value gradients travel with their block, collecting every rank's share, then take one
last hop back to the block's owner.

In both passes the next k/v block is in flight while the current one is computed; the backward's
gradient sums move between steps (they are ready only once a step is done).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from .._blocks import block_reduce, states_from
from .._call import AttentionCall, check_attention_args
from .._checks import check_int, shape_str
from .._kernel import (
    FUSED_ROWS,
    Plan,
    Problem,
    backward,
    default_blocks,
    delta_of,
    finish,
    folds,
    forward,
    make_plan,
    merge,
    restrict,
    sink_grad,
    sizes,
    small_scores,
)
from .._typing import Bool, Float, shape_checked
from ..backends.base import Backend, CallInputs
from ..masks import Geometry, Mask
from ._comm import Ring, agree, require_group
from .layout import LAYOUTS, segments

__all__ = ["ring_attention"]


# The ring computes each step in tiles of kernel blocks, so that a tile's temporaries are O(block),
# not O(T / W): its partial output and query gradients (TILE_BLOCKS_Q query blocks), and in the
# backward its share of the key/value gradients (TILE_BLOCKS_K_BACKWARD key blocks). Forward tiles
# are longer in keys, which costs no memory there: the kernel takes its slower, rescaling path on
# the first key block of each tile.
TILE_BLOCKS_Q = 4
TILE_BLOCKS_K = 16
TILE_BLOCKS_K_BACKWARD = 4


@dataclass(frozen=True)
class _Plan:
    """One call's settings, shared by the forward and backward rings."""

    ring: Ring
    causal: bool
    layout: str
    scale: float
    softcap: float | None
    structure: Mask | None  # the call's mask without its traveling key mask, global positions
    geo: Geometry  # the whole sequence's call
    q_len: int  # local lengths
    kv_len: int
    block_q: int
    block_k: int
    tile_q: int
    tile_k: int
    tile_k_backward: int
    careful: bool  # NaN/inf in some rank's q, k or v: the kernel's careful mode everywhere
    fused_rows: int | None  # see attnkit.backends.Chunked
    zero_offset: bool | None  # see attnkit._kernel.Problem; None: each piece decides


@dataclass(frozen=True)
class _Piece:
    """Local queries ``[qs, qe)`` against keys ``[ks, ke)`` of the block held, which sit at the
    global positions ``gq...`` and ``gk...`` (a piece never spans two runs of a zigzag shard)."""

    qs: int
    qe: int
    ks: int
    ke: int
    gq: int
    gk: int


def _pieces(plan: _Plan, src: int, tile_k: int) -> list[_Piece]:
    """What this rank computes against the block that rank ``src`` owns, in tiles; tiles whose
    every key comes after every query are left out under a causal mask."""
    world, pieces = plan.ring.world_size, []
    for lq, gq, nq in segments(plan.layout, plan.ring.rank, world, plan.q_len):
        for lk, gk, nk in segments(plan.layout, src, world, plan.kv_len):
            for qs in range(lq, lq + nq, plan.tile_q):
                qe = min(qs + plan.tile_q, lq + nq)
                for ks in range(lk, lk + nk, tile_k):
                    ke = min(ks + tile_k, lk + nk)
                    g_q, g_k = gq + qs - lq, gk + ks - lk
                    if plan.causal and g_k > g_q + (qe - qs) - 1:
                        continue  # above the diagonal: not computed at all
                    pieces.append(_Piece(qs, qe, ks, ke, g_q, g_k))
    return pieces


class _ShardKeys(Mask):
    """The key mask of the block a rank holds (it travels with its keys), asked at global key
    positions: local key ``j`` sits at global position ``j + start``."""

    def __init__(self, t: Tensor, start: int) -> None:
        self.t, self.start = t, start

    def describe(self) -> str:
        return f"key mask shard {shape_str(self.t.shape)}"

    def _keys(self, ks: int, ke: int) -> Tensor:
        """``(B|1, H|1, 1, keys|1)`` for global keys ``ks:ke``."""
        t = self.t.reshape((1,) * max(0, 4 - self.t.ndim) + tuple(self.t.shape))
        t = t.reshape(-1, *t.shape[-3:])
        return t[..., ks - self.start : ke - self.start] if t.size(-1) != 1 else t

    def tile(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        return self._keys(ks, ke)

    def block_states(
        self, geo: Geometry, q: tuple[int, int, int], k: tuple[int, int, int]
    ) -> Tensor:
        k0, k1, bk = k
        keys = self._keys(k0, k1).flatten(0, 2)  # (B*H | 1, keys | 1)
        anys, _ = block_reduce(keys.any(0, keepdim=True), k0, k1, bk, 1)
        _, alls = block_reduce(keys.all(0, keepdim=True), k0, k1, bk, 1)
        return states_from(~anys[0], alls[0]).expand(len(range(*q)), -1)

    @property
    def keys_only(self) -> bool:
        return True


def _problem(
    plan: _Plan,
    piece: _Piece,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    blocks: Plan | None = None,
) -> Problem:
    """The kernel's problem for one piece, its mask asked at the piece's global positions
    (unless its block plan is given)."""
    visible = plan.structure
    if mask is not None:
        shard = _ShardKeys(mask, piece.gk - piece.ks)
        visible = shard if visible is None else visible & shard
    hkv = k.size(-3)
    n = math.prod(q.shape[:-3])
    rows, keys = piece.qe - piece.qs, piece.ke - piece.ks
    qp = q[..., piece.qs : piece.qe, :]
    kp, vp = k[..., piece.ks : piece.ke, :], v[..., piece.ks : piece.ke, :]
    return Problem(
        q5=qp.reshape(n, hkv, q.size(-3) // hkv, rows, q.size(-1)),
        k3=kp.reshape(n * hkv, keys, k.size(-1)),
        v3=vp.reshape(n * hkv, keys, v.size(-1)),
        scale=plan.scale,
        plan=blocks
        if blocks is not None
        else make_plan(
            visible,
            plan.geo,
            q_start=piece.gq,
            q_len=rows,
            k_start=piece.gk,
            kv_len=keys,
            block_q=plan.block_q,
            block_k=plan.block_k,
        ),
        geo=plan.geo,
        mask=visible,
        softcap=plan.softcap,
        q_start=piece.gq,
        k_start=piece.gk,
        careful=plan.careful,
        fused_rows=plan.fused_rows,
        zero_offset=plan.zero_offset,
    )


def _kernel_shape(q: Tensor, v: Tensor) -> tuple[int, int, int]:
    """(B, Hkv, G): batch dims flattened, and query heads per key/value head."""
    hkv = v.size(-3)
    return math.prod(q.shape[:-3]), hkv, q.size(-3) // hkv


def _unpack(block: list[Tensor]) -> tuple[Tensor, Tensor, Tensor | None]:
    return block[0], block[1], block[2] if len(block) == 3 else None


# The block plans of a call's forward pieces, by the rank whose block they met and their first
# query: the backward takes its pieces' plans from them instead of asking the mask again.
_Plans = dict[tuple[int, int], list[tuple[_Piece, Plan]]]


def _ring_forward(
    plan: _Plan, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor, _Plans]:
    """Output ``(B, Hkv, G, Tq, Dv)`` and log-sum-exp ``(B, Hkv, G, Tq)`` in the work dtype
    (``-inf`` for queries that see no key anywhere, whose output is 0), and the pieces' plans."""
    n, hkv, g = _kernel_shape(q, v)
    work = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros(n, hkv, g, plan.q_len, v.size(-1), dtype=work)
    lse = q.new_full((n, hkv, g, plan.q_len), float("-inf"), dtype=work)
    ring = plan.ring
    block = [k, v] if mask is None else [k, v, mask]
    plans: _Plans = {}
    for step in range(ring.world_size):
        incoming = ring.exchange(block) if step < ring.world_size - 1 else None
        kb, vb, mb = _unpack(block)
        src = (ring.rank - step) % ring.world_size
        for piece in _pieces(plan, src, plan.tile_k):
            p = _problem(plan, piece, q, kb, vb, mb)
            plans.setdefault((src, piece.qs), []).append((piece, p.plan))
            block_out, block_lse = forward(p)
            rows = slice(piece.qs, piece.qe)
            merge(out[:, :, :, rows], lse[:, :, :, rows], block_out, block_lse)
        if incoming is not None:
            block = incoming.wait()
    return out, lse, plans


def _forward_plan(plans: _Plans, src: int, piece: _Piece) -> Plan | None:
    """A backward piece's block plan, cut from the forward piece that holds its keys (None when
    none does: tiles of the two passes that do not nest)."""
    for f, fplan in plans.get((src, piece.qs), []):
        if f.ks <= piece.ks and piece.ke <= f.ke and f.gk - f.ks == piece.gk - piece.ks:
            return restrict(fplan, piece.ks - f.ks, piece.ke - f.ks)
    return None


def _ring_backward(
    plan: _Plan,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    out: Tensor,
    lse: Tensor,
    delta: Tensor,
    dout: Tensor,
    plans: _Plans,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of the local q, k, v in the kernel layout and the work dtype, the pieces planned
    as the forward's ``plans``."""
    n, hkv, g = _kernel_shape(q, v)
    fold = folds(lse, plan.softcap)  # once for the call, not per piece
    dout5 = dout.reshape(n, hkv, g, plan.q_len, v.size(-1))
    dq = torch.zeros(n, hkv, g, plan.q_len, q.size(-1), dtype=lse.dtype, device=q.device)
    ring = plan.ring
    block = [k, v] if mask is None else [k, v, mask]
    # The key/value gradients of the block held: this rank's own block first, then each block's
    # running sums arrive with it and leave with it.
    dk = torch.zeros(n * hkv, plan.kv_len, k.size(-1), dtype=lse.dtype, device=q.device)
    dv = torch.zeros(n * hkv, plan.kv_len, v.size(-1), dtype=lse.dtype, device=q.device)
    for step in range(ring.world_size):
        incoming = ring.exchange(block) if step < ring.world_size - 1 else None
        kb, vb, mb = _unpack(block)
        src = (ring.rank - step) % ring.world_size
        for piece in _pieces(plan, src, plan.tile_k_backward):
            p = _problem(plan, piece, q, kb, vb, mb, _forward_plan(plans, src, piece))
            rows, keys = slice(piece.qs, piece.qe), slice(piece.ks, piece.ke)
            grads = backward(
                p,
                out[:, :, :, rows],
                lse[:, :, :, rows],
                delta[:, :, :, rows],
                dout5[:, :, :, rows],
                bias_grad=False,
                term_grads=False,
                fold=fold,
            )
            dq[:, :, :, rows] += grads.dq
            dk[:, keys] += grads.dk
            dv[:, keys] += grads.dv
        if incoming is not None:
            block = incoming.wait()
        del kb, vb, mb
        # Pass the sums on and take over those of the block that just arrived (after the last
        # step: this rank's own block, with every rank's share). Waiting here rather than during
        # the next step's compute keeps two fewer k/v-sized buffers alive; the transfer is small
        # next to a step's compute.
        dk, dv = ring.exchange([dk, dv]).wait()
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        plan: _Plan,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        sinks: Tensor | None,
    ) -> Tensor:
        _, hkv, g = _kernel_shape(q, v)
        out5, lse, plans = _ring_forward(plan, q, k, v, mask)
        out5, lse = finish(out5, lse, None if sinks is None else sinks.view(hkv, g))
        out = out5.view(*q.shape[:-1], v.size(-1)).to(q.dtype)
        # O before rounding, for the backward's rowsum(dO * O) (see attnkit._kernel.delta_of).
        ctx.save_for_backward(q, k, v, out5, lse, *(t for t in (mask, sinks) if t is not None))
        ctx.plan = plan  # type: ignore[attr-defined]
        ctx.plans = plans  # type: ignore[attr-defined]
        ctx.has = (mask is not None, sinks is not None)  # type: ignore[attr-defined]
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dout: Tensor
    ) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, *rest = ctx.saved_tensors  # type: ignore[attr-defined]
        has_mask, has_sinks = ctx.has  # type: ignore[attr-defined]
        mask = rest.pop(0) if has_mask else None
        sinks = rest.pop(0) if has_sinks else None
        _, hkv, g = _kernel_shape(q, v)
        delta = delta_of(out, dout.reshape(out.shape))
        plan = ctx.plan  # type: ignore[attr-defined]
        plans = ctx.plans  # type: ignore[attr-defined]
        dq, dk, dv = _ring_backward(plan, q, k, v, mask, out, lse, delta, dout, plans)
        dsinks = None
        if sinks is not None:
            dsinks = sink_grad(lse, delta, sinks.view(hkv, g)).reshape(sinks.shape).to(sinks.dtype)
        return (
            None,
            dq.reshape(q.shape).to(q.dtype),
            dk.view(k.shape).to(k.dtype),
            dv.view(v.shape).to(v.dtype),
            None,
            dsinks,
        )


# Function.apply is untyped in torch; give it its type once.
_apply_ring: Callable[..., Tensor] = _RingAttention.apply


def _structure(mask: Mask | None) -> tuple[Mask | None, Tensor | None, list[str]]:
    """Split a call's mask into what every rank evaluates at global positions (causal, windows,
    functions of the indices) and the dense key mask that travels with its keys; and the reasons
    ring attention cannot take the rest."""
    if mask is None:
        return None, None, []
    parts = mask.parts
    if mask.op == "or":
        return None, None, ["a mask combined with | cannot be split into traveling key masks"]
    structure: Mask | None = None
    travel: Tensor | None = None
    reasons = []
    for part in parts:
        if part.positional:
            structure = part if structure is None else structure & part
        elif part.tensor is not None and part.keys_only and travel is None:
            travel = part.tensor
        elif part.tensor is not None:
            reasons.append(
                "key masks only (..., 1, Tk): a mask that depends on the query cannot travel"
            )
        else:
            reasons.append(
                f"takes causal, sliding_window, from_fn and this rank's shard of a dense key mask; "
                f"give {part!r} as a (..., 1, Tk) bool tensor sharded like the keys"
            )
    return structure, travel, reasons


def ring_check(call: AttentionCall) -> list[str]:
    """Why ring attention cannot serve a call (empty when it can)."""
    reasons = []
    if call.bias_shape is not None or call.score_term is not None:
        reasons.append("no bias: a (Tq, Tk) bias cannot be sharded along with the keys")
    if call.dropout_p:
        reasons.append("no dropout")
    if call.return_weights:
        reasons.append("no weights: they would be the whole sequence's (Tq, Tk) matrix")
    if call.return_lse:
        reasons.append("no log-sum-exp (use the chunked backend per shard and merge_attention)")
    if call.causal and call.q_len != call.kv_len:
        reasons.append(f"causal needs Tq = Tk on each rank, got {call.q_len} and {call.kv_len}")
    reasons += _structure(call.mask)[2]
    return reasons


def _ring(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | None,
    scale: float,
    softcap: float | None,
    sinks: Tensor | None,
    layout: str,
    group: ProcessGroup | None,
    blocks: tuple[int | None, int | None],
    tiles: tuple[int, int, int],
    fused_rows: int | None,
) -> Tensor:
    """The ring backend's work, on arguments ``attention()`` has validated on this rank."""
    require_group(group, "ring_attention")
    structure, travel, reasons = _structure(mask)
    causal = structure is not None and any(
        p.band is not None and p.band[:2] == (-math.inf, 0) for p in structure.parts
    )
    description: dict[str, object] = {
        "q shape": tuple(q.shape),
        "k shape": tuple(k.shape),
        "v shape": tuple(v.shape),
        "dtype": str(q.dtype).removeprefix("torch."),
        "device type": q.device.type,
        "mask": None if structure is None else repr(structure),
        "key mask shape": None if travel is None else tuple(travel.shape),
        "layout": layout,
        "scale": scale,
        "softcap": softcap,
        "sinks": sinks is not None,
    }
    agree(
        group,
        "ring_attention",
        "; ".join(reasons) or None,
        description,
        shape_fields=("q shape", "k shape", "v shape", "key mask shape"),
    )
    if reasons:
        raise ValueError("ring_attention: " + "; ".join(reasons))
    ring = Ring(group)
    h, q_len = q.size(-3), q.size(-2)
    kv_len = k.size(-2)
    groups = h // k.size(-3)
    key_mask = None
    if travel is not None:
        ndim = q.ndim
        key_mask = travel.reshape((1,) * (ndim - travel.ndim) + tuple(travel.shape))
    block_q, block_k = default_blocks(causal, groups, q_len)
    block_q, block_k = blocks[0] or block_q, blocks[1] or block_k
    careful = (
        not bool(torch.stack([torch.isfinite(t).all() for t in (q, k, v) if t.numel()]).all())
        if q.numel() and k.numel()
        else False
    )
    # Whether every piece may take offset 0 (see attnkit._kernel.small_scores) needs the largest
    # key and value of every rank: asked with the careful flag, once for the call.
    work = torch.promote_types(q.dtype, torch.float32)
    largest = [0.0, 0.0, 0.0]
    if q.numel() and k.numel() and v.numel() and not careful:
        largest = sizes(q, k, v, work).tolist()
    flags = torch.tensor([float(careful), *largest[1:]], dtype=torch.float64)
    reduced = torch.distributed.get_backend(group) != "nccl"
    if reduced:
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=group)
    careful_any, k_norm, v_max = flags.tolist()
    # Without the all-reduce, each piece decides from its own tensors.
    zero_offset = None
    if reduced:
        zero_offset = (
            not careful_any
            and softcap is None
            and small_scores(largest[0], k_norm, v_max, scale, kv_len * ring.world_size, work)
        )
    plan = _Plan(
        ring=ring,
        causal=causal,
        layout=layout,
        scale=scale,
        softcap=softcap,
        structure=structure,
        geo=Geometry(
            tuple(q.shape[:-3]), h, q_len * ring.world_size, kv_len * ring.world_size, q.device
        ),
        q_len=q_len,
        kv_len=kv_len,
        block_q=block_q,
        block_k=block_k,
        tile_q=tiles[0] * block_q,
        tile_k=tiles[1] * block_k,
        tile_k_backward=tiles[2] * block_k,
        careful=bool(careful_any),
        fused_rows=fused_rows,
        zero_offset=zero_offset,
    )
    return _apply_ring(plan, q, k, v, key_mask, sinks)


class RingBackend(Backend):
    """Ring attention as an :func:`attnkit.attention` backend: q, k, v and the mask are this
    rank's shards of a sequence laid out as ``layout`` across ``group``. Never picked by
    ``auto``.

    ``block_q`` and ``block_k`` are the kernel's block sizes (default: the chunked backend's);
    ``tile_blocks`` how many blocks of queries, of keys, and of keys in the backward one tile of
    a ring step computes at once (a tile's temporaries are O(tile)); ``fused_rows`` when fully
    visible work goes to torch's fused CPU kernel, as in :class:`attnkit.backends.Chunked`.
    """

    def __init__(
        self,
        *,
        layout: str = "contiguous",
        group: ProcessGroup | None = None,
        name: str = "ring",
        block_q: int | None = None,
        block_k: int | None = None,
        tile_blocks: tuple[int, int, int] = (TILE_BLOCKS_Q, TILE_BLOCKS_K, TILE_BLOCKS_K_BACKWARD),
        fused_rows: int | None = FUSED_ROWS,
    ) -> None:
        if not isinstance(layout, str) or layout not in LAYOUTS:
            raise ValueError(
                f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}"
            )
        blocks = (
            None if block_q is None else check_int("block_q", block_q),
            None if block_k is None else check_int("block_k", block_k),
        )
        if not isinstance(tile_blocks, tuple) or len(tile_blocks) != 3:
            raise TypeError(f"tile_blocks must be a tuple of 3 ints, got {tile_blocks!r}")
        tiles = (
            check_int("tile_blocks[0]", tile_blocks[0]),
            check_int("tile_blocks[1]", tile_blocks[1]),
            check_int("tile_blocks[2]", tile_blocks[2]),
        )
        fused = None if fused_rows is None else check_int("fused_rows", fused_rows)
        super().__init__(name, auto=False)
        self.layout, self.group = layout, group
        self._blocks, self._tiles, self._fused_rows = blocks, tiles, fused

    def check(self, call: AttentionCall) -> list[str]:
        reasons = ring_check(call)
        if self.layout == "zigzag" and (call.q_len % 2 or call.kv_len % 2):
            reasons.append(
                f"layout='zigzag' holds two equal chunks per rank, so the local lengths must be "
                f"even, got Tq={call.q_len} and Tk={call.kv_len}; shard with "
                "attnkit.distributed.shard_zigzag"
            )
        return reasons

    def run(self, call: AttentionCall, inputs: CallInputs) -> Tensor:
        # check() has turned away bias, dropout and weights before this runs.
        return _ring(
            inputs.q,
            inputs.k,
            inputs.v,
            mask=call.mask,
            scale=call.scale,
            softcap=call.softcap,
            sinks=inputs.sinks,
            layout=self.layout,
            group=self.group,
            blocks=self._blocks,
            tiles=self._tiles,
            fused_rows=self._fused_rows,
        )

    def __repr__(self) -> str:
        return f"RingBackend(layout={self.layout!r})"


@shape_checked
def ring_attention(
    q: Float[Tensor, "*batch H Tq Dk"],
    k: Float[Tensor, "*batch Hkv Tk Dk"],
    v: Float[Tensor, "*batch Hkv Tk Dv"],
    *,
    causal: bool = False,
    mask: Bool[Tensor, "*#mb #Tk"] | Mask | None = None,
    layout: str = "contiguous",
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Float[Tensor, " H"] | None = None,
    group: ProcessGroup | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> Float[Tensor, "*batch H Tq Dv"]:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Every rank calls it with its own shard; the output is this rank's shard of what
    :func:`attnkit.attention` gives on the whole sequence, and so are the gradients. It is
    ``attention(q, k, v, ..., backend=RingBackend(layout=layout, group=group))``, after every rank
    has checked its arguments with the others.

    Args:
        q: this rank's queries ``(..., H, Tq, Dk)``; ``Tq = T / W`` for ``W`` ranks.
        k: this rank's keys ``(..., Hkv, Tk, Dk)`` (grouped-query attention when ``Hkv < H``).
        v: this rank's values ``(..., Hkv, Tk, Dv)``.
        causal: query ``i`` sees key ``j`` iff ``j <= i`` in the whole sequence's positions (needs
            ``Tq = Tk``). Blocks above the diagonal are not computed.
        mask: this rank's shard of a key mask, bool, broadcastable to ``(..., H, 1, Tk)``, True =
            may attend (the shard of :func:`attnkit.masks.padding_mask`; it travels around the
            ring with its keys), and/or structured masks without data
            (:func:`~attnkit.masks.causal`, :func:`~attnkit.masks.sliding_window`,
            :func:`~attnkit.masks.from_fn`), which every rank evaluates at the whole sequence's
            positions. A query with no key it may attend gets output 0, never NaN.
        layout: which positions each rank holds, ``"contiguous"`` (rank ``r`` holds the ``r``-th of
            ``W`` equal slices, ``x.chunk(W, dim)[r]``) or ``"zigzag"`` (chunks ``r`` and
            ``2W-1-r`` of ``2W``, from :func:`attnkit.distributed.shard_zigzag`, which gives every
            rank the same causal work). q, k, v and mask share it; the output follows it.
        scale: multiplies ``q k^T``; default ``1 / sqrt(Dk)``.
        softcap, sinks: as in :func:`attnkit.attention`.
        group: the process group whose ranks form the ring; default the whole world.
        block_q, block_k: the kernel's block sizes (default: the chunked backend's).

    Returns:
        This rank's output ``(..., H, Tq, Dv)``, in q's dtype.

    Every rank of the group must make the same calls in the same order, forward and backward (the
    k/v gradients travel around the ring too). Before any block travels, the ranks compare their
    arguments (one small all-gather), so a rank with bad arguments, or shapes, dtypes or flags that
    differ between ranks, raise on every rank instead of leaving the others waiting. Each rank
    holds its own shard plus one block in flight: memory ``O(T / W * (D + block))``, never the whole
    sequence.

    Raises:
        RuntimeError: no initialised process group.
        TypeError, ValueError: bad arguments on any rank, or arguments that differ between ranks.

    Shape legend: ``...`` batch dims, ``H`` query heads, ``Hkv`` key/value heads, ``Tq``/``Tk``
    this rank's query/key count, ``Dk`` query/key size, ``Dv`` value size.
    """
    from ..attention import dispatch

    require_group(group, "ring_attention")
    try:
        if not isinstance(layout, str) or layout not in LAYOUTS:
            raise ValueError(
                f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}"
            )
        backend = RingBackend(layout=layout, group=group, block_q=block_q, block_k=block_k)
        call = check_attention_args(
            q, k, v, mask=mask, bias=None, causal=causal, scale=scale, softcap=softcap,
            sinks=sinks,
        )  # fmt: skip
        reasons = backend.check(call)
        if reasons:
            raise ValueError("ring_attention: " + "; ".join(reasons))
    except (TypeError, ValueError) as error:
        agree(group, "ring_attention", str(error), {})  # the other ranks raise too, then so do we
        raise
    # The call is validated once, here; the dispatcher runs it on the ring.
    inputs = CallInputs(q, k, v, None, sinks)
    return dispatch(call, inputs, backend)  # type: ignore[return-value]
