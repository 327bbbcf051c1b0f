"""The kernel on one pair of shards: this rank's queries against a block of keys it holds.

A pair is a rectangle of the whole call's scores: queries ``gq : gq + nq`` against keys
``gk : gk + nk`` of the whole sequence, which sit at ``lq`` in this rank's shard and at ``lk`` in
the block of keys held. The kernel runs it as it runs any rectangle of a call
(:mod:`attnkit._kernel.rect`: its plan, its own score term, the kernel's own forward and
backward); here, the rows and keys of the pair cut from the shards, and the key mask that travels
with a block of keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._base.checks import shape_str
from .._kernel.backward import Grads
from .._kernel.phases import KernelSpec
from .._kernel.rect import RectSettings, backward_rect, forward_rect, per_query, plan_rect
from ..masks import Geometry, Mask
from ..masks._blocks import block_reduce, states_from

__all__ = [
    "PairPlan",
    "Rect",
    "ShardKeys",
    "backward_pair",
    "forward_pair",
    "kernel_shape",
    "per_query",
    "plan_pair",
    "work_dtype",
]


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
    """One pair's spec (see :func:`attnkit._kernel.rect.plan_rect`), made in the forward and read
    again by the backward."""

    rect: Rect
    spec: KernelSpec


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
# Plan, forward, backward


def _rows(t5: Tensor, r: Rect) -> Tensor:
    return t5[:, :, :, r.lq : r.lq + r.nq]


def _keys(t4: Tensor, r: Rect) -> Tensor:
    return t4[:, :, r.lk : r.lk + r.nk]


def _term_rows(s: RectSettings, r: Rect, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The term's inputs for the pair: those with a row per query (a position term's ``qv``, this
    rank's rows) at the pair's rows."""
    rowed = per_query(s.term)
    return tuple(
        t[:, :, r.lq : r.lq + r.nq] if a else t for t, a in zip(inputs, rowed, strict=True)
    )


def plan_pair(
    s: RectSettings, mask: Mask | None, rect: Rect, term_inputs: tuple[Tensor, ...]
) -> PairPlan | None:
    """The pair's plan (None when the mask hides every pair of the rectangle), ``mask`` asked at
    the whole call's positions."""
    spec = plan_rect(s, mask, rect.whole, _term_rows(s, rect, term_inputs))
    return None if spec is None else PairPlan(rect, spec)


def forward_pair(
    s: RectSettings,
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
    terms = _term_rows(s, r, term_inputs)
    return forward_rect(p.spec, _rows(q5, r), _keys(k4, r), _keys(v4, r), terms, mod_inputs)


def backward_pair(
    s: RectSettings,
    p: PairPlan,
    q5: Tensor,
    k4: Tensor,
    v4: Tensor,
    term_inputs: tuple[Tensor, ...],
    mod_inputs: tuple[Tensor, ...],
    rows: tuple[Tensor, Tensor, Tensor, Tensor],
    term_grads: tuple[bool, ...],
    fold: bool,
) -> Grads:
    """The pair's share of the gradients in the work dtype, given the call's final ``(out, lse,
    delta, dout)`` of this rank's queries (``rows``, in the kernel's layout): dq ``(N, Hkv, G,
    nq, Dk)``, dk and dv ``(N, Hkv, nk, D)``; a term input that holds this rank's rows (a
    position term's ``qv``) gets its gradient at the pair's rows, the others whole."""
    r = p.rect
    out5, lse, delta, dout5 = (_rows(t, r) for t in rows)
    return backward_rect(
        p.spec,
        _rows(q5, r),
        _keys(k4, r),
        _keys(v4, r),
        _term_rows(s, r, term_inputs),
        mod_inputs,
        (out5, lse, delta, dout5),
        term_grads,
        fold,
    )


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def kernel_shape(q: Tensor, v: Tensor) -> tuple[int, int, int]:
    """``(N, Hkv, G)``: batch dims flattened, and query heads per key/value head."""
    hkv = v.size(-3)
    return math.prod(q.shape[:-3]), hkv, q.size(-3) // hkv
