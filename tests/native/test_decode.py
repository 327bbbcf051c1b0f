"""The native kernel's decode path (``csrc/decode.cpp``): calls of a few queries in one query block.

Equal to the float64 reference with every mask, modifier and score term the kernel supports,
gradients included (the backward is the blocked kernel's, from the decode path's log-sum-exp);
split across threads by keys and merged exactly; careful about NaN and inf in q, k and v, which
an inference call does not read beforehand.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import _native, attention, masks, scores
from attnkit._base import finite as finite_module
from attnkit._kernel import draw_seed, dropout_mask
from attnkit._kernel.call import native_arguments, plan_call
from attnkit._kernel.choice import decodes
from attnkit._native.kernel import BF16_DOT, BF16_GROUP_DOTS, DECODE_QUERIES
from attnkit.backends import Chunked
from attnkit.testing import assert_close

pytestmark = pytest.mark.skipif(not _native.load(), reason=f"native kernel: {_native.status()[1]}")

# Blocks of 16 queries: every call below of at most 16 queries runs on the decode path.
DECODE = Chunked(block_q=16, block_k=32)

MASKS = {
    "none": lambda b, tk: None,
    "causal": lambda b, tk: masks.causal(),
    "window": lambda b, tk: masks.sliding_window(9, 3),
    "padding": lambda b, tk: masks.key_padding([tk, max(tk - 17, 0)][:b]),
    "padding & window": lambda b, tk: (
        masks.key_padding([max(tk - 5, 0), tk][:b]) & masks.sliding_window(20)
    ),
    "documents": lambda b, tk: masks.documents([[tk - 13, 13], [tk]][:b]) if tk > 13 else None,
    "tiles": lambda b, tk: masks.from_fn(lambda bb, h, i, j: (i + 2 * j + h) % 5 != 0),
}


def _inputs(
    b: int, h: int, hkv: int, tq: int, tk: int, dk: int = 16, dv: int = 12, seed: int = 0
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(b, h, tq, dk, generator=g, dtype=torch.float64),
        torch.randn(b, hkv, tk, dk, generator=g, dtype=torch.float64),
        torch.randn(b, hkv, tk, dv, generator=g, dtype=torch.float64),
    ]


def _token_major(t: torch.Tensor) -> torch.Tensor:
    """``(B, H, T, D)`` as a view of ``(B, T, H, D)`` memory, as flash-attn keeps a cache."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _grads(
    tensors: list[torch.Tensor], backend: object, dtype: torch.dtype, **kw: object
) -> list[torch.Tensor]:
    """The output and the gradients of every tensor, in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in tensors]
    extra = dict(zip([k for k in ("bias", "sinks") if k in kw], leaves[3:], strict=False))
    named = {k: v for k, v in kw.items() if k not in ("bias", "sinks")}
    out = attention(*leaves[:3], backend=backend, **extra, **named)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(99)
    cot = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
    return [out, *torch.autograd.grad(out, leaves, cot, materialize_grads=True)]


def test_the_python_side_knows_which_calls_decode() -> None:
    q, k, v = _inputs(1, 2, 1, DECODE_QUERIES, 40)
    spec, _, _ = plan_call(q, k, v, mask=None, bias=None, scale=0.3, block_q=16)
    assert decodes(spec.plan)
    q17 = torch.randn(1, 2, DECODE_QUERIES + 1, 16, dtype=torch.float64)
    spec, _, _ = plan_call(q17, k, v, mask=None, bias=None, scale=0.3, block_q=32)
    assert not decodes(spec.plan)
    spec, _, _ = plan_call(q[..., :5, :], k, v, mask=None, bias=None, scale=0.3, block_q=4)
    assert not decodes(spec.plan)  # two query blocks


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 8, 2), (3, 6, 3), (16, 4, 1)])
def test_decode_equals_the_reference(
    shape: tuple[int, int, int], mask: str, dtype: torch.dtype
) -> None:
    # (Tq, H, Hkv): one query, GQA groups of 4 and 2, 16 queries of 4 heads sharing one head
    tq, h, hkv = shape
    b, tk = 2, 77
    q, k, v = _inputs(b, h, hkv, tq, tk, seed=tq + h)
    g = torch.Generator().manual_seed(5)
    kw = {
        "mask": MASKS[mask](b, tk),
        "softcap": 4.0,
        "bias": torch.randn(h, tq, tk, generator=g, dtype=torch.float64),
        "sinks": torch.randn(h, generator=g, dtype=torch.float64),
    }
    tensors = [q, k, v, kw["bias"], kw["sinks"]]  # type: ignore[list-item]
    got = _grads(tensors, DECODE, dtype, **kw)
    want = _grads(tensors, "reference", torch.float64, **kw)
    for a, w in zip(got, want, strict=True):
        assert a.isfinite().all()
        assert_close(a, w, dtype=dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "padding"])
def test_long_caches_split_by_keys_merge_exactly(mask: str, threads: int) -> None:
    # One batch row and one key/value head: the keys are split into parts (each of at least 512
    # keys, a few per thread), merged by their log-sum-exps.
    q, k, v = _inputs(1, 3, 1, 2, 3000, dk=32, dv=24, seed=1)
    kw = {"mask": MASKS[mask](1, 3000)}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = attention(q.float(), k.float(), v.float(), backend=DECODE, return_lse=True, **kw)
    finally:
        torch.set_num_threads(before)
    want = attention(q, k, v, backend="reference", return_lse=True, **kw)
    for a, w in zip(got, want, strict=True):
        assert_close(a, w, dtype=torch.float32)


@pytest.mark.parametrize("layout", ["token-major", "packed"])
def test_keys_and_values_are_read_at_their_strides(layout: str) -> None:
    q, k, v = _inputs(2, 8, 4, 3, 300, seed=2)

    def laid_out(t: torch.Tensor) -> torch.Tensor:
        if layout == "token-major":  # a (B, T, H, D) cache, as flash-attn keeps it
            return _token_major(t)
        wide = torch.zeros(*t.shape[:-1], 3 * t.size(-1), dtype=t.dtype)
        wide[..., t.size(-1) : 2 * t.size(-1)] = t
        return wide[..., t.size(-1) : 2 * t.size(-1)]

    got = attention(*(laid_out(t).float() for t in (q, k, v)), causal=True, backend=DECODE)
    assert_close(got, attention(q, k, v, causal=True, backend="reference"), dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_score_terms_on_the_decode_path(dtype: torch.dtype) -> None:
    tq, tk, h = 4, 150, 4
    q, k, v = _inputs(2, h, 2, tq, tk, seed=3)
    g = torch.Generator().manual_seed(8)
    qv = torch.randn(2, h, tq, 16, generator=g, dtype=torch.float64)
    enc = torch.randn(h, tq + tk - 1, 16, generator=g, dtype=torch.float64)
    table = torch.randn(h, tq + tk - 1, generator=g, dtype=torch.float64)

    def run(backend: object, dt: torch.dtype, term: str) -> list[torch.Tensor]:
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v, qv, enc, table)]
        added: scores.ScoreTerm = (
            scores.RelativePositionTerm(leaves[3], leaves[4], 0.4)
            if term == "position"
            else scores.DistanceBias(leaves[5], first=-(tk - 1))
        )
        out = attention(*leaves[:3], mask=masks.sliding_window(40), bias=added, backend=backend)
        used = [*leaves[:3], *(leaves[3:5] if term == "position" else leaves[5:])]
        return [out, *torch.autograd.grad(out.sum(), used)]

    for term in ("position", "distance"):
        want = run("reference", torch.float64, term)
        for a, w in zip(run(DECODE, dtype, term), want, strict=True):
            assert_close(a, w, dtype=dtype)


@pytest.mark.parametrize("layout", ["head-major", "token-major"])
def test_dropout_on_the_decode_path_drops_the_pairs_of_the_mask(layout: str) -> None:
    # Token-major keys and values of 2 heads of 64 float64 (1 KiB tokens, 4 to a page) are read
    # for both heads at once, the tokens out of order: dropout still drops each pair by its own
    # position.
    q, k, v = _inputs(2, 4, 2, 3, 70, dk=64, dv=64, seed=4)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    laid = [_token_major(t) if layout == "token-major" else t for t in leaves]
    p = 0.3
    torch.manual_seed(11)
    got = attention(*laid, causal=True, dropout_p=p, backend=DECODE)
    torch.manual_seed(11)
    keep = dropout_mask(draw_seed(), p, (2, 4, 3, 70))  # the draw the kernel made
    _, weights = attention(*leaves, causal=True, return_weights=True, backend="reference")
    want = (weights * keep / (1 - p)) @ v.repeat_interleave(2, dim=1)
    assert_close(got, want)
    for a, w in zip(
        torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves), strict=True
    ):
        assert_close(a, w)


# --------------------------------------------------------------------------------------------------
# The bounds of windows and padding: where a step of keys needs no mask, and which keys of a
# cache's row a block of queries reads


def _mismatches(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], n: int
) -> list[int]:
    """The cases of ``n`` (equal slices of the batch) whose output or log-sum-exp differ (the
    same queries see no key; the rest to 1e-10)."""
    bad = []
    for c, parts in enumerate(zip(*(t.chunk(n) for t in (*got, *want)), strict=True)):
        out, lse, want_out, want_lse = parts
        seen = want_lse.isfinite()
        if not (
            torch.allclose(out, want_out, rtol=1e-10, atol=1e-10)
            and torch.equal(lse.isfinite(), seen)
            and torch.allclose(lse[seen], want_lse[seen], rtol=1e-10, atol=1e-10)
        ):
            bad.append(c)
    return bad


@pytest.mark.parametrize("layout", ["head-major", "token-major"])
@pytest.mark.parametrize("tq", [1, 3, 6])  # 2, 6 and 12 rows of 2 query heads per key/value head
def test_windows_and_padding_lengths_at_every_alignment_equal_the_reference(
    tq: int, layout: str
) -> None:
    # Windows wide enough that whole steps of keys lie inside every row's band (those steps run
    # unmasked), their left reach swept across a step's 16 alignments and their right reach on
    # either side of the diagonal, with and without key padding (whose flags every step must
    # read); queries aligned to the end of 150 keys. The reference runs all of them as one call.
    b, tk = 2, 150
    q, k, v = _inputs(b, 4, 2, tq, tk, seed=tq)
    laid = [_token_major(t) if layout == "token-major" else t for t in (k, v)]
    geo = masks.Geometry((b,), 4, tq, tk, torch.device("cpu"))
    cases, got, dense = [], [], []
    with torch.inference_mode():
        for left in range(16, 34):
            for right in (-3, 0, 2, 5):
                for padded in (False, True):
                    mask = masks.sliding_window(left, right)
                    if padded:
                        mask = mask & masks.key_padding([tk - 4, tk - left // 2 - 7])
                    cases.append((left, right, padded))
                    got.append(attention(q, *laid, mask=mask, backend=DECODE, return_lse=True))
                    dense.append(mask.tile(geo, 0, tq, 0, tk).expand(b, 1, tq, tk))
        n = len(cases)
        want = attention(
            *(t.repeat(n, 1, 1, 1) for t in (q, k, v)),
            mask=torch.cat(dense),
            backend="reference",
            return_lse=True,
        )
    outs = (torch.cat([o for o, _ in got]), torch.cat([lse for _, lse in got]))
    assert not [cases[c] for c in _mismatches(outs, want, n)]


def _cache_rows(
    k: torch.Tensor, ranges: list[tuple[int, int]], table: torch.Tensor | None
) -> torch.Tensor:
    """A cache ``(N, Hkv, L, D)`` as the kernel reads it: each row one contiguous page, or (with
    ``table``) pages of 16 keys in a pool, row ``n``'s page ``p`` at ``table[n, p]``. Keys outside
    a row's stretch are NaN: a read of one shows."""
    n, hkv, length, d = k.shape
    k = k.clone()
    for row, (start, end) in enumerate(ranges):
        k[row, :, :start] = k[row, :, end:] = float("nan")
    if table is None:
        return k
    pages = k.view(n, hkv, length // 16, 16, d).permute(0, 2, 1, 3, 4).reshape(-1, hkv, 16, d)
    pool = torch.empty_like(pages)
    pool[table.flatten()] = pages
    return pool


@pytest.mark.filterwarnings("ignore:mask lets no query")  # the row of no keys, (50, 50)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("tq", [1, 3, 7])
def test_a_caches_windows_and_padding_equal_the_reference(tq: int, paged: bool) -> None:
    # Rows of a cache with left padding (a stretch from start > 0) and their own lengths, bands
    # that cut either end (a right bound before the diagonal too), each row's queries aligned to
    # its stretch's end; against the reference with the same mask, dense, as one call.
    from attnkit._kernel.cache import cache_attention

    ranges = [(0, 160), (7, 121), (33, 61), (20, 20 + tq), (50, 50)]
    n, length = len(ranges), 160
    q, k, v = _inputs(n, 4, 2, tq, length, seed=tq + 1)
    table = None
    if paged:  # shuffled pages of 16 keys
        table = torch.randperm(n * 10, generator=torch.Generator().manual_seed(tq)).view(n, 10)
    kp, vp = _cache_rows(k, ranges, table), _cache_rows(v, ranges, table)
    inf = float("inf")
    bands: list[tuple[float, float] | None] = [None, (-inf, 0.0), (-inf, 3.0), (-40.0, 5.0)]
    bands += [(-25.0, -3.0), (-1.0, 1.0), *((-float(left), 0.0) for left in range(16, 34, 3))]
    i = (
        torch.tensor([end - tq for _, end in ranges])[:, None, None, None]
        + torch.arange(tq)[:, None]
    )  # each row's queries' key positions, (N, 1, Tq, 1)
    j = torch.arange(length)
    rows = (j >= torch.tensor([s for s, _ in ranges])[:, None, None, None]) & (
        j < torch.tensor([e for _, e in ranges])[:, None, None, None]
    )
    got, dense = [], []
    for band in bands:
        got.append(
            cache_attention(q, kp, vp, kv_range=ranges, block_table=table, band=band, scale=0.3)
        )
        lo, hi = (-inf, inf) if band is None else band
        dense.append(rows & (j - i >= lo) & (j - i <= hi))
    want = attention(
        *(t.repeat(len(bands), 1, 1, 1) for t in (q, k, v)),
        mask=torch.cat(dense),
        scale=0.3,
        backend="reference",
        return_lse=True,
    )
    outs = (torch.cat([o for o, _ in got]), torch.cat([lse for _, lse in got]))
    assert not [bands[c] for c in _mismatches(outs, want, len(bands))]


# --------------------------------------------------------------------------------------------------
# NaN and inf: not read beforehand, handled by the decode path


def test_an_inference_decode_reads_its_inputs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # The finiteness check reads all of q, k and v: for a long cache, as much as the call itself.
    calls: list[int] = []
    real = finite_module._finite

    def counting(*tensors: torch.Tensor) -> bool:
        calls.append(len(tensors))
        return real(*tensors)

    # (every read goes through it: finite(), which the kernel asks, and the call's description)
    monkeypatch.setattr(finite_module, "_finite", counting)
    q, k, v = (t.float() for t in _inputs(2, 4, 2, 1, 500))
    with torch.inference_mode():
        attention(q, k, v, causal=True, backend=DECODE)
    assert calls == []
    with torch.no_grad():
        attention(q, k, v, causal=True, backend=Chunked(block_q=1, block_k=32))
    assert calls == []
    attention(q.requires_grad_(), k, v, causal=True, backend=DECODE).sum().backward()
    assert calls  # a call that needs gradients is checked: the backward has no careful mode


@pytest.mark.parametrize("layout", ["head-major", "token-major"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("where", ["padding", "bias", "window"])
def test_nan_and_inf_where_the_mask_hides_them_change_nothing(
    where: str, dtype: torch.dtype, layout: str
) -> None:
    b, tq, tk = 2, 2, 700
    q, k, v = (t.to(dtype) for t in _inputs(b, 4, 2, tq, tk, seed=6))
    bias = torch.zeros(b, 4, tq, tk, dtype=dtype)
    kw: dict[str, object] = {}
    dirty_k, dirty_v = k.clone(), v.clone()
    if where == "padding":
        kw["mask"] = masks.key_padding([tk, 300])
        dirty_k[1, :, 300:], dirty_v[1, :, 300:] = float("nan"), float("inf")
    elif where == "bias":
        bias[0, :, :, 100:140] = float("-inf")
        kw["bias"] = bias
        dirty_k[0, :, 100:140], dirty_v[0, :, 120] = float("nan"), float("-inf")
    else:  # query 0 (at key 698) sees keys 648 to 698, query 1 keys 649 to 699
        kw["mask"] = masks.sliding_window(50)
        dirty_k[:, :, :648], dirty_v[:, :, :648] = float("inf"), float("nan")
    if layout == "token-major":
        dirty_k, dirty_v = _token_major(dirty_k), _token_major(dirty_v)
    with torch.inference_mode(), attnkit.record_dispatch() as calls:
        got = attention(q, dirty_k, dirty_v, backend=DECODE, **kw)  # type: ignore[arg-type]
    assert calls[0].kernel == "native kernel"
    wide = {n: x.double() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    want = attention(q.double(), k.double(), v.double(), backend="reference", **wide)  # type: ignore[arg-type]
    assert_close(got, want, dtype=dtype)


def test_nan_a_query_sees_reaches_its_row_only() -> None:
    q, k, v = (t.float() for t in _inputs(2, 4, 2, 3, 400, seed=7))
    k[0, 1, 17] = float("nan")  # seen by query heads 2 and 3 of batch row 0 (its rows, all 3)
    v[1, 0, 390] = float("inf")  # seen only by the causal queries that reach key 390
    with torch.inference_mode(), attnkit.record_dispatch() as calls:
        out = attention(q, k, v, mask=masks.causal(), backend=DECODE)
    assert calls[0].kernel == "native kernel"
    bad = ~out.isfinite().all(-1)  # (B, H, Tq)
    want = torch.zeros_like(bad)
    want[0, 2:] = True
    want[1, :2] = True  # every query of heads 0 and 1 reaches key 390 (Tq=3 aligned to the end)
    assert torch.equal(bad, want)


def test_a_query_that_sees_no_key_gets_zeros() -> None:
    q, k, v = (t.float() for t in _inputs(2, 4, 2, 2, 300, seed=8))
    k[1], v[1] = float("nan"), float("inf")  # row 1 sees no key at all
    with torch.inference_mode(), attnkit.record_dispatch() as calls:
        out, lse = attention(
            q, k, v, mask=masks.key_padding([300, 0]), backend=DECODE, return_lse=True
        )
    assert calls[0].kernel == "native kernel"
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert bool((lse[1] == float("-inf")).all())
    assert bool(out[0].isfinite().all())


# --------------------------------------------------------------------------------------------------
# The operator, and a fuzz against the reference


def test_opcheck_native_forward_on_the_decode_path() -> None:
    q, k, v = _inputs(2, 4, 2, 3, 45)
    spec, dense, terms = plan_call(
        q, k, v, mask=masks.sliding_window(7), bias=None, scale=0.3, softcap=5.0, block_q=8
    )
    assert decodes(spec.plan)
    args, kwargs = native_arguments(spec, q, k, v, dense, terms)
    args = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(torch.ops.attnkit.native_forward.default, args, kwargs)


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    mask=st.sampled_from(list(MASKS)),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_decode_fuzz_against_the_reference(
    data: st.DataObject, mask: str, dtype: torch.dtype
) -> None:
    draw = data.draw
    b, hkv, groups = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 5))
    tq, tk = draw(st.integers(1, DECODE_QUERIES)), draw(st.integers(1, 1500))
    dk, dv = draw(st.sampled_from([1, 7, 16, 64, 72])), draw(st.sampled_from([1, 5, 16, 68]))
    q, k, v = _inputs(b, hkv * groups, hkv, tq, tk, dk, dv, seed=draw(st.integers(0, 2**16)))
    kw: dict[str, object] = {"mask": MASKS[mask](b, tk)}
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([0.5, 3.0, 50.0]))
    if draw(st.booleans()):
        kw["sinks"] = torch.randn(hkv * groups, dtype=torch.float64)
    block_k = draw(st.sampled_from([16, 64, 256]))
    with torch.inference_mode():
        got = attention(
            q.to(dtype),
            k.to(dtype),
            v.to(dtype),
            backend=Chunked(block_q=DECODE_QUERIES, block_k=block_k),
            return_lse=True,
            **{n: (x.to(dtype) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()},  # type: ignore[arg-type]
        )
        want = attention(q, k, v, backend="reference", return_lse=True, **kw)  # type: ignore[arg-type]
    assert_close(got[0], want[0], dtype=dtype)
    seen = want[1].isfinite()
    assert torch.equal(seen, got[1].isfinite())
    assert_close(got[1][seen], want[1][seen], dtype=dtype)


def test_explain_says_the_decode_path_takes_care_of_nan() -> None:
    q, k, v = (t.float() for t in _inputs(1, 4, 2, 1, 64))
    text = str(attnkit.explain(q, k, v, backend=DECODE))
    assert "native kernel" in text
    assert "the eager kernel where q, k or v hold NaN" not in text
    q3 = torch.randn(1, 4, 20, 16)
    text = str(attnkit.explain(q3, k, v, backend=DECODE))
    assert "the eager kernel where q, k or v hold NaN or inf" in text


# bfloat16 and float16 keys and values: read as they are, each element converted to float32
# exactly, so the kernel must give what it gives on the same values in float32.
REDUCED_CASES = {
    "window & softcap": {"mask": masks.sliding_window(40, 3), "softcap": 5.0},
    "padding": {"mask": masks.key_padding([300, 170])},
    "alibi": {"mask": masks.causal(), "bias": "alibi"},
}


def _alibi(heads: int, tq: int, tk: int, dtype: torch.dtype) -> scores.DistanceBias:
    """ALiBi as a bias by distance: head h adds slope_h * (k_pos - q_pos)."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1, dtype=torch.float64) / heads)
    distances = torch.arange(-(tk - 1), tq, dtype=torch.float64)
    return scores.DistanceBias((slopes[:, None] * distances).to(dtype), first=-(tk - 1))


def _reduced_call(
    dtype: torch.dtype, tq: int, case: str, heads: tuple[int, int] = (8, 2), dk: int = 72
) -> tuple[tuple[object, ...], dict[str, object], tuple[object, ...], dict[str, object]]:
    """The operator's arguments for a call of q, k, v rounded to ``dtype``, as attention() plans
    it in ``dtype``, and the same call's arguments in float32."""
    h, hkv = heads
    q, k, v = (t.to(dtype) for t in _inputs(2, h, hkv, tq, 300, dk=dk, dv=40, seed=tq))
    planned = []
    for x in (dtype, torch.float32):
        kw: dict[str, Any] = {"mask": None, "bias": None, **REDUCED_CASES[case]}
        if kw["bias"] == "alibi":
            alibi = _alibi(h, tq, 300, dtype)  # the same rounded numbers in both calls
            kw["bias"] = scores.DistanceBias(alibi.table.to(x), first=alibi.first)
        spec, dense, terms = plan_call(
            q.to(x), k.to(x), v.to(x), scale=0.2, block_q=16, block_k=32, **kw
        )
        planned.append(native_arguments(spec, q.to(x), k.to(x), v.to(x), dense, terms))
    (args, kwargs), (args32, kwargs32) = planned
    return args, kwargs, args32, kwargs32


@pytest.mark.parametrize("case", list(REDUCED_CASES))
@pytest.mark.parametrize("tq", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_keys_and_values_are_read_as_they_are(
    dtype: torch.dtype, tq: int, case: str
) -> None:
    # 1 and 5 queries take the decode path, 40 the blocked forward (3 query blocks).
    args, kwargs, args32, kwargs32 = _reduced_call(dtype, tq, case)
    if dtype == torch.bfloat16 and (tq > 16 or (BF16_GROUP_DOTS and tq * 4 > 8)):
        # On a CPU that multiplies bfloat16, the blocked forward's products run in bfloat16 with
        # the probabilities rounded for p v (tests/native/test_matrix_unit.py), and so do a
        # decode step's of more than 8 rows a head where the dot products outrun float32 FMAs
        # (test_grouped_bf16_dot_products_stay_within_the_rounding_of_the_weights); without
        # register tiles they are float32 products of the same numbers, which this test is about.
        kwargs["register_tiles"] = False
    q, k, v = args[:3]
    assert q.dtype == torch.float32  # type: ignore[union-attr]
    assert k.dtype == v.dtype == dtype  # type: ignore[union-attr]
    out, lse = torch.ops.attnkit.native_forward(*args, **kwargs)
    out32, lse32 = torch.ops.attnkit.native_forward(*args32, **kwargs32)
    torch.testing.assert_close(out, out32, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse, lse32, rtol=2e-6, atol=2e-6)


def test_opcheck_native_forward_on_bfloat16_keys_and_values() -> None:
    # the decode path's bfloat16 keys and values (and q k^T on bfloat16 dot products where the
    # CPU has them), read as they are
    args, kwargs, _, _ = _reduced_call(torch.bfloat16, 2, "window & softcap")
    args = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(torch.ops.attnkit.native_forward.default, args, kwargs)


def test_opcheck_native_forward_on_grouped_bfloat16_rows() -> None:
    # 16 query heads over one key/value head: a grouped step (on AVX512-BF16's dot products
    # where they outrun float32 FMAs)
    args, kwargs, _, _ = _reduced_call(torch.bfloat16, 1, "window & softcap", heads=(16, 1))
    args = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(torch.ops.attnkit.native_forward.default, args, kwargs)


@pytest.mark.parametrize("tq", [1, 2])  # 4 and 8 rows of the item: its dot products
def test_queries_that_are_not_bfloat16_values_are_not_rounded(tq: int) -> None:
    # Where the CPU has bfloat16 dot products, a decode step runs q k^T on them when the queries
    # are bfloat16 values; other queries must keep their float32 products (rounded to bfloat16,
    # these scores would move by about 1e-3).
    args, kwargs, args32, kwargs32 = _reduced_call(torch.bfloat16, tq, "padding")
    q = cast(torch.Tensor, args[0])
    q = q + 1e-3 * torch.randn(q.shape, generator=torch.Generator().manual_seed(0))
    out, lse = torch.ops.attnkit.native_forward(q, *args[1:], **kwargs)
    out32, lse32 = torch.ops.attnkit.native_forward(q, *args32[1:], **kwargs32)
    torch.testing.assert_close(out, out32, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse, lse32, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_keys_and_values_split_by_keys(dtype: torch.dtype) -> None:
    # A long cache split into parts across threads, and steps of many rows (16 queries x 4
    # heads) whose products run as GEMMs on converted keys and values.
    q, k, v = (t.to(dtype) for t in _inputs(1, 4, 1, 16, 3000, dk=32, dv=24, seed=2))
    got = attention(q, k, v, backend=DECODE, return_lse=True, mask=masks.sliding_window(2000))
    want = attention(
        q.double(), k.double(), v.double(), backend="reference", return_lse=True,
        mask=masks.sliding_window(2000),
    )  # fmt: skip
    for a, w in zip(got, want, strict=True):
        assert_close(a, w, dtype=dtype)


# A decode step of many bfloat16 rows a key/value head, in a process that fixes how it runs
# ($ATTNKIT_BF16_DOTS, read once): the error against float64 and a digest of the outputs.
_GROUPED = """
import sys
import torch
import attnkit
from attnkit import masks
from attnkit._native.kernel import BF16_GROUP_DOTS
assert BF16_GROUP_DOTS == (sys.argv[1] == "always"), BF16_GROUP_DOTS
g = torch.Generator().manual_seed(0)
cases = [  # (B, H, Hkv, Tq, Tk, Dk, Dv or None: v the first 512 columns of k), keywords
    ((2, 16, 1, 1, 300, 576, None), {}),  # latent attention's absorbed decode
    ((2, 16, 1, 3, 301, 576, None), {"causal": True}),
    ((1, 12, 1, 1, 301, 72, 40), {"mask": masks.sliding_window(200), "softcap": 5.0}),
    ((2, 8, 2, 3, 257, 33, 17), {"mask": masks.key_padding([250, 3])}),
    ((1, 18, 2, 2, 129, 64, 64), {"sinks": torch.randn(18, generator=g).bfloat16()}),
    ((1, 12, 1, 1, 1, 2, 1), {}),  # one key, widths of 2 and 1
    ((2, 16, 1, 2, 33, 576, None), {"mask": masks.key_padding([0, 33])}),  # a row of no keys
    # blocks of 16 rows and a part block (40 = 16 + 16 + 8), an odd width, value columns that
    # end inside a register, 128 heads on one latent
    ((1, 40, 1, 1, 203, 575, 100), {}),
    ((1, 128, 1, 1, 70, 64, 48), {"causal": True}),
    # token-major keys and values ((B, Tk, Hkv, D) transposed): every key/value head of an item
    # packs its own rows
    ((2, 32, 2, 1, 150, 64, 40), {"token_major": True}),
]
worst, digest = 0.0, 0.0
for (b, h, hkv, tq, tk, dk, dv), kw in cases:
    token_major = kw.pop("token_major", False)
    q = torch.randn(b, h, tq, dk, generator=g).bfloat16()
    k = torch.randn(b, hkv, tk, dk, generator=g).bfloat16()
    v = k[..., :512] if dv is None else torch.randn(b, hkv, tk, dv, generator=g).bfloat16()
    if token_major:
        k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    with torch.inference_mode():
        out = attnkit.attention(q, k, v, backend="chunked", **kw)
    said = str(attnkit.explain(q, k, v, backend="chunked", **kw))
    assert ("AVX512-BF16's dot products, the weights rounded" in said) == BF16_GROUP_DOTS, said
    q64, k64, v64 = q.double(), k.double(), v.double()
    kw = {n: x.double() if n == "sinks" else x for n, x in kw.items()}
    want = attnkit.attention(q64, k64, v64, backend="reference", **kw)
    # each weight rounded to bfloat16 moves its term by at most 2^-8 of it (bfloat16 keeps 8
    # significant bits), and the output's own rounding moves it by 2^-8 of itself: 2^-8 of
    # sum_j p_j |v_j| bounds each
    reach = attnkit.attention(q64, k64, v64.abs(), backend="reference", **kw)
    worst = max(worst, ((out.double() - want).abs() / (2.0**-7 * reach + 1e-6)).max().item())
    digest += out.double().sum().item()
print(worst, digest)
"""


def _grouped_run(word: str) -> tuple[float, float]:
    env = {**os.environ, "ATTNKIT_BF16_DOTS": word}
    done = subprocess.run(
        [sys.executable, "-c", _GROUPED, word], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    worst, digest = done.stdout.split()
    return float(worst), float(digest)


@pytest.mark.skipif(not BF16_DOT, reason="the CPU has no AVX512-BF16")
def test_grouped_bf16_dot_products_stay_within_the_rounding_of_the_weights() -> None:
    # The query heads that share a key/value head (grouped heads, latent attention's absorbed
    # form), on AVX512-BF16's dot products: the keys as they are, the weights rounded to bfloat16
    # for p v. Their error stays within that rounding's; the float32 FMAs' run too, and the two
    # runs differ (the switch chooses).
    worst, digest = _grouped_run("always")
    worst32, digest32 = _grouped_run("never")
    assert worst <= 1.0, worst
    assert worst32 <= 1.0, worst32
    assert digest != digest32


def test_reduced_keys_and_values_need_a_float32_q() -> None:
    args, kwargs, _, _ = _reduced_call(torch.bfloat16, 1, "padding")
    q = args[0].double()  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="k and v must have q's dtype, or bfloat16/float16"):
        torch.ops.attnkit.native_forward(q, *args[1:], **kwargs)


# --------------------------------------------------------------------------------------------------
# int8 and float8 keys and values, read in place with their scales (dequantized in registers)

QUANTIZED = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def _quantize(
    x: torch.Tensor, dtype: torch.dtype, per_token: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (B, Hkv, Tk, D)`` as ``(xq, scale)``: a scale per token and head, or per head."""
    top = 127.0 if dtype == torch.int8 else torch.finfo(dtype).max
    amax = x.abs().amax(-1, keepdim=True) if per_token else x.abs().amax((-2, -1), keepdim=True)
    scale = (amax / top).clamp_min(1e-30).float()
    y = x / scale
    y = y.round().clamp(-127, 127) if dtype == torch.int8 else y
    return y.to(dtype), scale


def _dequantized(xq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (xq.float() * scale).double()  # the values the call uses, in float64


def _quantized_call(
    dtype: torch.dtype, b: int, h: int, hkv: int, tq: int, tk: int, per_token: bool = True
) -> tuple[torch.Tensor, ...]:
    q, k, v = _inputs(b, h, hkv, tq, tk, dk=40, dv=24, seed=tk + tq)
    (kq, ks), (vq, vs) = _quantize(k, dtype, per_token), _quantize(v, dtype, per_token)
    return q.float(), kq, vq, ks, vs


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize(
    ("mask", "kw"),
    [
        ("none", {}),
        ("causal", {"softcap": 4.0}),
        ("window", {"sinks": True}),
        ("padding", {}),
        ("padding & window", {"softcap": 2.0, "sinks": True}),
        ("documents", {}),
        ("tiles", {}),
    ],
)
@pytest.mark.parametrize(("h", "hkv", "tq"), [(4, 4, 1), (8, 2, 3), (6, 1, 16)])
def test_quantized_keys_and_values_equal_the_formula_over_their_values(
    dtype: torch.dtype, mask: str, kw: dict[str, object], h: int, hkv: int, tq: int
) -> None:
    # The kernel adds no error of its own: against the float64 formula over the dequantized keys
    # and values, float32's rounding alone.
    q, kq, vq, ks, vs = _quantized_call(dtype, 2, h, hkv, tq, 300)
    extra: dict[str, Any] = dict(kw)
    if extra.pop("sinks", False):
        extra["sinks"] = torch.linspace(-1.0, 2.0, h)
    m = MASKS[mask](2, 300)
    with torch.inference_mode(), attnkit.record_dispatch() as calls:
        out = attention(q, kq, vq, k_scale=ks, v_scale=vs, mask=m, backend=DECODE, **extra)
    assert calls[-1].kernel == f"native kernel ({str(dtype)[6:]} k and v read in place)"
    if "sinks" in extra:
        extra["sinks"] = extra["sinks"].double()
    ref = attention(
        q.double(), _dequantized(kq, ks), _dequantized(vq, vs), mask=m, backend="reference", **extra
    )
    assert _rel(out, ref) <= 1e-5


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("layout", ["token-major", "per-head scale", "split by keys"])
def test_quantized_layouts_and_scales(dtype: torch.dtype, layout: str) -> None:
    # (B, Tk, Hkv, D) memory (all heads of a token read together), a scale per head broadcast
    # over the tokens (strides 0), and a long cache split across threads by keys, merged exactly.
    tk = 3000 if layout == "split by keys" else 200
    q, kq, vq, ks, vs = _quantized_call(dtype, 1, 8, 4, 1, tk, per_token=layout != "per-head scale")
    if layout == "token-major":
        kq, vq = _token_major(kq), _token_major(vq)
    if layout == "per-head scale":
        ks, vs = ks[0], vs[0]  # (Hkv, 1, 1)
    with torch.inference_mode():
        out = attention(q, kq, vq, k_scale=ks, v_scale=vs, causal=True, backend=DECODE)
    ref = attention(
        q.double(), _dequantized(kq, ks), _dequantized(vq, vs), causal=True, backend="reference"
    )
    assert _rel(out, ref) <= 1e-5


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dk", [40, 100, 128])
def test_int8_keys_against_queries_of_any_magnitude(group: int, dk: int) -> None:
    # int8 keys dequantized in registers must keep the products at float32's rounding for query
    # rows of every magnitude (huge, tiny, near float32's limits, a few large elements among
    # small ones, all zero), widths that are not a multiple of 16, GQA groups of 1, 4 and 8 query
    # heads, and key counts that are not a multiple of the kernel's blocks: what a faster product
    # (integer dot products on split query rows, say) must keep too.
    hkv, tk = 8, 203
    h = hkv * group
    q, k, v = _inputs(2, h, hkv, 1, tk, dk=dk, dv=24, seed=dk + group)
    (kq, ks), (vq, vs) = _quantize(k, torch.int8), _quantize(v, torch.int8)
    # each key/value head's query rows times a factor and its keys' scales divided by it, so
    # that the scores stay near 1
    factor = torch.tensor([1e12, 1e-12, 1e-25, 1e-37, 1e31, 3.0, 1.0, 0.5], dtype=torch.float64)
    within = torch.linspace(0.5, 2.0, group, dtype=torch.float64)  # the rows of a group
    q = q * (factor[:, None] * within).reshape(1, h, 1, 1)
    ks = ks / factor.float().reshape(1, hkv, 1, 1)
    q[0, -1, 0, dk // 4 :] *= 1e-4  # a quarter of a row much larger than the rest
    q[1, -1] = 0.0  # a row of zeros: every key weighs the same
    q32 = q.float()
    with torch.inference_mode(), attnkit.record_dispatch() as calls:
        out = attention(q32, kq, vq, k_scale=ks, v_scale=vs, backend=DECODE)
    assert calls[-1].kernel == "native kernel (int8 k and v read in place)"
    ref = attention(q32.double(), _dequantized(kq, ks), _dequantized(vq, vs), backend="reference")
    assert out.isfinite().all()
    assert _rel(out, ref) <= 1e-5
    # each row on its own (the tolerance above is relative to the largest output)
    for n in range(2):
        for head in range(h):
            assert _rel(out[n, head], ref[n, head]) <= 1e-5, (n, head)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_float8_number_is_read_exactly(dtype: torch.dtype) -> None:
    # All 256 codes, NaN and inf included, as the values of one key the query sees with weight 1:
    # the output is the values as torch converts them (NaN where the non-finite policy says).
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).reshape(1, 1, 2, 128)
    q = torch.zeros(1, 1, 1, 128)
    one = torch.ones(1, 1, 1, 1)
    for i in range(2):
        v = codes[:, :, i : i + 1]
        k = torch.zeros(1, 1, 1, 128, dtype=dtype)
        with torch.inference_mode():
            out = attention(q, k, v, k_scale=one, v_scale=one, backend=DECODE)
            ref = attention(q, k.float(), v.float(), backend=DECODE)
        assert torch.equal(out.nan_to_num(7.0, 8.0, 9.0), ref.nan_to_num(7.0, 8.0, 9.0))


def test_quantized_nan_where_the_mask_hides_it_changes_nothing() -> None:
    q, kq, vq, ks, vs = _quantized_call(torch.float8_e4m3fn, 1, 4, 2, 1, 64)
    nan = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
    kq[..., 60:, :], vq[..., 60:, :] = nan, nan  # keys 60 to 63: hidden by the padding below
    m = masks.key_padding([60])
    with torch.inference_mode():
        out = attention(q, kq, vq, k_scale=ks, v_scale=vs, mask=m, backend=DECODE)
    ref = attention(
        q.double(), _dequantized(kq, ks), _dequantized(vq, vs), mask=m, backend="reference"
    )
    assert out.isfinite().all()
    assert _rel(out, ref) <= 1e-5


def test_bfloat16_queries_with_quantized_keys_and_values() -> None:
    q, kq, vq, ks, vs = _quantized_call(torch.int8, 2, 8, 2, 2, 100)
    with torch.inference_mode(), attnkit.record_dispatch() as calls:
        out = attention(q.bfloat16(), kq, vq, k_scale=ks, v_scale=vs, backend=DECODE)
    assert out.dtype == torch.bfloat16
    assert "read in place" in str(calls[-1].kernel)
    # The keys and values the call uses are in q's dtype: rounded to bfloat16 by the reference,
    # read in float32 here; bfloat16's tolerance covers both.
    ref = attention(q.bfloat16().double(), _dequantized(kq, ks), _dequantized(vq, vs))
    assert_close(out, ref)


def _quantized_arguments() -> tuple[tuple[object, ...], dict[str, object]]:
    q, kq, vq, ks, vs = _quantized_call(torch.int8, 2, 4, 2, 3, 45)
    spec, dense, terms = plan_call(
        q, kq, vq, mask=masks.sliding_window(7), bias=None, scale=0.3, softcap=5.0, block_q=8
    )
    assert decodes(spec.plan)
    args, kwargs = native_arguments(spec, q, kq, vq, dense, terms)
    scales = tuple(s.expand(2, 2, 45, 1)[..., 0].contiguous() for s in (ks, vs))
    return (*args, *scales), kwargs


def test_opcheck_native_forward_on_quantized_keys_and_values() -> None:
    args, kwargs = _quantized_arguments()
    torch.library.opcheck(torch.ops.attnkit.native_forward.default, args, kwargs)


def test_the_operator_refuses_quantized_keys_and_values_it_cannot_read() -> None:
    args, kwargs = _quantized_arguments()
    op = torch.ops.attnkit.native_forward
    with pytest.raises(RuntimeError, match="Char keys and values take k_scale and v_scale"):
        op(*args[:10], **kwargs)
    with pytest.raises(RuntimeError, match=r"k_scale must be float32 \(2, 2, 45\)"):
        op(*args[:10], args[10][..., :44], args[11], **kwargs)  # type: ignore[index]
    with pytest.raises(RuntimeError, match="k_scale is for int8/float8 k, got k of Float"):
        op(args[0], args[1].float(), args[2].float(), *args[3:], **kwargs)  # type: ignore[union-attr]
    many = {**kwargs, "block_q": 2}  # two query blocks: the blocked forward's call
    with pytest.raises(RuntimeError, match="read on the decode path alone"):
        op(*args, **many)
    # No backward through the operator itself (the kernel's autograd entries run the backward
    # operator, on keys and values dequantized first): torch says so on a backward through it.
    q = args[0].requires_grad_()  # type: ignore[union-attr]
    out, _ = op(q, *args[1:], **kwargs)
    with pytest.warns(UserWarning, match="an autograd kernel was not registered"):
        out.sum().backward()


def _pool(x: torch.Tensor, table: torch.Tensor | None, token_major: bool) -> torch.Tensor:
    """``x (N, Hkv, L, ...)`` as the kernel reads a cache: a page a row, or pages of 16 keys in
    a pool through ``table``; token-major: ``(X, page, Hkv, ...)`` memory (flash-attn's)."""
    if table is None:
        return x
    n, hkv, length = x.shape[:3]
    rest = x.shape[3:]
    pages = x.reshape(n, hkv, length // 16, 16, *rest).transpose(1, 2).reshape(-1, hkv, 16, *rest)
    pool = torch.empty_like(pages)
    pool[table.flatten()] = pages
    return pool.transpose(1, 2).contiguous().transpose(1, 2) if token_major else pool


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("layout", ["rows", "pages", "token-major pages"])
def test_quantized_caches_are_read_in_place(dtype: torch.dtype, layout: str) -> None:
    # native_cache_forward's rows (each a stretch of its keys, its queries aligned to the end)
    # on int8/float8 pages with a scale per token: against the same call on the dequantized keys
    # and values in float64.
    n, length = 3, 96
    q, k, v = _inputs(n, 8, 2, 2, length, dk=32, dv=24, seed=5)
    (kq, ks), (vq, vs) = _quantize(k, dtype), _quantize(v, dtype)
    table = None
    if layout != "rows":
        table = torch.randperm(n * 6, generator=torch.Generator().manual_seed(2)).view(n, 6)
    major = layout == "token-major pages"
    kp, vp = _pool(kq, table, major), _pool(vq, table, major)
    ksp, vsp = _pool(ks[..., 0], table, False), _pool(vs[..., 0], table, False)
    q5 = q.float().view(n, 2, 4, 2, 32)
    ranges = torch.tensor([[0, 96], [5, 70], [30, 31]])
    kw: dict[str, Any] = {"scale": 0.3, "band": [-40.0, 0.0], "softcap": 3.0}
    out, lse = torch.ops.attnkit.native_cache_forward(
        q5, kp, vp, table, ranges, None, None, None, ksp, vsp, **kw
    )
    kd, vd = ((x.float() * s[..., None]).double() for x, s in ((kp, ksp), (vp, vsp)))
    ref, ref_lse = torch.ops.attnkit.native_cache_forward(q5.double(), kd, vd, table, ranges, **kw)
    assert _rel(out, ref) <= 1e-5
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_opcheck_native_cache_forward_on_quantized_pages() -> None:
    q, k, v = _inputs(2, 4, 2, 1, 32, dk=16, dv=8, seed=9)
    # (int8: torch's schema check multiplies the inputs, which float8 tensors do not support)
    (kq, ks), (vq, vs) = _quantize(k, torch.int8), _quantize(v, torch.int8)
    table = torch.tensor([[3, 0], [1, 2]])
    args = (
        q.float().view(2, 2, 2, 1, 16),
        _pool(kq, table, False),
        _pool(vq, table, False),
        table,
        torch.tensor([[0, 32], [4, 20]]),
        None,
        None,
        None,
        _pool(ks[..., 0], table, False),
        _pool(vs[..., 0], table, False),
    )
    torch.library.opcheck(torch.ops.attnkit.native_cache_forward.default, args, {"scale": 0.3})


# Many query rows of one key/value head (more than the 8 an item takes as dot products): with keys
# and values of another dtype than the products', both products run on blocks of them converted
# once and read by every row (csrc/decode_group.h). (H, Hkv, Tq): 16 heads sharing one (absorbed
# latent attention), 9, 13 and 20 of one (blocks of rows of 4 and 8 with 1, 5 and 4 left), 12 of
# two, 3 heads of 16 queries (48 rows), one head of 9 queries.
GROUPS = [(16, 1, 1), (9, 1, 1), (13, 1, 1), (20, 1, 1), (24, 2, 1), (3, 1, 16), (1, 1, 9)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", [(40, 24), (72, 40), (33, 17)])  # (Dk, Dv), not all of 32
@pytest.mark.parametrize("mask", ["none", "causal", "window", "padding", "tiles"])
@pytest.mark.parametrize("group", GROUPS)
def test_many_rows_of_one_head_equal_the_reference(
    group: tuple[int, int, int], mask: str, dims: tuple[int, int], dtype: torch.dtype
) -> None:
    # 77 keys: blocks of 4 keys and of 16 values with some left over.
    h, hkv, tq = group
    dk, dv = dims
    b, tk = 2, 77
    q, k, v = (t.to(dtype) for t in _inputs(b, h, hkv, tq, tk, dk, dv, seed=h + tq))
    g = torch.Generator().manual_seed(5)
    kw: dict[str, Any] = {
        "mask": MASKS[mask](b, tk),
        "softcap": 4.0,
        "bias": torch.randn(h, tq, tk, generator=g).to(dtype),
        "sinks": torch.randn(h, generator=g).to(dtype),
        "scale": 0.3,
    }
    got = attention(q, k, v, backend=DECODE, return_lse=True, **kw)
    wide = {**kw, "bias": kw["bias"].double(), "sinks": kw["sinks"].double()}
    want = attention(
        q.double(), k.double(), v.double(), backend="reference", return_lse=True, **wide
    )
    # The products are float32 sums of exact products; only the output is rounded to the inputs'
    # dtype (2^-9 relative in bfloat16), far inside bfloat16's tolerance of 3e-2.
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-3
    torch.testing.assert_close(got[0].double(), want[0], atol=tol, rtol=tol)
    torch.testing.assert_close(got[1].double(), want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_many_rows_of_one_head_split_by_keys(threads: int) -> None:
    # The absorbed latent attention's shape at a small size: 16 heads share one key head whose
    # values are the first columns of the keys; a long cache split into parts by keys.
    q, k, _ = (t.to(torch.bfloat16) for t in _inputs(1, 16, 1, 1, 3000, dk=80, dv=8, seed=3))
    v = k[..., :64]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = attention(q, k, v, backend=DECODE, return_lse=True, mask=masks.sliding_window(2500))
    finally:
        torch.set_num_threads(before)
    want = attention(
        q.double(), k.double(), v.double(), backend="reference", return_lse=True,
        mask=masks.sliding_window(2500),
    )  # fmt: skip
    torch.testing.assert_close(got[0].double(), want[0], atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(got[1].double(), want[1], atol=1e-5, rtol=1e-5)
