"""``attention()``, ``explain()`` and the backend registry.

``attention()`` validates its arguments once, asks the registry which backend can serve the call,
and hands over. A backend is a function with ``attention()``'s signature (all arguments validated,
``scale`` resolved to a float) plus two functions of the call's description
(:class:`AttentionCall`):

* ``check(call)``: the reasons it *cannot* serve the call (empty: it can);
* ``cost(call)``: the reasons ``auto`` should prefer another backend even though this one can serve
  the call, namely ``(Tq, Tk)``-sized tensors it would materialise that the call does not need.

``backend="auto"`` takes, in preference order, the first backend with no reasons and no costs, else
the first with no reasons. :func:`explain` prints that decision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol, overload, runtime_checkable

import torch
from torch import Tensor

from ._checks import AttentionCall, check_attention_args, dim_str, shape_str
from ._typing import Bool, Float, shape_checked
from .backends.chunked import chunked
from .backends.reference import reference
from .backends.sdpa import causal_needs_mask, sdpa

__all__ = [
    "AttentionCall",
    "Backend",
    "BackendError",
    "Explanation",
    "attention",
    "available_backends",
    "explain",
    "register_backend",
    "unregister_backend",
]


@runtime_checkable
class BackendFn(Protocol):
    """The signature every backend implements (the arguments of :func:`attention`, validated)."""

    def __call__(
        self,
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
    ) -> Tensor | tuple[Tensor, Tensor]: ...


CallCheck = Callable[[AttentionCall], list[str]]


def _no_reasons(call: AttentionCall) -> list[str]:
    return []


@dataclass(frozen=True)
class Backend:
    """A registered backend: its function and what it says about a call."""

    name: str
    fn: BackendFn
    check: CallCheck = _no_reasons
    cost: CallCheck = _no_reasons
    auto: bool = True


class BackendError(ValueError):
    """A backend was asked for a call it cannot serve; the message lists its reasons."""


# --------------------------------------------------------------------------------------------------
# What the built-in backends can do


def _scores(call: AttentionCall) -> str:
    return f"(..., H, Tq, Tk) = {shape_str(call.scores_shape)}"


def _reference_cost(call: AttentionCall) -> list[str]:
    return [
        f"would materialise the scores {_scores(call)}; auto takes it only when nothing else can"
    ]


def _sdpa_check(call: AttentionCall) -> list[str]:
    if call.return_weights:
        return ["does not return attention weights (only reference does)"]
    return []


def _sdpa_cost(call: AttentionCall) -> list[str]:
    costs = []
    if causal_needs_mask(call):
        why = (
            f"Tq != Tk ({dim_str(call.q_len)} != {dim_str(call.kv_len)}) and torch's is_causal is "
            "top-left aligned"
            if call.q_len != call.kv_len
            else "torch does not take is_causal together with a mask or bias"
        )
        costs.append(
            f"would materialise a (Tq, Tk) = {shape_str((call.q_len, call.kv_len))} causal mask: "
            + why
        )
    if call.bias_requires_grad:
        costs.append(
            f"would keep the probabilities {_scores(call)} for the backward: torch computes a "
            "bias gradient only in its math kernel"
        )
    return costs


def _chunked_check(call: AttentionCall) -> list[str]:
    reasons = []
    if torch.compiler.is_compiling():
        reasons.append(
            "torch.compile/export is tracing: its block loop would unroll per block and its "
            "data-dependent block skipping does not trace"
        )
    if call.return_weights:
        reasons.append("does not return attention weights (only reference does)")
    if call.dropout_p:
        reasons.append(f"has no dropout (dropout_p={call.dropout_p}); sdpa and reference do")
    return reasons


# Insertion order is auto's order of preference: fastest first, the materialising spec last.
_REGISTRY: dict[str, Backend] = {
    "sdpa": Backend("sdpa", sdpa, check=_sdpa_check, cost=_sdpa_cost),
    "chunked": Backend("chunked", chunked, check=_chunked_check),
    "reference": Backend("reference", reference, cost=_reference_cost),
}
_BUILTIN = frozenset(_REGISTRY)


def register_backend(
    name: str,
    fn: BackendFn,
    *,
    check: CallCheck | None = None,
    cost: CallCheck | None = None,
    auto: bool = False,
    replace: bool = False,
) -> None:
    """Register ``fn`` as backend ``name``, usable as ``attention(..., backend=name)``.

    ``fn`` takes ``(q, k, v, *, mask, bias, causal, scale, dropout_p, return_weights)`` with every
    argument already validated and ``scale`` a float, and returns the output (or ``(output,
    weights)`` when ``return_weights``), following :func:`attention`'s conventions: bool mask with
    True = may attend, bottom-right causal, zeros for a query with no visible key.

    ``check(call)`` returns the reasons it cannot serve an :class:`AttentionCall` (default: none);
    ``cost(call)`` the reasons ``auto`` should prefer another backend. With ``auto=True`` the
    backend is tried by ``backend="auto"`` before the built-in ones.
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"backend name must be a non-empty string other than 'auto', got {name!r}")
    if not callable(fn):
        raise TypeError(f"backend {name!r}: fn must be callable, got {type(fn).__name__}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"backend {name!r} is already registered; pass replace=True to replace it")
    backend = Backend(name, fn, check or _no_reasons, cost or _no_reasons, auto)
    _REGISTRY.pop(name, None)
    if auto:  # user backends go first in auto's preference order
        rest = dict(_REGISTRY)
        _REGISTRY.clear()
        _REGISTRY[name] = backend
        _REGISTRY.update(rest)
    else:
        _REGISTRY[name] = backend


def unregister_backend(name: str) -> None:
    """Remove a backend registered with :func:`register_backend`."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; registered: {', '.join(_REGISTRY)}")
    if name in _BUILTIN:
        raise ValueError(f"backend {name!r} is built in and cannot be unregistered")
    del _REGISTRY[name]


def available_backends() -> list[str]:
    """Names of the registered backends, in ``auto``'s order of preference."""
    return list(_REGISTRY)


# --------------------------------------------------------------------------------------------------
# Dispatch


@dataclass(frozen=True)
class Explanation:
    """Which backend serves a call, and why each other backend does not.

    ``str()`` gives the readable report; the fields are there for programs.
    """

    call: AttentionCall
    requested: str
    chosen: str | None
    reasons: dict[str, list[str]] = field(default_factory=dict)
    costs: dict[str, list[str]] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"attention call: {self.call.describe()}"]
        if self.requested == "auto":
            lines.append(f"auto picks: {self.chosen}")
        elif self.chosen is None:
            lines.append(f"backend {self.requested!r} cannot serve this call")
        else:
            lines.append(f"backend {self.requested!r} (forced) serves this call")
        width = max(len(n) for n in self.reasons)
        for name in self.reasons:
            if name == self.chosen:
                head = "chosen"
                if self.costs[name]:
                    head += " (the only choice, although it " + "; ".join(self.costs[name]) + ")"
            elif self.reasons[name]:
                head = "cannot: " + "; ".join(self.reasons[name])
            elif self.requested != "auto":
                head = "could serve it (not requested)"
            elif self.costs[name]:
                head = "avoided: " + "; ".join(self.costs[name])
            else:
                head = "could serve it, but comes later in the order"
            lines.append(f"  {name:<{width}}  {head}")
        return "\n".join(lines)


def _decide(call: AttentionCall, backend: object) -> Explanation:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    if backend != "auto" and backend not in _REGISTRY:
        raise ValueError(
            f"unknown backend {backend!r}; choose 'auto' or one of: {', '.join(_REGISTRY)}"
        )
    reasons = {name: b.check(call) for name, b in _REGISTRY.items()}
    costs = {name: b.cost(call) for name, b in _REGISTRY.items()}
    if backend != "auto":
        chosen = None if reasons[backend] else backend
    else:
        able = [n for n, b in _REGISTRY.items() if b.auto and not reasons[n]]
        cheap = [n for n in able if not costs[n]]
        chosen = cheap[0] if cheap else able[0] if able else None
    return Explanation(call, backend, chosen, reasons, costs)


def _choose(call: AttentionCall, backend: str) -> str:
    """:func:`_decide`'s choice, without asking every backend when the first one will do."""
    if backend == "auto":
        for name, b in _REGISTRY.items():
            if b.auto and not b.check(call) and not b.cost(call):
                return name
    elif backend in _REGISTRY and not _REGISTRY[backend].check(call):
        return backend
    decision = _decide(call, backend)
    if decision.chosen is None:
        raise BackendError(str(decision))
    return decision.chosen


def _under_autocast(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, bool]:
    """The inputs as torch's SDPA takes them under ``torch.autocast``, and whether it is on.

    Autocast's rule: q, k, v and a float bias (float32 included) go to the autocast dtype;
    float64 stays. Outside autocast the inputs come back as they are.
    """
    # isinstance: the arguments are not validated yet; check_attention_args reports non-tensors.
    if not isinstance(q, Tensor):
        return q, k, v, bias, False
    device = q.device.type
    # "meta" (explain() without allocating) has no autocast state to ask about.
    if not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
        return q, k, v, bias, False
    dtype = torch.get_autocast_dtype(device)

    def cast(t: Tensor) -> Tensor:
        ok = isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if ok else t

    return cast(q), cast(k), cast(v), None if bias is None else cast(bias), True


def _run(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    return_weights: bool,
    backend: str,
) -> Tensor | tuple[Tensor, Tensor]:
    # Under torch.autocast, as torch's SDPA: inputs go to the autocast dtype. The backend then runs
    # with autocast off, or it would turn the float32 softmax accumulation back into bf16 GEMMs.
    q, k, v, bias, autocast = _under_autocast(q, k, v, bias)
    call = check_attention_args(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        return_weights=return_weights,
    )
    chosen = _choose(call, backend)
    with torch.autocast(q.device.type, enabled=False) if autocast else contextlib.nullcontext():
        return _REGISTRY[chosen].fn(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            causal=causal,
            scale=call.scale,
            dropout_p=dropout_p,
            return_weights=return_weights,
        )


@overload
def attention(
    q: Float[Tensor, "*batch H Tq Dk"],
    k: Float[Tensor, "*batch Hkv Tk Dk"],
    v: Float[Tensor, "*batch Hkv Tk Dv"],
    *,
    mask: Bool[Tensor, "*#mb #Tk"] | None = None,
    bias: Float[Tensor, "*#bb #Tk"] | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: Literal[False] = False,
    backend: str = "auto",
) -> Float[Tensor, "*batch H Tq Dv"]: ...


@overload
def attention(
    q: Float[Tensor, "*batch H Tq Dk"],
    k: Float[Tensor, "*batch Hkv Tk Dk"],
    v: Float[Tensor, "*batch Hkv Tk Dv"],
    *,
    mask: Bool[Tensor, "*#mb #Tk"] | None = None,
    bias: Float[Tensor, "*#bb #Tk"] | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: Literal[True],
    backend: str = "auto",
) -> tuple[Float[Tensor, "*batch H Tq Dv"], Float[Tensor, "*batch H Tq Tk"]]: ...


@shape_checked
def attention(
    q: Float[Tensor, "*batch H Tq Dk"],
    k: Float[Tensor, "*batch Hkv Tk Dk"],
    v: Float[Tensor, "*batch Hkv Tk Dv"],
    *,
    mask: Bool[Tensor, "*#mb #Tk"] | None = None,
    bias: Float[Tensor, "*#bb #Tk"] | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
) -> (
    Float[Tensor, "*batch H Tq Dv"]
    | tuple[Float[Tensor, "*batch H Tq Dv"], Float[Tensor, "*batch H Tq Tk"]]
):
    """Scaled dot-product attention: ``softmax(q k^T * scale + bias, masked) v``.

    Args:
        q: queries ``(..., H, Tq, Dk)``.
        k: keys ``(..., Hkv, Tk, Dk)``. ``H`` must be a multiple of ``Hkv``: with ``Hkv < H`` each
            group of ``H / Hkv`` query heads shares one key/value head (grouped-query attention;
            ``Hkv = 1`` is multi-query attention). k and v are not copied per head.
        v: values ``(..., Hkv, Tk, Dv)``.
        mask: bool, broadcastable to ``(..., H, Tq, Tk)``; **True = this query may attend this key**
            (torch SDPA's convention). See :mod:`attnkit.masks` for helpers.
        bias: float, q's dtype, broadcastable to ``(..., H, Tq, Tk)``, added to the scaled scores
            (relative positions, ALiBi). Differentiable.
        causal: query ``i`` may attend key ``j`` iff ``j <= i + Tk - Tq``. The alignment is
            bottom-right, which is what a KV cache needs: new queries sit after the cached keys::

                Tq=2, Tk=5        Tq=5, Tk=2
                1 1 1 1 0         0 0
                1 1 1 1 1         0 0
                                  0 0
                                  1 0
                                  1 1

            Combined with ``mask`` by logical AND.
        scale: multiplies ``q k^T``; default ``1 / sqrt(Dk)``.
        dropout_p: dropout on the attention weights (always applied when > 0: pass 0 in eval).
        return_weights: also return the softmax weights ``(..., H, Tq, Tk)`` (before dropout).
            Only the ``reference`` backend computes them, so ask only when you need them.
        backend: ``"auto"`` (default) or a name from :func:`available_backends`. ``auto`` takes the
            fastest backend that can serve the call without materialising a ``(Tq, Tk)`` tensor it
            does not need; :func:`explain` tells which and why.

    Returns:
        The output ``(..., H, Tq, Dv)`` in q's dtype, or ``(output, weights)``.

    A query with no key it may attend (a fully masked row, or ``Tk = 0``) gets output 0, weights 0
    and zero gradients in every backend, never NaN. float16 and bfloat16 inputs accumulate the
    softmax in float32.

    Raises:
        TypeError, ValueError: for bad arguments, naming the argument and quoting shapes or values.
        BackendError: when the requested backend cannot serve the call (a ``ValueError``).

    >>> import torch
    >>> q = torch.randn(2, 8, 5, 16)     # (B, H, Tq, Dk)
    >>> kv = torch.randn(2, 2, 7, 16)    # grouped-query: 2 key/value heads for 8 query heads
    >>> attention(q, kv, kv, causal=True).shape
    torch.Size([2, 8, 5, 16])

    Shape legend: ``...`` batch dims, ``H`` query heads, ``Hkv`` key/value heads, ``Tq`` queries,
    ``Tk`` keys, ``Dk`` query/key size, ``Dv`` value size.
    """
    return _run(q, k, v, mask, bias, causal, scale, dropout_p, return_weights, backend)


@shape_checked
def explain(
    q: Float[Tensor, "*batch H Tq Dk"],
    k: Float[Tensor, "*batch Hkv Tk Dk"],
    v: Float[Tensor, "*batch Hkv Tk Dv"],
    *,
    mask: Bool[Tensor, "*#mb #Tk"] | None = None,
    bias: Float[Tensor, "*#bb #Tk"] | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
) -> Explanation:
    """Which backend :func:`attention` would use for these arguments, and why not the others.

    Takes :func:`attention`'s arguments and runs nothing. Tensors on ``device="meta"`` work, so a
    call can be explained without allocating it. ``print()`` the result for the report:

    >>> import torch
    >>> q = torch.empty(1, 8, 4096, 64, device="meta")
    >>> print(explain(q, q, q, causal=True))
    attention call: q (1, 8, 4096, 64), k (1, 8, 4096, 64), v (1, 8, 4096, 64) float32 on meta,
    causal auto picks: sdpa
      sdpa       chosen
      chunked    could serve it, but comes later in the order
      reference  avoided: would materialise the scores (..., H, Tq, Tk) = (1, 8, 4096, 4096); ...
    """
    q, k, v, bias, _ = _under_autocast(q, k, v, bias)  # describe the call attention() makes
    call = check_attention_args(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        return_weights=return_weights,
    )
    return _decide(call, backend)
