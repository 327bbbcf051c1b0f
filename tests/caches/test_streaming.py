"""StreamingKVCache: attention over exactly the sinks and the window, in constant memory."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
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
