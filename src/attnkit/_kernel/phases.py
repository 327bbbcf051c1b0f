"""The kernel's forward and backward on a planned call: the one pair of phases that every way of
running the kernel takes.

A :class:`KernelSpec` is what both passes read, decided once: the call's plan and numbers, and
which kernel runs them (the native operator's marshalled call, or the eager kernel).
:func:`kernel_forward` and :func:`kernel_backward` run it on tensors in the kernel's layout, q
``(N, Hkv, G, Tq, Dk)``, k and v ``(N, Hkv, Tk, D)``, their results in the work dtype:

* on a whole call, in :mod:`attnkit._kernel.call` (which lays the call out, checks its score term
  and folds in its sinks): what the ``chunked`` backend's autograd function runs eagerly and
  attnkit's operator (:mod:`attnkit._kernel.operator`) inside compiled and exported graphs;
* on a rectangle of a call, in :mod:`attnkit._kernel.rect`: what ring attention runs for each
  pair of shards.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .._native.kernel import NativeCall
from .._score_mod import ScoreMod
from ..masks import Geometry, Mask
from ..scores import ScoreTerm
from .backward import Grads, backward
from .forward import forward
from .plan import BlockPlan
from .problem import Problem

__all__ = ["KernelSpec", "kernel_backward", "kernel_forward"]


@dataclass(frozen=True)
class KernelSpec:
    """What a planned call's forward and backward share besides its tensors: the call, its plan,
    and the kernel that runs it."""

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
    #: which kernel runs the call, in explain()'s words (see attnkit._kernel.choice.refusal)
    kernel: str = "native kernel"
    #: q, k and v were not read for NaN and inf beforehand: the native kernel's decode path,
    #: which handles them itself, serves an inference call (see attnkit._kernel.call.plan_call)
    unchecked: bool = False
    #: int8/float8 k and v's (k_scale, v_scale), each broadcastable to (*batch, Hkv, Tk, 1),
    #: where the native decode path reads them in place (see attnkit._kernel.call)
    scales: tuple[Tensor, Tensor] | None = None
    #: where the planned queries and keys start in ``geo`` (a rectangle of the call, see
    #: attnkit._kernel.rect), as the eager kernel asks the mask and the term about them
    starts: tuple[int, int] = (0, 0)


def _problem(
    spec: KernelSpec,
    q5: Tensor,
    k4: Tensor,
    v4: Tensor,
    bias5: Tensor | None,
    term_inputs: tuple[Tensor, ...],
    mod_inputs: tuple[Tensor, ...],
) -> Problem:
    """The eager kernel's :class:`Problem` (keys and values as ``(N * Hkv, Tk, D)``)."""
    return Problem(
        q5=q5,
        k3=k4.flatten(0, 1),
        v3=v4.flatten(0, 1),
        scale=spec.scale,
        plan=spec.plan.grid,
        geo=spec.geo,
        mask=spec.mask,
        bias5=bias5,
        softcap=spec.softcap,
        term=spec.term,
        term_inputs=term_inputs,
        q_start=spec.starts[0],
        k_start=spec.starts[1],
        careful=spec.careful,
        fused_rows=spec.fused_rows,
        dropout=spec.dropout,
        score_mod=spec.score_mod,
        mod_inputs=mod_inputs,
        zero_offset=spec.zero_offset,
    )


def kernel_forward(
    spec: KernelSpec,
    q5: Tensor,
    k4: Tensor,
    v4: Tensor,
    bias5: Tensor | None,
    term_inputs: tuple[Tensor, ...] = (),
    mod_inputs: tuple[Tensor, ...] = (),
    *,
    reduced_out: bool = False,
    scales: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out5 (N, Hkv, G, Tq, Dv), lse (N, Hkv, G, Tq))`` of a planned call in the work dtype,
    ``-inf`` for a row with no visible key, whose output is 0; no sinks (see
    :func:`attnkit._kernel.sinks.finish`). ``bias5``: a dense bias ``(N|1, Hkv|1, G|1, Tq|1,
    Tk|1)``; ``term_inputs``: the score term's inputs; ``mod_inputs``: the tensors a score_mod
    captures. On the native kernel only: ``reduced_out`` (out5 in bfloat16 when q, k and v are,
    see :meth:`attnkit._native.kernel.NativeCall.tensors`) and ``scales`` (int8/float8 k4 and
    v4's, float32 ``(N, Hkv, Tk)``)."""
    if spec.native is not None:
        return spec.native.forward(q5, k4, v4, bias5, term_inputs, reduced_out, scales)
    return forward(_problem(spec, q5, k4, v4, bias5, term_inputs, mod_inputs))


def kernel_backward(
    spec: KernelSpec,
    q5: Tensor,
    k4: Tensor,
    v4: Tensor,
    bias5: Tensor | None,
    rows: tuple[Tensor, Tensor, Tensor, Tensor],
    *,
    bias_grad: bool,
    term_inputs: tuple[Tensor, ...] = (),
    mod_inputs: tuple[Tensor, ...] = (),
    term_needs: tuple[bool, ...] = (),
    grads_out: tuple[Tensor, Tensor, Tensor] | None = None,
    fold: bool | None = None,
) -> Grads:
    """The gradients of a planned call in the work dtype, from its forward's rows ``(out5, lse,
    delta, dout5)`` (the final output and log-sum-exp of every key the queries see; ``delta``
    = rowsum(dO * O), less the log-sum-exp's gradient): dq ``(N, Hkv, G, Tq, Dk)``, dk and dv
    ``(N, Hkv, Tk, D)``, the bias's in bias5's shape where ``bias_grad`` asks, the term inputs'
    that ``term_needs`` asks (the eager kernel: those that require grad), the score_mod's
    captured tensors'. ``grads_out``: tensors to write the native kernel's dq, dk and dv into;
    ``fold``: see :func:`attnkit._kernel.backward.backward`."""
    out5, lse, delta, dout5 = rows
    if spec.native is not None:
        dq, dk, dv, dbias5, dterm = spec.native.backward(
            q5, k4, v4, bias5, dout5, lse, delta, bias_grad, term_inputs, term_needs, grads_out
        )
        return Grads(dq, dk, dv, dbias5, dterm, [None] * len(mod_inputs))
    grads = backward(
        _problem(spec, q5, k4, v4, bias5, term_inputs, mod_inputs),
        out5,
        lse,
        delta,
        dout5,
        bias_grad=bias_grad,
        term_grads=any(term_needs),
        fold=fold,
    )
    grads.dk = grads.dk.unflatten(0, k4.shape[:2])
    grads.dv = grads.dv.unflatten(0, v4.shape[:2])
    return grads
