"""PagedKVCache: attention over pages equals the float64 reference over each whole sequence; a
refused call changes nothing; pages are taken, freed and reused."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit
from attnkit import MultiHeadAttention, PagedKVCache, RotaryEmbedding, _native, masks
from attnkit._kernel import cache as kernel_cache
from attnkit.backends import chunked
from attnkit.modules.positional import alibi_term
from attnkit.testing import assert_close

F64 = torch.float64
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _snapshot(c: PagedKVCache) -> tuple[Any, ...]:
    return (
        c.k_pages.clone(),
        c.v_pages.clone(),
        c.block_table.clone(),
        list(c.lengths),
        [c.pages_of(b) for b in range(c.max_seqs)],
        c.num_free_pages,
    )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return all(
        torch.equal(x, y) if isinstance(x, Tensor) else x == y for x, y in zip(a, b, strict=True)
    )


class Rows:
    """Every token each row was given, to attend the whole sequence for the reference."""

    def __init__(self, rows: int, hkv: int, dk: int, dv: int) -> None:
        self.k = [torch.zeros(hkv, 0, dk, dtype=F64) for _ in range(rows)]
        self.v = [torch.zeros(hkv, 0, dv, dtype=F64) for _ in range(rows)]

    def add(self, k: Tensor, v: Tensor, new: list[int]) -> None:
        for b, n in enumerate(new):
            self.k[b] = torch.cat([self.k[b], k[b, :, :n]], 1)
            self.v[b] = torch.cat([self.v[b], v[b, :, :n]], 1)


def _reference(rows: Rows, q: Tensor, new: list[int], **kw: Any) -> list[Tensor]:
    """Each row's new queries against the row's whole sequence, on the float64 reference."""
    slopes = kw.pop("alibi", None)
    out = []
    for b, n in enumerate(new):
        s = rows.k[b].size(1)
        bias = None if slopes is None else alibi_term(slopes, n, s)
        got = attnkit.attention(
            q[b : b + 1, :, :n], rows.k[b][None], rows.v[b][None], bias=bias,
            backend="reference", **kw,
        )  # fmt: skip
        out.append(got[0])
    return out


def _steps(
    c: PagedKVCache, h: int, steps: list[list[int]], gen: torch.Generator, **kw: Any
) -> None:
    """Run ``steps`` (new tokens per row, per call) through ``c.attention`` and compare every
    call with the reference."""
    hkv, dk = c.token_major()[0].shape[2:]
    rows = Rows(c.max_seqs, hkv, dk, dk)
    for new in steps:
        t = max(new)
        q = torch.randn(c.max_seqs, h, t, dk, generator=gen, dtype=F64)
        k = torch.randn(c.max_seqs, hkv, t, dk, generator=gen, dtype=F64)
        v = torch.randn(c.max_seqs, hkv, t, dk, generator=gen, dtype=F64)
        rows.add(k, v, new)
        slopes = kw.get("alibi")
        call = {key: val for key, val in kw.items() if key != "alibi"}
        if slopes is not None:
            longest = max(x.size(1) for x in rows.k)
            call["bias"] = alibi_term(slopes, t, longest)
        c.schedule(new)
        with torch.no_grad():
            out, lse = c.attention(q, k, v, **call)
        c.commit()
        want = _reference(rows, q, new, **kw)
        for b, n in enumerate(new):
            assert_close(out[b, :, :n], want[b])
            assert bool(out[b, :, n:].eq(0).all())
            assert bool(lse[b, :, n:].eq(-math.inf).all())
    assert c.lengths == [x.size(1) for x in rows.k]


# --------------------------------------------------------------------------------------------------
# Through MultiHeadAttention


@pytest.mark.parametrize("page", [1, 16, 256])
@pytest.mark.parametrize("layout", ["flash", "vllm"])
def test_module_mixed_prefill_and_decode_equals_full_forward(page: int, layout: str) -> None:
    """Rows of different lengths, one prefilling while the others decode, GQA and rotary: each
    row's outputs equal the module's uncached causal forward over the row's whole sequence."""
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 8, num_kv_heads=2, rotary=RotaryEmbedding(4)).to(F64).eval()
    total = [40, 7, 23]
    x = [torch.randn(1, n, 32, dtype=F64) for n in total]
    # Row 1 arrives late (a prompt of 5 while row 0 decodes), row 2 prefills in two chunks.
    steps = [[30, 0, 12], [1, 5, 11], [1, 1, 0], [8, 1, 0]]
    cache = m.make_paged_cache(96, page, max_seqs=3, layout=layout)  # type: ignore[arg-type]
    done = [0, 0, 0]
    with torch.no_grad():
        full = [m(xi, causal=True)[0] for xi in x]
        for new in steps:
            t = max(new)
            step = torch.zeros(3, t, 32, dtype=F64)
            for b, n in enumerate(new):
                step[b, :n] = x[b][0, done[b] : done[b] + n]
            cache.schedule(new)
            out = m(step, causal=True, cache=cache)
            for b, n in enumerate(new):
                assert_close(out[b, :n], full[b][done[b] : done[b] + n])
                done[b] += n
    assert cache.lengths == total


def test_module_decodes_like_kv_cache() -> None:
    """Equal rows, one token a step: the paged cache gives the contiguous KVCache's outputs."""
    torch.manual_seed(1)
    m = MultiHeadAttention(24, 6, num_kv_heads=3, add_zero_attn=True).to(F64).eval()
    x = torch.randn(2, 12, 24, dtype=F64)
    contiguous, pages = m.make_cache(2, 12), m.make_paged_cache(8, 3, max_seqs=2)
    with torch.no_grad():
        for t in range(12):
            a = m(x[:, t : t + 1], cache=contiguous, mask=masks.sliding_window(4))
            b = m(x[:, t : t + 1], cache=pages, mask=masks.sliding_window(4))
            assert_close(b, a)


def test_transformer_layer_rewinds_a_paged_cache() -> None:
    """A layer that fails after its self-attention appended leaves the paged cache's lengths
    and pages as they were, and the same step then succeeds."""
    torch.manual_seed(2)
    layer = attnkit.TransformerDecoderLayer(16, 2, dropout=0.0).to(F64).eval()
    cache = layer.self_attn.make_paged_cache(8, 4, max_seqs=1)
    x, memory = torch.randn(1, 6, 16, dtype=F64), torch.randn(1, 3, 16, dtype=F64)
    with torch.no_grad():
        layer(x[:, :5], memory, cache=cache)
        before = _snapshot(cache)
        with pytest.raises(ValueError, match="memory_mask"):
            layer(
                x[:, 5:], memory, cache=cache, memory_mask=torch.ones(1, 1, 1, 9, dtype=torch.bool)
            )
        assert cache.lengths == before[3]
        assert cache.num_free_pages == before[5]
        out = layer(x[:, 5:], memory, cache=cache)
        want = layer(x, memory)[:, 5:]
    assert_close(out, want)


def test_module_refuses_what_a_paged_call_cannot_do() -> None:
    m = MultiHeadAttention(16, 2).to(F64).eval()
    cache = m.make_paged_cache(4, 4, max_seqs=1)
    x = torch.randn(1, 2, 16, dtype=F64)
    before = _snapshot(cache)
    with torch.no_grad():
        with pytest.raises(ValueError, match="no attention weights from a PagedKVCache call"):
            m(x, cache=cache, need_weights=True)
        with pytest.raises(TypeError, match="a bias by distance"):
            m(x, cache=cache, bias=torch.zeros(1, 2, 2, 2, dtype=F64))
        with pytest.raises(ValueError, match=re.escape("got key_padding(lengths=[2])")):
            m(x, cache=cache, mask=masks.key_padding([2]))
    assert _same(before, _snapshot(cache))


# --------------------------------------------------------------------------------------------------
# The cache itself


@pytest.mark.parametrize("page", [1, 16, 256])
def test_attention_over_pages_equals_reference(page: int) -> None:
    gen = torch.Generator().manual_seed(page)
    c = PagedKVCache(80, page, 2, 8, max_seqs=3, dtype=F64)
    _steps(c, 6, [[17, 1, 40], [1, 1, 1], [3, 0, 1], [1, 9, 1]], gen, causal=True)


def test_eager_path_equals_in_place_path() -> None:
    """The gathered path (no native kernel) computes what the kernel computes in place; the
    kernel is what serves a CPU float64 call."""
    calls: list[int] = []
    real = kernel_cache.cache_attention

    def counted(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*a, **kw)

    with mock.patch.object(kernel_cache, "cache_attention", counted):
        _steps(PagedKVCache(16, 4, 1, 8, max_seqs=2, dtype=F64), 2, [[5, 2], [1, 1]],
               torch.Generator().manual_seed(5), causal=True)  # fmt: skip
    assert len(calls) == 2
    with mock.patch.object(chunked, "in_place_refusal", return_value="refused for the test"):
        _steps(PagedKVCache(16, 4, 1, 8, max_seqs=2, dtype=F64), 2, [[5, 2], [1, 1]],
               torch.Generator().manual_seed(5), causal=True)  # fmt: skip


class _Ops(TorchDispatchMode):
    """Every operator a call runs, with its tensor arguments and outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, list[Tensor], list[Tensor]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        flat = [*args, *(kwargs or {}).values()]
        outs = out if isinstance(out, tuple | list) else [out]
        self.calls.append(
            (
                func,
                [a for a in flat if isinstance(a, Tensor)],
                [o for o in outs if isinstance(o, Tensor)],
            )
        )
        return out


def _decode_step(layout: str, dtype: torch.dtype, rows: int = 2) -> tuple[PagedKVCache, _Ops]:
    """A cache of ``rows`` rows of 100 tokens, and the operators of its next decode step."""
    gen = torch.Generator().manual_seed(6)
    c = PagedKVCache(16 * rows, 16, 2, 32, max_seqs=rows, layout=layout, dtype=dtype)  # type: ignore[arg-type]

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    with torch.inference_mode():
        prompt = rand(rows, 4, 100, 32), rand(rows, 2, 100, 32), rand(rows, 2, 100, 32)
        c.attention(*prompt, causal=True)
        c.commit()
        q, k, v = rand(rows, 4, 1, 32), rand(rows, 2, 1, 32), rand(rows, 2, 1, 32)
        ops = _Ops()
        with ops:
            out, _ = c.attention(q, k, v, causal=True)
    assert out.shape == (rows, 4, 1, 32)
    return c, ops


@pytest.mark.skipif(not _native.load(), reason=f"native kernel: {_native.status()[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["flash", "vllm"])
def test_a_decode_step_reads_the_pages_where_they_lie(layout: str, dtype: torch.dtype) -> None:
    """The native kernel gets the pool's pages themselves, and no operator of the step makes
    anything near their size: a copy of the pool (a contiguous(), a cast, a gather) would cost a
    decode step as much as its attention."""
    c, ops = _decode_step(layout, dtype)
    pool = c.k_pages.numel()
    kernel = torch.ops.attnkit.native_cache_forward.default
    native = [args for func, args, _ in ops.calls if func == kernel]
    assert len(native) == 1
    for got, pages in zip(native[0][1:3], (c.k_pages, c.v_pages), strict=True):
        assert got.untyped_storage().data_ptr() == pages.untyped_storage().data_ptr()
        assert got.numel() == pool
    own = {c.k_pages.untyped_storage().data_ptr(), c.v_pages.untyped_storage().data_ptr()}
    size = c.k_pages.untyped_storage().nbytes()
    for func, _, outs in ops.calls:
        for o in outs:
            # Neither the pages nor a view of them; what it holds, not its shape (the checks'
            # stand-ins for the keys are one zero, expanded).
            if o.untyped_storage().data_ptr() not in own:
                assert o.untyped_storage().nbytes() < size // 16, f"{func} made {tuple(o.shape)}"


@pytest.mark.skipif(not _native.load(), reason=f"native kernel: {_native.status()[1]}")
@pytest.mark.parametrize("rows", [2, 8])
@pytest.mark.parametrize("layout", ["flash", "vllm"])
def test_a_decode_step_runs_no_indexing_kernel(layout: str, rows: int) -> None:
    """The new tokens are copied into their pages (a copy a row, or with several rows one
    index_copy_ of their heads' rows, which stays on one thread below 32768 elements), not
    written by an index_put_ of a boolean selection: torch's other indexing kernels (and
    repeat_interleave) start the OpenMP threads from a few thousand elements on (B Hkv D of a
    decode step), and on a machine whose cores are busy a step that starts them before the
    attention waits for a core each time (twice as long as the contiguous KVCache's step,
    measured with benchmarks/bench_decode.py)."""
    _, ops = _decode_step(layout, torch.float32, rows)
    names = [str(func) for func, _, _ in ops.calls]
    indexing = ("aten.index", "aten.nonzero", "aten.masked_select", "aten.repeat_interleave")
    one_thread = "aten.index_copy_.default"
    assert [n for n in names if n.startswith(indexing) and n != one_thread] == []
    assert names.count(one_thread) == (2 if rows >= 4 else 0)  # (keys and values)
    assert names.count("attnkit.native_cache_forward.default") == 1


def test_decode_with_different_lengths_is_key_padding() -> None:
    """One query a row after rows of different lengths: the same as a padded contiguous batch
    under key_padding(lengths)."""
    gen = torch.Generator().manual_seed(7)
    lengths = [9, 1, 30, 16]
    c = PagedKVCache(64, 4, 2, 8, max_seqs=4, dtype=F64)
    k = torch.randn(4, 2, 30, 8, generator=gen, dtype=F64)
    v = torch.randn(4, 2, 30, 8, generator=gen, dtype=F64)
    c.schedule(lengths)
    c.stage(k, v)
    c.commit()
    q = torch.randn(4, 4, 1, 8, generator=gen, dtype=F64)
    nk, nv = torch.randn(4, 2, 1, 8, generator=gen, dtype=F64), torch.randn(4, 2, 1, 8, dtype=F64)
    with torch.no_grad():
        out, _ = c.attention(q, nk, nv)
    pk, pv = torch.zeros(4, 2, 31, 8, dtype=F64), torch.zeros(4, 2, 31, 8, dtype=F64)
    for b, n in enumerate(lengths):
        pk[b, :, :n], pk[b, :, n] = k[b, :, :n], nk[b, :, 0]
        pv[b, :, :n], pv[b, :, n] = v[b, :, :n], nv[b, :, 0]
    want = attnkit.attention(q, pk, pv, mask=masks.key_padding([n + 1 for n in lengths]),
                             backend="reference")  # fmt: skip
    assert_close(out, want)


def _pool() -> PagedKVCache:
    c = PagedKVCache(4, 2, 1, 2, max_seqs=2, max_pages_per_seq=3, dtype=F64)
    c.schedule([3, 1])
    c.stage(torch.randn(2, 1, 3, 2, dtype=F64), torch.randn(2, 1, 3, 2, dtype=F64))
    c.commit()
    return c


def _kv(b: int, t: int, dtype: torch.dtype = F64, d: int = 2) -> tuple[Tensor, Tensor]:
    return torch.randn(b, 1, t, d, dtype=dtype), torch.randn(b, 1, t, d, dtype=dtype)


@pytest.mark.parametrize(
    ("call", "exc", "message"),
    [
        (lambda c: c.stage(*_kv(2, 1, torch.float32)), TypeError,
         "k and v must have the cache's dtype (float64), got k float32 and v float32"),
        (lambda c: c.stage(*_kv(2, 1, d=3)), ValueError, "k and v must have shapes"),
        (lambda c: c.stage(*_kv(1, 1)), ValueError, "B = max_seqs = 2 sequences"),
        (lambda c: c.stage(*_kv(2, 4)), ValueError,
         "sequence 0: 4 new tokens after its 3 need 4 pages of 2, more than its block table's 3"),
        (lambda c: (c.schedule([2, 2]), c.stage(*_kv(2, 2))), ValueError,
         "out of pages: the new tokens [2, 2] need 2 more pages of 2 tokens and the pool has 1 "
         "free of 4"),
        (lambda c: (c.schedule([0, 3]), c.stage(*_kv(2, 2))), ValueError,
         "schedule() gave new tokens [0, 3], more than the call's T = 2"),
        (lambda c: c.stage(*(t.requires_grad_() for t in _kv(2, 1))), ValueError,
         "require grad"),
        (lambda c: c.attention(torch.randn(2, 2, 1, 2, dtype=F64), *_kv(2, 1),
                               mask=masks.key_padding([1, 1])), ValueError, "key_padding"),
        (lambda c: c.attention(torch.randn(2, 3, 1, 3, dtype=F64), *_kv(2, 1)), ValueError,
         "H a multiple of Hkv = 1 and Dk = 2, got (2, 3, 1, 3)"),
        (lambda c: c.attention(torch.randn(2, 2, 1, 2), *_kv(2, 1)), TypeError,
         "q must have the cache's dtype and device"),
        (lambda c: c.attention(torch.randn(2, 2, 1, 2, dtype=F64), *_kv(2, 1),
                               bias=alibi_term(torch.ones(2, dtype=F64), 1, 2)), ValueError,
         "holds distances -1 to 0"),
        (lambda c: c.write(torch.randn(2, 1, 2, dtype=F64), torch.randn(2, 1, 2, dtype=F64),
                           torch.tensor([3, 8])), ValueError,
         "slot_mapping[1] = 8 is not a slot: the pool holds 8"),
        (lambda c: c.write(torch.randn(2, 1, 2, dtype=F64), torch.randn(2, 1, 2, dtype=F64),
                           torch.tensor([3, 3])), ValueError, "names a slot twice"),
        (lambda c: c.write(torch.randn(2, 1, 2), torch.randn(2, 1, 2), torch.tensor([3, 4])),
         TypeError, "cache's dtype"),
    ],
)  # fmt: skip
def test_a_refused_call_changes_nothing(
    call: Callable[[PagedKVCache], object], exc: type[Exception], message: str
) -> None:
    c = _pool()
    c.schedule(None)
    before = _snapshot(c)
    with pytest.raises(exc, match=re.escape(message)):
        call(c)
    assert _same(before, _snapshot(c))


NAN, INF = math.nan, math.inf
SCALE = "scale must be finite and at most 1.8e+308 in magnitude (the largest float64, in which the "
SOFTCAP = "softcap must be a finite number > 0, got "

# Every argument of attention() that the cache passes on, refused with attention()'s words.
BAD_ATTENTION_ARGS = [
    ({"scale": NAN}, ValueError, SCALE + "scores are computed), got nan"),
    ({"scale": INF}, ValueError, SCALE + "scores are computed), got inf"),
    ({"scale": -INF}, ValueError, SCALE + "scores are computed), got -inf"),
    ({"scale": "0.5"}, TypeError, "scale must be a float or None, got '0.5'"),
    ({"softcap": NAN}, ValueError, SOFTCAP + "nan"),
    ({"softcap": -2.0}, ValueError, SOFTCAP + "-2.0"),
    ({"softcap": 0.0}, ValueError, SOFTCAP + "0.0"),
    ({"softcap": INF}, ValueError, SOFTCAP + "inf"),
    ({"softcap": True}, TypeError, "softcap must be a number > 0 or None, got True"),
    ({"sinks": torch.tensor([0.0, NAN], dtype=F64)}, ValueError,
     "sinks holds NaN: a sink may be -inf (no sink) but not NaN or +inf"),
    ({"sinks": torch.tensor([INF, 0.0], dtype=F64)}, ValueError, "sinks holds +inf"),
    ({"sinks": torch.zeros(2)}, TypeError,
     "sinks must have the dtype of q (float64), got float32; use sinks.to(q.dtype)"),
    ({"sinks": torch.zeros(3, dtype=F64)}, ValueError,
     "sinks must have shape (H,) = (2,), one logit per query head, got (3)"),
    ({"sinks": [0.0, 0.0]}, TypeError, "sinks must be a float tensor (H,) or None, got list"),
    ({"causal": 1}, TypeError, "causal must be a bool, got 1"),
]  # fmt: skip


@pytest.mark.parametrize("native", [True, False], ids=["in-place", "gathered"])
@pytest.mark.parametrize(("kw", "exc", "message"), BAD_ATTENTION_ARGS)
def test_attention_refuses_what_attention_refuses_before_writing(
    kw: dict[str, Any], exc: type[Exception], message: str, native: bool
) -> None:
    """scale, softcap and sinks are checked by attention()'s own checks before the new tokens
    are written, on either path (the native kernel's paged read, or a gather and attention()):
    the pages, the block table and the lengths stay as they were, and the same call without the
    bad argument then runs."""
    c = _pool()
    c.schedule(None)
    q, (k, v) = torch.randn(2, 2, 1, 2, dtype=F64), _kv(2, 1)
    before = _snapshot(c)
    gathered = mock.patch.object(chunked, "in_place_refusal", return_value="a gather")
    with contextlib.nullcontext() if native else gathered, torch.no_grad():
        with pytest.raises(exc, match=re.escape(message)):
            c.attention(q, k, v, **kw)
        assert _same(before, _snapshot(c))
        out, _ = c.attention(q, k, v)
    assert out.isfinite().all()


def test_a_negative_scale_and_a_minus_inf_sink_are_taken() -> None:
    """What attention() takes, the cache takes: the checks refuse only what has no meaning."""
    c = _pool()
    c.schedule(None)
    q, (k, v) = torch.randn(2, 2, 1, 2, dtype=F64), _kv(2, 1)
    sinks = torch.tensor([-INF, 0.5], dtype=F64)
    keys = [torch.cat([c.token_major()[0][c.pages_of(b)].flatten(0, 1)[: c.lengths[b]]
                       .permute(1, 0, 2)[None], k[b : b + 1]], 2) for b in range(2)]  # fmt: skip
    values = [torch.cat([c.token_major()[1][c.pages_of(b)].flatten(0, 1)[: c.lengths[b]]
                         .permute(1, 0, 2)[None], v[b : b + 1]], 2) for b in range(2)]  # fmt: skip
    with torch.no_grad():
        out, _ = c.attention(q, k, v, scale=-0.7, softcap=3.0, sinks=sinks)
    for b in range(2):
        want = attnkit.attention(q[b : b + 1], keys[b], values[b], scale=-0.7, softcap=3.0,
                                 sinks=sinks, backend="reference")  # fmt: skip
        assert_close(out[b : b + 1], want)


def test_free_and_reuse_pages() -> None:
    """A freed sequence's pages serve the next one; the other rows' tokens are untouched."""
    gen = torch.Generator().manual_seed(11)
    c = PagedKVCache(6, 4, 1, 4, max_seqs=2, dtype=F64)
    c.schedule([12, 12])
    k, v = torch.randn(2, 1, 12, 4, generator=gen, dtype=F64), torch.randn(2, 1, 12, 4, dtype=F64)
    c.stage(k, v)
    c.commit()
    assert c.num_free_pages == 0
    with pytest.raises(ValueError, match="out of pages"):
        c.stage(*_kv(2, 1, d=4))
    row0 = c.pages_of(0)
    c.free(0)
    assert c.lengths == [0, 12]
    assert c.num_free_pages == 3
    assert bool(c.block_table[0].eq(-1).all())
    # A new 5-token prompt in row 0 takes two of the freed pages; row 1 decodes one token.
    q = torch.randn(2, 2, 5, 4, generator=gen, dtype=F64)
    nk, nv = torch.randn(2, 1, 5, 4, generator=gen, dtype=F64), torch.randn(2, 1, 5, 4, dtype=F64)
    c.schedule([5, 1])
    with torch.no_grad():
        out, _ = c.attention(q, nk, nv, causal=True)
    c.commit()
    assert set(c.pages_of(0)) <= set(row0)
    assert c.num_free_pages == 0
    want0 = attnkit.attention(q[:1], nk[:1], nv[:1], causal=True, backend="reference")
    keys1 = torch.cat([k[1:], nk[1:, :, :1]], 2)
    vals1 = torch.cat([v[1:], nv[1:, :, :1]], 2)
    want1 = attnkit.attention(q[1:, :, :1], keys1, vals1, backend="reference")
    assert_close(out[:1], want0)
    assert_close(out[1:, :, :1], want1)
    c.reset()
    assert c.lengths == [0, 0]
    assert c.num_free_pages == 6


def test_uncommitted_stage_is_dropped_and_rewind_returns_pages() -> None:
    c = PagedKVCache(8, 2, 1, 2, max_seqs=1, dtype=F64)
    c.stage(*_kv(1, 3))
    # Staged pages are in the table but not held: the next stage drops them, so they count free.
    assert int(c.block_table[0].ge(0).sum()) == 2
    assert c.lengths == [0]
    assert c.num_free_pages == 8
    c.stage(*_kv(1, 1))  # the first stage is dropped: one page, not three
    c.commit()
    assert int(c.block_table[0].ge(0).sum()) == 1
    assert c.lengths == [1]
    assert c.num_free_pages == 7
    c.stage(*_kv(1, 6))
    c.commit()
    assert len(c.pages_of(0)) == 4
    c.rewind(2)
    assert c.lengths == [2]
    assert len(c.pages_of(0)) == 1
    assert int(c.block_table[0].ge(0).sum()) == 1
    assert c.num_free_pages == 7


def test_a_stage_staged_again_keeps_its_pages_and_a_refused_one_changes_nothing() -> None:
    """A step staged over an uncommitted one (a call retried, a step the caller threw away)
    keeps the pages it still needs, where they are in the block table: no page moves between
    rows. Fewer new tokens return the pages past them; a refused call changes nothing, the
    uncommitted stage included. The tokens read are the last stage's."""
    gen = torch.Generator().manual_seed(3)
    c = PagedKVCache(24, 4, 1, 2, max_seqs=4, dtype=F64)
    c.schedule([4, 3, 8, 0])
    c.stage(*_kv(4, 8))
    c.commit()
    c.schedule(None)
    c.stage(*_kv(4, 1))  # rows 0 and 2 take a page, rows 1 and 3 start one
    staged = [list(p) for p in c._pages]
    table, free = c.block_table.clone(), c.num_free_pages
    q = torch.randn(4, 2, 1, 2, generator=gen, dtype=F64)
    k, v = torch.randn(4, 1, 1, 2, generator=gen, dtype=F64), torch.randn(4, 1, 1, 2, dtype=F64)
    with torch.no_grad():
        out, _ = c.attention(q, k, v, causal=True)  # staged again over the first stage
    assert [list(p) for p in c._pages] == staged
    assert torch.equal(c.block_table, table)
    assert c.num_free_pages == free
    before = _snapshot(c)
    with pytest.raises(ValueError, match="takes causal=True"), torch.no_grad():
        c.attention(q, k, v, mask=masks.key_padding([1, 2, 3, 4]))
    assert _same(before, _snapshot(c))
    assert torch.equal(c.block_table, table)
    c.commit()
    for b in range(4):  # the held tokens then the last stage's
        keys = c.token_major()[0][c.pages_of(b)].flatten(0, 1)[: c.lengths[b]].permute(1, 0, 2)
        values = c.token_major()[1][c.pages_of(b)].flatten(0, 1)[: c.lengths[b]].permute(1, 0, 2)
        assert torch.equal(keys[:, -1:], k[b])
        assert torch.equal(values[:, -1:], v[b])
        want = attnkit.attention(q[b : b + 1], keys[None], values[None], backend="reference")
        assert_close(out[b : b + 1], want)
    c.schedule([0, 1, 0, 0])
    c.stage(*_kv(4, 1))
    c.schedule([0, 0, 0, 0])
    c.stage(*_kv(4, 1))  # the pages of the stage before go back
    assert c.num_free_pages == 24 - sum(len(c.pages_of(b)) for b in range(4))
    assert [len(p) for p in c._pages] == [len(c.pages_of(b)) for b in range(4)]


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_float8_page_taken_from_another_sequence_reads_with_its_new_sequences_scale(
    kv_dtype: torch.dtype,
) -> None:
    """A float8 sequence's scale is its first write's, kept on each of its pages: a page that
    comes back to the pool and is taken by another sequence, which grows onto it, is read with
    that sequence's scale, not its former owner's."""
    g = torch.Generator().manual_seed(2)
    c = PagedKVCache(3, 2, 1, 4, max_seqs=2, dtype=F64, kv_dtype=kv_dtype)
    big, small = (torch.randn(1, 1, 2, 4, generator=g, dtype=F64) * s for s in (100.0, 0.01))
    c.schedule([2, 2])
    c.stage(torch.cat([big, small]), torch.cat([big, small]))
    c.commit()
    c.free(0)  # row 0's page (scale for 100s) back to the pool
    new = torch.randn(2, 1, 2, 4, generator=g, dtype=F64) * 0.01
    c.schedule([0, 2])
    c.stage(new, new)  # row 1 grows onto the freed page
    c.commit()
    keys, _ = c.view().row(1, torch.float32)
    scale = c.k_scales[c.pages_of(1)[0], 0, 0]  # (its first write's, float32)
    assert scale == small.abs().amax().float() / torch.finfo(kv_dtype).max
    top = torch.finfo(kv_dtype).max  # (later tokens beyond its range saturate)
    for t, want in enumerate([*small[0, 0], *new[1, 0]]):
        stored = (want.float() / scale).clamp(-top, top).to(kv_dtype).float() * scale
        assert torch.equal(keys[0, 0, t], stored), t


def test_slot_mapping_writes_where_stage_writes() -> None:
    """vLLM's slot_mapping: write() into the slots stage() reports puts the same bits there;
    slot -1 is not written."""
    gen = torch.Generator().manual_seed(3)
    a = PagedKVCache(8, 4, 2, 4, max_seqs=2, dtype=F64, layout="vllm")
    b = PagedKVCache(8, 4, 2, 4, max_seqs=2, dtype=F64, layout="vllm")
    k, v = torch.randn(2, 2, 6, 4, generator=gen, dtype=F64), torch.randn(2, 2, 6, 4, dtype=F64)
    a.schedule([6, 2])
    slots = a.stage(k, v)
    assert slots.tolist() == [0, 1, 2, 3, 4, 5, 8, 9]
    packed_k = torch.cat([k[0, :, :6], k[1, :, :2]], 1).transpose(0, 1)  # (N, Hkv, D)
    packed_v = torch.cat([v[0, :, :6], v[1, :, :2]], 1).transpose(0, 1)
    pad = torch.full((1, 2, 4), float("nan"), dtype=F64)
    b.write(
        torch.cat([packed_k, pad]), torch.cat([packed_v, pad]), torch.cat([slots, -slots[:1] - 1])
    )
    assert torch.equal(a.k_pages, b.k_pages)
    assert torch.equal(a.v_pages, b.v_pages)


# --------------------------------------------------------------------------------------------------
# Fuzz: the paged and decode paths against the float64 reference


@st.composite
def _paged_calls(draw: st.DrawFn) -> dict[str, Any]:
    rows = draw(st.integers(1, 3))
    decode = draw(st.booleans())  # the decode path: one token a row after the first call
    steps = [[draw(st.integers(0, 9)) for _ in range(rows)]]
    for _ in range(draw(st.integers(1, 3))):
        steps.append([1 if decode else draw(st.integers(0, 4)) for _ in range(rows)])
    for s in steps:
        s[0] = max(s[0], 1)  # every call has a token
    mask = draw(st.sampled_from(["none", "causal", "window", "window&causal"]))
    return {
        "rows": rows,
        "steps": steps,
        "page": draw(st.sampled_from([1, 2, 3, 16])),
        "hkv": draw(st.integers(1, 2)),
        "groups": draw(st.sampled_from([1, 2, 4])),
        "mask": mask,
        "left": draw(st.integers(0, 6)),
        "softcap": draw(st.sampled_from([None, 2.0])),
        "alibi": draw(st.booleans()),
        "eager": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=40, deadline=None)
@given(case=_paged_calls())
def test_fuzz_paged_and_decode_paths(case: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    kw: dict[str, Any] = {"softcap": case["softcap"]}
    window = masks.sliding_window(case["left"])
    kw["mask"] = {"none": None, "causal": None, "window": window,
                  "window&causal": window & masks.causal()}[case["mask"]]  # fmt: skip
    kw["causal"] = case["mask"] == "causal"
    h = case["hkv"] * case["groups"]
    if case["alibi"]:
        kw["alibi"] = attnkit.alibi_slopes(h).to(F64)
    blocks = sum(-(-sum(s[b] for s in case["steps"]) // case["page"]) for b in range(case["rows"]))
    c = PagedKVCache(blocks, case["page"], case["hkv"], 4, max_seqs=case["rows"], dtype=F64)
    refusal = "the gathered path" if case["eager"] else None
    with mock.patch.object(chunked, "in_place_refusal", return_value=refusal):
        _steps(c, h, case["steps"], gen, **kw)
    assert c.num_free_pages == 0  # the pool was sized to the pages the sequences need


def test_a_cache_on_the_meta_device_attends_as_the_cpu_one_in_shape() -> None:
    """Pages, block table and tokens on the meta device: the checks read no value (the sinks'
    are skipped there) and the call gives what the same call gives on the CPU, in shape."""
    outs = []
    for device in ("cpu", "meta"):
        c = PagedKVCache(8, 4, 2, 8, max_seqs=2, dtype=F64, device=device)
        q = torch.randn(2, 4, 3, 8, dtype=F64, device=device)
        k, v = (torch.randn(2, 2, 3, 8, dtype=F64, device=device) for _ in range(2))
        with torch.no_grad():
            outs.append(
                c.attention(q, k, v, causal=True, sinks=torch.zeros(4, dtype=F64, device=device))
            )
    for real, meta in zip(*outs, strict=True):
        assert meta.is_meta
        assert (meta.shape, meta.dtype) == (real.shape, real.dtype)


def test_a_paged_call_is_an_attention_call_that_explain_shows_and_record_dispatch_records() -> None:
    """The cache's call goes through attention(): recorded with its view, and the module's
    explain() describes it on the pages, the chosen backend reading them in place."""
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, num_kv_heads=2).eval().double()
    cache = m.make_paged_cache(num_blocks=8, page_size=4, max_seqs=2)
    x = torch.randn(2, 3, 16, dtype=F64)
    with torch.no_grad(), attnkit.record_dispatch() as calls:
        m(x, cache=cache, causal=True)
        m(x[:, :1], cache=cache, causal=True)
    assert [c.chosen for c in calls] == ["chunked", "chunked"]
    assert all(c.call.cache is not None for c in calls)
    with torch.no_grad():
        said = str(m.explain(x[:, :1], cache=cache, causal=True))
    assert "k, v 2 rows of keys 0..5, 0..5 of 8 pages of 4 through a block table" in said
    assert "auto picks: chunked" in said
    if _native.load():
        assert calls[-1].kernel == kernel_cache.IN_PLACE
        assert "reads the cache in place: native kernel" in said


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), 1e30])
def test_a_float8_sequences_scale_comes_from_its_tokens_not_its_padding(
    kv_dtype: torch.dtype, garbage: float
) -> None:
    # A scheduled call's padding positions are never written and never attended: what they
    # hold must not set the scale a new float8 sequence keeps for all its tokens.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = (torch.randn(2, 2, 5, 8, generator=g) * 1e-3 for _ in "kv")
    caches = []
    for pad in (0.0, garbage):
        cache = PagedKVCache(8, 4, 2, 8, max_seqs=2, kv_dtype=kv_dtype)
        cache.schedule([3, 5])  # row 0: 3 tokens, then 2 positions of padding
        kp, vp = k.clone(), v.clone()
        kp[0, :, 3:] = vp[0, :, 3:] = pad
        out, _ = cache.attention(q, kp, vp, causal=True)
        cache.commit()
        assert not out.isnan().any()
        caches.append(cache)
    clean, dirty = caches
    for name in ("k_pages", "v_pages", "k_scales", "v_scales"):
        a, b = getattr(clean, name), getattr(dirty, name)
        assert torch.equal(a.view(torch.uint8) if a.dtype in FLOAT8 else a,
                           b.view(torch.uint8) if b.dtype in FLOAT8 else b), name  # fmt: skip
    page = dirty.pages_of(0)[0]  # head 0's scale: its largest real key at the format's largest
    want = float(k[0, 0, :3].abs().amax()) / torch.finfo(kv_dtype).max
    assert dirty.k_scales[page, 0].item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_module_conversions_change_the_read_dtype_and_keep_a_quantized_pool(
    kv_dtype: torch.dtype | None,
) -> None:
    # .double() (or a model's .to(dtype)) is a conversion of the dtype keys and values are given
    # and read in; a float8 page is a float tensor to torch, and must not become a float64 one.
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(8, 4, 2, 8, max_seqs=2, kv_dtype=kv_dtype)
    q, k, v = (
        torch.randn(2, 4, 6, 8, generator=g),
        *(torch.randn(2, 2, 6, 8, generator=g) for _ in "kv"),
    )
    cache.attention(q, k, v, causal=True)
    cache.commit()
    stored = {n: b.clone() for n, b in cache.named_buffers()}
    assert cache.double() is cache
    assert cache.dtype == F64
    for name, before in stored.items():
        after = getattr(cache, name)
        if kv_dtype is None and name.endswith("pages"):
            assert torch.equal(after, before.double())
        else:  # quantized pages, their float32 scales, the block table: as they were
            assert after.dtype == before.dtype, name
            assert torch.equal(after.view(torch.uint8), before.view(torch.uint8)), name
    q1, k1, v1 = (torch.randn(2, h, 1, 8, generator=g, dtype=F64) for h in (4, 2, 2))
    out, _ = cache.attention(q1, k1, v1, causal=True)
    view = cache.view()
    for b in range(2):
        keys, values = view.row(b, F64)
        want = attnkit.attention(q1[b : b + 1], keys, values, backend="reference")
        assert_close(out[b : b + 1], want, dtype=F64)
    with pytest.raises(TypeError, match=r"dtype must be torch\.float16, .* got float8_e4m3fn"):
        cache.to(torch.float8_e4m3fn)
    assert cache.dtype == F64
    assert cache.k_pages.dtype == (F64 if kv_dtype is None else kv_dtype)


# -------------------------------------------------------------------------------------------------
# A latent pool: values stored once, as the keys' first Dv columns (values_in_keys=True)


def _latent_pool(layout: str, dtype: torch.dtype = F64) -> PagedKVCache:
    return PagedKVCache(
        12,
        3,
        1,
        6,
        4,
        max_seqs=3,
        layout=layout,
        dtype=dtype,
        values_in_keys=True,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("layout", ["flash", "vllm"])
def test_a_latent_pools_values_are_a_view_of_its_keys(layout: str) -> None:
    """One memory in either layout: v_pages is k_pages[..., :Dv]. Rows of their own lengths,
    written by stage() and by write(), attend V = their keys' first columns."""
    c = _latent_pool(layout)
    assert c.v_pages.data_ptr() == c.k_pages.data_ptr()
    assert c.v_pages.stride() == c.k_pages.stride()
    assert c.v_pages.shape == (*c.k_pages.shape[:3], 4)
    g = torch.Generator().manual_seed(0)
    rows = Rows(3, 1, 6, 4)
    for new in ([5, 1, 7], [1, 1, 1], [2, 4, 1]):  # lengths that pages of 3 do not divide
        c.schedule(new)
        k = torch.randn(3, 1, 7, 6, dtype=F64, generator=g)
        q = torch.randn(3, 4, 7, 6, dtype=F64, generator=g)
        out, _ = c.attention(q, k, None, causal=True)
        c.commit()
        rows.add(k, k[..., :4], new)
        for b, n in enumerate(new):
            want = attnkit.attention(
                q[b : b + 1, :, :n],
                rows.k[b][None],
                rows.k[b][None, ..., :4],
                causal=True,
                backend="reference",
            )
            assert_close(out[b : b + 1, :, :n], want)
            assert_close(rows.v[b], rows.k[b][..., :4])
    # vLLM's reshape_and_cache writes the keys, and so the values
    slot = c.pages_of(1)[-1] * 3 + (c.lengths[1] - 1) % 3
    key = torch.randn(1, 1, 6, dtype=F64, generator=g)
    c.write(key, None, torch.tensor([slot]))
    vp = c.token_major()[1]
    assert torch.equal(vp[slot // 3, slot % 3], key[0, :, :4])
    c.write(key * 2, key[..., :4] * 2, torch.tensor([slot]))  # values equal to the keys' columns
    assert torch.equal(vp[slot // 3, slot % 3], 2 * key[0, :, :4])
    assert "values_in_keys=True" in repr(c)


@pytest.mark.parametrize("layout", ["flash", "vllm"])
def test_a_refused_write_into_a_latent_pool_changes_nothing(layout: str) -> None:
    c = _latent_pool(layout)
    k = torch.randn(3, 1, 4, 6, dtype=F64)
    c.stage(k, None)
    c.commit()
    before = _snapshot(c)
    other = k[..., :4].clone()
    other[2, 0, 1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"v\[2, 0, 1, 0\] = nan where k\[2, 0, 1, 0\] = "):
        c.stage(k, other)
    with pytest.raises(ValueError, match=r"v\[2, 0, 0\] = nan"):
        c.write(k[:, :, 1], other[:, :, 1], torch.tensor([20, 21, 22]))
    with pytest.raises(ValueError, match="out of pages"):
        c.stage(torch.randn(3, 1, 12, 6, dtype=F64), None)
    assert _same(_snapshot(c), before)


@pytest.mark.parametrize("layout", ["flash", "vllm"])
def test_keep_on_a_latent_pool_keeps_its_values_the_keys_first_columns(layout: str) -> None:
    """The kept tokens move once: values that are a view of the keys move with them."""
    c = _latent_pool(layout)
    k = torch.arange(3 * 8 * 6, dtype=F64).view(3, 1, 8, 6)
    c.stage(k, None)
    c.commit()
    c.keep(1, torch.tensor([[7, 2, 4, 0]]))
    view = c.view()
    keys, values = view.row(1)
    want = k[1:2, :, [0, 2, 4, 7]]
    assert torch.equal(keys, want)
    assert torch.equal(values, want[..., :4])
    assert c.v_pages.data_ptr() == c.k_pages.data_ptr()


@pytest.mark.parametrize("layout", ["flash", "vllm"])
def test_a_latent_pool_converted_keeps_its_values_a_view(layout: str) -> None:
    c = _latent_pool(layout)
    c.stage(torch.randn(3, 1, 4, 6, dtype=F64), None)
    c.commit()
    c.float()
    assert c.v_pages.dtype == torch.float32
    assert c.v_pages.data_ptr() == c.k_pages.data_ptr()
    assert torch.equal(c.v_pages, c.k_pages[..., :4])


@pytest.mark.parametrize("layout", ["flash", "vllm"])
def test_the_native_kernel_reads_a_latent_pool_in_place(layout: str) -> None:
    """float32 on the CPU: one attention call whose keys and values the native kernel reads from
    the pages where they lie, the values at the keys' own address (no copy of V)."""
    if not _native.load():
        pytest.skip("the native kernel is not available")
    c = PagedKVCache(16, 5, 1, 40, 32, max_seqs=2, layout=layout, values_in_keys=True)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)
    c.schedule([12, 7])
    c.stage(torch.randn(2, 1, 12, 40, generator=g), None)
    c.commit()
    q = torch.randn(2, 8, 1, 40, generator=g)
    with torch.no_grad(), attnkit.record_dispatch() as calls:
        out, _ = c.attention(q, torch.randn(2, 1, 1, 40, generator=g), None, causal=True)
    (call,) = calls
    assert call.kernel == kernel_cache.IN_PLACE
    read = call.call.cache
    assert read is not None
    assert read.v.data_ptr() == read.k.data_ptr() == c.k_pages.data_ptr()
    said = str(attnkit.explain(q, c.view(), causal=True))
    assert "auto picks: chunked" in said
    assert "reads the cache in place: native kernel" in said
    for b in range(2):
        keys, _ = c.view().row(b)
        want = attnkit.attention(
            q[b : b + 1].double(), keys.double(), keys[..., :32].double(), backend="reference"
        )
        assert_close(out[b : b + 1], want)


@pytest.mark.parametrize("layout", ["flash", "vllm"])
@pytest.mark.parametrize("kv_dtype", [torch.int8, *FLOAT8])
def test_a_quantized_latent_pool_reads_its_values_with_the_keys_scales(
    layout: str, kv_dtype: torch.dtype
) -> None:
    """Pages stored once, quantized: the values are the keys' first columns read with the keys'
    own scales (one buffer), through stage(), write(), keep(), a conversion and the native
    kernel's in-place read."""
    c = PagedKVCache(
        16,
        5,
        1,
        40,
        32,
        max_seqs=2,
        layout=layout,
        kv_dtype=kv_dtype,
        values_in_keys=True,  # type: ignore[arg-type]
    )
    assert c.v_scales is c.k_scales
    g = torch.Generator().manual_seed(0)
    c.schedule([12, 7])
    c.stage(torch.randn(2, 1, 12, 40, generator=g), None)
    c.commit()
    q = torch.randn(2, 8, 1, 40, generator=g)
    with torch.no_grad():
        out, _ = c.attention(q, torch.randn(2, 1, 1, 40, generator=g) * 3, None, causal=True)
    c.commit()
    for b in range(2):
        keys, values = c.view().row(b, F64)
        assert torch.equal(values, keys[..., :32])
        want = attnkit.attention(q[b : b + 1].double(), keys, keys[..., :32], backend="reference")
        assert_close(out[b : b + 1], want)
    slot = c.pages_of(1)[-1] * 5 + c.lengths[1] % 5
    c.write(torch.randn(1, 1, 40, generator=g), None, torch.tensor([slot]))
    keys, _ = c.view().row(0, F64)
    c.keep(0, torch.tensor([[12, 1, 2]]))  # (tokens moved onto the places of others kept)
    kept, values = c.view().row(0, F64)
    assert torch.equal(kept, keys[:, :, [1, 2, 12]])
    assert torch.equal(values, kept[..., :32])
    c.to("meta")  # (a move of device: each buffer moved on its own)
    assert c.v_scales is c.k_scales
    assert c.v_pages.data_ptr() == c.k_pages.data_ptr()


def test_a_sequence_is_named_by_any_integer_and_a_wrong_one_said_so() -> None:
    # Finished sequences found with numpy (np.nonzero(done)) are numpy integers: the message said
    # "seq must be a sequence from 0 to 1, got np.int64(1)", of a sequence in that range.
    np = pytest.importorskip("numpy")
    cache = PagedKVCache(4, 2, 1, 4, max_seqs=2, dtype=torch.float64)
    k = torch.arange(3, dtype=torch.float64).view(1, 1, 3, 1).expand(2, 1, 3, 4)
    cache.stage(k, k)
    cache.commit()
    cache.keep(np.int64(1), torch.tensor([[2]]))
    assert cache.lengths == [3, 1]
    assert cache.pages_of(np.int32(1)) == [2]
    cache.free(np.int64(0))
    assert cache.lengths == [0, 1]
    with pytest.raises(TypeError, match=r"seq must be an int, got tensor\(1\)"):
        cache.free(torch.tensor(1))
    with pytest.raises(ValueError, match=r"seq must be a sequence from 0 to 1, got 2"):
        cache.free(2)
    assert cache.lengths == [0, 1]


def test_a_compiled_decode_loop_compiles_a_few_times_not_once_a_token() -> None:
    # The page bookkeeping runs eagerly between graphs: its host-side lengths, taken into a graph,
    # were guarded as constants, so the staging frames compiled again at every token (until
    # torch's recompile limit). The steps equal an eager module's on its own cache.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # no frames compiled by earlier tests (their limits, their guards)
    torch.manual_seed(5)
    mha = MultiHeadAttention(32, 4).eval()
    eager_pool, pool = (PagedKVCache(32, 4, 4, 8, max_seqs=2) for _ in range(2))

    def step(x: Tensor, cache: PagedKVCache) -> Tensor:
        return mha(x, causal=True, cache=cache)

    compiled = torch.compile(step, backend="eager")  # dynamo's guards, no code generated
    with torch.no_grad():
        x = torch.randn(2, 6, 32)
        assert_close(compiled(x, pool), step(x, eager_pool))
        graphs = []
        for _ in range(10):
            x = torch.randn(2, 1, 32)
            assert_close(compiled(x, pool), step(x, eager_pool))
            graphs.append(counters["stats"]["unique_graphs"])
    assert pool.lengths == eager_pool.lengths == [16, 16]
    assert graphs[-1] - graphs[2] <= 2, graphs  # the graphs of the first steps, then few more


def test_a_compiled_decode_step_breaks_its_graph_only_around_the_bookkeeping() -> None:
    # Each method that runs between graphs looked its disabled form up in a table keyed by the
    # method's name, and hashing that name broke the graph once more at every trace
    # ("Missing hash_impl override"). Once the disabled forms are made (the first trace makes
    # them), the only breaks are the intended ones, and the steps equal an eager module's.
    from torch._dynamo.utils import counters

    torch.manual_seed(8)
    mha = MultiHeadAttention(32, 4).eval()

    def step(x: Tensor, cache: PagedKVCache) -> Tensor:
        return mha(x, causal=True, cache=cache)

    reasons: dict[str, int] = {}
    with torch.no_grad():
        for _ in range(2):  # the first makes the disabled forms; the second is counted
            torch._dynamo.reset()
            counters.clear()
            eager_pool, pool = (PagedKVCache(16, 4, 4, 8, max_seqs=2) for _ in range(2))
            compiled = torch.compile(step, backend="eager")
            for t in (6, 1, 1):
                x = torch.randn(2, t, 32)
                assert_close(compiled(x, pool), step(x, eager_pool))
        for reason, n in counters["graph_break"].items():
            reasons[reason.splitlines()[0]] = reasons.get(reason.splitlines()[0], 0) + n
    torch._dynamo.reset()
    assert pool.lengths == eager_pool.lengths == [8, 8]
    assert list(reasons) == ["Skip calling `torch.compiler.disable()`d function"], reasons


def test_an_inductor_compiled_rotary_decode_loop_on_rows_at_their_own_positions() -> None:
    # The rows' positions reach the graph as a tensor (next_positions()): as integers passed
    # from one graph to the next, inductor's generated code lost their symbol (NameError).
    torch._dynamo.reset()
    torch.manual_seed(7)
    mha = MultiHeadAttention(32, 4, num_kv_heads=2, rotary=RotaryEmbedding(8)).eval()
    eager_pool, pool = (PagedKVCache(32, 4, 2, 8, max_seqs=2) for _ in range(2))
    compiled = torch.compile(lambda x: mha(x, causal=True, cache=pool), dynamic=True)
    with torch.no_grad():
        x = torch.randn(2, 5, 32)
        for cache in (pool, eager_pool):
            cache.schedule([5, 3])
        assert_close(compiled(x), mha(x, causal=True, cache=eager_pool))
    torch._dynamo.reset()
    assert pool.lengths == eager_pool.lengths == [5, 3]


@pytest.mark.parametrize("prompts", [[6, 6], [6, 3]])
def test_a_compiled_decode_loop_with_rotary_reads_the_positions_between_graphs(
    prompts: list[int],
) -> None:
    # With a rotary, a module reads each row's position: a paged cache's are integers of a module,
    # which a graph read inside it took as constants, compiling again at every token until
    # torch's recompile limit; rows at positions of their own were grouped by a set of their
    # positions, which made them constants too. next_positions() reads them between graphs.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # no frames compiled by earlier tests (their limits, their guards)
    torch.manual_seed(6)
    mha = MultiHeadAttention(32, 4, rotary=RotaryEmbedding(8)).eval()
    eager_pool, pool = (PagedKVCache(32, 4, 4, 8, max_seqs=2) for _ in range(2))
    compiled = torch.compile(lambda x: mha(x, causal=True, cache=pool), backend="eager")
    with torch.no_grad():
        x = torch.randn(2, 6, 32)
        pool.schedule(prompts)
        eager_pool.schedule(prompts)
        assert_close(compiled(x), mha(x, causal=True, cache=eager_pool))
        graphs = []
        for _ in range(12):
            x = torch.randn(2, 1, 32)
            assert_close(compiled(x), mha(x, causal=True, cache=eager_pool))
            graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    want = [n + 12 for n in prompts]
    assert pool.lengths == eager_pool.lengths == want
    assert graphs[-1] - graphs[2] <= 2, graphs
    assert pool.positions == want
    assert pool.next_positions().tolist() == want
