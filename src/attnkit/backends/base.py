"""The backend protocol: what a backend says about a call, and how it serves one.

A backend is a :class:`Backend`: five methods of one validated call object
(:class:`~attnkit.AttentionCall`), and nothing else the dispatcher knows of it. Each backend
speaks of itself only; none names another.

* ``check(call)``: the reasons it *cannot* serve the call (empty: it can);
* ``cost(call)``: the reasons ``auto`` should prefer another backend although this one can serve
  the call (``(Tq, Tk)``-sized tensors it would materialise that the call does not need);
* ``slower(call)``: the reasons it would serve the call on a slow path of its own (a kernel that
  is slow for this kind of call, a fallback), which ``auto`` avoids when another backend serves
  the call on its fast path;
* ``notes(call)``: what :func:`~attnkit.explain` prints under it (its plan for the call, a path it
  may take at run time);
* ``run(call, inputs)``: the output, from the call and its tensors (:class:`CallInputs`).

Write one by subclassing :class:`Backend` and overriding the methods, or by handing
:func:`~attnkit.register_backend` a function with :func:`~attnkit.attention`'s arguments
(:class:`BackendFn`).

A backend serves every call its ``check`` accepts, or hands it to another backend *visibly*
(:meth:`Backend.hand_over`, naming the other backend as it is registered: the dispatcher of the
call resolves the name): the hand-over is counted in :attr:`Backend.handovers` and recorded by
:func:`record_dispatch`, and its ``notes`` say when it can happen.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from torch import Tensor

from .._base.quantized import dequantize
from .._call import AttentionCall
from .._record import Dispatch, note_handover, record_dispatch, recording
from ..masks import Mask
from ..scores import ScoreTerm

__all__ = [
    "Backend",
    "BackendError",
    "BackendFn",
    "CallCheck",
    "CallInputs",
    "Dispatch",
    "dequantized",
    "dequantized_cost",
    "own_costs",
    "record_dispatch",
    "recording",
    "registry_of_call",
]


@dataclass(frozen=True)
class CallInputs:
    """The tensors of a validated call, as :func:`~attnkit.attention` received them (cast under
    ``torch.autocast``): ``q (..., H, Tq, Dk)``, ``k (..., Hkv, Tk, Dk)``, ``v (..., Hkv, Tk, Dv)``,
    a dense float ``bias`` broadcastable to ``(..., H, Tq, Tk)`` or None, ``sinks (H,)`` or None,
    and ``captured``: the tensors needing gradients that ``call.score_mod`` captures (a backend
    that computes the scores' gradients itself returns theirs). A lazy score term is
    ``call.score_term``; the call's visibility is ``call.mask``."""

    q: Tensor
    k: Tensor
    v: Tensor
    bias: Tensor | None = None
    sinks: Tensor | None = None
    captured: tuple[Tensor, ...] = ()


#: how a cost of :func:`dequantized_cost` begins (a backend may add its own words after it)
DEQUANTIZE = "would dequantize "


def dequantized_cost(call: AttentionCall) -> str:
    """The cost of reading a call's int8/float8 keys and values (``call.quantized``) dequantized,
    in ``explain()``'s words."""
    what = "" if call.quantized is None else call.quantized.describe()
    return f"{DEQUANTIZE}{what} first (a copy of them in q's dtype)"


def own_costs(costs: list[str]) -> list[str]:
    """``costs`` without the copy of dequantized keys and values (:func:`dequantized_cost`):
    what sets backends apart on an int8/float8 call, where every path but the native decode
    pays that copy."""
    return [c for c in costs if not c.startswith(DEQUANTIZE)]


def dequantized(call: AttentionCall, inputs: CallInputs) -> tuple[AttentionCall, CallInputs]:
    """A call on int8/float8 keys and values (``call.quantized``) as one on the keys and values
    they stand for, ``(k.float() * k_scale).to(q.dtype)``: what a backend that does not read
    them receives (differentiable in the scales)."""
    quantized = call.quantized
    if quantized is None:
        return call, inputs
    k = dequantize(inputs.k, quantized.k_scale, call.dtype)
    v = dequantize(inputs.v, quantized.v_scale, call.dtype)
    return replace(call, quantized=None), replace(inputs, k=k, v=v)


#: What a backend returns: the output, or a tuple of the output, the weights and/or the lse.
Output = Tensor | tuple[Tensor, ...]


@runtime_checkable
class BackendFn(Protocol):
    """A backend as one function: :func:`attnkit.attention`'s arguments, validated.

    ``mask`` is the call's visibility as one :class:`~attnkit.masks.Mask` (``mask`` and ``causal``
    together; a bool tensor arrives wrapped, ``mask.dense(...)`` writes it out) or None; ``bias``
    is a float tensor or a :class:`~attnkit.scores.ScoreTerm`; ``scale`` is a float. Returns the
    output, or ``(output, weights)`` when ``return_weights``.
    """

    def __call__(
        self,
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
    ) -> Output: ...


CallCheck = Callable[[AttentionCall], list[str]]

# The registry the dispatcher chose the running call's backend from, where a hand-over's target is
# looked up by name (the registry lives above the backends, which never import it).
_REGISTRY_OF_CALL: contextvars.ContextVar[Mapping[str, Backend] | None] = contextvars.ContextVar(
    "attnkit_registry_of_call", default=None
)


def registry_of_call(
    registry: Mapping[str, Backend] | None,
) -> contextvars.Token[Mapping[str, Backend] | None]:
    """Set the registry a running call's hand-overs resolve names in (the dispatcher does, around
    ``backend.run``); returns the token that restores the previous one."""
    return _REGISTRY_OF_CALL.set(registry)


def restore_registry(token: contextvars.Token[Mapping[str, Backend] | None]) -> None:
    """Undo :func:`registry_of_call`."""
    _REGISTRY_OF_CALL.reset(token)


def _no_reasons(call: AttentionCall) -> list[str]:
    return []


class Backend:
    """A backend: what it says about a call and how it serves it (see :mod:`attnkit.backends.base`).

    Subclass it and override :meth:`run` (and :meth:`check`, :meth:`cost`, :meth:`slower`,
    :meth:`notes` as needed), or pass ``fn``, a function with :func:`attnkit.attention`'s
    arguments (:class:`BackendFn`), and optional ``check``/``cost``/``slower``/``notes`` functions
    of the call.
    ``auto``: whether ``backend="auto"`` may pick it.

    Pass a name to :func:`attnkit.attention` for a registered backend, or a ``Backend`` itself (for
    example ``attnkit.backends.Chunked(block_q=64, block_k=64)``).

    A call with a ``score_mod`` goes only to a backend whose :attr:`accepts_score_mod` is True (a
    class attribute, False by default), so a backend written before score_mods existed can never
    ignore one.
    """

    #: Whether :meth:`run` applies ``call.score_mod`` (the dispatcher declines the call otherwise).
    accepts_score_mod: bool = False
    #: Whether :meth:`run` reads ``call.quantized``, int8/float8 ``inputs.k`` and ``inputs.v``
    #: with their scales: the dispatcher hands other backends the keys and values they stand for.
    reads_quantized: bool = False
    #: Whether :meth:`run` reads ``call.cache``, a KV cache's keys where they lie (``inputs.k`` and
    #: ``inputs.v`` are then its pages; :meth:`~attnkit.caches.view.CacheView.attend_rows` gives
    #: dense calls): the dispatcher declines such calls otherwise.
    accepts_cache: bool = False

    def __init__(
        self,
        name: str,
        fn: BackendFn | None = None,
        *,
        check: CallCheck | None = None,
        cost: CallCheck | None = None,
        notes: CallCheck | None = None,
        auto: bool = True,
        slower: CallCheck | None = None,
    ) -> None:
        if not isinstance(name, str) or not name or name == "auto":
            raise ValueError(
                f"backend name must be a non-empty string other than 'auto', got {name!r}"
            )
        if fn is not None and not callable(fn):
            raise TypeError(f"backend {name!r}: fn must be callable, got {type(fn).__name__}")
        for what, f in (("check", check), ("cost", cost), ("slower", slower), ("notes", notes)):
            if f is not None and not callable(f):
                raise TypeError(
                    f"backend {name!r}: {what} must be a function of the call returning a list "
                    f"of strings, or None; got {f!r}"
                )
        if not isinstance(auto, bool):
            raise TypeError(f"backend {name!r}: auto must be a bool, got {auto!r}")
        self.name = name
        self.auto = auto
        #: How many calls this backend handed to another one at run time (see :meth:`hand_over`).
        self.handovers = 0
        self._fn = fn
        self._check, self._cost, self._slower, self._notes = check, cost, slower, notes

    # ----------------------------------------------------------------------------------------------
    # The protocol

    def check(self, call: AttentionCall) -> list[str]:
        """The reasons this backend cannot serve ``call`` (empty: it can)."""
        return self._check(call) if self._check is not None else []

    def cost(self, call: AttentionCall) -> list[str]:
        """The reasons ``auto`` should prefer another backend for ``call``."""
        return self._cost(call) if self._cost is not None else []

    def slower(self, call: AttentionCall) -> list[str]:
        """The reasons this backend would serve ``call`` on a slow path of its own: ``auto``
        prefers a backend without such reasons (and either to one with costs)."""
        return self._slower(call) if self._slower is not None else []

    def notes(self, call: AttentionCall) -> list[str]:
        """Lines :func:`~attnkit.explain` prints under this backend when it can serve ``call``."""
        return self._notes(call) if self._notes is not None else []

    def run(self, call: AttentionCall, inputs: CallInputs) -> Output:
        """The output ``(..., H, Tq, Dv)`` of ``call`` (or ``(output, weights)`` when
        ``call.return_weights``), following :func:`~attnkit.attention`'s conventions."""
        if self._fn is None:
            raise NotImplementedError(f"backend {self.name!r} must implement run(call, inputs)")
        bias: Tensor | ScoreTerm | None = inputs.bias
        if bias is None:
            bias = call.score_term
        return self._fn(
            inputs.q,
            inputs.k,
            inputs.v,
            mask=call.mask,
            bias=bias,
            scale=call.scale,
            softcap=call.softcap,
            sinks=inputs.sinks,
            dropout_p=call.dropout_p,
            return_weights=call.return_weights,
        )

    # ----------------------------------------------------------------------------------------------
    # For the dispatcher and for backends

    def reasons(
        self, call: AttentionCall, *, refused_costs: bool = True
    ) -> tuple[list[str], list[str]]:
        """``(check(call), cost(call))``, each checked to be a list of strings; a call with a
        ``score_mod`` gains a reason unless :attr:`accepts_score_mod`, one on a cache unless
        :attr:`accepts_cache` (then nothing else is asked: its other answers would be of a call
        it never sees). ``refused_costs=False``: no costs for a call the backend refuses (the
        dispatcher's choice, which does not read them)."""
        if call.cache is not None and not self.accepts_cache:
            return ["reads no KV cache view (chunked reads it in place, reference gathers it)"], []
        reasons = self._strings("check", self.check(call))
        if call.score_mod is not None and not self.accepts_score_mod:
            reasons = [*reasons, "does not apply a score_mod (chunked and reference do)"]
        if reasons and not refused_costs:
            return reasons, []
        costs = self._strings("cost", self.cost(call))
        if call.quantized is not None and not self.reads_quantized:
            costs = [*costs, dequantized_cost(call)]
        return reasons, costs

    def slower_reasons(self, call: AttentionCall) -> list[str]:
        """``slower(call)``, checked to be a list of strings."""
        return self._strings("slower", self.slower(call))

    def explain_notes(self, call: AttentionCall) -> list[str]:
        """``notes(call)``, checked to be a list of strings."""
        return self._strings("notes", self.notes(call))

    def _strings(self, what: str, got: object) -> list[str]:
        if type(got) is list and not got:  # (the common answer, nothing to look through)
            return got
        if not isinstance(got, list) or not all(isinstance(r, str) for r in got):
            raise TypeError(
                f"backend {self.name!r}: {what}(call) must return a list of strings, got {got!r}"
            )
        return got

    def hand_over(
        self, call: AttentionCall, inputs: CallInputs, to: str | Backend, why: str
    ) -> Output:
        """Serve ``call`` with another backend instead, visibly: counted in :attr:`handovers` and
        recorded by :func:`record_dispatch` with ``why``.

        ``to`` is the name of a registered backend (``"chunked"``), looked up when the call runs
        in the registry its dispatcher chose from, so that a backend never imports another; or a
        :class:`Backend` object of the caller's own. The target must be able to serve the call
        (its ``check`` gives no reason), else a :class:`BackendError` names both."""
        target = to if isinstance(to, Backend) else self._registered(to, why)
        refused = target.reasons(call)[0]
        if refused:
            raise BackendError(
                f"backend {self.name!r} handed the call to {target.name!r} ({why}), which cannot "
                f"serve it: {'; '.join(refused)}"
            )
        self.handovers += 1
        note_handover(self.name, target.name, why)
        return target.run(call, inputs)

    def _registered(self, name: str, why: str) -> Backend:
        registry = _REGISTRY_OF_CALL.get()
        if registry is None:
            raise BackendError(
                f"backend {self.name!r} hands the call to {name!r} ({why}) outside a call of "
                "attnkit.attention(): a name is looked up in the registry of the running call"
            )
        if name not in registry:
            raise BackendError(
                f"backend {self.name!r} hands the call to {name!r} ({why}), which is not "
                f"registered; registered: {', '.join(registry)}"
            )
        return registry[name]

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"


class BackendError(ValueError):
    """A backend was asked for a call it cannot serve; the message lists its reasons."""
