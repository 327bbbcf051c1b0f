"""flash-attn's ``alibi_slopes`` (``attnkit.flash_attn._alibi``): attnkit's one ALiBi, a bias by
distance the native kernel reads, for plain calls, KV caches with rows of several lengths and
packed sequences; per-sequence slopes as a term of the same formula; all against flash-attn's
semantics written out in float64."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import _native
from attnkit import flash_attn as fa
from attnkit.flash_attn._alibi import SequenceALiBi, alibi, varlen_alibi
from attnkit.scores import DistanceBias
from attnkit.testing import assert_close

from .helpers import cu, grads, reference

needs_native = pytest.mark.skipif(
    _native.load() is None, reason=f"native kernel unavailable: {_native.status()[1]}"
)


def _randn(*shape: int, g: torch.Generator) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


@needs_native
@pytest.mark.parametrize("per_row", [False, True], ids=["slopes (H,)", "slopes (B, H)"])
@pytest.mark.parametrize(("tq", "tk"), [(37, 37), (9, 70), (70, 9)])
def test_flash_attn_func_alibi_runs_in_the_native_kernel_and_equals_the_reference(
    per_row: bool, tq: int, tk: int
) -> None:
    g = torch.Generator().manual_seed(tq * 100 + tk)
    q, k, v = _randn(2, tq, 4, 16, g=g), _randn(2, tk, 2, 16, g=g), _randn(2, tk, 2, 16, g=g)
    slopes = torch.rand((2, 4) if per_row else (4,), generator=g, dtype=torch.float64)
    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
    with attnkit.record_dispatch() as calls:
        out = fa.flash_attn_func(*leaves, causal=True, alibi_slopes=slopes)
    (call,) = calls
    assert isinstance(call.call.score_term, DistanceBias)
    assert call.kernel is not None
    assert call.kernel.startswith("native kernel")  # the cache read in place
    want, _ = reference(*(t.clone().requires_grad_() for t in (q, k, v)), causal=True,
                        slopes=slopes)  # fmt: skip
    assert_close(out, want)
    weight = _randn(*want.shape, g=g)
    wants = [t.clone().requires_grad_() for t in (q, k, v)]
    want, _ = reference(*wants, causal=True, slopes=slopes)
    for got, w in zip(grads(out, leaves, weight), grads(want, tuple(wants), weight), strict=True):
        assert_close(got, w)


@needs_native
def test_explain_says_the_native_kernel_serves_flash_attns_alibi() -> None:
    q, k, v = (torch.randn(1, 4, 40, 16) for _ in range(3))
    bias = alibi(torch.rand(4), 4, 1, torch.float32, 40, 40)
    text = str(attnkit.explain(q, k, v, bias=bias, causal=True))
    assert "auto picks: chunked" in text
    assert "native kernel" in text


@needs_native
def test_a_kv_cache_of_rows_of_several_lengths_takes_alibi_in_the_native_kernel() -> None:
    # Rows that hold 5, 0 and 17 tokens before 2 new ones: their queries sit at their own last
    # keys, not at the call's, so each row's distances are shifted by as much.
    g = torch.Generator().manual_seed(31)
    batch, heads, hkv, d, new = 3, 4, 2, 8, 2
    k_cache, v_cache = _randn(batch, 24, hkv, d, g=g), _randn(batch, 24, hkv, d, g=g)
    q, k, v = (
        _randn(batch, 2, heads, d, g=g),
        _randn(batch, new, hkv, d, g=g),
        _randn(batch, new, hkv, d, g=g),
    )
    slopes = torch.rand(batch, heads, generator=g, dtype=torch.float64)
    seen = torch.tensor([5, 0, 17], dtype=torch.int32)
    before = k_cache.clone(), v_cache.clone()
    with attnkit.record_dispatch() as calls:
        out = fa.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=seen, causal=True, alibi_slopes=slopes
        )
    (call,) = calls
    assert isinstance(call.call.score_term, DistanceBias)
    assert call.kernel is not None
    assert call.kernel.startswith("native kernel")  # the cache read in place
    for b, n in enumerate(seen.tolist()):
        keys = torch.cat([before[0][b, :n], k[b]])[None]
        values = torch.cat([before[1][b, :n], v[b]])[None]
        want, _ = reference(q[b : b + 1], keys, values, causal=True, slopes=slopes[b])
        assert_close(out[b], want[0])


@pytest.mark.parametrize(
    ("lq", "lk", "per_sequence", "native"),
    [
        ([5, 0, 9, 3], [5, 0, 9, 3], False, True),  # documents: one alignment
        ([4, 2, 7], [6, 2, 7], False, True),  # more keys in the first: still one alignment
        ([4, 2, 7], [9, 2, 12], False, False),  # alignments differ
        ([5, 9, 3], [5, 9, 3], True, False),  # a row of slopes per sequence
    ],
)
def test_packed_sequences_take_a_bias_by_distance_where_one_serves_them_all(
    lq: list[int], lk: list[int], per_sequence: bool, native: bool
) -> None:
    g = torch.Generator().manual_seed(sum(lq) * 7 + sum(lk))
    heads = 4
    q, k, v = _randn(sum(lq), heads, 8, g=g), _randn(sum(lk), 2, 8, g=g), _randn(sum(lk), 2, 8, g=g)
    shape = (len(lq), heads) if per_sequence else (heads,)
    slopes = torch.rand(shape, generator=g, dtype=torch.float64)
    term = varlen_alibi(slopes, heads, lq, lk, torch.float64)
    assert isinstance(term, DistanceBias if native else SequenceALiBi)
    with attnkit.record_dispatch() as calls:
        out = fa.flash_attn_varlen_func(q, k, v, cu(lq), cu(lk), causal=True, alibi_slopes=slopes)
    if native and _native.load() is not None:
        assert calls[-1].kernel == "native kernel"
    parts = []
    for s, (a, b, c, e) in enumerate(zip(cu(lq), cu(lq)[1:], cu(lk), cu(lk)[1:], strict=False)):
        seq_slopes = slopes[s] if per_sequence else slopes
        want, _ = reference(q[a:b][None], k[c:e][None], v[c:e][None], causal=True,
                            slopes=seq_slopes)  # fmt: skip
        parts.append(want[0])
    assert_close(out, torch.cat(parts))


def test_the_slopes_gradient_reaches_the_slopes_through_the_table() -> None:
    g = torch.Generator().manual_seed(32)
    q, k, v = _randn(1, 12, 2, 8, g=g), _randn(1, 12, 2, 8, g=g), _randn(1, 12, 2, 8, g=g)
    slopes = torch.rand(2, generator=g, dtype=torch.float64).requires_grad_()
    out = fa.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    (got,) = torch.autograd.grad(out.sum(), slopes)
    ref_slopes = slopes.detach().clone().requires_grad_()
    want, _ = reference(q, k, v, causal=True, slopes=ref_slopes)
    (expected,) = torch.autograd.grad(want.sum(), ref_slopes)
    assert_close(got, expected)
