"""The chunked backend: exact attention in O(T * block) memory, in plain PyTorch.

It walks blocks of queries (outer loop) and blocks of keys (inner loop) with an online softmax, so
the ``(Tq, Tk)`` scores never exist at once, and it has its own backward that recomputes each score
block from the saved log-sum-exp instead of saving the probabilities (the FlashAttention recipe; Dao
et al., 2022). Blocks that no query may attend (above the causal diagonal, or all False in ``mask``)
are skipped in both passes, so a causal call does about half the work.

Two details make it fast in eager PyTorch:

* **Lazy rescaling.** The textbook online softmax takes the maximum of every score block and
  rescales the running sums whenever it grows: two extra passes over each block. Here each query row
  keeps a fixed offset ``m`` (its first block's maximum) and later blocks are computed directly as
  ``q k^T - m`` by one ``baddbmm``. Any offset is exact as long as ``exp`` neither overflows nor
  underflows more than it would with the true maximum (it cannot underflow more, since the true
  maximum is >= ``m``). Overflow is detected once per query block, on the running sum, and that
  block is then redone with the textbook rescaling. Logits of magnitude 1e4 take that path and stay
  exact.
* **Grouped-query attention without copies.** The ``G = H / Hkv`` query heads that share a key head
  are stacked as rows of one matrix, so each score block is a single batched GEMM against the shared
  keys.

float16/bfloat16 inputs are computed block by block in float32.

A private hook, :class:`ScoreTerm`, adds a score term that is never materialised whole: the kernel
asks it for the rows of one query block and then for one ``(bq, bk)`` tile at a time, and in the
backward hands each tile's score gradient back. Relative positions (:mod:`attnkit._relpos`) use it
to compute their term per block, so their memory stays O(T).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 256
# Causal calls: the diagonal's partly visible blocks waste work. Narrow key blocks, whose rows that
# see none of their keys are skipped (_Problem.first_row), waste least: at T=4096 on 2 cores a
# causal call takes 0.53x the non-causal time (0.61x with the non-causal 512 x 256 blocks). Below
# T=4096 there are too few 512-row query blocks to skip work in, so they take 256 rows: at T=1024
# 0.58x forward and 0.57x forward + backward (0.69x and 0.57x with 512 rows; 128 rows gives 0.56x
# forward but 0.65x with the backward). With grouped heads rows cannot be skipped, and square 256
# blocks do best (0.57x).
DEFAULT_BLOCK_Q_CAUSAL = 512
SHORT_BLOCK_Q_CAUSAL = 256  # when Tq < SHORT_CAUSAL_BELOW
SHORT_CAUSAL_BELOW = 4096
DEFAULT_BLOCK_K_CAUSAL = 128
DEFAULT_BLOCK_GROUPED_CAUSAL = 256


def default_blocks(causal: bool, groups: int, q_len: int) -> tuple[int, int]:
    """``(block_q, block_k)`` for a call; read at call time, so tests can shrink them."""
    if not causal:
        return DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K
    if groups == 1:
        short = q_len < SHORT_CAUSAL_BELOW
        return SHORT_BLOCK_Q_CAUSAL if short else DEFAULT_BLOCK_Q_CAUSAL, DEFAULT_BLOCK_K_CAUSAL
    return DEFAULT_BLOCK_GROUPED_CAUSAL, DEFAULT_BLOCK_GROUPED_CAUSAL


# A running sum above this (or inf/NaN) means the lazy offset was too low: redo the block safely.
_OVERFLOW_GUARD = 2.0**64


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Autocast off for the kernel's own work, whose dtypes are chosen on purpose.

    Inside ``torch.autocast`` (a forward, or a backward called within it) every ``bmm`` would run
    in the autocast dtype and meet the float32 running sums.
    """
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------------
# Layout helpers. Inside this file q is (N, H, Tq, Dk) with the batch dims flattened to N; masks and
# biases are 5-d (N|1, Hkv|1, G|1, Tq|1, Tk|1) views so that they broadcast against a score block
# viewed as (N, Hkv, G, bq, bk).


def _flatten_batch(t: Tensor, batch: tuple[int, ...], n: int) -> Tensor:
    """(...|1, X, Y, Z) broadcastable to (*batch, X, Y, Z) -> (N or 1, X, Y, Z)."""
    t = t.reshape((1,) * (len(batch) + 3 - t.ndim) + tuple(t.shape))
    lead = t.shape[: len(batch)]
    if all(s == 1 for s in lead):
        return t.reshape(1, *t.shape[len(batch) :])
    return t.expand(*batch, *t.shape[len(batch) :]).reshape(n, *t.shape[len(batch) :])


def _as_5d(t: Tensor | None, batch: tuple[int, ...], n: int, kv_heads: int) -> Tensor | None:
    if t is None:
        return None
    t = _flatten_batch(t, batch, n)
    return t.unsqueeze(2) if t.size(1) == 1 else t.unflatten(1, (kv_heads, -1))


def _tile(t: Tensor, qs: int, qe: int, ks: int, ke: int) -> Tensor:
    """The (qs:qe, ks:ke) block of a broadcastable mask or bias; broadcast dims stay size 1."""
    if t.size(-2) != 1:
        t = t[..., qs:qe, :]
    if t.size(-1) != 1:
        t = t[..., ks:ke]
    return t


def _causal_state(qs: int, qe: int, ks: int, ke: int, offset: int | None) -> int:
    """0: the block is hidden by causality; 1: partly visible; 2: fully visible (or no causality).

    Query i may attend key j iff ``j <= i + offset``.
    """
    if offset is None or ke - 1 <= qs + offset:
        return 2
    if ks > qe - 1 + offset:
        return 0
    return 1


def _block_mask(
    mask5: Tensor | None,
    qs: int,
    qe: int,
    ks: int,
    ke: int,
    offset: int | None,
    device: torch.device,
) -> Tensor | bool | None:
    """One block's visibility: ``False`` to skip it, ``None`` if all visible, else a bool tile."""
    state = _causal_state(qs, qe, ks, ke, offset)
    if state == 0:
        return False
    tile: Tensor | None = None
    if state == 1 and offset is not None:
        i = torch.arange(qs, qe, device=device).unsqueeze(-1)
        tile = torch.arange(ks, ke, device=device) <= i + offset  # (bq, bk)
    if mask5 is not None:
        user = _tile(mask5, qs, qe, ks, ke)
        # One pass over a bool tile buys skipping a whole block (padding, packed sequences).
        if not bool(user.any()):
            return False
        if not bool(user.all()):
            tile = user if tile is None else user & tile
    return tile


class ScoreTermRows(Protocol):
    """A score term for the queries ``qs:qe`` of one block (see :class:`ScoreTerm`)."""

    def tile(self, ks: int, ke: int) -> Tensor:
        """The term for keys ``ks:ke``, broadcastable to ``(N, Hkv, G, qe-qs, ke-ks)``."""
        ...

    def backward(self, ks: int, ke: int, ds: Tensor) -> None:
        """Take the gradient of the scores ``(N, Hkv, G, qe-qs, ke-ks)`` of that tile."""
        ...

    def flush(self) -> None:
        """The backward has seen every tile of these rows: turn the tiles into gradients."""
        ...


class ScoreTerm(Protocol):
    """An additive score term the kernel computes block by block, after the scaled ``q k^T``.

    Unlike ``bias`` it never exists as a whole ``(Tq, Tk)`` tensor: the kernel calls
    ``rows(qs, qe, key_end)`` once per query block (``key_end``: no tile past that key will be
    asked for), then ``tile`` per key block. The term owns its inputs and their gradients.
    """

    def rows(self, qs: int, qe: int, key_end: int) -> ScoreTermRows: ...


class _Problem:
    """One call's tensors in the kernel's layout, shared by the forward and backward passes."""

    def __init__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        bias: Tensor | None,
        causal_offset: int | None,
        scale: float,
        block_q: int,
        block_k: int,
        score_term: ScoreTerm | None = None,
    ) -> None:
        self.batch = tuple(q.shape[:-3])
        self.n = math.prod(self.batch)
        self.h, self.tq, self.dk = q.shape[-3:]
        self.hkv, self.tk, self.dv = v.shape[-3:]
        self.g = self.h // self.hkv
        self.work = torch.promote_types(q.dtype, torch.float32)
        self.q5 = q.reshape(self.n, self.hkv, self.g, self.tq, self.dk)
        self.k3 = k.reshape(self.n * self.hkv, self.tk, self.dk)
        self.v3 = v.reshape(self.n * self.hkv, self.tk, self.dv)
        self.mask5 = _as_5d(mask, self.batch, self.n, self.hkv)
        self.bias5 = _as_5d(bias, self.batch, self.n, self.hkv)
        self.offset = causal_offset
        self.scale = scale
        self.bq = max(1, block_q)
        self.bk = max(1, block_k)
        self.score_term = score_term

    def term_rows(self, qs: int, qe: int) -> ScoreTermRows | None:
        """The score term's rows for one query block, covering every key block it may visit."""
        if self.score_term is None:
            return None
        key_end = self.tk
        if self.offset is not None:  # key blocks past the causal diagonal are never visited
            last_visible = qe - 1 + self.offset
            key_end = min(self.tk, max(0, (last_visible // self.bk + 1) * self.bk))
        return self.score_term.rows(qs, qe, key_end)

    def q_block(self, qs: int, qe: int) -> Tensor:
        """(N*Hkv, G*bq, Dk) scaled queries of one block, in the work dtype (a small copy)."""
        qb = self.q5[:, :, :, qs:qe].reshape(self.n * self.hkv, self.g * (qe - qs), self.dk)
        return qb.to(self.work) * self.scale

    def first_row(self, qs: int, ks: int, term: ScoreTermRows | None) -> int:
        """Rows of the query block before this one see none of the keys from ``ks`` on (causal).

        The kernel then skips them: with 512-row query blocks and 256-key blocks, the second key
        block on the diagonal needs only the bottom half of the rows. Only for ``G == 1`` (with
        grouped heads a block's rows interleave the groups) and without a score term.
        """
        if self.offset is None or self.g != 1 or term is not None:
            return 0
        return max(0, ks - self.offset - qs)

    def scores(
        self,
        qb: Tensor,
        qs: int,
        qe: int,
        ks: int,
        ke: int,
        offset_rows: Tensor | None,
        term: ScoreTermRows | None = None,
    ) -> tuple[Tensor, int] | None:
        """Scaled scores of a block minus a per-row offset, masked with -inf; None if all hidden.

        Returns the scores of rows ``r0:`` of the block and ``r0`` (see :meth:`first_row`).
        ``term`` is the block's :class:`ScoreTerm` rows, whose tile is added like ``bias``.
        """
        vis = _block_mask(self.mask5, qs, qe, ks, ke, self.offset, qb.device)
        if vis is False:
            return None
        r0 = self.first_row(qs, ks, term)
        if r0:
            qs, qb = qs + r0, qb[:, r0:]
            offset_rows = None if offset_rows is None else offset_rows[:, r0:]
            vis = _block_mask(self.mask5, qs, qe, ks, ke, self.offset, qb.device)
            if vis is False:
                return None
        kb = self.k3[:, ks:ke].to(self.work).transpose(1, 2)
        if offset_rows is None:
            s = torch.bmm(qb, kb)  # (N*Hkv, G*bq, bk)
        else:
            s = torch.baddbmm(offset_rows, qb, kb, beta=-1.0)
        s5 = s.view(self.n, self.hkv, self.g, qe - qs, ke - ks)
        if self.bias5 is not None:
            s5.add_(_tile(self.bias5, qs, qe, ks, ke))
        if term is not None:
            s5.add_(term.tile(ks, ke))
        if isinstance(vis, Tensor):
            s5.masked_fill_(~vis, float("-inf"))
        return s, r0

    def k_ranges(self) -> list[tuple[int, int]]:
        return [(ks, min(ks + self.bk, self.tk)) for ks in range(0, self.tk, self.bk)]


# --------------------------------------------------------------------------------------------------
# Forward


def _forward_block(p: _Problem, qs: int, qe: int, lazy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Unnormalised output, running sum and offset of one query block.

    ``lazy=False`` is the textbook online softmax (rescale whenever a block's maximum is larger).
    """
    qb = p.q_block(qs, qe)
    term = p.term_rows(qs, qe)
    rows = qb.size(1)
    acc = qb.new_zeros(qb.size(0), rows, p.dv)
    lsum = qb.new_zeros(qb.size(0), rows, 1)
    m = qb.new_full((qb.size(0), rows, 1), float("-inf"))
    settled = False  # every row has a finite offset, so lazy steps are safe to take
    for ks, ke in p.k_ranges():
        res = p.scores(qb, qs, qe, ks, ke, m if (lazy and settled) else None, term)
        if res is None:
            continue
        s, r0 = res  # the scores of rows r0: of the block (the others see none of these keys)
        vb = p.v3[:, ks:ke].to(p.work)
        if lazy and settled:
            s.exp_()
        else:
            m_old = m[:, r0:]
            m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
            # Rows that have seen no visible key keep m = -inf (so the next block sets it from its
            # own maximum) but subtract 0: their scores are all -inf and exp(-inf - 0) = 0.
            m_sub = m_new.masked_fill(m_new == float("-inf"), 0.0)
            alpha = (m_old - m_sub).exp_()
            s.sub_(m_sub).exp_()
            lsum[:, r0:].mul_(alpha)
            acc[:, r0:].mul_(alpha)
            m[:, r0:] = m_new
            settled = bool(torch.isfinite(m).all())
        lsum[:, r0:].add_(s.sum(-1, keepdim=True))
        acc[:, r0:].baddbmm_(s, vb)
    return acc, lsum, m


def forward(p: _Problem) -> tuple[Tensor, Tensor]:
    """Output ``(N, Hkv, G, Tq, Dv)`` in the work dtype and log-sum-exp ``(N, Hkv, G, Tq, 1)``."""
    out = p.q5.new_empty(p.n, p.hkv, p.g, p.tq, p.dv, dtype=p.work)
    lse = p.q5.new_empty(p.n, p.hkv, p.g, p.tq, 1, dtype=p.work)
    for qs in range(0, p.tq, p.bq):
        qe = min(qs + p.bq, p.tq)
        acc, lsum, m = _forward_block(p, qs, qe, lazy=True)
        if not bool((lsum < _OVERFLOW_GUARD).all()):  # false for inf and NaN too
            acc, lsum, m = _forward_block(p, qs, qe, lazy=False)
        shape = (p.n, p.hkv, p.g, qe - qs)
        empty = lsum == 0  # rows with no key they may attend: output 0, never 0/0
        out[:, :, :, qs:qe] = (acc / lsum.masked_fill(empty, 1.0)).view(*shape, p.dv)
        # Empty rows get lse 0: in the backward their scores are all -inf, so exp(s - 0) = 0.
        lse[:, :, :, qs:qe] = (m + lsum.log()).masked_fill(empty, 0.0).view(*shape, 1)
    return out, lse


# --------------------------------------------------------------------------------------------------
# Backward


def backward(
    p: _Problem, out: Tensor, lse: Tensor, dout: Tensor, need_bias_grad: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients of q, k, v (in the work dtype, kernel layout) and of the 5-d bias view."""
    rows3 = (p.n * p.hkv, p.g, p.tq)
    dout5 = dout.reshape(p.n, p.hkv, p.g, p.tq, p.dv).to(p.work)
    out5 = out.reshape(p.n, p.hkv, p.g, p.tq, p.dv).to(p.work)
    delta = (dout5 * out5).sum(-1, keepdim=True)  # (N, Hkv, G, Tq, 1): rowsum(dO * O)
    dq = torch.zeros(*rows3, p.dk, dtype=p.work, device=out.device)
    dk = torch.zeros(p.n * p.hkv, p.tk, p.dk, dtype=p.work, device=out.device)
    dv = torch.zeros(p.n * p.hkv, p.tk, p.dv, dtype=p.work, device=out.device)
    dbias = None
    if need_bias_grad and p.bias5 is not None:
        dbias = torch.zeros(p.bias5.shape, dtype=p.work, device=out.device)

    def rows(t: Tensor, qs: int, qe: int) -> Tensor:
        # (N, Hkv, G, Tq, X) -> the block's (N*Hkv, G*bq, X) rows, matching q_block().
        return t[:, :, :, qs:qe].reshape(p.n * p.hkv, p.g * (qe - qs), t.size(-1))

    for qs in range(0, p.tq, p.bq):
        qe = min(qs + p.bq, p.tq)
        qb = p.q_block(qs, qe)
        term = p.term_rows(qs, qe)
        lse_b, delta_b, do_b = rows(lse, qs, qe), rows(delta, qs, qe), rows(dout5, qs, qe)
        dq_b = qb.new_zeros(qb.shape)
        for ks, ke in p.k_ranges():
            res = p.scores(qb, qs, qe, ks, ke, lse_b, term)
            if res is None:
                continue
            s, r0 = res  # rows r0: of the block; the others see none of these keys
            prob = s.exp_()  # (N*Hkv, G*bq, bk): the forward's probabilities, recomputed
            kb = p.k3[:, ks:ke].to(p.work)
            vb = p.v3[:, ks:ke].to(p.work)
            do_r = do_b[:, r0:]
            dv[:, ks:ke].baddbmm_(prob.transpose(1, 2), do_r)
            ds = torch.bmm(do_r, vb.transpose(1, 2)).sub_(delta_b[:, r0:]).mul_(prob)  # dL/dS
            dq_b[:, r0:].baddbmm_(ds, kb)
            dk[:, ks:ke].baddbmm_(ds.transpose(1, 2), qb[:, r0:])  # qb carries the scale
            if dbias is not None:
                tile = _tile(dbias, qs + r0, qe, ks, ke)
                tile.add_(ds.view(p.n, p.hkv, p.g, qe - qs - r0, ke - ks).sum_to_size(tile.shape))
            if term is not None:
                term.backward(ks, ke, ds.view(p.n, p.hkv, p.g, qe - qs, ke - ks))
        if term is not None:
            term.flush()
        dq.view(p.n, p.hkv, p.g, p.tq, p.dk)[:, :, :, qs:qe] = dq_b.view(
            p.n, p.hkv, p.g, qe - qs, p.dk
        )
    dq.mul_(p.scale)
    return dq, dk, dv, dbias


# --------------------------------------------------------------------------------------------------
# Autograd and the backend entry point


def _unlayout_bias_grad(d5: Tensor, bias: Tensor, batch: tuple[int, ...]) -> Tensor:
    """(N|1, Hkv|1, G|1, Tq|1, Tk|1) gradient -> the bias's own (broadcast) shape and dtype."""
    d = d5.flatten(1, 2)
    lead = batch if d.size(0) != 1 else (1,) * len(batch)
    padded = (1,) * (len(batch) + 3 - bias.ndim) + tuple(bias.shape)
    d = d.reshape(*lead, *d.shape[1:]).sum_to_size(padded)
    return d.reshape(bias.shape).to(bias.dtype)


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        bias: Tensor | None,
        causal_offset: int | None,
        scale: float,
        block_q: int,
        block_k: int,
    ) -> Tensor:
        p = _Problem(q, k, v, mask, bias, causal_offset, scale, block_q, block_k)
        with no_autocast(q.device):
            out5, lse = forward(p)
        out = out5.view(*q.shape[:-1], p.dv).to(q.dtype)
        optional = [t for t in (mask, bias) if t is not None]
        # The backward's rowsum(dO * O) takes O before rounding: with float16 O and a near one-hot
        # softmax, dO . (v_j - O) cancels and O's rounding error would dominate the gradients.
        ctx.save_for_backward(q, k, v, out5, lse, *optional)
        ctx.has = (mask is not None, bias is not None)  # type: ignore[attr-defined]
        ctx.args = (causal_offset, scale, block_q, block_k)  # type: ignore[attr-defined]
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dout: Tensor
    ) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, *optional = ctx.saved_tensors  # type: ignore[attr-defined]
        has_mask, has_bias = ctx.has  # type: ignore[attr-defined]
        mask = optional.pop(0) if has_mask else None
        bias = optional.pop(0) if has_bias else None
        p = _Problem(q, k, v, mask, bias, *ctx.args)  # type: ignore[attr-defined]
        need_bias = bias is not None and ctx.needs_input_grad[4]  # type: ignore[attr-defined]
        with no_autocast(dout.device):
            dq, dk, dv, dbias5 = backward(p, out, lse, dout, need_bias)
        dbias = None
        if dbias5 is not None and bias is not None:
            dbias = _unlayout_bias_grad(dbias5, bias, p.batch)
        return (
            dq.view(q.shape).to(q.dtype),
            dk.view(k.shape).to(k.dtype),
            dv.view(v.shape).to(v.dtype),
            None,
            dbias,
            None,
            None,
            None,
            None,
        )


# Function.apply is untyped in torch; give it its type once.
_apply_chunked: Callable[..., Tensor] = _ChunkedAttention.apply


def chunked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
) -> Tensor:
    """Run the chunked kernel directly with chosen block sizes (the backend uses the defaults).

    Arguments are those of :func:`attnkit.attention`, already validated; ``block_q`` and ``block_k``
    trade memory (one ``(H, block_q, block_k)`` score block at a time) against per-block overhead.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1)) if q.size(-1) else 1.0
    offset = k.size(-2) - q.size(-2) if causal else None
    return _apply_chunked(q, k, v, mask, bias, offset, scale, block_q, block_k)


def chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None,
    bias: Tensor | None,
    causal: bool,
    scale: float,
    dropout_p: float,
    return_weights: bool,
) -> Tensor:
    """The registered backend (see :func:`chunked_attention`); it has no dropout and no weights."""
    block_q, block_k = default_blocks(causal, q.size(-3) // k.size(-3), q.size(-2))
    return chunked_attention(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        causal=causal,
        scale=scale,
        block_q=block_q,
        block_k=block_k,
    )
