"""Score terms: what a call adds to ``q k^T``, computed one tile at a time.

``attention(q, k, v, bias=...)`` adds a bias to the scaled scores. A dense ``(Tq, Tk)`` tensor is
the simple form; a :class:`ScoreTerm` is the lazy one: attnkit asks it for the tile of the scores it
is computing, so the ``(Tq, Tk)`` term never exists and memory stays O(T), in training too. Its
gradients reach the tensors the term reads.

A term subclasses :class:`ScoreTerm` and implements :meth:`~ScoreTerm.tile`: the term for queries
at key positions ``q_pos`` and keys at ``k_pos``. ALiBi (Press et al., 2022) in a few lines:

>>> import torch, attnkit
>>> from attnkit.scores import ScoreTerm
>>> class ALiBi(ScoreTerm):
...     '''-slope[h] * |j - i'|: a linear penalty on distance, one slope per head.'''
...     def __init__(self, slopes):                    # (H,)
...         self.slopes = slopes
...     def inputs(self):                              # what gradients flow to
...         return (self.slopes,)
...     def tile(self, inputs, q_pos, k_pos):          # (rows, 1) and (1, keys) positions
...         (slopes,) = inputs
...         return -slopes[:, None, None] * (k_pos - q_pos).abs()   # (H, rows, keys)
>>> q, k, v = (torch.randn(1, 4, 300, 16) for _ in range(3))
>>> slopes = attnkit.alibi_slopes(4)
>>> lazy = attnkit.attention(q, k, v, bias=ALiBi(slopes), causal=True)
>>> dense = attnkit.attention(q, k, v, bias=attnkit.alibi_bias(4, 300), causal=True)
>>> torch.allclose(lazy, dense, atol=1e-5)
True

Positions are bottom-right aligned, as everywhere in attnkit: query ``i`` sits at key position
``i + Tk - Tq``, so a term written with distances ``k_pos - q_pos`` works with a KV cache. A term
may depend on the batch row and head by returning ``(B, H, rows, keys)`` (batch dims flattened to
``B``); smaller shapes broadcast.

:class:`DistanceBias` is the form such terms often take, a table read by distance, which the
native kernel reads without tiles. :class:`RelativePositionTerm`, Transformer-XL's position term,
shows the other level of the protocol: a term that knows its structure overrides
:meth:`ScoreTerm.block` to share work across the tiles of a query block and to write its own
gradients.

Shape letters: ``B`` batch, ``H`` heads, ``Tq`` queries, ``Tk`` keys, ``Dh`` head size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ._base.checks import INT_MAX, check_int, one_or, shape_str, spec_read, spec_text
from .masks._blocks import Geometry

__all__ = ["DistanceBias", "RelativePositionTerm", "ScoreShape", "ScoreTerm", "TermBlock"]


#: The call a term computes for: the :class:`~attnkit.masks.Geometry` masks are asked about too
#: (``batch`` rows, ``heads``, ``q_len``, ``kv_len``, tiles computed in ``dtype`` on ``device``).
ScoreShape = Geometry


class TermBlock:
    """A term's view of one query block (queries ``qs:qe`` against keys ``key_lo:key_hi``), asked
    for the tiles the kernel computes and, in the backward, handed their score gradients."""

    #: True when the tiles are views of a buffer the block owns: a caller may write to them.
    writable: bool = False

    def tile(self, ks: int, ke: int) -> Tensor:
        """The term for keys ``ks:ke``: float, broadcastable to ``(B, H, rows, ke-ks)``."""
        raise NotImplementedError

    def backward(self, ks: int, ke: int, ds: Tensor, row0: int) -> None:
        """Take ``d loss / d term`` ``(B, H, r, ke-ks)`` for the block's rows ``row0:row0+r``.
        ``ds`` is the block's own: nothing else writes to it, so it may be kept until
        :meth:`flush`."""
        raise NotImplementedError

    def flush(self) -> None:
        """Every tile of the block has been handed back: add the gradients up."""


class ScoreTerm:
    """An additive term of the attention scores that attnkit computes tile by tile.

    Subclasses implement :meth:`tile` (and :meth:`inputs` if gradients should reach tensors);
    :meth:`block` and :meth:`dense` have defaults built on it. The term is added to the scaled
    scores after ``softcap`` and before the mask, like ``bias``.

    Its values follow ``bias``'s rule: ``-inf`` masks that pair; NaN or ``+inf`` at a pair the mask
    leaves visible is a ``ValueError`` when the term's inputs, q and k are finite (a NaN the inputs
    bring is a NaN in the call's inputs: it reaches the outputs that depend on it). What a term
    holds at masked pairs never matters.
    """

    def inputs(self) -> tuple[Tensor, ...]:
        """The tensors the term reads; ``attention()`` returns their gradients. Default: none."""
        return ()

    def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The term for queries at key positions ``q_pos`` ``(rows, 1)`` and keys ``k_pos``
        ``(1, keys)`` (int64), as a float tensor broadcastable to ``(B, H, rows, keys)``.

        Compute it from ``inputs`` (which are :meth:`inputs`, or stand-ins for them while the
        gradients are computed), with differentiable tensor operations.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement tile()")

    def block(
        self,
        inputs: tuple[Tensor, ...],
        shape: ScoreShape,
        qs: int,
        qe: int,
        key_lo: int,
        key_hi: int,
        *,
        grads: list[Tensor | None] | None,
    ) -> TermBlock:
        """The term for the queries ``qs:qe``, whose tiles all lie in keys ``key_lo:key_hi``.

        With ``grads`` (one entry per input, None until something is added), the block adds the
        inputs' gradients there in :meth:`TermBlock.flush`. The default computes each tile with
        :meth:`tile` and its gradients with autograd.
        """
        return _TileBlock(self, inputs, shape, qs, qe, grads)

    def dense(self, inputs: tuple[Tensor, ...], shape: ScoreShape) -> Tensor:
        """The whole term ``(B|1, H|1, Tq, Tk)``, differentiable (the reference backend's form)."""
        out = self.tile(
            inputs, shape.q_positions(0, shape.q_len), shape.k_positions(0, shape.kv_len)
        )
        return _checked(self, out, shape, shape.q_len, shape.kv_len)

    def describe(self) -> str:
        """A few words for :func:`attnkit.explain`."""
        return type(self).__name__

    def check(self, shape: ScoreShape) -> None:
        """Refuse (``ValueError``) a call of ``shape`` the term cannot serve, before any kernel
        reads it. Default: refuses none."""

    def __repr__(self) -> str:
        return self.describe()


# Caps up to these (in the dtype the scores are computed in) are computed as 2c sigmoid(2x/c) - c,
# a fraction of tanh's cost on CPUs. That form is off by about c times the float epsilon whatever x,
# so larger caps take c tanh(x/c), whose error is that of x: below these limits the sigmoid form's
# error stays several times inside the tolerances of attnkit.testing (float32 2e-5, float64 1e-10).
_SIGMOID_CAPS = {torch.float32: 64.0, torch.float64: 65536.0}


class Softcap(NamedTuple):
    """How a call's scores are capped in their work dtype: ``cap`` is the cap computed with, and
    ``sigmoid`` whether as ``2 cap sigmoid(2x / cap) - cap`` (else ``cap * tanh(x / cap)``)."""

    cap: float
    sigmoid: bool


def softcap_form(softcap: float, dtype: torch.dtype) -> Softcap | None:
    """How ``softcap * tanh(s / softcap)`` is computed exactly for scores in ``dtype``, for any
    ``softcap > 0``; None: as no cap.

    A cap above the dtype's largest number is no cap: it moves a score by ``s^3 / (3 cap^2)``,
    which changes a weight only where scores sit far above 1e30, and there the spacing of the
    dtype's numbers already makes the softmax pick the largest. A cap below the dtype's smallest
    normal number is computed as that number: every capped score then rounds to 0 beside the
    others (the weights are uniform over the visible keys either way). A cap above half the
    largest number is computed as that half, so that capped scores stay finite in the kernels'
    base 2 (times ``log2(e)``): scores that large are at least ~1e23 apart where they differ, and
    the softmax gives the largest all the weight under either cap.
    """
    info = torch.finfo(dtype)
    if softcap > info.max:
        return None
    cap = min(max(softcap, info.tiny), info.max / 2)
    return Softcap(cap, 1.0 <= cap <= _SIGMOID_CAPS.get(dtype, 0.0))


def cap_scores(s: Tensor, softcap: float) -> Tensor:
    """``softcap * tanh(s / softcap)``, exact for any ``softcap > 0`` (see ``softcap_form``)."""
    form = softcap_form(softcap, s.dtype)
    return s if form is None else form.cap * torch.tanh(s / form.cap)


def term_error(term: ScoreTerm) -> ValueError:
    """The error for a term that gave NaN or +inf at a visible pair although its inputs (and q and
    k) were finite."""
    return ValueError(
        f"bias: {term.describe()}.tile() returned NaN or +inf at a pair the mask leaves visible, "
        "from finite inputs: a score term may hold -inf (that pair is then masked) but not NaN or "
        "+inf, which would make the softmax undefined"
    )


def reused(
    store: dict[str, Tensor],
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """A ``shape`` view of the buffer ``store`` keeps under ``name``, replaced when too small.

    The blocks of one call reuse their work tensors this way: a fresh multi-MiB allocation per
    block costs page faults, and a GEMM and the passes after it run measurably faster in a buffer
    that stays in place. The view's contents are gone at the next request of ``name``.
    """
    numel = math.prod(shape)
    flat = store.get(name)
    if flat is None or flat.numel() < numel or flat.dtype != dtype or flat.device != device:
        flat = torch.empty(numel, dtype=dtype, device=device)
        store[name] = flat
    return flat[:numel].view(shape)


def _checked(term: ScoreTerm, t: object, shape: ScoreShape, rows: int, keys: int) -> Tensor:
    want = (shape.batch, shape.heads, rows, keys)
    if not isinstance(t, Tensor) or not t.is_floating_point():
        got = str(t.dtype).removeprefix("torch.") if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"bias: {term.describe()}.tile() must return a float tensor, got {got}")
    if t.ndim > 4 or any(
        not one_or(s, w) for s, w in zip(reversed(t.shape), reversed(want), strict=False)
    ):
        raise ValueError(
            f"bias: {term.describe()}.tile() returned {shape_str(t.shape)}, which does not "
            f"broadcast to (B, H, rows, keys) = {shape_str(want)}"
        )
    return t.reshape((1,) * (4 - t.ndim) + tuple(t.shape)).to(shape.dtype)


class _TileBlock(TermBlock):
    """The default block: :meth:`ScoreTerm.tile` per tile, gradients by autograd per tile."""

    def __init__(
        self,
        term: ScoreTerm,
        inputs: tuple[Tensor, ...],
        shape: ScoreShape,
        qs: int,
        qe: int,
        grads: list[Tensor | None] | None,
    ) -> None:
        self.term, self.shape, self.grads = term, shape, grads
        self.inputs = inputs
        self.q_pos = shape.q_positions(qs, qe)

    def tile(self, ks: int, ke: int) -> Tensor:
        with torch.no_grad():
            t = self.term.tile(self.inputs, self.q_pos, self.shape.k_positions(ks, ke))
        return _checked(self.term, t, self.shape, self.q_pos.size(0), ke - ks)

    def backward(self, ks: int, ke: int, ds: Tensor, row0: int) -> None:
        if self.grads is None:
            return
        wanted = [i for i, x in enumerate(self.inputs) if x.requires_grad]
        if not wanted:
            return
        with torch.enable_grad():
            live = tuple(
                x.detach().requires_grad_(x.requires_grad) if x.is_floating_point() else x
                for x in self.inputs
            )
            q_pos = self.q_pos[row0 : row0 + ds.size(-2)]
            t = self.term.tile(live, q_pos, self.shape.k_positions(ks, ke))
            t = _checked(self.term, t, self.shape, q_pos.size(0), ke - ks)
            got = torch.autograd.grad(
                t, [live[i] for i in wanted], ds.sum_to_size(t.shape), allow_unused=True
            )
        for i, g in zip(wanted, got, strict=True):
            if g is not None:
                old = self.grads[i]
                self.grads[i] = g if old is None else old + g


# --------------------------------------------------------------------------------------------------
# A bias by distance


class DistanceBias(ScoreTerm):
    """A bias that depends only on how far a key is from its query (and on the head, the batch
    row): ``table[..., (k_pos - q_pos) - first]``.

    T5's and Swin's learned relative biases, ALiBi and FlexAttention's ``score + table[q_idx -
    kv_idx]`` are all of this form. The ``(Tq, Tk)`` bias is never formed: a kernel reads the
    table by index arithmetic (the native kernel reads each row of a tile as one stretch of the
    table), and the table's gradient is the sum of the score gradients along each diagonal.

    Args:
        table: ``(L,)``, ``(H, L)`` or ``(B, H, L)`` (``B`` the call's batch dimensions flattened,
            either of ``B`` and ``H`` may be 1): entry ``x`` is the bias at distance ``first + x``.
        first: the distance of the table's first entry. Distances are ``k_pos - q_pos``, positions
            bottom-right aligned as everywhere in attnkit: with ``Tq == Tk``, key ``j`` is at
            distance ``j - i`` from query ``i``.

    The table must hold every distance of the call, ``-(Tk - 1)`` to ``Tq - 1``, including those the
    mask hides (their entries are read, then masked): a call it does not cover is a
    ``ValueError``.

    >>> import torch, attnkit
    >>> T, H = 6, 2
    >>> table = torch.randn(H, 2 * T - 1)                   # distances -(T-1) .. T-1
    >>> q, k, v = (torch.randn(1, H, T, 8) for _ in range(3))
    >>> lazy = attnkit.attention(q, k, v, bias=DistanceBias(table, first=-(T - 1)))
    >>> j = torch.arange(T)
    >>> dense = table[:, j[None, :] - j[:, None] + T - 1]   # (H, T, T)
    >>> torch.allclose(lazy, attnkit.attention(q, k, v, bias=dense), atol=1e-6)
    True
    """

    def __init__(self, table: Tensor, first: int) -> None:
        if not isinstance(table, Tensor) or not table.is_floating_point():
            got = str(table.dtype) if isinstance(table, Tensor) else type(table).__name__
            raise TypeError(f"DistanceBias: table must be a float tensor, got {got}")
        if not 1 <= table.ndim <= 3 or table.size(-1) == 0:
            raise ValueError(
                "DistanceBias: table must be (L,), (H, L) or (B, H, L) with L >= 1, got "
                f"{shape_str(table.shape)}"
            )
        self.table = table
        self.first = check_int("first", first, minimum=-INT_MAX)

    def inputs(self) -> tuple[Tensor, ...]:
        return (self.table,)

    def describe(self) -> str:
        return f"DistanceBias({shape_str(self.table.shape)} table from distance {self.first})"

    def check(self, shape: ScoreShape) -> None:
        """Refuse a call whose distances or heads the table does not cover."""
        lead = (1,) * (3 - self.table.ndim) + tuple(self.table.shape)
        for name, got, want in (("B", lead[0], shape.batch), ("H", lead[1], shape.heads)):
            if not one_or(got, want):
                raise ValueError(
                    f"bias: {self.describe()} has {name}={got}, the call {name}={want} (1 "
                    "broadcasts)"
                )
        if not shape.q_len or not shape.kv_len:
            return
        lo, hi = -(shape.kv_len - 1), shape.q_len - 1
        last = self.first + self.table.size(-1) - 1
        if self.first > lo or last < hi:
            raise ValueError(
                f"bias: {self.describe()} holds distances {self.first} to {last}, and the call "
                f"(Tq={shape.q_len}, Tk={shape.kv_len}) has distances {lo} to {hi}: the table must "
                "hold all of them (entries at distances the mask hides are read, then masked)"
            )

    def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
        (table,) = inputs
        return table[..., k_pos - q_pos - self.first]

    def block(
        self,
        inputs: tuple[Tensor, ...],
        shape: ScoreShape,
        qs: int,
        qe: int,
        key_lo: int,
        key_hi: int,
        *,
        grads: list[Tensor | None] | None,
    ) -> TermBlock:
        self.check(shape)
        return super().block(inputs, shape, qs, qe, key_lo, key_hi, grads=grads)

    def dense(self, inputs: tuple[Tensor, ...], shape: ScoreShape) -> Tensor:
        self.check(shape)
        return super().dense(inputs, shape)

    def layout(self, shape: ScoreShape, groups: int) -> list[int]:
        """Where the bias of ``(n, hk, g, i, j)`` (query ``i`` of ``Tq``, head ``hk * groups + g``)
        lies in the contiguous table: strides of the five indices (``-1`` and ``1`` for ``i`` and
        ``j``), then the element of ``(0, 0, 0, 0, 0)``."""
        self.check(shape)
        lead = (1,) * (3 - self.table.ndim) + tuple(self.table.shape)
        length = lead[2]
        heads = length if lead[1] > 1 else 0
        return [
            lead[1] * length if lead[0] > 1 else 0,
            heads * groups,
            heads,
            -1,
            1,
            -(shape.kv_len - shape.q_len) - self.first,
        ]


# --------------------------------------------------------------------------------------------------
# Transformer-XL's position term


# A query block's product of the position term spans at most this many distances when it is
# computed once for the block; wider ones are computed once per tile. A GEMM writing long rows runs
# markedly slower than one whose output stays in the CPU's caches, by more than the ``rows - 1``
# distances that each tile's window adds.
WHOLE_WIDTH = 2048


class _Skew(NamedTuple):
    """Where the tiles of one query block lie in the product ``qv[rows] @ enc[window]^T``.

    Tile element ``(r, c)`` for key ``key_lo + c`` is element ``offset + r * stride + c`` of the
    product of each head and batch row, read as a flat ``(rows, window)`` matrix. ``enc_lo`` may be
    negative and ``enc_hi`` past the table: those rows of the window are zero.
    """

    row_lo: int
    row_hi: int
    enc_lo: int
    enc_hi: int
    offset: int
    stride: int


def _check_relative_inputs(qv: object, enc: object, legacy: bool) -> tuple[Tensor, Tensor]:
    """``qv (B, H, Tq, Dh)`` and ``enc (H, P, Dh)`` if they are float tensors of one ``H`` and
    ``Dh`` (openspeech's ``enc``: ``P = Tq + 1``), else an error quoting their shapes."""
    for name, t in (("qv", qv), ("enc", enc)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            got = str(t.dtype) if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"RelativePositionTerm: {name} must be a float tensor, got {got}")
    if not isinstance(qv, Tensor) or not isinstance(enc, Tensor):  # for type checkers
        raise TypeError("RelativePositionTerm: qv and enc must be tensors")
    if qv.ndim != 4 or enc.ndim != 3 or not one_or(enc.size(0), qv.size(1)):
        wrong = True
    else:
        wrong = enc.size(2) != qv.size(3)
    if wrong:
        rows = "Tq + 1" if legacy else "P"
        raise ValueError(
            f"RelativePositionTerm: qv must be (B, H, Tq, Dh) and enc (H, {rows}, Dh) (or (1, "
            f"{rows}, Dh) for every head) with the same H and Dh, got qv {shape_str(qv.shape)} "
            f"and enc {shape_str(enc.shape)}"
        )
    if enc.size(0) != qv.size(1):  # one table for every head: each kernel reads (H, P, Dh)
        enc = enc.expand(qv.size(1), -1, -1)
    return qv, enc


def _check_term_scale(scale: object) -> float:
    """A term's ``scale``: a finite real number (a symbolic one under torch.compile)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.SymInt, torch.SymFloat)):
        raise TypeError(f"RelativePositionTerm: scale must be a float, got {scale!r}")
    if isinstance(scale, (int, float)) and not math.isfinite(scale):
        raise ValueError(f"RelativePositionTerm: scale must be finite, got {scale!r}")
    return scale  # type: ignore[return-value]


class RelativePositionTerm(ScoreTerm):
    """Transformer-XL's position term (Dai et al., 2019): ``scale * qv_i . R[i' - j]``.

    Args:
        qv: the position queries ``q + v`` ``(B, H, Tq, Dh)``.
        enc: the projected encodings ``(H, P, Dh)`` (or ``(1, P, Dh)``, one table for every
            head) of the distances ``max_distance``,
            ``max_distance - 1``, ..., ``max_distance - P + 1`` (largest first), where the distance
            of query ``i`` to key ``j`` is ``i' - j`` with ``i' = i + Tk - Tq``. A pair whose
            distance the table does not list gets a term of 0 (give the table every distance the
            mask leaves visible: with a sliding window only those of the window).
        scale: multiplies the term (the call's ``scale``).
        max_distance: the distance of ``enc``'s first row; default ``Tk - 1`` (the table lists
            ``Tk - 1`` down to ``1 - Tq``, ``Tq + Tk - 1`` rows).
        legacy: openspeech's variant: ``enc`` is ``(H, T + 1, Dh)``, the projected *absolute*
            encodings of positions ``0..T-1`` after a zero row, and the term is openspeech's
            pad-and-reshape shift of ``qv @ enc^T`` (self-attention only).
        whole_width: a query block whose product spans at most this many distances computes it
            once; a wider one computes it per tile's keys (0: always per tile). The result is the
            same; the default keeps the product in the CPU's caches.

    For a block of queries it multiplies ``qv`` by the rows of ``enc`` those queries can need
    (``keys + rows - 1`` of them; over long inputs, for each tile's keys separately, so that the
    product stays in the CPU's caches) and reads each tile as a strided view of that product, so
    neither ``(Tq, Tk)`` nor ``(Tq, Tk, Dh)`` tensors exist; its backward turns each tile's score
    gradient into gradients of ``qv`` and ``enc`` the same way.
    """

    def __init__(
        self,
        qv: Tensor,
        enc: Tensor,
        scale: float,
        *,
        max_distance: int | None = None,
        legacy: bool = False,
        whole_width: int = WHOLE_WIDTH,
    ) -> None:
        self.qv, self.enc = _check_relative_inputs(qv, enc, legacy)
        self.scale = _check_term_scale(scale)
        self.max_distance = max_distance
        self.legacy = legacy
        self.whole_width = check_int("whole_width", whole_width, minimum=0)
        self._buffers: dict[str, Tensor] = {}
        self._rows: tuple[Tensor, torch.dtype, Tensor] | None = None

    def inputs(self) -> tuple[Tensor, ...]:
        return self.qv, self.enc

    def describe(self) -> str:
        kind = "openspeech " if self.legacy else ""
        return f"{kind}relative position term ({self.enc.size(1)} distances)"

    def check(self, shape: ScoreShape) -> None:
        """Refuse a call whose batch rows (flattened), heads or queries ``qv`` does not match,
        or an openspeech term's call that is not self-attention over ``enc``'s ``T``."""
        want = (shape.batch, shape.heads, shape.q_len)
        # size by size with ==: sizes traced by torch.compile are compared by value
        if not all(got == size for got, size in zip(self.qv.shape[:3], want, strict=True)):
            raise ValueError(
                f"bias: {self.describe()}: qv must be (B, H, Tq, Dh) with (B, H, Tq) = "
                f"{shape_str(want)}, got {shape_str(self.qv.shape)}"
            )
        if self.legacy and (shape.q_len != shape.kv_len or self.enc.size(1) != shape.q_len + 1):
            raise ValueError(
                f"bias: {self.describe()} is for self-attention (Tq == Tk) with enc (H, T + 1, "
                f"Dh), got Tq = {shape.q_len}, Tk = {shape.kv_len} and enc "
                f"{shape_str(self.enc.shape)}"
            )

    def top(self, shape: ScoreShape) -> int:
        """The distance of ``enc``'s first row in a call of ``shape``: ``max_distance``, else
        ``Tk - 1``."""
        return shape.kv_len - 1 if self.max_distance is None else self.max_distance

    def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
        raise NotImplementedError(
            "RelativePositionTerm computes its tiles in block() and the whole term in dense()"
        )

    def buffer(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """A work tensor reused by the blocks of one call (see :func:`reused`)."""
        return reused(self._buffers, name, shape, dtype, device)

    def scaled_rows(self, qv: Tensor, dtype: torch.dtype) -> Tensor:
        """``scale * qv`` as ``(H, Tq, B, Dh)`` in ``dtype``, made once per call: every block's
        rows are then a view ``(H, rows * B, Dh)``, one GEMM per head against its window."""
        if self._rows is None or self._rows[0] is not qv or self._rows[1] != dtype:
            rows = torch.empty(
                qv.size(1), qv.size(2), qv.size(0), qv.size(3), dtype=dtype, device=qv.device
            )
            if qv.dtype == dtype:
                torch.mul(qv.permute(1, 2, 0, 3), self.scale, out=rows)
            else:  # a float16 product would be rounded before it reached rows
                rows.copy_(qv.permute(1, 2, 0, 3)).mul_(self.scale)
            self._rows = (qv, dtype, rows)
        return self._rows[2]

    def dense(self, inputs: tuple[Tensor, ...], shape: ScoreShape) -> Tensor:
        qv, enc = inputs
        b, h, tq, _ = qv.shape
        tk = shape.kv_len
        product = qv.to(shape.dtype) @ enc.to(shape.dtype).transpose(-1, -2).unsqueeze(0)
        if self.legacy:
            # openspeech's shift: the (T, T+1) rows, read as T+1 rows of T, lose their first row.
            return product.reshape(b, h, tq + 1, tk)[:, :, 1:] * self.scale  # (B, H, T, T)
        i = shape.q_positions(0, tq)  # (Tq, 1): i'
        j = shape.k_positions(0, tk)
        index = self.top(shape) - (i - j)  # row of enc holding distance i' - j
        found = (index >= 0) & (index < enc.size(1))
        column = index.clamp(0, max(0, enc.size(1) - 1)).expand(b, h, tq, tk)
        out = product.gather(-1, column) if enc.size(1) else product.new_zeros(b, h, tq, tk)
        return out.masked_fill(~found, 0.0) * self.scale  # (B, H, Tq, Tk)

    def block(
        self,
        inputs: tuple[Tensor, ...],
        shape: ScoreShape,
        qs: int,
        qe: int,
        key_lo: int,
        key_hi: int,
        *,
        grads: list[Tensor | None] | None,
    ) -> TermBlock:
        return _RelativeBlock(self, inputs, shape, qs, qe, key_lo, key_hi, grads)


class _RelativeBlock(TermBlock):
    """One query block of :class:`RelativePositionTerm`. Its product ``qv @ enc[window]^T`` is
    computed at the first tile, in a buffer shared by the blocks of one call: once for the block's
    whole key range, or once per tile's key range when the whole range spans more than
    ``whole_width`` distances."""

    writable = True

    def __init__(
        self,
        term: RelativePositionTerm,
        inputs: tuple[Tensor, ...],
        shape: ScoreShape,
        qs: int,
        qe: int,
        key_lo: int,
        key_hi: int,
        grads: list[Tensor | None] | None,
    ) -> None:
        self.term, self.shape, self.grads = term, shape, grads
        self.qv, self.enc = inputs
        self.n, self.h, _, self.dh = self.qv.shape
        self.qs, self.qe, self.bq = qs, qe, qe - qs
        self.whole = True  # one product for the block's whole key range
        if term.legacy:
            # Shifted row i is flat element T * (i + 1) + j of the padded (T, T + 1) product: it
            # reads the end of product row i and, above the diagonal, the start of row i + 1.
            t = shape.q_len
            self.key_lo = 0
            self.skew = _Skew(qs, min(qe + 1, t), 0, t + 1, t - qs, t)
        else:
            self._set_window(key_lo, key_hi)
            self.whole = self.width <= term.whole_width
        self._qv: Tensor | None = None
        self._product: Tensor | None = None
        self._grad: Tensor | None = None

    def _set_window(self, key_lo: int, key_hi: int) -> None:
        """Make the product's window the distances of keys ``key_lo:key_hi``."""
        # Window columns run from distance (qs' - key_lo)... : row of enc for query i, key j is
        # top - (i' - j); over the block it spans top - (qe-1)' + key_lo ... + width - 1. Rounded
        # up to 16 columns: GEMMs writing rows of an odd width run markedly slower.
        width = -(-((key_hi - key_lo) + self.bq - 1) // 16) * 16
        shift = self.shape.kv_len - self.shape.q_len
        lo = self.term.top(self.shape) - (self.qe - 1 + shift) + key_lo
        self.key_lo, self.key_hi = key_lo, key_hi
        self.skew = _Skew(self.qs, self.qe, lo, lo + width, self.bq - 1, width - 1)

    def _cover(self, ks: int, ke: int) -> None:
        """Per-tile products: make the window that of keys ``ks:ke`` (gradients of the previous
        window are added up first)."""
        if self.whole or (ks, ke) == (self.key_lo, self.key_hi):
            return
        self.flush()
        self._set_window(ks, ke)
        self._product = None

    @property
    def nrows(self) -> int:
        return self.skew.row_hi - self.skew.row_lo

    @property
    def width(self) -> int:
        return self.skew.enc_hi - self.skew.enc_lo

    def _qv_rows(self) -> Tensor:
        """``(H, N * rows, Dh)`` scaled position queries: one GEMM per head against its window.

        Rows are query-major (row ``r * N + n``), a view of :meth:`RelativePositionTerm.
        scaled_rows`; openspeech's shift reads past the end of a row into the next query's, so
        there they are batch-major (row ``n * rows + r``), a copy."""
        if self._qv is None:
            s = self.skew
            if self.term.legacy:
                rows = self.qv[:, :, s.row_lo : s.row_hi].transpose(0, 1).to(self.shape.dtype)
                self._qv = (rows * self.term.scale).reshape(self.h, self.n * self.nrows, self.dh)
            else:
                all_rows = self.term.scaled_rows(self.qv, self.shape.dtype)
                self._qv = all_rows[:, s.row_lo : s.row_hi].reshape(
                    self.h, self.nrows * self.n, self.dh
                )
        return self._qv

    def _window(self) -> tuple[Tensor, int, int]:
        """The rows of ``enc`` in the window that exist, and where they go in it."""
        s = self.skew
        lo, hi = max(s.enc_lo, 0), min(s.enc_hi, self.enc.size(1))
        return self.enc[:, lo:hi].to(self.shape.dtype), lo - s.enc_lo, max(lo, hi) - s.enc_lo

    def _view(self, full: Tensor, ks: int, ke: int) -> Tensor:
        """The ``(N, H, bq, ke-ks)`` tile of a ``(H, rows * N, W)`` product, without a copy.

        Tile element ``(r, c)`` of a batch row and head is element ``offset + r * stride + c`` of
        that row's ``(rows, W)`` product read flat (the skew): with query-major rows, row ``r`` of
        batch row ``n`` starts at ``(r * N + n) * W``."""
        s = self.skew
        start = s.offset + (ks - self.key_lo)
        n, w = self.n, self.width
        plane = self.nrows * n * w
        if self.term.legacy:
            strides = (self.nrows * w, plane, s.stride, 1)
        else:
            strides = (w, plane, s.stride + (n - 1) * w, 1)
        last = start + (self.bq - 1) * strides[2] + (n - 1) * strides[0] + (ke - ks)
        if start < 0 or last > plane:
            # as_strided does not check bounds: never let a wrong skew read past the product.
            raise RuntimeError("attnkit internal error: relative-position tile out of bounds")
        return full.as_strided(
            (n, self.h, self.bq, ke - ks), strides, full.storage_offset() + start
        )

    def tile(self, ks: int, ke: int) -> Tensor:
        self._cover(ks, ke)
        if self._product is None:
            window, a, b = self._window()
            shape = (self.h, self.nrows * self.n, self.width)
            out = self.term.buffer("product", shape, self.shape.dtype, self.qv.device)
            if (a, b) != (0, self.width):
                # Part of the window lies outside the table: those distances get 0, from zero
                # rows (a GEMM into a column slice of the product would be far slower).
                size = (window.size(0), self.width, window.size(2))
                padded = self.term.buffer("window", size, window.dtype, window.device)
                padded[:, :a] = 0.0
                padded[:, b:] = 0.0
                padded[:, a:b] = window
                window = padded
            torch.bmm(self._qv_rows(), window.transpose(1, 2), out=out)
            self._product = out
        return self._view(self._product, ks, ke)

    def backward(self, ks: int, ke: int, ds: Tensor, row0: int) -> None:
        if self.grads is None:
            return
        self._cover(ks, ke)
        if self._grad is None:
            shape = (self.h, self.nrows * self.n, self.width)
            self._grad = self.term.buffer("grad", shape, self.shape.dtype, self.qv.device).zero_()
        self._view(self._grad, ks, ke)[:, :, row0 : row0 + ds.size(-2)].add_(ds)

    def flush(self) -> None:
        grads, grad = self.grads, self._grad
        if grads is None or grad is None:
            return
        s = self.skew
        window, a, b = self._window()
        if self.qv.requires_grad:
            dqv = torch.bmm(grad[:, :, a:b], window).mul_(self.term.scale)  # (H, rows, Dh)
            if self.term.legacy:  # batch-major rows
                dqv = dqv.view(self.h, self.n, self.nrows, self.dh).transpose(0, 1)
            else:  # query-major rows
                dqv = dqv.view(self.h, self.nrows, self.n, self.dh).permute(2, 0, 1, 3)
            dqv_all = grads[0]
            if dqv_all is None:
                dqv_all = grads[0] = torch.zeros(
                    self.qv.shape, dtype=self.shape.dtype, device=dqv.device
                )
            # += and not =: openspeech's rows overlap the next block's first row.
            dqv_all[:, :, s.row_lo : s.row_hi] += dqv
        if self.enc.requires_grad and b > a:
            denc = grads[1]
            if denc is None:
                denc = grads[1] = torch.zeros(
                    self.enc.shape, dtype=self.shape.dtype, device=self.enc.device
                )
            lo = s.enc_lo + a
            denc[:, lo : lo + (b - a)].baddbmm_(grad[:, :, a:b].transpose(1, 2), self._qv_rows())
        self._grad = None


def encode_term(
    term: ScoreTerm | None, tensors: list[Tensor], numbers: list[object] | None = None
) -> str | None:
    """``term`` as text (its kind and numbers, JSON), its inputs appended to ``tensors``: how a
    score term crosses into attnkit's operator in compiled and exported graphs (see
    :func:`attnkit.masks.encode`). None for a term that text cannot carry (a term class of one's
    own, openspeech's variant of the position term); ``numbers``: as for masks.

    >>> tensors = []
    >>> encode_term(DistanceBias(torch.zeros(2, 9), first=-4), tensors), len(tensors)
    ('["distance",-4]', 1)
    """
    if term is None:
        return "null"
    if type(term) is DistanceBias:
        tensors.append(term.table)
        return spec_text(["distance", term.first], numbers)
    if type(term) is RelativePositionTerm and not term.legacy:
        tensors += [term.qv, term.enc]
        scale = term.scale if isinstance(term.scale, torch.SymFloat) else float(term.scale)
        return spec_text(["relative", scale, term.max_distance, term.whole_width], numbers)
    return None


def decode_term(
    text: str, tensors: list[Tensor], numbers: Sequence[object] = ()
) -> ScoreTerm | None:
    """The score term :func:`encode_term` wrote as ``text`` with ``tensors`` and ``numbers``."""
    tree = spec_read(text, numbers)
    if tree is None:
        return None
    if not isinstance(tree, list) or not tree:
        raise ValueError(f"not an encoded score term: {text!r}")
    kind, *args = tree
    if kind == "distance":
        return DistanceBias(tensors[0], args[0])
    if kind == "relative":
        scale, top, whole = args
        return RelativePositionTerm(
            tensors[0], tensors[1], scale, max_distance=top, whole_width=whole
        )
    raise ValueError(f"not an encoded score term: {text!r}")
