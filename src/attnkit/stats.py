"""``attention_stats``: how much attention each key receives, and how spread each query's is,
without the ``(Tq, Tk)`` weights.

Cache eviction (H2O's heavy hitters, SnapKV's keys the last queries attend most) and attention
analysis need, per key, the weight it receives summed over the queries and its largest one, and
per query the entropy of its weights. ``attention(..., return_weights=True)`` gives them at the
price of a ``(..., H, Tq, Tk)`` tensor; :func:`attention_stats` computes them in one pass over
the kernel's block plan that recomputes the scores tile by tile and normalises them with each
query's log-sum-exp (see :mod:`attnkit._kernel.stats`), in memory of the outputs' size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ._base.checks import dtype_str, shape_str
from ._base.hints import torch_keywords, warn_torch_convention
from ._base.quantized import is_quantized
from ._base.shapes import Bool, Float, shape_checked
from ._call import AttentionCall, check_attention_args
from ._kernel.stats import kernel_stats, stats_refusal
from ._record import note_served
from ._score_mod import ScoreMod, check_elementwise
from .attention import attention
from .caches.view import CacheView
from .masks import Mask
from .scores import ScoreTerm

__all__ = ["AttentionStats", "attention_stats"]

_BACKENDS = ("auto", "reference")

_MaskArg = Bool[Tensor, "*#mb #Tk"] | Mask | None
_BiasArg = Float[Tensor, "*#bb #Tk"] | ScoreTerm | None


@dataclass(frozen=True)
class AttentionStats:
    """What :func:`attention_stats` returns, in the dtype the scores are computed in (float32
    for float16, bfloat16 and float32 inputs, float64 for float64).

    Attributes:
        key_mass: ``(..., H, Tk)``: the weight each key receives, summed over the queries
            (``(..., Hkv, Tk)``, summed over each group's query heads too, with
            ``per_kv_head=True``).
        key_max: ``(..., H, Tk)``: the largest weight each key receives from one query (its
            maximum over each group's query heads with ``per_kv_head=True``); 0 for a key no
            query sees.
        entropy: ``(..., H, Tq)``: ``-sum_j w_j log w_j`` over each query's weights ``w`` (in
            nats; 0 for a query with no visible key). With sinks the weights sum to less than
            1 and the sink's own share is not a term: it is not a key.
    """

    key_mass: Tensor
    key_max: Tensor
    entropy: Tensor


def _check_lse(lse: object, call: AttentionCall) -> Tensor:
    """A natural-log log-sum-exp ``(..., H, Tq)``: a float tensor on the call's device."""
    want = (*call.batch_shape, call.num_heads, call.q_len)
    if not isinstance(lse, Tensor) or not lse.is_floating_point():
        got = dtype_str(lse.dtype) if isinstance(lse, Tensor) else type(lse).__name__
        raise TypeError(
            f"lse must be a float tensor (..., H, Tq), as attention(..., return_lse=True) "
            f"returns it, or None; got {got}"
        )
    if tuple(lse.shape) != want:
        raise ValueError(
            f"lse must have shape (..., H, Tq) = {shape_str(want)} for q "
            f"{shape_str((*call.batch_shape, call.num_heads, call.q_len, call.qk_dim))}, got "
            f"{shape_str(lse.shape)}"
        )
    if lse.device != call.device:
        raise ValueError(f"lse is on {lse.device} but q is on {call.device}")
    return lse


def _reference_stats(
    q: Tensor, k: Tensor, lse: Tensor | None, arguments: dict[str, object]
) -> tuple[Tensor, Tensor, Tensor]:
    """The statistics of the reference's weights ``(..., H, Tq, Tk)`` (normalised by ``lse``
    where it is given): the spec the one-pass form is tested against. The weights are those of
    q, k and the call's float tensors in the dtype the scores are computed in: the reference
    returns float16 and bfloat16 calls' weights rounded to their dtype, whose sums would carry
    that rounding."""
    work = torch.promote_types(q.dtype, torch.float32)
    raised = {
        name: value.to(work) if isinstance(value, Tensor) and value.is_floating_point() else value
        for name, value in arguments.items()
    }
    _, w, own = attention(
        q.to(work),
        k.to(work),
        k.to(work),
        **raised,
        return_weights=True,
        return_lse=True,
        backend="reference",
    )  # type: ignore[call-overload]
    if lse is not None:  # the weights exp(s - lse) of the given log-sum-exp
        given = lse.to(work)
        # (a row given -inf has no weight, as in the one-pass form: not exp(s + inf))
        none = (own == float("-inf")) | (given == float("-inf"))
        ratio = (own - given).exp().masked_fill(none, 0.0)
        w = w * ratio.unsqueeze(-1)
    # (no queries: no key receives any weight)
    top = w.amax(-2) if w.size(-2) else w.new_zeros((*w.shape[:-2], w.size(-1)))
    return w.sum(-2), top, torch.special.entr(w).sum(-1)


@torch_keywords
@shape_checked
def attention_stats(
    q: Float[Tensor, "*batch H Tq Dk"],
    k: Float[Tensor, "*batch Hkv Tk Dk"],
    *,
    mask: _MaskArg = None,
    bias: _BiasArg = None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    sinks: Float[Tensor, " H"] | None = None,
    lse: Float[Tensor, "*batch H Tq"] | None = None,
    per_kv_head: bool = False,
    backend: str = "auto",
) -> AttentionStats:
    """Per key, the attention weight it receives (summed and largest); per query, the entropy of
    its weights; for the call :func:`attention` would make, without its ``(Tq, Tk)`` weights.

    The weights are those of ``attention(q, k, v, ...)`` with the same arguments
    (``return_weights=True`` returns them): every mask, ``causal``, ``bias`` (a tensor or a
    :class:`~attnkit.scores.ScoreTerm`), ``softcap``, ``score_mod`` and ``sinks``, checked as
    :func:`attention` checks them. Values play no part. The statistics carry no gradient (a
    call under autograd records nothing). Inside a ``torch.compile``'d function the pass runs
    eagerly between its graphs (it reads whether q and k are finite to choose its kernel), so
    ``fullgraph=True`` and ``torch.export`` refuse it; so does ``torch.func.vmap``, where
    ``backend="reference"`` runs (every leading dim of q and k is a batch dim already). On
    ``device="meta"`` tensors it returns the statistics' shapes and dtype, on meta, and
    computes nothing.

    Args:
        q, k, mask, bias, causal, scale, softcap, score_mod, sinks: as :func:`attention`.
        lse: each query's natural-log log-sum-exp ``(..., H, Tq)``, as
            ``attention(q, k, v, ..., return_lse=True)`` returned it for the same call (sinks
            included): the statistics then take one pass over the scores. None: a first pass
            computes it (``attention()`` with ``return_lse=True`` and no values). Its shape
            and dtype are checked, its values not checked (that would take the pass it saves):
            the weights are ``exp(s - lse)``, so an ``lse`` larger by ``c`` than the call's
            scales a query's weights by ``e^-c`` and its entropy to ``e^-c (h + c)``; a query
            given ``-inf`` has no weight, as one with no visible key (and one given ``+inf``:
            its weights are ``e^-inf = 0``).
        per_kv_head: with grouped-query attention, ``key_mass`` and ``key_max`` per key/value
            head ``(..., Hkv, Tk)``: summed (and maxed) over the query heads that share it, the
            statistic a cache of ``Hkv`` heads evicts by. ``entropy`` stays per query head.
        backend: ``"auto"``: one pass over the kernel's block plan, recomputing the scores tile
            by tile, in memory of the outputs' size (plus a few tiles); ``"reference"``: from
            the reference backend's weights, written out (the spec the first is tested against).

    Returns:
        An :class:`AttentionStats` with ``key_mass``, ``key_max`` and ``entropy``.

    >>> import torch, attnkit
    >>> q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    >>> out, lse = attnkit.attention(q, k, v, causal=True, return_lse=True)
    >>> stats = attnkit.attention_stats(q, k, causal=True, lse=lse)
    >>> stats.key_mass.shape, stats.entropy.shape
    (torch.Size([1, 2, 6]), torch.Size([1, 2, 6]))
    >>> round(float(stats.key_mass.sum()), 4)  # each of 2 x 6 queries gives out weight 1
    12.0
    >>> stats.key_mass[0, 0, -1] == stats.key_max[0, 0, -1]  # the last key: the last query only
    tensor(True)

    Shape legend: ``...`` batch dims, ``H`` query heads, ``Hkv`` key/value heads, ``Tq`` queries,
    ``Tk`` keys, ``Dk`` query/key size.
    """
    _check_keys(k)
    try:
        call = check_attention_args(
            q,
            k,
            k,  # (no values: any tensor of k's heads and length passes their check)
            mask=mask,
            bias=bias,
            causal=causal,
            scale=scale,
            softcap=softcap,
            sinks=sinks,
            score_mod=score_mod,
        )
    except (TypeError, ValueError) as error:
        if type(error) not in (TypeError, ValueError):
            raise
        raise type(error)(_without_values(str(error))) from None
    given = None if lse is None else _check_lse(lse, call)
    if not isinstance(per_kv_head, bool):
        raise TypeError(f"per_kv_head must be a bool, got {per_kv_head!r}")
    if backend not in _BACKENDS:
        raise ValueError(
            f"attention_stats computes with backend='auto' (one pass over the kernel's block "
            f"plan) or 'reference' (from the reference's weights), got {backend!r}"
        )
    if isinstance(mask, Tensor):
        warn_torch_convention(mask)  # True = may NOT attend, as in torch's modules? (warned once)
    arguments: dict[str, object] = dict(
        mask=mask, bias=bias, causal=causal, scale=scale, softcap=softcap, score_mod=score_mod
    )
    # Both passes read q and k as given: under autocast the log-sum-exp pass would round them.
    # (made only where autocast exists: torch.autocast("meta") itself raises)
    autocast = (
        torch.autocast(q.device.type, enabled=False)
        if torch.amp.is_autocast_available(q.device.type)
        else contextlib.nullcontext()
    )
    with autocast, torch.no_grad():
        if call.device.type == "meta":
            mass, top, entropy = _shapes(call)
        elif backend == "reference":
            mass, top, entropy = _reference_stats(q, k, given, {**arguments, "sinks": sinks})
        else:
            mass, top, entropy = _eager_pass(q, k, call, given, sinks, arguments)
    if per_kv_head and call.groups > 1:
        mass = mass.unflatten(-2, (call.num_kv_heads, call.groups)).sum(-2)
        top = top.unflatten(-2, (call.num_kv_heads, call.groups)).amax(-2)
    return AttentionStats(key_mass=mass, key_max=top, entropy=entropy)


def _shapes(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
    """A call on the meta device: the statistics' shapes and dtype, on meta. Such a call holds
    no values for a plan (the mask's) or a kernel (whether q and k are finite) to read."""
    work = torch.promote_types(call.dtype, torch.float32)
    keys = (*call.batch_shape, call.num_heads, call.kv_len)
    queries = (*call.batch_shape, call.num_heads, call.q_len)
    empty = [torch.empty(shape, dtype=work, device="meta") for shape in (keys, keys, queries)]
    return empty[0], empty[1], empty[2]


def _without_values(message: str) -> str:
    """attention()'s message about q, k and v as one about q and k: attention_stats takes no
    values (the check was given the keys in their place, so what it says of v it says of k)."""
    message = message.replace("q, k and v", "q and k").replace("k and v", "k")
    return re.sub(r",\s+v (?:on \S+|\([^)]*\)|\S+)$", "", message)


def _check_keys(k: object) -> None:
    """``k`` as attention_stats takes it: float keys, not a cache's view or quantized keys (the
    checks of attention() would speak of its values, which attention_stats has none of)."""
    if isinstance(k, CacheView):
        raise TypeError(
            f"attention_stats takes the keys k as a tensor (*batch, Hkv, Tk, Dk), got a "
            f"CacheView ({k.describe()}): give a cache's keys as view.dense() (rows sharing "
            f"their keys) or view.row(n)"
        )
    if isinstance(k, Tensor) and is_quantized(k):
        raise TypeError(
            f"attention_stats takes float keys, got k of {dtype_str(k.dtype)}: give them "
            f"dequantized (k.float() * k_scale)"
        )


def _one_pass(
    q: Tensor,
    k: Tensor,
    call: AttentionCall,
    lse: Tensor | None,
    sinks: Tensor | None,
    arguments: dict[str, object],
) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's pass, after the log-sum-exp pass where no ``lse`` is given: the native
    kernel's where it serves the call, else the eager one's, recorded as the kernel of an
    ``attention_stats`` call (:func:`attnkit.record_dispatch`, :attr:`attnkit.Dispatch.kernel`)."""
    if lse is None:
        _, lse = attention(q, k, k[..., :0], **arguments, sinks=sinks, return_lse=True)  # type: ignore[call-overload]
    elif call.score_mod is not None:
        # attention() probes a score_mod once per function: the pass calls it on tiles too
        work = torch.promote_types(call.dtype, torch.float32)
        check_elementwise(call.score_mod, dataclasses.replace(call.geometry, dtype=work))
    bias = call.score_term if call.score_term is not None else _dense(arguments["bias"])
    why = stats_refusal(q, k, bias, call.score_mod)
    note_served(call, "attention_stats", "native kernel" if why is None else why)
    return kernel_stats(
        q,
        k,
        lse.detach(),
        mask=call.mask,
        bias=bias,
        scale=call.scale,
        softcap=call.softcap,
        score_mod=call.score_mod,
        native=why is None,
    )


_REASON = (
    "attention_stats reads whether q and k are finite to choose its kernel: it runs eagerly, "
    "between compiled graphs"
)
_disabled_pass: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None


def _eager_pass(*args: Any) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_one_pass`, run eagerly inside a compiled function (a graph break there): the pass
    reads whether q and k are finite (one host read) to choose its kernel, which no traced graph
    can answer. The disabled wrapper is made on the first compiled call, since making it imports
    torch's compiler, which ``import attnkit`` does not."""
    global _disabled_pass
    if not torch.compiler.is_compiling():
        return _one_pass(*args)
    if torch.compiler.is_exporting():
        # (an exported program has no eager code between graphs: the read would meet fake
        # tensors, and fail deep in the kernel's choice)
        raise RuntimeError(
            f"attention_stats cannot run inside torch.export: {_REASON}, and an exported program "
            "is one graph; compute the statistics outside the exported program"
        )
    if _disabled_pass is None:
        _disabled_pass = torch.compiler.disable(_one_pass, reason=_REASON)
    return _disabled_pass(*args)


def _dense(bias: object) -> Tensor | None:
    """A checked call's dense bias (None when it has none or a score term)."""
    return bias if isinstance(bias, Tensor) else None
