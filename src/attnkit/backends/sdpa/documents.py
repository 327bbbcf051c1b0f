"""Packed documents, one fused call each: torch serves a mask of packed documents (alone or with
causal) as variable-length kernels do, one ``scaled_dot_product_attention`` per document of each
batch row, when the documents are long enough for that to cost less than the blocked kernel.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ...masks import Mask

__all__ = ["MIN_DOCUMENT_MEAN", "document_cuts", "per_document"]

# Packed documents go to torch one document at a time (as variable-length kernels do) when they
# are long enough for a call per document to cost less than the blocked kernel. The cuts come from
# the mask's document starts, not from a BlockPlan: a plan is block-granular, a cut must be exact.
MIN_DOCUMENT_MEAN = 128


def document_cuts(
    mask: Mask | None, q_len: int, kv_len: int
) -> tuple[list[list[int]], bool] | None:
    """``(bounds, causal)`` when the mask is packed documents (alone or with causal) that torch can
    serve one document at a time: per batch row (one row when all rows share them) the positions
    where documents start, then ``Tk``; ``causal`` whether each document is causal inside. None for
    any other mask, for ``Tq != Tk``, for documents whose ids are not contiguous runs, and for
    documents shorter than ``MIN_DOCUMENT_MEAN`` on average."""
    if mask is None or q_len != kv_len or not kv_len:
        return None
    parts = mask.parts if mask.op == "and" else (mask,)
    causal = [p for p in parts if p.band is not None and p.band[:2] == (-math.inf, 0)]
    if len(parts) - len(causal) != 1:
        return None
    bounds = next(p for p in parts if p not in causal).document_starts()
    if bounds is None or kv_len < MIN_DOCUMENT_MEAN * max(len(b) - 1 for b in bounds):
        return None
    return bounds, bool(causal)


def per_document(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bounds: list[list[int]],
    causal: bool,
    scale: float,
    dropout_p: float,
) -> Tensor:
    """One fused call per document of each batch row, the outputs joined along the queries."""
    gqa = True if q.size(-3) != k.size(-3) else False  # noqa: SIM210 (a SymBool is refused)

    def row(q: Tensor, k: Tensor, v: Tensor, cuts: list[int]) -> Tensor:
        pieces = []
        for a, b in itertools.pairwise(cuts):
            if b > a:
                pieces.append(
                    F.scaled_dot_product_attention(
                        q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], dropout_p=dropout_p,
                        is_causal=causal, scale=scale, enable_gqa=gqa,
                    )
                )  # fmt: skip
        return torch.cat(pieces, -2)

    if len(bounds) == 1:
        return row(q, k, v, bounds[0])
    batch = q.shape[:-3]
    q3, k3, v3 = (t.reshape(-1, *t.shape[-3:]) for t in (q, k, v))
    out = torch.stack([row(q3[b], k3[b], v3[b], bounds[b]) for b in range(len(bounds))])
    return out.reshape(*batch, *out.shape[-3:])
