"""New tokens into a cache: the one check of new keys and values, and the one writer.

Every cache writes the same way (:class:`~attnkit.KVCache`, :class:`~attnkit.PagedKVCache`,
flash-attn's ``flash_attn_with_kvcache``): row ``n``'s new tokens go to its key positions ``at[n],
at[n] + 1, ...`` of pages ``(X, Hkv, page, D)``, named by a block table or, without one, page ``n``
(see :mod:`attnkit.caches.view`). The writer is called once everything is checked, so a refused
call writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .._base.checks import check_float_tensor, dtype_str, shape_str

__all__ = [
    "Piece",
    "Spelling",
    "check_tokens",
    "check_values",
    "given",
    "put",
    "values_of_keys",
    "write",
]

#: A stretch of a write in one page: ``(row, page, offset in the page, tokens, row's first token)``.
Piece = tuple[int, int, int, int, int]


@dataclass(frozen=True)
class Spelling:
    """How :func:`check_tokens` names what its caller was given, in its messages: attnkit's caches
    by default (tokens ``(B, Hkv, T, D)`` into "the cache"); a front end that takes tokens in
    another layout or under other names (flash-attn's ``k``, ``v`` ``(batch, seqlen_new,
    nheads_k, headdim)`` into ``k_cache``) says so, and its users read their own arguments."""

    #: the layouts of k and v as the caller writes them
    k_shape: str = "(B, Hkv, T, Dk)"
    v_shape: str = "(B, Hkv, T, Dv)"
    #: tokens ``(N, T, Hkv, D)`` (token-major, flash-attn's) rather than ``(N, Hkv, T, D)``
    token_major: bool = False
    #: whose dtype and device new tokens must have
    dtype_of: str = "the cache's dtype"
    device_of: str = "the cache's device"
    #: who refuses keys that need gradients (None: ``what``'s first word)
    who: str | None = None


def given(
    k_pages: Tensor, v_pages: Tensor, quantized_as: torch.dtype | None
) -> tuple[Tensor, Tensor]:
    """The pages as new tokens must match them in :func:`check_tokens`: the pages themselves, or
    for int8/float8 pages (``quantized_as``: the dtype tokens come in) stand-ins of their shapes
    in that dtype, without data."""
    if quantized_as is None:
        return k_pages, v_pages
    zero = torch.zeros((), dtype=quantized_as, device=k_pages.device)
    return zero.expand(k_pages.shape), zero.expand(v_pages.shape)


def check_tokens(
    k: object,
    v: object,
    k_pages: Tensor,
    v_pages: Tensor,
    rows: int,
    what: str,
    spelling: Spelling = Spelling(),
) -> tuple[Tensor, Tensor]:
    """New keys ``(N, Hkv, T, Dk)`` and values ``(N, Hkv, T, Dv)`` (token-major ``(N, T, Hkv,
    D)`` where ``spelling`` says so) for ``rows`` rows of the pages ``(X, Hkv, page, D)`` of
    ``what`` (a cache's name and its rows, for the messages): of the pages' heads, sizes, dtype
    and device, and needing no gradient (a cache is for inference: stored keys would keep the
    graph of every step alive). Returns ``k`` and ``v`` as given."""
    k = check_float_tensor("k", k)
    v = check_float_tensor("v", v)
    heads = k_pages.size(1)
    want_k: tuple[int | str, ...]
    want_v: tuple[int | str, ...]
    if spelling.token_major:
        t = k.size(1) if k.ndim == 4 else "T"  # v must bring as many tokens as k
        want_k = (rows, t, heads, k_pages.size(3))
        want_v = (rows, t, v_pages.size(1), v_pages.size(3))
    else:
        t = k.size(-2) if k.ndim == 4 else "T"
        want_k = (rows, heads, t, k_pages.size(3))
        want_v = (rows, v_pages.size(1), t, v_pages.size(3))
    if tuple(k.shape) != want_k or tuple(v.shape) != want_v:
        raise ValueError(
            f"k and v must have shapes {spelling.k_shape} = {_dims(want_k)} and "
            f"{spelling.v_shape} = {_dims(want_v)} for this cache ({what}), got k "
            f"{shape_str(k.shape)} and v "
            f"{shape_str(v.shape)}"
        )
    if k.dtype != k_pages.dtype or v.dtype != v_pages.dtype:
        raise TypeError(
            f"k and v must have {spelling.dtype_of} ({dtype_str(k_pages.dtype)}), got k "
            f"{dtype_str(k.dtype)} and v {dtype_str(v.dtype)}" + _autocast_hint(k)
        )
    if k.device != k_pages.device or v.device != k_pages.device:
        # (a copy_ would move them, or fail half-way with v on the meta device)
        raise ValueError(
            f"k and v must be on {spelling.device_of} ({k_pages.device}), got k on {k.device} "
            f"and v on {v.device}"
        )
    if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
        who = spelling.who or what.split()[0]
        named = " and ".join(n for n, t in (("k", k), ("v", v)) if t.requires_grad)
        raise ValueError(
            f"{who} got keys that require grad: the cache is for inference, run decoding "
            f"under torch.no_grad() or torch.inference_mode() (got {named} with "
            "requires_grad=True)"
        )
    return k, v


def _autocast_hint(k: Tensor) -> str:
    """Why keys may come in another dtype than the cache's: under ``torch.autocast`` a module's
    float32 projections give keys in the autocast dtype, and a cache made with the module's
    parameters' dtype then refuses them."""
    device = k.device.type
    # (a device autocast does not know, such as "meta", is never under it: torch refuses the
    # question with a RuntimeError)
    if not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
        return ""
    if k.dtype != torch.get_autocast_dtype(device):
        return ""
    return (
        f": under torch.autocast the projections give {dtype_str(k.dtype)} keys and values; "
        f"make the cache in it (cache.to(dtype={k.dtype}))"
    )


def values_of_keys(k: object, v: object, dv: int) -> tuple[object, bool]:
    """For a cache whose values are its keys' first ``dv`` columns (a latent cache): the values
    new keys ``k`` bring, and whether they are to be compared with a ``v`` the caller gave.
    ``v`` None: the keys' columns themselves (a view), nothing to compare; a ``v`` of the
    caller's is checked by :func:`check_values` once :func:`check_tokens` has checked both."""
    if v is None:
        if isinstance(k, Tensor) and k.ndim >= 1 and k.size(-1) >= dv:
            return k[..., :dv], False
        return k, False  # (check_tokens says what is wrong with k)
    return v, True


def check_values(k: Tensor, v: Tensor, dv: int, what: str) -> None:
    """Refuse values that are not the keys' first ``dv`` columns: a latent cache stores its keys
    once and reads its values as a view of them, so values of their own would be lost."""
    kv = k[..., :dv]
    if v.data_ptr() == kv.data_ptr() and v.stride() == kv.stride():
        return  # a view of the keys' own columns
    differ = (v != kv) & ~(v.isnan() & kv.isnan())
    if bool(differ.any()):
        at = tuple(differ.nonzero()[0].tolist())
        raise ValueError(
            f"{what} reads its values as the first Dv = {dv} columns of its keys "
            f"(values_in_keys=True) and stores them once: pass v=None, or v equal to k[..., :{dv}]"
            f"; got v{list(at)} = {float(v[at])} where k{list(at)} = {float(kv[at])}"
        )


def _dims(dims: tuple[int | str, ...]) -> str:
    """``(2, T, 2, 8)``: a wanted shape, its unknown sizes by their letter."""
    return f"({', '.join(str(d) for d in dims)})"


def write(
    k_pages: Tensor,
    v_pages: Tensor | None,
    k: Tensor,
    v: Tensor | None,
    *,
    at: Sequence[int],
    counts: Sequence[int] | None = None,
    block_table: Tensor | Sequence[Sequence[int]] | None = None,
    pieces: list[Piece] | None = None,
) -> list[Piece]:
    """Write row ``n``'s first ``counts[n]`` new tokens (all ``T`` when None) of ``k`` ``(N, Hkv,
    T, Dk)`` and ``v`` at its key positions ``at[n]`` on, through ``block_table`` ``(N, P)`` (a
    tensor, or each row's pages as ints) or row ``n`` on page ``n``, converting to the pages'
    dtype. Returns the stretches written (none listed for the one copy of rows in order), which
    a write of the same tokens' scales takes as ``pieces`` rather than working them out again.
    ``v_pages`` None: the values are a view of the keys' pages (a latent cache), written with them.

    How it writes is chosen by the shape of the write: rows in order at one position, one copy
    (a contiguous cache's step); one token in each of several rows (a decode step over pages),
    one ``index_copy_`` of its heads' rows into each of the pages' memory, which torch runs on
    one thread below 32768 elements; other stretches a row or fewer pieces than rows, a copy a
    piece, since torch's other indexing kernels start their threads from a few thousand elements
    on and, where the cores are busy, each start waits for one; more pieces (a prompt over
    pages), one indexed write of all the tokens."""
    rows, _, t, _ = k.shape
    new = [t] * rows if counts is None else list(counts)
    if k_pages.dtype in _FLOAT8:
        # float8 moved as its bytes: torch's index_copy_ has no float8 kernel, and inductor
        # compiles a second copy into one float8 tensor as a select of a bool and float8, which
        # torch refuses (a streaming cache's prompt writes its sinks and its ring so)
        k_pages, k = _bytes(k_pages, k)
        if v_pages is not None and v is not None:
            v_pages, v = _bytes(v_pages, v)
    # (comparisons, not a set: a compiled step's position is a symbolic size, which a set would
    # make a constant, and so a new graph at every step)
    if block_table is None and counts is None and rows and all(a == at[0] for a in at):
        k_pages[:rows, :, at[0] : at[0] + t].copy_(k)
        if v_pages is not None and v is not None:
            v_pages[:rows, :, at[0] : at[0] + t].copy_(v)
        return []
    if isinstance(block_table, Tensor) and block_table.device.type == "meta":
        return []  # no page numbers to read, and pages on the meta device hold no values
    if pieces is None:
        pieces = _pieces(k_pages.size(2), at, new, block_table)
    if k_pages.device.type == "meta":
        return pieces  # (pages on the meta device hold no values: nothing to write)
    # (while traced, a copy a piece: the positions may be symbolic sizes, never read as numbers)
    rows_at_once = t == 1 and len(pieces) == rows >= _ROWS_COPIED
    k_rows = None
    if rows_at_once and not torch.compiler.is_compiling():
        k_rows = _memory_rows(k_pages)
    if k_rows is not None:
        index = _row_index(k_pages, pieces)
        _write_rows(k_rows, k, index)
        if v_pages is not None and v is not None:
            v_rows = _memory_rows(v_pages)
            if v_rows is None:
                for n, page, offset, _, _ in pieces:  # (values at strides of their own)
                    v_pages[page, :, offset : offset + 1].copy_(v[n])
            else:
                same = v_pages.stride()[:3] == k_pages.stride()[:3] and v.size(-1) == k.size(-1)
                _write_rows(v_rows, v, index if same else _row_index(v_pages, pieces))
        return pieces
    if len(pieces) <= rows:
        for n, page, offset, m, i in pieces:
            k_pages[page, :, offset : offset + m].copy_(k[n, :, i : i + m])
            if v_pages is not None and v is not None:
                v_pages[page, :, offset : offset + m].copy_(v[n, :, i : i + m])
        return pieces
    size = k_pages.size(2)
    slots = [page * size + offset + j for _, page, offset, m, _ in pieces for j in range(m)]
    real = torch.arange(t)[None, :] < torch.tensor(new)[:, None]  # (N, T): the tokens written
    real = real.to(k.device)
    where = torch.tensor(slots, dtype=torch.int64)
    values = None if v_pages is None or v is None else v.transpose(1, 2)[real]
    put(k_pages, v_pages, k.transpose(1, 2)[real], values, where)
    return pieces


#: from this many rows of one token each on, a decode step's write is one ``index_copy_`` of
#: rows rather than a copy a row (each copy costs a few microseconds of dispatch)
_ROWS_COPIED = 4

_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _bytes(pages: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """float8 ``pages`` and new tokens ``x`` (converted to the pages' dtype) as views of their
    bytes, which every copy and indexed write takes."""
    return pages.view(torch.uint8), x.to(pages.dtype).view(torch.uint8)


def _memory_rows(pages: Tensor) -> Tensor | None:
    """Pages ``(X, Hkv, page, D)`` as a view ``(rows, D)`` of their memory, each row one token's
    head, where they lie densely in some order of their first three dims with ``D`` contiguous
    (a cache's own pages, token-major or head-major); None otherwise. Row ``(x*s0 + h*s1 +
    p*s2) // D`` is ``pages[x, h, p]`` for the pages' strides ``s``."""
    d = pages.size(-1)
    if pages.stride(-1) != 1 and d != 1:
        return None
    strides = pages.stride()
    order = sorted(range(3), key=lambda i: -strides[i])
    dense = pages.permute(*order, 3)
    if not dense.is_contiguous():
        return None
    return dense.view(-1, d)


def _row_index(pages: Tensor, pieces: list[Piece]) -> Tensor:
    """The rows of :func:`_memory_rows` that each piece's one token fills, a head after another
    (piece ``n``, head ``h`` at ``n * Hkv + h``)."""
    d, (s0, s1, s2), device = pages.size(-1), pages.stride()[:3], pages.device
    first = [(page * s0 + offset * s2) // d for _, page, offset, _, _ in pieces]
    # (a size-1 dim's stride is never used: it may be any number)
    heads = torch.arange(pages.size(1), device=device) * (s1 // d if pages.size(1) > 1 else 0)
    return (torch.tensor(first, dtype=torch.int64, device=device)[:, None] + heads).view(-1)


def _write_rows(rows: Tensor, x: Tensor, index: Tensor) -> None:
    """Row ``n``'s one token of ``x`` ``(N, Hkv, 1, D)`` into the memory rows ``rows`` of its
    pages at ``index[n * Hkv : (n + 1) * Hkv]``, in one ``index_copy_``."""
    src = x[:, :, 0].to(rows.dtype).reshape(-1, rows.size(-1))
    rows.index_copy_(0, index, src)


def _pieces(
    page: int,
    at: Sequence[int],
    new: list[int],
    block_table: Tensor | Sequence[Sequence[int]] | None,
) -> list[Piece]:
    """The write's stretches of one page (a tensor table: one read of the columns it reaches)."""
    lo = min((a // page for a, n in zip(at, new, strict=True) if n), default=0)
    hi = max((-(-(a + n) // page) for a, n in zip(at, new, strict=True) if n), default=0)
    table = (
        block_table[:, lo:hi].tolist()
        if isinstance(block_table, Tensor)
        else None
        if block_table is None
        else [row[lo:hi] for row in block_table]
    )
    pieces = []
    for row, (start, n) in enumerate(zip(at, new, strict=True)):
        pos, end = start, start + n
        while pos < end:
            col, offset = divmod(pos, page)
            m = min(page - offset, end - pos)
            number = row if table is None else int(table[row][col - lo])
            pieces.append((row, number, offset, m, pos - start))
            pos += m
    return pieces


def put(
    k_pages: Tensor, v_pages: Tensor | None, k: Tensor, v: Tensor | None, slots: Tensor
) -> None:
    """Token ``n`` of ``k`` ``(tokens, Hkv, Dk)`` and ``v`` into slot ``slots[n]`` (page
    ``slot // page``, row ``slot % page``) of the pages, in one indexed write each (the keys
    only where ``v_pages`` is None: values that are a view of them)."""
    size = k_pages.size(2)
    slots = slots.to(k_pages.device)
    where = (slots // size, slots % size)
    k_pages.transpose(1, 2).index_put_(where, k.to(k_pages.dtype))
    if v_pages is not None and v is not None:
        v_pages.transpose(1, 2).index_put_(where, v.to(v_pages.dtype))
