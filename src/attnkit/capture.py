"""``capture_attention(model)``: record the attention weights of every attnkit module in a model.

>>> import torch, attnkit
>>> model = torch.nn.Sequential(attnkit.MultiHeadAttention(16, 4))
>>> with attnkit.capture_attention(model) as maps:
...     _ = model(torch.randn(2, 5, 16))
>>> list(maps), maps["0"][0].shape
(['0'], torch.Size([2, 4, 5, 5]))

Outside the context nothing is recorded and no weights are computed: an attention module asks
:func:`is_capturing` (one check of an empty list) and keeps its fast path.

For module authors: an attnkit attention module calls ``is_capturing(self)`` in its forward; when
True it computes the per-head weights ``(B, H, Tq, Tk)`` and passes them to ``record(self, w)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor, nn

__all__ = ["AttentionMaps", "capture_attention", "is_capturing", "record"]


class AttentionMaps(dict[str, list[Tensor]]):
    """Module name (as in ``model.named_modules()``) -> the weights of each forward call, in order.

    Each entry is a detached ``(B, H, Tq, Tk)`` tensor of per-head attention weights.
    """


# Active captures, innermost last: (module -> its name in the captured model, where to record).
_ACTIVE: list[tuple[dict[nn.Module, str], AttentionMaps]] = []


@contextlib.contextmanager
def capture_attention(model: nn.Module) -> Iterator[AttentionMaps]:
    """Within the context, every attnkit attention module inside ``model`` records its weights.

    The model's code and call sites stay as they are. Nested captures each get their own record.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture_attention() takes an nn.Module, got {type(model).__name__}")
    names = {m: name for name, m in model.named_modules()}
    maps = AttentionMaps()
    entry = (names, maps)
    _ACTIVE.append(entry)
    try:
        yield maps
    finally:
        _ACTIVE.remove(entry)


def is_capturing(module: nn.Module) -> bool:
    """True if a :func:`capture_attention` context wants this module's weights."""
    return bool(_ACTIVE) and any(module in names for names, _ in _ACTIVE)


def record(module: nn.Module, weights: Tensor) -> None:
    """Store ``weights`` ``(B, H, Tq, Tk)`` for every active capture that covers ``module``."""
    for names, maps in _ACTIVE:
        if module in names:
            maps.setdefault(names[module], []).append(weights.detach())
