"""``attention()``, ``explain()`` and the backend registry.

``attention()`` validates its arguments once, asks the registry which backend can serve the call,
and hands over. A backend (:class:`~attnkit.Backend`) is a function with ``attention()``'s
arguments (all validated, ``mask`` and ``causal`` folded into one mask, ``scale`` a float) plus
functions of the call's description (:class:`~attnkit.AttentionCall`) in which it speaks of itself:

* ``check(call)``: the reasons it *cannot* serve the call (empty: it can);
* ``cost(call)``: the reasons ``auto`` should prefer another backend even though this one can serve
  the call, namely ``(Tq, Tk)``-sized tensors it would materialise that the call does not need;
* ``slower(call)``: the reasons it would serve the call on a slow path of its own.

``backend="auto"`` takes, in preference order, the first backend that can serve the call with no
costs and no slow path; else the first with no costs; else the first that can serve it.
:func:`explain` prints that decision.

The registry may be changed while other threads call ``attention()``: every call reads one
consistent snapshot of it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, overload

import torch
from torch import Tensor

from ._base.checks import shape_str
from ._base.devices import (
    Target,
    assuming,
    compiled_refusal,
    parse_device,
    slow_paths_cost_more,
    target,
)
from ._base.hints import torch_keywords, warn_torch_convention
from ._base.quantized import QuantizedKV, check_kv_scales, is_quantized, stand_in
from ._base.shapes import Bool, Float, Int, shape_checked
from ._call import AttentionCall, check_attention_args, copy_call, describe_call
from ._record import begin_call, end_call
from ._score_mod import ScoreMod, captured_tensors, check_captured, check_elementwise
from .backends import builtin_backends, missing_builtins
from .backends.base import (
    Backend,
    BackendError,
    BackendFn,
    CallCheck,
    CallInputs,
    Output,
    dequantized,
    own_costs,
    registry_of_call,
    restore_registry,
)
from .caches.view import CacheView
from .masks import Mask
from .scores import ScoreTerm

__all__ = [
    "AttentionCall",
    "Backend",
    "BackendError",
    "Explanation",
    "attend",
    "attention",
    "available_backends",
    "dispatch",
    "explain",
    "merge_attention",
    "register_backend",
    "under_autocast",
    "unregister_backend",
]


# Insertion order is auto's order of preference: user backends registered with auto=True first,
# then the fastest built-in, the materialising spec last. Never changed in place: a change
# publishes a new dict, so a reader that took it once sees one consistent registry.
_REGISTRY: dict[str, Backend] = {b.name: b for b in builtin_backends()}
_BUILTIN = tuple(_REGISTRY)
_WRITE = threading.Lock()


def register_backend(
    name: str,
    fn: BackendFn | Backend,
    *,
    check: CallCheck | None = None,
    cost: CallCheck | None = None,
    notes: CallCheck | None = None,
    auto: bool = False,
    replace: bool = False,
    slower: CallCheck | None = None,
) -> None:
    """Register ``fn`` as backend ``name``, usable as ``attention(..., backend=name)``.

    ``fn`` takes ``(q, k, v, *, mask, bias, scale, softcap, sinks, dropout_p, return_weights)``
    with every argument already validated (see :class:`~attnkit.backends.base.BackendFn`) and
    returns the output (or ``(output, weights)`` when ``return_weights``), following
    :func:`attention`'s conventions: True = may attend, zeros for a query with no visible key.

    ``check(call)`` returns the reasons it cannot serve an :class:`AttentionCall` (default: none);
    ``cost(call)`` the reasons ``auto`` should prefer another backend (memory it would spend);
    ``slower(call)`` the reasons it would take a slow path of its own; ``notes(call)`` the lines
    :func:`explain` prints under it. ``fn`` may also be a :class:`Backend` (a subclass that
    implements ``run(call, inputs)``), registered under ``name``. With ``auto=True`` the
    backend is tried by ``backend="auto"`` before the built-in ones. ``replace=True`` replaces a
    backend registered earlier under ``name`` (keeping its place in the order); the built-in
    backends cannot be replaced.
    """
    if isinstance(fn, Backend):
        if any(f is not None for f in (check, cost, notes, slower)):
            raise TypeError(
                f"backend {name!r}: a Backend object brings its own check/cost/slower/notes methods"
            )
        if not isinstance(auto, bool):
            raise TypeError(f"backend {name!r}: auto must be a bool, got {auto!r}")
        backend: Backend = fn
        backend.name, backend.auto = name, auto
    else:
        backend = Backend(name, fn, check=check, cost=cost, notes=notes, auto=auto, slower=slower)
    if not isinstance(replace, bool):
        raise TypeError(f"replace must be a bool, got {replace!r}")
    with _WRITE:
        global _REGISTRY
        if name in _BUILTIN:
            raise ValueError(
                f"backend {name!r} is built in and cannot be replaced; register yours under "
                f"another name (auto=True tries it first)"
            )
        if name in _REGISTRY and not replace:
            raise ValueError(
                f"backend {name!r} is already registered; pass replace=True to replace it"
            )
        if name in _REGISTRY:
            _REGISTRY = {n: backend if n == name else b for n, b in _REGISTRY.items()}
        elif auto:
            _REGISTRY = {name: backend, **_REGISTRY}
        else:
            _REGISTRY = {**_REGISTRY, name: backend}


def unregister_backend(name: str) -> None:
    """Remove a backend registered with :func:`register_backend`."""
    with _WRITE:
        global _REGISTRY
        if name not in _REGISTRY:
            raise ValueError(f"unknown backend {name!r}; registered: {', '.join(_REGISTRY)}")
        if name in _BUILTIN:
            raise ValueError(f"backend {name!r} is built in and cannot be unregistered")
        _REGISTRY = {n: b for n, b in _REGISTRY.items() if n != name}


def available_backends() -> list[str]:
    """Names of the registered backends, in ``auto``'s order of preference."""
    return list(_REGISTRY)


def check_backend(backend: object, name: str = "backend") -> str | Backend:
    """``backend`` if it is ``"auto"``, a registered name or a :class:`Backend`; else an error."""
    if isinstance(backend, Backend):
        return backend
    if not isinstance(backend, str):
        raise TypeError(
            f"{name} must be 'auto', the name of a registered backend or an attnkit.Backend, got "
            f"{type(backend).__name__}"
        )
    registry = _REGISTRY
    if backend != "auto" and backend not in registry:
        why = missing_builtins().get(backend)
        if why is not None:
            raise ValueError(
                f"{name} {backend!r} is not available: it is {why}; choose 'auto' or one of: "
                f"{', '.join(registry)}"
            )
        near = difflib.get_close_matches(backend.strip().lower(), ["auto", *registry], n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ValueError(
            f"unknown {name} {backend!r}; {hint}choose 'auto' or one of: {', '.join(registry)} (a "
            "backend of your own must be registered with attnkit.register_backend before it is "
            "named)"
        )
    return backend


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
    notes: dict[str, list[str]] = field(default_factory=dict)
    #: each backend's slow paths for the call (see :meth:`Backend.slower`)
    slower: dict[str, list[str]] = field(default_factory=dict)
    #: the device the call was decided for, where it is a GPU (``explain(..., device="cuda")``,
    #: or a call on one): its rules weigh a slow path above a cost (see :func:`_rank`)
    device: Target | None = None

    def _rank(self, name: str | None) -> int:
        gpu = self.device is not None
        return _rank(self.costs.get(name, []), self.slower.get(name, []), gpu) if name else 0

    def _chosen(self, name: str) -> str:
        """The chosen backend's line: on a GPU, what it costs or its slow path, and that every
        backend before it cannot serve the call or costs more."""
        said = self.costs[name] + (self.slower.get(name, []) if self.device is not None else [])
        if not said:
            return "chosen"
        if self.device is None:
            # (a quantized prefill: every backend dequantizes, the chosen one with the least else)
            able = any(not why for n, why in self.reasons.items() if n != name)
            which = "as requested" if self.requested != "auto" else "the only choice"
            which = "the least costly choice" if able and self.requested == "auto" else which
            return f"chosen ({which}, although it " + "; ".join(said) + ")"
        return "chosen, the best that can serve it, although it " + "; ".join(said)

    def _device_lines(self, device: Target) -> list[str]:
        """The device the call was decided for, and whether torch's compiled FlexAttention runs
        there with gradients."""
        flex = compiled_refusal(device) or "torch's FlexAttention compiles here, with gradients"
        return [f"device: {device.describe()}; {flex}"]

    def __str__(self) -> str:
        lines = [f"attention call: {self.call.describe()}"]
        if self.device is not None:
            lines += self._device_lines(self.device)
        if self.requested == "auto":
            lines.append(f"auto picks: {self.chosen}")
        elif self.chosen is None:
            lines.append(f"backend {self.requested!r} cannot serve this call")
        else:
            lines.append(f"backend {self.requested!r} (forced) serves this call")
        width = max(len(n) for n in self.reasons)
        before = self.chosen is not None  # still before the chosen backend in the order
        for name in self.reasons:
            before = before and name != self.chosen
            gpu = self.device is not None
            worse = self._rank(name) > self._rank(self.chosen) and (before or gpu)
            if name == self.chosen:
                head = self._chosen(name)
            elif self.reasons[name]:
                head = "cannot: " + "; ".join(self.reasons[name])
            elif self.requested != "auto":
                head = "could serve it (not requested)"
            elif self.costs[name] or worse:
                head = "avoided: " + "; ".join(self.costs[name] + self.slower.get(name, []))
            else:
                head = "could serve it, but comes later in the order"
            lines.append(f"  {name:<{width}}  {head}")
            if name == self.chosen:  # what runs; the others' notes stay in self.notes
                lines += [f"  {'':<{width}}  {note}" for note in self.notes.get(name, [])]
        return "\n".join(lines)


def _rank(costs: list[str], slower: list[str], gpu: bool = False) -> int:
    """auto's preference among backends that can serve a call: 0 (no costs, no slow path), 1 (a
    slow path of its own), 2 (costs). The first backend of the lowest rank wins. On a GPU the
    last two swap (see :func:`attnkit._base.devices.slow_paths_cost_more`): a slow path there is
    a loop of small kernels or torch's math kernel, which costs more than a mask written out for
    a fused kernel. Dequantizing int8/float8 keys and values weighs less than any other cost:
    every path but the native decode pays it, so the other costs decide between those that do
    (the rank doubled, plus 1 with the copy)."""
    own = own_costs(costs)
    rank = (2 if slower else 1 if own else 0) if gpu else (2 if own else 1 if slower else 0)
    return 2 * rank + (len(own) != len(costs))


def _decide(call: AttentionCall, backend: str | Backend) -> Explanation:
    registry = _REGISTRY
    if isinstance(backend, Backend):
        registry = {
            backend.name: backend,
            **{n: b for n, b in registry.items() if b is not backend},
        }
        if backend.name in _REGISTRY and _REGISTRY[backend.name] is not backend:
            registry = {f"{backend!r}": backend, **_REGISTRY}
        requested = next(n for n, b in registry.items() if b is backend)
    else:
        requested = backend
    gpu = slow_paths_cost_more(target(call.device))
    reasons, costs, notes, slower = {}, {}, {}, {}
    # Notes are for people and may read a block plan (under a lock torch.compile cannot enter):
    # while tracing, a refusal's error names the reasons without them.
    tracing = torch.compiler.is_compiling()
    for name, b in registry.items():
        reasons[name], costs[name] = b.reasons(call)
        able = not reasons[name]
        slower[name] = b.slower_reasons(call) if able else []
        notes[name] = b.explain_notes(call) if able and not tracing else []
    if requested != "auto":
        chosen = None if reasons[requested] else requested
    else:
        able_auto = [n for n, b in registry.items() if b.auto and not reasons[n]]
        ranked = sorted(able_auto, key=lambda n: _rank(costs[n], slower[n], gpu))  # stable
        chosen = ranked[0] if ranked else None
    device = target(call.device) if gpu else None
    return Explanation(call, requested, chosen, reasons, costs, notes, slower, device)


def _choose(call: AttentionCall, backend: str | Backend) -> Backend:
    """:func:`_decide`'s choice, asking each backend once and no further than the first that
    serves the call on its fast path without costs."""
    registry = _REGISTRY
    if isinstance(backend, Backend):
        if not backend.reasons(call)[0]:
            return backend
    elif backend == "auto":
        best, best_rank = None, 6
        gpu = slow_paths_cost_more(target(call.device))
        for b in registry.values():
            if not b.auto:
                continue
            refused, costs = b.reasons(call, refused_costs=False)
            if refused:
                continue
            slow = b.slower_reasons(call) if gpu or not costs or not own_costs(costs) else []
            if not costs and not slow:  # rank 0: the first such backend wins
                return b
            rank = _rank(costs, slow, gpu)
            if rank < best_rank:
                best, best_rank = b, rank
        if best is not None:
            return best
    elif backend in registry and not registry[backend].reasons(call)[0]:
        return registry[backend]
    decision = _decide(call, backend)
    if decision.chosen is None:
        raise BackendError(str(decision))
    return backend if isinstance(backend, Backend) else registry[decision.chosen]


def under_autocast(
    tensors: tuple[object, ...],
) -> tuple[tuple[object, ...], bool, str | None]:
    """The tensors as torch's SDPA takes them under ``torch.autocast``, whether it is on, and the
    autocast dtype's name.

    Autocast's rule: q, k, v and float tensors (float32 included) go to the autocast dtype;
    float64 stays. Outside autocast the inputs come back as they are.
    """
    q = tensors[0]
    # isinstance: the arguments are not validated yet; check_attention_args reports non-tensors.
    if not isinstance(q, Tensor):
        return tensors, False, None
    device = q.device.type
    # "meta" (explain() without allocating) has no autocast state to ask about.
    if not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
        return tensors, False, None
    dtype = torch.get_autocast_dtype(device)

    def cast(t: object) -> object:
        if isinstance(t, CacheView):  # its rows' keys, copied in the autocast dtype
            return t.to(dtype) if t.k.dtype != torch.float64 else t
        ok = isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if ok and isinstance(t, Tensor) else t

    return tuple(cast(t) for t in tensors), True, str(dtype).removeprefix("torch.")


def _autocast_hint(error: TypeError, autocast: str | None) -> TypeError:
    """``error`` of the checks; under autocast, a dtype error that also says what autocast did."""
    if autocast is None or "dtype" not in str(error):
        return error
    return TypeError(
        f"{error} (inside torch.autocast, float16/bfloat16/float32 inputs are cast to "
        f"{autocast} and float64 ones are not, so mixing float64 with others fails there)"
    )


def _call_of(
    args: tuple[object, ...],
    mask: object,
    causal: object,
    scale: object,
    softcap: object,
    dropout_p: object,
    return_weights: object,
    return_lse: object,
    autocast: str | None,
    score_mod: object = None,
) -> AttentionCall:
    """The validated call."""
    q, k, v, bias, sinks = args
    try:
        return check_attention_args(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            causal=causal,
            scale=scale,
            softcap=softcap,
            sinks=sinks,
            dropout_p=dropout_p,
            return_weights=return_weights,
            return_lse=return_lse,
            score_mod=score_mod,
            check_finite=True,
        )
    except TypeError as error:
        raise _autocast_hint(error, autocast) from None


def _quantized(
    q: object, k: object, v: object, k_scale: object, v_scale: object
) -> tuple[object, object, QuantizedKV | None]:
    """int8/float8 ``k`` and ``v``: stand-ins of their shapes in q's dtype, which the checks of
    the other arguments read, and the call's quantized keys and values (their scales checked);
    else ``k`` and ``v`` as given and None."""
    if k_scale is None and v_scale is None and not is_quantized(k) and not is_quantized(v):
        return k, v, None  # (the common call: nothing quantized, no scales)
    if isinstance(k, CacheView) and (k_scale is not None or v_scale is not None):
        raise TypeError(
            "k_scale and v_scale are for int8/float8 k and v tensors: a CacheView carries its "
            "pages' scales (CacheView(..., k_scale=, v_scale=), as a quantized cache's view())"
        )
    scales = check_kv_scales(q, k, v, k_scale, v_scale)
    if scales is None or not (
        isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    ):
        return k, v, None
    quantized = QuantizedKV(k.dtype, *scales)
    k_in = stand_in(k, q.dtype, scales[0])
    if v.shape == k.shape and not (scales[0].requires_grad or scales[1].requires_grad):
        return k_in, k_in, quantized  # (the checks read shapes alone: one stand-in serves both)
    return k_in, stand_in(v, q.dtype, scales[1]), quantized


def _with_quantized(
    call: AttentionCall, quantized: QuantizedKV, q: Tensor, k: Tensor, v: Tensor
) -> AttentionCall:
    """The call on int8/float8 ``k`` and ``v`` with their scales. Where its checks read whether
    the inputs are finite (a call that needs gradients), they read the stand-ins: the answer is
    the one for the keys and values the call reads, so a NaN or inf scale (or float8 value)
    routes it as a NaN in float keys does."""
    finite = None if call.finite is None else quantized.finite(q, k, v)
    if torch.compiler.is_compiling():  # (dynamo traces a dataclass's own copy)
        return dataclasses.replace(call, quantized=quantized, finite=finite)
    return copy_call(call, quantized=quantized, finite=finite)


def _keys_values(k: object, v: object) -> tuple[Tensor, Tensor]:
    """What a backend receives as k and v: a cache view's pages (it reads the view itself as
    ``call.cache``), else k and v as checked."""
    if isinstance(k, CacheView):
        return k.k, k.v
    if not isinstance(k, Tensor) or not isinstance(v, Tensor):
        raise TypeError(f"attnkit internal error: k and v unchecked ({type(k).__name__})")
    return k, v


def _run(
    q: Tensor,
    k: Tensor | CacheView,
    v: Tensor | None,
    mask: Tensor | Mask | None,
    bias: Tensor | ScoreTerm | None,
    causal: bool,
    scale: float | None,
    softcap: float | None,
    sinks: Tensor | None,
    dropout_p: float,
    return_weights: bool,
    return_lse: bool,
    backend: str | Backend,
    score_mod: ScoreMod | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Output:
    given_k, given_v = k, v
    checked_k, checked_v, quantized = _quantized(q, k, v, k_scale, v_scale)
    # Under torch.autocast, as torch's SDPA: inputs go to the autocast dtype. The backend then runs
    # with autocast off, or it would turn the float32 softmax accumulation back into bf16 GEMMs.
    args, autocast, autocast_dtype = under_autocast((q, checked_k, checked_v, bias, sinks))
    call = _call_of(
        args,
        mask,
        causal,
        scale,
        softcap,
        dropout_p,
        return_weights,
        return_lse,
        autocast_dtype,
        score_mod,
    )
    if isinstance(mask, Tensor):
        warn_torch_convention(mask)  # True = may NOT attend, as in torch's modules? (warned once)
    q, k, v, bias, sinks = args  # type: ignore[assignment]
    k, v = _keys_values(k, v)
    if quantized is not None and isinstance(given_k, Tensor) and isinstance(given_v, Tensor):
        k, v = given_k, given_v  # int8/float8, read with call.quantized's scales
        call = _with_quantized(call, quantized, q, k, v)
    dense = bias if isinstance(bias, Tensor) else None
    captured: tuple[Tensor, ...] = ()
    if call.score_mod is not None:
        # A score_mod sees tiles, FlexAttention's one score at a time: the same only if it is
        # elementwise (probed once per function, shapes and tile).
        work = torch.promote_types(call.dtype, torch.float32)
        check_elementwise(call.score_mod, dataclasses.replace(call.geometry, dtype=work))
    if call.score_mod is not None and torch.is_grad_enabled():
        captured = captured_tensors(call.score_mod)
        if not torch.compiler.is_compiling():
            check_captured(call.score_mod, captured, q.dtype, q.device)
    inputs = CallInputs(q, k, v, dense, sinks, captured)
    chosen = check_backend(backend)
    if not autocast:
        return dispatch(call, inputs, chosen)
    with torch.autocast(q.device.type, enabled=False):
        return dispatch(call, inputs, chosen)


def attend(
    q: Tensor,
    k: Tensor | CacheView,
    v: Tensor | None,
    *,
    mask: Tensor | Mask | None,
    bias: Tensor | ScoreTerm | None,
    causal: bool,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: str | Backend,
) -> Output:
    """:func:`attention` for the call a module makes: each argument is checked once per call.

    ``q``, ``k``, ``v``, ``sinks``, ``dropout_p``, the flags and ``backend`` are the module's own,
    built from arguments and parameters it has checked (its inputs' shapes, dtypes and devices at
    each call, its settings and backend when it was built), so they are not checked again; the
    caller's ``mask``, ``bias`` and ``causal``, which the module passes on, are checked here, by
    the same checks as :func:`attention`'s (``k`` a cache view and ``v`` None: the call on a
    module's cache). The scale is ``1/sqrt(Dk)``; what follows (autocast,
    the torch-convention warning, the choice of backend) is :func:`attention`'s."""
    args, autocast, autocast_dtype = under_autocast((q, k, v, bias, sinks))
    q, k, v, bias, sinks = args  # type: ignore[assignment]
    try:
        call = describe_call(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            causal=causal,
            sinks=sinks,
            dropout_p=dropout_p,
            return_weights=return_weights,
            return_lse=return_lse,
            check_finite=True,
        )
    except TypeError as error:
        raise _autocast_hint(error, autocast_dtype) from None
    if isinstance(mask, Tensor):
        warn_torch_convention(mask)  # True = may NOT attend, as in torch's modules? (warned once)
    k, v = _keys_values(k, v)
    inputs = CallInputs(q, k, v, bias if isinstance(bias, Tensor) else None, sinks)
    if not autocast:
        return dispatch(call, inputs, backend)
    with torch.autocast(q.device.type, enabled=False):
        return dispatch(call, inputs, backend)


def dispatch(call: AttentionCall, inputs: CallInputs, backend: str | Backend) -> Output:
    """Choose the backend for a validated call and run it (what :func:`attention` does after
    validating; entry points that validate a call themselves, such as ring attention, call it)."""
    chosen = _choose(call, backend)
    if call.quantized is not None and not chosen.reads_quantized:
        call, inputs = dequantized(call, inputs)
    if torch.compiler.is_compiling():  # a traced call records and hands over nothing
        return chosen.run(call, inputs)
    noted = begin_call(call, chosen.name)  # (recorded where record_dispatch() is open)
    # A hand-over names its target; it is looked up in the registry this call was dispatched from.
    token = registry_of_call(_REGISTRY)
    try:
        return chosen.run(call, inputs)
    finally:
        restore_registry(token)
        end_call(noted)


_MaskArg = Bool[Tensor, "*#mb #Tk"] | Mask | None
# keys: a tensor, or a KV cache's keys and values where they lie (then no values tensor)
_KeysArg = Float[Tensor, "*batch Hkv Tk Dk"] | Int[Tensor, "*batch Hkv Tk Dk"] | CacheView
_ValuesArg = Float[Tensor, "*batch Hkv Tk Dv"] | Int[Tensor, "*batch Hkv Tk Dv"] | None
_BiasArg = Float[Tensor, "*#bb #Tk"] | ScoreTerm | None


@overload
def attention(
    q: Float[Tensor, "*batch H Tq Dk"],
    k: _KeysArg,
    v: _ValuesArg = None,
    *,
    mask: _MaskArg = None,
    bias: _BiasArg = None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    sinks: Float[Tensor, " H"] | None = None,
    dropout_p: float = 0.0,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    return_weights: Literal[False] = False,
    return_lse: Literal[False] = False,
    backend: str | Backend = "auto",
) -> Float[Tensor, "*batch H Tq Dv"]: ...


@overload
def attention(
    q: Float[Tensor, "*batch H Tq Dk"],
    k: _KeysArg,
    v: _ValuesArg = None,
    *,
    mask: _MaskArg = None,
    bias: _BiasArg = None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    sinks: Float[Tensor, " H"] | None = None,
    dropout_p: float = 0.0,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    return_weights: Literal[True],
    return_lse: Literal[False] = False,
    backend: str | Backend = "auto",
) -> tuple[Float[Tensor, "*batch H Tq Dv"], Float[Tensor, "*batch H Tq Tk"]]: ...


@overload
def attention(
    q: Float[Tensor, "*batch H Tq Dk"],
    k: _KeysArg,
    v: _ValuesArg = None,
    *,
    mask: _MaskArg = None,
    bias: _BiasArg = None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    sinks: Float[Tensor, " H"] | None = None,
    dropout_p: float = 0.0,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    return_weights: Literal[False] = False,
    return_lse: Literal[True],
    backend: str | Backend = "auto",
) -> tuple[Float[Tensor, "*batch H Tq Dv"], Float[Tensor, "*batch H Tq"]]: ...


@overload
def attention(
    q: Float[Tensor, "*batch H Tq Dk"],
    k: _KeysArg,
    v: _ValuesArg = None,
    *,
    mask: _MaskArg = None,
    bias: _BiasArg = None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    sinks: Float[Tensor, " H"] | None = None,
    dropout_p: float = 0.0,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    return_weights: bool,
    return_lse: Literal[False] = False,
    backend: str | Backend = "auto",
) -> (
    Float[Tensor, "*batch H Tq Dv"]
    | tuple[Float[Tensor, "*batch H Tq Dv"], Float[Tensor, "*batch H Tq Tk"]]
): ...


@overload
def attention(
    q: Float[Tensor, "*batch H Tq Dk"],
    k: _KeysArg,
    v: _ValuesArg = None,
    *,
    mask: _MaskArg = None,
    bias: _BiasArg = None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    sinks: Float[Tensor, " H"] | None = None,
    dropout_p: float = 0.0,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: str | Backend = "auto",
) -> (
    Float[Tensor, "*batch H Tq Dv"]
    | tuple[Float[Tensor, "*batch H Tq Dv"], Float[Tensor, "*batch H Tq Tk"]]
    | tuple[Float[Tensor, "*batch H Tq Dv"], Float[Tensor, "*batch H Tq"]]
    | tuple[
        Float[Tensor, "*batch H Tq Dv"],
        Float[Tensor, "*batch H Tq Tk"],
        Float[Tensor, "*batch H Tq"],
    ]
): ...


@torch_keywords
@shape_checked
def attention(
    q: Float[Tensor, "*batch H Tq Dk"],
    k: _KeysArg,
    v: _ValuesArg = None,
    *,
    mask: _MaskArg = None,
    bias: _BiasArg = None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    sinks: Float[Tensor, " H"] | None = None,
    dropout_p: float = 0.0,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: str | Backend = "auto",
) -> (
    Float[Tensor, "*batch H Tq Dv"]
    | tuple[Float[Tensor, "*batch H Tq Dv"], Float[Tensor, "*batch H Tq Tk"]]
    | tuple[Float[Tensor, "*batch H Tq Dv"], Float[Tensor, "*batch H Tq"]]
    | tuple[
        Float[Tensor, "*batch H Tq Dv"],
        Float[Tensor, "*batch H Tq Tk"],
        Float[Tensor, "*batch H Tq"],
    ]
):
    """Scaled dot-product attention: ``softmax(mod(cap(q k^T * scale) + bias), masked) v``.

    Args:
        q: queries ``(..., H, Tq, Dk)``.
        k: keys ``(..., Hkv, Tk, Dk)``. ``H`` must be a multiple of ``Hkv``: with ``Hkv < H`` each
            group of ``H / Hkv`` query heads shares one key/value head (grouped-query attention;
            ``Hkv = 1`` is multi-query attention). k and v are not copied per head.

            Or the keys and values of a KV cache where they lie, a
            :class:`~attnkit.caches.view.CacheView` (then no ``v``): ``attention(q, view)`` with
            ``q`` ``(N, H, Tq, Dk)`` attends row ``n``'s queries to its own keys
            ``view.kv_range[n]`` of a contiguous cache or of pages through a block table, the
            queries aligned bottom-right to the end of the row's keys. Rows whose keys differ
            take a band for a mask (``causal``, :func:`~attnkit.masks.causal`,
            :func:`~attnkit.masks.sliding_window`, their ``&``) and a bias by distance or none;
            rows that share their keys take anything a dense call takes. ``chunked`` reads the
            cache in place (the native kernel's decode path), ``reference`` gathers each row's
            keys; :func:`explain` says which, and why.
        v: values ``(..., Hkv, Tk, Dv)``; None with a cache view.
        mask: which pairs may attend, **True = this query may attend this key** (torch SDPA's
            convention): a bool tensor broadcastable to ``(..., H, Tq, Tk)``, or a structured
            :class:`~attnkit.masks.Mask` (:func:`~attnkit.masks.causal`,
            :func:`~attnkit.masks.sliding_window`, :func:`~attnkit.masks.documents`,
            :func:`~attnkit.masks.key_padding`, :func:`~attnkit.masks.from_fn`, combined with
            ``&`` and ``|``), which is never written out as a ``(Tq, Tk)`` matrix by the chunked
            backend: it skips the blocks the mask hides.
        bias: added to the scores: a float tensor in q's dtype, broadcastable to
            ``(..., H, Tq, Tk)`` (ALiBi, a T5 bias, an additive float mask), or a lazy
            :class:`~attnkit.scores.ScoreTerm` computed tile by tile (relative positions).
            Differentiable. ``-inf`` masks that pair; NaN and ``+inf`` are a ``ValueError``.
        causal: shorthand for ``mask=masks.causal()`` (ANDed with ``mask``): query ``i`` may
            attend key ``j`` iff ``j <= i + Tk - Tq``. The alignment is bottom-right, which is what
            a KV cache needs: new queries sit after the cached keys::

                Tq=2, Tk=5        Tq=5, Tk=2
                1 1 1 1 0         0 0
                1 1 1 1 1         0 0
                                  0 0
                                  1 0
                                  1 1

            (``masks.causal(align="top_left")`` is the other alignment.)
        scale: multiplies ``q k^T``; default ``1 / sqrt(Dk)``. Must be finite and representable
            in the dtype the scores are computed in.
        softcap: caps the scaled scores, ``softcap * tanh(s / softcap)``, before ``bias`` and the
            mask (Gemma 2's logit softcapping). Any number > 0, exact in every backend (a huge
            cap is no cap, a tiny one a hard limit), or None.
        score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score``, any
            function of the scores written with tensor operations, applied after ``softcap``
            and ``bias`` and before the mask (so a masked pair stays masked whatever it returns
            there). ``score`` is a float tile ``(B, H, rows, keys)`` and the indices are int64
            tensors broadcastable to it, ``(B, 1, 1, 1)``, ``(1, H, 1, 1)``, ``(1, 1, rows, 1)``
            and ``(1, 1, 1, keys)`` (``b`` counts the batch dims flattened; ``q_idx`` and
            ``kv_idx`` are raw positions). Differentiable: gradients reach q, k and the tensors
            it captures in its closure, default arguments, the globals it names or its object's
            attributes (a captured tensor that needs gradients and is reached otherwise is a
            ``ValueError``). Served by ``chunked`` (tile by tile, O(T) memory) and ``reference``.
        sinks: ``(H,)`` logits in q's dtype, one per head, that join every row's softmax
            denominator and attend to nothing (attention sinks, as in GPT-OSS): the row's
            weights sum to less than 1. Differentiable. ``-inf`` is no sink for that head; NaN
            and ``+inf`` are a ``ValueError``.
        dropout_p: dropout on the attention weights (always applied when > 0: pass 0 in eval).
        k_scale, v_scale: for ``k`` and ``v`` stored as ``torch.int8``, ``torch.float8_e4m3fn``
            or ``torch.float8_e5m2`` (a quantized KV cache): float tensors broadcastable to
            ``(..., Hkv, Tk, 1)``, a scale per token and key/value head, per head, or one. The
            keys used are ``(k.float() * k_scale).to(q.dtype)``, the values likewise. The native
            kernel's decode path (``chunked``: at most 16 queries, no gradients, q not float64)
            reads them in place, dequantized in registers in float32 (for a float16/bfloat16 q,
            closer to ``k.float() * k_scale`` than that formula rounded to q's dtype); every
            other path dequantizes them first, a copy that :func:`explain` lists as a cost.
            Gradients reach q and the scales.
        return_weights: also return the softmax weights ``(..., H, Tq, Tk)`` (before dropout,
            without the sinks' share). Only the ``reference`` backend computes them, so ask only
            when you need them.
        return_lse: also return the natural-log log-sum-exp of each query's scores
            ``(..., H, Tq)`` in the dtype the scores are computed in (float32 for float16/bfloat16,
            the sinks' share included; ``-inf`` for a query with no visible key), the log of the
            softmax's denominator. Differentiable. With it, partial attentions over disjoint sets
            of keys (chunked prefill, cascades, shards) merge exactly:
            :func:`merge_attention`. Served by ``chunked`` and ``reference``.
        backend: ``"auto"`` (default), a name from :func:`available_backends`, or a
            :class:`~attnkit.Backend` such as ``attnkit.backends.Chunked(block_q=64)``. ``auto``
            takes the fastest backend that can serve the call without materialising a
            ``(Tq, Tk)`` tensor it does not need; :func:`explain` tells which and why.

    Returns:
        The output ``(..., H, Tq, Dv)`` in q's dtype; ``(output, weights)``, ``(output, lse)`` or
        ``(output, weights, lse)`` when asked for.

    Masked pairs and non-finite values, in every backend:

    * a query with no key it may attend (a fully masked row, or ``Tk = 0``) gets output 0,
      weights 0 and zero gradients, never NaN;
    * a masked pair never influences any output or gradient, whatever q, k, v or ``bias`` hold
      there: NaN padding is harmless;
    * a NaN or inf in a visible input reaches exactly the outputs that depend on it (as NaN or
      inf, never hidden as 0): a query's row, or the value dims of the queries that see that key.

    float16 and bfloat16 inputs accumulate the softmax in float32.

    Raises:
        TypeError, ValueError: for bad arguments, naming the argument and quoting shapes or values.
        BackendError: when the requested backend cannot serve the call (a ``ValueError``).

    >>> import torch
    >>> from attnkit import masks
    >>> q = torch.randn(2, 8, 5, 16)     # (B, H, Tq, Dk)
    >>> kv = torch.randn(2, 2, 7, 16)    # grouped-query: 2 key/value heads for 8 query heads
    >>> attention(q, kv, kv, causal=True).shape
    torch.Size([2, 8, 5, 16])
    >>> window = masks.sliding_window(3) & masks.key_padding([7, 4])
    >>> attention(q, kv, kv, mask=window, softcap=30.0).shape
    torch.Size([2, 8, 5, 16])
    >>> from attnkit.caches.view import CacheView
    >>> cache = torch.randn(2, 2, 64, 16)  # a KV cache of 64 positions a row, 12 and 30 held
    >>> attention(q[:, :, -1:], CacheView(cache, cache, [(0, 12), (0, 30)]), causal=True).shape
    torch.Size([2, 8, 1, 16])

    Shape legend: ``...`` batch dims, ``H`` query heads, ``Hkv`` key/value heads, ``Tq`` queries,
    ``Tk`` keys, ``Dk`` query/key size, ``Dv`` value size.
    """
    return _run(  # type: ignore[return-value]
        q,
        k,
        v,
        mask,
        bias,
        causal,
        scale,
        softcap,
        sinks,
        dropout_p,
        return_weights,
        return_lse,
        backend,
        score_mod,
        k_scale,
        v_scale,
    )


@torch_keywords
@shape_checked
def explain(
    q: Float[Tensor, "*batch H Tq Dk"],
    k: _KeysArg,
    v: _ValuesArg = None,
    *,
    mask: _MaskArg = None,
    bias: _BiasArg = None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    sinks: Float[Tensor, " H"] | None = None,
    dropout_p: float = 0.0,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: str | Backend = "auto",
    device: str | torch.device | None = None,
) -> Explanation:
    """Which backend :func:`attention` would use for these arguments, and why not the others.

    Takes :func:`attention`'s arguments and runs nothing. Tensors on ``device="meta"`` work, so a
    call can be explained without allocating it. ``print()`` the result for the report; for a
    structured mask it also says how many blocks the chunked kernel would compute:

    >>> import torch
    >>> from attnkit import masks
    >>> q = torch.empty(1, 8, 4096, 64, device="meta")
    >>> print(explain(q, q, q, causal=True))
    attention call: q (1, 8, 4096, 64), k (1, 8, 4096, 64), v (1, 8, 4096, 64) float32 on meta, ...
    auto picks: sdpa
      sdpa       chosen
                 hands the call to chunked if torch's output breaks the non-finite policy (NaN/...
      chunked    could serve it, but comes later in the order
      reference  avoided: would materialise the scores (..., H, Tq, Tk) = (1, 8, 4096, 4096); ...
    >>> q = torch.empty(1, 8, 4096, 64)
    >>> print(explain(q, q, q, mask=masks.sliding_window(512)))
    attention call: q (1, 8, 4096, 64), k (1, 8, 4096, 64), v (1, 8, 4096, 64) float32 on cpu, ...
    auto picks: chunked
      sdpa       avoided: would materialise the mask sliding_window(left=512, right=0) as a ...
      chunked    chosen
                 block plan: ... computed, ... with a mask, in ... visits (...)
                 ...
      reference  avoided: would materialise the scores (..., H, Tq, Tk) = (1, 8, 4096, 4096); ...

    The report's long lines are cut at ``...`` here, as are the block counts and the kernel that
    runs the call (the native kernel, or the eager one and why: see the native kernel's guide).
    With a structured mask on a real device it
    also says how many blocks the chunked kernel computes; for a call that needs gradients it
    reads whether q, k and v are finite, as :func:`attention` does, so it names the backend that
    will run.

    ``device="cuda"`` (or ``"rocm"``, ``"xpu"``, ``"cpu"``) explains the call as it would run on
    that device, whatever device the tensors are on and on any machine: the same rules decide
    (torch's version, whether its compiled FlexAttention runs there, which of SDPA's kernels
    serves the call), read for a GPU this process has, else for the one they assume (for
    ``"cuda"``, an H100). Nothing is read from the tensors then (no block plan):

    >>> q = torch.empty(1, 8, 4096, 64, device="meta", dtype=torch.bfloat16)
    >>> print(explain(q, q, q, mask=masks.sliding_window(512), device="cuda"))
    attention call: q (1, 8, 4096, 64), k (1, 8, 4096, 64), v (1, 8, 4096, 64) bfloat16 on cuda, ...
    device: cuda (NVIDIA, sm_90, assumed: torch sees no such device), torch ...
    auto picks: flex
      sdpa       avoided: would materialise the mask sliding_window(left=512, right=0) as a ...
      flex       chosen
                 ...
      chunked    avoided: runs the eager kernel (the native kernel runs on CPUs, not cuda)
      reference  avoided: would materialise the scores (..., H, Tq, Tk) = (1, 8, 4096, 4096); ...
    """
    checked_k, checked_v, quantized = _quantized(q, k, v, k_scale, v_scale)
    # the call attention() makes
    args, _, autocast_dtype = under_autocast((q, checked_k, checked_v, bias, sinks))
    call = _call_of(
        args,
        mask,
        causal,
        scale,
        softcap,
        dropout_p,
        return_weights,
        return_lse,
        autocast_dtype,
        score_mod,
    )
    read = args[0]  # q as the call reads it (under autocast, in its dtype)
    if quantized is not None and (
        isinstance(read, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    ):
        call = _with_quantized(call, quantized, read, k, v)
    chosen = check_backend(backend)
    if device is None:
        return _decide(call, chosen)
    where = parse_device(device)
    if where.present and call.device.type == where.type:
        return _decide(call, chosen)  # the tensors are on it: as attention() decides
    # The call as on that device, its tensors (on meta or elsewhere) not read.
    with assuming(where):
        return _decide(dataclasses.replace(call, device=torch.device(where.type)), chosen)


def merge_attention(
    outs: Sequence[Tensor], lses: Sequence[Tensor]
) -> tuple[Float[Tensor, "*batch H Tq Dv"], Float[Tensor, "*batch H Tq"]]:
    """Merge partial attentions of the same queries over disjoint sets of keys into the attention
    over all of them: ``(out, lse)`` from ``attention(..., return_lse=True)`` calls.

    ``out = sum_i exp(lse_i - lse) * out_i`` with ``lse = logsumexp_i lse_i``: exact (to rounding),
    and differentiable. A query no part lets see any key stays 0 with ``lse = -inf``. A sink must
    join one part only (its share is in that part's ``lse``).

    >>> import torch
    >>> q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    >>> a = attention(q, k[..., :3, :], v[..., :3, :], return_lse=True)
    >>> b = attention(q, k[..., 3:, :], v[..., 3:, :], return_lse=True)
    >>> out, lse = merge_attention([a[0], b[0]], [a[1], b[1]])
    >>> torch.allclose(out, attention(q, k, v))
    True
    """
    if not outs or len(outs) != len(lses):
        raise ValueError(
            f"merge_attention() takes as many outputs as log-sum-exps, at least one; got "
            f"{len(outs)} and {len(lses)}"
        )
    shape = tuple(outs[0].shape)
    for i, (o, lse) in enumerate(zip(outs, lses, strict=True)):
        if tuple(o.shape) != shape or tuple(lse.shape) != shape[:-1]:
            raise ValueError(
                f"merge_attention(): part {i} has out {shape_str(o.shape)} and lse "
                f"{shape_str(lse.shape)}; every out must be {shape_str(shape)} and every lse "
                f"{shape_str(shape[:-1])}"
            )
    stacked = torch.stack([lse.to(torch.promote_types(lse.dtype, torch.float32)) for lse in lses])
    nothing = (stacked == float("-inf")).all(0)  # no part sees a key: 0, and no NaN gradients
    total = torch.logsumexp(stacked.masked_fill(nothing, 0.0), 0).masked_fill(nothing, -math.inf)
    anchor = total.masked_fill(nothing, 0.0)
    out = sum(
        (lse - anchor).exp().unsqueeze(-1) * o.to(stacked.dtype)
        for o, lse in zip(outs, stacked, strict=True)
    )
    return out.to(outs[0].dtype), total
