"""``capture_attention(model)``: record the attention weights of every attnkit module in a model.

>>> import torch, attnkit
>>> model = torch.nn.Sequential(attnkit.MultiHeadAttention(16, 4))
>>> with attnkit.capture_attention(model) as maps:
...     _ = model(torch.randn(2, 5, 16))
>>> list(maps), maps["0"][0].shape
(['0'], torch.Size([2, 4, 5, 5]))

A capture belongs to the context that opened it (a :mod:`contextvars` context: the thread, or the
asyncio task): calls made meanwhile by other threads or tasks, on the same model or another, are
not recorded and keep their fast path. Outside every capture nothing is recorded and no weights
are computed: an attention module asks :func:`is_capturing` (one check of an empty tuple).

Under ``torch.compile`` the captures are looked up per thread instead (the compiler cannot read a
context variable, but it can read a thread-local and guard on it per thread): compiled code run in
the thread that opened a capture is recorded, compiled code run in other threads is not.

For module authors: an attnkit attention module calls ``is_capturing(self)`` in its forward; when
True it computes the per-head weights ``(B, H, Tq, Tk)`` and passes them to ``record(self, w)``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import Tensor, nn

__all__ = ["AttentionMaps", "capture_attention", "is_capturing", "record"]


class AttentionMaps(dict[str, list[Tensor]]):
    """Module name (as in ``model.named_modules()``) -> the weights of each forward call, in order.

    Each entry is a detached ``(B, H, Tq, Tk)`` tensor of per-head attention weights.
    """


# One open capture: (module -> its name in the captured model, where to record).
_Capture = tuple[dict[nn.Module, str], AttentionMaps]

# The captures open in this context, innermost last. A module global list would be shared by
# every thread: one thread's capture would record, and slow down, every other thread's calls.
_ACTIVE: ContextVar[tuple[_Capture, ...]] = ContextVar("attnkit_captures", default=())


# The same captures per thread, in attribute "active", for compiled code only (see the module
# docstring).
_THREAD = threading.local()


def _thread_active() -> tuple[_Capture, ...]:
    active: tuple[_Capture, ...] = getattr(_THREAD, "active", ())
    return active


def _without(active: tuple[_Capture, ...], entry: _Capture) -> tuple[_Capture, ...]:
    return tuple(e for e in active if e is not entry)


def _active() -> tuple[_Capture, ...]:
    if torch.compiler.is_compiling():
        return _thread_active()
    return _ACTIVE.get()


@contextlib.contextmanager
def capture_attention(model: nn.Module) -> Iterator[AttentionMaps]:
    """Within the context, every attnkit attention module inside ``model`` records its weights.

    The model's code and call sites stay as they are. Nested captures each get their own record.
    Only calls made in the context that entered the ``with`` block are recorded, not those of
    other threads or asyncio tasks running at the same time.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture_attention() takes an nn.Module, got {type(model).__name__}")
    names = {m: name for name, m in model.named_modules()}
    maps = AttentionMaps()
    entry = (names, maps)
    _ACTIVE.set((*_ACTIVE.get(), entry))
    _THREAD.active = (*_thread_active(), entry)
    try:
        yield maps
    finally:
        # Removed by identity rather than by ContextVar.reset(): captures closed out of order
        # (two generators, say) still each remove their own entry.
        _ACTIVE.set(_without(_ACTIVE.get(), entry))
        _THREAD.active = _without(_thread_active(), entry)


def is_capturing(module: nn.Module) -> bool:
    """True if a :func:`capture_attention` context of the caller wants this module's weights."""
    active = _active()
    return bool(active) and any(module in names for names, _ in active)


def record(module: nn.Module, weights: Tensor) -> None:
    """Store ``weights`` ``(B, H, Tq, Tk)`` for every active capture that covers ``module``."""
    for names, maps in _active():
        if module in names:
            maps.setdefault(names[module], []).append(weights.detach())
