"""The kernel on a rectangle of a call's scores: queries ``q0 : q0 + nq`` against keys
``k0 : k0 + nk`` of the whole call, at the whole call's positions.

What ring attention runs for each pair of shards it holds: the rectangles' outputs merge through
their log-sum-exp (:func:`attnkit._kernel.merge.merge`) into the call's, and each rectangle's
backward reads the call's final output and log-sum-exp. :func:`rect_settings` decides once what
every rectangle of a call shares (which kernel, the blocks, the eager kernel's modes);
:func:`plan_rect` makes a rectangle's :class:`~attnkit._kernel.phases.KernelSpec` (its plan from
the one maker of plans, :func:`attnkit._kernel.planning.block_plan`, the mask asked at the whole
call's positions); :func:`forward_rect` and :func:`backward_rect` run the kernel's own two phases
(:mod:`attnkit._kernel.phases`) on it.

A score term is evaluated at the whole call's positions: each rectangle gets a term of its own
that reads the same numbers for its rows and keys (the position queries of its rows, the same
table of encodings or of distances). A term input that holds one row per query (a position
term's ``qv``, :func:`per_query`) is given at the rectangle's rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._call import AttentionCall
from .._native.kernel import native_call
from .._score_mod import ScoreMod
from ..masks import Geometry, Mask
from ..scores import DistanceBias, RelativePositionTerm, ScoreShape, ScoreTerm, TermBlock
from .backward import Grads
from .choice import refusal
from .forward import small_scores
from .phases import KernelSpec, kernel_backward, kernel_forward
from .planning import NATIVE_BLOCKS, block_plan
from .problem import default_blocks

__all__ = [
    "RectSettings",
    "backward_rect",
    "forward_rect",
    "per_query",
    "plan_rect",
    "rect_settings",
]


@dataclass(frozen=True)
class RectSettings:
    """What every rectangle of one call shares, decided once for the call (ring attention: on
    every rank alike)."""

    geo: Geometry  # the whole call: every rank's queries and keys
    groups: int  # query heads per key/value head
    scale: float
    softcap: float | None
    term: ScoreTerm | None  # as given: a position term's qv holds this rank's rows
    dropout: tuple[float, int] | None  # (p, seed), the seed the same on every rank
    score_mod: ScoreMod | None
    native: bool  # the native operator runs the rectangles, else the eager kernel
    kernel: str  # which, in explain()'s words
    careful: bool  # q, k or v holds NaN or inf somewhere: the eager kernel's careful mode
    zero_offset: bool | None
    fused_rows: int | None
    blocks: tuple[int, int]  # the kernel's block sizes
    dtype: torch.dtype  # the inputs'


def rect_settings(
    call: AttentionCall,
    geo: Geometry,
    *,
    finite: bool,
    norms: tuple[float, float, float],
    seed: int,
    blocks: tuple[int | None, int | None],
    fused_rows: int | None,
    native: bool,
    off: str,
) -> RectSettings:
    """The kernel's choice for a call cut into rectangles (``geo``: the whole call; ``call``:
    the part one process holds): whether q, k, v and the term's inputs are ``finite``
    everywhere, the largest norms of this process's q and of everyone's k and v (for the eager
    kernel's zero offset, see :func:`attnkit._kernel.forward.small_scores`), the dropout
    ``seed`` every process uses; ``off``: the words for the eager kernel when ``native`` is
    False."""
    why = refusal(
        native=native,
        device=call.device,
        term=call.score_term,
        score_mod=call.score_mod is not None,
        finite=finite,
        geo=call.geometry,
        build=True,
    )
    if not native:
        why = off
    if why is None and call.dropout_p:
        why = (
            "the eager kernel (dropout across ranks: the native kernel numbers the pairs it "
            "drops by its own inputs' positions, the eager one by the whole call's)"
        )
    plain = call.softcap is None and call.score_term is None and call.score_mod is None
    zero = (
        plain
        and finite
        and small_scores(norms[0], norms[1], norms[2], call.scale, geo.kv_len, geo.dtype)
    )
    banded = call.mask is not None and call.mask.distances(geo)[1] < math.inf
    if why is None:
        bq, bk = NATIVE_BLOCKS[banded]
    else:
        bq, bk = default_blocks(banded, call.groups, call.q_len, call.score_term is not None)
    return RectSettings(
        geo=geo,
        groups=call.groups,
        scale=call.scale,
        softcap=call.softcap,
        term=call.score_term,
        dropout=(call.dropout_p, seed) if call.dropout_p else None,
        score_mod=call.score_mod,
        native=why is None,
        kernel="native kernel" if why is None else why,
        careful=not finite,
        zero_offset=zero if why is not None else None,
        fused_rows=fused_rows,
        blocks=(blocks[0] or bq, blocks[1] or bk),
        dtype=call.dtype,
    )


# --------------------------------------------------------------------------------------------------
# A rectangle's own score term


class _Shifted(ScoreTerm):
    """A term of the whole call, asked at a rectangle's local positions: ``term`` at query
    position ``q_pos + dq`` and key position ``k_pos + dk``."""

    def __init__(self, term: ScoreTerm, dq: int, dk: int) -> None:
        self.term, self.dq, self.dk = term, dq, dk

    def inputs(self) -> tuple[Tensor, ...]:
        return self.term.inputs()

    def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return self.term.tile(inputs, q_pos + self.dq, k_pos + self.dk)

    def describe(self) -> str:
        return self.term.describe()


class _AtWhole(ScoreTerm):
    """A rectangle's term as the eager kernel asks it, at the whole call's positions (its
    ``geo`` is the whole call's, its blocks the rectangle's rows and keys)."""

    def __init__(self, term: ScoreTerm, rect: tuple[int, int, int, int]) -> None:
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
        q0, nq, k0, nk = self.rect
        local = Geometry(shape.batch_shape, shape.heads, nq, nk, shape.device, shape.dtype)
        inner = self.term.block(
            inputs, local, qs - q0, qe - q0, key_lo - k0, key_hi - k0, grads=grads
        )
        return _AtWholeBlock(inner, k0)


class _AtWholeBlock(TermBlock):
    def __init__(self, inner: TermBlock, k0: int) -> None:
        self.inner, self.k0 = inner, k0
        self.writable = inner.writable

    def tile(self, ks: int, ke: int) -> Tensor:
        return self.inner.tile(ks - self.k0, ke - self.k0)

    def backward(self, ks: int, ke: int, ds: Tensor, row0: int) -> None:
        self.inner.backward(ks - self.k0, ke - self.k0, ds, row0)

    def flush(self) -> None:
        self.inner.flush()


def _local_term(
    s: RectSettings, rect: tuple[int, int, int, int], inputs: tuple[Tensor, ...]
) -> ScoreTerm | None:
    """The rectangle's own term: at its local positions (query ``i``, key ``j`` of the
    rectangle, the queries bottom-right among its keys) it reads what the call's term reads at
    ``(q0 + i, k0 + j)``. ``inputs``: the call's term's inputs, a position term's ``qv`` at the
    rectangle's rows."""
    term = s.term
    if term is None:
        return None
    geo = s.geo
    q0, nq, k0, nk = rect
    # Query i of the rectangle sits at position q0 + i + (Tk - Tq) of the whole call, and at
    # i + (nk - nq) of the rectangle: positions differ by dq, keys by k0.
    dq = q0 + geo.shift - (nk - nq)
    if isinstance(term, RelativePositionTerm):
        rows, enc = inputs
        # enc's row for (i, j) is top - (i' - j): the rectangle's top is the call's less dq
        # plus k0.
        top = term.top(geo) - dq + k0
        return RelativePositionTerm(
            rows, enc, term.scale, max_distance=top, whole_width=term.whole_width
        )
    if isinstance(term, DistanceBias):
        # table[distance - first] with distance k_pos - q_pos: the rectangle's distances are the
        # call's less (k0 - dq).
        (table,) = inputs
        return DistanceBias(table, term.first - k0 + dq)
    return _Shifted(term, dq, k0)


def per_query(term: ScoreTerm | None) -> tuple[bool, ...]:
    """Which of a term's inputs hold one row per query (a rectangle takes them at its rows, and
    their gradients come at its rows): a position term's ``qv``."""
    if isinstance(term, RelativePositionTerm):
        return (True, False)
    return tuple(False for _ in (() if term is None else term.inputs()))


# --------------------------------------------------------------------------------------------------
# Plan, forward, backward


def plan_rect(
    s: RectSettings,
    mask: Mask | None,
    rect: tuple[int, int, int, int],
    term_inputs: tuple[Tensor, ...],
) -> KernelSpec | None:
    """The spec of the rectangle ``rect = (q0, nq, k0, nk)`` of the call (None when the mask
    hides every pair of it): its plan, the mask asked at the whole call's positions, cut for the
    native operator where it runs the rectangles; its own score term (``term_inputs``: the
    call's term's, those of :func:`per_query` at the rectangle's rows)."""
    q0, nq, k0, nk = rect
    bq, bk = s.blocks
    plan = block_plan(mask, s.geo, native=s.native, block_q=bq, block_k=bk, rect=rect)
    if not plan.grid.visited:
        return None
    term = _local_term(s, rect, term_inputs)
    native = None
    if s.native:
        local = Geometry(s.geo.batch_shape, s.geo.heads, nq, nk, s.geo.device)
        native = native_call(
            plan, local, scale=s.scale, softcap=s.softcap, dtype=s.dtype, term=term,
            groups=s.groups,
        )  # fmt: skip
    elif term is not None:
        term = _AtWhole(term, rect)  # the eager kernel asks at the whole call's positions
    return KernelSpec(
        mask=mask,
        geo=s.geo,
        plan=plan,
        scale=s.scale,
        softcap=s.softcap,
        term=term,
        careful=s.careful,
        check_term=False,
        has_bias=False,
        has_sinks=False,
        n_term=len(term_inputs),
        fused_rows=s.fused_rows,
        native=native,
        dropout=s.dropout,
        score_mod=s.score_mod,
        zero_offset=s.zero_offset,
        kernel=s.kernel,
        starts=(q0, k0),
    )


def forward_rect(
    spec: KernelSpec,
    q5: Tensor,
    k4: Tensor,
    v4: Tensor,
    term_inputs: tuple[Tensor, ...],
    mod_inputs: tuple[Tensor, ...],
) -> tuple[Tensor, Tensor]:
    """The rectangle's ``(out (N, Hkv, G, nq, Dv), lse (N, Hkv, G, nq))`` in the work dtype,
    from its queries ``q5 (N, Hkv, G, nq, Dk)`` and keys and values ``k4``/``v4 (N, Hkv, nk,
    D)`` (``term_inputs`` as :func:`plan_rect` took them)."""
    return kernel_forward(spec, q5, k4, v4, None, term_inputs, mod_inputs)


def backward_rect(
    spec: KernelSpec,
    q5: Tensor,
    k4: Tensor,
    v4: Tensor,
    term_inputs: tuple[Tensor, ...],
    mod_inputs: tuple[Tensor, ...],
    rows: tuple[Tensor, Tensor, Tensor, Tensor],
    term_needs: tuple[bool, ...],
    fold: bool,
) -> Grads:
    """The rectangle's share of the gradients in the work dtype, given the call's final ``(out,
    lse, delta, dout)`` of its rows (``rows``, in the kernel's layout): dq ``(N, Hkv, G, nq,
    Dk)``, dk and dv ``(N, Hkv, nk, D)``, those of the term's inputs that ``term_needs`` asks
    (a :func:`per_query` input's at the rectangle's rows; None elsewhere) and of the captured
    tensors."""
    # The eager kernel gives gradients to the term inputs that require them: say which.
    asked = tuple(
        t.detach().requires_grad_(need) if t.is_floating_point() else t
        for t, need in zip(term_inputs, term_needs, strict=True)
    )
    grads = kernel_backward(
        spec,
        q5,
        k4,
        v4,
        None,
        rows,
        bias_grad=False,
        term_inputs=term_inputs if spec.native is not None else asked,
        mod_inputs=mod_inputs,
        term_needs=term_needs,
        fold=fold,
    )
    dterm = list(grads.dterm) + [None] * (len(term_inputs) - len(grads.dterm))
    grads.dterm = [d if need else None for d, need in zip(dterm, term_needs, strict=True)]
    return grads
