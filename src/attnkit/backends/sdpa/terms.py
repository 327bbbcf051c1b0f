"""A score term beside torch's kernel: one fused call per block of queries, whose float
``attn_mask`` is the block's term (+ bias, masked with -inf); memory O(B * H * block * Tk). Calls
without gradients only (torch would keep each block's probabilities for the backward).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._kernel import make_plan
from ...masks import Geometry, Mask
from ...scores import ScoreTerm
from . import screen

__all__ = ["TERM_KEYS", "blocked_term"]

# A score term's tiles are asked for this many keys at a time: a term that computes a product per
# tile (relative positions over long inputs) then keeps it in the CPU's caches.
TERM_KEYS = 1024


def blocked_term(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None,
    bias: Tensor | None,
    term: ScoreTerm,
    scale: float,
    dropout_p: float,
    block_q: int,
    product_q: int,
    term_keys: int = TERM_KEYS,
) -> tuple[Tensor, bool]:
    """A score term without gradients: per block of queries, one fused call whose float mask is
    the block's term (+ bias, masked with -inf). Keys no query of the block may see are left out.
    Returns the output and whether it looked trustworthy.

    torch takes a strided float mask as it is, so a term whose tiles are views of its own product
    (relative positions) reaches the fused kernel without a copy when nothing is added to it.
    """
    batch = tuple(q.shape[:-3])
    h, tq, _ = q.shape[-3:]
    hkv, tk, dv = v.shape[-3:]
    n = math.prod(batch)
    q4, k4, v4 = (t.reshape(n, *t.shape[-3:]) for t in (q, k, v))
    bias4 = None
    if bias is not None:
        bias4 = bias.reshape((1,) * (len(batch) + 3 - bias.ndim) + tuple(bias.shape))
        bias4 = bias4.expand(*batch, *bias4.shape[len(batch) :]).reshape(-1, *bias4.shape[-3:])
    geo = Geometry(batch, h, tq, tk, q.device)
    work = torch.promote_types(q.dtype, torch.float32)
    shape = Geometry(batch, h, tq, tk, q.device, work)
    inputs = tuple(term.inputs())
    empties: list[Tensor] = []  # (B, H, rows): queries of each block that see no key
    # The plan says which keys each block of queries can see (64-key resolution).
    plan = make_plan(
        mask, geo, q_start=0, q_len=tq, k_start=0, kv_len=tk, block_q=block_q, block_k=64
    )
    # (B, Tq, H, Dv) memory, so that a caller's merge of the heads is a view, not a copy.
    out = q.new_empty(n, tq, h, dv).transpose(1, 2)
    widest = max((b.key_range[1] - b.key_range[0] for b in plan.blocks), default=0)
    scratch = _Scratch(n * h * block_q * widest, work, q.device)
    for qb in plan.blocks:
        qs, qe = qb.qs, qb.qe
        lo, hi = qb.key_range
        if hi <= lo:  # no query of the block sees a key
            out[:, :, qs:qe] = 0.0
            empties.append(torch.ones((), dtype=torch.bool, device=q.device).expand(n, h, qe - qs))
            continue
        covered = sum(vt.ke - vt.ks for vt in qb.visits) == hi - lo
        masked = mask is not None and (not covered or any(vt.partial for vt in qb.visits))
        full = (n, h, qe - qs, hi - lo)
        if qe - qs <= product_q:
            tb = term.block(inputs, shape, qs, qe, lo, hi, grads=None)
            attn_mask = tb.tile(lo, hi)  # (B|1, H|1, rows, keys)
            writable = tb.writable and tuple(attn_mask.shape) == full
        else:
            into = scratch.take(full)
            attn_mask = _products(term, inputs, shape, into, qs, lo, product_q, term_keys)
            writable = True
        if bias4 is not None or masked:
            if not writable:
                attn_mask = scratch.take(full).copy_(attn_mask)
            if bias4 is not None:
                attn_mask.add_((bias4[..., qs:qe, :] if bias4.size(-2) != 1 else bias4)[..., lo:hi])
            if masked and mask is not None:
                hidden = ~mask.tile(geo, qs, qe, lo, hi)
                attn_mask.masked_fill_(hidden, float("-inf"))
        block = F.scaled_dot_product_attention(
            q4[:, :, qs:qe],
            k4[:, :, lo:hi],
            v4[:, :, lo:hi],
            attn_mask=attn_mask.to(q.dtype),
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=True if h != hkv else False,  # noqa: SIM210 (a SymBool is refused)
        )
        if bias4 is not None:  # a -inf bias may empty a row too
            empty = (attn_mask == float("-inf")).all(-1)
        elif masked:
            empty = hidden.all(-1)
        if masked or bias4 is not None:
            if q.device.type != "cpu":
                block = block.masked_fill(empty.unsqueeze(-1), 0.0)
            empties.append(empty.expand(n, h, qe - qs))
        else:
            empties.append(torch.zeros((), dtype=torch.bool, device=q.device).expand(n, h, qe - qs))
        out[:, :, qs:qe] = block
    trusted = torch.compiler.is_compiling() or screen.trustworthy(
        out, None, torch.cat(empties, -1) if empties else None, (q4, k4, v4), dropout_p > 0
    )
    return out.reshape(*batch, h, tq, dv), trusted


class _Scratch:
    """A float buffer for the blocks' masks that must be written: allocated when a block first
    needs it, then reused by every block rather than one per block."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.size, self.dtype, self.device = size, dtype, device
        self.buffer: Tensor | None = None

    def take(self, shape: tuple[int, ...]) -> Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(self.size, dtype=self.dtype, device=self.device)
        return self.buffer[: math.prod(shape)].view(shape)


def _products(
    term: ScoreTerm,
    inputs: tuple[Tensor, ...],
    shape: Geometry,
    into: Tensor,
    qs: int,
    lo: int,
    product_q: int,
    term_keys: int,
) -> Tensor:
    """The term of a block of queries from ``qs`` and keys from ``lo`` (``into``'s rows and
    columns), written into ``into``: ``product_q`` queries per product, ``term_keys`` keys per
    tile. Products of a few rows waste little (a product spans rows - 1 more distances than keys);
    one fused call over many rows costs less per query."""
    qe, hi = qs + into.size(-2), lo + into.size(-1)
    for ps in range(qs, qe, product_q):
        pe = min(ps + product_q, qe)
        tb = term.block(inputs, shape, ps, pe, lo, hi, grads=None)
        for ks in range(lo, hi, term_keys):
            ke = min(ks + term_keys, hi)
            into[:, :, ps - qs : pe - qs, ks - lo : ke - lo] = tb.tile(ks, ke)
    return into
