"""The online softmax's backward: gradients recomputed block by block from the log-sum-exp.

The backward walks the same plan as the forward and recomputes each visited block's scores from
the saved log-sum-exp instead of saving the probabilities (the FlashAttention recipe; Dao et al.,
2022). It asks once whether every row's log-sum-exp is within ``2^+-32`` (:func:`folds`), and then
folds ``exp(-lse)`` into ``dO`` and ``delta`` per row instead of subtracting ``lse`` from
every score. The runs that went to torch's fused kernel take their gradients from its backward
(:func:`~attnkit._kernel.fused.fused_backward`).

The empty-row rule: a query with no visible key has log-sum-exp ``-inf``; the backward reads it as
0, so that its probabilities ``exp(-inf - 0)`` are 0 and its gradients vanish.

In the careful mode (non-finite inputs) the products use the zeroed q, k and v and drop masked
pairs explicitly, the softcap's factor included. A score_mod's tile is called again under
``torch.enable_grad()`` and its gradient taken with ``torch.autograd.grad``
(:meth:`~attnkit._kernel.problem.Problem.mod_backward`); a masked pair's score gets no gradient,
whatever the mod.

The backward is differentiable once: :func:`first_order` marks the gradients it gives where a
graph of them is asked for (``create_graph=True``), so that differentiating them again raises an
error that names the backends whose backward torch differentiates.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..scores import TermBlock
from .fused import fused_backward
from .plan import Visit
from .problem import LOG2E, ZERO_BITS, Problem, tile5

__all__ = ["SECOND_ORDER", "Grads", "backward", "delta_of", "first_order", "folds"]


@dataclass
class Grads:
    """Gradients in the kernel's layout and work dtype."""

    dq: Tensor  # (B, Hkv, G, Tq, Dk)
    dk: Tensor  # (B*Hkv, Tk, Dk)
    dv: Tensor  # (B*Hkv, Tk, Dv)
    dbias5: Tensor | None
    dterm: list[Tensor | None]
    dmod: list[Tensor | None] = field(default_factory=list)


def _score_grads(
    p: Problem,
    ds: Tensor,
    shape5: tuple[int, int, int, int, int],
    vis: Tensor | None,
    sig: Tensor | None,
    qs: int,
    visit: Visit,
    tb: TermBlock | None,
    dbias: Tensor | None,
    dmod: list[Tensor | None],
) -> Tensor:
    """A visit's score gradients ``dL/dS`` (B*Hkv, rows*G, keys) taken through what the call
    adds to the scores: masked pairs get none, the score_mod's inputs, the dense bias and the
    term take theirs, and the softcap's derivative turns them into gradients of ``q k^T``."""
    ds5 = ds.view(shape5)
    if p.careful and vis is not None:
        ds5.masked_fill_(~vis, 0.0)
    if p.modded:
        p.mod_backward(ds5, dmod)
        if vis is not None:  # a masked pair's score gets no gradient, whatever the mod
            ds5.masked_fill_(~vis, 0.0)
    if dbias is not None:
        tile = tile5(dbias, qs + visit.r0, qs + visit.r1, visit.ks, visit.ke).transpose(2, 3)
        tile.add_(ds5.sum_to_size(tile.shape))
    if tb is not None:  # (B, H, rows, keys): a view unless heads are grouped
        ds_heads = ds5.transpose(2, 3).reshape(p.n, p.hkv * p.g, *shape5[2::2])
        tb.backward(visit.ks + p.k_start, visit.ke + p.k_start, ds_heads, visit.r0)
    if sig is None:
        return ds
    # d c tanh(x/c) / dx = 1 - tanh^2 = 4 s (1 - s), s = sigmoid(2x/c): with the sigmoid form
    # s (1 - s), its 4 applied to dQ and dK by the caller; else tanh^2 - 1, the sign there.
    factor = sig.addcmul_(sig, sig, value=-1.0) if p.cap_sigmoid else sig.mul_(sig).sub_(1.0)
    if p.careful and vis is not None:  # a masked pair's NaN score: 0 * NaN
        factor.view(shape5).masked_fill_(~vis, 0.0)
    return ds.mul_(factor) if tb is None else ds * factor  # the term's stay as handed


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
        lse_b, delta_b = p.rows(lse, qb.qs, qb.qe).mul_(LOG2E), p.rows(delta, qb.qs, qb.qe)
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
            ds = _score_grads(p, ds, shape5, vis, sig, qb.qs, visit, tb, dbias, dmod)
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
        fused_backward(p, out, final_lse, dout, dq.transpose(2, 3), dk, dv)
    return Grads(dq.transpose(2, 3), dk, dv, dbias, dterm, dmod)


def folds(lse: Tensor, softcap: float | None) -> bool:
    """Whether the backward may fold ``exp(-lse)`` into ``dO`` and ``delta`` (every row's
    log-sum-exp, base 2, within ``2^+-ZERO_BITS``, no softcap) instead of subtracting it from
    every score. Decided once for the call, one host read."""
    if softcap is not None:
        return False
    if not lse.numel():
        return True
    largest = lse.masked_fill(lse == float("-inf"), 0.0).abs().amax().mul_(LOG2E)
    return float(largest) <= ZERO_BITS


def delta_of(out: Tensor, dout: Tensor) -> Tensor:
    """``rowsum(dO * O)`` ``(B, Hkv, G, Tq)`` in the work dtype, from the unrounded output: with
    float16 O and a near one-hot softmax, ``dO . (v_j - O)`` cancels and O's rounding error would
    dominate the gradients."""
    return (dout.to(out.dtype) * out).sum(-1)


#: Why the gradients of attnkit's kernel cannot be differentiated again, and what can.
SECOND_ORDER = (
    "attnkit's chunked kernel computes first-order gradients only: its backward cannot be "
    "differentiated again (a gradient penalty, a Hessian-vector product, MAML's inner step). "
    'Run such a call with backend="reference", whose backward is made of torch\'s '
    'differentiable operations, or backend="sdpa" inside '
    "torch.nn.attention.sdpa_kernel(SDPBackend.MATH) (torch's fused kernels are first-order "
    'too). backend="auto" picks chunked for training on CPUs: nothing at the forward tells it '
    "that a second derivative will be taken"
)


class _FirstOrder(torch.autograd.Function):
    """A gradient, as it is, whose own backward raises :data:`SECOND_ORDER`. It hangs on the
    ``anchors``, the tensors the gradient depends on, so that it needs a gradient where they do
    (a gradient made from an ``out.sum()`` that needs none would otherwise need none either)."""

    generate_vmap_rule = True  # (torch.func.vmap over grad: per-example gradients)

    @staticmethod
    def forward(grad: Tensor, *anchors: Tensor) -> Tensor:
        return grad.view_as(grad)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *unused: Tensor | None) -> Tensor:
        raise RuntimeError(SECOND_ORDER)


_Backward = Callable[..., tuple[Any, ...]]


def first_order(backward: _Backward) -> _Backward:
    """An ``autograd.Function``'s ``backward`` run without a graph (as torch's
    ``once_differentiable`` runs it); where a graph of its gradients is asked for
    (``create_graph=True``: grad mode is on in the backward), each gradient it gives is marked,
    so that differentiating it again raises :data:`SECOND_ORDER` rather than leaving the
    kernel's part out of the second derivative or failing on a gradient without a graph.
    ``ctx.saved_tensors`` must hold the inputs the gradients depend on."""

    @functools.wraps(backward)
    def run(ctx: Any, *grad_outputs: Any) -> tuple[Any, ...]:
        graphed = torch.is_grad_enabled()
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        if not graphed:
            return grads
        anchors = [t for t in ctx.saved_tensors if isinstance(t, Tensor) and t.requires_grad]
        apply: Callable[..., Tensor] = _FirstOrder.apply
        return tuple(apply(g, *anchors) if isinstance(g, Tensor) else g for g in grads)

    return run
