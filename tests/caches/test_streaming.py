"""StreamingKVCache: attention over exactly the sinks and the window, in constant memory."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit._kernel.cache import IN_PLACE
from attnkit.caches import view as view_module
from attnkit.caches._quantize import quantize_fp8, quantize_int8
from attnkit.caches.streaming import StreamingKVCache

F64 = torch.float64


def whole_sequence(q, k, v, sinks: int, window: int):
    """Every position's output over the whole sequence with the mask sinks | window (float64
    reference): what a streaming cache must give, token by token."""
    t = k.size(-2)
    keep = masks.sliding_window(window - 1) | (
        masks.causal() & masks.key_padding([min(sinks, t)] * k.size(0))
    )
    assert t == q.size(-2)
    return attnkit.attention(q, k, v, mask=keep, backend="reference")


def randn(*shape, dtype=F64):
    return torch.randn(*shape, dtype=dtype, generator=GEN)


GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize(
    ("sinks", "window", "chunks"),
    [
        (2, 5, [1] * 40),  # decoding far past S + W
        (0, 4, [1] * 20),  # a window alone
        (3, 6, [7, 1, 1, 9, 1, 12, 1, 1]),  # prompts and chunks between steps
        (4, 3, [2, 2, 1, 5, 1]),  # a chunk longer than the window
        (5, 8, [3, 1, 1, 1, 20]),  # the sinks filled across calls
    ],
)
def test_streaming_equals_attention_over_exactly_the_kept_tokens(sinks, window, chunks) -> None:
    b, h, hkv, d = 2, 4, 2, 8
    n = sum(chunks)
    q, k, v = randn(b, h, n, d), randn(b, hkv, n, d), randn(b, hkv, n, d)
    want = whole_sequence(q, k, v, sinks, window)
    cache = StreamingKVCache(b, hkv, d, sink_tokens=sinks, window=window, dtype=F64)
    storage = cache.k_cache.data_ptr()
    at = 0
    with torch.no_grad():
        for t in chunks:
            out, lse = cache.attention(
                q[:, :, at : at + t], k[:, :, at : at + t], v[:, :, at : at + t]
            )
            torch.testing.assert_close(out, want[:, :, at : at + t], atol=1e-12, rtol=1e-12)
            assert torch.isfinite(lse).all()
            at += t
    assert cache.position == n
    assert cache.length == min(n, sinks + window)
    assert cache.k_cache.data_ptr() == storage  # the same memory all along
    assert cache.k_cache.size(2) == sinks + window


def test_the_native_kernel_serves_a_step_with_the_cache_in_place() -> None:
    cache = StreamingKVCache(1, 2, 16, sink_tokens=4, window=32)
    with torch.no_grad(), attnkit.record_dispatch() as record:
        for _ in range(50):
            x = torch.randn(1, 2, 1, 16)
            cache.attention(torch.randn(1, 4, 1, 16), x, x)
    assert len(record) == 50
    assert {(d.served_by, d.kernel) for d in record} == {("chunked", "native kernel")}
    assert cache.length == 36


def test_a_refused_call_changes_nothing_a_later_query_sees() -> None:
    sinks, window, b, d = 2, 4, 1, 8
    q, k, v = randn(b, 2, 30, d), randn(b, 2, 30, d), randn(b, 2, 30, d)
    want = whole_sequence(q, k, v, sinks, window)
    cache = StreamingKVCache(b, 2, d, sink_tokens=sinks, window=window, dtype=F64)
    with torch.no_grad():
        cache.attention(q[:, :, :10], k[:, :, :10], v[:, :, :10])
        held = cache.k_cache.clone()
        with pytest.raises(ValueError, match="softcap"):
            cache.attention(q[:, :, 10:13], k[:, :, 10:13], v[:, :, 10:13], softcap=-1.0)
        assert torch.equal(cache.k_cache, held)  # a chunk writes only at commit
        assert cache.position == 10
        with pytest.raises(ValueError, match="softcap"):
            cache.attention(q[:, :, 10:11], k[:, :, 10:11], v[:, :, 10:11], softcap=-1.0)
        assert cache.position == 10
        out, _ = cache.attention(q[:, :, 10:], k[:, :, 10:], v[:, :, 10:])
    torch.testing.assert_close(out, want[:, :, 10:], atol=1e-12, rtol=1e-12)


def test_what_the_cache_refuses() -> None:
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        StreamingKVCache(1, 1, 8, sink_tokens=4, window=0)
    with pytest.raises(ValueError, match="sink_tokens must be >= 0, got -1"):
        StreamingKVCache(1, 1, 8, sink_tokens=-1, window=4)
    cache = StreamingKVCache(2, 1, 8, sink_tokens=1, window=4)
    with pytest.raises(ValueError, match=r"\(B, Hkv, T, Dk\) = \(2, 1, 3, 8\)"):
        cache.update(torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8))
    with pytest.raises(TypeError, match="cache's dtype"):
        cache.update(torch.randn(2, 1, 3, 8, dtype=F64), torch.randn(2, 1, 3, 8, dtype=F64))
    with pytest.raises(ValueError, match="no token"):
        cache.update(torch.randn(2, 1, 0, 8), torch.randn(2, 1, 0, 8))
    x = torch.randn(2, 1, 1, 8, requires_grad=True)
    with pytest.raises(ValueError, match="inference"):
        cache.update(x, x)
    assert cache.position == 0
    assert "sink_tokens=1, window=4, position=0, length=0" in repr(cache)


def test_reset_and_update_return_what_to_attend() -> None:
    cache = StreamingKVCache(1, 1, 4, sink_tokens=1, window=2, dtype=F64)
    k = torch.arange(5, dtype=F64).view(1, 1, 5, 1).expand(1, 1, 5, 4)
    keys, _, mask = cache.update(k, k)
    assert mask is not None
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]  # a first chunk: itself, in order
    keys, _, mask = cache.update(k[:, :, :1] + 5, k[:, :, :1] + 5)
    assert mask is None
    assert sorted(keys[0, 0, :, 0].tolist()) == [0, 4, 5]  # sink 0, the window 4 and 5
    cache.reset()
    assert cache.position == 0
    assert cache.length == 0


@settings(max_examples=25, deadline=None)
@given(
    sinks=st.integers(0, 4),
    window=st.integers(1, 6),
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    heads=st.sampled_from([(1, 1), (4, 2), (3, 3)]),
)
def test_streaming_fuzz(sinks: int, window: int, chunks: list[int], heads: tuple[int, int]) -> None:
    h, hkv = heads
    n = sum(chunks)
    q, k, v = randn(1, h, n, 4), randn(1, hkv, n, 4), randn(1, hkv, n, 4)
    want = whole_sequence(q, k, v, sinks, window)
    cache = StreamingKVCache(1, hkv, 4, sink_tokens=sinks, window=window, dtype=F64)
    at = 0
    with torch.no_grad():
        for t in chunks:
            out, _ = cache.attention(
                q[:, :, at : at + t], k[:, :, at : at + t], v[:, :, at : at + t]
            )
            torch.testing.assert_close(out, want[:, :, at : at + t], atol=1e-12, rtol=1e-12)
            at += t
    assert cache.length == min(n, sinks + window)


def test_a_module_decodes_with_it_at_the_tokens_own_positions() -> None:
    # MultiHeadAttention with rotary decoding through a streaming cache equals the module over
    # the whole sequence with the mask sinks | window: positions count every token.
    torch.manual_seed(0)
    sinks, window, n = 2, 5, 23
    mha = attnkit.MultiHeadAttention(
        32, 4, num_kv_heads=2, rotary=attnkit.RotaryEmbedding(8), dtype=F64
    ).eval()
    x = torch.randn(1, n, 32, dtype=F64)
    keep = masks.sliding_window(window - 1) | (masks.causal() & masks.key_padding([sinks]))
    with torch.no_grad():
        want = mha(x, mask=keep)
        cache = StreamingKVCache(1, 2, 8, sink_tokens=sinks, window=window, dtype=F64)
        got = [mha(x[:, :7], cache=cache, causal=True)]
        got += [mha(x[:, t : t + 1], cache=cache, causal=True) for t in range(7, n)]
    torch.testing.assert_close(torch.cat(got, 1), want, atol=1e-12, rtol=1e-12)
    assert cache.position == n
    assert cache.length == sinks + window


# ---------------------------------------------------------------------------------------------
# Quantized storage (kv_dtype): the sinks and the window as int8 or float8, with their scales

KV_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# The relative error of a step against the unquantized cache, on random data: the bound the
# inference guide's table of quantized caches documents (its measured figures lie well inside).
FORMAT_ERROR = {torch.int8: 2e-2, torch.float8_e4m3fn: 8e-2, torch.float8_e5m2: 1.5e-1}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone().contiguous().view(torch.uint8)


def _state(cache: StreamingKVCache) -> list[torch.Tensor | None]:
    return [_bits(t) for t in (cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale)]


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def _as_stored(x: torch.Tensor, kv_dtype: torch.dtype, first: int) -> torch.Tensor:
    """Every token of ``x`` (B, Hkv, N, D) as the cache stores it, dequantized in float64,
    computed apart from the cache: int8 a scale per token; float8 the scale of the first
    write's ``first`` tokens, for every token."""
    if kv_dtype == torch.int8:
        xq, scale = quantize_int8(x)
    else:
        _, scale = quantize_fp8(x[:, :, :first], kv_dtype)
        xq, scale = quantize_fp8(x, kv_dtype, scale=scale)
    return xq.double() * scale.double()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_quantized_streaming_equals_the_formula_over_the_dequantized_tokens(
    kv_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prompts, steps far past S + W, a chunk that wraps the ring: each output equals the float64
    # formula over exactly the held tokens as stored (dequantized), so every token and scale is
    # in its slot after every roll; and stays within the format's error of the float cache.
    g = torch.Generator().manual_seed(7)
    sinks, window, b, h, hkv, d = 3, 8, 2, 4, 2, 16
    chunks = [24] + [1] * 20 + [5] + [1] * 12  # a prompt longer than S + W first
    n = sum(chunks)
    q, k, v = (torch.randn(b, heads, n, d, generator=g) for heads in (h, hkv, hkv))
    want = whole_sequence(
        q.double(), _as_stored(k, kv_dtype, chunks[0]), _as_stored(v, kv_dtype, chunks[0]),
        sinks, window,
    )  # fmt: skip
    cache = StreamingKVCache(b, hkv, d, sink_tokens=sinks, window=window, kv_dtype=kv_dtype)
    plain = StreamingKVCache(b, hkv, d, sink_tokens=sinks, window=window)
    monkeypatch.setattr(view_module, "dequantize", _no_copy)  # a step copies nothing
    at, outs, unquantized = 0, [], []
    with torch.no_grad():
        for t in chunks:
            part = [x[:, :, at : at + t] for x in (q, k, v)]
            with attnkit.record_dispatch() as seen:
                out, _ = cache.attention(*part)
            assert _rel(out, want[:, :, at : at + t]) <= 1e-5, at
            if t == 1:
                assert seen[0].kernel == IN_PLACE, at
            outs.append(out)
            unquantized.append(plain.attention(*part)[0])
            at += t
    assert _rel(torch.cat(outs, 2), torch.cat(unquantized, 2)) <= FORMAT_ERROR[kv_dtype]
    assert cache.k_cache.dtype == kv_dtype
    assert cache.length == sinks + window


def _no_copy(*args: object) -> torch.Tensor:
    raise AssertionError("a step dequantized the cache into a copy")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_refused_call_leaves_a_quantized_streaming_cache_as_it_was(kv_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(8)
    sinks, window, d = 2, 4, 8
    q, k, v = (torch.randn(1, 2, 30, d, generator=g) for _ in "qkv")
    want = whole_sequence(
        q.double(), _as_stored(k, kv_dtype, 5), _as_stored(v, kv_dtype, 5), sinks, window
    )
    cache = StreamingKVCache(1, 2, d, sink_tokens=sinks, window=window, kv_dtype=kv_dtype)
    empty = _state(cache)
    with torch.no_grad():
        # a first write, which would set the float8 scales: refused before anything is written
        with pytest.raises(TypeError, match="cache's dtype"):
            cache.attention(q[:, :, :5], k[:, :, :5].double(), v[:, :, :5].double())
        with pytest.raises(ValueError, match="softcap"):
            cache.attention(q[:, :, :5] * 100, k[:, :, :5] * 100, v[:, :, :5], softcap=-1.0)
        assert _same(_state(cache), empty)
        assert cache.position == 0
        cache.attention(q[:, :, :5], k[:, :, :5], v[:, :, :5])
        for t in range(5, 12):  # past S + W: each step rolls the ring
            cache.attention(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
        held = _state(cache)
        # a chunk (its evictions happen at commit) and a step, refused: bit for bit as it was
        with pytest.raises(ValueError, match="softcap"):
            cache.attention(q[:, :, 12:15], k[:, :, 12:15], v[:, :, 12:15], softcap=-1.0)
        with pytest.raises(ValueError, match=r"\(B, Hkv, T, Dk\) = \(1, 2, 1, 8\)"):
            cache.attention(q[:, :, 12:13], k[:, :, 12:13, :4], v[:, :, 12:13])
        x = k[:, :, 12:13].clone().requires_grad_()
        with torch.enable_grad(), pytest.raises(ValueError, match="inference"):
            cache.update(x, x)
        assert _same(_state(cache), held)
        assert cache.position == 12
        # a step refused by attention() after its write: only the slot of the token that had
        # left the window changed, and the next calls see what they would have seen
        with pytest.raises(ValueError, match="softcap"):
            cache.attention(q[:, :, 12:13], k[:, :, 12:13], v[:, :, 12:13], softcap=-1.0)
        assert cache.position == 12
        slot = cache._slot(12)
        now = _state(cache)
        for before, after in zip(held, now, strict=True):
            if before is not None and after is not None and before.size(2) > 1:
                keep = [s for s in range(before.size(2)) if s != slot]
                assert torch.equal(before[:, :, keep], after[:, :, keep])
        out, _ = cache.attention(q[:, :, 12:], k[:, :, 12:], v[:, :, 12:])
    assert _rel(out, want[:, :, 12:]) <= 1e-5


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_quantized_streaming_cache_keeps_its_memory_past_the_window(
    kv_dtype: torch.dtype,
) -> None:
    sinks, window, b, hkv, d = 4, 16, 2, 2, 32
    cache = StreamingKVCache(b, hkv, d, sink_tokens=sinks, window=window, kv_dtype=kv_dtype)

    def held() -> list[tuple[int, int]]:  # every tensor the cache holds: (address, bytes)
        return [
            (t.data_ptr(), t.untyped_storage().nbytes())
            for t in vars(cache).values()
            if isinstance(t, torch.Tensor)
        ]

    start = held()
    with torch.no_grad():
        cache.attention(*(torch.randn(b, n, 7, d) for n in (4, hkv, hkv)))
        for step in range(5 * (sinks + window)):
            cache.attention(*(torch.randn(b, n, 1, d) for n in (4, hkv, hkv)))
            if step % 20 == 0:
                assert held() == start, step
    assert held() == start
    assert cache.length == sinks + window
    per_token = d + (4 if kv_dtype == torch.int8 else 0)  # int8 keeps a float32 scale a token
    assert cache.k_cache.nbytes + (cache.k_scale.nbytes if kv_dtype == torch.int8 else 0) == (
        b * hkv * (sinks + window) * per_token
    )


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_module_decodes_through_a_quantized_streaming_cache(kv_dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    sinks, window, n = 2, 6, 30
    mha = attnkit.MultiHeadAttention(
        32, 4, num_kv_heads=2, rotary=attnkit.RotaryEmbedding(8)
    ).eval()
    x = torch.randn(1, n, 32)
    caches = [
        StreamingKVCache(1, 2, 8, sink_tokens=sinks, window=window, kv_dtype=kind)
        for kind in (None, kv_dtype)
    ]
    outs = []
    with torch.no_grad(), attnkit.record_dispatch() as seen:
        for cache in caches:
            got = [mha(x[:, :5], cache=cache, causal=True)]
            got += [mha(x[:, t : t + 1], cache=cache, causal=True) for t in range(5, n)]
            outs.append(torch.cat(got, 1))
    assert _rel(outs[1], outs[0]) <= FORMAT_ERROR[kv_dtype]
    assert sum(s.kernel == IN_PLACE for s in seen) == n - 5  # the quantized steps, in place
    assert "kv_dtype=" in repr(caches[1])


def test_kv_dtype_is_checked() -> None:
    with pytest.raises(TypeError, match=r"kv_dtype must be None, torch\.int8, .*got float16"):
        StreamingKVCache(1, 1, 8, sink_tokens=1, window=2, kv_dtype=torch.float16)


@settings(max_examples=20, deadline=None)
@given(
    sinks=st.integers(0, 4),
    window=st.integers(1, 6),
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    kv_dtype=st.sampled_from(KV_DTYPES),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_quantized_streaming_fuzz(
    sinks: int, window: int, chunks: list[int], kv_dtype: torch.dtype, magnitude: float, seed: int
) -> None:
    # Over sinks, windows, chunk lengths, formats and the scales' magnitudes: every output equals
    # the float64 formula over the held tokens as stored.
    g = torch.Generator().manual_seed(seed)
    n = sum(chunks)
    q = torch.randn(1, 2, n, 4, generator=g) / magnitude  # scores of order 1 at any scale
    k, v = (torch.randn(1, 1, n, 4, generator=g) * magnitude for _ in "kv")
    want = whole_sequence(
        q.double(), _as_stored(k, kv_dtype, chunks[0]), _as_stored(v, kv_dtype, chunks[0]),
        sinks, window,
    )  # fmt: skip
    cache = StreamingKVCache(1, 1, 4, sink_tokens=sinks, window=window, kv_dtype=kv_dtype)
    at = 0
    with torch.no_grad():
        for t in chunks:
            out, _ = cache.attention(*(x[:, :, at : at + t] for x in (q, k, v)))
            assert _rel(out, want[:, :, at : at + t]) <= 1e-5, at
            at += t
    assert cache.length == min(n, sinks + window)


def test_to_keeps_a_quantized_storage_and_changes_the_dtype_read() -> None:
    g = torch.Generator().manual_seed(9)
    k = torch.randn(1, 1, 5, 8, generator=g)
    plain = StreamingKVCache(1, 1, 8, sink_tokens=1, window=3)
    int8 = StreamingKVCache(1, 1, 8, sink_tokens=1, window=3, kv_dtype=torch.int8)
    for cache in (plain, int8):
        cache.update(k, k)
        cache.to(dtype=F64)
        keys, _, _ = cache.update(k[:, :, :1].double(), k[:, :, :1].double())
        assert keys.dtype == F64
        assert cache.dtype == F64
    assert plain.k_cache.dtype == F64
    assert int8.k_cache.dtype == torch.int8
    assert int8.k_scale is not None
    assert int8.k_scale.dtype == torch.float32
    assert "dtype=torch.float64, kv_dtype=torch.int8" in repr(int8)
    with pytest.raises(TypeError, match=r"cache's dtype \(float64\), got k float32"):
        int8.update(k[:, :, :1], k[:, :, :1])


@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_a_step_with_a_mask_or_bias_of_its_own_reads_the_held_tokens_in_time_order(
    kv_dtype: torch.dtype | None,
) -> None:
    # A step read the held tokens in the ring's order; a call's own mask or bias, which depend
    # on the keys' order, then fell on the wrong tokens once the ring wrapped.
    b, h, hkv, d, sinks, window, n = 1, 2, 1, 8, 1, 4, 12
    q, k, v = randn(b, h, n, d), randn(b, hkv, n, d), randn(b, hkv, n, d)
    for own in ("mask", "bias"):
        cache = StreamingKVCache(b, hkv, d, sink_tokens=sinks, window=window, dtype=F64,
                                 kv_dtype=kv_dtype)  # fmt: skip
        stored_k, stored_v = [], []
        for t in range(n):
            new = (k[:, :, t : t + 1], v[:, :, t : t + 1])
            held = [p for p in range(t + 1) if p < sinks or t - p < window]  # in time order
            bias = torch.linspace(-1, 1, len(held), dtype=F64) if own == "bias" else None
            own_mask = masks.sliding_window(1) if own == "mask" else None
            keys, values, mask = cache.stage_call(q[:, :, t : t + 1], *new, mask=own_mask,
                                                  bias=bias)  # fmt: skip
            out = attnkit.attention(q[:, :, t : t + 1], keys, values, mask=mask, bias=bias)
            cache.commit()
            if kv_dtype is None:
                stored_k.append(new[0])
                stored_v.append(new[1])
            else:  # the tokens as stored
                stored_k.append(quantize_int8(new[0])[0].double() * quantize_int8(new[0])[1])
                stored_v.append(quantize_int8(new[1])[0].double() * quantize_int8(new[1])[1])
            kk = torch.cat([stored_k[p] for p in held], 2)
            vv = torch.cat([stored_v[p] for p in held], 2)
            if own == "mask":  # the query and the token before it, by position
                near = torch.tensor([t - p <= 1 for p in held])
                want = attnkit.attention(q[:, :, t : t + 1], kk, vv, mask=near, backend="reference")
            else:
                want = attnkit.attention(q[:, :, t : t + 1], kk, vv, bias=bias, backend="reference")
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn])
def test_rewinding_a_step_puts_back_the_token_it_wrote_over(kv_dtype) -> None:
    # Once the ring is full a step writes its token over its window's oldest, in place, when it
    # is staged. Rewinding the step, staged (a call that failed after staging) or committed,
    # puts that token back: the view holds exactly the tokens kept.
    b, d = 2, 8
    k, v = randn(b, 2, 8, d, dtype=torch.float32), randn(b, 2, 8, d, dtype=torch.float32)
    cache = StreamingKVCache(b, 2, d, sink_tokens=1, window=3, kv_dtype=kv_dtype)

    def held() -> list[torch.Tensor]:
        return [t.clone() for t in cache.view().dense()]

    def same(a: list[torch.Tensor], c: list[torch.Tensor]) -> None:
        for x, y in zip(a, c, strict=True):
            assert torch.equal(x, y)

    with torch.no_grad():
        cache.stage(k[:, :, :5], v[:, :, :5])  # (past the 4 slots: the ring is full)
        cache.commit()
        cache.stage(k[:, :, 5:6], v[:, :, 5:6])
        cache.commit()
        at_6 = held()
        cache.stage(k[:, :, 6:7], v[:, :, 6:7])  # staged, not committed
        cache.rewind(6)
        same(held(), at_6)
        cache.commit()  # nothing staged any more
        same(held(), at_6)
        cache.stage(k[:, :, 6:7], v[:, :, 6:7])
        cache.commit()
        cache.rewind(6)  # a committed step
        same(held(), at_6)
        # One step further back, a query at 5 finds its window (5, 4, 3) and the sink whole.
        cache.rewind(5)
        model = StreamingKVCache(b, 2, d, sink_tokens=1, window=3, kv_dtype=kv_dtype)
        model.stage(k[:, :, :5], v[:, :, :5])
        model.commit()
        q = randn(b, 2, 1, d, dtype=torch.float32)
        step = (q, k[:, :, 5:6], v[:, :, 5:6])
        torch.testing.assert_close(cache.attention(*step), model.attention(*step), atol=0, rtol=0)


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn])
def test_rewind_undoes_the_last_step_or_chunk_and_refuses_what_the_ring_let_go(kv_dtype) -> None:
    sinks, window, b, d, n = 1, 3, 1, 8, 20
    q, k, v = randn(b, 2, n, d), randn(b, 2, n, d), randn(b, 2, n, d)
    cache = StreamingKVCache(b, 2, d, sink_tokens=sinks, window=window, kv_dtype=kv_dtype)
    model = StreamingKVCache(b, 2, d, sink_tokens=sinks, window=window, kv_dtype=kv_dtype)

    def run(c, at, t):
        part = (x[:, :, at : at + t].float() for x in (q, k, v))
        return c.attention(*part)[0]

    with torch.no_grad():
        for c in (cache, model):
            run(c, 0, 6)
        run(cache, 6, 5)  # a chunk past the window: its commit wrote over the whole ring
        cache.rewind(6)
        torch.testing.assert_close(run(cache, 6, 1), run(model, 6, 1), atol=0, rtol=0)
        run(cache, 7, 1)
        cache.rewind(7)  # a step back: the window still holds what a query at 7 attends
        torch.testing.assert_close(run(cache, 7, 1), run(model, 7, 1), atol=0, rtol=0)
        held_k, held_v = cache.k_cache.clone(), cache.v_cache.clone()
        with pytest.raises(ValueError, match=r"cannot rewind to position 6: .* back to position 7"):
            cache.rewind(6)
        assert cache.position == 8
        assert torch.equal(held_k, cache.k_cache)
        assert torch.equal(held_v, cache.v_cache)
        cache.rewind(100)  # past the tokens appended: all kept
        assert cache.position == 8


def test_a_conversion_forgets_what_the_last_chunk_wrote_over() -> None:
    cache = StreamingKVCache(1, 1, 4, sink_tokens=1, window=2)
    for t in (2, 5):
        cache.update(torch.randn(1, 1, t, 4), torch.randn(1, 1, t, 4))
    cache.to(dtype=F64)  # the chunk's old tokens were float32: refused, not a dtype clash
    with pytest.raises(ValueError, match=r"cannot rewind to position 2: .* back to position 6"):
        cache.rewind(2)
    cache.rewind(6)
    assert cache.position == 6


@pytest.mark.parametrize(("queries", "tokens"), [(3, 1), (1, 3), (2, 4)])
def test_a_query_per_new_token(queries: int, tokens: int) -> None:
    # Query i sits at position `position + i`: more queries than tokens attended the whole ring
    # (a step reads it with no mask), fewer sat at the chunk's last positions; both silently.
    cache = StreamingKVCache(1, 2, 8, sink_tokens=1, window=3)
    cache.attention(torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
    held = cache.k_cache.clone()
    k = torch.randn(1, 2, tokens, 8)
    with pytest.raises(ValueError, match=rf"q brings {queries} queries .* {tokens} new tokens"):
        cache.attention(torch.randn(1, 4, queries, 8), k, k)
    assert cache.position == 5
    assert torch.equal(cache.k_cache, held)


# ---------------------------------------------------------------------------------------------
# Under torch.compile


def _own_mask(kind: str, rows: int, kept: int, sinks: int) -> object:
    """The call's own mask of a step over ``kept`` held keys: none, a band, or a bool tensor that
    hides the sinks from row 1 (its keys in time order, the sinks first)."""
    if kind == "window":
        return masks.sliding_window(2)
    if kind == "bool":
        valid = torch.ones(rows, 1, 1, kept, dtype=torch.bool)
        valid[1, ..., :sinks] = False
        return valid
    return None


@pytest.mark.parametrize("kind", ["none", "window", "bool"])
def test_a_compiled_decode_loop_past_the_wrap_settles_at_a_few_graphs(kind: str) -> None:
    # A call's own mask (or bias, or weights) has a step read the held tokens in time order:
    # their slots were a Python list over the range of positions, which torch.compile took as
    # constants, compiling the step again at every token until its recompile limit. Past the
    # ring's wrap the graphs stop growing, and every step equals the eager module on its own
    # cache and the module over the whole sequence with the mask sinks | window (and the call's).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # no frames compiled by earlier tests (their limits, their guards)
    torch.manual_seed(3)
    b, sinks, window, prompt, n = 2, 2, 4, 3, 3 + 12  # 3 windows of steps after the prompt
    mha = attnkit.MultiHeadAttention(
        32, 4, num_kv_heads=2, rotary=attnkit.RotaryEmbedding(8), dtype=F64
    ).eval()
    x = torch.randn(b, n, 32, dtype=F64)
    keep = masks.sliding_window(window - 1) | (masks.causal() & masks.key_padding([sinks] * b))
    if kind == "window":
        keep = keep & masks.sliding_window(2)  # (inside the window: the same keys either way)
    if kind == "bool":  # row 1's steps see no sink (the prompt is left out of the comparison)
        keep = keep & masks.key_padding([n, n - sinks], side="left")
    caches = [StreamingKVCache(b, 2, 8, sink_tokens=sinks, window=window, dtype=F64) for _ in "ab"]

    def step(x: torch.Tensor, cache: StreamingKVCache, own: object) -> torch.Tensor:
        return mha(x, cache=cache, causal=True, mask=own)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)  # a step: one graph
    got, graphs = [], []
    before = counters["stats"]["unique_graphs"]  # (counted since the process started)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64):
        want = mha(x, mask=keep)
        for at, t in [(0, prompt), *((p, 1) for p in range(prompt, n))]:
            kept = min(at, sinks + window - 1) + t
            own = _own_mask(kind, b, kept, sinks) if t == 1 else None
            out = compiled(x[:, at : at + t], caches[0], own)
            torch.testing.assert_close(out, step(x[:, at : at + t], caches[1], own))
            got.append(out)
            graphs.append(counters["stats"]["unique_graphs"] - before)
    torch._dynamo.reset()
    first = 1 if kind == "bool" else 0
    torch.testing.assert_close(
        torch.cat(got[first:], 1), want[:, first * prompt :], atol=1e-12, rtol=1e-12
    )
    assert caches[0].position == caches[1].position == n
    wrapped = sinks + window - prompt + 1  # the first step whose slot held another token
    assert graphs[-1] == graphs[wrapped], graphs
    assert graphs[-1] <= 8, graphs
