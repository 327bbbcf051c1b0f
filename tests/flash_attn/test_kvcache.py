"""``flash_attn_with_kvcache`` (``attnkit.flash_attn._kvcache``): the new tokens written in place
and attended, row by row against the reference; and a refused call, whatever its fault, leaves
the cache as it was."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import _native
from attnkit import flash_attn as fa
from attnkit._kernel.cache import IN_PLACE
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
        k_rot = rotate(k[b], cos, sin, torch.arange(new) + n, interleaved)
        positional = is_causal or window != (-1, -1)
        q_at = torch.arange(tq) if positional else torch.zeros(tq, dtype=torch.long)
        q_rot = rotate(q[b], cos, sin, q_at + n, interleaved)
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


NEW_SHAPES = (
    "k and v must have shapes (batch, seqlen_new, nheads_k, headdim) = (2, 2, 2, 8) and "
    "(batch, seqlen_new, nheads_k, headdim_v) = (2, 2, 2, 6)"
)


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
        # new k and v: the caches' one check of new tokens, in flash-attn's names and layout
        ("k headdim", dict(k=torch.randn(2, 2, 2, 4, generator=g, dtype=torch.float64)),
         ValueError, f"{NEW_SHAPES} for this cache (k_cache "),
        ("v headdim", dict(v=torch.randn(2, 2, 2, 8, generator=g, dtype=torch.float64)),
         ValueError, f"{NEW_SHAPES} for this cache (k_cache "),
        ("k heads", dict(k=torch.randn(2, 2, 1, 8, generator=g, dtype=torch.float64)),
         ValueError, f"{NEW_SHAPES} for this cache (k_cache "),
        ("k batch", dict(k=torch.randn(3, 2, 2, 8, generator=g, dtype=torch.float64)),
         ValueError, f"{NEW_SHAPES} for this cache (k_cache "),
        ("v tokens", dict(v=torch.randn(2, 3, 2, 6, generator=g, dtype=torch.float64)),
         ValueError, f"{NEW_SHAPES} for this cache (k_cache "),
        ("k 3-d", dict(k=torch.randn(2, 2, 8, generator=g, dtype=torch.float64)), ValueError,
         "(batch, seqlen_new, nheads_k, headdim) = (2, T, 2, 8)"),
        ("k dtype", dict(k=torch.randn(2, 2, 2, 8, generator=g)), TypeError,
         "k and v must have k_cache's dtype (float64), got k float32 and v float64"),
        ("v int", dict(v=torch.ones(2, 2, 2, 6, dtype=torch.int64)), TypeError,
         "v must be a float tensor, got int64"),
        ("k list", dict(k=[[1.0]]), TypeError, "k must be a torch.Tensor, got list"),
        ("k grad", dict(k=torch.randn(2, 2, 2, 8, dtype=torch.float64, requires_grad=True)),
         ValueError, "flash_attn_with_kvcache got keys that require grad: the cache is for "
         "inference, run decoding under torch.no_grad() or torch.inference_mode() (got k with "
         "requires_grad=True)"),
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


@pytest.mark.parametrize("paged", [False, True], ids=["rows", "paged"])
def test_new_tokens_on_another_device_are_refused_by_name_before_writing(paged: bool) -> None:
    call = kv_call(paged)
    call["v"] = call["v"].to("meta")
    before = snapshot({n: t for n, t in call.items() if n != "v"})
    message = "k and v must be on k_cache's device (cpu), got k on cpu and v on meta"
    with pytest.raises(ValueError, match=re.escape(message)):
        fa.flash_attn_with_kvcache(**call)
    assert_unchanged(call, before)


@pytest.mark.parametrize("paged", [False, True], ids=["rows", "paged"])
def test_float_tokens_into_a_float8_cache_come_in_qs_dtype(paged: bool) -> None:
    # Float k and v are quantized with the descale factors before they are written: in q's
    # dtype, or already in the cache's float8 format; anything else is refused, nothing written.
    call = kv_call(paged)
    for name in ("learnable_sink", "alibi_slopes", "softcap", "rotary_cos", "rotary_sin"):
        del call[name]
    call["k_cache"] = call["k_cache"].to(torch.float8_e4m3fn)
    call["v_cache"] = call["v_cache"].to(torch.float8_e4m3fn)
    call["k"], call["v"] = call["k"].float(), call["v"].float()
    before = snapshot(call)
    message = "k and v must have k_cache's float8 dtype or q's (float64), got k float32"
    with pytest.raises(TypeError, match=re.escape(message)):
        fa.flash_attn_with_kvcache(**call)
    assert_unchanged(call, before)
    call["k"], call["v"] = call["k"].to(torch.float8_e5m2), call["v"].to(torch.float8_e5m2)
    before = snapshot(call)
    with pytest.raises(
        TypeError, match=re.escape("k_cache's dtype (float8_e4m3fn), got k float8_e5m2")
    ):
        fa.flash_attn_with_kvcache(**call)
    assert_unchanged(call, before)
    for dtype in (torch.float64, torch.float8_e4m3fn):  # both taken
        ok = {**call, "k": call["k"].to(dtype), "v": call["v"].to(dtype)}
        assert fa.flash_attn_with_kvcache(**ok).isfinite().all()


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
    call["k"], call["v"] = call["k"].float(), call["v"].float()  # new tokens: the cache's dtype
    call["q"] = call["q"].bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fa.flash_attn_with_kvcache(**call)
    assert out.dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------------
# The cache read in place by the native kernel


def _paged(cache: Tensor, page: int, order: Tensor) -> tuple[Tensor, Tensor]:
    """A contiguous ``(B, L, Hkv, D)`` cache as pages ``(blocks, page, Hkv, D)`` in the shuffled
    ``order``, NaN in the spare ones, and its block table (entries past a row's pages name no
    page)."""
    batch, length, hkv, d = cache.shape
    per_row = -(-length // page)
    padded = torch.full((batch, per_row * page, hkv, d), float("nan"), dtype=cache.dtype)
    padded[:, :length] = cache
    pages = torch.full((order.numel(), page, hkv, d), float("nan"), dtype=cache.dtype)
    pages[order[: batch * per_row]] = padded.view(batch * per_row, page, hkv, d)
    table = order[: batch * per_row].view(batch, per_row).int()
    return pages, torch.cat([table, torch.full((batch, 3), -5, dtype=torch.int32)], 1)


@pytest.mark.skipif(not _native.load(), reason=f"native kernel: {_native.status()[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page", [1, 16, 256])
@pytest.mark.parametrize(
    "options",
    [
        {"causal": True},
        {"window_size": (40, 0), "softcap": 5.0},
        {"causal": True, "alibi_slopes": "slopes", "learnable_sink": "sinks"},
        {"cache_leftpad": "leftpad", "causal": True},
    ],
    ids=["causal", "window-softcap", "alibi-sinks", "leftpad"],
)
def test_a_paged_cache_is_read_in_place_as_the_contiguous_one(
    options: dict[str, Any], page: int, dtype: torch.dtype
) -> None:
    # Rows of 300, 17 and 0 tokens before 1 new one; the same call on a contiguous cache, on its
    # pages, and (asking gradients, which the native kernel's cache read has not) on the rows
    # gathered by attention(): one answer, and record_dispatch names the read in place (bfloat16
    # and float16 caches too, read as they are).
    g = torch.Generator().manual_seed(page)
    batch, hkv, heads, d, length = 3, 2, 8, 16, 320
    k_cache = torch.randn(batch, length, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(batch, length, hkv, d, generator=g).to(dtype)
    q = torch.randn(batch, 1, heads, d, generator=g).to(dtype)
    new_k, new_v = (
        torch.randn(batch, 1, hkv, d, generator=g).to(dtype),
        torch.randn(batch, 1, hkv, d, generator=g).to(dtype),
    )
    seen = torch.tensor([300, 17, 0], dtype=torch.int32)
    kw = dict(options)
    if kw.get("alibi_slopes") == "slopes":
        kw["alibi_slopes"] = torch.rand(heads, generator=g)
    if kw.get("learnable_sink") == "sinks":
        kw["learnable_sink"] = torch.randn(heads, generator=g)
    if kw.get("cache_leftpad") == "leftpad":
        kw["cache_leftpad"] = torch.tensor([250, 3, 0], dtype=torch.int32)
    order = torch.randperm(batch * -(-length // page) + 2, generator=g)
    k_pages, table = _paged(k_cache, page, order)
    v_pages, _ = _paged(v_cache, page, order)

    def run(kc: Tensor, vc: Tensor, **extra: Any) -> tuple[Tensor, Tensor, list[Any]]:
        with attnkit.record_dispatch() as calls:
            out, lse = fa.flash_attn_with_kvcache(
                q, kc, vc, new_k, new_v, cache_seqlens=seen, return_softmax_lse=True, **kw, **extra
            )
        return out.detach(), lse.detach(), calls

    contiguous = run(k_cache.clone(), v_cache.clone())
    paged = run(k_pages, v_pages, block_table=table)
    q.requires_grad_()
    gathered = run(k_cache.clone(), v_cache.clone())
    for got in (contiguous, paged):
        assert [(c.chosen, c.kernel) for c in got[2]] == [("chunked", IN_PLACE)]
        assert got[0].dtype == dtype
        assert got[1].dtype == gathered[1].dtype
        assert_close(got[0], gathered[0], dtype=dtype)
        assert_close(got[1], gathered[1], dtype=dtype)
    assert [c.kernel for c in gathered[2]] != [IN_PLACE]
    # The new tokens were written into the pages too.
    rows = torch.arange(batch)
    at = table.long()[rows, seen.long() // page], seen.long() % page
    assert torch.equal(k_pages[at], new_k[:, 0])


@pytest.mark.skipif(not _native.load(), reason=f"native kernel: {_native.status()[1]}")
def test_cache_batch_idx_selects_rows_in_place() -> None:
    g = torch.Generator().manual_seed(9)
    k_cache, v_cache = torch.randn(5, 64, 2, 8, generator=g), torch.randn(5, 64, 2, 8, generator=g)
    q = torch.randn(2, 1, 4, 8, generator=g)
    idx = torch.tensor([4, 1], dtype=torch.int32)
    seen = torch.tensor([60, 7], dtype=torch.int32)
    with attnkit.record_dispatch() as calls:
        out = fa.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seen, cache_batch_idx=idx, causal=True
        )
    assert [(c.chosen, c.kernel) for c in calls] == [("chunked", IN_PLACE)]
    for b, (row, n) in enumerate(zip(idx.tolist(), seen.tolist(), strict=True)):
        want, _ = reference(
            q[b : b + 1], k_cache[row : row + 1, :n], v_cache[row : row + 1, :n], causal=True
        )
        assert_close(out[b : b + 1], want, dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# The meta device


def _on_meta(call: dict[str, Any], keep: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        n: t.to("meta") if isinstance(t, Tensor) and n not in keep else t for n, t in call.items()
    }


@pytest.mark.parametrize("paged", [False, True], ids=["rows", "paged"])
def test_a_meta_call_gives_the_shapes_of_the_same_call_on_the_cpu(paged: bool) -> None:
    """q, the caches, the new tokens, rotary tables, slopes and sinks (and the block table) on
    the meta device, cache_seqlens on the CPU: the call runs, its outputs shaped as the CPU's.
    The block table's page numbers only say where the keys lie, which changes no shape: on meta
    with the pages, it is taken unread."""
    call = {**kv_call(paged), "return_softmax_lse": True}
    out, lse = fa.flash_attn_with_kvcache(**call)
    m_out, m_lse = fa.flash_attn_with_kvcache(**_on_meta(call, keep=("cache_seqlens",)))
    for real, meta in ((out, m_out), (lse, m_lse)):
        assert meta.is_meta
        assert (meta.shape, meta.dtype) == (real.shape, real.dtype)


META_ROWS = [
    ("cache_seqlens", "say how many keys each row holds and where the new ones are written"),
    ("cache_leftpad", "say where each row's keys start"),
    ("cache_batch_idx", "say which cache row each batch row reads and writes"),
]


@pytest.mark.parametrize("everything", [False, True], ids=["real-cache", "meta-cache"])
@pytest.mark.parametrize(("name", "decides"), META_ROWS)
def test_a_meta_tensor_of_row_numbers_is_refused_by_name(
    name: str, decides: str, everything: bool
) -> None:
    """cache_seqlens, cache_leftpad and cache_batch_idx say how much each row holds and where:
    the call's mask, its checks and where it writes. On the meta device they hold no values, so
    the call is refused naming the argument (not torch's "Cannot copy out of meta tensor"),
    before anything is written; the caller passes them on the CPU."""
    call = kv_call(False)
    given = {
        "cache_seqlens": call["cache_seqlens"],
        "cache_leftpad": torch.tensor([1, 0]),
        "cache_batch_idx": torch.tensor([1, 0]),
    }[name]
    call = {**(_on_meta(call, keep=("cache_seqlens",)) if everything else call)}
    call[name] = given.to("meta")
    before = snapshot({n: t for n, t in call.items() if n != name})
    message = (
        f"{name} is on the meta device, which holds no values to read, and its values {decides}: "
        "pass it on the CPU (the call's other tensors may stay on the meta device)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        fa.flash_attn_with_kvcache(**call)
    if not everything:
        assert_unchanged(call, before)


def test_a_meta_block_table_over_real_pages_is_refused_before_writing() -> None:
    call = kv_call(True)
    call["block_table"] = call["block_table"].to("meta")
    before = snapshot({n: t for n, t in call.items() if n != "block_table"})
    message = (
        "block_table is on the meta device, which holds no values to read, but k_cache "
        "(7, 4, 2, 8) is on cpu: the table's page numbers say where each row's keys lie in it"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        fa.flash_attn_with_kvcache(**call)
    assert_unchanged(call, before)


def test_a_kvcache_call_is_recorded_with_the_cache_it_reads() -> None:
    """flash_attn_with_kvcache is one attention() call on the cache's view: record_dispatch()
    records it with the rows' keys where they lie, and explain() of that call says the same."""
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(2, 16, 2, 8, generator=g), torch.randn(2, 16, 2, 8, generator=g)
    q = torch.randn(2, 1, 4, 8, generator=g)
    with torch.no_grad(), attnkit.record_dispatch() as calls:
        fa.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=torch.tensor([5, 9], dtype=torch.int32), causal=True
        )
    (call,) = calls
    assert call.chosen == "chunked"
    assert call.call.cache is not None
    assert "2 rows of keys 0..5, 0..9 of a contiguous cache" in call.call.describe()
    said = str(attnkit.explain(q.transpose(1, 2), call.call.cache, causal=True))
    assert "auto picks: chunked" in said


def test_an_int8_cache_is_refused_by_name_before_writing() -> None:
    # flash-attn's quantized caches are float8 with descale factors; an int8 one was refused
    # later, as "q, k and v must share a dtype", which names neither the cache nor its way in
    call = kv_call(paged=False)
    call["k_cache"] = call["k_cache"].to(torch.int8)
    call["v_cache"] = call["v_cache"].to(torch.int8)
    before = snapshot(call)
    message = "k_cache and v_cache must be float, or float8 with k_descale/v_descale"
    with pytest.raises(TypeError, match=re.escape(message) + ".*got int8 and int8.*kv_dtype="):
        fa.flash_attn_with_kvcache(**call)
    assert_unchanged(call, before)


@pytest.mark.parametrize("paged", [False, True], ids=["cache_batch_idx", "shared_pages"])
def test_rows_sharing_float8_pages_read_them_with_their_own_descale_factors(paged: bool) -> None:
    # Two batch rows read the same float8 keys (one cache row through cache_batch_idx, or the
    # same pages: a shared prefix) with factors of their own, as flash-attn 3 takes them per
    # batch row: each row's output and log-sum-exp are the reference's over its own dequantized
    # keys (row 0 was read with row 1's factors), softcap and sinks included.
    g = torch.Generator().manual_seed(51)
    hkv, d, length = 2, 8, 6
    k_cache = torch.randn(1, length, hkv, d, generator=g).to(torch.float8_e4m3fn)
    v_cache = torch.randn(1, length, hkv, d, generator=g).to(torch.float8_e4m3fn)
    q = torch.randn(2, 1, 4, d, generator=g)
    sinks = torch.randn(4, generator=g)
    kd, vd = torch.tensor([[0.5, 1.0], [3.0, 2.0]]), torch.tensor([[1.5, 0.25], [2.0, 4.0]])
    call: dict[str, Any] = {"cache_seqlens": torch.tensor([length, length]), "softcap": 2.0,
                            "learnable_sink": sinks, "k_descale": kd, "v_descale": vd,
                            "return_softmax_lse": True}  # fmt: skip
    if paged:
        pages = (k_cache.view(3, 2, hkv, d), v_cache.view(3, 2, hkv, d))
        call["block_table"] = torch.tensor([[0, 1, 2], [0, 1, 2]], dtype=torch.int32)
    else:
        pages = (k_cache, v_cache)
        call["cache_batch_idx"] = torch.tensor([0, 0], dtype=torch.int32)
    out, lse = fa.flash_attn_with_kvcache(q, *pages, **call)
    for b in range(2):
        keys = (k_cache[0].double() * kd[b].double()[:, None]).transpose(0, 1)[None]
        values = (v_cache[0].double() * vd[b].double()[:, None]).transpose(0, 1)[None]
        want, want_lse = attnkit.attention(
            q[b : b + 1].transpose(1, 2).double(), keys, values, softcap=2.0,
            sinks=sinks.double(), return_lse=True, backend="reference",
        )  # fmt: skip
        assert_close(out[b : b + 1].transpose(1, 2), want)
        assert_close(lse[b : b + 1], want_lse)


@pytest.mark.skipif(not _native.load(), reason="the native cache read")
@pytest.mark.parametrize("batch", [1, 2])
def test_alibi_with_rows_that_start_after_0(batch: int) -> None:
    # cache_leftpad the same in every row: the rows share a stretch of keys from 4 on, and the
    # native read refused the ALiBi table built for it ('the call (Tq=2, Tk=10) has distances
    # -9 to 1') where the reference served it.
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(batch, 12, 2, 8, generator=g) for _ in range(2))
    q = torch.randn(batch, 2, 4, 8, generator=g)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    got = fa.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=torch.full((batch,), 10, dtype=torch.int32),
        cache_leftpad=torch.full((batch,), 4, dtype=torch.int32),
        causal=True,
        alibi_slopes=slopes,
    )
    want, _ = reference(q, k_cache[:, 4:10], v_cache[:, 4:10], causal=True, slopes=slopes)
    assert_close(got, want.float())
