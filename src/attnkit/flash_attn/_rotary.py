"""flash-attn's rotary embedding of the KV-cache call: ``rotary_cos``/``rotary_sin`` tables, pairs
interleaved (GPT-J) or split in halves (GPT-NeoX), at the positions each row writes."""

from __future__ import annotations

import torch
from torch import Tensor

from .._base.checks import dtype_str, shape_str
from ..caches._quantize import FLOAT8

__all__ = ["check_rotary", "rotate"]


def rotate(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """``x`` ``(B, T, H, D)`` with its first ``2 * cos.size(-1)`` dims rotated at ``positions``
    ``(B, T)``: pairs ``(2i, 2i + 1)`` when ``interleaved`` (GPT-J), else ``(i, i + d/2)``
    (GPT-NeoX). Computed in float32 at least and rounded once to ``x``'s dtype, as flash-attn's
    kernel does: rounding a half-precision product and sum each would move about a third of the
    rotated values by one step."""
    half = cos.size(-1)
    # (float8 promotes with no dtype and has no indexing kernel: float8 keys and tables are
    # read in float32, and the rotated keys go back to the format saturating, as flash-attn 3
    # stores its float8 keys)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    if cos.dtype in FLOAT8:
        cos, sin = cos.float(), sin.float()
    c = cos[positions].unsqueeze(2).to(work)  # (B, T, 1, half)
    s = sin[positions].unsqueeze(2).to(work)
    part, rest = x[..., : 2 * half].to(work), x[..., 2 * half :]
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]
        turned = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = part[..., :half], part[..., half:]
        turned = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    if x.dtype in FLOAT8:
        top = torch.finfo(x.dtype).max
        return torch.cat((turned.clamp(-top, top).to(x.dtype), rest), dim=-1)
    return torch.cat((turned.to(x.dtype), rest), dim=-1)


def _rotary_table(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor) or not t.is_floating_point():
        got = dtype_str(t.dtype) if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{name} must be a float tensor (seqlen_ro, rotary_dim / 2), got {got}")
    if t.ndim != 2:
        raise ValueError(
            f"{name} must be (seqlen_ro, rotary_dim / 2), got shape {shape_str(t.shape)}"
        )
    return t


def check_rotary(cos: object, sin: object, head_dim: int, reach: int) -> tuple[Tensor, Tensor]:
    """``rotary_cos`` and ``rotary_sin``: float ``(seqlen_ro, rotary_dim / 2)`` tables of at least
    ``reach`` positions, with ``rotary_dim`` at most ``head_dim``."""
    cos = _rotary_table("rotary_cos", cos)
    sin = _rotary_table("rotary_sin", sin)
    if sin.shape != cos.shape:
        raise ValueError(
            f"rotary_sin {shape_str(sin.shape)} must have rotary_cos's shape {shape_str(cos.shape)}"
        )
    half = cos.size(1)
    if 2 * half > head_dim:
        raise ValueError(
            f"rotary_cos has {half} columns (rotary_dim / 2) and so rotates {2 * half} dims, more "
            f"than the headdim of {head_dim}: it may have at most {head_dim // 2} columns, got "
            f"shape {shape_str(cos.shape)}"
        )
    if reach > cos.size(0):
        raise ValueError(
            f"rotary_cos has {cos.size(0)} positions, fewer than the {reach} this call reaches "
            "(cache_seqlens plus the new tokens, and the queries' positions)"
        )
    return cos, sin
