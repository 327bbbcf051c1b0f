"""FlashMLA's and DeepSeek V3.2's attention, restated through attnkit and checked against float64
formulas written here.

FlashMLA decodes with ``flash_mla_with_kvcache``: queries ``(B, s_q, h_q, 576)`` over a paged
latent cache (pages of 64 tokens, one key/value head of 576 numbers a token), the values the
first 512 columns of the keys (``dv = 512``), causal over ``s_q > 1`` aligned to each row's end
(MTP decodes ``s_q = 2``), a softmax scale, and the log-sum-exp beside the output. Its sparse
variant takes ``indices`` ``(B, s_q, topk)``: the absolute positions each query attends, ``-1``
padding. In attnkit these are one :func:`attnkit.attention` call of ``H`` query heads over
``Hkv = 1``, ``Dk = 576``, ``v = k[..., :512]`` (a view, on a cache ``values_in_keys=True``),
``masks.key_indices(indices.unsqueeze(1))`` for the selection, ``return_lse=True``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks
from attnkit.modules.latent import MultiHeadLatentAttention

F64 = torch.float64
DK, DV = 576, 512  # FlashMLA's latent: kv_lora_rank 512 + rope 64; values the first 512
# (atol, rtol) of each dtype against the float64 formula of the same (rounded) inputs
TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 2e-2)}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=gen(seed), dtype=F64).to(dtype)


def chosen(indices: Tensor, kv_len: int) -> Tensor:
    """``(B, Hi, Tq, Tk)`` bool: the keys ``indices`` lists (``-1`` none; repeats once)."""
    idx = indices.long()
    out = torch.zeros(*idx.shape[:-1], kv_len + 1, dtype=torch.bool)
    return out.scatter_(-1, idx.where(idx >= 0, kv_len), True)[..., :kv_len]


def end_causal(tq: int, kv_len: int) -> Tensor:
    """``(Tq, Tk)``: query ``i`` sees keys ``j <= i + Tk - Tq`` (aligned to the end)."""
    return torch.arange(kv_len)[None, :] <= torch.arange(tq)[:, None] + kv_len - tq


def formula(q: Tensor, k: Tensor, dv: int, allowed: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Attention in float64 over keys ``k`` ``(B, Hkv, S, Dk)`` whose values are their first
    ``dv`` columns; ``allowed`` broadcasts to ``(B, H, Tq, S)``. ``(out, lse)``; a query that
    sees no key gives 0 and ``-inf``."""
    heads = q.size(1) // k.size(1)
    k64 = k.double().repeat_interleave(heads, 1)
    s = (q.double() @ k64.mT * scale).masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1).nan_to_num(0.0) @ k64[..., :dv], lse


def close(got: Tensor, want: Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol, equal_nan=False)


def close_lse(got: Tensor, want: Tensor) -> None:
    assert torch.equal(got.isneginf(), want.isneginf())
    finite = want.isfinite()
    # the log-sum-exp comes back in float32 for every input dtype
    torch.testing.assert_close(got.double()[finite], want[finite], atol=2e-5, rtol=2e-5)


# --------------------------------------------------------------------------------------------------
# Dense decoding over a paged latent cache (flash_mla_with_kvcache)


def latent_paged_cache(lengths: list[int], dtype: torch.dtype, seed: int) -> tuple[Any, Tensor]:
    """A paged cache of 64-token pages holding one latent head (``values_in_keys``), with the
    rows' prompts of ``lengths`` tokens; and the latents ``(B, 1, max, 576)`` given."""
    cache = attnkit.PagedKVCache(
        num_blocks=12, page_size=64, num_kv_heads=1, head_dim=DK, v_head_dim=DV,
        max_seqs=len(lengths), dtype=dtype, values_in_keys=True,
    )  # fmt: skip
    latents = randn(len(lengths), 1, max(lengths), DK, seed=seed, dtype=dtype)
    cache.schedule(lengths)
    cache.stage(latents, None)
    cache.commit()
    return cache, latents


@pytest.mark.parametrize(
    ("heads", "dtype"),
    [(16, torch.float32), (64, torch.bfloat16), (128, torch.float32), (128, torch.bfloat16)],
)
def test_paged_latent_decode_of_one_and_two_queries_is_the_formula(
    dtype: torch.dtype, heads: int
) -> None:
    # Rows of 100, 7 and 130 tokens (one page, two, three), then an MTP step of s_q = 2 and a
    # step of 1: out and lse of each row against the formula over its own keys.
    lengths, scale = [100, 7, 130], 1 / math.sqrt(192)
    cache, prompt = latent_paged_cache(lengths, dtype, seed=1)
    held = [prompt[b, :, :n] for b, n in enumerate(lengths)]
    for step, tq in enumerate((2, 1)):
        q = randn(3, heads, tq, DK, seed=10 + step, dtype=dtype)
        new = randn(3, 1, tq, DK, seed=20 + step, dtype=dtype)
        out, lse = cache.attention(q, new, None, causal=True, scale=scale)
        cache.commit()
        assert out.shape == (3, heads, tq, DV)
        assert out.dtype == dtype
        for b in range(3):
            held[b] = torch.cat((held[b], new[b]), 1)
            keys = held[b][None]
            want, want_lse = formula(q[b : b + 1], keys, DV, end_causal(tq, keys.size(2)), scale)
            close(out[b : b + 1], want, dtype)
            close_lse(lse[b : b + 1], want_lse)
    assert cache.lengths == [n + 3 for n in lengths]


# --------------------------------------------------------------------------------------------------
# Sparse decoding and prefill (indices of absolute positions, -1 padding)


def flashmla_indices(b: int, tq: int, topk: int, kv_len: int, seed: int) -> Tensor:
    """``(B, s_q, topk)`` as DeepSeek V3.2's indexer gives them: positions, ``-1`` padding, a
    row of none, a key listed several times."""
    idx = torch.randint(-1, kv_len, (b, tq, topk), generator=gen(seed))
    idx[0, -1] = -1  # a query with none
    idx[-1, 0, : topk // 2] = 3  # one key, many times
    idx[-1, -1, topk // 2 :] = -1  # padding at the end
    return idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("tq", [1, 2])
def test_sparse_decode_over_a_latent_cache_is_the_formula(
    dtype: torch.dtype, heads: int, tq: int
) -> None:
    # A KVCache holding the latent (values its keys' first 512), read where it lies; the
    # selection per query, shared by every head; a query with none gives 0 and lse -inf.
    cache = attnkit.KVCache(2, 160, 1, DK, DV, dtype=dtype, values_in_keys=True)
    keys = randn(2, 1, 150, DK, seed=3, dtype=dtype)
    cache.update(keys, None)
    q = randn(2, heads, tq, DK, seed=4, dtype=dtype)
    idx = flashmla_indices(2, tq, 64, 150, seed=5).to(torch.int32).unsqueeze(1)
    out, lse = attnkit.attention(
        q, cache.view(), None, mask=masks.key_indices(idx), scale=0.07, return_lse=True
    )
    want, want_lse = formula(q, keys, DV, chosen(idx, 150), 0.07)
    close(out, want, dtype)
    close_lse(lse, want_lse)
    assert not out[0, :, -1].any()
    assert lse[0, :, -1].isneginf().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
def test_sparse_prefill_with_causal_and_padding_and_v_a_view_of_k(dtype: torch.dtype) -> None:
    # Prefill: every query its top-k of the keys, ANDed with causal (aligned to the end) and
    # with key padding; V the first 512 columns of K, a view.
    b, heads, tq, kv_len = 2, 16, 24, 40
    k = randn(b, 1, kv_len, DK, seed=6, dtype=dtype)
    q = randn(b, heads, tq, DK, seed=7, dtype=dtype)
    idx = flashmla_indices(b, tq, 16, kv_len, seed=8).unsqueeze(1)
    mask = masks.key_indices(idx) & masks.causal() & masks.key_padding([40, 31])
    out, lse = attnkit.attention(q, k, k[..., :DV], mask=mask, scale=0.05, return_lse=True)
    pad = (torch.arange(kv_len)[None, :] < torch.tensor([40, 31])[:, None])[:, None, None]
    allowed = chosen(idx, kv_len) & end_causal(tq, kv_len) & pad
    want, want_lse = formula(q, k, DV, allowed, 0.05)
    close(out, want, dtype)
    close_lse(lse, want_lse)


def compositions(idx: Tensor, other: Tensor, lengths: list[int]) -> dict[str, tuple[Any, Any]]:
    """name -> (mask, the brute-force allowed ``(B, H|1, Tq, Tk)`` given Tq and Tk)."""
    a, o = masks.key_indices(idx), masks.key_indices(other)

    def pad(tq: int, tk: int) -> Tensor:
        return (torch.arange(tk)[None, :] < torch.tensor(lengths)[:, None])[:, None, None]

    def win(tq: int, tk: int) -> Tensor:
        d = torch.arange(tk)[None, :] - torch.arange(tq)[:, None] - (tk - tq)
        return (d <= 0) & (d >= -4)

    def mine(i: Tensor, tk: int) -> Tensor:
        return chosen(i, tk).repeat_interleave(4 // i.size(1), 1)

    return {
        "and_causal": (a & masks.causal(), lambda tq, tk: mine(idx, tk) & end_causal(tq, tk)),
        "or": (a | o, lambda tq, tk: mine(idx, tk) | mine(other, tk)),
        "and_indices": (a & o, lambda tq, tk: mine(idx, tk) & mine(other, tk)),
        "and_padding_causal": (
            a & masks.key_padding(lengths) & masks.causal(),
            lambda tq, tk: mine(idx, tk) & pad(tq, tk) & end_causal(tq, tk),
        ),
        "and_window": (a & masks.sliding_window(4), lambda tq, tk: mine(idx, tk) & win(tq, tk)),
        "or_and_causal": (
            (a | o) & masks.causal(),
            lambda tq, tk: (mine(idx, tk) | mine(other, tk)) & end_causal(tq, tk),
        ),
    }


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [(b, d) for b in ("reference", "chunked", "sdpa") for d in (torch.float32, F64)]
    + [("flex", torch.float32)],  # (flex runs float64 unfused on the CPU: what sdpa checks)
)
def test_index_masks_composed_on_every_backend_are_the_formula(
    backend: str, dtype: torch.dtype
) -> None:
    # GQA of 4 query heads over 2 key/value heads, a selection per key/value head ANDed or ORed
    # with another shared by all heads, causal, a window and padding; out and lse.
    b, tq, tk, dk = 2, 6, 20, 16
    q, k = randn(b, 4, tq, dk, seed=9, dtype=dtype), randn(b, 2, tk, dk, seed=10, dtype=dtype)
    idx = torch.randint(-1, tk, (b, 2, tq, 5), generator=gen(11))
    idx[0, 1, 2] = -1
    idx[1, 0, 3] = 7
    other = torch.randint(-1, tk, (1, 1, tq, 6), generator=gen(12))
    for name, (mask, allowed) in compositions(idx, other, [20, 13]).items():
        lse_too = backend != "sdpa"  # (torch's SDPA returns none)
        got = attnkit.attention(
            q, k, k[..., :8], mask=mask, scale=0.3, return_lse=lse_too, backend=backend
        )
        out, lse = got if lse_too else (got, None)
        want, want_lse = formula(q, k, 8, allowed(tq, tk), 0.3)
        try:
            close(out, want, dtype)
            if lse is not None:
                close_lse(lse, want_lse)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


# --------------------------------------------------------------------------------------------------
# Gradients


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(("heads", "kv_heads", "index_heads"), [(16, 1, 1), (8, 2, 2), (8, 2, 1)])
def test_gradients_of_key_indices_with_repeats_none_and_empty_rows(
    dtype: torch.dtype, heads: int, kv_heads: int, index_heads: int
) -> None:
    # Through out and lse, V a view of K (its gradient the sum of both uses), causal; queries
    # with no key have no gradient.
    b, tq, tk, dk, dv = 2, 5, 40, 72, 64
    q = randn(b, heads, tq, dk, seed=13).to(dtype).requires_grad_()
    k = randn(b, kv_heads, tk, dk, seed=14).to(dtype).requires_grad_()
    idx = torch.randint(-1, tk, (b, index_heads, tq, 12), generator=gen(15))
    idx[0, 0, 2] = -1
    idx[1, -1, 1, :6] = 3
    idx[0, -1, 4, 3:] = -1
    out, lse = attnkit.attention(
        q, k, k[..., :dv], mask=masks.key_indices(idx) & masks.causal(), scale=0.1,
        return_lse=True,
    )  # fmt: skip
    g_out, g_lse = randn(*out.shape, seed=16), randn(*lse.shape, seed=17)
    ((out.double() * g_out).sum() + (lse.double().nan_to_num(0, 0, 0) * g_lse).sum()).backward()
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    allowed = chosen(idx, tk).repeat_interleave(heads // index_heads, 1) & end_causal(tq, tk)
    want, want_lse = formula(q64, k64, dv, allowed, 0.1)
    ((want * g_out).sum() + (want_lse.nan_to_num(0, 0, 0) * g_lse).sum()).backward()
    assert q.grad is not None
    assert k.grad is not None
    close(out, want.detach(), dtype)
    close(q.grad, q64.grad, dtype)
    close(k.grad, k64.grad, dtype)
    assert not q.grad[0, : heads // index_heads, 2].any()


def test_a_compiled_key_indices_call_with_v_a_view_of_k_is_the_formula() -> None:
    # fullgraph; new index values run without a new trace; gradients of q and of the shared
    # K/V; lse of a query with none is -inf.
    b, heads, tq, tk, dk, dv = 2, 16, 2, 40, 72, 64

    def call(q: Tensor, k: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
        mask = masks.key_indices(idx)
        out, lse = attnkit.attention(
            q, k, k[..., :dv], mask=mask, causal=True, scale=0.1, return_lse=True
        )
        return out, lse

    compiled = torch.compile(call, fullgraph=True)
    for seed in (18, 19):
        q = randn(b, heads, tq, dk, seed=seed).requires_grad_()
        k = randn(b, 1, tk, dk, seed=seed + 10).requires_grad_()
        idx = torch.randint(-1, tk, (b, 1, tq, 8), generator=gen(seed))
        idx[0, 0, 1] = -1
        idx[1, 0, 0, :4] = 5
        out, lse = compiled(q, k, idx)
        (out.sum() + lse.nan_to_num(0, 0, 0).sum()).backward()
        q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
        allowed = chosen(idx, tk) & end_causal(tq, tk)
        want, want_lse = formula(q64, k64, dv, allowed, 0.1)
        (want.sum() + want_lse.nan_to_num(0, 0, 0).sum()).backward()
        close(out, want.detach(), torch.float32)
        close_lse(lse, want_lse.detach())
        close(q.grad, q64.grad, torch.float32)
        close(k.grad, k64.grad, torch.float32)


# --------------------------------------------------------------------------------------------------
# The module at DeepSeek V3's widths


def deepseek_mla(dtype: torch.dtype = F64) -> MultiHeadLatentAttention:
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(
        64, 16, kv_lora_rank=512, q_lora_rank=32, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, dtype=F64,
    )  # fmt: skip
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m.to(dtype)


@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
def test_mtp_decode_of_the_module_over_a_paged_latent_cache_is_the_whole_forward(
    dtype: torch.dtype,
) -> None:
    # A 66-token prompt, then steps of two tokens whose second is not accepted in row 1
    # (schedule [2, 1, 2]: rows at their own lengths): each real token's output is the whole
    # forward's, in float64 to rounding, in float32 and bfloat16 within theirs.
    m64 = deepseek_mla()
    x = randn(3, 72, 64, seed=21, dtype=F64)
    with torch.no_grad():
        whole = m64(x, causal=True)
        m = copy.deepcopy(m64).to(dtype)
        cache = m.make_paged_cache(8, 64, max_seqs=3)
        m(x[:, :66].to(dtype), causal=True, cache=cache)
        at = [66, 66, 66]
        for _ in range(3):
            cache.schedule([2, 1, 2])
            step = torch.stack([x[b, at[b] : at[b] + 2] for b in range(3)]).to(dtype)
            got = m(step, causal=True, cache=cache)
            for b, n in enumerate([2, 1, 2]):
                close(got[b, :n], whole[b, at[b] : at[b] + n], dtype)
                at[b] += n
    assert cache.lengths == at == [72, 69, 72]


def test_the_module_decodes_with_key_indices_over_each_cache() -> None:
    # DeepSeek V3.2's decode: each new token's selection among the cached (causal) keys, on a
    # LatentCache and on a KVCache of the latent; the whole forward with the same selection.
    m = deepseek_mla()
    x = randn(2, 9, 64, seed=22, dtype=F64)
    idx = torch.stack([torch.randint(-1, t + 1, (2, 1, 4), generator=gen(t)) for t in range(9)], 2)
    idx[0, 0, 3] = -1
    with torch.no_grad():
        whole = m(x, mask=masks.key_indices(idx), causal=True, form="expanded")
        absorbed = m(x, mask=masks.key_indices(idx), causal=True, form="absorbed")
        torch.testing.assert_close(absorbed, whole, atol=1e-12, rtol=0)
        for cache in (m.make_cache(2, 16), m.make_kv_cache(2, 16)):
            m(x[:, :7], mask=masks.key_indices(idx[:, :, :7]), causal=True, cache=cache)
            got = [
                m(x[:, t : t + 1], mask=masks.key_indices(idx[:, :, t : t + 1]), cache=cache)
                for t in (7, 8)
            ]
            torch.testing.assert_close(torch.cat(got, 1), whole[:, 7:], atol=1e-12, rtol=0)


class _Refused(Exception):
    pass


@pytest.mark.parametrize("kind", ["kv", "paged"])
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_a_failed_first_step_on_a_quantized_latent_cache_leaves_no_trace(
    kind: str, kv_dtype: torch.dtype
) -> None:
    # A prompt 50x larger than the next one fails after its latents were staged (and, for
    # float8, its scales chosen): the cache then serves the next prompt and a decode step as a
    # fresh cache does, bit for bit.
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(
        64, 4, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8
    )
    x, big = randn(2, 5, 64, seed=23), randn(2, 5, 64, seed=24) * 50

    def make() -> Any:
        if kind == "kv":
            return m.make_kv_cache(2, 16, kv_dtype=kv_dtype)
        return m.make_paged_cache(8, 4, max_seqs=2, kv_dtype=kv_dtype)

    def refuse(*_: object) -> None:
        raise _Refused

    used, fresh = make(), make()
    with torch.no_grad():
        hook = m.out_proj.register_forward_pre_hook(refuse)
        with pytest.raises(_Refused):
            m(big, causal=True, cache=used)
        hook.remove()
        for part in (x[:, :4], x[:, 4:]):
            assert torch.equal(m(part, causal=True, cache=used), m(part, causal=True, cache=fresh))


# --------------------------------------------------------------------------------------------------
# transformers' DeepSeek V3.2, left-padded, an indexer top-k above the sequence


@pytest.fixture
def registered() -> Iterator[None]:
    pytest.importorskip("transformers")
    from transformers import AttentionInterface
    from transformers import masking_utils as mu

    from attnkit.integrations import transformers as hf

    hf.register()
    yield
    AttentionInterface._global_mapping.pop("attnkit", None)
    mu.AttentionMaskInterface._global_mapping.pop("attnkit", None)


@pytest.mark.usefixtures("registered")
@pytest.mark.parametrize(
    ("family", "topk"), [("deepseek_v3", 0), ("deepseek_v32", 4), ("deepseek_v32", 64)]
)
def test_deepseek_left_padded_generation_equals_sdpa(family: str, topk: int) -> None:
    # Row 1 left-padded by 5 of 12; V3.2's top-k 64 is more keys than any query has. Logits at
    # real tokens and 6 greedy tokens equal sdpa's (eager's are NaN past a padded row's first
    # layer: its softmax over a query with no key).
    import transformers

    from ..integrations.transformers.helpers import run, sweep, use

    config = sweep().tiny_config(family)
    if family == "deepseek_v32":
        config.index_topk = topk
        config.mlp_layer_types = ["dense"] * config.num_hidden_layers  # float64 throughout
        cls = transformers.DeepseekV32ForCausalLM
    else:
        config.first_k_dense_replace = config.num_hidden_layers
        cls = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    m = cls(config).double().eval()
    ids = torch.randint(3, 100, (2, 12), generator=gen(3))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    logits = {i: run(m, i, input_ids=ids, attention_mask=mask).logits for i in ("sdpa", "attnkit")}
    real = mask.bool()
    torch.testing.assert_close(logits["attnkit"][real], logits["sdpa"][real], atol=1e-12, rtol=0)
    tokens = {}
    for impl in ("sdpa", "attnkit"):
        with use(m, impl), torch.no_grad():
            tokens[impl] = m.generate(
                ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0
            )
    assert torch.equal(tokens["attnkit"], tokens["sdpa"])


# --------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("make", [masks.key_indices, lambda i: masks.block_indices(i, block=2)])
def test_indices_for_no_heads_are_refused_with_the_shape_quoted(make: Any) -> None:
    # (a ZeroDivisionError from the check that the heads divide H)
    with pytest.raises(ValueError, match=r"at least one head \(Hi >= 1\), got \(2, 0, 3, 2\)"):
        make(torch.zeros(2, 0, 3, 2, dtype=torch.long))


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_a_latent_cache_under_autocast_says_how_to_take_its_latents() -> None:
    # Under torch.autocast the projections give bfloat16 latents, which a float32 cache refuses
    # with the way out named, as a KVCache does; the cache in bfloat16 then decodes.
    m = deepseek_mla(torch.float32)
    x = randn(2, 5, 64, seed=25)
    cache = m.make_cache(2, 8)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        with pytest.raises(TypeError, match=r"under torch.autocast .*cache.to\(dtype=torch.bfl"):
            m(x, causal=True, cache=cache)
        assert cache.length == 0
        cache.to(dtype=torch.bfloat16)
        m(x[:, :4], causal=True, cache=cache)
        got = m(x[:, 4:], causal=True, cache=cache)
        want = m(x, causal=True)[:, 4:]
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
