"""The sdpa backend: torch's fused ``scaled_dot_product_attention``.

torch picks its own kernel (flash, memory-efficient, cuDNN or math) for the device and inputs; this
adapter translates attnkit's conventions, which differ from torch's in two places:

* ``causal=True`` is bottom-right aligned in attnkit and top-left in torch (they agree when
  ``Tq == Tk``), and torch refuses ``is_causal`` together with a mask. Both cases need an explicit
  ``(Tq, Tk)`` mask here, which is why the dispatcher prefers the chunked backend for them.
* attnkit's ``bias`` is torch's float ``attn_mask``; with a bool mask as well, the two are merged
  into one float tensor.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .._checks import AttentionCall
from ..masks import causal_mask


def causal_needs_mask(call: AttentionCall) -> bool:
    """True when ``causal`` cannot be passed to torch as ``is_causal`` and must become a mask."""
    if not call.causal or call.q_len <= 1:  # one query, bottom-right: it sees every key
        return False
    return call.q_len != call.kv_len or call.mask_shape is not None or call.bias_shape is not None


def sdpa(
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
) -> Tensor:
    tq, tk = q.size(-2), k.size(-2)
    # A branch, not `causal and tq > 1`: with symbolic lengths (torch.compile dynamic=True) that
    # expression is a SymBool, which torch's kernel refuses as is_causal; `if` guards on it.
    is_causal = False
    if causal and tq > 1:
        is_causal = True
    if is_causal and (tq != tk or mask is not None or bias is not None):
        c = causal_mask(tq, tk, device=q.device)
        mask = c if mask is None else mask & c
        is_causal = False
    attn_mask = mask
    if bias is not None:
        attn_mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
    if attn_mask is not None and attn_mask.ndim < 2:
        attn_mask = attn_mask.unsqueeze(0)  # torch wants (..., Tq|1, Tk); ours may be just (Tk,)
    if scale == 0.0:
        # torch's causal kernels scale their -inf too (0 * -inf = NaN, torch 2.13 CPU): zero
        # queries with scale 1 give the same all-zero scores and the same zero gradient of q.
        q, scale = q * 0.0, 1.0
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.size(-3) != k.size(-3),
    )
    if mask is not None and q.device.type != "cpu":
        # On CPU torch >= 2.5 returns 0 for a query with no visible key (its math and flash kernels
        # use a safe softmax); the CUDA kernels have differed between releases, so make sure.
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return out
