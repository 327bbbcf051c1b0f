"""attnkit's kernel on a whole call as one PyTorch operator: ``torch.ops.attnkit.attention``.

Inside ``torch.compile`` and ``torch.export`` a call's plan cannot be made while tracing (it is
read from the mask's data and the call's sizes, and the kernel's loop would unroll per block), so
the ``chunked`` backend hands the traced call to this operator instead: the graph holds one node,
and at run time the operator does what the backend does in eager mode (:mod:`attnkit._kernel.call`:
validate the mask against the call, plan it or take the kept plan, check the inputs, run the
native kernel or the eager one) in O(T) memory, through the same forward and backward as an
eager call (:func:`attnkit._kernel.call.run_forward`, :func:`~attnkit._kernel.call.run_backward`,
over the kernel's two phases in :mod:`attnkit._kernel.phases`). Its backward is a second
operator, ``torch.ops.attnkit.attention_backward``, registered as its autograd formula.

A call with an index mask (:func:`attnkit.masks.key_indices`, :func:`~attnkit.masks.block_indices`)
runs where an eager call runs it, by the same rules
(:func:`attnkit._kernel.gathered.gathered_call`): on the gathered kernel, which reads each
query's selected keys (O(Tq * k) time and memory), or on the scanning kernel where that one
serves it (too many keys a query, dropout, NaN or inf in q, k or v, ...). The choice reads the
indices and the inputs, so it is made when the operator runs, not while tracing: a graph holds
one node whichever kernel serves, and new indices run it without a new trace. The backward
operator asks the same question of the same tensors, so it takes the forward's kernel.

The mask and the score term travel as text plus tensors (:func:`attnkit.masks.encode`,
:func:`attnkit.scores.encode_term`), so a graph's arguments say the whole call. Outputs are
laid out as q is (token-major when q is a transposed ``(B, T, H, D)`` view), which the fake
kernel reproduces; the log-sum-exp is in the work dtype (float32 for half inputs).

Dropout's seed is drawn in the graph (``torch.randint``) and passed in, so that the forward and
the backward drop the same pairs however the graph is partitioned; a compiled graph draws it
from its own generator, so its pattern differs from an eager call's under the same
``torch.manual_seed``, as torch's own dropout does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._base.finite import finite
from .._call import check_attention_args
from .._record import Dispatch, recording
from ..masks import Geometry, Mask, decode, encode
from ..scores import ScoreTerm, decode_term, encode_term
from .call import plan_call, run_backward, run_forward
from .gathered import Gathered, gathered_backward, gathered_call, gathered_forward

__all__ = ["attention_op", "traceable", "traced_attention"]


def _work(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _like_q(q: Tensor, dv: int) -> Tensor:
    """An empty output of ``(..., H, Tq, dv)`` laid out as q is: token-major when q's rows are
    (its Tq stride exceeds its H stride), else contiguous."""
    shape = (*q.shape[:-1], dv)
    if q.dim() >= 3 and q.size(-2) > 1 and q.size(-3) > 1 and q.stride(-2) > q.stride(-3):
        t = q.new_empty((*q.shape[:-3], q.size(-2), q.size(-3), dv))
        return t.transpose(-3, -2)
    return q.new_empty(shape)


def _optional(x: int) -> int | None:
    return None if x < 0 else x


def _decoded(
    q: Tensor,
    k: Tensor,
    mask_tensors: list[Tensor],
    term_tensors: list[Tensor],
    numbers: list[int],
    settings: dict[str, Any],
) -> tuple[Mask | None, ScoreTerm | None]:
    """The call's mask and score term, the mask checked against the call: while tracing only its
    structure could be."""
    mask = decode(settings["mask"], mask_tensors, numbers)
    term = decode_term(settings["term"], term_tensors, numbers)
    if mask is not None:
        geo = Geometry(tuple(q.shape[:-3]), q.size(-3), q.size(-2), k.size(-2), q.device)
        mask.check(geo, "mask")
    return mask, term


def _gathered(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    added: Tensor | ScoreTerm | None,
    mask: Mask | None,
    settings: dict[str, Any],
) -> tuple[Gathered, str] | None:
    """The gathered kernel's call where it serves this one, by the rules of an eager call (see
    :func:`attnkit._kernel.gathered.gathered_call`): an index mask runs in O(Tq * k) in a graph
    too. The operator's forward and its backward ask alike, of the same tensors."""
    return gathered_call(
        q, k, v, mask=mask, bias=added, scale=settings["scale"], softcap=settings["softcap"],
        score_mod=None, n_captured=0, dropout_p=settings["dropout_p"], is_finite=None,
        native=settings["native"],
    )  # fmt: skip


def _planned(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    added: Tensor | ScoreTerm | None,
    sinks: Tensor | None,
    mask: Mask | None,
    seed: Tensor | None,
    settings: dict[str, Any],
    is_finite: bool | None = None,
) -> tuple[Any, Tensor | None, tuple[Tensor, ...]]:
    """The call's plan (see :func:`attnkit._kernel.call.plan_call`)."""
    return plan_call(
        q,
        k,
        v,
        mask=mask,
        bias=added,
        scale=settings["scale"],
        softcap=settings["softcap"],
        sinks=sinks,
        block_q=_optional(settings["block_q"]) or None,
        block_k=_optional(settings["block_k"]) or None,
        fused_rows=_optional(settings["fused_rows"]),
        native=settings["native"],
        is_finite=is_finite,
        dropout_p=settings["dropout_p"],
        seed=None if seed is None else int(seed),
        register_tiles=settings["register_tiles"],
        skewed_position=settings["skewed_position"],
    )


def _record(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None,
    added: Tensor | ScoreTerm | None,
    sinks: Tensor | None,
    kernel: str,
    settings: dict[str, Any],
) -> None:
    """Inside a compiled graph the dispatcher ran while tracing: a call that runs records itself
    here, as the chunked backend's, with the kernel that serves it (``kernel``, in the words an
    eager call records)."""
    record = recording()
    if record is None:
        return
    call = check_attention_args(
        q,
        k,
        v,
        mask=mask,
        bias=added,
        causal=False,
        scale=settings["scale"],
        softcap=settings["softcap"],
        sinks=sinks,
        dropout_p=settings["dropout_p"],
    )
    record.append(Dispatch(call, "chunked", kernel=kernel))


@torch.library.custom_op("attnkit::attention", mutates_args=())
def attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    sinks: Tensor | None,
    mask_tensors: list[Tensor],
    term_tensors: list[Tensor],
    seed: Tensor | None,
    *,
    numbers: list[int],
    mask: str,
    term: str,
    scale: float,
    softcap: float | None,
    dropout_p: float,
    block_q: int,
    block_k: int,
    fused_rows: int,
    native: bool,
    register_tiles: bool,
    skewed_position: bool,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of ``attention(q, k, v, ...)`` on attnkit's kernel: out ``(..., H, Tq, Dv)``
    in q's dtype and layout, lse ``(..., H, Tq)`` in the work dtype. ``mask``/``term``: text
    from :func:`attnkit.masks.encode` / :func:`attnkit.scores.encode_term` over
    ``mask_tensors``/``term_tensors`` and ``numbers`` (symbolic sizes while tracing with dynamic
    shapes); ``seed``: a 0-d int64 tensor when ``dropout_p > 0``;
    ``block_q``, ``block_k``, ``fused_rows``: -1 for the default / none."""
    settings = dict(
        mask=mask,
        term=term,
        scale=scale,
        softcap=softcap,
        dropout_p=dropout_p,
        block_q=block_q,
        block_k=block_k,
        fused_rows=fused_rows,
        native=native,
        register_tiles=register_tiles,
        skewed_position=skewed_position,
    )
    decoded, term_ = _decoded(q, k, mask_tensors, term_tensors, numbers, settings)
    added = term_ if term_ is not None else bias
    gathered = _gathered(q, k, v, added, decoded, settings)
    if gathered is not None:
        _record(q, k, v, decoded, added, sinks, gathered[1], settings)
        out, lse = gathered_forward(gathered[0], q, k, v, sinks)
        out, lse = out.to(q.dtype).reshape(*q.shape[:-1], v.size(-1)), lse.reshape(q.shape[:-1])
    else:
        spec, dense, term_inputs = _planned(q, k, v, added, sinks, decoded, seed, settings)
        _record(q, k, v, spec.mask, dense if dense is not None else spec.term, sinks,
                spec.kernel, settings)  # fmt: skip
        out, lse, _, _ = run_forward(spec, q, k, v, dense, sinks, term_inputs)
    laid = _like_q(q, v.size(-1))
    if laid.stride() != out.stride():
        laid.copy_(out)
        out = laid
    return out, lse


@attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
    return _like_q(q, v.size(-1)), q.new_empty(q.shape[:-1], dtype=_work(q.dtype))


@torch.library.custom_op("attnkit::attention_backward", mutates_args=())
def attention_backward_op(
    dout: Tensor,
    dlse: Tensor,
    out: Tensor,
    lse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    sinks: Tensor | None,
    mask_tensors: list[Tensor],
    term_tensors: list[Tensor],
    seed: Tensor | None,
    needs: list[bool],
    *,
    numbers: list[int],
    mask: str,
    term: str,
    scale: float,
    softcap: float | None,
    dropout_p: float,
    block_q: int,
    block_k: int,
    fused_rows: int,
    native: bool,
    register_tiles: bool,
    skewed_position: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """The gradients of :func:`attention_op`'s ``(q, k, v, bias, sinks, term_tensors)`` from
    its outputs' gradients (``dout``, ``dlse``; an empty tensor for an output not used), each
    an empty tensor where ``needs`` (q, k, v, bias, sinks, then one per term tensor) does not
    ask for it."""
    settings = dict(
        mask=mask,
        term=term,
        scale=scale,
        softcap=softcap,
        dropout_p=dropout_p,
        block_q=block_q,
        block_k=block_k,
        fused_rows=fused_rows,
        native=native,
        register_tiles=register_tiles,
        skewed_position=skewed_position,
    )
    decoded, term_ = _decoded(q, k, mask_tensors, term_tensors, numbers, settings)
    added = term_ if term_ is not None else bias
    given = (
        dout if dout.numel() or not out.numel() else None,
        dlse if dlse.numel() or not lse.numel() else None,
    )
    gathered = _gathered(q, k, v, added, decoded, settings)
    grads: tuple[Tensor | None, ...]
    if gathered is not None:
        grads = _gathered_grads(gathered[0], (q, k, v), (out, lse), bias, sinks, term_tensors,
                                given, needs)  # fmt: skip
    else:
        spec, dense, term_inputs = _planned(
            q, k, v, added, sinks, decoded, seed, settings, is_finite=finite(q, k, v)
        )
        work = _work(q.dtype)
        hkv = k.size(-3)
        n, g = spec.geo.batch, q.size(-3) // hkv  # g spelled out: -1 is ambiguous for B = 0
        out5 = out.to(work).reshape(n, hkv, g, q.size(-2), v.size(-1))
        lse5 = lse.to(work).reshape(n, hkv, g, q.size(-2))
        grads = run_backward(
            spec, q, k, v, out5, lse5, dense, sinks, term_inputs, *given, tuple(needs), joint=False
        )
    # An output not asked for is an empty tensor of its own (outputs may not alias each other).
    dq, dk, dv, dbias, dsinks, *dterm = (q.new_empty((0,)) if g is None else g for g in grads)
    return dq, dk, dv, dbias, dsinks, list(dterm)


def _gathered_grads(
    call: Gathered,
    qkv: tuple[Tensor, Tensor, Tensor],
    saved: tuple[Tensor, Tensor],
    bias: Tensor | None,
    sinks: Tensor | None,
    term_tensors: list[Tensor],
    given: tuple[Tensor | None, Tensor | None],
    needs: list[bool],
) -> tuple[Tensor | None, ...]:
    """:func:`attention_backward_op`'s gradients on the gathered kernel, from the forward's
    ``saved`` ``(out, lse)`` (laid out as q is; read in the work dtype, as the kernel saves
    them), None where ``needs`` does not ask."""
    q = qkv[0]
    work = _work(q.dtype)
    geo = call.geo
    out, lse = saved
    out4 = out.to(work).reshape(geo.batch, geo.heads, geo.q_len, out.size(-1))
    lse3 = lse.to(work).reshape(geo.batch, geo.heads, geo.q_len)
    wants = (bool(needs[3]), bool(needs[4]), any(needs[5:]))
    dq, dk, dv, dbias, dsinks, dterm = gathered_backward(
        call, qkv, (out4, lse3), (bias, sinks, tuple(term_tensors)), given, wants
    )
    found = (dq, dk, dv, dbias, dsinks, *dterm)
    inputs = (*qkv, bias, sinks, *term_tensors)
    return tuple(
        _laid_like(g, x) if need and g is not None and x is not None else None
        for g, x, need in zip(found, inputs, needs, strict=True)
    )


def _laid_like(grad: Tensor, x: Tensor) -> Tensor:
    """``grad`` laid out as its input ``x`` (a token-major q's gradient token-major too), as the
    fake kernel (``torch.empty_like``) says: a compiled graph reads it with those strides."""
    if grad.stride() == x.stride():
        return grad
    laid = torch.empty_like(x)
    laid.copy_(grad)
    return laid


@attention_backward_op.register_fake
def _(
    dout: Tensor,
    dlse: Tensor,
    out: Tensor,
    lse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    sinks: Tensor | None,
    mask_tensors: list[Tensor],
    term_tensors: list[Tensor],
    seed: Tensor | None,
    needs: list[bool],
    **kwargs: Any,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    def like(t: Tensor | None, need: bool) -> Tensor:
        return torch.empty_like(t) if need and t is not None else q.new_empty((0,))

    dterm = [like(t, need) for t, need in zip(term_tensors, needs[5:], strict=True)]
    return (
        like(q, needs[0]),
        like(k, needs[1]),
        like(v, needs[2]),
        like(bias, needs[3]),
        like(sinks, needs[4]),
        dterm,
    )


def _setup_context(
    ctx: Any, inputs: tuple[Any, ...], keyword_only_inputs: dict[str, Any], output: Any
) -> None:
    q, k, v, bias, sinks, mask_tensors, term_tensors, seed = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, bias, sinks, seed, out, lse, *mask_tensors, *term_tensors)
    ctx.counts = (len(mask_tensors), len(term_tensors))
    ctx.settings = dict(keyword_only_inputs)
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Any, ...]:
    """The operator's autograd entry: its backward is :func:`attention_backward_op`, an operator
    of its own (a graph holds it as one node too), which runs the kernel's backward phase
    (:func:`attnkit._kernel.call.run_backward`) on the call planned again from its arguments
    (the plan kept from the forward)."""
    q, k, v, bias, sinks, seed, out, lse, *rest = ctx.saved_tensors
    n_mask, n_term = ctx.counts
    mask_tensors, term_tensors = rest[:n_mask], rest[n_mask:]
    needs = ctx.needs_input_grad
    want_terms = list(needs[6]) if isinstance(needs[6], list | tuple) else [bool(needs[6])] * n_term
    flags = [bool(needs[0]), bool(needs[1]), bool(needs[2])]
    flags += [bool(needs[3]) and bias is not None, bool(needs[4]) and sinks is not None]
    flags += [bool(w) for w in want_terms]
    none = q.new_empty((0,))
    dq, dk, dv, dbias, dsinks, dterm = attention_backward_op(
        none if dout is None else dout,
        none if dlse is None else dlse,
        out,
        lse,
        q,
        k,
        v,
        bias,
        sinks,
        list(mask_tensors),
        list(term_tensors),
        seed,
        flags,
        **ctx.settings,
    )
    return (
        dq if flags[0] else None,
        dk if flags[1] else None,
        dv if flags[2] else None,
        dbias if flags[3] else None,
        dsinks if flags[4] else None,
        [None] * n_mask,
        [g if w else None for g, w in zip(dterm, flags[5:], strict=True)],
        None,
    )


attention_op.register_autograd(_backward, setup_context=_setup_context)


def traceable(mask: object, term: object) -> str | None:
    """Why a call with this mask and score term cannot be traced into :func:`attention_op`
    (None: it can)."""
    try:
        mask_text = encode(mask, [], [])  # type: ignore[arg-type]
        term_text = encode_term(term, [], [])  # type: ignore[arg-type]
    except TypeError as err:  # a symbolic float, say
        return f"the call's mask or score term cannot be traced into attnkit's operator ({err})"
    if mask_text is None:
        return (
            f"the mask {mask.describe()} cannot be traced into attnkit's operator (a from_fn "  # type: ignore[attr-defined]
            "mask or a mask class of one's own: its function would run inside the graph)"
        )
    if term_text is None:
        return f"the score term {term.describe()} cannot be traced into attnkit's operator"  # type: ignore[attr-defined]
    return None


def traced_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Any,
    bias: Tensor | None,
    term: ScoreTerm | None,
    sinks: Tensor | None,
    scale: float,
    softcap: float | None,
    dropout_p: float,
    block_q: int | None,
    block_k: int | None,
    fused_rows: int | None,
    native: bool,
    register_tiles: bool,
    skewed_position: bool,
) -> tuple[Tensor, Tensor]:
    """The chunked backend's call as one :func:`attention_op` node (what it runs while
    torch.compile or torch.export traces)."""
    mask_tensors: list[Tensor] = []
    term_tensors: list[Tensor] = []
    numbers: list[object] = []
    mask_text = encode(mask, mask_tensors, numbers)
    term_text = encode_term(term, term_tensors, numbers)
    if mask_text is None or term_text is None:
        raise RuntimeError("attnkit internal error: an untraceable call reached the operator")
    seed = None
    if dropout_p:
        seed = torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64)
    return torch.ops.attnkit.attention(  # type: ignore[no-any-return]
        q,
        k,
        v,
        bias,
        sinks,
        mask_tensors,
        term_tensors,
        seed,
        numbers=numbers,
        mask=mask_text,
        term=term_text,
        scale=float(scale),
        softcap=None if softcap is None else float(softcap),
        dropout_p=float(dropout_p),
        block_q=-1 if block_q is None else block_q,
        block_k=-1 if block_k is None else block_k,
        fused_rows=-1 if fused_rows is None else fused_rows,
        native=native,
        register_tiles=register_tiles,
        skewed_position=skewed_position,
    )
