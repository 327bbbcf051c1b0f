"""Hints for the mistakes people bring from torch: its mask convention and its keyword names.

attnkit's masks are True = may attend. ``torch.nn.MultiheadAttention``'s bool ``attn_mask`` and
``key_padding_mask`` are the opposite (True = may NOT attend), and so is the ``triu(1)`` causal
mask torch code builds for them; such a mask passed as ``mask=`` runs without an error and attends
exactly the wrong keys. Two cheap tests catch the common cases (:func:`warn_torch_convention`);
torch's keyword names get an error naming attnkit's (:func:`torch_keywords`).
"""

from __future__ import annotations

import functools
import inspect
import os
import types
import warnings
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch
from torch import Tensor

__all__ = ["TORCH_KEYWORDS", "padding_mask_hint", "torch_keywords", "warn_torch_convention"]

P = ParamSpec("P")
R = TypeVar("R")

_CONVERT = (
    "attnkit.interop.torch.from_torch_masks(attn_mask, key_padding_mask, num_heads=H) converts "
    "torch's masks into attnkit's"
)

# torch's keyword -> what to pass to attnkit instead.
TORCH_KEYWORDS: dict[str, str] = {
    "is_causal": "causal=True",
    "attn_mask": (
        "mask= (bool, True = may attend) or bias= (float, added to the scores); "
        "nn.MultiheadAttention's bool attn_mask is True = may NOT attend: " + _CONVERT
    ),
    "key_padding_mask": (
        "mask=attnkit.masks.key_padding(lengths) or mask=attnkit.masks.key_padding(valid=...) "
        "(True = real key); torch's key_padding_mask is True = padding: " + _CONVERT
    ),
    "need_weights": "return_weights=True",
    "average_attn_weights": (
        "nothing: where attnkit returns weights they come per head, (..., H, Tq, Tk), and "
        "weights.mean(dim=-3) averages them (MultiHeadAttention takes average_weights=)"
    ),
    "enable_gqa": "nothing: attnkit takes k and v with fewer heads than q as they are",
    # nn.TransformerEncoderLayer / DecoderLayer / Transformer's names
    "src_mask": (
        "mask= (bool, True = may attend) or bias= (float, added to the scores); torch's bool "
        "src_mask is True = may NOT attend: " + _CONVERT
    ),
    "tgt_mask": (
        "causal=True, or mask= (bool, True = may attend) or bias= (float, added to the scores); "
        "torch's bool tgt_mask is True = may NOT attend: " + _CONVERT
    ),
    "src_key_padding_mask": (
        "mask=attnkit.masks.key_padding(lengths) (True = real key); torch's "
        "src_key_padding_mask is True = padding: " + _CONVERT
    ),
    "tgt_key_padding_mask": (
        "mask=attnkit.masks.key_padding(lengths) (True = real key); torch's "
        "tgt_key_padding_mask is True = padding: " + _CONVERT
    ),
    "memory_key_padding_mask": (
        "memory_mask=attnkit.masks.key_padding(memory_lengths) (True = real key); torch's "
        "memory_key_padding_mask is True = padding: " + _CONVERT
    ),
    "src_is_causal": "causal=True (a layer's argument)",
    "tgt_is_causal": "nothing: attnkit's decoder layers are causal unless given causal=False",
    "memory_is_causal": "memory_mask=attnkit.masks.causal()",
}

# torch's keyword -> (attnkit's parameter, what to pass where the function takes that parameter).
_RENAMED: dict[str, tuple[str, str]] = {
    "average_attn_weights": ("average_weights", "average_weights= (same meaning)"),
}


def torch_keywords(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn``, raising a ``TypeError`` that names attnkit's argument when it is called with one
    of torch's keyword names that ``fn`` does not take (``is_causal=``, ``attn_mask=``, ...).

    The check runs only when a call passes such a keyword, so the cost of a call is one test of
    its keywords."""
    taken = set(inspect.signature(fn).parameters)
    foreign = {k: v for k, v in TORCH_KEYWORDS.items() if k not in taken}
    for k, (own, advice) in _RENAMED.items():
        if k in foreign and own in taken:
            foreign[k] = advice
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", "the function"))

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        # A comprehension, not dict_keys.isdisjoint: torch.compile traces this wrapper.
        used = [k for k in kwargs if k in foreign] if kwargs else []
        if used:
            advice = "; ".join(f"instead of {k}=, pass {foreign[k]}" for k in used)
            raise TypeError(f"{name}() takes no {'=, '.join(used)}= (torch's name): {advice}")
        return fn(*args, **kwargs)

    return wrapper


# Kinds of warning already given: each is given once per process.
_warned: set[str] = set()


def warn_torch_convention(mask: Tensor, name: str = "mask") -> None:
    """Warn, once, when the bool ``mask`` (True = may attend, broadcastable to ``(..., H, Tq,
    Tk)``) looks like a mask in torch's convention (True = may NOT attend):

    * a whole batch element whose every query sees no key: what a torch ``key_padding_mask``
      gives for a sequence without padding (and it leaves the others attending only their
      padding);
    * exactly the strictly upper triangle of a square ``(T, T)`` mask: a ``triu(1)`` causal
      mask, which in attnkit lets each query see only the keys after it.

    Both are almost never meant. The test reads the mask once: one reduction over it, and a wait
    for the result on an accelerator; it is skipped while torch.compile or torch.export trace, and
    for tensors without data (``device="meta"``)."""
    if len(_warned) == 2 or mask.dtype != torch.bool or mask.device.type == "meta":
        return
    if torch.compiler.is_compiling() or mask.ndim < 2 or mask.numel() == 0:
        return
    if "batch" not in _warned and mask.ndim >= 4:  # (..., H, Tq, Tk): it has batch dims
        # Per batch element (the batch dims flattened): does any query see any key?
        blind = ~mask.flatten(0, -4).flatten(1).any(-1)  # (B,)
        if bool(blind.any()):
            first = int(blind.nonzero()[0, 0])
            _warn(
                "batch",
                f"{name} lets no query of batch element {first} (of {blind.numel()}) attend "
                "any key, which gives that element all-zero outputs. attnkit's masks are True = "
                "may attend; torch's key_padding_mask and attn_mask are True = may NOT attend. "
                f"If this is one of those, {_CONVERT}, or invert it (~{name}); "
                "for padding, attnkit.masks.key_padding(lengths) says it without a tensor; "
                f"if it is meant, attnkit.masks.from_tensor({name}) says so",
            )
    t = mask.size(-1)
    if "triu" not in _warned and t > 1 and mask.shape[-2:] == (t, t) and mask.numel() == t * t:
        square = mask.reshape(t, t)
        if bool(torch.equal(square, torch.ones_like(square).triu(1))):
            _warn(
                "triu",
                f"{name} is the strictly upper triangle of a ({t}, {t}) matrix, which lets each "
                "query attend only the keys after it. attnkit's masks are True = may attend; "
                "torch's causal attn_mask (torch.ones(T, T).triu(1), True = may NOT attend) "
                "is the opposite: pass causal=True (or mask=attnkit.masks.causal()) instead",
            )


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # attnkit/


def _outside_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside attnkit (and the shape-checking wrappers
    around its functions): the user's line that made the call."""
    here = inspect.currentframe()
    frame: types.FrameType | None = None if here is None else here.f_back
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_PACKAGE) or "jaxtyping" in name or "beartype" in name):
            return level
        frame, level = frame.f_back, level + 1
    return level


def _warn(kind: str, message: str) -> None:
    _warned.add(kind)
    level = _outside_stacklevel()
    warnings.warn(f"{message} (this warning is given once)", UserWarning, stacklevel=level)


def padding_mask_hint(shape: tuple[int, ...], target: tuple[int, ...]) -> str:
    """A sentence for the error about a mask of ``shape`` that does not broadcast to the scores'
    ``target`` ``(..., H, Tq, Tk)``: when it is ``(B, Tk)``, a padding mask, how to pass one;
    otherwise ``""``."""
    if len(shape) == 2 and len(target) >= 4 and shape == (target[0], target[-1]):
        return (
            f"; a (B, Tk) = {tuple(shape)} padding mask (True = real key) goes in as "
            "attnkit.masks.key_padding(valid=mask), or as mask[:, None, None, :] of shape "
            "(B, 1, 1, Tk); a torch key_padding_mask (True = padding) as "
            "attnkit.masks.key_padding(valid=~mask)"
        )
    return ""
