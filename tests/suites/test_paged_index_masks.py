"""Index masks on paged caches: ``key_indices``/``block_indices`` over a :class:`PagedKVCache`
(both layouts, int8/float8 pages), through ``PagedKVCache.attention``, ``MultiHeadAttention``,
``MultiHeadLatentAttention``'s absorbed decode and a bare :class:`CacheView` through a block
table, each against the float64 reference on each row's dense keys and values with the same
selection written out as a bool mask (the queries aligned by hand to the row's end)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks
from attnkit.caches.view import CacheView
from attnkit.testing import assert_close

F64 = torch.float64


def dense_selection(idx: Tensor, n: int, heads: int, length: int, block: int = 1) -> Tensor:
    """Row ``n``'s selection as a bool mask ``(1, H, Tq, length)``, written out by hand: entry
    ``x`` lets its query attend keys ``x * block .. x * block + block - 1`` that the row holds."""
    rows = idx[n if idx.size(0) > 1 else 0].long()  # (Hi, Tq, k)
    out = torch.zeros(rows.size(0), rows.size(1), length, dtype=torch.bool)
    for h in range(rows.size(0)):
        for t in range(rows.size(1)):
            for x in rows[h, t].tolist():
                for j in range(x * block, x * block + block):
                    if x >= 0 and j < length:
                        out[h, t, j] = True
    return out.repeat_interleave(heads // rows.size(0), 0)[None]


def aligned_band(q_len: int, length: int, lo: float, hi: float) -> Tensor:
    """``(q_len, length)``: query ``i`` at key position ``length - q_len + i`` sees key ``j``
    iff ``lo <= j - position <= hi``."""
    j = torch.arange(length)[None, :]
    at = torch.arange(length - q_len, length)[:, None]
    return ((j - at) >= lo) & ((j - at) <= hi)


def reference_rows(
    q: Tensor,
    keys: list[tuple[Tensor, Tensor]],
    allowed: list[Tensor],
    real: list[int],
    **kw: Any,
) -> tuple[Tensor, Tensor]:
    """Each row's first ``real[n]`` queries over its keys ``(1, Hkv, L, D)`` under the bool mask
    ``allowed[n]`` ``(1, H, real, L)``, in float64 by the reference; padding queries 0, -inf."""
    n, h, t, _ = q.shape
    dv = keys[0][1].size(-1)
    out = torch.zeros(n, h, t, dv, dtype=F64)
    lse = torch.full((n, h, t), -math.inf, dtype=F64)
    for b in range(n):
        m = real[b]
        k, v = keys[b]
        if not m or not k.size(2):
            continue
        sinks = kw.get("sinks")
        o, s = attnkit.attention(
            q[b : b + 1, :, :m].to(F64),
            k.to(F64),
            v.to(F64),
            mask=masks.from_tensor(allowed[b]),
            scale=kw.get("scale"),
            softcap=kw.get("softcap"),
            sinks=None if sinks is None else sinks.to(F64),
            backend="reference",
            return_lse=True,
        )
        out[b, :, :m], lse[b, :, :m] = o[0], s[0]
    return out, lse


def fill(cache: attnkit.PagedKVCache, lengths: list[int], seed: int = 0) -> None:
    """Rows of their own lengths: one scheduled prompt a row, committed."""
    g = torch.Generator().manual_seed(seed)
    hkv = cache.k_pages.size(2 if cache.layout == "flash" else 1)
    t = max(lengths)
    dk, dv = cache.k_pages.size(-1), cache.v_pages.size(-1)
    k = torch.randn(len(lengths), hkv, t, dk, generator=g).to(cache.dtype)
    v = torch.randn(len(lengths), hkv, t, dv, generator=g).to(cache.dtype)
    cache.schedule(lengths)
    cache.stage(k, v)
    cache.commit()


def row_keys(view: CacheView) -> list[tuple[Tensor, Tensor]]:
    return [view.row(n, F64) for n in range(view.rows)]


def selection(rows: int, heads: int, q_len: int, k: int, top: int, seed: int = 1) -> Tensor:
    """Random entries from -1 to ``top - 1``, one repeated in each query, some -1."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, top, (rows, heads, q_len, k), generator=g)
    idx[..., -1] = idx[..., 0]  # a repeat counts once
    return idx


def causal_selection(rows: int, heads: int, q_len: int, k: int, seed: int = 1) -> Tensor:
    """As an indexer picks: query ``t``'s entries from -1 to ``t`` (its own keys), a repeat."""
    g = torch.Generator().manual_seed(seed)
    top = torch.arange(1, q_len + 1).view(1, 1, -1, 1) + 1
    idx = (torch.rand(rows, heads, q_len, k, generator=g) * top).long() - 1
    idx[..., -1] = idx[..., 0]
    return idx


def decode_case(
    layout: str, heads_i: int, kv_dtype: torch.dtype | None = None, q_len: int = 1, **kw: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A decode step over a paged cache of rows 5, 11, 2 and 0 tokens long (pages of 4): its
    output and log-sum-exp through ``PagedKVCache.attention`` with ``key_indices & causal``,
    and the reference's on each row's dense keys (the row's selection written out by hand,
    entries past its end ignored). The same call on torch's products
    (``Chunked(native=False)``) must give what the native kernel gave."""
    torch.manual_seed(0)
    hkv, h, d = 2, 4, 8
    cache = attnkit.PagedKVCache(
        num_blocks=24, page_size=4, num_kv_heads=hkv, head_dim=d, max_seqs=4,
        layout=layout, dtype=torch.float32, kv_dtype=kv_dtype,
    )  # fmt: skip
    fill(cache, [5, 11, 2, 0])
    q = torch.randn(4, h, q_len, d)
    k_new, v_new = torch.randn(4, hkv, q_len, d), torch.randn(4, hkv, q_len, d)
    lengths = [n + q_len for n in cache.lengths]
    idx = selection(4, heads_i, q_len, 6, max(lengths))
    idx[3] = -1  # a row that selects nothing
    out, lse = cache.attention(q, k_new, v_new, mask=masks.key_indices(idx), causal=True, **kw)
    view = cache.view()
    torch_products = attnkit.backends.Chunked(native=False)
    again = attnkit.attention(q, view, mask=masks.key_indices(idx), causal=True,
                              return_lse=True, backend=torch_products, **kw)  # fmt: skip
    torch.testing.assert_close(again, (out, lse), atol=1e-5, rtol=1e-5)
    allowed = [
        dense_selection(idx, n, h, L)[:, :, :q_len] & aligned_band(q_len, L, -math.inf, 0)
        for n, L in enumerate(lengths)
    ]
    want, want_lse = reference_rows(q, row_keys(view), allowed, [q_len] * 4, **kw)
    return out, lse, want, want_lse, idx


@pytest.mark.parametrize("layout", ["flash", "vllm"])
@pytest.mark.parametrize("heads_i", [1, 2, 4])
def test_a_paged_decode_step_with_key_indices_is_the_reference(layout: str, heads_i: int) -> None:
    """One selection for all heads (Hi = 1), one a key/value head (Hi = Hkv = 2) or one a query
    head (Hi = H = 4), with GQA (4 query heads on 2): -1 entries, repeats, entries past a
    row's own length (ignored: keys it does not hold), a row of no keys and a row selecting
    none (0 and -inf)."""
    out, lse, want, want_lse, _ = decode_case(layout, heads_i)
    torch.testing.assert_close(out.to(F64), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.to(F64), want_lse, atol=1e-5, rtol=1e-5)
    assert bool((out[3] == 0).all())
    assert bool((lse[3] == -math.inf).all())


def test_softcap_sinks_scale_and_several_queries_a_row() -> None:
    """Three new queries a row (each at its own position: causal from the row's end), softcap,
    sinks and a scale of one's own."""
    kw = {"softcap": 2.0, "sinks": torch.randn(4), "scale": 0.7}
    out, lse, want, want_lse, _ = decode_case("flash", 2, q_len=3, **kw)
    torch.testing.assert_close(out.to(F64), want, atol=1e-5, rtol=1e-5)
    # (row 3 selects nothing: its queries' log-sum-exp is the sink's alone)
    torch.testing.assert_close(lse[:3].to(F64), want_lse[:3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[3], kw["sinks"][:, None].expand(4, 3))


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout", ["flash", "vllm"])
def test_quantized_pages_are_read_with_their_scales(kv_dtype: torch.dtype, layout: str) -> None:
    out, lse, want, want_lse, _ = decode_case(layout, 1, kv_dtype=kv_dtype)
    torch.testing.assert_close(out.to(F64), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.to(F64), want_lse, atol=1e-5, rtol=1e-5)


def paged_view(lengths: list[int], page: int = 3, hkv: int = 2, d: int = 8) -> CacheView:
    """A float64 cache of rows of their own lengths, as its view (pages of ``page``)."""
    blocks = sum(-(-n // page) for n in lengths) + 2
    cache = attnkit.PagedKVCache(
        num_blocks=blocks, page_size=page, num_kv_heads=hkv, head_dim=d, max_seqs=len(lengths),
        dtype=F64,
    )  # fmt: skip
    fill(cache, lengths)
    return cache.view()


def test_block_indices_and_a_window_with_padding_queries() -> None:
    """NSA's blocks (of 2 keys) ANDed with a sliding window and causal, on rows whose queries are
    partly padding (``q_lens``: the real ones aligned to the row's end), in float64."""
    pages = paged_view([7, 12, 4])
    view = CacheView(pages.k, pages.v, pages.kv_range, pages.block_table, q_lens=(2, 3, 1))
    h, tq = 4, 3
    q = torch.randn(3, h, tq, 8, dtype=F64)
    idx = selection(3, 1, tq, 3, 6, seed=4)
    mask = masks.block_indices(idx, block=2) & masks.sliding_window(5)
    out, lse = attnkit.attention(q, view, mask=mask, causal=True, return_lse=True)
    real = [2, 3, 1]
    allowed = []
    for n, (m, (_, end)) in enumerate(zip(real, view.kv_range, strict=True)):
        sel = dense_selection(idx, n, h, end, block=2)[:, :, :m]
        allowed.append(sel & aligned_band(m, end, -5, 0))
    want, want_lse = reference_rows(q, row_keys(view), allowed, real)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)


def test_the_gradients_of_q_and_the_sinks_are_the_references() -> None:
    view = paged_view([6, 10])
    q = torch.randn(2, 4, 2, 8, dtype=F64, requires_grad=True)
    sinks = torch.randn(4, dtype=F64, requires_grad=True)
    mask = masks.key_indices(selection(2, 2, 2, 4, 10, seed=7))
    out = attnkit.attention(q, view, mask=mask, causal=True, sinks=sinks, softcap=3.0)
    want = attnkit.attention(
        q, view, mask=mask, causal=True, sinks=sinks, softcap=3.0, backend="reference"
    )
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, sinks), grad)
    expected = torch.autograd.grad(want, (q, sinks), grad)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_entries_past_every_row_are_refused_and_past_a_row_ignored() -> None:
    """An entry past the longest row's keys is no key of the call: refused with the values. One
    past its own row's (a key another row holds) is ignored: that row attends what it holds."""
    view = paged_view([3, 9])
    q = torch.randn(2, 4, 1, 8, dtype=F64)
    with pytest.raises(ValueError, match=r"entries from -1 to 9.*Tk = 9 keys \(0 to 8\)"):
        attnkit.attention(q, view, mask=masks.key_indices(torch.tensor([-1, 9]).view(1, 1, 1, 2)))
    only_past = torch.tensor([[5, 7], [5, 7]]).view(2, 1, 1, 2)  # row 0 holds keys 0..2
    out, lse = attnkit.attention(q, view, mask=masks.key_indices(only_past), return_lse=True)
    assert bool((out[0] == 0).all())
    assert bool((lse[0] == -math.inf).all())
    k, v = view.row(1)
    want = attnkit.attention(q[1:], k[:, :, 5:8:2], v[:, :, 5:8:2], backend="reference")
    torch.testing.assert_close(out[1:], want, atol=1e-12, rtol=0)


def test_explain_names_the_kernel_that_attends_the_gathered_keys() -> None:
    from attnkit import _native

    if not _native.load():
        pytest.skip(f"the native kernel is not available: {_native.status()[1]}")
    view = paged_view([5, 9])
    mask = masks.key_indices(selection(2, 1, 1, 3, 9))
    q = torch.randn(2, 4, 1, 8, dtype=F64)
    words = "attended by torch's products: float64 (the native kernel computes in float32)"
    assert words in str(attnkit.explain(q, view, mask=mask))
    q = q.float().requires_grad_()
    pages = CacheView(view.k.float(), view.v.float(), view.kv_range, view.block_table)
    assert "attended by the native kernel" in str(attnkit.explain(q.detach(), pages, mask=mask))
    words = "attended by torch's products: gradients are asked"
    assert words in str(attnkit.explain(q, pages, mask=mask))


def test_explain_and_record_dispatch_name_the_gather_through_the_block_table() -> None:
    view = paged_view([5, 9])
    q = torch.randn(2, 4, 1, 8, dtype=F64)
    mask = masks.key_indices(selection(2, 1, 1, 3, 9))
    text = str(attnkit.explain(q, view, mask=mask, causal=True))
    words = "each query's 3 selected keys gathered through the block table"
    assert "auto picks: chunked" in text
    assert words in text
    with attnkit.record_dispatch() as seen:
        attnkit.attention(q, view, mask=mask, causal=True)
    assert seen[-1].chosen == "chunked"
    assert words in str(seen[-1].kernel)


def test_no_tensor_of_the_whole_rows_is_made() -> None:
    """The keys a call reads are the selected ones: rows of 4,000 keys and a selection of 8
    allocate O(Tq * k) (no gather of a row, no (Tq, Tk) tensor): every tensor made while the call
    runs holds fewer bytes than one head of a row's keys."""
    view = paged_view([4096, 4000], page=16)
    q = torch.randn(2, 4, 2, 8, dtype=F64)
    mask = masks.key_indices(selection(2, 2, 2, 8, 4000)) & masks.causal()
    pools = {view.k.untyped_storage().data_ptr(), view.v.untyped_storage().data_ptr()}
    largest = 0

    class Sizes(torch.overrides.TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            nonlocal largest
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, Tensor) and t.untyped_storage().data_ptr() not in pools:
                    largest = max(largest, t.untyped_storage().nbytes())
            return out

    with Sizes():
        attnkit.attention(q, view, mask=mask)
    assert 0 < largest < 4000 * 8 * 8, largest


def test_a_contiguous_kv_cache_with_index_masks_still_works() -> None:
    """``MultiHeadAttention`` decoding over a ``KVCache`` with ``key_indices``: each step the
    reference over the whole sequence with the same selection (causal, a repeat and -1)."""
    torch.manual_seed(3)
    m = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=F64)
    x = torch.randn(2, 9, 16, dtype=F64)
    idx = causal_selection(2, 2, 9, 4, seed=5)
    with torch.no_grad():
        whole = m(x, mask=masks.key_indices(idx), causal=True)
        cache = attnkit.KVCache(2, 16, 2, 4, dtype=F64)
        parts = [m(x[:, :6], mask=masks.key_indices(idx[:, :, :6]), causal=True, cache=cache)]
        for t in range(6, 9):
            step = masks.key_indices(idx[:, :, t : t + 1])
            parts.append(m(x[:, t : t + 1], mask=step, causal=True, cache=cache))
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-12, rtol=0)


def test_multihead_attention_on_a_paged_cache_takes_key_indices() -> None:
    """Rows of their own lengths (a prompt each, then a step): equal to the module without a
    cache on each row's own sequence, with the same selection."""
    torch.manual_seed(4)
    m = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=F64)
    x = torch.randn(3, 10, 16, dtype=F64)
    lengths = [4, 9, 6]
    idx = causal_selection(3, 2, 10, 5, seed=6)
    with torch.no_grad():
        cache = m.make_paged_cache(num_blocks=16, page_size=4, max_seqs=3, layout="vllm")
        cache.schedule(lengths)
        m(x[:, :9], causal=True, cache=cache)
        step = torch.stack([x[b, n : n + 1] for b, n in enumerate(lengths)])
        chosen = torch.stack([idx[b, :, n : n + 1] for b, n in enumerate(lengths)])
        got = m(step, mask=masks.key_indices(chosen), causal=True, cache=cache)
        for b, n in enumerate(lengths):
            alone = m(x[b : b + 1, : n + 1], mask=masks.key_indices(idx[b : b + 1, :, : n + 1]),
                      causal=True)  # fmt: skip
            torch.testing.assert_close(got[b, 0], alone[0, -1], atol=1e-12, rtol=0)


def latent_module() -> Any:
    torch.manual_seed(0)
    m = attnkit.MultiHeadLatentAttention(
        32, 4, kv_lora_rank=24, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=6,
        v_head_dim=10, dtype=F64,
    )  # fmt: skip
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m


@pytest.mark.parametrize("layout", ["flash", "vllm"])
def test_latent_absorbed_decode_with_key_indices_over_a_paged_cache(layout: str) -> None:
    """DeepSeek V3.2's decode: the absorbed form over a paged latent cache with ``key_indices``
    equals the same over a contiguous KVCache, the expanded form over the paged cache, and the
    expanded form without a cache on the whole sequence."""
    m = latent_module()
    x = torch.randn(2, 12, 32, dtype=F64)
    idx = causal_selection(2, 1, 12, 5, seed=8)
    with torch.no_grad():
        whole = m(x, mask=masks.key_indices(idx), causal=True, form="expanded")
        paged = m.make_paged_cache(num_blocks=12, page_size=4, max_seqs=2, layout=layout)
        contiguous = m.make_kv_cache(batch_size=2, max_len=16)
        for cache in (paged, contiguous):
            m(x[:, :9], mask=masks.key_indices(idx[:, :, :9]), causal=True, cache=cache)
        steps: dict[str, list[Tensor]] = {"paged": [], "kv": [], "expanded": []}
        for t in range(9, 12):
            step = masks.key_indices(idx[:, :, t : t + 1])
            lengths = list(paged.lengths)
            steps["paged"].append(m(x[:, t : t + 1], mask=step, causal=True, cache=paged))
            steps["kv"].append(m(x[:, t : t + 1], mask=step, causal=True, cache=contiguous))
            paged.rewind(lengths)
            steps["expanded"].append(
                m(x[:, t : t + 1], mask=step, causal=True, cache=paged, form="expanded")
            )
    for got in steps.values():
        torch.testing.assert_close(torch.cat(got, 1), whole[:, 9:], atol=1e-12, rtol=0)


def test_latent_rows_of_their_own_lengths() -> None:
    """A paged latent cache whose rows hold 3, 8 and 6 tokens: each row's absorbed decode step
    with its selection is the expanded form's on its own sequence."""
    m = latent_module()
    x = torch.randn(3, 10, 32, dtype=F64)
    lengths = [3, 8, 6]
    idx = causal_selection(3, 1, 10, 4, seed=9)
    with torch.no_grad():
        cache = m.make_paged_cache(num_blocks=12, page_size=4, max_seqs=3)
        cache.schedule(lengths)
        m(x[:, :8], causal=True, cache=cache)
        step = torch.stack([x[b, n : n + 1] for b, n in enumerate(lengths)])
        chosen = torch.stack([idx[b, :, n : n + 1] for b, n in enumerate(lengths)])
        got = m(step, mask=masks.key_indices(chosen), causal=True, cache=cache)
        for b, n in enumerate(lengths):
            mask = masks.key_indices(idx[b : b + 1, :, : n + 1])
            alone = m(x[b : b + 1, : n + 1], mask=mask, causal=True, form="expanded")
            torch.testing.assert_close(got[b, 0], alone[0, -1], atol=1e-12, rtol=0)


def test_a_flash_layout_cache_through_a_block_table() -> None:
    """flash-attn's ``(blocks, page, Hkv, D)`` pages named by a block table in any order (what
    ``flash_attn_with_kvcache`` reads) as a view, with ``key_indices & causal``."""
    g = torch.Generator().manual_seed(2)
    k_cache = torch.randn(10, 4, 2, 8, generator=g, dtype=F64)
    v_cache = torch.randn(10, 4, 2, 8, generator=g, dtype=F64)
    table = torch.tensor([[7, 2, 9], [0, 5, -1]], dtype=torch.int32)
    view = CacheView(k_cache.permute(0, 2, 1, 3), v_cache.permute(0, 2, 1, 3),
                     kv_range=((0, 11), (0, 6)), block_table=table)  # fmt: skip
    q = torch.randn(2, 4, 2, 8, dtype=F64)
    idx = selection(2, 2, 2, 4, 11, seed=3)
    out = attnkit.attention(q, view, mask=masks.key_indices(idx), causal=True)
    allowed = [
        dense_selection(idx, n, 4, L) & aligned_band(2, L, -math.inf, 0)
        for n, L in enumerate((11, 6))
    ]
    keys = []
    for n, length in enumerate((11, 6)):
        pages = [p for p in table[n].tolist() if p >= 0]
        k = torch.cat([k_cache[p] for p in pages])[:length].transpose(0, 1)[None]
        v = torch.cat([v_cache[p] for p in pages])[:length].transpose(0, 1)[None]
        keys.append((k, v))
    want, _ = reference_rows(q, keys, allowed, [2, 2])
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


def test_a_bool_tensor_mask_on_a_paged_cache_runs_on_each_rows_keys() -> None:
    """Any other mask read at (query, key position), a bool tensor ``(N, H, Tq, Tk)``: each row's
    keys gathered, its rows of the tensor, and explain() says so."""
    view = paged_view([5, 9])
    q = torch.randn(2, 4, 1, 8, dtype=F64)
    dense = torch.rand(2, 4, 1, 9, generator=torch.Generator().manual_seed(1)) < 0.5
    out = attnkit.attention(q, view, mask=dense)
    allowed = [dense[n : n + 1, :, :, :L] for n, L in enumerate((5, 9))]
    want, _ = reference_rows(q, row_keys(view), allowed, [1, 1])
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    assert "each row's keys gathered from the cache" in str(attnkit.explain(q, view, mask=dense))


def test_masks_that_say_which_keys_exist_are_refused_with_their_names() -> None:
    cache = attnkit.PagedKVCache(num_blocks=4, page_size=4, num_kv_heads=1, head_dim=8, max_seqs=2)
    q, k = torch.randn(2, 2, 1, 8), torch.randn(2, 1, 1, 8)
    with pytest.raises(ValueError, match=r"key_indices\(\), block_indices\(\).*got key_padding"):
        cache.attention(q, k, k, mask=masks.key_padding(torch.tensor([1, 1])))
    assert cache.lengths == [0, 0]


def test_rows_that_start_past_0_read_positions_of_their_pages() -> None:
    """Rows whose keys start past 0 (left padding, ``cache_leftpad``) on a contiguous cache:
    positions are those of the row's pages, entries before its start ignored; the gather and
    the reference's rows agree."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 2, 12, 8, generator=g, dtype=F64)
    v = torch.randn(2, 2, 12, 8, generator=g, dtype=F64)
    view = CacheView(k, v, kv_range=((3, 10), (0, 6)))
    q = torch.randn(2, 4, 2, 8, dtype=F64)
    idx = selection(2, 2, 2, 5, 10, seed=11)
    mask = masks.key_indices(idx) & masks.causal()
    out, lse = attnkit.attention(q, view, mask=mask, return_lse=True)
    want = attnkit.attention(q, view, mask=mask, return_lse=True, backend="reference")
    torch.testing.assert_close((out, lse), want, atol=1e-12, rtol=0)
    # by hand: row 0's keys 3..9, its queries at positions 8 and 9
    sel = dense_selection(idx, 0, 4, 10)[:, :, :, 3:] & aligned_band(2, 7, -math.inf, 0)
    alone = attnkit.attention(q[:1], k[:1, :, 3:10], v[:1, :, 3:10],
                              mask=masks.from_tensor(sel), backend="reference")  # fmt: skip
    torch.testing.assert_close(out[:1], alone, atol=1e-12, rtol=0)


def test_index_masks_anded_with_a_tensor_run_on_each_rows_keys() -> None:
    """``key_indices & a bool tensor``: not a band beside the selection, so each row's keys are
    gathered and the row's own entries of both masks read (explain() says why)."""
    view = paged_view([6, 10])
    q = torch.randn(2, 4, 1, 8, dtype=F64)
    idx = selection(2, 1, 1, 4, 10, seed=12)
    dense = torch.rand(2, 1, 1, 10, generator=torch.Generator().manual_seed(2)) < 0.7
    out = attnkit.attention(q, view, mask=masks.key_indices(idx) & dense)
    allowed = [
        dense_selection(idx, n, 4, L) & dense[n : n + 1, :, :, :L] for n, L in enumerate((6, 10))
    ]
    want, _ = reference_rows(q, row_keys(view), allowed, [1, 1])
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    said = str(attnkit.explain(q, view, mask=masks.key_indices(idx) & dense))
    assert "is not a band of each row's keys" in said


def test_a_quantized_kv_cache_gathers_its_selected_rows_with_their_scales() -> None:
    """An int8 ``KVCache`` whose rows share their keys: the selected rows gathered and
    dequantized, as the reference reads the whole rows dequantized."""
    cache = attnkit.KVCache(2, 16, 2, 8, kv_dtype=torch.int8)
    g = torch.Generator().manual_seed(6)
    cache.update(torch.randn(2, 2, 11, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g))
    view = cache.view()
    q = torch.randn(2, 4, 1, 8)
    mask = masks.key_indices(selection(2, 2, 1, 5, 11, seed=13))
    out = attnkit.attention(q, view, mask=mask, causal=True)
    want = attnkit.attention(q, view, mask=mask, causal=True, backend="reference")
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert "dequantized with their scales" in str(attnkit.explain(q, view, mask=mask))


def test_no_rows_and_no_queries() -> None:
    view = paged_view([4, 7])
    for q in (torch.randn(2, 4, 0, 8, dtype=F64),):
        mask = masks.key_indices(torch.zeros(2, 1, 0, 3, dtype=torch.long))
        out, lse = attnkit.attention(q, view, mask=mask, return_lse=True)
        assert out.shape == (2, 4, 0, 8)
        assert lse.shape == (2, 4, 0)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_latent_decode_over_quantized_pages(kv_dtype: torch.dtype) -> None:
    """An int8/float8 paged latent cache (the values the keys' first columns, read with the
    keys' scales) with ``key_indices``: the absorbed step equals the same step over a
    contiguous cache quantized alike, and the expanded form's over the paged latents (read
    whole, dequantized, expanded per head)."""
    m = latent_module().float()
    x = torch.randn(2, 10, 32)
    idx = causal_selection(2, 1, 10, 4, seed=10)
    with torch.no_grad():
        paged = m.make_paged_cache(num_blocks=8, page_size=4, max_seqs=2, kv_dtype=kv_dtype)
        contiguous = m.make_kv_cache(batch_size=2, max_len=12, kv_dtype=kv_dtype)
        got = []
        for cache in (paged, contiguous):
            m(x[:, :9], causal=True, cache=cache)
            step = masks.key_indices(idx[:, :, 9:])
            got.append(m(x[:, 9:], mask=step, causal=True, cache=cache))
        paged.rewind(9)
        expanded = m(x[:, 9:], mask=step, causal=True, cache=paged, form="expanded")
    torch.testing.assert_close(got[0], got[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0], expanded, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_pages_are_read_as_they_are(dtype: torch.dtype) -> None:
    """bfloat16 and float16 pages (the native kernel reads them as they are, torch's products
    in float32): both within the dtype's tolerance of the float64 reference."""
    cache = attnkit.PagedKVCache(num_blocks=12, page_size=4, num_kv_heads=2, head_dim=8,
                                 max_seqs=2, dtype=dtype)  # fmt: skip
    fill(cache, [6, 13])
    view = cache.view()
    q = torch.randn(2, 4, 2, 8).to(dtype)
    mask = masks.key_indices(selection(2, 2, 2, 5, 13, seed=14)) & masks.causal()
    wide = CacheView(view.k.double(), view.v.double(), view.kv_range, view.block_table)
    want = attnkit.attention(q.double(), wide, mask=mask, backend="reference")
    for backend in ("chunked", attnkit.backends.Chunked(native=False)):
        out = attnkit.attention(q, view, mask=mask, backend=backend)
        assert out.dtype == dtype
        assert_close(out, want)


def test_gradients_reach_the_pages_through_the_gathered_rows() -> None:
    """Pages that need gradients (a cache of trained keys): each page row's gradient is the sum
    over the queries that selected it, as the reference's over the rows gathered whole."""
    base = paged_view([5, 8])
    k = base.k.detach().float().requires_grad_()
    v = base.v.detach().float().requires_grad_()
    view = CacheView(k, v, base.kv_range, base.block_table)
    q = torch.randn(2, 4, 2, 8)
    mask = masks.key_indices(selection(2, 2, 2, 4, 8, seed=15)) & masks.causal()
    out = attnkit.attention(q, view, mask=mask)
    want = attnkit.attention(q, view, mask=mask, backend="reference")
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (k, v), grad)
    expected = torch.autograd.grad(want, (k, v), grad)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert bool(got[0].abs().sum() > 0)


def test_a_prefill_that_selects_more_rows_than_its_rows_hold_reads_each_row_once() -> None:
    """20 queries a row, 8 keys each, over rows of 30 and 40 keys: gathering each query's keys
    would copy 640 rows where the rows hold 140, so each row's keys are gathered once and its
    queries read there by position (explain() says why); the reference's result either way."""
    view = paged_view([30, 40], page=4)
    q = torch.randn(2, 4, 20, 8, dtype=F64)
    idx = selection(2, 1, 20, 8, 40, seed=16)
    mask = masks.key_indices(idx) & masks.causal()
    said = str(attnkit.explain(q, view, mask=mask))
    assert "its 20 queries select 640 rows, more than its rows hold" in said
    out = attnkit.attention(q, view, mask=mask)
    allowed = [
        dense_selection(idx, n, 4, L) & aligned_band(20, L, -math.inf, 0)
        for n, L in enumerate((30, 40))
    ]
    want, _ = reference_rows(q, row_keys(view), allowed, [20, 20])
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
