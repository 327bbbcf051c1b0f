"""Sinusoidal encodings of relative distances (Transformer-XL), the toolkits' own tables, and their
mirrored projection.

:class:`attnkit.RelativePositionEmbedding` projects these tables for
:class:`attnkit.RelativeMultiHeadAttention`, which hands them to
:class:`attnkit.scores.RelativePositionTerm`; the term is computed tile by tile.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

# openspeech's PositionalEncoding fills a table of this many positions once; the legacy encodings
# are computed with the same shape so that they come out bit for bit the same.
OPENSPEECH_MAX_LEN = 5000


# --------------------------------------------------------------------------------------------------
# Sinusoidal encodings


def relative_sinusoid(distances: Tensor, dim: int) -> Tensor:
    """``(P, dim)`` float64 encodings of (possibly negative) distances, every sine then every
    cosine (one fewer for an odd ``dim``): :func:`attnkit.relative_encoding` in float64. The angles
    are computed in float64, so that far distances keep their phase."""
    half = (dim + 1) // 2
    freq = torch.pow(10000.0, -2.0 * torch.arange(half, dtype=torch.float64) / dim)
    angle = distances.to(torch.float64).unsqueeze(-1) * freq.to(distances.device)  # (P, half)
    return torch.cat([angle.sin(), angle.cos()[:, : dim - half]], dim=-1)


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
# Projection


class _Mirrored(torch.autograd.Function):
    """``table @ weight^T`` for the encodings of distances ``top .. bottom`` (``top >= 0 > bottom``)
    from those of ``0, -1, ..., -m`` alone (``m = max(top, -bottom)``): see
    :func:`mirrored_projection`."""

    @staticmethod
    def forward(
        ctx: Any, weight: Tensor, negative: Tensor, top: int, bottom: int, odd: bool
    ) -> Tensor:
        half = (weight.size(1) + 1) // 2  # the sines' columns
        sines = negative[:, :half] @ weight[:, :half].t()  # (m + 1, D): the sines' share at -k
        cosines = negative[:, half:] @ weight[:, half:].t()  # the cosines' share, at k as at -k
        out = weight.new_empty(top - bottom + 1, weight.size(0))
        # Rows 0 .. top hold distances top .. 0: k = top - row. With odd sines, r(k)'s sines
        # are -r(-k)'s.
        cos_k, sin_k = cosines[: top + 1], sines[: top + 1]
        at_k = cos_k - sin_k if odd else cos_k + sin_k
        down = torch.arange(top, -1, -1, device=weight.device)
        torch.index_select(at_k, 0, down, out=out[: top + 1])
        # Rows top + 1 .. hold distances -1 .. bottom: k = row - top.
        torch.add(cosines[1 : 1 - bottom], sines[1 : 1 - bottom], out=out[top + 1 :])
        ctx.save_for_backward(negative)
        ctx.shape = (top, bottom, odd, half)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (negative,) = ctx.saved_tensors
        top, bottom, odd, half = ctx.shape
        at_k = grad[: top + 1].flip(0)  # the gradients of distances 0 .. top
        past = grad[top + 1 :]  # of distances -1 .. bottom
        d_cos = grad.new_zeros(negative.size(0), grad.size(1))
        d_cos[: top + 1] = at_k
        d_cos[1 : 1 - bottom] += past
        d_sin = grad.new_zeros(negative.size(0), grad.size(1))
        d_sin[: top + 1] = -at_k if odd else at_k
        d_sin[1 : 1 - bottom] += past
        dw = torch.cat([d_sin.t() @ negative[:, :half], d_cos.t() @ negative[:, half:]], dim=1)
        return dw, None, None, None, None


def mirrored_projection(
    weight: Tensor, negative: Tensor, top: int, bottom: int, *, odd: bool = True
) -> Tensor:
    """``enc @ weight^T`` for the sinusoidal encodings ``enc`` of distances ``top .. bottom``
    (``top >= 0 > bottom``), given the encodings of distances ``0, -1, ..., -m`` only
    (``negative``, ``m = max(top, -bottom)``; sines in its first ``ceil(D / 2)`` columns).

    ``r(d)`` and ``r(-d)`` share their cosines and, for ``odd=True`` (signed distances), negate
    their sines (``odd=False``: equal sines, as for the encoding of ``|d|``), so the products
    are taken once per ``|d|``, for the sine and the cosine columns apart, and the rows of ``d``
    and ``-d`` are their difference and their sum: half the multiplications of the whole table,
    forward and for ``weight``'s gradient.
    """
    if not (top >= 0 and bottom < 0 and negative.size(0) == max(top, -bottom) + 1):
        raise ValueError(
            f"attnkit internal error: mirrored_projection of top={top}, bottom={bottom} from "
            f"{negative.size(0)} encodings"
        )
    return _mirrored(weight, negative, top, bottom, odd)


# Function.apply is untyped in torch; give it its type once.
_mirrored: Callable[..., Tensor] = _Mirrored.apply
