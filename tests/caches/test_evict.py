"""KVCache.keep and PagedKVCache.keep: after compaction a decoding step equals the float64
reference over exactly the kept keys and values (gathered by hand), pages no longer needed go
back to the pool, and a refused call changes nothing."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import attnkit
from attnkit import KVCache, PagedKVCache
from attnkit.caches import _evict
from attnkit.testing import assert_close

F64 = torch.float64


def _choose(gen: torch.Generator, lead: tuple[int, ...], length: int, k: int) -> Tensor:
    """``k`` distinct tokens of ``length`` per row of ``lead``, in no particular order."""
    return torch.rand(*lead, length, generator=gen).argsort(-1)[..., :k]


def _gather(x: Tensor, index: Tensor) -> Tensor:
    """``x`` ``(..., L, D)`` at the tokens ``index`` ``(..., K)``, in time order: by hand."""
    rows = index.sort(-1).values
    return torch.stack([x.flatten(0, -3)[r][i] for r, i in enumerate(rows.flatten(0, -2))]).view(
        *rows.shape, x.size(-1)
    )


def _reference(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return attnkit.attention(q.to(F64), k.to(F64), v.to(F64), backend="reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kv_cache_keep_then_decode_equals_reference_over_kept(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    b, h, hkv, d, length, kept = 2, 4, 2, 8, 11, 5  # grouped-query attention
    cache = KVCache(b, 16, hkv, d, dtype=dtype)
    k, v = (torch.randn(b, hkv, length, d, generator=gen, dtype=dtype) for _ in range(2))
    with torch.no_grad():
        cache.update(k, v)
        index = _choose(gen, (b, hkv), length, kept)
        cache.keep(index)
        assert cache.length == kept
        # The kept tokens, moved to the front in time order, bit for bit.
        assert torch.equal(cache.k_cache[:, :, :kept], _gather(k, index))
        assert torch.equal(cache.v_cache[:, :, :kept], _gather(v, index))
        for _ in range(2):  # decoding goes on after the kept tokens
            q = torch.randn(b, h, 1, d, generator=gen, dtype=dtype)
            kn, vn = (torch.randn(b, hkv, 1, d, generator=gen, dtype=dtype) for _ in range(2))
            out = attnkit.attention(q, *cache.update(kn, vn))
            k, v = torch.cat([_gather(k, index), kn], 2), torch.cat([_gather(v, index), vn], 2)
            index = torch.arange(k.size(2)).expand(b, hkv, -1)
            assert_close(out, _reference(q, k, v))


def test_kv_cache_keep_drops_a_stage_and_keeps_all_or_none() -> None:
    cache = KVCache(1, 8, 1, 2, dtype=F64)
    k = torch.arange(8.0, dtype=F64).view(1, 1, 4, 2)
    cache.update(k, k)
    cache.stage(k[:, :, :2], k[:, :, :2])
    cache.keep(torch.tensor([[[3, 1, 0, 2]]]))  # every token: nothing moves
    assert cache.length == 4
    assert cache._staged == 0
    assert torch.equal(cache.k_cache[:, :, :4], k)
    cache.keep(torch.zeros(1, 1, 0, dtype=torch.int64))
    assert cache.length == 0


def _paged(layout: str, page: int, blocks: int = 16, seqs: int = 2) -> PagedKVCache:
    return PagedKVCache(
        blocks, page, 2, 8, max_seqs=seqs, max_pages_per_seq=blocks, layout=layout, dtype=F64
    )  # type: ignore[arg-type]


def _tokens(c: PagedKVCache, seq: int) -> tuple[Tensor, Tensor]:
    """Sequence ``seq``'s keys and values ``(Hkv, L, D)``, read through its pages by hand."""
    kp, vp = c.token_major()
    pages = c.pages_of(seq)
    n = c.lengths[seq]
    return tuple(  # type: ignore[return-value]
        torch.cat([p[i] for i in pages], 0)[:n].transpose(0, 1)
        if pages
        else p[0, :0].transpose(0, 1)
        for p in (kp, vp)
    )


@pytest.mark.parametrize("layout", ["flash", "vllm"])
@pytest.mark.parametrize("page", [1, 3, 4, 16])
def test_paged_keep_then_decode_equals_reference_over_kept(layout: str, page: int) -> None:
    gen = torch.Generator().manual_seed(page)
    c = _paged(layout, page, blocks=32)
    h, hkv, d, lengths, kept = 4, 2, 8, [13, 9], 7  # K = 7 splits pages of 3 and 4
    k, v = (torch.randn(2, hkv, 13, d, generator=gen, dtype=F64) for _ in range(2))
    with torch.no_grad():
        c.schedule(lengths)
        c.stage(k, v)
        c.commit()
        free = c.num_free_pages
        index = _choose(gen, (hkv,), 13, kept)
        c.keep(0, index)
        assert c.lengths == [kept, 9]
        assert len(c.pages_of(0)) == math.ceil(kept / page)
        assert c.num_free_pages == free + math.ceil(13 / page) - math.ceil(kept / page)
        assert (c.block_table[0, len(c.pages_of(0)) :] == -1).all()
        want = [(_gather(k[0], index), _gather(v[0], index)), (k[1, :, :9], v[1, :, :9])]
        for got, exp in zip(_tokens(c, 0), want[0], strict=True):
            assert torch.equal(got, exp)
        for _ in range(2):  # a decoding step in both rows
            q = torch.randn(2, h, 1, d, generator=gen, dtype=F64)
            kn, vn = (torch.randn(2, hkv, 1, d, generator=gen, dtype=F64) for _ in range(2))
            out, _ = c.attention(q, kn, vn)
            c.commit()
            want = [
                (torch.cat([ks, kn[r]], 1), torch.cat([vs, vn[r]], 1))
                for r, (ks, vs) in enumerate(want)
            ]
            for r, (ks, vs) in enumerate(want):
                assert_close(out[r : r + 1], _reference(q[r : r + 1], ks[None], vs[None]))


def test_paged_keep_frees_pages_that_another_sequence_then_takes() -> None:
    gen = torch.Generator().manual_seed(1)
    c = _paged("vllm", 2, blocks=7)
    k, v = (torch.randn(2, 2, 10, 8, generator=gen, dtype=F64) for _ in range(2))
    c.schedule([10, 0])
    c.stage(k, v)
    c.commit()
    assert c.num_free_pages == 2
    c.schedule([0, 8])
    with pytest.raises(ValueError, match="out of pages"):
        c.stage(k, v)  # 4 pages needed, 2 free
    index = torch.tensor([[0, 9], [5, 1]])
    c.keep(0, index)  # 1 page kept, 4 freed
    assert c.num_free_pages == 6
    c.schedule([0, 8])
    c.stage(k, v)  # now it fits, in pages sequence 0 held
    c.commit()
    assert set(c.pages_of(1)) & {1, 2, 3, 4}
    q = torch.randn(2, 4, 1, 8, generator=gen, dtype=F64)
    kn, vn = (torch.randn(2, 2, 1, 8, generator=gen, dtype=F64) for _ in range(2))
    out, _ = c.attention(q, kn, vn)
    k0 = torch.cat([_gather(k[0], index), kn[0]], 1)
    v0 = torch.cat([_gather(v[0], index), vn[0]], 1)
    k1, v1 = torch.cat([k[1, :, :8], kn[1]], 1), torch.cat([v[1, :, :8], vn[1]], 1)
    assert_close(out[:1], _reference(q[:1], k0[None], v0[None]))
    assert_close(out[1:], _reference(q[1:], k1[None], v1[None]))


def test_paged_keep_drops_an_uncommitted_stage() -> None:
    c = _paged("flash", 4)
    k = torch.randn(2, 2, 6, 8, dtype=F64)
    c.stage(k, k)
    c.commit()
    c.stage(k[:, :, :3], k[:, :, :3])  # 3 staged tokens in each row, never committed
    c.keep(1, torch.tensor([[5, 0], [2, 3]]))
    assert c.lengths == [6, 2]
    assert c.num_free_pages == 16 - 2 - 1
    assert torch.equal(_tokens(c, 0)[0], k[0])


# -------------------------------------------------------------------------------------------------
# Refused calls change nothing


def _kv_snapshot(c: KVCache) -> tuple[Any, ...]:
    return c.k_cache.clone(), c.v_cache.clone(), c.length, c._staged


def _paged_snapshot(c: PagedKVCache) -> tuple[Any, ...]:
    return (
        c.k_pages.clone(),
        c.v_pages.clone(),
        c.block_table.clone(),
        list(c.lengths),
        [c.pages_of(b) for b in range(c.max_seqs)],
        c.num_free_pages,
        list(c._staged),
    )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y) if isinstance(x, Tensor) else x == y


_REFUSED: list[tuple[Any, type[Exception], str]] = [
    (torch.tensor([[[0, 5]], [[1, 2]]]), ValueError, r"from 0 to 4 .* got 5 in row \(0, 0\)"),
    (torch.tensor([[[0, -1]], [[1, 2]]]), ValueError, r"got -1 in row \(0, 0\)"),
    (torch.tensor([[[0, 1]], [[2, 2]]]), ValueError, r"row \(1, 0\) keeps token 2 twice"),
    (torch.tensor([[0, 1], [1, 2]]), ValueError, r"shape \(2, 1, K\) .* got \(2, 2\)"),
    (torch.tensor([[[0, 1]]]), ValueError, r"shape \(2, 1, K\) .* got \(1, 1, 2\)"),
    (torch.zeros(2, 1, 6, dtype=torch.int64), ValueError, "keeps 6 tokens of a row of 5"),
    (torch.tensor([[[0.0, 1.0]], [[1.0, 2.0]]]), TypeError, "integer tensor, got float32"),
    (torch.ones(2, 1, 2, dtype=torch.bool), TypeError, "integer tensor, got bool"),
    ([[[0, 1]], [[1, 2]]], TypeError, "integer tensor, got list"),
    # (meta indices hold no values to move: torch's "Cannot copy out of meta tensor")
    (torch.zeros(2, 1, 2, dtype=torch.int64, device="meta"), ValueError, "on meta, .* on cpu"),
]


@pytest.mark.parametrize(("indices", "error", "match"), _REFUSED)
def test_kv_cache_refused_keep_changes_nothing(indices: Any, error: type, match: str) -> None:
    cache = KVCache(2, 8, 1, 4)
    cache.update(torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4))
    cache.stage(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4))
    before = _kv_snapshot(cache)
    with pytest.raises(error, match=match):
        cache.keep(indices)
    _same(before, _kv_snapshot(cache))


@pytest.mark.parametrize(
    ("seq", "indices", "error", "match"),
    [
        (0, torch.tensor([[0, 5], [1, 2]]), ValueError, r"from 0 to 4 .* got 5 in row \(0,\)"),
        (0, torch.tensor([[3, 1], [1, 1]]), ValueError, r"row \(1,\) keeps token 1 twice"),
        (0, torch.tensor([0, 1]), ValueError, r"shape \(2, K\) .* got \(2\)"),
        (0, torch.tensor([[0.0, 1.0], [0.0, 1.0]]), TypeError, "got float32"),
        (1, torch.tensor([[0, 1], [0, 1]]), ValueError, "keeps 2 tokens of a row of 0"),
        (2, torch.tensor([[0, 1], [0, 1]]), ValueError, "seq must be a sequence from 0 to 1"),
        (-1, torch.tensor([[0, 1], [0, 1]]), ValueError, "seq must be a sequence from 0 to 1"),
    ],
)
def test_paged_refused_keep_changes_nothing(
    seq: int, indices: Any, error: type, match: str
) -> None:
    c = _paged("vllm", 2)
    c.schedule([5, 0])
    c.stage(torch.randn(2, 2, 5, 8, dtype=F64), torch.randn(2, 2, 5, 8, dtype=F64))
    c.commit()
    c.stage(torch.randn(2, 2, 1, 8, dtype=F64), torch.randn(2, 2, 1, 8, dtype=F64))
    before = _paged_snapshot(c)
    with pytest.raises(error, match=match):
        c.keep(seq, indices)
    _same(before, _paged_snapshot(c))


# -------------------------------------------------------------------------------------------------
# Fuzz


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(["flash", "vllm"]),
    page=st.integers(1, 5),
    length=st.integers(0, 12),
    data=st.data(),
)
def test_paged_keep_fuzz(layout: str, page: int, length: int, data: st.DataObject) -> None:
    kept = data.draw(st.integers(0, length))
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    c = _paged(layout, page, blocks=16)
    k, v = (torch.randn(2, 2, 12, 8, generator=gen, dtype=F64) for _ in range(2))
    c.schedule([length, 12 - length])
    c.stage(k, v)
    c.commit()
    other = _tokens(c, 1)
    index = _choose(gen, (2,), length, kept)
    c.keep(0, index)
    assert c.lengths == [kept, 12 - length]
    assert c.num_free_pages == 16 - math.ceil(kept / page) - math.ceil((12 - length) / page)
    for got, x in zip(_tokens(c, 0), (k[0], v[0]), strict=True):
        assert torch.equal(got, _gather(x[:, :length], index))
    for got, was in zip(_tokens(c, 1), other, strict=True):
        assert torch.equal(got, was)  # the other sequence is untouched
    q = torch.randn(2, 4, 1, 8, generator=gen, dtype=F64)
    kn, vn = (torch.randn(2, 2, 1, 8, generator=gen, dtype=F64) for _ in range(2))
    out, _ = c.attention(q, kn, vn)
    ks = torch.cat([_gather(k[0, :, :length], index), kn[0]], 1)
    vs = torch.cat([_gather(v[0, :, :length], index), vn[0]], 1)
    assert_close(out[:1], _reference(q[:1], ks[None], vs[None]))


def test_check_indices_sorts_into_time_order() -> None:
    index = _evict.check_indices(torch.tensor([[4, 0, 2]], dtype=torch.int32), (1,), 5, "i")
    assert index.dtype == torch.int64
    assert index.tolist() == [[0, 2, 4]]


def test_a_module_rotates_new_tokens_at_the_sequences_positions_after_keep() -> None:
    # After keep, MultiHeadAttention rotates the next token at its position in the sequence
    # (cache.position), not at the number of tokens kept (cache.length): the step equals the
    # module over the whole sequence with only the kept keys visible to that token.
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(
        32, 4, num_kv_heads=2, rotary=attnkit.RotaryEmbedding(8), dtype=torch.float64
    ).eval()
    x = torch.randn(1, 11, 32, dtype=torch.float64)
    kept = [0, 3, 4, 8]
    visible = torch.ones(11, 11, dtype=torch.bool).tril()
    visible[10] = False
    visible[10, [*kept, 10]] = True
    with torch.no_grad():
        want = mha(x, mask=visible)[:, 10]
        cache = mha.make_cache(batch_size=1, max_len=16)
        mha(x[:, :10], cache=cache, causal=True)
        cache.keep(torch.tensor(kept).expand(1, 2, 4))
        got = mha(x[:, 10:], cache=cache, causal=True)[:, 0]
    assert (cache.length, cache.position) == (5, 11)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_paged_keep_refuses_indices_on_meta_and_changes_no_token() -> None:
    # (torch's "Cannot copy out of meta tensor" before; the check reads no value on meta)
    c = _paged("flash", 2)
    c.schedule([5, 0])
    c.stage(torch.randn(2, 2, 5, 8, dtype=F64), torch.randn(2, 2, 5, 8, dtype=F64))
    c.commit()
    before = _paged_snapshot(c)
    with pytest.raises(ValueError, match="kept are on meta, which holds no values, but the cache"):
        c.keep(0, torch.zeros(2, 1, dtype=torch.int64, device="meta"))
    _same(before, _paged_snapshot(c))
