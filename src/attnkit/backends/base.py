"""What a backend is: a function with ``attention()``'s arguments, and what it says about a call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from torch import Tensor

from .._call import AttentionCall
from ..masks import Mask
from ..scores import ScoreTerm

__all__ = ["Backend", "BackendError", "BackendFn", "CallCheck"]


@runtime_checkable
class BackendFn(Protocol):
    """The signature every backend implements: :func:`attnkit.attention`'s arguments, validated.

    ``mask`` is the call's visibility as one :class:`~attnkit.masks.Mask` (``mask`` and ``causal``
    together; a bool tensor arrives wrapped, ``mask.dense(...)`` writes it out) or None; ``bias``
    is a float tensor or a :class:`~attnkit.scores.ScoreTerm`; ``scale`` is a float.
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
    ) -> Tensor | tuple[Tensor, Tensor]: ...


CallCheck = Callable[[AttentionCall], list[str]]


def _no_reasons(call: AttentionCall) -> list[str]:
    return []


class Backend:
    """A backend: its function and what it says about a call.

    * ``check(call)``: the reasons it *cannot* serve an :class:`~attnkit.AttentionCall` (empty:
      it can);
    * ``cost(call)``: the reasons ``auto`` should prefer another backend even though this one can
      serve the call (``(Tq, Tk)``-sized tensors it would materialise that the call does not need);
    * ``auto``: whether ``backend="auto"`` may pick it.

    Pass a name to :func:`attnkit.attention` for a registered backend, or a ``Backend`` itself (for
    example ``attnkit.backends.Chunked(block_q=64, block_k=64)``).
    """

    def __init__(
        self,
        name: str,
        fn: BackendFn,
        *,
        check: CallCheck | None = None,
        cost: CallCheck | None = None,
        auto: bool = True,
    ) -> None:
        if not isinstance(name, str) or not name or name == "auto":
            raise ValueError(
                f"backend name must be a non-empty string other than 'auto', got {name!r}"
            )
        if not callable(fn):
            raise TypeError(f"backend {name!r}: fn must be callable, got {type(fn).__name__}")
        for what, f in (("check", check), ("cost", cost)):
            if f is not None and not callable(f):
                raise TypeError(
                    f"backend {name!r}: {what} must be a function of the call returning a list "
                    f"of reasons, or None; got {f!r}"
                )
        if not isinstance(auto, bool):
            raise TypeError(f"backend {name!r}: auto must be a bool, got {auto!r}")
        self.name = name
        self.fn = fn
        self.check: CallCheck = check or _no_reasons
        self.cost: CallCheck = cost or _no_reasons
        self.auto = auto

    def reasons(self, call: AttentionCall) -> tuple[list[str], list[str]]:
        """``(check(call), cost(call))``, each checked to be a list of strings."""
        out = []
        for what, f in (("check", self.check), ("cost", self.cost)):
            got = f(call)
            if not isinstance(got, list) or not all(isinstance(r, str) for r in got):
                raise TypeError(
                    f"backend {self.name!r}: {what}(call) must return a list of strings, got "
                    f"{got!r}"
                )
            out.append(got)
        return out[0], out[1]

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"


class BackendError(ValueError):
    """A backend was asked for a call it cannot serve; the message lists its reasons."""
