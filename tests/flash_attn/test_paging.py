"""Paged caches (``attnkit.flash_attn._paging``): keys read through a block table equal the same
keys packed, and every page a call reads must exist, while entries past a row's pages are not
read."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
import torch
from torch import Tensor

from attnkit import flash_attn as fa
from attnkit.testing import assert_close

from .helpers import cu, kv_call, reference


def test_random_cu_seqlens_and_paged_keys() -> None:
    """Random sequence lengths; the same call with its keys in a paged cache."""
    rng = random.Random(3)
    lq = [rng.randint(0, 40) for _ in range(6)]
    lk = [n + rng.randint(0, 30) for n in lq]
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lq), 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lk), 1, 8, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lk), 1, 8, generator=g, dtype=torch.float64)
    out = fa.flash_attn_varlen_func(q, k, v, cu(lq), cu(lk), 40, 70, causal=True)
    parts = []
    for a, b, c, e in zip(cu(lq), cu(lq)[1:], cu(lk), cu(lk)[1:], strict=False):
        parts.append(reference(q[a:b][None], k[c:e][None], v[c:e][None], causal=True)[0][0])
    assert_close(out, torch.cat(parts))
    page, per_seq = 8, -(-max(lk) // 8)
    order = torch.randperm(len(lk) * per_seq, generator=g)
    table = order.view(len(lk), per_seq).to(torch.int32)
    kp = torch.zeros(len(order), page, 1, 8, dtype=torch.float64)
    vp = torch.zeros_like(kp)
    for s, (c, e) in enumerate(zip(cu(lk), cu(lk)[1:], strict=False)):
        for t in range(int(e - c)):
            kp[table[s, t // page], t % page] = k[c + t]
            vp[table[s, t // page], t % page] = v[c + t]
    paged = fa.flash_attn_varlen_func(
        q, kp, vp, cu(lq), cu(lk), 40, 70, causal=True, block_table=table
    )
    assert_close(paged, out)


def _paged_varlen(table: Tensor) -> Any:
    g = torch.Generator().manual_seed(23)
    q = torch.randn(5, 2, 8, generator=g, dtype=torch.float64)
    kp, vp = (torch.randn(4, 4, 1, 8, generator=g, dtype=torch.float64) for _ in range(2))
    return fa.flash_attn_varlen_func(q, kp, vp, cu([2, 3]), cu([6, 3]), block_table=table)


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
    call = kv_call(paged=True)
    call["cache_seqlens"] = torch.tensor([1, 7], dtype=torch.int32)  # row 0 fills 1 page of 3
    padded = {n: t.clone() if isinstance(t, Tensor) else t for n, t in call.items()}
    padded["block_table"] = torch.tensor([[4, -1, 99], [5, 1, 3]], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(**padded)
    assert_close(out, fa.flash_attn_with_kvcache(**call))
    assert torch.equal(padded["k_cache"], call["k_cache"])  # the same tokens went in, in place


def test_a_meta_block_table_runs_over_meta_pages_and_is_refused_over_real_ones() -> None:
    """A block table's page numbers say where each sequence's keys lie, which changes no shape:
    with the pages on the meta device it is taken unread (gathering used to fail in torch's
    repeat_interleave on meta); over real pages it is refused by name."""
    table = torch.tensor([[0, 2], [1, 3]])
    want = _paged_varlen(table)
    g = torch.Generator().manual_seed(23)
    q = torch.randn(5, 2, 8, generator=g, dtype=torch.float64)
    kp, vp = (torch.randn(4, 4, 1, 8, generator=g, dtype=torch.float64) for _ in range(2))
    lengths = (cu([2, 3]), cu([6, 3]))
    got = fa.flash_attn_varlen_func(
        *(t.to("meta") for t in (q, kp, vp)), *lengths, block_table=table.to("meta")
    )
    assert got.is_meta
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    message = (
        "block_table is on the meta device, which holds no values to read, but the paged k "
        "(4, 4, 1, 8) is on cpu"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        fa.flash_attn_varlen_func(q, kp, vp, *lengths, block_table=table.to("meta"))
