"""Attention masks in attnkit's one convention: **True = this query may attend this key**.

Two kinds, accepted wherever attnkit takes a ``mask``:

* **Structured masks** (:class:`Mask`): lazy descriptions of which pairs may attend, built by
  :func:`causal`, :func:`sliding_window`, :func:`documents`, :func:`key_padding` and
  :func:`from_fn`, and combined with ``&`` and ``|`` (also with bool tensors). They are never
  written out as a ``(Tq, Tk)`` matrix unless a backend needs one: attnkit's chunked kernel asks a
  structured mask which blocks of the scores are empty, full or partial, skips the empty ones, does
  no mask work in the full ones and builds a small tile only for the partial ones. A sliding window
  over 65536 tokens costs a few KiB instead of a 4 GiB bool matrix. ``mask.dense(Tq, Tk)`` writes
  one out when you want to look at it.
* **Dense bool tensors** broadcastable to the ``(..., H, Tq, Tk)`` scores, as torch's
  ``scaled_dot_product_attention`` takes them. The helpers :func:`causal_mask`,
  :func:`sliding_window_mask`, :func:`padding_mask`, :func:`block_diagonal_mask` build them and
  :func:`combine_masks` ANDs them.

Queries and keys are aligned **bottom-right**: when there are fewer queries than keys (a KV cache, a
streaming chunk), query ``i`` sits at key position ``i' = i + Tk - Tq``. That is what decoding
with a cache needs, and it is the alignment of ``attention(..., causal=True)``. :func:`from_fn` is
the exception: its function sees the raw indices, as FlexAttention's ``mask_mod`` does.

>>> import torch
>>> m = causal() & key_padding([3, 2])       # causal within each row's real tokens
>>> m
causal() & key_padding(lengths=[3, 2])
>>> m.dense(3, batch_size=2)[:, 0].int()
tensor([[[1, 0, 0],
         [1, 1, 0],
         [1, 1, 1]],
<BLANKLINE>
        [[1, 0, 0],
         [1, 1, 0],
         [1, 1, 0]]], dtype=torch.int32)

Shape letters: ``B`` batch (several batch dims count as one, flattened), ``H`` heads, ``Tq``
queries, ``Tk`` keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ._checks import check_int, dim_str, shape_str
from ._typing import Bool, Int, shape_checked

__all__ = [
    "Mask",
    "block_diagonal_mask",
    "causal",
    "causal_mask",
    "combine_masks",
    "documents",
    "from_fn",
    "key_padding",
    "padding_mask",
    "sliding_window",
    "sliding_window_mask",
]

# Block states of a block plan: no pair may attend, some may, all may.
EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class _Geometry:
    """The call a mask is asked about: batch dims ``batch_shape`` (structured masks see them
    flattened to ``batch`` rows), ``heads`` query heads, ``q_len`` queries and ``kv_len`` keys, on
    ``device``. Block and tile positions are always in these coordinates (ring attention's shards
    pass their global positions)."""

    batch_shape: tuple[int, ...]
    heads: int
    q_len: int
    kv_len: int
    device: torch.device

    @property
    def batch(self) -> int:
        return math.prod(self.batch_shape)

    @property
    def shift(self) -> int:
        """``Tk - Tq``: query ``i`` sits at key position ``i + shift`` (bottom-right)."""
        return self.kv_len - self.q_len


def _edges(start: int, stop: int, block: int) -> tuple[Tensor, Tensor]:
    """First and last (inclusive) positions of the blocks of ``block`` in ``[start, stop)``."""
    first = torch.arange(start, stop, block)
    last = torch.clamp(first + block - 1, max=stop - 1)
    return first, last


def _states_from(empty: Tensor, full: Tensor) -> Tensor:
    return torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.uint8)


def _block_reduce(t: Tensor, start: int, stop: int, block: int, dim: int) -> tuple[Tensor, Tensor]:
    """``(any, all)`` of the bool tensor ``t`` over the blocks of ``[start, stop)`` along ``dim``
    (size ``stop - start`` there, or 1 to broadcast)."""
    n = -(-(stop - start) // block)
    if t.size(dim) == 1:
        shape = list(t.shape)
        shape[dim] = n
        return t.expand(shape), t.expand(shape)
    pad = n * block - (stop - start)
    t = t.movedim(dim, -1)
    anys = torch.nn.functional.pad(t, (0, pad), value=False).unflatten(-1, (n, block)).any(-1)
    alls = torch.nn.functional.pad(t, (0, pad), value=True).unflatten(-1, (n, block)).all(-1)
    return anys.movedim(-1, dim), alls.movedim(-1, dim)


class Mask:
    """A structured mask: which (query, key) pairs may attend, described without a ``(Tq, Tk)``
    matrix. Build one with :func:`causal`, :func:`sliding_window`, :func:`documents`,
    :func:`key_padding` or :func:`from_fn`; combine with ``&`` and ``|`` (bool tensors work on
    either side). Pass it as ``mask=`` to :func:`attnkit.attention` or to any attnkit module.
    """

    # ----------------------------------------------------------------------------------------------
    # Public

    def __and__(self, other: object) -> Mask:
        return _combine("and", self, other)

    def __rand__(self, other: object) -> Mask:
        return _combine("and", other, self)

    def __or__(self, other: object) -> Mask:
        return _combine("or", self, other)

    def __ror__(self, other: object) -> Mask:
        return _combine("or", other, self)

    def dense(
        self,
        q_len: int,
        kv_len: int | None = None,
        *,
        batch_size: int = 1,
        num_heads: int = 1,
        device: torch.device | str | None = None,
    ) -> Bool[Tensor, "#B #H Tq Tk"]:
        """The mask written out as a bool tensor ``(B|1, H|1, Tq, Tk)`` (a dim is 1 where the mask
        does not depend on it). ``kv_len`` defaults to ``q_len``."""
        q_len = check_int("q_len", q_len, minimum=0)
        kv_len = q_len if kv_len is None else check_int("kv_len", kv_len, minimum=0)
        geo = _Geometry(
            (check_int("batch_size", batch_size),),
            check_int("num_heads", num_heads),
            q_len,
            kv_len,
            torch.device("cpu") if device is None else torch.device(device),
        )
        self._check(geo, "mask")
        return self._tile(geo, 0, q_len, 0, kv_len).expand(-1, -1, q_len, kv_len)

    def __repr__(self) -> str:
        return self._describe()

    # ----------------------------------------------------------------------------------------------
    # What the kernel asks (every subclass implements _describe, _tile and, for speed, _states)

    def _describe(self) -> str:
        raise NotImplementedError

    def _check(self, geo: _Geometry, name: str) -> None:
        """Raise ``ValueError``/``TypeError`` naming ``name`` if the mask does not fit the call."""

    def _tile(self, geo: _Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        """Bool ``(B|1, H|1, qe-qs|1, ke-ks|1)``: may queries ``qs:qe`` attend keys ``ks:ke``."""
        raise NotImplementedError

    def _states(self, geo: _Geometry, q: tuple[int, int, int], k: tuple[int, int, int]) -> Tensor:
        """uint8 ``(nq, nk)`` on the CPU: EMPTY, PARTIAL or FULL for each block of the grid.

        ``q = (start, stop, block)`` cuts the queries ``[start, stop)`` into blocks of ``block``
        rows; ``k`` likewise the keys. The default evaluates the whole grid tile by tile; masks
        with structure answer from it.
        """
        return _states_by_tiles(self, geo, q, k)

    def _rows(self, geo: _Geometry, qs: int, qe: int, ks: int, ke: int) -> tuple[int, int]:
        """Rows ``r0:r1`` (relative to ``qs``) outside which no query of ``qs:qe`` sees a key of
        ``ks:ke``. Masks that cannot tell cheaply answer all rows."""
        return 0, qe - qs

    def _distances(self, geo: _Geometry) -> tuple[float, float]:
        """Bounds on ``j - i'`` (key position minus the query's bottom-right position) over every
        visible pair; infinite where the mask does not bound it."""
        return -math.inf, math.inf

    @property
    def _keys_only(self) -> bool:
        """True when visibility depends on the key (and batch row) only, never on the query."""
        return False

    @property
    def _parts(self) -> tuple[Mask, ...]:
        return (self,)


def _states_by_tiles(
    mask: Mask, geo: _Geometry, q: tuple[int, int, int], k: tuple[int, int, int]
) -> Tensor:
    """Block states from the mask's own tiles, one query block at a time and in strips of keys, so
    the evaluation holds about 4M elements at most whatever ``Tq`` and ``Tk`` are."""
    (q0, q1, bq), (k0, k1, bk) = q, k
    width = max(1, (1 << 22) // max(1, geo.batch * geo.heads * bq) // bk) * bk
    rows = []
    for qs in range(q0, q1, bq):
        qe = min(qs + bq, q1)
        strips = []
        for ks in range(k0, k1, width):
            ke = min(ks + width, k1)
            t = mask._tile(geo, qs, qe, ks, ke).flatten(0, 2)  # (B*H*rows | 1, keys | 1)
            anys, _ = _block_reduce(t.any(0, keepdim=True), ks, ke, bk, 1)
            _, alls = _block_reduce(t.all(0, keepdim=True), ks, ke, bk, 1)
            strips.append(_states_from(~anys[0], alls[0]))
        rows.append(torch.cat(strips).cpu() if strips else torch.zeros(0, dtype=torch.uint8))
    if not rows:
        return torch.zeros(0, len(range(k0, k1, bk)), dtype=torch.uint8)
    return torch.stack(rows)


# --------------------------------------------------------------------------------------------------
# Causal and sliding windows: visibility is a band around the diagonal j = i + shift


class _Band(Mask):
    """Query ``i`` may attend key ``j`` iff ``lo <= j - (i + offset) <= hi`` (either bound may be
    infinite); ``offset`` is ``Tk - Tq`` (bottom-right) or 0 (top-left)."""

    def __init__(self, lo: float, hi: float, align: str) -> None:
        self.lo, self.hi, self.align = lo, hi, align

    def _offset(self, geo: _Geometry) -> int:
        return geo.shift if self.align == "bottom_right" else 0

    def _tile(self, geo: _Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        i = torch.arange(qs, qe, device=geo.device).unsqueeze(-1) + self._offset(geo)
        d = torch.arange(ks, ke, device=geo.device) - i  # (rows, keys): j - i'
        vis = d <= self.hi if self.hi < math.inf else torch.ones_like(d, dtype=torch.bool)
        if self.lo > -math.inf:
            vis = vis & (d >= self.lo)
        return vis[None, None]

    def _states(self, geo: _Geometry, q: tuple[int, int, int], k: tuple[int, int, int]) -> Tensor:
        qf, ql = _edges(*q)
        kf, kl = _edges(*k)
        off = self._offset(geo)
        qf, ql = qf.unsqueeze(-1) + off, ql.unsqueeze(-1) + off
        # j - i' over the block runs from kf - ql (its minimum) to kl - qf (its maximum).
        dmin, dmax = kf - ql, kl - qf
        empty = (dmax < self.lo) | (dmin > self.hi)
        full = (dmin >= self.lo) & (dmax <= self.hi)
        return _states_from(empty, full)

    def _rows(self, geo: _Geometry, qs: int, qe: int, ks: int, ke: int) -> tuple[int, int]:
        off = self._offset(geo)
        # Row i sees some key of ks:ke iff ks - hi <= i' and i' <= ke - 1 - lo.
        rows = qe - qs
        r0 = 0 if self.hi == math.inf else min(rows, max(0, int(ks - self.hi) - off - qs))
        r1 = rows if self.lo == -math.inf else min(rows, int(ke - 1 - self.lo) - off - qs + 1)
        return r0, max(r0, r1)

    def _distances(self, geo: _Geometry) -> tuple[float, float]:
        shift = self._offset(geo) - geo.shift  # top-left: i + 0 = i' - (Tk - Tq)
        return self.lo + shift, self.hi + shift


class _Causal(_Band):
    def __init__(self, align: str) -> None:
        super().__init__(-math.inf, 0, align)

    def _describe(self) -> str:
        return "causal()" if self.align == "bottom_right" else "causal(align='top_left')"


class _Window(_Band):
    def __init__(self, left: int, right: int) -> None:
        super().__init__(-left, right, "bottom_right")
        self.left, self.right = left, right

    def _describe(self) -> str:
        return f"sliding_window(left={self.left}, right={self.right})"


def causal(align: Literal["bottom_right", "top_left"] = "bottom_right") -> Mask:
    """Causal attention: query ``i`` may attend key ``j`` iff ``j <= i + Tk - Tq``.

    ``align="bottom_right"`` (the default, and ``attention(..., causal=True)``) puts the queries at
    the last key positions, which is what a KV cache needs: new tokens after cached ones see every
    cached key. ``align="top_left"`` puts them at the first positions (``j <= i``), which is what a
    preallocated (static) cache filled from position 0 means. They agree when ``Tq == Tk``::

        Tq=2, Tk=5          bottom_right   top_left
                            1 1 1 1 0      1 0 0 0 0
                            1 1 1 1 1      1 1 0 0 0

    >>> causal().dense(2, 5)[0, 0].int()
    tensor([[1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1]], dtype=torch.int32)
    >>> causal(align="top_left").dense(2, 5)[0, 0].int()
    tensor([[1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0]], dtype=torch.int32)
    """
    if align not in ("bottom_right", "top_left"):
        raise ValueError(f"align must be 'bottom_right' or 'top_left', got {align!r}")
    return _Causal(align)


def sliding_window(left: int, right: int = 0) -> Mask:
    """Local attention: query ``i`` (at key position ``i' = i + Tk - Tq``) may attend the keys
    ``i' - left <= j <= i' + right``.

    ``right=0`` (the default) is causal local attention over ``left + 1`` keys, as in Mistral;
    ``left`` and ``right`` both > 0 is the limited context of streaming speech encoders. Blocks
    outside the band are never computed, so time grows linearly with ``T`` and memory does not.

    >>> sliding_window(2).dense(5)[0, 0].int()
    tensor([[1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [0, 1, 1, 1, 0],
            [0, 0, 1, 1, 1]], dtype=torch.int32)
    >>> sliding_window(1, right=1).dense(3, 5)[0, 0].int()
    tensor([[0, 1, 1, 1, 0],
            [0, 0, 1, 1, 1],
            [0, 0, 0, 1, 1]], dtype=torch.int32)
    """
    return _Window(check_int("left", left, minimum=0), check_int("right", right, minimum=0))


# --------------------------------------------------------------------------------------------------
# Masks with data: packed documents, key padding


def _document_rows(lengths: object) -> list[list[int]]:
    """``lengths`` as one list of document lengths per batch row (one row when shared)."""
    if isinstance(lengths, Tensor):
        if lengths.is_floating_point() or lengths.dtype == torch.bool or lengths.ndim not in (1, 2):
            raise TypeError(
                f"lengths must be a 1-d or 2-d integer tensor, got "
                f"{str(lengths.dtype).removeprefix('torch.')} of shape {shape_str(lengths.shape)}"
            )
        lengths = lengths.tolist()
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise TypeError(
            f"lengths must be a sequence of ints, or one sequence per batch row, got "
            f"{type(lengths).__name__}"
        )
    nested = [isinstance(x, Sequence) and not isinstance(x, (str, bytes)) for x in lengths]
    if lengths and all(nested):
        return [_lengths(f"lengths[{b}]", row) for b, row in enumerate(lengths)]
    return [_lengths("lengths", lengths)]


def _on(t: Tensor, device: torch.device, cache: dict[torch.device, Tensor]) -> Tensor:
    """``t`` on ``device``, copied once per device."""
    if t.device == device:
        return t
    if device not in cache:
        cache[device] = t.to(device)
    return cache[device]


class _Documents(Mask):
    """Packed sequences: query ``i'`` and key ``j`` may attend each other iff they carry the same
    document id. ``ids`` is ``(B|1, Tk)``."""

    def __init__(self, ids: Tensor, what: str) -> None:
        self.ids = ids
        self.what = what
        self._devices: dict[torch.device, Tensor] = {}

    def _describe(self) -> str:
        return f"documents({self.what})"

    def _check(self, geo: _Geometry, name: str) -> None:
        rows, length = self.ids.shape
        if length != geo.kv_len:
            raise ValueError(
                f"{name}: {self._describe()} covers {length} positions but the call has "
                f"Tk = {dim_str(geo.kv_len)} keys"
            )
        if rows not in (1, geo.batch):
            raise ValueError(
                f"{name}: {self._describe()} describes {rows} batch rows but the call has "
                f"B = {geo.batch}"
            )

    def _ids(self, geo: _Geometry) -> Tensor:
        return _on(self.ids, geo.device, self._devices)

    def _runs(self) -> list[list[int]] | None:
        """Per row of ``ids`` the positions where a document starts, then ``Tk``; None when some
        document's positions are not one contiguous run. Computed once (one host read)."""
        if not hasattr(self, "_run_bounds"):
            ids = self.ids
            starts = torch.ones_like(ids, dtype=torch.bool)
            starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
            distinct = [int(torch.unique(r).numel()) for r in ids]
            cuts = [[*r.nonzero().flatten().tolist(), ids.size(1)] for r in starts]
            runs = (
                None if any(len(c) - 1 != n for c, n in zip(cuts, distinct, strict=True)) else cuts
            )
            self._run_bounds: list[list[int]] | None = runs
        return self._run_bounds

    def _q_ids(self, geo: _Geometry, qs: int, qe: int) -> Tensor:
        """``(B|1, qe-qs)`` ids of queries ``qs:qe``; -1 (a document no key has) before key 0."""
        ids = self._ids(geo)
        lo, hi = qs + geo.shift, qe + geo.shift
        out = ids[:, max(lo, 0) : max(hi, 0)]
        if lo < 0:  # more queries than keys: the first ones sit before every key
            out = torch.cat([out.new_full((out.size(0), min(hi, 0) - lo), -1), out], 1)
        return out

    def _tile(self, geo: _Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        qi = self._q_ids(geo, qs, qe).unsqueeze(-1)  # (B|1, rows, 1)
        kj = self._ids(geo)[:, ks:ke].unsqueeze(-2)  # (B|1, 1, keys)
        return ((qi == kj) & (qi >= 0)).unsqueeze(1)  # (B|1, 1, rows, keys)

    def _states(self, geo: _Geometry, q: tuple[int, int, int], k: tuple[int, int, int]) -> Tensor:
        # Per block the range of ids: a block pair is empty when the ranges of its queries and
        # keys are disjoint, full when both hold one and the same id (sound for any ids).
        def ranges(ids: Tensor, start: int, stop: int, block: int) -> tuple[Tensor, Tensor]:
            n = -(-(stop - start) // block)
            # Padding by concatenation: F.pad takes its value as a float, and iinfo.max of int64
            # rounds up to 2**63, which wraps to the smallest int64.
            big = torch.iinfo(ids.dtype).max
            pad = ids.new_full((ids.size(0), n * block - ids.size(1)), big)
            lo = torch.cat([ids, pad], 1).unflatten(1, (n, block))
            hi = torch.cat([ids, pad.neg()], 1).unflatten(1, (n, block))
            return lo.amin(-1), hi.amax(-1)  # (B|1, n)

        (q0, q1, bq), (k0, k1, bk) = q, k
        qmin, qmax = ranges(self._q_ids(geo, q0, q1), q0, q1, bq)
        kmin, kmax = ranges(self._ids(geo)[:, k0:k1], k0, k1, bk)
        qmin, qmax = qmin.unsqueeze(-1), qmax.unsqueeze(-1)
        kmin, kmax = kmin.unsqueeze(-2), kmax.unsqueeze(-2)
        empty = ((qmax < kmin) | (kmax < qmin) | (qmax < 0)).all(0)
        full = ((qmin == qmax) & (kmin == kmax) & (qmin == kmin) & (qmin >= 0)).all(0)
        return _states_from(empty, full).cpu()


def documents(
    lengths: Sequence[int] | Sequence[Sequence[int]] | Tensor | None = None,
    *,
    ids: Int[Tensor, "*#B Tk"] | None = None,
) -> Mask:
    """Packed sequences: a query may attend only the keys of its own document.

    Give either ``lengths``, the document lengths in packing order (one list for every batch row,
    or one list per row; zero-length documents are allowed; they must sum to ``Tk``), or ``ids``,
    an integer document id per key position, ``(Tk,)`` or ``(B, Tk)``. Queries are aligned
    bottom-right: query ``i`` belongs to the document of key position ``i + Tk - Tq``. AND it with
    :func:`causal` for causal packed training. Blocks between documents are never computed.

    >>> documents([2, 0, 3]).dense(5)[0, 0].int()
    tensor([[1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 1, 1],
            [0, 0, 1, 1, 1],
            [0, 0, 1, 1, 1]], dtype=torch.int32)
    >>> (documents(ids=torch.tensor([7, 7, 7, 9, 9])) & causal()).dense(5)[0, 0].int()
    tensor([[1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [0, 0, 0, 1, 1]], dtype=torch.int32)
    """
    if (lengths is None) == (ids is None):
        raise TypeError("documents() takes lengths or ids=, exactly one of them")
    if ids is not None:
        if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.dtype == torch.bool:
            got = f"{ids.dtype}" if isinstance(ids, Tensor) else type(ids).__name__
            raise TypeError(f"ids must be an integer tensor (Tk,) or (B, Tk), got {got}")
        if ids.ndim not in (1, 2):
            raise ValueError(f"ids must be (Tk,) or (B, Tk), got {shape_str(ids.shape)}")
        # Dense ranks keep which positions share a document and free -1 for "before key 0".
        ranks = (
            torch.unique(ids, return_inverse=True)[1]
            .reshape(ids.shape)
            .reshape(1 if ids.ndim == 1 else ids.size(0), ids.size(-1))
        )
        batch = "" if ids.ndim == 1 else f", B={ids.size(0)}"
        return _Documents(ranks.long(), f"ids of Tk={ids.size(-1)}{batch}")
    rows = _document_rows(lengths)
    totals = [sum(row) for row in rows]
    if len(set(totals)) > 1:
        raise ValueError(
            f"documents(): every batch row must cover the same Tk, got row totals {totals}"
        )
    ids2 = torch.stack(
        [
            torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r, dtype=torch.long))
            for r in rows
        ]
    )
    return _Documents(ids2, f"lengths={rows[0] if len(rows) == 1 else rows}")


class _KeyPadding(Mask):
    """Keys ``j`` with ``valid[b, j]`` True may be attended by every query of row ``b``."""

    def __init__(self, lengths: Tensor | None, valid: Tensor | None, side: str) -> None:
        self.lengths, self.valid, self.side = lengths, valid, side
        self._devices: dict[torch.device, Tensor] = {}

    def _describe(self) -> str:
        if self.lengths is not None:
            side = "" if self.side == "right" else ", side='left'"
            return f"key_padding(lengths={self.lengths.tolist()}{side})"
        v = self.valid
        return f"key_padding(valid {shape_str(v.shape) if v is not None else '?'})"

    def _rows_and_len(self) -> tuple[int, int | None]:
        if self.valid is not None:
            return self.valid.size(0), self.valid.size(1)
        return len(self.lengths) if self.lengths is not None else 0, None

    def _check(self, geo: _Geometry, name: str) -> None:
        rows, length = self._rows_and_len()
        if rows not in (1, geo.batch):
            raise ValueError(
                f"{name}: {self._describe()} has {rows} batch rows but the call has B = {geo.batch}"
            )
        if length is not None and length != geo.kv_len:
            raise ValueError(
                f"{name}: {self._describe()} covers {length} keys but the call has "
                f"Tk = {dim_str(geo.kv_len)}"
            )
        if self.lengths is not None and self.lengths.numel():
            longest = int(self.lengths.max())
            if longest > geo.kv_len:
                raise ValueError(
                    f"{name}: {self._describe()} has a length {longest} > Tk = "
                    f"{dim_str(geo.kv_len)}"
                )

    def _keys(self, geo: _Geometry, ks: int, ke: int) -> Tensor:
        """``(B|1, ke-ks)`` bool: which of the keys ``ks:ke`` are real."""
        if self.valid is not None:
            return _on(self.valid, geo.device, self._devices)[:, ks:ke]
        lengths = _on(self.lengths, geo.device, self._devices).unsqueeze(-1)  # type: ignore[arg-type]
        j = torch.arange(ks, ke, device=geo.device)
        return j < lengths if self.side == "right" else j >= geo.kv_len - lengths

    def _tile(self, geo: _Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        return self._keys(geo, ks, ke)[:, None, None, :]

    def _states(self, geo: _Geometry, q: tuple[int, int, int], k: tuple[int, int, int]) -> Tensor:
        k0, k1, bk = k
        anys, alls = _block_reduce(self._keys(geo, k0, k1), k0, k1, bk, 1)
        states = _states_from(~anys.any(0), alls.all(0)).cpu()  # (nk,)
        return states.expand(len(range(*q)), -1)

    @property
    def _keys_only(self) -> bool:
        return True


def key_padding(
    lengths: Sequence[int] | Int[Tensor, " B"] | None = None,
    *,
    valid: Bool[Tensor, "B Tk"] | None = None,
    side: Literal["right", "left"] = "right",
) -> Mask:
    """Padded batches: row ``b`` may attend only its real keys.

    Give ``lengths`` (one per batch row; the real keys come first with ``side="right"``, last with
    ``side="left"``) or ``valid``, a ``(B, Tk)`` bool tensor, True = real key (a Hugging Face
    ``attention_mask.bool()``). A query whose row has no real key gets output 0.

    >>> key_padding([3, 1]).dense(2, 4, batch_size=2)[:, 0, 0].int()
    tensor([[1, 1, 1, 0],
            [1, 0, 0, 0]], dtype=torch.int32)
    >>> key_padding([3, 1], side="left").dense(2, 4, batch_size=2)[:, 0, 0].int()
    tensor([[0, 1, 1, 1],
            [0, 0, 0, 1]], dtype=torch.int32)
    """
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
    if (lengths is None) == (valid is None):
        raise TypeError("key_padding() takes lengths or valid=, exactly one of them")
    if valid is not None:
        if not isinstance(valid, Tensor) or valid.dtype != torch.bool or valid.ndim != 2:
            got = (
                f"{str(valid.dtype).removeprefix('torch.')} of shape {shape_str(valid.shape)}"
                if isinstance(valid, Tensor)
                else type(valid).__name__
            )
            raise TypeError(f"valid must be a (B, Tk) bool tensor, True = real key; got {got}")
        return _KeyPadding(None, valid, side)
    if isinstance(lengths, Tensor):
        if lengths.ndim != 1 or lengths.is_floating_point() or lengths.dtype == torch.bool:
            raise TypeError(
                f"lengths must be a 1-d integer tensor, got {lengths.dtype} of shape "
                f"{shape_str(lengths.shape)}"
            )
        if lengths.numel() and bool((lengths < 0).any()):
            raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
        return _KeyPadding(lengths.long(), None, side)
    lens = _lengths("lengths", lengths)
    return _KeyPadding(torch.tensor(lens, dtype=torch.long), None, side)


# --------------------------------------------------------------------------------------------------
# Any function, dense tensors, and composition


class _FromFn(Mask):
    def __init__(self, fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> None:
        self.fn = fn

    def _describe(self) -> str:
        return f"from_fn({getattr(self.fn, '__name__', type(self.fn).__name__)})"

    def _tile(self, geo: _Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        dev = geo.device
        b = torch.arange(geo.batch, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(geo.heads, device=dev).view(1, -1, 1, 1)
        qi = torch.arange(qs, qe, device=dev).view(1, 1, -1, 1)
        kj = torch.arange(ks, ke, device=dev).view(1, 1, 1, -1)
        out = self.fn(b, h, qi, kj)
        want = (geo.batch, geo.heads, qe - qs, ke - ks)
        if not isinstance(out, Tensor) or out.dtype != torch.bool:
            got = f"{out.dtype}" if isinstance(out, Tensor) else type(out).__name__
            raise TypeError(
                f"mask: {self._describe()} must return a bool tensor (True = may attend), got {got}"
            )
        if out.ndim > 4 or any(
            s not in (1, w) for s, w in zip(reversed(out.shape), reversed(want), strict=False)
        ):
            raise ValueError(
                f"mask: {self._describe()} returned shape {shape_str(out.shape)}, which does not "
                f"broadcast to (B, H, Tq, Tk) = {shape_str(want)} for index tensors b "
                f"{shape_str(b.shape)}, h {shape_str(h.shape)}, q_idx {shape_str(qi.shape)}, "
                f"kv_idx {shape_str(kj.shape)}"
            )
        return out.reshape((1,) * (4 - out.ndim) + tuple(out.shape))


def from_fn(fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> Mask:
    """Any mask, as a function ``fn(b, h, q_idx, kv_idx) -> bool tensor`` (True = may attend).

    ``fn`` is called with broadcastable int64 index tensors shaped ``(B, 1, 1, 1)``, ``(1, H, 1,
    1)``, ``(1, 1, rows, 1)`` and ``(1, 1, 1, keys)`` for a tile of the scores, so it must be
    written with tensor operations (comparisons, ``&``, ``|``, indexing into tensors), as
    FlexAttention's ``mask_mod``. The indices are raw: ``q_idx`` runs ``0..Tq-1`` even when
    ``Tq < Tk``. attnkit evaluates it tile by tile to find the blocks it may skip, and again on the
    partial tiles, so the ``(Tq, Tk)`` mask never exists at once.

    >>> def prefix_lm(b, h, q_idx, kv_idx):     # the first 2 tokens see each other
    ...     return (kv_idx <= q_idx) | (kv_idx < 2)
    >>> from_fn(prefix_lm).dense(4)[0, 0].int()
    tensor([[1, 1, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    if not callable(fn):
        raise TypeError(f"from_fn() takes a function, got {type(fn).__name__}")
    return _FromFn(fn)


class _Dense(Mask):
    """A bool tensor broadcastable to ``(..., H, Tq, Tk)``, seen as ``(B|1, H|1, Tq|1, Tk|1)``."""

    def __init__(self, t: Tensor) -> None:
        self.t = t

    def _describe(self) -> str:
        return f"tensor{shape_str(self.t.shape)}"

    def _as4(self, geo: _Geometry) -> Tensor:
        """``(B|1, H|1, Tq|1, Tk|1)``: the call's batch dims flattened (expanded where needed)."""
        t = self.t
        nb = len(geo.batch_shape)
        t = t.reshape((1,) * max(0, nb + 3 - t.ndim) + tuple(t.shape))
        lead = t.shape[:nb]
        if all(s == 1 for s in lead):
            return t.reshape(1, *t.shape[nb:])
        return t.expand(*geo.batch_shape, *t.shape[nb:]).reshape(geo.batch, *t.shape[nb:])

    def _check(self, geo: _Geometry, name: str) -> None:
        want = (*geo.batch_shape, geo.heads, geo.q_len, geo.kv_len)
        ok = self.t.ndim <= len(want) and all(
            s in (1, w) for s, w in zip(reversed(self.t.shape), reversed(want), strict=False)
        )
        if not ok:
            raise ValueError(
                f"{name} of shape {shape_str(self.t.shape)} does not broadcast to "
                f"(..., H, Tq, Tk) = {shape_str(want)}"
            )

    def _tile(self, geo: _Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        t = self._as4(geo)
        if t.size(-2) != 1:
            t = t[..., qs:qe, :]
        if t.size(-1) != 1:
            t = t[..., ks:ke]
        return t

    def _states(self, geo: _Geometry, q: tuple[int, int, int], k: tuple[int, int, int]) -> Tensor:
        (q0, q1, bq), (k0, k1, bk) = q, k
        t = self._tile(geo, q0, q1, k0, k1).flatten(0, 1)  # (BH|1, rows|1, keys|1)
        any_rows, _ = _block_reduce(t.any(0), q0, q1, bq, 0)
        _, all_rows = _block_reduce(t.all(0), q0, q1, bq, 0)
        anys, _ = _block_reduce(any_rows, k0, k1, bk, 1)
        _, alls = _block_reduce(all_rows, k0, k1, bk, 1)
        return _states_from(~anys, alls).cpu()

    @property
    def _keys_only(self) -> bool:
        return self.t.ndim < 2 or self.t.size(-2) == 1


class _Combined(Mask):
    """``&`` (all parts) or ``|`` (any part) of several masks."""

    def __init__(self, op: str, parts: tuple[Mask, ...]) -> None:
        self.op, self.parts = op, parts

    def _describe(self) -> str:
        sep = " & " if self.op == "and" else " | "
        return sep.join(
            f"({p._describe()})" if isinstance(p, _Combined) else p._describe() for p in self.parts
        )

    def _check(self, geo: _Geometry, name: str) -> None:
        for p in self.parts:
            p._check(geo, name)

    def _tile(self, geo: _Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        out = self.parts[0]._tile(geo, qs, qe, ks, ke)
        for p in self.parts[1:]:
            t = p._tile(geo, qs, qe, ks, ke)
            out = out & t if self.op == "and" else out | t
        return out

    def _states(self, geo: _Geometry, q: tuple[int, int, int], k: tuple[int, int, int]) -> Tensor:
        # EMPTY < PARTIAL < FULL: an AND is as visible as its least visible part, an OR as its most.
        # (A PARTIAL answer is always safe: the tile then decides.)
        states = [p._states(geo, q, k) for p in self.parts]
        out = states[0]
        for s in states[1:]:
            out = torch.minimum(out, s) if self.op == "and" else torch.maximum(out, s)
        return out

    def _rows(self, geo: _Geometry, qs: int, qe: int, ks: int, ke: int) -> tuple[int, int]:
        spans = [p._rows(geo, qs, qe, ks, ke) for p in self.parts]
        if self.op == "and":
            r0, r1 = max(s[0] for s in spans), min(s[1] for s in spans)
            return r0, max(r0, r1)
        return min(s[0] for s in spans), max(s[1] for s in spans)

    def _distances(self, geo: _Geometry) -> tuple[float, float]:
        spans = [p._distances(geo) for p in self.parts]
        if self.op == "and":
            return max(s[0] for s in spans), min(s[1] for s in spans)
        return min(s[0] for s in spans), max(s[1] for s in spans)

    @property
    def _keys_only(self) -> bool:
        return all(p._keys_only for p in self.parts)

    @property
    def _parts(self) -> tuple[Mask, ...]:
        return self.parts


def _as_mask(x: object, side: str) -> Mask:
    if isinstance(x, Mask):
        return x
    if isinstance(x, Tensor) and x.dtype == torch.bool:
        return _Dense(x)
    got = f"a {str(x.dtype).removeprefix('torch.')} tensor" if isinstance(x, Tensor) else repr(x)
    raise TypeError(
        f"a mask combines with masks and bool tensors (True = may attend); the {side} operand is "
        f"{got}"
    )


def _combine(op: str, a: object, b: object) -> Mask:
    ma, mb = _as_mask(a, "left"), _as_mask(b, "right")
    parts: list[Mask] = []
    for m in (ma, mb):
        parts += m.parts if isinstance(m, _Combined) and m.op == op else [m]
    return _Combined(op, tuple(parts))


def _visibility(mask: Tensor | Mask | None, causal_flag: bool) -> Mask | None:
    """A call's ``mask`` and ``causal`` as one mask (None: every pair may attend)."""
    m = None if mask is None else _as_mask(mask, "given")
    if not causal_flag:
        return m
    return _Causal("bottom_right") if m is None else _Causal("bottom_right") & m


# --------------------------------------------------------------------------------------------------
# Dense helpers (bool tensors)


def _lengths(name: str, lengths: object) -> list[int]:
    """A sequence of ints >= 0, each checked; a lone int is a TypeError naming ``name``."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(lengths).__name__}")
    return [check_int(f"{name}[]", n, minimum=0) for n in lengths]


def _offsets(q_len: int, kv_len: int | None, device: torch.device | str | None) -> Tensor:
    """``d[i, j] = j - (i + Tk - Tq)``: a key's distance ahead of its bottom-right-aligned query."""
    q_len = check_int("q_len", q_len, minimum=0)
    kv_len = q_len if kv_len is None else check_int("kv_len", kv_len, minimum=0)
    i = torch.arange(q_len, device=device).unsqueeze(-1)
    j = torch.arange(kv_len, device=device)
    return j - (i + kv_len - q_len)


@shape_checked
def causal_mask(
    q_len: int, kv_len: int | None = None, *, device: torch.device | str | None = None
) -> Bool[Tensor, "Tq Tk"]:
    """Dense causal mask aligned bottom-right: query ``i`` may attend key ``j`` iff
    ``j <= i + Tk - Tq`` (:func:`causal` without the ``(Tq, Tk)`` tensor).

    ``kv_len`` defaults to ``q_len``. With ``Tq < Tk`` (new tokens after a cache) the last query
    sees every key; with ``Tq > Tk`` the first ``Tq - Tk`` queries see nothing (and attend to
    zeros).

    >>> causal_mask(3).int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
    >>> causal_mask(3, 5).int()  # 3 new queries after 2 cached keys
    tensor([[1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1]], dtype=torch.int32)
    >>> causal_mask(4, 2).int()  # more queries than keys: the first two rows are empty
    tensor([[0, 0],
            [0, 0],
            [1, 0],
            [1, 1]], dtype=torch.int32)
    """
    return _offsets(q_len, kv_len, device) <= 0


@shape_checked
def sliding_window_mask(
    q_len: int,
    kv_len: int | None = None,
    *,
    left: int,
    right: int = 0,
    device: torch.device | str | None = None,
) -> Bool[Tensor, "Tq Tk"]:
    """Dense local attention: query ``i`` (at key position ``p = i + Tk - Tq``) may attend keys
    ``p - left <= j <= p + right`` (:func:`sliding_window` without the ``(Tq, Tk)`` tensor).

    ``right=0`` (the default) is causal local attention with a window of ``left + 1`` keys.

    >>> sliding_window_mask(5, left=2).int()
    tensor([[1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [0, 1, 1, 1, 0],
            [0, 0, 1, 1, 1]], dtype=torch.int32)
    >>> sliding_window_mask(3, 5, left=1, right=1).int()
    tensor([[0, 1, 1, 1, 0],
            [0, 0, 1, 1, 1],
            [0, 0, 0, 1, 1]], dtype=torch.int32)
    """
    left = check_int("left", left, minimum=0)
    right = check_int("right", right, minimum=0)
    d = _offsets(q_len, kv_len, device)
    return (d >= -left) & (d <= right)


@shape_checked
def padding_mask(
    lengths: Int[Tensor, " B"] | Sequence[int],
    max_len: int | None = None,
    *,
    side: str = "right",
) -> Bool[Tensor, "B 1 1 T"]:
    """Dense key padding mask from sequence lengths, shaped ``(B, 1, 1, T)`` to broadcast over
    heads and queries. True marks the real tokens (:func:`key_padding` is the structured form).

    ``side="right"`` means the padding follows the tokens, ``side="left"`` that it precedes them.
    ``max_len`` defaults to the longest length.

    >>> padding_mask([3, 1, 4])[:, 0, 0].int()
    tensor([[1, 1, 1, 0],
            [1, 0, 0, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    >>> padding_mask([3, 1], max_len=5, side="left")[:, 0, 0].int()
    tensor([[0, 0, 1, 1, 1],
            [0, 0, 0, 0, 1]], dtype=torch.int32)
    """
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
    if isinstance(lengths, Tensor):
        if lengths.ndim != 1 or lengths.is_floating_point() or lengths.dtype == torch.bool:
            raise TypeError(
                f"lengths must be a 1-d integer tensor, got {lengths.dtype} of shape "
                f"{tuple(lengths.shape)}"
            )
        lens = lengths
    else:
        lens = torch.as_tensor(_lengths("lengths", lengths), dtype=torch.long)
    if lens.numel() and bool((lens < 0).any()):
        raise ValueError(f"lengths must be >= 0, got {lens.tolist()}")
    longest = int(lens.max()) if lens.numel() else 0
    if max_len is None:
        max_len = longest
    elif check_int("max_len", max_len, minimum=0) < longest:
        raise ValueError(f"max_len ({max_len}) is shorter than the longest length ({longest})")
    pos = torch.arange(max_len, device=lens.device)
    if side == "left":
        pos = pos.flip(0)
    return (pos < lens.unsqueeze(-1))[:, None, None, :]


@shape_checked
def block_diagonal_mask(
    q_lens: Sequence[int],
    kv_lens: Sequence[int] | None = None,
    *,
    device: torch.device | str | None = None,
) -> Bool[Tensor, "Tq Tk"]:
    """Dense mask for packed sequences: the queries of segment ``s`` may attend only the keys of
    segment ``s`` (:func:`documents` is the structured form). ``kv_lens`` defaults to ``q_lens``;
    both list the segment lengths in packing order.

    For causal packed sequences, AND it with :func:`causal_mask` (with equal query and key
    segments, the global causal mask is causal within every block).

    >>> block_diagonal_mask([2, 3]).int()
    tensor([[1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 1, 1],
            [0, 0, 1, 1, 1],
            [0, 0, 1, 1, 1]], dtype=torch.int32)
    >>> combine_masks(block_diagonal_mask([2, 3]), causal_mask(5)).int()
    tensor([[1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1]], dtype=torch.int32)
    """
    q_lens = _lengths("q_lens", q_lens)
    kv_lens = q_lens if kv_lens is None else _lengths("kv_lens", kv_lens)
    if len(q_lens) != len(kv_lens):
        raise ValueError(
            f"q_lens and kv_lens must list as many segments, got {len(q_lens)} and {len(kv_lens)}"
        )
    segments = torch.arange(len(q_lens), device=device)
    q_seg = segments.repeat_interleave(torch.as_tensor(q_lens, dtype=torch.long, device=device))
    kv_seg = segments.repeat_interleave(torch.as_tensor(kv_lens, dtype=torch.long, device=device))
    return q_seg.unsqueeze(-1) == kv_seg


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """AND dense bool masks together, broadcasting; ``None`` (no mask) is skipped.

    Returns ``None`` when every argument is ``None``. (Structured masks combine with ``&``.)

    >>> combine_masks(causal_mask(3), None, padding_mask([2, 3])).int()[:, 0]
    tensor([[[1, 0, 0],
             [1, 1, 0],
             [1, 1, 0]],
    <BLANKLINE>
            [[1, 0, 0],
             [1, 1, 0],
             [1, 1, 1]]], dtype=torch.int32)
    """
    out: Tensor | None = None
    for i, m in enumerate(masks):
        if m is None:
            continue
        if not isinstance(m, Tensor) or m.dtype != torch.bool:
            got = m.dtype if isinstance(m, Tensor) else type(m).__name__
            raise TypeError(f"combine_masks() takes bool tensors or None; argument {i} is {got}")
        if out is None:
            out = m
            continue
        try:
            torch.broadcast_shapes(out.shape, m.shape)
        except RuntimeError:
            raise ValueError(
                f"combine_masks(): argument {i} of shape {tuple(m.shape)} does not broadcast with "
                f"the masks before it, of shape {tuple(out.shape)}"
            ) from None
        out = out & m
    return out
