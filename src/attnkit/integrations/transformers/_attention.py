"""The attention function: every attention layer's call, ``(module, q, k, v, mask, **kwargs)``
in transformers' ``(B, H, T, D)`` layout, as one :func:`attnkit.attention` call (see the package's
table of what transformers passes and what attnkit gets)."""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import masks
from ..._base.checks import shape_str
from ..._base.shapes import Float, shape_checked
from ...attention import Backend, attention
from ...flash_attn import varlen_mask
from ...masks import Geometry, Mask, band_visibility
from ...modules._shards import SequenceShards
from ...modules.capture import is_capturing, record
from ._masks import TransformersMask

__all__ = ["attention_forward"]


def _top_left_causal(q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """Query ``i`` sees keys ``j <= i`` (torch SDPA's ``is_causal``), as a ``(Tq, Tk)`` mask."""
    i = torch.arange(q_len, device=device).unsqueeze(-1)
    return band_visibility(i, torch.arange(kv_len, device=device), -math.inf, 0)


def _packed(
    module: nn.Module, query: Tensor, key: Tensor, kwargs: dict[str, Any], positions: bool = True
) -> tuple[Tensor, Tensor] | None:
    """``(cu_seq_lens_q, cu_seq_lens_k)`` of packed sequences without padding, as transformers
    hands them to its flash-attention path: given, or (unless ``positions`` is False) read from
    packed ``position_ids`` of one batch row (a new sequence wherever the positions do not step
    by 1). None otherwise."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if (cu_q is None) != (cu_k is None):
        raise ValueError(
            f"{_layer(module)}: packed sequences need both cu_seq_lens_q and cu_seq_lens_k, got "
            f"only {'cu_seq_lens_q' if cu_k is None else 'cu_seq_lens_k'}"
        )
    if cu_q is None:
        if not positions:
            return None
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


def _traced_packing(
    query: Tensor, key: Tensor, kwargs: dict[str, Any], padding: Tensor | None = None
) -> Mask | None:
    """While torch.compile traces, packed ``position_ids`` of one batch row as a documents mask:
    where the positions reset is data, so :func:`_packed`'s boundaries cannot be read there; a
    new sequence starts wherever the positions do not step by 1, as there, unless the row's 2-d
    ``padding`` hides a token (then it is one sequence). None when there are no such positions
    (or cumulative lengths are given: :func:`_packed` reads those)."""
    if not torch.compiler.is_compiling() or kwargs.get("cu_seq_lens_q") is not None:
        return None
    ids = kwargs.get("position_ids")
    if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.size(0) != 1:
        return None
    if ids.size(1) != query.size(-2) or query.size(-2) != key.size(-2) or ids.size(1) < 2:
        return None
    # Prepending the first position less 1 keeps every step the length of the positions: a
    # (T - 1,) difference would make torch.export's dynamic T start at 3 instead of 2.
    starts = torch.diff(ids[0], prepend=ids[0, :1] - 1) != 1
    if padding is not None:  # whether it hides a token is data here: no start where it does
        starts = starts & padding.to(torch.bool).all()
    return masks.documents(ids=starts.long().cumsum(0))


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


def _shard_padding(mask: Mask, batch: int, kv_len: int, device: torch.device) -> Mask | Tensor:
    """``mask`` with its key padding as this rank's bool key mask ``(B, 1, 1, Tk)``: transformers
    built it from this rank's 2-d mask, so it is the rank's keys' own and travels with them (a
    structured mask would be read at the whole sequence's positions)."""
    if mask.op is not None:
        parts = [_shard_padding(p, batch, kv_len, device) for p in mask.parts]
        joined: Mask | Tensor = functools.reduce(
            operator.and_ if mask.op == "and" else operator.or_, parts
        )
        return joined
    if mask.keys_only and mask.tensor is None:
        geo = Geometry((batch,), 1, kv_len, kv_len, device)
        return mask.key_tile(geo, 0, kv_len).reshape(-1, 1, 1, kv_len)
    return mask


def _sharded(
    module: nn.Module,
    shards: SequenceShards,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: object,
    kwargs: dict[str, Any],
) -> Tensor:
    """The layer's call on this rank's shard of a sequence split across processes: q, k, v and
    the 2-d padding mask transformers built the mask from are the shard's; ``position_ids`` are
    the shard's positions in the whole sequence (rotary reads them), so they say nothing of
    packing here."""
    if kwargs["position_bias"] is not None:
        raise ValueError(
            f"{_layer(module)}: a dense position_bias would need the whole sequence's rows on "
            "every rank"
        )
    if kwargs["output_attentions"] or is_capturing(module) or _model_collects_weights():
        raise ValueError(
            f"{_layer(module)}: no attention weights from a sequence split across processes: they "
            "would be the whole sequence's (Tq, Tk) matrix on every rank"
        )
    if kwargs.get("cu_seq_lens_q") is not None or (
        isinstance(attention_mask, TransformersMask) and attention_mask.packed
    ):
        raise ValueError(
            f"{_layer(module)}: packed sequences across processes need the whole sequence's "
            "document lengths: call attnkit.distributed.ring_attention with "
            "masks.documents(lengths)"
        )
    q_len, kv_len = query.size(-2), key.size(-2)
    mask: Mask | Tensor | None = None
    causal = False
    if isinstance(attention_mask, TransformersMask):
        if attention_mask.keys != kv_len:
            raise ValueError(
                f"{_layer(module)}: a cache's unfilled slots ({attention_mask!r}) do not split "
                "across processes; run without a cache (use_cache=False)"
            )
        causal = attention_mask.causal
        given = attention_mask.mask
        if isinstance(given, Mask):
            mask = _shard_padding(given, query.size(0), kv_len, query.device)
        else:  # transformers' own dense mask: the distributed call says why it cannot take it
            mask = given
    elif isinstance(attention_mask, Tensor):
        if attention_mask.dtype != torch.bool:
            raise ValueError(
                f"{_layer(module)}: a float attention_mask {shape_str(attention_mask.shape)} "
                "would need the whole sequence's rows on every rank; register attnkit's mask "
                "function with the attention function (register() does)"
            )
        mask = attention_mask
    elif attention_mask is None:
        causal = bool(getattr(module, "is_causal", True)) and q_len > 1
    out = shards.attention(
        query, key, value, mask=mask, bias=None, causal=causal, scale=kwargs.get("scaling"),
        sinks=kwargs.get("sinks"), dropout_p=kwargs.get("dropout_p", 0.0), return_lse=False,
        softcap=kwargs.get("softcap"),
    )  # fmt: skip
    return cast(Tensor, out)  # return_lse=False: the output alone


def _selected_keys(
    module: nn.Module, indices: Tensor, batch: int, q_len: int, keys: int
) -> masks.KeyIndices:
    """The keys a sparse-attention indexer selected for each query (DeepSeek V3.2's ``indices``,
    ``(B, Tq, topk)`` key positions), one selection for every head, over the ``keys`` the call
    keeps: what transformers' eager and sdpa paths AND into a ``(B, 1, Tq, Tk)`` mask before they
    attend, as an index mask, which the chunked backend serves by reading each query's ``topk``
    keys (O(Tq * topk)) instead of scanning all of them."""
    if indices.ndim != 3 or indices.shape[:2] != (batch, q_len) or indices.is_floating_point():
        raise ValueError(
            f"{_layer(module)}: indices must be integer key positions (B, Tq, topk) = "
            f"({batch}, {q_len}, topk), got {indices.dtype} of shape {shape_str(indices.shape)}"
        )
    selected = indices.long()
    # A static cache's slots past the keys kept can only be empty: no key there to attend.
    selected = torch.where(selected < keys, selected, -1)
    return masks.key_indices(selected.unsqueeze(1))


def _sink_share(module: nn.Module, sinks: Tensor, lse: Tensor) -> Tensor:
    """``(B, H, Tq, 1)``: the share of each row's softmax that its per-query sink leaves to the
    keys, ``sigmoid(lse - sink)``. A sink is one more logit in the row's denominator with a zero
    value, so the row's output and weights are those without it times this share; the call
    stays O(T) in memory (no extra key column of bias)."""
    if sinks.ndim != 4 or sinks.size(-1) != 1 or sinks.shape[1:3] != lse.shape[-2:]:
        raise ValueError(
            f"{_layer(module)}: per-query sinks must have shape (B|1, H, Tq, 1) = "
            f"(B|1, {lse.size(-2)}, {lse.size(-1)}, 1), got {shape_str(sinks.shape)}"
        )
    return torch.sigmoid(lse.unsqueeze(-1) - sinks.to(lse.dtype))


def _with_selection(
    module: nn.Module,
    mask: Mask | Tensor | None,
    query: Tensor,
    keys: int,
    kwargs: dict[str, Any],
) -> Mask | Tensor | None:
    """``mask`` with the keys a sparse-attention indexer selected ANDed in (``indices``, as
    :func:`attnkit.masks.key_indices`), over the ``keys`` the call keeps."""
    if kwargs.get("block_indices") is not None:
        # MiniMax M3's block selection: attending every key instead would be another model.
        raise ValueError(
            f"{_layer(module)}: a block-sparse selection (block_indices) is applied by "
            "transformers' eager and sdpa paths only; load the model with "
            'attn_implementation="eager" or "sdpa"'
        )
    indices = kwargs.get("indices")
    if not isinstance(indices, Tensor):
        return mask
    selected = _selected_keys(module, indices, query.size(0), query.size(-2), keys)
    # The method, not `&`: the mask may be a tensor, and the method call is inlined as it is,
    # without torch's dispatch of an operator with a tensor operand.
    return selected if mask is None else selected.__and__(mask)


def _with_sinks(
    module: nn.Module, result: Tensor | tuple[Tensor, ...], sinks: Tensor | None, weights: bool
) -> tuple[Tensor, Tensor | None]:
    """The output and weights (when asked for) of :func:`attention`'s ``result``, with per-query
    ``sinks`` taking their share (the call then returned the log-sum-exp last)."""
    parts = list(result) if isinstance(result, tuple) else [result]
    out, probs = parts[0], (parts[1] if weights else None)
    if sinks is not None:
        share = _sink_share(module, sinks, parts[-1])
        out = (out * share).to(out.dtype)
        probs = None if probs is None else (probs * share).to(probs.dtype)
    return out, probs


@shape_checked
def _without_a_mask(
    module: nn.Module, query: Tensor, key: Tensor, is_causal: bool | None, kwargs: dict[str, Any]
) -> tuple[int, Mask | Tensor | None, bool]:
    """``(keys, mask, causal)`` of a call that transformers hands no mask: packed sequences (from
    cumulative lengths or resetting positions), else the module's own causality."""
    q_len, kv_len = query.size(-2), key.size(-2)
    causal_module = getattr(module, "is_causal", True) if is_causal is None else is_causal
    window = kwargs.get("sliding_window")
    traced = _traced_packing(query, key, kwargs)
    if traced is not None:  # each sequence's queries and keys are its own: aligned alike
        mask = traced & masks.causal() if causal_module else traced
        if window:
            mask = mask & masks.sliding_window(window - 1, 0 if causal_module else window - 1)
        return kv_len, mask, False
    packed = _packed(module, query, key, kwargs)
    if packed is not None:  # as transformers' flash-attention path: bottom-right per sequence
        packed_mask = varlen_mask(
            *packed,
            causal=bool(causal_module),
            window_size=(window - 1, window - 1) if window else (-1, -1),
        )
        return kv_len, packed_mask, False
    if causal_module and q_len > 1:
        if q_len <= kv_len:  # top-left: the keys after the last query are never seen
            return q_len, None, True
        return kv_len, _top_left_causal(q_len, kv_len, query.device), False
    return kv_len, None, False


def _read_mask(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    attention_mask: object,
    is_causal: bool | None,
    kwargs: dict[str, Any],
) -> tuple[int, Mask | Tensor | None, Tensor | None, bool]:
    """``(keys, mask, bias, causal)`` of what transformers hands as ``attention_mask``: attnkit's
    :class:`TransformersMask`, a 4-d bool or float tensor, or None."""
    q_len, kv_len = query.size(-2), key.size(-2)
    if isinstance(attention_mask, TransformersMask) and attention_mask.constrains_nothing:
        # Every pair may attend: the sizes it was built for do not matter (transformers sizes a
        # decoder's cross-attention mask from the self-attention cache; eager broadcasts it).
        return kv_len, None, None, False
    if isinstance(attention_mask, TransformersMask):
        if (attention_mask.q_len, attention_mask.kv_len) != (q_len, kv_len):
            raise ValueError(
                f"{_layer(module)}: {attention_mask!r} does not fit q {shape_str(query.shape)} and "
                f"k {shape_str(key.shape)}"
            )
        return attention_mask.keys, attention_mask.mask, None, attention_mask.causal
    if isinstance(attention_mask, Tensor):
        if attention_mask.ndim != 4 or not (
            attention_mask.dtype == torch.bool or attention_mask.is_floating_point()
        ):
            # A 2-d padding mask here would broadcast over the wrong axes without a word.
            raise ValueError(
                f"{_layer(module)}: a tensor attention_mask must be 4-d (B|1, H|1, Tq, Tk), bool "
                f"or float, got {attention_mask.dtype} of shape {shape_str(attention_mask.shape)}"
            )
        if attention_mask.dtype == torch.bool:
            return kv_len, attention_mask, None, False
        return kv_len, None, attention_mask.to(query.dtype), False
    if attention_mask is None:
        keys, mask, causal = _without_a_mask(module, query, key, is_causal, kwargs)
        return keys, mask, None, causal
    raise TypeError(
        f"{_layer(module)}: attention_mask must be a 4-d bool or float tensor, a "
        f"TransformersMask or None, got {type(attention_mask).__name__}"
    )


def _with_packing(
    module: nn.Module,
    mask: Mask | Tensor | None,
    query: Tensor,
    key: Tensor,
    padding: Tensor | None,
    kwargs: dict[str, Any],
) -> Mask | Tensor | None:
    """``mask`` ANDed with the packed sequences the positions show. transformers builds a packed
    mask only without a cache (training usually runs with use_cache=True all the same); its
    flash-attention path reads the packing from the positions whatever the cache, and so does
    this one. Not where the 2-d mask hides a token (``padding``): flash-attention then attends
    by the mask alone, as eager and sdpa do, and a row with a hole in it (generate() numbers the
    real tokens on past the hole) is one sequence."""
    traced = _traced_packing(query, key, kwargs, padding)
    if traced is not None:  # the method, as in _with_selection: the mask may be a tensor
        return traced if mask is None else traced.__and__(mask)
    packed = _packed(module, query, key, kwargs, positions=padding is None)
    if packed is None:
        return mask
    sequences = varlen_mask(*packed)  # the mask holds the pattern; the sequences are ANDed in
    if sequences is None:
        return mask
    return sequences if mask is None else sequences & mask


def attention_forward(
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
    sequence_shards: SequenceShards | None = None,
    **kwargs: Any,
) -> tuple[Float[Tensor, "B Tq H Dv"], Float[Tensor, "B H Tq Tk"] | None]:
    if sequence_shards is not None:
        extra = {
            "scaling": scaling,
            "softcap": softcap,
            "sinks": s_aux if s_aux is not None else sinks,
            "dropout_p": float(dropout) if module.training else 0.0,
            "position_bias": position_bias,
            "output_attentions": output_attentions,
        }
        out = _sharded(module, sequence_shards, query, key, value, attention_mask, kwargs | extra)
        return out.transpose(1, 2).contiguous(), None
    kv_len = key.size(-2)
    keys, mask, bias, causal = _read_mask(module, query, key, attention_mask, is_causal, kwargs)
    mask = _with_selection(module, mask, query, keys, kwargs)
    if isinstance(attention_mask, TransformersMask) and not attention_mask.packed:
        mask = _with_packing(module, mask, query, key, attention_mask.padding, kwargs)
    if position_bias is not None:
        position_bias = position_bias.to(query.dtype)
        bias = position_bias if bias is None else position_bias + bias
    if keys < kv_len:
        key, value = key[..., :keys, :], value[..., :keys, :]
        if bias is not None and bias.size(-1) != 1:
            bias = bias[..., :keys]
    if isinstance(mask, Tensor) and mask.dtype == torch.bool:
        # transformers' own mask, True = may attend: a row of padding alone is meant, not a sign
        # of torch's convention
        mask = masks.from_tensor(mask)
    sink = s_aux if s_aux is not None else sinks
    per_query_sinks = sink is not None and sink.ndim > 1  # Inkling 2's (B, H, Tq, 1)
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
        sinks=None if per_query_sinks else sink,
        dropout_p=dropout_p,
        return_weights=want_weights,
        return_lse=per_query_sinks,
        backend=backend,
    )
    out, weights = _with_sinks(module, result, sink if per_query_sinks else None, want_weights)
    if weights is not None:
        weights = F.pad(weights, (0, kv_len - keys))
        if capturing:
            record(module, weights)
    return out.transpose(1, 2).contiguous(), weights


# Registration
