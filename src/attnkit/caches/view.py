"""CacheView: a KV cache as an :func:`attnkit.attention` call reads it, where its keys lie.

A decoding server's keys are rows of a preallocated cache, or pages of a pool named through a block
table, and each row holds a stretch of its own: ``attention(q, view)`` attends row ``n``'s queries
to the keys ``kv_range[n][0] <= j < kv_range[n][1]`` of its pages, the queries aligned
bottom-right to the end of that stretch (query ``i`` of ``Tq`` sits at key position ``end - Tq +
i``), as everywhere in attnkit.

The keys and values are pages ``(X, Hkv, page, D)`` at any strides: a contiguous ``(B, Hkv, L,
D)`` cache is ``B`` pages of ``L`` keys, row ``n`` on page ``n``; flash-attn's ``(blocks, page,
Hkv, D)`` pages are ``k_cache.permute(0, 2, 1, 3)``; vLLM's ``(blocks, Hkv, page, D)`` are
themselves. With a block table, row ``n``'s key ``j`` is row ``j % page`` of page ``block_table[n,
j // page]``.

Backends read the view as :attr:`attnkit.AttentionCall.cache`: ``chunked`` reads the pages where
they lie (the native kernel), ``reference`` gathers each row's keys into dense tensors and computes
its formula; a backend of one's own serves such calls when its ``accepts_cache`` is True
(:meth:`CacheView.attend_rows` gives it dense calls).

A call whose rows attend keys of their own takes the masks that can be read at a row's own pairs
of (query, key position) (:func:`rows_refusal`): bands aligned to each row's end, index masks
(:func:`~attnkit.masks.key_indices`; positions in the row's pages, an entry outside the row's
keys ignored) and bool tensors ``(N|1, H|1, Tq|1, Tk|1)``. A call whose rows all attend one
stretch ``start <= j < end`` with all their queries (:attr:`CacheView.shared`) is the dense
call over those keys instead, and takes any mask as that call does: its masks count the keys
from ``start`` (the same as positions in the pages when ``start`` is 0, as in every view the
caches make). :func:`row_mask` gives a row's call
of :meth:`CacheView.attend_rows` its own entries of such a mask; ``chunked`` gathers an index
mask's selected keys alone (:mod:`attnkit._kernel.cache`).

>>> import torch, attnkit
>>> k = torch.randn(2, 2, 16, 8)                 # a contiguous cache: 2 rows of 16 positions
>>> view = CacheView(k, k, kv_range=[(0, 5), (0, 9)])
>>> view
CacheView(k, v: 2 rows of keys 0..5, 0..9 of a contiguous cache (2, 2, 16, 8) / (2, 2, 16, 8))
>>> attnkit.attention(torch.randn(2, 4, 1, 8), view, causal=True).shape
torch.Size([2, 4, 1, 8])

A quantized cache's pages are ``torch.int8``, ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``,
with float32 scales ``(X, Hkv, page, 1)`` beside them (``k_scale``, ``v_scale``; a scale per head
is one expanded with stride 0): key ``j`` of a page is ``k[x, h, j].float() * k_scale[x, h, j]``,
as :func:`attnkit.attention`'s ``k_scale=`` reads it. ``chunked`` reads the pages and their
scales in place; a row's keys read into dense tensors (:meth:`CacheView.row`,
:meth:`CacheView.dense`) are dequantized.

Shape letters: ``N`` rows (the call's batch), ``X`` pages, ``P`` pages per row in the block table,
``Hkv`` key/value heads, ``H`` query heads, ``Tq`` queries, ``Dk``/``Dv`` head sizes.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .._base.checks import broadcasts_to, dtype_str, shape_str
from .._base.quantized import QUANTIZED, dequantize
from ..masks import KeyIndices, Mask, from_tensor
from ..scores import DistanceBias, ScoreTerm

__all__ = ["CacheView", "RowCall", "band_of", "row_mask", "row_term", "rows_refusal"]

#: ``attend(q, k, v, row)``: one dense call of :meth:`CacheView.attend_rows`, on row ``row``'s
#: queries and keys (``(1, ...)``), or on every row's (``row`` None) when they share their keys'
#: stretch; it returns what :func:`attnkit.attention` returns for the call's flags.
RowCall = Callable[[Tensor, Tensor, Tensor, int | None], Tensor | tuple[Tensor, ...]]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _ints(name: str, value: object, rows: int | None = None) -> tuple[int, ...]:
    if isinstance(value, Tensor):
        value = value.tolist()
    if not isinstance(value, Sequence) or any(
        isinstance(x, bool) or not isinstance(x, int) for x in value
    ):
        raise TypeError(f"{name} must be a sequence of ints, got {value!r}")
    if rows is not None and len(value) != rows:
        raise ValueError(f"{name} must hold {rows} ints, one a row, got {list(value)}")
    return tuple(value)


def _ranges(value: object) -> tuple[tuple[int, int], ...]:
    if isinstance(value, Tensor):
        value = value.tolist()
    if not isinstance(value, Sequence) or not all(
        isinstance(r, Sequence | Tensor) and len(r) == 2 for r in value
    ):
        raise TypeError(f"kv_range must be a (start, end) pair of ints a row, got {value!r}")
    pairs = tuple((a, e) for a, e in (_ints("kv_range", r) for r in value))
    bad = [list(r) for r in pairs if not 0 <= r[0] <= r[1]]
    if bad:
        raise ValueError(
            f"kv_range: each row's keys run from start to end >= start >= 0, got {bad}"
        )
    return pairs


@dataclass(frozen=True, eq=False)
class CacheView:
    """The keys and values an attention call reads from a KV cache, where they lie.

    Args:
        k, v: the pages ``(X, Hkv, page, Dk)`` and ``(X, Hkv, page, Dv)`` (any strides, one dtype
            and device; see the module's docstring for the layouts they view).
        kv_range: ``(start, end)`` a row: row ``n`` attends its keys ``start <= j < end``.
        block_table: ``(N, P)`` integers, row ``n``'s pages in order (entries past a row's keys
            are never read); None: row ``n``'s keys are page ``n``.
        q_lens: per row, how many of the call's ``Tq`` queries are real: row ``n``'s first
            ``q_lens[n]`` (aligned to the end of its keys), the rest padding whose outputs are 0
            (and log-sum-exp ``-inf``); None: all of them.
        k_scale, v_scale: for int8/float8 pages, float scales broadcastable to ``(X, Hkv, page,
            1)`` (kept as float32 ``(X, Hkv, page, 1)``, expanded): the keys are ``k.float() *
            k_scale``; None for float pages.

    Every field is checked when the view is made (its ranges against the pages, each page the
    table names for a row's keys against the pool, with one read of the table), so a view that
    exists can be read.
    """

    k: Tensor
    v: Tensor
    kv_range: tuple[tuple[int, int], ...]
    block_table: Tensor | None = None
    q_lens: tuple[int, ...] | None = None
    k_scale: Tensor | None = None
    v_scale: Tensor | None = None
    #: made by a cache from its own state, right by construction: not checked again
    trusted: bool = field(default=False, repr=False, compare=False)
    #: the attention call a cache checked on this view before it wrote the tokens the view
    #: holds, with the arguments it was checked with (``attnkit._call.CheckedCall``): a call
    #: on the view with the same arguments takes it rather than being checked again
    checked_call: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.trusted:  # a cache's own view, right by construction (a step makes one per call)
            return
        if torch.compiler.is_compiling():
            # While tracing its ends may be symbolic sizes: checked as the graph's guards, so a
            # view made inside a compiled function never reads past its pages.
            self._check_traced()
            return
        k, v = self.k, self.v
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, Tensor) or t.ndim != 4:
                got = shape_str(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise TypeError(f"CacheView: {name} must be pages (X, Hkv, page, D), got {got}")
            if t.dtype not in _FLOATS and t.dtype not in QUANTIZED:
                raise TypeError(
                    f"CacheView: {name} must be float16, bfloat16, float32 or float64 (or int8, "
                    f"float8_e4m3fn, float8_e5m2 with scales), got {dtype_str(t.dtype)}"
                )
        if k.shape[:3] != v.shape[:3] or k.dtype != v.dtype or k.device != v.device:
            raise ValueError(
                f"CacheView: k and v must be the same pages (X, Hkv, page, ...) of one dtype on "
                f"one device, got k {shape_str(k.shape)} {dtype_str(k.dtype)} on {k.device} and "
                f"v {shape_str(v.shape)} {dtype_str(v.dtype)} on {v.device}"
            )
        if k.size(1) == 0:  # (a call's H is a multiple of Hkv: none of 0)
            raise ValueError(
                f"CacheView: the pages must hold at least one key/value head (Hkv = k.shape[1] "
                f">= 1), got k {shape_str(k.shape)}"
            )
        self._check_scales()
        ranges = _ranges(self.kv_range)
        object.__setattr__(self, "kv_range", ranges)
        if self.q_lens is not None:
            lens = _ints("q_lens", self.q_lens, len(ranges))
            if any(n < 0 for n in lens):
                raise ValueError(f"q_lens must be counts >= 0, got {list(lens)}")
            object.__setattr__(self, "q_lens", lens)
        self._check_pages()

    def _check_traced(self) -> None:
        """The ranges against the pages while tracing, where their ends may be symbolic sizes:
        ``0 <= start <= end``, each row's keys within its page (a table's pages, without reading
        the table). The comparisons become the graph's guards, and the messages are constants
        (no symbolic size is printed while tracing)."""
        ranges = self.kv_range
        if isinstance(ranges, Tensor) or any(isinstance(x, Tensor) for r in ranges for x in r):
            # Ends held in a tensor are data: read on the host, as in eager (a graph break;
            # under fullgraph=True, torch's error about data-dependent values).
            ranges = _ranges(ranges)
            object.__setattr__(self, "kv_range", ranges)
        page = self.k.size(2)
        table = self.block_table
        room = page if table is None else table.size(1) * page
        if table is None and len(ranges) > self.k.size(0):
            raise ValueError(
                "CacheView: without a block table row n's keys are page n: more rows than pages"
            )
        for start, end in ranges:
            if start < 0 or end < start:
                raise ValueError("CacheView: each row's keys run from start to end >= start >= 0")
            if end > room:
                raise ValueError("CacheView: a row's keys end past the keys its pages hold")

    def _check_scales(self) -> None:
        """Scales for int8/float8 pages, none for float ones; kept as float32 ``(X, Hkv, page, 1)``
        (expanded: a scale per head is one number a head, read with stride 0)."""
        quantized = self.k.dtype in QUANTIZED
        given = (self.k_scale is not None, self.v_scale is not None)
        if given != (quantized, quantized):
            raise TypeError(
                f"CacheView: pages of {dtype_str(self.k.dtype)} take "
                + ("k_scale and v_scale (both)" if quantized else "no k_scale or v_scale")
                + f", got k_scale {'given' if given[0] else 'None'} and v_scale "
                f"{'given' if given[1] else 'None'}"
            )
        for name, pages, scale in (("k", self.k, self.k_scale), ("v", self.v, self.v_scale)):
            if scale is None:
                continue
            want = (*pages.shape[:3], 1)
            if not isinstance(scale, Tensor) or scale.dtype not in _FLOATS:
                got = dtype_str(scale.dtype) if isinstance(scale, Tensor) else type(scale).__name__
                raise TypeError(f"CacheView: {name}_scale must be a float tensor, got {got}")
            if not broadcasts_to(tuple(scale.shape), want) or scale.device != pages.device:
                raise ValueError(
                    f"CacheView: {name}_scale must be broadcastable to the pages' "
                    f"(X, Hkv, page, 1) = {shape_str(want)} on {pages.device}, got "
                    f"{shape_str(scale.shape)} on {scale.device}"
                )
            object.__setattr__(self, f"{name}_scale", scale.float().expand(want))

    def _check_pages(self) -> None:
        """Each row's keys within its pages, and each page it names within the pool."""
        rows, pages, page = len(self.kv_range), self.k.size(0), self.k.size(2)
        table = self.block_table
        if table is None:
            if rows > pages or self.kv_len > page:
                raise ValueError(
                    f"CacheView: without a block table row n's keys are page n: {rows} rows of "
                    f"keys up to {self.kv_len} need {rows} pages of as many keys, the cache has "
                    f"{pages} of {page} ({shape_str(self.k.shape)})"
                )
            return
        if not isinstance(table, Tensor) or table.is_floating_point() or table.dtype == torch.bool:
            got = dtype_str(table.dtype) if isinstance(table, Tensor) else type(table).__name__
            raise TypeError(f"CacheView: block_table must be an integer tensor (N, P), got {got}")
        if table.ndim != 2 or table.size(0) != rows or self.kv_len > table.size(1) * page:
            raise ValueError(
                f"CacheView: block_table must be (N, P) with N = {rows} rows and P pages of "
                f"{page} keys holding the longest row's {self.kv_len}, got "
                f"{shape_str(table.shape)}"
            )
        if table.device.type == "meta":
            if self.k.device.type != "meta":  # a table without data, for pages that are read
                raise ValueError(
                    f"CacheView: block_table is on meta but the pages are on {self.k.device}: "
                    "give the table with its entries (on the pages' device)"
                )
            return
        used = torch.tensor([-(-e // max(page, 1)) for _, e in self.kv_range], device=table.device)
        needed = torch.arange(table.size(1), device=table.device) < used[:, None]
        bad = needed & ((table < 0) | (table >= pages))
        if bool(bad.any()):
            row, col = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"CacheView: block_table[{row}, {col}] = {int(table[row, col])} is not a page: "
                f"the cache holds {pages} (row {row} reads its first {int(used[row])} entries)"
            )

    # ---------------------------------------------------------------------------------------------
    # What it holds

    @property
    def rows(self) -> int:
        """``N``: the rows of the call."""
        return len(self.kv_range)

    @property
    def num_kv_heads(self) -> int:
        return self.k.size(1)

    @property
    def quantized(self) -> bool:
        """Whether the pages are int8/float8, read with :attr:`k_scale` and :attr:`v_scale`."""
        return self.k_scale is not None

    @property
    def page_size(self) -> int:
        return self.k.size(2)

    @property
    def kv_len(self) -> int:
        """The end of the longest row's keys."""
        longest = 0
        for _, end in self.kv_range:  # (a loop, not max(): its ends may be symbolic sizes)
            longest = end if end > longest else longest
        return longest

    @property
    def shared(self) -> bool:
        """Whether every row attends the same stretch of keys with all its queries: the call is
        then a dense call on those keys (any mask, any bias)."""
        compiling = torch.compiler.is_compiling()  # (nothing kept while traced: no guard on it)
        known = None if compiling else self.__dict__.get("_shared")
        if known is not None:
            return bool(known)
        first = self.kv_range[0] if self.kv_range else None
        shared = self.q_lens is None and all(r == first for r in self.kv_range)
        if not compiling:  # (a step asks it several times; the fields never change)
            self.__dict__["_shared"] = shared
        return shared

    @property
    def width(self) -> int:
        """``Tk`` of the call: the shared stretch's keys, else the longest row's end (the keys of
        the weights ``(N, H, Tq, Tk)``, row ``n``'s at their positions)."""
        if self.shared and self.kv_range:
            start, end = self.kv_range[0]
            return end - start
        return self.kv_len

    @property
    def contiguous(self) -> bool:
        """Whether each row's keys lie on one page (a contiguous cache, its rows named by a table
        of one column or in order)."""
        return self.block_table is None or self.block_table.size(1) == 1

    def describe(self) -> str:
        """``2 rows of keys 0..5, 0..9 of a contiguous cache (2, 2, 16, 8) / (2, 2, 16, 8)``."""
        ranges = ", ".join(f"{a}..{e}" for a, e in self.kv_range[:4])
        if self.rows > 4:
            ranges += ", ..."
        what = (
            "a contiguous cache"
            if self.block_table is None
            else f"{self.k.size(0)} pages of {self.page_size} through a block table"
        )
        text = (
            f"{self.rows} row{'s' if self.rows != 1 else ''} of keys {ranges} of {what} "
            f"{shape_str(self.k.shape)} / {shape_str(self.v.shape)}"
        )
        if self.q_lens is not None:
            text += f", queries {list(self.q_lens)}"
        if self.k_scale is not None and self.v_scale is not None:
            text += (
                f", {dtype_str(self.k.dtype)} with scales {shape_str(self.k_scale.shape)} / "
                f"{shape_str(self.v_scale.shape)}"
            )
        return text

    def __repr__(self) -> str:
        return f"CacheView(k, v: {self.describe()})"

    def with_queries(self, q_len: int) -> CacheView:
        """The view for a call of ``q_len`` queries a row: ``q_lens`` None when every row's are
        all real."""
        if self.q_lens is not None and all(n == q_len for n in self.q_lens):
            return replace(self, q_lens=None, trusted=True)
        return self

    # ---------------------------------------------------------------------------------------------
    # Reading the keys into dense tensors

    def _values(
        self, read: Callable[[Tensor], Tensor], dtype: torch.dtype | None
    ) -> tuple[Tensor, Tensor]:
        """``read`` of the keys and values; of int8/float8 pages, dequantized to ``dtype``
        (default float32) with their scales read the same way."""
        if self.k_scale is None or self.v_scale is None:
            return read(self.k), read(self.v)
        work = torch.float32 if dtype is None else dtype
        return (
            dequantize(read(self.k), read(self.k_scale), work),
            dequantize(read(self.v), read(self.v_scale), work),
        )

    def _pages_named(self, entries: Tensor, row0: int, col0: int) -> Tensor:
        """The pages that ``entries`` of the block table name (``entries[0, 0]`` is the table's
        ``[row0, col0]``), as int64 on the pages' device, each checked to be a page of the pool
        before anything is gathered.

        A cache's own view shares the cache's block table, which ``free()``, ``keep()`` and
        ``rewind()`` change: a view kept past them may name -1 where its row held pages, which
        indexing would read as the pool's last page. (While tracing, the gather's own bounds
        apply; the native kernel checks the table it reads itself.)"""
        pages = entries.to(self.k.device).long()
        if torch.compiler.is_compiling() or pages.numel() == 0 or pages.device.type == "meta":
            return pages
        bad = (pages < 0) | (pages >= self.k.size(0))
        if bool(bad.any()):
            row, col = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"CacheView: block_table[{row0 + row}, {col0 + col}] = {int(pages[row, col])} is "
                f"not a page of the {self.k.size(0)} the cache holds: the cache's block table "
                "changed since this view was taken (free(), keep(), rewind()); take a new view()"
            )
        return pages

    def row(self, n: int, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """Row ``n``'s keys and values ``(1, Hkv, end - start, D)``: a view of a contiguous
        cache, a gather of its pages (of int8/float8 pages, dequantized copies in ``dtype``,
        default float32)."""
        start, end = self.kv_range[n]
        if self.block_table is None:
            return self._values(lambda t: t[n : n + 1, :, start:end], dtype)
        page = max(self.page_size, 1)  # (pages of no keys hold rows of none)
        first, last = start // page, -(-end // page)
        pages = self._pages_named(self.block_table[n : n + 1, first:last], n, first)[0]
        at = start - first * page

        def read(t: Tensor) -> Tensor:  # (p, Hkv, page, D) -> (1, Hkv, p * page, D)
            return t[pages].transpose(0, 1).flatten(1, 2)[None, :, at : at + end - start]

        return self._values(read, dtype)

    def dense(self, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """Every row's keys and values ``(N, Hkv, width, D)`` of a :attr:`shared` view: views
        of a contiguous cache in order, else its pages gathered (of int8/float8 pages,
        dequantized copies in ``dtype``, default float32)."""
        if not self.shared:
            raise ValueError(
                f"a view whose rows attend keys of their own has no dense form: {self.describe()}"
            )
        # The last row's ends, not the first's: while torch.compile traces, each row's ends are
        # symbols of their own, and `shared` found them equal, which makes the last row's the
        # symbols the graph binds; sizes made from the first row's then named a symbol the
        # generated code never bound (a NameError from inductor's code for pages).
        start, end = self.kv_range[-1] if self.kv_range else (0, 0)
        if self.block_table is None:
            return self._values(lambda t: t[: self.rows, :, start:end], dtype)
        page = max(self.page_size, 1)  # (pages of no keys hold rows of none)
        pages = self._pages_named(self.block_table[:, : -(-end // page)], 0, 0)

        def read(t: Tensor) -> Tensor:  # (N, p, Hkv, page, D) -> (N, Hkv, p * page, D)
            return t[pages].transpose(1, 2).flatten(2, 3)[:, :, start:end]

        return self._values(read, dtype)

    def to(self, dtype: torch.dtype) -> CacheView:
        """The rows' keys and values in ``dtype``, copied into a contiguous view of their own
        (what ``torch.autocast`` hands a call; int8/float8 pages dequantized): the pages stay as
        they are."""
        if dtype == self.k.dtype and not self.quantized:
            return self
        keys = self.k.new_zeros(
            self.rows, self.num_kv_heads, self.kv_len, self.k.size(-1), dtype=dtype
        )
        values = self.v.new_zeros(
            self.rows, self.num_kv_heads, self.kv_len, self.v.size(-1), dtype=dtype
        )
        for n, (start, end) in enumerate(self.kv_range):
            k, v = self.row(n, dtype)
            keys[n, :, start:end], values[n, :, start:end] = k[0], v[0]
        return CacheView(keys, values, self.kv_range, None, self.q_lens, trusted=True)

    def attend_rows(
        self, q: Tensor, attend: RowCall, *, weights: bool, lse: bool
    ) -> Tensor | tuple[Tensor, ...]:
        """The call as dense calls: one on every row's keys (:meth:`dense`) when the rows share
        them, else one a row on its real queries and its own keys (:meth:`row`), its output,
        weights and log-sum-exp put back in place (0, and ``-inf``, for padding queries; a row's
        weights at its keys' positions). ``attend(q, k, v, row)`` returns what
        :func:`attnkit.attention` returns for the flags ``weights`` and ``lse``."""
        if self.shared:
            k, v = self.dense(q.dtype)
            return attend(q, k, v, None)
        rows, heads, q_len = q.shape[:3]
        out = q.new_zeros(rows, heads, q_len, self.v.size(-1))
        probs = q.new_zeros(rows, heads, q_len, self.kv_len) if weights else None
        work = torch.promote_types(q.dtype, torch.float32)
        lses = q.new_full((rows, heads, q_len), -math.inf, dtype=work) if lse else None
        counts = self.q_lens if self.q_lens is not None else (q_len,) * rows
        for n, ((start, end), m) in enumerate(zip(self.kv_range, counts, strict=True)):
            if not m:
                continue
            k, v = self.row(n, q.dtype)
            got = attend(q[n : n + 1, :, :m], k, v, n)
            parts = [got] if isinstance(got, Tensor) else list(got)
            out[n, :, :m] = parts[0][0]
            if probs is not None:
                probs[n, :, :m, start:end] = parts[1][0]
            if lses is not None:
                lses[n, :, :m] = parts[-1][0]
        extra = [t for t in (probs, lses) if t is not None]
        return (out, *extra) if extra else out


def band_of(mask: Tensor | Mask | None) -> tuple[float, float] | None:
    """``(lo, hi)`` when a call's visibility (``mask`` and ``causal`` as one mask) is a band of
    distances, bottom-right aligned: query ``i`` may attend key ``j`` iff ``lo <= j - p_i <= hi``,
    ``p_i`` its key position (``-inf``, ``inf``: no bound); None for any other mask. Bands are
    what rows of their own lengths can share: :func:`~attnkit.masks.causal`,
    :func:`~attnkit.masks.sliding_window`, and their ``&``."""
    lo, hi = -math.inf, math.inf
    if mask is None:
        return lo, hi
    parts = mask.parts if isinstance(mask, Mask) and mask.op == "and" else (mask,)
    for part in parts:
        band = part.band if isinstance(part, Mask) else None
        if band is None or band[2] != "bottom_right":
            return None
        lo, hi = max(lo, band[0]), min(hi, band[1])
    return lo, hi


def row_term(term: ScoreTerm | None, n: int | None) -> ScoreTerm | None:
    """A call's score term for row ``n``'s call of :meth:`CacheView.attend_rows` (None: every
    row's): a bias by distance with a table per row gives that row's table."""
    if n is None or not isinstance(term, DistanceBias):
        return term
    if term.table.ndim == 3 and term.table.size(0) > 1:
        return DistanceBias(term.table[n : n + 1], term.first)
    return term


def rows_refusal(mask: Tensor | Mask | None) -> str | None:
    """None when a call whose rows attend keys of their own can take ``mask`` (``mask`` and
    ``causal`` as one mask), else what it holds that such a call cannot: its parts, joined by
    ``&`` and ``|``, must be bands (:func:`~attnkit.masks.causal`,
    :func:`~attnkit.masks.sliding_window`; bottom-right aligned, to each row's own end), index
    masks (:func:`~attnkit.masks.key_indices`, :func:`~attnkit.masks.block_indices`) or bool
    tensors ``(N|1, H|1, Tq|1, Tk|1)``: what can be read at a row's pairs of (query, key
    position). A mask that says which keys exist (key padding, documents) has no meaning there:
    each row's keys are its own stretch."""
    if mask is None or isinstance(mask, Tensor):
        return None
    if mask.op in ("and", "or"):
        for part in mask.parts:
            why = rows_refusal(part)
            if why is not None:
                return why
        return None
    band = mask.band
    if isinstance(mask, KeyIndices) or mask.tensor is not None:
        return None
    if band is not None and band[2] == "bottom_right":
        return None
    return mask.describe()


def row_mask(mask: Mask | None, view: CacheView, n: int, q_len: int) -> Mask | None:
    """A call's mask (with ``causal`` folded in) for row ``n``'s call of
    :meth:`CacheView.attend_rows` on its own ``q_len`` real queries and its keys ``start <= j <
    end`` (``(1, H, q_len, end - start)``): bands as they are (each aligned to the row's own
    end), an index mask's entries of the row made positions in its keys (those outside them
    ``-1``: keys the row does not hold are not attended), a bool tensor's rows, real queries and
    keys of the row. See :func:`rows_refusal` for the masks it takes."""
    if mask is None:
        return None
    start, end = view.kv_range[n]
    if mask.op in ("and", "or"):
        parts = [row_mask(p, view, n, q_len) for p in mask.parts]
        join = operator.and_ if mask.op == "and" else operator.or_
        return functools.reduce(join, parts)
    if isinstance(mask, KeyIndices):
        return _row_indices(mask, n, q_len, start, end)
    t = mask.tensor
    if t is not None:
        t4 = t.reshape((1,) * (4 - t.ndim) + tuple(t.shape))
        t4 = t4[n : n + 1] if t4.size(0) > 1 else t4
        t4 = t4[:, :, :q_len] if t4.size(2) > 1 else t4
        return from_tensor(t4[..., start:end] if t4.size(3) > 1 else t4)
    if rows_refusal(mask) is not None:
        raise ValueError(f"mask: {mask.describe()} cannot be read on one row of a cache's keys")
    return mask


def _row_indices(mask: KeyIndices, n: int, q_len: int, start: int, end: int) -> KeyIndices:
    """Row ``n``'s entries of an index mask for its first ``q_len`` queries, as positions in its
    keys ``start <= j < end`` (``-1`` for none and for keys outside them); blocks written out
    as their keys."""
    idx = mask.indices
    idx = (idx[n : n + 1] if idx.size(0) > 1 else idx)[:, :, :q_len].long()
    if mask.block > 1:  # (..., k) blocks -> (..., k * block) keys, none from the row's end on
        offsets = torch.arange(min(mask.block, end), device=idx.device)
        wide = idx.unsqueeze(-1) * mask.block + offsets
        idx = torch.where(idx.unsqueeze(-1) >= 0, wide, -1).flatten(-2)
    inside = (idx >= start) & (idx < end)
    return KeyIndices(torch.where(inside, idx - start, -1), 1)
