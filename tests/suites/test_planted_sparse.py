"""Index masks, latent attention and the flex lowering at the edges the other suites pass by: a
selection that names the first key past a row's end, a window's oldest key on a cache, block
selections over more than 32 blocks, a selection changed in place, rotary positions after a
cache let tokens go, a checkpoint's own norm epsilon. Each case against the float64 reference
or a property the docs promise."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks
from attnkit.backends.flex import lower_call, run_lowered
from attnkit.backends.flex.mask_mod import bitmap_bytes
from attnkit.caches.view import CacheView
from attnkit.interop.deepseek import FrequencyRotary, latent_attention
from attnkit.scores import DistanceBias

F64 = torch.float64


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def paged(lengths: list[int], *, page: int = 4, hkv: int = 2, d: int = 8) -> attnkit.PagedKVCache:
    """A float32 paged cache holding rows of ``lengths`` random tokens."""
    cache = attnkit.PagedKVCache(
        num_blocks=sum(-(-n // page) for n in lengths) + 4, page_size=page, num_kv_heads=hkv,
        head_dim=d, max_seqs=len(lengths), dtype=torch.float32,
    )  # fmt: skip
    t = max(lengths)
    cache.schedule(lengths)
    cache.stage(randn(len(lengths), hkv, t, d, seed=1), randn(len(lengths), hkv, t, d, seed=2))
    cache.commit()
    return cache


def by_rows(q: Tensor, cache: attnkit.PagedKVCache, allowed: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Each row's queries over its own keys under ``allowed[n]`` ``(H, Tq, L)``, by the float64
    reference: ``(out, lse)``."""
    view = cache.view()
    outs, lses = [], []
    for n in range(view.rows):
        k, v = view.row(n)
        o, s = attnkit.attention(
            q[n : n + 1].to(F64), k.to(F64), v.to(F64), mask=masks.from_tensor(allowed[n][None]),
            backend="reference", return_lse=True,
        )  # fmt: skip
        outs.append(o[0])
        lses.append(s[0])
    return torch.stack(outs), torch.stack(lses)


def written_out(idx: Tensor, n: int, heads: int, length: int) -> Tensor:
    """Row ``n``'s selection ``(Hi, Tq, k)`` as a bool ``(H, Tq, length)``: the keys it names
    that the row holds."""
    rows = idx[n]
    out = torch.zeros(rows.size(0), rows.size(1), length, dtype=torch.bool)
    for h in range(rows.size(0)):
        for t in range(rows.size(1)):
            for x in rows[h, t].tolist():
                if 0 <= x < length:
                    out[h, t, x] = True
    return out.repeat_interleave(heads // rows.size(0), 0)


# --------------------------------------------------------------------------------------------------
# Index masks on a paged cache


def test_a_selected_key_just_past_a_rows_end_is_not_attended() -> None:
    """Without causal, a query that names its row's end (the first position the row does not
    hold: a slot of its last page with whatever the page holds there) ignores that entry, as it
    ignores every key past the end."""
    lengths, h = [5, 8, 3], 4
    cache = paged(lengths)
    q = randn(3, h, 1, 8, seed=3)
    k_new, v_new = randn(3, 2, 1, 8, seed=4), randn(3, 2, 1, 8, seed=5)
    ends = [n + 1 for n in lengths]  # held and the staged new token
    idx = torch.tensor([[[[0, 2, ends[0]]]], [[[ends[1] - 1, 1, 7]]], [[[3, ends[2], -1]]]])
    out, lse = cache.attention(q, k_new, v_new, mask=masks.key_indices(idx))
    allowed = [written_out(idx, n, h, end) for n, end in enumerate(ends)]
    want, want_lse = by_rows(q, cache, allowed)
    torch.testing.assert_close(out.to(F64), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.to(F64), want_lse, atol=1e-5, rtol=1e-5)


def test_padding_queries_with_sinks_give_zero_and_minus_infinity() -> None:
    """Rows whose new tokens are fewer than the call's queries (``schedule``): each padding
    query gives 0 and ``-inf``, sinks or not; the first padding query of a row included."""
    lengths, h = [6, 9], 4
    cache = paged(lengths)
    cache.schedule([3, 1])
    q = randn(2, h, 3, 8, seed=6)
    k_new, v_new = randn(2, 2, 3, 8, seed=7), randn(2, 2, 3, 8, seed=8)
    idx = torch.tensor([[0, 2, 4, -1], [1, 5, 6, 3], [7, 8, 0, 1]]).view(1, 1, 3, 4)
    sinks = randn(h, seed=9)
    mask = masks.key_indices(idx) & masks.causal()
    out, lse = cache.attention(q, k_new, v_new, mask=mask, sinks=sinks)
    assert bool((out[1, :, 1:] == 0).all())
    assert bool((lse[1, :, 1:] == -math.inf).all()), lse[1]
    assert bool((lse[0] > -math.inf).all())  # (every real query attends the sink at least)


def test_a_selection_changed_in_place_is_read_again() -> None:
    """An indexer that writes its top-k into the same tensor each step: the mask made once over
    it attends the new selection, on the gathered kernel and on the reference (which writes
    the mask out tile by tile)."""
    q, k, v = randn(1, 2, 4, 8, seed=14), randn(1, 2, 12, 8, seed=15), randn(1, 2, 12, 8, seed=16)
    idx = torch.tensor([[0, 3, 5], [1, 1, 7], [2, 9, -1], [11, 4, 6]]).view(1, 1, 4, 3)
    mask = masks.key_indices(idx)
    for backend in ("chunked", "reference"):
        idx[..., 0] = torch.tensor([0, 1, 2, 11])
        attnkit.attention(q, k, v, mask=mask, backend=backend)
        idx[..., 0] = torch.tensor([8, 10, 6, 0])
        got = attnkit.attention(q, k, v, mask=mask, backend=backend)
        fresh = masks.key_indices(idx.clone())
        want = attnkit.attention(
            q.double(), k.double(), v.double(), mask=fresh, backend="reference"
        )
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=backend)


def rows_case(
    dtype: torch.dtype = F64,
) -> tuple[Tensor, Tensor, Tensor, CacheView, Tensor, list[Tensor]]:
    """Rows of 7, 12 and 4 keys in pages of their own (float64, needing gradients), two queries
    a row, a selection per key/value head with entries past some rows' ends; and each row's
    selection & causal written out ``(H, 2, L)``."""
    lengths, h, hkv = [7, 12, 4], 4, 2
    k = randn(3, hkv, 12, 8, seed=17, dtype=dtype).requires_grad_()
    v = randn(3, hkv, 12, 8, seed=18, dtype=dtype).requires_grad_()
    view = CacheView(k, v, tuple((0, n) for n in lengths))
    q = randn(3, h, 2, 8, seed=19, dtype=dtype)
    idx = torch.randint(-1, 12, (3, hkv, 2, 5), generator=torch.Generator().manual_seed(20))
    allowed = []
    for n, length in enumerate(lengths):
        j, at = torch.arange(length), torch.arange(length - 2, length)[:, None]
        allowed.append(written_out(idx, n, h, length) & (j <= at))
    return q, k, v, view, idx, allowed


def per_row(
    q: Tensor, k: Tensor, v: Tensor, view: CacheView, allowed: list[Tensor], **kw: object
) -> Tensor:
    """Each row's queries over its keys under ``allowed[n]``, by the reference."""
    outs = []
    for n, (_, end) in enumerate(view.kv_range):
        mask = masks.from_tensor(allowed[n][None])
        outs.append(attnkit.attention(q[n : n + 1], k[n : n + 1, :, :end], v[n : n + 1, :, :end],
                                      mask=mask, backend="reference", **kw))  # type: ignore[call-overload]  # fmt: skip
    return torch.cat(outs)


def test_alibi_on_a_cache_with_an_index_mask() -> None:
    """A bias by distance (ALiBi) is added at each selected key's distance from its query,
    each row's queries aligned to its own end."""
    q, k, v, view, idx, allowed = rows_case()
    table = randn(4, 13, seed=21, dtype=F64)  # distances -11 .. 1
    bias = DistanceBias(table, first=-11)
    with torch.no_grad():
        got = attnkit.attention(q, view, mask=masks.key_indices(idx), causal=True, bias=bias)
        want = per_row(q, k, v, view, allowed, bias=bias)
    torch.testing.assert_close(got, want)


def test_gradients_reach_the_pages_through_an_index_mask() -> None:
    """Pages that need gradients (a learned prefix held as a cache) get them, the queries not
    needing any: the call runs where autograd sees it (float32 pages, which the native kernel
    would otherwise take)."""
    q, k, v, view, idx, allowed = rows_case(torch.float32)
    got = attnkit.attention(q, view, mask=masks.key_indices(idx), causal=True)
    got.pow(2).sum().backward()
    k64, v64 = k.detach().double().requires_grad_(), v.detach().double().requires_grad_()
    per_row(q.double(), k64, v64, view, allowed).pow(2).sum().backward()
    for got_grad, want in ((k.grad, k64.grad), (v.grad, v64.grad)):
        assert got_grad is not None
        torch.testing.assert_close(got_grad.double(), want, atol=1e-5, rtol=1e-5)


def test_a_selection_changed_in_place_is_planned_again() -> None:
    """Over keys of several blocks, a selection moved in place to other blocks: the block plan
    made for the first call (which blocks some query selects a key of) is not reused for the
    second, on the chunked kernel (the index mask ORed with a window) and on flex."""
    q, k, v = randn(1, 2, 3, 8, seed=23), randn(1, 2, 400, 8, seed=24), randn(1, 2, 400, 8, seed=25)
    idx = torch.tensor([[0, 5], [1, 9], [2, 3]]).view(1, 1, 3, 2)
    mask = masks.key_indices(idx) | masks.sliding_window(1)
    runs = {
        "chunked": lambda: attnkit.attention(q, k, v, mask=mask, backend="chunked"),
        "flex": lambda: flex_eager(q, k, v, mask=mask),
    }
    for name, run in runs.items():
        idx.copy_(torch.tensor([[0, 5], [1, 9], [2, 3]]).view(1, 1, 3, 2))
        run()
        idx.copy_(torch.tensor([[150, 250], [140, 260], [300, 200]]).view(1, 1, 3, 2))
        fresh = masks.key_indices(idx.clone()) | masks.sliding_window(1)
        want = attnkit.attention(
            q.double(), k.double(), v.double(), mask=fresh, backend="reference"
        )
        torch.testing.assert_close(run().double(), want, atol=1e-5, rtol=1e-5, msg=name)


def test_a_window_on_a_cache_keeps_its_oldest_key() -> None:
    """``key_indices & sliding_window(3)`` on rows of their own lengths: each query attends the
    selected keys among its 4 (its own and the 3 before, the oldest included)."""
    q, k, v, view, _, _ = rows_case()
    ends = [end for _, end in view.kv_range]
    # each query selects its window's oldest key, its own and one outside the window
    idx = torch.stack([torch.tensor([[e - 5, e - 2, e - 7], [e - 4, e - 1, e - 6]]) for e in ends])
    idx = idx.clamp_min(-1).view(3, 1, 2, 3)
    with torch.no_grad():
        got = attnkit.attention(q, view, mask=masks.key_indices(idx) & masks.sliding_window(3))
    allowed = []
    for n, end in enumerate(ends):
        j, at = torch.arange(end), torch.arange(end - 2, end)[:, None]
        allowed.append(written_out(idx, n, 4, end) & (j >= at - 3) & (j <= at))
    with torch.no_grad():
        want = per_row(q, k, v, view, allowed)
    torch.testing.assert_close(got, want)


def test_torchs_products_per_batch_row_with_alibi_and_gradients() -> None:
    """The gathered call on torch's products (no native kernel): a selection per batch row and
    key/value head, ALiBi on fewer queries than keys (each query at its aligned position), a
    scale of its own; outputs and gradients against the reference's."""
    q = randn(2, 4, 3, 8, seed=31, dtype=F64).requires_grad_()
    k = randn(2, 2, 64, 8, seed=32, dtype=F64).requires_grad_()
    v = randn(2, 2, 64, 8, seed=33, dtype=F64).requires_grad_()
    # (4 keys of 64 a query: few enough that the keys are gathered, not scanned)
    idx = torch.randint(40, 64, (2, 2, 3, 4), generator=torch.Generator().manual_seed(34))
    bias = DistanceBias(randn(4, 66, seed=35, dtype=F64), first=-63)
    mask = masks.key_indices(idx) & masks.causal()
    grads = []
    for backend in (attnkit.backends.Chunked(native=False), "reference"):
        out = attnkit.attention(q, k, v, mask=mask, bias=bias, scale=0.6, backend=backend)
        grads.append((out, *torch.autograd.grad(out.pow(2).sum(), (q, k, v))))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want)


def test_two_selections_per_head_anded() -> None:
    """Two index masks of a selection per key/value head ANDed, 4 query heads on 2: query head
    ``h`` reads selection ``h // 2`` of each."""
    q, k, v = randn(1, 4, 3, 8, seed=36), randn(1, 2, 64, 8, seed=37), randn(1, 2, 64, 8, seed=38)
    g = torch.Generator().manual_seed(39)
    a, b = (
        torch.randint(0, 16, (1, 2, 3, 8), generator=g),
        torch.randint(0, 16, (1, 2, 3, 8), generator=g),
    )
    mask = masks.key_indices(a) & masks.key_indices(b)
    got = attnkit.attention(q, k, v, mask=mask, backend=attnkit.backends.Chunked(native=False))
    want = attnkit.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_a_selection_of_other_batch_rows_is_refused() -> None:
    """Indices of 2 batch rows for a call of 3: refused with both numbers (1 or B rows)."""
    q = randn(3, 2, 4, 8, seed=40)
    idx = torch.zeros(2, 1, 4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="has 2 batch rows but the call has B = 3"):
        attnkit.attention(q, q, q, mask=masks.key_indices(idx))


# --------------------------------------------------------------------------------------------------
# Latent attention


def mla() -> attnkit.MultiHeadLatentAttention:
    torch.manual_seed(0)
    return attnkit.MultiHeadLatentAttention(
        32, 4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
    ).double()


@torch.no_grad()
def test_rewinding_a_latent_cache_past_its_length_holds_nothing_more() -> None:
    """``rewind(n)`` forgets the tokens from ``n`` on: with ``n`` past what the cache holds it
    forgets none and holds none more, and the next step attends the tokens held alone."""
    m = mla()
    x = randn(2, 6, 32, seed=10, dtype=F64)
    cache = m.make_cache(batch_size=2, max_len=16)
    m(x[:, :5], causal=True, cache=cache)
    cache.rewind(12)
    assert cache.length == 5
    step = m(x[:, 5:], causal=True, cache=cache)
    torch.testing.assert_close(step, m(x, causal=True)[:, 5:])
    assert cache.length == 6


@torch.no_grad()
def test_a_step_that_fails_after_staging_leaves_each_cache_as_it_was() -> None:
    """A step whose output projection raises (a hook) after its latents were staged: the cache
    holds what it held, and the steps after it are those of a run without the failed one."""
    m = mla()
    x = randn(2, 7, 32, seed=26, dtype=F64)
    whole = m(x, causal=True)
    caches = {
        "latent": m.make_cache(batch_size=2, max_len=16),
        "kv": m.make_kv_cache(batch_size=2, max_len=16),
        "paged": m.make_paged_cache(16, 4, max_seqs=2),
    }

    def fail(*_: object) -> None:
        raise RuntimeError("a failing hook")

    for name, cache in caches.items():
        m(x[:, :4], causal=True, cache=cache)
        hook = m.out_proj.register_forward_hook(fail)
        try:
            m(x[:, 4:6], causal=True, cache=cache)
        except RuntimeError:
            pass
        finally:
            hook.remove()
        for t in range(4, 7):
            step = m(x[:, t : t + 1], causal=True, cache=cache)
            torch.testing.assert_close(step, whole[:, t : t + 1], msg=name)


@torch.no_grad()
def test_new_tokens_rotate_from_every_token_seen_after_keep() -> None:
    """After ``KVCache.keep`` lets a token go, a new token is rotated at its place in the
    sequence (every token taken counts), not at the number of tokens kept: the step is the
    uncached call over the same tokens with the dropped one masked."""
    m = mla()
    x = randn(1, 5, 32, seed=27, dtype=F64)
    cache = m.make_kv_cache(batch_size=1, max_len=8)
    m(x[:, :4], causal=True, cache=cache)
    cache.keep(torch.tensor([0, 1, 3]).view(1, 1, 3))
    step = m(x[:, 4:], cache=cache)
    seen = torch.tensor([True, True, False, True, True]).view(1, 1, 1, 5)
    torch.testing.assert_close(step, m(x, mask=masks.from_tensor(seen))[:, 4:])


@torch.no_grad()
def test_a_kv_cache_whose_values_are_not_the_latents_is_refused() -> None:
    """A KV cache of the latents' width whose values are fewer than ``kv_lora_rank`` columns of
    its keys cannot hold this module's latents: the call is refused with what it needs, before
    anything is written."""
    m = mla()
    cache = attnkit.KVCache(1, 8, 1, 20, 8, dtype=F64, values_in_keys=True)
    with pytest.raises(ValueError, match=r"v_head_dim = kv_lora_rank = 16 .* v_head_dim=8"):
        m(randn(1, 1, 32, seed=30, dtype=F64), cache=cache)
    assert cache.length == 0


# --------------------------------------------------------------------------------------------------
# The flex lowering


def flex_eager(q: Tensor, k: Tensor, v: Tensor, **kw: object) -> Tensor:
    """The call lowered for FlexAttention and run by its eager form (what the compiled kernel
    computes, without compiling)."""
    call = attnkit.explain(q, k, v, **kw).call  # type: ignore[arg-type]
    out, _ = run_lowered(lower_call(call, q, k, v, None), lse=False, compiled=False)
    return out


def test_block_indices_over_more_than_32_blocks_on_flex() -> None:
    """Blocks of 2 over 65 keys: 33 blocks, the last one key wide, in a bitmap of two 32-bit
    words a query (the second for the last block alone); selections in both words."""
    q = randn(1, 2, 5, 8, seed=11)
    k, v = randn(1, 2, 65, 8, seed=12), randn(1, 2, 65, 8, seed=13)
    idx = torch.tensor([[32, 0, -1], [31, 32, 30], [5, 5, 20], [32, -1, -1], [1, 2, 3]])
    mask = masks.block_indices(idx.view(1, 1, 5, 3), block=2)
    got = flex_eager(q, k, v, mask=mask)
    want = attnkit.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_the_rotary_scaling_multiplies_both_halves() -> None:
    """YaRN's ``attention_scaling`` scales the rotated vector as a whole (its cos and its sin):
    a rotation that keeps norms, times the scaling."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=F64) / 8))
    x = randn(2, 3, 7, 8, seed=22, dtype=F64)
    plain = FrequencyRotary(inv_freq)(x, offset=5)
    torch.testing.assert_close(FrequencyRotary(inv_freq, 0.75)(x, offset=5), 0.75 * plain)
    torch.testing.assert_close(plain.norm(dim=-1), x.norm(dim=-1))


def test_the_bitmap_size_counts_blocks_not_keys() -> None:
    """What ``explain()`` quotes for an index mask's bitmap: a bit a key, or a block of keys,
    per query and selection head, in 32-bit words (256 keys: 8 words; 64 blocks of 4: 2)."""
    geo = masks.Geometry((3,), 4, 5, 256, torch.device("cpu"))
    idx = torch.zeros(1, 2, 5, 3, dtype=torch.long)
    assert bitmap_bytes(masks.key_indices(idx), geo) == 2 * 5 * 8 * 4
    assert bitmap_bytes(masks.block_indices(idx, block=4), geo) == 2 * 5 * 2 * 4
    assert bitmap_bytes(masks.block_indices(idx, block=3), geo) == 2 * 5 * 3 * 4  # 86 blocks


# --------------------------------------------------------------------------------------------------
# Loading DeepSeek's attention


def deepseek_module(**kw: object) -> tuple[object, torch.nn.Module]:
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    c = transformers.DeepseekV3Config(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=12,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        num_hidden_layers=1, vocab_size=32, max_position_embeddings=64, **kw,
    )  # fmt: skip
    torch.manual_seed(0)
    return hf, hf.DeepseekV3Attention(c, layer_idx=0).to(F64).eval()


def test_the_loaded_norms_take_their_own_epsilon() -> None:
    """Norms whose epsilon is not the default (set on transformers' modules, as a variant's
    own layers set it): each loaded norm takes its own and gives what transformers' gives."""
    _, module = deepseek_module()
    module.kv_a_layernorm.variance_epsilon = 0.5
    module.q_a_layernorm.variance_epsilon = 0.25
    out = latent_attention(module)
    x = randn(3, 16, seed=28, dtype=F64)
    # (transformers normalises in float32: the two agree to its rounding)
    with torch.no_grad():
        torch.testing.assert_close(out.kv_a_norm(x), module.kv_a_layernorm(x), atol=1e-6, rtol=0)
        assert out.q_a_norm is not None
        got, want = out.q_a_norm(x[:, :12]), module.q_a_layernorm(x[:, :12])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_the_rotary_base_comes_from_the_rope_parameters() -> None:
    """A checkpoint's ``rope_theta`` (in ``rope_parameters``): the loaded rotary embedding turns
    a key by transformers' angles."""
    hf, module = deepseek_module(rope_parameters={"rope_type": "default", "rope_theta": 50.0})
    out = latent_attention(module)
    x = randn(1, 1, 6, 4, seed=29, dtype=F64)
    emb = hf.DeepseekV3RotaryEmbedding(module.config)
    angle = torch.arange(3, 9, dtype=F64)[:, None] * emb.inv_freq.to(F64)
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    want = x * cos + hf.rotate_half(x) * sin
    torch.testing.assert_close(out.rotary(x, offset=3), want)


def test_the_frequencies_stay_float64_when_the_module_is_cast() -> None:
    """``module.to(torch.bfloat16)`` keeps the rotary frequencies in float64: far positions turn
    by the same angles (bfloat16 frequencies would turn position 4,000 by whole radians)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=F64) / 8))
    rotary = FrequencyRotary(inv_freq).to(torch.bfloat16)
    assert rotary.inv_freq.dtype == F64
    torch.testing.assert_close(rotary.inv_freq, inv_freq, rtol=0, atol=0)


def test_a_bias_over_two_batch_dims_on_flex() -> None:
    """q ``(2, 3, H, Tq, D)`` and a bias ``(1, 3, H, Tq, Tk)`` that broadcasts over the first
    batch dim only: each batch row reads its own bias."""
    q, k, v = (randn(2, 3, 2, 4, 8, seed=s) for s in (44, 45, 46))
    bias = randn(1, 3, 2, 4, 4, seed=47)
    call = attnkit.explain(q, k, v, bias=bias).call
    got, _ = run_lowered(lower_call(call, q, k, v, bias), lse=False, compiled=False)
    want = attnkit.attention(
        q.double(), k.double(), v.double(), bias=bias.double(), backend="reference"
    )
    torch.testing.assert_close(got.reshape(want.shape).double(), want, atol=1e-5, rtol=1e-5)
