"""The kernel on a KV cache read in place: each row's keys a stretch of a contiguous cache, or of
pages through a block table, and its queries aligned bottom-right to the end of that stretch.

This is what a decoding server asks: flash-attn's ``flash_attn_with_kvcache`` (``cache_seqlens``,
``cache_leftpad``, ``cache_batch_idx``, ``block_table``), its paged ``flash_attn_varlen_func``,
vLLM's paged attention. The native kernel's ``native_cache_forward`` reads the keys and values
where they are (no gather of pages, no slice of rows), on its decode path (split across threads by
keys, each key/value head read once for all its query heads). A cache call reaches it through
:func:`attnkit.attention` with a :class:`~attnkit.caches.view.CacheView`: the ``chunked`` backend
asks :func:`in_place_refusal` and reads the cache with :func:`read_cache`, or else gathers the
rows' keys for its dense kernel.

The pages are ``(X, Hkv, page, D)`` tensors at any strides: flash-attn's ``(blocks, page, Hkv, D)``
cache is ``k_cache.permute(0, 2, 1, 3)``, vLLM's and Intel's ``(blocks, Hkv, page, D)`` is itself,
and a contiguous ``(B, Tk, Hkv, D)`` cache is one page of ``Tk`` keys per row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .._native import load
from .._native.kernel import DECODE_QUERIES, REDUCED
from ..masks import Geometry
from ..scores import DistanceBias, softcap_form
from .choice import refusal
from .sinks import finish

__all__ = ["IN_PLACE", "cache_attention", "cache_refusal", "in_place_refusal", "read_cache"]

#: The kernel :func:`attnkit.record_dispatch` names (:attr:`attnkit.Dispatch.kernel`) for a cache
#: call that the chunked backend served by reading the cache in place.
IN_PLACE = "native kernel, the cache read in place"

_CACHE_DTYPES = (torch.float32, torch.float64, *REDUCED)


def cache_refusal(q: Tensor, k: Tensor, v: Tensor, *others: Tensor | None) -> str | None:
    """None when the native kernel reads a cache call of queries ``q`` and pages ``k``, ``v`` in
    place, else why not: CPU tensors of one dtype (float32 or float64; bfloat16 or float16, whose
    keys and values it reads as they are, computing in float32), no gradient asked of them or
    of the call's ``others`` (the kernel has no backward for pages), no autocast, not while
    torch.compile traces, and the kernel available (built on first use)."""
    if not q.dtype == k.dtype == v.dtype:
        dtypes = ", ".join(str(t.dtype).removeprefix("torch.") for t in (q, k, v))
        return (
            "the native kernel reads caches of q, k and v of one dtype (float32, float64, "
            f"bfloat16 or float16), got {dtypes}"
        )
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, *others)
    )
    return in_place_refusal(
        device=q.device, dtype=q.dtype, requires_grad=grad, q_len=q.size(-2), shared_rows=False
    )


def _int64(x: Tensor | Sequence[Sequence[int]]) -> Tensor:
    if not isinstance(x, Tensor):
        return torch.tensor(x, dtype=torch.int64)
    return x if x.dtype == torch.int64 and x.is_contiguous() else x.to(torch.int64).contiguous()


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
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
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
        k_scale, v_scale: for int8/float8 pages (q then float32, bfloat16 or float16), their
            float32 scales ``(X, Hkv, page)`` at any strides (a scale per head: stride 0 along
            the page): key ``j`` of a page is ``k[..., j, :] * k_scale[..., j]``, dequantized in
            registers.

    Returns:
        ``(out, lse)``: ``(N, H, Tq, Dv)`` laid out as q (a view of ``(N, Tq, H, Dv)`` memory when
        q is token-major) in q's dtype, and the natural-log log-sum-exp ``(N, H, Tq)`` in the one
        it is computed in (q's, at least float32); a query that sees no key gets 0 and ``-inf``.
    """
    if not load():
        raise RuntimeError("attnkit internal error: a cache call without the native kernel")
    nq, h, tq, dk = q.shape
    hkv = k.size(1)
    # (N, 2) also for N = 0: the pairs of no rows make a tensor of shape (0,)
    ranges = _int64(kv_range).view(-1, 2)
    packed = None if q_range is None else _int64(q_range).view(-1, 2)
    table = None if block_table is None else _int64(block_table)
    rows = ranges.size(0)
    if table is None and k.size(0) > rows:
        # Row n's keys are page n: a call of fewer rows than the cache holds (a batch that
        # shrank) reads its first pages, which the kernel takes as one page a row.
        k, v = k[:rows], v[:rows]
        k_scale = None if k_scale is None else k_scale[:rows]
        v_scale = None if v_scale is None else v_scale[:rows]
    work = torch.promote_types(q.dtype, torch.float32)
    q5 = q.reshape(nq, hkv, h // hkv, tq, dk).to(work)
    if q5.stride(-1) != 1 or (tq > 1 and q5.stride(-2) < dk):
        # (the kernel reads a row of Dk a query: queries expanded along Tq share their memory)
        q5 = q5.contiguous()
    bias_table, layout = None, []
    if bias is not None:  # (the lengths read from the host only here)
        q_len = tq if packed is None else int(packed[:, 1].max()) if rows else 0
        kv_len = int(ranges[:, 1].max()) if rows else 0
        stretch = int((ranges[:, 1] - ranges[:, 0]).max()) if rows else 0
        bias = _from_longest_end(bias, Geometry((rows,), h, q_len, stretch, q.device), kv_len)
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
        k_scale,
        v_scale,
        scale=float(scale),
        softcap=0.0 if form is None else float(form.cap),
        bias_layout=layout,
        band=[] if band is None else [float(band[0]), float(band[1])],
    )
    if sinks is not None:
        out5, lse = finish(out5, lse, sinks.view(hkv, -1).to(work))
    return out5.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


def _from_longest_end(bias: DistanceBias, rows: Geometry, kv_len: int) -> DistanceBias:
    """``bias`` checked against the distances the rows meet (``rows``: ``Tk`` the longest
    stretch of keys a row attends), as a table the kernel lays out from the longest end
    ``kv_len``: a row whose keys start after 0 (a window, left padding) meets no distance below
    ``-(end - start - 1)``, so a table built for its stretch is padded below, with entries no
    row reads."""
    bias.check(rows)
    lowest = -(kv_len - 1)
    if kv_len == 0 or bias.first <= lowest:
        return bias
    table = torch.nn.functional.pad(bias.table, (bias.first - lowest, 0))
    return DistanceBias(table, lowest)


def in_place_refusal(
    *,
    device: torch.device,
    dtype: torch.dtype,
    requires_grad: bool,
    q_len: int,
    shared_rows: bool,
    build: bool = True,
) -> str | None:
    """None when the native kernel reads a cache call in place, else why not: what
    :func:`cache_refusal` asks, of the call's description (``shared_rows``: every row one page of
    the same stretch of keys, which the blocked kernel runs faster as a prefill than the decode
    path reads it; ``build``: load the kernel, building it if needed, as a call about to run does,
    or only ask whether it would be available, as questions do)."""
    if shared_rows and q_len > DECODE_QUERIES:
        return "a prefill of rows that share their keys: the blocked kernel on the cache's rows"
    if torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling():
        return "autocast or torch.compile (the native kernel reads caches in eager inference)"
    why = refusal(
        native=True, device=device, term=None, score_mod=False, finite=None, geo=None, build=build
    )
    if why is not None:
        return why
    if dtype not in _CACHE_DTYPES:
        return (
            "the native kernel reads caches of one dtype (float32, float64, bfloat16 or "
            f"float16), got {str(dtype).removeprefix('torch.')}"
        )
    if requires_grad:
        return "gradients are asked (the native kernel reads caches for inference only)"
    return None


def read_cache(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    kv_range: Sequence[tuple[int, int]],
    block_table: Tensor | None,
    q_lens: Sequence[int] | None,
    band: tuple[float, float] | None,
    scale: float,
    softcap: float | None,
    bias: DistanceBias | None,
    sinks: Tensor | None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`cache_attention` on queries ``(N, H, Tq, Dk)`` of which row ``n``'s first
    ``q_lens[n]`` are real (all when None): ``(out (N, H, Tq, Dv), lse (N, H, Tq))``, 0 and
    ``-inf`` for the padding queries. ``k_scale``, ``v_scale``: int8/float8 pages' scales,
    float32 ``(X, Hkv, page, 1)`` as a :class:`~attnkit.caches.view.CacheView` holds them."""
    ranges = [list(r) for r in kv_range]
    kw = {"band": band, "scale": scale, "softcap": softcap, "bias": bias, "sinks": sinks}
    if k_scale is not None and v_scale is not None:
        kw["k_scale"], kw["v_scale"] = k_scale[..., 0], v_scale[..., 0]  # (X, Hkv, page) views
    if q_lens is None:
        return cache_attention(q, k, v, kv_range=ranges, block_table=block_table, **kw)  # type: ignore[arg-type]
    b, h, t, dk = q.shape
    # Rows of their own query counts: the queries of all rows packed as one row of N * Tq, row n's
    # from n * Tq on (a view when q's rows are evenly strided).
    flat = q.transpose(1, 2).reshape(1, b * t, h, dk).transpose(1, 2)
    out, lse = cache_attention(
        flat,
        k,
        v,
        kv_range=ranges,
        block_table=block_table,
        q_range=[[r * t, n] for r, n in enumerate(q_lens)],
        **kw,  # type: ignore[arg-type]
    )
    real = (torch.arange(t)[None, :] < torch.tensor(q_lens)[:, None]).to(q.device)  # (N, Tq)
    # (1, H, N * Tq, ...) -> (N, H, Tq, ...); the padding positions were never written.
    out = out[0].unflatten(1, (b, t)).transpose(0, 1)
    lse = lse[0].unflatten(1, (b, t)).transpose(0, 1)
    return (
        out.masked_fill(~real[:, None, :, None], 0.0),
        lse.masked_fill(~real[:, None, :], -math.inf),
    )
