"""Relative-position scores (Transformer-XL), materialised for reading and blocked for speed.

:class:`attnkit.RelativeMultiHeadAttention` scores query ``i`` against key ``j`` as

    ((q_i + u) . k_j  +  (q_i + v) . R[a_i - j]) * scale

where ``a_i = i + Tk - Tq`` is the query's position among the keys (queries are the last ``Tq``
positions) and ``R[d]`` is the projected sinusoidal encoding of the distance ``d``. The module hands
this file the content queries ``qu = q + u``, the position queries ``qv = q + v`` and the projected
encodings as a per-head table ``enc``; what the position term needs is a skew of one product:

* **exact** (the default): ``enc`` lists the distances from ``Tk - 1`` down to ``1 - Tq``, so
  ``R[a_i - j]`` is row ``Tq - 1 - i + j`` of it. Row ``i`` of ``qv @ enc^T`` read from column
  ``Tq - 1 - i`` onwards is the row of the term: a diagonal skew.
* **openspeech** (legacy): ``enc`` is the projected *absolute* encoding of positions ``0..T-1``
  with a zero row in front, and the term is openspeech's pad-and-reshape shift of
  ``qv @ enc^T``: the ``(T, T+1)`` product read as ``(T+1, T)`` with its first row dropped.

:func:`position_scores` writes either out as a ``(B, H, Tq, Tk)`` tensor (the readable version,
used for attention weights and dropout). :func:`relative_attention` never does: for a block of
queries it multiplies ``qv`` by the window of ``enc`` those queries need (``Tk + block - 1``
distances), and the chunked kernel reads each tile of the term as a strided view of that product
(see :class:`attnkit.backends.chunked.ScoreTerm`). Memory stays O(T · block).
:func:`relative_attention_sdpa`, for calls that need no gradient, hands the same per-block view to
torch's fused ``scaled_dot_product_attention`` as its float mask, one block of queries at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import present
from .backends import chunked as _kernel
from .positional import relative_encoding

# Blocks of the chunked path. The position term costs (Tk + block_q - 1) / Tk times q k^T, so
# query blocks below the kernel's default 512 waste less of it: a training step at T=2048 on 2
# cores took 0.56 s with 128 x 512 blocks, 0.57 s with 256 x 256 and 0.72 s with 512 x 256.
BLOCK_Q = 128
BLOCK_K = 512
# Inference: query rows per torch SDPA call, whose float mask is (B, H, rows, Tk), and per product
# of the position term. 192 rows is where torch's CPU flash kernel starts splitting queries by 64
# rather than 32; 64-row products waste little (Tk + 63 distances for 64 rows). B=4 T=1024 on 2
# cores, against MultiHeadAttention: 1.66-1.82x, against 1.83-1.87x with 192-row products and
# 2.05-2.12x with 64-row calls and products.
SDPA_BLOCK_Q = 192
SDPA_PRODUCT_Q = 64
# openspeech's PositionalEncoding fills a table of this many positions once; the legacy encodings
# are computed with the same shape so that they come out bit for bit the same.
OPENSPEECH_MAX_LEN = 5000


# --------------------------------------------------------------------------------------------------
# Sinusoidal encodings


def relative_sinusoid(distances: Tensor, dim: int) -> Tensor:
    """``(P, dim)`` float64 encodings of (possibly negative) distances, sines then cosines: see
    :func:`attnkit.relative_encoding`, which this is in float64."""
    return relative_encoding(distances, dim, dtype=torch.float64)


def float32_sinusoid(distances: Tensor, dim: int) -> Tensor:
    """``(P, dim)`` float32 encodings of distances computed as ESPnet, NeMo and SpeechBrain compute
    their relative tables, in attnkit's layout (sines, then cosines).

    Every step is theirs, in float32: ``f_k = exp(2k * -ln(10000) / dim)``, the product of the
    distance and ``f_k``, its sine and cosine. Far distances lose their phase to the rounding of the
    product (~1e-4 radians at ``d = 1000``), and a model trained on these tables has learnt them.
    """
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * -(math.log(10000.0) / dim))
    angle = distances.to(torch.float32).unsqueeze(-1) * freq.to(distances.device)  # (P, half)
    return torch.cat([angle.sin(), angle.cos()[:, : dim // 2]], dim=-1)


def openspeech_sinusoid(length: int, dim: int) -> Tensor:
    """openspeech's absolute ``PositionalEncoding`` of positions ``0..length-1``, in float32.

    ``pe[p, 2k] = sin(p * f_k)`` and ``pe[p, 2k+1] = cos(p * f_k)`` with
    ``f_k = exp(2k * -ln(10000) / dim)``, every step in float32 as openspeech computes it: the
    rounding of ``p * f_k`` alone moves far positions by ~1e-4, so a float64 recomputation would not
    reproduce a trained model's inputs.
    """
    rows = max(length, OPENSPEECH_MAX_LEN)
    pe = torch.zeros(rows, dim)
    position = torch.arange(0, rows, dtype=torch.float).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2).float() * -(math.log(10000.0) / dim))
    pe[:, 0::2] = torch.sin(position * freq)
    pe[:, 1::2] = torch.cos(position * freq[: dim // 2])
    return pe[:length]


def espnet_legacy_sinusoid(length: int, dim: int, max_len: int) -> Tensor:
    """ESPnet's ``LegacyRelPositionalEncoding`` for an input of ``length`` frames, in float32.

    ESPnet builds a table of ``L = max(max_len, length)`` rows for the *reversed* positions
    ``L - 1, L - 2, ..., 0`` (interleaved ``sin``/``cos`` as :func:`openspeech_sinusoid`, every step
    in float32) and hands its first ``length`` rows to the attention: positions ``L - 1`` down to
    ``L - length``. The table is computed with ESPnet's shape so that it comes out bit for bit the
    same (its positions reach ``max_len - 1``, where float32 rounding of the angles is ~1e-4).
    """
    rows = max(length, max_len)
    pe = torch.zeros(rows, dim)
    position = torch.arange(rows - 1, -1, -1.0, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * -(math.log(10000.0) / dim))
    pe[:, 0::2] = torch.sin(position * freq)
    pe[:, 1::2] = torch.cos(position * freq[: dim // 2])
    return pe[:length]


# --------------------------------------------------------------------------------------------------
# The readable version


def position_scores(qv: Tensor, enc: Tensor, tk: int, *, legacy: bool) -> Tensor:
    """The position term ``(B, H, Tq, Tk)`` (unscaled), written out whole.

    ``qv`` is ``(B, H, Tq, Dh)``; ``enc`` is ``(H, Tq + Tk - 1, Dh)`` (exact) or ``(H, T + 1, Dh)``
    (openspeech, whose first row is zero).
    """
    b, h, tq, _ = qv.shape
    product = qv @ enc.transpose(-1, -2).unsqueeze(0)  # (B, H, Tq, P)
    if legacy:
        # openspeech's shift: the (T, T+1) rows, read as T+1 rows of T, lose their first row.
        return product.reshape(b, h, tq + 1, tk)[:, :, 1:]  # (B, H, T, T)
    i = torch.arange(tq, device=qv.device).unsqueeze(-1)
    j = torch.arange(tk, device=qv.device)
    column = (tq - 1 - i + j).expand(b, h, tq, tk)  # row of enc holding distance a_i - j
    return product.gather(-1, column)  # (B, H, Tq, Tk)


# --------------------------------------------------------------------------------------------------
# The blocked version: a score term for the chunked kernel


class _Skew(NamedTuple):
    """Where the tile of one query block lies in its product ``qv[rows] @ enc[window]^T``.

    Tile element ``(r, j)`` is element ``offset + r * stride + j`` of the product of each head and
    batch entry, read as a flat ``(rows, window)`` matrix.
    """

    row_lo: int
    row_hi: int
    enc_lo: int
    enc_hi: int
    offset: int
    stride: int


class _RelativeTerm:
    """The position term as a :class:`~attnkit.backends.chunked.ScoreTerm`.

    ``qv`` ``(N, H, Tq, Dh)`` and ``enc`` ``(H, P, Dh)`` are the inputs; with ``grads`` the rows
    accumulate ``dqv`` and ``denc`` (in the work dtype) during the backward.
    """

    def __init__(
        self, qv: Tensor, enc: Tensor, scale: float, tk: int, legacy: bool, grads: bool
    ) -> None:
        self.n, self.h, self.tq, self.dh = qv.shape
        self.tk = tk
        self.work = torch.promote_types(qv.dtype, torch.float32)
        self.qv = qv
        self.enc = enc.to(self.work)
        self.scale = scale
        self.legacy = legacy
        self.dqv = torch.zeros(qv.shape, dtype=self.work, device=qv.device) if grads else None
        self.denc = torch.zeros_like(self.enc) if grads else None
        self._buffers: dict[str, Tensor] = {}

    def buffer(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """A reused work tensor: a fresh multi-MiB allocation per block costs page faults (on 2
        cores, ~10% of an inference call with 128-row blocks)."""
        numel = math.prod(shape)
        flat = self._buffers.get(name)
        if flat is None or flat.numel() < numel:
            flat = self.enc.new_empty(numel)
            self._buffers[name] = flat
        return flat[:numel].view(shape)

    def skew(self, qs: int, qe: int, key_end: int) -> _Skew:
        bq = qe - qs
        if self.legacy:
            # Shifted row i is flat element T * (i + 1) + j of the padded (T, T + 1) product: it
            # reads the end of product row i and, above the diagonal, the start of row i + 1.
            t = self.tq
            return _Skew(qs, min(qe + 1, t), 0, t + 1, t - qs, t)
        # Columns of the window run from distance a_{qe-1} down to a_qs - (key_end - 1).
        width = key_end + bq - 1
        lo = self.tq - qe
        return _Skew(qs, qe, lo, lo + width, bq - 1, width - 1)

    def rows(self, qs: int, qe: int, key_end: int) -> _RelativeRows:
        return _RelativeRows(self, self.skew(qs, qe, key_end), qe - qs)


class _RelativeRows:
    """One query block of :class:`_RelativeTerm`; its product is computed at the first tile."""

    def __init__(self, term: _RelativeTerm, skew: _Skew, bq: int) -> None:
        self.term = term
        self.skew = skew
        self.bq = bq
        self.nrows = skew.row_hi - skew.row_lo
        self.width = skew.enc_hi - skew.enc_lo
        self._qv: Tensor | None = None
        self._product: Tensor | None = None
        self._grad: Tensor | None = None

    def _qv_rows(self) -> Tensor:
        """``(H, N * rows, Dh)`` scaled position queries: one GEMM per head against its window."""
        if self._qv is None:
            t, s = self.term, self.skew
            rows = t.qv[:, :, s.row_lo : s.row_hi].transpose(0, 1).to(t.work) * t.scale
            self._qv = rows.reshape(t.h, t.n * self.nrows, t.dh)
        return self._qv

    def _window(self) -> Tensor:
        return self.term.enc[:, self.skew.enc_lo : self.skew.enc_hi]  # (H, W, Dh)

    def _view(self, full: Tensor, ks: int, ke: int) -> Tensor:
        """The ``(N, H, 1, bq, ke-ks)`` tile of a ``(H, N, rows, W)`` product, without a copy."""
        t, s = self.term, self.skew
        if s.offset + (self.bq - 1) * s.stride + ke > self.nrows * self.width:
            # as_strided does not check bounds: never let a wrong skew read past the product.
            raise RuntimeError("attnkit internal error: relative-position tile out of bounds")
        plane = self.nrows * self.width
        return full.as_strided(
            (t.n, t.h, 1, self.bq, ke - ks),
            (plane, t.n * plane, 1, s.stride, 1),
            full.storage_offset() + s.offset + ks,
        )

    def tile(self, ks: int, ke: int) -> Tensor:
        if self._product is None:
            shape = (self.term.h, self.term.n * self.nrows, self.width)
            out = self.term.buffer("product", shape)
            self._product = torch.bmm(self._qv_rows(), self._window().transpose(1, 2), out=out)
        return self._view(self._product, ks, ke)

    def backward(self, ks: int, ke: int, ds: Tensor) -> None:
        if self._grad is None:
            shape = (self.term.h, self.term.n * self.nrows, self.width)
            self._grad = self.term.buffer("grad", shape).zero_()
        self._view(self._grad, ks, ke).add_(ds)

    def flush(self) -> None:
        t, s, grad = self.term, self.skew, self._grad
        if grad is None or t.dqv is None or t.denc is None:
            return
        dqv = torch.bmm(grad, self._window()).mul_(t.scale)  # (H, N * rows, Dh)
        dqv = dqv.view(t.h, t.n, self.nrows, t.dh).transpose(0, 1)
        # += and not =: openspeech's rows overlap the next block's first row.
        t.dqv[:, :, s.row_lo : s.row_hi] += dqv
        t.denc[:, s.enc_lo : s.enc_hi].baddbmm_(grad.transpose(1, 2), self._qv_rows())
        self._grad = None


class _RelativeAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        qu: Tensor,
        k: Tensor,
        v: Tensor,
        qv: Tensor,
        enc: Tensor,
        mask: Tensor | None,
        causal_offset: int | None,
        scale: float,
        legacy: bool,
        block_q: int,
        block_k: int,
    ) -> Tensor:
        term = _RelativeTerm(qv, enc, scale, k.size(-2), legacy, grads=False)
        p = _kernel._Problem(
            qu, k, v, mask, None, causal_offset, scale, block_q, block_k, score_term=term
        )
        with _kernel.no_autocast(qu.device):
            out5, lse = _kernel.forward(p)
        out = out5.view(*qu.shape[:-1], p.dv).to(qu.dtype)
        # O before rounding, for the backward's rowsum(dO * O) (see the chunked backend).
        ctx.save_for_backward(qu, k, v, qv, enc, out5, lse, *([] if mask is None else [mask]))
        ctx.args = (causal_offset, scale, legacy, block_q, block_k)  # type: ignore[attr-defined]
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dout: Tensor
    ) -> tuple[Tensor | None, ...]:
        qu, k, v, qv, enc, out, lse, *rest = ctx.saved_tensors  # type: ignore[attr-defined]
        mask = rest[0] if rest else None
        causal_offset, scale, legacy, block_q, block_k = ctx.args  # type: ignore[attr-defined]
        term = _RelativeTerm(qv, enc, scale, k.size(-2), legacy, grads=True)
        p = _kernel._Problem(
            qu, k, v, mask, None, causal_offset, scale, block_q, block_k, score_term=term
        )
        with _kernel.no_autocast(dout.device):
            dq, dk, dv, _ = _kernel.backward(p, out, lse, dout, False)
        dqv, denc = present(term.dqv, "dqv"), present(term.denc, "denc")
        return (
            dq.view(qu.shape).to(qu.dtype),
            dk.view(k.shape).to(k.dtype),
            dv.view(v.shape).to(v.dtype),
            dqv.to(qv.dtype),
            denc.to(enc.dtype),
            *([None] * 6),
        )


# Function.apply is untyped in torch; give it its type once.
_apply: Callable[..., Tensor] = _RelativeAttention.apply


def relative_attention(
    qu: Tensor,
    k: Tensor,
    v: Tensor,
    qv: Tensor,
    enc: Tensor,
    *,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    legacy: bool,
) -> Tensor:
    """Attention with the position term computed block by block inside the chunked kernel.

    ``qu``, ``qv`` ``(B, H, Tq, Dh)``, ``k`` ``(B, H, Tk, Dh)``, ``v`` ``(B, H, Tk, Dv)``, ``enc``
    as in :func:`position_scores`; ``mask`` already validated. Returns ``(B, H, Tq, Dv)``. The block
    sizes are read at call time, so tests can shrink them to exercise many blocks.
    """
    offset = k.size(-2) - qu.size(-2) if causal else None
    return _apply(qu, k, v, qv, enc, mask, offset, scale, legacy, BLOCK_Q, BLOCK_K)


def _block_visibility(
    mask: Tensor | None,
    causal_offset: int | None,
    qs: int,
    qe: int,
    key_end: int,
    device: torch.device,
) -> Tensor | None:
    """Bool ``(B|1, H|1, qe-qs, key_end)`` visibility of one query block, or None: all visible."""
    vis = None
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
        vis = mask[..., qs:qe, :] if mask.size(-2) != 1 else mask
        vis = vis[..., :key_end] if mask.size(-1) != 1 else vis
    if causal_offset is not None and key_end > qs + causal_offset + 1:  # a key above the diagonal
        rows = torch.arange(qs, qe, device=device).unsqueeze(-1)
        causal = torch.arange(key_end, device=device) <= rows + causal_offset  # (bq, key_end)
        vis = causal if vis is None else vis & causal
    return vis


def relative_attention_sdpa(
    qu: Tensor,
    k: Tensor,
    v: Tensor,
    qv: Tensor,
    enc: Tensor,
    *,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    legacy: bool,
) -> Tensor:
    """:func:`relative_attention` for calls that need no gradient, on torch's fused kernel.

    For each block of ``SDPA_BLOCK_Q`` queries the position term (strided views of products of
    ``SDPA_PRODUCT_Q`` rows, as in the chunked path) is copied into one float mask for
    ``scaled_dot_product_attention``, with ``mask`` and causality folded in as ``-inf``. Keys a
    causal block cannot see are left out of its call. The mask is in q's dtype, so float16/bfloat16
    callers should use the chunked path, which keeps the position term in float32. Memory:
    O(B · H · block · Tk).
    """
    with _kernel.no_autocast(qu.device):
        return _relative_attention_sdpa(qu, k, v, qv, enc, mask, causal, scale, legacy)


def _relative_attention_sdpa(
    qu: Tensor,
    k: Tensor,
    v: Tensor,
    qv: Tensor,
    enc: Tensor,
    mask: Tensor | None,
    causal: bool,
    scale: float,
    legacy: bool,
) -> Tensor:
    n, h, tq, _ = qu.shape
    tk = k.size(-2)
    term = _RelativeTerm(qv, enc, scale, tk, legacy, grads=False)
    offset = tk - tq if causal else None
    # (B, Tq, H, Dv) memory, so that the caller's merge of the heads is a view, not a copy.
    out = qu.new_empty(n, tq, h, v.size(-1)).transpose(1, 2)
    for qs in range(0, tq, SDPA_BLOCK_Q):
        qe = min(qs + SDPA_BLOCK_Q, tq)
        key_end = tk if offset is None else min(tk, max(0, qe + offset))
        if key_end == 0:  # no key visible to any query of the block
            out[:, :, qs:qe] = 0.0
            continue
        bias = term.buffer("bias", (n, h, qe - qs, key_end))
        for ps in range(qs, qe, SDPA_PRODUCT_Q):
            pe = min(ps + SDPA_PRODUCT_Q, qe)
            tile = term.rows(ps, pe, key_end).tile(0, key_end)  # (N, H, 1, pe-ps, key_end)
            bias[:, :, ps - qs : pe - qs] = tile.squeeze(2)
        vis = _block_visibility(mask, offset, qs, qe, key_end, qu.device)
        if vis is not None:
            bias.masked_fill_(~vis, float("-inf"))
        block = F.scaled_dot_product_attention(
            qu[:, :, qs:qe],
            k[:, :, :key_end],
            v[:, :, :key_end],
            attn_mask=bias.to(qu.dtype),
            scale=scale,
        )
        if vis is not None:
            # A query with no visible key gets 0 (torch's CPU kernels agree; not every CUDA one).
            block = block.masked_fill(~vis.any(-1, keepdim=True), 0.0)
        out[:, :, qs:qe] = block
    return out
