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

An index mask on a cache (:func:`~attnkit.masks.key_indices`, :func:`~attnkit.masks.block_indices`:
DeepSeek V3.2's top-k selection decoding over a paged latent cache) is served by
:func:`indexed_cache_attention`: each query's selected keys are gathered through the block table
(key ``j`` of row ``n`` is row ``j % page`` of page ``block_table[n, j // page]``) into compact
``(N, C, Tq, W, D)`` keys and values, int8/float8 ones dequantized with their scales, and the
attention runs over them: O(Tq * W) time and memory, no ``(Tq, Tk)`` tensor and no read of the
keys no query selected. Inside a compiled graph the rows' positions are made by an operator of
their own, ``torch.ops.attnkit.indexed_cache_rows``, which records the call for
:func:`attnkit.record_dispatch` when the graph runs (the dispatcher ran while tracing), as an
eager call records it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .._base.quantized import dequantize
from .._call import AttentionCall, check_attention_args
from .._native import load
from .._native.kernel import DECODE_QUERIES, REDUCED
from .._record import Dispatch, recording
from ..caches.view import CacheView
from ..masks import Geometry, Mask, decode, encode
from ..scores import DistanceBias, cap_scores, softcap_form
from .choice import refusal
from .gathered import Gathered, Selection, native_refusal, selection
from .sinks import finish

__all__ = [
    "IN_PLACE",
    "cache_attention",
    "cache_refusal",
    "in_place_refusal",
    "indexed_cache",
    "indexed_cache_attention",
    "read_cache",
]

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


# --------------------------------------------------------------------------------------------------
# Index masks on a cache: the selected keys gathered through the block table

#: Gathered keys and values (elements of both) a chunk of queries holds at most: a few tens of
#: MiB in float32, and at least one query a chunk.
_INDEXED_ELEMENTS = 1 << 23
#: The dtypes the native gathered kernel reads keys and values in (others: dequantized first).
_NATIVE_KV = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class IndexedCache:
    """A cache call whose index mask :func:`indexed_cache_attention` serves: its selection, the
    bands ANDed with it (``(lo, hi)`` over ``j - p_i``, each row's queries aligned to its end),
    whether the native gathered kernel attends the gathered keys (else torch's products), and
    the words ``explain()`` and ``record_dispatch()`` say."""

    found: Selection
    bands: tuple[tuple[float, float], ...]
    native: bool
    words: str


def _and_leaves(parts: Sequence[Mask]) -> list[Mask]:
    return [q for p in parts for q in (_and_leaves(p.parts) if p.op == "and" else [p])]


def indexed_cache(
    call: AttentionCall, native: bool = True, build: bool = False
) -> IndexedCache | str | None:
    """The :class:`IndexedCache` of a cache call whose mask holds an index mask, when
    :func:`indexed_cache_attention` serves it; else why not (the call then runs on each row's
    keys, gathered), or None for a call that is not on a cache or holds no index mask. A view
    whose rows share their keys as views of a contiguous cache is left to the dense call on
    those views (None), which gathers each query's keys there. ``native``: whether the backend
    may run the native kernel; ``build``: load it (building it on first use), as a call about
    to run does, or only ask whether it would be available, as questions do."""
    view = call.cache
    if view is None or call.mask is None:
        return None
    # (no share of Tk bounds it: the other way reads every key of every row)
    found = selection(call.mask, None, 0.0, sys.maxsize)
    if found is None or (call.dense_views is not None and view.shared):
        return None
    if isinstance(found, str):
        return f"index mask on a cache: {found}"
    if call.return_weights or call.dropout_p or call.score_mod is not None:
        return "index mask on a cache: weights, dropout or a score_mod ask for the whole rows"
    if call.bias_shape is not None or call.score_term is not None:
        return "index mask on a cache: a bias, which its gather does not add"
    selected = _selected_rows(call, found)
    if call.q_len > DECODE_QUERIES and selected > view.num_kv_heads * _held(view):
        return (
            f"index mask on a cache: its {call.q_len} queries select {selected} rows, more than "
            "its rows hold: each row's keys gathered once, each query's read there by position"
        )
    bands = []
    for part in _and_leaves(found.rest):
        band = part.band
        if band is None or band[2] != "bottom_right":
            return f"index mask on a cache: {part.describe()} is not a band of each row's keys"
        bands.append((band[0], band[1]))
    why = native_refusal(found, (call.dtype, call.dtype), None, call.device, native=native,
                         build=build)  # fmt: skip
    pages_grad = torch.is_grad_enabled() and (view.k.requires_grad or view.v.requires_grad)
    if why is None and (call.requires_grad or pages_grad):
        why = "gradients are asked (the native kernel attends the gathered keys for inference)"
    pages = "through the block table" if view.block_table is not None else "from the cache's rows"
    words = (
        f"index mask on a cache: each query's {found.width} selected keys gathered {pages}"
        + (", dequantized with their scales" if view.quantized else "")
        + " (O(Tq * k) time and memory), attended by "
        + ("the native kernel" if why is None else f"torch's products: {why}")
    )
    return IndexedCache(found, tuple(bands), why is None, words)


def _selected_rows(call: AttentionCall, found: Selection) -> int:
    """Rows of keys the gather of a call's selection copies: a query's ``W`` for each gathered
    head (``lcm(Hi, Hkv)``)."""
    heads = math.lcm(call.num_kv_heads, *(m.heads for m in found.covers))
    return call.batch_shape[0] * call.q_len * heads * found.width if call.batch_shape else 0


def _held(view: CacheView) -> int:
    """Keys the rows of a view hold, summed."""
    return sum(end - start for start, end in view.kv_range)


def indexed_cache_attention(
    call: AttentionCall, served: IndexedCache, q: Tensor, sinks: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``(out (N, H, Tq, Dv), lse (N, H, Tq))`` of a cache call :func:`indexed_cache` serves (q
    ``(N, H, Tq, Dk)``; ``lse`` in the work dtype, q's and at least float32), differentiable on
    torch's products (the native kernel's calls record no graph).

    Key positions are those of the call's keys (of the weights' columns): from a row's first
    key where every row shares its stretch, else from 0 of its pages. A query attends its
    selected keys that its row holds (``start <= j < end``; others are ignored, as keys the row
    does not have), that the bands let through from its position ``end - q_lens[n] + i``, each
    once. A query that attends none gets 0 and ``-inf`` (with sinks, the sink's log-sum-exp);
    a padding query 0 and ``-inf``."""
    view = call.cache
    if view is None:
        raise ValueError("attnkit internal error: an indexed cache call without its cache view")
    geo = Geometry((view.rows,), q.size(1), q.size(2), call.kv_len, q.device)
    plan = Gathered(served.found, geo, view.num_kv_heads, call.scale, call.softcap,
                    None, None, None, 0)  # fmt: skip
    work = torch.promote_types(q.dtype, torch.float32)
    if torch.compiler.is_compiling():  # (made when the graph runs, which records the call)
        rows = _RowPositions.traced(call, served, q, sinks)
    else:
        rows = _RowPositions.of(view, q.size(2), q.device)
    per_query = plan.c * plan.width * (view.k.size(-1) + view.v.size(-1)) * max(1, view.rows)
    step = max(1, _INDEXED_ELEMENTS // max(1, per_query))
    outs, lses = [], []
    for t0 in range(0, q.size(2), step):
        t1 = min(q.size(2), t0 + step)
        vis, keys = _visible(plan, served.bands, rows, t0, t1)  # (N, t, C, W)
        if served.native:  # float keys read as they are, the entries that do not count skipped
            k, v = _gather(view, keys, None, _native_dtype(view.k.dtype))
        else:
            k, v = _gather(view, keys, vis, work)
        run = _native_attend if served.native else _attend
        out, lse = run(call, q[:, :, t0:t1], k, v, vis)  # (N, H, t, Dv), (N, H, t)
        outs.append(out)
        lses.append(lse)
    return _finish(view, q, outs, lses, sinks, rows.real, work)


def _native_dtype(stored: torch.dtype) -> torch.dtype:
    return stored if stored in _NATIVE_KV else torch.float32


def _finish(
    view: CacheView,
    q: Tensor,
    outs: list[Tensor],
    lses: list[Tensor],
    sinks: Tensor | None,
    real: Tensor,
    work: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """The chunks' outputs and log-sum-exps put together, the sinks folded in (padding queries
    stay 0 and ``-inf``)."""
    n, h, tq = q.shape[:3]
    hkv, dv = view.num_kv_heads, view.v.size(-1)
    if tq:
        out5 = torch.cat(outs, 2).to(work).view(n, hkv, h // hkv, tq, dv)
        lse4 = torch.cat(lses, 2).to(work).view(n, hkv, h // hkv, tq)
    else:
        out5 = q.new_zeros(n, hkv, h // hkv, 0, dv, dtype=work)
        lse4 = q.new_zeros(n, hkv, h // hkv, 0, dtype=work)
    if sinks is not None:
        out5, lse4 = finish(out5, lse4, sinks.view(hkv, -1).to(work))
        padding = torch.arange(tq, device=q.device) >= real.view(-1, 1, 1, 1)
        lse4 = lse4.masked_fill(padding, -math.inf)
    return out5.reshape(n, h, tq, dv).to(q.dtype), lse4.reshape(n, h, tq)


@dataclass(frozen=True)
class _RowPositions:
    """Each row's keys and queries as ``(N, 1, 1, 1)`` tensors: ``base`` (the key position 0
    stands for: the shared stretch's start, else 0), ``start``, ``end``, and ``real`` (its real
    queries, aligned to ``end``)."""

    base: Tensor
    start: Tensor
    end: Tensor
    real: Tensor

    @classmethod
    def of(cls, view: CacheView, q_len: int, device: torch.device) -> _RowPositions:
        ranges = torch.tensor(view.kv_range, dtype=torch.long).view(-1, 2)
        real = torch.tensor(view.q_lens if view.q_lens is not None else [q_len] * view.rows)
        base = ranges[:, 0] if view.shared else torch.zeros_like(ranges[:, 0])
        return cls(*(t.to(device).view(-1, 1, 1, 1) for t in (base, *ranges.unbind(1), real)))

    @classmethod
    def unpacked(cls, table: Tensor) -> _RowPositions:
        """The positions of :func:`_positions`' ``(4, N)`` table."""
        return cls(*(t.view(-1, 1, 1, 1) for t in table.unbind(0)))

    @classmethod
    def traced(
        cls, call: AttentionCall, served: IndexedCache, q: Tensor, sinks: Tensor | None
    ) -> _RowPositions:
        """The positions as a node of a compiled graph, :func:`indexed_cache_rows`, which
        records the call when the graph runs (while tracing, the dispatcher records nothing)."""
        view = call.cache
        if view is None:
            raise ValueError("attnkit internal error: an indexed cache call without its view")
        tensors: list[Tensor] = []
        numbers: list[object] = []
        mask = encode(call.mask, tensors, numbers) or "null"
        table = torch.ops.attnkit.indexed_cache_rows(
            q, view.k, view.v, view.block_table, view.k_scale, view.v_scale, sinks, tensors,
            ranges=_flat(view.kv_range), q_lens=list(view.q_lens or ()), shared=view.shared,
            numbers=numbers, mask=mask, scale=float(call.scale),
            softcap=None if call.softcap is None else float(call.softcap), words=served.words,
        )  # fmt: skip
        return cls.unpacked(table)


def _flat(ranges: Sequence[tuple[int, int]]) -> list[int]:
    return [x for pair in ranges for x in pair]


def _positions(ranges: list[int], real: list[int], shared: bool, device: torch.device) -> Tensor:
    """``(4, N)`` int64: each row's base (its first key where the rows share their stretch,
    else 0), first key, end and real queries, from the rows' ``(start, end)`` pairs (flat), as
    :meth:`_RowPositions.of` makes them in eager calls."""
    pairs = torch.tensor(ranges, dtype=torch.long).view(-1, 2)
    base = pairs[:, 0] if shared else torch.zeros_like(pairs[:, 0])
    real_t = torch.tensor(real, dtype=torch.long).view(-1)
    return torch.stack([base, pairs[:, 0], pairs[:, 1], real_t]).to(device)


@torch.library.custom_op("attnkit::indexed_cache_rows", mutates_args=())
def indexed_cache_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_table: Tensor | None,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    sinks: Tensor | None,
    mask_tensors: list[Tensor],
    *,
    ranges: list[int],
    q_lens: list[int],
    shared: bool,
    numbers: list[int],
    mask: str,
    scale: float,
    softcap: float | None,
    words: str,
) -> Tensor:
    """The rows' positions of an index mask on a cache (``(4, N)`` int64: base, first key, end,
    real queries; see :func:`_positions`), as a compiled graph's node: when it runs under
    :func:`attnkit.record_dispatch` it records the call, as the chunked backend's, with the
    kernel that serves it (``words``, those an eager call records), as attnkit's operator
    does for the calls it serves. The call is the view of pages ``k``, ``v`` (its rows
    ``ranges``, flat ``(start, end)`` pairs; ``block_table``; ``q_lens``, empty for None; the
    scales) with the mask that :func:`attnkit.masks.encode` wrote as ``mask``."""
    record = recording()
    if record is not None:
        pairs = tuple(zip(ranges[::2], ranges[1::2], strict=True))
        view = CacheView(k, v, pairs, block_table, tuple(q_lens) if q_lens else None, k_scale,
                         v_scale, trusted=True)  # fmt: skip
        call = check_attention_args(
            q, view, None, mask=decode(mask, mask_tensors, numbers), bias=None, causal=False,
            scale=scale, softcap=softcap, sinks=sinks,
        )  # fmt: skip
        record.append(Dispatch(call, "chunked", kernel=words))
    real = q_lens or [q.size(-2)] * (len(ranges) // 2)
    return _positions(ranges, real, shared, q.device)


@indexed_cache_rows.register_fake
def _(q: Tensor, *args: object, ranges: list[int], **kwargs: object) -> Tensor:
    return q.new_empty((4, len(ranges) // 2), dtype=torch.long)


def _visible(
    plan: Gathered, bands: tuple[tuple[float, float], ...], rows: _RowPositions, t0: int, t1: int
) -> tuple[Tensor, Tensor]:
    """``(vis, keys)`` of queries ``t0:t1``, ``(N, t, C, W)`` each: whether each gathered entry
    counts (its first entry, a key its row holds, inside every band, a real query), and its
    key position in the row's pages (0 where it does not count: a key every row may read)."""
    n = rows.end.size(0)
    keys = plan.keys[:, :, t0:t1] + rows.base  # (N, Hs, t, W)
    first = plan.first[:, :, t0:t1]
    i = torch.arange(t0, t1, device=keys.device).view(1, 1, -1, 1)
    vis = first & (keys >= rows.start) & (keys < rows.end) & (i < rows.real)
    at = rows.end - rows.real + i  # each query's key position
    for lo, hi in bands:
        d = keys - at
        vis = vis & (d >= lo) & (d <= hi)
    vis = vis.expand(n, -1, -1, -1).repeat_interleave(plan.c // keys.size(1), 1).transpose(1, 2)
    keys = keys.expand(n, -1, -1, -1).repeat_interleave(plan.c // keys.size(1), 1).transpose(1, 2)
    return vis, torch.where(vis, keys, 0)


def _gather(
    view: CacheView, keys: Tensor, hide: Tensor | None, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """The keys and values at ``keys`` ``(N, t, C, W)`` (gathered head ``c`` reads key/value
    head ``c // (C / Hkv)``), ``(N, t, C, W, Dk|Dv)`` in ``dtype``, read through the block table;
    0 where ``hide`` (the entries that do not count) is False, so that no masked NaN reaches a
    product. Values that are the keys' first columns (a latent cache) are read with them."""
    n, _, c, _ = keys.shape
    page = view.page_size
    if view.block_table is None:
        pages = torch.arange(n, device=keys.device).view(-1, 1, 1, 1).expand_as(keys)
    else:
        table = view.block_table.to(keys.device).long()
        col = (keys // page).clamp_max(table.size(1) - 1)
        pages = table.gather(1, col.flatten(1)).view_as(keys)
        if hide is not None:
            pages = torch.where(hide, pages, 0)
        else:  # (the table's entries past a row's pages are never read, whatever they hold)
            pages = pages.clamp(0, view.k.size(0) - 1)
    heads = (torch.arange(c, device=keys.device) // (c // view.num_kv_heads)).view(1, 1, -1, 1)
    at = (pages, heads, keys % page)

    def read(pool: Tensor, scale: Tensor | None) -> Tensor:
        raw = _rows_at(pool, at)
        got = raw.to(dtype) if scale is None else dequantize(raw, scale[at], dtype)
        return got if hide is None else got.masked_fill_(~hide.unsqueeze(-1), 0.0)

    k = read(view.k, view.k_scale)
    dv = view.v.size(-1)
    prefix = _same(view.v, view.k) and _same(view.v_scale, view.k_scale)
    return k, (k[..., :dv] if prefix else read(view.v, view.v_scale))


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    """Whether ``a`` starts where ``b`` does, at its strides (the values of a latent cache: the
    keys' first columns, read with the keys' scales)."""
    if a is None or b is None:
        return a is b
    if torch.compiler.is_compiling():
        # (torch.compile cannot compare the data pointers of tensors that differ: the graph
        # would break, in a loop, and the whole call would run uncompiled; the values are then
        # read on their own, the same numbers)
        return False
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


def _rows_at(pool: Tensor, at: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """``pool[at]`` ``(..., D)`` of pages ``(X, Hkv, page, D)`` at any strides, as one
    ``index_select`` of rows: the pages seen as rows of ``D`` a step of ``e`` elements apart (the
    greatest common divisor of the strides), so each selected row is one copy of ``D`` values."""
    strides = [s for s in pool.stride()[:3] if s]
    e = math.gcd(*strides) if strides else 1
    extent = sum((n - 1) * s for n, s in zip(pool.shape[:3], pool.stride()[:3], strict=True))
    rows = pool.as_strided((extent // e + 1, pool.size(-1)), (e, pool.stride(-1)))
    ids = (at[0] * pool.stride(0) + at[1] * pool.stride(1) + at[2] * pool.stride(2)) // e
    shape = torch.broadcast_shapes(*(i.shape for i in at))
    flat = ids.expand(shape).reshape(-1)
    if pool.element_size() == 1:  # (int8 and float8 read as their bytes: no float8 kernel)
        got = rows.view(torch.uint8).index_select(0, flat).view(pool.dtype)
    else:  # (differentiable: pages that need gradients get them)
        got = rows.index_select(0, flat)
    return got.view(*shape, pool.size(-1))


def _attend(
    call: AttentionCall, q: Tensor, k: Tensor, v: Tensor, vis: Tensor
) -> tuple[Tensor, Tensor]:
    """``(out (N, H, t, Dv), lse (N, H, t))`` in the work dtype of queries ``q`` ``(N, H, t,
    Dk)`` over their gathered keys and values ``(N, t, C, W, D)``, without sinks, by torch's
    products (differentiable)."""
    n, h, t, dk = q.shape
    c = k.size(2)
    work = k.dtype
    q5 = q.reshape(n, c, h // c, t, dk).permute(0, 3, 1, 2, 4).to(work)  # (N, t, C, G', Dk)
    s = (q5 @ k.transpose(-1, -2)) * call.scale  # (N, t, C, G', W)
    if call.softcap is not None:
        s = cap_scores(s, call.softcap)
    s = s.masked_fill(~vis.unsqueeze(-2), -math.inf)
    top = s.amax(-1, keepdim=True)
    top = top.masked_fill(top == -math.inf, 0.0)  # a query with no key: weights 0
    p = (s - top).exp()
    total = p.sum(-1)
    tiny = torch.finfo(work).tiny
    out = (p @ v) / total.clamp_min(tiny).unsqueeze(-1)  # (N, t, C, G', Dv)
    lse = torch.where(total > 0, top.squeeze(-1) + total.clamp_min(tiny).log(), -math.inf)
    return out.permute(0, 2, 3, 1, 4).reshape(n, h, t, -1), lse.permute(0, 2, 3, 1).reshape(n, h, t)


def _native_attend(
    call: AttentionCall, q: Tensor, k: Tensor, v: Tensor, vis: Tensor
) -> tuple[Tensor, Tensor]:
    """:func:`_attend` by the native gathered kernel (float32 outputs; no graph): each query a
    batch row of its own, whose keys are its gathered ``W`` (those that count, in order)."""
    n, h, t, dk = q.shape
    c, w, dv = k.size(2), k.size(3), v.size(-1)
    local = torch.where(vis, torch.arange(w, device=vis.device), -1).sort(-1).values
    form = None if call.softcap is None else softcap_form(call.softcap, torch.float32)
    k4 = k.reshape(n * t, c, w, dk)
    # Values that are the keys' first Dv columns (a latent cache): the kernel reads the keys' rows
    # whole, rather than a copy of their first columns, and the output's first Dv are kept.
    prefix = _same(v, k)
    out, lse = torch.ops.attnkit.gathered_forward(
        q.transpose(1, 2).reshape(n * t, h, 1, dk).float(),
        k4,
        k4 if prefix else v.reshape(n * t, c, w, dv),
        local.reshape(n * t, c, 1, w),
        None,
        scale=float(call.scale),
        softcap=0.0 if form is None else float(form.cap),
        band=[],
    )
    out = out.reshape(n, t, h, -1)[..., :dv].transpose(1, 2)
    return out, lse.reshape(n, t, h).transpose(1, 2)
