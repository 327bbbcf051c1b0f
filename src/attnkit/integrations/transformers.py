"""attnkit as an attention implementation of Hugging Face transformers models.

::

    from attnkit.integrations.transformers import register
    register()  # once per process: "attnkit" becomes an attention implementation
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnkit")
    # or, on a model already loaded: model.set_attn_implementation("attnkit")

:func:`register` installs two functions under one name (transformers 5.20 or later):

* a **mask function** (transformers' ``AttentionMaskInterface``). Each model forward calls it once
  per kind of layer, with the query and key ranges, the 2-d padding mask and a pattern function
  (causal, sliding window, bidirectional). It returns a :class:`TransformersMask`: the pattern and
  the key padding already in :func:`attnkit.attention`'s terms, built once for all layers. The
  common case, causal plus padding, never becomes a ``(Tq, Tk)`` tensor, so ``auto`` can take an
  O(T)-memory backend; so do packed sequences (``DataCollatorWithFlattening``'s packed
  ``position_ids``), as :func:`attnkit.masks.documents`. A pattern it does not recognise (chunked
  attention, a model's own ``or``/``and`` overlays) becomes transformers' own dense bool mask,
  exactly as ``sdpa`` would get it; the mask's ``repr()`` says which form it took and why.
* an **attention function** (``AttentionInterface``), which every attention layer calls with
  ``(module, q, k, v, mask, **kwargs)`` in the ``(B, H, T, D)`` layout. It returns the output as
  ``(B, T, H, D)``, and the weights when the model collects them.

Both are needed: with an attention function alone, transformers hands it ``mask=None`` and padded
tokens are silently attended to.

What transformers passes, and what the attention function makes of it:

=============================  ===================================================================
transformers passes            attnkit gets
=============================  ===================================================================
a ``TransformersMask``         its ``mask`` and ``causal``; keys that no query may see (a static
                               cache's unfilled slots) are left out of the call
a bool 4-d tensor              ``mask=`` (True = may attend): a mask the caller built
a float 4-d tensor             ``bias=``: an additive, eager-style mask the caller built
``None``                       transformers' meaning: causal **top-left** (query ``i`` sees keys
                               ``j <= i``) if the module is causal and ``Tq > 1``, else no mask
``position_bias`` (T5)         ``bias=`` (summed with a float mask)
``softcap`` (Gemma 2)          ``softcap=``
``s_aux``/``sinks`` (GPT-OSS)  ``sinks=``
``cu_seq_lens_q/k``             packed sequences without padding, as transformers' flash-attention
``max_length_q/k``               path takes them: :func:`attnkit.flash_attn.varlen_mask` (documents,
                               causal within each when the module is causal) ANDed with the mask
packed ``position_ids``        with no mask: the same, the sequences read from the positions
``dropout``                    ``dropout_p=``, only while ``module.training``
attention weights wanted       ``return_weights=True`` when the model collects them
                               (``output_attentions=True``) or :func:`attnkit.capture_attention`
                               covers the layer; captured under the layer's module name
=============================  ===================================================================

Shape letters: ``B`` batch, ``H`` query heads, ``Hkv`` key/value heads, ``Tq`` queries, ``Tk``
keys, ``D`` head size.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import shape_str
from .._typing import Float, shape_checked
from ..attention import Backend, attention, available_backends
from ..capture import is_capturing, record
from ..flash_attn import varlen_mask
from ..masks import Mask, band_visibility, causal_mask, documents, key_padding, sliding_window

__all__ = ["TransformersMask", "build_mask", "register"]

# The oldest transformers where all of this holds. Mask functions take (q_length, q_offset) from 5.4
# on (a cache_position tensor before); T5 calls the attention interface from 5.15, and its encoder
# and decoder follow set_attn_implementation() from 5.20 (before, they silently kept their own).
MIN_TRANSFORMERS = (5, 20)
_INSTALL = 'install the hf extra: pip install "attnkit[hf]" (or ".[hf]" from a checkout)'


def _require_transformers() -> None:
    """Import transformers, or raise one ImportError that says how to get a version that works."""
    need = ".".join(map(str, MIN_TRANSFORMERS))
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"attnkit.integrations.transformers needs transformers>={need}, which is not "
            f"installed: {_INSTALL}"
        ) from e
    found = importlib.metadata.version("transformers")
    parsed = re.match(r"(\d+)\.(\d+)", found)
    if parsed is None or tuple(map(int, parsed.groups())) < MIN_TRANSFORMERS:
        raise ImportError(
            f"attnkit.integrations.transformers needs transformers>={need}, found {found}: "
            f"{_INSTALL}"
        )


# --------------------------------------------------------------------------------------------------
# The mask function


@dataclass(frozen=True)
class _Pattern:
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
    return dict(inspect.getclosurevars(fn).nonlocals)


def _recognise(fn: object) -> _Pattern | None:
    """The pattern of one of transformers' own mask functions, or None for anything else.

    transformers builds sliding windows as ``and_masks(overlay(window), base)`` closures; their
    parts are read from the closure, and :func:`_agrees` then checks the reading on sample
    positions, so a future transformers that changes what these functions mean is caught here
    (the mask becomes dense) instead of giving wrong masks.
    """
    from transformers import masking_utils as mu

    if fn is mu.causal_mask_function:
        return _Pattern(causal=True)
    if fn is mu.bidirectional_mask_function:
        return _Pattern(causal=False)
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
        return _Pattern(causal=True, window=window)
    if base is mu.bidirectional_mask_function and overlay_name.startswith(
        "sliding_window_bidirectional_overlay."
    ):
        return _Pattern(causal=False, window=window)
    return None


def _unpack(fn: object) -> tuple[Callable[..., Tensor], Tensor] | None:
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


_AGREED: dict[_Pattern, bool] = {}


def _agrees(fn: Callable[..., Tensor], pattern: _Pattern) -> bool:
    """Whether ``fn`` gives ``pattern``'s answer at the positions where patterns differ.

    Queries near the start and around one and two windows in; keys around each query, around its
    window's edges and at the start. Checked once per pattern and process.
    """
    if pattern not in _AGREED:
        w = pattern.window or 4
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
            _AGREED[pattern] = bool(torch.equal(theirs, pattern.visible(q_pos, k_pos)))
        except (RuntimeError, TypeError, IndexError):
            _AGREED[pattern] = False
    return _AGREED[pattern]


class TransformersMask:
    """What transformers' mask creation asked for, as :func:`attnkit.attention` arguments.

    The mask function builds one per forward and kind of layer; every layer's attention call then
    uses it as it is. Fields:

    * ``batch_size``, ``q_len``, ``kv_len``: the call it was built for (``Tk`` as transformers'
      cache hands the keys over, a static cache's unfilled slots included);
    * ``keys``: how many leading keys any query may see; the attention call leaves out the rest
      (they can only be a static cache's empty slots), and pads the weights back with zeros;
    * ``mask``, ``causal``: :func:`attnkit.attention`'s arguments over those keys;
    * ``form``: one line on what it is (printed by ``repr()``), naming the reason when the mask had
      to be dense.

    transformers' queries sit at positions ``q_offset + i`` and its keys at ``kv_offset + j``, and
    a causal query sees the keys at or before its own position. Mapped to attnkit, query ``i`` sits
    at key index ``i + q_offset - kv_offset``. attnkit's ``causal`` is aligned bottom-right, so
    the keys after the last query's position are cut off: a static cache of 6 slots holding 1
    cached token and 2 new ones (``q_offset=1``) uses 3 keys::

        transformers (Tq=2, Tk=6)   attnkit (keys=3, causal)
        1 1 0 0 0 0                 1 1 0
        1 1 1 0 0 0                 1 1 1

    >>> m = TransformersMask.build(_Pattern(causal=True), batch_size=1, q_len=2, kv_len=6,
    ...                            q_offset=1, kv_offset=0, padding=None, device="cpu")
    >>> m
    TransformersMask(1 x 2 queries x 6 keys: causal; 3 keys used, 3 never visible left out)
    >>> m.dense()[0, 0].int()
    tensor([[1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0]], dtype=torch.int32)
    """

    # generate() builds the masks ahead of the forward when the cache is static and treats them as
    # prepared 4-d masks: it asks for ``ndim`` and (before transformers 5.24) ``contiguous()``.
    ndim = 4

    def contiguous(self) -> TransformersMask:
        """Itself: it holds nothing to lay out."""
        return self

    def __init__(
        self,
        *,
        batch_size: int,
        q_len: int,
        kv_len: int,
        keys: int,
        mask: Tensor | Mask | None,
        causal: bool,
        form: str,
        device: torch.device | str,
        packed: bool = False,
    ) -> None:
        self.packed = packed
        self.batch_size = batch_size
        self.q_len = q_len
        self.kv_len = kv_len
        self.keys = keys
        self.mask = mask
        self.causal = causal
        self.form = form
        self.device = torch.device(device)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, 1, Tq, Tk)``, the shape of the dense mask it stands for."""
        return (self.batch_size, 1, self.q_len, self.kv_len)

    def __repr__(self) -> str:
        size = f"{self.batch_size} x {self.q_len} queries x {self.kv_len} keys"
        return f"TransformersMask({size}: {self.form})"

    def dense(self) -> Tensor:
        """The ``(B|1, 1, Tq, Tk)`` bool mask the attention call applies (True = may attend)."""
        visible = torch.ones(self.q_len, self.keys, dtype=torch.bool, device=self.device)
        if isinstance(self.mask, Mask):
            drawn = self.mask.dense(
                self.q_len, self.keys, batch_size=self.batch_size, device=self.device
            )
            visible = visible & drawn
        elif self.mask is not None:
            visible = visible & self.mask
        if self.causal:
            visible = visible & causal_mask(self.q_len, self.keys, device=self.device)
        visible = visible.reshape((1,) * (4 - visible.ndim) + tuple(visible.shape))
        return F.pad(visible, (0, self.kv_len - self.keys), value=False)

    @classmethod
    def build(
        cls,
        pattern: _Pattern,
        *,
        batch_size: int,
        q_len: int,
        kv_len: int,
        q_offset: int,
        kv_offset: int,
        padding: Tensor | None,
        device: torch.device | str,
        packed: Tensor | None = None,
    ) -> TransformersMask | str:
        """The mask for a recognised pattern, or why it cannot be served without a dense mask.

        ``packed``: ``(B, Tk)`` document ids of packed sequences (the pattern then holds within
        each document)."""
        shift = q_offset - kv_offset  # query i sits at key index i + shift
        keys, causal = kv_len, pattern.causal
        notes = ["causal" if causal else "bidirectional"]
        window: Mask | None = None
        if causal:
            # No query sees past the last query's own key; attnkit's causal is bottom-right
            # aligned on the keys that remain.
            keys = q_len + shift
            if keys > kv_len:
                return (
                    f"queries placed after the last key (q_offset={q_offset}, "
                    f"kv_offset={kv_offset}, Tq={q_len}, Tk={kv_len})"
                )
            keys = max(keys, 0)
            if pattern.window is not None and pattern.window < keys:
                # transformers' window of w keys ends at the query's own key: w - 1 to its left.
                window = sliding_window(pattern.window - 1, 0)
                notes.append(f"sliding window of {pattern.window}")
        elif pattern.window is not None:
            reach = max(kv_len - 1 - shift, q_len - 1 + shift)
            if pattern.window < reach:
                if shift != kv_len - q_len:
                    return (
                        f"a bidirectional window with queries not aligned to the last keys "
                        f"(q_offset={q_offset}, kv_offset={kv_offset}, Tq={q_len}, Tk={kv_len})"
                    )
                window = sliding_window(pattern.window, pattern.window)
                notes.append(f"window of +-{pattern.window}")
        valid = None if padding is None else _real_keys(padding, kv_offset, keys)
        if valid is not None:
            notes.append("key padding")
        docs = None
        if packed is not None:
            if packed.shape != (batch_size, keys) or keys != q_len:
                return f"packed sequences with Tq={q_len} and Tk={kv_len}"
            docs = documents(ids=packed)
            notes.append("packed sequences")
        if keys < kv_len:
            notes.append(f"{keys} keys used, {kv_len - keys} never visible left out")
        return cls(
            batch_size=batch_size,
            q_len=q_len,
            kv_len=kv_len,
            keys=keys,
            mask=_both(_both(window, None if valid is None else key_padding(valid=valid)), docs),
            causal=causal,
            form="; ".join(notes),
            device=device,
            packed=docs is not None,
        )


def _real_keys(padding: Tensor, kv_offset: int, keys: int) -> Tensor | None:
    """``(B, keys)`` bool, True for a real token, from transformers' 2-d mask; None if all real.

    The 2-d mask covers the positions seen so far; positions past its end (a static cache's
    empty slots) are not real tokens.
    """
    valid = padding[:, kv_offset : kv_offset + keys].to(torch.bool)
    if valid.size(-1) < keys:
        valid = F.pad(valid, (0, keys - valid.size(-1)), value=False)
    return None if bool(valid.all()) else valid


def _both(a: Mask | None, b: Mask | None) -> Mask | None:
    """Pairs both masks let through (either one alone; None for none)."""
    return b if a is None else a if b is None else a & b


def _dense(reason: str, **kwargs: Any) -> TransformersMask:
    """transformers' own ``(B, 1, Tq, Tk)`` bool mask, for a pattern attnkit cannot express."""
    from transformers.masking_utils import sdpa_mask

    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    mask = sdpa_mask(**kwargs)
    return TransformersMask(
        batch_size=kwargs["batch_size"],
        q_len=kwargs["q_length"],
        kv_len=kwargs["kv_length"],
        keys=kwargs["kv_length"],
        mask=mask,
        causal=False,
        form=f"dense (B, 1, Tq, Tk) = {shape_str(mask.shape)}: {reason}",
        device=mask.device,
    )


def build_mask(
    *,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Tensor] | None = None,
    attention_mask: Tensor | TransformersMask | None = None,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> TransformersMask:
    """The mask function :func:`register` installs (transformers' ``AttentionMaskInterface``).

    Takes the arguments transformers passes to every mask function; the ones not named here
    (``local_size``, ``allow_is_causal_skip``, ``dtype``, ``config``, ``use_vmap``, ...) matter only
    when the mask has to be dense. Never returns None: for a causal layer transformers would read
    None as "top-left causal", which is wrong as soon as a cache holds tokens.
    """
    if isinstance(attention_mask, TransformersMask):
        # generate() with a static cache builds the masks ahead of the forward, which hands them
        # back here: they were built for this very call.
        if (attention_mask.q_len, attention_mask.kv_len) != (q_length, kv_length):
            raise ValueError(
                f"a prepared {attention_mask!r} was handed back for {q_length} queries and "
                f"{kv_length} keys"
            )
        return attention_mask
    from transformers.masking_utils import causal_mask_function

    fn = causal_mask_function if mask_function is None else mask_function
    if isinstance(q_offset, Tensor):  # a static cache keeps its length in a tensor
        q_offset = int(q_offset)
    padding = attention_mask
    dense_args = dict(
        kwargs,
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=fn,
        attention_mask=padding,
        device=device,
    )
    packed = None
    unpacked = _unpack(fn) if padding is None and (q_offset, kv_offset) == (0, 0) else None
    if unpacked is not None:  # dense_args keeps the packed function, should it come to that
        fn, packed = unpacked
    pattern = _recognise(fn)
    if pattern is None:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        return _dense(f"mask function {name} is not a pattern attnkit knows", **dense_args)
    if not _agrees(fn, pattern):
        return _dense(f"{pattern} does not read as attnkit expects", **dense_args)
    if padding is not None and (padding.ndim != 2 or padding.size(0) != batch_size):
        return _dense(f"attention_mask of shape {shape_str(padding.shape)}", **dense_args)
    built = TransformersMask.build(
        pattern,
        batch_size=batch_size,
        q_len=q_length,
        kv_len=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        padding=padding,
        device=device,
        packed=packed,
    )
    return _dense(built, **dense_args) if isinstance(built, str) else built


# --------------------------------------------------------------------------------------------------
# The attention function


def _top_left_causal(q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """Query ``i`` sees keys ``j <= i`` (torch SDPA's ``is_causal``), as a ``(Tq, Tk)`` mask."""
    i = torch.arange(q_len, device=device).unsqueeze(-1)
    return band_visibility(i, torch.arange(kv_len, device=device), -math.inf, 0)


def _packed(
    module: nn.Module, query: Tensor, key: Tensor, kwargs: dict[str, Any]
) -> tuple[Tensor, Tensor] | None:
    """``(cu_seq_lens_q, cu_seq_lens_k)`` of packed sequences without padding, as transformers
    hands them to its flash-attention path: given, or read from packed ``position_ids`` of one
    batch row (a new sequence wherever the positions do not step by 1). None otherwise."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if (cu_q is None) != (cu_k is None):
        raise ValueError(
            f"{_layer(module)}: packed sequences need both cu_seq_lens_q and cu_seq_lens_k, got "
            f"only {'cu_seq_lens_q' if cu_k is None else 'cu_seq_lens_k'}"
        )
    if cu_q is None:
        ids = kwargs.get("position_ids")
        if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.size(0) != 1:
            return None
        if ids.size(1) != query.size(-2) or query.size(-2) != key.size(-2) or ids.size(1) < 2:
            return None
        starts = (torch.diff(ids[0]) != 1).nonzero().flatten() + 1
        if not starts.numel():
            return None
        edges = [0, *starts.tolist(), ids.size(1)]
        cu_q = cu_k = torch.tensor(edges, dtype=torch.int32)
    if query.size(0) != 1:
        raise ValueError(
            f"{_layer(module)}: packed sequences (cu_seq_lens_q/cu_seq_lens_k) come in one batch "
            f"row, got q {shape_str(query.shape)}"
        )
    return torch.as_tensor(cu_q), torch.as_tensor(cu_q if cu_k is None else cu_k)


def _model_collects_weights() -> bool:
    """Whether the transformers forward running now collects attention weights.

    Some layers (GPT-2's, Whisper's) take ``output_attentions`` as their own argument and do not
    pass it to the attention function; the model's output collector is where the request lives.
    """
    from transformers.utils import output_capturing

    collector = getattr(output_capturing, "_active_collector", None)
    collected = None if collector is None else collector.get()
    return isinstance(collected, dict) and any(str(k).endswith("attentions") for k in collected)


def _layer(module: nn.Module) -> str:
    layer = getattr(module, "layer_idx", None)
    return type(module).__name__ + ("" if layer is None else f" (layer {layer})")


@shape_checked
def _attention_forward(
    module: nn.Module,
    query: Float[Tensor, "B H Tq D"],
    key: Float[Tensor, "B Hkv Tk D"],
    value: Float[Tensor, "B Hkv Tk Dv"],
    attention_mask: object,
    *,
    backend: str | Backend,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: Tensor | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    sinks: Tensor | None = None,
    output_attentions: bool | None = None,
    **kwargs: Any,
) -> tuple[Float[Tensor, "B Tq H Dv"], Float[Tensor, "B H Tq Tk"] | None]:
    q_len, kv_len = query.size(-2), key.size(-2)
    keys, mask, bias, causal = kv_len, None, None, False
    if isinstance(attention_mask, TransformersMask):
        if (attention_mask.q_len, attention_mask.kv_len) != (q_len, kv_len):
            raise ValueError(
                f"{_layer(module)}: {attention_mask!r} does not fit q {shape_str(query.shape)} and "
                f"k {shape_str(key.shape)}"
            )
        keys, mask, causal = attention_mask.keys, attention_mask.mask, attention_mask.causal
    elif isinstance(attention_mask, Tensor):
        if attention_mask.ndim != 4 or not (
            attention_mask.dtype == torch.bool or attention_mask.is_floating_point()
        ):
            # A 2-d padding mask here would broadcast over the wrong axes without a word.
            raise ValueError(
                f"{_layer(module)}: a tensor attention_mask must be 4-d (B|1, H|1, Tq, Tk), bool "
                f"or float, got {attention_mask.dtype} of shape {shape_str(attention_mask.shape)}"
            )
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:
            bias = attention_mask.to(query.dtype)
    elif attention_mask is None:
        causal_module = getattr(module, "is_causal", True) if is_causal is None else is_causal
        packed = _packed(module, query, key, kwargs)
        if packed is not None:  # as transformers' flash-attention path: bottom-right per sequence
            window = kwargs.get("sliding_window")
            mask = varlen_mask(
                *packed,
                causal=bool(causal_module),
                window_size=(window - 1, window - 1) if window else (-1, -1),
            )
        elif causal_module and q_len > 1:
            if q_len <= kv_len:  # top-left: the keys after the last query are never seen
                keys, causal = q_len, True
            else:
                mask = _top_left_causal(q_len, kv_len, query.device)
    else:
        raise TypeError(
            f"{_layer(module)}: attention_mask must be a 4-d bool or float tensor, a "
            f"TransformersMask or None, got {type(attention_mask).__name__}"
        )
    if isinstance(attention_mask, TransformersMask) and not attention_mask.packed:
        # transformers builds a packed mask only without a cache (training usually runs with
        # use_cache=True all the same); its flash-attention path reads the packing from the
        # positions whatever the mask, and so does this one.
        packed = _packed(module, query, key, kwargs)
        if packed is not None:  # the mask holds the pattern; the sequences are ANDed in
            sequences = varlen_mask(*packed)
            if sequences is not None:
                mask = sequences if mask is None else sequences & mask
    if position_bias is not None:
        position_bias = position_bias.to(query.dtype)
        bias = position_bias if bias is None else position_bias + bias
    if keys < kv_len:
        key, value = key[..., :keys, :], value[..., :keys, :]
        if bias is not None and bias.size(-1) != 1:
            bias = bias[..., :keys]
    sink = s_aux if s_aux is not None else sinks
    dropout_p = float(dropout) if module.training else 0.0
    capturing = is_capturing(module)
    want_weights = bool(output_attentions) or capturing or _model_collects_weights()
    result = attention(
        query,
        key,
        value,
        mask=mask,
        bias=bias,
        causal=causal,
        scale=scaling,
        softcap=softcap,
        sinks=sink,
        dropout_p=dropout_p,
        return_weights=want_weights,
        backend=backend,
    )
    weights: Tensor | None = None
    if isinstance(result, tuple):
        out, weights = result
        weights = F.pad(weights, (0, kv_len - keys))
        if capturing:
            record(module, weights)
    else:
        out = result
    return out.transpose(1, 2).contiguous(), weights


# --------------------------------------------------------------------------------------------------
# Registration

_TRANSFORMERS_NAMES = ("sdpa", "flash", "flex", "/", "|")


def register(name: str = "attnkit", *, backend: str | Backend = "auto") -> None:
    """Make attnkit the attention implementation ``name`` of transformers models.

    Afterwards ``from_pretrained(..., attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` run every attention layer of a model through
    :func:`attnkit.attention` with ``backend``. Registering again under a name replaces what it
    stood for (another backend, say). The registration lasts for the process.

    Args:
        name: the implementation's name in transformers. transformers gives names containing
            ``sdpa``, ``flash``, ``flex``, ``/`` (a Hub kernel) or ``|``, and ``eager``, a meaning
            of their own, so those are refused.
        backend: passed to every :func:`attnkit.attention` call: ``"auto"`` (the fastest backend
            that serves each call) or a backend name or object.

    Raises:
        ImportError: transformers is missing or older than 5.20 (the hf extra:
            ``pip install "attnkit[hf]"``, or ``".[hf]"`` from a checkout).
        ValueError, TypeError: for a name transformers would misread, or an unknown backend.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    if name == "eager" or any(part in name for part in _TRANSFORMERS_NAMES):
        raise ValueError(
            f"name {name!r} would be read by transformers as one of its own implementations or "
            "as a Hub kernel (names with 'sdpa', 'flash', 'flex', '/' or '|', and 'eager'); "
            "choose another, such as 'attnkit'"
        )
    if isinstance(backend, str):
        if backend != "auto" and backend not in available_backends():
            raise ValueError(
                f"unknown backend {backend!r}; choose 'auto' or one of: "
                + ", ".join(available_backends())
            )
    elif not isinstance(backend, Backend):
        raise TypeError(f"backend must be a name or a Backend, got {type(backend).__name__}")
    _require_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def attnkit_attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: TransformersMask | Tensor | None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        return _attention_forward(
            module, query, key, value, attention_mask, backend=backend, **kwargs
        )

    AttentionInterface.register(name, attnkit_attention)
    AttentionMaskInterface.register(name, build_mask)
