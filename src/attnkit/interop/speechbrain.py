"""SpeechBrain's relative attention (``RelPosMHAXL`` fed by ``RelPosEncXL``), loaded into attnkit.

SpeechBrain's module computes Transformer-XL's relative attention with four differences from
attnkit's defaults, each mapped:

* **The encoding is symmetric.** ``RelPosEncXL`` (every release to 1.1.x) fills the rows of the
  negative distances with the sines of the positive ones: the row of distance ``d`` is
  ``r(|d|)``, so the position term cannot tell a key ``d`` frames before the query from one ``d``
  frames after it. attnkit reproduces it with ``encoding="symmetric"``; a model trained with an
  encoding that keeps the sign (``RelPosEncXL`` fixed, as proposed upstream) loads with
  ``encoding="signed"``.
* **The scale** is ``1/sqrt(d_model)``, not ``1/sqrt(head_dim)``: attnkit's ``scale=``.
* **The packed projection.** ``in_proj_weight`` ``(3 E, E)`` is read, on SpeechBrain's
  self-attention path, per head as ``[q | k | v]`` blocks of ``head_dim`` rows; q and k have no
  bias, v has ``value_bias_weight`` when built with ``vbias=True``.
* **u and v** are stored ``(head_dim, H)`` and read as ``(H, head_dim)`` (a reshape of the same
  memory, not a transpose).

=====================================================  ==========================================
SpeechBrain ``RelPosMHAXL``                            attnkit ``RelativeMultiHeadAttention``
=====================================================  ==========================================
``in_proj_weight.view(H, 3, dh, E)[:, 0].reshape(E, E)``  ``q_proj.weight`` (bias 0)
``in_proj_weight.view(H, 3, dh, E)[:, 1].reshape(E, E)``  ``k_proj.weight`` (bias 0)
``in_proj_weight.view(H, 3, dh, E)[:, 2].reshape(E, E)``  ``v_proj.weight``
``value_bias_weight`` (or 0)                           ``v_proj.bias``
``out_proj``                                           ``out_proj``
``linear_pos.weight``                                  ``pos_proj.weight``: columns ``0, 2, 4, ...``
                                                       then ``1, 3, 5, ...``
``pos_bias_u.reshape(H, dh)``, ``pos_bias_v...``       ``pos_bias_u``, ``pos_bias_v``
``scale`` (``1/sqrt(E)``)                              ``scale=``
``RelPosEncXL``                                        ``encoding="symmetric"``
``dropout_att.p``                                      ``dropout``
=====================================================  ==========================================

What is not reproduced: SpeechBrain reads ``in_proj_weight`` differently (three ``(E, E)``
blocks) when the key is not the query, a path whose relative shift assumes as many keys as
queries anyway; the result reproduces the self-attention path, the one its Conformer takes.
``mask_pos_future`` needs nothing: SpeechBrain zeroes the position term above the diagonal before
cropping the shifted product to the keys, so on self-attention it changes nothing. SpeechBrain
computes its table in float32 and the softmax in float32 (a float64 ``RelPosMHAXL`` fails in its
own matmul); the loaded module computes the table as SpeechBrain does (``encoding_dtype``) and
everything else in its parameters' dtype.

The mask: SpeechBrain's ``key_padding_mask`` ``(B, S)`` is True = padding: pass
``~key_padding_mask[:, None, None, :]``. Its boolean ``attn_mask`` is True = blocked: pass
``~attn_mask``. A fully masked row gives 0 in both (SpeechBrain 1.0 and later).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from .._base.checks import present
from ..modules.relative import RelativeMultiHeadAttention
from . import _copy

__all__ = ["relative_attention"]


def relative_attention(
    module: nn.Module,
    *,
    encoding: Literal["symmetric", "signed"] = "symmetric",
    encoding_dtype: torch.dtype = torch.float32,
) -> RelativeMultiHeadAttention:
    """attnkit's copy of SpeechBrain's ``RelPosMHAXL`` (see the module docstring).

    ``encoding``: ``"symmetric"`` (default) for ``RelPosEncXL`` as SpeechBrain ships it;
    ``"signed"`` for a model trained with a relative encoding that keeps the sign of the distance.
    ``encoding_dtype``: float32 (default) for the table ``RelPosEncXL`` computes (since 1.0.1;
    1.0.0 computed it in the input's dtype from float32 frequencies), float64 for the exact
    sinusoids.
    """
    who = "speechbrain.relative_attention()"
    if not isinstance(module, nn.Module):
        raise TypeError(f"{who} takes an nn.Module, got {type(module).__name__}")
    kind = type(module).__name__
    if kind != "RelPosMHAXL":
        raise TypeError(f"{who} takes SpeechBrain's RelPosMHAXL, got {kind}")
    if encoding not in ("symmetric", "signed"):
        raise ValueError(f"encoding must be 'symmetric' or 'signed', got {encoding!r}")
    if getattr(module, "in_proj_weight", None) is None:
        raise ValueError(
            f"{who}: RelPosMHAXL without in_proj_weight (vdim != embed_dim) raises "
            "NotImplementedError in SpeechBrain's own forward"
        )
    packed = _copy.tensor(module, "in_proj_weight", who)
    heads = _copy.integer(module, "num_heads", who)
    d_model = _copy.integer(module, "embed_dim", who)
    if d_model % 2:
        raise ValueError(f"{who}: d_model must be even for a sinusoidal table, got {d_model}")
    if d_model % heads:
        raise ValueError(f"{who}: embed_dim ({d_model}) must be divisible by num_heads ({heads})")
    head_dim = d_model // heads
    if tuple(packed.shape) != (3 * d_model, d_model):
        raise ValueError(
            f"{who}: in_proj_weight is {tuple(packed.shape)}, expected (3 * embed_dim, embed_dim) "
            f"= {(3 * d_model, d_model)}"
        )
    out_proj = _copy.part(module, "out_proj", nn.Linear, who)
    linear_pos = _copy.part(module, "linear_pos", nn.Linear, who)
    if linear_pos.bias is not None:
        raise ValueError(f"{who}: linear_pos has a bias; attnkit's pos_proj has none")
    scale = getattr(module, "scale", 1.0 / math.sqrt(d_model))
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{who} needs RelPosMHAXL.scale to be a float, got {scale!r}")
    new = RelativeMultiHeadAttention(
        d_model,
        heads,
        dropout=_copy.dropout_p(module, "dropout_att"),
        proj_bias=True,
        encoding=encoding,
        encoding_dtype=encoding_dtype,
        scale=float(scale),
        device=packed.device,
        dtype=packed.dtype,
    )
    q, k, v = packed.reshape(heads, 3, head_dim, d_model).unbind(1)  # each (H, dh, E)
    for name, w, linear in (("q", q, new.q_proj), ("k", k, new.k_proj), ("v", v, new.v_proj)):
        _copy.copy(linear.weight, w.reshape(d_model, d_model), f"in_proj_weight ({name} rows)", who)
        with torch.no_grad():
            present(linear.bias, "proj bias").zero_()
    value_bias = getattr(module, "value_bias_weight", None)
    if getattr(module, "vbias", None) is not None and isinstance(value_bias, Tensor):
        _copy.copy(present(new.v_proj.bias, "v bias"), value_bias, "value_bias_weight", who)
    _copy.copy_linear(new.out_proj, out_proj, "out_proj", who)
    pos = linear_pos.weight[:, _copy.halves_from_interleaved(d_model).to(packed.device)]
    _copy.copy_linear(new.pos_proj, linear_pos, "linear_pos", who, weight=pos)
    for name in ("pos_bias_u", "pos_bias_v"):
        stored = _copy.tensor(module, name, who)
        if stored.numel() != d_model:
            raise ValueError(
                f"{who}: {name} is {tuple(stored.shape)}, expected (head_dim, num_heads) = "
                f"{(head_dim, heads)}"
            )
        # SpeechBrain reads the (dh, H) parameter as .view(H, dh): the same memory, reshaped.
        _copy.copy(getattr(new, name), stored.reshape(heads, head_dim), name, who)
    return new.train(module.training)
