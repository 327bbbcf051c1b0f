"""MultiHeadLatentAttention: the expanded and the absorbed forms against each other and against
the formula, in float64; the latent cache; the native kernel's decode path on the absorbed call."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks
from attnkit.modules import latent as latent_module
from attnkit.modules.latent import LatentCache, MultiHeadLatentAttention

F64 = torch.float64
D, H, R, DN, DR, DV = 32, 4, 24, 8, 6, 10


def make(q_lora_rank: int | None = 12, dtype: torch.dtype = F64, seed: int = 0, **kw: Any) -> Any:
    torch.manual_seed(seed)
    m = MultiHeadLatentAttention(
        D,
        H,
        kv_lora_rank=R,
        q_lora_rank=q_lora_rank,
        qk_nope_head_dim=DN,
        qk_rope_head_dim=DR,
        v_head_dim=DV,
        dtype=dtype,
        **kw,
    )
    with torch.no_grad():  # norms' weights away from 1, biases away from 0
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m


def randn(*shape: int, seed: int = 1, dtype: torch.dtype = F64) -> Tensor:
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def formula(m: Any, x: Tensor, allowed: Tensor) -> Tensor:
    """MLA as DeepSeek-V2's paper writes it, head by head, with a plain softmax: every head's
    keys ``[W_uk c, rope(k_rope)]`` and values ``W_uv c``; ``allowed`` ``(B, 1, Tq, S)``."""
    b, t, _ = x.shape
    q = m.q_proj(x) if m.q_proj is not None else m.q_b_proj(m.q_a_norm(m.q_a_proj(x)))
    q = q.view(b, t, H, DN + DR)
    kv = m.kv_a_proj(x)
    c, k_rope = m.kv_a_norm(kv[..., :R]), kv[..., R:]
    w = m.kv_b_proj.weight.view(H, DN + DV, R)
    outs = []
    for h in range(H):
        q_nope, q_rope = q[:, :, h, :DN], m.rotary(q[:, :, h, DN:])
        k = torch.cat((c @ w[h, :DN].T, m.rotary(k_rope)), -1)  # (B, S, DN + DR)
        v = c @ w[h, DN:].T  # (B, S, DV)
        scores = torch.cat((q_nope, q_rope), -1) @ k.mT / math.sqrt(DN + DR)
        scores = scores.masked_fill(~allowed[:, 0], -math.inf)
        outs.append(torch.softmax(scores, -1) @ v)
    return m.out_proj(torch.cat(outs, -1))


def padding_and_causal(lengths: list[int], t: int) -> Tensor:
    keys = torch.arange(t)
    pad = keys[None, :] < torch.tensor(lengths)[:, None]  # (B, S)
    return (pad[:, None, None, :] & (keys[None, :] <= keys[:, None]))[:, :, :, :]


@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_each_form_is_the_formula(q_lora_rank: int | None, form: str) -> None:
    m = make(q_lora_rank, proj_bias=True)
    x, lengths = randn(2, 7, D), [7, 5]
    with torch.no_grad():
        got = m(x, mask=masks.key_padding(lengths), causal=True, form=form)
        want = formula(m, x, padding_and_causal(lengths, 7))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_the_forms_have_the_same_gradients() -> None:
    m = make()
    x = randn(2, 6, D).requires_grad_()
    grads = []
    for form in ("expanded", "absorbed"):
        out = m(x, mask=torch.ones(2, 1, 6, 6, dtype=torch.bool).tril(), form=form)
        grads.append(torch.autograd.grad(out.square().sum(), (x, *m.parameters())))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=0)


@pytest.mark.parametrize("prompt", [1, 5])
def test_decoding_over_the_latent_cache_is_the_whole_forward(prompt: int) -> None:
    m, x, lengths = make(), randn(2, 9, D), [9, 6]
    with torch.no_grad():
        whole = m(x, mask=masks.key_padding(lengths), causal=True, form="expanded")
        cache = m.make_cache(batch_size=2, max_len=12)
        # the prompt expanded (over the cache), then one token at a time in the absorbed form
        steps = [
            m(
                x[:, :prompt],
                mask=masks.key_padding([prompt, min(prompt, 6)]),
                causal=True,
                cache=cache,
                form="expanded",
            )
        ]
        for t in range(prompt, 9):
            pad = masks.key_padding([t + 1, min(t + 1, 6)])
            steps.append(m(x[:, t : t + 1], mask=pad, causal=True, cache=cache))
    assert cache.length == 9
    torch.testing.assert_close(torch.cat(steps, 1), whole, atol=1e-12, rtol=0)


def test_chunks_of_a_prompt_over_the_cache_are_the_whole_forward() -> None:
    """Chunks longer than a decode step run expanded over every cached latent; each form of a
    chunk after a cached prefix sees the prefix at its positions."""
    m, x = make(), randn(2, 40, D)
    n = latent_module.DECODE_TOKENS + 2
    with torch.no_grad():
        whole = m(x, causal=True)
        for form in ("expanded", "absorbed"):
            cache = m.make_cache(batch_size=2, max_len=40)
            parts = [m(x[:, i : i + n], causal=True, cache=cache, form=form) for i in (0, n)]
            parts.append(m(x[:, 2 * n :], causal=True, cache=cache))
            torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-12, rtol=0)


def test_auto_takes_the_absorbed_form_to_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Tensor, Tensor, Tensor]] = []

    def spy(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> Tensor:
        seen.append((q, k, v))
        return attnkit.attention(q, k, v, **kw)

    monkeypatch.setattr(latent_module, "attention", spy)
    m, x = make(), randn(2, 21, D)
    n = latent_module.DECODE_TOKENS + 4
    cache = m.make_cache(batch_size=2, max_len=n + 1)
    with torch.no_grad():
        m(x[:, :4], causal=True)  # no cache: expanded
        m(x[:, :n], causal=True, cache=cache)  # more tokens than a decode step: expanded
        m(x[:, n:], causal=True, cache=cache)  # a decode step: absorbed
    shapes = [(tuple(q.shape), tuple(k.shape), tuple(v.shape)) for q, k, v in seen]
    assert shapes == [
        ((2, H, 4, DN + DR), (2, H, 4, DN + DR), (2, H, 4, DV)),
        ((2, H, n, DN + DR), (2, H, n, DN + DR), (2, H, n, DV)),
        ((2, H, 1, R + DR), (2, 1, n + 1, R + DR), (2, 1, n + 1, R)),
    ]
    # the absorbed call's keys are the cache's latents, and its values a view of them: one
    # memory, the same strides, nothing copied
    _, k, v = seen[-1]
    store = cache.latent
    assert k.data_ptr() == v.data_ptr() == store.data_ptr()
    assert k.stride() == v.stride() == store.stride()
    assert v._base is store
    assert k._base is store


def test_a_refused_call_leaves_the_cache_as_it_was() -> None:
    m, x = make(), randn(2, 3, D)
    cache = m.make_cache(batch_size=2, max_len=8)
    with torch.no_grad():
        m(x, causal=True, cache=cache)
        held = cache.latent.clone()
        with pytest.raises(ValueError, match="mask"):
            m(x[:, :1], mask=torch.ones(3, 1, 1, 4, dtype=torch.bool), cache=cache)
    assert cache.length == 3
    torch.testing.assert_close(cache.latent[:, :, :3], held[:, :, :3], atol=0, rtol=0)


def test_native_decode_serves_the_absorbed_call_reading_the_latent_once() -> None:
    """The absorbed decode step is one multi-query call (Hkv = 1) that the chunked backend's
    native kernel serves on its decode path, whose work items are (batch row, key/value head,
    part of the keys): each latent row is read once for the H query heads that share it. (Which
    backend ``auto`` takes depends on the CPU and the cache's size: benchmarks/bench_mla.py
    records it at DeepSeek's sizes.)"""
    from attnkit._kernel.choice import decodes
    from attnkit._native import status
    from attnkit.backends import Chunked

    if not status()[0]:
        pytest.skip(f"the native kernel is not available: {status()[1]}")
    h = 16
    m = MultiHeadLatentAttention(
        64,
        h,
        kv_lora_rank=128,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        backend="chunked",
    )
    x = randn(2, 65, 64, dtype=torch.float32)
    cache = m.make_cache(batch_size=2, max_len=80)
    with torch.no_grad():
        m(x[:, :64], causal=True, cache=cache)
        with attnkit.record_dispatch() as calls:
            step = m(x[:, 64:], causal=True, cache=cache)
        whole = m(x, causal=True, form="expanded")
        said = str(m.explain(x[:, 64:], causal=True, cache=cache))
    (call,) = calls
    torch.testing.assert_close(step, whole[:, 64:], atol=2e-5, rtol=2e-5)
    assert (call.served_by, call.kernel) == ("chunked", "native kernel")
    assert (call.call.groups, call.call.q_len, call.call.kv_len) == (h, 1, 65)
    assert decodes(Chunked().block_plan(call.call))
    assert f"q (2, {h}, 1, 144), k (2, 1, 66, 144), v (2, 1, 66, 128)" in said
    assert "chunked    chosen" in said
    assert "native kernel" in said


def test_errors_quote_the_values() -> None:
    m = make()
    cache = m.make_cache(batch_size=2, max_len=4)
    # (explain() makes forward()'s checks; forward's annotations are checked first in the tests)
    with pytest.raises(ValueError, match=r'form must be "auto", "expanded" or "absorbed", got .x.'):
        m.explain(randn(2, 1, D), form="x")
    with pytest.raises(ValueError, match=r"kv_lora_rank=24 \+ qk_rope_head_dim=6 wide"):
        m(randn(2, 1, D), cache=LatentCache(2, 4, 16, 6, dtype=F64))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "as num_kv_heads=1, head_dim = kv_lora_rank + qk_rope_head_dim = 24 + 6, v_head_dim = "
            "kv_lora_rank = 24 and values_in_keys=True (make_kv_cache(), make_paged_cache()), got "
            "num_kv_heads=1, head_dim=30, v_head_dim=30, values_in_keys=False"
        ),
    ):
        m.explain(randn(2, 1, D), cache=attnkit.KVCache(2, 4, 1, 30, dtype=F64))
    with pytest.raises(ValueError, match="got num_kv_heads=1, head_dim=30, v_head_dim=20, values"):
        m(randn(2, 1, D), cache=attnkit.PagedKVCache(4, 2, 1, 30, 20, max_seqs=2, dtype=F64))
    with pytest.raises(TypeError, match="a PagedKVCache holding the latents, or None, got str"):
        m.explain(randn(2, 1, D), cache="cache")  # type: ignore[arg-type]
    with torch.no_grad():
        m(randn(2, 2, D), cache=cache)
        with pytest.raises(ValueError, match=r"3 new tokens after the 2 cached"):
            m(randn(2, 3, D), cache=cache)
    assert cache.length == 2
    with pytest.raises(
        ValueError, match=r"rotary.head_dim \(8\) must equal qk_rope_head_dim \(6\)"
    ):
        make(rotary=attnkit.RotaryEmbedding(8))
    with pytest.raises(ValueError, match="require grad"):
        cache.stage(randn(2, 1, 1, R + DR).requires_grad_())


def test_cache_helpers() -> None:
    cache = LatentCache(1, 4, 3, 2, dtype=F64)
    keys = cache.stage(randn(1, 1, 3, 5))
    assert cache.length == 0  # staged, not held
    cache.commit()
    assert cache.values(keys).data_ptr() == keys.data_ptr()
    assert cache.values(keys).shape[-1] == 3
    cache.rewind(1)
    assert cache.length == 1
    cache.reset()
    assert cache.length == 0
    assert "kv_lora_rank=3, rope_dim=2" in repr(cache)


# -------------------------------------------------------------------------------------------------
# The latents in a KVCache or a PagedKVCache: one head whose values are its keys' first R columns


@pytest.mark.parametrize("prompt_form", ["expanded", "absorbed"])
def test_decoding_over_a_latent_kv_cache_is_the_expanded_form_and_the_formula(
    prompt_form: str,
) -> None:
    m, x = make(), randn(2, 24, D)
    with torch.no_grad():
        whole = m(x, causal=True, form="expanded")
        want = formula(m, x, padding_and_causal([24, 24], 24))
        cache = m.make_kv_cache(batch_size=2, max_len=24)
        steps = [m(x[:, :5], causal=True, cache=cache, form=prompt_form)]
        for t in range(5, 24):
            steps.append(m(x[:, t : t + 1], causal=True, cache=cache))  # auto: absorbed
    assert (cache.length, cache.values_in_keys) == (24, True)
    got = torch.cat(steps, 1)
    torch.testing.assert_close(got, whole, atol=1e-12, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("layout", ["flash", "vllm"])
@pytest.mark.parametrize("prompt_form", ["expanded", "absorbed"])
def test_decoding_over_a_latent_paged_cache_is_the_expanded_form_and_the_formula(
    layout: str, prompt_form: str
) -> None:
    """Rows of their own lengths over pages of 3 tokens (which divide none of them): each row's
    prompt, then steps of 1 and 3 tokens, each output the expanded form's and the formula's at
    the row's own positions (its rotary parts rotated there)."""
    m, x = make(), randn(3, 24, D)
    with torch.no_grad():
        whole = m(x, causal=True, form="expanded")
        want = formula(m, x, padding_and_causal([24] * 3, 24))
        cache = m.make_paged_cache(num_blocks=30, page_size=3, max_seqs=3, layout=layout)  # type: ignore[arg-type]
        lengths = [5, 2, 7]
        cache.schedule(lengths)
        out = m(x[:, :7], causal=True, cache=cache, form=prompt_form)
        got = [[out[b, :n]] for b, n in enumerate(lengths)]
        for n in [1] * 6 + [3] + [1] * 8:
            step = torch.stack([x[b, t : t + n] for b, t in enumerate(lengths)])
            out = m(step, causal=True, cache=cache)  # auto: absorbed
            for b in range(3):
                got[b].append(out[b])
            lengths = [t + n for t in lengths]
    assert cache.lengths == lengths == [22, 19, 24]
    for b, n in enumerate(lengths):
        row = torch.cat(got[b])
        torch.testing.assert_close(row, whole[b, :n], atol=1e-12, rtol=0)
        torch.testing.assert_close(row, want[b, :n], atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", ["kv", "flash", "vllm"])
def test_the_absorbed_decode_reads_a_latent_cache_in_place(kind: str) -> None:
    """float32 on the CPU: the decode step is one attention call on the cache's view, which the
    native kernel reads where it lies, the values at the keys' own address (no copy of V)."""
    from attnkit import _native
    from attnkit._kernel import cache as kernel_cache

    if not _native.load():
        pytest.skip("the native kernel is not available")
    # (auto reads a short contiguous cache with sdpa, as views of its rows)
    m = make(dtype=torch.float32, backend="chunked" if kind == "kv" else "auto")
    x = randn(2, 20, D, dtype=torch.float32)
    cache: Any = (
        m.make_kv_cache(batch_size=2, max_len=20)
        if kind == "kv"
        else m.make_paged_cache(num_blocks=20, page_size=4, max_seqs=2, layout=kind)
    )
    storage = cache.k_cache if kind == "kv" else cache.k_pages
    with torch.no_grad():
        m(x[:, :19], causal=True, cache=cache)
        said = str(m.explain(x[:, 19:], causal=True, cache=cache))
        with attnkit.record_dispatch() as calls:
            step = m(x[:, 19:], causal=True, cache=cache)
        whole = m(x, causal=True, form="expanded")
    (call,) = calls
    assert (call.chosen, call.kernel) == ("chunked", kernel_cache.IN_PLACE)
    read = call.call.cache
    assert read is not None
    assert read.v.data_ptr() == read.k.data_ptr() == storage.data_ptr()
    assert (call.call.groups, call.call.q_len) == (H, 1)
    assert "chunked    chosen" in said
    assert "reads the cache in place: native kernel" in said
    torch.testing.assert_close(step, whole[:, 19:], atol=2e-5, rtol=2e-5)


def test_a_refused_call_leaves_a_latent_paged_cache_as_it_was() -> None:
    m, x = make(), randn(2, 3, D)
    cache = m.make_paged_cache(num_blocks=8, page_size=2, max_seqs=2)
    with torch.no_grad():
        m(x, causal=True, cache=cache)
        pages, table = cache.k_pages.clone(), cache.block_table.clone()
        with pytest.raises(ValueError, match="a PagedKVCache call takes causal=True"):
            m(x[:, :1], mask=masks.key_padding([4, 3]), cache=cache)
    assert cache.lengths == [3, 3]
    assert torch.equal(cache.k_pages, pages)
    assert torch.equal(cache.block_table, table)


@pytest.mark.parametrize("kind", ["kv", "paged"])
@pytest.mark.parametrize(
    ("kv_dtype", "within"),
    [(torch.int8, 0.03), (torch.float8_e4m3fn, 0.1), (torch.float8_e5m2, 0.2)],
)
def test_decoding_over_a_quantized_latent_cache_is_the_expanded_form_within_its_rounding(
    kind: str, kv_dtype: torch.dtype, within: float
) -> None:
    """Latents stored quantized, the values read with the keys' scales: the decoded tokens are
    the expanded form's within the format's rounding (relative error of the whole output; the
    caches' own tests check the reads exactly)."""
    m, x = make(dtype=torch.float32), randn(2, 20, D, dtype=torch.float32)
    with torch.no_grad():
        whole = m(x, causal=True)
        cache: Any = (
            m.make_kv_cache(batch_size=2, max_len=20, kv_dtype=kv_dtype)
            if kind == "kv"
            else m.make_paged_cache(num_blocks=20, page_size=3, max_seqs=2, kv_dtype=kv_dtype)
        )
        steps = [m(x[:, :5], causal=True, cache=cache)]
        steps += [m(x[:, t : t + 1], causal=True, cache=cache) for t in range(5, 20)]
    got = torch.cat(steps, 1)
    assert float((got - whole).norm() / whole.norm()) < within


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
@pytest.mark.parametrize(("rows", "tokens"), [(0, 3), (2, 0)])
def test_a_call_of_no_rows_or_no_tokens_gives_an_empty_output(
    form: str, rows: int, tokens: int
) -> None:
    """No batch rows, or no new tokens (with and without a cache): an empty output, and a cache
    that then decodes as if the empty call had not happened (the formula's tokens)."""
    m, x = make(), randn(2, 4, D)
    with torch.no_grad():
        assert m(randn(rows, tokens, D), causal=True, form=form).shape == (rows, tokens, D)
        cache = m.make_kv_cache(batch_size=2, max_len=8)
        assert m(x[:, :0], causal=True, cache=cache, form=form).shape == (2, 0, D)
        got = torch.cat([m(x[:, t : t + 1], causal=True, cache=cache) for t in range(4)], 1)
    torch.testing.assert_close(
        got, formula(m, x, padding_and_causal([4, 4], 4)), atol=1e-12, rtol=0
    )


@pytest.mark.parametrize("kind", ["kv", "paged"])
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_the_expanded_form_over_a_quantized_latent_cache_is_the_absorbed_form(
    kind: str, kv_dtype: torch.dtype
) -> None:
    """float64 parameters over int8/float8 latents, rows of their own lengths on pages: the
    expanded form reads the latents dequantized in the module's dtype and equals the absorbed
    form over the same cache (the same dequantized latents) to float64 rounding."""
    m, x = make(), randn(2, 8, D)
    outs: dict[str, list[Tensor]] = {}
    with torch.no_grad():
        for form in ("expanded", "absorbed"):
            cache: Any = (
                m.make_kv_cache(batch_size=2, max_len=8, kv_dtype=kv_dtype)
                if kind == "kv"
                else m.make_paged_cache(num_blocks=8, page_size=3, max_seqs=2, kv_dtype=kv_dtype)
            )
            lengths = [4, 4]
            if kind == "paged":
                lengths = [4, 2]
                cache.schedule(lengths)
            first = m(x[:, :4], causal=True, cache=cache, form=form)
            outs[form] = [first[b, :n] for b, n in enumerate(lengths)]
            for _ in range(2):
                step = torch.stack([x[b, t : t + 1] for b, t in enumerate(lengths)])
                out = m(step, causal=True, cache=cache, form=form)
                outs[form] += [out[0], out[1]]
                lengths = [t + 1 for t in lengths]
    for got, want in zip(outs["expanded"], outs["absorbed"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


class _Refused(RuntimeError):
    pass


@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("kind", ["latent", "kv", "paged"])
def test_a_call_that_fails_after_staging_leaves_the_cache_as_it_was(kind: str, new: int) -> None:
    # out_proj raises after attention() read the staged latents: the error reaches the caller as
    # it was raised, the cache holds what it held (a stray commit() adds nothing), and the next
    # call is the whole forward's.
    m, x, failed = make(), randn(2, 4 + new, D), randn(2, new, D)
    if kind == "latent":
        cache = m.make_cache(batch_size=2, max_len=12)
    elif kind == "kv":
        cache = m.make_kv_cache(batch_size=2, max_len=12)
    else:
        cache = m.make_paged_cache(num_blocks=8, page_size=2, max_seqs=2)
    raised = _Refused("out_proj refused")

    def refuse(*_: object) -> None:
        raise raised

    def held() -> list[Tensor]:
        if isinstance(cache, LatentCache):
            return [cache.latent[:, :, : cache.length].clone()]
        view = cache.view()
        return [view.row(n, F64)[0].clone() for n in range(len(view.kv_range))]

    with torch.no_grad():
        m(x[:, :4], causal=True, cache=cache)
        before = held()
        hook = m.out_proj.register_forward_pre_hook(refuse)
        with pytest.raises(_Refused) as info:
            m(failed, causal=True, cache=cache)
        hook.remove()
        assert info.value is raised
        for _ in range(2):  # as the call left it, and after a stray commit()
            after = held()
            assert len(after) == len(before)
            for a, b in zip(before, after, strict=True):
                assert torch.equal(a, b)
            cache.commit()
        got = m(x[:, 4:], causal=True, cache=cache)
        want = m(x, causal=True)[:, 4:]
    torch.testing.assert_close(got, want)
