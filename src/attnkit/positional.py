"""Positional information: sinusoidal (absolute and relative), rotary (RoPE) and ALiBi (a bias).

* :class:`SinusoidalPositionalEncoding` adds the fixed encoding of *Attention Is All You Need*
  (Vaswani et al., 2017, section 3.5) to the token embeddings.
* :func:`relative_encoding` is the sinusoidal encoding of (signed) distances that
  :class:`~attnkit.RelativeMultiHeadAttention` projects into its position term.
* :class:`RotaryEmbedding` rotates queries and keys by an angle proportional to their position
  (Su et al., 2021), so that ``q . k`` depends on the positions only through their difference.
  Pass it to :class:`~attnkit.MultiHeadAttention` (``rotary=``); with a KV cache the new tokens are
  rotated at the cache's offset.
* :func:`alibi_bias` is the linear distance penalty of ALiBi (Press et al., 2022), to pass as
  ``bias=`` to :func:`~attnkit.attention` or :class:`~attnkit.MultiHeadAttention`. ALiBi is a bias
  by distance: :func:`alibi_term` gives it as a :class:`~attnkit.scores.DistanceBias`, which no
  kernel writes out as ``(Tq, Tk)`` and the native kernel reads as it is, and
  :func:`alibi_by_distance` is the formula both are computed with.

Angles are computed on the fly and only then cast to the input's dtype: a table stored as a
buffer would be rounded by ``model.half()``, and positions beyond a few hundred lose their angle in
16-bit floats. The sinusoidal encoding computes its angles in float64: float32 holds integers
exactly only up to 2^24, so positions 2^24 and 2^24 + 1 would get one encoding, and its angles
drift by ``pos * 6e-8`` radians well before that. Rotary embeddings and ALiBi work in float32
(float64 for float64 inputs), on the relative distances attention sees.

Shape letters: ``B`` batch, ``T`` positions, ``D`` model size, ``H`` heads, ``Dh`` head size,
``Tq`` queries, ``Tk`` keys.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from ._checks import check_float_tensor, check_int, check_probability
from ._typing import Float, Int, shape_checked
from .scores import DistanceBias

__all__ = [
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "alibi_bias",
    "alibi_slopes",
    "relative_encoding",
]


def _angle_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# The first position float64 cannot tell from its successor: the largest encoding computed is that
# of position 2^53 - 1.
_MAX_POSITION = 2**53


class SinusoidalPositionalEncoding(nn.Module):
    """Adds ``PE[pos, 2i] = sin(pos / base^(2i/D))``, ``PE[pos, 2i+1] = cos(pos / base^(2i/D))``.

    Args:
        d_model: ``D``, the size of the embeddings the encoding is added to (odd sizes work: the
            last column is a sine).
        base: the wavelength scale, 10000 in the paper.
        dropout: dropout on the sum, in training only (the paper uses 0.1).

    ``forward(x, offset=0)`` takes embeddings ``x`` of shape ``(B, T, D)`` and returns
    ``x + PE[offset : offset + T]``, same shape. ``offset`` is the position of ``x``'s first token:
    when decoding with a KV cache, pass ``cache.length``. Angles are computed in float64 (on the
    CPU for a device without float64), so every position below 2^53 gets its own encoding; later
    positions are a ``ValueError``.

    >>> pe = SinusoidalPositionalEncoding(4)
    >>> pe(torch.zeros(1, 3, 4))
    tensor([[[ 0.0000,  1.0000,  0.0000,  1.0000],
             [ 0.8415,  0.5403,  0.0100,  0.9999],
             [ 0.9093, -0.4161,  0.0200,  0.9998]]])

    The encoding is not scaled; the paper multiplies the embeddings by ``sqrt(D)`` before adding it.
    """

    def __init__(self, d_model: int, *, base: float = 10000.0, dropout: float = 0.0) -> None:
        super().__init__()
        self.d_model = check_int("d_model", d_model)
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
            raise ValueError(f"base must be a number > 1, got {base!r}")
        self.base = float(base)
        self.dropout = nn.Dropout(check_probability("dropout", dropout))

    @shape_checked
    def encoding(
        self,
        length: int,
        *,
        offset: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> Float[Tensor, "T D"]:
        """The encoding of positions ``offset, ..., offset + length - 1``: ``(length, D)``."""
        length = check_int("length", length, minimum=0)
        offset = check_int("offset", offset, minimum=0)
        if offset + length > _MAX_POSITION:
            raise ValueError(
                f"offset ({offset}) + length ({length}) must be at most 2^53 = {_MAX_POSITION}: "
                "float64 angles cannot tell later positions apart"
            )
        # Apple's MPS has no float64: the (T, D) table is small, so it is computed on the CPU.
        work = "cpu" if device is not None and torch.device(device).type == "mps" else device
        pos = torch.arange(offset, offset + length, dtype=torch.float64, device=work)
        two_i = torch.arange(0, self.d_model, 2, dtype=torch.float64, device=work)
        angle = pos[:, None] * torch.exp(
            two_i * (-math.log(self.base) / self.d_model)
        )  # (T, ⌈D/2⌉)
        pe = torch.empty(length, self.d_model, dtype=torch.float64, device=work)
        pe[:, 0::2] = angle.sin()
        pe[:, 1::2] = angle[:, : self.d_model // 2].cos()
        return pe.to(dtype=dtype, device=device)

    @shape_checked
    def forward(self, x: Float[Tensor, "B T D"], *, offset: int = 0) -> Float[Tensor, "B T D"]:
        check_float_tensor("x", x)  # an int x would get an encoding truncated to ints
        if x.ndim != 3 or x.size(-1) != self.d_model:
            raise ValueError(
                f"x must have shape (B, T, d_model={self.d_model}), got {tuple(x.shape)}"
            )
        pe = self.encoding(x.size(1), offset=offset, dtype=x.dtype, device=x.device)
        out: Tensor = self.dropout(x + pe)
        return out

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, base={self.base:g}"


@shape_checked
def relative_encoding(
    distances: Int[Tensor, " P"],
    dim: int,
    *,
    layout: Literal["halves", "interleaved"] = "halves",
    dtype: torch.dtype = torch.float32,
) -> Float[Tensor, "P D"]:
    """Sinusoidal encodings of signed distances: ``(P, dim)``, one row per entry of ``distances``.

    Row ``p`` encodes ``d = distances[p]`` with the frequencies ``w_k = 10000^(-2k / dim)``,
    ``k < ceil(dim / 2)``, in one of two column layouts:

    * ``"halves"`` (attnkit's, Transformer-XL's): ``[sin(d w_0), ..., sin(d w_K) | cos(d w_0),
      ..., cos(d w_K')]``, every sine first, then the cosines (one fewer for an odd ``dim``);
    * ``"interleaved"`` (ESPnet's, NeMo's and SpeechBrain's): ``[sin(d w_0), cos(d w_0),
      sin(d w_1), ...]``. The two differ by a permutation of the columns, which is why a
      toolkit's ``linear_pos`` weight is permuted when loaded into attnkit.

    The angles are computed in float64 whatever ``dtype`` (the result's), so that far distances
    keep their phase; toolkits that compute them in float32 are off by about
    ``|d| * w_k * 1e-7`` radians.

    :class:`~attnkit.RelativeMultiHeadAttention` encodes, in the ``"halves"`` layout, the distances
    ``Tk - 1, Tk - 2, ..., 1 - Tq`` (from the query's position ``a_i = i + Tk - Tq`` back to key
    ``j``: positive for keys before the query, negative after), ``Tq + Tk - 1`` rows; with
    ``encoding="symmetric"`` it encodes ``|d|`` instead. Sines are odd in ``d`` and cosines even:

    >>> relative_encoding(torch.tensor([1, 0, -1]), 4)  # sin w0, sin w1 | cos w0, cos w1
    tensor([[ 0.8415,  0.0100,  0.5403,  0.9999],
            [ 0.0000,  0.0000,  1.0000,  1.0000],
            [-0.8415, -0.0100,  0.5403,  0.9999]])
    >>> relative_encoding(torch.tensor([1]), 4, layout="interleaved")
    tensor([[0.8415, 0.5403, 0.0100, 0.9999]])
    """
    if not isinstance(distances, Tensor) or distances.dtype.is_floating_point:
        raise TypeError(f"distances must be an integer tensor, got {distances!r}")
    if distances.ndim != 1:
        raise ValueError(f"distances must be 1-d (P,), got shape {tuple(distances.shape)}")
    dim = check_int("dim", dim)
    if layout not in ("halves", "interleaved"):
        raise ValueError(f"layout must be 'halves' or 'interleaved', got {layout!r}")
    half = (dim + 1) // 2
    freq = torch.pow(10000.0, -2.0 * torch.arange(half, dtype=torch.float64) / dim)
    angle = distances.to(torch.float64).unsqueeze(-1) * freq.to(distances.device)  # (P, half)
    sin, cos = angle.sin(), angle.cos()[:, : dim - half]  # (P, half), (P, dim - half)
    if layout == "halves":
        return torch.cat([sin, cos], dim=-1).to(dtype)
    out = torch.empty(distances.size(0), dim, dtype=torch.float64, device=distances.device)
    out[:, 0::2] = sin
    out[:, 1::2] = cos
    return out.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE) for queries and keys of shape ``(B, H, T, Dh)``.

    The head size ``Dh`` is split in two halves ``x = [x1, x2]`` and each pair ``(x1[i], x2[i])`` is
    rotated by the angle ``pos * base^(-2i/Dh)`` (the "rotate half" layout of GPT-NeoX and
    Hugging Face's LLaMA; Meta's original LLaMA rotates adjacent pairs instead, which is the same
    up to a permutation of the projection weights). Rotating both ``q`` and ``k`` makes their dot
    product a function of ``pos_q - pos_k``.

    Args:
        head_dim: ``Dh``, even.
        base: the wavelength scale (10000 in the paper; long-context models use larger values).

    ``forward(x, offset=0)`` rotates ``x`` ``(..., T, Dh)`` as positions ``offset, ...,
    offset + T - 1`` and returns the same shape. :class:`~attnkit.MultiHeadAttention` calls it with
    ``offset = cache.length`` so that tokens decoded one at a time get the positions a full forward
    gives them.

    >>> rope = RotaryEmbedding(8)
    >>> q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    >>> a = rope(q, offset=5) @ rope(k, offset=3).mT       # positions 5 and 3
    >>> b = rope(q, offset=12) @ rope(k, offset=10).mT     # positions 12 and 10: same distance
    >>> torch.allclose(a, b, atol=1e-5)
    True
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = check_int("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
            raise ValueError(f"base must be a number > 1, got {base!r}")
        self.base = float(base)

    @shape_checked
    def cos_sin(
        self,
        length: int,
        *,
        offset: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> tuple[Float[Tensor, "T Dh"], Float[Tensor, "T Dh"]]:
        """``cos`` and ``sin`` of the angles of positions ``offset ... offset + length - 1``,
        each ``(length, Dh)`` with the ``Dh / 2`` frequencies repeated for the two halves."""
        length = check_int("length", length, minimum=0)
        offset = check_int("offset", offset, minimum=0)
        if offset + length > _MAX_POSITION:
            raise ValueError(
                f"offset ({offset}) + length ({length}) must be at most 2^53 = {_MAX_POSITION}: "
                "float64 cannot tell later positions apart"
            )
        work = _angle_dtype(dtype)
        half = self.head_dim // 2
        inv_freq = self.base ** (-torch.arange(half, dtype=work, device=device) / half)
        pos = torch.arange(offset, offset + length, dtype=work, device=device)
        angle = (pos[:, None] * inv_freq).repeat(1, 2)  # (T, Dh)
        return angle.cos().to(dtype), angle.sin().to(dtype)

    @shape_checked
    def forward(
        self, x: Float[Tensor, "*batch T Dh"], *, offset: int = 0
    ) -> Float[Tensor, "*batch T Dh"]:
        check_float_tensor("x", x)
        if x.ndim < 2 or x.size(-1) != self.head_dim:
            raise ValueError(
                f"x must have shape (..., T, head_dim={self.head_dim}), got {tuple(x.shape)}"
            )
        cos, sin = self.cos_sin(
            x.size(-2),
            offset=check_int("offset", offset, minimum=0),
            dtype=x.dtype,
            device=x.device,
        )
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}"


@shape_checked
def alibi_slopes(num_heads: int) -> Float[Tensor, " H"]:
    """ALiBi's per-head slopes: the geometric sequence ``2^(-8/H), 2^(-16/H), ..., 2^-8``.

    For a head count that is not a power of two, the paper's rule: the slopes of the largest power
    of two ``n < H``, then every other slope of ``2n`` heads for the rest.

    >>> alibi_slopes(4)
    tensor([0.2500, 0.0625, 0.0156, 0.0039])
    """

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    num_heads = check_int("num_heads", num_heads)
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(n) + power_of_two(2 * n)[0::2][: num_heads - n]
    return torch.tensor(slopes)


@shape_checked
def alibi_bias(
    num_heads: int,
    q_len: int,
    kv_len: int | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Float[Tensor, "H Tq Tk"]:
    """ALiBi's bias ``-slope[h] * |j - p_i|``, shaped ``(H, Tq, Tk)``, for ``bias=``.

    Query ``i`` sits at key position ``p_i = i + Tk - Tq`` (bottom-right, like ``causal=True``), so
    the same call serves a KV cache: ``alibi_bias(H, 1, cache_len)`` is the last row of the full
    bias. With ``causal=True`` only keys ``j <= p_i`` count and this is the paper's bias; without it
    the distance is symmetric (the usual bidirectional variant).

    >>> alibi_bias(2, 3)[0]        # slope 1/16 for the first of two heads
    tensor([[-0.0000, -0.0625, -0.1250],
            [-0.0625, -0.0000, -0.0625],
            [-0.1250, -0.0625, -0.0000]])
    """
    q_len = check_int("q_len", q_len, minimum=0)
    kv_len = q_len if kv_len is None else check_int("kv_len", kv_len, minimum=0)
    slopes = alibi_slopes(num_heads).to(dtype=_angle_dtype(dtype), device=device)
    term = alibi_term(slopes, q_len, kv_len)
    # Read as every kernel reads a bias by distance: query i sits at key position i + Tk - Tq.
    q_pos = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    k_pos = torch.arange(kv_len, device=device)[None, :]
    return term.tile(term.inputs(), q_pos, k_pos).to(dtype)  # (H, Tq, Tk)


def alibi_by_distance(slopes: Tensor, distances: Tensor) -> Tensor:
    """ALiBi's formula, ``-slope * |distance|``: ``(..., H, L)`` from ``slopes`` ``(..., H)`` and
    ``distances`` ``(..., L)`` (leading dimensions broadcast), in their promoted dtype.

    >>> alibi_by_distance(torch.tensor([0.5, 0.25]), torch.tensor([-2.0, 0.0, 1.0]))
    tensor([[-1.0000, -0.0000, -0.5000],
            [-0.5000, -0.0000, -0.2500]])
    """
    return -(slopes.unsqueeze(-1) * distances.unsqueeze(-2).abs())


def alibi_term(
    slopes: Tensor, q_len: int, kv_len: int, *, shifts: Tensor | None = None
) -> DistanceBias:
    """ALiBi over ``q_len`` queries and ``kv_len`` keys as a bias by distance: ``-slope[h] *
    |j - p_i|``, where query ``i`` sits at key position ``p_i = i + Tk - Tq`` (bottom-right).

    Args:
        slopes: ``(H,)`` or ``(B, H)`` (one row of slopes per batch row), in the dtype the
            scores are computed in (float32, or float64 for float64 inputs).
        q_len, kv_len: the call's ``Tq`` and ``Tk``.
        shifts: ``(B,)`` integers, or None: batch row ``b``'s queries sit ``shifts[b]`` keys
            before ``p_i``, so that its bias is ``-slope * |j - (p_i - shifts[b])|`` (rows whose
            keys end before the call's last key, as in a cache of rows of several lengths).

    The table holds every distance of the call, ``-(Tk - 1)`` to ``Tq - 1``: ``(H, Tq + Tk - 1)``,
    or ``(B, H, Tq + Tk - 1)`` with a row of slopes or a shift per batch row; gradients reach
    ``slopes`` through it.
    """
    first = -(kv_len - 1)
    length = max(q_len + kv_len - 1, 1)  # a table of one entry when the call has no pair
    distances = torch.arange(first, first + length, dtype=slopes.dtype, device=slopes.device)
    if shifts is not None:
        distances = distances + shifts.to(slopes.device, slopes.dtype)[:, None]  # (B, L)
    return DistanceBias(alibi_by_distance(slopes, distances), first=first)
