"""The mask function: what transformers' mask creation asks for, as :func:`attnkit.attention`
arguments built once per forward (:class:`TransformersMask`, :func:`build_mask`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._base.checks import shape_str
from ...masks import Mask, causal_mask, documents, key_padding, sliding_window
from ._patterns import Pattern, agrees, recognise, unpack

__all__ = ["TransformersMask", "build_mask", "serve_eager_masks"]

# Config classes of the models that transformers runs with eager attention only (no sdpa, flash or
# flex): their code may rely on eager's mask, a float tensor it can widen or edit, so their mask
# function returns exactly that. Filled when such a model is built or switched to attnkit.
_EAGER_MASK_CONFIGS: set[type] = set()


def serve_eager_masks(config_class: type) -> None:
    """Give the models of ``config_class`` transformers' eager mask (a float tensor) from now on."""
    _EAGER_MASK_CONFIGS.add(config_class)


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
      to be dense;
    * ``padding``: transformers' 2-d mask of one row of queries and keys alike when it hides a
      token, else None: the row's positions then say nothing of packed sequences (every
      transformers path attends by the mask alone), which the attention call otherwise reads.

    transformers' queries sit at positions ``q_offset + i`` and its keys at ``kv_offset + j``, and
    a causal query sees the keys at or before its own position. Mapped to attnkit, query ``i`` sits
    at key index ``i + q_offset - kv_offset``. attnkit's ``causal`` is aligned bottom-right, so
    the keys after the last query's position are cut off: a static cache of 6 slots holding 1
    cached token and 2 new ones (``q_offset=1``) uses 3 keys::

        transformers (Tq=2, Tk=6)   attnkit (keys=3, causal)
        1 1 0 0 0 0                 1 1 0
        1 1 1 0 0 0                 1 1 1

    >>> m = TransformersMask.build(Pattern(causal=True), batch_size=1, q_len=2, kv_len=6,
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
    # Some models read the layer mask in their own code as the bool tensor sdpa gets (LASR's
    # convolution module zeroes the frames no query may see: ``dtype``, then ``~mask``).
    dtype = torch.bool

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
        padding: Tensor | None = None,
    ) -> None:
        self.packed = packed
        self.padding = padding
        self.batch_size = batch_size
        self.q_len = q_len
        self.kv_len = kv_len
        self.keys = keys
        self.mask = mask
        self.causal = causal
        self.form = form
        self.device = torch.device(device)

    def __getitem__(self, index: Any) -> TransformersMask | Tensor:
        """The mask of some of the queries, as models slice the ``(B, 1, Tq, Tk)`` tensor it stands
        for: Gemma 4 keeps the last ``n`` queries (``mask[:, :, -n:, :]``) once its remaining layers
        reuse earlier layers' keys and values. The last queries keep their places relative to the
        keys, so they keep the structured mask; any other index gets the dense one, indexed."""
        rows = _trailing_rows(index, self.q_len)
        if rows is None or self.packed:
            return self.dense()[index]
        mask = self.mask
        if isinstance(mask, Tensor) and mask.ndim == 4 and mask.size(-2) == self.q_len:
            mask = mask[:, :, self.q_len - rows :, :]
        return TransformersMask(
            batch_size=self.batch_size,
            q_len=rows,
            kv_len=self.kv_len,
            keys=self.keys,
            mask=mask,
            causal=self.causal,
            form=self.form,
            device=self.device,
            padding=self.padding,
        )

    def __invert__(self) -> Tensor:
        """The dense mask it stands for, inverted (True = may not attend), as ``~`` inverts the
        bool tensor a model reading the mask would otherwise get."""
        return ~self.dense()

    def flip(self, *dims: Any, **kwargs: Any) -> Tensor:
        """The dense mask it stands for, flipped as ``Tensor.flip`` would: Gemma 4's assistant
        (a draft model for assisted generation) flips its sliding-window mask along the keys
        to read the window over past keys instead of future ones."""
        return self.dense().flip(*dims, **kwargs)

    @property
    def constrains_nothing(self) -> bool:
        """Whether every query may attend every key (bidirectional, no padding, no key left out)."""
        return self.mask is None and not self.causal and self.keys == self.kv_len

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
        pattern: Pattern,
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
            padding=_hidden_tokens(padding, batch_size, q_len, kv_len),
        )


def _trailing_rows(index: Any, q_len: int) -> int | None:
    """How many queries ``index`` keeps when it keeps the last ones of every row and every key
    (``[:, :, -n:, :]`` or ``[:, :, -n:]``); None for any other index."""
    everything = slice(None)
    if not isinstance(index, tuple) or len(index) not in (3, 4):
        return None
    if index[:2] != (everything, everything) or index[3:] not in ((), (everything,)):
        return None
    rows = index[2]
    if not isinstance(rows, slice):
        return None
    start, stop, step = rows.indices(q_len)
    if step != 1 or stop != q_len:
        return None
    return q_len - start


def _real_keys(padding: Tensor, kv_offset: int, keys: int) -> Tensor | None:
    """``(B, keys)`` bool, True for a real token, from transformers' 2-d mask; None if all real.

    The 2-d mask covers the positions seen so far; positions past its end (a static cache's
    empty slots) are not real tokens.
    """
    valid = padding[:, kv_offset : kv_offset + keys].to(torch.bool)
    if valid.size(-1) < keys:
        valid = F.pad(valid, (0, keys - valid.size(-1)), value=False)
    # Whether every key is real is data: under torch.compile the padding mask stays (no host read).
    if torch.compiler.is_compiling():
        return valid
    return None if bool(valid.all()) else valid


def _hidden_tokens(padding: Tensor | None, batch: int, q_len: int, kv_len: int) -> Tensor | None:
    """The 2-d mask of a call whose positions could show packed sequences (one row, as many
    queries as keys) when it hides a token; None otherwise. Under torch.compile whether it hides
    one is data: the mask is kept, and the call reads it in the graph."""
    if not isinstance(padding, Tensor) or padding.ndim != 2 or (batch, q_len) != (1, kv_len):
        return None
    if torch.compiler.is_compiling():
        return padding
    return None if bool(padding.all()) else padding


def _both(a: Mask | None, b: Mask | None) -> Mask | None:
    """Pairs both masks let through (either one alone; None for none)."""
    return b if a is None else a if b is None else a & b


def _sdpa_tensor(**kwargs: Any) -> Tensor:
    """transformers' own ``(B, 1, Tq, Tk)`` bool mask (sdpa's, True = may attend), never None."""
    from transformers.masking_utils import sdpa_mask

    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    mask: Tensor = sdpa_mask(**kwargs)
    return mask


def _eager_tensor(**kwargs: Any) -> Tensor:
    """transformers' own ``(B, 1, Tq, Tk)`` float mask (eager's: 0 or the dtype's minimum)."""
    from transformers.masking_utils import eager_mask

    kwargs.update(allow_is_bidirectional_skip=False)
    mask: Tensor = eager_mask(**kwargs)
    return mask


def _dense(reason: str, **kwargs: Any) -> TransformersMask:
    """transformers' own ``(B, 1, Tq, Tk)`` bool mask, for a pattern attnkit cannot express."""
    mask = _sdpa_tensor(**kwargs)
    return TransformersMask(
        batch_size=kwargs["batch_size"],
        q_len=kwargs["q_length"],
        kv_len=kwargs["kv_length"],
        keys=kwargs["kv_length"],
        mask=mask,
        causal=False,
        form=f"dense (B, 1, Tq, Tk) = {shape_str(mask.shape)}: {reason}",
        device=mask.device,
        padding=_hidden_tokens(
            kwargs["attention_mask"], kwargs["batch_size"], kwargs["q_length"], kwargs["kv_length"]
        ),
    )


def _asks_for_a_tensor(pattern: Pattern | None, kwargs: dict[str, Any]) -> bool:
    """Whether transformers was asked not to skip the mask: the flag of the pattern's kind (the
    bidirectional mask creators always pass ``allow_is_causal_skip=False``), either for a pattern
    attnkit does not know."""
    causal_flag = kwargs.get("allow_is_causal_skip", True) is False
    bidirectional_flag = kwargs.get("allow_is_bidirectional_skip", True) is False
    if pattern is None:
        return causal_flag or bidirectional_flag
    return causal_flag if pattern.causal else bidirectional_flag


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
) -> TransformersMask | Tensor:
    """The mask function :func:`register` installs (transformers' ``AttentionMaskInterface``).

    Takes the arguments transformers passes to every mask function. Returns a
    :class:`TransformersMask` (the pattern and padding as :func:`attnkit.attention` arguments,
    built once for all layers), except where the model needs a tensor it can read or edit:

    * asked with ``allow_is_causal_skip=False`` (a causal pattern) or
      ``allow_is_bidirectional_skip=False`` (a bidirectional one), as models do that slice the
      mask for an indexer or add their own terms to it: transformers' own bool mask, what
      ``sdpa`` gets (also a static cache's decoding step, where transformers sets the flag itself;
      not packed sequences, where it does too and the structured mask serves them);
    * a model that transformers runs with eager attention only (:func:`serve_eager_masks`):
      eager's float mask, the one its code was written for.

    Never returns None: for a causal layer transformers would read None as "top-left causal",
    which is wrong as soon as a cache holds tokens.
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
    if type(kwargs.get("config")) in _EAGER_MASK_CONFIGS:
        return _eager_tensor(**dense_args)
    packed = None
    unpacked = unpack(fn) if padding is None and (q_offset, kv_offset) == (0, 0) else None
    if unpacked is not None:  # dense_args keeps the packed function, should it come to that
        fn, packed = unpacked
    pattern = recognise(fn)
    if packed is None and _asks_for_a_tensor(pattern, kwargs):
        return _sdpa_tensor(**dense_args)
    if pattern is None:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        return _dense(f"mask function {name} is not a pattern attnkit knows", **dense_args)
    if not agrees(fn, pattern):
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


# The attention function
