"""Quantized and evicting caches under hostile use: compiled steps, refused calls, odd inputs.

Each test compares numbers (the float64 formula over the dequantized values, the eager cache) or
the cache's state bit for bit before and after a call that must change nothing.
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.caches._quantize import fp8_scale, quantize_fp8, quantize_int8
from attnkit.caches.kv_cache import KVCache
from attnkit.caches.paged import PagedKVCache
from attnkit.caches.streaming import StreamingKVCache

F8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _as_stored(x: torch.Tensor, kv_dtype, first_write: int) -> torch.Tensor:
    """Tokens ``x (B, Hkv, T, D)`` as a cache of ``kv_dtype`` stores them, dequantized to float64:
    int8 a scale per token, float8 the scale of the cache's first write (its first
    ``first_write`` tokens)."""
    if kv_dtype is None:
        return x.double()
    if kv_dtype == torch.int8:
        xq, scale = quantize_int8(x)
    else:
        xq, scale = quantize_fp8(x, kv_dtype, scale=fp8_scale(x[:, :, :first_write], kv_dtype))
    return (xq.float() * scale).double()


def _state(cache: StreamingKVCache, slots: int | None = None) -> list[torch.Tensor]:
    """A streaming cache's stored tensors (their first ``slots`` slots: None, all of them),
    float8 as bytes, to compare bit for bit."""
    out = []
    for t in (cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale):
        if t is not None:
            t = t.view(torch.uint8) if t.dtype in F8 else t
            out.append(t[:, :, :slots].clone() if t.size(2) > 1 else t.clone())
    return out


@pytest.mark.parametrize("kv_dtype", F8)
def test_a_compiled_float8_streaming_prompt_equals_the_eager_cache(kv_dtype) -> None:
    # A prompt into a float8 StreamingKVCache writes its sinks and the ring's tokens as two copies
    # into one float8 tensor: inductor lowered the second as a select on a bool and float8, which
    # torch refuses ("Promotion for Float8 Types is not supported"), and the compiled step failed.
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    b, h, hkv, d = 2, 4, 2, 8

    def step(q, k, v, cache):
        keys, values, mask = cache.stage_call(q, k, v)
        out = attnkit.attention(q, keys, values, mask=mask)
        cache.commit()
        return out

    caches = [StreamingKVCache(b, hkv, d, sink_tokens=2, window=3, kv_dtype=kv_dtype) for _ in "ab"]
    compiled = torch.compile(step, fullgraph=True)
    with torch.no_grad():
        for t in (6, 1, 1):  # a prompt past S + W (sinks, and a ring that wraps), then steps
            q = torch.randn(b, h, t, d, generator=gen)
            k, v = (
                torch.randn(b, hkv, t, d, generator=gen),
                torch.randn(b, hkv, t, d, generator=gen),
            )
            torch.testing.assert_close(compiled(q, k, v, caches[0]), step(q, k, v, caches[1]))
    torch._dynamo.reset()
    for got, want in zip(_state(caches[0]), _state(caches[1]), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("paged", [False, True])
def test_a_compiled_flash_attn_with_kvcache_writes_a_float8_cache(paged) -> None:
    # The same inductor refusal, for flash_attn_with_kvcache's write of each batch row's new
    # keys into a float8 cache: one copy a row into one float8 tensor.
    from attnkit.flash_attn import flash_attn_with_kvcache

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(6)
    b, h, hkv, d = 2, 4, 2, 8

    def step(q, k_cache, v_cache, k, v, seen, kd, vd, table):
        return flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=seen, k_descale=kd, v_descale=vd,
            block_table=table, causal=True,
        )  # fmt: skip

    shape = (8, 4, hkv, d) if paged else (b, 16, hkv, d)
    table = torch.arange(8, dtype=torch.int32).view(b, 4) if paged else None
    caches = [torch.randn(*shape, generator=gen).to(torch.float8_e4m3fn) for _ in "kv"]
    copies = [t.clone() for t in caches]
    kd, vd = torch.rand(b, hkv, generator=gen) + 0.5, torch.rand(b, hkv, generator=gen) + 0.5
    compiled = torch.compile(step)
    with torch.no_grad():
        for at in range(3):
            q = torch.randn(b, 1, h, d, generator=gen)
            k, v = (torch.randn(b, 1, hkv, d, generator=gen) for _ in "kv")
            seen = torch.tensor([3, 5]) + at
            got = compiled(q, *caches, k, v, seen, kd, vd, table)
            torch.testing.assert_close(got, step(q, *copies, k, v, seen, kd, vd, table))
    torch._dynamo.reset()
    for got, want in zip(caches, copies, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("position", [3, 9])  # the ring not full yet; wrapped
@pytest.mark.parametrize("bad", ["softcap", "sinks", "scale"])
def test_a_refused_streaming_attention_call_leaves_the_cache_as_it_was(
    kv_dtype, position, bad
) -> None:
    # StreamingKVCache.attention() staged its step (writing the new token over the window's oldest
    # one) before attention() checked softcap, sinks and scale: a refused call left the token in
    # the ring and the step staged, and rewind(position - 1), which the cache allowed before the
    # call, was then refused.
    gen = torch.Generator().manual_seed(1)
    b, h, hkv, d = 2, 4, 2, 8
    cache = StreamingKVCache(b, hkv, d, sink_tokens=1, window=4, kv_dtype=kv_dtype)
    with torch.no_grad():
        for _ in range(position):
            cache.update(*(torch.randn(b, hkv, 1, d, generator=gen) for _ in "kv"))
    before = _state(cache, cache.length)  # the slots a later query may read
    wrong = {
        "softcap": {"softcap": -1.0},
        "sinks": {"sinks": torch.full((h,), float("nan"))},
        "scale": {"scale": float("nan")},
    }[bad]
    q = torch.randn(b, h, 1, d, generator=gen)
    k, v = torch.randn(b, hkv, 1, d, generator=gen), torch.randn(b, hkv, 1, d, generator=gen)
    with torch.no_grad(), pytest.raises(ValueError, match=bad):
        cache.attention(q, k, v, **wrong)
    assert cache.position == position
    for got, want in zip(_state(cache, cache.length), before, strict=True):
        assert torch.equal(got, want)
    cache.rewind(position - 1)  # (allowed before the refused call)
    assert cache.position == position - 1


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn])
def test_a_paged_stage_may_take_the_pages_of_a_later_rows_dropped_stage(kv_dtype) -> None:
    # A stage drops the uncommitted stage before it and counts that stage's pages as free, but
    # each row took its pages before the rows after it had given theirs back: row 0 found the
    # pool empty (an IndexError, "pop from empty list") and kept a page the block table did not
    # name, lost to the pool.
    gen = torch.Generator().manual_seed(2)
    b, h, hkv, d = 2, 4, 1, 4
    pool = PagedKVCache(3, 1, hkv, d, max_seqs=b, kv_dtype=kv_dtype)
    with torch.no_grad():
        pool.schedule([0, 2])  # row 1 takes pages 0 and 1, not committed
        pool.stage(
            torch.randn(b, hkv, 2, d, generator=gen), torch.randn(b, hkv, 2, d, generator=gen)
        )
        pool.schedule([3, 0])  # row 0 needs all three pages: row 1's stage is dropped first
        q = torch.randn(b, h, 3, d, generator=gen)
        k, v = torch.randn(b, hkv, 3, d, generator=gen), torch.randn(b, hkv, 3, d, generator=gen)
        out, _ = pool.attention(q, k, v, causal=True)
        pool.commit()
    assert pool.lengths == [3, 0]
    assert pool.num_free_pages == 0
    assert sorted(pool.pages_of(0)) == [0, 1, 2]
    assert pool.block_table[0].tolist() == pool.pages_of(0)
    keys, values = (t.double() for t in pool.view().row(0, torch.float64))
    if kv_dtype is None:
        assert torch.equal(keys[0].float(), k[0])
        assert torch.equal(values[0].float(), v[0])
    want = attnkit.attention(q[:1].double(), keys, values, causal=True, backend="reference")
    torch.testing.assert_close(out[:1].double(), want, atol=1e-5, rtol=1e-5)
    assert not out[1].any()  # (a row without new tokens: padding, 0)


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("first", ["step", "chunk"])
def test_a_wrapped_streaming_cache_rewinds_one_token_only_once(kv_dtype, first) -> None:
    # rewind() went back "by one token" from wherever the cache stood: after rewind(p - 1) it took
    # rewind(p - 2) too, though the token at p - 1 - W, which a query at p - 2 attends, had been
    # written over by the token at p - 1. The next steps then attended the wrong token. (A step
    # keeps a copy of the slot it wrote over, so after steps the cache goes back one more.)
    gen = torch.Generator().manual_seed(3)
    b, h, hkv, d, sinks, window = 2, 4, 2, 4, 1, 3
    cache = StreamingKVCache(b, hkv, d, sink_tokens=sinks, window=window, kv_dtype=kv_dtype)
    k, v = torch.randn(b, hkv, 12, d, generator=gen), torch.randn(b, hkv, 12, d, generator=gen)
    with torch.no_grad():
        if first == "chunk":
            cache.update(k[:, :, :10], v[:, :, :10])
            cache.rewind(9)  # by one: the window still holds positions 7 and 8
        else:
            for t in range(10):
                cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
            cache.rewind(9)  # the last step's copy puts position 6 back in its slot
            cache.rewind(8)  # by one: the window holds positions 6 and 7
        at = cache.position
        with pytest.raises(ValueError, match=f"cannot rewind to position {at - 1}"):
            cache.rewind(at - 1)  # position at - 1 - W was written over by position at
        assert cache.position == at
        q = torch.randn(b, h, 1, d, generator=gen)
        out, _ = cache.attention(q, k[:, :, at : at + 1], v[:, :, at : at + 1])
    # the float64 formula over the tokens as stored: the sink and the window up to position at
    keep = [0, *range(at + 1 - window, at + 1)]
    first_write = 10 if first == "chunk" else 1
    keys, values = (_as_stored(x, kv_dtype, first_write)[:, :, keep] for x in (k, v))
    want = attnkit.attention(q.double(), keys, values, backend="reference")
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("paged", [False, True], ids=["cache_batch_idx", "block_table"])
@pytest.mark.parametrize("fp8", [False, True])
def test_flash_attn_with_kvcache_refuses_rows_that_write_one_slot(paged, fp8) -> None:
    # Two batch rows writing their new keys to one slot (one cache row named twice by
    # cache_batch_idx, or one page in both rows' block tables) were accepted: the last write
    # won, and row 0 attended row 1's key in place of its own. No answer is right there (flash-
    # attn's kernels race): the call is refused, naming the rows, and writes nothing.
    from attnkit.flash_attn import flash_attn_with_kvcache

    gen = torch.Generator().manual_seed(4)
    b, h, hkv, d = 2, 2, 1, 4
    dtype = torch.float8_e4m3fn if fp8 else torch.float32
    k_cache, v_cache = (torch.randn(3, 4, hkv, d, generator=gen).to(dtype) for _ in "kv")
    before = [t.view(torch.uint8).clone() if fp8 else t.clone() for t in (k_cache, v_cache)]
    q = torch.randn(b, 1, h, d, generator=gen)
    k, v = torch.randn(b, 1, hkv, d, generator=gen), torch.randn(b, 1, hkv, d, generator=gen)
    call = {"cache_seqlens": torch.tensor([2, 2])}
    if paged:  # page 0 in both rows, at the column both write
        call["block_table"] = torch.tensor([[0, 1], [0, 2]], dtype=torch.int32)
    else:
        call["cache_batch_idx"] = torch.tensor([1, 1])
    with pytest.raises(ValueError, match="batch rows 0 and 1 write their new keys to one slot"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **call)
    after = [t.view(torch.uint8) if fp8 else t for t in (k_cache, v_cache)]
    assert all(torch.equal(x, y) for x, y in zip(after, before, strict=True))
    # the same call with rows of their own (cache row 2, or page 2 at the column written)
    if paged:
        call["block_table"] = torch.tensor([[0, 1], [2, 1]], dtype=torch.int32)
    else:
        call["cache_batch_idx"] = torch.tensor([1, 2])
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **call)
    for n, row in enumerate([0, 2] if paged else [1, 2]):
        keys, values = (
            c[row, :3].float().transpose(0, 1)[None].double() for c in (k_cache, v_cache)
        )
        want = attnkit.attention(q[n : n + 1].transpose(1, 2).double(), keys, values)
        torch.testing.assert_close(out[n : n + 1].transpose(1, 2).double(), want)


@pytest.mark.parametrize("kv_dtype", [torch.int8, *F8])
def test_a_quantized_cache_of_tiny_keys_reads_them_as_numbers(kv_dtype) -> None:
    # A head (float8) or token (int8) whose largest magnitude is tiny (1e-43: a subnormal
    # float32) got the scale amax / max, which is below float32's smallest number: 0. Its zeros
    # were then 0 / 0 = NaN (float8 keeps NaN), and every query that saw them gave NaN.
    gen = torch.Generator().manual_seed(5)
    b, h, hkv, d = 1, 2, 1, 4
    k = torch.tensor([1e-43, 0.0, -1e-44, 0.0]).expand(b, hkv, 3, d).clone()
    v = torch.randn(b, hkv, 3, d, generator=gen)
    cache = KVCache(b, 8, hkv, d, kv_dtype=kv_dtype)
    q = torch.randn(b, h, 1, d, generator=gen)
    with torch.no_grad():
        cache.update(k, v)
        out = attnkit.attention(q, cache.view())
    keys, _ = cache.view().dense(torch.float64)
    assert bool(keys.isfinite().all())
    torch.testing.assert_close(keys, k.double(), atol=1e-42, rtol=0)
    want = attnkit.attention(q.double(), k.double(), _as_stored(v, kv_dtype, 3))
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn])
def test_a_paged_cache_on_meta_takes_a_prompt_over_several_pages(kv_dtype) -> None:
    # A prompt longer than a page in more rows than one was written as one indexed write of the
    # real tokens, picked by a bool mask: on the meta device that index needs nonzero(), which
    # torch does not run there (NotImplementedError). Pages on meta hold no values to write: the
    # call gives the CPU call's slots, lengths, block table and output shape.
    got = {}
    for device in ("cpu", "meta"):
        pool = PagedKVCache(8, 2, 2, 4, max_seqs=2, kv_dtype=kv_dtype, device=device)
        pool.schedule([3, 2])
        q = torch.zeros(2, 4, 3, 4, device=device)
        k, v = (torch.zeros(2, 2, 3, 4, device=device) for _ in "kv")
        with torch.no_grad():
            slots = pool.stage(k, v)
            out, lse = pool.attention(q, k, v, causal=True)
            pool.commit()
        got[device] = (slots, out, lse, pool)
    (slots, out, lse, pool), (meta_slots, meta_out, meta_lse, meta_pool) = got["cpu"], got["meta"]
    assert meta_slots.is_meta
    assert meta_slots.shape == slots.shape
    assert meta_pool.lengths == pool.lengths == [3, 2]
    assert [meta_pool.pages_of(n) for n in (0, 1)] == [pool.pages_of(n) for n in (0, 1)]
    assert (meta_out.shape, meta_lse.shape) == (out.shape, lse.shape)


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn])
def test_paged_write_with_slots_or_pages_on_meta(kv_dtype) -> None:
    # PagedKVCache.write (vLLM's reshape_and_cache) read the slots' values to check them: slots
    # on meta failed in torch ("Tensor.item() cannot be called on meta tensors"), on a meta pool
    # as on a CPU one. Meta slots are refused for a pool that holds values (naming the argument);
    # a meta pool checks slots it can read and writes nothing.
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    pool = PagedKVCache(4, 2, 2, 4, max_seqs=1, kv_dtype=kv_dtype)
    before = [t.clone() for t in (pool.k_pages, pool.v_pages)]
    with pytest.raises(ValueError, match="slot_mapping is on meta"):
        pool.write(k, v, torch.tensor([0, 3], device="meta"))
    for got, want in zip((pool.k_pages, pool.v_pages), before, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    pool.write(k, v, torch.tensor([0, 3]))  # the same slots on the CPU: written
    stored = pool.k_pages[0, 0].float()  # slot 0: page 0, row 0, (Hkv, D)
    if kv_dtype is not None:
        stored = stored * pool.k_scales[0, :, 0]  # (float8: 1 on a page no sequence holds)
    want = k[0, :, None]  # (Hkv, 1, D)
    if kv_dtype == torch.int8:
        xq, scale = quantize_int8(want)
        want = xq.float() * scale
    elif kv_dtype is not None:
        xq, scale = quantize_fp8(want, kv_dtype, scale=torch.ones(2, 1, 1))
        want = xq.float() * scale
    torch.testing.assert_close(stored, want[:, 0])
    meta = PagedKVCache(4, 2, 2, 4, max_seqs=1, kv_dtype=kv_dtype, device="meta")
    k, v = k.to("meta"), v.to("meta")
    meta.write(k, v, torch.tensor([0, 3], device="meta"))
    meta.write(k, v, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="is not a slot"):
        meta.write(k, v, torch.tensor([0, 8]))


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("backend", ["chunked", "auto"])
def test_quantized_attention_under_vmap(kv_dtype, backend) -> None:
    # Before reading int8/float8 keys in place, chunked asks whether their scales are finite:
    # under torch.func.vmap no value can be read, and the call failed ("before a call that needs
    # gradients ... vmap cannot read a value") where float keys and values run. The scales that
    # cannot be read go the dequantizing way.
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 2, 4, 3, 8, generator=gen)
    k = (torch.randn(3, 2, 2, 5, 8, generator=gen) * 40).clamp(-127, 127).to(kv_dtype)
    scale = torch.rand(3, 2, 2, 5, 1, generator=gen) / 50

    def one(q, k, scale):
        return attnkit.attention(q, k, k, k_scale=scale, v_scale=scale, backend=backend)

    with torch.no_grad():
        out = torch.func.vmap(one)(q, k, scale)
    kd = (k.float() * scale).double()
    want = attnkit.attention(q.double(), kd, kd, backend="reference")
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
