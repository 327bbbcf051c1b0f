"""The reference backend: attention as the formula reads. Every other backend is tested against it.

It materialises the ``(..., H, Tq, Tk)`` scores, so it is the slow path, and the only backend that
returns the attention weights. It is also what torch.compile/export trace for calls with a score
term; while tracing, the two data-dependent steps of the non-finite policy (keeping masked NaN out
of the gradients, marking outputs a non-finite value reaches) are left out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._ops import OpOverload

from .._base.checks import shape_str
from .._base.devices import slow_paths_cost_more, target
from .._base.transforms import transforms_active
from .._call import AttentionCall
from .._score_mod import ScoreMod, index_tensors
from .._score_mod import apply as apply_score_mod
from ..caches.view import row_mask, row_term
from ..masks import Geometry, Mask, decode
from ..scores import ScoreTerm, cap_scores, decode_term, term_error
from .base import Backend, CallInputs, Output

__all__ = ["Reference", "decompositions", "formula"]


def _batched(t: Tensor, batch: tuple[int, ...]) -> Tensor:
    """``(B|1, ...)`` with the batch dims flattened -> ``(*batch|1, ...)``."""
    return t.reshape(
        (*batch, *t.shape[1:]) if t.size(0) != 1 else (*(1,) * len(batch), *t.shape[1:])
    )


def _product(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` whose gradients never multiply a non-finite entry by 0: a NaN at a masked position
    must not reach any gradient. The values are the plain product's."""
    plain = a @ b
    if torch.compiler.is_compiling() or plain.device.type == "meta":  # no values to read
        return plain
    # (under torch.func's transforms, where vmap reads no value, always the careful product)
    if not transforms_active() and bool(torch.isfinite(a).all() & torch.isfinite(b).all()):
        return plain
    clean = a.masked_fill(~torch.isfinite(a), 0.0) @ b.masked_fill(~torch.isfinite(b), 0.0)
    return clean + (plain - clean).detach()


def _check_term(term: ScoreTerm, dense: Tensor, visible: Tensor) -> None:
    """Raise when the term holds NaN or +inf at a visible pair although its inputs are finite
    (where the values can be read: not under torch.func.vmap)."""
    if torch.compiler.is_compiling() or dense.device.type == "meta":
        return
    try:
        inputs = [t for t in term.inputs() if t.is_floating_point()]
        if not all(bool(torch.isfinite(t).all()) for t in inputs):
            return  # a NaN the inputs bring spreads like a NaN in q
        bad = bool((visible & ~(dense < math.inf)).any())  # NaN or +inf, where visible
    except RuntimeError:
        if not transforms_active():
            raise
        return
    if bad:
        raise term_error(term)


def formula(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | None,
    bias: Tensor | ScoreTerm | None,
    scale: float,
    softcap: float | None,
    sinks: Tensor | None,
    dropout_p: float,
    return_weights: bool,
    return_lse: bool = False,
    score_mod: ScoreMod | None = None,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """The formula the ``reference`` backend computes, written to be read: the spec. It takes a
    validated call's arguments (``mask`` one :class:`~attnkit.masks.Mask`, ``scale`` a float); to
    run it, call ``attnkit.attention(..., backend="reference")``."""
    # float16/bfloat16 run in float32; float64 stays float64 (it is the spec the tests compare to).
    work = torch.promote_types(q.dtype, torch.float32)
    batch, (h, tq, _), (hkv, tk, _) = tuple(q.shape[:-3]), q.shape[-3:], k.shape[-3:]
    qg = q.to(work).unflatten(-3, (hkv, -1))  # (..., Hkv, G, Tq, Dk): GQA without copying k, v
    kg, vg = k.to(work).unsqueeze(-3), v.to(work).unsqueeze(-3)  # (..., Hkv, 1, Tk, D)

    s = (_product(qg, kg.transpose(-1, -2)) * scale).flatten(-4, -3)  # (..., H, Tq, Tk)
    visible = torch.ones((), dtype=torch.bool, device=q.device)
    if mask is not None:
        geo = Geometry(batch, h, tq, tk, q.device)
        visible = _batched(mask.tile(geo, 0, tq, 0, tk), batch)  # (...|1, H|1, Tq|1, Tk|1)
    added = None
    if isinstance(bias, ScoreTerm):
        shape = Geometry(batch, h, tq, tk, q.device, work)
        added = _batched(bias.dense(bias.inputs(), shape), batch)
    elif bias is not None:
        added = bias
    if added is not None:
        visible = visible & (added != float("-inf"))  # -inf in a bias or term masks that pair
    if isinstance(bias, ScoreTerm) and added is not None:
        _check_term(bias, added, visible)
    if softcap is not None:
        # A masked score may be NaN (garbage in a padded key): cap 0 there, so that the gradient
        # of tanh, 0 * NaN, never reaches q or k.
        s = cap_scores(s.masked_fill(~visible, 0.0), softcap)
    if added is not None:
        s = s + added
    if score_mod is not None:  # on (B, H, Tq, Tk) with the batch dims flattened, as the kernel
        n = math.prod(batch)
        idx = index_tensors(n, h, 0, tq, 0, tk, q.device)
        # masked scores (maybe NaN garbage) enter as 0, as for the softcap: no 0 * NaN gradient
        s = s.masked_fill(~visible, 0.0).reshape(n, h, tq, tk)
        s = apply_score_mod(score_mod, s, idx).reshape(*batch, h, tq, tk)
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # one more logit per row, attending to nothing
        s = torch.cat([s, sinks.to(work)[:, None, None].expand(*s.shape[:-1], 1)], -1)
    # A row with no key to attend would be softmax(-inf, ..., -inf) = NaN: give it weights 0.
    empty = (s == float("-inf")).all(-1, keepdim=True)  # (..., H, Tq, 1)
    w = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    # (..., H, Tq), the sinks' share included; -inf (and no gradient) for a row with nothing.
    lse = torch.logsumexp(s.masked_fill(empty, 0.0), -1).masked_fill(empty[..., 0], float("-inf"))
    # (..., H, Tq, Tk): without the sink's share, and 0 at every masked pair, also in a row that
    # a NaN query made NaN (a masked pair influences no output, the weights included)
    w = w[..., :tk].masked_fill(~visible, 0.0)

    p = F.dropout(w, dropout_p) if dropout_p else w
    bad = ~torch.isfinite(vg)  # a non-finite value reaches exactly the outputs that see its key
    out = (p.unflatten(-3, (hkv, -1)) @ vg.masked_fill(bad, 0.0)).flatten(
        -4, -3
    )  # (..., H, Tq, Dv)
    # (under torch.func's transforms, which read no value, always; on meta, no value to read)
    readable = not torch.compiler.is_compiling() and q.device.type != "meta"
    if readable and (transforms_active() or bool(bad.any())):
        seen = visible.expand(*w.shape).unflatten(-3, (hkv, -1)).to(work) @ bad.to(work)
        out = out.masked_fill(seen.flatten(-4, -3) > 0, float("nan"))
    result: Tensor = out.to(q.dtype)
    extra = [w.to(q.dtype)] if return_weights else []
    extra += [lse] if return_lse else []
    return (result, *extra) if extra else result  # type: ignore[return-value]


class Reference(Backend):
    """The reference as a backend: it serves every call, and ``auto`` takes it only when nothing
    else can (it materialises the scores). A call on a cache it computes on each row's keys,
    gathered (:meth:`~attnkit.caches.view.CacheView.attend_rows`)."""

    accepts_score_mod = True
    accepts_cache = True

    def __init__(self) -> None:
        super().__init__("reference")

    def cost(self, call: AttentionCall) -> list[str]:
        return [
            f"would materialise the scores (..., H, Tq, Tk) = {shape_str(call.scores_shape)}; "
            "auto takes it only when nothing else can"
        ]

    def slower(self, call: AttentionCall) -> list[str]:
        # On a GPU auto weighs a slow path above a cost (attnkit._base.devices): saying both keeps
        # the reference the last resort there too, behind attnkit's eager kernel.
        if not slow_paths_cost_more(target(call.device)):
            return []
        return ["computes the formula operation by operation, the scores written out"]

    def run(self, call: AttentionCall, inputs: CallInputs) -> Output:
        if call.cache is not None:

            def dense(q: Tensor, k: Tensor, v: Tensor, row: int | None) -> Output:
                rows = replace(inputs, q=q, k=k, v=v)
                own = call
                if row is not None and call.cache is not None:  # the row's entries of its mask
                    own = replace(call, mask=row_mask(call.mask, call.cache, row, q.size(2)))
                return self._formula(own, rows, row_term(call.score_term, row))

            return call.cache.attend_rows(
                inputs.q, dense, weights=call.return_weights, lse=call.return_lse
            )
        return self._formula(call, inputs, call.score_term)

    @staticmethod
    def _formula(call: AttentionCall, inputs: CallInputs, term: ScoreTerm | None) -> Output:
        return formula(
            inputs.q,
            inputs.k,
            inputs.v,
            mask=call.mask,
            bias=inputs.bias if inputs.bias is not None else term,
            scale=call.scale,
            softcap=call.softcap,
            sinks=inputs.sinks,
            dropout_p=call.dropout_p,
            return_weights=call.return_weights,
            return_lse=call.return_lse,
            score_mod=call.score_mod,
        )


def _dense_operator(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    sinks: Tensor | None,
    mask_tensors: list[Tensor],
    term_tensors: list[Tensor],
    seed: Tensor | None,
    numbers: list[int],
    *,
    mask: str,
    term: str,
    scale: float,
    softcap: float | None,
    dropout_p: float,
    **settings: object,
) -> tuple[Tensor, Tensor]:
    """``torch.ops.attnkit.attention`` as the formula reads (see :func:`decompositions`)."""
    if dropout_p:
        raise ValueError(
            f"attnkit's operator with dropout_p={dropout_p} has no dense form: export the model "
            "in eval mode (dropout off)"
        )
    m = decode(mask, mask_tensors, numbers)
    t = decode_term(term, term_tensors, numbers)
    out, lse = formula(  # type: ignore[misc]
        q,
        k,
        v,
        mask=m,
        bias=t if t is not None else bias,
        scale=scale,
        softcap=softcap,
        sinks=sinks,
        dropout_p=0.0,
        return_weights=False,
        return_lse=True,
    )
    return out, lse


def decompositions() -> dict[OpOverload, Callable[..., object]]:
    """attnkit's operator (``torch.ops.attnkit.attention``, which compiled and exported graphs
    hold) written as the dense formula in PyTorch's own operators, for programs that must run
    without attnkit: ``program.run_decompositions(attnkit.decompositions())``.
    ``torch.onnx.export(..., dynamo=True)`` writes this form by itself (no table to pass). The
    dense form materialises the ``(..., H, Tq, Tk)`` scores, as torch's SDPA with a mask would;
    inside PyTorch keep the operator, which runs in O(T) memory."""
    return {torch.ops.attnkit.attention.default: _dense_operator}
