"""The online softmax: exact attention in O(T * block) memory, forward and backward, in PyTorch.

The forward walks the query blocks of a :class:`~attnkit._kernel.plan.Plan` and, within each, the
key blocks the plan visits, keeping a running maximum, sum and weighted sum per query row, so the
``(Tq, Tk)`` scores never exist at once. The backward recomputes each visited block's scores from
the saved log-sum-exp instead of saving the probabilities (the FlashAttention recipe; Dao et al.,
2022). What a call adds to ``q k^T`` (softcap, a dense ``bias``, a lazy :class:`ScoreTerm`, the
mask's tiles on partial blocks, sinks) is applied here, once, for every backend built on it.

A few details make it fast in eager PyTorch:

* **Lazy rescaling.** The textbook online softmax takes the maximum of every score block and
  rescales the running sums whenever it grows: two extra passes over each block. Here each query row
  keeps a fixed offset ``m`` (the maximum of the first blocks it sees) and later blocks are computed
  directly as ``q k^T - m`` by one ``baddbmm``. Any offset is exact as long as ``exp`` does not
  overflow (it cannot underflow more than with the true maximum, which is >= ``m``). Overflow, of
  the running sum or of the weighted values, is checked for every query block at once at the end of
  the call, and the blocks that overflowed are redone with the textbook rescaling. When every
  offset of a block is small (within ``2^+-32``), the offset is 0 and the subtraction disappears.
* **Decided per call, not per block.** The loops never read a number back to the host: what they
  need is decided once. When ``|q| |k| * scale`` bounds every score of the call within
  ``2^+-32`` (base 2) and nothing is added to the scores, every block takes offset 0 from its
  first key and nothing can overflow (three norms, one read). Otherwise the first block whose rows
  are all reached asks whether its offsets are small, and the others move onto 0 on that answer,
  checked with the overflow at the end. The backward asks once whether every row's log-sum-exp is
  within ``2^+-32``, and then folds ``exp(-lse)`` into ``dO`` and ``delta`` per row instead of
  subtracting ``lse`` from every score.
* **Cheap elementwise work.** Scores are kept in base 2 (``log2(e)`` rides on the queries, and on
  the adds of a bias or score term) because ``exp2`` costs about half of ``exp`` on CPUs, and a
  softcap up to a few dozen is computed through a sigmoid, a fraction of the cost of ``tanh``
  (larger caps, where that form would cancel, through ``tanh``; see ``scores.softcap_form``).
* **One buffer per kind of work.** Each visit's scores (and in the backward their gradients and
  the softcap's sigmoid) are written into a buffer the whole call reuses (:meth:`Problem.scratch`):
  a GEMM and the passes after it run measurably faster there than in a fresh multi-MiB tensor.
* **Grouped-query attention without copies.** The ``G = H / Hkv`` query heads that share a key head
  are stacked as rows of one matrix (query-major: row ``t * G + g``), so each score block is a
  single batched GEMM against the shared keys, and a block's first rows can be skipped for every
  group at once.

**Fully visible stretches** of the plan (see :func:`~attnkit._kernel.plan.split_runs`) go, on CPUs
and when it computes the same thing, to torch's fused CPU attention kernel: one call per run and
query group, merged with the rest of each row by log-sum-exp (:func:`merge`). Its backward, given
the call's final output and log-sum-exp, computes exactly those keys' share of the gradients,
because the probabilities ``exp(S - lse)`` and ``rowsum(dO * O)`` it forms are the whole row's.

The single rule for a query with no visible key lives here too: its log-sum-exp is ``-inf``, its
output 0, and the backward reads its log-sum-exp as 0 so that its probabilities ``exp(-inf - 0)``
are 0 and its gradients vanish.

Non-finite inputs (a call's ``careful`` mode, decided once per call): scores of masked pairs (by
the mask, or by a ``-inf`` bias or score term) are replaced by ``-inf`` after the product, so NaN
at masked positions of q, k or ``bias`` never matters; values enter the weighted sum with their
non-finite entries zeroed, and an output entry is made NaN exactly when a visible key's value is
non-finite there; the backward's products use the zeroed q, k and v and drop masked pairs
explicitly, the softcap's factor included.

**A score_mod** (``score_mod(score, b, h, q_idx, kv_idx)``, any function) is applied to each
visit's natural-log scores, after softcap and bias and before the mask, with the tile's broadcast
index tensors; the backward recomputes the tile's scores, calls the score_mod again under
``torch.enable_grad()``, and turns the modified scores' gradient into the scores' gradient and
the gradients of the tensors it captures (``mod_inputs``) with ``torch.autograd.grad``. Nothing
else changes: masked pairs are ``-inf`` whatever it returns there, and a row it leaves with no
finite score follows the empty-row rule.

float16/bfloat16 inputs are computed block by block in float32.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .._score_mod import ScoreMod, index_tensors
from .._score_mod import apply as apply_score_mod
from ..masks import Geometry, Mask
from ..scores import ScoreShape, ScoreTerm, TermBlock, reused, softcap_form
from .dropout import dropout_mask
from .plan import Plan, QueryBlock, Run, Visit, split_runs

__all__ = [
    "FUSED_ROWS",
    "Problem",
    "backward",
    "finish",
    "folds",
    "forward",
    "fused_serves",
    "merge",
    "no_autocast",
    "sink_grad",
    "sizes",
    "small_scores",
    "zero_offset_safe",
]

# A running sum at or above this (or inf/NaN) means the lazy offset was too low: redo the block.
_OVERFLOW_GUARD = 2.0**64
_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2
# Rows whose offsets (base 2) are all within +-32 take offset 0: the sums of 2^score stay far from
# float32's limits unless a later score is 2^32 times larger, which the guard catches.
_ZERO_BITS = 32.0
# A row that takes offset 0 before it has seen a visible key must end with a sum at least this
# large (its largest score then lies within the zero offset's range).
_TINY_SUM = 2.0**-_ZERO_BITS
# Fully visible work of at least this many queries goes to torch's fused CPU kernel, whose tiles
# are tallest (and fastest) from 768 queries up.
FUSED_ROWS = 768


def _fused_ops() -> (
    tuple[Callable[..., tuple[Tensor, Tensor]], Callable[..., tuple[Tensor, ...]]] | None
):
    """torch's fused CPU attention forward and backward (the kernel behind its SDPA on CPUs)."""
    try:
        return (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        )
    except (AttributeError, RuntimeError):  # a build without them: the kernel does the work
        return None


_FUSED = _fused_ops()


def _fused() -> tuple[Callable[..., tuple[Tensor, Tensor]], Callable[..., tuple[Tensor, ...]]]:
    """The fused ops, for a problem whose runs were split off because they exist."""
    if _FUSED is None:
        raise RuntimeError("attnkit internal error: runs planned without torch's fused kernel")
    return _FUSED


def fused_serves(
    device: torch.device,
    dtype: torch.dtype,
    dk: int,
    dv: int,
    *,
    softcap: float | None,
    added: bool,
) -> bool:
    """Whether torch's fused CPU kernel computes what a call asks of its fully visible blocks:
    plain ``softmax(q k^T * scale) v`` (no softcap, nothing ``added`` to the scores) in float32 or
    float64 on the CPU, keys and values of one width."""
    return (
        _FUSED is not None
        and device.type == "cpu"
        and dtype in (torch.float32, torch.float64)
        and dk == dv
        and softcap is None
        and not added
    )


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Autocast off for the kernel's own work, whose dtypes are chosen on purpose.

    Inside ``torch.autocast`` (a forward, or a backward called within it) every ``bmm`` would run
    in the autocast dtype and meet the float32 running sums.
    """
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _bad(t: Tensor) -> Tensor:
    return ~torch.isfinite(t)


def _clean(t: Tensor) -> Tensor:
    """``t`` with its non-finite entries replaced by 0."""
    return t.masked_fill(_bad(t), 0.0)


@dataclass
class Problem:
    """One call (or one shard pair of a ring call) in the kernel's layout.

    ``q5`` is ``(B, Hkv, G, Tq, Dk)`` (batch dims flattened to ``B``), ``k3``/``v3`` are
    ``(B*Hkv, Tk, D)``; ``bias5`` is a ``(B|1, Hkv|1, G|1, Tq|1, Tk|1)`` view of a dense bias;
    ``sinks`` is ``(Hkv, G)``. ``geo`` is the call the mask and the score term are asked about, and
    ``q_start``/``k_start`` where the local queries and keys sit in it. ``fused_rows``: runs of
    fully visible blocks with at least this many queries go to torch's fused CPU kernel when
    nothing is added to the scores (``None``: never). ``zero_offset``: what
    :func:`zero_offset_safe` answers for the call, when the caller knows it (``None``: the forward
    asks, one host read). ``score_mod`` and the tensors it captures, ``mod_inputs``, are described
    in the module docstring.
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
        self.v_bad = self.careful and bool(_bad(self.v3).any())
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
            out.masked_fill_(_bad(out), 0.0)
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
        return _tile5(self.bias5, qs, qe, ks, ke).transpose(2, 3)

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
            return 1.0 if self.modded else _LOG2E
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
            s5.mul_(_LOG2E)
        else:
            torch.mul(y5, _LOG2E, out=s5)

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
        unit = 1.0 if self.modded else _LOG2E  # a score_mod sees natural-log scores
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


def _tile5(t: Tensor, qs: int, qe: int, ks: int, ke: int) -> Tensor:
    """The ``(qs:qe, ks:ke)`` block of a 5-d broadcastable bias; broadcast dims stay size 1."""
    if t.size(-2) != 1:
        t = t[..., qs:qe, :]
    if t.size(-1) != 1:
        t = t[..., ks:ke]
    return t


def _score_shape(p: Problem) -> ScoreShape:
    geo = p.geo
    return Geometry(geo.batch_shape, geo.heads, geo.q_len, geo.kv_len, p.q5.device, p.work)


# --------------------------------------------------------------------------------------------------
# Forward


def zero_offset_safe(p: Problem) -> bool:
    """Whether every block of the call may take offset 0 from its first key: no softcap and nothing
    added to the scores (a score_mod can make any score of bounded q and k unbounded), and
    :func:`small_scores` holds for its q, k and v. One host read."""
    if p.softcap is not None or p.bias5 is not None or p.term is not None or p.careful:
        return False
    if p.modded:
        return False
    if not (p.q5.numel() and p.k3.numel() and p.v3.numel()):
        return False
    q_norm, k_norm, v_max = sizes(p.q5, p.k3, p.v3, p.work).tolist()
    return small_scores(q_norm, k_norm, v_max, p.scale, p.tk, p.work)


def sizes(q: Tensor, k: Tensor, v: Tensor, work: torch.dtype) -> Tensor:
    """The largest row norm (over the last dimension) of non-empty ``q``, ``k`` and ``v``, as one
    tensor of 3 in ``work``, for :func:`small_scores` (a value row's norm bounds its entries): one
    pass over each. Inf or NaN where an input holds inf or NaN (or where a square overflows)."""
    return torch.stack([torch.linalg.vector_norm(t, dim=-1, dtype=work).amax() for t in (q, k, v)])


def small_scores(
    q_norm: float, k_norm: float, v_max: float, scale: float, keys: int, work: torch.dtype
) -> bool:
    """Whether queries and keys of at most these norms give scores (base 2) within
    ``2^+-_ZERO_BITS`` (Cauchy-Schwarz: ``|q . k| <= |q| |k|``), and ``keys`` of them, weighting
    values no larger than ``v_max``, sums that stay within ``work``'s range: then offset 0 is
    exact for every row. NaN compares False."""
    bound = abs(scale) * _LOG2E * q_norm * k_norm
    return bound <= _ZERO_BITS and keys * 2.0**bound * v_max <= torch.finfo(work).max / 4


def _forward_block(
    p: Problem, qb: QueryBlock, mode: str, switch: bool | None = False
) -> tuple[Tensor, Tensor, Tensor | None, bool | None]:
    """Output (normalised) and log-sum-exp of one query block, as rows; for ``mode="lazy"`` a
    bool tensor, whether the lazy offsets were safe (False: redo the block ``"exact"``), and
    whether it moved its offsets onto 0.

    ``"exact"`` is the textbook online softmax (rescale whenever a block's maximum is larger).
    ``"zero"`` takes offset 0 for every key (:func:`zero_offset_safe` holds for the call).
    ``"lazy"`` rescales on the visits that reach rows no earlier visit of the block reached, as
    the plan says, and keeps each row's offset afterwards. A row the plan reached that has seen no
    visible key keeps offset ``-inf``, so any key it sees later makes its sum inf or NaN and fails
    the check.
    Once every row is reached, ``switch`` says whether the offsets move onto 0: ``None`` asks
    (one host read: are they all within ``2^+-32``), True takes it on trust (checked at the end).
    """
    qr_all = p.q_rows(qb.qs, qb.qe, factor=p.score_factor())
    tb = p.term_block(qb, None)
    rows = qr_all.size(1)
    acc = qr_all.new_zeros(qr_all.size(0), rows, p.dv)
    lsum = qr_all.new_zeros(qr_all.size(0), rows, 1)
    zero = mode == "zero"  # offset 0: no subtraction at all
    m = qr_all.new_full((qr_all.size(0), rows, 1), 0.0 if zero else float("-inf"))
    spoiled = qr_all.new_zeros(qr_all.size(0), rows, p.dv) if p.v_bad else None
    # Rows of the block some visit has reached (lazy mode), as the plan says: no data is read.
    reached = bytearray(qb.qe - qb.qs) if mode == "lazy" else None
    switched: bool | None = None
    unsure: list[Tensor] = []  # where the offset 0 taken on trust may have been wrong
    for visit in qb.visits:
        lo, hi = visit.r0 * p.g, visit.r1 * p.g
        step = zero or (reached is not None and reached.find(0, visit.r0, visit.r1) < 0)
        offset = m[:, lo:hi] if step and not zero else None
        s, _, vis = p.scores(qr_all[:, lo:hi], qb.qs, visit, offset, tb)
        vb = p.values(visit.ks, visit.ke)
        if step:
            torch.exp2_(s)
        else:
            m_old = m[:, lo:hi]
            m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
            # Rows that have seen no visible key keep m = -inf (so a later block sets it from its
            # own maximum) but subtract 0: their scores are all -inf and exp(-inf - 0) = 0.
            m_sub = m_new.masked_fill(m_new == float("-inf"), 0.0)
            alpha = torch.exp2_(m_old - m_sub)
            torch.exp2_(s.sub_(m_sub))
            lsum[:, lo:hi].mul_(alpha)
            acc[:, lo:hi].mul_(alpha)
            m[:, lo:hi] = m_new
        lsum[:, lo:hi].add_(s.sum(-1, keepdim=True))
        keep = p.keep(qb.qs, visit)
        acc[:, lo:hi].baddbmm_(s if keep is None else s.mul_(keep), vb)
        if reached is not None and not step:
            reached[visit.r0 : visit.r1] = b"\x01" * (visit.r1 - visit.r0)
            if switch is not False and reached.find(0) < 0:
                # Every row reached: offsets within 2^+-32 move onto 0 (the sums so far with them),
                # so later blocks are exp(q k^T) with no pass to subtract anything. A row that has
                # seen no key yet takes 0 too, and must end with a sum that is not tiny (else its
                # keys may have underflowed): the check at the end redoes the block.
                empty = m == float("-inf")
                offsets = m.masked_fill(empty, 0.0).abs()
                if switch is None:
                    # NaN: False; no rows at all (an empty batch): nothing to switch
                    switch = offsets.numel() > 0 and float(offsets.amax()) <= _ZERO_BITS
                if switch:
                    unsure += [~(offsets <= _ZERO_BITS), empty]
                    shift = torch.exp2_(m.clone())
                    lsum.mul_(shift)
                    acc.mul_(shift)
                    m.zero_()
                    zero = True
                switched = switch
        if spoiled is not None:
            bad = _bad(p.v3[:, visit.ks : visit.ke]).to(p.work)
            spoiled[:, lo:hi].baddbmm_(p.visible(qb.qs, visit, vis), bad)
    safe = None
    if mode == "lazy":
        # The lazy offset was too low if a running sum passed the guard or the weighted values
        # overflowed: one number tells both (NaN/inf in acc makes it NaN, and NaN < guard is false).
        safe = acc.sum().mul_(0.0).add_(lsum.amax() if lsum.numel() else 0.0) < _OVERFLOW_GUARD
        if unsure:
            wrong, empty = unsure
            safe &= ~(wrong | (empty & (lsum < _TINY_SUM))).any()
    empty_rows = lsum == 0  # rows with no key they may attend: output 0, never 0/0
    out = acc.div_(lsum.masked_fill(empty_rows, 1.0))
    if spoiled is not None:
        out.masked_fill_(spoiled > 0, float("nan"))
    # -inf for empty rows: m = -inf (or 0) and log(0) = -inf
    lse = m.add_(lsum.log2_()).mul_(_LN2)
    return out, lse, safe, switched


def forward(p: Problem) -> tuple[Tensor, Tensor]:
    """Output ``(B, Hkv, G, Tq, Dv)`` in the work dtype (laid out in memory as ``(B, Tq, H, Dv)``)
    and log-sum-exp ``(B, Hkv, G, Tq)``, ``-inf`` for queries with no visible key. No sinks.

    At most three host reads, whatever the number of blocks: :func:`zero_offset_safe` (unless the
    problem was told); in lazy mode, whether the first block's offsets may move onto 0 (the later
    blocks then do so on trust), and one check of every block at the end (the blocks that fail it
    are redone with the textbook rescaling).
    """
    out = torch.empty(p.n, p.tq, p.hkv, p.g, p.dv, dtype=p.work, device=p.q5.device)
    out = out.permute(0, 2, 3, 1, 4)
    lse = torch.empty(p.n, p.hkv, p.g, p.tq, dtype=p.work, device=p.q5.device)
    if p.runs:
        _fused_forward(p, out, lse)
    zero = p.zero_offset if p.zero_offset is not None else zero_offset_safe(p)
    mode = "zero" if zero else "lazy"
    # A softcap's offsets ride on its sigmoid pass for free: they never move onto 0.
    switch: bool | None = None if p.softcap is None else False
    # In lazy mode a fused block's part is merged only once it is known to be exact.
    held: dict[int, tuple[Tensor, Tensor]] = {}
    checks: list[tuple[int, Tensor]] = []
    for i, qb in enumerate(p.blocks):
        if not qb.visits:
            if not qb.fused:
                out[:, :, :, qb.qs : qb.qe] = 0.0
                lse[:, :, :, qb.qs : qb.qe] = float("-inf")
            continue
        o, lse_b, safe, switched = _forward_block(p, qb, mode, switch)
        if switch is None:
            switch = switched
        if safe is not None:
            checks.append((i, safe))
        if qb.fused and safe is not None:
            held[i] = (o, lse_b)
        else:
            _store(p, qb, out, lse, o, lse_b)
    if checks:
        verdicts = torch.stack([safe for _, safe in checks]).tolist()
        for (i, _), fine in zip(checks, verdicts, strict=True):
            if not fine:
                o, lse_b, _, _ = _forward_block(p, p.blocks[i], "exact")
                if i in held:
                    held[i] = (o, lse_b)
                else:
                    _store(p, p.blocks[i], out, lse, o, lse_b)
    for i, (o, lse_b) in held.items():
        _store(p, p.blocks[i], out, lse, o, lse_b)
    return out, lse


def _store(p: Problem, qb: QueryBlock, out: Tensor, lse: Tensor, o: Tensor, lse_b: Tensor) -> None:
    """Write one query block's rows into the output, or merge them with a run's part of them."""
    rows = qb.qe - qb.qs
    o5 = o.view(p.n, p.hkv, rows, p.g, p.dv).transpose(2, 3)
    lse5 = lse_b.view(p.n, p.hkv, rows, p.g).transpose(2, 3)
    if qb.fused:
        merge(out[:, :, :, qb.qs : qb.qe], lse[:, :, :, qb.qs : qb.qe], o5, lse5)
    else:
        out[:, :, :, qb.qs : qb.qe] = o5
        lse[:, :, :, qb.qs : qb.qe] = lse5


def _kv4(p: Problem, run: Run) -> tuple[Tensor, Tensor]:
    """The run's keys and values as ``(B, Hkv, keys, D)`` views."""
    k4 = p.k3.unflatten(0, (p.n, p.hkv))[:, :, run.ks : run.ke]
    return k4, p.v3.unflatten(0, (p.n, p.hkv))[:, :, run.ks : run.ke]


def _fused_forward(p: Problem, out: Tensor, lse: Tensor) -> None:
    """The problem's runs through torch's fused kernel, one call per run and query group (the
    ``G`` query heads that share a key head are ``G`` calls on views, no copies)."""
    fused_forward = _fused()[0]
    for run in p.runs:
        k4, v4 = _kv4(p, run)
        for g in range(p.g):
            o, lse_g = fused_forward(p.q5[:, :, g, run.qs : run.qe], k4, v4, scale=p.scale)
            out[:, :, g, run.qs : run.qe] = o
            lse[:, :, g, run.qs : run.qe] = lse_g


def merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one part's (output, log-sum-exp) into a running pair, in place (``block_out`` too).

    Two parts of one row's keys combine exactly: ``lse = logaddexp(lse_a, lse_b)`` and each output
    weighs ``exp(lse_part - lse)``.
    """
    new = torch.logaddexp(lse, block_lse)
    # A row that has seen no key on either side stays at -inf; subtracting 0 then keeps both
    # weights at exp(-inf) = 0 instead of exp(-inf + inf) = nan.
    safe = new.masked_fill(new == float("-inf"), 0.0)
    out.mul_((lse - safe).exp_().unsqueeze(-1))
    out.add_(block_out.mul_((block_lse - safe).exp_().unsqueeze(-1)))
    lse.copy_(new)


def finish(out: Tensor, lse: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """Fold the sinks ``(Hkv, G)`` into a forward's output and log-sum-exp (in place for ``out``).

    A sink joins each row's softmax denominator with its logit and attends to nothing, so the row's
    output shrinks by ``exp(lse - lse_with_sink)``; a row with no visible key stays 0. A ``-inf``
    sink is no sink: a row with no visible key then keeps log-sum-exp ``-inf``.
    """
    if sinks is None:
        return out, lse
    total = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, :, None])
    # exp(-inf - 0) = 0 where both are -inf, not exp(-inf + inf) = NaN
    out.mul_((lse - total.masked_fill(total == float("-inf"), 0.0)).exp_().unsqueeze(-1))
    return out, total


# --------------------------------------------------------------------------------------------------
# Backward


@dataclass
class Grads:
    """Gradients in the kernel's layout and work dtype."""

    dq: Tensor  # (B, Hkv, G, Tq, Dk)
    dk: Tensor  # (B*Hkv, Tk, Dk)
    dv: Tensor  # (B*Hkv, Tk, Dv)
    dbias5: Tensor | None
    dterm: list[Tensor | None]
    dmod: list[Tensor | None] = field(default_factory=list)


def backward(
    p: Problem,
    out: Tensor,
    lse: Tensor,
    delta: Tensor,
    dout: Tensor,
    *,
    bias_grad: bool,
    term_grads: bool,
    fold: bool | None = None,
) -> Grads:
    """Gradients of one problem given the call's final output ``(B, Hkv, G, Tq, Dv)`` (before
    rounding), log-sum-exp and ``delta = rowsum(dO * O)`` (both ``(B, Hkv, G, Tq)``, sinks
    included) and ``dout`` ``(B, Hkv, G, Tq, Dv)``. ``fold``: what :func:`folds` answers for the
    call's log-sum-exp, when the caller knows it (``None``: asked here, one host read)."""
    final_lse = lse
    if fold is None:
        fold = folds(lse, p.softcap)
    # The empty-row rule: such rows read lse 0, so their probabilities exp(-inf - 0) are 0.
    lse = lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1)
    delta = delta.unsqueeze(-1)
    dev = p.q5.device
    dq = torch.zeros(p.n, p.hkv, p.tq, p.g, p.dk, dtype=p.work, device=dev)
    dk = torch.zeros(p.n * p.hkv, p.tk, p.dk, dtype=p.work, device=dev)
    dv = torch.zeros(p.n * p.hkv, p.tk, p.dv, dtype=p.work, device=dev)
    dbias = None
    if bias_grad and p.bias5 is not None:
        dbias = torch.zeros(p.bias5.shape, dtype=p.work, device=dev)
    dterm: list[Tensor | None] = [None] * len(p.term_inputs)
    dmod: list[Tensor | None] = [None] * len(p.mod_inputs)
    for qb in p.blocks:
        if not qb.visits:
            continue
        qr = p.q_rows(qb.qs, qb.qe, factor=p.score_factor())  # for the scores
        qr_clean = p.q_rows(qb.qs, qb.qe, clean=p.careful)  # for dK
        lse_b, delta_b = p.rows(lse, qb.qs, qb.qe).mul_(_LOG2E), p.rows(delta, qb.qs, qb.qe)
        do_b = p.rows(dout, qb.qs, qb.qe)
        offset: Tensor | None = lse_b
        if fold:
            # P = exp(S - lse) = exp(S) * w with w = exp(-lse) per row, small enough to carry in
            # dO and delta instead: dV = exp(S)^T (w dO), dS = exp(S) (w dO V^T - w delta).
            w = torch.exp2_(lse_b.neg())
            do_b.mul_(w)
            delta_b.mul_(w)
            offset = None
        dq_b = torch.zeros_like(qr)
        tb = p.term_block(qb, dterm if term_grads else None)
        for visit in qb.visits:
            lo, hi = visit.r0 * p.g, visit.r1 * p.g
            s, sig, vis = p.scores(
                qr[:, lo:hi],
                qb.qs,
                visit,
                None if offset is None else offset[:, lo:hi],
                tb,
                keep_sigmoid=p.softcap is not None,
                keep_graph=p.modded,
            )
            prob = torch.exp2_(s)  # (B*Hkv, rows*G, keys): the forward's probabilities, recomputed
            shape5 = (p.n, p.hkv, (hi - lo) // p.g, p.g, visit.ke - visit.ks)
            if p.careful and vis is not None:
                prob.view(shape5).masked_fill_(~vis, 0.0)
            kb = p.keys(visit.ks, visit.ke, clean=p.careful)
            vb = p.values(visit.ks, visit.ke)
            do_r = do_b[:, lo:hi]
            keep = p.keep(qb.qs, visit)  # dropout: the forward's weights were prob * keep
            kept = prob if keep is None else prob * keep
            dv[:, visit.ks : visit.ke].baddbmm_(kept.transpose(1, 2), do_r)
            # A term's block may keep the score gradients it is handed: then they are its own.
            ds = torch.bmm(
                do_r, vb.transpose(1, 2), out=None if tb is not None else p.scratch("ds", s.shape)
            )
            if keep is not None:
                ds.mul_(keep)
            ds.sub_(delta_b[:, lo:hi]).mul_(prob)  # dL/dS
            ds5 = ds.view(shape5)
            if p.careful and vis is not None:
                ds5.masked_fill_(~vis, 0.0)
            if p.modded:
                p.mod_backward(ds5, dmod)
                if vis is not None:  # a masked pair's score gets no gradient, whatever the mod
                    ds5.masked_fill_(~vis, 0.0)
            if dbias is not None:
                tile = _tile5(dbias, qb.qs + visit.r0, qb.qs + visit.r1, visit.ks, visit.ke)
                tile = tile.transpose(2, 3)
                tile.add_(ds5.sum_to_size(tile.shape))
            if tb is not None:  # (B, H, rows, keys): a view unless heads are grouped
                ds_heads = ds5.transpose(2, 3).reshape(p.n, p.hkv * p.g, *shape5[2::2])
                tb.backward(visit.ks + p.k_start, visit.ke + p.k_start, ds_heads, visit.r0)
            if sig is not None:  # d c tanh(x/c) / dx = 1 - tanh^2 = 4 s (1 - s), s = sigmoid(2x/c)
                if p.cap_sigmoid:  # the 4 is applied to dQ and dK below
                    factor = sig.addcmul_(sig, sig, value=-1.0)
                else:  # tanh^2 - 1: the sign is applied to dQ and dK below
                    factor = sig.mul_(sig).sub_(1.0)
                if p.careful and vis is not None:  # a masked pair's NaN score: 0 * NaN
                    factor.view(shape5).masked_fill_(~vis, 0.0)
                ds = ds.mul_(factor) if tb is None else ds * factor  # the term's stay as handed
            dq_b[:, lo:hi].baddbmm_(ds, kb)
            dk[:, visit.ks : visit.ke].baddbmm_(ds.transpose(1, 2), qr_clean[:, lo:hi])
        if tb is not None:
            tb.flush()
        dq[:, :, qb.qs : qb.qe] = dq_b.view(p.n, p.hkv, qb.qe - qb.qs, p.g, p.dk)
    capped = 1.0 if p.softcap is None else 4.0 if p.cap_sigmoid else -1.0
    dq.mul_(p.scale * capped)
    if p.softcap is not None:
        dk.mul_(capped)
    if p.runs:
        _fused_backward(p, out, final_lse, dout, dq.transpose(2, 3), dk, dv)
    return Grads(dq.transpose(2, 3), dk, dv, dbias, dterm, dmod)


def folds(lse: Tensor, softcap: float | None) -> bool:
    """Whether the backward may fold ``exp(-lse)`` into ``dO`` and ``delta`` (every row's
    log-sum-exp, base 2, within ``2^+-_ZERO_BITS``, no softcap) instead of subtracting it from
    every score. Decided once for the call, one host read."""
    if softcap is not None:
        return False
    if not lse.numel():
        return True
    largest = lse.masked_fill(lse == float("-inf"), 0.0).abs().amax().mul_(_LOG2E)
    return float(largest) <= _ZERO_BITS


def _unit_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _fused_backward(
    p: Problem, out: Tensor, lse: Tensor, dout: Tensor, dq5: Tensor, dk: Tensor, dv: Tensor
) -> None:
    """Add the runs' gradients. Given the call's final output and log-sum-exp, the fused
    backward of a run's keys computes exactly their share: the probabilities ``exp(S - lse)`` and
    ``rowsum(dO * O)`` are those of the whole row."""
    fused_backward = _fused()[1]
    out, dout = _unit_stride(out), _unit_stride(dout)
    dk4, dv4 = dk.unflatten(0, (p.n, p.hkv)), dv.unflatten(0, (p.n, p.hkv))
    for run in p.runs:
        k4, v4 = _kv4(p, run)
        rows = slice(run.qs, run.qe)
        for g in range(p.g):
            dq_g, dk_g, dv_g = fused_backward(
                dout[:, :, g, rows],
                p.q5[:, :, g, rows],
                k4,
                v4,
                out[:, :, g, rows],
                lse[:, :, g, rows],
                0.0,
                False,
                scale=p.scale,
            )
            dq5[:, :, g, rows] += dq_g
            dk4[:, :, run.ks : run.ke] += dk_g
            dv4[:, :, run.ks : run.ke] += dv_g


def sink_grad(lse: Tensor, delta: Tensor, sinks: Tensor) -> Tensor:
    """``d loss / d sinks`` ``(Hkv, G)``: each row's sink has probability ``exp(sink - lse)`` and
    value 0, so it moves the output by ``-p_sink * O``: ``-sum_rows p_sink * rowsum(dO * O)``."""
    # A -inf sink of a row with no visible key (lse -inf too) has probability 0, not exp(NaN).
    p_sink = (
        sinks.to(lse.dtype)[None, :, :, None] - lse.masked_fill(lse == float("-inf"), 0.0)
    ).exp_()
    return -(p_sink * delta).sum(dim=(0, 3))


def delta_of(out: Tensor, dout: Tensor) -> Tensor:
    """``rowsum(dO * O)`` ``(B, Hkv, G, Tq)`` in the work dtype, from the unrounded output: with
    float16 O and a near one-hot softmax, ``dO . (v_j - O)`` cancels and O's rounding error would
    dominate the gradients."""
    return (dout.to(out.dtype) * out).sum(-1)


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
