"""KV caches under torch.compile: what record_dispatch() records when a compiled graph runs an
index mask on a cache, against an eager call's record."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.caches.view import CacheView

F64 = torch.float64


def _said(calls: list[attnkit.Dispatch]) -> list[tuple[object, ...]]:
    """What a record says of each call: backend, hand-overs, kernel, and the call's sizes,
    settings, rows and mask."""
    out = []
    for d in calls:
        c = d.call
        rows = None if c.cache is None else (c.cache.kv_range, c.cache.block_table is not None)
        mask = None if c.mask is None else c.mask.describe()
        sizes = (c.batch_shape, c.num_heads, c.num_kv_heads, c.q_len, c.kv_len, c.dtype)
        out.append((d.chosen, d.served_by, d.handovers, d.kernel, sizes, c.scale, c.sinks, rows,
                    mask))  # fmt: skip
    return out


@pytest.fixture
def fresh_dynamo() -> object:
    torch._dynamo.reset()  # no frames compiled by earlier tests (their limits, their guards)
    yield None
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("dtype", [torch.float32, F64])  # native gathered kernel; torch's products
def test_a_compiled_index_mask_on_pages_records_what_an_eager_one_does(dtype: torch.dtype) -> None:
    # Eager, an index mask on a paged cache records "index mask on a cache" with the kernel that
    # attends the gathered keys; compiled, the dispatcher ran while tracing and the call recorded
    # nothing (and the gather fell back to eager Python: its check for values stored in the keys
    # broke the graph inside a loop). Each step equals the eager module on its own pool.
    torch.manual_seed(4)
    mha = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2, dtype=dtype).eval()
    eager_pool, pool = (attnkit.PagedKVCache(16, 4, 2, 8, max_seqs=2, dtype=dtype) for _ in "ab")

    def step(x: torch.Tensor, cache: attnkit.PagedKVCache, idx: torch.Tensor) -> torch.Tensor:
        return mha(x, cache=cache, mask=masks.key_indices(idx))

    compiled = torch.compile(step, backend="aot_eager")
    with torch.no_grad():
        x = torch.randn(2, 6, 32, dtype=dtype)
        for cache in (pool, eager_pool):
            mha(x, cache=cache, causal=True)
        for t in range(2):
            x = torch.randn(2, 1, 32, dtype=dtype)
            idx = torch.tensor([[[[0, 3 + t, 6 + t]]], [[[1, 2, 5]]]])  # (B, 1, 1, k)
            with attnkit.record_dispatch() as eager:
                want = step(x, eager_pool, idx)
            with attnkit.record_dispatch() as traced:
                got = compiled(x, pool, idx)
            torch.testing.assert_close(got, want)
            assert _said(traced) == _said(eager)
            (call,) = traced
            assert str(call.kernel).startswith("index mask on a cache")
    assert pool.lengths == eager_pool.lengths == [8, 8]


@pytest.mark.usefixtures("fresh_dynamo")
def test_an_inductor_compiled_index_mask_on_a_view_of_rows_records_what_an_eager_one_does() -> None:
    # attention(q, view) on rows of their own lengths of a contiguous cache (no block table),
    # with an index mask and a band: recorded when the graph runs, as an eager call is, and
    # equal to the reference over each row's keys. Inductor's code, since it lowers the
    # operator that records as a call of its own (an argument named as one of that call's
    # failed there).
    torch.manual_seed(5)
    k, v = torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    q = torch.randn(2, 4, 1, 8)
    idx = torch.tensor([0, 2, 4, 8, 11]).view(1, 1, 1, 5)
    mask = masks.key_indices(idx) & masks.sliding_window(6)

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        view = CacheView(k, v, kv_range=[(0, 9), (0, 13)])
        return attnkit.attention(q, view, mask=mask, backend="chunked")

    compiled = torch.compile(call)
    with attnkit.record_dispatch() as eager:
        want = call(q, k, v)
    compiled(q, k, v)  # (traced outside the record)
    with attnkit.record_dispatch() as traced:
        got = compiled(q, k, v)
    torch.testing.assert_close(got, want)
    assert _said(traced) == _said(eager)
    assert [c.kernel.split(":")[0] for c in traced if c.kernel] == ["index mask on a cache"]
    for n, end in enumerate((9, 13)):  # (an entry past a row's keys is ignored)
        row = masks.key_indices(idx.masked_fill(idx >= end, -1)) & masks.sliding_window(6)
        ref = attnkit.attention(q[n : n + 1], k[n : n + 1, :, :end], v[n : n + 1, :, :end],
                                mask=row, backend="reference")  # fmt: skip
        torch.testing.assert_close(got[n : n + 1], ref)
