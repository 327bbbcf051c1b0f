"""torch's attention modules in and out: ``torch.nn.MultiheadAttention``, its Transformer layers
and its masks.

* :func:`from_torch`: the attnkit module computing what a ``torch.nn.MultiheadAttention``,
  ``TransformerEncoderLayer``, ``TransformerDecoderLayer`` or ``Transformer`` computes, with
  copies of its parameters;
* :func:`to_torch`: a ``torch.nn.MultiheadAttention`` from a :class:`~attnkit.MultiHeadAttention`;
* :func:`from_torch_masks`: torch's ``attn_mask``/``key_padding_mask`` (True = may NOT attend) as
  attnkit's ``(mask, bias)`` (True = may attend).
"""

from __future__ import annotations

import copy
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._base.checks import check_int, present, shape_str
from .._base.shapes import Bool, Float, shape_checked
from ..modules.layers import Transformer, TransformerDecoderLayer, TransformerEncoderLayer
from ..modules.multihead import MultiHeadAttention

__all__ = ["from_torch", "from_torch_masks", "to_torch"]

_TorchModule = (
    nn.MultiheadAttention | nn.TransformerEncoderLayer | nn.TransformerDecoderLayer | nn.Transformer
)


@overload
def from_torch(
    m: nn.MultiheadAttention, *, batch_first: bool | None = None
) -> MultiHeadAttention: ...


@overload
def from_torch(
    m: nn.TransformerEncoderLayer, *, batch_first: bool | None = None
) -> TransformerEncoderLayer: ...


@overload
def from_torch(
    m: nn.TransformerDecoderLayer, *, batch_first: bool | None = None
) -> TransformerDecoderLayer: ...


@overload
def from_torch(m: nn.Transformer, *, batch_first: bool | None = None) -> Transformer: ...


def from_torch(
    m: _TorchModule, *, batch_first: bool | None = None
) -> MultiHeadAttention | TransformerEncoderLayer | TransformerDecoderLayer | Transformer:
    """The attnkit module that computes what the torch module ``m`` computes, with copies of its
    parameters:

    * ``torch.nn.MultiheadAttention`` -> :class:`~attnkit.MultiHeadAttention`;
    * ``torch.nn.TransformerEncoderLayer`` -> :class:`~attnkit.TransformerEncoderLayer` (post- or
      pre-norm; the activation a string or a callable: ``F.relu``, ``torch.relu``, ``nn.ReLU``,
      ``F.gelu``, ``nn.GELU()``, ``F.silu``, ``nn.SiLU``);
    * ``torch.nn.TransformerDecoderLayer`` -> :class:`~attnkit.TransformerDecoderLayer`. torch's
      decoder layer is causal only when given a causal ``tgt_mask``: call the result with
      ``causal=True`` for that, ``causal=False`` otherwise;
    * ``torch.nn.Transformer`` -> :class:`~attnkit.Transformer`, each layer as above and the
      final LayerNorms of both stacks (which torch has after post-norm layers too). Its decoder
      is causal: it computes what torch's computes given a causal ``tgt_mask``
      (``nn.Transformer.generate_square_subsequent_mask(T)``). Only torch's own stacks are
      taken, not a ``custom_encoder`` or ``custom_decoder``.

    For ``torch.nn.MultiheadAttention``: packed or separate projections, with or without bias,
    ``kdim``/``vdim``, ``add_bias_kv`` (``bias_k`` and ``bias_v`` are copied) and
    ``add_zero_attn`` are supported, outputs and weights: with ``need_weights=True`` the copy
    returns torch's weights, the extra tokens' columns included. Translate torch's
    ``attn_mask``/``key_padding_mask`` (and a layer's ``src_mask``, ``src_key_padding_mask``, ...)
    with :func:`from_torch_masks`: they cover the keys only, and the extra tokens stay visible to
    every query, as torch pads its masks for them. A layer takes the translation as ``mask=`` and
    ``bias=`` (the decoder's cross-attention as ``memory_mask=`` and ``memory_bias=``).

    attnkit's modules are batch-first: they take ``(B, T, E)``. torch's default,
    ``batch_first=False``, takes ``(T, B, E)``, which the copy would read as a batch of ``T``
    sequences of length ``B``, without an error. So a module with ``batch_first=False`` is
    refused unless ``batch_first=True`` says that the copy will be given batch-first inputs
    (``x.transpose(0, 1)`` of the torch module's inputs, and the output transposed back).

    One difference: in training with dropout, torch returns the weights after dropout,
    attnkit before.

    >>> theirs = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    >>> ours = from_torch(theirs).eval()
    >>> x = torch.randn(2, 5, 16)
    >>> torch.allclose(ours(x), theirs(x, x, x, need_weights=False)[0], atol=1e-6)
    True
    """
    if isinstance(m, nn.MultiheadAttention):
        return _multihead(m, batch_first)
    if isinstance(m, nn.TransformerEncoderLayer):
        options = _layer_options(m)  # its errors first: they hold whatever batch_first
        encoder = TransformerEncoderLayer(
            m.linear1.in_features, attention=_multihead(m.self_attn, batch_first), **options
        )
        _copy_layer(encoder, m, norms=2)
        return encoder.train(m.training)
    if isinstance(m, nn.TransformerDecoderLayer):
        options = _layer_options(m)
        decoder = TransformerDecoderLayer(
            m.linear1.in_features,
            attention=_multihead(m.self_attn, batch_first),
            cross_attention=_multihead(m.multihead_attn, batch_first),
            **options,
        )
        _copy_layer(decoder, m, norms=3)
        return decoder.train(m.training)
    if isinstance(m, nn.Transformer):
        return _transformer(m, batch_first)
    raise TypeError(
        "from_torch() takes a torch.nn.MultiheadAttention, TransformerEncoderLayer, "
        f"TransformerDecoderLayer or Transformer, got {type(m).__name__}"
    )


def _transformer(m: nn.Transformer, batch_first: bool | None) -> Transformer:
    """A copy of a ``torch.nn.Transformer`` (see :func:`from_torch`)."""
    stacks = {"encoder": nn.TransformerEncoder, "decoder": nn.TransformerDecoder}
    for name, cls in stacks.items():
        stack = getattr(m, name)
        if type(stack) is not cls:
            raise TypeError(
                f"from_torch(): this torch.nn.Transformer's {name} is a "
                f"{type(stack).__name__} (a custom_{name}), not torch's {cls.__name__}: convert "
                "its layers one by one"
            )
    encoders, decoders = list(m.encoder.layers), list(m.decoder.layers)
    first = (encoders + decoders)[:1]
    if not first:
        raise ValueError("from_torch(): this torch.nn.Transformer has no layer")
    options = _layer_options(first[0])
    ours = Transformer(
        m.d_model,
        m.nhead,
        num_encoder_layers=len(encoders),
        num_decoder_layers=len(decoders),
        **options,
    )
    for i, layer in enumerate(encoders):
        ours.encoder_layers[i] = from_torch(layer, batch_first=batch_first)
    for i, layer in enumerate(decoders):
        ours.decoder_layers[i] = from_torch(layer, batch_first=batch_first)
    # torch's stacks end with a LayerNorm (nn.Transformer builds one whatever norm_first) or None.
    ours.encoder_norm = nn.Identity() if m.encoder.norm is None else copy.deepcopy(m.encoder.norm)
    ours.decoder_norm = nn.Identity() if m.decoder.norm is None else copy.deepcopy(m.decoder.norm)
    return ours.train(m.training)


def _activation(m: nn.Module) -> str:
    """The name of a torch Transformer layer's activation, for the attnkit feed-forward."""
    # torch keeps the function it was given: F.relu/F.gelu for the strings, or any callable.
    act = getattr(m, "activation", None)
    if any(act is f for f in (F.relu, torch.relu)) or isinstance(act, nn.ReLU):
        return "relu"
    if act is F.gelu or (isinstance(act, nn.GELU) and act.approximate == "none"):
        return "gelu"
    if act is F.silu or isinstance(act, nn.SiLU):
        return "silu"
    raise ValueError(
        f"from_torch(): activation {act!r} has no attnkit equivalent (relu, gelu with "
        "approximate='none', silu)"
    )


def _layer_options(m: nn.TransformerEncoderLayer | nn.TransformerDecoderLayer) -> dict[str, Any]:
    """The constructor arguments a torch Transformer layer implies for ours (all but attention)."""
    return {
        "d_ff": m.linear1.out_features,
        "dropout": float(m.dropout.p),
        "activation": _activation(m),
        "norm_first": m.norm_first,
        "layer_norm_eps": m.norm1.eps,
        "bias": m.linear1.bias is not None,
        "device": m.linear1.weight.device,
        "dtype": m.linear1.weight.dtype,
    }


def _copy_layer(ours: nn.Module, theirs: nn.Module, norms: int) -> None:
    """Copy the feed-forward and the ``norm1 .. norm<norms>`` LayerNorms of a torch layer."""
    for name in ("linear1", "linear2"):
        getattr(ours.ffn, name).load_state_dict(getattr(theirs, name).state_dict())
    for i in range(1, norms + 1):
        getattr(ours, f"norm{i}").load_state_dict(getattr(theirs, f"norm{i}").state_dict())


def _multihead(m: nn.MultiheadAttention, batch_first: bool | None) -> MultiHeadAttention:
    """A copy of a ``torch.nn.MultiheadAttention`` (see :func:`from_torch`)."""
    if (m.bias_k is None) != (m.bias_v is None):
        raise ValueError(
            f"from_torch(): bias_k is {_set_or_none(m.bias_k)} but bias_v is "
            f"{_set_or_none(m.bias_v)}; torch's add_bias_kv=True sets both"
        )
    if batch_first is False:
        raise ValueError(
            "from_torch(batch_first=False): attnkit's MultiHeadAttention takes batch-first "
            "inputs (B, T, E) only; pass batch_first=True and transpose (T, B, E) inputs with "
            "x.transpose(0, 1)"
        )
    if batch_first is None and not m.batch_first:
        raise ValueError(
            "from_torch(): this torch.nn.MultiheadAttention has batch_first=False, so it takes "
            "(T, B, E) inputs, but attnkit's MultiHeadAttention takes (B, T, E): given (T, B, E) "
            "it would silently attend across the batch. Call from_torch(m, batch_first=True) "
            "and give the copy x.transpose(0, 1) (its output transposed back), or build the "
            "torch module with batch_first=True"
        )
    ref = m.out_proj.weight
    new = MultiHeadAttention(
        m.embed_dim,
        m.num_heads,
        kdim=m.kdim,
        vdim=m.vdim,
        proj_bias=m.in_proj_bias is not None,
        dropout=float(m.dropout),
        add_bias_kv=m.bias_k is not None,
        add_zero_attn=bool(m.add_zero_attn),
        device=ref.device,
        dtype=ref.dtype,
    )

    def copy(name: str, ours: Tensor, theirs: Tensor) -> None:
        # copy_ would broadcast a tensor of the wrong shape (one row into every row).
        if theirs.shape != ours.shape:
            raise ValueError(
                f"from_torch(): {name} has shape {shape_str(theirs.shape)}, expected "
                f"{shape_str(ours.shape)} for embed_dim={m.embed_dim}, "
                f"num_heads={m.num_heads}"
            )
        ours.copy_(theirs)

    with torch.no_grad():
        if m.in_proj_weight is not None and new.in_proj_weight is not None:
            copy("in_proj_weight", new.in_proj_weight, m.in_proj_weight)
        else:
            for name, ours, theirs in zip(
                ("q_proj_weight", "k_proj_weight", "v_proj_weight"),
                new.in_weights(),
                (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight),
                strict=True,
            ):
                copy(name, ours, theirs)
        if new.in_proj_bias is not None:
            copy("in_proj_bias", new.in_proj_bias, m.in_proj_bias)
        if new.bias_k is not None and new.bias_v is not None:
            copy("bias_k", new.bias_k, present(m.bias_k, "bias_k"))
            copy("bias_v", new.bias_v, present(m.bias_v, "bias_v"))
        new.out_proj.load_state_dict(m.out_proj.state_dict())
    return new.train(m.training)


def to_torch(module: MultiHeadAttention, *, batch_first: bool = True) -> nn.MultiheadAttention:
    """A ``torch.nn.MultiheadAttention`` with copies of ``module``'s parameters.

    Only plain multi-head attention has one: ``num_kv_heads == num_heads``, ``head_dim ==
    v_head_dim == d_model / num_heads``, no ``rotary``. ``add_bias_kv`` (with ``bias_k`` and
    ``bias_v``) and ``add_zero_attn`` carry over.
    """
    if not isinstance(module, MultiHeadAttention):
        raise TypeError(
            f"to_torch() takes an attnkit.MultiHeadAttention, got {type(module).__name__}"
        )
    plain = module.d_model // module.num_heads
    problems = []
    if module.num_kv_heads != module.num_heads:
        problems.append(f"num_kv_heads ({module.num_kv_heads}) != num_heads ({module.num_heads})")
    if module.head_dim * module.num_heads != module.d_model or module.v_head_dim != module.head_dim:
        problems.append(
            f"head_dim ({module.head_dim}) and v_head_dim ({module.v_head_dim}) must both be "
            f"d_model / num_heads ({module.d_model} / {module.num_heads} = {plain})"
        )
    if module.rotary is not None:
        problems.append("rotary embeddings are set")
    if problems:
        raise ValueError(
            "to_torch(): torch.nn.MultiheadAttention has no equivalent: " + "; ".join(problems)
        )
    ref = module.out_proj.weight
    m = nn.MultiheadAttention(
        module.d_model,
        module.num_heads,
        dropout=module.dropout,
        bias=module.in_proj_bias is not None,
        add_bias_kv=module.bias_k is not None,
        add_zero_attn=module.add_zero_attn,
        kdim=module.kdim,
        vdim=module.vdim,
        batch_first=batch_first,
        device=ref.device,
        dtype=ref.dtype,
    )
    with torch.no_grad():
        if m.in_proj_weight is not None and module.in_proj_weight is not None:
            m.in_proj_weight.copy_(module.in_proj_weight)
        else:
            for theirs, ours in zip(
                (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight),
                module.in_weights(),
                strict=True,
            ):
                theirs.copy_(ours)
        if module.in_proj_bias is not None:
            m.in_proj_bias.copy_(module.in_proj_bias)
        if module.bias_k is not None and module.bias_v is not None:
            present(m.bias_k, "bias_k").copy_(module.bias_k)
            present(m.bias_v, "bias_v").copy_(module.bias_v)
        m.out_proj.load_state_dict(module.out_proj.state_dict())
    return m.train(module.training)


@shape_checked
def from_torch_masks(
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    *,
    num_heads: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[Bool[Tensor, "..."] | None, Float[Tensor, "..."] | None]:
    """Translate ``torch.nn.MultiheadAttention``'s masks into attnkit's ``(mask, bias)``.

    The rules are torch's: a bool mask means **True = may NOT attend** (the opposite of
    attnkit's); a float mask is added to the scores (attnkit's ``bias``); any other dtype (an
    integer or uint8 mask, which older torch read as bool) is a ``TypeError``, as torch raises
    for it. Reading a 0/1 integer mask as a bias would add +1 to the keys it means to block.

    Args:
        attn_mask: ``(Tq, Tk)`` or ``(B*H, Tq, Tk)``, bool or float.
        key_padding_mask: ``(B, Tk)``, bool (True = padding) or float.
        num_heads: ``H``, to unfold a ``(B*H, Tq, Tk)`` mask into ``(B, H, Tq, Tk)``.
        dtype: of the returned bias (the query's dtype), a floating-point dtype.

    Returns:
        ``(mask, bias)`` for ``MultiHeadAttention.forward(mask=..., bias=...)``, each broadcastable
        to ``(B, H, Tq, Tk)`` or None.

    >>> torch_pad = torch.tensor([[False, False, True]])      # torch: True = padding
    >>> mask, bias = from_torch_masks(key_padding_mask=torch_pad, num_heads=4)
    >>> mask.int(), bias
    (tensor([[[[1, 1, 0]]]], dtype=torch.int32), None)
    """
    num_heads = check_int("num_heads", num_heads)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    masks: list[Tensor] = []
    biases: list[Tensor] = []
    if attn_mask is not None:
        _check_torch_mask("attn_mask", attn_mask)
        if attn_mask.ndim == 3:
            if attn_mask.size(0) % num_heads:
                raise ValueError(
                    f"a 3-d attn_mask must be (B*H, Tq, Tk) with H = num_heads ({num_heads}), got "
                    f"{shape_str(attn_mask.shape)}"
                )
            attn_mask = attn_mask.unflatten(0, (-1, num_heads))
        elif attn_mask.ndim != 2:
            raise ValueError(
                f"attn_mask must be (Tq, Tk) or (B*H, Tq, Tk), got {shape_str(attn_mask.shape)}"
            )
        (masks if attn_mask.dtype == torch.bool else biases).append(attn_mask)
    if key_padding_mask is not None:
        _check_torch_mask("key_padding_mask", key_padding_mask)
        if key_padding_mask.ndim != 2:
            raise ValueError(
                f"key_padding_mask must be (B, Tk), got {shape_str(key_padding_mask.shape)}"
            )
        kpm = key_padding_mask[:, None, None, :]  # (B, 1, 1, Tk)
        (masks if kpm.dtype == torch.bool else biases).append(kpm)
    mask = None
    for m in masks:
        mask = ~m if mask is None else mask & ~m
    bias = None
    for b in biases:
        bias = b.to(dtype) if bias is None else bias + b.to(dtype)
    return mask, bias


def _set_or_none(t: Tensor | None) -> str:
    return "None" if t is None else f"set {shape_str(t.shape)}"


def _check_torch_mask(name: str, mask: object) -> None:
    """Raise unless ``mask`` is a mask torch.nn.MultiheadAttention takes: a bool or float tensor."""
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor (bool, True = may not attend; or float, added to the "
            f"scores) or None, got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool and not mask.is_floating_point():
        dtype = str(mask.dtype).removeprefix("torch.")
        raise TypeError(
            f"{name} must be a bool tensor (True = may not attend) or a float tensor (added to "
            f"the scores), as torch.nn.MultiheadAttention requires; got {dtype}. For a 0/1 "
            f"mask where 1 means padding, pass {name}.bool()"
        )
