"""CacheView: a call on a cache's rows where they lie equals brute-force attention over each row's
keys; explain() shows it and record_dispatch() records it; a backend serves it if it says so."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks
from attnkit.backends.base import CallInputs, Output
from attnkit.caches.view import CacheView, band_of, row_mask, rows_refusal
from attnkit.testing import assert_close
from tests.helpers import brute_force

F64 = torch.float64


def _rows(gen: torch.Generator, ranges: list[tuple[int, int]], hkv: int = 2, d: int = 4) -> Any:
    """Each row's keys and values (its own length), and the same tokens as a contiguous cache and
    as shuffled pages of 3 through a block table."""
    rows, length = len(ranges), max(e for _, e in ranges)
    k = torch.randn(rows, hkv, length, d, generator=gen, dtype=F64)
    v = torch.randn(rows, hkv, length, d + 1, generator=gen, dtype=F64)
    page = 3
    per_row = -(-length // page)
    order = torch.randperm(rows * per_row, generator=gen)
    table = order.view(rows, per_row)

    def paged(t: Tensor) -> Tensor:  # (N, Hkv, L, D) -> (X, Hkv, page, D), row n on table[n]
        padded = torch.zeros(rows, t.size(1), per_row * page, t.size(3), dtype=F64)
        padded[:, :, : t.size(2)] = t
        blocks = padded.unflatten(2, (per_row, page)).transpose(1, 2).flatten(0, 1)
        pages = torch.empty_like(blocks)
        pages[order] = blocks
        return pages

    return k, v, CacheView(k, v, ranges), CacheView(paged(k), paged(v), ranges, table)


def _expected(q: Tensor, k: Tensor, v: Tensor, ranges: list[tuple[int, int]], counts: list[int],
              **kw: Any) -> Tensor:  # fmt: skip
    out = torch.zeros(*q.shape[:-1], v.size(-1), dtype=F64)
    for n, ((a, e), m) in enumerate(zip(ranges, counts, strict=True)):
        if m:
            out[n, :, :m] = brute_force(q[n : n + 1, :, :m], k[n : n + 1, :, a:e],
                                        v[n : n + 1, :, a:e], **kw)[0][0]  # fmt: skip
    return out


@pytest.mark.parametrize("backend", ["chunked", "reference"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("q_lens", [None, (2, 0, 1)])
def test_each_row_attends_its_own_keys(backend: str, layout: str, q_lens: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    ranges = [(0, 7), (2, 5), (1, 11)]
    k, v, contiguous, paged = _rows(gen, ranges)
    view = contiguous if layout == "contiguous" else paged
    if q_lens is not None:
        view = CacheView(view.k, view.v, ranges, view.block_table, q_lens)
    q = torch.randn(3, 4, 2, 4, generator=gen, dtype=F64)
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=F64)
    with torch.no_grad():
        out, lse = attnkit.attention(q, view, causal=True, softcap=3.0, sinks=sinks,
                                     return_lse=True, backend=backend)  # fmt: skip
    counts = list(q_lens or (2, 2, 2))
    assert_close(out, _expected(q, k, v, ranges, counts, causal=True, softcap=3.0, sinks=sinks))
    assert lse.shape == (3, 4, 2)
    assert (lse[1, :, :] == -torch.inf).all() == (q_lens is not None)


def test_rows_that_share_their_keys_take_any_mask_and_bias() -> None:
    """Every row's keys the same stretch: the call is the dense call on them."""
    gen = torch.Generator().manual_seed(1)
    k, v, _, paged = _rows(gen, [(1, 9)] * 2)
    paged = CacheView(paged.k, paged.v, [(1, 9)] * 2, paged.block_table)
    q = torch.randn(2, 4, 3, 4, generator=gen, dtype=F64)
    mask = masks.key_padding([8, 5])
    bias = torch.randn(2, 4, 3, 8, generator=gen, dtype=F64)
    keys, values = k[:, :, 1:9], v[:, :, 1:9]
    want = attnkit.attention(q, keys, values, mask=mask, bias=bias, backend="reference")
    for backend in ("chunked", "reference"):
        got = attnkit.attention(q, paged, mask=mask, bias=bias, backend=backend)
        assert_close(got, want)


def test_explain_shows_a_cache_call_and_record_dispatch_records_it() -> None:
    gen = torch.Generator().manual_seed(2)
    _, _, _, paged = _rows(gen, [(0, 7), (0, 4)])
    q = torch.randn(2, 4, 1, 4, generator=gen, dtype=F64)
    text = str(attnkit.explain(q, paged, causal=True))
    assert "2 rows of keys 0..7, 0..4 of 6 pages of 3 through a block table" in text
    assert "auto picks: chunked" in text
    assert re.search(r"sdpa +cannot: reads a KV cache view on cpu only as views", text)
    with torch.no_grad(), attnkit.record_dispatch() as calls:
        attnkit.attention(q, paged, causal=True)
    assert [c.chosen for c in calls] == ["chunked"]
    assert calls[0].call.cache is not None
    assert calls[0].call.cache.rows == 2


class _Gathering(attnkit.Backend):
    """A backend of one's own that serves cache calls through dense calls of its own."""

    accepts_cache = True

    def run(self, call: attnkit.AttentionCall, inputs: CallInputs) -> Output:
        def dense(q: Tensor, k: Tensor, v: Tensor, row: int | None) -> Tensor:
            return attnkit.attention(q, k, v, mask=call.mask, scale=call.scale, backend="reference")

        assert call.cache is not None
        return call.cache.attend_rows(inputs.q, dense, weights=False, lse=False)


def test_a_backend_serves_cache_calls_only_when_it_says_so() -> None:
    gen = torch.Generator().manual_seed(3)
    k, v, contiguous, _ = _rows(gen, [(0, 5), (3, 6)])
    q = torch.randn(2, 2, 1, 4, generator=gen, dtype=F64)
    mine = _Gathering("gathering")
    got = attnkit.attention(q, contiguous, causal=True, backend=mine)
    assert_close(got, _expected(q, k, v, [(0, 5), (3, 6)], [1, 1], causal=True))

    def fn(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> Tensor:
        raise AssertionError("never run")

    plain = attnkit.Backend("plain", fn)
    with pytest.raises(attnkit.BackendError, match="reads no KV cache view"):
        attnkit.attention(q, contiguous, causal=True, backend=plain)


def test_gradients_reach_q_through_the_gathered_rows() -> None:
    gen = torch.Generator().manual_seed(4)
    k, v, _, paged = _rows(gen, [(0, 6), (2, 4)])
    q = torch.randn(2, 2, 2, 4, generator=gen, dtype=F64, requires_grad=True)
    grads = []
    for backend in ("chunked", "reference"):
        out = attnkit.attention(q, paged, causal=True, backend=backend)
        (g,) = torch.autograd.grad(out.square().sum(), q)
        grads.append(g)
    q0 = q.detach().requires_grad_()
    want = torch.zeros(2, 2, 2, 5, dtype=F64)
    for n, (a, e) in enumerate([(0, 6), (2, 4)]):
        want[n] = attnkit.attention(q0[n : n + 1], k[n : n + 1, :, a:e], v[n : n + 1, :, a:e],
                                    causal=True, backend="reference")[0]  # fmt: skip
    (expected,) = torch.autograd.grad(want.square().sum(), q0)
    for g in grads:
        assert_close(g, expected)


def test_rows_of_their_own_take_bands_and_biases_by_distance_only() -> None:
    gen = torch.Generator().manual_seed(5)
    _, _, contiguous, _ = _rows(gen, [(0, 5), (0, 3)])
    q = torch.randn(2, 2, 1, 4, generator=gen, dtype=F64)
    with pytest.raises(ValueError, match=re.escape("got key_padding(lengths=[5, 3])")):
        attnkit.attention(q, contiguous, mask=masks.key_padding([5, 3]))
    with pytest.raises(TypeError, match="takes a bias by distance"):
        attnkit.attention(q, contiguous, bias=torch.zeros(2, 2, 1, 5, dtype=F64))
    with pytest.raises(TypeError, match="v must be None"):
        attnkit.attention(q, contiguous, contiguous.v)  # type: ignore[call-overload]
    window = masks.sliding_window(2) & masks.causal()
    assert band_of(window) == (-2, 0)
    assert band_of(masks.key_padding([1])) is None


def test_rows_of_their_own_take_masks_read_at_their_own_pairs() -> None:
    """Bands aligned to the row's end, index masks and bool tensors, joined by & and |; a mask
    that says which keys exist, or a band from the top-left corner, is named."""
    idx = masks.key_indices(torch.zeros(1, 1, 1, 1, dtype=torch.long))
    assert rows_refusal(idx & masks.causal() | torch.ones(1, 1, 1, 1, dtype=torch.bool)) is None
    assert rows_refusal(masks.key_padding([1]) & idx) == "key_padding(lengths=[1])"
    assert rows_refusal(masks.causal("top_left")) == masks.causal("top_left").describe()


def test_a_rows_own_mask_reads_its_entries_at_its_keys() -> None:
    """Row 0 holds keys 2..5, row 1 keys 0..2: NSA's blocks of 2, ``[0, 2]`` and ``[1, -1]``, are
    keys 0, 1, 4, 5 and 2, 3, of which each row attends those it holds, at their places in its
    own keys; a tensor's row, its real queries and the row's keys."""
    k = torch.zeros(2, 1, 8, 1)
    view = CacheView(k, k, kv_range=((2, 6), (0, 3)))
    blocks = masks.block_indices(torch.tensor([[0, 2], [1, -1]]).view(2, 1, 1, 2), block=2)
    row0, row1 = (row_mask(blocks, view, n, 1) for n in (0, 1))
    assert row0 is not None
    assert row1 is not None
    assert row0.dense(1, 4)[0, 0].int().tolist() == [[0, 0, 1, 1]]
    assert row1.dense(1, 3)[0, 0].int().tolist() == [[0, 0, 1]]
    dense = torch.arange(2 * 2 * 6).view(2, 1, 2, 6) % 3 == 0  # (N, 1, Tq, Tk)
    own = row_mask(masks.from_tensor(dense) & masks.causal(), view, 0, 1)
    assert own is not None
    assert torch.equal(own.parts[0].tensor, dense[:1, :, :1, 2:6])  # type: ignore[arg-type]
    assert own.parts[1].band == (-float("inf"), 0, "bottom_right")


def test_a_view_is_checked_when_it_is_made() -> None:
    pages = torch.zeros(4, 1, 2, 3)
    with pytest.raises(ValueError, match=re.escape("block_table[1, 0] = 4 is not a page")):
        CacheView(pages, pages, [(0, 3), (0, 1)], torch.tensor([[0, 1], [4, 9]]))
    with pytest.raises(ValueError, match="without a block table row n's keys are page n"):
        CacheView(pages, pages, [(0, 3)])
    with pytest.raises(ValueError, match="end >= start >= 0"):
        CacheView(pages, pages, [(2, 1)])
    with pytest.raises(ValueError, match="q_lens must hold 1 ints"):
        CacheView(pages, pages, [(0, 2)], q_lens=(1, 1))


def test_a_block_table_without_data_is_refused_for_pages_that_are_read() -> None:
    # It was taken unread, and the call then failed in torch ("Cannot copy out of meta tensor").
    pages = torch.zeros(4, 1, 2, 3)
    with pytest.raises(ValueError, match="block_table is on meta but the pages are on cpu"):
        CacheView(pages, pages, [(0, 3)], torch.zeros(1, 2, dtype=torch.int32, device="meta"))
    meta = pages.to("meta")  # explain(device=...) describes such a view: nothing is read
    view = CacheView(meta, meta, [(0, 3)], torch.zeros(1, 2, dtype=torch.int32, device="meta"))
    assert view.kv_len == 3


def test_under_autocast_the_rows_are_cast_as_q_is() -> None:
    gen = torch.Generator().manual_seed(6)
    k, v, _, paged = _rows(gen, [(0, 6), (1, 4)])
    paged = CacheView(paged.k.float(), paged.v.float(), paged.kv_range, paged.block_table)
    q = torch.randn(2, 2, 1, 4, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attnkit.attention(q, paged, causal=True)
    assert out.dtype == torch.bfloat16
    want = _expected(q.double(), k, v, [(0, 6), (1, 4)], [1, 1], causal=True)
    assert_close(out, want, dtype=torch.bfloat16)


def test_a_view_made_while_compiling_never_reads_past_its_pages() -> None:
    # Made inside a compiled function, a view's ends were not checked (its checks ran in eager
    # only): keys past a row's page were sliced away and the call gave numbers over fewer keys.
    pages = torch.randn(2, 2, 16, 8)

    def step(q: torch.Tensor, ends: tuple[int, int]) -> torch.Tensor:
        view = CacheView(pages, pages, [(0, ends[0]), (0, ends[1])])
        return attnkit.attention(q, view, causal=True)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    q = torch.randn(2, 4, 1, 8)
    with pytest.raises(Exception, match="past the keys its pages hold"):
        compiled(q, (20, 3))


def test_a_view_made_while_compiling_reads_ends_given_as_a_tensor() -> None:
    # kv_range as a tensor (N, 2) is read on the host, as in eager; while compiling it was left
    # a tensor and the call failed in 'Boolean value of Tensor with more than one value'.
    pages = torch.randn(2, 2, 16, 8)

    def step(q: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        return attnkit.attention(q, CacheView(pages, pages, ends), causal=True)

    q, ends = torch.randn(2, 4, 1, 8), torch.tensor([[0, 5], [2, 9]])
    got = torch.compile(step, backend="eager")(q, ends)
    assert_close(
        got, attnkit.attention(q, CacheView(pages, pages, ends), backend="reference", causal=True)
    )
