"""Quantized keys and values (int8, float8) against what their peers promise and what attnkit
promises, each number checked against the float64 formula over the dequantized values.

* flash-attn 3's float8 KV-cache call (``hopper/flash_attn_interface.py`` and its tests,
  ``test_flash_attn_kvcache``, ``attention_ref``): ``q``, ``k_cache``, ``v_cache`` and the new
  ``k``, ``v`` in one float8 dtype, ``q_descale``, ``k_descale``, ``v_descale`` of shape
  ``(batch, nheads_k)`` float32, the keys used ``k.float() * k_descale[b, h]`` (the queries
  likewise, each factor shared by the query heads of a key/value head), new tokens appended at
  ``cache_seqlens``, rotated first (the float8 key rotated and stored in float8 again), with
  ``block_table``, ``cache_batch_idx``, ``cache_leftpad``, causal, windows and softcap; output
  bfloat16 for float8 inputs.
* vLLM's float8 KV cache (``kv_cache_dtype="fp8"``/``"fp8_e5m2"``, ``reshape_and_cache_flash``):
  a cache entry is ``x / scale`` converted to the format saturating at its largest finite number
  (448 for e4m3fn, 57344 for e5m2) rather than overflowing to inf or NaN, the scale per tensor
  (1.0 unless calibrated) or per head; attention reads ``entry * scale``.
* attnkit's own promises (``attention(..., k_scale=, v_scale=)``, ``KVCache``/``PagedKVCache``
  with ``kv_dtype``): every broadcastable scale shape, every backend, every mask kind and
  modifier, degenerate sizes, refusals that name the argument, the formula followed for zero,
  negative, NaN and inf scales, int8's ``-128``, gradients, torch.compile and torch.export, and
  caches whose refused writes change nothing.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import attnkit
import attnkit.flash_attn as fa
from attnkit import KVCache, PagedKVCache, attention, masks
from attnkit._base.quantized import check_kv_scales
from attnkit.caches._quantize import quantize_fp8, quantize_int8
from attnkit.testing import assert_close

from ..helpers import flash_attn_formula

F8 = (torch.float8_e4m3fn, torch.float8_e5m2)
ALL = (torch.int8, *F8)
BACKENDS = ("auto", "chunked", "reference", "sdpa", "flex")


def _quantized(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``x (..., Tk, D)`` as ``dtype`` with a float32 scale per row (its largest magnitude at the
    format's largest number): the test's own quantizer, independent of attnkit's."""
    top = 127.0 if dtype == torch.int8 else torch.finfo(dtype).max
    scale = (x.abs().amax(-1, keepdim=True) / top).clamp_min(1e-30).float()
    y = x / scale
    return (y.round().clamp(-127, 127) if dtype == torch.int8 else y).to(dtype), scale


def _formula(
    q: Tensor, k: Tensor, v: Tensor, k_scale: Tensor | float, v_scale: Tensor | float, **kw: Any
) -> Any:
    """The float64 reference over the keys and values ``k.float() * k_scale`` stands for."""
    keys = k.double() * (k_scale.double() if isinstance(k_scale, Tensor) else k_scale)
    values = v.double() * (v_scale.double() if isinstance(v_scale, Tensor) else v_scale)
    kw = {n: t.double() if isinstance(t, Tensor) and t.is_floating_point() else t
          for n, t in kw.items()}  # fmt: skip
    return attention(q.double(), keys, values, backend="reference", **kw)


def _call(dtype: torch.dtype, tq: int = 3, tk: int = 12, seed: int = 0) -> tuple[Tensor, ...]:
    """``q (2, 4, tq, 16)`` and quantized ``k``, ``v`` ``(2, 2, tk, 16)`` with their scales."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, tq, 16, generator=g)
    kq, ks = _quantized(torch.randn(2, 2, tk, 16, generator=g) * 3, dtype)
    vq, vs = _quantized(torch.randn(2, 2, tk, 16, generator=g), dtype)
    return q, kq, vq, ks, vs


# --------------------------------------------------------------------------------------------------
# flash-attn 3: the float8 KV-cache call


def _fa_rotate(x: Tensor, cos: Tensor, sin: Tensor, at: Tensor) -> Tensor:
    """flash-attn's interleaved rotary of ``x (T, H, D)`` at positions ``at (T,)``, float64."""
    half = cos.size(1)
    c, s = cos[at].double()[:, None], sin[at].double()[:, None]
    x = x.double()
    a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
    turned = torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)
    return torch.cat((turned, x[..., 2 * half :]), -1)


def _to_fp8(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` converted to ``dtype`` saturating at its largest finite number."""
    top = torch.finfo(dtype).max
    return x.float().clamp(-top, top).to(dtype)


def _fa3_grid() -> list[tuple[Any, ...]]:
    axes = itertools.product(
        F8,
        [None, 4],  # page size (None: a cache of rows)
        [False, True],  # cache_batch_idx
        [False, True],  # cache_leftpad
        ["none", "fp8", "float"],  # new tokens: none, in the cache's float8, in q's float dtype
        ["fp8", "float"],  # q
        [False, True],  # causal
        [(-1, -1), (3, 1)],  # window
        [0.0, 2.5],  # softcap
        [False, True],  # rotary
    )
    keep = []
    for n, c in enumerate(axes):
        _, page, batch_idx, _, new, _, _, _, _, rotary = c
        # (float new tokens come in q's float dtype: a float8 q takes float8 ones, as in
        # flash-attn 3, where q, the cache and the new tokens share one dtype)
        if (
            (page is not None and batch_idx)
            or (rotary and new == "none")
            or c[4:6] == ("float", "fp8")
        ):
            continue
        if n % 53 == 0 or (rotary and new == "fp8" and n % 13 == 0):
            keep.append(c)
    return keep


@pytest.mark.parametrize(
    ("dtype", "page", "batch_idx", "leftpad", "new", "q_kind", "causal", "window", "softcap",
     "rotary"),
    _fa3_grid(),
)  # fmt: skip
def test_flash_attn_3_float8_kvcache(
    dtype: torch.dtype,
    page: int | None,
    batch_idx: bool,
    leftpad: bool,
    new: str,
    q_kind: str,
    causal: bool,
    window: tuple[int, int],
    softcap: float,
    rotary: bool,
) -> None:
    """flash-attn 3's test of the KV-cache call in float8, GQA: each row's output and
    log-sum-exp are flash-attn's ``attention_ref`` over its descaled keys ``cache_leftpad[b]
    <= j < cache_seqlens[b] + new``, the new ones written at ``cache_seqlens[b]`` (float8 ones
    as they are, rotated ones rotated and stored in float8 again, float ones quantized with
    ``k_descale``), nothing else written."""
    g = torch.Generator().manual_seed(11 + len(new) + int(causal))
    batch, tq, h, hkv, d, cap, n_new = 3, 2, 4, 2, 16, 24, 0 if new == "none" else 2
    rows = 5 if batch_idx else batch
    full_k = _to_fp8(torch.randn(rows, cap, hkv, d, generator=g) * 4, dtype)
    full_v = _to_fp8(torch.randn(rows, cap, hkv, d, generator=g) * 4, dtype)
    q = torch.randn(batch, tq, h, d, generator=g)
    k_new = torch.randn(batch, n_new, hkv, d, generator=g) * 3
    v_new = torch.randn(batch, n_new, hkv, d, generator=g) * 3
    if new == "fp8":
        k_new, v_new = _to_fp8(k_new, dtype), _to_fp8(v_new, dtype)
    if q_kind == "fp8":
        q = _to_fp8(q, dtype)
    qd, kd, vd = (torch.rand(batch, hkv, generator=g) * 2 + 0.05 for _ in range(3))
    angles = torch.rand(cap, 4, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    seen, pad = [5, 0, 13], [2, 0, 4] if leftpad else [0, 0, 0]
    which = [3, 0, 4] if batch_idx else [0, 1, 2]
    k_cache, v_cache, table = full_k.clone(), full_v.clone(), None
    if page is not None:
        per = cap // page
        table = torch.randperm(batch * per + 2, generator=g)[: batch * per].view(batch, per)
        k_cache = _to_fp8(torch.randn(batch * per + 2, page, hkv, d, generator=g), dtype)
        v_cache = _to_fp8(torch.randn(batch * per + 2, page, hkv, d, generator=g), dtype)
        for b, t in itertools.product(range(batch), range(cap)):
            k_cache[table[b, t // page], t % page] = full_k[b, t]
            v_cache[table[b, t // page], t % page] = full_v[b, t]
    before = k_cache.view(torch.uint8).clone()
    out, lse = fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, None if new == "none" else k_new, None if new == "none" else v_new,
        cos if rotary else None, sin if rotary else None,
        torch.tensor(seen, dtype=torch.int32),
        torch.tensor(which, dtype=torch.int32) if batch_idx else None,
        torch.tensor(pad, dtype=torch.int32) if leftpad else None,
        None if table is None else table.int(), None, causal, window, softcap,
        return_softmax_lse=True, q_descale=qd if q_kind == "fp8" else None, k_descale=kd,
        v_descale=vd,
    )  # fmt: skip
    assert out.dtype == (torch.bfloat16 if q_kind == "fp8" else torch.float32)
    written = set()
    for b in range(batch):
        n, row = seen[b], which[b]
        q_b = q[b].double()
        if q_kind == "fp8":
            q_b = q_b * qd[b].double().repeat_interleave(h // hkv)[:, None]
        keys_new = k_new[b].double()
        if rotary:
            keys_new = _fa_rotate(keys_new, cos, sin, torch.arange(n_new) + n)
            positional = causal or window != (-1, -1)
            steps = torch.arange(tq) if positional else torch.zeros(tq, dtype=torch.long)
            q_b = _fa_rotate(q_b, cos, sin, steps + n)
        # what the cache stores of the new tokens: float8, as given or rotated, or quantized
        stored_k = keys_new if new == "fp8" and not rotary else None
        if stored_k is None:
            divide = kd[b].double()[:, None] if new == "float" else 1.0
            stored_k = _to_fp8(keys_new / divide, dtype).double()
        stored_v = v_new[b].double()
        if new == "float":
            stored_v = _to_fp8(stored_v / vd[b].double()[:, None], dtype).double()
        keys = torch.cat([full_k[row, pad[b] : n].double(), stored_k]) * kd[b].double()[:, None]
        values = torch.cat([full_v[row, pad[b] : n].double(), stored_v])
        values = values * vd[b].double()[:, None]
        want, want_lse = flash_attn_formula(q_b, keys, values, causal, window, softcap)
        assert_close(out[b], want.to(out.dtype).double() if q_kind == "fp8" else want,
                     dtype=out.dtype, conditioning=4.0)  # fmt: skip
        finite = want_lse.isfinite()
        assert torch.equal(lse[b].isfinite(), finite)
        assert_close(lse[b][finite], want_lse[finite], dtype=out.dtype, conditioning=4.0)
        for t in range(n, n + n_new):
            at = (row, t) if table is None else (int(table[b, t // page]), t % page)
            # one step of the format at most apart (the rotation in float32 against float64)
            torch.testing.assert_close(k_cache[at].double(), stored_k[t - n], rtol=2**-2, atol=1e-6)
            written.add(at)
    changed = (k_cache.view(torch.uint8) != before).any(-1).any(-1).nonzero().tolist()
    assert {tuple(x) for x in changed} <= written


def test_flash_attn_3_rotates_float8_keys_as_it_stores_them() -> None:
    # flash-attn 3's own KV-cache test passes q, the new k and v and the rotary tables in
    # float8; rotating the float8 keys raised "Promotion for Float8 Types is not supported".
    g = torch.Generator().manual_seed(5)
    dtype = torch.float8_e4m3fn
    k_cache = _to_fp8(torch.randn(1, 8, 1, 8, generator=g), dtype)
    v_cache = _to_fp8(torch.randn(1, 8, 1, 8, generator=g), dtype)
    k = _to_fp8(torch.randn(1, 1, 1, 8, generator=g) * 300, dtype)  # near the format's edge
    v = _to_fp8(torch.randn(1, 1, 1, 8, generator=g), dtype)
    angles = torch.rand(8, 4, generator=g) * 6
    cos, sin = _to_fp8(angles.cos(), dtype), _to_fp8(angles.sin(), dtype)
    q = _to_fp8(torch.randn(1, 1, 2, 8, generator=g), dtype)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=3,
                                     causal=True)  # fmt: skip
    assert out.dtype == torch.bfloat16
    turned = _fa_rotate(k[0].double(), cos.float(), sin.float(), torch.tensor([3]))
    # stored in float8 again, saturating (a rotation may lift a pair's element past 448)
    torch.testing.assert_close(k_cache[0, 3].double(), _to_fp8(turned[0], dtype).double(),
                               rtol=2**-3, atol=0.0)  # fmt: skip
    assert k_cache[0, 3].float().isfinite().all()


# --------------------------------------------------------------------------------------------------
# vLLM: float8 entries are x / scale saturating at the format's largest number


@pytest.mark.parametrize("dtype", F8)
@pytest.mark.parametrize("per", ["tensor", "head"])
def test_vllm_float8_entries_are_x_over_scale_saturating(dtype: torch.dtype, per: str) -> None:
    g = torch.Generator().manual_seed(2)
    top = torch.finfo(dtype).max
    x = torch.randn(2, 3, 5, 8, generator=g) * 4
    x[0, 1, 2, :3] = torch.tensor([1e9, -1e9, top * 1.01])  # past the range: saturate
    scale = torch.tensor(0.5) if per == "tensor" else torch.rand(3, 1, 1, generator=g) + 0.1
    xq, used = quantize_fp8(x, dtype, scale=scale)
    want = torch.clamp(x / scale, -top, top).to(dtype)  # vLLM's scaled_convert, SATFINITE
    assert torch.equal(xq.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(xq[0, 1, 2, :3].float(), torch.tensor([top, -top, top]))
    assert xq.float().isfinite().all()
    torch.testing.assert_close(used, scale.float().expand_as(used))


@pytest.mark.parametrize("dtype", F8)
def test_vllm_reshape_and_cache_saturates_and_reads_entry_times_scale(dtype: torch.dtype) -> None:
    """vLLM's ``reshape_and_cache_flash`` into a fresh pool, whose pages hold vLLM's default
    scale 1.0: entries are ``x`` in the format, saturating at its largest number (not inf or
    NaN), in vLLM's page layout ``(num_blocks, Hkv, page_size, D)``."""
    top = torch.finfo(dtype).max
    cache = PagedKVCache(4, 2, 2, 4, max_seqs=1, layout="vllm", kv_dtype=dtype)
    k = torch.tensor([[[1e6, -1e6, 3.0, 0.5], [2.0, 1.0, -4.0, 0.0]]])  # (N=1, Hkv=2, D=4)
    cache.write(k, k * 2, torch.tensor([3]))  # page 1, offset 1
    want = torch.clamp(k[0], -top, top).to(dtype)
    assert torch.equal(cache.k_pages[1, :, 1].view(torch.uint8), want.view(torch.uint8))
    assert cache.k_scales is not None
    assert bool((cache.k_scales == 1).all())
    assert cache.k_pages.float().isfinite().all()
    assert cache.v_pages.float().isfinite().all()


def test_a_freed_float8_page_takes_vllms_default_scale_again() -> None:
    # A page freed by a sequence kept that sequence's scale: reshape_and_cache into it then
    # quantized with it (a scale of 2e-5 from a prompt of 0.01s), so a key of 3.0 read 0.01.
    cache = PagedKVCache(4, 2, 1, 4, max_seqs=1, kv_dtype=torch.float8_e4m3fn)
    small = torch.full((1, 1, 2, 4), 0.01)
    cache.stage(small, small)
    cache.commit()
    assert cache.k_scales is not None
    assert cache.k_scales[0].item() < 1e-4
    cache.free(0)
    x = torch.tensor([[[3.0, -2.0, 1.0, 0.5]]])
    cache.write(x, x, torch.tensor([0]))
    kp, vp = cache.token_major()
    assert cache.v_scales is not None
    assert torch.equal(kp[0, 0, 0].float() * cache.k_scales[0].flatten(), x[0, 0])
    assert torch.equal(vp[0, 0, 0].float() * cache.v_scales[0].flatten(), x[0, 0])


# --------------------------------------------------------------------------------------------------
# attention(..., k_scale=, v_scale=): shapes, dtypes, refusals


def _on(backend: str, q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> Tensor:
    """``attention()`` on ``backend``; flex through FlexAttention's eager form (asked for the
    log-sum-exp), which takes the same lowering without a compilation per shape."""
    if backend != "flex":
        return attention(q, k, v, backend=backend, **kw)  # type: ignore[no-any-return]
    return attention(q, k, v, backend=backend, return_lse=True, **kw)[0]  # type: ignore[misc]


def _scales(ks: Tensor) -> dict[str, Tensor]:
    """Every broadcastable form of a scale for keys ``(2, 2, Tk, D)``."""
    return {
        "scalar": ks.mean().reshape(()),
        "(Hkv,1,1)": ks.mean((0, 2))[..., None],
        "(B,Hkv,Tk,1)": ks,
        "(1,1,Tk,1)": ks.mean((0, 1), keepdim=True),
        "(B,1,1,1)": ks.mean((1, 2, 3), keepdim=True),
        "(Tk,1)": ks[0, 0],
        "float64": ks.double(),
        "bfloat16": ks.bfloat16(),
        "expanded": ks.mean().expand(2, 2, ks.size(2), 1),
        "strided": torch.cat([ks, ks], 2)[:, :, ::2].transpose(0, 1).contiguous().transpose(0, 1),
    }


@pytest.mark.parametrize(
    ("dtype", "backend", "tq"),
    [
        c
        for c in itertools.product(ALL, BACKENDS, [1, 5])
        if c[0] == torch.int8 or (c[1] in ("auto", "sdpa") and c[2] == 5) or c[1:] == ("auto", 1)
    ],
)
def test_every_scale_shape_on_every_backend(dtype: torch.dtype, backend: str, tq: int) -> None:
    q, kq, vq, ks, vs = _call(dtype, tq)
    for name, scale in _scales(ks).items():
        out = _on(backend, q, kq, vq, k_scale=scale, v_scale=vs, causal=True)
        want = _formula(q, kq, vq, scale, vs, causal=True)
        assert out.dtype == q.dtype, name
        assert_close(out, want)


@pytest.mark.parametrize(
    ("k_scale", "exc", "message"),
    [
        (0.5, TypeError, "k_scale must be a float tensor, got float"),
        ([0.5], TypeError, "k_scale must be a float tensor, got list"),
        (torch.tensor(2), TypeError, "k_scale must be float16, bfloat16, float32 or float64, "
         "got int64"),
        (torch.ones(2, 2, 12), ValueError, r"k_scale must be broadcastable to \(\*batch, Hkv, "
         r"Tk, 1\) = \(2, 2, 12, 1\) .*got \(2, 2, 12\)"),
        (torch.ones(3, 1, 1), ValueError, r"k_scale must be broadcastable .* got \(3, 1, 1\)"),
        (torch.ones(1, 2, 2, 12, 1), ValueError, r"k_scale must be broadcastable"),
        (torch.ones((), device="meta"), ValueError, r"k_scale must be on q's device \(cpu\), "
         "got meta"),
        (None, TypeError, r"k of int8 needs k_scale= \(a float tensor broadcastable to "
         r"\(2, 2, 12, 1\)\)"),
    ],
    ids=["float", "list", "int", "no 1", "heads", "more dims", "device", "missing"],
)  # fmt: skip
def test_a_wrong_scale_is_refused_by_name(k_scale: Any, exc: type, message: str) -> None:
    q, kq, vq, _, vs = _call(torch.int8)
    # (a Python number or list is refused by the type annotation first where the test suite
    # checks them; the check itself names the argument)
    call = check_kv_scales if isinstance(k_scale, float | list) else _attention
    with pytest.raises(exc, match=message):
        call(q, kq, vq, k_scale, vs)
    with pytest.raises(exc, match=message.replace("k_scale", "v_scale").replace("k of", "v of")):
        call(q, kq, vq, vs, k_scale)


def _attention(q: Tensor, k: Tensor, v: Tensor, k_scale: Any, v_scale: Any) -> Tensor:
    return attention(q, k, v, k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("v_dtype", [torch.float8_e4m3fn, torch.float32])
def test_mixed_keys_and_values_are_refused_naming_both(v_dtype: torch.dtype) -> None:
    q, kq, vq, ks, vs = _call(torch.int8)
    v = (vq.float() * vs).to(v_dtype)
    want = f"quantized k and v must share a dtype, got k int8 and v {str(v_dtype)[6:]}"
    with pytest.raises(TypeError, match=want):
        attention(q, kq, v, k_scale=ks, v_scale=torch.ones(()))
    with pytest.raises(TypeError, match=f"got k {str(v_dtype)[6:]} and v int8"):
        attention(q, v, kq, k_scale=torch.ones(()), v_scale=ks)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [0.0, -0.02, math.nan, math.inf])
def test_zero_negative_and_non_finite_scales_follow_the_formula(backend: str, value: float) -> None:
    """A scale is a number like any other: ``k.float() * k_scale``, whatever its sign, and NaN
    or inf where a query sees the keys they scale (the non-finite policy), on every backend."""
    q, kq, vq, ks, vs = _call(torch.int8, tq=5)
    bad = ks.clone()
    bad[0, 1] = value  # every key of row 0, head 1
    out = _on(backend, q, kq, vq, k_scale=bad, v_scale=vs, causal=True)
    want = _formula(q, kq, vq, bad, vs, causal=True)
    assert torch.equal(out.isnan(), want.isnan())
    assert_close(out.nan_to_num(0.0), want.nan_to_num(0.0))
    if not math.isfinite(value):  # the heads that read them: NaN; the others untouched
        assert out[0, 2:].isnan().all()
        assert not out[1].isnan().any()


def test_compiled_flex_gives_nan_where_every_visible_key_is_nan() -> None:
    # torch's compiled FlexAttention gives such a query 0, as a query with no visible key: an
    # output row of zeros is trusted only once q, k and v are read to be finite.
    q, kq, vq, ks, vs = _call(torch.int8, tq=5)
    bad = ks.clone()
    bad[0, 1] = math.nan  # every key of row 0, head 1: its query heads 2 and 3 read only NaN
    out = attention(q, kq, vq, k_scale=bad, v_scale=vs, causal=True, backend="flex")
    assert out[0, 2:].isnan().all()


@pytest.mark.parametrize("which", ["k", "v"])
def test_the_native_decode_reads_an_inf_scale_as_the_formula_does(which: str) -> None:
    q, kq, vq, ks, vs = _call(torch.int8, tq=1)
    ks, vs = ks.clone(), vs.clone()
    (ks if which == "k" else vs)[0, 1, 2] = math.inf  # key 2 of row 0, heads 2 and 3 read it
    # The native read scales each product, (q . k) s, where the formula scales each element,
    # q . (k s): a call with an inf (or NaN) scale is dequantized first.
    with torch.inference_mode(), attnkit.record_dispatch() as calls:
        out = attention(q, kq, vq, k_scale=ks, v_scale=vs)
    assert "dequantized first: a scale is NaN or inf" in str(calls[-1].kernel)
    want = _formula(q, kq, vq, ks, vs)
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.isinf(), want.isinf())


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_minus_128_reads_as_minus_128(backend: str) -> None:
    """int8's range is -128..127; attnkit writes -127..127 (symmetric) and reads a -128 handed to
    it as -128 times its scale, on every backend, the native decode path included."""
    for tq in (1, 5):  # (1: the native decode path)
        q, kq, vq, ks, vs = _call(torch.int8, tq=tq)
        kq, vq = kq.clone(), vq.clone()
        kq[:, :, ::3] = -128
        vq[1, 0, 5] = -128
        out = _on(backend, q, kq, vq, k_scale=ks, v_scale=vs, causal=True)
        assert_close(out, _formula(q, kq, vq, ks, vs, causal=True))
    xq, _scale = quantize_int8(torch.tensor([[[[-1.0, 0.999, 1.0, -0.5]]]]))
    assert xq.tolist() == [[[[-127, 127, 127, -64]]]]
    assert int(quantize_int8(torch.randn(3, 4, 50, 8) * 100)[0].min()) >= -127


# --------------------------------------------------------------------------------------------------
# Every mask kind and modifier, degenerate sizes


def _mask_kinds(tq: int, tk: int) -> dict[str, dict[str, Any]]:
    g = torch.Generator().manual_seed(4)
    rows = torch.zeros(2, 1, tq, tk, dtype=torch.bool)
    rows[:, :, ::2] = True  # the odd queries see no key
    return {
        "none": {},
        "causal": {"causal": True},
        "top_left": {"mask": masks.causal("top_left")},
        "window": {"mask": masks.sliding_window(3, 1)},
        "padding&causal": {"mask": masks.key_padding(torch.tensor([tk, 4])) & masks.causal()},
        "documents": {"mask": masks.documents(torch.tensor([tk // 2, tk - tk // 2]))},
        "from_fn": {"mask": masks.from_fn(lambda b, h, i, j: (i + j) % 3 != 0)},
        "dense": {"mask": torch.rand(2, 1, tq, tk, generator=g) > 0.4},
        "empty rows": {"mask": rows},
        "key_indices": {
            "mask": masks.key_indices(torch.randint(-1, tk, (2, 2, tq, 3), generator=g))
        },
        "block_indices": {
            "mask": masks.block_indices(torch.randint(-1, 3, (2, 1, tq, 2), generator=g), block=4)
        },
        "bias": {"bias": torch.randn(2, 4, tq, tk, generator=g)},
        "softcap": {"softcap": 2.0, "causal": True},
        "sinks": {"sinks": torch.randn(4, generator=g), "causal": True},
        "scale": {"scale": 0.3, "mask": masks.sliding_window(2)},
    }


@pytest.mark.parametrize(
    ("dtype", "tq"), [(torch.int8, 1), (torch.int8, 5), (torch.int8, 16), *((d, 5) for d in F8)]
)
def test_every_mask_kind_and_modifier_with_the_log_sum_exp(dtype: torch.dtype, tq: int) -> None:
    """Fewer queries than keys (the native decode path at 1), more queries than keys, and fully
    masked rows: output and log-sum-exp (``-inf`` for a row with no visible key) are the
    formula's, on auto and chunked."""
    q, kq, vq, ks, vs = _call(dtype, tq=tq, tk=12)
    for name, kw in _mask_kinds(tq, kq.size(2)).items():
        want, want_lse = _formula(q, kq, vq, ks, vs, return_lse=True, **kw)
        for backend in ("auto", "chunked"):
            out, lse = attention(q, kq, vq, k_scale=ks, v_scale=vs, return_lse=True,
                                 backend=backend, **kw)  # fmt: skip
            assert_close(out, want)
            assert torch.equal(lse.isinf(), want_lse.isinf()), (name, backend)
            assert_close(lse.nan_to_num(neginf=0.0), want_lse.nan_to_num(neginf=0.0))


@pytest.mark.parametrize("backend", BACKENDS[:4])
def test_degenerate_sizes(backend: str) -> None:
    """No keys: every output 0 (and log-sum-exp -inf); no batch rows, no queries: empty."""
    q, kq, vq, ks, vs = _call(torch.int8, tq=3)
    out = attention(q, kq[:, :, :0], vq[:, :, :0], k_scale=ks[:, :, :0], v_scale=vs[:, :, :0],
                    backend=backend)  # fmt: skip
    assert out.shape == (2, 4, 3, 16)
    assert not out.any()
    for sizes in ((q[:0], kq[:0], vq[:0], ks[:0], vs[:0]), (q[:, :, :0], kq, vq, ks, vs)):
        a, k, v, s, t = sizes
        assert attention(a, k, v, k_scale=s, v_scale=t, backend=backend).numel() == 0
    if backend != "sdpa":
        _, lse = attention(q, kq[:, :, :0], vq[:, :, :0], k_scale=ks[:, :, :0],
                           v_scale=vs[:, :, :0], return_lse=True, backend=backend)  # fmt: skip
        assert torch.equal(lse, torch.full_like(lse, -math.inf))


# --------------------------------------------------------------------------------------------------
# Gradients, the choice of backend, torch.compile and torch.export


@pytest.mark.parametrize("backend", BACKENDS[:4])
@pytest.mark.parametrize("tq", [1, 5])
def test_gradients_of_q_and_the_scales(backend: str, tq: int) -> None:
    q, kq, vq, ks, vs = _call(torch.float8_e5m2, tq=tq)
    leaves = [t.double().requires_grad_() for t in (q, ks.mean((0, 2))[..., None], vs)]
    cap = None if backend == "sdpa" else 3.0  # (torch's SDPA takes no softcap)
    out = attention(leaves[0], kq, vq, k_scale=leaves[1], v_scale=leaves[2], causal=True,
                    softcap=cap, backend=backend)  # fmt: skip
    grads = torch.autograd.grad(out.square().sum(), leaves)
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    want = _formula(ref_leaves[0], kq, vq, ref_leaves[1], ref_leaves[2], causal=True, softcap=cap)
    want_grads = torch.autograd.grad(want.square().sum(), ref_leaves)
    assert_close(out, want)
    for got, exp in zip(grads, want_grads, strict=True):
        assert_close(got, exp)


def test_auto_takes_the_kernel_for_a_quantized_prefill_or_training_call() -> None:
    # Every path but the native decode dequantizes first, a cost each of them listed: auto then
    # took the first registered backend, sdpa, which writes out a (Tq, Tk) mask for a
    # bottom-right causal call and trains slowly on a CPU, where the kernel took the same call
    # on float keys.
    q, kq, vq, ks, vs = _call(torch.int8, tq=20, tk=30)  # (more queries than a decode reads)
    for grad in (False, True):
        a = q.clone().requires_grad_(grad)
        said = attnkit.explain(a, kq, vq, k_scale=ks, v_scale=vs, causal=True)
        assert said.chosen == "chunked", str(said)
        # (every backend would dequantize: the chosen one is not the only one that can serve it)
        assert "chunked    chosen (the least costly choice, although it would dequantize" in str(
            said
        )
        with attnkit.record_dispatch() as calls:
            out = attention(a, kq, vq, k_scale=ks, v_scale=vs, causal=True)
        assert calls[-1].chosen == "chunked"
        assert_close(out, _formula(q, kq, vq, ks, vs, causal=True))
    with torch.inference_mode(), attnkit.record_dispatch() as calls:  # a decode: read in place
        attention(q[:, :, :1], kq, vq, k_scale=ks, v_scale=vs, causal=True)
    assert calls[-1].kernel == "native kernel (int8 k and v read in place)"


def test_compiled_in_one_graph_with_tensor_scales() -> None:
    """torch.compile(fullgraph=True, dynamic=True) of a call on int8 keys and values with tensor
    scales, q needing gradients: one graph, the formula's output and gradient, and another
    number of keys and queries in the same graph."""
    q, kq, vq, ks, vs = _call(torch.int8, tq=3)

    def step(q: Tensor, kq: Tensor, vq: Tensor, ks: Tensor, vs: Tensor) -> Tensor:
        return attention(q, kq, vq, k_scale=ks, v_scale=vs, causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="eager")
    leaf = q.clone().requires_grad_()
    out = compiled(leaf, kq, vq, ks, vs)
    (grad,) = torch.autograd.grad(out.sum(), leaf)
    ref_leaf = q.double().requires_grad_()
    want = _formula(ref_leaf, kq, vq, ks, vs, causal=True)
    (want_grad,) = torch.autograd.grad(want.sum(), ref_leaf)
    assert_close(out, want)
    assert_close(grad, want_grad)
    with torch.no_grad():  # another length of the cache
        q2, kq2, vq2, ks2, vs2 = _call(torch.int8, tq=1, tk=20, seed=1)
        assert_close(compiled(q2, kq2, vq2, ks2, vs2), _formula(q2, kq2, vq2, ks2, vs2,
                                                                 causal=True))  # fmt: skip


def test_exported_with_a_dynamic_number_of_keys() -> None:
    class Step(torch.nn.Module):
        def forward(self, q: Tensor, kq: Tensor, vq: Tensor, ks: Tensor, vs: Tensor) -> Tensor:
            return attention(q, kq, vq, k_scale=ks, v_scale=vs, causal=True)

    q, kq, vq, ks, vs = _call(torch.int8, tq=1)
    tk = torch.export.Dim("tk", min=2, max=4096)
    shapes = {"q": None, "kq": {2: tk}, "vq": {2: tk}, "ks": {2: tk}, "vs": {2: tk}}
    program = torch.export.export(Step(), (q, kq, vq, ks, vs), dynamic_shapes=shapes)
    for seed, n in ((0, 12), (2, 30)):
        q, kq, vq, ks, vs = _call(torch.int8, tq=1, tk=n, seed=seed)
        assert_close(program.module()(q, kq, vq, ks, vs), _formula(q, kq, vq, ks, vs, causal=True))


# --------------------------------------------------------------------------------------------------
# Caches: writes that quantize, refused writes, keep(), conversions, and a fuzz of paged pools


def _bits(t: Tensor | None) -> Tensor | None:
    """``t``'s bytes (a float8 tensor compares NaN with NaN this way)."""
    return None if t is None else t.detach().clone().view(torch.uint8)


def _state(*tensors: Tensor | None) -> list[Tensor | None]:
    return [_bits(t) for t in tensors]


def _same(a: list[Tensor | None], b: list[Tensor | None]) -> bool:
    return all(x is y or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b, strict=True))  # fmt: skip


@pytest.mark.parametrize("dtype", ALL)
def test_refused_writes_change_nothing_scales_included(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(8)
    cache = KVCache(2, 6, 2, 4, kv_dtype=dtype)
    held = (cache.k_cache, cache.v_cache, cache.k_scale, cache.v_scale)
    before = _state(*held)
    for k, v, exc in [
        (torch.randn(2, 2, 7, 4, generator=g) * 50, torch.randn(2, 2, 7, 4), ValueError),
        (torch.randn(2, 2, 2, 4).double(), torch.randn(2, 2, 2, 4).double(), TypeError),
        (torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 5), ValueError),
    ]:  # a first write, which would set a float8 cache's scales, refused
        with pytest.raises(exc):
            cache.update(k, v)
        assert _same(_state(*held), before)
        assert cache.length == 0
    paged = PagedKVCache(3, 2, 2, 4, max_seqs=2, kv_dtype=dtype, layout="vllm")
    paged.stage(torch.randn(2, 2, 2, 4, generator=g), torch.randn(2, 2, 2, 4, generator=g))
    paged.commit()
    pool = (paged.k_pages, paged.v_pages, paged.k_scales, paged.v_scales, paged.block_table)
    before = _state(*pool)
    with pytest.raises(ValueError, match="out of pages"):
        paged.stage(torch.randn(2, 2, 3, 4, generator=g), torch.randn(2, 2, 3, 4, generator=g))
    with pytest.raises(ValueError, match="names a slot twice"):
        paged.write(torch.randn(2, 2, 4), torch.randn(2, 2, 4), torch.tensor([5, 5]))
    with pytest.raises(ValueError, match=r"keep|indices|position"):
        paged.keep(0, torch.tensor([[0, 2], [1, 0]]))  # position 2 is past the 2 held
    assert _same(_state(*pool), before)
    assert paged.lengths == [2, 2]


def test_a_refused_float8_kvcache_call_writes_nothing() -> None:
    g = torch.Generator().manual_seed(9)
    k_cache = _to_fp8(torch.randn(2, 8, 2, 8, generator=g), torch.float8_e4m3fn)
    v_cache = _to_fp8(torch.randn(2, 8, 2, 8, generator=g), torch.float8_e4m3fn)
    before = _state(k_cache, v_cache)
    q, k, v = torch.randn(2, 1, 4, 8), torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
    for kw, message in [
        ({"k_descale": torch.ones(2)}, r"k_descale must be \(batch, nheads_k\) = \(2, 2\)"),
        ({"v_descale": torch.ones(2, 2, dtype=torch.int32)}, "v_descale must be a float tensor"),
        ({"cache_seqlens": 8}, "do not fit the cache's 8 positions"),
    ]:
        call = {"cache_seqlens": torch.tensor([3, 5], dtype=torch.int32), **kw}
        with pytest.raises((TypeError, ValueError), match=message):
            fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **call)
        assert _same(_state(k_cache, v_cache), before)


@pytest.mark.parametrize("dtype", ALL)
def test_keep_moves_each_token_with_its_scale(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 2, 7, 4, generator=g) * torch.logspace(-2, 2, 7)[:, None]
    cache = KVCache(2, 8, 2, 4, kv_dtype=dtype)
    cache.update(x, x * 2)
    keys, values = cache.view().dense(torch.float64)
    index = torch.stack([torch.randperm(7, generator=g)[:4] for _ in range(4)]).view(2, 2, 4)
    cache.keep(index)
    kept = index.sort(-1).values[..., None].expand(-1, -1, -1, 4)
    got_k, got_v = cache.view().dense(torch.float64)
    assert torch.equal(got_k, keys.gather(2, kept))
    assert torch.equal(got_v, values.gather(2, kept))
    paged = PagedKVCache(8, 3, 2, 4, max_seqs=2, kv_dtype=dtype)
    paged.stage(x, x * 2)
    paged.commit()
    q = torch.randn(2, 4, 1, 4, generator=g)
    for b in range(2):
        paged.keep(b, index[b])
    new = torch.zeros(2, 2, 1, 4)
    out = attention(q, paged.stage_call(q, new, new), backend="reference")
    want_k = torch.cat([keys.gather(2, kept), new.double()], 2)
    want_v = torch.cat([values.gather(2, kept), new.double()], 2)
    assert_close(out, attention(q.double(), want_k, want_v, backend="reference"))


@pytest.mark.parametrize("dtype", ALL)
def test_conversions_keep_the_stored_bytes_and_scales(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(12)
    x = torch.randn(1, 2, 5, 4, generator=g)
    cache = KVCache(1, 8, 2, 4, kv_dtype=dtype).to(dtype=torch.float64)
    cache.update(x.double(), x.double())
    before = _state(cache.k_cache, cache.k_scale)
    cache.to(dtype=torch.bfloat16).to(dtype=torch.float32)
    assert _same(_state(cache.k_cache, cache.k_scale), before)
    assert cache.k_cache.dtype == dtype
    assert cache.dtype == torch.float32
    with pytest.raises(TypeError, match="pass kv_dtype="):
        cache.to(dtype=dtype)
    paged = PagedKVCache(4, 2, 2, 4, max_seqs=1, kv_dtype=dtype)
    paged.stage(x, x)
    paged.commit()
    model = torch.nn.ModuleDict({"cache": paged, "proj": torch.nn.Linear(4, 4)})
    pool = _state(paged.k_pages, paged.v_pages, paged.k_scales, paged.v_scales)
    model.double()
    assert paged.dtype == torch.float64
    assert paged.k_pages.dtype == dtype
    assert paged.k_scales is not None
    assert paged.k_scales.dtype == torch.float32
    state = model.state_dict()  # the weights, never the cache's pages
    assert sorted(state) == ["proj.bias", "proj.weight"]
    model.load_state_dict(state)
    assert _same(_state(paged.k_pages, paged.v_pages, paged.k_scales, paged.v_scales), pool)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(ALL),
    page=st.integers(1, 5),
    layout=st.sampled_from(["flash", "vllm"]),
    prompts=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    magnitude=st.floats(1e-3, 1e3),
    steps=st.integers(1, 3),
)
def test_fuzz_paged_pools_against_their_own_pages(
    dtype: torch.dtype, page: int, layout: str, prompts: list[int], magnitude: float, steps: int
) -> None:
    """A pool of any page size, layout and format, prompts of any length (0 included), keys of
    any magnitude: every decode step's output is the formula over the entries and scales its
    pages hold, and each entry is within the format's step of the key written."""
    g = torch.Generator().manual_seed(len(prompts) * 7 + page)
    rows, hkv, d = len(prompts), 2, 8
    cache = PagedKVCache(40, page, hkv, d, max_seqs=rows, layout=layout, kv_dtype=dtype,  # type: ignore[arg-type]
                         dtype=torch.float64)  # fmt: skip
    written: list[list[Tensor]] = [[] for _ in range(rows)]
    if max(prompts):
        cache.schedule(prompts)
        x = torch.randn(rows, hkv, max(prompts), d, generator=g, dtype=torch.float64) * magnitude
        cache.stage(x, x)
        cache.commit()
        for b, n in enumerate(prompts):
            written[b] += list(x[b, :, :n].unbind(1))
    for _ in range(steps):
        q = torch.randn(rows, 4, 1, d, generator=g, dtype=torch.float64)
        x = torch.randn(rows, hkv, 1, d, generator=g, dtype=torch.float64) * magnitude
        out = attention(q, cache.stage_call(q, x, x), causal=True)
        cache.commit()
        kp, _ = cache.token_major()
        assert cache.k_scales is not None
        for b in range(rows):
            written[b].append(x[b, :, 0])
            n = cache.lengths[b]
            slots = [(p, t) for p in cache.pages_of(b) for t in range(page)][:n]
            entries = torch.stack([kp[p, t] for p, t in slots]).double()  # (n, Hkv, D)
            scales = torch.stack([cache.k_scales[p, :, t if dtype == torch.int8 else 0]
                                  for p, t in slots]).double()  # fmt: skip
            keys = (entries * scales).transpose(0, 1)[None]  # (1, Hkv, n, D)
            want = attention(q[b : b + 1], keys, keys, backend="reference")
            assert_close(out[b : b + 1], want, dtype=torch.float32)
            exact = torch.stack(written[b], 1)[None]
            step = scales.transpose(0, 1)[None] * (0.5 if dtype == torch.int8 else 0.0)
            rel = 2.0**-4 if dtype == torch.float8_e4m3fn else 2.0**-3
            tol = step + rel * exact.abs() + (scales.max() * 2.0**-9 if dtype in F8 else 0.0)
            top = torch.finfo(dtype).max if dtype in F8 else math.inf
            inside = (exact.abs() <= top * scales.transpose(0, 1)[None]).all(-1, keepdim=True)
            assert bool(((keys - exact).abs() <= tol * 1.001)[inside.expand_as(keys)].all())


_FORMS = {  # a scale's shape for keys (*batch, Hkv, Tk, D), each broadcastable to its target
    "(*B, Hkv, Tk, 1)": lambda b, h, t: (*b, h, t, 1),
    "(*B, Hkv, 1, 1)": lambda b, h, t: (*b, h, 1, 1),
    "(*B, 1, Tk, 1)": lambda b, h, t: (*b, 1, t, 1),
    "(Hkv, Tk, 1)": lambda b, h, t: (h, t, 1),
    "(Hkv, 1, 1)": lambda b, h, t: (h, 1, 1),
    "(Tk, 1)": lambda b, h, t: (t, 1),
    "()": lambda b, h, t: (),
}


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(ALL),
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    hkv=st.integers(1, 3),
    group=st.integers(1, 3),
    tq=st.integers(1, 6),
    tk=st.integers(0, 9),
    forms=st.tuples(st.sampled_from(sorted(_FORMS)), st.sampled_from(sorted(_FORMS))),
    backend=st.sampled_from(["auto", "chunked", "reference"]),
    causal=st.booleans(),
    magnitude=st.floats(1e-4, 1e3),
)
def test_fuzz_scales_of_every_broadcast_shape(
    dtype: torch.dtype,
    batch: list[int],
    hkv: int,
    group: int,
    tq: int,
    tk: int,
    forms: tuple[str, str],
    backend: str,
    causal: bool,
    magnitude: float,
) -> None:
    """Any batch dims (none, one, two), GQA, any number of keys (0 included), scales of any
    shape broadcastable to ``(*batch, Hkv, Tk, 1)`` and of any magnitude: the formula over the
    dequantized values."""
    g = torch.Generator().manual_seed(tq * 10 + tk)
    q = torch.randn(*batch, hkv * group, tq, 8, generator=g)
    kq, _ = _quantized(torch.randn(*batch, hkv, tk, 8, generator=g), dtype)
    vq, _ = _quantized(torch.randn(*batch, hkv, tk, 8, generator=g), dtype)
    k_scale = torch.rand(_FORMS[forms[0]](batch, hkv, tk), generator=g) * magnitude
    v_scale = torch.rand(_FORMS[forms[1]](batch, hkv, tk), generator=g) + 0.5
    out = attention(q, kq, vq, k_scale=k_scale, v_scale=v_scale, causal=causal, backend=backend)
    want = _formula(q, kq, vq, k_scale, v_scale, causal=causal)
    assert out.shape == want.shape
    assert_close(out, want, conditioning=max(1.0, magnitude / 16))
