"""Which kernel serves a call, decided once: the native kernel or the eager one, and on the native
kernel its decode path or its blocked forward.

:func:`refusal` is the one decision of whether the native kernel may serve a call, in the words
``explain()`` prints and :attr:`attnkit.Dispatch.kernel` records; :func:`choose` makes it for a
call about to run, reading its inputs once where it must (whether they are finite, and for the
eager kernel how large), and gives the call's :class:`~attnkit._kernel.plan.BlockPlan` for the
kernel it chose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._base.finite import finite, finite_if_readable
from .._call import AttentionCall
from .._native import load, loaded, status
from .._native.kernel import DECODE_QUERIES, fuses
from ..masks import Geometry, Mask
from ..scores import ScoreTerm
from .forward import sizes, small_scores
from .plan import BlockPlan
from .planning import decode_plan, planned

__all__ = [
    "Choice",
    "choose",
    "decode_sized",
    "decodes",
    "native_serves",
    "quantized_decode",
    "quantized_refusal",
    "refusal",
    "why_not_native",
]


def refusal(
    *,
    native: bool,
    device: torch.device,
    term: ScoreTerm | None,
    score_mod: bool,
    finite: bool | None,
    geo: Geometry | None,
    build: bool,
) -> str | None:
    """The one decision of which kernel serves a call: None when the native kernel does, else
    the words for the eager kernel and why (what ``explain()`` prints, what
    :attr:`attnkit.Dispatch.kernel` records). ``finite``: whether q, k, v (and the term's inputs)
    are finite (None: not known yet); ``build``: load the kernel, building it if needed (when a
    call is about to run), or only ask whether it would be available (questions never build)."""
    if not native:
        return "the eager kernel (Chunked(native=False))"
    if device.type != "cpu":
        return f"the eager kernel (the native kernel runs on CPUs, not {device.type})"
    if term is not None and not fuses(term, geo):
        return f"the eager kernel (the native kernel does not fuse the score term {term!r})"
    if score_mod:
        return "the eager kernel (the native kernel does not fuse a score_mod)"
    if finite is False:
        return "the eager kernel (non-finite values in q/k/v)"
    if build and load():
        return None
    if not torch.compiler.is_compiling() and loaded():  # no question of files or tools left
        return None  # (not asked while traced: the graph would guard on the library's state)
    available, why = status()
    return None if available and not build else f"the eager kernel (native kernel: {why})"


def why_not_native(call: AttentionCall, native: bool = True) -> str | None:
    """:func:`refusal` for a described call, without building anything."""
    return refusal(
        native=native,
        device=call.device,
        term=call.score_term,
        score_mod=call.score_mod is not None,
        finite=call.finite,
        geo=call.geometry,
        build=False,
    )


def native_serves(
    device: torch.device,
    term: ScoreTerm | None,
    careful: bool,
    native: bool,
    geo: Geometry | None = None,
) -> bool:
    """Whether the native kernel runs a call (see :func:`refusal`), loading it, or building it on
    first use, if it would."""
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


def decodes(plan: BlockPlan) -> bool:
    """Whether the native kernel runs a call of this plan on its decode path."""
    return plan.q_len <= min(plan.block_q, DECODE_QUERIES)


def decode_sized(q_len: int, block_q: int | None) -> bool:
    """Whether ``q_len`` queries take the native kernel's decode path: no more than one block of
    queries, and no more than the path's few rows (``DECODE_QUERIES``)."""
    return q_len <= min(block_q or q_len, DECODE_QUERIES)


@dataclass(frozen=True)
class Choice:
    """Which kernel runs a call, with which plan, and what was read of its inputs to decide."""

    plan: BlockPlan
    #: None: the native kernel; else the eager kernel and why, in explain()'s words
    why: str | None
    #: q, k or v hold NaN or inf: the eager kernel's careful mode
    careful: bool
    #: q, k and v were not read beforehand: the native kernel's decode path, which handles NaN
    #: and inf itself, serves an inference call
    unchecked: bool
    #: q, k, v and the term's inputs are finite: a non-finite log-sum-exp is the term's doing
    check_term: bool
    #: whether the eager kernel may take offset 0 throughout (None: its forward asks)
    zero_offset: bool | None


def choose(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | None,
    geo: Geometry,
    term: ScoreTerm | None,
    term_inputs: tuple[Tensor, ...],
    block_q: int | None,
    block_k: int | None,
    is_finite: bool | None,
    native: bool,
    score_mod: bool,
    wants_grads: bool,
    plain: bool,
    scale: float,
    decode: BlockPlan | None = None,
) -> Choice:
    """The kernel of a call about to run, and its plan (see :class:`Choice`).

    The native kernel serves the call if its inputs are finite (its blocked forward has no
    careful mode; its decode path has). ``is_finite``: whether q, k and v hold only finite values,
    if the caller knows (None: read them, in the same host read as the sizes that tell whether
    the eager kernel may take offset 0 throughout, see :func:`attnkit._kernel.sizes`);
    ``wants_grads``: autograd will ask for gradients; ``plain``: nothing but ``q k^T`` makes the
    scores (no softcap, bias, term or score_mod). ``decode``: the plan
    :func:`quantized_decode` gave the call, which the native kernel's decode path serves (an
    inference call whose inputs are not read beforehand), not decided a second time."""
    if decode is not None:
        return _decode_choice(decode, term, term_inputs)
    groups = q.size(-3) // k.size(-3)
    why = refusal(
        native=native,
        device=q.device,
        term=term,
        score_mod=score_mod,
        finite=None,
        geo=geo,
        build=True,
    )
    if is_finite is None and why is None and not wants_grads:
        plan = _decode(mask, geo, groups, term is not None, block_q, block_k)
        if plan is not None:
            return _decode_choice(plan, term, term_inputs)
    term_finite: bool | None = None
    zero_offset = None
    if is_finite is None and why is None:
        is_finite, term_finite = _read_finite(q, k, v, term_inputs)
    if is_finite is None:
        is_finite, zero_offset = _read_sizes(q, k, v, plain, scale, geo.kv_len)
    careful = not is_finite
    if why is None and careful:
        why = "the eager kernel (non-finite values in q/k/v)"
    plan = planned(mask, geo, groups, term is not None, block_q, block_k, why is None)
    check_term = (
        term is not None
        and not careful
        and (finite(*term_inputs) if term_finite is None else term_finite)
    )
    return Choice(plan, why, careful, False, check_term, zero_offset)


def _decode_choice(
    plan: BlockPlan, term: ScoreTerm | None, term_inputs: tuple[Tensor, ...]
) -> Choice:
    """The choice of an inference call that the native kernel's decode path serves on ``plan``,
    its inputs not read beforehand."""
    # (under torch.func.vmap no value can be read: nothing to check it against)
    check_term = term is not None and finite_if_readable(*term_inputs) is True
    return Choice(plan, None, False, True, check_term, None)


def quantized_refusal(
    q: Tensor,
    *,
    mask: Mask | None,
    geo: Geometry,
    groups: int,
    term: ScoreTerm | None,
    block_q: int | None,
    block_k: int | None,
    native: bool,
    score_mod: bool,
    wants_grads: bool,
) -> str | None:
    """None when the native kernel's decode path reads a call's int8/float8 keys and values in
    place (dequantized in registers, each product times its key's scale, each weight times its
    value's scale); else why they are dequantized first, in ``explain()``'s words. (Only the
    decode path reads them: the blocked forward and the backward take float keys and values.)"""
    return quantized_decode(
        q,
        mask=mask,
        geo=geo,
        groups=groups,
        term=term,
        block_q=block_q,
        block_k=block_k,
        native=native,
        score_mod=score_mod,
        wants_grads=wants_grads,
    )[0]


def quantized_decode(
    q: Tensor,
    *,
    mask: Mask | None,
    geo: Geometry,
    groups: int,
    term: ScoreTerm | None,
    block_q: int | None,
    block_k: int | None,
    native: bool,
    score_mod: bool,
    wants_grads: bool,
) -> tuple[str | None, BlockPlan | None]:
    """``(why, plan)``: :func:`quantized_refusal`'s answer, and where it is None the decode
    path's plan, which :func:`choose` takes for the call (``decode=``) rather than deciding
    again."""
    if wants_grads:
        return "a call that needs gradients (the native backward takes float keys and values)", None
    if q.dtype == torch.float64:
        return "float64 queries (the native kernel reads them with float32 products)", None
    if not decode_sized(geo.q_len, block_q):
        return (
            f"{geo.q_len} queries: the native kernel reads them on its decode path alone (at "
            f"most {DECODE_QUERIES} queries in one block)"
        ), None
    why = refusal(
        native=native,
        device=q.device,
        term=term,
        score_mod=score_mod,
        finite=None,
        geo=geo,
        build=True,
    )
    if why is not None:
        return f"{why} runs the call", None
    plan = _decode(mask, geo, groups, term is not None, block_q, block_k)
    if plan is None:
        return "the call's plan is not the decode path's", None
    return None, plan


def _decode(
    mask: Mask | None,
    geo: Geometry,
    groups: int,
    term: bool,
    block_q: int | None,
    block_k: int | None,
) -> BlockPlan | None:
    """The plan of an inference call the native kernel's decode path serves, which reads q, k
    and v once and takes care of NaN and inf itself (a call that needs gradients is read
    beforehand: the backward has no such care); None when the call is not one. (A decode plan's
    long key blocks are for the decode path alone.)"""
    if not decode_sized(geo.q_len, block_q):
        return None
    decode_mask, keys = decode_plan(mask, geo, block_k)
    plan = planned(decode_mask, geo, groups, term, block_q, keys, True)
    return plan if decodes(plan) else None


def _read_finite(
    q: Tensor, k: Tensor, v: Tensor, term_inputs: tuple[Tensor, ...]
) -> tuple[bool, bool | None]:
    """``(q, k and v are finite, the term's inputs are too)``: what the native kernel needs to
    know, in one host read (see :func:`attnkit._base.finite.finite`); the second None where not
    known."""
    ok = finite(q, k, v, *term_inputs)
    if not ok and term_inputs:
        return finite(q, k, v), None
    return ok, ok


def _read_sizes(
    q: Tensor, k: Tensor, v: Tensor, plain: bool, scale: float, kv_len: int
) -> tuple[bool, bool | None]:
    """``(q, k and v are finite, the eager kernel may take offset 0 throughout)``, from one host
    read of their sizes (see :func:`attnkit._kernel.sizes`)."""
    if not (q.numel() and k.numel() and v.numel()):
        return True, None
    work = torch.promote_types(q.dtype, torch.float32)
    q_norm, k_norm, v_max = sizes(q, k, v, work).tolist()
    ok = math.isfinite(q_norm + k_norm + v_max)
    return ok, ok and plain and small_scores(q_norm, k_norm, v_max, scale, kv_len, work)
