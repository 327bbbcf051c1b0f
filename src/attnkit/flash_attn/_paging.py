"""Paged KV caches: pages of any size, read and written through a block table.

Sequence (or cache row) ``b`` holds its ``n`` tokens in the pages ``block_table[b, :ceil(n /
page)]``, in order. Every page a call reads or writes is checked to exist before anything is
written.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._base.checks import dtype_str, shape_str
from ._args import four_d, lengths_of

__all__ = [
    "check_block_table",
    "checked_pages",
    "gather_pages",
    "page_table",
    "paged_sequences",
    "pages_used",
]


def gather_pages(cache: Tensor, block_table: Tensor, lengths: list[int]) -> Tensor:
    """The packed ``(sum(lengths), Hkv, D)`` tokens of a paged ``(blocks, page, Hkv, D)`` cache:
    sequence ``b`` holds its first ``lengths[b]`` tokens in the pages ``block_table[b]``."""
    page = cache.size(1)
    rows = torch.repeat_interleave(
        torch.arange(len(lengths), device=block_table.device),
        torch.tensor(lengths, device=block_table.device),
        output_size=sum(lengths),  # known here: no read of the device's count (none on meta)
    )
    starts = torch.tensor([0, *lengths], device=block_table.device).cumsum(0)[:-1]
    t = torch.arange(sum(lengths), device=block_table.device) - starts[rows]
    blocks = block_table.long()[rows, t // page]
    return cache[blocks.to(cache.device), (t % page).to(cache.device)]


def check_block_table(block_table: object, rows: int) -> Tensor:
    if not isinstance(block_table, Tensor):
        raise TypeError(
            "block_table must be an integer tensor (batch, max_blocks) of page numbers, got "
            f"{type(block_table).__name__}"
        )
    if (
        block_table.is_floating_point()
        or block_table.is_complex()
        or block_table.dtype == torch.bool
    ):
        raise TypeError(
            "block_table must be an integer tensor (batch, max_blocks) of page numbers, got "
            f"{dtype_str(block_table.dtype)}"
        )
    if block_table.ndim != 2 or block_table.size(0) != rows:
        raise ValueError(
            f"block_table must be (batch, max_blocks) with batch = {rows}, got shape "
            f"{shape_str(block_table.shape)}"
        )
    return block_table


def pages_used(lengths: list[int], page: int) -> list[int]:
    """How many pages of ``page`` tokens each sequence of ``lengths`` tokens fills."""
    return [-(-n // page) if page else 0 for n in lengths]


def page_table(
    table: Tensor, used: list[int], pages: int, what: str, device: torch.device
) -> Tensor:
    """``table`` as int64 indices, after checking that the first ``used[b]`` entries of each row
    ``b`` are pages of the ``pages`` that ``what`` (on ``device``) holds; the entries past them,
    which name no page the call reads, are replaced by 0 so that gathering whole rows cannot
    fail on them.

    Indexing would take a negative entry from the end (another sequence's page, read or written
    without a word) and fail on one past the end with an IndexError naming nothing: both are
    refused here, with one host read.

    A table on the meta device is taken unread when the pages are on it too: its entries only
    say where the keys lie, and a meta call computes shapes, which they do not change. Pages
    that hold values cannot be read through a table that holds none: refused by name.
    """
    if table.device.type == "meta" and device.type != "meta":
        raise ValueError(
            f"block_table is on the meta device, which holds no values to read, but {what} is on "
            f"{device}: the table's page numbers say where each row's keys lie in it; pass "
            "block_table on a device that holds values"
        )
    if not table.numel() or table.device.type == "meta" or torch.compiler.is_compiling():
        return table.long()
    cols = torch.arange(table.size(1), device=table.device)
    needed = cols < torch.tensor(used, device=table.device)[:, None]
    bad = needed & ((table < 0) | (table >= pages))
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        numbered = f", numbered 0 to {pages - 1}" if pages else ""
        raise ValueError(
            f"block_table[{row}, {col}] = {int(table[row, col])} is not a page: {what} holds "
            f"{pages} pages{numbered} (row {row} reads its first {used[row]} entries)"
        )
    return torch.where(needed, table.long(), 0)


def paged_sequences(
    k: object, v: object, cu_seqlens_k: Tensor, block_table: object, rows: int
) -> tuple[Tensor, Tensor, list[int]]:
    """The packed ``(total_k, Hkv, D)`` keys and values of ``rows`` sequences held in a paged
    ``(blocks, page, Hkv, D)`` cache, and their lengths: sequence ``s`` holds the first
    ``cu_seqlens_k[s + 1] - cu_seqlens_k[s]`` tokens of its pages ``block_table[s]``."""
    k, v, table, k_lengths = checked_pages(k, v, cu_seqlens_k, block_table, rows)
    return gather_pages(k, table, k_lengths), gather_pages(v, table, k_lengths), k_lengths


def checked_pages(
    k: object, v: object, cu_seqlens_k: Tensor, block_table: object, rows: int
) -> tuple[Tensor, Tensor, Tensor, list[int]]:
    """The paged ``(blocks, page, Hkv, D)`` keys and values of ``rows`` sequences, their block
    table (int64, checked as :func:`page_table` does) and their lengths, as
    :func:`paged_sequences` reads them, every page checked and none gathered."""
    k = four_d("k", k, "(num_blocks, page_block_size, nheads_k, headdim) with block_table")
    v = four_d("v", v, "(num_blocks, page_block_size, nheads_k, headdim_v) with block_table")
    table = check_block_table(block_table, rows)
    k_lengths = lengths_of("cu_seqlens_k", cu_seqlens_k, None)
    capacity = table.size(1) * k.size(1)
    if max(k_lengths, default=0) > capacity:
        raise ValueError(
            f"cu_seqlens_k gives a sequence {max(k_lengths)} keys, more than its "
            f"{table.size(1)} pages of {k.size(1)} hold"
        )
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"k {shape_str(k.shape)} and v {shape_str(v.shape)} must be the same pages "
            "(num_blocks, page_block_size, ...)"
        )
    used = pages_used(k_lengths, k.size(1))
    table = page_table(table, used, k.size(0), f"the paged k {shape_str(k.shape)}", k.device)
    return k, v, table, k_lengths
