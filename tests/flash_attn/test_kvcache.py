"""``flash_attn_with_kvcache`` (``attnkit.flash_attn._kvcache``): the new tokens written in place
and attended, row by row against the reference; and a refused call, whatever its fault, leaves
the cache as it was."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import Tensor

from attnkit import flash_attn as fa
from attnkit.testing import assert_close

from .helpers import assert_unchanged, kv_call, reference, rotate, snapshot


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(
    ("is_causal", "window", "leftpad", "batch_idx"),
    [(True, (-1, -1), False, False), (False, (-1, -1), True, True), (True, (5, 0), True, False)],
)
def test_kvcache_appends_in_place_and_attends(
    paged: bool,
    interleaved: bool,
    is_causal: bool,
    window: tuple[int, int],
    leftpad: bool,
    batch_idx: bool,
) -> None:
    if paged and batch_idx:
        pytest.skip("flash-attn takes cache_batch_idx without a block table only")
    g = torch.Generator().manual_seed(11)
    batch, heads, hkv, d, capacity, new, tq = 3, 4, 2, 16, 40, 3, 3
    seen = torch.tensor([5, 0, 17], dtype=torch.int32)
    pad = torch.tensor([2, 0, 9], dtype=torch.int32) if leftpad else None
    rows = torch.tensor([2, 0, 3]) if batch_idx else None
    cache_rows = 4 if batch_idx else batch
    full_k = torch.randn(cache_rows, capacity, hkv, d, generator=g, dtype=torch.float64)
    full_v = torch.randn(cache_rows, capacity, hkv, d, generator=g, dtype=torch.float64)
    q = torch.randn(batch, tq, heads, d, generator=g, dtype=torch.float64)
    k = torch.randn(batch, new, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, new, hkv, d, generator=g, dtype=torch.float64)
    rd = 8  # rotary on half the head
    angles = torch.rand(64, rd // 2, generator=g, dtype=torch.float64) * 6
    cos, sin = angles.cos(), angles.sin()
    slopes = torch.rand(heads, generator=g, dtype=torch.float64)
    k_cache, v_cache = full_k.clone(), full_v.clone()
    table = None
    if paged:  # pages of 8 in a shuffled pool
        page, per_row = 8, capacity // 8
        order = torch.randperm(batch * per_row, generator=g)
        table = order.view(batch, per_row).to(torch.int32)
        k_cache = torch.zeros(batch * per_row, page, hkv, d, dtype=torch.float64)
        v_cache = torch.zeros_like(k_cache)
        for b in range(batch):
            for t in range(capacity):
                k_cache[table[b, t // page], t % page] = full_k[b, t]
                v_cache[table[b, t // page], t % page] = full_v[b, t]
    out, lse = fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cos, sin, seen, rows, pad, table, None, is_causal, window,
        0.0, interleaved, slopes, return_softmax_lse=True,
    )  # fmt: skip
    assert out.shape == (batch, tq, heads, d)
    assert lse.shape == (batch, heads, tq)
    for b in range(batch):
        r = b if rows is None else int(rows[b])
        start = 0 if pad is None else int(pad[b])
        n = int(seen[b])
        k_rot = rotate(k[b], cos, sin, torch.arange(new) + n - start, interleaved)
        positional = is_causal or window != (-1, -1)
        q_at = torch.arange(tq) if positional else torch.zeros(tq, dtype=torch.long)
        q_rot = rotate(q[b], cos, sin, q_at + n - start, interleaved)
        keys = torch.cat([full_k[r, start:n], k_rot])
        values = torch.cat([full_v[r, start:n], v[b]])
        if paged:
            written = torch.stack([k_cache[table[b, t // 8], t % 8] for t in range(n, n + new)])
        else:
            written = k_cache[r, n : n + new]
        assert_close(written, k_rot)  # the new keys went into the cache, rotated
        o, l_ = reference(q_rot[None], keys[None], values[None], causal=is_causal, window=window,
                          slopes=slopes)  # fmt: skip
        assert_close(out[b], o[0])
        assert_close(lse[b], l_[0])


def test_kvcache_without_new_keys_reads_cache_seqlens() -> None:
    g = torch.Generator().manual_seed(12)
    k_cache = torch.randn(2, 10, 1, 8, generator=g, dtype=torch.float64)
    v_cache = torch.randn(2, 10, 1, 8, generator=g, dtype=torch.float64)
    q = torch.randn(2, 1, 2, 8, generator=g, dtype=torch.float64)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([4, 9]))
    for b, n in enumerate([4, 9]):
        want, _ = reference(q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n])
        assert_close(out[b], want[0])


def _refused_kv_calls(paged: bool) -> list[tuple[str, dict[str, Any], type[Exception], str]]:
    """(what, overrides of _kv_call, exception, message fragment): each a call that must fail."""
    nan, inf = float("nan"), float("inf")
    slopes = torch.tensor([0.5, 0.25, nan, 0.0625], dtype=torch.float64)
    g = torch.Generator().manual_seed(22)
    cases = [
        ("softcap < 0", dict(softcap=-1.0), ValueError, "softcap must be a finite number > 0"),
        ("softcap nan", dict(softcap=nan), ValueError, "softcap must be a finite number > 0"),
        ("softcap inf", dict(softcap=inf), ValueError, "softcap must be a finite number > 0"),
        ("softcap str", dict(softcap="5"), TypeError, "softcap must be a number"),
        ("scale nan", dict(softmax_scale=nan), ValueError, "softmax_scale must be finite"),
        ("scale inf", dict(softmax_scale=-inf), ValueError, "softmax_scale must be finite"),
        ("scale huge", dict(softmax_scale=1e309 / 1e10), ValueError, "softmax_scale must be"),
        ("scale str", dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a float"),
        ("slopes shape", dict(alibi_slopes=torch.ones(3, dtype=torch.float64)), ValueError,
         "alibi_slopes must be (nheads,) = (4,)"),
        ("slopes int", dict(alibi_slopes=torch.ones(4, dtype=torch.int64)), TypeError,
         "alibi_slopes must be a float tensor"),
        ("slopes nan", dict(alibi_slopes=slopes), ValueError,
         "alibi_slopes must be finite, got alibi_slopes[2] = nan"),
        ("sinks shape", dict(learnable_sink=torch.zeros(3, dtype=torch.float64)), ValueError,
         "learnable_sink must be (nheads,) = (4,)"),
        ("sinks nan", dict(learnable_sink=torch.tensor([0.0, nan, 0.0, 0.0])), ValueError,
         "learnable_sink holds NaN"),
        ("sinks +inf", dict(learnable_sink=torch.tensor([0.0, inf, 0.0, 0.0])), ValueError,
         "learnable_sink holds +inf"),
        ("sinks int", dict(learnable_sink=torch.zeros(4, dtype=torch.int64)), TypeError,
         "learnable_sink must be a float tensor"),
        ("sinks twice", dict(s_aux=torch.zeros(4, dtype=torch.float64)), TypeError,
         "learnable_sink or s_aux, not both"),
        ("q headdim", dict(q=torch.randn(2, 1, 4, 16, generator=g, dtype=torch.float64)),
         ValueError, "q's headdim (16) must be k_cache's (8)"),
        ("q heads", dict(q=torch.randn(2, 1, 3, 8, generator=g, dtype=torch.float64)),
         ValueError, "q's nheads (3) must be a multiple of the cache's nheads_k (2)"),
        ("q dtype", dict(q=torch.randn(2, 1, 4, 8, generator=g)), TypeError,
         "must share a dtype"),
        ("k headdim", dict(k=torch.randn(2, 2, 2, 4, generator=g, dtype=torch.float64)),
         ValueError, "k (2, 2, 2, 4) must have k_cache's (nheads_k, headdim) = (2, 8)"),
        ("v headdim", dict(v=torch.randn(2, 2, 2, 8, generator=g, dtype=torch.float64)),
         ValueError, "v (2, 2, 2, 8) must have v_cache's (nheads_k, headdim) = (2, 6)"),
        ("rotary wide", dict(rotary_cos=torch.ones(16, 6, dtype=torch.float64),
                             rotary_sin=torch.ones(16, 6, dtype=torch.float64)), ValueError,
         "rotary_cos has 6 columns"),
        ("rotary sin", dict(rotary_sin=torch.ones(16, 1, dtype=torch.float64)), ValueError,
         "rotary_sin (16, 1) must have rotary_cos's shape (16, 2)"),
        ("rotary short", dict(rotary_cos=torch.ones(5, 2, dtype=torch.float64),
                              rotary_sin=torch.ones(5, 2, dtype=torch.float64)), ValueError,
         "rotary_cos has 5 positions, fewer than the 9"),
        ("window", dict(window_size=(2.5, 0)), TypeError, "window_size left bound"),
        ("lse flag", dict(return_softmax_lse=1), TypeError, "return_softmax_lse must be a bool"),
        ("too long", dict(cache_seqlens=torch.tensor([3, 11], dtype=torch.int32)), ValueError,
         "do not fit the cache's 12 positions"),
        ("leftpad", dict(cache_leftpad=torch.tensor([4, 0], dtype=torch.int32)), ValueError,
         "cache_leftpad [4, 0] must lie in 0..cache_seqlens [3, 7]"),
    ]  # fmt: skip
    if paged:
        cases += [
            ("table < 0", dict(block_table=torch.tensor([[4, 0, 2], [5, -1, 3]])), ValueError,
             "block_table[1, 1] = -1 is not a page: k_cache (7, 4, 2, 8) holds 7 pages"),
            ("table > pages", dict(block_table=torch.tensor([[4, 7, 2], [5, 1, 3]])), ValueError,
             "block_table[0, 1] = 7 is not a page: k_cache (7, 4, 2, 8) holds 7 pages, numbered "
             "0 to 6"),
            ("table float", dict(block_table=torch.tensor([[4.0, 0, 2], [5, 1, 3]])), TypeError,
             "block_table must be an integer tensor (batch, max_blocks) of page numbers, got "
             "float32"),
            ("table rows", dict(block_table=torch.tensor([[4, 0, 2]])), ValueError,
             "block_table must be (batch, max_blocks) with batch = 2, got shape (1, 3)"),
            ("v pages", dict(v_cache=torch.zeros(6, 4, 2, 6, dtype=torch.float64)), ValueError,
             "k_cache (7, 4, 2, 8) and v_cache (6, 4, 2, 6) must agree"),
        ]  # fmt: skip
    else:
        cases += [
            ("cache rows", dict(cache_batch_idx=torch.tensor([0, 2])), ValueError,
             "cache_batch_idx must index the 2 cache rows, got [0, 2]"),
        ]  # fmt: skip
    return cases


KV_REFUSED = [(paged, *case) for paged in (False, True) for case in _refused_kv_calls(paged)]


@pytest.mark.parametrize(
    ("paged", "what", "overrides", "exc", "message"),
    KV_REFUSED,
    ids=[f"{'paged' if c[0] else 'rows'}-{c[1]}" for c in KV_REFUSED],
)
def test_a_refused_kvcache_call_changes_nothing(
    paged: bool, what: str, overrides: dict[str, Any], exc: type[Exception], message: str
) -> None:
    good = kv_call(paged)
    # The same call without the bad argument writes into the cache: what must not happen here.
    written = {n: t.clone() if isinstance(t, Tensor) else t for n, t in good.items()}
    fa.flash_attn_with_kvcache(**written)
    assert not torch.equal(written["k_cache"], good["k_cache"])
    assert not torch.equal(written["v_cache"], good["v_cache"])
    call = {**good, **overrides}
    before = snapshot(call)
    with pytest.raises(exc, match=re.escape(message)):
        fa.flash_attn_with_kvcache(**call)
    assert_unchanged(call, before)


def test_the_early_checks_follow_autocast() -> None:
    """Under torch.autocast attention() casts q and the cache to one dtype; the checks made
    before the write allow what attention() then serves."""
    call = kv_call(paged=False)
    call["q"] = call["q"].float()
    del call["learnable_sink"]
    with pytest.raises(TypeError, match="must share a dtype"):
        fa.flash_attn_with_kvcache(**{n: t.clone() if isinstance(t, Tensor) else t
                                      for n, t in call.items()})  # fmt: skip
    call["k_cache"], call["v_cache"] = call["k_cache"].float(), call["v_cache"].float()
    call["q"] = call["q"].bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fa.flash_attn_with_kvcache(**call)
    assert out.dtype == torch.bfloat16
