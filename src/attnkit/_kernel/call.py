"""The kernel on a whole call: its plan (made once, kept for calls like it), which kernel runs it
(native or eager), and its forward and backward as one autograd function.

:func:`kernel_attention` is what the ``chunked`` backend runs; :func:`plan_call`,
:func:`run_forward` and :func:`run_backward` are its parts, which attnkit's operator
(:mod:`attnkit._kernel.operator`) runs inside compiled and exported graphs.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._finite import finite
from .._native.kernel import (
    DECODE_QUERIES,
    NativeCall,
    block_plan,
    decodes,
    native_call,
    refusal,
)
from .._packing import joint_grads
from .._record import note_kernel
from .._score_mod import ScoreMod
from ..masks import Geometry, Mask
from ..scores import ScoreTerm, term_error
from . import (
    FUSED_ROWS,
    BlockPlan,
    Grads,
    Plan,
    Problem,
    backward,
    default_blocks,
    delta_of,
    draw_seed,
    finish,
    forward,
    make_plan,
    no_autocast,
    sink_grad,
    sizes,
    small_scores,
)

__all__ = [
    "NATIVE_BLOCKS",
    "kernel_attention",
    "native_arguments",
    "native_serves",
    "plan_call",
    "plan_for",
    "planned",
    "run_backward",
    "run_forward",
]


def _flatten_batch(t: Tensor, batch: tuple[int, ...], n: int) -> Tensor:
    """(...|1, X, Y, Z) broadcastable to (*batch, X, Y, Z) -> (B or 1, X, Y, Z)."""
    t = t.reshape((1,) * (len(batch) + 3 - t.ndim) + tuple(t.shape))
    lead = t.shape[: len(batch)]
    if all(s == 1 for s in lead):
        return t.reshape(1, *t.shape[len(batch) :])
    return t.expand(*batch, *t.shape[len(batch) :]).reshape(n, *t.shape[len(batch) :])


def _as_5d(t: Tensor, batch: tuple[int, ...], n: int, kv_heads: int) -> Tensor:
    """A bias broadcastable to ``(*batch, H, Tq, Tk)`` as ``(B|1, Hkv|1, G|1, Tq|1, Tk|1)``."""
    t = _flatten_batch(t, batch, n)
    return t.unsqueeze(2) if t.size(1) == 1 else t.unflatten(1, (kv_heads, -1))


def _unlayout_bias_grad(d5: Tensor, bias: Tensor, batch: tuple[int, ...]) -> Tensor:
    """(B|1, Hkv|1, G|1, Tq|1, Tk|1) gradient -> the bias's own (broadcast) shape and dtype."""
    d = d5.flatten(1, 2)
    lead = batch if d.size(0) != 1 else (1,) * len(batch)
    padded = (1,) * (len(batch) + 3 - bias.ndim) + tuple(bias.shape)
    d = d.reshape(*lead, *d.shape[1:]).sum_to_size(padded)
    return d.reshape(bias.shape).to(bias.dtype)


def _check_term(term: ScoreTerm, lse: Tensor, unchecked: tuple[Tensor, ...] = ()) -> None:
    """Raise when a score term gave NaN or +inf at a visible pair (one host synchronisation).

    With finite q, k, v and term inputs (and a bias already checked), only the term can make a
    visible score NaN or +inf, and any such score makes its row's log-sum-exp NaN or +inf: one
    look at the ``(B, H, Tq)`` log-sum-exp replaces a pass over every tile. (Scores overflowing
    the work dtype, ``|q . k| * scale`` beyond 3e38 in float32, would read the same.)
    ``unchecked``: q, k and v when they were not read beforehand (the decode path): they are read
    only when the log-sum-exp says something is not finite, and a NaN they hold is theirs.
    """
    if not lse.numel():
        return
    top = float(lse.max())  # NaN propagates through max; -inf rows (no visible key) are fine
    if (math.isnan(top) or top == math.inf) and (not unchecked or finite(*unchecked)):
        raise term_error(term)


@dataclass(frozen=True)
class _Spec:
    """What the backward needs besides the saved tensors: the call, and its plan."""

    mask: Mask | None
    geo: Geometry
    plan: BlockPlan
    scale: float
    softcap: float | None
    term: ScoreTerm | None
    careful: bool
    #: q, k, v and the term's inputs are finite: a non-finite log-sum-exp is the term's doing
    check_term: bool
    has_bias: bool
    has_sinks: bool
    n_term: int
    fused_rows: int | None
    native: NativeCall | None  # None: the eager kernel
    dropout: tuple[float, int] | None  # (p, seed), see attnkit._kernel.dropout
    score_mod: ScoreMod | None = None
    zero_offset: bool | None = None
    #: which kernel runs the call, in explain()'s words (see attnkit._native.kernel.refusal)
    kernel: str = "native kernel"
    #: q, k and v were not read for NaN and inf beforehand: the native kernel's decode path,
    #: which handles them itself, serves an inference call (see plan_call)
    unchecked: bool = False


def _layout(
    spec: _Spec, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, native: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """q, k, v and a dense bias in the kernel's layout (see :class:`Problem`); for the native
    kernel k and v stay ``(B, Hkv, Tk, D)``, views at the caller's strides where they can be."""
    batch = spec.geo.batch_shape
    n = spec.geo.batch
    hkv = k.size(-3)
    kv = (n, hkv) if native else (n * hkv,)
    return (
        q.reshape(n, hkv, q.size(-3) // hkv, q.size(-2), q.size(-1)),
        k.reshape(*kv, k.size(-2), k.size(-1)),
        v.reshape(*kv, v.size(-2), v.size(-1)),
        None if bias is None else _as_5d(bias, batch, n, hkv),
    )


def _problem(
    spec: _Spec,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    term_inputs: tuple[Tensor, ...],
    mod_inputs: tuple[Tensor, ...] = (),
) -> Problem:
    q5, k3, v3, bias5 = _layout(spec, q, k, v, bias)
    return Problem(
        q5=q5,
        k3=k3,
        v3=v3,
        scale=spec.scale,
        plan=spec.plan.grid,
        geo=spec.geo,
        mask=spec.mask,
        bias5=bias5,
        softcap=spec.softcap,
        term=spec.term,
        term_inputs=term_inputs,
        careful=spec.careful,
        fused_rows=spec.fused_rows,
        dropout=spec.dropout,
        score_mod=spec.score_mod,
        mod_inputs=mod_inputs,
        zero_offset=spec.zero_offset,
    )


def run_forward(
    spec: _Spec,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    sinks: Tensor | None,
    extra: tuple[Tensor, ...],
    for_backward: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward of a planned call: ``(out, lse, out5, lse5)``, the output in q's layout and
    dtype, the natural-log log-sum-exp ``(..., H, Tq)`` (the sinks' share included), and both in
    the kernel's layout and work dtype for the backward (``extra``: the score term's inputs,
    then the tensors the score_mod captures). Without ``for_backward``, a bfloat16 call's out5
    may be in bfloat16: the native kernel then writes the output rounded, with no float32 copy
    of the queries or the output, and the log-sum-exp returned may be a view of lse5."""
    hkv = k.size(-3)
    term_inputs, mod_inputs = extra[: spec.n_term], extra[spec.n_term :]
    if not q.shape[:-1].numel():  # no query rows at all (an empty batch, no heads or queries)
        work = torch.promote_types(q.dtype, torch.float32)
        out5 = q.new_zeros((spec.geo.batch, hkv, 0, q.size(-2), v.size(-1)), dtype=work)
        lse5 = q.new_zeros(out5.shape[:-1], dtype=work)
        return (
            q.new_zeros((*q.shape[:-1], v.size(-1))),
            q.new_zeros(q.shape[:-1], dtype=work),
            out5,
            lse5,
        )
    with no_autocast(q.device):
        if spec.native is not None:
            q5, k4, v4, bias5 = _layout(spec, q, k, v, bias, native=True)
            # (sinks rescale the output after the kernel: in the work dtype)
            reduced = not for_backward and sinks is None
            out5, lse = spec.native.forward(q5, k4, v4, bias5, term_inputs, reduced)
        else:
            out5, lse = forward(_problem(spec, q, k, v, bias, term_inputs, mod_inputs))
        if spec.check_term and spec.term is not None:
            _check_term(spec.term, lse, (q, k, v) if spec.unchecked else ())
        sinks2 = None if sinks is None else sinks.view(hkv, -1)
        out5, lse = finish(out5, lse, sinks2)
    # (B, Hkv, G, Tq, Dv) laid out as (B, Tq, H, Dv): a view of q's shape, like torch's SDPA.
    out = out5.flatten(1, 2).reshape(*q.shape[:-1], v.size(-1)).to(q.dtype)
    # (B, Hkv, G, Tq) -> (..., H, Tq): the natural-log log-sum-exp, the sinks' share included
    # (a copy when lse is kept for the backward, which a caller's in-place change must not reach).
    lse_out = lse.flatten(1, 2).reshape(q.shape[:-1])
    return out, lse_out.clone() if for_backward else lse_out, out5, lse


def run_backward(
    spec: _Spec,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out5: Tensor,
    lse: Tensor,
    bias: Tensor | None,
    sinks: Tensor | None,
    extra: tuple[Tensor, ...],
    dout: Tensor | None,
    dlse: Tensor | None,
    needs: tuple[bool, ...],
    joint: bool = True,
) -> tuple[Tensor | None, ...]:
    """The gradients of a planned call's inputs ``(q, k, v, bias, sinks, *extra)``, None where
    ``needs`` (one flag for each) does not ask (``out5``, ``lse``: :func:`run_forward`'s, in the
    kernel's layout and work dtype; ``dout``/``dlse`` None when that output was not used).
    ``joint``: q's, k's and v's gradients may be written as views of one tensor when q, k and v
    are views of one (see :func:`attnkit._packing.joint_grads`)."""
    term_inputs, mod_inputs = tuple(extra[: spec.n_term]), tuple(extra[spec.n_term :])
    if not q.shape[:-1].numel():  # no query rows: nothing reaches any input
        inputs = (q, k, v, bias, sinks, *extra)
        return tuple(
            torch.zeros_like(t) if t is not None and need else None
            for t, need in zip(inputs, needs, strict=True)
        )
    with no_autocast(q.device):
        # dout is None when only the log-sum-exp is used.
        dout5 = out5.new_zeros(out5.shape) if dout is None else dout.reshape(out5.shape)
        delta = delta_of(out5, dout5)
        if dlse is not None:
            # d lse / d s = the softmax: the score gradient P * (dP - delta) gains P * dlse.
            delta = delta - dlse.reshape(lse.shape).to(delta.dtype)
        bias_grad = bias is not None and needs[3]
        if spec.native is not None:
            q5, k4, v4, bias5 = _layout(spec, q, k, v, bias, native=True)
            packed = joint_grads(q, k, v) if joint else None
            dq, dk, dv, dbias5, dterm5 = spec.native.backward(
                q5,
                k4,
                v4,
                bias5,
                dout5,
                lse,
                delta,
                bias_grad,
                term_inputs,
                tuple(needs[5 : 5 + spec.n_term]),
                None if packed is None else _layout(spec, *packed, None, native=True)[:3],
            )
            grads = Grads(dq, dk, dv, dbias5, dterm5)
        else:
            grads = backward(
                _problem(spec, q, k, v, bias, term_inputs, mod_inputs),
                out5,
                lse,
                delta,
                dout5,
                bias_grad=bias_grad,
                term_grads=any(needs[5 : 5 + spec.n_term]),
            )
        dsinks = None
        if sinks is not None and needs[4]:
            groups = sinks.view(out5.size(1), -1)
            dsinks = sink_grad(lse, delta, groups).reshape(sinks.shape).to(sinks.dtype)
    dbias = None
    if grads.dbias5 is not None and bias is not None:
        dbias = _unlayout_bias_grad(grads.dbias5, bias, spec.geo.batch_shape)
    # An input no tile reached (no queries, every block skipped) gets zeros, not None.
    dterm = [
        (torch.zeros_like(t) if need else None) if g is None else g.to(t.dtype)
        for g, t, need in zip(
            [*grads.dterm, *grads.dmod], [*term_inputs, *mod_inputs], needs[5:], strict=True
        )
    ]
    return (
        grads.dq.reshape(q.shape).to(q.dtype),
        grads.dk.reshape(k.shape).to(k.dtype),
        grads.dv.reshape(v.shape).to(v.dtype),
        dbias,
        dsinks,
        *dterm,
    )


class _KernelAttention(torch.autograd.Function):
    # The forward apart from its context, as torch.func's transforms (grad, vjp, jacrev, vmap)
    # need it; under vmap, torch runs the forward and backward per batch of examples.
    generate_vmap_rule = True

    @staticmethod
    def forward(
        spec: _Spec,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        sinks: Tensor | None,
        *extra: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        # (out, lse, and the kernel's out5 and lse5 for the backward: outputs, not gradients)
        out, lse, out5, lse5 = run_forward(spec, q, k, v, bias, sinks, extra)
        return out, lse, out5.detach(), lse5.detach()

    @staticmethod
    def setup_context(
        ctx: torch.autograd.function.FunctionCtx,
        inputs: tuple[Any, ...],
        output: tuple[Tensor, Tensor, Tensor, Tensor],
    ) -> None:
        spec, q, k, v, bias, sinks, *extra = inputs
        out5, lse5 = output[2:]
        ctx.mark_non_differentiable(out5, lse5)
        optional = [t for t in (bias, sinks) if t is not None]
        # The backward's rowsum(dO * O) takes O before rounding (see kernel.delta_of).
        ctx.save_for_backward(q, k, v, out5, lse5, *optional, *extra)
        ctx.spec = spec  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        dout: Tensor | None,
        dlse: Tensor | None,
        *unused: Tensor | None,
    ) -> tuple[Tensor | None, ...]:
        spec: _Spec = ctx.spec  # type: ignore[attr-defined]
        q, k, v, out5, lse, *rest = ctx.saved_tensors  # type: ignore[attr-defined]
        bias = rest.pop(0) if spec.has_bias else None
        sinks = rest.pop(0) if spec.has_sinks else None
        needs = ctx.needs_input_grad  # type: ignore[attr-defined]
        grads = run_backward(
            spec, q, k, v, out5, lse, bias, sinks, tuple(rest), dout, dlse, tuple(needs[1:])
        )
        return (None, *grads)


# Function.apply is untyped in torch; give it its type once.
_apply_4: Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]] = _KernelAttention.apply


def _apply(*args: Any) -> tuple[Tensor, Tensor]:
    """The differentiable ``(out, lse)`` of a planned call: ``(spec, q, k, v, bias, sinks,
    *extra)``."""
    out, lse, _, _ = _apply_4(*args)
    return out, lse


# The native kernel's default blocks (banded masks, others): its score buffer stays in L2. A
# band's visits are cut at the band's own edges (see attnkit._native.kernel), so its key blocks
# need not be narrow to skip what the band hides.
NATIVE_BLOCKS = {True: (128, 256), False: (128, 256)}


def plan_for(
    mask: Mask | None,
    geo: Geometry,
    groups: int,
    term: bool,
    block_q: int | None = None,
    block_k: int | None = None,
    native: bool = False,
) -> Plan:
    """The block plan of a whole call, with the default block sizes where none are given (those
    of the native kernel when ``native``)."""
    banded = mask is not None and mask.distances(geo)[1] < math.inf
    bq, bk = NATIVE_BLOCKS[banded] if native else default_blocks(banded, groups, geo.q_len, term)
    return make_plan(
        mask,
        geo,
        q_start=0,
        q_len=geo.q_len,
        k_start=0,
        kv_len=geo.kv_len,
        block_q=block_q or bq,
        block_k=block_k or bk,
    )


def decode_sized(q_len: int, block_q: int | None) -> bool:
    """Whether ``q_len`` queries take the native kernel's decode path: no more than one block of
    queries, and no more than the path's few rows (``DECODE_QUERIES``)."""
    return q_len <= min(block_q or q_len, DECODE_QUERIES)


def decode_plan(
    mask: Mask | None, geo: Geometry, block_k: int | None
) -> tuple[Mask | None, int | None]:
    """``(mask, block_k)`` to plan an inference call on the native kernel's decode path with.

    The mask: None where it is a band that hides no pair of this call (causal under one new
    query: every cached key is before it), whose plan would otherwise ask the band about its
    blocks at every step. The key block (unless one is given): every key in one block when no
    key block could be skipped (no mask) or a band cuts its visits at its own edges (see
    :func:`attnkit._native.kernel.block_plan`), else None (the default blocks, whose EMPTY ones
    are skipped). The decode path steps through a visit of any length: one visit spares a step
    of a growing cache, whose geometry and so whose plan is new at every step, a plan that
    grows with the cache, and the kernel a break in its prefetching at every block."""
    band = None if mask is None else mask.band
    if band is not None:
        lo, hi = mask.distances(geo)  # type: ignore[union-attr]
        # j - i' over the call's pairs runs from -(Tk - 1) to Tq - 1 (i' bottom-right)
        if lo <= -(geo.kv_len - 1) and hi >= geo.q_len - 1:
            mask = None
    if block_k is None and (mask is None or band is not None):
        block_k = max(geo.kv_len, 1)
    return mask, block_k


# The plans of recent calls (see Mask.plan_key): a training or serving loop calls with one mask
# and one geometry again and again, and making a long call's plan in Python costs a tenth of its
# attention or more. Each entry holds its mask, so a key made of a tensor's id names that tensor.
# At most 16 plans and 2^17 visits in all (a few dozen MiB of Python objects at most).
_PLANS: OrderedDict[Hashable, tuple[Mask | None, BlockPlan, int]] = OrderedDict()
_PLANS_KEPT = 16
_PLANS_VISITS = 1 << 17
_PLANS_LOCK = threading.Lock()
# The visits _PLANS holds (kept as it changes: iterating an OrderedDict hashes every key again).
_PLANS_HELD = [0]


def planned(
    mask: Mask | None,
    geo: Geometry,
    groups: int,
    term: bool,
    block_q: int | None,
    block_k: int | None,
    native: bool,
) -> BlockPlan:
    """The call's :class:`BlockPlan`: :func:`plan_for`'s grid, cut for the native kernel when
    ``native`` (see :func:`attnkit._native.kernel.block_plan`), else the grid's own visits; from
    the cache when an earlier call had the same mask (by :attr:`Mask.plan_key`) and geometry."""
    mask_key = "no mask" if mask is None else mask.plan_key
    key = None if mask_key is None else (mask_key, geo, groups, term, block_q, block_k, native)
    if key is not None:
        with _PLANS_LOCK:
            hit = _PLANS.get(key)
            if hit is not None:
                _PLANS.move_to_end(key)
                return hit[1]
    grid = plan_for(mask, geo, groups, term, block_q, block_k, native=native)
    if native:
        plan = block_plan(mask, geo, grid)
    else:
        plan = BlockPlan.of_grid(grid, geo.q_len, geo.kv_len, geo.shift)
    size = grid.visited
    if key is not None and size <= _PLANS_VISITS:
        with _PLANS_LOCK:
            held = _PLANS_HELD[0] if _PLANS else 0
            made = _PLANS.pop(key, None)  # (made twice: by two threads at once)
            held += size - (0 if made is None else made[2])
            _PLANS[key] = (mask, plan, size)
            while len(_PLANS) > _PLANS_KEPT or held > _PLANS_VISITS:
                held -= _PLANS.popitem(last=False)[1][2]
            _PLANS_HELD[0] = held
    return plan


def kernel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | None,
    bias: Tensor | ScoreTerm | None,
    scale: float,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    fused_rows: int | None = FUSED_ROWS,
    is_finite: bool | None = None,
    return_lse: bool = False,
    score_mod: ScoreMod | None = None,
    captured: tuple[Tensor, ...] = (),
    native: bool = True,
    dropout_p: float = 0.0,
    register_tiles: bool = True,
    skewed_position: bool = True,
) -> Tensor | tuple[Tensor, Tensor]:
    """Run the kernel on a validated call (what the ``chunked`` backend does): :func:`plan_call`,
    then the forward, differentiable (``return_lse``: also return the natural-log log-sum-exp
    ``(..., H, Tq)``, differentiable too; ``captured``: the tensors the ``score_mod`` captures
    that need gradients, which receive theirs)."""
    spec, dense, term_inputs = plan_call(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        scale=scale,
        softcap=softcap,
        sinks=sinks,
        block_q=block_q,
        block_k=block_k,
        fused_rows=fused_rows,
        is_finite=is_finite,
        score_mod=score_mod,
        native=native,
        dropout_p=dropout_p,
        register_tiles=register_tiles,
        skewed_position=skewed_position,
    )
    note_kernel(spec.kernel)
    extra = (*term_inputs, *captured)
    if _wants_grads(q, k, v, dense, sinks, *extra):
        out, lse = _apply(spec, q, k, v, dense, sinks, *extra)
    else:  # no graph to record: the forward alone (autograd.Function's own costs are a
        # sizable part of a small decode step's)
        out, lse = run_forward(spec, q, k, v, dense, sinks, extra, for_backward=False)[:2]
    return (out, lse) if return_lse else out


def plan_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | None,
    bias: Tensor | ScoreTerm | None,
    scale: float,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    fused_rows: int | None = FUSED_ROWS,
    is_finite: bool | None = None,
    score_mod: ScoreMod | None = None,
    native: bool = True,
    dropout_p: float = 0.0,
    seed: int | None = None,
    register_tiles: bool = True,
    skewed_position: bool = True,
) -> tuple[_Spec, Tensor | None, tuple[Tensor, ...]]:
    """Everything a call's forward and backward share, decided once: ``(spec, dense bias, the
    score term's inputs)``. ``is_finite``:
    whether q, k and v hold only finite values, if the caller knows (None: find out, in the same
    host read as the sizes that tell whether the kernel may take offset 0 throughout, see
    :func:`attnkit._kernel.sizes`). ``score_mod``: applied to each tile.

    ``native``: use the native kernel where it computes the same thing (see
    :func:`native_serves`; never with a ``score_mod``). ``dropout_p``: both kernels drop the same
    pairs for ``seed`` (None: one drawn from torch's generator, see
    :mod:`attnkit._kernel.dropout`)."""
    batch = tuple(q.shape[:-3])
    h, tq, _ = q.shape[-3:]
    hkv, tk, _ = k.shape[-3:]
    geo = Geometry(batch, h, tq, tk, q.device)
    term = bias if isinstance(bias, ScoreTerm) else None
    dense = bias if isinstance(bias, Tensor) else None
    term_inputs = () if term is None else tuple(term.inputs())
    zero_offset = None  # asked by the kernel's forward
    term_finite: bool | None = None
    # The native kernel serves the call if its inputs are finite (its blocked forward has no
    # careful mode; its decode path has, see below).
    why = refusal(
        native=native,
        device=q.device,
        term=term,
        score_mod=score_mod is not None,
        finite=None,
        geo=geo,
        build=True,
    )
    native_ok = why is None
    # The native kernel's decode path reads q, k and v once and takes care of NaN and inf itself:
    # an inference call it serves is not read beforehand (a call that needs gradients is: the
    # backward has no such care).
    plan = None
    if (
        is_finite is None
        and native_ok
        and decode_sized(tq, block_q)
        and not _wants_grads(q, k, v, dense, sinks, *term_inputs)
    ):
        decode_mask, keys = decode_plan(mask, geo, block_k)
        plan = planned(decode_mask, geo, h // hkv, term is not None, block_q, keys, True)
    unchecked = plan is not None and decodes(plan)
    if not unchecked:  # (a decode plan's long key blocks are for the decode path alone)
        plan = None
    if is_finite is None and native_ok and not unchecked:
        # The native kernel needs to know only that q, k, v (and the term's inputs) are finite:
        # one host read (see attnkit._finite.finite).
        is_finite = term_finite = finite(q, k, v, *term_inputs)
        if not is_finite and term_inputs:
            is_finite, term_finite = finite(q, k, v), None
    if is_finite is None and not unchecked:
        is_finite = True
        if q.numel() and k.numel() and v.numel():
            work = torch.promote_types(q.dtype, torch.float32)
            q_norm, k_norm, v_max = sizes(q, k, v, work).tolist()
            is_finite = math.isfinite(q_norm + k_norm + v_max)
            plain = is_finite and softcap is None and bias is None and score_mod is None
            zero_offset = plain and small_scores(q_norm, k_norm, v_max, scale, tk, work)
    careful = not unchecked and not is_finite
    seed = (draw_seed() if seed is None else seed) if dropout_p else 0
    served = native_ok and not careful
    if native_ok and careful:
        why = "the eager kernel (non-finite values in q/k/v)"
    if plan is None or not served:
        plan = planned(mask, geo, h // hkv, term is not None, block_q, block_k, served)
    fast = None
    if served:
        fast = native_call(
            mask,
            geo,
            plan,
            scale=scale,
            softcap=softcap,
            dtype=q.dtype,
            p_drop=dropout_p,
            seed=seed,
            term=term,
            groups=h // hkv,
            register_tiles=register_tiles,
            skewed_position=skewed_position,
        )
    spec = _Spec(
        mask=mask,
        geo=geo,
        plan=plan,
        scale=scale,
        softcap=softcap,
        term=term,
        careful=careful,
        check_term=term is not None
        and not careful
        and (finite(*term_inputs) if term_finite is None else term_finite),
        has_bias=dense is not None,
        has_sinks=sinks is not None,
        n_term=len(term_inputs),
        fused_rows=fused_rows,
        native=fast,
        dropout=(dropout_p, seed) if dropout_p else None,
        score_mod=score_mod,
        zero_offset=zero_offset,
        kernel="native kernel" if why is None else why,
        unchecked=unchecked,
    )
    return spec, dense, term_inputs


def _wants_grads(*tensors: Tensor | None) -> bool:
    """Whether autograd will ask for a gradient of any of ``tensors``."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def native_serves(
    device: torch.device,
    term: ScoreTerm | None,
    careful: bool,
    native: bool,
    geo: Geometry | None = None,
) -> bool:
    """Whether the native kernel runs a call (see :func:`attnkit._native.kernel.refusal`),
    loading it, or building it on first use, if it would."""
    why = refusal(
        native=native,
        device=device,
        term=term,
        score_mod=False,
        finite=False if careful else None,
        geo=geo,
        build=True,
    )
    return why is None


def native_arguments(
    spec: _Spec,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    term_inputs: tuple[Tensor, ...] = (),
) -> tuple[tuple[Tensor | None, ...], dict[str, object]]:
    """``(args, kwargs)`` of ``torch.ops.attnkit.native_forward`` for a call that
    :func:`plan_call` planned for the native kernel (``spec.native`` set): what the kernel is
    called with, for calling the operator directly (tests, measurements)."""
    if spec.native is None:
        raise ValueError(f"the native kernel does not serve this call: {spec.kernel}")
    q5, k4, v4, bias5 = _layout(spec, q, k, v, bias, native=True)
    return spec.native.tensors(q5, k4, v4, bias5, term_inputs), spec.native.settings()
