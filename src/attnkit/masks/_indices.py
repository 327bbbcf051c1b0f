"""Index masks: the keys each query may attend, given as their positions.

A sparse-attention indexer (DeepSeek V3.2's top-k, NSA's block selection) picks for every query
a few keys out of many: :func:`key_indices` takes their positions, :func:`block_indices` the
blocks of keys. Both are :class:`KeyIndices` masks, which compose with ``&`` and ``|`` like every
mask (``key_indices(idx) & causal()``). The chunked backend serves them by gathering each query's
selected keys (:mod:`attnkit._kernel.gathered`), in O(Tq * k) time and memory; the flex backend
(torch's FlexAttention, what a GPU runs) reads each query's selection from a bitmap of
``Tq * Tk / 8`` bytes per selection head (:mod:`attnkit.backends.flex.mask_mod`); every other
backend asks them for tiles, as for any mask (the reference writes the ``(Tq, Tk)`` mask out).

Shape letters: ``B`` batch rows, ``Hi`` heads of the indices (1, or a divisor of ``H``: query
head ``h`` reads the indices of head ``h // (H / Hi)``, so ``Hi = Hkv`` gives each key/value head
its own selection), ``Tq`` queries, ``k`` selected keys (or blocks) per query, ``Tk`` keys.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable

import torch
from torch import Tensor

from .._base.checks import check_int, shape_str
from . import Geometry, Mask
from ._blocks import EMPTY, PARTIAL

__all__ = ["KeyIndices", "block_indices", "first_entries", "joined", "key_indices"]


class KeyIndices(Mask):
    """A mask that lists, for each query, the keys it may attend: what :func:`key_indices` and
    :func:`block_indices` build.

    ``indices`` is ``(B|1, Hi, Tq, k)``, integer, ``-1`` for no key; ``block`` is the number of
    keys an entry stands for (1 for key positions; entry ``x`` then covers keys ``x * block`` to
    ``x * block + block - 1``). Repeated entries count once. :meth:`selected` gives the keys in
    the form the gathered kernel reads.
    """

    #: what calls made of the mask (see Mask): also the joined selections' concatenation
    _MADE_BY_CALLS = ("_devices", "_kept", "_joined")

    def __init__(self, indices: Tensor, block: int, *, sources: tuple[Tensor, ...] = ()) -> None:
        self._indices = indices
        self.block = block
        # Index masks joined by | (see joined): the selections listed side by side, read from
        # their own tensors at every use, so that one changed in place is read again (as a
        # single index mask reads its tensor); `indices` their concatenation, made once per
        # version of theirs.
        self._sources = sources
        self._joined: dict[Hashable, Tensor] = {}
        # (kv_len, device) -> the sorted keys of that call (see selected), for the tensor's version
        self._kept: dict[tuple[int, torch.device], tuple[Hashable, Tensor]] = {}

    def __setstate__(self, state: dict[str, object]) -> None:
        if "indices" in state:  # pickled before joined selections were read at each use
            state["_indices"] = state.pop("indices")
        self.__dict__.update({"_sources": (), "_joined": {}, **state})

    @property
    def indices(self) -> Tensor:
        """``(B|1, Hi, Tq, k)`` integer: the entries, ``-1`` for none (of index masks joined by
        ``|``, their selections side by side, as they hold now)."""
        if not self._sources:
            return self._indices
        version = self._version()
        held = None if version is None else self._joined.get(version)
        if held is not None:
            return held
        rows, heads = (max(t.size(d) for t in self._sources) for d in (0, 1))
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in self._sources))
        both = torch.cat([t.expand(rows, heads, -1, -1).to(dtype) for t in self._sources], -1)
        if version is not None:
            self._joined = {version: both}
        return both

    def _version(self) -> Hashable | None:
        """The entries' version: the tensor's version counter (a tuple of them for joined
        selections), or None where there is none to keep a result by (see :func:`_version`)."""
        if not self._sources:
            return _version(self._indices)
        versions = tuple(_version(t) for t in self._sources)
        return None if None in versions else versions

    def describe(self) -> str:
        if self.block == 1:
            return f"key_indices(indices {shape_str(self.indices.shape)})"
        return f"block_indices(indices {shape_str(self.indices.shape)}, block={self.block})"

    @property
    def plan_key(self) -> Hashable | None:
        tensors = self._sources or (self._indices,)
        try:
            versions = tuple(t._version for t in tensors)
        except RuntimeError:  # made under inference_mode: no version counter
            return None
        return ("key_indices", tuple(map(id, tensors)), versions, self.block)

    @property
    def heads(self) -> int:
        """``Hi``: the heads the selection is given for."""
        return self.indices.size(1)

    @property
    def width(self) -> int:
        """Keys each query may attend at most: ``k * block``."""
        return self.indices.size(-1) * self.block

    def check(self, geo: Geometry, name: str) -> None:
        idx = self.indices
        rows, heads, q_len, _ = idx.shape
        if rows not in (1, geo.batch):
            raise ValueError(
                f"{name}: {self.describe()} has {rows} batch rows but the call has B = {geo.batch}"
            )
        if geo.heads % heads:
            raise ValueError(
                f"{name}: {self.describe()} gives {heads} heads, which do not divide the call's "
                f"H = {geo.heads} query heads (give 1, or the key/value heads)"
            )
        if q_len != geo.q_len:
            raise ValueError(
                f"{name}: {self.describe()} selects keys for {q_len} queries but the call has "
                f"Tq = {geo.q_len}"
            )
        if idx.device.type == "meta" and geo.device.type != "meta":
            # (indices elsewhere are moved to the call's device; meta ones hold no values to move)
            raise ValueError(
                f"{name}: {self.describe()} is on meta, which holds no values, but the call's q "
                f"is on {geo.device}: give the indices on {geo.device}"
            )
        slots = -(-geo.kv_len // self.block)
        # The values are data: while torch.compile traces, attnkit's operator checks them when
        # it runs, and on the CPU the graph checks them for the backends that run in it (on an
        # accelerator that would be a device-side assertion, which ends the process's use of
        # the device: there they are not checked in the graph). Nothing reads them on meta.
        if torch.compiler.is_compiling():
            if idx.device.type == "cpu" and idx.numel():
                fits = ((idx >= -1) & (idx < slots)).all()
                what = "key_indices" if self.block == 1 else "block_indices"
                torch._assert_async(
                    fits,
                    f"{name}: each entry of {what} must be -1 (none) or a key of the call's"
                    f" Tk keys" + ("" if self.block == 1 else f" in blocks of {self.block}"),
                )
            return
        if idx.device.type == "meta" or not idx.numel():
            return
        lo, hi = (int(x) for x in torch.aminmax(idx))
        if lo < -1 or hi >= slots:
            what = "key" if self.block == 1 else f"block of {self.block} keys"
            raise ValueError(
                f"{name}: {self.describe()} holds entries from {lo} to {hi}, and each must be -1 "
                f"(none) or a {what} of the call's Tk = {geo.kv_len} keys (0 to {slots - 1})"
            )

    def selected(self, kv_len: int, device: torch.device) -> Tensor:
        """``(B|1, Hi, Tq, k * block)`` int64 key positions on ``device``, sorted in each row:
        first the ``-1`` (none, and the keys past ``Tk`` of a last partial block), then the keys
        in order, a repeated key as often as given (:func:`first_entries` says which entry
        counts). Made once per tensor version and call size: the forward and the backward, and
        the tiles of a plan, share it."""
        version = self._version()
        if not isinstance(kv_len, int):  # a SymInt (an export of dynamic shapes): not hashable
            version = None
        kept = None if version is None else self._kept.get((kv_len, device))
        if kept is not None and kept[0] == version:
            return kept[1]
        keys = self.indices.to(device=device, dtype=torch.long)
        if self.block > 1:
            # A block's keys from Tk on do not exist: a block wider than the call is read as Tk
            # keys, not written out whole.
            offsets = torch.arange(min(self.block, kv_len), device=device)
            wide = keys.unsqueeze(-1) * self.block + offsets  # (..., k, block)
            keys = torch.where((keys.unsqueeze(-1) >= 0) & (wide < kv_len), wide, -1).flatten(-2)
        # In order, a gather reads the keys as they lie, and a repeat sits beside its first.
        keys = keys.sort(-1).values
        if version is not None:
            self._kept = {(kv_len, device): (version, keys)}
        return keys

    def _rows(self, geo: Geometry, qs: int, qe: int) -> Tensor:
        """``(B|1, H|1, rows, k * block)`` selected keys of queries ``qs:qe``, per query head."""
        keys = self.selected(geo.kv_len, geo.device)[:, :, qs:qe]
        if keys.size(1) not in (1, geo.heads):
            keys = keys.repeat_interleave(geo.heads // keys.size(1), dim=1)
        return keys

    def tile(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        keys = self._rows(geo, qs, qe) - ks
        width = ke - ks
        # Keys outside ks:ke (and none) go to one spare column, dropped after the scatter.
        keys = torch.where((keys >= 0) & (keys < width), keys, width)
        out = torch.zeros((*keys.shape[:-1], width + 1), dtype=torch.bool, device=geo.device)
        return out.scatter(-1, keys, True)[..., :width]

    def block_states(
        self, geo: Geometry, q: tuple[int, int, int], k: tuple[int, int, int]
    ) -> Tensor:
        # A block holds a visible pair iff some query of it selected some key of it; no block is
        # said FULL (PARTIAL is always sound).
        (q0, q1, bq), (k0, k1, bk) = q, k
        nq, nk = -(-(q1 - q0) // bq), -(-(k1 - k0) // bk)
        keys = self.selected(geo.kv_len, geo.device)[:, :, q0:q1]  # (B|1, Hi, rows, w)
        qb = (torch.arange(q1 - q0, device=geo.device) // bq).view(1, 1, -1, 1)
        inside = (keys >= k0) & (keys < k1)
        flat = torch.where(inside, qb * nk + (keys - k0) // bk, nq * nk)
        counts = torch.bincount(flat.flatten(), minlength=nq * nk + 1)[: nq * nk]
        return torch.where(counts > 0, PARTIAL, EMPTY).to(torch.uint8).view(nq, nk)


def joined(a: KeyIndices, b: KeyIndices) -> KeyIndices | None:
    """``a | b`` as one index mask listing the keys of both (so a call gathers it rather than
    scanning every key), where the two can be one: blocks of one size, the same queries, batch
    rows and heads that are equal or 1, one device. None where they cannot."""
    ia, ib = a.indices, b.indices
    if a.block != b.block or ia.device != ib.device or ia.size(2) != ib.size(2):
        return None
    for x, y in ((ia.size(0), ib.size(0)), (ia.size(1), ib.size(1))):
        if x != y and 1 not in (x, y):
            return None
    # Read from a's and b's own tensors at each use (KeyIndices.indices), not copied now: a
    # selection refilled in place is read again, as it is on its own.
    sources = (a._sources or (ia,)) + (b._sources or (ib,))
    return KeyIndices(ia, a.block, sources=sources)


def _version(t: Tensor) -> int | None:
    """``t``'s version counter, or None where the selected keys cannot be kept by it: a tensor
    made under ``torch.inference_mode`` has no counter, and while torch.compile traces the
    counter is symbolic (comparing it would guard on data)."""
    if torch.compiler.is_compiling():
        return None
    try:
        return t._version
    except RuntimeError:
        return None


def first_entries(keys: Tensor) -> Tensor:
    """Bool, the shape of ``keys`` (rows sorted, as :meth:`KeyIndices.selected` gives them): True
    at each key's first entry, False at its repeats and at ``-1``."""
    first = keys >= 0
    first[..., 1:] &= keys[..., 1:] != keys[..., :-1]
    return first


#: Unsigned integer dtypes wider than 8 bits, which torch's kernels barely support.
_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


def _checked(indices: object, what: str) -> Tensor:
    if not isinstance(indices, Tensor) or indices.is_floating_point() or indices.is_complex():
        got = str(indices.dtype) if isinstance(indices, Tensor) else type(indices).__name__
        raise TypeError(f"{what}() takes an integer tensor (B|1, Hi, Tq, k), got {got}")
    if indices.dtype == torch.bool:
        raise TypeError(
            f"{what}() takes integer positions, got a bool tensor: a bool mask (True = may "
            "attend) is a mask= of its own"
        )
    if indices.dtype in _UNSIGNED:
        # (torch's CPU kernels have no minimum, maximum or comparison for them)
        raise TypeError(
            f"{what}() takes indices of int64, int32, int16, int8 or uint8, got "
            f"{indices.dtype}: give indices.long()"
        )
    if indices.layout != torch.strided:
        raise TypeError(
            f"{what}() takes a dense (strided) tensor of indices, got one of layout "
            f"{indices.layout}: give indices.to_dense()"
        )
    if indices.ndim != 4:
        hint = (
            f"; a (B, Tq, k) selection shared by all heads is {what}(indices.unsqueeze(1))"
            if indices.ndim == 3
            else ""
        )
        raise ValueError(
            f"{what}() takes indices (B|1, Hi, Tq, k), got {shape_str(indices.shape)}{hint}"
        )
    if not indices.size(1):  # (every call has a head: Hi = 0 divides none of them)
        raise ValueError(
            f"{what}() takes indices (B|1, Hi, Tq, k) for at least one head (Hi >= 1), got "
            f"{shape_str(indices.shape)}"
        )
    return indices


def key_indices(indices: Tensor) -> KeyIndices:
    """The keys each query may attend, by position: ``indices`` ``(B|1, Hi, Tq, k)`` integer
    (int64, int32, int16, int8 or uint8), ``-1`` for none (a query with none attends nothing:
    its output is 0). Repeated entries count once. ``Hi`` is 1 (every head attends the same
    keys) or divides ``H`` (``Hi = Hkv``: one selection per key/value head). AND it with other
    masks (``& causal()``) to restrict it.

    The chunked backend gathers each query's ``k`` keys instead of scanning all ``Tk``: time and
    memory O(Tq * k), forward and backward.

    >>> import torch
    >>> from attnkit.masks import causal
    >>> idx = torch.tensor([[0, 2], [1, 1], [3, -1]]).view(1, 1, 3, 2)
    >>> key_indices(idx).dense(3, 4)[0, 0].int()
    tensor([[1, 0, 1, 0],
            [0, 1, 0, 0],
            [0, 0, 0, 1]], dtype=torch.int32)
    >>> (key_indices(idx) & causal()).dense(3, 4)[0, 0].int()     # queries at keys 1, 2, 3
    tensor([[1, 0, 0, 0],
            [0, 1, 0, 0],
            [0, 0, 0, 1]], dtype=torch.int32)
    """
    return KeyIndices(_checked(indices, "key_indices"), 1)


def block_indices(indices: Tensor, *, block: int) -> KeyIndices:
    """The blocks of keys each query may attend (NSA's selected blocks): entry ``x`` of
    ``indices`` ``(B|1, Hi, Tq, n)`` lets the query attend keys ``x * block`` to
    ``x * block + block - 1`` (those that exist); ``-1`` for none. Otherwise as
    :func:`key_indices`, with ``k = n * block`` keys a query.

    >>> import torch
    >>> from attnkit.masks import causal
    >>> idx = torch.tensor([[0], [2], [0]]).view(1, 1, 3, 1)
    >>> (block_indices(idx, block=2) & causal()).dense(3, 5)[0, 0].int()
    tensor([[1, 1, 0, 0, 0],
            [0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0]], dtype=torch.int32)
    """
    return KeyIndices(_checked(indices, "block_indices"), check_int("block", block))
