"""The one writer of new tokens: each way it writes (one copy, a copy a piece, one indexed write)
puts every token where a token-by-token write puts it, and nothing elsewhere; the one check of new
keys and values names what is wrong."""

from __future__ import annotations

import re

import pytest
import torch
from torch import Tensor

from attnkit.caches._tokens import Spelling, check_tokens, put, write


def _by_hand(
    pages: Tensor, k: Tensor, at: list[int], counts: list[int], table: list[list[int]] | None
) -> Tensor:
    out = pages.clone()
    size = pages.size(2)
    for n, (start, c) in enumerate(zip(at, counts, strict=True)):
        for i in range(c):
            pos = start + i
            page = n if table is None else table[n][pos // size]
            out[page, :, pos % size] = k[n, :, i]
    return out


@pytest.mark.parametrize(
    ("at", "counts", "paged"),
    [
        ([2, 2], None, False),  # rows in order at one position: one copy
        ([2, 5], None, False),  # a stretch a row: a copy each
        ([1, 3], None, True),  # one token a row over pages: a copy each
        ([0, 4], [5, 2], True),  # a prompt over pages: one indexed write
    ],
)
def test_every_way_of_writing_puts_each_token_in_its_place(
    at: list[int], counts: list[int] | None, paged: bool
) -> None:
    gen = torch.Generator().manual_seed(0)
    t = 1 if paged and counts is None else 5 if counts else 3
    k = torch.randn(2, 2, t, 4, generator=gen)
    v = torch.randn(2, 2, t, 3, generator=gen)
    table = [[5, 1, 3, 0], [2, 4, 6, 7]] if paged else None
    shape = (8, 2, 3, 4) if paged else (2, 2, 9, 4)
    k_pages = torch.randn(shape, generator=gen)
    v_pages = torch.randn(*shape[:3], 3, generator=gen).to(torch.float64)  # converted on write
    want_k = _by_hand(k_pages, k, at, counts or [t, t], table)
    want_v = _by_hand(v_pages, v.double(), at, counts or [t, t], table)
    block_table = None if table is None else torch.tensor(table)
    write(k_pages, v_pages, k, v, at=at, counts=counts, block_table=block_table)
    assert torch.equal(k_pages, want_k)
    assert torch.equal(v_pages, want_v)


def test_put_writes_slots() -> None:
    pages = torch.zeros(3, 1, 2, 1)
    put(pages, pages.clone(), torch.tensor([[[1.0]], [[2.0]]]), torch.zeros(2, 1, 1),
        torch.tensor([5, 0]))  # fmt: skip
    assert pages.flatten().tolist() == [2.0, 0, 0, 0, 0, 1.0]


def test_the_check_names_what_is_wrong() -> None:
    pages = torch.zeros(2, 2, 8, 4)
    ok = torch.zeros(2, 2, 1, 4)
    check_tokens(ok, ok, pages, pages, 2, "KVCache")
    message = "k and v must have shapes (B, Hkv, T, Dk) = (2, 2, 1, 4) and (B, Hkv, T, Dv) = "
    with pytest.raises(ValueError, match=re.escape(message)):
        check_tokens(ok, torch.zeros(2, 2, 2, 4), pages, pages, 2, "KVCache")
    with pytest.raises(TypeError, match=re.escape("cache's dtype (float32), got k float64")):
        check_tokens(ok.double(), ok, pages, pages, 2, "KVCache")
    with pytest.raises(ValueError, match="KVCache got keys that require grad"):
        check_tokens(ok.requires_grad_(), ok, pages, pages, 2, "KVCache")
    with pytest.raises(TypeError, match="k must be a float tensor"):
        check_tokens(ok.int(), ok, pages, pages, 2, "KVCache")


def test_a_front_end_spells_the_check_in_its_own_names_and_layout() -> None:
    # flash-attn's token-major (N, T, Hkv, D) tokens, checked against the same pages
    pages = torch.zeros(2, 2, 8, 4)
    spelling = Spelling(
        k_shape="(batch, seqlen_new, nheads_k, headdim)",
        v_shape="(batch, seqlen_new, nheads_k, headdim_v)",
        token_major=True,
        dtype_of="k_cache's dtype",
        device_of="k_cache's device",
        who="flash_attn_with_kvcache",
    )
    ok = torch.zeros(2, 3, 2, 4)
    check_tokens(ok, ok, pages, pages, 2, "k_cache", spelling)
    message = "(batch, seqlen_new, nheads_k, headdim) = (2, T, 2, 4) and "
    with pytest.raises(ValueError, match=re.escape(message)):
        check_tokens(torch.zeros(2, 2, 4), ok, pages, pages, 2, "k_cache", spelling)
    with pytest.raises(ValueError, match=re.escape("= (2, 3, 2, 4) for this cache (k_cache)")):
        check_tokens(ok, torch.zeros(2, 2, 3, 4), pages, pages, 2, "k_cache", spelling)
    with pytest.raises(TypeError, match=re.escape("k_cache's dtype (float32), got k float64")):
        check_tokens(ok.double(), ok, pages, pages, 2, "k_cache", spelling)
    with pytest.raises(ValueError, match=re.escape("on k_cache's device (cpu), got k on meta")):
        check_tokens(ok.to("meta"), ok, pages, pages, 2, "k_cache", spelling)
    grad = ok.clone().requires_grad_()
    with pytest.raises(ValueError, match=re.escape("flash_attn_with_kvcache got keys that "
                                                   "require grad: the cache is for inference, "
                                                   "run decoding under torch.no_grad() or "
                                                   "torch.inference_mode() (got v with "
                                                   "requires_grad=True)")):  # fmt: skip
        check_tokens(ok, grad, pages, pages, 2, "k_cache", spelling)


def _as_bytes(t: Tensor) -> Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


@pytest.mark.parametrize("rows", [4, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e5m2])
@pytest.mark.parametrize("layout", ["head-major", "token-major", "strided", "latent"])
def test_a_decode_step_over_pages_puts_each_token_in_its_place(
    rows: int, dtype: torch.dtype, layout: str
) -> None:
    """One token in each of several rows (a decode step), written as rows of the pages' memory
    in one index_copy_ where the pages lie densely (either order of a pool), a copy a row where
    they do not (pages that are a slice of wider ones): every token where a token-by-token write
    puts it, every other byte as it was."""
    gen = torch.Generator().manual_seed(1)
    pages, hkv, size, dk, dv = 12, 3, 4, 8, 8 if layout != "strided" else 5

    def rand(*shape: int) -> Tensor:
        x = torch.randn(*shape, generator=gen) * 10
        return x.round().to(dtype) if dtype == torch.int8 else x.to(dtype)

    if layout == "token-major":  # (X, page, Hkv, D), seen head-major
        k_pages, v_pages = rand(pages, size, hkv, dk).transpose(1, 2), rand(pages, size, hkv, dv)
        v_pages = v_pages.transpose(1, 2)
    elif layout == "strided":  # values a slice of wider pages: not rows of their memory
        k_pages, v_pages = rand(pages, hkv, size, dk), rand(pages, hkv, size, dv + 3)[..., :dv]
    else:
        k_pages, v_pages = rand(pages, hkv, size, dk), rand(pages, hkv, size, dv)
    table = torch.randperm(pages, generator=gen)[: rows * 2].view(rows, 2).tolist()
    at = [int(a) for a in torch.randint(0, 2 * size, (rows,), generator=gen)]
    k, v = rand(rows, hkv, 1, dk), rand(rows, hkv, 1, dv)
    latent = layout == "latent"  # values a view of the keys: written with them
    want_k = _as_bytes(_by_hand(k_pages, k, at, [1] * rows, table))
    want_v = _as_bytes(_by_hand(v_pages, v, at, [1] * rows, table))
    before_v = _as_bytes(v_pages.clone())
    pieces = write(
        k_pages, None if latent else v_pages, k, None if latent else v, at=at,
        block_table=torch.tensor(table),
    )  # fmt: skip
    assert [(n, p, o, m) for n, p, o, m, _ in pieces] == [
        (n, table[n][a // size], a % size, 1) for n, a in enumerate(at)
    ]
    assert torch.equal(_as_bytes(k_pages), want_k)
    assert torch.equal(_as_bytes(v_pages), before_v if latent else want_v)


@pytest.mark.parametrize("layout", ["head-major", "token-major"])
def test_a_decode_steps_rows_are_those_of_the_pages_memory(layout: str) -> None:
    """The rows written are where the pages lie: a token of page ``p``, head ``h``, offset
    ``o`` is row ``(p * s0 + h * s1 + o * s2) / D`` of the memory, whichever order."""
    shape = (5, 3, 4, 2) if layout == "head-major" else (5, 4, 3, 2)
    memory = torch.zeros(shape)
    pages = memory if layout == "head-major" else memory.transpose(1, 2)
    k = torch.arange(4 * 3 * 2, dtype=torch.float32).view(4, 3, 1, 2) + 1
    write(pages, None, k, None, at=[0, 1, 2, 3], block_table=torch.tensor([[4], [0], [3], [1]]))
    for n, (page, offset) in enumerate([(4, 0), (0, 1), (3, 2), (1, 3)]):
        assert torch.equal(pages[page, :, offset], k[n, :, 0])
    assert int(memory.ne(0).sum()) == k.numel()


def test_a_module_under_autocast_is_told_to_make_its_cache_in_the_autocast_dtype() -> None:
    # Under torch.autocast a module's float32 projections give bfloat16 keys; the cache the
    # module made in its parameters' dtype refused them without saying why they were bfloat16.
    # Made in the autocast dtype as the message says, the decode equals the whole call's output.
    from attnkit import MultiHeadAttention
    from attnkit.testing import assert_close

    m = MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    x = torch.randn(2, 6, 32)
    cache = m.make_cache(2, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        whole = m(x, causal=True)
        with pytest.raises(TypeError, match=r"under torch\.autocast .*cache\.to\(dtype="):
            m(x[:, :4], causal=True, cache=cache)
        assert cache.length == 0
        cache.to(dtype=torch.bfloat16)
        steps = [m(x[:, :4], causal=True, cache=cache), m(x[:, 4:5], causal=True, cache=cache)]
        steps.append(m(x[:, 5:], causal=True, cache=cache))
    assert_close(torch.cat(steps, 1), whole)
