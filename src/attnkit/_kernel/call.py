"""The kernel on a whole call: the choice of kernel and plan (:mod:`attnkit._kernel.choice`) put
together with the native operator's arguments, and its forward and backward as one autograd
function.

:func:`kernel_attention` is what the ``chunked`` backend runs. Its parts: :func:`plan_call` (the
call's :class:`~attnkit._kernel.phases.KernelSpec`), and :func:`run_forward` and
:func:`run_backward`, which lay a whole call out for the kernel's own two phases
(:func:`~attnkit._kernel.phases.kernel_forward`, :func:`~attnkit._kernel.phases.kernel_backward`),
check its score term and fold in its sinks. Two autograd entries adapt them, each in its own
terms: :class:`_KernelAttention` in eager mode, holding the spec itself; attnkit's operator
(:mod:`attnkit._kernel.operator`) inside compiled and exported graphs, whose arguments say the
call as text and tensors and whose backward is an operator of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._base.checks import dtype_str
from .._base.finite import finite, finite_if_readable
from .._base.quantized import dequantize
from .._base.records import made
from .._native.kernel import native_call, scale_rows
from .._record import note_kernel
from .._score_mod import ScoreMod
from ..masks import Geometry, KeyIndices, Mask
from ..modules._packing import joint_grads
from ..scores import ScoreTerm, term_error
from . import FUSED_ROWS, delta_of, draw_seed, finish, no_autocast, sink_grad
from .backward import first_order
from .choice import choose, quantized_decode
from .gathered import gathered_attention
from .phases import KernelSpec, kernel_backward, kernel_forward
from .plan import BlockPlan

__all__ = [
    "kernel_attention",
    "native_arguments",
    "plan_call",
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


def _check_term(
    term: ScoreTerm,
    lse: Tensor,
    unchecked: tuple[Tensor, ...] | Callable[[], tuple[Tensor, ...]] = (),
) -> None:
    """Raise when a score term gave NaN or +inf at a visible pair (one host synchronisation).

    With finite q, k, v and term inputs (and a bias already checked), only the term can make a
    visible score NaN or +inf, and any such score makes its row's log-sum-exp NaN or +inf: one
    look at the ``(B, H, Tq)`` log-sum-exp replaces a pass over every tile. (Scores overflowing
    the work dtype, ``|q . k| * scale`` beyond 3e38 in float32, would read the same.)
    ``unchecked``: q, k and v when they were not read beforehand (the decode path), or what
    gives them (quantized keys and values, dequantized only then): they are read only when the
    log-sum-exp says something is not finite, and a NaN they hold is theirs.
    """
    if not lse.numel():
        return
    top = float(lse.max())  # NaN propagates through max; -inf rows (no visible key) are fine
    if math.isnan(top) or top == math.inf:
        tensors = unchecked() if callable(unchecked) else unchecked
        if not tensors or finite(*tensors):
            raise term_error(term)


def _layout(
    spec: KernelSpec, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """q, k, v and a dense bias in the kernel's layout (see :mod:`attnkit._kernel.phases`): q
    ``(N, Hkv, G, Tq, Dk)``, k and v ``(N, Hkv, Tk, D)``, views at the caller's strides where
    they can be."""
    n = spec.geo.batch
    qs, ks, vs = q.shape, k.shape, v.shape
    hkv = ks[-3]
    k4, v4 = (n, hkv, ks[-2], ks[-1]), (n, hkv, vs[-2], vs[-1])
    return (
        q.reshape(n, hkv, qs[-3] // hkv, qs[-2], qs[-1]),
        # (keys and values already (N, Hkv, Tk, D), the common 4-d call, are taken as they are)
        k if ks == k4 else k.reshape(k4),
        v if vs == v4 else v.reshape(v4),
        None if bias is None else _as_5d(bias, spec.geo.batch_shape, n, hkv),
    )


def run_forward(
    spec: KernelSpec,
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
    if not q.shape[:-1].numel():  # no query rows at all (an empty batch, no heads or queries)
        work = torch.promote_types(q.dtype, torch.float32)
        out5 = q.new_zeros((spec.geo.batch, k.size(-3), 0, q.size(-2), v.size(-1)), dtype=work)
        lse5 = q.new_zeros(out5.shape[:-1], dtype=work)
        return (
            q.new_zeros((*q.shape[:-1], v.size(-1))),
            q.new_zeros(q.shape[:-1], dtype=work),
            out5,
            lse5,
        )
    out5, lse = _forward(spec, q, k, v, bias, sinks, extra, for_backward)
    # (B, Hkv, G, Tq) -> (..., H, Tq): the natural-log log-sum-exp, the sinks' share included
    # (a copy when lse is kept for the backward, which a caller's in-place change must not reach).
    lse_out = lse.flatten(1, 2)
    if lse_out.shape != q.shape[:-1]:
        lse_out = lse_out.reshape(q.shape[:-1])
    return _output(out5, q, v), lse_out.clone() if for_backward else lse_out, out5, lse


def _forward(
    spec: KernelSpec,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    sinks: Tensor | None,
    extra: tuple[Tensor, ...],
    for_backward: bool,
) -> tuple[Tensor, Tensor]:
    """:func:`run_forward`'s ``(out5, lse5)`` of a call with query rows."""
    term_inputs, mod_inputs = extra[: spec.n_term], extra[spec.n_term :]
    with no_autocast(q.device):
        q5, k4, v4, bias5 = _layout(spec, q, k, v, bias)
        scales = None
        if spec.scales is not None:
            n = spec.geo.batch
            scales = (scale_rows(spec.scales[0], k, n), scale_rows(spec.scales[1], v, n))
        out5, lse = kernel_forward(
            spec,
            q5,
            k4,
            v4,
            bias5,
            term_inputs,
            mod_inputs,
            # (sinks rescale the output after the kernel: in the work dtype)
            reduced_out=not for_backward and sinks is None,
            scales=scales,
        )
        if spec.check_term and spec.term is not None:
            _check_term(spec.term, lse, _unchecked(spec, q, k, v))
        sinks2 = None if sinks is None else sinks.view(k.size(-3), -1)
        return finish(out5, lse, sinks2)


def _output(out5: Tensor, q: Tensor, v: Tensor) -> Tensor:
    """The output in q's layout and dtype."""
    # (B, Hkv, G, Tq, Dv) laid out as (B, Tq, H, Dv): a view of q's shape, like torch's SDPA.
    out = out5.flatten(1, 2)
    shape = (*q.shape[:-1], v.size(-1))
    if out.shape != shape:  # (several batch dims, or none)
        out = out.reshape(shape)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def run_backward(
    spec: KernelSpec,
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
    are views of one (see :func:`attnkit.modules._packing.joint_grads`)."""
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
        q5, k4, v4, bias5 = _layout(spec, q, k, v, bias)
        packed = joint_grads(q, k, v) if joint and spec.native is not None else None
        grads = kernel_backward(
            spec,
            q5,
            k4,
            v4,
            bias5,
            (out5, lse, delta, dout5),
            bias_grad=bias is not None and needs[3],
            term_inputs=term_inputs,
            mod_inputs=mod_inputs,
            term_needs=tuple(needs[5 : 5 + spec.n_term]),
            grads_out=None if packed is None else _layout(spec, *packed, None)[:3],
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


def _unchecked(
    spec: KernelSpec, q: Tensor, k: Tensor, v: Tensor
) -> tuple[Tensor, ...] | Callable[[], tuple[Tensor, ...]]:
    """What :func:`_check_term` reads when a call's log-sum-exp is not finite: q, k and v when
    they were not read beforehand, dequantized where they are int8/float8; else nothing."""
    if not spec.unchecked:
        return ()
    scales = spec.scales
    if scales is None:
        return (q, k, v)
    return lambda: (q, dequantize(k, scales[0], q.dtype), dequantize(v, scales[1], q.dtype))


class _KernelAttention(torch.autograd.Function):
    """The eager autograd entry: :func:`run_forward` and :func:`run_backward` on a spec planned
    once, saved with the tensors. (A call through attnkit's operator instead would serialise its
    mask and dispatch twice per step: the operator is for graphs, where a spec cannot travel.)"""

    # The forward apart from its context, as torch.func's transforms (grad, vjp, jacrev, vmap)
    # need it; under vmap, torch runs the forward and backward per batch of examples.
    generate_vmap_rule = True

    @staticmethod
    def forward(
        spec: KernelSpec,
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
    @first_order
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        dout: Tensor | None,
        dlse: Tensor | None,
        *unused: Tensor | None,
    ) -> tuple[Tensor | None, ...]:
        spec: KernelSpec = ctx.spec  # type: ignore[attr-defined]
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
    kv_scales: tuple[Tensor, Tensor] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Run the kernel on a validated call (what the ``chunked`` backend does): :func:`plan_call`,
    then the forward, differentiable (``return_lse``: also return the natural-log log-sum-exp
    ``(..., H, Tq)``, differentiable too; ``captured``: the tensors the ``score_mod`` captures
    that need gradients, which receive theirs). ``kv_scales``: int8/float8 k and v's
    ``(k_scale, v_scale)`` (see :mod:`attnkit._base.quantized`), read in place by the native
    decode path, else dequantized first (:func:`attnkit._kernel.choice.quantized_refusal`)."""
    quantized, decode = "", None
    if kv_scales is not None:
        why, decode = _quantized_refusal(
            q, k, mask, bias, sinks, block_q, block_k, native, score_mod, kv_scales
        )
        if why is None:
            quantized, is_finite = f"{dtype_str(k.dtype)} k and v read in place", None
        else:
            quantized = f"on {dtype_str(k.dtype)} k and v dequantized first: {why}"
            k, v = dequantize(k, kv_scales[0], q.dtype), dequantize(v, kv_scales[1], q.dtype)
            kv_scales = None
    # An index mask, alone or joined with others: each query's selected keys gathered (a call
    # without a mask, or with one mask of another kind, holds none).
    if mask is not None and (mask.op is not None or isinstance(mask, KeyIndices)):
        served = gathered_attention(
            q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap, sinks=sinks,
            score_mod=score_mod, captured=captured, dropout_p=dropout_p, return_lse=return_lse,
            is_finite=is_finite, native=native,
        )  # fmt: skip
        if served is not None:
            return served
    # (asked once, here and for the plan; a score term's inputs are asked for by the plan)
    wants_grads = None
    if not isinstance(bias, ScoreTerm):
        wants_grads = _wants_grads(q, k, v, bias, sinks)
    spec, dense, term_inputs = plan_call(
        q,
        k,
        v,
        wants_grads=wants_grads,
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
        quantized=(kv_scales, quantized) if quantized else None,
        decode=decode,
    )
    note_kernel(spec.kernel)
    extra = (*term_inputs, *captured)
    if wants_grads is None:
        wants_grads = _wants_grads(q, k, v, dense, sinks, *term_inputs)
    if wants_grads or (captured and _wants_grads(*captured)):
        out, lse = _apply(spec, q, k, v, dense, sinks, *extra)
    else:  # no graph to record: the forward alone (autograd.Function's own costs are a
        # sizable part of a small decode step's)
        out, lse = run_forward(spec, q, k, v, dense, sinks, extra, for_backward=False)[:2]
    return (out, lse) if return_lse else out


def _quantized_refusal(
    q: Tensor,
    k: Tensor,
    mask: Mask | None,
    bias: Tensor | ScoreTerm | None,
    sinks: Tensor | None,
    block_q: int | None,
    block_k: int | None,
    native: bool,
    score_mod: ScoreMod | None,
    kv_scales: tuple[Tensor, Tensor],
) -> tuple[str | None, tuple[Geometry, BlockPlan] | None]:
    """:func:`attnkit._kernel.choice.quantized_refusal` for a call about to run, and where it is
    None the call's geometry and decode plan (:func:`plan_call`'s ``decode``)."""
    term = bias if isinstance(bias, ScoreTerm) else None
    inputs = () if term is None else tuple(term.inputs())
    dense = bias if isinstance(bias, Tensor) else None
    geo = Geometry(tuple(q.shape[:-3]), q.size(-3), q.size(-2), k.size(-2), q.device)
    why, plan = quantized_decode(
        q,
        mask=mask,
        geo=geo,
        groups=q.size(-3) // k.size(-3),
        term=term,
        block_q=block_q,
        block_k=block_k,
        native=native,
        score_mod=score_mod is not None,
        wants_grads=_wants_grads(q, dense, sinks, *inputs, *kv_scales),
    )
    # The native read scales each product, (q . k) s, where the formula scales each element,
    # q . (k s): the same for finite scales, not for an inf one (inf - inf within the sum is the
    # formula's NaN). The scales are a small fraction of the bytes the call reads; under
    # torch.func.vmap none can be read, and the keys and values are dequantized first.
    readable = None if why is not None else finite_if_readable(*kv_scales)
    if why is None and readable is None:
        return "the scales cannot be read (torch.func.vmap)", None
    if why is None and not readable:
        return (
            "a scale is NaN or inf (the formula's products of its elements decide the values)",
            None,
        )
    return why, None if why is not None or plan is None else (geo, plan)


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
    wants_grads: bool | None = None,
    quantized: tuple[tuple[Tensor, Tensor] | None, str] | None = None,
    decode: tuple[Geometry, BlockPlan] | None = None,
) -> tuple[KernelSpec, Tensor | None, tuple[Tensor, ...]]:
    """Everything a call's forward and backward share, decided once: ``(spec, dense bias, the
    score term's inputs)``. The kernel and its plan are :func:`attnkit._kernel.choice.choose`'s
    (``is_finite``: whether q, k and v hold only finite values, if the caller knows; None: find
    out); for the native kernel, its arguments are :func:`attnkit._native.kernel.native_call`'s.
    ``score_mod``: applied to each tile.

    ``native``: use the native kernel where it computes the same thing (see
    :func:`attnkit._kernel.choice.refusal`; never with a ``score_mod``). ``dropout_p``: both
    kernels drop the same pairs for ``seed`` (None: one drawn from torch's generator, see
    :mod:`attnkit._kernel.dropout`). ``wants_grads``: whether autograd will ask for a gradient
    of q, k, v, the bias, the sinks or the term's inputs, if the caller found out (None: find
    out). ``quantized``: for int8/float8 k and v, ``(scales, words)``: their ``(k_scale, v_scale)``
    where the native decode path reads them in place (else None: they were dequantized first),
    and the words that say how, which follow the kernel's in parentheses. ``decode``: the call's
    geometry and the decode plan the native decode path serves it with, where the caller found
    them (see :func:`attnkit._kernel.choice.quantized_decode`): not decided a second time."""
    term = bias if isinstance(bias, ScoreTerm) else None
    dense = bias if isinstance(bias, Tensor) else None
    term_inputs = () if term is None else tuple(term.inputs())
    qs = q.shape
    if decode is None:
        geo = Geometry(tuple(qs[:-3]), qs[-3], qs[-2], k.size(-2), q.device)
    else:
        geo = decode[0]
    choice = choose(
        q,
        k,
        v,
        mask=mask,
        geo=geo,
        term=term,
        term_inputs=term_inputs,
        block_q=block_q,
        block_k=block_k,
        is_finite=is_finite,
        native=native,
        score_mod=score_mod is not None,
        wants_grads=(
            _wants_grads(q, k, v, dense, sinks, *term_inputs)
            if wants_grads is None
            else wants_grads
        ),
        plain=softcap is None and bias is None and score_mod is None,
        scale=scale,
        decode=None if decode is None else decode[1],
    )
    seed = (draw_seed() if seed is None else seed) if dropout_p else 0
    fast = None
    if choice.why is None:
        fast = native_call(
            choice.plan,
            geo,
            scale=scale,
            softcap=softcap,
            dtype=q.dtype,
            p_drop=dropout_p,
            seed=seed,
            term=term,
            groups=q.size(-3) // k.size(-3),
            register_tiles=register_tiles,
            skewed_position=skewed_position,
        )
    kernel = "native kernel" if choice.why is None else choice.why
    spec = made(
        KernelSpec,
        mask=mask,
        geo=geo,
        plan=choice.plan,
        scale=scale,
        softcap=softcap,
        term=term,
        careful=choice.careful,
        check_term=choice.check_term,
        has_bias=dense is not None,
        has_sinks=sinks is not None,
        n_term=len(term_inputs),
        fused_rows=fused_rows,
        native=fast,
        dropout=(dropout_p, seed) if dropout_p else None,
        score_mod=score_mod,
        zero_offset=choice.zero_offset,
        kernel=kernel if quantized is None else f"{kernel} ({quantized[1]})",
        unchecked=choice.unchecked,
        scales=None if quantized is None else quantized[0],
    )
    return spec, dense, term_inputs


def _wants_grads(*tensors: Tensor | None) -> bool:
    """Whether autograd will ask for a gradient of any of ``tensors``."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def native_arguments(
    spec: KernelSpec,
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
    q5, k4, v4, bias5 = _layout(spec, q, k, v, bias)
    return spec.native.tensors(q5, k4, v4, bias5, term_inputs), spec.native.settings()
