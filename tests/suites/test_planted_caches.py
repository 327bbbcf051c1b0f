"""Quantized and eviction caches and attention statistics: behaviours each checked once, against
the float64 reference or the documented contract, where a small slip in the code would otherwise
go unnoticed (a bound off by one, a scale left behind when its token moves, a check that runs
after the state it guards has changed, a maximum taken as a sum).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import KVCache, StreamingKVCache, attention_stats
from attnkit.caches._quantize import fp8_scale, quantize_fp8, quantize_int8
from attnkit.testing import assert_close

F64 = torch.float64
D = 8


def randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).float()


def state(cache: object) -> dict[str, object]:
    """A cache's attributes, tensors cloned (one-byte dtypes as bytes)."""
    out: dict[str, object] = {}
    for name, value in vars(cache).items():
        if isinstance(value, Tensor):
            out[name] = (value.view(torch.uint8) if value.element_size() == 1 else value).clone()
        else:
            out[name] = value
    return out


def assert_same(before: dict[str, object], after: dict[str, object]) -> None:
    assert before.keys() == after.keys()
    for name, value in before.items():
        if isinstance(value, Tensor):
            other = after[name]
            assert isinstance(other, Tensor), name
            assert other.dtype == value.dtype, name
            assert torch.equal(value, other), name
        else:
            assert value == after[name], name


# quantizing


def test_an_int8_token_with_one_nan_reads_as_nan_in_every_element() -> None:
    x = randn(1, 2, 3, D, seed=1)
    x[0, 1, 2, 5] = float("nan")
    xq, scale = quantize_int8(x)
    read = xq.float() * scale
    assert read[0, 1, 2].isnan().all()  # the whole token, not only its NaN element
    assert read[0, 1, :2].isfinite().all()
    assert read[0, 0].isfinite().all()
    # through a cache: a query that sees the token gets NaN, as with the float keys
    cache = KVCache(1, 4, 2, D, kv_dtype=torch.int8)
    cache.update(x, randn(1, 2, 3, D, seed=2))
    out = attnkit.attention(randn(1, 2, 1, D, seed=3), cache.view(), None)
    assert out[0, 1].isnan().all()
    assert out[0, 0].isfinite().all()


def test_e4m3fn_stores_inf_as_nan_and_e5m2_keeps_it() -> None:
    x = torch.tensor([[[[1.0, float("inf"), -float("inf"), 2.0]]]])
    scale = torch.ones(1, 1, 1, 1)
    e4, _ = quantize_fp8(x, torch.float8_e4m3fn, scale=scale)
    assert e4.float()[0, 0, 0].tolist()[0::3] == [1.0, 2.0]
    assert e4.float()[0, 0, 0, 1:3].isnan().all()  # not saturated at +-448
    e5, _ = quantize_fp8(x, torch.float8_e5m2, scale=scale)
    assert e5.float()[0, 0, 0].tolist() == [1.0, float("inf"), -float("inf"), 2.0]


def test_fp8_saturates_finite_values_beyond_its_range() -> None:
    x = torch.tensor([[[[1e6, -1e6, 3.0]]]])
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        xq, _ = quantize_fp8(x, dtype, scale=torch.ones(1, 1, 1, 1))
        top = torch.finfo(dtype).max
        assert xq.float()[0, 0, 0].tolist() == [top, -top, 3.0]


def test_fp8_scale_reads_only_the_real_tokens() -> None:
    x = randn(2, 1, 4, D, seed=4)
    x[0, 0, 3] = 1000.0  # padding of row 0: sets no scale
    real = torch.tensor([[True, True, True, False], [True, True, True, True]])
    scale = fp8_scale(x, torch.float8_e4m3fn, real[:, None, :, None])
    top = torch.finfo(torch.float8_e4m3fn).max
    assert scale[0].item() == pytest.approx(x[0, 0, :3].abs().max().item() / top, rel=1e-6)
    assert scale[1].item() == pytest.approx(x[1].abs().max().item() / top, rel=1e-6)


# checks of quantized calls


def test_float_keys_with_int8_values_are_refused_naming_both() -> None:
    q, k = randn(1, 2, 3, D, seed=5), randn(1, 2, 4, D, seed=6)
    v = torch.ones(1, 2, 4, D, dtype=torch.int8)
    with pytest.raises(TypeError, match=r"share a dtype, got k float32 and v int8"):
        attnkit.attention(q, k, v, k_scale=torch.ones(1), v_scale=torch.ones(1))


def test_a_value_scale_alone_gets_its_gradient() -> None:
    q, k8, v8 = randn(1, 2, 3, D, seed=7), quantize_int8(randn(1, 2, 5, D, seed=8))[0], None
    v8, vs = quantize_int8(randn(1, 2, 5, D, seed=9))
    ks = torch.full((1, 2, 5, 1), 0.02)
    vs = vs.clone().requires_grad_(True)
    out = attnkit.attention(q, k8, v8, k_scale=ks, v_scale=vs)
    (grad,) = torch.autograd.grad(out.square().sum(), vs)
    vs64 = vs.detach().double().requires_grad_(True)
    want = attnkit.attention(
        q.double(), k8.double() * ks.double(), v8.double() * vs64, backend="reference"
    )
    (want_grad,) = torch.autograd.grad(want.square().sum(), vs64)
    assert_close(grad, want_grad, dtype=torch.float32)


def test_a_scale_per_element_is_refused() -> None:
    q = randn(1, 2, 3, D, seed=54)
    k8, ks = quantize_int8(randn(1, 2, 5, D, seed=55))
    with pytest.raises(ValueError, match=r"k_scale must be broadcastable to .*\(1, 2, 5, 1\)"):
        attnkit.attention(q, k8, k8, k_scale=ks.expand(1, 2, 5, D), v_scale=ks)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_bfloat16_queries_read_int8_keys_and_values_dequantized_to_bfloat16(backend: str) -> None:
    q = randn(1, 2, 3, D, seed=56).bfloat16()
    (k8, ks), (v8, vs) = (quantize_int8(randn(1, 2, 5, D, seed=s)) for s in (57, 58))
    out = attnkit.attention(q, k8, v8, k_scale=ks, v_scale=vs, backend=backend)
    # the keys and values the call sees: (k.float() * k_scale).to(q.dtype)
    keys, values = ((x.float() * s).bfloat16() for x, s in ((k8, ks), (v8, vs)))
    assert torch.equal(out, attnkit.attention(q, keys, values, backend=backend))


# eviction: KVCache.keep


def test_keep_refuses_the_token_just_past_the_held_ones_and_changes_nothing() -> None:
    cache = KVCache(1, 8, 2, D)
    cache.update(randn(1, 2, 5, D, seed=10), randn(1, 2, 5, D, seed=11))
    before = state(cache)
    with pytest.raises(ValueError, match=r"from 0 to 4 .* got 5"):
        cache.keep(torch.tensor([[[0, 5], [1, 2]]]))
    assert_same(before, state(cache))


def test_keep_refuses_a_token_twice_and_changes_nothing() -> None:
    cache = KVCache(1, 8, 2, D)
    cache.update(randn(1, 2, 5, D, seed=12), randn(1, 2, 5, D, seed=13))
    before = state(cache)
    with pytest.raises(ValueError, match=r"keeps token 3 twice"):
        cache.keep(torch.tensor([[[3, 0, 3], [1, 2, 4]]]))
    assert_same(before, state(cache))


def test_keep_on_an_int8_cache_moves_the_values_scales_with_their_tokens() -> None:
    k, v = randn(1, 2, 6, D, seed=14), randn(1, 2, 6, D, seed=15)
    v[..., 1::2, :] *= 50  # scales that differ from token to token
    cache = KVCache(1, 8, 2, D, kv_dtype=torch.int8)
    cache.update(k, v)
    keys, values = (t.double() for t in cache.view().dense(F64))
    index = torch.tensor([[[5, 1, 3], [0, 4, 5]]])
    cache.keep(index)
    q = randn(1, 4, 1, D, seed=16)
    at = index.sort(-1).values[..., None].expand(1, 2, 3, D)
    want = attnkit.attention(
        q.double(), keys.gather(2, at), values.gather(2, at), backend="reference"
    )
    assert_close(attnkit.attention(q, cache.view(), None), want, dtype=torch.float32)


def test_keep_refuses_a_staged_token() -> None:
    cache = KVCache(1, 8, 1, D)
    cache.update(randn(1, 1, 3, D, seed=50), randn(1, 1, 3, D, seed=51))
    cache.stage(randn(1, 1, 2, D, seed=52), randn(1, 1, 2, D, seed=53))
    before = state(cache)
    with pytest.raises(ValueError, match=r"from 0 to 2 .* got 3"):
        cache.keep(torch.tensor([[[0, 3]]]))
    assert_same(before, state(cache))


def test_keep_drops_the_staged_tokens() -> None:
    cache = KVCache(1, 8, 1, D)
    cache.update(randn(1, 1, 4, D, seed=17), randn(1, 1, 4, D, seed=18))
    cache.stage(randn(1, 1, 2, D, seed=19), randn(1, 1, 2, D, seed=20))
    cache.keep(torch.tensor([[[0, 2]]]))
    cache.commit()  # nothing staged any more
    assert (cache.length, cache.position) == (2, 4)
    assert cache.view().dense(F64)[0].size(2) == 2


def test_rewind_after_keep_counts_positions_back_too() -> None:
    cache = KVCache(1, 8, 1, D)
    cache.update(randn(1, 1, 6, D, seed=21), randn(1, 1, 6, D, seed=22))
    cache.keep(torch.tensor([[[1, 3, 5]]]))  # length 3, position 6
    cache.update(randn(1, 1, 2, D, seed=23), randn(1, 1, 2, D, seed=24))
    cache.rewind(4)  # forget the 1 token past 4 held: position back by 1 too
    assert (cache.length, cache.position) == (4, 7)
    cache.rewind(0)
    assert (cache.length, cache.position) == (0, 3)


# moving a cache


def test_to_refuses_a_storage_dtype_and_changes_nothing() -> None:
    cache = KVCache(1, 8, 2, D)
    cache.update(randn(1, 2, 3, D, seed=25), randn(1, 2, 3, D, seed=26))
    before = state(cache)
    with pytest.raises(TypeError, match=r"kv_dtype=torch.int8"):
        cache.to(dtype=torch.int8)
    assert_same(before, state(cache))


# StreamingKVCache


def streaming(position: int) -> StreamingKVCache:
    cache = StreamingKVCache(1, 1, D, sink_tokens=1, window=3)
    for i in range(position):
        cache.update(randn(1, 1, 1, D, seed=100 + i), randn(1, 1, 1, D, seed=200 + i))
    return cache


def test_streaming_rewinds_at_most_one_token_once_the_ring_has_wrapped() -> None:
    cache = streaming(7)
    before = state(cache)
    with pytest.raises(ValueError, match=r"cannot rewind to position 5"):
        cache.rewind(5)
    assert_same(before, state(cache))
    cache.rewind(6)
    assert cache.position == 6


def test_a_staged_step_on_a_full_ring_refuses_a_rewind_past_it() -> None:
    cache = streaming(4)  # S + W tokens: every slot holds one, none written twice
    cache.stage(randn(1, 1, 1, D, seed=30), randn(1, 1, 1, D, seed=31))  # over token 1's slot
    with pytest.raises(ValueError, match=r"cannot rewind to position 3"):
        cache.rewind(3)


def streamed(cache: StreamingKVCache, q: Tensor) -> Tensor:
    """A step's output over what the cache holds, from the float64 reference over its held
    tokens (any order: one query attends every one of them)."""
    keys, values = (t[:, :, : cache.length] for t in (cache.k_cache, cache.v_cache))
    return attnkit.attention(q.double(), keys.double(), values.double(), backend="reference")


@pytest.mark.parametrize("position", [4, 6], ids=["just-full", "wrapped"])
def test_rewinding_a_staged_step_on_a_full_ring_puts_the_oldest_token_back(position: int) -> None:
    cache = streaming(position)  # S + W = 4: the step writes over a held token
    q = randn(1, 1, 1, D, seed=34)
    want = streamed(cache, q)
    cache.stage(randn(1, 1, 1, D, seed=35), randn(1, 1, 1, D, seed=36))
    cache.rewind(position)
    assert cache.position == position
    assert_close(attnkit.attention(q, cache.view(), None), want, dtype=torch.float32)


def test_rewinding_a_chunk_on_a_full_ring_puts_its_slots_back() -> None:
    cache = streaming(6)
    before = state(cache)
    cache.update(randn(1, 1, 2, D, seed=37), randn(1, 1, 2, D, seed=38))
    cache.rewind(6)
    after = state(cache)
    for name in ("k_cache", "v_cache", "position"):
        assert_same({name: before[name]}, {name: after[name]})


def test_a_streaming_chunk_moved_then_rewound_is_refused_or_put_back_in_the_new_dtype() -> None:
    cache = streaming(6)
    k, v = randn(1, 1, 2, D, seed=32), randn(1, 1, 2, D, seed=33)
    cache.update(k, v)
    cache.to(dtype=torch.float64)
    with pytest.raises(ValueError, match=r"cannot rewind to position 6"):
        cache.rewind(6)


# attention_stats


def reference(q: Tensor, k: Tensor, **kw: object) -> tuple[Tensor, Tensor, Tensor]:
    """Column sums, column maxima and row entropies of the float64 reference's weights."""
    kw = {
        n: v.double() if isinstance(v, Tensor) and v.is_floating_point() else v
        for n, v in kw.items()
    }
    _, w = attnkit.attention(
        q.double(), k.double(), k.double(), return_weights=True, backend="reference", **kw
    )
    return w.sum(-2), w.amax(-2), torch.special.entr(w).sum(-1)


def test_per_kv_head_key_max_is_the_largest_over_the_group() -> None:
    q, k = randn(1, 4, 5, D, seed=40), randn(1, 2, 6, D, seed=41)
    stats = attention_stats(q, k, causal=True, per_kv_head=True)
    mass, top, _ = reference(q, k, causal=True)
    assert_close(stats.key_mass, mass.unflatten(1, (2, 2)).sum(2), dtype=torch.float32)
    assert_close(stats.key_max, top.unflatten(1, (2, 2)).amax(2), dtype=torch.float32)


@pytest.mark.parametrize("kernel", ["native", "eager"])
def test_a_given_lse_of_minus_inf_gives_no_weight(kernel: str) -> None:
    q, k = randn(1, 2, 4, D, seed=42), randn(1, 2, 4, D, seed=43)
    _, lse = attnkit.attention(q, k, k, return_lse=True)
    lse = lse.clone()
    lse[0, 1, 2] = float("-inf")
    if kernel == "eager":  # (a NaN query of head 0: the eager pass serves the call)
        q = nan_row(q)
    ref = attention_stats(q, k, lse=lse, backend="reference")
    got = attention_stats(q, k, lse=lse)
    for a, b in zip(
        (ref.key_mass, ref.key_max, ref.entropy),
        (got.key_mass, got.key_max, got.entropy),
        strict=True,
    ):
        assert a[0, 1].isfinite().all()
        assert b[0, 1].isfinite().all()
        assert_close(b[0, 1], a[0, 1], dtype=torch.float32)
    assert ref.entropy[0, 1, 2] == 0
    assert got.entropy[0, 1, 2] == 0


def nan_row(q: Tensor) -> Tensor:
    """q with a NaN in its last query of head 0: the eager pass serves the call (the native
    one takes finite q and k only), and only that query's statistics are NaN."""
    q = q.clone()
    q[0, 0, -1, 0] = float("nan")
    return q


def test_the_eager_pass_gives_a_query_with_no_visible_key_no_weight() -> None:
    q, k = nan_row(randn(1, 2, 6, D, seed=44)), randn(1, 2, 6, D, seed=45)
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[1] = False  # query 1 sees no key
    stats = attention_stats(q, k, mask=mask)
    mass, top, entropy = reference(q[:, 1:], k[:, 1:], mask=mask)
    assert_close(stats.key_mass[:, 1:], mass, dtype=torch.float32)
    assert_close(stats.key_max[:, 1:], top, dtype=torch.float32)
    assert_close(stats.entropy[:, 1:], entropy, dtype=torch.float32)
    assert stats.entropy[0, 0, 1] == 0


def test_the_eager_pass_over_a_causal_diagonal_gives_finite_entropies() -> None:
    q, k = nan_row(randn(1, 2, 40, D, seed=46)), randn(1, 2, 40, D, seed=47)
    stats = attention_stats(q, k, causal=True)
    _, _, entropy = reference(q, k, causal=True)
    assert_close(stats.entropy[0, 1], entropy[0, 1], dtype=torch.float32)
    assert_close(stats.entropy[0, 0, :-1], entropy[0, 0, :-1], dtype=torch.float32)
    assert math.isnan(float(stats.entropy[0, 0, -1]))


def test_the_eager_pass_with_grouped_heads_normalises_each_query_head_by_its_own_lse() -> None:
    q, k = nan_row(randn(1, 4, 5, D, seed=48)), randn(1, 2, 7, D, seed=49)
    stats = attention_stats(q, k, causal=True)
    mass, top, entropy = reference(q, k, causal=True)
    # (head 0's last query is NaN: the second group's heads are the ones to compare)
    assert_close(stats.key_mass[:, 2:], mass[:, 2:], dtype=torch.float32)
    assert_close(stats.key_max[:, 2:], top[:, 2:], dtype=torch.float32)
    assert_close(stats.entropy[:, 1:], entropy[:, 1:], dtype=torch.float32)


def test_the_eager_pass_with_grouped_heads_reads_each_query_heads_bias() -> None:
    q, k = nan_row(randn(1, 4, 5, D, seed=59)), randn(1, 2, 5, D, seed=60)
    bias = randn(4, 5, 5, seed=61) * 3
    stats = attention_stats(q, k, bias=bias)
    mass, top, entropy = reference(q, k, bias=bias)
    assert_close(stats.key_mass[:, 1:], mass[:, 1:], dtype=torch.float32)
    assert_close(stats.key_max[:, 1:], top[:, 1:], dtype=torch.float32)
    assert_close(stats.entropy[:, 1:], entropy[:, 1:], dtype=torch.float32)
