"""KVCache: decoding through the cache equals the full causal forward, in float64 to 1e-10."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import attnkit
from attnkit import KVCache, MultiHeadAttention, RotaryEmbedding, masks
from attnkit.testing import assert_close


def chunks(draw: st.DrawFn, total: int) -> list[int]:
    """Split ``total`` tokens into a prompt and then steps of 1 or more tokens."""
    sizes = []
    left = total
    while left:
        n = draw(st.integers(1, left)) if draw(st.booleans()) else 1
        sizes.append(n)
        left -= n
    return sizes


def decode(
    m: MultiHeadAttention, x: Tensor, sizes: list[int], mask: Tensor | None = None
) -> Tensor:
    """Run ``x`` through ``m`` in chunks of ``sizes`` tokens with a cache; concatenate."""
    cache = m.make_cache(x.size(0), max_len=x.size(1) + 3)
    outs, start = [], 0
    with torch.no_grad():
        for n in sizes:
            m_step = None if mask is None else mask[..., : start + n]  # keys held after this step
            outs.append(m(x[:, start : start + n], causal=True, cache=cache, mask=m_step))
            start += n
    assert cache.length == x.size(1)
    return torch.cat(outs, dim=1)


@given(
    hkv=st.integers(1, 2),
    groups=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([2, 4, 6]),
    rotary=st.booleans(),
    b=st.integers(1, 2),
    t=st.integers(1, 12),
    data=st.data(),
)
def test_incremental_equals_full_causal_forward(
    hkv: int, groups: int, head_dim: int, rotary: bool, b: int, t: int, data: st.DataObject
) -> None:
    torch.manual_seed(data.draw(st.integers(0, 2**16)))
    h = hkv * groups
    m = MultiHeadAttention(
        10,
        h,
        head_dim=head_dim,
        num_kv_heads=hkv,
        rotary=RotaryEmbedding(head_dim) if rotary else None,
        dtype=torch.float64,
    ).eval()
    x = torch.randn(b, t, 10, dtype=torch.float64)
    with torch.no_grad():
        full = m(x, causal=True)
    assert_close(decode(m, x, chunks(data.draw, t)), full)  # float64: atol = rtol = 1e-10


def test_prefill_then_single_steps_with_padding() -> None:
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.float64).eval()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    pad = masks.padding_mask([7, 9], max_len=9, side="left")  # (B, 1, 1, T): two pads, then tokens
    with torch.no_grad():
        full = m(x, causal=True, mask=pad)
    # The pad queries see no real key: 0 before the output projection, in both paths.
    assert_close(decode(m, x, [5, 1, 1, 1, 1], mask=pad), full)


def test_cache_holds_kv_heads_and_the_new_tokens() -> None:
    m = MultiHeadAttention(16, 4, num_kv_heads=1, dtype=torch.float64).eval()
    cache = m.make_cache(1, 8)
    x = torch.randn(1, 3, 16, dtype=torch.float64)
    with torch.no_grad():
        m(x, cache=cache, causal=True)
    assert cache.k_cache.shape == (1, 1, 8, 4)
    assert cache.length == 3
    _, k, v = m._project(x, x, x)
    assert_close(cache.k_cache[:, :, :3], k.view(1, 3, 1, 4).transpose(1, 2))
    assert_close(cache.v_cache[:, :, :3], v.view(1, 3, 1, 4).transpose(1, 2))
    assert not any(t is cache.k_cache for t in m.state_dict().values())  # not the model's state


def test_to_converts_the_tokens_held() -> None:
    """``to`` converts both buffers in place of the old ones and keeps the tokens held; the repr
    names the sizes, the length, the dtype and the device."""
    m = MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.float64).eval()
    cache = m.make_cache(1, 8)
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        m(x[:, :3], cache=cache, causal=True)
        held = cache.k_cache[:, :, :3].clone(), cache.v_cache[:, :, :3].clone()
        assert cache.to(dtype=torch.float32) is cache
        assert cache.k_cache.dtype == cache.v_cache.dtype == torch.float32
        assert_close(cache.k_cache[:, :, :3], held[0].float())
        assert_close(cache.v_cache[:, :, :3], held[1].float())
        assert cache.length == 3
        cache.to("cpu", torch.float64)
        got = m(x[:, 3:], cache=cache, causal=True)
    assert_close(got, m(x, causal=True)[:, 3:], dtype=torch.float32)
    assert repr(cache) == (
        "KVCache(batch_size=1, max_len=8, num_kv_heads=2, head_dim=4, v_head_dim=4, length=5, "
        "dtype=torch.float64, device=cpu)"
    )


def test_overflow_is_a_clear_error() -> None:
    m = MultiHeadAttention(8, 2).eval()
    cache = m.make_cache(1, max_len=4)
    with torch.no_grad():
        m(torch.randn(1, 3, 8), cache=cache, causal=True)
        with pytest.raises(
            ValueError,
            match=r"KV cache overflow: 2 new tokens after the 3 cached exceed max_len \(4\)",
        ):
            m(torch.randn(1, 2, 8), cache=cache, causal=True)
        assert cache.length == 3  # the failed step changed nothing
        m(torch.randn(1, 1, 8), cache=cache, causal=True)
        cache.reset()
        assert cache.length == 0
        m(torch.randn(1, 4, 8), cache=cache, causal=True)


@pytest.mark.usefixtures("no_shape_checks")
def test_update_errors() -> None:
    cache = KVCache(2, 8, num_kv_heads=2, head_dim=4, v_head_dim=3)
    with pytest.raises(
        ValueError, match=r"\(B, Hkv, T, Dk\) = \(2, 2, 1, 4\) .* got k \(2, 4, 1, 4\)"
    ):
        cache.update(torch.randn(2, 4, 1, 4), torch.randn(2, 4, 1, 3))
    with pytest.raises(TypeError, match=r"cache's dtype \(float32\), got k float64"):
        cache.update(torch.randn(2, 2, 1, 4, dtype=torch.float64), torch.randn(2, 2, 1, 3))
    k = torch.randn(2, 2, 1, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"require grad: the cache is for inference"):
        cache.update(k, torch.randn(2, 2, 1, 3))
    with pytest.raises(ValueError, match=r"max_len must be >= 1, got 0"):
        KVCache(1, 0, 1, 4)
    with pytest.raises(TypeError, match=r"num_kv_heads must be an int, got 2.0"):
        KVCache(1, 4, 2.0, 4)  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_shape_checks")
def test_keys_on_another_device_are_refused_before_anything_is_written() -> None:
    """k on the cache's device and v on another: refused by name before k is copied in (a copy_
    would write k, then fail on v with torch's words; or move them silently)."""
    cache = KVCache(2, 8, num_kv_heads=2, head_dim=4)
    cache.update(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4))
    before = (cache.k_cache.clone(), cache.v_cache.clone(), cache.length)
    here, meta = torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4, device="meta")
    for k, v, got in (
        (here, meta, "k on cpu and v on meta"),
        (meta, here, "k on meta and v on cpu"),
    ):
        message = f"k and v must be on the cache's device (cpu), got {got}"
        with pytest.raises(ValueError, match=re.escape(message)):
            cache.stage(k, v)
        assert torch.equal(cache.k_cache, before[0])
        assert torch.equal(cache.v_cache, before[1])
        assert cache.length == before[2]


def test_update_returns_views_of_everything_held() -> None:
    cache = KVCache(1, 6, num_kv_heads=1, head_dim=2)
    a, b = torch.randn(1, 1, 2, 2), torch.randn(1, 1, 3, 2)
    cache.update(a, a)
    k, v = cache.update(b, b)
    assert torch.equal(k, torch.cat([a, b], dim=2))
    assert torch.equal(v, k)
    assert k.data_ptr() == cache.k_cache.data_ptr()  # a view, not a copy


# --------------------------------------------------------------------------------------------------
# A call that raises leaves the cache as it was


def bad_calls(t: int, held: int) -> list[tuple[dict[str, object], type[Exception], str]]:
    """Keyword arguments that attention() refuses, for ``t`` new tokens after ``held`` cached."""
    s = held + t
    return [
        ({"mask": torch.ones(1, 1, t, s + 1, dtype=torch.bool)}, ValueError, "does not broadcast"),
        ({"mask": torch.ones(t, s)}, TypeError, "mask must be a bool tensor, got float32"),
        ({"causal": 1}, TypeError, "causal must be a bool, got 1"),
        ({"bias": torch.zeros(t, s, dtype=torch.float64)}, TypeError, "bias must have the dtype"),
    ]


@pytest.mark.usefixtures("no_shape_checks")
def test_a_refused_call_leaves_the_cache_unchanged() -> None:
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, num_kv_heads=2, rotary=RotaryEmbedding(4)).eval()
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        full = m(x, causal=True)
        cache = m.make_cache(2, 8)
        outs = [m(x[:, :4], causal=True, cache=cache)]
        for kwargs, error, message in bad_calls(t=2, held=4):
            with pytest.raises(error, match=message):
                m(x[:, 4:6], cache=cache, **{"causal": True, **kwargs})  # type: ignore[arg-type]
            assert cache.length == 4, kwargs
        # The retry sees exactly the four tokens held: the same output as the uncached call.
        outs.append(m(x[:, 4:6], causal=True, cache=cache))
        outs.append(m(x[:, 6:], causal=True, cache=cache))
    assert cache.length == 7
    assert_close(torch.cat(outs, 1), full)


def test_stage_then_commit() -> None:
    cache = KVCache(1, 6, num_kv_heads=1, head_dim=2)
    a, b, c = torch.randn(1, 1, 2, 2), torch.randn(1, 1, 3, 2), torch.randn(1, 1, 1, 2)
    cache.update(a, a)
    k, v = cache.stage(b, b)
    assert torch.equal(k, torch.cat([a, b], dim=2))  # the staged tokens are attended...
    assert torch.equal(v, k)
    assert cache.length == 2  # ...but not held until the commit
    k, _ = cache.stage(c, c)  # a second stage replaces the first
    assert torch.equal(k, torch.cat([a, c], dim=2))
    cache.commit()
    assert cache.length == 3
    cache.commit()  # nothing staged: nothing changes
    assert cache.length == 3
    k, _ = cache.update(b, b)
    assert torch.equal(k, torch.cat([a, c, b], dim=2))


def test_a_cache_of_another_batch_size_names_both() -> None:
    mha = MultiHeadAttention(16, 4)
    cache = mha.make_cache(batch_size=3, max_len=8)
    with torch.no_grad(), pytest.raises(ValueError, match="batch_size=2") as err:
        mha(torch.randn(2, 1, 16), cache=cache)
    message = str(err.value)
    assert "KVCache holds a batch of 3 sequences (batch_size=3)" in message
    assert "brings a batch of 2" in message
    assert "k and v" not in message
    assert cache.length == 0
    # An empty batch: no cache holds one (batch_size >= 1), so the advice is not a cache of 0.
    with torch.no_grad(), pytest.raises(ValueError, match="empty batch") as err:
        mha(torch.randn(0, 1, 16), cache=cache)
    assert "batch_size=0" not in str(err.value)


# -------------------------------------------------------------------------------------------------
# A latent cache: values stored once, as the keys' first Dv columns (values_in_keys=True)


def latent_cache(**kw: object) -> KVCache:
    return KVCache(2, 12, 1, 6, 4, dtype=torch.float64, values_in_keys=True, **kw)  # type: ignore[arg-type]


def test_a_latent_caches_values_are_a_view_of_its_keys() -> None:
    """One memory: V is k_cache[..., :Dv] (same pointer, same strides), so writing keys is
    writing values, and attention over the cache reads V = the keys' first columns."""
    cache = latent_cache()
    assert cache.v_cache.data_ptr() == cache.k_cache.data_ptr()
    assert cache.v_cache.stride() == cache.k_cache.stride()
    assert cache.v_cache.shape == (2, 1, 12, 4)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 1, 5, 6, dtype=torch.float64, generator=g)
    keys, values = cache.update(k, None)
    assert values.data_ptr() == keys.data_ptr()
    assert values.stride() == keys.stride()
    assert torch.equal(values, k[..., :4])
    step = torch.randn(2, 1, 1, 6, dtype=torch.float64, generator=g)
    keys, values = cache.update(step, step[..., :4].clone())  # values equal to the keys' columns
    assert torch.equal(values[:, :, 5], step[:, :, 0, :4])
    cache.k_cache[0, 0, 2, :4] = 7.0  # a key written is a value written
    assert torch.equal(cache.v_cache[0, 0, 2], torch.full((4,), 7.0, dtype=torch.float64))
    q = torch.randn(2, 3, 1, 6, dtype=torch.float64, generator=g)
    whole = torch.cat((k, step), 2)
    whole[0, 0, 2, :4] = 7.0
    want = attnkit.attention(q, whole, whole[..., :4], backend="reference")
    assert_close(attnkit.attention(q, cache.view()), want)
    assert "values_in_keys=True" in repr(cache)


def test_a_refused_write_into_a_latent_cache_changes_nothing() -> None:
    cache = latent_cache()
    k = torch.randn(2, 1, 3, 6, dtype=torch.float64)
    cache.update(k, None)
    held = cache.k_cache.clone()
    other = k[..., :4].clone()
    other[1, 0, 2, 3] += 1.0
    with pytest.raises(ValueError, match=r"v\[1, 0, 2, 3\] = .* where k\[1, 0, 2, 3\] = "):
        cache.update(k, other)
    with pytest.raises(ValueError, match=re.escape("(B, Hkv, T, Dv) = (2, 1, 3, 4)")):
        cache.update(k, k)
    with pytest.raises(ValueError, match="overflow"):
        cache.update(torch.randn(2, 1, 10, 6, dtype=torch.float64), None)
    assert cache.length == 3
    assert torch.equal(cache.k_cache, held)


def test_keep_on_a_latent_cache_keeps_its_values_the_keys_first_columns() -> None:
    """The tokens kept move once: values that are a view of the keys move with them."""
    cache = latent_cache()
    k = torch.arange(2 * 7 * 6, dtype=torch.float64).view(2, 1, 7, 6)
    cache.update(k, None)
    index = torch.tensor([[[6, 1, 3]], [[0, 2, 5]]])
    cache.keep(index)
    kept = k.gather(2, index.sort(-1).values[..., None].expand(2, 1, 3, 6))
    assert torch.equal(cache.k_cache[:, :, :3], kept)
    assert torch.equal(cache.v_cache[:, :, :3], kept[..., :4])
    assert cache.v_cache.data_ptr() == cache.k_cache.data_ptr()


def test_to_keeps_a_latent_caches_values_a_view() -> None:
    cache = latent_cache()
    cache.update(torch.randn(2, 1, 3, 6, dtype=torch.float64), None)
    cache.to(dtype=torch.float32)
    assert cache.v_cache.dtype == torch.float32
    assert cache.v_cache.data_ptr() == cache.k_cache.data_ptr()
    assert torch.equal(cache.v_cache, cache.k_cache[..., :4])


def test_what_a_latent_cache_refuses() -> None:
    with pytest.raises(ValueError, match=r"v_head_dim \(8\) must be at most head_dim \(6\)"):
        KVCache(2, 12, 1, 6, 8, values_in_keys=True)
    with pytest.raises(TypeError, match="values_in_keys must be a bool"):
        KVCache(2, 12, 1, 6, 4, values_in_keys=1)  # type: ignore[arg-type]


def test_the_native_kernel_reads_a_latent_cache_in_place() -> None:
    """float32 on the CPU: the chunked backend's native kernel reads the keys and the values
    where they lie, the values at the keys' own address (no copy of V)."""
    from attnkit import _native
    from attnkit._kernel import cache as kernel_cache

    if not _native.load():
        pytest.skip("the native kernel is not available")
    cache = KVCache(2, 40, 1, 40, 32, values_in_keys=True)
    g = torch.Generator().manual_seed(0)
    cache.update(torch.randn(2, 1, 30, 40, generator=g), None)
    q = torch.randn(2, 8, 1, 40, generator=g)
    with torch.no_grad(), attnkit.record_dispatch() as calls:
        view = cache.stage_call(q, torch.randn(2, 1, 1, 40, generator=g), None)
        out = attnkit.attention(q, view, causal=True, backend="chunked")
        said = str(attnkit.explain(q, view, causal=True, backend="chunked"))
    (call,) = calls
    assert call.kernel == kernel_cache.IN_PLACE
    read = call.call.cache
    assert read is not None
    assert read.v.data_ptr() == read.k.data_ptr() == cache.k_cache.data_ptr()
    assert "reads the cache in place: native kernel" in said
    keys = cache.k_cache[:, :, :31].double()
    want = attnkit.attention(q.double(), keys, keys[..., :32], causal=True, backend="reference")
    assert_close(out, want)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_quantized_latent_cache_reads_its_values_with_the_keys_scales(
    kv_dtype: torch.dtype,
) -> None:
    """Keys stored once, quantized: the values are the keys' first columns read with the keys'
    own scales (one scale tensor), so V dequantized is K dequantized's first Dv columns, through
    writes, keep() and the attention call."""
    cache = KVCache(2, 40, 1, 40, 32, values_in_keys=True, kv_dtype=kv_dtype)
    assert cache.v_scale is cache.k_scale
    assert cache.v_cache.data_ptr() == cache.k_cache.data_ptr()
    g = torch.Generator().manual_seed(0)
    cache.update(torch.randn(2, 1, 30, 40, generator=g), None)
    keys, values = cache.update(torch.randn(2, 1, 1, 40, generator=g) * 0.5, None)
    assert torch.equal(values, keys[..., :32])  # dequantized copies, one the other's columns
    q = torch.randn(2, 8, 1, 40, generator=g)
    want = attnkit.attention(
        q.double(), keys.double(), keys[..., :32].double(), backend="reference"
    )
    assert_close(attnkit.attention(q, cache.view(), backend="chunked"), want)
    index = torch.tensor([[[3, 0, 7]], [[1, 2, 30]]])
    before = keys.gather(2, index.sort(-1).values[..., None].expand(2, 1, 3, 40))
    cache.keep(index)
    keys, values = cache.view().dense()
    assert torch.equal(keys, before)
    assert torch.equal(values, before[..., :32])
    cache.to("meta")  # (each tensor moved on its own)
    assert cache.v_scale is cache.k_scale


def test_rewind_refuses_a_length_that_is_not_a_count_and_leaves_the_cache() -> None:
    # rewind(-1) made length -1 and the next update returned no keys; rewind(1.0) a float length
    # that failed later in a slice.
    cache = KVCache(batch_size=1, max_len=8, num_kv_heads=1, head_dim=2)
    k = torch.randn(1, 1, 5, 2)
    cache.update(k, k)
    with pytest.raises(ValueError, match="length must be >= 0, got -1"):
        cache.rewind(-1)
    with pytest.raises(TypeError, match=re.escape("length must be an int, got 1.0")):
        cache.rewind(1.0)  # type: ignore[arg-type]
    assert (cache.length, cache.position) == (5, 5)
    cache.rewind(9)  # past the tokens held: all kept
    assert (cache.length, cache.position) == (5, 5)
    cache.rewind(3)
    new = torch.randn(1, 1, 1, 2)
    keys, _ = cache.update(new, new)
    assert torch.equal(keys, torch.cat([k[:, :, :3], new], 2))
