"""The native CPU kernel: equal to the float64 reference, honest about itself, dropout in O(T)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import _native, attention, masks, scores
from attnkit._kernel import draw_seed, dropout_mask
from attnkit._kernel.planning import block_plan
from attnkit._native.build import capability
from attnkit._native.kernel import native_call
from attnkit.backends import Chunked
from attnkit.masks import Geometry
from attnkit.scores import RelativePositionTerm
from attnkit.testing import assert_close

AVAILABLE, WHY = _native.status()
needs_native = pytest.mark.skipif(not AVAILABLE, reason=f"native kernel: {WHY}")


@pytest.mark.skipif(
    not os.environ.get("CI") or os.environ.get("ATTNKIT_NATIVE") == "0",
    reason="CI builds the native kernel; elsewhere a machine may lack a compiler",
)
def test_ci_builds_the_native_kernel() -> None:
    # Every native test skips when the kernel is unavailable: CI must not pass that way.
    assert AVAILABLE, WHY


def small(native: bool = True) -> Chunked:
    return Chunked(block_q=8, block_k=16, native=native)


MASKS = {
    "none": None,
    "causal": masks.causal(),
    "top-left causal": masks.causal(align="top_left"),
    "window": masks.sliding_window(5, 2),
    "padding": masks.key_padding([13, 0]),  # the second row sees no key at all
    "padding & causal": masks.key_padding([30, 9]) & masks.causal(),
    "documents": masks.documents([[10, 20, 7], [37]]),
    "same documents": masks.documents([10, 0, 20, 7]),  # every row: FULL visits, no tiles
    "same documents & causal": masks.documents([10, 0, 20, 7]) & masks.causal(),
    "from_fn": masks.from_fn(lambda b, h, i, j: (i + j + h) % 3 != 0),
}


def laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A (B, H, T, D) leaf of ``t``'s values at another layout: "token-major" is a transposed view
    of (B, T, H, D) memory (what projections give), "packed" a slice of a wider last dimension
    (as q, k, v split from one qkv projection). Leaves of other shapes stay as they are."""
    if t.dim() != 4 or layout == "contiguous":
        return t
    if layout == "token-major":
        return t.detach().transpose(1, 2).contiguous().transpose(1, 2)
    wide = torch.zeros(*t.shape[:-1], 3 * t.size(-1), dtype=t.dtype)
    wide[..., t.size(-1) : 2 * t.size(-1)] = t.detach()
    return wide.transpose(1, 2).contiguous().transpose(1, 2)[..., t.size(-1) : 2 * t.size(-1)]


def grads_of(
    backend: object, dtype: torch.dtype, seed: int = 0, tq: int = 30, tk: int = 37, **kw: object
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, tq, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, tk, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, tk, 6, generator=g, dtype=torch.float64)
    extra = {}
    if kw.pop("with_bias", False):
        extra["bias"] = torch.randn(4, tq, tk, generator=g, dtype=torch.float64)
    if kw.pop("with_sinks", False):
        extra["sinks"] = torch.randn(4, generator=g, dtype=torch.float64)
    cot = torch.randn(2, 4, tq, 6, generator=g, dtype=torch.float64)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, *extra.values())]
    named = dict(zip(extra, leaves[3:], strict=True))
    out = attention(*leaves[:3], backend=backend, **named, **kw)  # type: ignore[arg-type]
    return [out, *torch.autograd.grad(out, leaves, cot.to(dtype), materialize_grads=True)]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", list(MASKS))
def test_native_equals_reference(mask: str, dtype: torch.dtype) -> None:
    kw = {"mask": MASKS[mask], "softcap": 4.0, "with_bias": True, "with_sinks": True}
    got = grads_of(small(), dtype, **kw)
    want = grads_of("reference", torch.float64, **kw)
    for a, b in zip(got, want, strict=True):
        assert a.isfinite().all()
        assert_close(a, b, dtype=dtype)


@needs_native
def test_rows_without_keys_are_zero_with_zero_gradients() -> None:
    out, dq, dk, dv = grads_of(small(), torch.float32, mask=masks.key_padding([13, 0]))
    assert out[1].abs().max() == 0
    assert dq[1].abs().max() == 0
    assert dk[1].abs().max() == 0
    assert dv[1].abs().max() == 0


@needs_native
def test_query_blocks_the_plan_skips_get_zero_gradients() -> None:
    # 40 queries, 10 keys, bottom-right causal: queries 0..29 see no key, and their blocks of 8
    # are not visited at all (the gradient buffer must not keep what memory held before).
    q = torch.randn(1, 2, 40, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 10, 8, requires_grad=True) for _ in range(2))
    out = attention(q, k, v, causal=True, backend=small())
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert out[:, :, :30].abs().max() == 0
    assert dq[:, :, :30].abs().max() == 0
    want = attention(q, k, v, causal=True, backend="reference")
    assert_close(dq, torch.autograd.grad(want.sum(), q)[0])


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_thread_counts_give_the_same_result(threads: int) -> None:
    # One key/value head per call: the backward splits its query blocks into stretches with
    # their own dk/dv buffers, summed at the end; several heads take the in-place path.
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        g = torch.Generator().manual_seed(4)
        for shape in [(1, 1, 70, 8), (2, 4, 70, 8)]:
            q, k, v = (torch.randn(*shape, generator=g).requires_grad_() for _ in range(3))
            got = attention(q, k, v, causal=True, backend=small())
            grads = torch.autograd.grad(got.square().sum(), (q, k, v))
            want = attention(*(t.double() for t in (q, k, v)), causal=True, backend="reference")
            wants = torch.autograd.grad(want.square().sum(), (q, k, v))
            assert_close(got, want)
            for a, b in zip(grads, wants, strict=True):
                assert_close(a, b)
    finally:
        torch.set_num_threads(before)


@needs_native
@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("dims", [(8, 8), (17, 5), (64, 64), (72, 100), (130, 33)])
def test_products_in_register_tiles_equal_the_blas(tiles: bool, dims: tuple[int, int]) -> None:
    # In float32 on AVX-512 the kernel runs its products in its own register tiles: columns in
    # 4-vector and 1-vector stretches and a masked rest, rows in tiles of 6 and a rest, keys and
    # values packed into panels of 16 keys for query blocks of 16 rows or more. Both paths must
    # equal the float64 reference: 70 rows in blocks of 32 leave rests of every kind, a window
    # makes triangle visits of few rows, documents visits that start off the panels' grid (the
    # BLAS computes those), and two query heads share each key/value head's panels.
    dk, dv = dims
    g = torch.Generator().manual_seed(dk * 1000 + dv)
    q = torch.randn(2, 4, 70, dk, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 61, dk, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 61, dv, generator=g, dtype=torch.float64)
    cot = torch.randn(2, 4, 70, dv, generator=g, dtype=torch.float64)
    for mask in (None, masks.sliding_window(20, 3), masks.documents([23, 38])):
        leaves = [laid_out(t.float(), "token-major").requires_grad_() for t in (q, k, v)]
        got = attention(
            *leaves, mask=mask, backend=Chunked(block_q=32, block_k=32, register_tiles=tiles)
        )
        grads = torch.autograd.grad(got, leaves, cot.float())
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        want = attention(*ref, mask=mask, backend="reference")
        wants = torch.autograd.grad(want, ref, cot)
        for a, b in zip((got, *grads), (want, *wants), strict=True):
            assert_close(a, b, dtype=torch.float32)


def _with_position(
    ts: list[torch.Tensor],
    backend: object,
    *,
    mask: masks.Mask | None,
    softcap: float | None,
    whole: int,
    cot: torch.Tensor,
) -> list[torch.Tensor]:
    """attention(q, k, v) with the position term of (qv, enc) = ts[3:], and its gradients."""
    leaves = [t.requires_grad_() for t in ts]
    term = RelativePositionTerm(leaves[3], leaves[4], 0.7, whole_width=whole)
    out = attention(*leaves[:3], mask=mask, bias=term, softcap=softcap, backend=backend)  # type: ignore[arg-type]
    return [out, *torch.autograd.grad(out, leaves, cot.to(out.dtype))]


@needs_native
@pytest.mark.parametrize(
    ("tiles", "fuse", "whole"),
    [
        (True, True, 2048),
        (True, False, 0),
        (True, False, 2048),
        (False, False, 0),
        (False, False, 2048),
    ],
    ids=["skewed", "tiles per visit", "tiles per block", "blas per visit", "blas per block"],
)
def test_position_term_in_register_tiles(tiles: bool, fuse: bool, whole: int) -> None:
    # Transformer-XL's position term on every path: added by the skewed register tiles (its
    # gradients too), or as a product per visit (whole=0) or per block in the tiles or the BLAS.
    # 70 queries in blocks of 32 leave row rests of every size under 6 (the skewed tiles' groups),
    # 61 keys visits of 32 and 29; a window, causal, documents and key padding make partial
    # visits, a softcap comes before the term, and two query heads share each key/value head.
    g = torch.Generator().manual_seed(whole + tiles + 2 * fuse)
    q, qv = (torch.randn(2, 4, 70, 24, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, 61, 24, generator=g, dtype=torch.float64) for _ in range(2))
    enc = torch.randn(4, 70 + 61 - 1, 24, generator=g, dtype=torch.float64)
    cot = torch.randn(2, 4, 70, 24, generator=g, dtype=torch.float64)
    tensors = [q, k, v, qv, enc]
    tiled = Chunked(block_q=32, block_k=32, register_tiles=tiles, skewed_position=fuse)
    cases = [
        (None, None),
        (masks.sliding_window(20, 3), None),
        (masks.causal(), None),
        (masks.documents([23, 38]) & masks.key_padding([61, 50]), None),
        (None, 5.0),
        (masks.sliding_window(20, 3), 5.0),
    ]
    for mask, softcap in cases:
        kw = {"mask": mask, "softcap": softcap, "whole": whole, "cot": cot}
        got = _with_position([t.float() for t in tensors], tiled, **kw)
        want = _with_position([t.clone() for t in tensors], "reference", **kw)
        for name, a, b in zip(("out", "dq", "dk", "dv", "dqv", "denc"), got, want, strict=True):
            try:
                assert_close(a, b, dtype=torch.float32)
            except AssertionError as err:
                raise AssertionError(f"{mask}, softcap {softcap}: {name}: {err}") from None
        if fuse and mask is None and softcap is None and capability() == "AVX512":
            # The skewed tiles (AVX-512 only) sum the term in another order than a window's
            # product: equal bits would mean that this case never took them.
            windows = Chunked(block_q=32, block_k=32, skewed_position=False)
            other = _with_position([t.float() for t in tensors], windows, **kw)
            assert not torch.equal(got[0], other[0])  # (the output: each row has one owner)


@needs_native
@pytest.mark.parametrize("fuse", [True, False])
def test_position_gradients_come_in_the_callers_layout(fuse: bool) -> None:
    # As RelativeMultiHeadAttention hands them over: qv a (B, H, T, D) view of token-major memory,
    # enc an (H, P, D) view of (P, H, D) memory. The gradients come back in the same layouts (the
    # transposes back are then free) and equal the reference's, also for the 200 queries that see
    # no key (bottom-right causal, 300 queries, 100 keys): blocks the plan never visits, whose dqv
    # rows must be zeros, not what the memory held before.
    g = torch.Generator().manual_seed(5)
    q, qv = (torch.randn(1, 300, 4, 16, generator=g).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(1, 100, 4, 16, generator=g).transpose(1, 2) for _ in range(2))
    enc = torch.randn(399, 4, 16, generator=g).transpose(0, 1)
    cot = torch.randn(1, 4, 300, 16, generator=g)

    def run(backend: object, dtype: torch.dtype) -> list[torch.Tensor]:
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, qv, enc)]
        if dtype == torch.float32:  # layouts as above (to() keeps them)
            assert leaves[3].transpose(1, 2).is_contiguous()
            assert leaves[4].transpose(0, 1).is_contiguous()
        term = RelativePositionTerm(leaves[3], leaves[4], 0.5)
        out = attention(*leaves[:3], bias=term, causal=True, backend=backend)  # type: ignore[arg-type]
        torch.full((4 * 300 * 16,), float("nan")).sum()  # freed memory of dqv's size, NaN
        return [out, *torch.autograd.grad(out, leaves, cot.to(dtype))]

    got = run(Chunked(block_q=32, block_k=32, skewed_position=fuse), torch.float32)
    want = run("reference", torch.float64)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dqv", "denc"), got, want, strict=True):
        try:
            assert_close(a, b, dtype=torch.float32)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
    dqv, denc = got[4], got[5]
    assert dqv[:, :, :200].abs().max() == 0
    assert dqv.transpose(1, 2).is_contiguous()
    assert denc.transpose(0, 1).is_contiguous()
    # One table for every head: an expanded view (head stride 0) is read as it is, and its
    # gradient is the sum over the heads.
    shared = enc[:1].detach().clone()
    for dtype in (torch.float32, torch.float64):
        base = shared.to(dtype).requires_grad_()
        term = RelativePositionTerm(qv.to(dtype), base.expand(4, -1, -1), 0.5)
        backend = (
            Chunked(block_q=32, block_k=32, skewed_position=fuse)
            if dtype == torch.float32
            else "reference"
        )
        out = attention(q.to(dtype), k.to(dtype), v.to(dtype), bias=term, backend=backend)  # type: ignore[arg-type]
        (grad,) = torch.autograd.grad(out, base, cot.to(dtype))
        if dtype == torch.float32:
            got_out, got_grad = out, grad
    assert_close(got_out, out, dtype=torch.float32)
    assert_close(got_grad, grad, dtype=torch.float32)


@needs_native
@pytest.mark.parametrize("fuse", [True, False])
def test_a_pair_beyond_the_position_table_gets_no_term(fuse: bool) -> None:
    # A table of 10 distances (4 .. -5) and a band whose pairs lie 20 .. 40 before their query:
    # every visible pair is beyond the table and gets the term 0, so an infinite qv changes
    # nothing. The skewed tiles would multiply it by their zeros outside the table (inf * 0 =
    # NaN): those visits take the per-visit product, which leaves such pairs out. With a table
    # of every distance the same qv row sees infinite terms: its row is NaN, as in the
    # reference (not the zeros of a row that sees no key).
    g = torch.Generator().manual_seed(11)
    q, k, v, qv = (torch.randn(1, 2, 70, 16, generator=g) for _ in range(4))
    enc = torch.randn(2, 10, 16, generator=g)
    qv[0, 1, 50] = float("inf")
    far = masks.sliding_window(40, -20)
    for mask, top in ((far, 4), (masks.causal(), 69)):
        table = enc if top == 4 else torch.randn(2, 70, 16, generator=g)
        term = RelativePositionTerm(qv, table, 0.5, max_distance=top)
        got = attention(
            q,
            k,
            v,
            mask=mask,
            bias=term,
            backend=Chunked(block_q=32, block_k=32, skewed_position=fuse),
        )
        want = attention(q, k, v, mask=mask, bias=term, backend="reference")
        assert got[0, 1, 50].isfinite().all() == want[0, 1, 50].isfinite().all() == (top == 4)
        got[0, 1, 50] = want[0, 1, 50] = 0  # NaN in both where top != 4
        assert_close(got, want, dtype=torch.float32)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("softcap", [1e-3, 0.5, 30.0, 1e4, 3e38, 1.5e308])
def test_softcap_is_exact_across_tanhs_range(softcap: float, dtype: torch.dtype) -> None:
    # Rows of 64 keys run the kernel's vector tanh. Row i's scores reach about 10^(-5 + i/5)
    # caps (at most 300): from far below 1, where 1 - 2 / (exp(2y) + 1) would cancel, to deep in
    # tanh's flat ends, beyond 9, where float32's tanh is 1. Caps of 3e38 and 1.5e308 overflow
    # the dtype when multiplied by log2(e).
    if softcap > torch.finfo(dtype).max:
        pytest.skip("a cap above the dtype's largest number is no cap")
    g = torch.Generator().manual_seed(5)
    t, d = 40, 4
    k = torch.randn(1, 1, 64, d, generator=g, dtype=torch.float64)
    unit = torch.randn(1, 1, t, d, generator=g, dtype=torch.float64)
    unit = unit / unit.norm(dim=-1, keepdim=True)
    reach = 10.0 ** (-5 + torch.arange(t, dtype=torch.float64) / 5)  # in caps
    amplitude = torch.clamp(reach * softcap, max=300.0) / k.norm(dim=-1).max()
    q = unit * amplitude[:, None] * d**0.5
    v = torch.randn(1, 1, 64, 3, generator=g, dtype=torch.float64)
    cot = torch.randn(1, 1, t, 3, generator=g, dtype=torch.float64)

    def run(backend: object, dt: torch.dtype, k: torch.Tensor = k) -> list[torch.Tensor]:
        leaves = [x.to(dt).requires_grad_() for x in (q, k, v)]
        out = attention(*leaves, softcap=softcap, backend=backend)  # type: ignore[arg-type]
        return [out, *torch.autograd.grad(out, leaves, cot.to(dt))]

    how = attnkit.explain(*(x.to(dtype) for x in (q, k, v)), softcap=softcap, backend=Chunked())
    assert "native kernel" in str(how)
    got, want = run(Chunked(), dtype), run("reference", torch.float64)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        try:
            assert_close(a, b, dtype=dtype)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
    # An infinite score is capped to +-softcap like any other (in both kernels); a NaN one makes
    # its rows NaN.
    bad = k.clone()
    bad[..., 9, 0] = float("inf")
    want = run("reference", torch.float64, bad)[0]
    for backend in (Chunked(), Chunked(native=False)):
        assert_close(run(backend, dtype, bad)[0], want, dtype=dtype)
    bad[..., 7, 0] = float("nan")
    assert run(Chunked(), dtype, bad)[0].isnan().all()


LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # (2, 37, 3, 4, 16) memory seen as a call brings it
    "contiguous": lambda m: m,
    "token-major": lambda m: m[:, :, 0].transpose(1, 2),
    "packed": lambda m: m[:, :, 1].transpose(1, 2),
    "every other column": lambda m: m[..., ::2],
    "rows of 2368": lambda m: m.reshape(-1, 2368)[:, 100:],
    "broadcast": lambda m: m[:1, :1, :1, :1].expand(2, 5, 3, 4, 16),
}


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_finiteness_check_finds_a_bad_element_anywhere(layout: str, dtype: torch.dtype) -> None:
    # attnkit._base.finite.finite runs in the native kernel once it is loaded: one bad element
    # anywhere in a view is found, and values near the dtype's largest number (which a sum
    # overflows) are finite.
    from attnkit._base.finite import finite

    g = torch.Generator().manual_seed(3)
    other = torch.randn(4, 16, generator=g, dtype=dtype)
    memory = torch.randn(2, 37, 3, 4, 16, generator=g, dtype=dtype)
    assert finite(other, LAYOUTS[layout](memory))
    for trial in range(30):
        view = LAYOUTS[layout](memory.clone())
        at = tuple(int(torch.randint(s, (1,), generator=g)) for s in view.shape)
        view[at] = (float("nan"), float("inf"), -float("inf"))[trial % 3]
        assert not finite(other, view), (at, view[at])
    big = torch.finfo(dtype).max / 2
    assert finite(LAYOUTS[layout](torch.full_like(memory, big)), other.fill_(-big))


def _grads_with_bias(
    backend: object, ts: list[torch.Tensor], cot: torch.Tensor
) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in ts]
    out = attention(*leaves[:3], bias=leaves[3], causal=True, backend=backend)  # type: ignore[arg-type]
    return list(torch.autograd.grad(out, leaves, cot))


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "shape",
    [(1, 4, 30, 37), (2, 1, 30, 37), (30, 37), (2, 4, 1, 37), (37,), (2, 4, 30, 37)],
    ids=["over batch", "over heads", "over both", "over queries", "keys only", "full"],
)
def test_a_broadcast_bias_gets_the_summed_gradient(shape: tuple[int, ...], threads: int) -> None:
    # The kernel adds the bias gradient into a buffer of the bias's own shape: items of other
    # batch rows, heads or query stretches add to the same elements (one key/value head of one
    # batch row below is split into stretches of query blocks).
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        g = torch.Generator().manual_seed(5)
        for b, hkv in [(2, 2), (1, 1)]:
            bias = torch.randn(shape, generator=g, dtype=torch.float64)
            if b == 1 and len(shape) == 4:
                bias = bias[:1]
            q = torch.randn(b, 4, 30, 8, generator=g, dtype=torch.float64)
            k, v = (torch.randn(b, hkv, 37, 8, generator=g, dtype=torch.float64) for _ in "kv")
            cot = torch.randn(b, 4, 30, 8, generator=g, dtype=torch.float64)
            got = _grads_with_bias(small(), [t.float() for t in (q, k, v, bias)], cot.float())
            want = _grads_with_bias("reference", [q, k, v, bias], cot)
            assert got[3].shape == bias.shape
            for a, w in zip(got, want, strict=True):
                assert_close(a, w, dtype=torch.float32)
    finally:
        torch.set_num_threads(before)


def test_packed_documents_need_no_tiles() -> None:
    # 40 queries (shift 3: query i is in the document of key i + 3) in blocks of 8 against keys
    # in blocks of 16: the cut blocks become one FULL visit per document, rows and keys clipped.
    mask = masks.documents([5, 0, 20, 18])
    geo = Geometry((2,), 4, 40, 43, torch.device("cpu"))
    plan = block_plan(mask, geo, native=True, block_q=8, block_k=16)
    call = native_call(plan, geo, scale=1.0, softcap=None, dtype=torch.float32)
    assert call.tiles is None
    visits = call.visits.tolist()
    assert all(partial == 0 for *_, partial, _ in visits)
    # Query block 0 (queries 0:8, keys 3:11): document 0 (keys 0:5) for rows 0:2, document 2
    # (keys 5:25, in two key blocks) for rows 2:8.
    want = [[0, 5, 0, 2, 0, -1], [5, 16, 2, 8, 0, -1], [16, 25, 2, 8, 0, -1]]
    assert visits[: call.off[1]] == want
    dense = mask.dense(40, 43)[0, 0]
    covered = torch.zeros(40, 43, dtype=torch.bool)
    for b in range(len(call.off) - 1):
        for ks, ke, r0, r1, _, _ in visits[call.off[b] : call.off[b + 1]]:
            assert not covered[b * 8 + r0 : b * 8 + r1, ks:ke].any()  # no pair twice
            covered[b * 8 + r0 : b * 8 + r1, ks:ke] = True
    assert torch.equal(covered, dense)


@pytest.mark.parametrize(
    "mask",
    [
        masks.sliding_window(37),
        masks.sliding_window(20, 9),
        masks.causal(),
        masks.causal("top_left"),
        masks.documents([40, 0, 70, 60]) & masks.causal(),
        masks.sliding_window(20, 9) & masks.documents([40, 0, 70, 60]),
    ],
)
def test_band_visits_cover_every_visible_pair_once(mask: masks.Mask) -> None:
    # A band's visits are cut at its edges (and at the documents' bounds), not at key blocks:
    # FULL visits hold visible pairs only, partial ones at most one block of keys, every visible
    # pair is in exactly one visit, fewer pairs are computed than the plan's key blocks hold,
    # and no tile is needed.
    _check_band_visits(mask, 150, 170, 32, 48)


@pytest.mark.parametrize(
    ("mask", "most"),
    [
        (masks.sliding_window(300, 40), 1.12),
        (masks.sliding_window(512), 1.08),
        (masks.causal(), 1.08),
    ],
)
def test_band_triangles_are_cut_into_stretches_of_rows(mask: masks.Mask, most: float) -> None:
    # The native kernel's 128-row blocks: each triangle at a band's edge is one visit per 64
    # keys of the band's width, of at least 16 rows (5, 8 and 8 here). They compute at most
    # `most` times the pairs the band holds; halves of 64 rows compute 1.18, 1.13 and 1.10 times
    # (a window of 512 at T=65536: 1.029 against 1.123).
    computed, visible = _check_band_visits(mask, 600, 700, 128, 256)
    assert computed < most * visible


def _check_band_visits(mask: masks.Mask, tq: int, tk: int, bq: int, bk: int) -> tuple[int, int]:
    """Check a band's visits (see above); ``(pairs computed, pairs visible)``."""
    geo = Geometry((1,), 2, tq, tk, torch.device("cpu"))
    plan = block_plan(mask, geo, native=True, block_q=bq, block_k=bk)
    call = native_call(plan, geo, scale=1.0, softcap=None, dtype=torch.float32)
    assert call.tiles is None
    dense = mask.dense(tq, tk)[0, 0]
    count = torch.zeros(tq, tk, dtype=torch.int64)
    computed = 0
    for b in range(len(call.off) - 1):
        for ks, ke, r0, r1, partial, _ in call.visits[call.off[b] : call.off[b + 1]].tolist():
            assert 0 < ke - ks <= bk
            assert 0 <= r0 < r1 <= bq
            rows = slice(b * bq + r0, b * bq + r1)
            if not partial:
                assert dense[rows, ks:ke].all()
            count[rows, ks:ke] += 1
            computed += (ke - ks) * (r1 - r0)
    assert torch.equal(count[dense], torch.ones(int(dense.sum()), dtype=torch.int64))
    blocks = sum((v.ke - v.ks) * (v.r1 - v.r0) for qb in plan.grid.blocks for v in qb.visits)
    assert computed < blocks
    return computed, int(dense.sum())


@needs_native
def test_explain_says_which_kernel_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 2, 16, 8)
    assert "native kernel" in str(attnkit.explain(q, q, q, backend="chunked"))
    eager = str(attnkit.explain(q, q, q, backend=Chunked(native=False)))
    assert "the eager kernel (Chunked(native=False))" in eager
    monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    off = str(attnkit.explain(q, q, q, backend="chunked"))
    assert "the eager kernel (native kernel: disabled by ATTNKIT_NATIVE=0)" in off
    assert_close(attention(q, q, q, backend="chunked"), attention(q, q, q, backend="reference"))


# --------------------------------------------------------------------------------------------------
# Dropout


@pytest.mark.parametrize("native", [True, False])
def test_dropout_equals_the_reference_with_the_same_mask(native: bool) -> None:
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 20, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 25, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 25, 8, generator=g, dtype=torch.float64, requires_grad=True)
    cot = torch.randn(2, 4, 20, 8, generator=g, dtype=torch.float64)
    p = 0.3
    backend = small(native)
    torch.manual_seed(11)
    got = attention(q, k, v, causal=True, dropout_p=p, backend=backend)
    got_grads = torch.autograd.grad(got, (q, k, v), cot)
    torch.manual_seed(11)
    keep = dropout_mask(draw_seed(), p, (2, 4, 20, 25))  # the draw the kernel made
    _, weights = attention(q, k, v, causal=True, return_weights=True, backend="reference")
    want = (weights * keep / (1 - p)) @ v.repeat_interleave(2, dim=1)
    want_grads = torch.autograd.grad(want, (q, k, v), cot)
    assert_close(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert_close(a, b)
    # The same seed gives the same output; the next call draws another.
    torch.manual_seed(11)
    assert torch.equal(attention(q, k, v, causal=True, dropout_p=p, backend=backend), got)
    assert not torch.equal(attention(q, k, v, causal=True, dropout_p=p, backend=backend), got)


@pytest.mark.parametrize("native", [True, False])
def test_relative_attention_trains_with_dropout_by_the_same_mask(native: bool) -> None:
    # The position term and dropout together: both kernels drop the pairs the exposed mask
    # says, and the gradients of qv and the table follow the same mask.
    g = torch.Generator().manual_seed(3)
    q, qv = (torch.randn(1, 2, 18, 4, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, 18, 4, generator=g, dtype=torch.float64) for _ in range(2))
    enc = torch.randn(2, 35, 4, generator=g, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (q, k, v, qv, enc)]
    cot = torch.randn(1, 2, 18, 4, generator=g, dtype=torch.float64)
    p = 0.25
    window = masks.sliding_window(6, 2)
    torch.manual_seed(5)
    term = RelativePositionTerm(qv, enc, 0.5)
    got = attention(q, k, v, mask=window, bias=term, dropout_p=p, backend=small(native))
    got_grads = torch.autograd.grad(got, leaves, cot)
    torch.manual_seed(5)
    keep = dropout_mask(draw_seed(), p, (1, 2, 18, 18))
    _, weights = attention(
        q, k, v, mask=window, bias=RelativePositionTerm(qv, enc, 0.5), return_weights=True
    )
    want = (weights * keep / (1 - p)) @ v
    for a, b in zip(
        [got, *got_grads], [want, *torch.autograd.grad(want, leaves, cot)], strict=True
    ):
        assert_close(a, b)


# --------------------------------------------------------------------------------------------------
# Fuzz: the native kernel against the float64 reference, values and gradients


@needs_native
@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    mask=st.sampled_from(list(MASKS)),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_native_fuzz_against_reference(data: st.DataObject, mask: str, dtype: torch.dtype) -> None:
    draw = data.draw
    b, hkv, groups = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    tq, tk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    dk, dv = draw(st.sampled_from([1, 4, 8, 16, 72])), draw(st.sampled_from([1, 3, 8, 68]))
    if mask in (
        "padding",
        "padding & causal",
        "documents",
        "same documents",
        "same documents & causal",
    ):
        tk = tq = max(tq, 37)  # the masks above describe 37 keys, two batch rows
        b = 2
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    h = hkv * groups
    q = torch.randn(b, h, tq, dk, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, tk, dk, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, tk, dv, generator=g, dtype=torch.float64)
    kw: dict[str, object] = {"scale": draw(st.sampled_from([None, 0.1, 1.0]))}
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([0.5, 3.0, 50.0]))
    tensors = [q, k, v]
    names = []
    if draw(st.booleans()):
        tensors.append(torch.randn(h, tq, tk, generator=g, dtype=torch.float64))
        names.append("bias")
    if draw(st.booleans()):
        tensors.append(torch.randn(h, generator=g, dtype=torch.float64))
        names.append("sinks")
    the_mask = MASKS[mask]
    if mask in (
        "padding",
        "padding & causal",
        "documents",
        "same documents",
        "same documents & causal",
    ):
        the_mask = {
            "padding": masks.key_padding([tk, 13]),
            "padding & causal": masks.key_padding([tk, 9]) & masks.causal(),
            "documents": masks.documents([[tk - 17, 17], [tk]]),
            "same documents": masks.documents([5, tk - 22, 0, 17]),
            "same documents & causal": masks.documents([5, tk - 22, 0, 17]) & masks.causal(),
        }[mask]
    sizes = (draw(st.sampled_from([1, 4, 8, 16])), draw(st.sampled_from([1, 5, 16, 32])))
    cot = torch.randn(b, h, tq, dv, generator=g, dtype=torch.float64)

    def run(ts: list[torch.Tensor], backend: object) -> list[torch.Tensor]:
        leaves = [t.requires_grad_() for t in ts]
        extra = dict(zip(names, leaves[3:], strict=True))
        out = attention(*leaves[:3], mask=the_mask, backend=backend, **extra, **kw)  # type: ignore[arg-type]
        return [out, *torch.autograd.grad(out, leaves, cot.to(out.dtype), materialize_grads=True)]

    layout = draw(st.sampled_from(["contiguous", "token-major", "packed"]))
    got = run(
        [laid_out(t.to(dtype), layout) for t in tensors],
        Chunked(block_q=sizes[0], block_k=sizes[1]),
    )
    want = run([t.clone() for t in tensors], "reference")
    for a, w in zip(got, want, strict=True):
        assert a.isfinite().all()
        assert_close(a, w, dtype=dtype)


@needs_native
@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    mask=st.sampled_from(["none", "causal", "window", "padding & causal", "from_fn"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_native_position_term_fuzz_against_reference(
    data: st.DataObject, mask: str, dtype: torch.dtype
) -> None:
    # Transformer-XL's position term, fused in the native kernel: tables that list every
    # distance, only some (a window's) or start elsewhere (max_distance), products per query
    # block or per visit (whole_width=0), softcap before the term, GQA, Tq != Tk.
    draw = data.draw
    b, hkv, groups = 2, draw(st.integers(1, 2)), draw(st.integers(1, 2))
    tq, tk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    if mask == "padding & causal":
        tk = tq = max(tq, 37)
    dk = draw(st.sampled_from([1, 4, 8]))
    h = hkv * groups
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    top = draw(st.one_of(st.none(), st.integers(-5, tk + 5)))
    rows = draw(st.integers(0, tq + tk + 4))
    q, qv = (torch.randn(b, h, tq, dk, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, hkv, tk, dk, generator=g, dtype=torch.float64) for _ in range(2))
    enc = torch.randn(h, rows, dk, generator=g, dtype=torch.float64)
    whole = draw(st.sampled_from([0, 20, 2048]))
    kw: dict[str, object] = {"scale": draw(st.sampled_from([None, 0.5]))}
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([0.5, 5.0]))
    sizes = (draw(st.sampled_from([1, 4, 8, 16])), draw(st.sampled_from([1, 5, 16])))
    cot = torch.randn(b, h, tq, dk, generator=g, dtype=torch.float64)

    def run(ts: list[torch.Tensor], backend: object) -> list[torch.Tensor]:
        leaves = [t.requires_grad_() for t in ts]
        term = RelativePositionTerm(leaves[3], leaves[4], 0.7, max_distance=top, whole_width=whole)
        the_mask = (
            masks.key_padding([tk, 9]) & masks.causal()
            if mask == "padding & causal"
            else MASKS[mask]
        )
        out = attention(*leaves[:3], mask=the_mask, bias=term, backend=backend, **kw)  # type: ignore[arg-type]
        return [out, *torch.autograd.grad(out, leaves, cot.to(out.dtype), materialize_grads=True)]

    fast = Chunked(block_q=sizes[0], block_k=sizes[1])
    tensors = [q, k, v, qv, enc]
    layout = draw(st.sampled_from(["contiguous", "token-major", "packed"]))
    leaves = [laid_out(t.to(dtype), layout) for t in tensors]
    assert "native kernel" in str(
        attnkit.explain(
            *leaves[:3], bias=RelativePositionTerm(leaves[3], leaves[4], 0.7), backend=fast
        )
    )
    got = run(leaves, fast)
    want = run([t.clone() for t in tensors], "reference")
    for a, w in zip(got, want, strict=True):
        assert_close(a, w, dtype=dtype)


@needs_native
def test_explain_says_which_score_terms_the_native_kernel_fuses() -> None:
    q = torch.randn(1, 2, 9, 4)
    table = torch.randn(2, 17, 4)
    fused = RelativePositionTerm(q, table, 0.5)
    legacy = RelativePositionTerm(q, torch.randn(2, 10, 4), 0.5, legacy=True)
    assert "native kernel" in str(attnkit.explain(q, q, q, bias=fused, backend="chunked"))
    text = str(attnkit.explain(q, q, q, bias=legacy, backend="chunked"))
    assert "the native kernel does not fuse the score term" in text


@needs_native
@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    mask=st.sampled_from(["none", "causal", "window", "padding & causal", "from_fn"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_native_distance_bias_fuzz_against_reference(
    data: st.DataObject, mask: str, dtype: torch.dtype
) -> None:
    # A bias by distance, read by the kernel as a bias with strides -1 and 1 in its table:
    # tables per head, per batch row or shared, longer than the call needs, GQA, Tq != Tk,
    # softcap before it, one or two threads adding to the table's gradient.
    draw = data.draw
    b, hkv, groups = 2, draw(st.integers(1, 2)), draw(st.integers(1, 2))
    tq, tk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    if mask == "padding & causal":
        tk = tq = max(tq, 37)
    h = hkv * groups
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    lead = draw(st.sampled_from([(), (h,), (1, h), (b, h), (b, 1)]))
    before, after = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    q = torch.randn(b, h, tq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, tk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    table = torch.randn(*lead, before + tq + tk - 1 + after, generator=g, dtype=torch.float64)
    first = -(tk - 1) - before
    kw: dict[str, object] = {}
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([0.5, 5.0]))
    sizes = (draw(st.sampled_from([1, 4, 8, 16])), draw(st.sampled_from([1, 5, 16])))
    cot = torch.randn(b, h, tq, 8, generator=g, dtype=torch.float64)
    the_mask = (
        masks.key_padding([tk, 9]) & masks.causal() if mask == "padding & causal" else MASKS[mask]
    )

    def run(ts: list[torch.Tensor], backend: object) -> list[torch.Tensor]:
        leaves = [t.requires_grad_() for t in ts]
        term = scores.DistanceBias(leaves[3], first)
        out = attention(*leaves[:3], mask=the_mask, bias=term, backend=backend, **kw)  # type: ignore[arg-type]
        return [out, *torch.autograd.grad(out, leaves, cot.to(out.dtype), materialize_grads=True)]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(draw(st.sampled_from([1, 2])))
        layout = draw(st.sampled_from(["contiguous", "token-major", "packed"]))
        leaves = [laid_out(t.to(dtype), layout) for t in (q, k, v)] + [table.to(dtype)]
        fast = Chunked(block_q=sizes[0], block_k=sizes[1])
        term = scores.DistanceBias(leaves[3], first)
        assert "native kernel" in str(attnkit.explain(*leaves[:3], bias=term, backend=fast))
        got = run(leaves, fast)
    finally:
        torch.set_num_threads(threads)
    want = run([t.clone() for t in (q, k, v, table)], "reference")
    for a, w in zip(got, want, strict=True):
        assert_close(a, w, dtype=dtype)


@needs_native
@pytest.mark.parametrize("mask", [m for m in MASKS if m != "none"])
@pytest.mark.parametrize("rect", [(0, 37, 0, 37), (8, 16, 20, 17), (30, 7, 0, 33), (3, 11, 26, 11)])
def test_a_rectangle_of_the_scores_is_planned_at_the_calls_positions(
    mask: str, rect: tuple[int, int, int, int]
) -> None:
    # One process's queries against another's keys (attnkit.distributed): the plan of a rectangle
    # of a call's scores asks the mask at the call's positions, and the kernel run on the
    # rectangle's rows and keys alone gives attention under that rectangle of the mask.
    m = MASKS[mask]
    assert m is not None
    b, h, t, d = 2, 2, 37, 8
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, h, t, d, generator=g, dtype=torch.float64) for _ in range(3))
    geo = Geometry((b,), h, t, t, q.device)
    q0, nq, k0, nk = rect
    plan = block_plan(m, geo, native=True, block_q=8, block_k=16, rect=rect)
    assert (plan.q_len, plan.kv_len) == (nq, nk)
    local = Geometry((b,), h, nq, nk, q.device)
    call = native_call(plan, local, scale=d**-0.5, softcap=None, dtype=q.dtype)
    rows, keys = slice(q0, q0 + nq), slice(k0, k0 + nk)
    q5 = q[:, :, rows].reshape(b, h, 1, nq, d)
    out, lse = call.forward(q5, k[:, :, keys], v[:, :, keys], None)
    dense = m.dense(t, t, batch_size=b, num_heads=h)[..., rows, keys]
    want, want_lse = attention(
        q[:, :, rows], k[:, :, keys], v[:, :, keys], mask=dense, backend="reference",
        return_lse=True,
    )  # fmt: skip
    torch.testing.assert_close(out.reshape(b, h, nq, d), want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse.reshape(b, h, nq), want_lse, atol=1e-10, rtol=1e-10)
