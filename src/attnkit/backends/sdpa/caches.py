"""A KV cache view (``attention(q, view)``) on GPUs: one fused call.

Row ``n`` of the cache attends its keys ``start_n <= j < end_n``, its queries aligned to the end of
that stretch. torch's kernel takes one key length for every row, so the call reads every row's
first ``Tk`` positions under a bool mask ``(N, 1, Tq, Tk)`` that says each row's stretch and band:
views of a contiguous cache, nothing copied, or a paged cache's pages gathered in order. Both are
costs (the mask, the copy) that a GPU pays gladly where the alternative is attnkit's eager loop.
A contiguous cache whose rows all attend the same stretch (a batch decoding in step) is the dense
call on views of its rows, on every device: nothing to copy and no mask to write. On the CPU the
native kernel reads the other caches in place, and sdpa declines them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._base.checks import shape_str
from ..._base.devices import on_gpu
from ..._call import AttentionCall
from ...caches.view import CacheView, band_of

__all__ = ["cache_attention", "cache_cost", "cache_refusal", "dense_rows"]


def cache_refusal(call: AttentionCall) -> str | None:
    """Why sdpa does not read the call's cache view (None: it does, or the call has none)."""
    view = call.cache
    if view is None:
        return None
    if view.quantized:
        return "reads no int8/float8 cache view (chunked reads it in place, reference dequantizes)"
    if call.dense_views is not None:
        return None  # views of a contiguous cache's rows: the dense call, nothing copied
    if not on_gpu(call.device):
        return (
            f"reads a KV cache view on {call.device.type} only as views of a contiguous "
            "cache's rows that attend the same keys (chunked reads any cache in place there)"
        )
    if band_of(call.mask) is None:
        return "reads a cache under a band only (causal, sliding windows)"
    if call.bias_shape is not None or call.score_term is not None:
        return "adds no bias to a cache call"
    return None


def cache_cost(call: AttentionCall) -> list[str]:
    """The mask a cache call writes out (none when every row attends all its keys alike)."""
    view = call.cache
    if view is None or (view.shared and call.mask is None):
        return []
    size = shape_str((view.rows, 1, call.q_len, view.kv_len))
    costs = [f"would write each row's stretch of the cache out as a {size} bool mask"]
    if view.block_table is not None:
        keys = shape_str((view.rows, view.num_kv_heads, view.kv_len))
        costs.append(f"would gather the pages into dense keys and values {keys}")
    return costs


def dense_rows(view: CacheView) -> tuple[Tensor, Tensor]:
    """Every row's first ``Tk`` positions ``(N, Hkv, Tk, D)``: views of a contiguous cache, a
    paged cache's pages gathered in order (pages past a row's keys read as any, then masked)."""
    rows, length = view.rows, view.kv_len
    if view.block_table is None:
        return view.k[:rows, :, :length], view.v[:rows, :, :length]
    pages = view.block_table[:, : -(-length // view.page_size)].to(view.k.device).long()

    def read(t: Tensor) -> Tensor:  # (N, p, Hkv, page, D) -> (N, Hkv, p * page, D)
        return t[pages].transpose(1, 2).flatten(2, 3)[:, :, :length]

    return read(view.k), read(view.v)


def _visible(
    view: CacheView, band: tuple[float, float], q_len: int, device: torch.device
) -> Tensor:
    """Bool ``(N, 1, Tq, Tk)``: row ``n``'s query ``i`` (at key position ``end_n - Tq + i``) may
    attend key ``j`` iff ``start_n <= j < end_n`` and ``lo <= j - p_i <= hi``; its padding
    queries (past the view's ``q_lens``) none."""
    starts = torch.tensor([s for s, _ in view.kv_range], device=device)[:, None, None]
    ends = torch.tensor([e for _, e in view.kv_range], device=device)[:, None, None]
    i = torch.arange(q_len, device=device)[None, :, None]
    j = torch.arange(view.kv_len, device=device)[None, None, :]
    pos = ends - q_len + i
    if view.q_lens is not None:  # a row's real queries are its first q_lens[n], at its end
        counts = torch.tensor(view.q_lens, device=device)[:, None, None]
        pos = ends - counts + i
    seen = (j >= starts) & (j < ends)
    lo, hi = band
    if lo != -math.inf:
        seen = seen & (j - pos >= lo)
    if hi != math.inf:
        seen = seen & (j - pos <= hi)
    if view.q_lens is not None:
        seen = seen & (i < counts)
    return seen.expand(-1, q_len, -1)[:, None]


def cache_attention(call: AttentionCall, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The call on its contiguous cache (``k``, ``v`` every row's first ``Tk`` positions, ``(N,
    Hkv, Tk, D)`` views of it): the output and the mask torch saw (for the non-finite screen)."""
    view, band = call.cache, band_of(call.mask)
    if view is None or band is None:
        raise RuntimeError("attnkit internal error: sdpa ran a cache call it declines")
    attn_mask = _visible(view, band, call.q_len, q.device)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=call.dropout_p,
        scale=call.scale,
        enable_gqa=True if q.size(-3) != k.size(-3) else False,  # noqa: SIM210 (a SymBool is refused)
    )
    # a query with no key (an empty stretch, a padding query) gives 0, whatever the kernel wrote
    return out.masked_fill(~attn_mask.any(-1, keepdim=True), 0.0), attn_mask
