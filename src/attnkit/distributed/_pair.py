"""The kernel on one pair of shards: this rank's queries against a block of keys it holds.

A pair is a rectangle of the whole call's scores: queries ``gq : gq + nq`` against keys
``gk : gk + nk`` of the whole sequence. Its block plan is made for that rectangle by the one
maker of plans (:func:`attnkit._kernel.planning.block_plan`, the mask asked at the whole call's
positions); the native operator runs it, or the eager kernel (:class:`attnkit._kernel.Problem`
with the rectangle's starts) where a call in one process would take the eager kernel too. A
score term is evaluated at the whole call's positions: each pair gets a term of its own that
reads the same numbers for its rectangle (the position queries of its rows, the same table of
encodings or of distances).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._base.checks import shape_str
from .._kernel import BlockPlan, Problem, backward, forward
from .._kernel.planning import block_plan
from .._native.kernel import NativeCall, native_call
from .._score_mod import ScoreMod
from ..masks import Geometry, Mask
from ..masks._blocks import block_reduce, states_from
from ..scores import DistanceBias, RelativePositionTerm, ScoreShape, ScoreTerm, TermBlock

__all__ = [
    "PairPlan",
    "Rect",
    "Settings",
    "ShardKeys",
    "backward_pair",
    "forward_pair",
    "plan_pair",
]


@dataclass(frozen=True)
class Settings:
    """What every pair of one call shares, decided once for the call on every rank alike."""

    geo: Geometry  # the whole call: every rank's queries and keys
    groups: int  # query heads per key/value head
    scale: float
    softcap: float | None
    term: ScoreTerm | None  # as given: a position term's qv holds this rank's rows
    dropout: tuple[float, int] | None  # (p, seed), the seed the same on every rank
    score_mod: ScoreMod | None
    native: bool  # the native operator runs the pairs, else the eager kernel
    kernel: str  # which, in explain()'s words
    careful: bool  # some rank's q, k or v holds NaN or inf: the eager kernel's careful mode
    zero_offset: bool | None
    fused_rows: int | None
    blocks: tuple[int, int]  # the kernel's block sizes
    dtype: torch.dtype  # the inputs'


@dataclass(frozen=True)
class Rect:
    """This rank's queries ``lq : lq + nq`` (local) against keys ``lk : lk + nk`` of the block it
    holds, which sit at ``gq`` and ``gk`` in the whole sequence."""

    lq: int
    gq: int
    nq: int
    lk: int
    gk: int
    nk: int

    @property
    def whole(self) -> tuple[int, int, int, int]:
        """``(q_start, q_len, k_start, kv_len)`` in the whole call."""
        return self.gq, self.nq, self.gk, self.nk


@dataclass(frozen=True)
class PairPlan:
    """One pair's plan, made in the forward and read again by the backward."""

    rect: Rect
    mask: Mask | None  # asked at the whole call's positions
    plan: BlockPlan  # cut for the native operator where it runs the pair
    native: NativeCall | None  # the native operator's plan and numbers; None: the eager kernel
    term: ScoreTerm | None  # the pair's own term (local positions)


class ShardKeys(Mask):
    """The key mask of a block of keys a rank holds (it travels with them), asked at the whole
    call's positions: the block's key ``j`` sits at position ``j + start``."""

    def __init__(self, t: Tensor, start: int) -> None:
        self.t, self.start = t, start

    def describe(self) -> str:
        return f"key mask shard {shape_str(self.t.shape)}"

    def _keys(self, ks: int, ke: int) -> Tensor:
        """``(B|1, H|1, 1, keys|1)`` for keys ``ks:ke`` of the whole call."""
        t = self.t.reshape((1,) * max(0, 4 - self.t.ndim) + tuple(self.t.shape))
        t = t.reshape(-1, *t.shape[-3:])
        return t[..., ks - self.start : ke - self.start] if t.size(-1) != 1 else t

    def tile(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        return self._keys(ks, ke)

    def block_states(
        self, geo: Geometry, q: tuple[int, int, int], k: tuple[int, int, int]
    ) -> Tensor:
        k0, k1, bk = k
        keys = self._keys(k0, k1).flatten(0, 2)  # (B*H | 1, keys | 1)
        anys, _ = block_reduce(keys.any(0, keepdim=True), k0, k1, bk, 1)
        _, alls = block_reduce(keys.all(0, keepdim=True), k0, k1, bk, 1)
        return states_from(~anys[0], alls[0]).expand(len(range(*q)), -1)

    @property
    def keys_only(self) -> bool:
        return True


# --------------------------------------------------------------------------------------------------
# A pair's own score term


class _Shifted(ScoreTerm):
    """A term of the whole call, asked at a pair's local positions: ``term`` at query position
    ``q_pos + dq`` and key position ``k_pos + dk``."""

    def __init__(self, term: ScoreTerm, dq: int, dk: int) -> None:
        self.term, self.dq, self.dk = term, dq, dk

    def inputs(self) -> tuple[Tensor, ...]:
        return self.term.inputs()

    def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return self.term.tile(inputs, q_pos + self.dq, k_pos + self.dk)

    def describe(self) -> str:
        return self.term.describe()


class _AtWhole(ScoreTerm):
    """A pair's term as the eager kernel asks it, at the whole call's positions (its ``geo`` is
    the whole call's, its blocks the rectangle's rows and keys)."""

    def __init__(self, term: ScoreTerm, rect: Rect) -> None:
        self.term, self.rect = term, rect

    def inputs(self) -> tuple[Tensor, ...]:
        return self.term.inputs()

    def describe(self) -> str:
        return self.term.describe()

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
        r = self.rect
        local = Geometry(shape.batch_shape, shape.heads, r.nq, r.nk, shape.device, shape.dtype)
        inner = self.term.block(
            inputs, local, qs - r.gq, qe - r.gq, key_lo - r.gk, key_hi - r.gk, grads=grads
        )
        return _AtWholeBlock(inner, r.gk)


class _AtWholeBlock(TermBlock):
    def __init__(self, inner: TermBlock, gk: int) -> None:
        self.inner, self.gk = inner, gk
        self.writable = inner.writable

    def tile(self, ks: int, ke: int) -> Tensor:
        return self.inner.tile(ks - self.gk, ke - self.gk)

    def backward(self, ks: int, ke: int, ds: Tensor, row0: int) -> None:
        self.inner.backward(ks - self.gk, ke - self.gk, ds, row0)

    def flush(self) -> None:
        self.inner.flush()


def _local_term(s: Settings, rect: Rect, inputs: tuple[Tensor, ...]) -> ScoreTerm | None:
    """The pair's own term: at its local positions (query ``i``, key ``j`` of the rectangle, the
    queries bottom-right among its keys) it reads what the call's term reads at ``(gq + i, gk +
    j)``. ``inputs``: the call's term's inputs (a position term's ``qv`` holds this rank's rows)."""
    term = s.term
    if term is None:
        return None
    geo = s.geo
    # Query i of the rectangle sits at position gq + i + (Tk - Tq) of the whole call, and at
    # i + (nk - nq) of the rectangle: positions differ by dq, keys by gk.
    dq = rect.gq + geo.shift - (rect.nk - rect.nq)
    if isinstance(term, RelativePositionTerm):
        qv, enc = inputs
        # enc's row for (i, j) is top - (i' - j): the rectangle's top is the call's less dq
        # plus gk.
        top = term.top(geo) - dq + rect.gk
        rows = qv[:, :, rect.lq : rect.lq + rect.nq]
        return RelativePositionTerm(
            rows, enc, term.scale, max_distance=top, whole_width=term.whole_width
        )
    if isinstance(term, DistanceBias):
        # table[distance - first] with distance k_pos - q_pos: the rectangle's distances are the
        # call's less (gk - dq).
        (table,) = inputs
        return DistanceBias(table, term.first - rect.gk + dq)
    return _Shifted(term, dq, rect.gk)


def _local_inputs(s: Settings, rect: Rect, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    if isinstance(s.term, RelativePositionTerm):
        qv, enc = inputs
        return qv[:, :, rect.lq : rect.lq + rect.nq], enc
    return inputs


# --------------------------------------------------------------------------------------------------
# Plan, forward, backward


def plan_pair(
    s: Settings, mask: Mask | None, rect: Rect, term_inputs: tuple[Tensor, ...]
) -> PairPlan | None:
    """The pair's plan (None when the mask hides every pair of the rectangle): its grid asked of
    the mask at the whole call's positions and, for the native operator, its visits cut (see
    :func:`attnkit._kernel.planning.block_plan`)."""
    bq, bk = s.blocks
    plan = block_plan(mask, s.geo, native=s.native, block_q=bq, block_k=bk, rect=rect.whole)
    if not plan.grid.visited:
        return None
    term = _local_term(s, rect, term_inputs)
    native = None
    if s.native:
        local = Geometry(s.geo.batch_shape, s.geo.heads, rect.nq, rect.nk, s.geo.device)
        native = native_call(
            plan,
            local,
            scale=s.scale,
            softcap=s.softcap,
            dtype=s.dtype,
            term=term,
            groups=s.groups,
        )
    return PairPlan(rect, mask, plan, native, term)


def _rows(t5: Tensor, r: Rect) -> Tensor:
    return t5[:, :, :, r.lq : r.lq + r.nq]


def _keys(t4: Tensor, r: Rect) -> Tensor:
    return t4[:, :, r.lk : r.lk + r.nk]


def _problem(
    s: Settings,
    p: PairPlan,
    q5: Tensor,
    k4: Tensor,
    v4: Tensor,
    term_inputs: tuple[Tensor, ...],
    mod_inputs: tuple[Tensor, ...],
) -> Problem:
    r = p.rect
    n, hkv = k4.shape[:2]
    kp, vp = _keys(k4, r), _keys(v4, r)
    return Problem(
        q5=_rows(q5, r),
        k3=kp.reshape(n * hkv, r.nk, kp.size(-1)),
        v3=vp.reshape(n * hkv, r.nk, vp.size(-1)),
        scale=s.scale,
        plan=p.plan.grid,
        geo=s.geo,
        mask=p.mask,
        softcap=s.softcap,
        term=None if p.term is None else _AtWhole(p.term, r),
        term_inputs=_local_inputs(s, r, term_inputs),
        q_start=r.gq,
        k_start=r.gk,
        careful=s.careful,
        fused_rows=s.fused_rows,
        dropout=s.dropout,
        score_mod=s.score_mod,
        mod_inputs=mod_inputs,
        zero_offset=s.zero_offset,
    )


def forward_pair(
    s: Settings,
    p: PairPlan,
    q5: Tensor,
    k4: Tensor,
    v4: Tensor,
    term_inputs: tuple[Tensor, ...],
    mod_inputs: tuple[Tensor, ...],
) -> tuple[Tensor, Tensor]:
    """The pair's ``(out (N, Hkv, G, nq, Dv), lse (N, Hkv, G, nq))`` in the work dtype, from this
    rank's queries ``q5 (N, Hkv, G, Tq, Dk)`` and the block held, ``k4``/``v4 (N, Hkv, Tk, D)``."""
    r = p.rect
    if p.native is not None:
        local = _local_inputs(s, r, term_inputs)
        return p.native.forward(_rows(q5, r), _keys(k4, r), _keys(v4, r), None, local)
    return forward(_problem(s, p, q5, k4, v4, term_inputs, mod_inputs))


@dataclass
class PairGrads:
    """A pair's gradients in the work dtype: ``dq (N, Hkv, G, nq, Dk)``, ``dk``/``dv (N, Hkv, nk,
    D)``, and those of the call's term inputs and captured tensors (None where none)."""

    dq: Tensor
    dk: Tensor
    dv: Tensor
    dterm: list[Tensor | None]
    dmod: list[Tensor | None]


def backward_pair(
    s: Settings,
    p: PairPlan,
    q5: Tensor,
    k4: Tensor,
    v4: Tensor,
    term_inputs: tuple[Tensor, ...],
    mod_inputs: tuple[Tensor, ...],
    rows: tuple[Tensor, Tensor, Tensor, Tensor],
    term_grads: tuple[bool, ...],
    fold: bool,
) -> PairGrads:
    """The pair's share of the gradients, given the call's final ``(out, lse, delta, dout)`` of
    this rank's queries (``rows``, in the kernel's layout). A term input that holds this rank's
    rows (a position term's ``qv``) gets its gradient at the pair's rows, the others whole."""
    r = p.rect
    out5, lse, delta, dout5 = (t[:, :, :, r.lq : r.lq + r.nq] for t in rows)
    local = _local_inputs(s, r, term_inputs)
    n, hkv = k4.shape[:2]
    if p.native is not None:
        dq, dk, dv, _, dlocal = p.native.backward(
            _rows(q5, r),
            _keys(k4, r),
            _keys(v4, r),
            None,
            dout5,
            lse.contiguous(),
            delta.contiguous(),
            False,
            local,
            term_grads,
        )
        dmod: list[Tensor | None] = [None] * len(mod_inputs)
    else:
        # The eager kernel gives gradients to the inputs that require them: say which.
        asked = tuple(
            t.detach().requires_grad_(need) if t.is_floating_point() else t
            for t, need in zip(term_inputs, term_grads, strict=True)
        )
        grads = backward(
            _problem(s, p, q5, k4, v4, asked, mod_inputs),
            out5,
            lse,
            delta,
            dout5,
            bias_grad=False,
            term_grads=any(term_grads),
            fold=fold,
        )
        dq, dlocal, dmod = grads.dq, grads.dterm, grads.dmod
        dk = grads.dk.view(n, hkv, r.nk, -1)
        dv = grads.dv.view(n, hkv, r.nk, -1)
    dterm = list(dlocal) + [None] * (len(term_inputs) - len(dlocal))
    dterm = [d if need else None for d, need in zip(dterm, term_grads, strict=True)]
    return PairGrads(dq, dk.view(n, hkv, r.nk, -1), dv.view(n, hkv, r.nk, -1), dterm, dmod)


def per_query(term: ScoreTerm | None) -> tuple[bool, ...]:
    """Which of a term's inputs hold this rank's query rows (their gradients come per pair's
    rows): a position term's ``qv``."""
    if isinstance(term, RelativePositionTerm):
        return (True, False)
    return tuple(False for _ in (() if term is None else term.inputs()))


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def kernel_shape(q: Tensor, v: Tensor) -> tuple[int, int, int]:
    """``(N, Hkv, G)``: batch dims flattened, and query heads per key/value head."""
    hkv = v.size(-3)
    return math.prod(q.shape[:-3]), hkv, q.size(-3) // hkv
