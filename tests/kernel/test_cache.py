"""The kernel on a KV cache read in place (``attnkit._kernel.cache``, the native kernel's
``native_cache_forward``): contiguous caches and pages of any size in flash-attn's and vLLM's
layouts, each row its own stretch of keys and its queries aligned to the end of it, against the
float64 reference on the same keys gathered; pages no row reads hold NaN and table entries past a
row's pages name no page, so a read of either shows; every index is checked before it is
followed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import _native, attention
from attnkit._kernel.cache import cache_attention, cache_refusal
from attnkit.modules.positional import alibi_term
from attnkit.testing import assert_close

pytestmark = pytest.mark.skipif(not _native.load(), reason=f"native kernel: {_native.status()[1]}")

LAYOUTS = ["contiguous", "flash", "vllm"]


def _pages(
    x: torch.Tensor, layout: str, page: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A cache ``(N, Hkv, L, D)`` as the kernel reads it: ``(pages, block table)``. Pages are
    shuffled, a few spare ones hold NaN, and table entries past a row's pages are out of range."""
    n, hkv, length, d = x.shape
    if layout == "contiguous":  # (N, L, Hkv, D) memory, one page per row
        return x.transpose(1, 2).contiguous().transpose(1, 2), None
    per_row = -(-length // page)
    padded = torch.full((n, hkv, per_row * page, d), float("nan"), dtype=x.dtype)
    padded[:, :, :length] = x
    blocks = padded.view(n, hkv, per_row, page, d).permute(0, 2, 1, 3, 4).reshape(-1, hkv, page, d)
    spare = 3
    order = torch.randperm(n * per_row + spare, generator=g)
    store = torch.full((n * per_row + spare, hkv, page, d), float("nan"), dtype=x.dtype)
    store[order[: n * per_row]] = blocks
    table = order[: n * per_row].view(n, per_row)
    table = torch.cat([table, torch.full((n, 2), 10**9)], 1)  # entries no row reads
    if layout == "flash":  # (blocks, page, Hkv, D) memory
        return store.transpose(1, 2).contiguous().transpose(1, 2), table
    return store, table


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranges: list[tuple[int, int]],
    band: tuple[float, float] | None,
    slopes: torch.Tensor | None,
    **kw: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row, in float64, on the row's keys (as a contiguous tensor), with a dense mask."""
    outs, lses = [], []
    tq = q.size(2)
    for n, (start, end) in enumerate(ranges):
        i = torch.arange(tq)[:, None] + (end - tq)  # each query's key position
        j = torch.arange(end)[None, :]
        seen = j >= start
        if band is not None:
            seen = seen & (j - i >= band[0]) & (j - i <= band[1])
        bias = None
        if slopes is not None:
            bias = -slopes.double()[:, None, None] * (j - i).abs().double()
        wide = {name: x.double() if isinstance(x, torch.Tensor) else x for name, x in kw.items()}
        out, lse = attention(
            q[n : n + 1].double(),
            k[n : n + 1, :, :end].double(),
            v[n : n + 1, :, :end].double(),
            mask=seen,
            bias=bias,
            backend="reference",
            return_lse=True,
            **wide,  # type: ignore[arg-type]
        )
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _case(
    g: torch.Generator,
    n: int,
    h: int,
    hkv: int,
    tq: int,
    length: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(n, h, tq, 16, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(n, hkv, length, 16, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(n, hkv, length, 12, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: str,
    page: int,
    ranges: list[tuple[int, int]],
    g: torch.Generator,
    **kw: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    kp, table = _pages(k, layout, page, g)
    g2 = torch.Generator().manual_seed(int(torch.randint(0, 2**16, (1,), generator=g)))
    if table is None:
        vp, _ = _pages(v, layout, page, g2)
    else:
        vp, _ = _same_pages(v, layout, page, table, kp.size(0))
    with torch.inference_mode():
        return cache_attention(q, kp, vp, kv_range=ranges, block_table=table, **kw)  # type: ignore[arg-type]


def _same_pages(
    x: torch.Tensor, layout: str, page: int, table: torch.Tensor, pages: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in the ``pages`` pages of which ``table`` already assigned some (values share the
    keys' block table)."""
    n, hkv, length, d = x.shape
    store = torch.full((pages, hkv, page, d), float("nan"), dtype=x.dtype)
    for row in range(n):
        for p in range(-(-length // page)):
            chunk = x[row, :, p * page : (p + 1) * page]
            store[int(table[row, p]), :, : chunk.size(1)] = chunk
    if layout == "flash":
        return store.transpose(1, 2).contiguous().transpose(1, 2), table
    return store, table


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("page", [1, 16, 48, 256])
@pytest.mark.parametrize("layout", ["flash", "vllm"])
def test_pages_read_through_the_table_equal_the_keys_gathered(
    layout: str, page: int, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(page)
    q, k, v = _case(g, 3, 8, 2, 2, 300, dtype)
    ranges = [(0, 300), (17, 211), (5, 6)]
    got = _run(q, k, v, layout, page, ranges, g, band=(-math.inf, 0.0), scale=0.3)
    want = _reference(q, k, v, ranges, (-math.inf, 0.0), None, scale=0.3)
    for a, w in zip(got, want, strict=True):
        assert_close(a, w, dtype=dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_of_their_own_lengths_windows_alibi_softcap_and_sinks(layout: str) -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = _case(g, 4, 6, 3, 5, 700, torch.float32)
    ranges = [(0, 700), (100, 650), (0, 3), (250, 260)]  # row 2: fewer keys than queries
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03, 0.01])
    kw = {"scale": 0.25, "softcap": 3.0, "sinks": torch.randn(6, generator=g)}
    got = _run(
        q,
        k,
        v,
        layout,
        32,
        ranges,
        g,
        band=(-40.0, 0.0),
        bias=alibi_term(slopes, 5, 700),
        **kw,
    )
    want = _reference(q, k, v, ranges, (-40.0, 0.0), slopes, **kw)
    for a, w in zip(got, want, strict=True):
        assert_close(a, w, dtype=torch.float32)


@pytest.mark.parametrize("terms", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "flash"])
@pytest.mark.parametrize(
    ("hkv", "d", "dtype"),
    [
        (2, 16, torch.float32),  # 128-byte tokens, 32 to a 4 KiB page: read out of order
        (3, 16, torch.float32),  # 192 bytes: pages hold no whole number of tokens
        (4, 256, torch.float32),  # 4 KiB, a token a page
        (8, 16, torch.bfloat16),  # 256 bytes of bfloat16, 16 to a page
    ],
)
def test_token_major_rows_read_for_every_head_at_once(
    hkv: int, d: int, dtype: torch.dtype, layout: str, terms: bool
) -> None:
    # Token-major keys and values (flash-attn's layout) are read for all heads of a block of keys
    # in turn, in address order, tokens smaller than a page out of order; lengths that are no
    # multiple of a block or a step; the terms read the scores in the keys' own order.
    g = torch.Generator().manual_seed(hkv * d)
    length = 300
    q = torch.randn(3, 2 * hkv, 2, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(3, hkv, length, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(3, hkv, length, d, generator=g, dtype=torch.float64).to(dtype)
    ranges = [(0, 300), (37, 211), (5, 6)]
    band, slopes = None, None
    kw: dict[str, object] = {"scale": d**-0.5}
    if terms:
        band, slopes = (-70.0, 0.0), torch.linspace(0.02, 0.3, 2 * hkv)
        kw["softcap"] = 4.0
    got = _run(
        q,
        k,
        v,
        layout,
        16,
        ranges,
        g,
        band=band,
        bias=None if slopes is None else alibi_term(slopes, 2, length),
        **kw,
    )
    want = _reference(q, k, v, ranges, band, slopes, **kw)
    for a, w in zip(got, want, strict=True):
        assert_close(a, w, dtype=dtype)


def test_packed_queries_of_several_lengths() -> None:
    # flash-attn's varlen with a block table: sequence s has its own queries and keys.
    g = torch.Generator().manual_seed(2)
    lengths_q, ranges = [3, 1, 0, 20], [(0, 40), (0, 7), (0, 5), (0, 90)]
    q = torch.randn(1, 4, sum(lengths_q), 16, generator=g, dtype=torch.float64)
    k = torch.randn(4, 2, 90, 16, generator=g, dtype=torch.float64)
    v = torch.randn(4, 2, 90, 12, generator=g, dtype=torch.float64)
    starts = [0, 3, 4, 4]
    q_range = [[s, n] for s, n in zip(starts, lengths_q, strict=True)]
    kp, table = _pages(k, "flash", 16, g)
    vp, _ = _same_pages(v, "flash", 16, table, kp.size(0))  # type: ignore[arg-type]
    slopes = torch.tensor([0.5, 0.25, 0.1, 0.05], dtype=torch.float64)
    with torch.inference_mode():
        out, lse = cache_attention(
            q,
            kp,
            vp,
            kv_range=ranges,
            block_table=table,
            q_range=q_range,
            band=(-math.inf, 0.0),
            bias=alibi_term(slopes, max(lengths_q), 90),
            scale=0.3,
        )
    for s, (first, count) in enumerate(q_range):
        if not count:
            continue
        qs = q[:, :, first : first + count]
        want = _reference(
            qs, k[s : s + 1], v[s : s + 1], [ranges[s]], (-math.inf, 0.0), slopes, scale=0.3
        )
        assert_close(out[:, :, first : first + count], want[0])
        assert_close(lse[:, :, first : first + count], want[1])


@pytest.mark.parametrize("threads", [1, 2])
def test_a_long_row_split_by_keys(threads: int) -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = _case(g, 1, 4, 1, 1, 5000, torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _run(q, k, v, "flash", 256, [(3, 4999)], g, scale=0.25)
    finally:
        torch.set_num_threads(before)
    want = _reference(q, k, v, [(3, 4999)], None, None, scale=0.25)
    for a, w in zip(got, want, strict=True):
        assert_close(a, w, dtype=torch.float32)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_cache_fuzz_against_the_reference(data: st.DataObject) -> None:
    draw = data.draw
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    n, hkv, groups = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    tq = draw(st.sampled_from([1, 2, 7, 16, 23]))
    length = draw(st.integers(1, 400))
    ends = [draw(st.integers(0, length)) for _ in range(n)]
    ranges = [(draw(st.integers(0, e)), e) for e in ends]
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    q, k, v = _case(g, n, hkv * groups, hkv, tq, length, dtype)
    band = draw(st.sampled_from([None, (-math.inf, 0.0), (-9.0, 0.0), (-5.0, 3.0), (2.0, 30.0)]))
    slopes = None
    kw: dict[str, object] = {"scale": draw(st.sampled_from([0.1, 0.5]))}
    if draw(st.booleans()):
        slopes = torch.rand(hkv * groups, generator=g, dtype=torch.float64).to(dtype)
        kw["bias"] = alibi_term(slopes, tq, max(ends))
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([0.5, 5.0]))
    layout = draw(st.sampled_from(LAYOUTS))
    page = draw(st.sampled_from([1, 3, 16, 64, 256]))
    got = _run(q, k, v, layout, page, ranges, g, band=band, **kw)
    kw.pop("bias", None)
    want = _reference(q, k, v, ranges, band, slopes, **kw)
    assert_close(got[0], want[0], dtype=dtype)
    seen = want[1].isfinite()
    assert torch.equal(got[1].isfinite(), seen)
    assert_close(got[1][seen], want[1][seen], dtype=dtype)


def test_nan_in_the_keys_a_row_does_not_see_changes_nothing() -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = _case(g, 2, 4, 2, 3, 200, torch.float32)
    ranges = [(50, 200), (0, 120)]
    dirty_k, dirty_v = k.clone(), v.clone()
    dirty_k[0, :, :50], dirty_v[0, :, :50] = float("nan"), float("inf")  # before row 0's start
    dirty_k[1, :, 120:], dirty_v[1, :, 120:] = float("inf"), float("nan")  # after row 1's end
    got = _run(q, dirty_k, dirty_v, "vllm", 16, ranges, g, band=(-100.0, 0.0), scale=0.3)
    want = _reference(q, k, v, ranges, (-100.0, 0.0), None, scale=0.3)
    for a, w in zip(got, want, strict=True):
        assert_close(a, w, dtype=torch.float32)


def test_opcheck_native_cache_forward() -> None:
    g = torch.Generator().manual_seed(5)
    q, k, v = _case(g, 2, 4, 2, 3, 60, torch.float32)
    kp, table = _pages(k, "flash", 16, g)
    vp, _ = _same_pages(v, "flash", 16, table, kp.size(0))  # type: ignore[arg-type]
    q5 = q.reshape(2, 2, 2, 3, 16)
    ranges = torch.tensor([[0, 60], [7, 33]])
    args = (q5, kp, vp, table, ranges, None, None, None)
    kwargs = {"scale": 0.3, "band": [-math.inf, 0.0], "softcap": 2.0}
    torch.library.opcheck(torch.ops.attnkit.native_cache_forward.default, args, kwargs)


def test_opcheck_indexed_cache_rows() -> None:
    """The operator a compiled index-mask call on a cache makes its rows' positions with: each
    row's base, first key, end and real queries, for rows of their own and for shared ones."""
    g = torch.Generator().manual_seed(6)
    q, k, v = _case(g, 2, 4, 2, 3, 60, torch.float32)
    for ranges, q_lens, shared in (([0, 60, 7, 33], [3, 2], False), ([5, 40, 5, 40], [], True)):
        args = (q, k, v, None, None, None, None, [])
        kwargs = {
            "ranges": ranges, "q_lens": q_lens, "shared": shared, "numbers": [], "mask": "null",
            "scale": 0.3, "softcap": None, "words": "index mask on a cache",
        }  # fmt: skip
        op = torch.ops.attnkit.indexed_cache_rows.default
        torch.library.opcheck(op, args, kwargs)
        base = [ranges[0], ranges[2]] if shared else [0, 0]
        real = q_lens or [3, 3]
        want = torch.tensor([base, ranges[0::2], ranges[1::2], real])
        assert torch.equal(op(*args, **kwargs), want)


def test_who_is_served() -> None:
    q, k = torch.randn(1, 2, 1, 8), torch.randn(3, 2, 16, 8)
    assert cache_refusal(q, k, k) is None
    assert "one dtype" in str(cache_refusal(q.bfloat16(), k, k))
    assert "float64, bfloat16 or float16), got int32" in str(
        cache_refusal(*(x.int() for x in (q, k, k)))
    )
    reduced = (q.bfloat16(), k.bfloat16(), k.bfloat16())
    assert cache_refusal(*reduced) is None  # read as they are, computed in float32
    assert "gradients" in str(cache_refusal(q.requires_grad_(), k, k))
    with torch.no_grad():
        assert cache_refusal(q, k, k) is None


# Arguments that would make the kernel read or write out of bounds, each in a child process: a
# missing check would crash it rather than fail a test.
BAD = {
    "nothing": ("pass", ""),
    "a page past the end": ("table[1, 2] = 7", "block_table[1, 2] = 7 is not a page"),
    "a negative page": ("table[0, 0] = -1", "block_table[0, 0] = -1 is not a page"),
    "keys past the table": ("ranges[1, 1] = 65", "lie outside its 64 positions"),
    "a start past the end": ("ranges[0] = torch.tensor([9, 4])", "row 0's keys 9:4"),
    "an int32 table": ("table = table.int()", "block_table must be contiguous int64"),
    "float64 pages": ("k = k.double()", "k and v must have q's dtype"),
    "queries past q": (
        "q_range = torch.tensor([[0, 2], [2, 5]])",
        "row 1's queries 2:7 overlap the previous row's or lie outside",
    ),
    "a short distance table": ("bias = bias[:, :3].contiguous()", "reads elements"),
}


def test_a_bad_index_is_refused_before_it_is_followed() -> None:
    # One child runs every case in turn and prints what each raised: a crash ends the child, and
    # the last case it announced is the one that crashed it.
    script = textwrap.dedent(
        """
        import json, sys, torch, attnkit._native as native
        assert native.load()
        for case, edit in json.loads(sys.argv[1]).items():
            print(json.dumps({"started": case}), flush=True)
            q = torch.randn(1, 2, 2, 6, 8)
            k, v = torch.randn(5, 2, 16, 8), torch.randn(5, 2, 16, 8)
            table = torch.tensor([[0, 1, 2, 3], [4, 0, 1, 2]])
            ranges = torch.tensor([[0, 64], [3, 40]])
            q_range = torch.tensor([[0, 2], [2, 4]])
            bias = torch.randn(4, 70)
            exec(edit)
            try:
                torch.ops.attnkit.native_cache_forward(
                    q, k, v, table, ranges, q_range, bias, None, scale=0.3,
                    bias_layout=[0, 140, 70, -1, 1, 3],  # distances from -63 (Tq=4, Tk=64)
                )
                said = None
            except RuntimeError as err:
                said = str(err)
            print(json.dumps({"case": case, "said": said}), flush=True)
        """
    )
    edits = {case: edit for case, (edit, _) in BAD.items()}
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(edits)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    started = [line["started"] for line in lines if "started" in line]
    assert done.returncode == 0, f"the child died in {started[-1:]}: {done.stderr[-2000:]}"
    said = {line["case"]: line["said"] for line in lines if "case" in line}
    assert list(said) == list(BAD)
    for case, (_, words) in BAD.items():
        if words:
            assert words in (said[case] or ""), (case, said[case])
        else:
            assert said[case] is None, (case, said[case])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8, torch.float8_e4m3fn])
def test_a_call_of_no_rows_gives_an_empty_output(kv_dtype: torch.dtype) -> None:
    """No batch rows: the pairs of no rows are still ``(0, 2)`` ranges, and the call gives an
    empty output and log-sum-exp, as the reference does (flash_attn_with_kvcache of a float8
    cache at B = 0 failed in the operator's check of kv_range)."""
    from attnkit import CacheView
    from attnkit.flash_attn import flash_attn_with_kvcache

    pages = torch.zeros(0, 2, 8, 4).to(kv_dtype)
    scales: dict[str, torch.Tensor] = {}
    if kv_dtype != torch.float32:
        scales = {"k_scale": torch.ones(0, 2, 8, 1), "v_scale": torch.ones(0, 2, 8, 1)}
    q = torch.randn(0, 4, 1, 4)
    flat = {name: s[..., 0] for name, s in scales.items()}  # (X, Hkv, page)
    out, lse = cache_attention(q, pages, pages, kv_range=[], scale=0.5, **flat)  # type: ignore[arg-type]
    assert out.shape == (0, 4, 1, 4)
    assert lse.shape == (0, 4, 1)
    view = CacheView(pages, pages, [], **scales)
    want = attention(q, view, None, backend="reference")
    assert torch.equal(attention(q, view, None, backend="chunked"), want)
    if kv_dtype == torch.float8_e4m3fn:
        cache = pages.transpose(1, 2)  # (B, capacity, Hkv, D)
        got = flash_attn_with_kvcache(
            q.transpose(1, 2), cache, cache, k_descale=torch.ones(0, 2), v_descale=torch.ones(0, 2)
        )
        assert got.shape == (0, 1, 4, 4)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("ranges", [[(0, 9)], [(0, 9), (0, 5)], [(2, 9), (2, 9)]])
def test_a_view_of_fewer_rows_than_the_cache_reads_its_first_pages(
    ranges: list[tuple[int, int]], kv_dtype: torch.dtype
) -> None:
    """A contiguous cache of 4 rows viewed for a call of fewer (a batch that shrank): row n's
    keys are page n, the pages past the rows unread (the native read refused the call: 'k and v
    hold one page per row: 2 rows, got 4')."""
    from attnkit import CacheView
    from attnkit.caches.kv_cache import KVCache

    g = torch.Generator().manual_seed(0)
    cache = KVCache(4, 12, 2, 8, kv_dtype=None if kv_dtype == torch.float32 else kv_dtype)
    cache.update(*(torch.randn(4, 2, 9, 8, generator=g) for _ in range(2)))
    whole = cache.view()
    view = CacheView(whole.k, whole.v, ranges, k_scale=whole.k_scale, v_scale=whole.v_scale)
    for q_len in (1, 3):
        q = torch.randn(len(ranges), 4, q_len, 8, generator=g)
        want = attention(q, view, causal=True, backend="reference")
        assert_close(attention(q, view, causal=True, backend="chunked"), want)


@pytest.mark.parametrize("paged", [False, True])
def test_a_bias_by_distance_over_rows_whose_keys_start_after_0(paged: bool) -> None:
    """Rows that share a stretch of keys starting after 0 (a window, left padding) make a call of
    Tk = the stretch's keys, and a bias by distance built for it holds its distances; the native
    read laid the table out from the stretch's end and refused it ('the call (Tq=2, Tk=9) has
    distances -8 to 1')."""
    from attnkit import CacheView, alibi_slopes

    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, 12, 8, generator=g) for _ in range(2))
    table = None
    if paged:  # pages of 4 through a table
        k = k.view(2, 2, 3, 4, 8).transpose(1, 2).reshape(6, 2, 4, 8)
        v = v.view(2, 2, 3, 4, 8).transpose(1, 2).reshape(6, 2, 4, 8)
        table = torch.arange(6, dtype=torch.int32).view(2, 3)
    view = CacheView(k, v, [(3, 9), (3, 9)], block_table=table)
    q = torch.randn(2, 4, 2, 8, generator=g)
    bias = alibi_term(alibi_slopes(4), 2, view.width)  # the call's Tk: the stretch of 6 keys
    want = attention(q, view, causal=True, bias=bias, backend="reference")
    assert_close(attention(q, view, causal=True, bias=bias, backend="chunked"), want)
    short = alibi_term(alibi_slopes(4), 2, view.width - 1)  # one distance short: refused
    with pytest.raises(ValueError, match="the table must hold all of them"):
        attention(q, view, causal=True, bias=short, backend="chunked")


def test_queries_expanded_along_tq_are_read_as_their_values() -> None:
    """Queries that share their memory along Tq (one query expanded, stride 0): the native read
    took them for overlapping rows and raised 'rows must not overlap'."""
    from attnkit import CacheView

    g = torch.Generator().manual_seed(0)
    pages = torch.randn(3, 2, 16, 8, generator=g)
    q = torch.randn(1, 1, 1, 8, generator=g).expand(3, 4, 5, 8)
    for ranges in ([(0, 9), (0, 5), (2, 12)], [(0, 9)] * 3):
        view = CacheView(pages, pages, ranges)
        want = attention(q.contiguous(), view, causal=True, backend="reference")
        assert_close(attention(q, view, causal=True, backend="chunked"), want)
