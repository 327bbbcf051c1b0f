"""PagedKVCache: the keys and values of many sequences in one pool of fixed-size pages.

A server decoding many requests at once does not know how long each will grow. A contiguous
:class:`~attnkit.KVCache` reserves ``max_len`` tokens for every row; a paged cache hands out pages
of ``page_size`` tokens as each sequence grows, and a finished sequence's pages go back to the
pool for the next request. Sequence ``s`` holds its ``lengths[s]`` tokens in the pages
``block_table[s, :ceil(lengths[s] / page_size)]``, in order: token ``t`` is row ``t % page_size``
of page ``block_table[s, t // page_size]``, which is vLLM's slot ``block * page_size + offset``.

It is a class of its own rather than a mode of :class:`~attnkit.KVCache` because the two answer
different questions: a contiguous cache hands back views ``(B, Hkv, S, D)`` of every row's keys,
all of one length, for any attention call; a paged cache's rows have lengths of their own and its
keys are scattered over pages, so it attends them itself (:meth:`PagedKVCache.attention`), through
the block table where they lie. What the two share is the protocol the modules use: ``stage`` new
tokens, ``commit`` them once the call succeeded, ``rewind`` on failure, ``reset``.

Shape letters: ``B`` sequences (the rows of every call), ``Hkv`` key/value heads, ``H`` query
heads, ``T`` new tokens per row in a call, ``N`` packed tokens, ``Dk``/``Dv`` head sizes, ``P``
pages per sequence at most.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Literal, TypeVar, cast

import torch
from torch import Tensor, nn

from .._base.checks import check_float_tensor, check_int, dtype_str, shape_str
from .._base.shapes import Float, shape_checked
from .._call import CheckedCall, check_cache_call
from ..attention import attention
from ..masks import Mask
from ..scores import DistanceBias
from ._evict import check_indices, compact_pages
from ._memory import cache_zeros
from ._quantize import (
    FLOAT8,
    check_dtype,
    check_kv_dtype,
    fp8_scale,
    new_scales,
    pickled_state,
    quantize,
    unpickled_state,
)
from ._tokens import Piece, check_tokens, check_values, given, put, values_of_keys, write
from .kv_cache import check_values_in_keys
from .view import CacheView, rows_refusal

__all__ = ["PagedKVCache"]

Layout = Literal["flash", "vllm"]

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _between_graphs(method: _Method) -> _Method:
    """``method`` run eagerly under ``torch.compile``, a graph break around it: the page
    bookkeeping reads and changes host-side lengths and tables, which a graph would take as
    constants and compile again for at every token. The disabled form is made on the first
    compiled call, since making it imports torch's compiler, which ``import attnkit`` does not;
    it is kept in the wrapper's own closure, which a trace reads as it is (a table keyed by the
    method's name broke the graph once more at every trace, on hashing that name)."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return method(*args, **kwargs)
        if not disabled:  # (the first trace only)
            disabled.append(torch.compiler.disable(method))
        return disabled[0](*args, **kwargs)

    return cast(_Method, run)


def _counts(name: str, value: object, rows: int, most: int) -> list[int]:
    """``value`` (an int, a sequence of ints or a ``(rows,)`` integer tensor) as one count per
    row, each from 0 to ``most``."""
    if isinstance(value, Tensor):
        if value.is_floating_point() or value.dtype == torch.bool or value.ndim != 1:
            raise TypeError(
                f"{name} must be an int or {rows} ints, got a {dtype_str(value.dtype)} tensor of "
                f"shape {shape_str(value.shape)}"
            )
        value = value.tolist()
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value] * rows
    if not isinstance(value, Sequence) or any(
        isinstance(x, bool) or not isinstance(x, int) for x in value
    ):
        raise TypeError(f"{name} must be an int or {rows} ints, got {value!r}")
    if len(value) != rows or any(not 0 <= x <= most for x in value):
        raise ValueError(f"{name} must be {rows} ints from 0 to {most}, got {list(value)}")
    return list(value)


def _check_mask(mask: Tensor | Mask | None) -> None:
    """A paged cache takes masks read at each row's own pairs of (query, key position): bands
    (causal(), sliding_window(), with ``causal=True``), index masks (key_indices(),
    block_indices()) and bool tensors, joined by ``&`` and ``|``. Each row's keys are its own
    tokens, so no key padding is needed, and masks that say which keys exist have no meaning
    when every row has its own ``Tk``."""
    what = rows_refusal(mask)
    if what is not None:
        raise ValueError(
            f"mask: a PagedKVCache call takes causal=True, causal(), sliding_window(), "
            f"key_indices(), block_indices() or a bool tensor (or their & and |), got {what}: "
            "each sequence attends its own tokens, so its lengths already say which keys exist"
        )


class PagedKVCache(nn.Module):
    """Keys and values of ``max_seqs`` sequences in a shared pool of ``num_blocks`` pages.

    Args:
        num_blocks: pages in the pool.
        page_size: tokens per page (any size from 1 on).
        num_kv_heads: ``Hkv``.
        head_dim: ``Dk``; ``v_head_dim``: ``Dv``, default ``Dk``.
        max_seqs: ``B``, the sequences held, which are the batch rows of every call.
        max_pages_per_seq: ``P``, the width of the block table (default: the whole pool).
        layout: ``"flash"``: pages ``(num_blocks, page_size, Hkv, D)``, flash-attn's
            ``k_cache``; ``"vllm"``: ``(num_blocks, Hkv, page_size, D)``, vLLM's ``key_cache``.
            The kernel reads either where it lies.
        dtype, device: of the keys and values given and read, and of the pages unless
            ``kv_dtype`` says otherwise.
        kv_dtype: store the pages quantized: ``torch.int8`` (symmetric, a float32 scale per
            token and key/value head) or ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (a
            float32 scale per sequence and key/value head, set by the sequence's first write
            and kept on each of its pages; later tokens beyond its range saturate). The scales
            are the buffers ``k_scales`` and ``v_scales``, head-major ``(num_blocks, Hkv,
            page_size, 1)`` (int8) or ``(num_blocks, Hkv, 1, 1)`` (float8). Writes quantize;
            attention reads the pages where they lie with their scales. None (default): pages
            in ``dtype``.
        values_in_keys: the values are the keys' first ``Dv`` columns (``Dv <= Dk``), stored
            once: ``v_pages`` is the view ``k_pages[..., :Dv]``, in either layout. This is
            multi-head latent attention's cache (one head of ``[c, k_rope]`` a token, whose
            values are the latent ``c``: :meth:`MultiHeadLatentAttention.make_paged_cache()
            <attnkit.MultiHeadLatentAttention.make_paged_cache>`). Writes take the keys only
            (``v=None``), or values equal to the keys' first ``Dv`` columns (anything else is
            refused); an attention call reads the values where the keys lie. With
            ``kv_dtype`` the values are read with the keys' scales (``v_scales`` is
            ``k_scales``): the keys' first ``Dv`` columns, dequantized.

    The pages are the buffers ``k_pages`` and ``v_pages`` (not in ``state_dict()``);
    ``block_table`` ``(B, P)`` int32 names each sequence's pages in order (``-1`` past them),
    ``lengths`` holds each sequence's token count as Python ints (decoding never reads a tensor
    back for them). Pages are taken from the pool as a sequence grows and returned by
    :meth:`free`.

    Every call checks everything (shapes, dtypes, devices, counts, free pages, the mask and bias
    of an attention call) before it writes anything: a call that raises leaves the pages, the
    block table and the lengths as they were, bit for bit.

    :class:`~attnkit.MultiHeadAttention` takes it as ``cache=``, as it takes a
    :class:`~attnkit.KVCache` (:meth:`MultiHeadAttention.make_paged_cache()
    <attnkit.MultiHeadAttention.make_paged_cache>` builds one). In a call ``(B, T, D)`` every
    row appends ``T`` tokens, unless :meth:`schedule` said otherwise: then row ``b`` appends its
    first ``new_tokens[b]`` and the rest of its ``T`` positions are padding, so that one call
    prefills a prompt in one row while the others decode one token each.

    Under ``torch.compile`` the page bookkeeping (:meth:`stage`, :meth:`stage_call`,
    :meth:`write`, :meth:`commit`, :meth:`rewind`, :meth:`free`, :meth:`keep`, :meth:`reset`)
    runs eagerly between graphs: it allocates pages from host-side lengths, which a graph would
    otherwise take as constants and compile again at every token. The attention on the cache's
    view compiles.

    >>> cache = PagedKVCache(num_blocks=8, page_size=4, num_kv_heads=2, head_dim=8, max_seqs=2)
    >>> cache.schedule([5, 1])                       # a 5-token prompt; one token in row 1
    >>> slots = cache.stage(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))
    >>> cache.commit()
    >>> cache.lengths, cache.pages_of(0), cache.pages_of(1), slots.tolist()
    ([5, 1], [0, 1], [2], [0, 1, 2, 3, 4, 8])
    """

    k_pages: Tensor
    v_pages: Tensor
    k_scales: Tensor | None
    v_scales: Tensor | None
    block_table: Tensor

    def __init__(
        self,
        num_blocks: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        *,
        max_seqs: int,
        max_pages_per_seq: int | None = None,
        layout: Layout = "flash",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        kv_dtype: torch.dtype | None = None,
        values_in_keys: bool = False,
    ) -> None:
        super().__init__()
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.dtype = check_dtype(dtype)  # given and read in
        stored = self.dtype if self.kv_dtype is None else self.kv_dtype
        self.num_blocks = check_int("num_blocks", num_blocks)
        self.page_size = check_int("page_size", page_size)
        h = check_int("num_kv_heads", num_kv_heads)
        dk = check_int("head_dim", head_dim)
        dv = dk if v_head_dim is None else check_int("v_head_dim", v_head_dim)
        rows = check_int("max_seqs", max_seqs)
        width = (
            self.num_blocks
            if max_pages_per_seq is None
            else check_int("max_pages_per_seq", max_pages_per_seq)
        )
        if layout not in ("flash", "vllm"):
            raise ValueError(f"layout must be 'flash' or 'vllm', got {layout!r}")
        self.layout: Layout = layout
        #: whether ``v_pages`` is the view ``k_pages[..., :Dv]`` (a latent cache)
        self.values_in_keys = check_values_in_keys(values_in_keys, dk, dv)

        def pages(d: int) -> Tensor:
            shape = (self.num_blocks, self.page_size, h, d)
            if layout == "vllm":
                shape = (self.num_blocks, h, self.page_size, d)
            return cache_zeros(shape, dtype=stored, device=device)

        self.register_buffer("k_pages", pages(dk), False)
        self.register_buffer(
            "v_pages", self.k_pages[..., :dv] if values_in_keys else pages(dv), False
        )
        for name, t in (("k_scales", self.k_pages), ("v_scales", self.v_pages)):
            head_major = t if layout == "vllm" else t.transpose(1, 2)
            scales = None if self.kv_dtype is None else new_scales(head_major)
            if name == "v_scales" and values_in_keys:  # the values read with the keys' scales
                scales = self.k_scales
            self.register_buffer(name, scales, False)
        self.register_buffer(
            "block_table", torch.full((rows, width), -1, dtype=torch.int32, device=device), False
        )
        self.lengths = [0] * rows  # tokens each sequence holds
        #: each sequence's next token position: its tokens appended, those :meth:`keep` let go
        #: included (the offset a module rotates its new tokens by)
        self.positions = [0] * rows
        self._pages: list[list[int]] = [[] for _ in range(rows)]
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() takes the lowest first
        self._staged = [0] * rows  # tokens written by stage() after lengths, not yet held
        self._next: list[int] | None = None  # schedule(): the next call's new tokens per row

    # ---------------------------------------------------------------------------------------------
    # What the cache holds

    @property
    def max_seqs(self) -> int:
        return len(self.lengths)

    @property
    def length(self) -> int:
        """The longest sequence's tokens."""
        return max(self.lengths)

    @property
    def num_free_pages(self) -> int:
        """Pages of the pool that no sequence holds."""
        return len(self._free) + sum(self._staged_pages(b) for b in range(self.max_seqs))

    @_between_graphs
    def next_positions(self) -> Tensor:
        """Each sequence's next token position (:attr:`positions`) as an int64 tensor
        ``(max_seqs,)`` on the pages' device: where a module rotates its new tokens from, one
        offset per row (``rotary(x, offset=positions)``, see
        :func:`~attnkit.modules.positional.rotary_positions`). Under ``torch.compile`` it is made
        between graphs, so the positions reach the next graph as a tensor input: read inside one,
        they are integers of a module, which the graph takes as constants and compiles again for
        at every token (and as symbolic sizes, passed from one graph to the next, inductor's code
        lost them)."""
        return torch.tensor(self.positions, dtype=torch.int64, device=self.block_table.device)

    def pages_of(self, seq: int) -> list[int]:
        """The pages sequence ``seq`` holds, in order."""
        return list(self._pages[self._seq(seq)][: self._used(self.lengths[seq])])

    def token_major(self) -> tuple[Tensor, Tensor]:
        """The pages as ``(num_blocks, page_size, Hkv, D)`` views (flash-attn's layout), whatever
        ``layout`` they are stored in."""
        if self.layout == "vllm":
            return self.k_pages.transpose(1, 2), self.v_pages.transpose(1, 2)
        return self.k_pages, self.v_pages

    def _head_major(self) -> tuple[Tensor, Tensor]:
        """The pages as ``(num_blocks, Hkv, page_size, D)`` views, as the kernel reads them."""
        if self.layout == "vllm":
            return self.k_pages, self.v_pages
        return self.k_pages.transpose(1, 2), self.v_pages.transpose(1, 2)

    #: the buffers that are views of others in a values_in_keys pool, made again after a conversion
    _SHARED = ("v_pages", "v_scales")

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> PagedKVCache:
        """``nn.Module``'s conversions (``.to()``, ``.half()``, ``.double()``, ``.cuda()``, those
        of a model that holds the cache) change ``dtype``, the one keys and values are given and
        read in: a float pool's pages follow it, while quantized pages and their float32 scales
        keep their formats and only move (a float8 page is a float tensor to torch)."""
        probe = torch.zeros((), dtype=self.dtype, device=self.block_table.device)
        read = check_dtype(fn(probe).dtype)  # (a refused one moves nothing)
        was_meta = self.block_table.device.type == "meta"

        for name, t in self._buffers.items():  # (no parameters and no submodules)
            if t is not None and not (name in self._SHARED and self.values_in_keys):
                out = fn(t)
                keep = self.kv_dtype is not None and out.dtype != t.dtype
                self._buffers[name] = t.to(out.device) if keep else out
        if self.values_in_keys:  # still a view of the keys, not a copy beside them
            self._buffers["v_pages"] = self.k_pages[..., : self.v_pages.size(-1)]
            self._buffers["v_scales"] = self.k_scales
        self.dtype = read
        if was_meta and self.block_table.device.type != "meta":
            self._materialised()
        return self

    def _materialised(self) -> None:
        """The block table and a float8 pool's page scales of a pool moved off the meta device
        (``to_empty()``, a model built under ``torch.device("meta")``), where they had no
        values: each row's pages as the host-side lists name them and -1 past them, and a
        quantized pool's scales 1, as in a new pool (tokens held on meta had no values either)."""
        table = torch.full_like(self.block_table, -1)
        for b, pages in enumerate(self._pages):
            table[b, : len(pages)] = torch.tensor(pages, dtype=table.dtype)
        self.block_table.copy_(table)
        if self.k_scales is not None and self.v_scales is not None:
            self.k_scales.fill_(1.0)
            self.v_scales.fill_(1.0)

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle``, ``copy`` and ``torch.save`` store: float8 pages as their bytes (torch
        cannot unpickle a float8 tensor), and of a ``values_in_keys`` pool the values' width
        instead of their view, which pickle would store as a copy beside the keys (later
        tokens' values would then be written where nothing reads them)."""
        state = pickled_state(super().__getstate__())  # type: ignore[no-untyped-call]
        if self.values_in_keys:
            state["_buffers"]["v_pages"] = self.v_pages.size(-1)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(unpickled_state(state))  # type: ignore[no-untyped-call]
        if self.values_in_keys:  # the values a view of the keys' first columns again
            self._buffers["v_pages"] = self.k_pages[..., : state["_buffers"]["v_pages"]]

    def _given(self) -> tuple[Tensor, Tensor]:
        """The head-major pages as keys and values are given and read: the pages, or of a
        quantized pool stand-ins in ``dtype`` without data (what the checks compare with)."""
        kp, vp = self._head_major()
        return given(kp, vp, None if self.kv_dtype is None else self.dtype)

    def _scale_views(self) -> tuple[Tensor | None, Tensor | None]:
        """A quantized pool's scales as a view takes them, ``(X, Hkv, page, 1)`` (float8's
        expanded along the page); None for float pages."""
        if self.k_scales is None or self.v_scales is None:
            return None, None
        shape = (*self._head_major()[0].shape[:3], 1)
        return self.k_scales.expand(shape), self.v_scales.expand(shape)

    def _quantized(
        self, k: Tensor, v: Tensor | None, new: list[int]
    ) -> tuple[Tensor, Tensor | None, tuple[Tensor, Tensor | None] | None]:
        """Checked new tokens ``(B, Hkv, T, D)`` as the pages store them, and their scales: int8
        a scale per token; float8 each row's (a new sequence's from its first ``new[b]`` tokens,
        else the one its first page holds). Float pages: as given, None. ``v`` None (values
        that are the keys' columns): the keys only."""
        if self.kv_dtype is None or self.k_scales is None or self.v_scales is None:
            return k, v, None
        if v is None:
            kq, ks = self._quantized_one(k, self.k_scales, new)
            return kq, None, (ks, None)
        (kq, ks), (vq, vs) = (
            self._quantized_one(x, held, new)
            for x, held in ((k, self.k_scales), (v, self.v_scales))
        )
        return kq, vq, (ks, vs)

    def _quantized_one(self, x: Tensor, held: Tensor, new: list[int]) -> tuple[Tensor, Tensor]:
        """:meth:`_quantized` of the keys or of the values, whose scales are ``held``."""
        if self.kv_dtype is None or self.kv_dtype == torch.int8:
            return quantize(x, torch.int8)
        # a sequence's tokens share the scale of its first write, which its first page holds
        holding = [b for b, n in enumerate(self.lengths) if n]
        firsts = torch.tensor([self._pages[b][0] for b in holding], device=held.device)
        if len(holding) == len(new):  # (a decode step: no row starts a sequence)
            return quantize(x, self.kv_dtype, held[firsts].to(x.device))
        real = (
            torch.arange(x.size(2), device=x.device) < torch.tensor(new, device=x.device)[:, None]
        )
        # (B, Hkv, 1, 1), from each row's real tokens: what its padding holds sets nothing
        scale = fp8_scale(x, self.kv_dtype, real[:, None, :, None])
        if holding:
            scale[torch.tensor(holding, device=x.device)] = held[firsts].to(x.device)
        return quantize(x, self.kv_dtype, scale)

    def _write(
        self,
        k: Tensor,
        v: Tensor | None,
        scales: tuple[Tensor, Tensor | None] | None,
        new: list[int],
    ) -> list[Piece]:
        """Row ``b``'s first ``new[b]`` stored tokens after its ``lengths[b]``, through its pages
        (taken already), and their scales: int8 beside each token, float8 on each of the row's
        pages. ``v`` None: values that are the keys' columns, written with them (and read with
        their scales), never on their own."""
        kp, vp = self._head_major()
        kw = {"at": self.lengths, "counts": new, "block_table": self._pages}
        pieces = write(kp, None if v is None else vp, k, v, **kw)  # type: ignore[arg-type]
        if scales is None or self.k_scales is None or self.v_scales is None:
            return pieces
        ks, vs = scales
        v_scales = None if vs is None else self.v_scales
        if self.kv_dtype == torch.int8:
            write(self.k_scales, v_scales, ks, vs, pieces=pieces, **kw)  # type: ignore[arg-type]
            return pieces
        # float8: the row's scale on the pages new to it (those past its held tokens' pages,
        # all of a new sequence's); the pages of its held tokens carry it already
        owners, pages = [], []
        for b, taken in enumerate(self._pages):
            if new[b]:
                fresh = taken[self._used(self.lengths[b]) :]
                owners += [b] * len(fresh)
                pages += fresh
        if pages:
            device = self.k_scales.device
            at, who = torch.tensor(pages, device=device), torch.tensor(owners, device=ks.device)
            self.k_scales[at] = ks[who].to(device)
            if v_scales is not None and vs is not None:
                v_scales[at] = vs[who].to(device)
        return pieces

    def _seq(self, seq: int) -> int:
        # (any integer: numpy's too, as rows found with np.nonzero are)
        seq = check_int("seq", seq, minimum=0) if not isinstance(seq, int) else seq
        if isinstance(seq, bool) or not 0 <= seq < self.max_seqs:
            raise ValueError(f"seq must be a sequence from 0 to {self.max_seqs - 1}, got {seq!r}")
        return seq

    def _used(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _staged_pages(self, b: int) -> int:
        """Pages the uncommitted stage took for row ``b`` (past those of its held tokens)."""
        return len(self._pages[b]) - self._used(self.lengths[b])

    # ---------------------------------------------------------------------------------------------
    # Writing

    def schedule(self, new_tokens: Sequence[int] | Tensor | None) -> None:
        """How many of a call's ``T`` positions are new tokens in each row, for the calls until
        the next :meth:`commit` (which clears it); None: all ``T`` in every row. Row ``b``'s
        first ``new_tokens[b]`` positions are written and attend; the others are padding, never
        written, whose outputs are 0."""
        if new_tokens is None:
            self._next = None
            return
        self._next = _counts("new_tokens", new_tokens, self.max_seqs, 2**62)

    def _plan(self, k: Tensor, v: Tensor | None) -> list[int]:
        """The checks of a stage of ``k`` and ``v``; the new tokens of each row."""
        rows = self.max_seqs
        kp, vp = self._given()
        what = f"PagedKVCache of B = max_seqs = {rows} sequences"
        compare = False
        if self.values_in_keys:
            v, compare = values_of_keys(k, v, vp.size(-1))  # type: ignore[assignment]
        k, v = check_tokens(k, v, kp, vp, rows, what)
        if compare:
            check_values(k, v, vp.size(-1), "this PagedKVCache")
        new = [k.size(-2)] * rows if self._next is None else self._next
        if any(n > k.size(-2) for n in new):
            raise ValueError(
                f"schedule() gave new tokens {new}, more than the call's T = {k.size(-2)} in a row"
            )
        self._check_room(new)
        return new

    def _check_room(self, new: list[int]) -> None:
        """Refuse new tokens that overflow a row's block table or the pool's free pages."""
        width = self.block_table.size(1)
        need = 0
        for b, n in enumerate(new):
            pages = self._used(self.lengths[b] + n)
            if pages > width:
                raise ValueError(
                    f"sequence {b}: {n} new tokens after its {self.lengths[b]} need {pages} pages "
                    f"of {self.page_size}, more than its block table's {width} "
                    "(max_pages_per_seq)"
                )
            need += pages - self._used(self.lengths[b])
        # The pages of an uncommitted stage are dropped first, and so count as free.
        if need > self.num_free_pages:
            raise ValueError(
                f"out of pages: the new tokens {new} need {need} more pages of {self.page_size} "
                f"tokens and the pool has {self.num_free_pages} free of {self.num_blocks}; free() "
                "finished sequences or make a larger pool"
            )

    def _drop_staged(self) -> None:
        for b in range(self.max_seqs):
            self._trim(b, self.lengths[b])
        self._staged = [0] * self.max_seqs

    def _trim(self, b: int, tokens: int) -> None:
        """Return row ``b``'s pages past those of its first ``tokens`` tokens to the pool."""
        keep = self._used(tokens)
        extra = self._pages[b][keep:]
        if extra:
            # (the tensors first, the lists last: cut short by an interrupt, the same call again
            # finds the pages still the row's, and returns them)
            self.block_table[b, keep : keep + len(extra)] = -1
            if self.kv_dtype in FLOAT8 and self.k_scales is not None:
                # a page back in the pool holds no sequence's scale: write() quantizes into it
                # with 1 (as into a new pool), not with the scale of the sequence it last held
                at = torch.tensor(extra, device=self.k_scales.device)
                self.k_scales[at] = 1.0
                if self.v_scales is not None and not self.values_in_keys:
                    self.v_scales[at] = 1.0
            del self._pages[b][keep:]
            self._free.extend(reversed(extra))

    @shape_checked
    @_between_graphs
    def stage(
        self, k: Float[Tensor, "B Hkv T Dk"], v: Float[Tensor, "B Hkv T Dv"] | None
    ) -> Tensor:
        """Write each row's new tokens after the ``lengths`` it holds, without holding them yet.

        Row ``b`` writes its first ``T`` tokens (or ``new_tokens[b]`` of :meth:`schedule`),
        taking pages from the pool as it needs them. They are held once :meth:`commit` runs;
        until then the next :meth:`stage` or :meth:`rewind` drops them and returns their pages.
        Returns the ``(N,)`` int64 slots written (vLLM's ``slot_mapping``: ``page * page_size +
        offset``), row by row. ``v`` None: a ``values_in_keys`` cache's values, the keys' first
        ``Dv`` columns.
        """
        pieces = self._stage(k, v, self._plan(k, v))
        size = self.page_size
        slots = [s for _, p, at, m, _ in pieces for s in range(p * size + at, p * size + at + m)]
        return torch.tensor(slots, dtype=torch.int64, device=self.block_table.device)

    def _stage(self, k: Tensor, v: Tensor | None, new: list[int]) -> list[Piece]:
        """:meth:`stage` of checked tokens, ``new[b]`` of them in row ``b``; the stretches
        written."""
        # (before anything is written; a values_in_keys cache's values are its keys')
        k, v, scales = self._quantized(k, None if self.values_in_keys else v, new)
        try:
            self._take_pages(new)
            pieces = self._write(k, v, scales, new)
        except BaseException:
            # A write cut short (a KeyboardInterrupt lands between any two of its operations)
            # returns the pages it took, and names none of them in the block table.
            self._drop_staged()
            raise
        self._staged = new
        return pieces

    def _take_pages(self, new: list[int]) -> None:
        """Row ``b``'s pages for its held tokens and ``new[b]`` more. The pages of an uncommitted
        stage that are still needed stay (a step staged again takes no page and writes no entry
        of the block table), those past them return to the pool, every row's before any row
        takes one (:meth:`_check_room` counted them all as free), and the pages taken are named
        in the block table in one write."""
        for b, n in enumerate(new):
            self._trim(b, self.lengths[b] + n)
        cells: list[tuple[int, int, int]] = []  # (row, column, page) of the pages taken
        for b, n in enumerate(new):
            need = self._used(self.lengths[b] + n)
            pages = self._pages[b]
            while len(pages) < need:
                cells.append((b, len(pages), self._free.pop()))
                pages.append(cells[-1][2])
        if len(cells) == 1:
            b, column, page = cells[0]
            self.block_table[b, column] = page
        elif cells:
            device = self.block_table.device
            rows, columns, taken = zip(*cells, strict=True)
            at = torch.tensor([rows, columns], device=device)
            self.block_table[at[0], at[1]] = torch.tensor(taken, dtype=torch.int32, device=device)

    @_between_graphs
    def write(
        self,
        k: Float[Tensor, "N Hkv Dk"],
        v: Float[Tensor, "N Hkv Dv"] | None,
        slot_mapping: Tensor,
    ) -> None:
        """vLLM's ``reshape_and_cache``: token ``n``'s key and value into slot
        ``slot_mapping[n]`` (``page * page_size + offset``; ``-1``: not written, vLLM's padding).

        A write into the pool only: the lengths and block table stay as they are. Every slot is
        checked (in the pool, none twice) before anything is written. ``v`` None: a
        ``values_in_keys`` cache's values, the keys' first ``Dv`` columns. A quantized pool
        stores them as :meth:`stage` does: int8 with a scale per token, float8 with the scale
        of the slot's page (a sequence's, or 1 on a page no sequence holds: vLLM's default
        ``k_scale``), ``x / scale`` saturating at the format's largest number.
        """
        kp, vp = self.token_major()
        compare = False
        if self.values_in_keys:
            v, compare = values_of_keys(k, v, vp.size(-1))  # type: ignore[assignment]
        check_float_tensor("k", k)
        v = check_float_tensor("v", v)
        if (
            k.ndim != 3
            or v.ndim != 3
            or k.shape[:2] != v.shape[:2]
            or k.shape[1:] != kp.shape[2:]
            or v.shape[1:] != vp.shape[2:]
        ):
            raise ValueError(
                f"k and v must be (N, Hkv, Dk) = (N, {kp.size(2)}, {kp.size(3)}) and (N, Hkv, Dv) "
                f"= (N, {vp.size(2)}, {vp.size(3)}), got k {shape_str(k.shape)} and v "
                f"{shape_str(v.shape)}"
            )
        if k.dtype != self.dtype or v.dtype != self.dtype:
            raise TypeError(
                f"k and v must have the cache's dtype ({dtype_str(self.dtype)}), got k "
                f"{dtype_str(k.dtype)} and v {dtype_str(v.dtype)}"
            )
        if k.device != kp.device or v.device != kp.device:
            raise ValueError(
                f"k and v must be on the cache's device ({kp.device}), got {k.device}, {v.device}"
            )
        if (
            not isinstance(slot_mapping, Tensor)
            or slot_mapping.is_floating_point()
            or slot_mapping.dtype == torch.bool
            or slot_mapping.shape != (k.size(0),)
        ):
            got = (
                f"{dtype_str(slot_mapping.dtype)} {shape_str(slot_mapping.shape)}"
                if isinstance(slot_mapping, Tensor)
                else type(slot_mapping).__name__
            )
            raise TypeError(f"slot_mapping must be ({k.size(0)},) integers, got {got}")
        if compare:
            check_values(k, v, vp.size(-1), "this PagedKVCache")
        slots = self._checked_slots(slot_mapping, kp.device)
        if slots is None:
            return  # (pages on the meta device hold no values to write)
        keep = slots >= 0
        kp, vp = self._head_major()
        k, v, slots = k[keep.to(k.device)], v[keep.to(v.device)], slots[keep]
        # (the values of values_in_keys written with the keys, and read with their scales)
        vp_or_none = None if self.values_in_keys else vp
        if self.kv_dtype is None or self.k_scales is None or self.v_scales is None:
            put(kp, vp_or_none, k, v, slots)
            return
        # quantized, every scale computed before anything is written: int8 a scale per token,
        # float8 the one of the slot's page (1 on a page no sequence holds, vLLM's default)
        at = slots.to(kp.device) // self.page_size
        fp8 = self.kv_dtype != torch.int8
        kq, ks = quantize(k[:, :, None], self.kv_dtype, self.k_scales[at] if fp8 else None)
        vq, vs = quantize(v[:, :, None], self.kv_dtype, self.v_scales[at] if fp8 else None)
        put(kp, vp_or_none, kq[:, :, 0], vq[:, :, 0], slots)
        if not fp8:
            v_scales = None if self.values_in_keys else self.v_scales
            put(self.k_scales, v_scales, ks[:, :, 0], vs[:, :, 0], slots)

    def _checked_slots(self, slot_mapping: Tensor, device: torch.device) -> Tensor | None:
        """:meth:`write`'s ``slot_mapping`` as int64, each slot in the pool or -1 and none twice;
        None for pages on the meta device (slots on meta hold no values to check: refused for
        pages elsewhere)."""
        if slot_mapping.device.type == "meta":
            if device.type != "meta":
                raise ValueError(
                    f"slot_mapping is on meta, which holds no values, but the cache is on "
                    f"{device}: give the slots on {device}"
                )
            return None
        slots = slot_mapping.long()
        keep = slots >= 0
        size = self.num_blocks * self.page_size
        bad = (slots < -1) | (slots >= size)
        if bool(bad.any()):
            n = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"slot_mapping[{n}] = {int(slots[n])} is not a slot: the pool holds {size} "
                f"({self.num_blocks} pages of {self.page_size}), -1 for a token not written"
            )
        if int(slots[keep].unique().numel()) != int(keep.sum()):
            raise ValueError("slot_mapping names a slot twice: which token would it hold?")
        return None if device.type == "meta" else slots

    @_between_graphs
    def commit(self) -> None:
        """Hold the tokens of the last :meth:`stage`, and forget :meth:`schedule`."""
        self.lengths = [n + s for n, s in zip(self.lengths, self._staged, strict=True)]
        self.positions = [n + s for n, s in zip(self.positions, self._staged, strict=True)]
        self._staged = [0] * self.max_seqs
        self._next = None

    @_between_graphs
    def rewind(self, lengths: int | Sequence[int]) -> None:
        """Forget every token of sequence ``b`` from position ``lengths[b]`` on (an int: the same
        for every sequence), and any uncommitted stage, returning the pages no longer needed."""
        keep = _counts("lengths", lengths, self.max_seqs, 2**62)
        self._drop_staged()
        for b, n in enumerate(keep):
            self.positions[b] -= self.lengths[b] - min(self.lengths[b], n)
            self.lengths[b] = min(self.lengths[b], n)
            self._trim(b, self.lengths[b])

    @_between_graphs
    def free(self, seq: int) -> None:
        """Forget sequence ``seq`` and return its pages to the pool: its row takes a new sequence
        (a prompt of its own length) at the next call."""
        b = self._seq(seq)
        self._drop_staged()
        self.lengths[b] = 0
        self.positions[b] = 0
        self._trim(b, 0)

    @_between_graphs
    def keep(self, seq: int, indices: Tensor) -> None:
        """Keep only the tokens ``indices`` ``(Hkv, K)`` of sequence ``seq``, per key/value head
        (positions from 0 to ``lengths[seq] - 1``, none twice in a head, in any order): they
        move to the sequence's first ``K`` positions through its block table, in time order,
        ``lengths[seq]`` becomes ``K`` and the pages no longer needed return to the pool. H2O
        and SnapKV evict this way (the inference guide builds both from
        :func:`attnkit.attention_stats`).

        ``K`` is the same for every head. Any uncommitted stage is dropped, as :meth:`free`
        drops it. Everything is checked before anything moves: a refused call leaves the pages,
        the block table and the lengths as they were; a call interrupted once the tokens began
        to move (a KeyboardInterrupt) completes first, leaving the cache as after the call.
        Attention over the sequence is then attention over exactly the kept tokens, and its next
        tokens are appended after them. Keys move as they are stored: a key rotated at its
        position (RoPE) keeps that rotation, and ``positions[seq]`` (the offset a module rotates
        new tokens by) still counts every token of the sequence, while ``lengths[seq]`` counts
        the kept ones.

        >>> cache = PagedKVCache(num_blocks=4, page_size=2, num_kv_heads=1, head_dim=1, max_seqs=1)
        >>> k = torch.arange(5.0).view(1, 1, 5, 1)  # tokens 0..4, their own value
        >>> _ = cache.stage(k, k); cache.commit()
        >>> cache.pages_of(0), cache.num_free_pages
        ([0, 1, 2], 1)
        >>> cache.keep(0, torch.tensor([[4, 1]]))
        >>> cache.lengths, cache.pages_of(0), cache.num_free_pages
        ([2], [0], 3)
        >>> cache.k_pages[0, :, 0, 0].tolist()  # page 0 holds tokens 1 and 4
        [1.0, 4.0]
        """
        b = self._seq(seq)
        h = self.k_pages.size(2 if self.layout == "flash" else 1)
        what = f"indices for sequence {b} of this PagedKVCache (Hkv={h})"
        index = check_indices(indices, (h,), self.lengths[b], what, self.k_pages.device)
        self._drop_staged()
        # (float8 moved as its bytes: torch's indexing has no float8 kernel; values that are a
        # view of the keys move with them, and would be moved twice on their own)
        stored = self._head_major()[: 1 if self.values_in_keys else 2]
        moved = [t.view(torch.uint8) if t.dtype in FLOAT8 else t for t in stored]
        if self.kv_dtype == torch.int8 and self.k_scales is not None and self.v_scales is not None:
            # a scale a token moves with it (once, where the values' are the keys')
            moved += [self.k_scales] if self.values_in_keys else [self.k_scales, self.v_scales]

        def held() -> None:
            self.lengths[b] = index.size(-1)
            self._trim(b, self.lengths[b])

        # (an interrupt once it writes: it completes first)
        compact_pages(moved, self._pages[b], index, self.page_size, held)

    @_between_graphs
    def reset(self) -> None:
        """Forget every sequence (the memory stays allocated)."""
        self._drop_staged()
        for b in range(self.max_seqs):
            self.lengths[b] = 0
            self.positions[b] = 0
            self._trim(b, 0)
        self._next = None

    # ---------------------------------------------------------------------------------------------
    # Attending

    def _check_attention(
        self,
        q: Tensor,
        new: list[int],
        view: CacheView,
        *,
        mask: object,
        causal: object,
        scale: object,
        softcap: object,
        bias: object,
        sinks: object,
    ) -> CheckedCall:
        """Every argument of an attention call, before anything is written: q against the cache,
        then what :func:`attnkit.attention` checks of the call on ``view``, the view it reads
        once the ``new`` tokens are written (``scale``, ``softcap``, the sinks' shape, dtype and
        values, the mask and the bias against each row's keys); the call so checked."""
        check_float_tensor("q", q)
        hkv = self.k_pages.size(2 if self.layout == "flash" else 1)
        dk = self.k_pages.size(-1)
        if q.ndim != 4 or q.size(0) != self.max_seqs or q.size(1) % hkv or q.size(-1) != dk:
            raise ValueError(
                f"q must be (B, H, T, Dk) with B = {self.max_seqs}, H a multiple of Hkv = {hkv} "
                f"and Dk = {dk}, got {shape_str(q.shape)}"
            )
        if q.dtype != self.dtype or q.device != self.k_pages.device:
            raise TypeError(
                f"q must have the cache's dtype and device ({dtype_str(self.dtype)} on "
                f"{self.k_pages.device}), got {dtype_str(q.dtype)} on {q.device}"
            )
        if any(n > q.size(2) for n in new):
            raise ValueError(f"the new tokens {new} are more than q's T = {q.size(2)} in a row")
        if bias is not None and not isinstance(bias, DistanceBias):
            raise TypeError(
                "bias: a PagedKVCache call takes a bias by distance (DistanceBias, "
                f"attnkit.alibi_term), got {type(bias).__name__}"
            )
        return check_cache_call(
            q, view, mask=mask, bias=bias, causal=causal, scale=scale, softcap=softcap, sinks=sinks
        )

    def _view_of(self, new: Sequence[int]) -> CacheView:
        """The view of each row's held tokens and ``new[b]`` more (with :meth:`schedule`, its
        real queries): the pages and the block table where they lie, views that show what a
        stage then writes into them."""
        ends = [n + s for n, s in zip(self.lengths, new, strict=True)]
        width = min(max(1, *(self._used(e) for e in ends)), self.block_table.size(1))
        kp, vp = self._head_major()
        ks, vs = self._scale_views()
        return CacheView(
            kp,
            vp,
            tuple((0, e) for e in ends),
            self.block_table[:, :width],
            None if self._next is None else tuple(new),
            ks,
            vs,
            trusted=True,
        )

    def stand_in(self, new_tokens: int) -> CacheView:
        """The view a call of ``new_tokens`` tokens a row (or :meth:`schedule`'s) will read once
        they are staged: the pages and the block table as they are, the rows' keys as they will
        be (pages not taken yet are named, but nothing reads them). What ``explain()``
        describes."""
        return self._view_of([new_tokens] * self.max_seqs if self._next is None else self._next)

    def view(self) -> CacheView:
        """The keys and values held and staged, as :func:`attnkit.attention` reads them where
        they lie: the pages through the block table, row ``b``'s keys its ``lengths[b]`` held
        and staged tokens, and with :meth:`schedule` its staged tokens its real queries.

        The view reads the pool and the block table when a call runs, not copies made now:
        tokens appended later leave what it reads as it was; the pages that :meth:`free`,
        :meth:`keep` or :meth:`rewind` return to the pool are -1 in the table, which a call on
        the view refuses, and pages taken again hold another sequence's tokens. Take a new
        view after those."""
        return self._view_of(self._staged)

    @_between_graphs
    def stage_call(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor | None,
        *,
        mask: Tensor | Mask | None = None,
        causal: bool = False,
        scale: float | None = None,
        softcap: float | None = None,
        bias: object = None,
        sinks: Tensor | None = None,
    ) -> CacheView:
        """Check the attention call of ``q`` on the keys held and the new ``k``, ``v`` (every
        argument, before anything is written), stage ``k`` and ``v``, and return the
        :meth:`view` that call reads: what a module does before its one
        :func:`attnkit.attention` call. The view carries the call so checked: the
        :func:`attnkit.attention` call on it with the same arguments (the same ``q``, ``mask``,
        ``bias`` and ``sinks``) is not described and checked a second time."""
        _check_mask(mask)
        new = self._plan(k, v)
        view = self._view_of(new)  # (what the call reads once the new tokens are written)
        kw = {"mask": mask, "causal": causal, "scale": scale, "softcap": softcap}
        checked = self._check_attention(q, new, view, bias=bias, sinks=sinks, **kw)
        self._stage(k, v, new)
        return replace(view, checked_call=checked)

    def attention(
        self,
        q: Float[Tensor, "B H T Dk"],
        k: Float[Tensor, "B Hkv T Dk"],
        v: Float[Tensor, "B Hkv T Dv"] | None,
        *,
        mask: Tensor | Mask | None = None,
        causal: bool = False,
        scale: float | None = None,
        softcap: float | None = None,
        bias: DistanceBias | None = None,
        sinks: Tensor | None = None,
    ) -> tuple[Float[Tensor, "B H T Dv"], Float[Tensor, "B H T"]]:
        """Stage the new ``k`` and ``v`` (as :meth:`stage`), then attend each row's queries to
        its keys: row ``b``'s new query ``i`` sits at position ``lengths[b] + i`` and sees the
        row's tokens up to its own staged ones, bottom-right aligned as everywhere in attnkit.

        Args:
            q: the queries of the new tokens (row ``b``'s first ``new_tokens[b]`` are real).
            mask, causal: which of its keys each query attends: bands over distances
                (``causal=True``, :func:`~attnkit.masks.causal`,
                :func:`~attnkit.masks.sliding_window`), index masks
                (:func:`~attnkit.masks.key_indices`, :func:`~attnkit.masks.block_indices`:
                positions in the row's tokens from 0, ``(B|1, Hi, T, k)``; an entry past the
                row's own length is ignored, one past the longest row's refused) and bool tensors
                ``(B|1, H|1, T, S)`` at (query, key position), joined by ``&`` and ``|``.
            scale: multiplies ``q k^T`` (default ``1/sqrt(Dk)``); ``softcap``: ``softcap *
                tanh(s / softcap)`` of the scaled scores.
            bias: a bias by distance (ALiBi: :func:`attnkit.alibi_term`) whose table holds the
                distances ``-(S - 1) .. T - 1`` of the longest row's ``S`` keys.
            sinks: ``(H,)`` logits, an attention sink per query head.

        Returns:
            ``(out, lse)``: ``(B, H, T, Dv)`` and the natural-log log-sum-exp ``(B, H, T)``;
            padding positions get 0 and ``-inf``.

        Every argument is checked before anything is written. The new tokens are staged, not
        held: :meth:`commit` holds them. A call that raises after it staged them (an interrupt
        included) drops its stage: the lengths, the block table and the free pages are as they
        were, and a later :meth:`commit` holds nothing of it. The call is one
        :func:`attnkit.attention` call on the cache's :meth:`view` (``explain()`` shows it,
        ``record_dispatch()`` records it): on CPUs without gradients (float32, float64, bfloat16,
        float16) the chunked backend's native kernel reads the pages through the block table
        where they lie; otherwise each row's keys are gathered. With an index mask only each
        query's selected keys are gathered, through the block table (O(T * k) time and memory),
        and attended.
        """
        kw = {"mask": mask, "causal": causal, "scale": scale, "softcap": softcap}
        view = self.stage_call(q, k, v, bias=bias, sinks=sinks, **kw)  # type: ignore[arg-type]
        try:
            out, lse = attention(q, view, bias=bias, sinks=sinks, return_lse=True, **kw)  # type: ignore[call-overload]
        except BaseException:
            # The call failed (a KeyboardInterrupt in the kernel's call included): its tokens
            # are not left staged, where a later commit() would hold them, and its pages go
            # back to the pool.
            self._drop_staged()
            raise
        return out, lse

    def extra_repr(self) -> str:
        kp = self.token_major()[0]
        return (
            f"num_blocks={self.num_blocks}, page_size={self.page_size}, num_kv_heads={kp.size(2)}, "
            f"head_dim={kp.size(3)}, v_head_dim={self.v_pages.size(-1)}, max_seqs="
            f"{self.max_seqs}, layout={self.layout!r}, lengths={self.lengths}"
            + ("" if self.kv_dtype is None else f", kv_dtype={self.kv_dtype}")
            + (", values_in_keys=True" if self.values_in_keys else "")
        )
