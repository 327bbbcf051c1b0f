"""Recognising transformers' mask functions: the patterns attnkit can serve without a dense mask.

transformers hands its mask interface a function, not a mask. Its own functions are recognised by
identity (causal, bidirectional) and by their ``__qualname__`` and closures (sliding windows built
as ``and_masks(overlay(window), base)``, packed sequences as a remapped pattern ANDed with "same
sequence"); a reading is then checked on sample positions (:func:`agrees`), so a transformers
whose functions mean something else falls back to its own dense mask instead of a wrong one.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from ...masks import band_visibility

__all__ = ["Pattern", "agrees", "recognise", "unpack"]


@dataclass(frozen=True)
class Pattern:
    """A mask pattern transformers builds from a known function, in its absolute positions.

    ``causal``: key ``k`` visible from query ``q`` only if ``k <= q``; with ``window`` also
    ``k > q - window`` (the window counts the query's own key). Not causal: every key, or with
    ``window`` those with ``|q - k| <= window``.
    """

    causal: bool
    window: int | None = None

    def visible(self, q: Tensor, k: Tensor) -> Tensor:
        """Which (query, key) position pairs this pattern lets through (broadcast int tensors)."""
        if self.causal:  # the window counts the query's own key
            lo = -math.inf if self.window is None else -(self.window - 1)
            return band_visibility(q, k, lo, 0)
        bound = math.inf if self.window is None else self.window
        return band_visibility(q, k, -bound, bound)


def _free_variables(fn: object) -> dict[str, Any]:
    """The variables a Python function closes over (none for other callables)."""
    if not inspect.isfunction(fn):
        return {}
    try:
        return dict(inspect.getclosurevars(fn).nonlocals)
    except AttributeError:
        # torch.compile cannot read the closure of a function made while it traces (a model's
        # window function): the pattern goes unrecognised, and transformers' dense mask serves.
        return {}


def recognise(fn: object) -> Pattern | None:
    """The pattern of one of transformers' own mask functions, or None for anything else.

    transformers builds sliding windows as ``and_masks(overlay(window), base)`` closures; their
    parts are read from the closure, and :func:`agrees` then checks the reading on sample
    positions, so a future transformers that changes what these functions mean is caught here
    (the mask becomes dense) instead of giving wrong masks.
    """
    from transformers import masking_utils as mu

    if fn is mu.causal_mask_function:
        return Pattern(causal=True)
    if fn is mu.bidirectional_mask_function:
        return Pattern(causal=False)
    if getattr(fn, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = _free_variables(fn).get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    overlay, base = parts
    window = _free_variables(overlay).get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        return None
    overlay_name = getattr(overlay, "__qualname__", "")
    if base is mu.causal_mask_function and overlay_name.startswith("sliding_window_overlay."):
        return Pattern(causal=True, window=window)
    if base is mu.bidirectional_mask_function and overlay_name.startswith(
        "sliding_window_bidirectional_overlay."
    ):
        return Pattern(causal=False, window=window)
    return None


def unpack(fn: object) -> tuple[Callable[..., Tensor], Tensor] | None:
    """``(pattern function, document ids (B, T))`` when ``fn`` is transformers' mask of packed
    sequences: a pattern remapped to each sequence's positions and ANDed with "same sequence".

    transformers starts a new sequence wherever the positions do not step by 1, so within a
    sequence the remapped positions differ as the token indices do, and a pattern of position
    differences (causal, windows) reads the same on indices. That is checked on the positions.
    """
    if getattr(fn, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = _free_variables(fn).get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    remapped, same = parts
    if not getattr(remapped, "__qualname__", "").startswith("remap_positions_for_packed_sequence."):
        return None
    if not getattr(same, "__qualname__", "").startswith("packed_sequence_mask_function."):
        return None
    inner = _free_variables(remapped).get("mask_function")
    positions = _free_variables(remapped).get("position_ids")
    ids = _free_variables(same).get("packed_sequence_mask")
    if not (callable(inner) and isinstance(positions, Tensor) and isinstance(ids, Tensor)):
        return None
    if positions.shape != ids.shape or positions.ndim != 2:
        return None
    steps = torch.diff(positions, dim=-1)
    new_sequence = torch.diff(ids, dim=-1) != 0
    if not bool(((steps == 1) | new_sequence).all()):
        return None
    return inner, ids


_AGREED: dict[Pattern, bool] = {}


def agrees(fn: Callable[..., Tensor], pattern: Pattern) -> bool:
    """Whether ``fn`` gives ``pattern``'s answer at the positions where patterns differ.

    Queries near the start and around one and two windows in; keys around each query, around its
    window's edges and at the start. Checked once per pattern and process.
    """
    if pattern in _AGREED:
        return _AGREED[pattern]
    agreed = _agrees_on_samples(fn, pattern.causal, pattern.window)
    if not torch.compiler.is_compiling():  # a traced store would have to rebuild the Pattern
        _AGREED[pattern] = agreed
    return agreed


def _sampled_agreement(fn: Callable[..., Tensor], causal: bool, window: int | None) -> bool:
    pattern = Pattern(causal=causal, window=window)
    w = window or 4
    queries = sorted({0, 1, 2, 3, w - 1, w, w + 1, 2 * w, 2 * w + 1})
    keys = {0, 1, 2, 3}
    for q in queries:
        for edge in (q - w, q, q + w):
            keys.update(range(max(0, edge - 2), edge + 3))
    q_pos = torch.tensor(queries).view(1, 1, -1, 1)
    k_pos = torch.tensor(sorted(keys)).view(1, 1, 1, -1)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    try:
        theirs = torch.as_tensor(fn(zero, zero, q_pos, k_pos)).expand(
            1, 1, q_pos.numel(), k_pos.numel()
        )
        return bool(torch.equal(theirs, pattern.visible(q_pos, k_pos)))
    except (RuntimeError, TypeError, IndexError):
        return False


# The answer reads the samples' values, which torch.compile cannot turn into a Python bool while it
# traces; it runs the check then and takes the answer as a constant, so a compiled fullgraph=True
# step can be the first call of a process. (Plain arguments: it rebuilds them for the call.)
_agrees_on_samples = cast(
    Callable[[Callable[..., Tensor], bool, "int | None"], bool],
    torch.compiler.assume_constant_result(_sampled_agreement),
)
