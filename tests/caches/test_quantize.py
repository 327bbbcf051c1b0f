"""Writing keys and values into a quantized cache (``attnkit.caches._quantize``): each element
within the format's step of the input, scales of the documented shapes, saturation with a given
scale, the arguments refused with their values quoted, and attention over what was written equal
to attention over the dequantized values and near the unquantized one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import KVCache, PagedKVCache, StreamingKVCache, attention, explain, record_dispatch
from attnkit._kernel.cache import IN_PLACE
from attnkit.caches import view as view_module
from attnkit.caches._quantize import FLOAT8, quantize_fp8, quantize_int8
from attnkit.caches.view import CacheView
from attnkit.flash_attn import flash_attn_with_kvcache
from attnkit.masks import key_padding


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 5


def test_int8_elements_lie_within_half_a_step() -> None:
    x = _x(2, 3, 40, 16)
    xq, scale = quantize_int8(x)
    assert xq.dtype == torch.int8
    assert scale.shape == (2, 3, 40, 1)
    assert scale.dtype == torch.float32
    err = (xq.float() * scale - x).abs()
    assert bool((err <= scale / 2 * (1 + 1e-6)).all())
    # each row's largest magnitude is the format's largest number
    assert torch.equal(xq.abs().amax(-1), torch.full((2, 3, 40), 127, dtype=torch.int8))


def test_int8_rows_of_zeros_stay_zero() -> None:
    x = _x(1, 2, 5, 8)
    x[0, 1, 3] = 0
    xq, scale = quantize_int8(x)
    assert scale[0, 1, 3].item() == 1.0
    assert not xq[0, 1, 3].any()


@pytest.mark.parametrize("dtype", FLOAT8)
def test_float8_elements_within_the_formats_rounding(dtype: torch.dtype) -> None:
    x = _x(2, 3, 40, 16)
    xq, scale = quantize_fp8(x, dtype)
    assert xq.dtype == dtype
    assert scale.shape == (2, 3, 1, 1)
    back = xq.float() * scale
    normal = x.abs() >= torch.finfo(dtype).smallest_normal * scale
    rel = ((back - x).abs() / x.abs())[normal]
    bound = 2.0**-4 if dtype == torch.float8_e4m3fn else 2.0**-3
    assert float(rel.max()) <= bound
    assert float((xq.float().abs().amax((-2, -1)) - torch.finfo(dtype).max).abs().max()) == 0


@pytest.mark.parametrize("dtype", FLOAT8)
def test_float8_with_the_caches_scale_saturates(dtype: torch.dtype) -> None:
    x = _x(1, 2, 10, 8)
    _, scale = quantize_fp8(x[..., :5, :], dtype)
    later = x[..., 5:, :] * 100  # far beyond the first tokens' range
    xq, same = quantize_fp8(later, dtype, scale=scale)
    assert torch.equal(same, scale)
    assert not xq.float().isnan().any()
    assert float(xq.float().abs().max()) == torch.finfo(dtype).max


def test_int8_a_token_holding_nan_or_inf_reads_as_nan_and_leaves_the_others_alone() -> None:
    # int8 has no NaN or inf: the token's scale carries it, so it reaches the outputs as NaN
    # (attnkit's non-finite policy) instead of a NaN read as 0 and a row rounded at scale 1
    x = _x(1, 2, 4, 8)
    bad = x.clone()
    bad[0, 0, 1, 3] = float("nan")
    bad[0, 1, 2, 5] = float("inf")
    xq, scale = quantize_int8(bad)
    want_q, want_scale = quantize_int8(x)
    hit = torch.zeros(1, 2, 4, 1, dtype=torch.bool)
    hit[0, 0, 1] = hit[0, 1, 2] = True
    assert bool(scale[hit].isnan().all())
    assert torch.equal(scale[~hit], want_scale[~hit])  # every other token as without them
    assert torch.equal(xq[~hit.expand_as(xq)], want_q[~hit.expand_as(want_q)])
    back = xq.float() * scale
    assert bool(back[hit.expand_as(back)].isnan().all())
    assert not back[~hit.expand_as(back)].isnan().any()


@pytest.mark.parametrize("dtype", FLOAT8)
def test_float8_nan_and_inf_set_no_scale_and_stay_non_finite(dtype: torch.dtype) -> None:
    x = _x(1, 2, 6, 8)
    bad = x.clone()
    bad[0, 0, 1, 3] = float("nan")
    bad[0, 1, 2, 5] = float("inf")
    bad[0, 1, 4, 0] = -float("inf")
    xq, scale = quantize_fp8(bad, dtype)
    finite = bad.isfinite()
    want_q, want_scale = quantize_fp8(x.where(finite, 0.0), dtype)
    assert torch.equal(scale, want_scale)  # the finite elements' range, not 1 or inf
    assert torch.equal(_bits(xq)[finite], _bits(want_q)[finite])
    back = xq.float() * scale
    assert bool(back[0, 0, 1, 3].isnan())
    if dtype == torch.float8_e5m2:  # inf where the format has it
        assert back[0, 1, 2, 5].item() == float("inf")
        assert back[0, 1, 4, 0].item() == -float("inf")
    else:  # e4m3fn has none: NaN, never its largest number
        assert bool(back[0, 1, 2, 5].isnan())
        assert bool(back[0, 1, 4, 0].isnan())
    # later tokens with the cache's scale: an inf is no saturated number either
    later, _ = quantize_fp8(bad[..., 2:3, :], dtype, scale=scale)
    assert not later.float()[0, 1, 0, 5].isfinite()


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_nan_key_in_a_quantized_cache_reaches_exactly_the_queries_that_see_it(
    kv_dtype: torch.dtype,
) -> None:
    g = torch.Generator().manual_seed(3)
    cache = KVCache(2, 16, 2, 8, kv_dtype=kv_dtype)
    k, v = (torch.randn(2, 2, 6, 8, generator=g) for _ in "kv")
    k[1, 0, 4, 2] = float("nan")  # row 1, key/value head 0, token 4
    q = torch.randn(2, 4, 6, 8, generator=g)
    out = attention(q, cache.stage_call(q, k, v), causal=True)
    nan = out.isnan().any(-1)  # (B, H, Tq)
    want = torch.zeros(2, 4, 6, dtype=torch.bool)
    want[1, :2, 4:] = True  # the query heads of KV head 0 from token 4 on
    assert torch.equal(nan, want)


def test_arguments_refused_with_their_values() -> None:
    with pytest.raises(TypeError, match="x must be a float16, bfloat16, float32 or float64 tensor, "
                       "got int8"):  # fmt: skip
        quantize_int8(torch.zeros(2, 3, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., Hkv, T, D\), got \(5\)"):
        quantize_int8(torch.zeros(5))
    with pytest.raises(TypeError, match=r"dtype must be torch\.float8_e4m3fn or "
                       r"torch\.float8_e5m2, got int8"):  # fmt: skip
        quantize_fp8(torch.zeros(1, 2, 3), torch.int8)
    with pytest.raises(ValueError, match=r"scale must be broadcastable to \(\.\.\., Hkv, 1, 1\) = "
                       r"\(1, 2, 1, 1\), got \(3, 1, 1\)"):  # fmt: skip
        quantize_fp8(torch.zeros(1, 2, 4, 3), scale=torch.ones(3, 1, 1))


@pytest.mark.parametrize("kind", ["int8", "e4m3fn", "e5m2"])
def test_attention_over_a_written_cache(kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 1, 32, generator=g)
    k, v = (torch.randn(2, 2, 200, 32, generator=g) for _ in "kv")
    if kind == "int8":
        (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    else:
        dtype = torch.float8_e4m3fn if kind == "e4m3fn" else torch.float8_e5m2
        (kq, ks), (vq, vs) = quantize_fp8(k, dtype), quantize_fp8(v, dtype)
    out = attention(q, kq, vq, k_scale=ks, v_scale=vs, causal=True)
    deq = attention(
        q.double(), kq.double() * ks, vq.double() * vs, causal=True, backend="reference"
    )
    exact = attention(q.double(), k.double(), v.double(), causal=True, backend="reference")
    torch.testing.assert_close(out.double(), deq, rtol=1e-5, atol=1e-6)
    err = float((out.double() - exact).norm() / exact.norm())
    assert err < {"int8": 2e-2, "e4m3fn": 6e-2, "e5m2": 1.2e-1}[kind]


# ---------------------------------------------------------------------------------------------
# Quantized caches: KVCache and PagedKVCache with kv_dtype=, read in place by attention()

KV_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# relative error of a decode step against the unquantized cache, on random data
FORMAT_ERROR = {torch.int8: 2e-2, torch.float8_e4m3fn: 8e-2, torch.float8_e5m2: 1.5e-1}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor's bytes, comparable with torch.equal whatever its dtype (float8 included)."""
    return None if t is None else t.detach().clone().contiguous().view(torch.uint8)


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def _dense_kv(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The held and staged keys and values of a KVCache, dequantized by hand in float64."""
    end = cache.length + cache._staged
    ks = cache.k_scale.expand(*cache.k_cache.shape[:3], 1)
    vs = cache.v_scale.expand(*cache.v_cache.shape[:3], 1)
    k = cache.k_cache[:, :, :end].double() * ks[:, :, :end].double()
    v = cache.v_cache[:, :, :end].double() * vs[:, :, :end].double()
    return k, v


def _paged_row(cache: PagedKVCache, b: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``b``'s first ``end`` keys and values ``(1, Hkv, end, D)``, dequantized by hand
    in float64 through its pages."""
    kp, vp = cache.token_major()  # (X, page, Hkv, D)
    size = cache.page_size
    pages = cache._pages[b]
    rows = []
    for pages_, scales in ((kp, cache.k_scales), (vp, cache.v_scales)):
        tokens = []
        for t in range(end):
            page, at = pages[t // size], t % size
            s = scales[page, :, at if scales.size(2) > 1 else 0, 0]  # (Hkv,)
            tokens.append(pages_[page, at].double() * s.double()[:, None])
        rows.append(torch.stack(tokens, 1)[None])  # (1, Hkv, end, D)
    return rows[0], rows[1]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_kv_cache_decodes_in_place_equal_to_the_dequantized_formula(
    kv_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(1)
    b, h, hkv, d = 2, 8, 2, 32
    cache = KVCache(b, 64, hkv, d, kv_dtype=kv_dtype)
    plain = KVCache(b, 64, hkv, d)
    prompt = torch.randn(b, hkv, 20, d, generator=g), torch.randn(b, hkv, 20, d, generator=g)
    cache.update(*prompt)
    plain.update(*prompt)
    # no dequantized copy of the cache on the in-place path
    monkeypatch.setattr(view_module, "dequantize", _no_copy)
    for step in range(3):
        q = torch.randn(b, h, 1, d, generator=g)
        k, v = torch.randn(b, hkv, 1, d, generator=g), torch.randn(b, hkv, 1, d, generator=g)
        with record_dispatch() as seen:
            out = attention(q, cache.stage_call(q, k, v), causal=True)
        assert seen[0].chosen == "chunked"
        assert seen[0].kernel == IN_PLACE
        keys, values = _dense_kv(cache)
        exact = attention(q.double(), keys, values, causal=True, backend="reference")
        assert _rel(out, exact) <= 1e-5, step
        unquantized = attention(q, plain.stage_call(q, k, v), causal=True)
        assert _rel(out, unquantized) <= FORMAT_ERROR[kv_dtype], step
        cache.commit()
        plain.commit()
    assert cache.k_cache.dtype == kv_dtype
    assert cache.dtype == torch.float32


def _no_copy(*args: object) -> torch.Tensor:
    raise AssertionError("the cache was dequantized into a copy")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("layout", ["flash", "vllm"])
@pytest.mark.parametrize("page", [3, 16])
def test_paged_cache_decodes_in_place_equal_to_the_dequantized_formula(
    kv_dtype: torch.dtype, layout: str, page: int
) -> None:
    g = torch.Generator().manual_seed(2)
    h, hkv, d = 4, 2, 16
    kw = {"max_seqs": 3, "layout": layout}
    cache = PagedKVCache(64, page, hkv, d, kv_dtype=kv_dtype, **kw)  # type: ignore[arg-type]
    plain = PagedKVCache(64, page, hkv, d, **kw)  # type: ignore[arg-type]
    prompt = torch.randn(3, hkv, 21, d, generator=g), torch.randn(3, hkv, 21, d, generator=g)
    for c in (cache, plain):
        c.schedule([21, 5, 17])  # rows that end inside a page
        c.stage(*prompt)
        c.commit()
    for step in range(2):
        q = torch.randn(3, h, 1, d, generator=g)
        k, v = torch.randn(3, hkv, 1, d, generator=g), torch.randn(3, hkv, 1, d, generator=g)
        with record_dispatch() as seen:
            out = attention(q, cache.stage_call(q, k, v, causal=True), causal=True)
        assert seen[0].kernel == IN_PLACE
        for row, n in enumerate(cache.lengths):
            keys, values = _paged_row(cache, row, n + 1)
            exact = attention(q[row : row + 1].double(), keys, values, backend="reference")
            assert _rel(out[row : row + 1], exact) <= 1e-5, (step, row)
        unquantized = attention(q, plain.stage_call(q, k, v, causal=True), causal=True)
        assert _rel(out, unquantized) <= FORMAT_ERROR[kv_dtype]
        cache.commit()
        plain.commit()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_refused_write_leaves_a_quantized_cache_bit_identical(kv_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    cache = KVCache(2, 8, 2, 4, kv_dtype=kv_dtype)

    def state() -> list[torch.Tensor | None]:
        return [_bits(t) for t in (cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale)]

    before = state()
    with pytest.raises(ValueError, match="overflow"):  # a first write, which sets the scales
        cache.update(torch.randn(2, 2, 9, 4, generator=g) * 100, torch.randn(2, 2, 9, 4))
    assert _same(state(), before)
    assert cache.length == 0
    cache.update(torch.randn(2, 2, 5, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g))
    before = state()
    with pytest.raises(ValueError, match="overflow"):
        cache.update(torch.randn(2, 2, 4, 4, generator=g), torch.randn(2, 2, 4, 4, generator=g))
    with pytest.raises(TypeError, match="cache's dtype"):
        cache.update(torch.randn(2, 2, 1, 4).double(), torch.randn(2, 2, 1, 4).double())
    assert _same(state(), before)
    assert cache.length == 5

    paged = PagedKVCache(3, 2, 2, 4, max_seqs=2, kv_dtype=kv_dtype)
    paged.stage(torch.randn(2, 2, 2, 4, generator=g), torch.randn(2, 2, 2, 4, generator=g))
    paged.commit()

    def pstate() -> list[torch.Tensor | None]:
        return [_bits(t) for t in (paged.k_pages, paged.v_pages, paged.k_scales, paged.v_scales)]

    before = pstate()
    with pytest.raises(ValueError, match="out of pages"):
        paged.stage(torch.randn(2, 2, 3, 4, generator=g), torch.randn(2, 2, 3, 4, generator=g))
    q = torch.randn(2, 2, 1, 4)
    with pytest.raises(ValueError, match="mask"):
        paged.stage_call(q, q[:, :, :, :] * 1, q * 1, mask=key_padding([1, 1]))
    assert _same(pstate(), before)
    assert paged.lengths == [2, 2]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_keep_carries_the_scales_with_the_tokens(kv_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    cache = KVCache(1, 16, 2, 8, kv_dtype=kv_dtype)
    x = torch.randn(1, 2, 10, 8, generator=g) * torch.linspace(0.1, 10, 10)[:, None]
    cache.update(x, -x)
    keys, values = _dense_kv(cache)
    index = torch.tensor([[[7, 1, 4], [0, 9, 5]]])
    cache.keep(index)
    kept = index.sort(-1).values[..., None].expand(-1, -1, -1, 8)
    after = _dense_kv(cache)
    assert torch.equal(after[0], keys.gather(2, kept))
    assert torch.equal(after[1], values.gather(2, kept))

    paged = PagedKVCache(8, 3, 2, 8, max_seqs=1, kv_dtype=kv_dtype)
    paged.stage(x, -x)
    paged.commit()
    keys, values = _paged_row(paged, 0, 10)
    paged.keep(0, index[0])
    after = _paged_row(paged, 0, 3)
    assert torch.equal(after[0], keys.gather(2, kept))
    assert torch.equal(after[1], values.gather(2, kept))


@pytest.mark.parametrize("kv_dtype", FLOAT8)
@pytest.mark.parametrize("paged", [False, True])
def test_flash_attn_with_kvcache_reads_float8_with_descale(
    kv_dtype: torch.dtype, paged: bool
) -> None:
    g = torch.Generator().manual_seed(5)
    b, h, hkv, d, cap, page = 2, 4, 2, 16, 32, 4
    k_descale = torch.rand(b, hkv, generator=g) + 0.05
    v_descale = torch.rand(b, hkv, generator=g) + 0.05
    kc = (torch.randn(b, cap, hkv, d, generator=g) * 3).to(kv_dtype)
    vc = (torch.randn(b, cap, hkv, d, generator=g) * 3).to(kv_dtype)
    q = torch.randn(b, 1, h, d, generator=g)
    k, v = torch.randn(b, 1, hkv, d, generator=g), torch.randn(b, 1, hkv, d, generator=g)
    seqlens = torch.tensor([5, 11])
    kw = {"cache_seqlens": seqlens, "causal": True, "k_descale": k_descale, "v_descale": v_descale}
    if paged:  # each row's pages in reverse order in the pool
        pages = cap // page
        table = torch.stack([torch.arange(pages) * b + r for r in range(b)]).flip(1).int()
        kp = torch.empty(b * pages, page, hkv, d, dtype=kv_dtype)
        vp = torch.empty_like(kp)
        kp[table.long()] = kc.view(b, pages, page, hkv, d)
        vp[table.long()] = vc.view(b, pages, page, hkv, d)
        with record_dispatch() as seen:
            out = flash_attn_with_kvcache(q, kp, vp, k, v, block_table=table, **kw)
        kc = kp[table.long()].flatten(1, 2)
        vc = vp[table.long()].flatten(1, 2)
    else:
        with record_dispatch() as seen:
            out = flash_attn_with_kvcache(q, kc, vc, k, v, **kw)
    assert seen[0].kernel == IN_PLACE
    for r in range(b):
        n = int(seqlens[r]) + 1
        keys = kc[r, :n].double() * k_descale[r].double()[:, None]  # (n, Hkv, D)
        values = vc[r, :n].double() * v_descale[r].double()[:, None]
        # the new token was quantized with the row's descale: within the format's step
        assert _rel(keys[-1], k[r, 0]) <= 0.1
        exact = attention(
            q[r : r + 1].transpose(1, 2).double(),
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            backend="reference",
        )
        assert _rel(out[r : r + 1].transpose(1, 2), exact) <= 1e-5


@settings(max_examples=25, deadline=None)
@given(
    page=st.integers(1, 9),
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=3),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
    kv_dtype=st.sampled_from(KV_DTYPES),
    layout=st.sampled_from(["flash", "vllm"]),
    seed=st.integers(0, 2**16),
)
def test_fuzz_quantized_paged_cache(
    page: int, lengths: list[int], magnitude: float, kv_dtype: torch.dtype, layout: str, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    rows, hkv, d = len(lengths), 2, 8
    cache = PagedKVCache(
        100,
        page,
        hkv,
        d,
        max_seqs=rows,
        layout=layout,
        kv_dtype=kv_dtype,  # type: ignore[arg-type]
    )
    longest = max(lengths)
    if longest:
        cache.schedule(lengths)
        x = torch.randn(rows, hkv, longest, d, generator=g) * magnitude
        cache.stage(x, x.flip(-1))
        cache.commit()
    q = torch.randn(rows, 4, 1, d, generator=g)
    k = torch.randn(rows, hkv, 1, d, generator=g) * magnitude
    out = attention(q, cache.stage_call(q, k, -k, causal=True), causal=True)
    for row, n in enumerate(cache.lengths):
        keys, values = _paged_row(cache, row, n + 1)
        exact = attention(q[row : row + 1].double(), keys, values, backend="reference")
        got = out[row : row + 1].double()
        bound = 1e-5 * exact.norm() + _rounded_scores(q[row : row + 1], keys, values, exact)
        assert (got - exact).norm() <= bound


def _rounded_scores(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, exact: torch.Tensor
) -> torch.Tensor:
    """What float32 scores may move an output by, to first order: each score s_j = q . k_j / sqrt(D)
    summed in float32 is off by up to (D + 2) u sum_i |q_i k_ji| / sqrt(D) (u = 2^-24), which
    moves the output by sum_j p_j |ds_j| |v_j - out|. Next to 1e-5 relative it matters only where
    scores are large: with keys of magnitude 300 two near-tied weights of scores near 1,000 move
    the output by 3e-5 relative, the float32 reference's own rounding as much as the kernel's."""
    g = q.size(1) // keys.size(1)
    k, v = (t.repeat_interleave(g, dim=1) for t in (keys, values))
    scale = q.size(-1) ** -0.5
    p = torch.softmax(q.double() @ k.transpose(-1, -2) * scale, dim=-1)
    ds = (q.size(-1) + 2) * 2.0**-24 * (q.double().abs() @ k.abs().transpose(-1, -2)) * scale
    return ((p * ds).unsqueeze(-1) * (v.unsqueeze(2) - exact.unsqueeze(3)).abs()).sum(3).norm()


def test_a_view_takes_scales_with_quantized_pages_only() -> None:
    pages = torch.zeros(2, 2, 8, 4)
    with pytest.raises(TypeError, match="pages of float32 take no k_scale or v_scale"):
        CacheView(pages, pages, [(0, 3)] * 2, k_scale=torch.ones(2, 2, 8, 1))
    quantized = pages.to(torch.int8)
    with pytest.raises(TypeError, match=r"int8 take k_scale and v_scale \(both\)"):
        CacheView(quantized, quantized, [(0, 3)] * 2)
    one = torch.ones(2, 2, 8, 1)
    with pytest.raises(ValueError, match=r"k_scale must be broadcastable .* \(2, 2, 8, 1\)"):
        CacheView(quantized, quantized, [(0, 3)] * 2, k_scale=one[:, :, :3], v_scale=one)
    view = CacheView(quantized, quantized, [(0, 3)] * 2, k_scale=torch.ones(2, 1, 1), v_scale=one)
    assert view.k_scale is not None
    assert view.k_scale.shape == (2, 2, 8, 1)  # a scale per head, expanded


def test_float64_queries_and_gpus_dequantize_a_quantized_view() -> None:
    g = torch.Generator().manual_seed(6)
    cache = KVCache(2, 16, 2, 8, dtype=torch.float64, kv_dtype=torch.int8)
    q = torch.randn(2, 4, 1, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))
    cache.update(k, v)
    view = cache.view()
    with record_dispatch() as seen:
        out = attention(q, view, causal=True)
    assert seen[0].kernel != IN_PLACE  # float64 queries: the rows gathered, dequantized
    keys, values = _dense_kv(cache)
    exact = attention(q, keys, values, backend="reference")
    assert _rel(out, exact) <= 1e-6  # (the keys are k.float() * k_scale: float32 products)
    # on a GPU the backends that read float pages as they are decline int8 ones
    said = str(explain(q.float(), cache.view(), causal=True, device="cuda"))
    assert "sdpa       cannot: reads no int8/float8 cache view" in said


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_slot_writes_quantize_into_the_pool(kv_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    cache = PagedKVCache(4, 4, 2, 8, max_seqs=1, layout="vllm", kv_dtype=kv_dtype)
    x = torch.randn(1, 2, 6, 8, generator=g)
    cache.stage(x, -x)  # sets a float8 sequence's scale on its pages
    cache.commit()
    new = torch.randn(3, 2, 8, generator=g) * 0.5
    cache.write(new, -new, torch.tensor([6, -1, 7]))  # vLLM's reshape_and_cache, -1 skipped
    keys, values = _paged_row(cache, 0, 8)
    step = {torch.int8: 1 / 127, torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}[kv_dtype]
    for slot, token in ((6, 0), (7, 2)):
        got = keys[0, :, slot].float()
        assert (got - new[token]).abs().max() <= step * new[token].abs().max() * 1.01
        assert torch.equal(values[0, :, slot], -keys[0, :, slot])
    q = torch.randn(1, 4, 1, 8, generator=g)
    # the 8 tokens written, through the pool's pages and scales (write() holds no tokens)
    out = attention(q, dataclasses.replace(cache.view(), kv_range=((0, 8),)), causal=True)
    exact = attention(q.double(), keys, values, backend="reference")
    assert _rel(out, exact) <= 1e-5


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_refused_keep_leaves_a_quantized_cache_and_its_scales_bit_identical(
    kv_dtype: torch.dtype,
) -> None:
    # keep() moves each token's scale with it: every index is checked before anything moves, so
    # a refused keep leaves the pages and the scales as they were, and a keep after it works.
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 2, 6, 4, generator=g) * torch.linspace(0.1, 10, 6)[:, None]
    cache = KVCache(2, 8, 2, 4, kv_dtype=kv_dtype)
    cache.update(x, -x)

    def state() -> list[torch.Tensor | None]:
        return [_bits(t) for t in (cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale)]

    before = state()
    for bad, match in [
        (torch.tensor([[[0, 6], [1, 2]], [[0, 1], [2, 3]]]), r"got 6 in row \(0, 0\)"),
        (torch.tensor([[[0, 1], [1, 1]], [[0, 1], [2, 3]]]), r"row \(0, 1\) keeps token 1 twice"),
        (torch.tensor([[[0, 1]]]), r"shape \(2, 2, K\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            cache.keep(bad)
        assert _same(state(), before)
        assert cache.length == 6
    keys, _ = _dense_kv(cache)
    cache.keep(torch.tensor([[[5, 0], [3, 1]], [[2, 4], [0, 5]]]))
    assert torch.equal(_dense_kv(cache)[0][0, 0], keys[0, 0, [0, 5]])

    paged = PagedKVCache(8, 3, 2, 4, max_seqs=1, kv_dtype=kv_dtype)
    paged.stage(x[:1], -x[:1])
    paged.commit()

    def pstate() -> list[torch.Tensor | None]:
        return [_bits(t) for t in (paged.k_pages, paged.v_pages, paged.k_scales, paged.v_scales)]

    before = pstate()
    with pytest.raises(ValueError, match=r"got 6 in row \(0,\)"):
        paged.keep(0, torch.tensor([[0, 6], [1, 2]]))
    with pytest.raises(ValueError, match=r"row \(1,\) keeps token 2 twice"):
        paged.keep(0, torch.tensor([[0, 1], [2, 2]]))
    assert _same(pstate(), before)
    assert paged.lengths == [6]


@pytest.mark.parametrize("wrong", [torch.int8, torch.float8_e4m3fn, torch.int64])
def test_a_caches_dtype_is_a_float_dtype_and_quantized_storage_is_kv_dtype(
    wrong: torch.dtype,
) -> None:
    # dtype=torch.int8 made a store of int8 with no scales, whose tokens were then refused as
    # "not the cache's dtype"; .to(dtype=torch.int8) turned a float cache into one.
    hint = "pass kv_dtype=" if wrong != torch.int64 else ""
    want = rf"dtype must be torch\.float16, .* got {str(wrong)[6:]}.*{hint}"
    makers = [
        lambda: KVCache(1, 8, 2, 4, dtype=wrong),
        lambda: PagedKVCache(4, 2, 2, 4, max_seqs=1, dtype=wrong, kv_dtype=torch.int8),
        lambda: StreamingKVCache(1, 2, 4, sink_tokens=1, window=2, dtype=wrong),
    ]
    for make in makers:
        with pytest.raises(TypeError, match=want):
            make()
    for cache in (
        KVCache(1, 8, 2, 4),
        StreamingKVCache(1, 2, 4, sink_tokens=1, window=2, kv_dtype=torch.int8),
    ):
        before = (cache.k_cache.dtype, cache.dtype)
        with pytest.raises(TypeError, match=want):
            cache.to(dtype=wrong)
        assert (cache.k_cache.dtype, cache.dtype) == before


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
def test_a_write_of_no_token_into_an_empty_cache_sets_no_scale(kv_dtype: torch.dtype) -> None:
    # A float8 cache's first write takes its scale from the tokens; a write of none (a call of
    # T = 0) raised torch's 'amax(): Expected reduction dim -2 to have non-zero size'.
    from attnkit import KVCache

    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, 3, 8, generator=g) * 50 for _ in range(2))
    once = KVCache(2, 8, 2, 8, kv_dtype=kv_dtype)
    once.update(k, v)
    after_none = KVCache(2, 8, 2, 8, kv_dtype=kv_dtype)
    keys, values = after_none.update(k[:, :, :0], v[:, :, :0])
    assert keys.shape == values.shape == (2, 2, 0, 8)
    after_none.update(k, v)
    for got, want in zip(after_none.view().dense(), once.view().dense(), strict=True):
        assert torch.equal(got, want)
    _, scale = quantize_fp8(torch.zeros(2, 3, 0, 8))
    assert torch.equal(scale, torch.ones(2, 3, 1, 1))
