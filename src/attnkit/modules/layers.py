"""Transformer layers: encoder layer, decoder layer, and the encoder-decoder Transformer.

Each layer is residual sublayers around :class:`~attnkit.MultiHeadAttention` and
:class:`~attnkit.PositionwiseFeedForward`, with LayerNorm either after the residual sum
(``norm_first=False``, post-norm, the paper's layout and torch's default) or at the input of each
sublayer (``norm_first=True``, pre-norm, which trains deep stacks without warm-up tricks)::

    post-norm:  x = norm(x + dropout(sublayer(x)))
    pre-norm:   x = x + dropout(sublayer(norm(x)))

The self-attention of a layer can be built elsewhere and passed in (``attention=``), e.g. relative
attention for a Conformer-style stack. It is called as ``attention(x, mask=mask, causal=causal)``
(plus ``bias=bias`` and ``cache=cache`` when they are given) and returns ``(B, T, D)``. Whatever
fails in a layer called with a :class:`~attnkit.KVCache` (that module included), the cache keeps
the length it had before the call (a :class:`~attnkit.PagedKVCache` its lengths, a
:class:`~attnkit.StreamingKVCache` its position).

Masks follow attnkit's one convention (bool, True = may attend) and broadcast to the scores
``(B, H, Tq, Tk)``; for padded batches pass :func:`attnkit.masks.padding_mask` ``(B, 1, 1, T)``.
A ``bias`` (float, added to the scores, as torch's float masks are) broadcasts likewise.

Shape letters: ``B`` batch, ``T`` target (or encoder input) positions, ``Tm`` memory positions,
``D`` d_model, ``Dm`` memory width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .._base.checks import (
    check_bool,
    check_input,
    check_int,
    check_positive,
    check_probability,
    present,
    shape_str,
)
from .._base.hints import torch_keywords
from .._base.shapes import Bool, Float, shape_checked
from ..caches.kv_cache import KVCache
from ..caches.paged import PagedKVCache
from ..caches.streaming import StreamingKVCache
from ..masks import Mask, check_mask
from ..scores import ScoreTerm
from .feedforward import PositionwiseFeedForward
from .multihead import MultiHeadAttention

__all__ = ["Transformer", "TransformerDecoderLayer", "TransformerEncoderLayer"]


def _check_module(name: str, m: object) -> nn.Module:
    if not isinstance(m, nn.Module):
        raise TypeError(f"{name} must be an nn.Module, got {type(m).__name__}")
    return m


def _reject_options(given: str, **options: object) -> None:
    """Options of the attention attnkit builds make no sense next to a module built elsewhere."""
    clash = [k for k, v in options.items() if v is not None]
    if clash:
        raise ValueError(
            f"{', '.join(clash)} configure the attention attnkit builds; with {given} given, "
            "configure that module instead"
        )


def _call_self_attention(
    attn: nn.Module,
    x: Tensor,
    mask: Tensor | Mask | None,
    causal: bool,
    cache: KVCache | PagedKVCache | None,
    bias: Tensor | ScoreTerm | None = None,
) -> Tensor:
    # bias= and cache= only when given, so that an injected module need not know about them.
    extra: dict[str, object] = {}
    if bias is not None:
        extra["bias"] = bias
    if cache is not None:
        extra["cache"] = cache
    out: Tensor = attn(x, mask=mask, causal=causal, **extra)
    return out


def _undo_on_error(caches: Sequence[object], step: Callable[[], Tensor]) -> Tensor:
    """``step()``; if it raises (or is interrupted), every :class:`KVCache`,
    :class:`PagedKVCache` and :class:`StreamingKVCache` in ``caches`` is wound back to the
    lengths (a streaming cache: the position) it had before, whichever sublayer or layer failed.

    A layer appends to its cache in its self-attention and can still fail afterwards (in the
    cross-attention, in a module built elsewhere, on Ctrl-C); a stack of layers can fail in its
    last layer after the first ones appended. Without the rewind the caches would hold a step the
    caller never got, at lengths that differ from layer to layer. What was written past the old
    length stays in the buffers, where nothing reads it and the next step overwrites it.
    """
    held = [(c, c.length) for c in caches if isinstance(c, KVCache)]
    paged = [(c, list(c.lengths)) for c in caches if isinstance(c, PagedKVCache)]
    # (a streaming cache goes back by its position: its ring has let tokens go, and it can undo
    # the one step it took)
    streaming = [(c, c.position) for c in caches if isinstance(c, StreamingKVCache)]
    try:
        return step()
    except BaseException:
        for c, length in held:
            c.rewind(length)
        for p, lengths in paged:
            p.rewind(lengths)
        for s, position in streaming:
            s.rewind(position)
        raise


def _check_sequence(layer: nn.Module, name: str, x: object, width: int | None) -> Tensor:
    """``x``, checked as the layer's argument ``name``: the attention inside would report a
    ``query`` or ``key`` the caller never passed, and a LayerNorm a RuntimeError."""
    shape = f"(B, T, {'D' if width is None else width})"
    return check_input(name, x, shape, width, next(layer.parameters(), None))


def _check_same_batch(name: str, t: Tensor, other_name: str, other: Tensor) -> None:
    if t.size(0) != other.size(0):
        raise ValueError(
            f"{name} {shape_str(t.shape)} and {other_name} {shape_str(other.shape)} must have the "
            "same batch size"
        )


def _check_layer_mask(
    name: str, mask: object, attn: nn.Module, batch: int, q_len: int, kv_len: int
) -> None:
    """A mask the layer hands to ``attn`` under another name, checked under its own."""
    if mask is None:
        return
    heads = getattr(attn, "num_heads", None)
    if not isinstance(heads, int):  # an attention built elsewhere: leave the head dim to it
        heads = mask.size(-3) if isinstance(mask, Tensor) and mask.ndim >= 3 else 1
    check_mask(name, mask, (batch, heads, q_len, kv_len))


class TransformerEncoderLayer(nn.Module):
    """Self-attention and feed-forward sublayers, each with a residual connection and LayerNorm.

    Args:
        d_model: ``D``.
        num_heads: heads of the self-attention attnkit builds (not with ``attention=``).
        d_ff: hidden units of the feed-forward; default ``4 * D``.
        dropout: on the attention weights, the feed-forward's hidden units and each sublayer's
            output, in training only (0.1, as in the paper and in torch).
        activation: of the feed-forward: ``"relu"``, ``"gelu"`` or ``"swiglu"``.
        norm_first: pre-norm when True, post-norm (the default) when False.
        layer_norm_eps: the LayerNorms' epsilon.
        bias: biases in the projections, the feed-forward and the LayerNorms.
        num_kv_heads: grouped-query attention (see :class:`~attnkit.MultiHeadAttention`).
        rotary: rotary embeddings for the self-attention (:class:`~attnkit.RotaryEmbedding`).
        attention: a self-attention module built elsewhere, instead of the default one.
        device, dtype: of the parameters.

    ``forward(x, *, mask=None, bias=None, causal=False, cache=None)``: ``x`` ``(B, T, D)`` ->
    ``(B, T, D)``; ``bias`` is added to the self-attention's scores. With ``causal=True`` and a
    :class:`~attnkit.KVCache` this is a decoder-only block that decodes incrementally.

    >>> layer = TransformerEncoderLayer(32, 4, norm_first=True).eval()
    >>> x = torch.randn(2, 6, 32)
    >>> from attnkit.masks import padding_mask
    >>> layer(x, mask=padding_mask([6, 4])).shape
    torch.Size([2, 6, 32])
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int | None = None,
        d_ff: int | None = None,
        *,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        bias: bool = True,
        num_kv_heads: int | None = None,
        rotary: nn.Module | None = None,
        attention: nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_model = check_int("d_model", d_model)
        d_ff = 4 * d_model if d_ff is None else d_ff
        dropout = check_probability("dropout", dropout)
        self.norm_first = check_bool("norm_first", norm_first)
        bias = check_bool("bias", bias)
        check_positive("layer_norm_eps", layer_norm_eps)
        if attention is None:
            if num_heads is None:
                raise ValueError("pass num_heads, or a ready-made attention= module")
            attention = MultiHeadAttention(
                d_model,
                num_heads,
                num_kv_heads=num_kv_heads,
                proj_bias=bias,
                dropout=dropout,
                rotary=rotary,
                device=device,
                dtype=dtype,
            )
        else:
            _reject_options(
                "attention=", num_heads=num_heads, num_kv_heads=num_kv_heads, rotary=rotary
            )
        self.self_attn = _check_module("attention", attention)
        self.ffn = PositionwiseFeedForward(
            d_model,
            d_ff,
            activation=activation,
            dropout=dropout,
            bias=bias,
            device=device,
            dtype=dtype,
        )
        self.norm1 = nn.LayerNorm(
            d_model, eps=layer_norm_eps, bias=bias, device=device, dtype=dtype
        )
        self.norm2 = nn.LayerNorm(
            d_model, eps=layer_norm_eps, bias=bias, device=device, dtype=dtype
        )
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    @torch_keywords
    @shape_checked
    def forward(
        self,
        x: Float[Tensor, "B T D"],
        *,
        mask: Bool[Tensor, "..."] | Mask | None = None,
        bias: Float[Tensor, "..."] | ScoreTerm | None = None,
        causal: bool = False,
        cache: KVCache | PagedKVCache | None = None,
    ) -> Float[Tensor, "B T D"]:
        _check_sequence(self, "x", x, self.d_model)
        if cache is None:
            return self._layer(x, mask, bias, causal, None)
        return _undo_on_error([cache], lambda: self._layer(x, mask, bias, causal, cache))

    def _layer(
        self,
        x: Tensor,
        mask: Tensor | Mask | None,
        bias: Tensor | ScoreTerm | None,
        causal: bool,
        cache: KVCache | PagedKVCache | None,
    ) -> Tensor:
        def sa(h: Tensor) -> Tensor:
            out: Tensor = self.dropout1(
                _call_self_attention(self.self_attn, h, mask, causal, cache, bias)
            )
            return out

        def ff(h: Tensor) -> Tensor:
            out: Tensor = self.dropout2(self.ffn(h))
            return out

        if self.norm_first:
            x = x + sa(self.norm1(x))
            return x + ff(self.norm2(x))
        x = self.norm1(x + sa(x))
        out: Tensor = self.norm2(x + ff(x))
        return out


class TransformerDecoderLayer(nn.Module):
    """Causal self-attention, cross-attention on the encoder's output, feed-forward; each with a
    residual connection and LayerNorm.

    Takes :class:`TransformerEncoderLayer`'s arguments, plus ``memory_dim`` (``Dm``, the width of
    the memory, default ``D``) and ``cross_attention=`` (a cross-attention module built elsewhere,
    called as ``cross_attention(x, memory, mask=memory_mask)``, plus ``bias=memory_bias`` when
    given).

    ``forward(x, memory, *, mask=None, bias=None, memory_mask=None, memory_bias=None,
    causal=True, cache=None)``: ``x`` ``(B, T, D)`` and ``memory`` ``(B, Tm, Dm)`` -> ``(B, T, D)``.
    ``mask`` and ``bias`` are the self-attention's (broadcast to ``(B, H, T, S)``), ``memory_mask``
    and ``memory_bias`` the cross-attention's (to ``(B, H, T, Tm)``; the mask typically the
    encoder's padding mask). ``cache`` is the self-attention's
    :class:`~attnkit.KVCache`.

    >>> layer = TransformerDecoderLayer(32, 4).eval()
    >>> layer(torch.randn(2, 5, 32), torch.randn(2, 9, 32)).shape
    torch.Size([2, 5, 32])
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int | None = None,
        d_ff: int | None = None,
        *,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        bias: bool = True,
        num_kv_heads: int | None = None,
        memory_dim: int | None = None,
        rotary: nn.Module | None = None,
        attention: nn.Module | None = None,
        cross_attention: nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_model = check_int("d_model", d_model)
        d_ff = 4 * d_model if d_ff is None else d_ff
        dropout = check_probability("dropout", dropout)
        self.norm_first = check_bool("norm_first", norm_first)
        bias = check_bool("bias", bias)
        check_positive("layer_norm_eps", layer_norm_eps)
        if attention is None or cross_attention is None:
            if num_heads is None:
                raise ValueError("pass num_heads, or ready-made attention= and cross_attention=")
        else:
            _reject_options(
                "attention= and cross_attention=", num_heads=num_heads, num_kv_heads=num_kv_heads
            )
        if attention is None:
            attention = MultiHeadAttention(
                d_model,
                present(num_heads, "num_heads"),
                num_kv_heads=num_kv_heads,
                proj_bias=bias,
                dropout=dropout,
                rotary=rotary,
                device=device,
                dtype=dtype,
            )
        else:
            _reject_options("attention=", rotary=rotary)
        if cross_attention is None:
            num_heads = present(num_heads, "num_heads")
            if memory_dim is not None:  # named here: the attention would call it kdim
                check_int("memory_dim", memory_dim)
            cross_attention = MultiHeadAttention(
                d_model,
                num_heads,
                kdim=memory_dim,
                vdim=memory_dim,
                num_kv_heads=num_kv_heads,
                proj_bias=bias,
                dropout=dropout,
                device=device,
                dtype=dtype,
            )
        else:
            _reject_options("cross_attention=", memory_dim=memory_dim)
        self.self_attn = _check_module("attention", attention)
        self.cross_attn = _check_module("cross_attention", cross_attention)
        self.ffn = PositionwiseFeedForward(
            d_model,
            d_ff,
            activation=activation,
            dropout=dropout,
            bias=bias,
            device=device,
            dtype=dtype,
        )
        self.norm1, self.norm2, self.norm3 = (
            nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, device=device, dtype=dtype)
            for _ in range(3)
        )
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)

    @torch_keywords
    @shape_checked
    def forward(
        self,
        x: Float[Tensor, "B T D"],
        memory: Float[Tensor, "B Tm Dm"],
        *,
        mask: Bool[Tensor, "..."] | Mask | None = None,
        bias: Float[Tensor, "..."] | ScoreTerm | None = None,
        memory_mask: Bool[Tensor, "..."] | Mask | None = None,
        memory_bias: Float[Tensor, "..."] | ScoreTerm | None = None,
        causal: bool = True,
        cache: KVCache | PagedKVCache | None = None,
    ) -> Float[Tensor, "B T D"]:
        _check_sequence(self, "x", x, self.d_model)
        memory_dim = getattr(self.cross_attn, "kdim", None)
        _check_sequence(self, "memory", memory, memory_dim if isinstance(memory_dim, int) else None)
        _check_same_batch("memory", memory, "x", x)
        _check_layer_mask(
            "memory_mask", memory_mask, self.cross_attn, x.size(0), x.size(1), memory.size(1)
        )
        masks = (mask, bias, memory_mask, memory_bias)
        if cache is None:
            return self._layer(x, memory, masks, causal, None)
        return _undo_on_error([cache], lambda: self._layer(x, memory, masks, causal, cache))

    def _layer(
        self,
        x: Tensor,
        memory: Tensor,
        masks: tuple[
            Tensor | Mask | None,
            Tensor | ScoreTerm | None,
            Tensor | Mask | None,
            Tensor | ScoreTerm | None,
        ],
        causal: bool,
        cache: KVCache | PagedKVCache | None,
    ) -> Tensor:
        """The layer on ``masks``: the self-attention's mask and bias, the cross-attention's."""
        mask, bias, memory_mask, memory_bias = masks

        def sa(h: Tensor) -> Tensor:
            out: Tensor = self.dropout1(
                _call_self_attention(self.self_attn, h, mask, causal, cache, bias)
            )
            return out

        def ca(h: Tensor) -> Tensor:
            extra = {} if memory_bias is None else {"bias": memory_bias}
            out: Tensor = self.dropout2(self.cross_attn(h, memory, mask=memory_mask, **extra))
            return out

        def ff(h: Tensor) -> Tensor:
            out: Tensor = self.dropout3(self.ffn(h))
            return out

        if self.norm_first:
            x = x + sa(self.norm1(x))
            x = x + ca(self.norm2(x))
            return x + ff(self.norm3(x))
        x = self.norm1(x + sa(x))
        x = self.norm2(x + ca(x))
        out: Tensor = self.norm3(x + ff(x))
        return out


class Transformer(nn.Module):
    """The encoder-decoder Transformer: a stack of encoder layers and a stack of decoder layers.

    Args:
        d_model, num_heads: as for the layers (the paper's base model: 512 and 8).
        num_encoder_layers, num_decoder_layers: stack depths (6 each in the paper).
        Every other keyword argument is passed to each :class:`TransformerEncoderLayer` and
        :class:`TransformerDecoderLayer`. With ``norm_first=True`` each stack ends with a LayerNorm
        (pre-norm layers leave their output unnormalised); post-norm stacks need none.

    It maps embeddings to embeddings: token embeddings, positional encodings and the output
    projection are the caller's (as in ``torch.nn.Transformer``).

    * ``forward(src, tgt, *, src_mask=None, tgt_mask=None, memory_mask=None)``: ``src``
      ``(B, Ts, D)``, ``tgt`` ``(B, T, D)`` -> ``(B, T, D)``. The decoder's self-attention is
      causal; ``tgt_mask`` is ANDed with that. ``memory_mask`` (e.g. the source padding mask)
      limits the cross-attention; it is not derived from ``src_mask``.
    * ``encode(src, *, mask=None)`` -> memory ``(B, Ts, D)``.
    * ``decode(tgt, memory, *, mask=None, memory_mask=None, cache=None)`` -> ``(B, T, D)``. With a
      cache from :meth:`make_cache`, ``tgt`` holds only the new tokens (their positions start at
      ``cache[0].length``) and ``mask``, if any, covers every key held after the step: it
      broadcasts to ``(B, H, T, S)`` with ``S = cache[0].length + T``. A step is all or nothing:
      if any layer raises (or the step is interrupted), every cache keeps the length it had.

    Greedy decoding, one token at a time through the KV caches:

    >>> model = Transformer(32, 4, num_encoder_layers=2, num_decoder_layers=2).eval()
    >>> src, tgt = torch.randn(1, 7, 32), torch.randn(1, 4, 32)
    >>> with torch.no_grad():
    ...     full = model(src, tgt)
    ...     memory = model.encode(src)
    ...     cache = model.make_cache(batch_size=1, max_len=16)
    ...     steps = [model.decode(tgt[:, i : i + 1], memory, cache=cache) for i in range(4)]
    >>> bool(torch.allclose(torch.cat(steps, 1), full, atol=1e-5))
    True
    """

    def __init__(
        self,
        d_model: int = 512,
        num_heads: int = 8,
        *,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        d_ff: int | None = None,
        dropout: float = 0.1,
        activation: str = "relu",
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        bias: bool = True,
        num_kv_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_model = check_int("d_model", d_model)
        self.num_heads = check_int("num_heads", num_heads)
        check_int("num_encoder_layers", num_encoder_layers, minimum=0)
        check_int("num_decoder_layers", num_decoder_layers, minimum=0)
        check_bool("bias", bias)
        kw: dict[str, object] = {
            "dropout": dropout,
            "activation": activation,
            "norm_first": norm_first,
            "layer_norm_eps": layer_norm_eps,
            "bias": bias,
            "num_kv_heads": num_kv_heads,
            "device": device,
            "dtype": dtype,
        }
        self.encoder_layers = nn.ModuleList(
            TransformerEncoderLayer(d_model, num_heads, d_ff, **kw)  # type: ignore[arg-type]
            for _ in range(num_encoder_layers)
        )
        self.decoder_layers = nn.ModuleList(
            TransformerDecoderLayer(d_model, num_heads, d_ff, **kw)  # type: ignore[arg-type]
            for _ in range(num_decoder_layers)
        )
        self.encoder_norm: nn.Module = nn.Identity()
        self.decoder_norm: nn.Module = nn.Identity()
        if norm_first:
            self.encoder_norm = nn.LayerNorm(
                d_model, eps=layer_norm_eps, bias=bias, device=device, dtype=dtype
            )
            self.decoder_norm = nn.LayerNorm(
                d_model, eps=layer_norm_eps, bias=bias, device=device, dtype=dtype
            )

    @shape_checked
    def encode(
        self, src: Float[Tensor, "B Ts D"], *, mask: Bool[Tensor, "..."] | Mask | None = None
    ) -> Float[Tensor, "B Ts D"]:
        _check_sequence(self, "src", src, self.d_model)
        for layer in self.encoder_layers:
            src = layer(src, mask=mask)
        out: Tensor = self.encoder_norm(src)
        return out

    @shape_checked
    def decode(
        self,
        tgt: Float[Tensor, "B T D"],
        memory: Float[Tensor, "B Ts D"],
        *,
        mask: Bool[Tensor, "..."] | Mask | None = None,
        memory_mask: Bool[Tensor, "..."] | Mask | None = None,
        cache: Sequence[KVCache | PagedKVCache] | None = None,
    ) -> Float[Tensor, "B T D"]:
        _check_sequence(self, "tgt", tgt, self.d_model)
        _check_sequence(self, "memory", memory, self.d_model)
        _check_same_batch("memory", memory, "tgt", tgt)
        if cache is None:
            return self._decode(tgt, memory, mask, memory_mask, None)
        if len(cache) != len(self.decoder_layers):
            raise ValueError(
                f"cache must hold one KVCache per decoder layer ({len(self.decoder_layers)}), got "
                f"{len(cache)}; use make_cache()"
            )
        for i, c in enumerate(cache):
            for j in range(i):
                if cache[j] is c:  # two layers would append to one cache, each seeing the other's
                    raise ValueError(
                        f"cache[{j}] and cache[{i}] are the same KVCache; each decoder layer needs "
                        "its own (make_cache() makes them)"
                    )
        # All or nothing: a step that fails in a later layer must not leave the earlier layers'
        # caches one step ahead.
        return _undo_on_error(cache, lambda: self._decode(tgt, memory, mask, memory_mask, cache))

    def _decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        mask: Tensor | Mask | None,
        memory_mask: Tensor | Mask | None,
        cache: Sequence[KVCache | PagedKVCache] | None,
    ) -> Tensor:
        for i, layer in enumerate(self.decoder_layers):
            tgt = layer(
                tgt,
                memory,
                mask=mask,
                memory_mask=memory_mask,
                cache=None if cache is None else cache[i],
            )
        out: Tensor = self.decoder_norm(tgt)
        return out

    @torch_keywords
    @shape_checked
    def forward(
        self,
        src: Float[Tensor, "B Ts D"],
        tgt: Float[Tensor, "B T D"],
        *,
        src_mask: Bool[Tensor, "..."] | Mask | None = None,
        tgt_mask: Bool[Tensor, "..."] | Mask | None = None,
        memory_mask: Bool[Tensor, "..."] | Mask | None = None,
    ) -> Float[Tensor, "B T D"]:
        _check_sequence(self, "src", src, self.d_model)
        _check_sequence(self, "tgt", tgt, self.d_model)
        _check_same_batch("tgt", tgt, "src", src)
        b, ts, t = src.size(0), src.size(1), tgt.size(1)
        # Checked here under the names the caller used; the layers would say mask/memory_mask.
        for name, mask, q_len, kv_len in (
            ("src_mask", src_mask, ts, ts),
            ("tgt_mask", tgt_mask, t, t),
            ("memory_mask", memory_mask, t, ts),
        ):
            if isinstance(mask, Tensor) and mask.is_floating_point():
                raise TypeError(
                    f"{name} must be a bool tensor (True = may attend) or a Mask, got "
                    f"{str(mask.dtype).removeprefix('torch.')}: Transformer takes no additive "
                    f"scores. A float mask of 0 and -inf is the bool mask ({name} == 0); torch's "
                    "generate_square_subsequent_mask is causal, which the decoder already is; "
                    "other float scores go to a layer's bias= (encoder_layers[i](x, bias=...))"
                )
            if mask is not None:
                check_mask(name, mask, (b, self.num_heads, q_len, kv_len))
        memory = self.encode(src, mask=src_mask)
        return self.decode(tgt, memory, mask=tgt_mask, memory_mask=memory_mask)

    def make_cache(self, batch_size: int, max_len: int) -> list[KVCache]:
        """One empty :class:`~attnkit.KVCache` per decoder layer, for :meth:`decode`."""
        caches = []
        for layer in self.decoder_layers:
            attn = layer.self_attn
            if not isinstance(attn, MultiHeadAttention):
                raise TypeError(
                    f"make_cache() needs MultiHeadAttention layers, got {type(attn).__name__}"
                )
            caches.append(attn.make_cache(batch_size, max_len))
        return caches
