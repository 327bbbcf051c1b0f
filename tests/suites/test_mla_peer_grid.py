"""The grids that FlashMLA's and vLLM's own tests run, restated through attnkit's API and checked
against the float64 formula written here (not against attnkit's reference backend).

FlashMLA (``tests/test_flash_mla_dense_decoding.py``, ``test_flash_mla_sparse_decoding.py``,
``test_flash_mla_sparse_prefill.py``) decodes ``s_q`` queries of ``h_q`` heads over a paged
latent cache: pages of 64 tokens of ``h_kv = 1`` head of ``d = 576`` numbers (``dv = 512``: the
values are the keys' first 512 columns), ``cache_seqlens`` of any length (0 included, and not a
multiple of the page), a shuffled block table whose entries past a row's pages are junk, NaN in
the slots past each row's length, causal over ``s_q > 1`` aligned to the row's end, the
log-sum-exp beside the output; its sparse kernels take ``indices`` ``(s_q, h_kv, topk)`` (``-1``
and out-of-range entries invalid, ``topk`` larger than the keys, a per-query ``topk_length``) and
an attention sink per head. vLLM's MLA and sparse-MLA backend tests run batches of rows of their
own lengths and query counts (``BATCH_SPECS``: ``seq_lens`` and ``query_lens``) over a paged
latent cache of pages of 64, with causal top-k indices padded with ``-1``, in bfloat16, float16
and an fp8 cache.

In attnkit each is one :func:`attnkit.attention` call of ``H`` query heads over ``Hkv`` latent
heads: a :class:`~attnkit.CacheView` of FlashMLA's own page pool (``(X, 64, Hkv, d)`` seen as
``(X, Hkv, 64, d)``; ``v`` the view ``k[..., :dv]``), a :class:`~attnkit.PagedKVCache` or
:class:`~attnkit.KVCache` holding the latents (``values_in_keys=True``, ``kv_dtype`` for int8
and float8), ``masks.key_indices`` for the selection, ``sinks=`` for the sink and
``return_lse=True``; and :class:`~attnkit.MultiHeadLatentAttention` decoding over those caches.
The differences of convention, each checked: the indices are positions in a row's own tokens
(FlashMLA's sparse decode takes slots of the pool); an entry past a row's length is ignored on a
cache and an entry outside the keys is refused in a dense call (FlashMLA ignores both); a query
with no key gets output 0 and log-sum-exp ``-inf`` (FlashMLA: ``+inf``); the log-sum-exp
includes the sink's share (FlashMLA's leaves it out); a ``+inf`` sink is refused. The sizes are
small (the latent 64 + 16 wide) except in the cases at FlashMLA's 576/512.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import attnkit
from attnkit import masks
from attnkit.caches.view import CacheView

F64 = torch.float64
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
D, DV = 80, 64  # the latent, shrunk: 64 values + 16 rotary numbers
PAGE = 64
JUNK = 2147480000  # what FlashMLA's tests write into the block table past a row's pages
#: (atol, rtol) of the output against the float64 formula of the same rounded inputs, and the
#: log-sum-exp's (which comes back in float32 for half-precision inputs)
TOL = {F64: (1e-12, 1e-12), F32: (2e-5, 2e-5), BF16: (2e-2, 2e-2), F16: (4e-3, 4e-3)}
LSE_TOL = {F64: 1e-12, F32: 2e-5, BF16: 2e-5, F16: 2e-5}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, g: torch.Generator, dtype: torch.dtype = F32) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=F64).to(dtype)


# --------------------------------------------------------------------------------------------------
# The formula, in float64


def formula(
    q: Tensor,
    k: Tensor,
    dv: int,
    allowed: Tensor,
    scale: float,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of ``q`` ``(B, H, Tq, Dk)`` over keys ``k`` ``(B, Hkv, S, Dk)`` whose
    values are their first ``dv`` columns; ``allowed`` broadcasts to ``(B, H, Tq, S)``; a sink
    per head is one more logit in each row's softmax, attending nothing. A query that sees no
    key (and no sink) gives 0 and ``-inf``."""
    k64 = k.double().repeat_interleave(q.size(1) // k.size(1), 1)
    s = (q.double() @ k64.mT * scale).masked_fill(~allowed, -math.inf)
    if sinks is not None:
        sink = sinks.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        s = torch.cat((s, sink), -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    return p @ k64[..., :dv], torch.logsumexp(s, -1)


def chosen(indices: Tensor, kv_len: int) -> Tensor:
    """``(B, Hi, Tq, kv_len)`` bool: the keys ``indices`` lists; ``-1`` and entries outside the
    keys select none, a repeat counts once."""
    idx = indices.long()
    out = torch.zeros(*idx.shape[:-1], kv_len + 1, dtype=torch.bool)
    inside = (idx >= 0) & (idx < kv_len)
    return out.scatter_(-1, idx.where(inside, kv_len), True)[..., :kv_len]


def end_causal(tq: int, kv_len: int) -> Tensor:
    """``(Tq, S)``: query ``i`` sees keys ``j <= i + S - Tq`` (aligned to the end)."""
    return torch.arange(kv_len)[None, :] <= torch.arange(tq)[:, None] + kv_len - tq


def check(
    out: Tensor, lse: Tensor | None, want: Tensor, want_lse: Tensor, dtype: torch.dtype
) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=rtol)
    if lse is None:
        return
    assert torch.equal(lse.isneginf(), want_lse.isneginf()), (lse, want_lse)
    finite = want_lse.isfinite()
    tol = LSE_TOL[dtype]
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=tol, rtol=tol)


# --------------------------------------------------------------------------------------------------
# FlashMLA's page pool, as its tests build it


class Pool:
    """FlashMLA's paged cache of ``lengths`` rows: ``blocked_k`` ``(X, 64, Hkv, d)`` pages handed
    out in a shuffled order, the block table's entries past each row's pages junk, NaN in every
    slot past a row's length and in the pages no row holds. ``view`` is attnkit's
    :class:`CacheView` of the same memory (values ``k[..., :dv]``); ``keys(b)`` row ``b``'s keys
    ``(1, Hkv, n, d)``, read by hand."""

    def __init__(
        self, lengths: list[int], heads: int, d: int, dv: int, dtype: torch.dtype, seed: int
    ) -> None:
        g = gen(seed)
        used = [-(-n // PAGE) for n in lengths]
        count = sum(used) + 2
        blocked = randn(count, PAGE, heads, d, g=g, dtype=dtype) / 3
        order = torch.randperm(count, generator=g)
        table = torch.full((len(lengths), max(used) + 1), JUNK, dtype=torch.int32)
        at = 0
        for b, (n, p) in enumerate(zip(lengths, used, strict=True)):
            table[b, :p] = order[at : at + p].int()
            at += p
            if n % PAGE:
                blocked[table[b, p - 1], n % PAGE :] = math.nan
        blocked[order[at:]] = math.nan
        self.lengths, self.table, self.used = lengths, table, used
        self.pages = blocked.transpose(1, 2)  # (X, Hkv, 64, d): a view, nothing copied
        self.view = CacheView(
            self.pages, self.pages[..., :dv], [(0, n) for n in lengths], self.table
        )

    def keys(self, b: int) -> Tensor:
        n, p = self.lengths[b], self.used[b]
        rows = self.pages[self.table[b, :p].long()]  # (p, Hkv, 64, d)
        return rows.transpose(0, 1).reshape(1, rows.size(1), p * PAGE, rows.size(-1))[:, :, :n]


def check_rows(
    pool: Pool,
    q: Tensor,
    out: Tensor,
    lse: Tensor,
    allowed: Any,
    scale: float,
    sinks: Tensor | None = None,
) -> None:
    """Each row of a call on ``pool.view`` against the formula on its own keys;
    ``allowed(b, n)`` is row ``b``'s ``(1, H|1, Tq, n)`` mask."""
    for b, n in enumerate(pool.lengths):
        row = slice(b, b + 1)
        want, want_lse = formula(q[row], pool.keys(b), out.size(-1), allowed(b, n), scale, sinks)
        check(out[row], lse[row], want, want_lse, q.dtype)


LENGTHS = [0, 1, 64, 65, 130]  # empty, one token, a page, past it, three pages


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q", [1, 2, 4])
@pytest.mark.parametrize(("dtype", "h_q", "h_kv"), [(BF16, 64, 1), (F16, 32, 1), (F32, 16, 2)])
def test_dense_decoding_over_flashmlas_page_pool(
    dtype: torch.dtype, h_q: int, h_kv: int, s_q: int, causal: bool
) -> None:
    # flash_mla_with_kvcache: rows of 0 to 130 tokens in one call; a row of none, and queries
    # that causal leaves without keys (s_q > the row's length), give 0 and -inf.
    pool = Pool(LENGTHS, h_kv, D, DV, dtype, seed=s_q + 10 * h_q)
    q = randn(len(LENGTHS), h_q, s_q, D, g=gen(1), dtype=dtype) / 3
    out, lse = attnkit.attention(q, pool.view, causal=causal, scale=0.3, return_lse=True)
    assert out.shape == (len(LENGTHS), h_q, s_q, DV)
    assert out.dtype == dtype

    def allowed(b: int, n: int) -> Tensor:
        return end_causal(s_q, n) if causal else torch.ones(s_q, n, dtype=torch.bool)

    check_rows(pool, q, out, lse, allowed, 0.3)
    assert not out[0].any()
    assert lse[0].isneginf().all()


def flashmla_selection(rows: int, s_q: int, topk: int, lengths: list[int], seed: int) -> Tensor:
    """``(rows, 1, s_q, topk)`` int32 positions as FlashMLA's sparse tests make them: each
    query's distinct keys in random order, ``-1`` padding where the row holds fewer than
    ``topk``, a ``topk_length`` (every entry past a query's own count ``-1``), a query with none,
    and entries past the row's own length (a batch's selection padded to its longest row)."""
    g = gen(seed)
    longest = max(lengths)
    idx = torch.full((rows, 1, s_q, topk), -1, dtype=torch.int32)
    for b in range(rows):
        for i in range(s_q):
            pick = torch.randperm(longest, generator=g)[:topk]
            idx[b, 0, i, : pick.numel()] = pick.int()
    idx[0, 0, -1, 3:] = -1  # topk_length 3
    idx[-1, 0, 0] = -1  # a query with none
    return idx


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("s_q", [1, 3])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_sparse_decoding_over_flashmlas_page_pool(
    dtype: torch.dtype, s_q: int, sinks: bool
) -> None:
    # flash_mla_with_kvcache(indices=...): top-k 48 of rows of 0 to 130 keys, causal, an
    # attention sink per head (one -inf: no sink); entries past a row's length are ignored.
    h = 16
    pool = Pool(LENGTHS, 1, D, DV, dtype, seed=3 + s_q)
    q = randn(len(LENGTHS), h, s_q, D, g=gen(4), dtype=dtype) / 3
    idx = flashmla_selection(len(LENGTHS), s_q, 48, LENGTHS, seed=5)
    sink = None
    if sinks:
        sink = randn(h, g=gen(6), dtype=dtype)
        sink[1] = -math.inf
    mask = masks.key_indices(idx)
    out, lse = attnkit.attention(
        q, pool.view, mask=mask, causal=True, sinks=sink, scale=0.5, return_lse=True
    )

    def allowed(b: int, n: int) -> Tensor:
        return chosen(idx[b : b + 1], n) & end_causal(s_q, n)

    check_rows(pool, q, out, lse, allowed, 0.5, sink)
    # A row of no keys: 0, and the log-sum-exp of its sink alone (-inf where there is none).
    assert not out[0].any()
    want = torch.full((h,), -math.inf) if sink is None else sink.float()
    assert torch.equal(lse[0, :, 0].float(), want)


def test_a_sparse_decode_at_flashmlas_sizes_reads_the_pool_in_bfloat16() -> None:
    # d 576, dv 512, 64 heads, MTP's s_q = 2, top-k 64, sinks: the decode path's kernel.
    lengths = [0, 1, 200, 65]
    pool = Pool(lengths, 1, 576, 512, BF16, seed=7)
    q = randn(4, 64, 2, 576, g=gen(8), dtype=BF16) / 10
    idx = flashmla_selection(4, 2, 64, lengths, seed=9)
    sink = randn(64, g=gen(10), dtype=BF16)
    scale = 1 / math.sqrt(192)
    for mask in (None, masks.key_indices(idx)):
        with attnkit.record_dispatch() as calls:
            out, lse = attnkit.attention(
                q, pool.view, mask=mask, causal=True, sinks=sink, scale=scale, return_lse=True
            )
        sel = None if mask is None else idx

        def allowed(b: int, n: int, sel: Tensor | None = sel) -> Tensor:
            band = end_causal(2, n)
            return band if sel is None else band & chosen(sel[b : b + 1], n)

        check_rows(pool, q, out, lse, allowed, scale, sink)
        kernel = calls[0].kernel or ""
        assert calls[0].served_by == "chunked"
        if mask is None:
            assert kernel.startswith("native kernel, the cache read in place"), kernel
        else:
            assert "gathered through the block table" in kernel, kernel
            assert "attended by the native kernel" in kernel, kernel


def test_a_selection_past_every_row_is_refused_quoting_the_entries() -> None:
    # FlashMLA ignores any entry outside the keys; attnkit ignores one past a row's own length
    # (the batch padded to its longest row) and refuses one past every row, and any below -1.
    pool = Pool([64, 130], 1, D, DV, F32, seed=11)
    q = randn(2, 4, 1, D, g=gen(12))
    for entry, taken in ((129, True), (64, True), (130, False), (-2, False), (-(2**31), False)):
        idx = torch.tensor([entry, 0], dtype=torch.int32).view(2, 1, 1, 1)
        if taken:
            out, lse = attnkit.attention(q, pool.view, mask=masks.key_indices(idx), return_lse=True)
            assert not out[0].any()
            assert lse[0].isneginf().all()
            continue
        with pytest.raises(ValueError, match=rf"entries from {min(entry, 0)} to {max(entry, 0)}"):
            attnkit.attention(q, pool.view, mask=masks.key_indices(idx))


# --------------------------------------------------------------------------------------------------
# FlashMLA's sparse prefill (flash_mla_sparse_fwd): one sequence of keys, each query its top-k


def strided(t: Tensor) -> Tensor:
    """``t``'s values in memory of other strides (FlashMLA's tests make every input so)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("backend", ["auto", "chunked", "reference"])
@pytest.mark.parametrize(
    ("s_kv", "topk", "s_q", "sinks", "dtype"),
    [
        (95, 128, 13, True, BF16),  # top-k wider than the keys: -1 padding
        (153, 64, 1, False, F32),
        (40, 16, 21, True, F32),
        (128, 128, 5, False, BF16),  # every key
    ],
)
def test_sparse_prefill_grid(
    s_kv: int, topk: int, s_q: int, sinks: bool, dtype: torch.dtype, backend: str
) -> None:
    h = 16
    g = gen(s_kv + s_q)
    q = strided(randn(1, h, s_q, D, g=g, dtype=dtype))
    kv = strided(randn(1, 1, s_kv, D, g=g, dtype=dtype))
    idx = torch.full((1, 1, s_q, topk), -1, dtype=torch.int32)
    for i in range(s_q):
        pick = torch.randperm(s_kv, generator=g)[:topk]
        idx[0, 0, i, : pick.numel()] = pick.int()
    idx[0, 0, s_q // 2, 5:] = -1  # topk_length 5
    idx[0, 0, -1] = -1  # a query with none
    sink = None
    if sinks:
        sink = randn(h, g=g, dtype=dtype)
        sink[::3] = -math.inf
    for indices in (idx, idx.long(), strided(idx)):
        out, lse = attnkit.attention(
            q,
            kv,
            kv[..., :DV],
            mask=masks.key_indices(indices),
            sinks=sink,
            scale=0.5,
            return_lse=True,
            backend=backend,
        )
        want, want_lse = formula(q, kv, DV, chosen(idx, s_kv), 0.5, sink)
        check(out, lse, want, want_lse, dtype)


@pytest.mark.parametrize("backend", ["auto", "chunked", "reference", "sdpa"])
@pytest.mark.parametrize("entry", [-(2**31), -123456, -2, 95, 114514, 2**31 - 1])
def test_flashmlas_invalid_entries_are_refused_in_a_dense_call(entry: int, backend: str) -> None:
    # FlashMLA's tests fill invalid slots with these and expect them ignored; attnkit's dense
    # call says which entries it got and what it takes.
    idx = torch.zeros(1, 1, 3, 4, dtype=torch.int32)
    idx[0, 0, 1, 2] = entry
    q, kv = torch.zeros(1, 4, 3, D), torch.zeros(1, 1, 95, D)
    lo, hi = min(entry, 0), max(entry, 0)
    with pytest.raises(ValueError, match=rf"entries from {lo} to {hi}.*Tk = 95 keys \(0 to 94\)"):
        attnkit.attention(q, kv, kv[..., :DV], mask=masks.key_indices(idx), backend=backend)


def test_an_infinite_sink_is_refused_and_a_minus_infinite_one_is_none() -> None:
    # FlashMLA's sink may be +inf (every weight 0); attnkit refuses it, and takes -inf as no sink.
    q, kv = randn(1, 4, 2, D, g=gen(13)), randn(1, 1, 9, D, g=gen(14))
    sink = torch.tensor([0.5, -math.inf, 1.0, -math.inf])
    out, lse = attnkit.attention(q, kv, kv[..., :DV], sinks=sink, return_lse=True)
    want, want_lse = formula(q, kv, DV, torch.ones(9, dtype=torch.bool), 1 / math.sqrt(D), sink)
    check(out, lse, want, want_lse, F32)
    with pytest.raises(ValueError, match="sinks"):
        attnkit.attention(q, kv, kv[..., :DV], sinks=torch.tensor([0.0, math.inf, 0.0, 0.0]))


# --------------------------------------------------------------------------------------------------
# vLLM's MLA and sparse-MLA backend tests: batches of rows of their own lengths and query counts

BATCH_SPECS = {  # name: (seq_lens, query_lens), each row's queries the last of its tokens
    "small_decode": ([32, 40], [1, 1]),
    "small_prefill": ([32, 40], [8, 8]),
    "mixed_small": ([32, 40, 48, 56], [1, 1, 5, 5]),
    "across_pages": ([1, 64, 65, 130], [1, 3, 1, 2]),  # a row that is all new, page edges
}


def vllm_selection(seq_lens: list[int], query_lens: list[int], topk: int, seed: int) -> Tensor:
    """``(B, 1, T, topk)``: each real query's top-k among the keys up to its own position, in
    random order, ``-1`` padding (vLLM's causal top-k indices); padding queries none."""
    g = gen(seed)
    idx = torch.full((len(seq_lens), 1, max(query_lens), topk), -1)
    for b, (n, m) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for i in range(m):
            pick = torch.randperm(n - m + i + 1, generator=g)[:topk]
            idx[b, 0, i, : pick.numel()] = pick
    return idx


def held_keys(cache: attnkit.PagedKVCache, b: int) -> Tensor:
    """Row ``b``'s latents ``(1, 1, n, Dk)`` read from the pages by hand (dequantized with their
    scales where the pages are int8 or float8)."""
    pages = torch.tensor(cache.pages_of(b))
    k = cache.k_pages if cache.layout == "vllm" else cache.k_pages.transpose(1, 2)
    rows = k[pages].double()  # (p, 1, page, Dk)
    if cache.k_scales is not None:
        rows = rows * cache.k_scales[pages].double()
    width = k.size(-1)
    return rows.transpose(0, 1).reshape(1, 1, len(pages) * cache.page_size, width)[
        :, :, : cache.lengths[b]
    ]


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("spec", list(BATCH_SPECS))
def test_vllm_batch_specs_on_a_paged_latent_cache(
    spec: str, sparse: bool, kv_dtype: torch.dtype | None
) -> None:
    seq_lens, query_lens = BATCH_SPECS[spec]
    rows, h, t = len(seq_lens), 16, max(query_lens)
    dtype = BF16 if kv_dtype is None else F32
    layout = "vllm" if sparse else "flash"
    cache = attnkit.PagedKVCache(
        12, PAGE, 1, D, DV, max_seqs=rows, dtype=dtype, layout=layout,
        kv_dtype=kv_dtype, values_in_keys=True,
    )  # fmt: skip
    g = gen(len(spec) + 100 * sparse)
    context = [n - m for n, m in zip(seq_lens, query_lens, strict=True)]
    cache.schedule(context)
    cache.stage(randn(rows, 1, max(context), D, g=g, dtype=dtype), None)
    cache.commit()
    q = randn(rows, h, t, D, g=g, dtype=dtype)
    idx = vllm_selection(seq_lens, query_lens, 24, seed=1)
    cache.schedule(query_lens)
    mask = masks.key_indices(idx) if sparse else None
    out, lse = cache.attention(
        q, randn(rows, 1, t, D, g=g, dtype=dtype), None, mask=mask, causal=True, scale=0.2
    )
    cache.commit()
    assert cache.lengths == seq_lens
    for b, (n, m) in enumerate(zip(seq_lens, query_lens, strict=True)):
        allowed = end_causal(m, n) & (chosen(idx[b : b + 1, :, :m], n) if sparse else True)
        want, want_lse = formula(q[b : b + 1, :, :m], held_keys(cache, b), DV, allowed, 0.2)
        check(out[b : b + 1, :, :m], lse[b : b + 1, :, :m], want, want_lse, dtype)
        assert not out[b, :, m:].any()
        assert lse[b, :, m:].isneginf().all()


@pytest.mark.parametrize("q_dtype", [F32, BF16])
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_pages_whose_unused_scales_are_nan_or_inf(
    kv_dtype: torch.dtype, q_dtype: torch.dtype
) -> None:
    # A pool's scales past a row's length and in free pages are whatever they held before: the
    # call reads only each row's own tokens (dense decode and top-k alike).
    lengths, count = [0, 1, 70, 64, 130], 10
    g = gen(15)
    latents = randn(count, 1, PAGE, D, g=g)
    top = 127.0 if kv_dtype == torch.int8 else 448.0
    scales = latents.abs().amax(-1, keepdim=True) / top
    pages = (
        (latents / scales).round().clamp(-127, 127) if kv_dtype == torch.int8 else latents / scales
    )
    pages = pages.to(kv_dtype)
    exact = pages.double() * scales.double()
    order = torch.randperm(count, generator=g)
    table = torch.full((5, 3), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(lengths):
        p = -(-n // PAGE)
        table[b, :p] = order[at : at + p].int()
        at += p
        if n % PAGE:
            scales[table[b, p - 1], :, n % PAGE :] = math.nan
    scales[order[at:]] = math.inf
    ranges = [(0, n) for n in lengths]
    view = CacheView(pages, pages[..., :DV], ranges, table, k_scale=scales, v_scale=scales)
    q = randn(5, 16, 3, D, g=g, dtype=q_dtype)
    idx = torch.randint(-1, 130, (5, 1, 3, 11), generator=g)
    for mask in (None, masks.key_indices(idx)):
        out, lse = attnkit.attention(q, view, mask=mask, causal=True, return_lse=True)
        for b, n in enumerate(lengths):
            keys = (
                exact[table[b, : -(-n // PAGE)].long()]
                .transpose(0, 1)
                .reshape(1, 1, -1 if n else 0, D)
            )
            allowed = end_causal(3, n) & (True if mask is None else chosen(idx[b : b + 1], n))
            want, want_lse = formula(q[b : b + 1], keys[:, :, :n], DV, allowed, 1 / math.sqrt(D))
            check(out[b : b + 1], lse[b : b + 1], want, want_lse, q_dtype)


# --------------------------------------------------------------------------------------------------
# Index masks, adversarially: dense calls on every backend


@pytest.mark.parametrize("backend", ["auto", "chunked", "reference", "sdpa"])
@pytest.mark.parametrize(
    ("h", "h_kv", "h_i", "layout", "itype"),
    [
        (16, 1, 1, "contiguous", torch.int32),
        (16, 2, 2, "expanded", torch.int64),  # one selection broadcast over the batch (stride 0)
        (16, 2, 1, "every_other", torch.int16),  # entries of a wider tensor, stride 2
        (16, 4, 16, "contiguous", torch.int8),  # a selection per query head
    ],
)
def test_unsorted_repeated_and_empty_selections_with_causal_and_grouped_heads(
    h: int, h_kv: int, h_i: int, layout: str, itype: torch.dtype, backend: str
) -> None:
    rows, s_q, s_kv, topk = 2, 7, 40, 9
    g = gen(h_i + s_q)
    q = randn(rows, h, s_q, D, g=g)
    kv = randn(rows, h_kv, s_kv, D, g=g)
    idx = torch.randint(-1, s_kv, (rows, h_i, s_q, 2 * topk), generator=g)
    idx[0, :, 2] = -1  # a query with none
    idx[0, :, 1, :5] = idx[0, :, 1, 5:6]  # one key five times
    idx[0, :, 3] = s_kv - 1  # only the last key: after query 3 under causal, so none
    idx = idx.to(itype)
    if layout == "expanded":
        idx = idx[:1].expand(rows, -1, -1, -1)
    picked = idx[..., ::2] if layout == "every_other" else idx[..., :topk]
    mask = masks.key_indices(picked) & masks.causal()
    if backend == "sdpa":
        out, lse = attnkit.attention(q, kv, kv[..., :DV], mask=mask, backend=backend), None
    else:
        out, lse = attnkit.attention(
            q, kv, kv[..., :DV], mask=mask, return_lse=True, backend=backend
        )
    allowed = chosen(picked, s_kv).repeat_interleave(h // h_i, 1) & end_causal(s_q, s_kv)
    want, want_lse = formula(q, kv, DV, allowed, 1 / math.sqrt(D))
    check(out, lse, want, want_lse, F32)
    assert not out[0, :, 2].any()
    assert not out[0, :, 3].any()


@pytest.mark.parametrize("backend", ["auto", "chunked", "reference"])
@pytest.mark.parametrize("case", ["width_0", "all_none", "no_keys", "future_only"])
def test_empty_selections_give_zero_and_the_sinks_alone(case: str, backend: str) -> None:
    h, s_q = 4, 3
    s_kv = 0 if case == "no_keys" else 10
    width = 0 if case == "width_0" else 2
    q, kv = randn(1, h, s_q, D, g=gen(16)), randn(1, 1, s_kv, D, g=gen(17))
    idx = torch.full((1, 1, s_q, width), -1)
    if case == "future_only":  # queries at keys 7, 8, 9 each select only key 9 + ... none
        idx[..., 0] = 9
        idx[0, 0, 2] = -1
    sink = torch.tensor([0.25, -math.inf, -1.0, 2.0])
    for sinks in (None, sink):
        out, lse = attnkit.attention(
            q, kv, kv[..., :DV], mask=masks.key_indices(idx) & masks.causal(),
            sinks=sinks, return_lse=True, backend=backend,
        )  # fmt: skip
        allowed = chosen(idx, s_kv) & end_causal(s_q, s_kv)
        want, want_lse = formula(q, kv, DV, allowed, 1 / math.sqrt(D), sinks)
        check(out, lse, want, want_lse, F32)
        if case != "future_only":
            assert not out.any()
            alone = torch.full((h,), -math.inf) if sinks is None else sinks
            assert torch.equal(lse[0, :, 0], alone)


@pytest.mark.parametrize("backend", ["auto", "chunked", "reference"])
@pytest.mark.parametrize("s_q", [1, 40])
def test_nan_and_inf_in_keys_no_query_selects_reach_nothing(s_q: int, backend: str) -> None:
    # FlashMLA's tests put NaN where no query reads: the outputs, log-sum-exps and gradients
    # are those of the selected keys alone.
    g = gen(18 + s_q)
    q = randn(2, 16, s_q, D, g=g).requires_grad_()
    latents = randn(2, 1, 90, D, g=g)
    latents[:, :, 60:] = math.nan
    latents[1, 0, 59, 5] = math.inf
    latents.requires_grad_()
    idx = torch.randint(0, 59, (2, 1, s_q, 10), generator=g)
    idx[0, 0, 0] = -1
    out, lse = attnkit.attention(
        q, latents, latents[..., :DV], mask=masks.key_indices(idx), return_lse=True,
        backend=backend,
    )  # fmt: skip
    clean = latents.detach().nan_to_num(0.0, 0.0, 0.0)
    want, want_lse = formula(q.detach(), clean, DV, chosen(idx, 90), 1 / math.sqrt(D))
    check(out.detach(), lse.detach(), want, want_lse, F32)
    dq, dk = torch.autograd.grad(out.sum(), [q, latents])
    assert dq.isfinite().all()
    assert dk.isfinite().all()
    assert not dk[:, :, 59:].any()


@pytest.mark.parametrize("backend", ["auto", "chunked"])
@pytest.mark.parametrize(("dtype", "h_kv", "h_i"), [(F32, 1, 1), (F32, 2, 1), (BF16, 2, 2)])
def test_gradients_reach_the_latents_through_keys_and_their_values_view(
    dtype: torch.dtype, h_kv: int, h_i: int, backend: str
) -> None:
    # V = K[..., :dv]: the latents' gradient is the keys' and the values' summed, with sinks.
    g = gen(19 + h_kv)
    h, s_q, s_kv = 16, 6, 70
    q = randn(2, h, s_q, D, g=g, dtype=dtype).requires_grad_()
    latents = randn(2, h_kv, s_kv, D, g=g, dtype=dtype).requires_grad_()
    sinks = randn(h, g=g, dtype=dtype).requires_grad_()
    idx = torch.randint(-1, s_kv, (2, h_i, s_q, 12), generator=g)
    idx[0, :, 2] = -1
    idx[1, :, 1, :6] = 5
    out = attnkit.attention(
        q, latents, latents[..., :DV], mask=masks.key_indices(idx) & masks.causal(),
        sinks=sinks, backend=backend,
    )  # fmt: skip
    grad_out = randn(*out.shape, g=g, dtype=dtype)
    got = torch.autograd.grad((out * grad_out).sum(), [q, latents, sinks])
    ins = [t.detach().double().requires_grad_() for t in (q, latents, sinks)]
    allowed = chosen(idx, s_kv).repeat_interleave(h // h_i, 1) & end_causal(s_q, s_kv)
    want_out, _ = formula(ins[0], ins[1], DV, allowed, 1 / math.sqrt(D), ins[2])
    want = torch.autograd.grad((want_out * grad_out.double()).sum(), ins)
    tol = 1e-4 if dtype == F32 else 5e-2
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, atol=tol, rtol=tol)


# --------------------------------------------------------------------------------------------------
# MultiHeadLatentAttention: its two forms and its caches, against MLA written out here


class NoRotation(nn.Module):
    """A rotary part left as it is, so that the formula below needs no rotation of its own."""

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        return x


def rms(x: Tensor, norm: nn.RMSNorm) -> Tensor:
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    weight = norm.weight.double() if norm.weight is not None else 1.0
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def linear(x: Tensor, layer: nn.Module) -> Tensor:
    out = x @ layer.weight.double().T
    return out if layer.bias is None else out + layer.bias.double()


def mla(m: attnkit.MultiHeadLatentAttention, x: Tensor, allowed: Tensor) -> Tensor:
    """DeepSeek's MLA in float64, expanded, from ``m``'s weights: ``x`` ``(B, S, D)``, every
    position a query; ``allowed`` broadcasts to ``(B, H, S, S)``."""
    h, r = m.num_heads, m.kv_lora_rank
    dn, dr, dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    b, s, _ = x.shape
    if m.q_proj is not None:
        q = linear(x, m.q_proj)
    else:
        assert m.q_a_proj is not None
        assert m.q_a_norm is not None
        assert m.q_b_proj is not None
        q = linear(rms(linear(x, m.q_a_proj), m.q_a_norm), m.q_b_proj)
    q = q.view(b, s, h, dn + dr).transpose(1, 2)
    latent = linear(x, m.kv_a_proj)
    c, k_rope = rms(latent[..., :r], m.kv_a_norm), latent[..., r:]
    up = linear(c, m.kv_b_proj).view(b, s, h, dn + dv).transpose(1, 2)
    k = torch.cat((up[..., :dn], k_rope[:, None].expand(b, h, s, dr)), -1)
    scores = (q @ k.mT * m.scale).masked_fill(~allowed, -math.inf)
    out = torch.softmax(scores, -1).nan_to_num(0.0) @ up[..., dn:]
    return linear(out.transpose(1, 2).reshape(b, s, h * dv), m.out_proj)


def small_mla(heads: int, dtype: torch.dtype, **kw: Any) -> attnkit.MultiHeadLatentAttention:
    return attnkit.MultiHeadLatentAttention(
        32, heads, kv_lora_rank=64, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=8,
        rotary=NoRotation(), dtype=dtype, **kw,
    )  # fmt: skip


@pytest.mark.parametrize(("q_lora_rank", "proj_bias"), [(None, False), (12, True)])
def test_both_forms_and_their_gradients_are_mla_written_out(
    q_lora_rank: int | None, proj_bias: bool
) -> None:
    torch.manual_seed(20)
    m = small_mla(4, F64, q_lora_rank=q_lora_rank, proj_bias=proj_bias)
    x = torch.randn(2, 9, 32, dtype=F64, requires_grad=True)
    idx = torch.randint(-1, 9, (2, 1, 9, 4))
    idx[0, 0, 3] = -1
    mask = masks.key_indices(idx) & masks.causal()
    allowed = chosen(idx, 9) & end_causal(9, 9)
    want = mla(m, x, allowed)
    weights = torch.linspace(-1, 1, want.numel(), dtype=F64).view_as(want)
    params = [x, *m.parameters()]
    want_grads = torch.autograd.grad((want * weights).sum(), params)
    for form in ("expanded", "absorbed"):
        out = m(x, mask=mask, form=form)
        torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
        grads = torch.autograd.grad((out * weights).sum(), params)
        for got, expected in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-9, rtol=1e-9)


CACHE_PATHS = {  # the kernel record_dispatch() names for a top-k decode step on each cache
    "latent": "gathered: each query's 10 selected keys",
    "kv": "gathered: each query's 10 selected keys",
    "paged": "index mask on a cache: each query's 10 selected keys gathered through the block "
    "table",
}


@pytest.mark.parametrize("dtype", [F64, BF16])
@pytest.mark.parametrize("kind", list(CACHE_PATHS))
def test_top_k_decode_steps_over_each_latent_cache_are_mla_written_out(
    kind: str, dtype: torch.dtype
) -> None:
    # A prompt of 70 (past a page of 64), then a step of 1 query and an MTP step of 2, each
    # query its top-10 of the keys up to its own (-1 padding, a query with none).
    torch.manual_seed(21)
    m = small_mla(16, dtype)
    rows, prompt = 3, 70
    x = torch.randn(rows, prompt + 3, 32, dtype=F64)
    cache: Any = {
        "latent": lambda: m.make_cache(rows, 100),
        "kv": lambda: m.make_kv_cache(rows, 100),
        "paged": lambda: m.make_paged_cache(12, PAGE, max_seqs=rows),
    }[kind]()
    exact = copy.deepcopy(m).double()
    tol = 1e-10 if dtype == F64 else 5e-2
    with torch.no_grad():
        m(x[:, :prompt].to(dtype), causal=True, cache=cache)
        for start, tq in ((prompt, 1), (prompt + 1, 2)):
            s = start + tq
            idx = torch.randint(-1, s, (rows, 1, tq, 10))
            idx[1, 0, 0] = -1
            mask = masks.key_indices(idx) & masks.causal()
            with attnkit.record_dispatch() as calls:
                out = m(x[:, start:s].to(dtype), mask=mask, cache=cache)
            allowed = torch.ones(rows, 1, s, s, dtype=torch.bool)
            allowed[..., start:, :] = chosen(idx, s) & end_causal(tq, s)
            want = mla(exact, x[:, :s].to(dtype).double(), allowed)[:, start:]
            torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
            assert [c.served_by for c in calls] == ["chunked"]
            assert (calls[0].kernel or "").startswith(CACHE_PATHS[kind]), calls[0].kernel
        explained = str(m.explain(x[:, :2].to(dtype), mask=mask, cache=cache))
        assert "auto picks: chunked" in explained
        assert CACHE_PATHS[kind] in explained.replace("\n", " ")


def test_a_paged_step_whose_rows_decode_none_one_and_two_tokens() -> None:
    # vLLM's mixed batch through the module: rows of 70, 0 and 64 tokens; a step in which row 1
    # decodes nothing (its outputs are the output projection's bias of nothing: 0).
    torch.manual_seed(22)
    m = small_mla(16, F64)
    prompts, new = [70, 0, 64], [1, 0, 2]
    seqs = [torch.randn(n + 2, 32, dtype=F64) for n in prompts]
    cache = m.make_paged_cache(12, PAGE, max_seqs=3)
    first = torch.zeros(3, max(prompts), 32, dtype=F64)
    step = torch.zeros(3, 2, 32, dtype=F64)
    for b, n in enumerate(prompts):
        first[b, :n] = seqs[b][:n]
        step[b, : new[b]] = seqs[b][n : n + new[b]]
    idx = torch.randint(-1, 71, (3, 1, 2, 9))
    idx[..., 0] = 0
    with torch.no_grad():
        cache.schedule(prompts)
        m(first, causal=True, cache=cache)
        cache.schedule(new)
        out = m(step, mask=masks.key_indices(idx) & masks.causal(), cache=cache)
    assert cache.lengths == [71, 0, 66]
    for b, (n, t) in enumerate(zip(prompts, new, strict=True)):
        s = n + t
        allowed = torch.ones(1, 1, s, s, dtype=torch.bool)
        allowed[..., n:, :] = chosen(idx[b : b + 1, :, :t], s) & end_causal(t, s)
        want = mla(m, seqs[b][None, :s], allowed)[:, n:]
        torch.testing.assert_close(out[b : b + 1, :t], want, atol=1e-10, rtol=1e-10)
        assert not out[b, t:].any()


@pytest.mark.parametrize("sparse", [False, True])
def test_explain_of_an_expanded_step_on_a_paged_cache_describes_the_rows_it_reads(
    sparse: bool,
) -> None:
    # The expanded form on rows of their own lengths (vLLM's mixed batch) attends each row's
    # expanded keys as a view of the rows: explain() describes that call, not a dense one over
    # the longest row's keys for every query.
    torch.manual_seed(23)
    m = small_mla(16, F32)
    cache = m.make_paged_cache(12, PAGE, max_seqs=3)
    with torch.no_grad():
        cache.schedule([70, 30, 5])
        m(torch.randn(3, 70, 32), causal=True, cache=cache)
        cache.commit()
        cache.schedule([20, 1, 0])
        x = torch.randn(3, 20, 32)
        idx = torch.randint(-1, 31, (3, 1, 20, 4))
        mask = masks.key_indices(idx) & masks.causal() if sparse else None
        explained = str(m.explain(x, mask=mask, causal=not sparse, cache=cache, form="expanded"))
        with attnkit.record_dispatch() as calls:
            m(x, mask=mask, causal=not sparse, cache=cache, form="expanded")
    first = explained.splitlines()[0]
    assert "3 rows of keys 0..90, 0..31, 0..5" in first, first
    assert "queries [20, 1, 0]" in first, first
    assert calls[0].call.cache is not None
    chosen_note = explained.split("chunked    chosen")[1].split("reference")[0]
    path = "index mask on a cache" if sparse else "reads the cache in place"
    assert path in chosen_note, explained


def cached_latents(cache: attnkit.KVCache | attnkit.PagedKVCache, b: int) -> Tensor:
    """Row ``b``'s latents ``(1, 1, n, R + Dr)`` as the cache holds them, dequantized by hand."""
    if isinstance(cache, attnkit.PagedKVCache):
        return held_keys(cache, b)
    k = cache.k_cache[b : b + 1, :, : cache.length].double()
    return k if cache.k_scale is None else k * cache.k_scale[b : b + 1, :, : cache.length].double()


def absorbed(
    m: attnkit.MultiHeadLatentAttention, x: Tensor, latents: Tensor, allowed: Tensor
) -> Tensor:
    """MLA's absorbed form in float64 over given latents ``(1, 1, S, R + Dr)``: each query moved
    into the latent's space by ``W_uk``, attention with the latents' first ``R`` columns as values,
    ``W_uv`` on the result; ``x`` ``(1, Tq, D)``."""
    h, r, dn, dv = m.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim
    tq = x.size(1)
    assert m.q_proj is not None
    q = linear(x, m.q_proj).view(1, tq, h, -1).transpose(1, 2)
    w = m.kv_b_proj.weight.double().view(h, dn + dv, r)
    q = torch.cat((torch.einsum("bhtn,hnr->bhtr", q[..., :dn], w[:, :dn]), q[..., dn:]), -1)
    out, _ = formula(q, latents, r, allowed, m.scale)
    out = torch.einsum("bhtr,hvr->bhtv", out, w[:, dn:])
    return linear(out.transpose(1, 2).reshape(1, tq, h * dv), m.out_proj)


@pytest.mark.parametrize("kind", ["kv", "paged"])
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantized_latent_caches_decode_as_the_absorbed_form_of_what_they_hold(
    kv_dtype: torch.dtype, kind: str
) -> None:
    # The latents stored quantized once, their values read with the keys' scales: a top-k step
    # and an MTP step equal the absorbed formula over the cache's latents, dequantized here.
    torch.manual_seed(24)
    m = small_mla(16, BF16)
    rows = 2
    if kind == "kv":
        cache: Any = m.make_kv_cache(rows, 100, kv_dtype=kv_dtype)
    else:
        cache = m.make_paged_cache(8, PAGE, max_seqs=rows, kv_dtype=kv_dtype)
    exact = copy.deepcopy(m).double()
    x = torch.randn(rows, 73, 32).to(BF16)
    with torch.no_grad():
        m(x[:, :70], causal=True, cache=cache)
        for start, tq in ((70, 1), (71, 2)):
            s = start + tq
            idx = torch.randint(-1, s, (rows, 1, tq, 10))
            out = m(x[:, start:s], mask=masks.key_indices(idx) & masks.causal(), cache=cache)
            for b in range(rows):
                allowed = chosen(idx[b : b + 1], s) & end_causal(tq, s)
                want = absorbed(
                    exact, x[b : b + 1, start:s].double(), cached_latents(cache, b), allowed
                )
                torch.testing.assert_close(out[b : b + 1].double(), want, atol=6e-2, rtol=6e-2)


@pytest.mark.parametrize("backend", ["auto", "chunked"])
@pytest.mark.parametrize("sparse", [False, True])
def test_rows_sharing_prefix_pages_get_their_gradients_summed(sparse: bool, backend: str) -> None:
    # vLLM's prefix caching: two rows name the same first page. The pages' gradient is the sum
    # of both rows' (keys and values alike: the values are a view of the keys).
    g = gen(25)
    pages = randn(4, 1, 8, D, g=g).requires_grad_()
    table = torch.tensor([[2, 0], [2, 1], [3, -1]])
    lengths = [12, 16, 5]
    view = CacheView(pages, pages[..., :DV], [(0, n) for n in lengths], table)
    q = randn(3, 4, 2, D, g=g).requires_grad_()
    idx = torch.randint(-1, 16, (3, 1, 2, 6), generator=g)
    mask = masks.key_indices(idx) if sparse else None
    out = attnkit.attention(q, view, mask=mask, causal=True, backend=backend)
    grad_out = randn(*out.shape, g=g)
    got = torch.autograd.grad((out * grad_out).sum(), [q, pages])
    q64, pages64 = (t.detach().double().requires_grad_() for t in (q, pages))
    total = q64.new_zeros(())
    for b, n in enumerate(lengths):
        keys = pages64[table[b, : -(-n // 8)]].transpose(0, 1).reshape(1, 1, -1, D)[:, :, :n]
        allowed = end_causal(2, n) & (chosen(idx[b : b + 1], n) if sparse else True)
        row, _ = formula(q64[b : b + 1], keys, DV, allowed, 1 / math.sqrt(D))
        total = total + (row * grad_out[b : b + 1].double()).sum()
    want = torch.autograd.grad(total, [q64, pages64])
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize(
    "layout",
    ["table_slice", "table_int64", "table_column_major", "pages_wider", "pages_interleaved"],
)
def test_block_tables_pages_and_queries_of_other_strides(layout: str, sparse: bool) -> None:
    # A server's persistent block table sliced to the batch, an int64 one, a column-major one;
    # pages inside wider rows, or every other page of a pool holding keys and values together
    # (NaN between them); queries (B, s_q, H, d) seen as (B, H, s_q, d), as FlashMLA takes them.
    pool = Pool(LENGTHS, 1, D, DV, BF16, seed=26)
    table, pages = pool.table, pool.pages
    if layout == "table_slice":
        wide = torch.full((table.size(0), 2 * table.size(1)), 7, dtype=torch.int32)
        wide[:, : table.size(1)] = table
        table = wide[:, : table.size(1)]
    elif layout == "table_int64":
        table = table.long()
    elif layout == "table_column_major":
        table = table.t().contiguous().t()
    elif layout == "pages_wider":
        wider = torch.full((*pages.shape[:3], D + 24), math.nan, dtype=BF16)
        wider[..., :D] = pages
        pages = wider[..., :D]
    else:
        both = torch.full((pages.size(0), 2, *pages.shape[1:]), math.nan, dtype=BF16)
        both[:, 0] = pages
        pages = both[:, 0]
    view = CacheView(pages, pages[..., :DV], [(0, n) for n in LENGTHS], table)
    g = gen(27)
    q = (randn(len(LENGTHS), 2, 16, D, g=g, dtype=BF16) / 3).transpose(1, 2)
    idx = torch.randint(-1, 130, (len(LENGTHS), 1, 2, 9), generator=g)
    mask = masks.key_indices(idx) if sparse else None
    out, lse = attnkit.attention(q, view, mask=mask, causal=True, return_lse=True)

    def allowed(b: int, n: int) -> Tensor:
        return end_causal(2, n) & (chosen(idx[b : b + 1], n) if sparse else True)

    check_rows(pool, q, out, lse, allowed, 1 / math.sqrt(D))


def test_a_compiled_decode_loop_over_a_paged_latent_cache_compiles_a_few_times() -> None:
    # The rows' positions (where their rotary parts turn from) are integers of a module, the
    # paged cache, which a graph takes as constants: read inside the graph they were guarded,
    # and the module's forward compiled again at every token until torch's recompile limit,
    # then ran uncompiled; rows at positions of their own (vLLM's batches) were grouped by a
    # set of their positions, which made them constants too. The steps equal an eager module's
    # on its own cache.
    from torch._dynamo.utils import counters

    prompts = [60, 33]  # rows at positions of their own
    torch._dynamo.reset()  # no frames compiled by earlier tests (their limits, their guards)
    torch.manual_seed(28)
    m = attnkit.MultiHeadLatentAttention(
        32, 16, kv_lora_rank=64, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=8
    )
    eager = copy.deepcopy(m)
    pool, eager_pool = (
        m.make_paged_cache(12, PAGE, max_seqs=2),
        eager.make_paged_cache(12, PAGE, max_seqs=2),
    )
    step = torch.compile(lambda x: m(x, causal=True, cache=pool), backend="eager")
    x = torch.randn(2, 67, 32)
    graphs = []
    with torch.no_grad():
        for cache, module in ((pool, m), (eager_pool, eager)):
            cache.schedule(prompts)
            module(x[:, :60], causal=True, cache=cache)
        for t in range(60, 67):
            got = step(x[:, t : t + 1])
            torch.testing.assert_close(got, eager(x[:, t : t + 1], causal=True, cache=eager_pool))
            graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert pool.lengths == eager_pool.lengths == [n + 7 for n in prompts]
    assert graphs[-1] - graphs[2] <= 2, graphs  # the graphs of the first steps, then few more
