"""Weights in from openspeech: its Conformer's ``RelativeMultiHeadAttention``.

:func:`relative_attention` builds the attnkit module in ``legacy="openspeech"`` mode, which
reproduces openspeech's math, and copies the parameters. openspeech itself is never imported:
its module is read through attribute names.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._base.checks import shape_str
from ..modules.relative import RelativeMultiHeadAttention

__all__ = ["relative_attention"]

#: The function's name, as its errors give it.
WHO = "openspeech.relative_attention()"

#: The projections openspeech's module holds, by name.
PARTS = ("query_proj", "key_proj", "value_proj", "pos_proj", "out_proj")


def _linear_of(module: nn.Module, name: str) -> nn.Linear:
    """``module.<name>`` as an ``nn.Linear``, looking through openspeech's ``Linear`` wrapper."""
    part = getattr(module, name, None)
    inner = getattr(part, "linear", None)
    if isinstance(part, nn.Linear):
        return part
    if isinstance(inner, nn.Linear):
        return inner
    raise TypeError(
        f"{WHO} needs {type(module).__name__}.{name} to be an nn.Linear (or "
        f"openspeech's Linear wrapper around one), got {type(part).__name__}"
    )


def relative_attention(module: nn.Module) -> RelativeMultiHeadAttention:
    """A copy of openspeech's ``RelativeMultiHeadAttention``, in legacy mode.

    The result, called as ``m(x, mask=~os_mask.unsqueeze(1))``, returns what openspeech's
    module returns for ``(x, x, x, pos_embedding, os_mask)`` when ``pos_embedding`` is its
    Conformer's absolute ``PositionalEncoding`` of positions ``0..T-1``, to float64 rounding
    (``os_mask``: openspeech's ``(B, 1, T)`` or ``(B, T, T)``, True = blocked). It reproduces,
    on purpose:

    * the encoding: absolute positions (not distances), sin and cos interleaved, computed in
      float32 as openspeech does;
    * the pad-and-reshape shift of the position scores, which is a true relative shift only on
      and below the diagonal: above it, query ``i`` gets 0 at key ``i + 1`` and scores made
      from query ``i + 1`` further right;
    * the scale ``1/sqrt(d_model)`` instead of ``1/sqrt(head_dim)``;
    * dropout on the weights with openspeech's probability.

    What is *not* translated: the mask stays attnkit's (True = may attend), so pass the
    inverse of an openspeech mask. Masked scores are excluded (``-inf``) where openspeech fills
    ``-1e4``; outputs agree wherever a query has a visible key. A query with no visible key
    gets 0 here, and openspeech's uniform average of every value there. Self-attention only,
    as in openspeech.

    ``module`` needs openspeech's attributes: ``query_proj``, ``key_proj``, ``value_proj``,
    ``out_proj`` (``nn.Linear`` or openspeech's wrapper with ``.linear``), ``pos_proj`` (no
    bias), ``u_bias``, ``v_bias`` ``(num_heads, d_head)``, and ``num_heads``. The four other
    projections all have a bias or none has (a ``ValueError`` otherwise).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"{WHO} takes an nn.Module, got {type(module).__name__}")
    linears = {name: _linear_of(module, name) for name in PARTS}
    num_heads = getattr(module, "num_heads", None)
    u, v = getattr(module, "u_bias", None), getattr(module, "v_bias", None)
    if not isinstance(num_heads, int) or not isinstance(u, Tensor) or not isinstance(v, Tensor):
        raise TypeError(
            f"{WHO} needs num_heads (int), u_bias and v_bias (tensors) on "
            f"{type(module).__name__}, got num_heads={num_heads!r}, "
            f"u_bias={type(u).__name__}, v_bias={type(v).__name__}"
        )
    d_model = linears["query_proj"].in_features
    if linears["pos_proj"].bias is not None:
        raise ValueError(f"{WHO}: openspeech's pos_proj has no bias, this one does")
    # attnkit's proj_bias is one flag for the four: a bias on only some would be lost.
    with_bias = {name: linears[name].bias is not None for name in PARTS if name != "pos_proj"}
    if len(set(with_bias.values())) > 1:
        raise ValueError(f"{WHO}: only some projections have a bias: {with_bias}")
    has_bias = with_bias["query_proj"]
    dropout = getattr(module, "dropout", None)
    weight = linears["query_proj"].weight
    new = RelativeMultiHeadAttention(
        d_model,
        num_heads,
        dropout=dropout.p if isinstance(dropout, nn.Dropout) else 0.0,
        proj_bias=has_bias,
        legacy="openspeech",
        device=weight.device,
        dtype=weight.dtype,
    )
    ours = {
        "query_proj": new.q_proj,
        "key_proj": new.k_proj,
        "value_proj": new.v_proj,
        "pos_proj": new.pos_proj,
        "out_proj": new.out_proj,
    }
    with torch.no_grad():
        for name, linear in linears.items():
            target = ours[name]
            if linear.weight.shape != target.weight.shape:
                raise ValueError(
                    f"{WHO}: {name}.weight is {shape_str(linear.weight.shape)}, "
                    f"expected {shape_str(target.weight.shape)} for d_model={d_model}"
                )
            target.weight.copy_(linear.weight)
            if target.bias is not None and linear.bias is not None:
                if linear.bias.shape != target.bias.shape:  # copy_ would broadcast it
                    raise ValueError(
                        f"{WHO}: {name}.bias is {shape_str(linear.bias.shape)}, "
                        f"expected {shape_str(target.bias.shape)} for d_model={d_model}"
                    )
                target.bias.copy_(linear.bias)
        for name, src, dst in (("u_bias", u, new.pos_bias_u), ("v_bias", v, new.pos_bias_v)):
            if src.shape != dst.shape:
                raise ValueError(
                    f"{WHO}: {name} is {shape_str(src.shape)}, expected "
                    f"(num_heads, d_head) = {shape_str(dst.shape)}"
                )
            dst.copy_(src)
    new.train(module.training)
    return new
