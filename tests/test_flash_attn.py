"""attnkit.flash_attn against flash-attn's documented semantics, restated here in float64.

The reference below is written from flash-attn's docstrings, not from attnkit: per batch row and
head, scores ``q k^T * scale``, softcap, ALiBi ``-slope * |i + Tk - Tq - j|``, the band
``i + Tk - Tq - left <= j <= i + Tk - Tq + right`` (``causal``: ``right = 0``), a softmax whose
empty rows give 0, and the natural-log LSE. Packed sequences are checked one sequence at a time,
the KV cache one row at a time on the keys it holds after the append.
"""

from __future__ import annotations

import math
import random
import sys
from typing import Any

import pytest
import torch
from torch import Tensor

from attnkit import attention, masks
from attnkit import flash_attn as fa
from attnkit.testing import assert_close

# --------------------------------------------------------------------------------------------------
# flash-attn's semantics, written out


def reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] = (-1, -1),
    softcap: float = 0.0,
    slopes: Tensor | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out (B, Tq, H, Dv), lse (B, H, Tq))`` for ``(B, T, H, D)`` inputs, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    batch, tq, heads, d = q.shape
    tk, hkv = k.size(1), k.size(2)
    k = k.repeat_interleave(heads // hkv, dim=2)
    v = v.repeat_interleave(heads // hkv, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, k) * (d**-0.5 if scale is None else scale)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(tq)[:, None] + tk - tq  # each query's key position
    j = torch.arange(tk)[None, :]
    left, right = (None if w is None or w == -1 else w for w in window)
    if causal:
        right = 0
    visible = torch.ones(tq, tk, dtype=torch.bool)
    if left is not None:
        visible &= j >= i - left
    if right is not None:
        visible &= j <= i + right
    if slopes is not None:
        per_row = slopes.double().reshape(-1, heads)[:, :, None, None]  # (B|1, H, 1, 1)
        s = s - per_row * (i - j).abs()
    s = s.masked_fill(~visible, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double()[None, :, None, None].expand(batch, -1, tq, 1)], -1)
    lse = torch.logsumexp(s, -1)  # (B, H, Tq); -inf for an empty row
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("bhts,bshd->bthd", p, v), lse


def rotate(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """flash-attn's rotary embedding of ``x`` ``(T, H, D)`` at ``positions`` ``(T,)``: the first
    ``rotary_dim`` dims rotated as pairs ``(2i, 2i+1)`` (interleaved) or ``(i, i + rd/2)``."""
    rd = 2 * cos.size(-1)
    c, s = cos[positions].double(), sin[positions].double()  # (T, rd/2)
    if interleaved:
        c = c.repeat_interleave(2, -1)[:, None]
        s = s.repeat_interleave(2, -1)[:, None]
        x1, x2 = x[..., :rd:2], x[..., 1:rd:2]
        half = torch.stack((-x2, x1), -1).flatten(-2)
    else:
        c, s = torch.cat([c, c], -1)[:, None], torch.cat([s, s], -1)[:, None]
        x1, x2 = x[..., : rd // 2], x[..., rd // 2 : rd]
        half = torch.cat((-x2, x1), -1)
    return torch.cat([x[..., :rd] * c + half * s, x[..., rd:]], -1)


# --------------------------------------------------------------------------------------------------
# The grid


def _grid(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` cases drawn over flash-attn's test axes (seqlens with Tq != Tk up to ~300, head dims
    32..256, MHA/GQA/MQA, causal x window x softcap x alibi)."""
    rng = random.Random(seed)
    lens = [(1, 1), (1, 147), (113, 203), (128, 217), (113, 211), (108, 256), (256, 128), (3, 7)]
    lens += [(7, 3), (33, 33), (300, 300), (17, 64), (64, 17)]
    windows: list[tuple[int | None, int | None]] = [(-1, -1), (5, 3), (0, 0), (20, -1)]
    windows += [(-1, 7), (None, -11), (4, -2), (-3, 9), (-5, None)]
    cases = []
    for _ in range(n):
        tq, tk = rng.choice(lens)
        heads, hkv = rng.choice([(4, 4), (6, 2), (4, 1)])
        d = rng.choice([32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256])
        cases.append(
            dict(
                tq=tq,
                tk=tk,
                heads=heads,
                hkv=hkv,
                d=d,
                dv=rng.choice([d, d, 24]),
                batch=rng.choice([1, 2]),
                causal=rng.random() < 0.5,
                window=rng.choice(windows),
                softcap=rng.choice([0.0, 0.0, 2.0]),
                alibi=rng.random() < 0.4,
                batch_slopes=rng.random() < 0.5,
            )
        )
    return cases


def _skip_empty_band(case: dict[str, Any]) -> bool:
    left, right = case["window"]
    right = 0 if case["causal"] else right
    lo = -math.inf if left in (None, -1) else -left
    hi = math.inf if right in (None, -1) else right
    return lo > hi


def _inputs(case: dict[str, Any], dtype: torch.dtype, seed: int) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    b, tq, tk = case["batch"], case["tq"], case["tk"]
    q = torch.randn(b, tq, case["heads"], case["d"], generator=g, dtype=torch.float64)
    k = torch.randn(b, tk, case["hkv"], case["d"], generator=g, dtype=torch.float64)
    v = torch.randn(b, tk, case["hkv"], case["dv"], generator=g, dtype=torch.float64)
    slopes = None
    if case["alibi"]:
        shape = (b, case["heads"]) if case["batch_slopes"] else (case["heads"],)
        slopes = torch.rand(shape, generator=g, dtype=torch.float64) * 0.3
    return q.to(dtype), k.to(dtype), v.to(dtype), slopes


def _grads(out: Tensor, inputs: tuple[Tensor, ...], weight: Tensor) -> tuple[Tensor, ...]:
    return torch.autograd.grad((out.double() * weight).sum(), inputs)


CASES = _grid(14, seed=24)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "{tq}x{tk}-h{heads}/{hkv}-d{d}".format(**c))
def test_flash_attn_func_matches_flash_attn_semantics(
    case: dict[str, Any], dtype: torch.dtype
) -> None:
    if _skip_empty_band(case):
        with pytest.raises(ValueError, match="holds no key"):
            fa.flash_attn_func(*_inputs(case, dtype, 0)[:3], causal=case["causal"],
                               window_size=case["window"])  # fmt: skip
        return
    q, k, v, slopes = _inputs(case, dtype, seed=CASES.index(case))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kwargs = dict(causal=case["causal"], window_size=case["window"], softcap=case["softcap"])
    out = fa.flash_attn_func(q, k, v, alibi_slopes=slopes, **kwargs)
    want, _ = reference(q, k, v, causal=case["causal"], window=case["window"],
                        softcap=case["softcap"], slopes=slopes)  # fmt: skip
    assert out.shape == want.shape
    assert out.is_contiguous()
    assert_close(out, want, dtype=dtype)
    weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=want.dtype)
    got = _grads(out, (q, k, v), weight)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want, _ = reference(qd, kd, vd, causal=case["causal"], window=case["window"],
                        softcap=case["softcap"], slopes=slopes)  # fmt: skip
    for g, w in zip(got, _grads(want, (qd, kd, vd), weight), strict=True):
        assert_close(g, w, dtype=dtype)


def test_packed_variants_are_views_of_the_same_call() -> None:
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 9, 3, 4, 16, generator=g, dtype=torch.float64)
    q, k, v = qkv.unbind(2)
    want, _ = reference(q, k, v, causal=True, window=(3, 0))
    assert_close(fa.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(3, 0)), want)
    kv = torch.stack([k, v], 2)
    assert_close(fa.flash_attn_kvpacked_func(q, kv, 0.0, None, True, (3, 0)), want)


def test_positional_arguments_follow_flash_attn_order() -> None:
    """dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes by position."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    out = fa.flash_attn_func(q, k, v, 0.0, 0.3, True, (2, -1), 1.5, slopes)
    want, _ = reference(q, k, v, scale=0.3, causal=True, window=(2, -1), softcap=1.5, slopes=slopes)
    assert_close(out, want)


@pytest.mark.parametrize("window", [(-5, -1), (-5, None), (None, -6), (-1, 3), (2, -1)])
@pytest.mark.parametrize(("tq", "tk"), [(3, 3), (4, 9), (9, 4)])
def test_one_sided_windows(window: tuple[int | None, int | None], tq: int, tk: int) -> None:
    """Windows bounded on one side only, negative bounds included, at lengths shorter than the
    bound: rows without a key give 0, never an error."""
    g = torch.Generator().manual_seed(tq * 10 + tk)
    q = torch.randn(1, tq, 2, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, tk, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    want, _ = reference(q, k, v, window=window)
    assert_close(fa.flash_attn_func(q, k, v, window_size=window), want)


def test_sinks_join_the_softmax() -> None:
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 5, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    want, want_lse = reference(q, k, v, causal=True, sinks=sinks)
    out, lse, _ = fa.flash_attn_func(
        q, k, v, causal=True, return_attn_probs=True, learnable_sink=sinks
    )
    assert_close(out, want)
    assert_close(lse, want_lse)  # the sinks' share is in the LSE
    assert_close(fa.flash_attn_func(q, k, v, causal=True, s_aux=sinks), want)
    with pytest.raises(TypeError, match="learnable_sink or s_aux, not both"):
        fa.flash_attn_func(q, k, v, learnable_sink=sinks, s_aux=sinks)


def test_the_layout_goes_in_as_a_view(monkeypatch: pytest.MonkeyPatch) -> None:
    """No copy on the way in: attention() sees (B, H, T, D) views of the caller's tensors."""
    seen = []
    real = fa.attention

    def spy(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:
        seen.append((q, k, v))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(fa, "attention", spy)
    q, k, v = (torch.randn(2, 7, 4, 8) for _ in range(3))
    fa.flash_attn_func(q, k, v, causal=True)
    (aq, ak, av), = seen  # fmt: skip
    for ours, theirs in ((aq, q), (ak, k), (av, v)):
        assert ours.data_ptr() == theirs.data_ptr()
        assert ours.shape == (2, 4, 7, 8)


# --------------------------------------------------------------------------------------------------
# Packed sequences


def _cu(lengths: list[int]) -> Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)


VARLEN = [  # (query lengths, key lengths or None for the same), causal, window
    ([5, 1, 0, 9, 3], None, True, (-1, -1)),
    ([5, 1, 0, 9, 3], None, False, (2, 1)),
    ([4, 2, 7], [9, 2, 12], True, (-1, -1)),
    ([4, 2, 7], [9, 2, 12], False, (3, -1)),
    ([1, 1, 1], [6, 3, 8], True, (2, 0)),
    ([6, 3], [2, 5], True, (None, -2)),
    ([30, 17, 1], [41, 17, 60], False, (-1, -1)),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("lq", "lk", "is_causal", "window"), VARLEN)
@pytest.mark.parametrize("alibi", [False, True])
def test_varlen_matches_each_sequence(
    lq: list[int],
    lk: list[int] | None,
    is_causal: bool,
    window: tuple[int | None, int | None],
    alibi: bool,
    dtype: torch.dtype,
) -> None:
    lk = lq if lk is None else lk
    g = torch.Generator().manual_seed(sum(lq) + sum(lk))
    heads, hkv, d = 4, 2, 16
    q = torch.randn(sum(lq), heads, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64).to(dtype)
    slopes = torch.rand(len(lq), heads, generator=g, dtype=torch.float64) if alibi else None
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out, lse, _ = fa.flash_attn_varlen_func(
        q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=is_causal, window_size=window,
        alibi_slopes=slopes, return_attn_probs=True,
    )  # fmt: skip
    assert out.shape == (sum(lq), heads, d)
    assert lse.shape == (heads, sum(lq))
    weight = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = _grads(out, (q, k, v), weight)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs, lses = [], []
    for s, (a, b, c, e) in enumerate(zip(_cu(lq), _cu(lq)[1:], _cu(lk), _cu(lk)[1:], strict=False)):
        o, l_ = reference(
            qd[a:b][None], kd[c:e][None], vd[c:e][None], causal=is_causal, window=window,
            slopes=None if slopes is None else slopes[s],
        )  # fmt: skip
        outs.append(o[0])
        lses.append(l_[0])
    want, want_lse = torch.cat(outs), torch.cat(lses, -1)
    assert_close(out, want, dtype=dtype)
    assert torch.equal(lse.isinf(), want_lse.isinf())
    finite = want_lse.isfinite()
    assert_close(lse[finite], want_lse[finite], dtype=dtype)
    for g_, w in zip(got, _grads(want, (qd, kd, vd), weight), strict=True):
        assert_close(g_, w, dtype=dtype)


def test_random_cu_seqlens_and_paged_keys() -> None:
    """Random sequence lengths; the same call with its keys in a paged cache."""
    rng = random.Random(3)
    lq = [rng.randint(0, 40) for _ in range(6)]
    lk = [n + rng.randint(0, 30) for n in lq]
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lq), 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lk), 1, 8, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lk), 1, 8, generator=g, dtype=torch.float64)
    out = fa.flash_attn_varlen_func(q, k, v, _cu(lq), _cu(lk), 40, 70, causal=True)
    parts = []
    for a, b, c, e in zip(_cu(lq), _cu(lq)[1:], _cu(lk), _cu(lk)[1:], strict=False):
        parts.append(reference(q[a:b][None], k[c:e][None], v[c:e][None], causal=True)[0][0])
    assert_close(out, torch.cat(parts))
    page, per_seq = 8, -(-max(lk) // 8)
    order = torch.randperm(len(lk) * per_seq, generator=g)
    table = order.view(len(lk), per_seq).to(torch.int32)
    kp = torch.zeros(len(order), page, 1, 8, dtype=torch.float64)
    vp = torch.zeros_like(kp)
    for s, (c, e) in enumerate(zip(_cu(lk), _cu(lk)[1:], strict=False)):
        for t in range(int(e - c)):
            kp[table[s, t // page], t % page] = k[c + t]
            vp[table[s, t // page], t % page] = v[c + t]
    paged = fa.flash_attn_varlen_func(
        q, kp, vp, _cu(lq), _cu(lk), 40, 70, causal=True, block_table=table
    )
    assert_close(paged, out)


def test_varlen_qkvpacked_and_kvpacked() -> None:
    g = torch.Generator().manual_seed(8)
    lengths = [3, 6, 2]
    qkv = torch.randn(11, 3, 2, 8, generator=g, dtype=torch.float64)
    q, k, v = qkv.unbind(1)
    want = fa.flash_attn_varlen_func(q, k, v, _cu(lengths), _cu(lengths), 6, 6, causal=True)
    assert_close(fa.flash_attn_varlen_qkvpacked_func(qkv, _cu(lengths), 6, causal=True), want)
    kv = torch.stack([k, v], 1)
    got = fa.flash_attn_varlen_kvpacked_func(q, kv, _cu(lengths), _cu(lengths), 6, 6, causal=True)
    assert_close(got, want)


def test_varlen_mask_is_documents_when_lengths_agree() -> None:
    m = fa.varlen_mask(torch.tensor([0, 3, 5]), causal=True)
    assert repr(m) == "documents(lengths=[3, 2]) & causal()"
    assert fa.varlen_mask([0, 4]) is None


# --------------------------------------------------------------------------------------------------
# The KV cache


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


# --------------------------------------------------------------------------------------------------
# LSE, dropout, errors, install()


def test_lse_and_probs_follow_flash_attn() -> None:
    g = torch.Generator().manual_seed(13)
    q = torch.randn(2, 4, 2, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 4, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, window_size=(3, -2), return_attn_probs=True)
    want, want_lse = reference(q, k, v, window=(3, -2))
    assert_close(out, want)
    assert torch.equal(lse.isinf(), want_lse.isinf())
    assert bool((lse == -math.inf).any())
    assert_close(lse[lse.isfinite()], want_lse[want_lse.isfinite()])
    assert s_dmask.numel() == 0  # flash-attn's: nothing without dropout
    torch.manual_seed(0)
    _, _, probs = fa.flash_attn_func(q, k, v, 0.5, return_attn_probs=True)
    _, plain_lse = reference(q, k, v)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(8)
    assert_close(probs, torch.exp(scores - plain_lse[..., None]))


def test_dropout_by_seed() -> None:
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=g) for _ in range(3))
    torch.manual_seed(1)
    a = fa.flash_attn_func(q, k, v, 0.3, causal=True)
    torch.manual_seed(1)
    b = fa.flash_attn_func(q, k, v, 0.3, causal=True)
    torch.manual_seed(2)
    c = fa.flash_attn_func(q, k, v, 0.3, causal=True)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    torch.manual_seed(1)
    same = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                     dropout_p=0.3)  # fmt: skip
    assert torch.equal(a, same.transpose(1, 2))
    # With one key a query's weight is 1: dropout keeps it (scaled by 1 / (1 - p)) or drops it.
    q = torch.randn(1, 1000, 4, 8, generator=g)
    k, v = torch.randn(1, 1, 4, 8, generator=g), torch.randn(1, 1, 4, 8, generator=g)
    for probs in (False, True):  # the fused path, and the one that also returns the weights
        out = fa.flash_attn_func(q, k, v, 0.3, return_attn_probs=probs)
        out = out[0] if isinstance(out, tuple) else out
        dropped = (out == 0).all(-1, keepdim=True)
        assert_close(out, torch.where(dropped, 0.0, v / 0.7).expand(out.shape))
        assert 0.26 < float(dropped.double().mean()) < 0.34


def test_deterministic_is_accepted() -> None:
    q = torch.randn(1, 3, 2, 8)
    assert torch.equal(fa.flash_attn_func(q, q, q, deterministic=True), fa.flash_attn_func(q, q, q))


ERRORS = [
    (lambda q: fa.flash_attn_func(q[0], q, q), ValueError,
     "q must be (batch, seqlen_q, nheads, headdim), got shape (3, 2, 8)"),
    (lambda q: fa.flash_attn_func(q, q, q, window_size=3), TypeError,
     "window_size must be a pair (left, right), got 3"),
    (lambda q: fa.flash_attn_func(q, q, q, window_size=(2.5, 0)), TypeError,
     "window_size left bound must be an int or None (-1 or None: no bound), got 2.5"),
    (lambda q: fa.flash_attn_func(q, q, q, window_size=(-4, 2)), ValueError,
     "window_size=(-4, 2) holds no key: the band runs from 4 to 2 keys from the diagonal"),
    (lambda q: fa.flash_attn_func(q, q, q, softcap=-1.0), ValueError,
     "softcap must be a finite number > 0, or 0.0 for none, got -1.0"),
    (lambda q: fa.flash_attn_func(q, q, q, alibi_slopes=torch.ones(3)), ValueError,
     "alibi_slopes must be (nheads,) = (2,) or (batch, nheads) = (1, 2), got (3)"),
    (lambda q: fa.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 2]),
                                         torch.tensor([0, 3]), 2, 3), ValueError,
     "cu_seqlens_q must start at 0, never decrease and end at the 3 packed tokens, got [0, 2]"),
    (lambda q: fa.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 3]),
                                         torch.tensor([0, 1, 3]), 3, 3), ValueError,
     "cu_seqlens_q describes 1 sequences and cu_seqlens_k 2"),
    (lambda q: fa.flash_attn_with_kvcache(q, q, q, q), TypeError,
     "k and v come together"),
    (lambda q: fa.flash_attn_with_kvcache(q, q, q, q, q), TypeError,
     "cache_seqlens is needed with k and v"),
    (lambda q: fa.flash_attn_with_kvcache(q, q, q, q, q, cache_seqlens=1), ValueError,
     "cache_seqlens [1] + 3 new tokens do not fit the cache's 3 positions"),
]  # fmt: skip


@pytest.mark.parametrize(("fn", "exc", "message"), ERRORS)
def test_errors_name_the_argument(fn: Any, exc: type[Exception], message: str | None) -> None:
    import re

    q = torch.randn(1, 3, 2, 8)
    with pytest.raises(exc, match=None if message is None else re.escape(message)):
        fn(q)


def test_install_aliases_only_without_flash_attn(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    real_find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "flash_attn" else real_find(name, *a),
    )
    try:
        assert "now import attnkit.flash_attn" in fa.install()
        from flash_attn import flash_attn_func  # type: ignore[import-not-found]
        from flash_attn.flash_attn_interface import (  # type: ignore[import-not-found]
            flash_attn_varlen_func,
        )

        assert flash_attn_func is fa.flash_attn_func
        assert flash_attn_varlen_func is fa.flash_attn_varlen_func
        assert fa.install() == "flash_attn already stands for attnkit.flash_attn"
    finally:
        fa._uninstall()
    assert "flash_attn" not in sys.modules
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert "nothing was aliased" in fa.install()
    assert "flash_attn" not in sys.modules


def test_structured_masks_keep_memory_linear() -> None:
    """The varlen mask with different query and key lengths answers block states without a
    (Tq, Tk) tensor, and they are sound."""
    m = fa.varlen_mask([0, 3, 10, 11], [0, 8, 12, 30], causal=True, window_size=(4, 0))
    assert m is not None
    dense = m.dense(11, 30)[0, 0]
    geo = masks.Geometry((1,), 1, 11, 30, torch.device("cpu"))
    states = m.block_states(geo, (0, 11, 2), (0, 30, 2))
    for bi, qs in enumerate(range(0, 11, 2)):
        for bj, ks in enumerate(range(0, 30, 2)):
            block = dense[qs : qs + 2, ks : ks + 2]
            assert int(states[bi, bj]) != masks.EMPTY or not block.any()
            assert int(states[bi, bj]) != masks.FULL or block.all()
    assert (states == masks.EMPTY).any()
    assert (states == masks.FULL).any()


# --------------------------------------------------------------------------------------------------
# Refused calls: every argument checked, and a refused cache call changes nothing


def _kv_call(paged: bool) -> dict[str, Any]:
    """A valid flash_attn_with_kvcache call that writes 2 new tokens per row, by keyword: rotary,
    ALiBi, sinks and softcap on, two rows at different lengths, pages of 4 when ``paged``."""
    g = torch.Generator().manual_seed(21)

    def r(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    batch, heads, hkv, d, capacity, new = 2, 4, 2, 8, 12, 2
    angles = r(16, 2) * 3
    call: dict[str, Any] = dict(
        q=r(batch, 1, heads, d),
        k=r(batch, new, hkv, d),
        v=r(batch, new, hkv, 6),
        rotary_cos=angles.cos(),
        rotary_sin=angles.sin(),
        cache_seqlens=torch.tensor([3, 7], dtype=torch.int32),
        causal=True,
        softcap=5.0,
        alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64),
        learnable_sink=r(heads),
    )
    if paged:  # 3 pages a row, in a shuffled pool of 7 (page 6 belongs to no row)
        call["block_table"] = torch.tensor([[4, 0, 2], [5, 1, 3]], dtype=torch.int32)
        call["k_cache"], call["v_cache"] = r(7, 4, hkv, d), r(7, 4, hkv, 6)
    else:
        call["k_cache"], call["v_cache"] = r(batch, capacity, hkv, d), r(batch, capacity, hkv, 6)
    return call


def _snapshot(call: dict[str, Any]) -> dict[str, Tensor]:
    return {name: t.clone() for name, t in call.items() if isinstance(t, Tensor)}


def _assert_unchanged(call: dict[str, Any], before: dict[str, Tensor]) -> None:
    """Every tensor of the call holds the bits it held (NaN arguments included)."""
    for name, t in before.items():
        now = call[name]
        assert (now.dtype, now.shape) == (t.dtype, t.shape), f"{name} changed"
        same = torch.equal(now.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8))
        assert same, f"{name} changed"


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
    import re

    good = _kv_call(paged)
    # The same call without the bad argument writes into the cache: what must not happen here.
    written = {n: t.clone() if isinstance(t, Tensor) else t for n, t in good.items()}
    fa.flash_attn_with_kvcache(**written)
    assert not torch.equal(written["k_cache"], good["k_cache"])
    assert not torch.equal(written["v_cache"], good["v_cache"])
    call = {**good, **overrides}
    before = _snapshot(call)
    with pytest.raises(exc, match=re.escape(message)):
        fa.flash_attn_with_kvcache(**call)
    _assert_unchanged(call, before)


def test_the_early_checks_follow_autocast() -> None:
    """Under torch.autocast attention() casts q and the cache to one dtype; the checks made
    before the write allow what attention() then serves."""
    call = _kv_call(paged=False)
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


# Block tables: every page a call reads or writes must exist.


def _paged_varlen(table: Tensor) -> Any:
    g = torch.Generator().manual_seed(23)
    q = torch.randn(5, 2, 8, generator=g, dtype=torch.float64)
    kp, vp = (torch.randn(4, 4, 1, 8, generator=g, dtype=torch.float64) for _ in range(2))
    return fa.flash_attn_varlen_func(q, kp, vp, _cu([2, 3]), _cu([6, 3]), block_table=table)


@pytest.mark.parametrize(
    ("table", "exc", "message"),
    [
        ([[0, 2], [-1, 3]], ValueError,
         "block_table[1, 0] = -1 is not a page: the paged k (4, 4, 1, 8) holds 4 pages, numbered "
         "0 to 3 (row 1 reads its first 1 entries)"),
        ([[0, 4], [1, 3]], ValueError, "block_table[0, 1] = 4 is not a page"),
        ([[0, 2], [1, 99]], None, None),  # sequence 1's 3 keys fill one page: 99 is not read
        ([[0, 2], [1, -1]], None, None),
        ([[0.0, 2.0], [1.0, 3.0]], TypeError,
         "block_table must be an integer tensor (batch, max_blocks) of page numbers, got "
         "float32"),
        ([[True, False], [True, True]], TypeError, "got bool"),
    ],
)  # fmt: skip
def test_varlen_block_table_entries_are_pages(
    table: list[list[Any]], exc: type[Exception] | None, message: str | None
) -> None:
    import re

    t = torch.tensor(table)
    if exc is None:
        want = _paged_varlen(torch.tensor([[0, 2], [1, 3]]))
        assert_close(_paged_varlen(t), want)
        return
    with pytest.raises(exc, match=re.escape(str(message))):
        _paged_varlen(t)


def test_kvcache_reads_only_the_pages_its_rows_fill() -> None:
    """Entries past a row's last page (padding, here -1 and 99) are not read, and the pages a
    row does read are those of its own entries."""
    call = _kv_call(paged=True)
    call["cache_seqlens"] = torch.tensor([1, 7], dtype=torch.int32)  # row 0 fills 1 page of 3
    padded = {n: t.clone() if isinstance(t, Tensor) else t for n, t in call.items()}
    padded["block_table"] = torch.tensor([[4, -1, 99], [5, 1, 3]], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(**padded)
    assert_close(out, fa.flash_attn_with_kvcache(**call))
    assert torch.equal(padded["k_cache"], call["k_cache"])  # the same tokens went in, in place


# NaN and infinity in every float argument of every function


def _fa_inputs(fn: str) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(24)

    def r(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "flash_attn_func": (r(2, 5, 4, 8), r(2, 6, 2, 8), r(2, 6, 2, 8)),
        "flash_attn_qkvpacked_func": (r(2, 5, 3, 4, 8),),
        "flash_attn_kvpacked_func": (r(2, 5, 4, 8), r(2, 6, 2, 2, 8)),
        "flash_attn_varlen_func": (r(9, 4, 8), r(11, 2, 8), r(11, 2, 8), _cu([4, 5]), _cu([5, 6])),
        "flash_attn_varlen_qkvpacked_func": (r(9, 3, 4, 8), _cu([4, 5])),
        "flash_attn_varlen_kvpacked_func": (r(9, 4, 8), r(11, 2, 2, 8), _cu([4, 5]), _cu([5, 6])),
        "varlen_mask": ([0, 4, 9],),
    }[fn]


_ALL_FLOATS = ["dropout_p", "softmax_scale", "softcap", "alibi_slopes", "learnable_sink", "s_aux",
               "window_size left", "window_size right"]  # fmt: skip
FLOAT_ARGS = {
    **{fn: _ALL_FLOATS for fn in fa.__all__ if fn.startswith("flash_attn")},
    "flash_attn_with_kvcache": [a for a in _ALL_FLOATS if a != "dropout_p"],
    "varlen_mask": ["window_size left", "window_size right"],
}
assert set(FLOAT_ARGS) == set(fa.__all__) - {"install"}  # a new function gets its row here
NONFINITE = [
    (fn, arg, bad)
    for fn, args in FLOAT_ARGS.items()
    for arg in args
    for bad in ("nan", "inf", "-inf")
    if not (arg in ("learnable_sink", "s_aux") and bad == "-inf")  # -inf: no sink, allowed
]


@pytest.mark.parametrize(("fn", "arg", "bad"), NONFINITE)
def test_nan_and_inf_are_refused_by_name(fn: str, arg: str, bad: str) -> None:
    value = float(bad)
    if arg.startswith("window_size"):
        kw: dict[str, Any] = {"window_size": (value, -1) if arg.endswith("left") else (-1, value)}
        name = arg
    elif arg in ("alibi_slopes", "learnable_sink", "s_aux"):
        t = torch.full((4,), 0.5, dtype=torch.float64)
        t[1] = value
        kw, name = {arg: t}, arg
    else:
        kw, name = {arg: value}, arg
    if fn == "flash_attn_with_kvcache":
        call = _kv_call(paged=False)
        call.pop("learnable_sink")
        call.update(kw)
        before = _snapshot(call)
        with pytest.raises((ValueError, TypeError)) as info:
            fa.flash_attn_with_kvcache(**call)
        _assert_unchanged(call, before)
    else:
        with pytest.raises((ValueError, TypeError)) as info:
            getattr(fa, fn)(*_fa_inputs(fn), **kw)
    text = str(info.value)
    assert text.startswith(name), text
    assert bad.lstrip("-") in text.lower(), text  # the message quotes the value


def test_a_sink_of_minus_inf_is_no_sink() -> None:
    q, k, v = _fa_inputs("flash_attn_func")
    none = torch.full((4,), -math.inf, dtype=torch.float64)
    assert_close(fa.flash_attn_func(q, k, v, learnable_sink=none), fa.flash_attn_func(q, k, v))


def test_rotary_tables_wider_than_the_head_are_named() -> None:
    call = _kv_call(paged=False)
    call["rotary_cos"] = call["rotary_sin"] = torch.ones(16, 5, dtype=torch.float64)
    message = (
        "rotary_cos has 5 columns (rotary_dim / 2) and so rotates 10 dims, more than the headdim "
        "of 8: it may have at most 4 columns, got shape (16, 5)"
    )
    import re

    with pytest.raises(ValueError, match=re.escape(message)):
        fa.flash_attn_with_kvcache(**call)
    call["rotary_cos"] = call["rotary_sin"] = torch.ones(16, 4, dtype=torch.float64)
    fa.flash_attn_with_kvcache(**call)  # rotary_dim = headdim: the whole head turns
