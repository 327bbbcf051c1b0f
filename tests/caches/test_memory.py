"""A cache's memory on transparent huge pages (attnkit.caches._memory): the advice reaches the
kernel for the whole 2 MiB pages of every large cache tensor (read back from /proc/self/smaps,
whose VmFlags show ``hg`` on an advised range), nothing else changes, and ATTNKIT_HUGE_PAGES=0,
small tensors and other devices take plain zeros."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit.caches import _memory as memory
from attnkit.caches._memory import HUGE_PAGE, advise_huge_pages, cache_zeros

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists(),
    reason="transparent huge pages are Linux's",
)


def advised_bytes(x: torch.Tensor) -> int:
    """How many of x's bytes lie in ranges advised to huge pages (VmFlags ``hg``)."""
    start = x.data_ptr()
    end = start + x.numel() * x.element_size()
    total, span = 0, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            span = (int(m[1], 16), int(m[2], 16))
        elif line.startswith("VmFlags:") and span is not None and " hg" in f" {line[8:]}":
            total += max(0, min(end, span[1]) - max(start, span[0]))
    return total


@needs_thp
def test_a_large_cache_is_advised_to_huge_pages_whole() -> None:
    cache = attnkit.KVCache(2, 4096, 4, 128, dtype=torch.float32)  # 16 MiB each
    for x in (cache.k_cache, cache.v_cache):
        size = x.numel() * x.element_size()
        # every whole 2 MiB page inside the tensor, at most one page short at each end
        assert advised_bytes(x) >= size - 2 * HUGE_PAGE
        assert torch.count_nonzero(x) == 0


@needs_thp
@pytest.mark.parametrize("kind", ["paged", "streaming", "int8"])
def test_every_cache_kind_is_advised(kind: str) -> None:
    tensors: list[torch.Tensor]
    if kind == "paged":
        paged = attnkit.PagedKVCache(512, 16, 4, 128, dtype=torch.float32, max_seqs=2)
        tensors = [paged.k_pages, paged.v_pages]
    elif kind == "streaming":
        streaming = attnkit.StreamingKVCache(
            2, 4, 128, sink_tokens=4, window=8188, dtype=torch.float32
        )
        tensors = [streaming.k_cache, streaming.v_cache]
    else:
        cache = attnkit.KVCache(4, 8192, 4, 128, dtype=torch.float32, kv_dtype=torch.int8)
        tensors = [cache.k_cache, cache.v_cache]
    for x in tensors:
        assert advised_bytes(x) >= x.numel() * x.element_size() - 2 * HUGE_PAGE > 0


def test_switched_off_small_or_elsewhere_takes_plain_zeros(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The advice given, recorded (an advised range's flag outlives the tensor in memory that the
    # C library hands out again, so the smaps of a later tensor cannot tell).
    asked: list[tuple[int, int, int]] = []

    def advise(start: int, length: int, advice: int) -> int:
        asked.append((start, length, advice))
        return 0

    monkeypatch.setattr(memory, "_madvise", lambda: advise)
    on = cache_zeros((4, 1 << 20), dtype=torch.float32, device="cpu")
    ((start, length, advice),) = asked
    begin = on.data_ptr()
    assert advice == memory.MADV_HUGEPAGE
    assert start % HUGE_PAGE == 0
    assert length % HUGE_PAGE == 0
    assert begin <= start < begin + HUGE_PAGE
    assert start + length > begin + on.numel() * 4 - HUGE_PAGE
    assert torch.count_nonzero(on) == 0
    asked.clear()
    monkeypatch.setenv("ATTNKIT_HUGE_PAGES", "0")
    off = cache_zeros((4, 1 << 20), dtype=torch.float32, device="cpu")
    assert not advise_huge_pages(torch.empty(4, 1 << 20))
    monkeypatch.delenv("ATTNKIT_HUGE_PAGES")
    small = cache_zeros((1000,), dtype=torch.float32, device="cpu")
    meta = cache_zeros((4, 1 << 20), dtype=torch.float32, device="meta")
    assert not advise_huge_pages(meta)
    assert asked == []
    assert torch.count_nonzero(off) == 0
    assert torch.count_nonzero(small) == 0
    assert meta.device.type == "meta"
