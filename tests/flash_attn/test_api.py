"""flash-attn's attention functions (``attnkit.flash_attn``) against flash-attn's documented
semantics, written out in float64 in ``helpers.py``: a grid over flash-attn's test axes, the
packed variants, packed sequences one at a time, the LSE, dropout, and every float argument's
NaN and infinity refused by name."""

from __future__ import annotations

import math
import random
import re
from typing import Any

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import _native, attention
from attnkit import flash_attn as fa
from attnkit._kernel.cache import IN_PLACE
from attnkit.flash_attn import _api as fa_api
from attnkit.testing import assert_close

from .helpers import assert_unchanged, cu, fa_inputs, grads, kv_call, reference, snapshot


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
    got = grads(out, (q, k, v), weight)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want, _ = reference(qd, kd, vd, causal=case["causal"], window=case["window"],
                        softcap=case["softcap"], slopes=slopes)  # fmt: skip
    for g, w in zip(got, grads(want, (qd, kd, vd), weight), strict=True):
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
    real = fa_api.attention

    def spy(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:
        seen.append((q, k, v))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(fa_api, "attention", spy)
    q, k, v = (torch.randn(2, 7, 4, 8) for _ in range(3))
    fa.flash_attn_func(q, k, v, causal=True)
    (aq, ak, av), = seen  # fmt: skip
    for ours, theirs in ((aq, q), (ak, k), (av, v)):
        assert ours.data_ptr() == theirs.data_ptr()
        assert ours.shape == (2, 4, 7, 8)


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
        q, k, v, cu(lq), cu(lk), max(lq), max(lk), causal=is_causal, window_size=window,
        alibi_slopes=slopes, return_attn_probs=True,
    )  # fmt: skip
    assert out.shape == (sum(lq), heads, d)
    assert lse.shape == (heads, sum(lq))
    weight = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = grads(out, (q, k, v), weight)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs, lses = [], []
    for s, (a, b, c, e) in enumerate(zip(cu(lq), cu(lq)[1:], cu(lk), cu(lk)[1:], strict=False)):
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
    for g_, w in zip(got, grads(want, (qd, kd, vd), weight), strict=True):
        assert_close(g_, w, dtype=dtype)


def test_varlen_qkvpacked_and_kvpacked() -> None:
    g = torch.Generator().manual_seed(8)
    lengths = [3, 6, 2]
    qkv = torch.randn(11, 3, 2, 8, generator=g, dtype=torch.float64)
    q, k, v = qkv.unbind(1)
    want = fa.flash_attn_varlen_func(q, k, v, cu(lengths), cu(lengths), 6, 6, causal=True)
    assert_close(fa.flash_attn_varlen_qkvpacked_func(qkv, cu(lengths), 6, causal=True), want)
    kv = torch.stack([k, v], 1)
    got = fa.flash_attn_varlen_kvpacked_func(q, kv, cu(lengths), cu(lengths), 6, 6, causal=True)
    assert_close(got, want)


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
        call = kv_call(paged=False)
        call.pop("learnable_sink")
        call.update(kw)
        before = snapshot(call)
        with pytest.raises((ValueError, TypeError)) as info:
            fa.flash_attn_with_kvcache(**call)
        assert_unchanged(call, before)
    else:
        with pytest.raises((ValueError, TypeError)) as info:
            getattr(fa, fn)(*fa_inputs(fn), **kw)
    text = str(info.value)
    assert text.startswith(name), text
    assert bad.lstrip("-") in text.lower(), text  # the message quotes the value


def test_a_sink_of_minus_inf_is_no_sink() -> None:
    q, k, v = fa_inputs("flash_attn_func")
    none = torch.full((4,), -math.inf, dtype=torch.float64)
    assert_close(fa.flash_attn_func(q, k, v, learnable_sink=none), fa.flash_attn_func(q, k, v))


@pytest.mark.skipif(not _native.load(), reason=f"native kernel: {_native.status()[1]}")
@pytest.mark.parametrize("page", [1, 16, 256])
def test_varlen_reads_a_paged_cache_in_place(page: int) -> None:
    # vLLM's mixed batch: a prefill of 40 queries, decodes of one query and a sequence with no
    # new query, each against its own pages (NaN in the pages no sequence holds). In place (the
    # native kernel), gathered (asking gradients: attention() on the packed keys) and the
    # reference, sequence by sequence: one answer.
    g = torch.Generator().manual_seed(page)
    hkv, heads, d = 2, 4, 16
    q_lengths, k_lengths = [40, 1, 0, 1], [40, 333, 9, 70]
    per_row = [-(-n // page) for n in k_lengths]
    blocks = sum(per_row) + 3
    k_pages = torch.full((blocks, page, hkv, d), float("nan"))
    v_pages = torch.full((blocks, page, hkv, d), float("nan"))
    order = torch.randperm(blocks, generator=g).tolist()
    table = torch.full((4, max(per_row) + 1), blocks + 7, dtype=torch.int32)
    keys, values = [], []
    for s, n in enumerate(k_lengths):
        k = torch.randn(n, hkv, d, generator=g)
        v = torch.randn(n, hkv, d, generator=g)
        keys.append(k)
        values.append(v)
        for p in range(per_row[s]):
            at = order.pop()
            table[s, p] = at
            k_pages[at, : len(k[p * page : (p + 1) * page])] = k[p * page : (p + 1) * page]
            v_pages[at, : len(v[p * page : (p + 1) * page])] = v[p * page : (p + 1) * page]
    q = torch.randn(sum(q_lengths), heads, d, generator=g)
    slopes = torch.rand(heads, generator=g)
    kw = {"causal": True, "alibi_slopes": slopes, "softcap": 8.0, "return_attn_probs": True}

    def run(queries: Tensor) -> tuple[Tensor, Tensor, list[Any]]:
        with attnkit.record_dispatch() as calls:
            out, lse, _ = fa.flash_attn_varlen_func(
                queries, k_pages, v_pages, cu(q_lengths), cu(k_lengths), block_table=table, **kw
            )
        return out.detach(), lse.detach(), calls

    in_place = run(q)
    gathered = run(q.clone().requires_grad_())
    assert [(c.chosen, c.kernel) for c in in_place[2]] == [("chunked", IN_PLACE)]
    assert [c.kernel for c in gathered[2]] != [IN_PLACE]
    for a, b in zip(in_place[:2], gathered[:2], strict=True):
        assert_close(a, b, dtype=torch.float32)
    first = 0
    for s, n in enumerate(q_lengths):
        if n:
            want, want_lse = reference(
                q[None, first : first + n],
                keys[s][None],
                values[s][None],
                causal=True,
                softcap=8.0,
                slopes=slopes,
            )
            assert_close(in_place[0][first : first + n], want[0], dtype=torch.float32)
            assert_close(in_place[1][:, first : first + n], want_lse[0], dtype=torch.float32)
        first += n


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_meta_cumulative_lengths_are_refused_by_name(name: str) -> None:
    """cu_seqlens_q and cu_seqlens_k say where each sequence starts (the call's mask, and the check
    that they end at the packed tokens): on the meta device they hold none, and the call says so
    by name rather than with torch's "Cannot copy out of meta tensor"."""
    q, k, v, cu_q, cu_k = fa_inputs("flash_attn_varlen_func")
    given = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    given[name] = given[name].to("meta")
    message = (
        f"{name} is on the meta device, which holds no values to read, and its values say where "
        "each sequence starts: pass it on the CPU (the call's other tensors may stay on the meta "
        "device)"
    )
    for tensors in ((q, k, v), tuple(t.to("meta") for t in (q, k, v))):
        with pytest.raises(ValueError, match=re.escape(message)):
            fa.flash_attn_varlen_func(*tensors, **given, max_seqlen_q=5, max_seqlen_k=6)
    with pytest.raises(ValueError, match=re.escape(message.replace(name, "cu_seqlens_q"))):
        fa.varlen_mask(given["cu_seqlens_q"].to("meta"))


def test_meta_packed_sequences_with_lengths_on_the_cpu_run() -> None:
    q, k, v, cu_q, cu_k = fa_inputs("flash_attn_varlen_func")
    kw: dict[str, Any] = dict(max_seqlen_q=5, max_seqlen_k=6, causal=True, return_attn_probs=True)
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, **kw)
    meta = (t.to("meta") for t in (q, k, v))
    m_out, m_lse, _ = fa.flash_attn_varlen_func(*meta, cu_q, cu_k, **kw)
    for real, m in ((out, m_out), (lse, m_lse)):
        assert m.is_meta
        assert (m.shape, m.dtype) == (real.shape, real.dtype)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("q8", [False, True])
def test_float8_inputs_with_their_descale_factors(dtype: torch.dtype, q8: bool) -> None:
    # flash-attn 3's float8 call: keys and values k.float() * k_descale[b, h], read in place;
    # against the float64 formula over those values (causal, GQA, a window, softcap).
    g = torch.Generator().manual_seed(5)
    B, Tq, Tk, H, Hkv, D = 2, 6, 9, 4, 2, 16
    q = torch.randn(B, Tq, H, D, generator=g)
    k, v = (torch.randn(B, Tk, Hkv, D, generator=g) * 3 for _ in range(2))
    top = torch.finfo(dtype).max
    kd, vd = (x.abs().amax((1, 3)) / top for x in (k, v))  # (B, Hkv)
    k8, v8 = (x / d[:, None, :, None] for x, d in ((k, kd), (v, vd)))
    k8, v8 = k8.to(dtype), v8.to(dtype)
    qd = torch.rand(B, Hkv, generator=g) + 0.5
    qin = q.to(dtype) if q8 else q
    out, lse, _ = fa.flash_attn_func(
        qin,
        k8,
        v8,
        causal=True,
        window_size=(4, 0),
        softcap=20.0,
        return_attn_probs=True,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
    )
    qf = qin.double() * qd.repeat_interleave(H // Hkv, 1)[:, None, :, None].double()
    if q8:  # float8 queries are read in bfloat16, flash-attn 3's output dtype for them
        qf = qf.bfloat16().double()
    kf, vf = (x.double() * d[:, None, :, None].double() for x, d in ((k8, kd), (v8, vd)))
    want, want_lse, _ = fa.flash_attn_func(
        qf, kf, vf, causal=True, window_size=(4, 0), softcap=20.0, return_attn_probs=True
    )
    assert out.dtype == (torch.bfloat16 if q8 else torch.float32)
    tol = 1e-2 if q8 else 1e-5
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)


def test_float8_descale_factors_are_checked() -> None:
    q, k = torch.randn(2, 3, 4, 8), torch.randn(2, 5, 2, 8)
    k8 = k.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"k_descale must be \(batch, nheads_k\) = \(2, 2\)"):
        fa.flash_attn_func(q, k8, k8, k_descale=torch.ones(1, 2))
    with pytest.raises(TypeError, match="k_descale is for a float8 k and v"):
        fa.flash_attn_func(q, k, k, k_descale=torch.ones(2, 2))
    with pytest.raises(TypeError, match=r"go to attnkit.attention\(q, k, v, k_scale"):
        fa.flash_attn_func(q, k.to(torch.int8), k.to(torch.int8))
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        fa.flash_attn_func(torch.randn(2, 3, 3, 8), k8, k8, q_descale=torch.ones(2, 2))
    with pytest.raises(TypeError, match="a float8 q is read in bfloat16"):
        fa.flash_attn_func(q.to(torch.float8_e4m3fn), k, k)
    with pytest.raises(TypeError, match="so k_cache and v_cache must be float8 or bfloat16"):
        fa.flash_attn_with_kvcache(q.to(torch.float8_e4m3fn), k, k)
    # no factors: a float8 call reads its keys and values as they are (factors of 1)
    out = fa.flash_attn_func(q, k8, k8)
    torch.testing.assert_close(
        out, fa.flash_attn_func(q, k8.float(), k8.float()), atol=1e-5, rtol=1e-5
    )
