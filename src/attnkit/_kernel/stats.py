"""Attention statistics in one pass over a call's block plan, never writing out ``(Tq, Tk)``.

Given each query's log-sum-exp (the forward's, ``return_lse=True``), a visit's weights are
``p = 2^(s - lse)`` (scores in base 2, as :meth:`~attnkit._kernel.problem.Problem.scores` gives
them): no running maximum and no rescaling, so every visit of the plan is independent and its
tile of weights is final the moment it is computed. Each tile adds to three accumulators:

* ``key_mass``: the column sums of its weights (per key and query head);
* ``key_max``: the column maxima, kept as ``s - lse`` (the weights' base-2 logarithm) and raised
  to the power at the end, so the maximum is taken before the ``exp2`` of a whole tile;
* ``entropy``: the row sums of ``-p log p = -p t ln 2`` with ``t = s - lse``, which needs no
  ``log``: ``t`` is the tile itself. A masked pair has ``t = -inf`` and ``p = 0``, whose product
  would be NaN, so a tile that may hold ``-inf`` (a partial visit, a bias, a score term, a
  score_mod) has it replaced by the dtype's lowest value first (``0 * lowest = 0``).

The plan's EMPTY blocks are skipped, as in the forward; a query with no visible key (log-sum-exp
``-inf``, or given ``-inf`` or ``+inf``) takes the largest finite offset, so its weights are 0
and so is its entropy. Sinks take part only through the log-sum-exp: a row's weights then sum
to less than 1. The accumulators are the outputs' size; a visit's work lives in a few buffers
the whole pass reuses (its scores, its weights, the entropy's products), a tile each
(:data:`TILE`).

That loop is a few PyTorch operations per visit, each a parallel region of its own: on a CPU
whose cores are busy with other work, the threads of each region wait for each other. Where the
native kernel serves the call (:func:`stats_refusal`: what it takes in the forward, finite q and
k, no score_mod), the same pass runs there instead, in one parallel region
(``torch.ops.attnkit.native_stats``, ``csrc/stats.cpp``): each thread computes a visit's scores
in the forward's register tiles and ``p``, ``sum p t`` and the columns' sums and maxima in one
sweep over them, its columns in arrays of its own added into the outputs once per head.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._base.finite import finite, finite_if_readable
from .._base.transforms import transforms_active
from .._native.kernel import native_call
from .._score_mod import ScoreMod
from ..masks import Geometry, Mask
from ..scores import ScoreTerm
from .choice import refusal
from .plan import QueryBlock
from .planning import planned
from .problem import LN2, LOG2E, Problem, no_autocast

__all__ = ["TILE", "kernel_stats", "stats_blocks", "stats_refusal"]

# A visit's work tensors (its scores, its weights, the entropy's products) hold about this many
# elements each, whatever the batch and heads: 2 MiB in float32, so that the pass's few buffers
# stay well under the outputs' size at long lengths and within the larger CPU caches.
TILE = 1 << 19


def _layout(
    q: Tensor, k: Tensor, bias: Tensor | None, geo: Geometry
) -> tuple[Tensor, Tensor, Tensor | None]:
    """q as ``(B, Hkv, G, Tq, Dk)``, k as ``(B*Hkv, Tk, Dk)`` and a dense bias broadcastable to
    ``(*batch, H, Tq, Tk)`` as ``(B|1, Hkv|1, G|1, Tq|1, Tk|1)`` (views where they can be)."""
    n, hkv = geo.batch, k.size(-3)
    q5 = q.reshape(n, hkv, q.size(-3) // hkv, q.size(-2), q.size(-1))
    k3 = k.reshape(n * hkv, k.size(-2), k.size(-1))
    if bias is None:
        return q5, k3, None
    lead = len(geo.batch_shape)
    b = bias.reshape((1,) * (lead + 3 - bias.ndim) + tuple(bias.shape))
    if all(s == 1 for s in b.shape[:lead]):
        b = b.reshape(1, *b.shape[lead:])
    else:
        b = b.expand(*geo.batch_shape, *b.shape[lead:]).reshape(n, *b.shape[lead:])
    b5 = b.unsqueeze(2) if b.size(1) == 1 else b.unflatten(1, (hkv, -1))
    return q5, k3, b5


def stats_blocks(geo: Geometry) -> tuple[int, int]:
    """``(block_q, block_k)`` of the pass: key blocks of 128 (narrow blocks waste least on a
    causal diagonal), and query blocks of a power of two from 16 to 512 rows that keep a visit's
    tile of every batch row and head (``B * H * block_q * block_k`` elements) within
    :data:`TILE`."""
    block_k = 128
    rows = max(16, min(512, TILE // max(1, geo.batch * geo.heads * block_k)))
    return 1 << (rows.bit_length() - 1), block_k


def _offsets(lse: Tensor, p: Problem) -> Tensor:
    """The natural-log log-sum-exp ``(*batch, H, Tq)`` as the rows' base-2 offsets
    ``(B*Hkv, Tq*G, 1)`` (query-major, as the kernel's rows); the dtype's largest number for a
    query with no visible key, or one given ``-inf`` or ``+inf``: its weights are then
    ``2^(s - max) = 0``, and ``t = s - max`` stays finite, so its entropy's products ``p t`` are
    0 in a visit that replaces no ``-inf`` (an offset of ``+inf`` would make every ``t`` of the
    row ``-inf``, and ``0 * -inf`` NaN)."""
    off = lse.to(p.work).reshape(p.n, p.hkv, p.g, p.tq).transpose(2, 3) * LOG2E
    off = off.masked_fill(off.isinf(), torch.finfo(p.work).max)
    return off.reshape(p.n * p.hkv, p.tq * p.g, 1)


class _Sums:
    """The pass's accumulators, in the kernel's layout: column sums and base-2 column maxima
    ``(B*Hkv, G, Tk)``, and the rows' ``sum p t`` ``(B*Hkv, Tq*G)``."""

    def __init__(self, p: Problem) -> None:
        n, g = p.n * p.hkv, p.g
        self.mass = torch.zeros(n, g, p.tk, dtype=p.work, device=p.q5.device)
        self.top = torch.full((n, g, p.tk), float("-inf"), dtype=p.work, device=p.q5.device)
        self.plogp = torch.zeros(n, p.tq * g, dtype=p.work, device=p.q5.device)


def _block(p: Problem, qb: QueryBlock, off: Tensor, sums: _Sums, inf_free: bool) -> None:
    """Add one query block's visits to ``sums``. ``inf_free``: nothing the call adds to the
    scores can make one ``-inf``, so only partial visits need their ``-inf`` replaced.

    Few operations per visit, each one parallel region: the column sums are one matrix-vector
    product (a row of ones times the weights), and the entropy's products ``p t`` of every
    visit of the block are summed elementwise into one buffer, reduced over its keys once."""
    qr_all = p.q_rows(qb.qs, qb.qe, factor=p.score_factor())
    tb = p.term_block(qb, None)
    g, n = p.g, p.n * p.hkv
    rows0, rows = qb.qs * g, qr_all.size(1)
    lowest = torch.finfo(p.work).min
    width = max(v.ke - v.ks for v in qb.visits)
    plogp = p.scratch("plogp", (n, rows, width)).zero_()
    ones = p.scratch("ones", (n, 1, qb.qe - qb.qs)).fill_(1.0)
    for visit in qb.visits:
        lo, hi = visit.r0 * g, visit.r1 * g
        ks, ke, nr = visit.ks, visit.ke, visit.r1 - visit.r0
        # t = s - lse, base 2: the log of the weights, (B*Hkv, rows*G, keys)
        t, _, _ = p.scores(qr_all[:, lo:hi], qb.qs, visit, off[:, rows0 + lo : rows0 + hi], tb)
        top = sums.top[:, :, ks:ke]
        torch.maximum(top, t.view(n, nr, g, ke - ks).amax(1), out=top)
        w = p.scratch("weights", tuple(t.shape))
        torch.exp2(t, out=w)
        # column sums per query head: (1 x rows) @ (rows x G*keys)
        mass = sums.mass[:, :, ks:ke]
        mass += torch.bmm(ones[:, :, :nr], w.view(n, nr, g * (ke - ks))).view(mass.shape)
        if visit.partial or not inf_free:
            t.clamp_min_(lowest)  # -inf (p = 0) -> lowest: 0 * lowest = 0, not NaN
        plogp[:, lo:hi, : ke - ks].addcmul_(w, t)
    sums.plogp[:, rows0 : rows0 + rows] = plogp.sum(-1)


def stats_refusal(
    q: Tensor, k: Tensor, bias: Tensor | ScoreTerm | None, score_mod: ScoreMod | None
) -> str | None:
    """Which pass computes a call's statistics: None for the native kernel's, else the eager
    kernel's and why, in the words :func:`attnkit._kernel.choice.refusal` gives the forward's
    choice. The native pass takes what the native forward takes (every mask, softcap, a dense
    bias, sinks through the log-sum-exp, Transformer-XL's position term, a bias by distance),
    with finite q and k (the term's inputs too) read once, here, where it would serve."""
    term = bias if isinstance(bias, ScoreTerm) else None
    geo = Geometry(tuple(q.shape[:-3]), q.size(-3), q.size(-2), k.size(-2), q.device)
    why = refusal(
        native=True,
        device=q.device,
        term=term,
        score_mod=score_mod is not None,
        finite=None,
        geo=geo,
        build=True,
    )
    if why is not None and not transforms_active():
        return why  # (read nothing: the eager kernel follows the non-finite policy itself)
    readable = finite_if_readable(q, k, *(() if term is None else term.inputs()))
    if readable is None:
        # (under torch.func.vmap no value can be read, and the eager kernel writes with out=,
        # which vmap has no rule for)
        raise RuntimeError(
            "attention_stats reads whether q and k are finite to choose its kernel, which "
            "torch.func.vmap cannot read: give it the batched q and k (every leading dim is a "
            "batch dim), or backend='reference' (from the weights, written out)"
        )
    if why is None and not readable:
        return "the eager kernel (non-finite values in q/k)"
    return why


def kernel_stats(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    *,
    mask: Mask | None,
    bias: Tensor | ScoreTerm | None,
    scale: float,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    native: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(key_mass, key_max, entropy)`` of a validated call, ``(*batch, H, Tk)``,
    ``(*batch, H, Tk)`` and ``(*batch, H, Tq)`` in the work dtype (float32 for float16 and
    bfloat16), from each query's natural-log log-sum-exp ``lse`` ``(*batch, H, Tq)`` (the sinks'
    share included, when the call has sinks): one pass over the eager kernel's plan of the call
    (``mask`` the call's visibility, causal folded in), in blocks of :func:`stats_blocks` unless
    given; with ``native`` (where :func:`stats_refusal` says the native kernel serves the call),
    the native kernel's pass over its own plan, in its blocks unless given."""
    term = bias if isinstance(bias, ScoreTerm) else None
    dense = bias if isinstance(bias, Tensor) else None
    batch, h, tq, tk = tuple(q.shape[:-3]), q.size(-3), q.size(-2), k.size(-2)
    geo = Geometry(batch, h, tq, tk, q.device)
    groups = h // k.size(-3)
    if native:
        return _native_stats(q, k, lse, mask, dense, term, scale, softcap, geo, block_q, block_k)
    bq, bk = stats_blocks(geo)
    plan = planned(mask, geo, groups, term is not None, block_q or bq, block_k or bk, native=False)
    q5, k3, bias5 = _layout(q, k, dense, geo)
    added = dense is not None or term is not None
    p = Problem(
        q5=q5,
        k3=k3,
        v3=k3[..., :0],  # no values: the pass computes weights only
        scale=scale,
        plan=plan.grid,
        geo=geo,
        mask=mask,
        bias5=bias5,
        softcap=softcap,
        term=term,
        term_inputs=() if term is None else tuple(term.inputs()),
        # NaN in q or k where a -inf bias or term hides the pair must not reach the sums
        careful=added and bool(q.numel() and k.numel()) and not finite(q, k),
        score_mod=score_mod,
    )
    sums = _Sums(p)
    with no_autocast(q.device), torch.no_grad():
        off = _offsets(lse, p)
        inf_free = not added and score_mod is None
        for qb in p.blocks:
            if qb.visits:
                _block(p, qb, off, sums, inf_free)
    mass = sums.mass.reshape(*batch, h, tk)
    top = sums.top.exp2_().reshape(*batch, h, tk)
    # -sum p log p = -ln 2 * sum p t; rows back from query-major to (..., H, Tq)
    plogp = sums.plogp.view(p.n, p.hkv, tq, groups).transpose(2, 3)
    entropy = plogp.mul(-LN2).reshape(*batch, h, tq)
    return mass, top, entropy


def _native_stats(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    mask: Mask | None,
    dense: Tensor | None,
    term: ScoreTerm | None,
    scale: float,
    softcap: float | None,
    geo: Geometry,
    block_q: int | None,
    block_k: int | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`kernel_stats` on the native kernel: its plan of the call (the forward's), the
    operator's arguments as the forward's (:func:`attnkit._native.kernel.native_call`)."""
    groups = geo.heads // k.size(-3)
    plan = planned(mask, geo, groups, term is not None, block_q, block_k, native=True)
    call = native_call(
        plan, geo, scale=scale, softcap=softcap, dtype=q.dtype, term=term, groups=groups
    )
    q5, _, bias5 = _layout(q, k, dense, geo)
    n, hkv = geo.batch, k.size(-3)
    k4 = k.reshape(n, hkv, geo.kv_len, k.size(-1))  # (a view at the caller's strides)
    with no_autocast(q.device), torch.no_grad():
        mass, top, entropy = call.stats(
            q5,
            k4,
            bias5,
            lse.reshape(n, hkv, groups, geo.q_len),
            () if term is None else tuple(term.inputs()),
        )
    return (
        mass.reshape(*geo.batch_shape, geo.heads, geo.kv_len),
        top.reshape(*geo.batch_shape, geo.heads, geo.kv_len),
        entropy.reshape(*geo.batch_shape, geo.heads, geo.q_len),
    )
