"""Sinusoidal encodings of relative distances (Transformer-XL) and openspeech's absolute table.

:class:`attnkit.RelativeMultiHeadAttention` projects these tables and hands them to
:class:`attnkit.scores.RelativePositionTerm`, which computes the position term tile by tile.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# openspeech's PositionalEncoding fills a table of this many positions once; the legacy encodings
# are computed with the same shape so that they come out bit for bit the same.
OPENSPEECH_MAX_LEN = 5000


# --------------------------------------------------------------------------------------------------
# Sinusoidal encodings


def relative_sinusoid(distances: Tensor, dim: int) -> Tensor:
    """``(P, dim)`` encodings of (possibly negative) distances: ``[sin(d w_k) | cos(d w_k)]``.

    ``w_k = 10000^(-2k / dim)`` for ``k < ceil(dim / 2)``: the sines fill the first half, the
    cosines the rest (Transformer-XL's layout). Computed in float64 for any input dtype.
    """
    half = (dim + 1) // 2
    freq = torch.pow(10000.0, -2.0 * torch.arange(half, dtype=torch.float64) / dim)
    angle = distances.to(torch.float64).unsqueeze(-1) * freq.to(distances.device)  # (P, half)
    return torch.cat([angle.sin(), angle.cos()[:, : dim - half]], dim=-1)


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
