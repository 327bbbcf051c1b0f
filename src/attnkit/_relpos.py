"""Sinusoidal encodings of relative distances (Transformer-XL) and openspeech's absolute table.

:class:`attnkit.RelativeMultiHeadAttention` projects these tables and hands them to
:class:`attnkit.scores.RelativePositionTerm`, which computes the position term tile by tile.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .positional import relative_encoding

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
