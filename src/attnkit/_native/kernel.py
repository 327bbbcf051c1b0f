"""A call in the native kernel's terms: the block plan as index tensors, the mask as arithmetic.

The native kernel reads the same :class:`~attnkit._kernel.plan.Plan` as the eager one (its EMPTY
blocks are not in it, its FULL blocks do no mask work) and sees a partial block's mask in one of
three forms, the cheapest that is exact: a band ``lo <= j - (i + shift) <= hi`` (causal, sliding
windows), per-key flags (key padding), both for a band and key flags joined by ``&``, or else bool
tiles asked of the mask here, once per partial block of the plan. Packed documents (the same in
every batch row) need no mask at all: a block they cut becomes one FULL visit per document in it,
its rows and keys restricted to that document. A band alone is cut at its own edges rather than
at key blocks (see :func:`_band_visits`). Its forward takes the query blocks in the plan's
order (:attr:`~attnkit.BlockPlan.stretch`).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._call import AttentionCall
from .._kernel import BlockPlan, Plan, QueryBlock, Visit
from .._kernel.plan import int64_tensor, query_stretch
from ..masks import Geometry, Mask
from ..scores import DistanceBias, RelativePositionTerm, ScoreTerm, softcap_form
from . import load, status
from .ops import no_graph

__all__ = [
    "DECODE_QUERIES",
    "REDUCED",
    "NativeCall",
    "block_plan",
    "decodes",
    "fuses",
    "native_call",
    "refusal",
    "why_not_native",
]

#: The dtypes of keys and values that the native kernel reads as they are, computing in float32.
REDUCED = (torch.bfloat16, torch.float16)

#: A call of at most this many queries, all in one query block, runs on the native kernel's decode
#: path (``csrc/decode.cpp``, its ``kDecodeQueries``): split across threads by keys, each key/value
#: head's keys and values read once for all its query heads, NaN and inf in q, k and v handled
#: without reading them beforehand.
DECODE_QUERIES = 16


def cpu_has(check: str) -> bool:
    """torch.cpu's ``check`` (``"_is_amx_tile_supported"``...; absent: no), where torch runs its
    AVX-512 kernels: the native kernel's bfloat16 products are in that build alone (see
    csrc/matrix_unit.h), and so are torch's own on the matrix unit."""
    try:
        avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    except (AttributeError, RuntimeError):
        avx512 = False
    return avx512 and bool(getattr(torch.cpu, check, lambda: False)())


# Whether this CPU has a matrix unit for bfloat16 (AMX tiles), read once: the kernel runs a
# bfloat16 call's products there (see csrc/matrix_unit.h).
MATRIX_UNIT = cpu_has("_is_amx_tile_supported")
# Whether it has AVX512-BF16 (every CPU with AMX has): without the matrix unit the kernel runs
# those products as AVX512-BF16's dot products (AMD's Zen 4 on, Intel's Cooper Lake).
BF16_DOT = cpu_has("_is_avx512_bf16_supported")
#: Where the native kernel runs a bfloat16 call's products (products of bfloat16 summed in
#: float32), in words; None: in float32, on bfloat16 converted to float32.
BF16_PRODUCTS = (
    "the CPU's matrix unit (AMX)"
    if MATRIX_UNIT
    else "AVX512-BF16's dot products"
    if BF16_DOT
    else None
)


def decodes(plan: BlockPlan) -> bool:
    """Whether the native kernel runs a call of this plan on its decode path."""
    return plan.q_len <= min(plan.block_q, DECODE_QUERIES)


def fuses(term: ScoreTerm | None, geo: Geometry | None = None) -> bool:
    """Whether the native kernel computes a score term itself: Transformer-XL's position term
    (:class:`~attnkit.scores.RelativePositionTerm`, not openspeech's variant) with ``qv`` of shape
    ``(B, H, Tq, Dh)`` for the call's ``geo``, whose product ``qv @ enc^T`` the kernel takes per
    block over the block's distances and reads with the shift as index arithmetic; or a bias by
    distance (:class:`~attnkit.scores.DistanceBias`), read as a bias whose rows are stretches of
    its table."""
    if term is None or isinstance(term, DistanceBias):
        return True
    if not isinstance(term, RelativePositionTerm) or term.legacy:
        return False
    qv, enc = term.qv, term.enc
    if qv.dim() != 4 or enc.dim() != 3 or qv.size(-1) != enc.size(-1):
        return False
    return geo is None or (tuple(qv.shape[:3]) == (geo.batch, geo.heads, geo.q_len))


def refusal(
    *,
    native: bool,
    device: torch.device,
    term: ScoreTerm | None,
    score_mod: bool,
    finite: bool | None,
    geo: Geometry | None,
    build: bool,
) -> str | None:
    """The one decision of which kernel serves a call: None when the native kernel does, else
    the words for the eager kernel and why (what ``explain()`` prints, what
    :attr:`attnkit.Dispatch.kernel` records). ``finite``: whether q, k, v (and the term's inputs)
    are finite (None: not known yet); ``build``: load the kernel, building it if needed (when a
    call is about to run), or only ask whether it would be available (questions never build)."""
    if not native:
        return "the eager kernel (Chunked(native=False))"
    if device.type != "cpu":
        return f"the eager kernel (the native kernel runs on CPUs, not {device.type})"
    if term is not None and not fuses(term, geo):
        return f"the eager kernel (the native kernel does not fuse the score term {term!r})"
    if score_mod:
        return "the eager kernel (the native kernel does not fuse a score_mod)"
    if finite is False:
        return "the eager kernel (non-finite values in q/k/v)"
    if build and load():
        return None
    available, why = status()
    return None if available and not build else f"the eager kernel (native kernel: {why})"


def why_not_native(call: AttentionCall, native: bool = True) -> str | None:
    """:func:`refusal` for a described call, without building anything."""
    return refusal(
        native=native,
        device=call.device,
        term=call.score_term,
        score_mod=call.score_mod is not None,
        finite=call.finite,
        geo=call.geometry,
        build=False,
    )


@dataclass(frozen=True)
class NativeCall:
    """One call's plan and mask in the native kernel's terms (built once, used by the forward
    and the backward): the arguments of ``torch.ops.attnkit.native_forward`` besides the
    call's tensors."""

    plan: BlockPlan
    scale: float
    softcap: float  # 0: none
    p_drop: float
    seed: int
    #: the position term's (scale, distance of enc's first row, whole_width), or None
    position: tuple[float, int, int] | None = None
    #: a bias by distance's layout in its table (see DistanceBias.layout), or [] for none
    layout: tuple[int, ...] = ()
    #: how the kernel runs its products (the same numbers to rounding): float32 products in its
    #: own register tiles rather than the BLAS, and the position term along the diagonals of
    #: the scores rather than per block's window of distances (both where the build has AVX-512).
    #: register_tiles also lets a bfloat16 call run its products as bfloat16 (BF16_PRODUCTS:
    #: the CPU's matrix unit, AMX, or AVX512-BF16), with the probabilities rounded to bfloat16 for
    #: ``p v``; False keeps them float32.
    register_tiles: bool = True
    skewed_position: bool = True

    # The plan's parts, as the operators take them.
    @property
    def off(self) -> Tensor:
        return self.plan.offsets

    @property
    def visits(self) -> Tensor:
        return self.plan.visits

    @property
    def block_q(self) -> int:
        return self.plan.block_q

    @property
    def block_k(self) -> int:
        return self.plan.block_k

    @property
    def band(self) -> list[float]:
        return [] if self.plan.band is None else [float(x) for x in self.plan.band]

    @property
    def shift(self) -> int:
        return self.plan.shift

    @property
    def key_ok(self) -> Tensor | None:
        return self.plan.key_ok

    @property
    def tiles(self) -> Tensor | None:
        return self.plan.tiles

    def settings(self) -> dict[str, object]:
        """The operators' keyword arguments for this call."""
        rel_scale, top, whole = self.position if self.position is not None else (0.0, 0, 0)
        return {
            "block_q": self.block_q,
            "block_k": self.block_k,
            "scale": self.scale,
            "softcap": self.softcap,
            "bias_layout": list(self.layout),
            "band": list(self.band),
            "shift": self.shift,
            "stretch": self.plan.stretch,
            "dropout_p": self.p_drop,
            "seed": self.seed,
            "rel_scale": rel_scale,
            "rel_top": top,
            "whole_width": whole,
            "register_tiles": self.register_tiles,
            "skewed_position": self.skewed_position,
        }

    def reads_as_is(self, dtype: torch.dtype, backward: bool = False) -> bool:
        """Whether the kernel takes keys and values of ``dtype`` as they are: in the forward
        bfloat16 and float16, half the bytes of float32, converted to float32 in registers (the
        decode path) or block by block (the blocked forward), or multiplied as they are where
        the CPU has bfloat16 products (BF16_PRODUCTS); in the backward bfloat16, for those (the
        kernel otherwise converts them). Their gradients come in float32."""
        return dtype in REDUCED and (not backward or dtype == torch.bfloat16)

    def tensors(
        self,
        q5: Tensor,
        k4: Tensor,
        v4: Tensor,
        bias5: Tensor | None,
        term_inputs: tuple[Tensor, ...],
        backward: bool = False,
        reduced_out: bool = False,
    ) -> tuple[Tensor | None, ...]:
        """The operators' positional tensors, with contiguous rows: ``(q, k, v, offsets, visits,
        bias, key_ok, tiles, qv, enc)``, all in the work dtype but bfloat16/float16 keys and
        values that the forward reads as they are (see :meth:`reads_as_is`), and with
        ``reduced_out`` bfloat16 queries with such keys and values: the forward then gives its
        output in bfloat16 (no float32 copy of the queries or the output)."""
        work = torch.promote_types(q5.dtype, torch.float32)
        kv = k4.dtype if self.reads_as_is(k4.dtype, backward) and v4.dtype == k4.dtype else work
        reduced = reduced_out and not backward and q5.dtype == kv == torch.bfloat16
        qv = enc = None
        if self.position is not None:
            qv, enc = _rows(term_inputs[0], work), _rows(term_inputs[1], work)
        bias = None if bias5 is None else bias5.to(work)
        if self.layout:  # a bias by distance: its table
            bias = term_inputs[0].to(work).contiguous()
        return (
            _rows(q5, torch.bfloat16 if reduced else work),
            _rows(k4, kv),
            _rows(v4, kv),
            self.off,
            self.visits,
            bias,
            self.key_ok,
            self.tiles,
            qv,
            enc,
        )

    def forward(
        self,
        q5: Tensor,
        k4: Tensor,
        v4: Tensor,
        bias5: Tensor | None,
        term_inputs: tuple[Tensor, ...] = (),
        reduced_out: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """``(out5, lse)`` in the work dtype, as :func:`attnkit._kernel.forward` returns them
        (``term_inputs``: the position term's ``(qv, enc)``, or a bias by distance's table);
        with ``reduced_out``, out5 in bfloat16 when q, k and v are (see :meth:`tensors`)."""
        if not load():
            raise RuntimeError("attnkit internal error: native call without the native kernel")
        args = self.tensors(q5, k4, v4, bias5, term_inputs, reduced_out=reduced_out)
        with no_graph(args):
            out, lse = torch.ops.attnkit.native_forward(*args, **self.settings())
        return out, lse

    def backward(
        self,
        q5: Tensor,
        k4: Tensor,
        v4: Tensor,
        bias5: Tensor | None,
        dout5: Tensor,
        lse: Tensor,
        delta: Tensor,
        bias_grad: bool,
        term_inputs: tuple[Tensor, ...] = (),
        term_grads: tuple[bool, ...] = (),
        grads_out: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, list[Tensor | None]]:
        """``(dq5, dk4, dv4, dbias5, dterm)`` in the work dtype (``dbias5`` in ``bias5``'s shape;
        ``dterm``: the gradients of ``term_inputs`` that ``term_grads`` asks for, else None).
        ``grads_out``: tensors of q5's, k4's and v4's shapes to write dq5, dk4 and dv4 into (used
        when the inputs are in the work dtype with contiguous rows)."""
        if not load():
            raise RuntimeError("attnkit internal error: native call without the native kernel")
        work = torch.promote_types(q5.dtype, torch.float32)
        qv_grad, enc_grad = term_grads if self.position is not None else (False, False)
        table_grad = bool(self.layout) and term_grads[0]
        args = self.tensors(q5, k4, v4, bias5, term_inputs, backward=True)
        own = grads_out is not None and all(
            a is b for a, b in zip(args[:3], (q5, k4, v4), strict=True)
        )
        head = (_rows(dout5, work), lse.to(work).contiguous(), delta.to(work).contiguous())
        flags = {
            "bias_grad": table_grad or (bias_grad and bias5 is not None),
            "qv_grad": qv_grad,
            "enc_grad": enc_grad,
        }
        if own and grads_out is not None:
            dq, dk, dv = grads_out
            dbias, dqv, denc = torch.ops.attnkit.native_backward_into(
                *head, dq, dk, dv, *args, **self.settings(), **flags
            )
        else:
            dq, dk, dv, dbias, dqv, denc = torch.ops.attnkit.native_backward(
                *head, *args, **self.settings(), **flags
            )
        # dbias is already in bias5's shape (a bias by distance's: in its table's)
        asked = flags["bias_grad"]
        dterm: list[Tensor | None] = []
        if self.position is not None:
            dterm = [dqv if qv_grad else None, denc if enc_grad else None]
        elif self.layout:
            dterm, dbias = [dbias if table_grad else None], None
        return dq, dk, dv, (dbias if asked and not self.layout else None), dterm


def _rows(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype`` with contiguous rows (its last dimension), at any other strides: the
    kernel reads rows at their stride, so a ``(B, T, H, D)`` view needs no copy."""
    t = t.to(dtype)
    unit = t.stride(-1) == 1 or t.size(-1) <= 1
    apart = t.dim() < 2 or t.size(-2) <= 1 or t.stride(-2) >= max(t.size(-1), 1)
    return t if unit and apart else t.contiguous()


def _mask_form(
    mask: Mask | None, geo: Geometry, rect: tuple[int, int, int, int]
) -> tuple[list[float], Tensor | None, bool]:
    """``(band, key flags, needs tiles)`` for a mask on the rectangle ``rect = (q_start, q_len,
    k_start, kv_len)`` of the call's scores (see the module's docstring)."""
    q0, nq, k0, nk = rect
    if mask is None or nk == 0 or nq == 0:  # no pair to mask
        return [], None, False
    parts = mask.parts if mask.op == "and" else (mask,)
    bands = [m for m in parts if m.band is not None]
    keyed = [m for m in parts if m.band is None and m.keys_only]
    if len(bands) > 1 or len(bands) + len(keyed) != len(parts):
        return [], None, True
    band: list[float] = []
    if bands:
        lo, hi = bands[0].distances(geo)
        band = [float(lo), float(hi)]
    key_ok = None
    for m in keyed:
        # The first query's tile: a keys-only mask may still differ between heads (a dense
        # (H, 1, Tk) mask), which key flags cannot say.
        t = m.tile(geo, q0, q0 + 1, k0, k0 + nk)
        t = t.reshape((1,) * (4 - t.ndim) + tuple(t.shape))
        if t.size(1) != 1:
            return [], None, True
        flags = t[:, 0, 0, :].expand(t.size(0), nk)
        key_ok = flags if key_ok is None else key_ok & flags
    if key_ok is not None:
        key_ok = key_ok.to(torch.uint8).contiguous()
    return band, key_ok, False


def _document_starts(mask: Mask | None, geo: Geometry) -> list[int] | None:
    """Where documents start (then Tk) when ``mask`` is packed documents, each one run of
    positions, the same in every batch row; else None."""
    if mask is None or mask.op is not None or geo.kv_len == 0 or geo.q_len == 0:
        return None
    starts = mask.document_starts()
    if starts is None or any(row != starts[0] for row in starts[1:]):
        return None
    return starts[0]


def _document_visits(v: Visit, qs: int, shift: int, starts: list[int]) -> list[list[int]]:
    """A partial visit of packed documents as the FULL rectangles of the documents it cuts: the
    rows of query block ``qs`` and the keys that one document holds (query ``i`` is in the
    document of key ``i + shift``)."""
    out = []
    first = max(bisect.bisect_right(starts, v.ks) - 1, 0)
    for d in range(first, len(starts) - 1):
        a, b = starts[d], starts[d + 1]
        if a >= v.ke:
            break
        r0, r1 = max(v.r0, a - shift - qs), min(v.r1, b - shift - qs)
        ks, ke = max(v.ks, a), min(v.ke, b)
        if r0 < r1 and ks < ke:
            out.append([ks, ke, r0, r1, 0, -1])
    return out


def _documents_and_band(mask: Mask | None, geo: Geometry) -> tuple[list[float], list[int] | None]:
    """``(band, document starts)`` when ``mask`` is packed documents (as in
    :func:`_document_starts`) ``&`` one band, else ``([], None)``."""
    if mask is None or mask.op != "and" or len(mask.parts) != 2:
        return [], None
    bands = [m for m in mask.parts if m.band is not None]
    others = [m for m in mask.parts if m.band is None]
    if len(bands) != 1 or len(others) != 1:
        return [], None
    starts = _document_starts(others[0], geo)
    if starts is None:
        return [], None
    lo, hi = bands[0].distances(geo)
    return [float(lo), float(hi)], starts


def _clip_to_band(visit: list[int], qs: int, band: list[float], shift: int) -> list[int] | None:
    """A FULL visit of one document under a band: its rows that see some of its keys, partial
    unless the band holds all its pairs (None: it holds none)."""
    ks, ke, r0, r1, _, _ = visit
    lo, hi = band
    # Row i (diagonal i + shift) sees key j iff lo <= j - (i + shift) <= hi.
    if not math.isinf(hi):
        r0 = max(r0, math.ceil(ks - hi - shift - qs))
    if not math.isinf(lo):
        r1 = min(r1, math.floor(ke - 1 - lo - shift - qs) + 1)
    if r0 >= r1:
        return None
    first, last = qs + r0 + shift, qs + r1 - 1 + shift
    full = ks - last >= lo and ke - 1 - first <= hi
    return [ks, ke, r0, r1, 0 if full else 1, -1]


# Visits of a band are cut at multiples of this many keys where they can be: the kernel's rows
# are then whole vectors (16 float32 lanes of AVX-512), without scalar tails.
_ALIGN = 16


def _band_visits(qb: QueryBlock, band: list[float], shift: int, block_k: int) -> list[list[int]]:
    """A query block's visits under a band alone, cut at the band's own edges instead of at key
    blocks: the keys every row sees as FULL visits of at most ``block_k`` keys, split evenly, and
    the two triangles at the band's edges (each about one block's rows wide) as partial ones,
    cut into stretches of rows (see below), every visit's rows those that see some of its keys;
    the cuts are rounded outwards to multiples of ``_ALIGN`` keys."""
    if not qb.visits:
        return []
    lo, hi = band
    width = math.inf if math.isinf(lo) or math.isinf(hi) else hi - lo + 1  # keys a row may see
    k0, k1 = qb.key_range
    r0 = min(v.r0 for v in qb.visits)
    r1 = max(v.r1 for v in qb.visits)
    i0, i1 = qb.qs + r0 + shift, qb.qs + r1 - 1 + shift  # the rows' diagonals, first and last

    def left(i: int) -> int:  # row i's first visible key, at least k0
        return k0 if math.isinf(lo) else max(k0, math.ceil(i + lo))

    def right(i: int) -> int:  # one past row i's last visible key, at most k1
        return k1 if math.isinf(hi) else min(k1, math.floor(i + hi) + 1)

    def down(x: int) -> int:
        return max(k0, x - x % _ALIGN)

    def up(x: int) -> int:
        return min(k1, x + (-x) % _ALIGN)

    # Keys seen by some row: [first, last); by every row: [full0, full1) (maybe empty).
    first, last = down(left(i0)), up(right(i1))
    full0, full1 = up(max(first, left(i1))), down(min(last, right(i0)))
    if full0 >= full1:
        full0 = full1 = last
    out = []
    for a, b, partial in ((first, full0, 1), (full0, full1, 0), (full1, last, 1)):
        ks = a
        while ks < b:
            pieces = -(-(b - ks) // block_k)  # what is left, in even pieces of <= block_k keys
            ke = ks + -(-(b - ks) // pieces)
            if ke < b and ke - ke % _ALIGN > ks:
                ke -= ke % _ALIGN
            # Rows that see a key of ks:ke: diagonal + hi >= ks and diagonal + lo <= ke - 1.
            lo_row = r0 if math.isinf(hi) else max(r0, math.ceil(ks - hi - shift - qb.qs))
            hi_row = r1 if math.isinf(lo) else min(r1, math.floor(ke - 1 - lo - shift - qb.qs) + 1)
            if not partial or hi_row - lo_row < 2 * _ALIGN:
                if lo_row < hi_row:
                    out.append([ks, ke, lo_row, hi_row, partial, -1])
            else:
                # A triangle: stretches of its rows, each over the keys it sees, which skips
                # most of its masked pairs. Stretches of _ALIGN rows (the keys' alignment) at
                # the finest; fewer for a narrow band, whose rows do too little work to pay for
                # more visits: one stretch per 64 keys of the band's width.
                finest = (hi_row - lo_row) // _ALIGN
                n = finest if math.isinf(width) else int(min(finest, max(2, width // 64)))
                cuts = [lo_row + (hi_row - lo_row) * x // n for x in range(n + 1)]
                for ra, rb in itertools.pairwise(cuts):
                    ka = max(ks, down(left(qb.qs + ra + shift)))
                    kb = min(ke, up(right(qb.qs + rb - 1 + shift)))
                    if ka < kb:
                        out.append([ka, kb, ra, rb, 1, -1])
            ks = ke
    return out


def block_plan(
    mask: Mask | None,
    geo: Geometry,
    grid: Plan,
    rect: tuple[int, int, int, int] | None = None,
) -> BlockPlan:
    """The native kernel's plan of a call from its grid plan: its visits cut where the mask
    allows (see the module's docstring), and the mask of its partial visits as a band, key
    flags or tiles.

    ``rect = (q_start, q_len, k_start, kv_len)``: the grid covers that rectangle of the call's
    scores (made by :func:`~attnkit._kernel.make_plan` with the same starts and lengths), as when
    one process computes its queries against another's keys; default the whole call. The plan's
    indices are then local to the rectangle, its ``shift`` places the rectangle's queries among
    its keys, and the mask is asked at the call's positions."""
    if rect is None:
        rect = (0, geo.q_len, 0, geo.kv_len)
    q0, q_len, k0, kv_len = rect
    shift = geo.shift + q0 - k0  # local query i sits at local key position i + shift
    band, key_ok, tiled = _mask_form(mask, geo, rect)
    # Packed documents need no tiles: a block they cut is one FULL visit per document in it
    # (with a band, such as causal, the band's edges are then its only mask).
    starts = _document_starts(mask, geo) if tiled else None
    if tiled and starts is None:
        band, starts = _documents_and_band(mask, geo)
    tiled = tiled and starts is None
    if starts is not None:
        starts = [s - k0 for s in starts]  # local key positions
    band_only = bool(band) and key_ok is None and not tiled and starts is None
    off = [0]
    rows: list[list[int]] = []
    tiles: list[tuple[Tensor, int, int]] = []  # a partial block's tile, its rows and keys
    for qb in grid.blocks:
        if band_only:
            rows.extend(_band_visits(qb, band, shift, grid.block_k))
            off.append(len(rows))
            continue
        for v in qb.visits:
            tile = -1
            if v.partial and starts is not None:
                for r in _document_visits(v, qb.qs, shift, starts):
                    clipped = _clip_to_band(r, qb.qs, band, shift) if band else r
                    if clipped is not None:
                        rows.append(clipped)
                continue
            if v.partial and tiled and mask is not None:
                tile = len(tiles)
                t = mask.tile(geo, qb.qs + q0, qb.qe + q0, v.ks + k0, v.ke + k0)
                tiles.append(
                    (t.reshape((1,) * (4 - t.ndim) + tuple(t.shape)), qb.qe - qb.qs, v.ke - v.ks)
                )
            rows.append([v.ks, v.ke, v.r0, v.r1, int(v.partial), tile])
        off.append(len(rows))
    packed = None
    if tiles:
        tn = max(t.size(0) for t, _, _ in tiles)
        th = max(t.size(1) for t, _, _ in tiles)
        packed = torch.zeros(len(tiles), tn, th, grid.block_q, grid.block_k, dtype=torch.uint8)
        for i, (t, nr, nk) in enumerate(tiles):
            packed[i, :, :, :nr, :nk] = t.expand(tn, th, nr, nk)
    return BlockPlan(
        q_len=q_len,
        kv_len=kv_len,
        block_q=grid.block_q,
        block_k=grid.block_k,
        offsets=int64_tensor(off),
        visits=int64_tensor(rows, 6),
        grid=grid,
        band=(band[0], band[1]) if band else None,
        shift=shift,
        key_ok=key_ok,
        tiles=packed,
        stretch=query_stretch(mask, geo, grid.block_q),
    )


def native_call(
    mask: Mask | None,
    geo: Geometry,
    plan: Plan | BlockPlan,
    *,
    scale: float,
    softcap: float | None,
    dtype: torch.dtype,
    p_drop: float = 0.0,
    seed: int = 0,
    term: ScoreTerm | None = None,
    groups: int = 1,
    register_tiles: bool = True,
    skewed_position: bool = True,
) -> NativeCall:
    """A whole call in the native kernel's terms: its plan (a grid plan is cut by
    :func:`block_plan`; a :class:`BlockPlan` made before for this mask and geometry is used as
    it is) and its numbers (``dtype``: the inputs', which decides how a softcap is computed,
    see :func:`attnkit.scores.softcap_form`; ``groups``: query heads per key/value head;
    ``register_tiles``, ``skewed_position``: see :class:`NativeCall`)."""
    work = torch.promote_types(dtype, torch.float32)
    form = None if softcap is None else softcap_form(softcap, work)
    return NativeCall(
        plan=plan if isinstance(plan, BlockPlan) else block_plan(mask, geo, plan),
        scale=float(scale),
        softcap=0.0 if form is None else float(form.cap),
        p_drop=float(p_drop),
        seed=seed,
        position=_position(term, geo),
        layout=tuple(term.layout(geo, groups)) if isinstance(term, DistanceBias) else (),
        register_tiles=register_tiles,
        skewed_position=skewed_position,
    )


def _position(term: ScoreTerm | None, geo: Geometry) -> tuple[float, int, int] | None:
    if term is None or isinstance(term, DistanceBias):
        return None
    if not isinstance(term, RelativePositionTerm) or term.legacy:
        raise RuntimeError(f"attnkit internal error: the native kernel cannot fuse {term!r}")
    return float(term.scale), int(term.top(geo)), term.whole_width
