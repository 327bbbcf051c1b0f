"""One call (or one shard pair of a ring call) in the kernel's layout, and the scores of a visit.

A :class:`Problem` holds what the forward and the backward read: the inputs in the kernel's
layout, the call's plan and everything it adds to ``q k^T`` (softcap, a dense ``bias``, a lazy
:class:`~attnkit.scores.ScoreTerm`, the mask's tiles on partial blocks, a ``score_mod``, dropout),
and computes one visit's scores (:meth:`Problem.scores`), once, for every backend built on the
kernel. A few details make that fast in eager PyTorch:

* **Cheap elementwise work.** Scores are kept in base 2 (``log2(e)`` rides on the queries, and on
  the adds of a bias or score term) because ``exp2`` costs about half of ``exp`` on CPUs, and a
  softcap up to a few dozen is computed through a sigmoid, a fraction of the cost of ``tanh``
  (larger caps, where that form would cancel, through ``tanh``; see ``scores.softcap_form``).
* **One buffer per kind of work.** Each visit's scores (and in the backward their gradients and
  the softcap's sigmoid) are written into a buffer the whole call reuses
  (:meth:`Problem.scratch`): a GEMM and the passes after it run measurably faster there than in a
  fresh multi-MiB tensor.
* **Grouped-query attention without copies.** The ``G = H / Hkv`` query heads that share a key head
  are stacked as rows of one matrix (query-major: row ``t * G + g``), so each score block is a
  single batched GEMM against the shared keys, and a block's first rows can be skipped for every
  group at once.

Non-finite inputs (a call's ``careful`` mode, decided once per call): scores of masked pairs (by
the mask, or by a ``-inf`` bias or score term) are replaced by ``-inf`` after the product, so NaN
at masked positions of q, k or ``bias`` never matters; values enter the weighted sum with their
non-finite entries zeroed (see :mod:`~attnkit._kernel.forward` for the output's NaN).

**A score_mod** (``score_mod(score, b, h, q_idx, kv_idx)``, any function) is applied to each
visit's natural-log scores, after softcap and bias and before the mask, with the tile's broadcast
index tensors (:meth:`Problem.apply_mod`); the backward turns the modified scores' gradient
into the scores' gradient and the gradients of the tensors it captures
(:meth:`Problem.mod_backward`).
Masked pairs are ``-inf`` whatever it returns there.

float16/bfloat16 inputs are computed block by block in float32.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .._score_mod import ScoreMod, index_tensors
from .._score_mod import apply as apply_score_mod
from ..masks import Geometry, Mask
from ..scores import ScoreShape, ScoreTerm, TermBlock, reused, softcap_form
from .dropout import dropout_mask
from .fused import fused_serves
from .plan import Plan, QueryBlock, Run, Visit, split_runs

__all__ = [
    "LN2",
    "LOG2E",
    "ZERO_BITS",
    "Problem",
    "default_blocks",
    "no_autocast",
    "nonfinite",
    "tile5",
]

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
# Rows whose offsets (base 2) are all within +-32 take offset 0: the sums of 2^score stay far from
# float32's limits unless a later score is 2^32 times larger, which the guard catches.
ZERO_BITS = 32.0


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Autocast off for the kernel's own work, whose dtypes are chosen on purpose.

    Inside ``torch.autocast`` (a forward, or a backward called within it) every ``bmm`` would run
    in the autocast dtype and meet the float32 running sums.
    """
    if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def nonfinite(t: Tensor) -> Tensor:
    """Where ``t`` is inf or NaN."""
    return ~torch.isfinite(t)


def _clean(t: Tensor) -> Tensor:
    """``t`` with its non-finite entries replaced by 0."""
    return t.masked_fill(nonfinite(t), 0.0)


@dataclass
class Problem:
    """One call (or one shard pair of a ring call) in the kernel's layout.

    ``q5`` is ``(B, Hkv, G, Tq, Dk)`` (batch dims flattened to ``B``), ``k3``/``v3`` are
    ``(B*Hkv, Tk, D)``; ``bias5`` is a ``(B|1, Hkv|1, G|1, Tq|1, Tk|1)`` view of a dense bias;
    ``sinks`` is ``(Hkv, G)``. ``geo`` is the call the mask and the score term are asked about, and
    ``q_start``/``k_start`` where the local queries and keys sit in it. ``fused_rows``: runs of
    fully visible blocks with at least this many queries go to torch's fused CPU kernel when
    nothing is added to the scores (``None``: never). ``zero_offset``: what
    :func:`~attnkit._kernel.forward.zero_offset_safe` answers for the call, when the caller knows
    it (``None``: the forward asks, one host read). ``score_mod`` and the tensors it captures,
    ``mod_inputs``: see the module docstring.
    """

    q5: Tensor
    k3: Tensor
    v3: Tensor
    scale: float
    plan: Plan
    geo: Geometry
    mask: Mask | None = None
    bias5: Tensor | None = None
    softcap: float | None = None
    term: ScoreTerm | None = None
    term_inputs: tuple[Tensor, ...] = ()
    q_start: int = 0
    k_start: int = 0
    careful: bool = False
    fused_rows: int | None = None
    dropout: tuple[float, int] | None = None  # (p, seed): see attnkit._kernel.dropout
    score_mod: ScoreMod | None = None
    mod_inputs: tuple[Tensor, ...] = ()
    zero_offset: bool | None = None
    work: torch.dtype = field(init=False)
    _scratch: dict[str, Tensor] = field(init=False, default_factory=dict)
    # the score_mod's (input, output) of the visit the backward is at (see apply_mod)
    _graph: tuple[Tensor, Tensor] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.work = torch.promote_types(self.q5.dtype, torch.float32)
        # The cap computed with, and its form (None: a cap too large to change a score is none).
        form = None if self.softcap is None else softcap_form(self.softcap, self.work)
        self.softcap = None if form is None else form.cap
        self.cap_sigmoid = form is not None and form.sigmoid
        self.n, self.hkv, self.g, self.tq, self.dk = self.q5.shape
        self.tk, self.dv = self.v3.shape[-2:]
        # Only the careful mode looks at values: masked NaN values would otherwise meet 0 weights.
        self.v_bad = self.careful and bool(nonfinite(self.v3).any())
        self.runs: tuple[Run, ...] = ()
        self.blocks = self.plan.blocks
        if self.fused_rows is not None and self.dropout is None and self._fusable():
            self.runs, self.blocks = split_runs(self.plan, self.fused_rows)

    def _fusable(self) -> bool:
        """:func:`fused_serves`, on finite tensors of one dtype whose last dimension is contiguous
        (the fused kernel misreads any other)."""
        dtype = self.q5.dtype
        return (
            fused_serves(
                self.q5.device,
                dtype,
                self.dk,
                self.dv,
                softcap=self.softcap,
                added=self.term is not None or self.bias5 is not None or self.modded,
            )
            and self.k3.dtype == dtype == self.v3.dtype
            and not self.careful
            and all(t.stride(-1) == 1 for t in (self.q5, self.k3, self.v3))
        )

    @property
    def modded(self) -> bool:
        """Whether a score_mod applies: the scores are then computed in natural log first."""
        return self.score_mod is not None

    def scratch(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """A work tensor of ``shape`` in the work dtype that every visit of this problem reuses
        (see :func:`~attnkit.scores.reused`)."""
        return reused(self._scratch, name, shape, self.work, self.q5.device)

    # ----------------------------------------------------------------------------------------------
    # Rows of a query block: (B*Hkv, rows*G, X), query-major

    def rows(self, t5: Tensor, qs: int, qe: int) -> Tensor:
        """The block's rows of a ``(B, Hkv, G, Tq, X)`` tensor, as ``(B*Hkv, rows*G, X)`` in the
        work dtype (a copy)."""
        block = t5[:, :, :, qs:qe].transpose(2, 3)
        out = torch.empty(block.shape, dtype=self.work, device=t5.device)
        out.copy_(block)
        return out.view(self.n * self.hkv, (qe - qs) * self.g, t5.size(-1))

    def q_rows(self, qs: int, qe: int, clean: bool = False, factor: float = 1.0) -> Tensor:
        """Queries of a block times ``scale * factor``, ``(B*Hkv, rows*G, Dk)``; ``clean``:
        non-finite entries 0."""
        block = self.q5[:, :, :, qs:qe].transpose(2, 3)
        out = torch.empty(block.shape, dtype=self.work, device=block.device)
        if block.dtype == self.work:
            torch.mul(block, self.scale * factor, out=out)
        else:  # a float16 product would be rounded before it reached out
            out.copy_(block).mul_(self.scale * factor)
        if clean:
            out.masked_fill_(nonfinite(out), 0.0)
        return out.view(self.n * self.hkv, (qe - qs) * self.g, self.dk)

    def keys(self, ks: int, ke: int, clean: bool = False) -> Tensor:
        kb = self.k3[:, ks:ke]
        kb = kb if kb.dtype == self.work else kb.to(self.work)
        return _clean(kb) if clean else kb

    def values(self, ks: int, ke: int) -> Tensor:
        vb = self.v3[:, ks:ke]
        vb = vb if vb.dtype == self.work else vb.to(self.work)
        return _clean(vb) if self.careful else vb

    # ----------------------------------------------------------------------------------------------
    # Tiles in the score block's (B, Hkv, rows, G, keys) layout

    def _to_rows(self, t: Tensor) -> Tensor:
        """``(B|1, H|1, rows|1, keys|1)`` -> ``(B|1, Hkv|1, rows|1, G|1, keys|1)`` (a view).
        Fewer dimensions are leading ones (a term's block may return ``(H, rows, keys)``)."""
        if t.ndim < 4:
            t = t.reshape((1,) * (4 - t.ndim) + tuple(t.shape))
        if t.size(1) == 1:
            return t.unsqueeze(3)
        out: Tensor = t.unflatten(1, (self.hkv, self.g)).transpose(2, 3)
        return out

    def bias_tile(self, qs: int, qe: int, ks: int, ke: int) -> Tensor | None:
        if self.bias5 is None:
            return None
        return tile5(self.bias5, qs, qe, ks, ke).transpose(2, 3)

    def mask_tile(self, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        if self.mask is None:
            raise RuntimeError("attnkit internal error: a partial block without a mask")
        tile = self.mask.tile(
            self.geo, qs + self.q_start, qe + self.q_start, ks + self.k_start, ke + self.k_start
        )
        return self._to_rows(tile)

    def term_block(self, qb: QueryBlock, grads: list[Tensor | None] | None) -> TermBlock | None:
        if self.term is None or not qb.visits:
            return None
        lo, hi = qb.key_range
        return self.term.block(
            self.term_inputs,
            _score_shape(self),
            qb.qs + self.q_start,
            qb.qe + self.q_start,
            lo + self.k_start,
            hi + self.k_start,
            grads=grads,
        )

    def score_factor(self) -> float:
        """What the rows given to :meth:`scores` carry beyond ``scale``: ``2 / softcap`` with a
        softcap in the sigmoid form, ``1 / softcap`` or 1 in the tanh form, else ``log2(e)``
        (scores in base 2), or 1 with a score_mod (which sees natural-log scores)."""
        if self.softcap is None:
            return 1.0 if self.modded else LOG2E
        if self.cap_sigmoid:
            return 2.0 / self.softcap
        return 1.0 / self.softcap if self._cap_in_rows() else 1.0

    def _cap_in_rows(self) -> bool:
        """Whether the tanh form's ``1 / softcap`` rides on the rows (saving a pass over the
        scores): for caps from 1 to 2^32, where it can neither overflow nor lose the rows'
        precision to underflow."""
        return self.softcap is not None and 1.0 <= self.softcap <= 2.0**32

    def mod_view(self, s5: Tensor) -> Tensor:
        """``(B, Hkv, rows, G, keys)`` -> ``(B, H, rows, keys)``, the layout a score_mod sees (a
        copy when heads are grouped)."""
        n, hkv, rows, g, keys = s5.shape
        return s5.permute(0, 1, 3, 2, 4).reshape(n, hkv * g, rows, keys)

    def mod_indices(
        self, lo: int, hi: int, ks: int, ke: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """A score_mod's index tensors for queries ``lo:hi`` and keys ``ks:ke`` of this problem,
        in the call's positions."""
        return index_tensors(
            self.n,
            self.hkv * self.g,
            lo + self.q_start,
            hi + self.q_start,
            ks + self.k_start,
            ke + self.k_start,
            self.q5.device,
        )

    def apply_mod(
        self, s5: Tensor, lo: int, hi: int, ks: int, ke: int, keep_graph: bool = False
    ) -> None:
        """The score_mod on natural-log scores ``(B, Hkv, rows, G, keys)``, in place, its result
        times ``log2(e)`` (one pass). ``keep_graph``: under autograd, for :meth:`mod_backward`."""
        if self.score_mod is None:
            raise RuntimeError("attnkit internal error: apply_mod without a score_mod")
        idx = self.mod_indices(lo, hi, ks, ke)
        if keep_graph:
            # The function gets a copy of x: its graph may save what it is given (x is a view
            # of s5 with one query head per key/value head, and s5 is overwritten below), and
            # it may write to it in place (score.mul_(2)), which autograd forbids on a leaf.
            x = self.mod_view(s5).detach().requires_grad_(True)
            with torch.enable_grad():
                y = apply_score_mod(self.score_mod, x.clone(), idx)
            self._graph = (x, y)
        else:
            y = apply_score_mod(self.score_mod, self.mod_view(s5), idx)
        n, hkv, rows, g, keys = s5.shape
        y5 = y.detach().reshape(n, hkv, g, rows, keys).transpose(2, 3)
        if y5.untyped_storage().data_ptr() == s5.untyped_storage().data_ptr():
            # It returned its input (a view of s5 with one query head per key/value head), a
            # view of it or the input written in place: the same elements as s5 (apply refuses
            # any other view of the scores), which a multiplication into s5 may not read.
            s5.mul_(LOG2E)
        else:
            torch.mul(y5, LOG2E, out=s5)

    def mod_backward(self, ds5: Tensor, dmod: list[Tensor | None]) -> None:
        """Turn ``ds5``, the gradient of the last :meth:`apply_mod`'s output (kept with
        ``keep_graph``), into that of its input (in place), adding the captured tensors'
        gradients to ``dmod``."""
        if self._graph is None:
            raise RuntimeError("attnkit internal error: mod_backward without a kept graph")
        (x, y), self._graph = self._graph, None
        if not y.requires_grad:  # the score_mod depends on nothing that needs gradients
            ds5.zero_()
            return
        grads = torch.autograd.grad(y, (x, *self.mod_inputs), self.mod_view(ds5), allow_unused=True)
        dx = grads[0]
        if dx is None:  # the score_mod ignores the scores: they get no gradient
            ds5.zero_()
        else:
            if dx.untyped_storage().data_ptr() == ds5.untyped_storage().data_ptr():
                dx = dx.clone()  # an additive mod hands back the gradient it was given
            n, hkv, rows, g, keys = ds5.shape
            ds5.copy_(dx.reshape(n, hkv, g, rows, keys).transpose(2, 3))
        for i, d in enumerate(grads[1:]):
            if d is not None:
                total = dmod[i]
                dmod[i] = d.clone() if total is None else total.add_(d)

    def scores(
        self,
        qr: Tensor,
        qs: int,
        visit: Visit,
        offset: Tensor | None,
        tb: TermBlock | None,
        keep_sigmoid: bool = False,
        keep_graph: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Scores of one visit in base 2 (times ``log2(e)``) minus ``offset`` (per row), masked
        with ``-inf``.

        ``qr`` holds the visit's rows ``r0:r1`` of the block starting at query ``qs``, times
        ``scale * score_factor()``. A softcap up to a few dozen is computed as
        ``c * tanh(x / c) = 2c * sigmoid(2x / c) - c``: the same numbers to float rounding of ``c``
        (the absolute error of a capped score is ``c`` times the float epsilon, as for ``tanh`` near
        saturation), and a sigmoid costs a fraction of a tanh on CPUs; a larger cap, where that
        error would show, as ``c * tanh(x / c)``. Returns the scores ``(B*Hkv, rows*G, keys)``, the
        sigmoid (or tanh) when ``keep_sigmoid`` (the backward's softcap factor), and the visit's
        visibility: the mask tile of a partial block, and in the careful mode also the pairs a
        ``-inf`` bias or term hides (``NaN + -inf`` is NaN, not ``-inf``). With a score_mod the
        rows carry no ``log2(e)``: the natural-log scores go through it before the mask
        (``keep_graph``: under autograd, for :meth:`mod_backward`).
        """
        ks, ke = visit.ks, visit.ke
        lo, hi = qs + visit.r0, qs + visit.r1
        kt = self.keys(ks, ke).transpose(1, 2)
        added = self.bias5 is not None or tb is not None or self.modded
        unit = 1.0 if self.modded else LOG2E  # a score_mod sees natural-log scores
        pending = offset  # subtracted at the end unless taken on the way
        out = self.scratch("scores", (qr.size(0), qr.size(1), ke - ks))
        if self.softcap is None and offset is not None and not added:
            s = torch.baddbmm(offset, qr, kt, beta=-1.0, out=out)  # q k^T - m in one GEMM
            pending = None
        else:
            s = torch.bmm(qr, kt, out=out)
        sig = None
        if self.softcap is not None:
            c = self.softcap
            if self.cap_sigmoid:
                s.sigmoid_()
                two, shift = 2.0 * c * unit, c * unit  # (2c sigmoid - c) * log2(e)
            else:
                (s if self._cap_in_rows() else s.div_(c)).tanh_()
                two, shift = c * unit, 0.0  # c tanh * log2(e)
            sig = self.scratch("sigmoid", tuple(s.shape)).copy_(s) if keep_sigmoid else None
            if pending is not None and not added:
                # ... - m in one pass; the mask's -inf comes after.
                torch.add(pending.add(shift).neg_(), s, alpha=two, out=s)
                pending = None
            elif shift:
                s.mul_(two).sub_(shift)
            else:
                s.mul_(two)
        s5 = s.view(self.n, self.hkv, hi - lo, self.g, ke - ks)
        vis = self.mask_tile(lo, hi, ks, ke) if visit.partial else None
        bias = self.bias_tile(lo, hi, ks, ke)
        if bias is not None:
            s5.add_(bias, alpha=unit)
            if self.careful:
                vis = _hide(vis, bias)
        if tb is not None:
            tile = self._to_rows(
                tb.tile(ks + self.k_start, ke + self.k_start)[..., visit.r0 : visit.r1, :]
            )
            s5.add_(tile, alpha=unit)
            if self.careful:
                vis = _hide(vis, tile)
        if self.modded:
            self.apply_mod(s5, lo, hi, ks, ke, keep_graph)
        if vis is not None:
            s5.masked_fill_(~vis, float("-inf"))
        if pending is not None:
            s.sub_(pending)
        return s, sig, vis

    def keep(self, qs: int, visit: Visit) -> Tensor | None:
        """Dropout's ``1 / (1 - p)`` on the visit's kept pairs and 0 on the others, as rows
        ``(B*Hkv, rows*G, keys)`` (None without dropout)."""
        if self.dropout is None:
            return None
        p, seed = self.dropout
        lo, hi = qs + visit.r0 + self.q_start, qs + visit.r1 + self.q_start
        shape = (self.n, self.hkv * self.g, self.geo.q_len, self.geo.kv_len)
        keys = (visit.ks + self.k_start, visit.ke + self.k_start)
        kept = dropout_mask(seed, p, shape, queries=(lo, hi), keys=keys, device=self.q5.device)
        rows = kept.unflatten(1, (self.hkv, self.g)).transpose(2, 3)
        rows = rows.reshape(self.n * self.hkv, (hi - lo) * self.g, keys[1] - keys[0])
        out: Tensor = rows.to(self.work).mul_(1.0 / (1.0 - p))
        return out

    def visible(self, qs: int, visit: Visit, vis: Tensor | None) -> Tensor:
        """``(B*Hkv, rows*G, keys)`` float: 1 where the visit's pairs are visible, given the
        careful mode's visibility from :meth:`scores` (which counts a ``-inf`` bias or term as
        masked)."""
        lo, hi = qs + visit.r0, qs + visit.r1
        shape = (self.n, self.hkv, hi - lo, self.g, visit.ke - visit.ks)
        out = torch.ones(shape, dtype=self.work, device=self.q5.device)
        if vis is not None:
            out.masked_fill_(~vis, 0.0)
        return out.view(self.n * self.hkv, (hi - lo) * self.g, visit.ke - visit.ks)


def _hide(vis: Tensor | None, added: Tensor) -> Tensor:
    """``vis`` with the pairs that ``added`` (a bias or term tile) sets to ``-inf`` masked too."""
    keep = added != float("-inf")
    return keep if vis is None else vis & keep


def tile5(t: Tensor, qs: int, qe: int, ks: int, ke: int) -> Tensor:
    """The ``(qs:qe, ks:ke)`` block of a 5-d broadcastable bias; broadcast dims stay size 1."""
    if t.size(-2) != 1:
        t = t[..., qs:qe, :]
    if t.size(-1) != 1:
        t = t[..., ks:ke]
    return t


def _score_shape(p: Problem) -> ScoreShape:
    geo = p.geo
    return Geometry(geo.batch_shape, geo.heads, geo.q_len, geo.kv_len, p.q5.device, p.work)


def default_blocks(
    causal_like: bool, groups: int, q_len: int, term: bool = False
) -> tuple[int, int]:
    """``(block_q, block_k)`` that run well on CPUs.

    Non-causal calls take 512 x 256 blocks. Causal calls waste work in the diagonal's partly
    visible blocks; narrow key blocks, whose rows that see none of their keys are skipped, waste
    least: 512 x 128, with 256-row query blocks below 4096 queries (too few 512-row blocks to skip
    in), and square 256 blocks with grouped heads. With a score term such as relative positions,
    whose product for a block of queries spans ``block_q - 1`` more distances than keys, short
    query blocks waste least: 128 x 512 (128 x 128 within a band).
    """
    if term:
        return 128, 128 if causal_like else 512
    if not causal_like:
        return 512, 256
    if groups == 1:
        return (256 if q_len < 4096 else 512), 128
    return 256, 256
