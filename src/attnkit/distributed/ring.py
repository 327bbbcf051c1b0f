"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Each of the ``W`` ranks holds an equal shard of q, k and v. The k/v shards travel around the ring
(rank ``r`` sends to ``r + 1`` and receives from ``r - 1``) while each rank attends its queries to
the block it holds, so after ``W`` steps every query has met every key and no rank has held more
than two k/v shards at once (Liu et al., 2023, "Ring Attention with Blockwise Transformers"). Each
step runs the chunked kernel's forward tile by tile (a few kernel blocks of queries by a few of
keys); each tile's output and log-sum-exp are merged into a running pair in float32, the online
softmax one level up. Causal tiles above the diagonal are never computed.

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

from .._checks import AttentionCall, check_attention_args, shape_str
from .._typing import Bool, Float, shape_checked
from ..backends import chunked as _chunked
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
    q_len: int  # local lengths
    kv_len: int
    block_q: int
    block_k: int
    tile_q: int
    tile_k: int
    tile_k_backward: int


@dataclass(frozen=True)
class _Piece:
    """Local queries ``[qs, qe)`` against keys ``[ks, ke)`` of the block held.

    Query ``i`` of the piece sees key ``j`` iff ``j <= i + offset``; ``offset=None``: every key.
    """

    qs: int
    qe: int
    ks: int
    ke: int
    offset: int | None


def _piece(qs: int, qe: int, ks: int, ke: int, offset: int | None) -> _Piece | None:
    """The piece, with ``offset=None`` when it sees every key; None when it sees none."""
    if qe <= qs or ke <= ks:
        return None
    if offset is not None:
        if offset + (qe - qs) - 1 < 0:
            return None  # above the diagonal: not computed at all
        if offset >= (ke - ks) - 1:
            offset = None
    return _Piece(qs, qe, ks, ke, offset)


def _pieces(plan: _Plan, src: int, tile_k: int) -> list[_Piece]:
    """What this rank computes against the block that rank ``src`` owns, in tiles."""
    if not plan.causal:
        whole = _piece(0, plan.q_len, 0, plan.kv_len, None)
        return [] if whole is None else _tiles(whole, plan.tile_q, tile_k)
    world, pieces = plan.ring.world_size, []
    for lq, gq, nq in segments(plan.layout, plan.ring.rank, world, plan.q_len):
        for lk, gk, nk in segments(plan.layout, src, world, plan.kv_len):
            # Global query gq + i sees global key gk + j iff j <= i + (gq - gk).
            piece = _piece(lq, lq + nq, lk, lk + nk, gq - gk)
            if piece is not None:
                pieces += _tiles(piece, plan.tile_q, tile_k)
    return pieces


def _tiles(piece: _Piece, tile_q: int, tile_k: int) -> list[_Piece]:
    tiles = []
    for qs in range(piece.qs, piece.qe, tile_q):
        for ks in range(piece.ks, piece.ke, tile_k):
            offset = piece.offset
            if offset is not None:
                offset += (qs - piece.qs) - (ks - piece.ks)  # the same diagonal, seen from (qs, ks)
            tile = _piece(qs, min(qs + tile_q, piece.qe), ks, min(ks + tile_k, piece.ke), offset)
            if tile is not None:
                tiles.append(tile)
    return tiles


def _problem(
    plan: _Plan, piece: _Piece, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None
) -> _chunked._Problem:
    keys = slice(piece.ks, piece.ke)
    if mask is not None and mask.size(-1) != 1:
        mask = mask[..., keys]
    return _chunked._Problem(
        q[..., piece.qs : piece.qe, :],
        k[..., keys, :],
        v[..., keys, :],
        mask,
        None,
        piece.offset,
        plan.scale,
        plan.block_q,
        plan.block_k,
    )


def _empty_rows(p: _chunked._Problem, piece: _Piece) -> Tensor | None:
    """The piece's rows that see no key, ``(N|1, Hkv|1, G|1, rows, 1)``; None when there are none.

    The chunked kernel gives such rows a log-sum-exp of 0 (its backward needs a finite value), which
    a merge would read as weight ``exp(0) = 1``: they must enter the merge as -inf instead.
    """
    rows, keys = piece.qe - piece.qs, piece.ke - piece.ks
    device = p.q5.device
    if piece.offset is None:
        last = torch.full((rows,), keys - 1, device=device)
    else:
        last = (torch.arange(rows, device=device) + piece.offset).clamp(max=keys - 1)
    sees = last >= 0  # (rows,): the row's last visible key, causally
    if p.mask5 is None:
        return None if bool(sees.all()) else ~sees.view(rows, 1)
    counts = p.mask5.cumsum(-1)  # (N|1, Hkv|1, G|1, 1, keys|1): unmasked keys up to each position
    index = last.clamp(min=0) if counts.size(-1) > 1 else torch.zeros_like(last)
    seen = counts.index_select(-1, index) > 0  # (..., 1, rows)
    return (~(seen & sees)).transpose(-1, -2)


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one tile's (output, log-sum-exp) into the running pair, in place (block_out too)."""
    new = torch.logaddexp(lse, block_lse)
    # A row that has seen no key on either side stays at -inf; subtracting 0 then keeps both
    # weights at exp(-inf) = 0 instead of exp(-inf + inf) = nan.
    safe = new.masked_fill(new == float("-inf"), 0.0)
    out.mul_((lse - safe).exp_()).add_(block_out.mul_((block_lse - safe).exp_()))
    lse.copy_(new)


def _kernel_shape(q: Tensor, v: Tensor) -> tuple[int, int, int]:
    """(N, Hkv, G): batch dims flattened, and query heads per key/value head."""
    hkv = v.size(-3)
    return math.prod(q.shape[:-3]), hkv, q.size(-3) // hkv


def _unpack(block: list[Tensor]) -> tuple[Tensor, Tensor, Tensor | None]:
    return block[0], block[1], block[2] if len(block) == 3 else None


def _ring_forward(
    plan: _Plan, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Output ``(N, Hkv, G, Tq, Dv)`` and log-sum-exp ``(N, Hkv, G, Tq, 1)`` in the work dtype."""
    n, hkv, g = _kernel_shape(q, v)
    work = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros(n, hkv, g, plan.q_len, v.size(-1), dtype=work)
    lse = q.new_full((n, hkv, g, plan.q_len, 1), float("-inf"), dtype=work)
    ring = plan.ring
    block = [k, v] if mask is None else [k, v, mask]
    for step in range(ring.world_size):
        incoming = ring.exchange(block) if step < ring.world_size - 1 else None
        kb, vb, mb = _unpack(block)
        for piece in _pieces(plan, (ring.rank - step) % ring.world_size, plan.tile_k):
            p = _problem(plan, piece, q, kb, vb, mb)
            block_out, block_lse = _chunked.forward(p)
            empty = _empty_rows(p, piece)
            if empty is not None:
                block_lse.masked_fill_(empty, float("-inf"))
            rows = slice(piece.qs, piece.qe)
            _merge(out[:, :, :, rows], lse[:, :, :, rows], block_out, block_lse)
        if incoming is not None:
            block = incoming.wait()
    # Rows that saw no key at all have output 0; the chunked backward wants their lse at 0.
    lse.masked_fill_(lse == float("-inf"), 0.0)
    return out, lse


def _ring_backward(
    plan: _Plan,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of the local q, k, v in the kernel layout and the work dtype."""
    n, hkv, g = _kernel_shape(q, v)
    out5 = out.reshape(n, hkv, g, plan.q_len, v.size(-1))
    dout5 = dout.reshape(n, hkv, g, plan.q_len, v.size(-1))
    dq = torch.zeros(n * hkv, g, plan.q_len, q.size(-1), dtype=lse.dtype, device=q.device)
    ring = plan.ring
    block = [k, v] if mask is None else [k, v, mask]
    # The key/value gradients of the block held: this rank's own block first, then each block's
    # running sums arrive with it and leave with it.
    dk = torch.zeros(n * hkv, plan.kv_len, k.size(-1), dtype=lse.dtype, device=q.device)
    dv = torch.zeros(n * hkv, plan.kv_len, v.size(-1), dtype=lse.dtype, device=q.device)
    for step in range(ring.world_size):
        incoming = ring.exchange(block) if step < ring.world_size - 1 else None
        kb, vb, mb = _unpack(block)
        for piece in _pieces(plan, (ring.rank - step) % ring.world_size, plan.tile_k_backward):
            p = _problem(plan, piece, q, kb, vb, mb)
            rows, keys = slice(piece.qs, piece.qe), slice(piece.ks, piece.ke)
            dq_p, dk_p, dv_p, _ = _chunked.backward(
                p, out5[:, :, :, rows], lse[:, :, :, rows], dout5[:, :, :, rows], False
            )
            dq[:, :, rows] += dq_p.view(n * hkv, g, piece.qe - piece.qs, q.size(-1))
            dk[:, keys] += dk_p
            dv[:, keys] += dv_p
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
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        plan: _Plan,
    ) -> Tensor:
        out5, lse = _ring_forward(plan, q, k, v, mask)
        out = out5.view(*q.shape[:-1], v.size(-1)).to(q.dtype)
        # O before rounding, for the backward's rowsum(dO * O) (see the chunked backend).
        ctx.save_for_backward(q, k, v, out5, lse, *([] if mask is None else [mask]))
        ctx.plan = plan  # type: ignore[attr-defined]
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dout: Tensor
    ) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, *rest = ctx.saved_tensors  # type: ignore[attr-defined]
        mask = rest[0] if rest else None
        dq, dk, dv = _ring_backward(ctx.plan, q, k, v, mask, out, lse, dout)  # type: ignore[attr-defined]
        return (
            dq.view(q.shape).to(q.dtype),
            dk.view(k.shape).to(k.dtype),
            dv.view(v.shape).to(v.dtype),
            None,
            None,
        )


# Function.apply is untyped in torch; give it its type once.
_apply_ring: Callable[..., Tensor] = _RingAttention.apply


def _check_local(
    q: object,
    k: object,
    v: object,
    mask: object,
    causal: object,
    layout: object,
    scale: object,
) -> tuple[AttentionCall, Tensor | None]:
    """This rank's own argument checks; returns the call and the mask as a ``q.ndim``-d key mask."""
    call = check_attention_args(
        q,
        k,
        v,
        mask=mask,
        bias=None,
        causal=causal,
        scale=scale,
        dropout_p=0.0,
        return_weights=False,
    )
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    key_mask = None
    if isinstance(mask, Tensor):
        ndim = len(call.scores_shape)
        key_mask = mask.reshape((1,) * (ndim - mask.ndim) + tuple(mask.shape))
        if key_mask.size(-2) != 1:
            raise ValueError(
                f"mask must be a key mask, broadcastable to (..., H, 1, Tk) so that it can travel "
                f"with its keys, got {shape_str(mask.shape)} for (..., H, Tq, Tk) = "
                f"{shape_str(call.scores_shape)}; "
                f"a key padding mask is attnkit.masks.padding_mask(...) sharded along its last dim"
            )
    if causal and call.q_len != call.kv_len:
        raise ValueError(
            f"causal ring attention needs q and k to hold the same positions, got local lengths "
            f"Tq={call.q_len} and Tk={call.kv_len}"
        )
    if layout == "zigzag" and (call.q_len % 2 or call.kv_len % 2):
        raise ValueError(
            f"layout='zigzag' holds two equal chunks per rank, so the local lengths must be even, "
            f"got Tq={call.q_len} and Tk={call.kv_len}; shard with attnkit.distributed.shard_zigzag"
        )
    return call, key_mask


@shape_checked
def ring_attention(
    q: Float[Tensor, "*batch H Tq Dk"],
    k: Float[Tensor, "*batch Hkv Tk Dk"],
    v: Float[Tensor, "*batch Hkv Tk Dv"],
    *,
    causal: bool = False,
    mask: Bool[Tensor, "*#mb #Tk"] | None = None,
    layout: str = "contiguous",
    scale: float | None = None,
    group: ProcessGroup | None = None,
) -> Float[Tensor, "*batch H Tq Dv"]:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Every rank calls it with its own shard; the output is this rank's shard of what
    :func:`attnkit.attention` gives on the whole sequence, and so are the gradients.

    Args:
        q: this rank's queries ``(..., H, Tq, Dk)``; ``Tq = T / W`` for ``W`` ranks.
        k: this rank's keys ``(..., Hkv, Tk, Dk)`` (grouped-query attention when ``Hkv < H``).
        v: this rank's values ``(..., Hkv, Tk, Dv)``.
        causal: query ``i`` sees key ``j`` iff ``j <= i`` in the whole sequence's positions (needs
            ``Tq = Tk``). Blocks above the diagonal are not computed.
        mask: a key mask for this rank's keys, bool, broadcastable to ``(..., H, 1, Tk)``, True =
            may attend: this rank's shard of :func:`attnkit.masks.padding_mask`. It travels around
            the ring with its keys. A query with no key it may attend gets output 0, never NaN.
        layout: which positions each rank holds, ``"contiguous"`` (rank ``r`` holds the ``r``-th of
            ``W`` equal slices, ``x.chunk(W, dim)[r]``) or ``"zigzag"`` (chunks ``r`` and
            ``2W-1-r`` of ``2W``, from :func:`attnkit.distributed.shard_zigzag`, which gives every
            rank the same causal work). q, k, v and mask share it; the output follows it.
        scale: multiplies ``q k^T``; default ``1 / sqrt(Dk)``.
        group: the process group whose ranks form the ring; default the whole world.

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
    require_group(group, "ring_attention")
    try:
        call, key_mask = _check_local(q, k, v, mask, causal, layout, scale)
    except (TypeError, ValueError) as error:
        agree(group, "ring_attention", str(error), {})  # the other ranks raise too, then so do we
        raise
    description: dict[str, object] = {
        "q shape": tuple(q.shape),
        "k shape": tuple(k.shape),
        "v shape": tuple(v.shape),
        "dtype": str(call.dtype).removeprefix("torch."),
        "device type": call.device.type,
        "mask shape": None if key_mask is None else tuple(key_mask.shape),
        "causal": call.causal,
        "layout": layout,
        "scale": call.scale,
    }
    agree(
        group,
        "ring_attention",
        None,
        description,
        shape_fields=("q shape", "k shape", "v shape", "mask shape"),
    )
    # Read at call time, like the chunked backend, so tests can shrink the blocks and tiles.
    block_q, block_k = _chunked.default_blocks(call.causal, call.groups, call.q_len)
    plan = _Plan(
        ring=Ring(group),
        causal=call.causal,
        layout=layout,
        scale=call.scale,
        q_len=call.q_len,
        kv_len=call.kv_len,
        block_q=block_q,
        block_k=block_k,
        tile_q=max(1, TILE_BLOCKS_Q * block_q),
        tile_k=max(1, TILE_BLOCKS_K * block_k),
        tile_k_backward=max(1, TILE_BLOCKS_K_BACKWARD * block_k),
    )
    return _apply_ring(q, k, v, key_mask, plan)
