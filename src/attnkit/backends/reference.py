"""The reference backend: attention as the formula reads. Every other backend is tested against it.

It materialises the ``(..., H, Tq, Tk)`` scores, so it is the slow path, and the only backend that
returns the attention weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..masks import causal_mask


def reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None,
    bias: Tensor | None,
    causal: bool,
    scale: float,
    dropout_p: float,
    return_weights: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    # float16/bfloat16 run in float32; float64 stays float64 (it is the spec the tests compare to).
    work = torch.promote_types(q.dtype, torch.float32)
    groups = q.size(-3) // k.size(-3)
    qg = q.to(work).unflatten(-3, (-1, groups))  # (..., Hkv, G, Tq, Dk): GQA without copying k, v
    kg = k.to(work).unsqueeze(-3)  # (..., Hkv, 1, Tk, Dk)
    vg = v.to(work).unsqueeze(-3)  # (..., Hkv, 1, Tk, Dv)

    s = (qg @ kg.transpose(-1, -2) * scale).flatten(-4, -3)  # (..., H, Tq, Tk)
    if bias is not None:
        s = s + bias
    if causal:
        mask = causal_mask(q.size(-2), k.size(-2), device=q.device) & (
            True if mask is None else mask
        )
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    # A row with no key to attend would be softmax(-inf, ..., -inf) = NaN: give it weights 0.
    empty = (s == float("-inf")).all(-1, keepdim=True)  # (..., H, Tq, 1)
    w = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)  # (..., H, Tq, Tk)

    p = F.dropout(w, dropout_p) if dropout_p else w
    out: Tensor = (p.unflatten(-3, (-1, groups)) @ vg).flatten(-4, -3)  # (..., H, Tq, Dv)
    if return_weights:
        return out.to(q.dtype), w.to(q.dtype)
    return out.to(q.dtype)
