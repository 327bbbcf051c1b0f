"""ESPnet (and NeMo) relative attention and ESPnet's Conformer layer, loaded into attnkit.

**Relative attention.** ESPnet's ``RelPositionMultiHeadedAttention`` fed by its
``RelPositionalEncoding``, and NeMo's ``RelPositionMultiHeadAttention`` fed by its
``RelPositionalEncoding``, compute attnkit's formula (Transformer-XL, ``1/sqrt(head_dim)``) over
the distances ``T-1 .. 1-T``. Their encodings interleave the sines and cosines (``sin w_0, cos w_0,
sin w_1, ...``) where attnkit puts every sine first, so ``linear_pos.weight``'s columns are
permuted into ``pos_proj.weight``; everything else is copied as it is:

=============================  ==================================================================
ESPnet / NeMo                  attnkit ``RelativeMultiHeadAttention``
=============================  ==================================================================
``linear_q``, ``linear_k``,    ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (NeMo's
``linear_v``, ``linear_out``   ``use_bias=False``: ``proj_bias=False``)
``linear_pos.weight``          ``pos_proj.weight``: columns ``0, 2, 4, ...`` then ``1, 3, 5, ...``
``pos_bias_u``, ``pos_bias_v`` ``pos_bias_u``, ``pos_bias_v`` (both ``(H, dh)``)
``dropout.p``                  ``dropout``
=============================  ==================================================================

ESPnet and NeMo compute their encoding tables in float32, which rounds the angles by about
``|d| * w_k * 1e-7`` radians at distance ``d``; the loaded module computes its table the same way
(``encoding_dtype=torch.float32``) unless told to use the exact sinusoids (``torch.float64``).

ESPnet's ``LegacyRelPositionMultiHeadedAttention`` fed by its ``LegacyRelPositionalEncoding`` is
not a function of the distance: it projects the *absolute* encodings of the positions ``L - 1``
down to ``L - T`` (``L = max(max_len, T)``) and shifts the product by pad-and-reshape, a true
relative shift only on and below the diagonal (openspeech's). ``legacy="espnet"`` reproduces it,
its float32 table included; ``linear_pos.weight`` is then copied unpermuted.

**Conformer layer.** ESPnet's ``EncoderLayer`` (``espnet.nets.pytorch_backend.conformer`` and
``espnet2.legacy.nets.pytorch_backend.conformer``) with macaron feed-forwards, a convolution
module, ``normalize_before=True`` and ``concat_after=False`` maps onto
:class:`attnkit.ConformerLayer`:

=======================================  =========================================================
ESPnet ``EncoderLayer``                  attnkit ``ConformerLayer``
=======================================  =========================================================
``norm_ff_macaron``, ``norm_mha``,       ``ff1_norm``, ``attn_norm``, ``conv_norm``,
``norm_conv``, ``norm_ff``,              ``ff2_norm``, ``final_norm`` (their eps, 1e-12 in ESPnet)
``norm_final``
``feed_forward_macaron.w_1``, ``.w_2``   ``ff1.linear1``, ``ff1.linear2``
``feed_forward.w_1``, ``.w_2``           ``ff2.linear1``, ``ff2.linear2``
``self_attn``                            ``attn`` (as above)
``conv_module.pointwise_conv1``          ``conv.pointwise1`` (a Linear: the kernel axis dropped)
``conv_module.depthwise_conv``           ``conv.depthwise``
``conv_module.norm``                     ``conv.norm`` (BatchNorm, running statistics included)
``conv_module.pointwise_conv2``          ``conv.pointwise2``
``dropout.p``                            ``dropout``
Swish / ReLU / GELU activation           ``activation="silu"`` / ``"relu"`` / ``"gelu"``
=======================================  =========================================================

Where the two differ, on purpose: ESPnet's released ``ConvolutionModule`` convolves the padded
frames of a batch too (the GLU has written ``pointwise_conv1``'s bias into them), so the last
``(kernel_size - 1) / 2`` real frames of a padded sequence depend on the padding, and in training
BatchNorm's statistics include the padded frames. attnkit zeroes padded frames before the
depthwise convolution (as NeMo and the newest ESPnet ``ConvolutionModule``'s ``mask_pad`` do) and
keeps them out of the statistics. On unpadded input the two are equal; on a padded batch attnkit
gives each sequence what ESPnet gives it alone. ESPnet's stochastic depth (training only) is not
reproduced.

The mask: ESPnet's ``(B, 1, T)``, True = real, is attnkit's ``mask.unsqueeze(1)`` for the
attention and ``mask[:, 0]`` (``(B, T)``) for the layer. NeMo's ``(B, T, T)`` is True = blocked:
pass ``~mask.unsqueeze(1)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .._base.checks import present
from ..modules.relative import RelativeMultiHeadAttention
from . import _copy

if TYPE_CHECKING:
    from ..modules.conformer import ConformerLayer

__all__ = ["conformer_layer", "relative_attention"]

# Classes whose forward is attnkit's formula once mapped: ESPnet's, then NeMo's (one letter less).
_CURRENT = ("RelPositionMultiHeadedAttention", "RelPositionMultiHeadAttention")
_LEGACY = ("LegacyRelPositionMultiHeadedAttention",)
_PARTS = {
    "linear_q": "q_proj",
    "linear_k": "k_proj",
    "linear_v": "v_proj",
    "linear_out": "out_proj",
}


def relative_attention(
    module: nn.Module, *, max_len: int = 5000, encoding_dtype: torch.dtype = torch.float32
) -> RelativeMultiHeadAttention:
    """attnkit's copy of ESPnet's or NeMo's relative self-attention (see the module docstring).

    ``module`` is one of ``RelPositionMultiHeadedAttention`` (ESPnet, with
    ``RelPositionalEncoding``), ``RelPositionMultiHeadAttention`` (NeMo, with its
    ``RelPositionalEncoding``) or ``LegacyRelPositionMultiHeadedAttention`` (ESPnet, with
    ``LegacyRelPositionalEncoding``: the result has ``legacy="espnet"``), recognised by its class
    name. ``max_len`` is the ``LegacyRelPositionalEncoding``'s (ESPnet's default 5000; espnet2's
    ``max_pos_emb_len``) and matters only for the legacy class. ``encoding_dtype``: float32
    (default) for the tables ESPnet and NeMo compute, float64 for the exact sinusoids; not for the
    legacy class, whose own float32 table is reproduced.

    What is refused, with a ValueError: ``zero_triu=True`` (the position term zeroed above the
    diagonal), ``qk_norm`` (a LayerNorm on q and k), an odd ``d_model`` (the toolkits' tables need
    an even one), q/k/v/out projections of which only some have a bias.
    """
    who = "espnet.relative_attention()"
    if not isinstance(module, nn.Module):
        raise TypeError(f"{who} takes an nn.Module, got {type(module).__name__}")
    kind = type(module).__name__
    if kind not in _CURRENT + _LEGACY:
        raise TypeError(
            f"{who} takes ESPnet's RelPositionMultiHeadedAttention or "
            f"LegacyRelPositionMultiHeadedAttention, or NeMo's RelPositionMultiHeadAttention; "
            f"got {kind}"
        )
    legacy = kind in _LEGACY
    if getattr(module, "zero_triu", False):
        raise ValueError(
            f"{who}: zero_triu=True (the position term zeroed above the diagonal) has no attnkit "
            "equivalent"
        )
    for name in ("q_norm", "k_norm"):
        norm = getattr(module, name, None)
        if norm is not None and not isinstance(norm, nn.Identity):
            raise ValueError(
                f"{who}: {kind}.{name} is {type(norm).__name__} (qk_norm=True), "
                "which attnkit does not have"
            )
    linears = {name: _copy.part(module, name, nn.Linear, who) for name in (*_PARTS, "linear_pos")}
    heads = _copy.integer(module, "h", who)
    d_model = linears["linear_q"].in_features
    if d_model % 2:
        raise ValueError(f"{who}: d_model must be even for a sinusoidal table, got {d_model}")
    with_bias = {name: linears[name].bias is not None for name in _PARTS}
    if len(set(with_bias.values())) > 1:
        raise ValueError(f"{who}: only some projections have a bias: {with_bias}")
    if linears["linear_pos"].bias is not None:
        raise ValueError(f"{who}: linear_pos has a bias; attnkit's pos_proj has none")
    weight = linears["linear_q"].weight
    new = RelativeMultiHeadAttention(
        d_model,
        heads,
        dropout=_copy.dropout_p(module, "dropout"),
        proj_bias=with_bias["linear_q"],
        encoding_dtype=torch.float64 if legacy else encoding_dtype,
        legacy="espnet" if legacy else None,
        legacy_max_len=max_len if legacy else None,
        device=weight.device,
        dtype=weight.dtype,
    )
    for theirs, ours in _PARTS.items():
        _copy.copy_linear(getattr(new, ours), linears[theirs], theirs, who)
    pos = linears["linear_pos"].weight
    if not legacy:  # the legacy table is ESPnet's own, interleaved, so its projection fits as is
        pos = pos[:, _copy.halves_from_interleaved(d_model).to(pos.device)]
    _copy.copy_linear(new.pos_proj, linears["linear_pos"], "linear_pos", who, weight=pos)
    for name in ("pos_bias_u", "pos_bias_v"):
        _copy.copy(getattr(new, name), _copy.tensor(module, name, who), f"{name} (H, dh)", who)
    return new.train(module.training)


def _activation(module: object, who: str) -> str:
    """The attnkit name of an ESPnet activation module."""
    if isinstance(module, nn.SiLU):
        return "silu"
    if type(module).__name__ == "Swish" and float(getattr(module, "beta", 1.0)) == 1.0:
        return "silu"  # ESPnet's Swish: x * sigmoid(beta * x)
    if isinstance(module, nn.ReLU):
        return "relu"
    if isinstance(module, nn.GELU) and module.approximate == "none":
        return "gelu"
    raise ValueError(
        f"{who}: activation {module!r} has no attnkit equivalent (Swish/SiLU, ReLU, GELU)"
    )


def conformer_layer(
    layer: nn.Module, *, max_len: int = 5000, encoding_dtype: torch.dtype = torch.float32
) -> ConformerLayer:
    """attnkit's copy of ESPnet's Conformer ``EncoderLayer`` (see the module docstring).

    ``layer`` needs ESPnet's attributes: ``self_attn`` (any class :func:`relative_attention`
    takes), ``feed_forward`` and ``feed_forward_macaron`` (``PositionwiseFeedForward``: ``w_1``,
    ``w_2``, ``activation``, ``dropout``), ``conv_module`` (``ConvolutionModule``), the five
    LayerNorms, ``dropout``, ``normalize_before=True`` and ``concat_after=False``. ``max_len`` and
    ``encoding_dtype`` go to :func:`relative_attention`.
    """
    from ..modules.conformer import ConformerLayer

    who = "espnet.conformer_layer()"
    parts = _conformer_parts(layer, who)
    depthwise = parts.convs["depthwise_conv"]
    ours = ConformerLayer(
        depthwise.in_channels,
        d_ff=parts.d_ff,
        kernel_size=depthwise.kernel_size[0],
        dropout=_copy.dropout_p(layer, "dropout"),
        activation=parts.activation,
        bias=parts.bias,
        attention=relative_attention(
            _copy.part(layer, "self_attn", nn.Module, who),
            max_len=max_len,
            encoding_dtype=encoding_dtype,
        ),
        device=depthwise.weight.device,
        dtype=depthwise.weight.dtype,
    )
    _copy_feed_forwards(ours, parts, who)
    _copy_norms(ours, parts, who)
    _copy_convolution(ours, parts, who)
    return ours.train(layer.training)


@dataclass(frozen=True)
class _ConformerParts:
    """An ESPnet Conformer block's parts, read and checked against what attnkit's block holds:
    the two feed-forwards and their linears, the convolution module's convolutions and batch
    norm, the five LayerNorms, and the one activation, hidden size and bias setting they share."""

    ffs: dict[str, nn.Module]
    linears: dict[tuple[str, str], nn.Linear]
    convs: dict[str, nn.Conv1d]
    batch_norm: nn.BatchNorm1d
    norms: dict[str, nn.LayerNorm]
    activation: str
    d_ff: int
    bias: bool


def _conformer_parts(layer: object, who: str) -> _ConformerParts:
    """Read ``layer``'s parts, refusing a block attnkit's Conformer layer cannot hold."""
    if not isinstance(layer, nn.Module):
        raise TypeError(f"{who} takes an nn.Module, got {type(layer).__name__}")
    kind = type(layer).__name__
    for name in ("feed_forward_macaron", "conv_module"):
        if getattr(layer, name, None) is None:
            raise ValueError(f"{who}: {kind}.{name} is missing or None: not a Conformer block")
    if getattr(layer, "normalize_before", None) is not True:
        raise ValueError(f"{who}: only normalize_before=True (pre-norm) is a Conformer block")
    if getattr(layer, "concat_after", False):
        raise ValueError(f"{who}: concat_after=True has no attnkit equivalent")
    ffs = {
        name: _copy.part(layer, name, nn.Module, who)
        for name in ("feed_forward_macaron", "feed_forward")
    }
    lin = {(ff, w): _copy.part(ffs[ff], w, nn.Linear, who) for ff in ffs for w in ("w_1", "w_2")}
    conv = _copy.part(layer, "conv_module", nn.Module, who)
    convs = {
        name: _copy.part(conv, name, nn.Conv1d, who)
        for name in ("pointwise_conv1", "depthwise_conv", "pointwise_conv2")
    }
    bn = _copy.part(conv, "norm", nn.BatchNorm1d, who)
    norms = {
        name: _copy.part(layer, name, nn.LayerNorm, who)
        for name in ("norm_ff_macaron", "norm_mha", "norm_conv", "norm_ff", "norm_final")
    }
    activations = {
        f"{name}.activation": _activation(getattr(module, "activation", None), who)
        for name, module in (*ffs.items(), ("conv_module", conv))
    }
    if len(set(activations.values())) > 1:
        raise ValueError(f"{who}: the activations differ ({activations}); attnkit has one")
    d_ffs = {ff: lin[ff, "w_1"].out_features for ff in ffs}
    if len(set(d_ffs.values())) > 1:
        raise ValueError(f"{who}: the feed-forwards' hidden sizes differ: {d_ffs}")
    biases = {name: m.bias is not None for name, m in (*lin.items(), *convs.items())}
    if len(set(biases.values())) > 1:
        raise ValueError(f"{who}: only some feed-forward/convolution layers have a bias")
    depthwise = convs["depthwise_conv"]
    d_model, kernel = depthwise.in_channels, depthwise.kernel_size[0]
    if depthwise.groups != d_model or depthwise.padding != ((kernel - 1) // 2,):
        raise ValueError(
            f"{who}: conv_module.depthwise_conv must be depthwise (groups={d_model}) with "
            f"'same' padding {(kernel - 1) // 2}, got groups={depthwise.groups}, "
            f"padding={depthwise.padding}"
        )
    if not bn.affine or not bn.track_running_stats:
        raise ValueError(f"{who}: conv_module.norm must be affine and track running statistics")
    return _ConformerParts(
        ffs=ffs,
        linears=lin,
        convs=convs,
        batch_norm=bn,
        norms=norms,
        activation=next(iter(activations.values())),
        d_ff=next(iter(d_ffs.values())),
        bias=next(iter(biases.values())),
    )


def _copy_feed_forwards(ours: ConformerLayer, parts: _ConformerParts, who: str) -> None:
    """The macaron and the second feed-forward: their linears and dropouts."""
    for ff, mine in (("feed_forward_macaron", ours.ff1), ("feed_forward", ours.ff2)):
        for w, linear in (("w_1", mine.linear1), ("w_2", mine.linear2)):
            _copy.copy_linear(linear, parts.linears[ff, w], f"{ff}.{w}", who)
        mine.dropout.p = _copy.dropout_p(parts.ffs[ff], "dropout")


def _copy_norms(ours: ConformerLayer, parts: _ConformerParts, who: str) -> None:
    """The five LayerNorms; a LayerNorm without a bias (``bias=False``) gives a bias of 0."""
    d_model = ours.conv.depthwise.in_channels
    pairs = (
        ("norm_ff_macaron", ours.ff1_norm),
        ("norm_mha", ours.attn_norm),
        ("norm_conv", ours.conv_norm),
        ("norm_ff", ours.ff2_norm),
        ("norm_final", ours.final_norm),
    )
    for name, norm in pairs:
        theirs = parts.norms[name]
        if theirs.normalized_shape != (d_model,) or not theirs.elementwise_affine:
            raise ValueError(f"{who}: {name} must be an affine LayerNorm({d_model})")
        norm.eps = theirs.eps
        _copy.copy(norm.weight, theirs.weight, f"{name}.weight", who)
        bias = present(norm.bias, "LayerNorm bias")
        if theirs.bias is None:
            with torch.no_grad():
                bias.zero_()
        else:
            _copy.copy(bias, theirs.bias, f"{name}.bias", who)


def _copy_convolution(ours: ConformerLayer, parts: _ConformerParts, who: str) -> None:
    """The convolution module: its pointwise convolutions (as linears), the depthwise one and the
    batch norm with its running statistics."""
    convs = parts.convs
    for name, linear in (
        ("pointwise_conv1", ours.conv.pointwise1),
        ("pointwise_conv2", ours.conv.pointwise2),
    ):
        src = convs[name]
        if src.kernel_size != (1,):
            raise ValueError(
                f"{who}: conv_module.{name} must have kernel_size 1, got {src.kernel_size}"
            )
        _copy.copy(linear.weight, src.weight.squeeze(-1), f"conv_module.{name}.weight", who)
        if linear.bias is not None and src.bias is not None:
            _copy.copy(linear.bias, src.bias, f"conv_module.{name}.bias", who)
    depthwise = convs["depthwise_conv"]
    _copy.copy(
        ours.conv.depthwise.weight, depthwise.weight, "conv_module.depthwise_conv.weight", who
    )
    if ours.conv.depthwise.bias is not None and depthwise.bias is not None:
        _copy.copy(ours.conv.depthwise.bias, depthwise.bias, "conv_module.depthwise_conv.bias", who)
    bn = parts.batch_norm
    ours.conv.norm.eps, ours.conv.norm.momentum = bn.eps, bn.momentum
    ours.conv.norm.load_state_dict(bn.state_dict())
