"""A cache's memory: zeros on transparent huge pages where the system allows them.

A decode step reads the whole cache, and on 4 KiB pages a cache of tens of MiB spans thousands
of pages, more than the processor's address-translation caches hold: every step walks the page
tables again for most of them. On 2 MiB pages the same cache spans a few dozen. Linux backs a
range with huge pages when asked (``madvise(MADV_HUGEPAGE)``, honoured where
``/sys/kernel/mm/transparent_hugepage/enabled`` reads ``madvise`` or ``always``) before the range
is first touched, so a cache is made empty, advised, then zeroed.

``ATTNKIT_HUGE_PAGES=0`` turns the advice off (a system whose memory is too fragmented for huge
pages spends time compacting it on the first touch). Other systems, other devices and tensors
under 4 MiB take plain zeros. torch's own ``THP_MEM_ALLOC_ENABLE=1`` does the same for every
large tensor torch allocates.
"""

from __future__ import annotations

import ctypes
import sys
from functools import cache

import torch
from torch import Tensor

from .._base.env import switch

__all__ = ["cache_zeros"]

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB base pages) transparent huge page
MADV_HUGEPAGE = 14  # Linux's advice number, the same on every architecture


@cache
def _madvise() -> object | None:
    """libc's ``madvise``, or None where there is none (not Linux, or no C library to load)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        advise = libc.madvise
    except (OSError, AttributeError):
        return None
    advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advise.restype = ctypes.c_int
    return advise


def advise_huge_pages(x: Tensor) -> bool:
    """Ask the kernel to back ``x``'s memory with huge pages (the whole 2 MiB pages within it,
    which must not have been touched yet to take effect at once). True where the advice was
    given and taken; False where it was not given (another device, too small, turned off,
    another system) or the kernel refused it (nothing changes then)."""
    advise = _madvise()
    if advise is None or x.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    if not switch("ATTNKIT_HUGE_PAGES", True):
        return False
    try:
        start = x.data_ptr()
    except RuntimeError:  # a tensor without memory of its own (a fake tensor while tracing)
        return False
    end = start + x.numel() * x.element_size()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return False
    return bool(advise(first, last - first, MADV_HUGEPAGE) == 0)  # type: ignore[operator]


def cache_zeros(
    shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | str | None
) -> Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``, its memory advised to huge pages
    first where :func:`advise_huge_pages` can (a cache's keys, values or pages)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if out.device.type == "cpu" and out.numel() * out.element_size() >= 2 * HUGE_PAGE:
        advise_huge_pages(out)
    return out.zero_()
