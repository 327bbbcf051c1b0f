"""The kernel of index masks: each query's selected keys read by position, instead of a scan of
every key.

A call whose mask is an index mask (:func:`attnkit.masks.key_indices`,
:func:`~attnkit.masks.block_indices`), alone or ANDed with masks that can be read at any pair
(causal and other bands, key padding, dense tensors, other index masks), lets each query attend
at most ``k`` keys. This kernel computes just those pairs, on one of two paths.

The native kernel (``torch.ops.attnkit.gathered_forward`` and ``gathered_backward``,
``csrc/gathered.cpp``) serves float32, bfloat16 and float16 calls whose other masks are bands
and masks of keys (causal, sliding windows, key padding), with softcap and sinks: one parallel
region over (batch row, gathered head, block of queries); each selected key row is dotted into
registers for the ``G'`` query heads that share it, the softmax runs over a query's scores at
once, then the weighted sum of its value rows; the keys are walked in stretches that stay in the
core's cache while a block of queries reads them. Its backward owns each key/value head's
gradients in one thread (or in private copies, summed, where heads are fewer than threads).

Everything else (a dense ``bias`` or :class:`~attnkit.scores.DistanceBias`, a ``score_mod``,
other masks read at the pairs, float64) takes torch's sparse products: for a chunk of query rows
(one batch row and key/value head), the pairs form a sparse ``(rows, Tk)`` matrix of ``k``
entries a row, and torch's sparse kernels read each selected key or value row once: the scores
``scale * q . k_j`` at the pairs (a sampled dense-dense product, SDDMM), then everything the call
adds to them (softcap, a dense ``bias`` or a :class:`~attnkit.scores.DistanceBias` read at the
pairs, a ``score_mod``), the other ANDed masks read there too, a softmax over each row's ``k``
scores at once (no online softmax: a row's keys are all there), and the weighted sum of the
values (a sparse-dense product, SpMM). Sinks join afterwards, as in the blocked kernel
(:func:`~attnkit._kernel.sinks.finish`). The backward recomputes each chunk's scores from the
saved log-sum-exp; the queries' gradients are SpMMs, the keys' and values' those of the
transposed pairs; softcap's, the bias's and the term's by their formulas (a score_mod's alone by
autograd, which records nothing inside attnkit's operator). Time and memory are O(Tq * k); no
``(Tq, Tk)`` tensor exists.

Eager calls run the kernel through one autograd function (:func:`gathered_attention`); attnkit's
operator in compiled and exported graphs (:mod:`attnkit._kernel.operator`) asks
:func:`gathered_call` the same question when it runs and calls the two passes
(:func:`gathered_forward`, :func:`gathered_backward`) itself.

Each query reads its own keys, so a key is not reused across queries as in a dense product: the
work is bound by the bytes read (``k * (Dk + Dv)`` values per query and key/value head), not by
arithmetic. Queries that share their keys share the reads: with one selection for all heads
(``Hi = 1``) and grouped heads, the ``G`` query heads of a key/value head are rows of one pattern.

Shape letters: ``C`` gathered heads (``lcm(Hi, Hkv)``: each reads one key/value head with one
selection), ``G'`` query heads per gathered head (``H / C``), ``W`` the keys a query may attend
(``k * block``, several index masks joined by ``|`` side by side), ``n`` query rows of a chunk.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .._base.finite import finite
from .._base.transforms import transforms_active
from .._call import AttentionCall
from .._native import load, status
from .._record import note_kernel
from .._score_mod import ScoreMod
from .._score_mod import apply as apply_score_mod
from ..masks import Geometry, KeyIndices, Mask, band_visibility, first_entries
from ..scores import DistanceBias, ScoreTerm, cap_scores, softcap_form
from .backward import first_order
from .problem import no_autocast
from .sinks import finish, sink_grad

__all__ = [
    "GATHER_SHARE",
    "Gathered",
    "GatheredGrads",
    "NativeReading",
    "gathered_attention",
    "gathered_backward",
    "gathered_call",
    "gathered_forward",
    "gathered_note",
    "native_refusal",
    "selection",
]

#: An index mask is gathered when a query may attend at most this share of the keys. Gathering
#: reads each selected key once per query; the scanning kernel computes every score of the
#: blocks the selection touches but reads each key once per block of queries, and around a
#: quarter of the keys the two take about the same time on CPUs.
GATHER_SHARE = 0.25
#: The dtypes of keys and values the kernel gathers as they are.
_READ = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: The dtypes of keys and values the native kernel gathers as they are (others: in float32).
_NATIVE_READ = (torch.float16, torch.bfloat16, torch.float32)
#: Pairs per chunk (its scores, weights and indices are a few MiB each).
CHUNK_ENTRIES = 1 << 20


@dataclass(frozen=True)
class Selection:
    """What the gathered kernel reads of a mask: the index masks whose keys it gathers (several
    joined by ``|``), and the other masks ANDed with them, evaluated at the gathered pairs."""

    covers: tuple[KeyIndices, ...]
    rest: tuple[Mask, ...]

    @property
    def width(self) -> int:
        """Keys a query may attend at most: ``W``."""
        return sum(m.width for m in self.covers)


def _readable(mask: Mask) -> bool:
    """Whether :func:`_visible` can read ``mask`` at any pairs of positions."""
    if isinstance(mask, KeyIndices) or mask.band is not None or mask.tensor is not None:
        return True
    if mask.op is not None:
        return all(_readable(p) for p in mask.parts)
    return mask.keys_only


def selection(
    mask: Mask | None, term: ScoreTerm | None, dropout_p: float, kv_len: int
) -> Selection | str | None:
    """The :class:`Selection` of a call the gathered kernel serves; None for a call without an
    index mask; else why the kernel that scans the keys serves it (in ``explain()``'s words)."""
    if mask is None or not any(isinstance(p, KeyIndices) for p in _leaves(mask)):
        return None
    if isinstance(mask, KeyIndices):
        found: Selection | str = Selection((mask,), ())
    elif mask.op == "or" and all(isinstance(p, KeyIndices) for p in mask.parts):
        found = Selection(tuple(p for p in mask.parts if isinstance(p, KeyIndices)), ())
    elif mask.op == "and" and any(isinstance(p, KeyIndices) for p in mask.parts):
        # the narrowest index mask gathers (a loop: torch.compile traces no ``min(key=)``)
        covers = [p for p in mask.parts if isinstance(p, KeyIndices)]
        cover = covers[0]
        for p in covers[1:]:
            if p.width < cover.width:
                cover = p
        rest = tuple(p for p in mask.parts if p is not cover)
        unread = [p.describe() for p in rest if not _readable(p)]
        found = (
            Selection((cover,), rest)
            if not unread
            else f"{unread[0]} cannot be read at the gathered keys"
        )
    else:
        found = (
            f"{mask.describe()} selects keys beyond its index masks (an index mask gathers "
            "alone, ORed with index masks, or ANDed with other masks)"
        )
    if isinstance(found, str):
        return found
    if dropout_p:
        return "dropout's mask is drawn over blocks of the (Tq, Tk) scores"
    if term is not None and type(term) is not DistanceBias:
        return f"the score term {term.describe()} is computed over blocks of keys"
    if found.width > GATHER_SHARE * kv_len:
        return (
            f"each query may attend {found.width} of Tk = {kv_len} keys: above "
            f"{GATHER_SHARE:.0%} of them a scan, which reuses each key across a block of queries, "
            "is as fast as a gather"
        )
    return found


def _leaves(mask: Mask) -> list[Mask]:
    return [q for p in mask.parts for q in (_leaves(p) if p.op is not None else [p])]


def gathered_note(call: AttentionCall, native: bool = True) -> tuple[bool, str] | None:
    """``(served, words)`` for ``explain()``: whether the gathered kernel serves a call and how
    (``native``: whether the backend may run the native kernel), or why the kernel that scans
    the keys does; None for a call without an index mask. Builds nothing."""
    found = selection(call.mask, call.score_term, call.dropout_p, call.kv_len)
    why = None
    if isinstance(found, Selection):
        added = _added_words(call.score_mod is not None, call.bias_shape is not None,
                             call.score_term)  # fmt: skip
        why = native_refusal(
            found, (call.dtype, call.dtype), added, call.device, native=native, build=False
        )
    return _note(found, call.geometry, call.num_kv_heads, why)


def _added_words(score_mod: bool, dense_bias: bool, term: ScoreTerm | None) -> str | None:
    """What a call adds to its scores that the native kernel does not (None: nothing)."""
    if score_mod:
        return "a score_mod"
    if dense_bias:
        return "a dense bias"
    return None if term is None else f"the score term {term.describe()}"


def _note(
    found: Selection | str | None, geo: Geometry, kv_heads: int, why_not_native: str | None
) -> tuple[bool, str] | None:
    if found is None:
        return None
    if isinstance(found, str):
        return False, f"index mask scanned, not gathered: {found}"
    heads = _gathered_heads(found, geo.heads, kv_heads)
    per = geo.heads // heads
    how = (
        "the native kernel"
        if why_not_native is None
        else f"torch's sparse products: {why_not_native}"
    )
    return True, (
        f"gathered: each query's {found.width} selected keys of Tk = {geo.kv_len} read by "
        f"position, {heads} gathered head{'s' if heads > 1 else ''} of {per} query "
        f"head{'s' if per > 1 else ''} each (O(Tq * k) time and memory, {how}); the scanning "
        "kernel where q, k or v hold NaN or inf"
    )


@dataclass(frozen=True)
class NativeReading:
    """What the native gathered kernel reads of a call besides q, k, v and the selected keys:
    the bands ANDed with the selection, as ``(lo, hi, offset)`` triples (query ``i`` may attend
    key ``j`` iff ``lo <= j - (i + offset) <= hi``), and the AND of its masks of keys only,
    ``(B|1, Tk)`` bool."""

    band: tuple[float, ...]
    key_ok: Tensor | None

    @classmethod
    def of(cls, found: Selection, geo: Geometry) -> NativeReading:
        band: list[float] = []
        key_ok = None
        for part in _and_leaves(found.rest):
            if part.band is not None:
                lo, hi, align = part.band
                band += [lo, hi, float(geo.shift if align == "bottom_right" else 0)]
            else:
                keys = part.key_tile(geo, 0, geo.kv_len)
                key_ok = keys if key_ok is None else key_ok & keys
        return cls(tuple(band), None if key_ok is None else key_ok.contiguous())


def _and_leaves(parts: tuple[Mask, ...]) -> list[Mask]:
    """The masks ANDed together in ``parts``, ``&`` combinations opened."""
    return [q for p in parts for q in (_and_leaves(p.parts) if p.op == "and" else [p])]


def native_refusal(
    found: Selection,
    dtypes: tuple[torch.dtype, torch.dtype],
    added: str | None,
    device: torch.device,
    *,
    native: bool,
    build: bool,
) -> str | None:
    """Why torch's sparse products, not the native kernel, gather a call (None: the native
    kernel does): ``dtypes`` those of q and of k and v, ``added`` what the call adds to its
    scores that the native kernel does not compute (:func:`_added_words`). ``build``: load the
    kernel, or build it on first use, if it would serve (else only ask)."""
    if not native:
        return "Chunked(native=False)"
    if device.type != "cpu":
        return f"the native kernel runs on CPUs, not {device.type}"
    if added is not None:
        return f"the native kernel does not add {added}"
    if torch.float64 in dtypes:
        return "float64 (the native kernel computes in float32)"
    for part in _and_leaves(found.rest):
        if part.band is None and (isinstance(part, KeyIndices) or not part.keys_only):
            return (
                f"the native kernel reads bands and key masks at the pairs, not {part.describe()}"
            )
    if build and load():
        return None
    available, why = status()
    return None if available and not build else f"native kernel: {why}"


def _gathered_heads(found: Selection, heads: int, kv_heads: int) -> int:
    """``C``: heads that each read one key/value head with one selection."""
    return math.lcm(kv_heads, *(m.heads for m in found.covers))


# --------------------------------------------------------------------------------------------------
# The call's layout: query rows (b, c, t), each with its G' query heads and its W keys


@dataclass
class Gathered:
    """One call of the gathered kernel, in its layout: ``rows = B * C * Tq`` query rows, row
    ``r`` for batch row ``r // (C Tq)``, gathered head ``r // Tq % C``, query ``r % Tq``."""

    found: Selection
    geo: Geometry
    kv_heads: int
    scale: float
    softcap: float | None
    bias: Tensor | None  # (B|1, H|1, Tq|1, Tk|1): the call's dense bias, batch dims flattened
    term: DistanceBias | None
    score_mod: ScoreMod | None
    n_mod: int  # tensors the score_mod captures that need gradients (the last of the extras)
    chunk: int = CHUNK_ENTRIES
    #: what the native kernel reads (None: torch's sparse products serve the call)
    native: NativeReading | None = None
    keys: Tensor = field(init=False)  # (B|1, Hc, Tq, W) sorted key positions
    first: Tensor = field(init=False)  # (B|1, Hc, Tq, W) bool: the entries that count
    _read: dict[int, Tensor] = field(init=False, default_factory=dict)
    _memo: tuple[tuple[int, ...], tuple[Tensor, Tensor, _Pattern, Tensor | None]] | None = field(
        init=False, default=None
    )

    def __post_init__(self) -> None:
        geo, covers = self.geo, self.found.covers
        heads = math.lcm(*(m.heads for m in covers))
        parts = [m.selected(geo.kv_len, geo.device) for m in covers]
        if len(parts) > 1:  # side by side per query (one head count, one batch), in order again
            rows = max(p.size(0) for p in parts)
            parts = [
                p.repeat_interleave(heads // p.size(1), 1).expand(rows, heads, -1, -1)
                for p in parts
            ]
            self.keys = torch.cat(parts, -1).sort(-1).values
        else:
            self.keys = parts[0]
        self.first = first_entries(self.keys)
        self.c = math.lcm(self.keys.size(1), self.kv_heads)
        self.g = geo.heads // self.c
        self.rows = geo.batch * self.c * geo.q_len
        self.width = self.keys.size(-1)

    def spans(self) -> list[tuple[int, int]]:
        """The chunks of query rows, about :attr:`chunk` pairs each, each within one batch row
        and gathered head (whose keys and values it reads); the heads of one stretch of queries
        one after another, so that they share its pattern (see :meth:`shared`)."""
        step = max(1, self.chunk // max(1, self.width * self.g))
        tq = self.geo.q_len
        return [
            (head + t0, head + min(t0 + step, tq))
            for b in range(self.geo.batch)
            for t0 in range(0, tq, step)
            for head in range(b * self.c * tq, (b + 1) * self.c * tq, tq)
        ]

    def shared(
        self, r0: int, r1: int, b: Tensor, c: Tensor, t: Tensor
    ) -> tuple[Tensor, Tensor, _Pattern, Tensor | None]:
        """``(keys, first, pattern, visibility)`` of rows ``r0:r1``, made once for the gathered
        heads that read one selection (the visibility too where the other masks do not depend
        on the head; None where they do)."""
        tq = self.geo.q_len
        batch, head = divmod(r0 // tq, self.c)
        key = (batch, head // (self.c // self.keys.size(1)), r0 % tq, r1 - r0)
        if self._memo is None or self._memo[0] != key:
            keys, first = self.chunk_keys(r0, r1)
            pattern = _Pattern.of(keys, self.g, self.geo.kv_len)
            free = all(_head_free(p, self) for p in self.found.rest)
            vis = self.visible(b, c, t, keys, first) if free else None
            self._memo = (key, (keys, first, pattern, vis))
        return self._memo[1]

    def where(self, r0: int, r1: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(b, c, t)`` of rows ``r0:r1``, each ``(n,)``."""
        r = torch.arange(r0, r1, device=self.geo.device)
        tq = self.geo.q_len
        return r // (self.c * tq), r // tq % self.c, r % tq

    def chunk_keys(self, r0: int, r1: int) -> tuple[Tensor, Tensor]:
        """``(keys, first)`` of rows ``r0:r1`` (one batch row and gathered head), ``(n, W)``."""
        tq = self.geo.q_len
        b, c = divmod(r0 // tq, self.c)
        bi = b if self.keys.size(0) > 1 else 0
        hi = c // (self.c // self.keys.size(1))
        t0, t1 = r0 % tq, (r1 - 1) % tq + 1
        return self.keys[bi, hi, t0:t1], self.first[bi, hi, t0:t1]

    def kv_rows(self, r0: int) -> slice:
        """The rows of k and v, flattened to ``(B * Hkv * Tk, D)``, that query row ``r0`` reads."""
        tq, tk = self.geo.q_len, self.geo.kv_len
        b, c = divmod(r0 // tq, self.c)
        kv = b * self.kv_heads + c // (self.c // self.kv_heads)
        return slice(kv * tk, (kv + 1) * tk)

    def heads_of(self, c: Tensor) -> Tensor:
        """``(n, G')`` query heads of the rows."""
        return c.unsqueeze(-1) * self.g + torch.arange(self.g, device=c.device)

    # ----------------------------------------------------------------------------------------------
    # Visibility at the gathered pairs

    def visible(self, b: Tensor, c: Tensor, t: Tensor, keys: Tensor, first: Tensor) -> Tensor:
        """``(n, G'|1, W)`` bool: the entries that count and that every other mask lets through."""
        vis = first.unsqueeze(1)
        for part in self.found.rest:
            vis = vis & self._read_at(part, b, c, t, keys)
        return vis

    def _read_at(self, mask: Mask, b: Tensor, c: Tensor, t: Tensor, keys: Tensor) -> Tensor:
        """``mask`` at the pairs (query row, gathered key): ``(n, G'|1, W)`` bool."""
        geo = self.geo
        if mask.op is not None:
            parts = [self._read_at(p, b, c, t, keys) for p in mask.parts]
            out = parts[0]
            for p in parts[1:]:
                out = out & p if mask.op == "and" else out | p
            return out
        if isinstance(mask, KeyIndices):
            return _members(mask, geo, b, self.heads_of(c), t, keys)
        if mask.band is not None:
            lo, hi, align = mask.band
            at = t + (geo.shift if align == "bottom_right" else 0)
            return band_visibility(at.unsqueeze(-1), keys, lo, hi).unsqueeze(1)
        if mask.tensor is not None:
            return _at(self._whole(mask), b, self.heads_of(c), t, keys)
        table = self._whole(mask)  # (B|1, Tk): a mask of keys only
        bi = b if table.size(0) > 1 else torch.zeros_like(b)
        return table[bi.unsqueeze(-1), keys.clamp_min(0)].unsqueeze(1)

    def tensor_heads(self, mask: Mask) -> int:
        """The heads a dense mask's tile has (1: it broadcasts over them)."""
        return self._whole(mask).size(1)

    def _whole(self, mask: Mask) -> Tensor:
        """A dense mask's ``(B|1, H|1, Tq|1, Tk|1)`` tile, or a key mask's ``(B|1, Tk)`` keys,
        read once per call."""
        if id(mask) not in self._read:
            geo = self.geo
            whole = (
                mask.tile(geo, 0, geo.q_len, 0, geo.kv_len)
                if mask.tensor is not None
                else mask.key_tile(geo, 0, geo.kv_len)
            )
            self._read[id(mask)] = whole
        return self._read[id(mask)]

    # ----------------------------------------------------------------------------------------------
    # The scores of a chunk, with all the call adds to them

    def added(
        self, b: Tensor, c: Tensor, t: Tensor, keys: Tensor
    ) -> tuple[Tensor | None, Tensor | None]:
        """``(bias, term)`` at the chunk's pairs, ``(n, G'|1, W)`` each (None where absent)."""
        bias = None if self.bias is None else _at(self.bias, b, self.heads_of(c), t, keys)
        term = None
        if self.term is not None:
            table = self.term_table(self.term.table)
            at = t + self.geo.shift
            distance = (keys - at.unsqueeze(-1) - self.term.first).unsqueeze(1)
            term = _at3(table, b, self.heads_of(c), distance)
        return bias, term

    def term_table(self, table: Tensor) -> Tensor:
        """A :class:`DistanceBias` table as ``(B|1, H|1, L)``."""
        return table.reshape((1,) * (3 - table.ndim) + tuple(table.shape))

    def scores(
        self,
        raw: Tensor,
        added: tuple[Tensor | None, Tensor | None],
        vis: Tensor,
        b: Tensor,
        c: Tensor,
        t: Tensor,
        keys: Tensor,
    ) -> Tensor:
        """Natural-log scores ``(n, G', W)`` from ``raw = scale * q . k``: softcap, then the
        bias and the term (``added``), then the score_mod; differentiable, for the backward's
        autograd. Pairs ``vis`` hides enter the softcap and the score_mod as 0, as in the
        reference: what a function gives there is masked, and its gradient must not be NaN."""
        s = raw if self.softcap is None else cap_scores(raw.masked_fill(~vis, 0.0), self.softcap)
        for extra in added:
            if extra is not None:
                s = s + extra
        if self.score_mod is not None:
            s = s.masked_fill(~vis, 0.0)
            n, g, w = s.shape
            idx = (
                b.view(n, 1, 1, 1),
                self.heads_of(c).view(n, g, 1, 1),
                t.view(n, 1, 1, 1),
                keys.view(n, 1, 1, w),
            )
            s = apply_score_mod(self.score_mod, s.view(n, g, 1, w), idx).view(n, g, w)
        return s


def _head_free(mask: Mask, call: Gathered) -> bool:
    """Whether ``mask`` lets the same pairs through for every head (it is read once for the
    gathered heads of one selection)."""
    if mask.op is not None:
        return all(_head_free(p, call) for p in mask.parts)
    if isinstance(mask, KeyIndices):
        return mask.heads == 1
    if mask.band is not None or mask.tensor is None:
        return True  # a band, or a mask of keys only
    return call.tensor_heads(mask) == 1


def _at(t4: Tensor, b: Tensor, h: Tensor, t: Tensor, keys: Tensor) -> Tensor:
    """``t4`` ``(B|1, H|1, Tq|1, Tk|1)`` at the rows' pairs: ``(n, G'|1, W|1)``."""
    bi = (b if t4.size(0) > 1 else torch.zeros_like(b)).view(-1, 1, 1)
    hi = h.unsqueeze(-1) if t4.size(1) > 1 else torch.zeros_like(bi)
    ti = (t if t4.size(2) > 1 else torch.zeros_like(t)).view(-1, 1, 1)
    ki = keys.clamp_min(0).unsqueeze(1) if t4.size(3) > 1 else torch.zeros_like(bi)
    return t4[bi, hi, ti, ki]


def _bias_index(
    t4: Tensor, b: Tensor, h: Tensor, t: Tensor, keys: Tensor, shape: tuple[int, int, int]
) -> tuple[Tensor, ...]:
    """:func:`_at`'s indices of ``t4``, each expanded to ``shape`` ``(n, G', W)`` (what
    ``index_put_`` adds a chunk's gradient at)."""
    zero = torch.zeros((1, 1, 1), dtype=torch.long, device=b.device)
    bi = b.view(-1, 1, 1) if t4.size(0) > 1 else zero
    hi = h.unsqueeze(-1) if t4.size(1) > 1 else zero
    ti = t.view(-1, 1, 1) if t4.size(2) > 1 else zero
    ki = keys.clamp_min(0).unsqueeze(1) if t4.size(3) > 1 else zero
    return tuple(i.expand(shape) for i in (bi, hi, ti, ki))


def _at3(table: Tensor, b: Tensor, h: Tensor, distance: Tensor) -> Tensor:
    """A ``(B|1, H|1, L)`` table at ``distance`` ``(n, 1, W)`` (an index of the table, clamped
    for the entries that do not count): ``(n, G'|1, W)``."""
    bi = (b if table.size(0) > 1 else torch.zeros_like(b)).view(-1, 1, 1)
    hi = h.unsqueeze(-1) if table.size(1) > 1 else torch.zeros_like(bi)
    return table[bi, hi, distance.clamp(0, table.size(-1) - 1)]


def _members(
    mask: KeyIndices, geo: Geometry, b: Tensor, h: Tensor, t: Tensor, keys: Tensor
) -> Tensor:
    """Whether ``mask`` (an index mask other than the gathered one) lists each gathered key:
    ``(n, G', W)``, by a binary search of its sorted rows."""
    listed = mask.selected(geo.kv_len, geo.device)  # (B|1, Hi, Tq, w)
    bi = (b if listed.size(0) > 1 else torch.zeros_like(b)).unsqueeze(-1)
    rows = listed[bi, h // (geo.heads // listed.size(1)), t.unsqueeze(-1)]  # (n, G', w)
    wanted = keys.unsqueeze(1).expand(-1, rows.size(1), -1).contiguous()
    at = torch.searchsorted(rows.contiguous(), wanted).clamp_max(rows.size(-1) - 1)
    return rows.gather(-1, at) == wanted


# --------------------------------------------------------------------------------------------------
# Forward and backward


@dataclass
class _Inputs:
    """q in rows ``(B C Tq, G', Dk)`` in the work dtype, k and v flattened to ``(B Hkv Tk, D)``
    as they are (each chunk converts its key/value head's rows)."""

    q_rows: Tensor
    k_flat: Tensor
    v_flat: Tensor


def _inputs(call: Gathered, q: Tensor, k: Tensor, v: Tensor, work: torch.dtype) -> _Inputs:
    geo = call.geo
    q5 = q.reshape(geo.batch, call.c, call.g, geo.q_len, q.size(-1)).transpose(2, 3)
    return _Inputs(
        # contiguous: with one batch row and one gathered head the reshape is a view whose
        # (query, head) rows a chunk could not flatten
        q5.to(work).reshape(call.rows, call.g, q.size(-1)).contiguous(),
        k.flatten(0, -2),  # (not reshape(-1, D): values of D = 0 have no -1 to infer)
        v.flatten(0, -2),
    )


def _from_rows(call: Gathered, rows: Tensor) -> Tensor:
    """``(B C Tq, G', X)`` -> ``(B, H, Tq, X)``."""
    geo = call.geo
    x = rows.view(geo.batch, call.c, geo.q_len, call.g, -1).transpose(2, 3)
    return x.reshape(geo.batch, geo.heads, geo.q_len, -1)


def _to_rows(call: Gathered, t: Tensor) -> Tensor:
    """``(B, H, Tq, X)`` -> ``(B C Tq, G', X)`` (a copy)."""
    geo = call.geo
    x = t.reshape(geo.batch, call.c, call.g, geo.q_len, -1).transpose(2, 3)
    return x.reshape(call.rows, call.g, -1)


def _csr(crow: Tensor, cols: Tensor, values: Tensor, shape: tuple[int, int]) -> Tensor:
    with warnings.catch_warnings():  # torch calls its sparse CSR support beta: it is used here
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        return torch.sparse_csr_tensor(crow, cols, values, size=shape, check_invariants=False)


@dataclass
class _Pattern:
    """A chunk's pairs as a sparse ``(n G', Tk)`` matrix: row ``i G' + g`` (query ``i``, head
    ``g``) holds the query's ``W`` keys, in order (an entry that does not count at column 0, its
    weight 0). Products with it read each selected row of k or v once, in torch's sparse kernels:
    ``sampled`` gives ``a . k_j`` at the pairs (SDDMM), ``times`` the rows' weighted sums of
    values (SpMM), ``transposed_times`` the keys' sums over their queries (the backward's)."""

    crow: Tensor
    cols: Tensor
    rows: int
    kv_len: int
    _t: tuple[Tensor, Tensor, Tensor] | None = None

    @classmethod
    def of(cls, keys: Tensor, g: int, kv_len: int) -> _Pattern:
        n, w = keys.shape
        # int32 indices where they fit: torch's sparse kernels (MKL's) read them without a copy
        index = torch.int32 if max(kv_len, n * g * w) < 2**31 else torch.long
        cols = keys.clamp_min(0).to(index).unsqueeze(1).expand(n, g, w).reshape(-1)
        crow = torch.arange(0, n * g * w + 1, max(w, 1), device=keys.device, dtype=index)
        return cls(crow, cols, n * g, kv_len)

    def sampled(self, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
        """``alpha * (a @ b^T)`` at the pairs, ``(n G' W,)``: ``a`` ``(n G', D)``, ``b``
        ``(Tk, D)``."""
        zeros = a.new_zeros(self.cols.numel())
        pairs = _csr(self.crow, self.cols, zeros, (self.rows, self.kv_len))
        out: Tensor = torch.sparse.sampled_addmm(pairs, a, b.t(), beta=0.0, alpha=alpha)
        return out.values()

    def times(self, values: Tensor, b: Tensor) -> Tensor:
        """``(n G', D)``: each row's weighted sum of ``b``'s rows, ``values`` ``(n G' W,)``."""
        out: Tensor = torch.sparse.mm(
            _csr(self.crow, self.cols, values, (self.rows, self.kv_len)), b
        )
        return out

    def transposed_times(self, values: Tensor, a: Tensor) -> Tensor:
        """``(Tk, D)``: for each key the sum over its pairs of ``value * a[row]``."""
        if self._t is None:  # the pairs by key, made once per chunk
            order = self.cols.argsort(stable=True)
            counts = torch.bincount(self.cols, minlength=self.kv_len)
            crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(self.cols.dtype)
            width = max(1, self.cols.numel() // max(1, self.rows))
            self._t = (crow, (order // width).to(self.cols.dtype), order)
        crow, rows, order = self._t
        out: Tensor = torch.sparse.mm(_csr(crow, rows, values[order], (self.kv_len, self.rows)), a)
        return out


def _chunk(
    call: Gathered, ins: _Inputs, r0: int, r1: int, work: torch.dtype
) -> tuple[tuple[Tensor, ...], _Pattern, Tensor, Tensor, Tensor]:
    """What the forward and the backward compute alike for rows ``r0:r1``: ``((b, c, t, keys),
    the pattern, k and v of the rows' key/value head, raw = scale * q . k (n, G', W))``."""
    b, c, t = call.where(r0, r1)
    keys, first, pattern, vis = call.shared(r0, r1, b, c, t)
    rows = call.kv_rows(r0)
    kc, vc = ins.k_flat[rows].to(work), ins.v_flat[rows].to(work)
    qc = ins.q_rows[r0:r1].flatten(0, 1)
    raw = pattern.sampled(qc, kc, call.scale).view(r1 - r0, call.g, call.width)
    if vis is None:
        vis = call.visible(b, c, t, keys, first)
    return (b, c, t, keys, vis), pattern, kc, vc, raw


def _forward(
    call: Gathered, ins: _Inputs, bias_term: bool, work: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(out (B C Tq, G', Dv), lse (B C Tq, G'))`` in the work dtype, without sinks."""
    dv = ins.v_flat.size(-1)
    out = ins.q_rows.new_empty(call.rows, call.g, dv)
    lse = ins.q_rows.new_empty(call.rows, call.g)
    for r0, r1 in call.spans():
        (b, c, t, keys, vis), pattern, _, vc, raw = _chunk(call, ins, r0, r1, work)
        added = call.added(b, c, t, keys) if bias_term else (None, None)
        vis = _hidden_by(vis, added)
        s = call.scores(raw, added, vis, b, c, t, keys).masked_fill(~vis, float("-inf"))
        top = s.amax(-1, keepdim=True)
        top = top.masked_fill(top == float("-inf"), 0.0)  # a row with no key: weights 0
        p = (s - top).exp_()
        total = p.sum(-1)
        o = pattern.times(p.view(-1), vc).view(r1 - r0, call.g, dv)
        out[r0:r1] = o / total.clamp_min(torch.finfo(work).tiny).unsqueeze(-1)
        lse[r0:r1] = top.squeeze(-1) + total.log()
    return out, lse


@dataclass
class _Grads:
    dq: Tensor
    dk: Tensor
    dv: Tensor
    dbias: Tensor | None
    dtable: Tensor | None
    dmod: list[Tensor | None]


def _backward(
    call: Gathered,
    ins: _Inputs,
    lse: Tensor,
    delta: Tensor,
    dout: Tensor,
    wants: tuple[bool, bool, tuple[Tensor, ...]],
    work: torch.dtype,
) -> _Grads:
    """The gradients of q (rows), k, v (flat), the bias and the term's table (their ``(B|1,
    H|1, ...)`` views) and the score_mod's captured tensors, chunk by chunk (``lse``, ``delta``
    ``(B C Tq, G')``, ``dout`` ``(B C Tq, G', Dv)``; ``wants``: the bias's gradient, the
    table's, and the captured tensors that need theirs)."""
    want_bias, want_table, mod_inputs = wants
    grads = _Grads(
        torch.zeros_like(ins.q_rows),
        torch.zeros(ins.k_flat.shape, dtype=work, device=ins.k_flat.device),
        torch.zeros(ins.v_flat.shape, dtype=work, device=ins.v_flat.device),
        None,
        None,
        [None] * len(mod_inputs),
    )
    device = ins.q_rows.device
    if want_bias and call.bias is not None:
        grads.dbias = torch.zeros(call.bias.shape, dtype=work, device=device)
    if want_table and call.term is not None:
        grads.dtable = torch.zeros(
            call.term_table(call.term.table).shape, dtype=work, device=device
        )
    lse_safe = lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1)
    for r0, r1 in call.spans():
        (b, c, t, keys, vis), pattern, kc, vc, raw = _chunk(call, ins, r0, r1, work)
        bias, term = call.added(b, c, t, keys)
        vis = _hidden_by(vis, (bias, term))
        s, score_grads = _differentiable_scores(call, raw, (bias, term), vis, (b, c, t, keys))
        p = (s - lse_safe[r0:r1]).exp_().masked_fill_(~vis, 0.0)
        dout_c = dout[r0:r1].flatten(0, 1)
        dp = pattern.sampled(dout_c, vc).view(p.shape)
        ds = p * (dp - delta[r0:r1].unsqueeze(-1))
        got = score_grads(ds, mod_inputs)
        draw = _or_zeros(got[0], raw)
        _add_chunk_grads(call, grads, got, bias, term, (b, c, t, keys), len(mod_inputs))
        draw = draw.mul_(call.scale).reshape(-1)
        qc = ins.q_rows[r0:r1].flatten(0, 1)
        grads.dq[r0:r1] += pattern.times(draw, kc).view(r1 - r0, call.g, -1)
        rows = call.kv_rows(r0)
        grads.dk[rows] += pattern.transposed_times(draw, qc)
        grads.dv[rows] += pattern.transposed_times(p.reshape(-1), dout_c)
    return grads


#: The gradients of a chunk's scores by raw, the bias, the term (those the chunk has) and the
#: score_mod's captured tensors, from the scores' own gradient and those captured tensors.
_ScoreGrads = Callable[[Tensor, tuple[Tensor, ...]], tuple[Tensor | None, ...]]


def _differentiable_scores(
    call: Gathered,
    raw: Tensor,
    added: tuple[Tensor | None, Tensor | None],
    vis: Tensor,
    where: tuple[Tensor, Tensor, Tensor, Tensor],
) -> tuple[Tensor, _ScoreGrads]:
    """A chunk's scores ``(n, G', W)`` (see :meth:`Gathered.scores`, detached) and the map from
    their gradient to those of what they are made of. A score_mod's gradients come from autograd;
    softcap, the bias and the term's by their formulas, which also hold where autograd records
    nothing (inside attnkit's operator, run below autograd in compiled graphs)."""
    b, c, t, keys = where
    bias, term = added
    if call.score_mod is not None:
        leaves = [x.requires_grad_() for x in (raw, bias, term) if x is not None]
        with torch.enable_grad():
            s = call.scores(raw, added, vis, b, c, t, keys)

        def by_autograd(ds: Tensor, mod_inputs: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
            return torch.autograd.grad(s, [*leaves, *mod_inputs], ds, allow_unused=True)

        return s.detach(), by_autograd
    capped = call.scores(raw, (None, None), vis, b, c, t, keys)  # softcap alone
    form = None if call.softcap is None else softcap_form(call.softcap, raw.dtype)
    # d(cap tanh(x / cap))/dx = 1 - tanh(x / cap)^2
    slope = None if form is None else 1.0 - (capped / form.cap).square()
    s = capped
    for extra in added:
        if extra is not None:
            s = s + extra

    def by_formula(ds: Tensor, mod_inputs: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
        sums = [ds.sum_to_size(x.shape) for x in added if x is not None]
        return (ds if slope is None else ds * slope, *sums)

    return s, by_formula


def _hidden_by(vis: Tensor, added: tuple[Tensor | None, ...]) -> Tensor:
    """``vis`` with the pairs a ``-inf`` bias or term entry masks hidden too."""
    for extra in added:
        if extra is not None:
            vis = vis & (extra != float("-inf"))
    return vis


def _or_zeros(g: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if g is None else g


def _add_chunk_grads(
    call: Gathered,
    grads: _Grads,
    got: tuple[Tensor | None, ...],
    bias: Tensor | None,
    term: Tensor | None,
    where: tuple[Tensor, Tensor, Tensor, Tensor],
    n_mod: int,
) -> None:
    """Add a chunk's gradients of the bias, the term's table and the captured tensors (``got``:
    the autograd answers for raw, the bias, the term, then the captured tensors)."""
    b, c, t, keys = where
    i = 1
    for extra, total in ((bias, grads.dbias), (term, grads.dtable)):
        if extra is None:
            continue
        d = got[i]
        i += 1
        if total is None or d is None:
            continue
        n, g, w = d.shape
        if extra is bias:
            index = _bias_index(total, b, call.heads_of(c), t, keys, (n, g, w))
        else:
            at = t + call.geo.shift
            distance = keys - at.unsqueeze(-1) - call.term.first  # type: ignore[union-attr]
            lead = _bias_index(total.unsqueeze(2), b, call.heads_of(c), t, keys, (n, g, w))[:2]
            last = distance.clamp(0, total.size(-1) - 1).unsqueeze(1).expand(n, g, w)
            index = (*lead, last)
        total.index_put_(index, d.to(total.dtype).expand(n, g, w), accumulate=True)
    for j in range(n_mod):
        d = got[i + j]
        if d is not None:
            kept = grads.dmod[j]
            grads.dmod[j] = d.clone() if kept is None else kept.add_(d)


def _bias4(bias: Tensor, batch: tuple[int, ...], n: int) -> Tensor:
    """A bias broadcastable to ``(*batch, H, Tq, Tk)`` as ``(B|1, H|1, Tq|1, Tk|1)`` (a view
    where the batch dims broadcast)."""
    t = bias.reshape((1,) * (len(batch) + 3 - bias.ndim) + tuple(bias.shape))
    rest = t.shape[len(batch) :]
    if all(s == 1 for s in t.shape[: len(batch)]):
        return t.reshape(1, *rest)
    return t.expand(*batch, *rest).reshape(n, *rest)


def _bias_grad(d4: Tensor, bias: Tensor, batch: tuple[int, ...]) -> Tensor:
    """:func:`_bias4`'s layout of a gradient -> the bias's own shape and dtype."""
    lead = batch if d4.size(0) != 1 else (1,) * len(batch)
    padded = (1,) * (len(batch) + 3 - bias.ndim) + tuple(bias.shape)
    d = d4.reshape(*lead, *d4.shape[1:]).sum_to_size(padded)
    return d.reshape(bias.shape).to(bias.dtype)


def gathered_forward(
    call: Gathered, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The forward of a :func:`gathered_call`: ``(out (B, H, Tq, Dv), lse (B, H, Tq))`` in the
    work dtype (batch dims flattened), sinks folded in. Records no graph."""
    geo = call.geo
    work = torch.promote_types(q.dtype, torch.float32)
    with no_autocast(q.device):
        if call.native is not None:
            out, lse = _native_forward(call, call.native, q, k, v)
        else:
            out_rows, lse_rows = _forward(call, _inputs(call, q, k, v, work), True, work)
            out = _from_rows(call, out_rows)  # (B, H, Tq, Dv)
            lse = _from_rows(call, lse_rows.unsqueeze(-1)).squeeze(-1)  # (B, H, Tq)
        if sinks is not None:
            hkv, groups = call.kv_heads, geo.heads // call.kv_heads
            out5, lse4 = finish(  # (groups named: with Dv = 0 there is no -1 to infer)
                out.view(geo.batch, hkv, groups, geo.q_len, out.size(-1)),
                lse.view(geo.batch, hkv, groups, geo.q_len),
                sinks.view(hkv, groups),
            )
            out, lse = out5.view(out.shape), lse4.view(lse.shape)
    return out, lse


#: The gradients :func:`gathered_backward` gives: q, k, v, the bias, the sinks, then the score
#: term's inputs and the score_mod's captured tensors (None where not asked for).
GatheredGrads = tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, list[Tensor | None]]


def gathered_backward(
    call: Gathered,
    qkv: tuple[Tensor, Tensor, Tensor],
    saved: tuple[Tensor, Tensor],
    added: tuple[Tensor | None, Tensor | None, tuple[Tensor, ...]],
    grads_out: tuple[Tensor | None, Tensor | None],
    wants: tuple[bool, bool, bool],
) -> GatheredGrads:
    """The backward of a :func:`gathered_call`, recomputed from its forward's ``saved`` ``(out
    (B, H, Tq, Dv), lse (B, H, Tq))`` (sinks folded in; the work dtype): the gradients of q, k,
    v and of ``added`` (the dense bias, the sinks, then ``extra``: the score term's inputs and the
    score_mod's captured tensors) from ``grads_out`` (those of out and lse; None: not used).
    ``wants``: whether the bias, the sinks and the score term's inputs need theirs."""
    q, k, v = qkv
    out, lse = saved
    bias, sinks, extra = added
    dout, dlse = grads_out
    geo = call.geo
    work = out.dtype
    with no_autocast(q.device):
        dout4 = torch.zeros_like(out) if dout is None else dout.reshape(out.shape).to(work)
        delta = (dout4 * out).sum(-1)  # (B, H, Tq): rowsum(dO * O)
        if dlse is not None:  # d lse / d s = the softmax: P * (dP - delta) gains P * dlse
            delta = delta - dlse.reshape(delta.shape).to(work)
        dsinks = None
        if sinks is not None and wants[1]:
            hkv = call.kv_heads
            shape4 = (geo.batch, hkv, -1, geo.q_len)
            p_sinks = sink_grad(lse.view(shape4), delta.view(shape4), sinks.view(hkv, -1))
            dsinks = p_sinks.reshape(sinks.shape).to(sinks.dtype)
        if call.native is not None:  # (no bias, score term or score_mod)
            dq, dk, dv = _native_backward(call, call.native, (q, k, v), dout4, lse, delta)
            return dq, dk, dv, None, dsinks, [None] * len(extra)
        n_term = len(extra) - call.n_mod
        grads = _backward(
            call,
            _inputs(call, q, k, v, work),
            _to_rows(call, lse.unsqueeze(-1)).squeeze(-1),
            _to_rows(call, delta.unsqueeze(-1)).squeeze(-1),
            _to_rows(call, dout4),
            (bias is not None and wants[0], n_term > 0 and wants[2], tuple(extra[n_term:])),
            work,
        )
    dbias = None
    if grads.dbias is not None and bias is not None:
        dbias = _bias_grad(grads.dbias, bias, geo.batch_shape)
    dterm = [
        None if grads.dtable is None else grads.dtable.reshape(t.shape).to(t.dtype)
        for t in extra[:n_term]
    ]
    dmod = [
        None if d is None else d.to(t.dtype)
        for d, t in zip(grads.dmod, extra[n_term:], strict=True)
    ]
    return (
        _from_rows(call, grads.dq).reshape(q.shape).to(q.dtype),
        grads.dk.reshape(k.shape).to(k.dtype),
        grads.dv.reshape(v.shape).to(v.dtype),
        dbias,
        dsinks,
        [*dterm, *dmod],
    )


class _GatheredAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        call: Gathered,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        sinks: Tensor | None,
        *extra: Tensor,
    ) -> tuple[Tensor, Tensor]:
        out, lse = gathered_forward(call, q, k, v, sinks)
        ctx.save_for_backward(q, k, v, out, lse, bias, sinks, *extra)
        ctx.call = call
        ctx.set_materialize_grads(False)
        shape = q.shape[:-1]
        return out.to(q.dtype).reshape(*shape, v.size(-1)), lse.reshape(shape)

    @staticmethod
    @first_order
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, bias, sinks, *extra = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dq, dk, dv, dbias, dsinks, dextra = gathered_backward(
            ctx.call,
            (q, k, v),
            (out, lse),
            (bias, sinks, tuple(extra)),
            (dout, dlse),
            (bool(needs[4]), bool(needs[5]), len(needs) > 6 and bool(needs[6])),
        )
        return (None, dq, dk, dv, dbias, dsinks, *dextra)


def _native_inputs(call: Gathered, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
    """q ``(B, H, Tq, Dk)`` in float32; k and v ``(B, Hkv, Tk, D)`` as they are where the native
    kernel reads them so, else in float32."""
    geo = call.geo
    q4 = q.reshape(geo.batch, geo.heads, geo.q_len, q.size(-1)).to(torch.float32)
    if k.dtype != v.dtype or k.dtype not in _NATIVE_READ:
        k, v = k.to(torch.float32), v.to(torch.float32)
    k4 = k.reshape(geo.batch, call.kv_heads, geo.kv_len, k.size(-1))
    return q4, k4, v.reshape(geo.batch, call.kv_heads, geo.kv_len, v.size(-1))


def _native_softcap(call: Gathered) -> float:
    form = None if call.softcap is None else softcap_form(call.softcap, torch.float32)
    return 0.0 if form is None else form.cap


def _native_forward(
    call: Gathered, reading: NativeReading, q: Tensor, k: Tensor, v: Tensor
) -> tuple[Tensor, Tensor]:
    """``(out (B, H, Tq, Dv), lse (B, H, Tq))`` in float32, without sinks, from the native
    kernel."""
    q4, k4, v4 = _native_inputs(call, q, k, v)
    out, lse = torch.ops.attnkit.gathered_forward(
        q4, k4, v4, call.keys, reading.key_ok, scale=call.scale,
        softcap=_native_softcap(call), band=list(reading.band),
    )  # fmt: skip
    return out, lse


def _native_backward(
    call: Gathered,
    reading: NativeReading,
    qkv: tuple[Tensor, Tensor, Tensor],
    dout: Tensor,
    lse: Tensor,
    delta: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of q, k and v in their shapes and dtypes, from the native kernel (``dout``
    ``(B, H, Tq, Dv)``, ``lse`` and ``delta`` ``(B, H, Tq)``, float32)."""
    q, k, v = qkv
    q4, k4, v4 = _native_inputs(call, q, k, v)
    dq, dk, dv = torch.ops.attnkit.gathered_backward(
        dout.float(), q4, k4, v4, call.keys, lse.float(), delta.float(), reading.key_ok,
        scale=call.scale, softcap=_native_softcap(call), band=list(reading.band),
    )  # fmt: skip
    return (
        dq.reshape(q.shape).to(q.dtype),
        dk.reshape(k.shape).to(k.dtype),
        dv.reshape(v.shape).to(v.dtype),
    )


# Function.apply is untyped in torch; give it its type once.
_apply: Callable[..., tuple[Tensor, Tensor]] = _GatheredAttention.apply


def gathered_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | None,
    bias: Tensor | ScoreTerm | None,
    scale: float,
    softcap: float | None,
    score_mod: ScoreMod | None,
    n_captured: int,
    dropout_p: float,
    is_finite: bool | None,
    native: bool = True,
    check_inputs: bool = True,
) -> tuple[Gathered, str] | None:
    """A validated call as the gathered kernel's :class:`Gathered`, with the words
    ``record_dispatch()`` records for it; None when the kernel does not serve it (see
    :func:`selection`; also a call with nothing to compute, or whose q, k or v hold NaN or inf:
    the scanning kernel's careful mode takes those). The native kernel gathers it where it can
    (:func:`native_refusal`; ``native``: whether the backend may run it), else torch's sparse
    products. ``n_captured``: the tensors the ``score_mod`` captures that need gradients.
    ``check_inputs``: read whether q, k and v are finite (else the caller checks the output)."""
    term = bias if isinstance(bias, ScoreTerm) else None
    found = selection(mask, term, dropout_p, k.size(-2))
    if not isinstance(found, Selection) or not found.width or not q.numel() or not k.numel():
        return None
    if k.dtype not in _READ or v.dtype not in _READ:  # int8/float8 keys read with their scales
        return None
    if q.device.type == "meta" or is_finite is False:
        return None
    if is_finite is None and check_inputs and not finite(q, k, v):
        return None
    batch = tuple(q.shape[:-3])
    geo = Geometry(batch, q.size(-3), q.size(-2), k.size(-2), q.device)
    dense = bias if isinstance(bias, Tensor) else None
    call = Gathered(
        found,
        geo,
        k.size(-3),
        scale,
        softcap,
        None if dense is None else _bias4(dense, batch, geo.batch),
        term if isinstance(term, DistanceBias) else None,
        score_mod,
        n_captured,
    )
    why = native_refusal(
        found, (q.dtype, k.dtype), _added_words(score_mod is not None, dense is not None, term),
        q.device, native=native, build=True,
    )  # fmt: skip
    call.native = NativeReading.of(found, geo) if why is None else None
    words = _note(found, geo, k.size(-3), why)
    return call, (words[1].partition("; the scanning")[0] if words is not None else "gathered")


def gathered_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | None,
    bias: Tensor | ScoreTerm | None,
    scale: float,
    softcap: float | None,
    sinks: Tensor | None,
    score_mod: ScoreMod | None,
    captured: tuple[Tensor, ...],
    dropout_p: float,
    return_lse: bool,
    is_finite: bool | None,
    native: bool = True,
) -> Tensor | tuple[Tensor, Tensor] | None:
    """A validated call (the chunked backend's) through the gathered kernel, differentiable; None
    when the kernel does not serve it (see :func:`gathered_call`).

    Whether q, k and v hold NaN or inf is read before the call, except for a call without
    gradients whose queries select fewer keys than the keys held (a decode step's few queries
    over a long cache): reading every key for it would cost more than the call, so its output is
    read instead. The kernel reads only the selected keys, whose NaN or inf reach the output as
    they do the formula's; an output that is not finite goes to the scanning kernel's careful
    mode, as a non-finite input does. Under torch.func's transforms (``grad``, ``vmap``) the
    scanning kernel serves the call: its autograd function has the rules they need."""
    if transforms_active():
        return None
    dense = bias if isinstance(bias, Tensor) else None
    after = (
        is_finite is None
        and _few_rows(q, k, mask)
        and not _wants_grads(
            q,
            k,
            v,
            dense,
            sinks,
            *captured,
            *(bias.inputs() if isinstance(bias, ScoreTerm) else ()),
        )
    )
    served = gathered_call(
        q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap, score_mod=score_mod,
        n_captured=len(captured), dropout_p=dropout_p, is_finite=is_finite, native=native,
        check_inputs=not after,
    )  # fmt: skip
    if served is None:
        return None
    call, words = served
    extra = (*(call.term.inputs() if call.term is not None else ()), *captured)
    out, lse = _apply(call, q, k, v, dense, sinks, *extra)
    if after and not finite(out):
        return None
    note_kernel(words)
    return (out, lse) if return_lse else out


def _few_rows(q: Tensor, k: Tensor, mask: Mask | None) -> bool:
    """Whether each selection head's queries select fewer keys, all together, than the keys of
    a row (a decode step over a long cache): reads no tensor data."""
    widths = _widths(mask)
    return bool(widths) and q.size(-2) * sum(widths) < k.size(-2)


def _widths(mask: Mask | None) -> list[int]:
    """The widths (keys a query may select) of ``mask``'s index masks."""
    if mask is None:
        return []
    if isinstance(mask, KeyIndices):
        return [mask.width]
    return [w for p in mask.parts for w in _widths(p)] if mask.op is not None else []


def _wants_grads(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
