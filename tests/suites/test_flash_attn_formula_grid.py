"""``attnkit.flash_attn`` against a float64 statement of flash-attn's documented math, over the
combinations the peer grid leaves out: float64 inputs to 1e-10, value heads of their own size,
an explicit ``softmax_scale``, GQA and MQA with softcap and ALiBi on packed and paged sequences
(pages of 2, 16 and 256 keys) and on the KV cache, the KV cache in bfloat16, float16 and float32,
caches of no keys, and the refusals of mismatched shapes, named as the caller wrote them.

The statement: ``softmax(q k^T * softmax_scale + alibi)`` with the scores soft-capped as
``softcap * tanh(s / softcap)`` before ALiBi adds ``-slope * |i + Tk - Tq - j|``; query ``i`` sees
key ``j`` iff ``-left <= j - (i + Tk - Tq) <= right`` (-1: unbounded; causal: right = 0); GQA
repeats each key/value head over its group of query heads; a row that sees no key gives output 0
and a log-sum-exp of -inf.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from torch import Tensor

import attnkit.flash_attn as fa
from attnkit.testing import assert_close

from ..helpers import flash_attn_formula as _formula

_F64 = torch.float64


def _same(out: Tensor, lse: Tensor, want: Tensor, want_lse: Tensor, dtype: torch.dtype) -> None:
    """Output and LSE against the formula: float64 to 1e-10, else ``dtype``'s tolerance; a row
    with no key has an LSE of -inf."""
    empty = torch.isinf(want_lse)
    assert torch.equal(lse[empty], torch.full_like(lse[empty], -math.inf))
    if dtype == _F64:
        torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(lse[~empty], want_lse[~empty], atol=1e-10, rtol=1e-10)
    else:
        assert_close(out, want, dtype=dtype)
        assert_close(lse[~empty], want_lse[~empty], dtype=dtype)


_WINDOWS = [(-1, -1), (0, 0), (2, 0), (1, 3), (-1, 1), (3, -1), (100, 100)]
_HEADS = [(4, 4), (4, 2), (4, 1), (3, 1)]


def _slopes(kind: str | None, batch: int, heads: int, g: torch.Generator) -> Tensor | None:
    if kind is None:
        return None
    slopes = torch.rand(batch, heads, generator=g, dtype=_F64)
    return slopes[0] if kind == "h" else slopes


def _row(slopes: Tensor | None, b: int) -> Tensor | None:
    return None if slopes is None or slopes.ndim == 1 else slopes[b]


@pytest.mark.parametrize("seed", range(6))
def test_func_float64_equals_the_formula(seed: int) -> None:
    """flash_attn_func in float64 over a random slice of the grid, value heads of their own size
    and an explicit scale included; the packed layouts are the same call."""
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(25):
        batch, tq, tk = rnd.choice([1, 2]), rnd.choice([1, 2, 5, 9]), rnd.choice([1, 3, 5, 12])
        (h, hkv), d = rnd.choice(_HEADS), rnd.choice([5, 8, 13])
        dv = rnd.choice([d, 7])
        causal, window = rnd.random() < 0.5, rnd.choice(_WINDOWS)
        cap, kind, scale = (
            rnd.choice([0.0, 2.0]),
            rnd.choice([None, "h", "bh"]),
            rnd.choice([None, 0.3]),
        )
        q = torch.randn(batch, tq, h, d, generator=g, dtype=_F64)
        k = torch.randn(batch, tk, hkv, d, generator=g, dtype=_F64)
        v = torch.randn(batch, tk, hkv, dv, generator=g, dtype=_F64)
        slopes = _slopes(kind, batch, h, g)
        out, lse, s_dmask = fa.flash_attn_func(
            q, k, v, 0.0, scale, causal, window, cap, slopes, return_attn_probs=True
        )
        assert out.shape == (batch, tq, h, dv)
        assert lse.shape == (batch, h, tq)
        assert s_dmask.numel() == 0
        for b in range(batch):
            row = slopes if slopes is not None and slopes.ndim == 1 else _row(slopes, b)
            want, want_lse = _formula(q[b], k[b], v[b], causal, window, cap, row, scale)
            _same(out[b], lse[b], want, want_lse, _F64)
        if dv == d:
            kv = torch.stack([k, v], 2)
            args = (0.0, scale, causal, window, cap, slopes)
            torch.testing.assert_close(fa.flash_attn_kvpacked_func(q, kv, *args), out)
            if tq == tk and h == hkv:
                qkv = torch.stack([q, k, v], 2)
                torch.testing.assert_close(fa.flash_attn_qkvpacked_func(qkv, *args), out)


def _cu(lengths: list[int]) -> Tensor:
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def _paged(
    x: Tensor, lengths: list[int], page: int, g: torch.Generator, table: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Packed ``x (total, Hkv, D)`` as shuffled pages of ``page`` tokens (the other pages
    random), and their table (``table``: these pages)."""
    per = max(1, -(-max(lengths, default=0) // page))
    n = len(lengths)
    if table is None:
        table = torch.randperm(n * per + 1, generator=g)[: n * per].view(n, per)
    pages = torch.randn(n * per + 1, page, *x.shape[1:], generator=g, dtype=x.dtype)
    start = 0
    for s, length in enumerate(lengths):
        for t in range(length):
            pages[table[s, t // page], t % page] = x[start + t]
        start += length
    return pages, table.to(torch.int32)


@pytest.mark.parametrize("seed", range(6))
def test_varlen_float64_equals_the_formula_per_sequence(seed: int) -> None:
    """Packed sequences (empty ones, more queries than keys and the reverse) with GQA, softcap,
    ALiBi per head or per sequence and windows, packed or in pages of 2, 16 or 256 keys: each
    sequence is the formula on its own."""
    rnd, g = random.Random(100 + seed), torch.Generator().manual_seed(100 + seed)
    for _ in range(12):
        n = rnd.choice([1, 2, 3])
        q_lengths = [rnd.choice([0, 1, 2, 4]) for _ in range(n)]
        k_lengths = (
            list(q_lengths) if rnd.random() < 0.3 else [rnd.choice([0, 1, 3, 6]) for _ in range(n)]
        )
        (h, hkv), d = rnd.choice(_HEADS), rnd.choice([5, 8])
        dv = rnd.choice([d, 3])
        causal, window = rnd.random() < 0.5, rnd.choice(_WINDOWS)
        cap, kind, page = (
            rnd.choice([0.0, 2.0]),
            rnd.choice([None, "h", "bh"]),
            rnd.choice([None, 2, 16, 256]),
        )
        q = torch.randn(sum(q_lengths), h, d, generator=g, dtype=_F64)
        k = torch.randn(sum(k_lengths), hkv, d, generator=g, dtype=_F64)
        v = torch.randn(sum(k_lengths), hkv, dv, generator=g, dtype=_F64)
        slopes = _slopes(kind, n, h, g)
        keys, values, table = k, v, None
        if page is not None:
            keys, table = _paged(k, k_lengths, page, g)
            values, _ = _paged(v, k_lengths, page, g, table)
        out, lse, _ = fa.flash_attn_varlen_func(
            q, keys, values, _cu(q_lengths), _cu(k_lengths), max(q_lengths), max(k_lengths),
            0.0, None, causal, window, cap, slopes, return_attn_probs=True, block_table=table,
        )  # fmt: skip
        assert out.shape == (sum(q_lengths), h, dv)
        assert lse.shape == (h, sum(q_lengths))
        qs = ks = 0
        for s, (nq, nk) in enumerate(zip(q_lengths, k_lengths, strict=True)):
            row = slopes if slopes is not None and slopes.ndim == 1 else _row(slopes, s)
            want, want_lse = _formula(
                q[qs : qs + nq], k[ks : ks + nk], v[ks : ks + nk], causal, window, cap, row, None
            )
            _same(out[qs : qs + nq], lse[:, qs : qs + nq], want, want_lse, _F64)
            qs, ks = qs + nq, ks + nk


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, at: Tensor, interleaved: bool) -> Tensor:
    """``x (T, H, D)``'s first ``2 * cos.size(1)`` dims rotated at positions ``at (T,)``."""
    half = cos.size(1)
    c, s = cos[at][:, None], sin[at][:, None]
    part, rest = x[..., : 2 * half], x[..., 2 * half :]
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]
        turned = torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)
    else:
        a, b = part[..., :half], part[..., half:]
        turned = torch.cat((a * c - b * s, a * s + b * c), -1)
    return torch.cat((turned, rest), -1)


def _kv_case(rnd: random.Random) -> dict[str, Any]:
    batch, capacity, new = rnd.choice([1, 2, 3]), rnd.choice([6, 20]), rnd.choice([0, 1, 3])
    page = rnd.choice([None, None, 4, 16, 256])
    seen = [rnd.randint(0, capacity - new) for _ in range(batch)]
    int_seen = rnd.random() < 0.2
    if int_seen:
        seen = [seen[0]] * batch
    leftpad = rnd.random() < 0.3
    batch_idx = page is None and rnd.random() < 0.4
    return dict(
        batch=batch, capacity=capacity, new=new, page=page, seen=seen, int_seen=int_seen,
        tq=rnd.choice([1, 2, 4]), heads=rnd.choice(_HEADS), d=rnd.choice([6, 10]),
        dv=rnd.choice([None, 3]), causal=rnd.random() < 0.5,
        window=rnd.choice([(-1, -1), (0, 0), (2, 0), (1, 3), (-1, 1)]),
        cap=rnd.choice([0.0, 2.0]), alibi=rnd.choice([None, "h", "bh"]),
        pad=[rnd.randint(0, s) for s in seen] if leftpad else None,
        rows=rnd.sample(range(5), batch) if batch_idx else None,
        rotary=new > 0 and rnd.random() < 0.5, interleaved=rnd.random() < 0.5,
    )  # fmt: skip


def _run_kv_case(c: dict[str, Any], dtype: torch.dtype, g: torch.Generator) -> None:
    """One flash_attn_with_kvcache call against the formula on each row's keys, and the new
    tokens (rotated) written at ``cache_seqlens`` of the row's cache row or pages."""
    batch, capacity, new, page, seen = c["batch"], c["capacity"], c["new"], c["page"], c["seen"]
    (h, hkv), d, tq = c["heads"], c["d"], c["tq"]
    dv = c["dv"] or d
    rows = c["rows"] or list(range(batch))
    pad = c["pad"] or [0] * batch
    cache_rows = 5 if c["rows"] else batch

    def r(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=_F64).to(dtype)

    full_k, full_v = r(cache_rows, capacity, hkv, d), r(cache_rows, capacity, hkv, dv)
    q, k, v = r(batch, tq, h, d), r(batch, new, hkv, d), r(batch, new, hkv, dv)
    angles = torch.rand(64, 2, generator=g, dtype=_F64) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slopes = _slopes(c["alibi"], batch, h, g)
    k_cache, v_cache, table = full_k.clone(), full_v.clone(), None
    if page is not None:
        k_cache, table = _paged(full_k.flatten(0, 1), [capacity] * batch, page, g)
        v_cache = _paged(full_v.flatten(0, 1), [capacity] * batch, page, g, table)[0]
    out, lse = fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, k if new else None, v if new else None,
        cos if c["rotary"] else None, sin if c["rotary"] else None,
        seen[0] if c["int_seen"] else torch.tensor(seen, dtype=torch.int32),
        None if c["rows"] is None else torch.tensor(rows, dtype=torch.int32),
        None if c["pad"] is None else torch.tensor(pad, dtype=torch.int32),
        table, None, c["causal"], c["window"], c["cap"], c["interleaved"], slopes,
        return_softmax_lse=True,
    )  # fmt: skip
    assert out.shape == (batch, tq, h, dv)
    assert out.dtype == dtype
    for b in range(batch):
        n, row = seen[b], rows[b]
        k_new, q_b = k[b].double(), q[b].double()
        if c["rotary"]:
            k_new = _rotate(
                k_new, cos.double(), sin.double(), torch.arange(new) + n, c["interleaved"]
            )
            positional = c["causal"] or c["window"] != (-1, -1)
            steps = torch.arange(tq) if positional else torch.zeros(tq, dtype=torch.long)
            q_b = _rotate(q_b, cos.double(), sin.double(), steps + n, c["interleaved"])
        keys = torch.cat([full_k[row, pad[b] : n].double(), k_new])
        values = torch.cat([full_v[row, pad[b] : n].double(), v[b].double()])
        row_slopes = slopes if slopes is not None and slopes.ndim == 1 else _row(slopes, b)
        want, want_lse = _formula(
            q_b, keys, values, c["causal"], c["window"], c["cap"], row_slopes, None
        )
        _same(out[b], lse[b], want, want_lse, dtype)
        for t in range(n, n + new):
            at = (row, t) if table is None else (int(table[b, t // page]), t % page)
            assert_close(k_cache[at], k_new[t - n], dtype=dtype)
            assert torch.equal(v_cache[at], v[b, t - n])


@pytest.mark.parametrize("seed", range(6))
def test_kvcache_float64_equals_the_formula(seed: int) -> None:
    """The KV-cache call with GQA/MQA, softcap, ALiBi per head or per row, value heads of their
    own size, cache_leftpad, cache_batch_idx, pages of 4, 16 and 256 keys and rotary tables."""
    rnd, g = random.Random(200 + seed), torch.Generator().manual_seed(200 + seed)
    for _ in range(12):
        _run_kv_case(_kv_case(rnd), _F64, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kvcache_low_precision_equals_the_formula(dtype: torch.dtype) -> None:
    """The same grid in float32, bfloat16 and float16, within the dtype's tolerance."""
    rnd, g = random.Random(300), torch.Generator().manual_seed(300)
    for _ in range(12):
        _run_kv_case(_kv_case(rnd), dtype, g)


@pytest.mark.parametrize(
    "kw",
    [
        dict(k_cache=(2, 0, 2, 4)),
        dict(k_cache=(3, 0, 2, 4), cache_batch_idx=[0, 2]),
        dict(k_cache=(4, 0, 2, 4), block_table=[[0], [3]]),
        dict(k_cache=(2, 0, 2, 4), seqlens=None),
    ],
    ids=["rows", "batch-idx", "pages", "whole-capacity"],
)
def test_kvcache_of_no_keys_gives_zero(kw: dict[str, Any]) -> None:
    """A cache of no positions (pages of no keys): every row sees no key, so the output is 0 and
    the LSE -inf, as for any row with no key (the kernel once divided by the page size, 0, and
    killed the process with SIGFPE)."""
    q = torch.randn(2, 3, 4, 4, dtype=_F64)
    k_cache = torch.randn(*kw["k_cache"], dtype=_F64)
    table = kw.get("block_table")
    idx = kw.get("cache_batch_idx")
    out, lse = fa.flash_attn_with_kvcache(
        q, k_cache, k_cache.clone(),
        cache_seqlens=kw.get("seqlens", 0),
        cache_batch_idx=None if idx is None else torch.tensor(idx, dtype=torch.int32),
        block_table=None if table is None else torch.tensor(table, dtype=torch.int32),
        causal=True, return_softmax_lse=True,
    )  # fmt: skip
    assert torch.equal(out, torch.zeros(2, 3, 4, 4, dtype=_F64))
    assert torch.equal(lse, torch.full((2, 4, 3), -math.inf, dtype=_F64))


def test_paged_varlen_of_no_keys_gives_zero() -> None:
    """Packed queries on pages of no keys: output 0, LSE -inf."""
    q = torch.randn(3, 2, 4, dtype=_F64)
    pages = torch.randn(4, 0, 2, 4, dtype=_F64)
    out, lse, _ = fa.flash_attn_varlen_func(
        q, pages, pages.clone(), _cu([1, 2]), _cu([0, 0]), 2, 0, return_attn_probs=True,
        block_table=torch.tensor([[0], [1]], dtype=torch.int32),
    )  # fmt: skip
    assert torch.equal(out, torch.zeros(3, 2, 4, dtype=_F64))
    assert torch.equal(lse, torch.full((2, 3), -math.inf, dtype=_F64))


def _t(*shape: int) -> Tensor:
    return torch.zeros(*shape)


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: fa.flash_attn_func(_t(1, 2, 3, 4), _t(1, 5, 2, 4), _t(1, 5, 2, 4)),
         "nheads (3) must be a multiple of the key/value heads (k's and v's nheads_k, 2)"),
        (lambda: fa.flash_attn_func(_t(1, 2, 2, 4), _t(1, 5, 2, 6), _t(1, 5, 2, 4)),
         "q's headdim (4) must be k's (6)"),
        (lambda: fa.flash_attn_func(_t(1, 2, 2, 4), _t(1, 5, 2, 4), _t(1, 6, 2, 4)),
         "k and v must agree on all but the head size"),
        (lambda: fa.flash_attn_func(_t(2, 2, 2, 4), _t(1, 5, 2, 4), _t(1, 5, 2, 4)),
         "q, k and v must share their batch"),
        (lambda: fa.flash_attn_varlen_func(_t(3, 3, 4), _t(5, 2, 4), _t(5, 2, 4), _cu([3]),
            _cu([5])),
         "nheads (3) must be a multiple of the key/value heads"),
        (lambda: fa.flash_attn_varlen_func(_t(3, 2, 4), _t(5, 2, 4), _t(6, 2, 4), _cu([3]),
            _cu([5])),
         "k and v must agree on all but the head size"),
        (lambda: fa.flash_attn_varlen_func(
            _t(3, 3, 4), _t(2, 16, 2, 4), _t(2, 16, 2, 4), _cu([3]), _cu([5]),
            block_table=torch.zeros(1, 1, dtype=torch.int32)),
         "nheads (3) must be a multiple of the key/value heads"),
    ],
    ids=[
        "func-heads", "func-headdim", "func-kv", "func-batch", "varlen-heads", "varlen-kv",
        "paged-heads",
    ],
)  # fmt: skip
def test_mismatched_shapes_are_named_as_given(call: Any, words: str) -> None:
    """A refusal of mismatched q, k, v names their shapes as the caller gave them, in flash-attn's
    layout (they were named transposed to ``(B, H, T, D)``, or with a batch dim of 1 the caller
    never wrote: a ``(5, 2, 4)`` k was 'k (1, 2, 5, 4)')."""
    with pytest.raises(ValueError, match="must") as caught:
        call()
    message = str(caught.value)
    assert words in message
    assert "(1, 2, 5, 4)" not in message
    assert "(1, 3, 3, 4)" not in message


@pytest.mark.parametrize(
    "name", ["cu_seqlens_q", "cache_seqlens", "cache_leftpad", "cache_batch_idx"]
)
def test_complex_lengths_are_refused_by_name(name: str) -> None:
    """Complex lengths or indices are refused by the argument's name (they reached ``int()``,
    whose message names no argument)."""
    lengths = torch.tensor([0, 1, 3], dtype=torch.complex64)
    x, cache = torch.zeros(3, 2, 4), torch.zeros(3, 8, 2, 4)
    kw: dict[str, Any] = {"cache_seqlens": 3, name: lengths}

    def call() -> object:
        if name == "cu_seqlens_q":
            return fa.flash_attn_varlen_func(x, x, x, lengths, _cu([1, 2]))
        return fa.flash_attn_with_kvcache(torch.zeros(3, 1, 2, 4), cache, cache, **kw)

    with pytest.raises((TypeError, ValueError), match=f"{name} must be .*integer tensor"):
        call()
