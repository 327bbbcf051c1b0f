"""The kernel on a KV cache read in place: each row's keys a stretch of a contiguous cache, or of
pages through a block table, and its queries aligned bottom-right to the end of that stretch.

This is what a decoding server asks: flash-attn's ``flash_attn_with_kvcache`` (``cache_seqlens``,
``cache_leftpad``, ``cache_batch_idx``, ``block_table``), its paged ``flash_attn_varlen_func``,
vLLM's paged attention. The native kernel's ``native_cache_forward`` reads the keys and values
where they are (no gather of pages, no slice of rows), on its decode path (split across threads by
keys, each key/value head read once for all its query heads); :func:`cache_refusal` says when it
cannot serve such a call, and the caller then gathers the rows and calls
:func:`attnkit.attention`.

The pages are ``(X, Hkv, page, D)`` tensors at any strides: flash-attn's ``(blocks, page, Hkv, D)``
cache is ``k_cache.permute(0, 2, 1, 3)``, vLLM's and Intel's ``(blocks, Hkv, page, D)`` is itself,
and a contiguous ``(B, Tk, Hkv, D)`` cache is one page of ``Tk`` keys per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .._native import load
from .._native.kernel import REDUCED
from ..masks import Geometry
from ..scores import DistanceBias, softcap_form
from .choice import refusal
from .sinks import finish

__all__ = ["IN_PLACE", "cache_attention", "cache_refusal"]

#: What :func:`attnkit.record_dispatch` says served a cache call that the native kernel read in
#: place (:attr:`attnkit.Dispatch.chosen`): such a call is not dispatched to a backend.
IN_PLACE = "native kernel, the cache read in place"

_CACHE_DTYPES = (torch.float32, torch.float64, *REDUCED)


def cache_refusal(q: Tensor, k: Tensor, v: Tensor, *others: Tensor | None) -> str | None:
    """None when the native kernel reads a cache call of queries ``q`` and pages ``k``, ``v`` in
    place, else why not: CPU tensors of one dtype (float32 or float64; bfloat16 or float16, whose
    keys and values it reads as they are, computing in float32), no gradient asked of them or
    of the call's ``others`` (the kernel has no backward for pages), no autocast, not while
    torch.compile traces, and the kernel available (built on first use)."""
    why = refusal(
        native=True,
        device=q.device,
        term=None,
        score_mod=False,
        finite=None,
        geo=None,
        build=True,
    )
    if why is not None:
        return why
    if q.dtype not in _CACHE_DTYPES or not q.dtype == k.dtype == v.dtype:
        dtypes = ", ".join(str(t.dtype).removeprefix("torch.") for t in (q, k, v))
        return (
            "the native kernel reads caches of q, k and v of one dtype (float32, float64, "
            f"bfloat16 or float16), got {dtypes}"
        )
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, *others)
    ):
        return "gradients are asked (the native kernel reads caches for inference only)"
    if torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling():
        return "autocast or torch.compile (the native kernel reads caches in eager inference)"
    return None


def _int64(x: Tensor | Sequence[Sequence[int]]) -> Tensor:
    t = x if isinstance(x, Tensor) else torch.tensor(x, dtype=torch.int64)
    return t.to(torch.int64).contiguous()


def cache_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    kv_range: Tensor | Sequence[Sequence[int]],
    block_table: Tensor | None = None,
    q_range: Tensor | Sequence[Sequence[int]] | None = None,
    band: tuple[float, float] | None = None,
    scale: float,
    softcap: float | None = None,
    bias: DistanceBias | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of each row's queries to its stretch of a cache, read in place.

    Args:
        q: ``(N, H, Tq, Dk)``, rows contiguous (any other strides); or with ``q_range`` the packed
            queries of all rows, ``(1, H, total_q, Dk)``.
        k, v: the pages ``(X, Hkv, page, Dk|Dv)`` (see the module's docstring), in q's dtype;
            bfloat16 and float16 pages are read as they are, the products computed in float32.
        kv_range: ``(N, 2)`` integers: row ``n`` attends the keys ``kv_range[n, 0] <= j <
            kv_range[n, 1]`` of its pages, its queries aligned to the end: query ``i`` of ``Tq``
            sits at key position ``kv_range[n, 1] - Tq + i``.
        block_table: ``(N, pages)`` integers: row ``n``'s key ``j`` is row ``j % page`` of page
            ``block_table[n, j // page]``; None: row ``n``'s keys are page ``n``. Only the pages
            of a row's keys are read (and must exist).
        q_range: ``(N, 2)`` integers: row ``n``'s queries are ``q_range[n, 1]`` queries from
            ``q_range[n, 0]`` of the packed ``q``, in order, not overlapping.
        band: ``(lo, hi)``: query ``i`` sees key ``j`` iff ``lo <= j - p_i <= hi``, ``p_i`` its key
            position (``-inf`` or ``inf`` for no bound); None: every key of the row.
        scale: multiplies ``q k^T``; ``softcap``: ``softcap * tanh(s / softcap)`` of the scaled
            scores; ``bias``: a bias by distance from each query's key position (ALiBi); its
            table must hold the distances of the longest row; ``sinks``: ``(H,)`` logits.

    Returns:
        ``(out, lse)``: ``(N, H, Tq, Dv)`` laid out as q (a view of ``(N, Tq, H, Dv)`` memory when
        q is token-major) in q's dtype, and the natural-log log-sum-exp ``(N, H, Tq)`` in the one
        it is computed in (q's, at least float32); a query that sees no key gets 0 and ``-inf``.
    """
    if not load():
        raise RuntimeError("attnkit internal error: a cache call without the native kernel")
    nq, h, tq, dk = q.shape
    hkv = k.size(1)
    ranges = _int64(kv_range)
    packed = None if q_range is None else _int64(q_range)
    table = None if block_table is None else _int64(block_table)
    rows = ranges.size(0)
    q_len = tq if packed is None else int(packed[:, 1].max()) if rows else 0
    kv_len = int(ranges[:, 1].max()) if rows else 0
    work = torch.promote_types(q.dtype, torch.float32)
    q5 = q.reshape(nq, hkv, h // hkv, tq, dk).to(work)
    if q5.stride(-1) != 1:
        q5 = q5.contiguous()
    bias_table, layout = None, []
    if bias is not None:
        geo = Geometry((rows,), h, q_len, kv_len, q.device)
        layout = bias.layout(geo, h // hkv)
        bias_table = bias.table.to(work).contiguous()
    form = None if softcap is None else softcap_form(softcap, q.dtype)
    out5, lse = torch.ops.attnkit.native_cache_forward(
        q5,
        k,
        v,
        table,
        ranges,
        packed,
        bias_table,
        None,
        scale=float(scale),
        softcap=0.0 if form is None else float(form.cap),
        bias_layout=layout,
        band=[] if band is None else [float(band[0]), float(band[1])],
    )
    if sinks is not None:
        out5, lse = finish(out5, lse, sinks.view(hkv, -1).to(work))
    return out5.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)
