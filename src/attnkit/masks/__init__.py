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
import operator
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .._base.checks import (
    INT_MAX,
    check_broadcastable,
    check_int,
    check_lengths,
    dim_str,
    dtype_str,
    one_or,
    shape_str,
    spec_read,
    spec_text,
)
from .._base.hints import padding_mask_hint
from .._base.shapes import Bool, Int
from ._blocks import (
    EMPTY,
    FULL,
    PARTIAL,
    Geometry,
    band_visibility,
    block_edges,
    block_reduce,
    states_from,
)
from ._dense import (
    block_diagonal_mask,
    causal_mask,
    combine_masks,
    padding_mask,
    sliding_window_mask,
)

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "Geometry",
    "KeyIndices",
    "Mask",
    "band_visibility",
    "block_diagonal_mask",
    "block_indices",
    "causal",
    "causal_mask",
    "check_mask",
    "combine_masks",
    "documents",
    "first_entries",
    "from_fn",
    "from_tensor",
    "key_indices",
    "key_padding",
    "padding_mask",
    "sliding_window",
    "sliding_window_mask",
    "visibility",
]


class Mask:
    """A structured mask: which (query, key) pairs may attend, described without a ``(Tq, Tk)``
    matrix. Build one with :func:`causal`, :func:`sliding_window`, :func:`documents`,
    :func:`key_padding` or :func:`from_fn`; combine with ``&`` and ``|`` (bool tensors work on
    either side). Pass it as ``mask=`` to :func:`attnkit.attention` or to any attnkit module.

    **The mask protocol.** What a backend may ask of a mask, each question about a call described
    by a :class:`Geometry` (positions are the call's, bottom-right aligned where that matters):

    * :meth:`tile` (required): the bool visibility of a rectangle of the scores;
    * :meth:`block_states`: ``EMPTY``/``PARTIAL``/``FULL`` for a grid of blocks (the default asks
      :meth:`tile`, tile by tile; masks with structure answer from it);
    * :meth:`visible_rows`, :meth:`distances`, :attr:`keys_only`, :meth:`key_tile`: bounds that
      let a kernel skip work (the defaults bound nothing);
    * :attr:`band`, :meth:`document_starts`, :attr:`tensor`, :attr:`parts` and :attr:`op`: what
      the mask is, for backends that serve some kinds natively (torch's ``is_causal``, one call
      per document);
    * :meth:`check` and :meth:`describe`: validation and the one-line description.

    A subclass implements :meth:`tile` and :meth:`describe`, and may answer the others; every
    backend then serves it. Answers must be sound: a block said ``EMPTY`` must have no visible
    pair, one said ``FULL`` no hidden pair (``PARTIAL`` is always safe).
    """

    #: Attributes holding what calls made of the mask's tensors (copies on other devices, sorted
    #: selections): a copy or a pickle of the mask starts them empty, so a mask used on a GPU
    #: and saved loads where that device is absent, and a copy never shares them.
    _MADE_BY_CALLS: tuple[str, ...] = ("_devices", "_kept")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self._MADE_BY_CALLS:
            if name in state:
                state[name] = {}
        return state

    def __and__(self, other: object) -> Mask:
        return _combine("and", self, other)

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Iterable[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """``mask & tensor`` and ``tensor | mask`` as masks: torch.compile takes a binary operator
        with a tensor operand for a tensor operation, and asks the other operand's
        ``__torch_function__`` before it puts one in the graph. Any other torch function is not
        for a mask (NotImplemented: a ``TypeError``, as without this hook)."""
        op = _TORCH_BINARY_OPS.get(func)
        if op is None or kwargs or len(args) != 2:
            return NotImplemented
        return _combine(op, *args)

    def __rand__(self, other: object) -> Mask:
        return _combine("and", other, self)

    def __or__(self, other: object) -> Mask:
        return _combine("or", self, other)

    def __ror__(self, other: object) -> Mask:
        return _combine("or", other, self)

    def __invert__(self) -> Mask:
        # Python's own message would name the private class (bad operand type for unary ~).
        raise TypeError(
            f"~{self.describe()}: attnkit masks cannot be negated (the complement of a mask "
            "that says which keys exist, such as key_padding, would attend the padding). Say "
            "what may attend instead: another mask (causal() & ..., sliding_window(...)), "
            "from_fn(lambda b, h, q_idx, kv_idx: ...) written with ~, & and |, or the dense "
            "tensor ~mask.dense(Tq, Tk)"
        )

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
        geo = Geometry(
            (check_int("batch_size", batch_size),),
            check_int("num_heads", num_heads),
            q_len,
            kv_len,
            torch.device("cpu") if device is None else torch.device(device),
        )
        rows = _batch_rows(self)
        if batch_size == 1 and rows is not None and rows > 1:
            raise ValueError(
                f"dense(): {self.describe()} has {rows} batch rows, and dense() writes "
                f"batch_size=1 unless told: pass batch_size={rows}"
            )
        self.check(geo, "mask")
        return self.tile(geo, 0, q_len, 0, kv_len).expand(-1, -1, q_len, kv_len)

    def __repr__(self) -> str:
        return self.describe()

    # ----------------------------------------------------------------------------------------------
    # The protocol

    def describe(self) -> str:
        """One line that names the mask, as ``repr()`` prints it. Reads no tensor data."""
        return type(self).__name__

    def check(self, geo: Geometry, name: str) -> None:
        """Raise ``ValueError``/``TypeError`` naming ``name`` if the mask does not fit the call."""

    def tile(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        """Bool ``(B|1, H|1, qe-qs|1, ke-ks|1)`` on ``geo.device``: may queries ``qs:qe`` attend
        keys ``ks:ke`` (True = may attend)."""
        raise NotImplementedError(f"{type(self).__name__} must implement Mask.tile()")

    def block_states(
        self, geo: Geometry, q: tuple[int, int, int], k: tuple[int, int, int]
    ) -> Tensor:
        """uint8 ``(nq, nk)``: ``EMPTY``, ``PARTIAL`` or ``FULL`` for each block of the grid.

        ``q = (start, stop, block)`` cuts the queries ``[start, stop)`` into blocks of ``block``
        rows; ``k`` likewise the keys. The default evaluates the whole grid tile by tile; masks
        with structure answer from it. The answer may stay on ``geo.device``: the caller reads it
        once per plan.
        """
        return _states_by_tiles(self, geo, q, k)

    def visible_rows(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> tuple[int, int]:
        """Rows ``r0:r1`` (relative to ``qs``) outside which no query of ``qs:qe`` sees a key of
        ``ks:ke``. Masks that cannot tell cheaply answer all rows."""
        return 0, qe - qs

    def distances(self, geo: Geometry) -> tuple[float, float]:
        """Bounds on ``j - i'`` (key position minus the query's bottom-right position) over every
        visible pair; infinite where the mask does not bound it."""
        return -math.inf, math.inf

    @property
    def keys_only(self) -> bool:
        """True when visibility depends on the key (and batch row) only, never on the query."""
        return False

    @property
    def positional(self) -> bool:
        """True when visibility is a function of the positions alone (no tensor of the call's
        lengths): it can then be evaluated at any positions, e.g. a shard's global ones."""
        return False

    def key_tile(self, geo: Geometry, ks: int, ke: int) -> Tensor:
        """Bool ``(B|1, ke-ks)``: which keys ``ks:ke`` are visible, for a :attr:`keys_only` mask
        (every head and query sees the same keys)."""
        if not self.keys_only:
            raise ValueError(f"{self.describe()} depends on the query: it has no key tile")
        t = self.tile(geo, 0, min(1, geo.q_len), ks, ke)
        return t.any(1).any(1) if t.size(-2) else t[:, 0, 0]

    @property
    def band(self) -> tuple[float, float, str] | None:
        """``(lo, hi, align)`` when the mask is exactly a band around the diagonal: query ``i``
        may attend key ``j`` iff ``lo <= j - (i + offset) <= hi`` with ``offset = Tk - Tq``
        (``align="bottom_right"``) or 0 (``"top_left"``). :func:`causal` is ``(-inf, 0)``."""
        return None

    def document_starts(self) -> list[list[int]] | None:
        """For packed documents whose positions are contiguous runs: per batch row (one row when
        all rows share them) the positions where a document starts, then ``Tk``. None for any
        other mask."""
        return None

    @property
    def tensor(self) -> Tensor | None:
        """The bool tensor a dense mask wraps, as given; None for structured masks."""
        return None

    @property
    def op(self) -> str | None:
        """``"and"`` or ``"or"`` for a combination of masks (see :attr:`parts`), else None."""
        return None

    @property
    def parts(self) -> tuple[Mask, ...]:
        """The masks a combination joins with :attr:`op`; ``(self,)`` for any other mask."""
        return (self,)

    @property
    def plan_key(self) -> Hashable | None:
        """What the mask hides, as a hashable value, or None (the default). Calls on one geometry
        whose masks have equal keys share one block plan, made by the first of them, instead of
        asking the mask again on every call (at T = 65536 a sliding window's plan takes longer
        to make than 10% of its attention). Equal keys must mean equal answers to every question
        above, for every geometry. attnkit's masks name their numbers by value (two
        ``causal()`` share a plan) and their tensors by identity and version, never by reading
        them: an in-place write, which advances ``tensor._version``, makes a new plan. A mask
        of a function has no key (the function may change what it returns), nor has a dense
        tensor (a kept plan would keep it alive)."""
        return None


def _tensor_key(t: Tensor | None) -> Hashable | None:
    """A tensor's identity and version, for :attr:`Mask.plan_key` ("none" for no tensor; None
    where the tensor has no version counter: one made under ``torch.inference_mode``)."""
    if t is None:
        return "none"
    try:
        return (id(t), t._version)
    except RuntimeError:
        return None


def _keys_of(*keys: Hashable | None) -> tuple[Hashable, ...] | None:
    return None if any(k is None for k in keys) else keys


def _states_by_tiles(
    mask: Mask, geo: Geometry, q: tuple[int, int, int], k: tuple[int, int, int]
) -> Tensor:
    """Block states from the mask's own tiles, one query block at a time and in strips of keys, so
    the evaluation holds about 4M elements at most whatever ``Tq`` and ``Tk`` are. The states stay
    on the mask's device until the caller reads them."""
    (q0, q1, bq), (k0, k1, bk) = q, k
    width = max(1, (1 << 22) // max(1, geo.batch * geo.heads * bq) // bk) * bk
    rows = []
    for qs in range(q0, q1, bq):
        qe = min(qs + bq, q1)
        strips = []
        for ks in range(k0, k1, width):
            ke = min(ks + width, k1)
            t = mask.tile(geo, qs, qe, ks, ke).flatten(0, 2)  # (B*H*rows | 1, keys | 1)
            anys, _ = block_reduce(t.any(0, keepdim=True), ks, ke, bk, 1)
            _, alls = block_reduce(t.all(0, keepdim=True), ks, ke, bk, 1)
            strips.append(states_from(~anys[0], alls[0]))
        rows.append(torch.cat(strips) if strips else torch.zeros(0, dtype=torch.uint8))
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

    def _offset(self, geo: Geometry) -> int:
        return geo.shift if self.align == "bottom_right" else 0

    def tile(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        i = torch.arange(qs, qe, device=geo.device).unsqueeze(-1) + self._offset(geo)
        j = torch.arange(ks, ke, device=geo.device)
        return band_visibility(i, j, self.lo, self.hi)[None, None]

    @property
    def band(self) -> tuple[float, float, str]:
        return self.lo, self.hi, self.align

    @property
    def plan_key(self) -> Hashable:
        return ("band", self.lo, self.hi, self.align)

    @property
    def positional(self) -> bool:
        return True

    def block_states(
        self, geo: Geometry, q: tuple[int, int, int], k: tuple[int, int, int]
    ) -> Tensor:
        qf, ql = block_edges(*q, device=geo.device)
        kf, kl = block_edges(*k, device=geo.device)
        off = self._offset(geo)
        qf, ql = qf.unsqueeze(-1) + off, ql.unsqueeze(-1) + off
        # j - i' over the block runs from kf - ql (its minimum) to kl - qf (its maximum).
        dmin, dmax = kf - ql, kl - qf
        empty = (dmax < self.lo) | (dmin > self.hi)
        full = (dmin >= self.lo) & (dmax <= self.hi)
        return states_from(empty, full)

    def visible_rows(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> tuple[int, int]:
        off = self._offset(geo)
        # Row i sees some key of ks:ke iff ks - hi <= i' and i' <= ke - 1 - lo.
        rows = qe - qs
        r0 = 0 if self.hi == math.inf else min(rows, max(0, int(ks - self.hi) - off - qs))
        r1 = rows if self.lo == -math.inf else min(rows, int(ke - 1 - self.lo) - off - qs + 1)
        return r0, max(r0, r1)

    def distances(self, geo: Geometry) -> tuple[float, float]:
        shift = self._offset(geo) - geo.shift  # top-left: i + 0 = i' - (Tk - Tq)
        return self.lo + shift, self.hi + shift


class _Causal(_Band):
    def __init__(self, align: str) -> None:
        super().__init__(-math.inf, 0, align)

    def describe(self) -> str:
        return "causal()" if self.align == "bottom_right" else "causal(align='top_left')"


class _Window(_Band):
    def __init__(self, left: int, right: int) -> None:
        super().__init__(-left, right, "bottom_right")
        self.left, self.right = left, right

    def describe(self) -> str:
        return f"sliding_window(left={dim_str(self.left)}, right={dim_str(self.right)})"


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
    ``left`` and ``right`` both > 0 is the limited context of streaming speech encoders. Either
    bound may be negative, for a band that leaves out the diagonal (``right=-1``: strictly earlier
    keys, as flash-attn 4's negative window bounds); a band with no key (``left + right < 0``) is
    refused. Blocks outside the band are never computed, so time grows linearly with ``T`` and
    memory does not.

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
    >>> sliding_window(2, right=-1).dense(4)[0, 0].int()     # the two keys before the diagonal
    tensor([[0, 0, 0, 0],
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [0, 1, 1, 0]], dtype=torch.int32)
    """
    # Either bound may be negative (a band that leaves out the diagonal), and a reach past every
    # sequence is unbounded: it saturates. Only a band without a single key is an error.
    left = check_int("left", left, minimum=-INT_MAX, saturate=True)
    right = check_int("right", right, minimum=-INT_MAX, saturate=True)
    if left + right < 0:
        raise ValueError(
            f"sliding_window(left={left}, right={right}) holds no key: the band runs from "
            f"{-left} to {right} keys from the diagonal (left + right must be >= 0)"
        )
    return _Window(left, right)


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
        rows = [
            (f"lengths[{b}]", check_lengths(f"lengths[{b}]", row)) for b, row in enumerate(lengths)
        ]
    else:
        rows = [("lengths", check_lengths("lengths", lengths))]
    for name, row in rows:  # a row's documents end at the sum of their lengths: an int64 too
        if sum(row) > INT_MAX:
            raise ValueError(f"{name} must sum to at most 2**63 - 1 = {INT_MAX}, got {sum(row)}")
    return [row for _, row in rows]


def _on(t: Tensor, device: torch.device, cache: dict[torch.device, Tensor]) -> Tensor:
    """``t`` on ``device``, copied once per device."""
    if t.device == device:
        return t
    if device not in cache:
        cache[device] = t.to(device)
    return cache[device]


def _check_not_meta(t: Tensor | None, geo: Geometry, name: str, what: str) -> None:
    """Refuse a mask tensor on the meta device in a call that is not: it has no values to read
    (a call on meta tensors only propagates shapes, and takes it)."""
    if t is not None and t.device.type == "meta" and geo.device.type != "meta":
        raise ValueError(
            f"{name}: {what} is on the meta device, which holds no values, but the call's "
            f"tensors are on {geo.device}: make the mask from a tensor on a real device"
        )


class _Documents(Mask):
    """Packed sequences: query ``i'`` and key ``j`` may attend each other iff they carry the same
    document id. ``ids`` is ``(B|1, Tk)``."""

    def __init__(self, ids: Tensor, what: str) -> None:
        self.ids = ids
        self.what = what
        self._devices: dict[torch.device, Tensor] = {}

    def describe(self) -> str:
        return f"documents({self.what})"

    @property
    def plan_key(self) -> Hashable | None:
        return _keys_of("documents", _tensor_key(self.ids))

    def check(self, geo: Geometry, name: str) -> None:
        _check_not_meta(self.ids, geo, name, self.describe())
        rows, length = self.ids.shape
        if length != geo.kv_len:
            raise ValueError(
                f"{name}: {self.describe()} covers {length} positions but the call has "
                f"Tk = {dim_str(geo.kv_len)} keys"
            )
        if not one_or(rows, geo.batch):
            raise ValueError(
                f"{name}: {self.describe()} describes {rows} batch rows but the call has "
                f"B = {geo.batch}"
            )

    def _ids(self, geo: Geometry) -> Tensor:
        return _on(self.ids, geo.device, self._devices)

    def document_starts(self) -> list[list[int]] | None:
        """Per row of ``ids`` the positions where a document starts, then ``Tk``; None when some
        document's positions are not one contiguous run. Computed once (one host read); None
        while torch.compile traces, where the ids are data (the operator asks when it runs)."""
        unread = torch.compiler.is_compiling() or self.ids.device.type == "meta"
        if unread and not hasattr(self, "_run_bounds"):
            return None
        if not hasattr(self, "_run_bounds"):
            ids = self.ids
            starts = torch.ones_like(ids, dtype=torch.bool)
            starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
            distinct = [int(torch.unique(r).numel()) for r in ids]
            cuts = [[*r.nonzero().flatten().tolist(), ids.size(1)] for r in starts]
            # no rows (an empty batch): nothing to describe, and a reader takes starts[0]
            runs = (
                None
                if not cuts or any(len(c) - 1 != n for c, n in zip(cuts, distinct, strict=True))
                else cuts
            )
            self._run_bounds: list[list[int]] | None = runs
        return self._run_bounds

    def _q_ids(self, geo: Geometry, qs: int, qe: int) -> Tensor:
        """``(B|1, qe-qs)`` ids of queries ``qs:qe``; -1 (a document no key has) before key 0."""
        ids = self._ids(geo)
        lo, hi = qs + geo.shift, qe + geo.shift
        out = ids[:, max(lo, 0) : max(hi, 0)]
        if lo < 0:  # more queries than keys: the first ones sit before every key
            out = torch.cat([out.new_full((out.size(0), min(hi, 0) - lo), -1), out], 1)
        return out

    def tile(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        qi = self._q_ids(geo, qs, qe).unsqueeze(-1)  # (B|1, rows, 1)
        kj = self._ids(geo)[:, ks:ke].unsqueeze(-2)  # (B|1, 1, keys)
        return ((qi == kj) & (qi >= 0)).unsqueeze(1)  # (B|1, 1, rows, keys)

    def block_states(
        self, geo: Geometry, q: tuple[int, int, int], k: tuple[int, int, int]
    ) -> Tensor:
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
        return states_from(empty, full)


class _TracedDocuments(_Documents):
    """:func:`documents` of a lengths tensor built while torch.compile traces, where the lengths
    are data: the ids come from the lengths at the call's ``Tk`` (no host read, a static shape),
    and the lengths are checked when attnkit's operator runs (its mask is rebuilt there by
    :func:`documents`, which reads them)."""

    def __init__(self, lengths: Tensor) -> None:
        super().__init__(lengths, f"lengths {shape_str(lengths.shape)}")
        self.lengths = lengths  # (B|1, n)

    @property
    def plan_key(self) -> Hashable | None:
        return _keys_of("document_lengths", _tensor_key(self.lengths))

    def check(self, geo: Geometry, name: str) -> None:
        _check_not_meta(self.lengths, geo, name, self.describe())
        if not one_or(self.lengths.size(0), geo.batch):
            raise ValueError(
                f"{name}: {self.describe()} describes {self.lengths.size(0)} batch rows but the "
                f"call has B = {dim_str(geo.batch)}"
            )

    def _ids(self, geo: Geometry) -> Tensor:
        # Key j belongs to the first document whose end lies past it.
        ends = _on(self.lengths, geo.device, self._devices).cumsum(1)  # (B|1, n)
        j = torch.arange(geo.kv_len, device=geo.device).expand(ends.size(0), -1).contiguous()
        return torch.searchsorted(ends, j, right=True)  # (B|1, Tk)

    def document_starts(self) -> list[list[int]] | None:
        return None


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
        # (on meta there are no values to rank: the ids stand for their ranks; while
        # torch.compile traces, unique's output shape is data and breaks the graph: the ids less
        # their smallest keep the documents apart and free -1 too)
        if ids.device.type == "meta":
            ranks = ids
        elif torch.compiler.is_compiling():
            ranks = ids.long() - ids.long().flatten().amin(0) if ids.numel() else ids
        else:
            ranks = torch.unique(ids, return_inverse=True)[1]
        ranks = ranks.reshape(1 if ids.ndim == 1 else ids.size(0), ids.size(-1))
        batch = "" if ids.ndim == 1 else f", B={dim_str(ids.size(0))}"
        return _Documents(ranks.long(), f"ids of Tk={dim_str(ids.size(-1))}{batch}")
    if isinstance(lengths, Tensor) and (
        torch.compiler.is_compiling() or lengths.device.type == "meta"
    ):
        _document_rows(torch.empty([0] * lengths.ndim, dtype=lengths.dtype))  # dtype, dimensions
        return _TracedDocuments(lengths.long().reshape(-1, lengths.size(-1)))
    rows = _document_rows(lengths)
    totals = [sum(row) for row in rows]
    if len(set(totals)) > 1:
        raise ValueError(
            f"documents(): every batch row must cover the same Tk, got row totals {totals}"
        )
    # output_size: the length is known here, and torch.compile then traces a static shape.
    ids2 = torch.stack(
        [
            torch.repeat_interleave(
                torch.arange(len(r)), torch.tensor(r, dtype=torch.long), output_size=totals[0]
            )
            for r in rows
        ]
    )
    if torch.compiler.is_compiling():  # lengths may be symbolic sizes there: no values in text
        return _Documents(ids2, f"lengths of {len(rows[0])} documents")
    return _Documents(ids2, f"lengths={rows[0] if len(rows) == 1 else rows}")


class _KeyPadding(Mask):
    """Keys ``j`` with ``valid[b, j]`` True may be attended by every query of row ``b``."""

    def __init__(self, lengths: Tensor | None, valid: Tensor | None, side: str) -> None:
        self.lengths, self.valid, self.side = lengths, valid, side
        self._devices: dict[torch.device, Tensor] = {}
        self._read: list[int] | None = None

    def _lengths_read(self) -> list[int]:
        """The lengths as ints, read back once: every call describes and checks the mask."""
        if self._read is None:
            self._read = [] if self.lengths is None else self.lengths.tolist()
        return self._read

    def describe(self) -> str:
        if self.lengths is not None:
            side = "" if self.side == "right" else ", side='left'"
            # The values are data while torch.compile traces (no host read), and none on meta.
            if torch.compiler.is_compiling() or self.lengths.device.type == "meta":
                return f"key_padding(lengths {shape_str(self.lengths.shape)}{side})"
            return f"key_padding(lengths={self._lengths_read()}{side})"
        v = self.valid
        return f"key_padding(valid {shape_str(v.shape) if v is not None else '?'})"

    @property
    def plan_key(self) -> Hashable | None:
        return _keys_of(
            "key_padding", _tensor_key(self.lengths), _tensor_key(self.valid), self.side
        )

    def _rows_and_len(self) -> tuple[int, int | None]:
        if self.valid is not None:
            return self.valid.size(0), self.valid.size(1)
        return len(self.lengths) if self.lengths is not None else 0, None

    def check(self, geo: Geometry, name: str) -> None:
        _check_not_meta(self.lengths, geo, name, self.describe())
        _check_not_meta(self.valid, geo, name, self.describe())
        rows, length = self._rows_and_len()
        if not one_or(rows, geo.batch):
            raise ValueError(
                f"{name}: {self.describe()} has {rows} batch rows but the call has B = {geo.batch}"
            )
        if length is not None and length != geo.kv_len:
            raise ValueError(
                f"{name}: {self.describe()} covers {length} keys but the call has "
                f"Tk = {dim_str(geo.kv_len)}"
            )
        # The lengths' values are data: while torch.compile traces, attnkit's operator checks
        # them when it runs, and on the CPU the graph checks them for the backends that run in it
        # (on an accelerator such an assertion would be a device-side one, which ends the
        # process's use of the device: there, a length outside [0, Tk] acts as 0 or Tk).
        if self.lengths is not None and torch.compiler.is_compiling():
            if self.lengths.device.type == "cpu":
                fits = ((self.lengths >= 0) & (self.lengths <= geo.kv_len)).all()
                torch._assert_async(fits, f"{name}: key_padding lengths must lie in [0, Tk]")
            return
        if self.lengths is not None and self.lengths.numel() and self.lengths.device.type != "meta":
            read = self._lengths_read()
            if min(read) < 0:
                raise ValueError(f"{name}: {self.describe()} has a negative length {min(read)}")
            longest = max(read)
            if longest > geo.kv_len:
                raise ValueError(
                    f"{name}: {self.describe()} has a length {longest} > Tk = {dim_str(geo.kv_len)}"
                )

    def key_tile(self, geo: Geometry, ks: int, ke: int) -> Tensor:
        """``(B|1, ke-ks)`` bool: which of the keys ``ks:ke`` are real."""
        if self.valid is not None:
            return _on(self.valid, geo.device, self._devices)[:, ks:ke]
        lengths = _on(self.lengths, geo.device, self._devices).unsqueeze(-1)  # type: ignore[arg-type]
        j = torch.arange(ks, ke, device=geo.device)
        return j < lengths if self.side == "right" else j >= geo.kv_len - lengths

    def tile(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        return self.key_tile(geo, ks, ke)[:, None, None, :]

    def block_states(
        self, geo: Geometry, q: tuple[int, int, int], k: tuple[int, int, int]
    ) -> Tensor:
        k0, k1, bk = k
        anys, alls = block_reduce(self.key_tile(geo, k0, k1), k0, k1, bk, 1)
        states = states_from(~anys.any(0), alls.all(0))  # (nk,)
        return states.expand(len(range(*q)), -1)

    @property
    def keys_only(self) -> bool:
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

    The mask keeps a copy of ``lengths`` made when it is built: a lengths tensor changed in place
    afterwards does not change it (make a new mask for new lengths).

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
        # The values are data: while torch.compile traces, the operator checks them when it runs
        # (_KeyPadding.check).
        readable = not torch.compiler.is_compiling() and lengths.device.type != "meta"
        if lengths.numel() and readable and bool((lengths < 0).any()):
            raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
        # A copy: the lengths are read back once (see _KeyPadding), so they must not change.
        return _KeyPadding(lengths.to(torch.long, copy=True), None, side)
    lens = check_lengths("lengths", lengths)
    mask = _KeyPadding(torch.tensor(lens, dtype=torch.long), None, side)
    mask._read = lens
    return mask


# --------------------------------------------------------------------------------------------------
# Any function, dense tensors, and composition


class _FromFn(Mask):
    def __init__(self, fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> None:
        self.fn = fn

    def describe(self) -> str:
        return f"from_fn({getattr(self.fn, '__name__', type(self.fn).__name__)})"

    @property
    def mask_mod(self) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
        """The function, which is FlexAttention's ``mask_mod`` (same arguments, raw indices)."""
        return self.fn

    def tile(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        dev = geo.device
        b = torch.arange(geo.batch, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(geo.heads, device=dev).view(1, -1, 1, 1)
        qi = torch.arange(qs, qe, device=dev).view(1, 1, -1, 1)
        kj = torch.arange(ks, ke, device=dev).view(1, 1, 1, -1)
        try:
            out = self.fn(b, h, qi, kj)
        except RuntimeError as err:
            if "Boolean value of Tensor" not in str(err):
                raise
            # Python's `and`, `or`, `not` and `if` ask a tensor for one truth value.
            raise TypeError(
                f"mask: {self.describe()} used Python's and/or/not (or an if) on its index "
                "tensors, which hold a whole tile of positions: write it with the tensor "
                "operators & (and), | (or) and ~ (not), e.g. (kv_idx <= q_idx) & (kv_idx < 8), "
                "and torch.where for a choice"
            ) from None
        want = (geo.batch, geo.heads, qe - qs, ke - ks)
        if not isinstance(out, Tensor) or out.dtype != torch.bool:
            got = f"{out.dtype}" if isinstance(out, Tensor) else type(out).__name__
            raise TypeError(
                f"mask: {self.describe()} must return a bool tensor (True = may attend), got {got}"
            )
        if out.ndim > 4 or any(
            not one_or(s, w) for s, w in zip(reversed(out.shape), reversed(want), strict=False)
        ):
            raise ValueError(
                f"mask: {self.describe()} returned shape {shape_str(out.shape)}, which does not "
                f"broadcast to (B, H, Tq, Tk) = {shape_str(want)} for index tensors b "
                f"{shape_str(b.shape)}, h {shape_str(h.shape)}, q_idx {shape_str(qi.shape)}, "
                f"kv_idx {shape_str(kj.shape)}"
            )
        return out.reshape((1,) * (4 - out.ndim) + tuple(out.shape))

    @property
    def positional(self) -> bool:
        return True


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


def from_tensor(mask: Tensor) -> Mask:
    """A bool tensor (True = may attend, broadcastable to ``(..., H, Tq, Tk)``) as a mask: the same
    pairs as passing the tensor itself, saying that it is in attnkit's convention.

    :func:`attnkit.attention` checks a bool tensor for the signs of torch's convention (True = may
    NOT attend), and warns once when a whole batch element sees no key. A batch that holds an
    element of padding alone, or a mask made by a library in attnkit's convention, is meant that
    way: given through ``from_tensor`` it is not checked.

    >>> m = torch.tensor([[True, False], [True, True]])
    >>> from_tensor(m).dense(2)[0, 0]
    tensor([[ True, False],
            [ True,  True]])
    """
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = (
            f"a {str(mask.dtype).removeprefix('torch.')} tensor"
            if isinstance(mask, Tensor)
            else type(mask).__name__
        )
        raise TypeError(f"from_tensor() takes a bool tensor (True = may attend), got {got}")
    return _Dense(mask)


class _Dense(Mask):
    """A bool tensor broadcastable to ``(..., H, Tq, Tk)``, seen as ``(B|1, H|1, Tq|1, Tk|1)``."""

    def __init__(self, t: Tensor) -> None:
        self.t = t

    def describe(self) -> str:
        return f"tensor{shape_str(self.t.shape)}"

    @property
    def plan_key(self) -> Hashable | None:
        # None: a cached plan would keep the tensor alive, and a dense mask can be (Tq, Tk) per
        # head and made anew every step.
        return None

    @property
    def tensor(self) -> Tensor:
        return self.t

    def _as4(self, geo: Geometry) -> Tensor:
        """``(B|1, H|1, Tq|1, Tk|1)``: the call's batch dims flattened (expanded where needed)."""
        t = self.t
        nb = len(geo.batch_shape)
        t = t.reshape((1,) * max(0, nb + 3 - t.ndim) + tuple(t.shape))
        lead = t.shape[:nb]
        if all(s == 1 for s in lead):
            return t.reshape(1, *t.shape[nb:])
        return t.expand(*geo.batch_shape, *t.shape[nb:]).reshape(geo.batch, *t.shape[nb:])

    def check(self, geo: Geometry, name: str) -> None:
        want = (*geo.batch_shape, geo.heads, geo.q_len, geo.kv_len)
        ok = self.t.ndim <= len(want) and all(
            one_or(s, w) for s, w in zip(reversed(self.t.shape), reversed(want), strict=False)
        )
        if not ok:
            raise ValueError(
                f"{name} of shape {shape_str(self.t.shape)} does not broadcast to "
                f"(..., H, Tq, Tk) = {shape_str(want)}"
            )

    def tile(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        t = self._as4(geo)
        if t.size(-2) != 1:
            t = t[..., qs:qe, :]
        if t.size(-1) != 1:
            t = t[..., ks:ke]
        return t

    def block_states(
        self, geo: Geometry, q: tuple[int, int, int], k: tuple[int, int, int]
    ) -> Tensor:
        (q0, q1, bq), (k0, k1, bk) = q, k
        t = self.tile(geo, q0, q1, k0, k1).flatten(0, 1)  # (BH|1, rows|1, keys|1)
        any_rows, _ = block_reduce(t.any(0), q0, q1, bq, 0)
        _, all_rows = block_reduce(t.all(0), q0, q1, bq, 0)
        anys, _ = block_reduce(any_rows, k0, k1, bk, 1)
        _, alls = block_reduce(all_rows, k0, k1, bk, 1)
        return states_from(~anys, alls)

    @property
    def keys_only(self) -> bool:
        return self.t.ndim < 2 or self.t.size(-2) == 1


class _Combined(Mask):
    """``&`` (all parts) or ``|`` (any part) of several masks."""

    def __init__(self, op: str, parts: tuple[Mask, ...]) -> None:
        self._op, self._members = op, parts

    def describe(self) -> str:
        sep = " & " if self.op == "and" else " | "
        # A list, not a generator: dynamo traces str.join of a list only.
        return sep.join(
            [f"({p.describe()})" if isinstance(p, _Combined) else p.describe() for p in self.parts]
        )

    @property
    def plan_key(self) -> Hashable | None:
        return _keys_of(self.op, *(p.plan_key for p in self.parts))

    def check(self, geo: Geometry, name: str) -> None:
        for p in self.parts:
            p.check(geo, name)

    def tile(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        out = self.parts[0].tile(geo, qs, qe, ks, ke)
        for p in self.parts[1:]:
            t = p.tile(geo, qs, qe, ks, ke)
            out = out & t if self.op == "and" else out | t
        return out

    def block_states(
        self, geo: Geometry, q: tuple[int, int, int], k: tuple[int, int, int]
    ) -> Tensor:
        # EMPTY < PARTIAL < FULL: an AND is as visible as its least visible part, an OR as its most.
        # (A PARTIAL answer is always safe: the tile then decides.)
        states = [p.block_states(geo, q, k) for p in self.parts]
        out = states[0]
        for s in states[1:]:
            s = s.to(out.device)  # a mask of the user's may answer on another device
            out = torch.minimum(out, s) if self.op == "and" else torch.maximum(out, s)
        return out

    def visible_rows(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> tuple[int, int]:
        spans = [p.visible_rows(geo, qs, qe, ks, ke) for p in self.parts]
        if self.op == "and":
            r0, r1 = max(s[0] for s in spans), min(s[1] for s in spans)
            return r0, max(r0, r1)
        return min(s[0] for s in spans), max(s[1] for s in spans)

    def distances(self, geo: Geometry) -> tuple[float, float]:
        spans = [p.distances(geo) for p in self.parts]
        if self.op == "and":
            return max(s[0] for s in spans), min(s[1] for s in spans)
        return min(s[0] for s in spans), max(s[1] for s in spans)

    @property
    def keys_only(self) -> bool:
        return all(p.keys_only for p in self.parts)

    @property
    def positional(self) -> bool:
        return all(p.positional for p in self.parts)

    @property
    def op(self) -> str:
        return self._op

    @property
    def parts(self) -> tuple[Mask, ...]:
        return self._members


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
        for part in m.parts if isinstance(m, _Combined) and m.op == op else (m,):
            # Index masks joined by | are one list of keys (gathered, not scanned).
            merged = None
            if op == "or" and isinstance(part, KeyIndices):
                for i, seen in enumerate(parts):
                    if isinstance(seen, KeyIndices):
                        merged = joined(seen, part)
                        if merged is not None:
                            parts[i] = merged
                            break
            if merged is None:
                parts.append(part)
    return parts[0] if len(parts) == 1 else _Combined(op, tuple(parts))


# The binary operators a mask takes a bool tensor in, as torch's dispatch names them: the Tensor
# methods eagerly, Python's operators or the tensor's bitwise method while torch.compile traces
# (which may hand the tensor first: both operators are symmetric).
_TORCH_BINARY_OPS: dict[object, str] = {
    operator.and_: "and",
    operator.or_: "or",
    Tensor.__and__: "and",
    Tensor.__rand__: "and",
    Tensor.__or__: "or",
    Tensor.__ror__: "or",
    torch._C.TensorBase.bitwise_and: "and",
    torch._C.TensorBase.bitwise_or: "or",
}


def visibility(mask: Tensor | Mask | None, causal_flag: bool) -> Mask | None:
    """A call's ``mask`` and ``causal`` as one mask (None: every pair may attend)."""
    m = None if mask is None else _as_mask(mask, "given")
    if not causal_flag:
        return m
    return _Causal("bottom_right") if m is None else _Causal("bottom_right") & m


def _batch_rows(mask: Mask) -> int | None:
    """The batch rows ``mask`` describes, when it says (key padding, documents, a tensor with
    batch dims); ``None`` when it fits any batch."""
    if isinstance(mask, _KeyPadding):
        return mask._rows_and_len()[0]
    if isinstance(mask, _Documents):
        return mask.ids.size(0) if mask.ids.ndim == 2 else None
    if isinstance(mask, _Dense):
        return mask.t.shape[:-3].numel() if mask.t.ndim >= 4 else None
    if isinstance(mask, KeyIndices):
        return mask.indices.size(0)
    if isinstance(mask, _Combined):
        found = [r for r in map(_batch_rows, mask.parts) if r is not None]
        return max(found) if found else None
    return None


def check_mask(
    name: str, mask: object, target: tuple[int, ...], legend: str = "(B, H, Tq, Tk)"
) -> Tensor | Mask:
    """``mask`` if it is a structured :class:`~attnkit.masks.Mask` that fits a call with scores
    ``target``, or a bool tensor that broadcasts to ``target``; else TypeError/ValueError.

    ``name`` is the argument as the caller knows it (``memory_mask``, ``src_mask``, ...).
    """
    if isinstance(mask, Mask):
        *batch, heads, q_len, kv_len = target
        mask.check(Geometry(tuple(batch), heads, q_len, kv_len, torch.device("cpu")), name)
        return mask
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"{name} must be a bool tensor or an attnkit.masks.Mask, got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        if mask.is_floating_point():
            hint = (
                "; a float tensor of additive scores belongs in bias= (mask is boolean, "
                "True = may attend)"
            )
        elif mask.ndim == 2 and len(target) >= 4 and tuple(mask.shape) == (target[0], target[-1]):
            # A Hugging Face attention_mask: (B, Tk), 1 = real token. mask.bool() alone would
            # lead straight into the broadcast error below.
            hint = (
                f"; a (B, Tk) 0/1 padding mask (1 = real token, as a Hugging Face "
                f"attention_mask) goes in as attnkit.masks.key_padding(valid={name}.bool()), "
                f"or as {name}.bool()[:, None, None, :]"
            )
        else:
            hint = f"; convert it with {name}.bool() (True = may attend)"
        raise TypeError(f"{name} must be a bool tensor, got {dtype_str(mask.dtype)}{hint}")
    try:
        check_broadcastable(name, mask, target, legend)
    except ValueError as err:
        raise ValueError(f"{err}{padding_mask_hint(tuple(mask.shape), target)}") from None
    return mask


# --------------------------------------------------------------------------------------------------
# A mask as an operator's arguments, and as a pytree


def encode(
    mask: Mask | None, tensors: list[Tensor], numbers: list[object] | None = None
) -> str | None:
    """``mask`` as text (its kinds and numbers, JSON), its tensors appended to ``tensors`` and
    named there by index: how a mask crosses into attnkit's operator
    (``torch.ops.attnkit.attention``) in compiled and exported graphs, and how torch.export
    flattens a mask given as an input. :func:`decode` rebuilds it. None for a mask that text
    cannot carry: :func:`from_fn` (a function) and masks of one's own classes. ``numbers``: where
    symbolic sizes go while tracing with dynamic shapes (see
    :func:`attnkit._base.checks.spec_text`; None: there are none).

    >>> tensors = []
    >>> text = encode(causal() & key_padding([3, 1]), tensors)
    >>> text, [t.tolist() for t in tensors]
    ('["and",["causal","bottom_right"],["key_padding",0,null,"right"]]', [[3, 1]])
    >>> decode(text, tensors).describe()
    'causal() & key_padding(lengths=[3, 1])'
    """
    if mask is None:
        return "null"
    tree = _tree(mask, tensors)
    return None if tree is None else spec_text(tree, numbers)


def _index(t: Tensor | None, tensors: list[Tensor]) -> int | None:
    if t is None:
        return None
    tensors.append(t)
    return len(tensors) - 1


def _tree(mask: Mask, tensors: list[Tensor]) -> list[object] | None:
    kind = type(mask)
    if kind is _Causal:
        return ["causal", mask.align]  # type: ignore[attr-defined]
    if kind is _Window:
        return ["window", mask.left, mask.right]  # type: ignore[attr-defined]
    if kind is _Band:
        return ["band", mask.lo, mask.hi, mask.align]  # type: ignore[attr-defined]
    if kind is _Documents:
        return ["documents", _index(mask.ids, tensors), mask.what]  # type: ignore[attr-defined]
    if kind is _TracedDocuments:
        return ["document_lengths", _index(mask.lengths, tensors)]  # type: ignore[attr-defined]
    if kind is _KeyPadding:
        padding: _KeyPadding = mask  # type: ignore[assignment]
        lengths = _index(padding.lengths, tensors)
        return ["key_padding", lengths, _index(padding.valid, tensors), padding.side]
    if kind is _Dense:
        return ["dense", _index(mask.tensor, tensors)]
    if kind is KeyIndices:
        return ["indices", _index(mask.indices, tensors), mask.block]  # type: ignore[attr-defined]
    if kind is _Combined:
        parts = [_tree(p, tensors) for p in mask.parts]
        return None if any(p is None for p in parts) else [mask.op, *parts]
    return None


def decode(text: str, tensors: Sequence[Tensor], numbers: Sequence[object] = ()) -> Mask | None:
    """The mask :func:`encode` wrote as ``text`` with ``tensors`` and ``numbers`` (None for
    ``"null"``)."""
    return _from_tree(spec_read(text, numbers), tensors)


def _from_tree(tree: object, tensors: Sequence[Tensor]) -> Mask | None:
    if tree is None:
        return None
    if not isinstance(tree, list) or not tree or not isinstance(tree[0], str):
        raise ValueError(f"not an encoded mask: {tree!r}")
    kind, *args = tree
    if kind == "causal":
        return _Causal(args[0])
    if kind == "window":
        return _Window(args[0], args[1])
    if kind == "band":
        return _Band(float(args[0]), float(args[1]), args[2])
    if kind == "documents":
        return _Documents(tensors[args[0]], args[1])
    if kind == "document_lengths":
        return documents(tensors[args[0]])
    if kind == "key_padding":
        lengths = None if args[0] is None else tensors[args[0]]
        valid = None if args[1] is None else tensors[args[1]]
        return _KeyPadding(lengths, valid, args[2])
    if kind == "dense":
        return _Dense(tensors[args[0]])
    if kind == "indices":
        return KeyIndices(tensors[args[0]], int(args[1]))
    if kind in ("and", "or"):
        parts = tuple(_from_tree(p, tensors) for p in args)
        return _Combined(kind, parts)  # type: ignore[arg-type]
    raise ValueError(f"not an encoded mask: {tree!r}")


def _flatten(mask: Mask) -> tuple[list[Tensor], str]:
    tensors: list[Tensor] = []
    text = encode(mask, tensors)
    if text is None:  # not reachable: only classes encode() writes are registered
        raise TypeError(f"{mask.describe()} cannot be flattened")
    return tensors, text


def _flatten_with_keys(mask: Mask) -> tuple[list[tuple[object, Tensor]], str]:
    tensors, text = _flatten(mask)
    return [(pytree.SequenceKey(i), t) for i, t in enumerate(tensors)], text


def _unflatten(tensors: Iterable[Any], text: Any) -> Mask:
    mask = decode(str(text), list(tensors))
    if mask is None:
        raise ValueError("an encoded mask of None")
    return mask


# torch.export takes a mask as an input (export(module, (x, masks.key_padding(lengths)))): its
# tensors become the program's inputs and its text the structure that rebuilds it.
for _cls in (_Band, _Causal, _Window, _Documents, _TracedDocuments, _KeyPadding, _Dense, _Combined):
    pytree.register_pytree_node(
        _cls,
        _flatten,
        _unflatten,
        serialized_type_name=f"attnkit.masks.{_cls.__name__.lstrip('_')}",
        flatten_with_keys_fn=_flatten_with_keys,  # type: ignore[arg-type]
    )

# Index masks subclass Mask: imported once it exists.
from ._indices import KeyIndices, block_indices, first_entries, joined, key_indices  # noqa: E402

pytree.register_pytree_node(
    KeyIndices,
    _flatten,
    _unflatten,
    serialized_type_name="attnkit.masks.KeyIndices",
    flatten_with_keys_fn=_flatten_with_keys,  # type: ignore[arg-type]
)
