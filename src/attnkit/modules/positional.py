"""Positional information: sinusoidal (absolute and relative), rotary (RoPE) and ALiBi (a bias).

* :class:`SinusoidalPositionalEncoding` adds the fixed encoding of *Attention Is All You Need*
  (Vaswani et al., 2017, section 3.5) to the token embeddings.
* :func:`relative_encoding` is the sinusoidal encoding of (signed) distances, and
  :class:`RelativePositionEmbedding` its projection ``W_r r(d)`` (Transformer-XL): the position
  module of :class:`~attnkit.RelativeMultiHeadAttention` (``pos_proj=``).
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
from typing import Literal, cast

import torch
from torch import Tensor, nn

from .._base.checks import check_float_tensor, check_int, check_probability
from .._base.shapes import Float, Int, shape_checked
from .._base.transforms import transforms_active
from ..scores import DistanceBias
from . import _relpos

__all__ = [
    "RelativePositionEmbedding",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "alibi_bias",
    "alibi_slopes",
    "relative_encoding",
    "rotary_positions",
    "rows_by_offset",
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
    when decoding with a KV cache, pass ``cache.position``. Angles are computed in float64 (on the
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
    table = _relpos.relative_sinusoid(distances, dim)  # (P, dim): sines, then cosines
    if layout == "halves":
        return table.to(dtype)
    half = (dim + 1) // 2
    out = torch.empty_like(table)
    out[:, 0::2] = table[:, :half]
    out[:, 1::2] = table[:, half:]
    return out.to(dtype)


class RelativePositionEmbedding(nn.Module):
    """Transformer-XL's position embeddings: ``W_r r(d)``, the sinusoidal encodings of distances
    projected by a learned ``W_r``, one row per distance a call of
    :class:`~attnkit.RelativeMultiHeadAttention` can see (its ``pos_proj``).

    ``pos(top, bottom)`` is ``(top - bottom + 1, d_model)``: the rows of the distances ``top``,
    ``top - 1``, ..., ``bottom`` (a query's position minus a key's: positive for keys before the
    query), each ``r(d) @ weight.T`` with ``r(d) = [sin(d w_k) | cos(d w_k)]`` and
    ``w_k = 10000^(-2k / d_model)`` (:func:`relative_encoding`). A call of ``Tq`` queries and
    ``Tk`` keys asks for ``Tk - 1`` down to ``1 - Tq``, cut to what its mask leaves visible (a
    sliding window's distances alone).

    Args:
        d_model: the size of the encodings and of ``W_r``'s rows and columns.
        encoding: which ``r(d)`` is projected. ``"signed"`` (default): the formula above, whose
            sines tell a key ``d`` frames before the query from one ``d`` frames after it
            (Transformer-XL, ESPnet, NeMo). ``"symmetric"``: ``r(|d|)``, the same for ``+d`` and
            ``-d``, which is what SpeechBrain's ``RelPosEncXL`` computes (its future half repeats
            the past half's sines); use it only to run models trained with it
            (:func:`attnkit.interop.speechbrain.relative_attention`).
        encoding_dtype: what the angles are computed in. ``torch.float64`` (default): the
            sinusoids to float64 rounding, whatever ``weight``'s dtype. ``torch.float32``: every
            step in float32, as ESPnet, NeMo and SpeechBrain compute their tables (their
            frequency formula, products and sines rounded to float32: ~1e-4 radians off at
            distance 1000), so that a model trained with those tables gets them.
        legacy: ``None`` (default), or the toolkit whose *absolute* encodings a legacy
            :class:`~attnkit.RelativeMultiHeadAttention` projects: ``"openspeech"`` (positions
            ``0 .. T - 1``) or ``"espnet"`` (ESPnet's ``LegacyRelPositionalEncoding``: positions
            ``L - 1`` down to ``L - T``, ``L = max(legacy_max_len, T)``), each in that toolkit's
            float32. ``pos(T - 1, 1 - T)`` is then the table of a self-attention call of ``T``
            frames, one row per frame.
        legacy_max_len: with ``legacy="espnet"``, that encoding's ``max_len`` (ESPnet's default
            5000; espnet2's ``max_pos_emb_len``). ``None`` otherwise.
        device, dtype: ``weight``'s.

    Parameters: ``weight``, ``W_r`` ``(d_model, d_model)``. There is no bias (``bias`` is None,
    as in an ``nn.Linear`` without one).

    The encodings are computed once per device and dtype for the distances asked so far and kept
    (they hold no parameter). A table of distances of both signs is projected from its distances
    ``0, -1, ..., -m`` alone: ``r(d)`` and ``r(-d)`` share their cosines and negate their sines, so
    the products are taken once per ``|d|`` (half of them; see
    :func:`attnkit.modules._relpos.mirrored_projection`).
    Where no gradient is needed (inference), the last
    projection is kept with a copy of the weight it was made from, and a call for the same
    distances reuses it while ``weight`` is still bit for bit that copy: one read of ``weight``
    instead of ``P * d_model`` products, and a weight written in any way (an optimizer step,
    ``load_state_dict``, an in-place edit) is projected again.

    >>> import torch, attnkit
    >>> pos = attnkit.RelativePositionEmbedding(8)
    >>> pos(2, -1).shape  # distances 2, 1, 0, -1
    torch.Size([4, 8])
    >>> r = attnkit.relative_encoding(torch.tensor([2, 1, 0, -1]), 8, dtype=torch.float64)
    >>> torch.allclose(pos(2, -1), (r @ pos.weight.double().T).float(), atol=1e-6)
    True
    """

    # A table of distances of both signs is projected mirrored when it holds at least this many
    # of each sign: a smaller table saves few products for the mirrored path's extra passes.
    _MIRROR_ROWS = 32

    bias: None

    def __init__(
        self,
        d_model: int,
        *,
        encoding: Literal["signed", "symmetric"] = "signed",
        encoding_dtype: torch.dtype = torch.float64,
        legacy: Literal["openspeech", "espnet"] | None = None,
        legacy_max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_model = check_int("d_model", d_model)
        _check_encoding(encoding, encoding_dtype, legacy)
        if legacy == "espnet":
            legacy_max_len = check_int(
                "legacy_max_len", 5000 if legacy_max_len is None else legacy_max_len
            )
        elif legacy_max_len is not None:
            raise ValueError(
                f"legacy_max_len applies to legacy='espnet' only, got legacy_max_len="
                f"{legacy_max_len!r} with legacy={legacy!r}"
            )
        self.encoding = encoding
        self.encoding_dtype = encoding_dtype
        self.legacy = legacy
        self.legacy_max_len = legacy_max_len
        self.weight = nn.Parameter(torch.empty(d_model, d_model, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()
        # (device, dtype) -> (size, encodings of distances size .. -size, or the legacy table)
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[int, Tensor]] = {}
        # The last projection made without gradients: ((top, bottom), the weight's copy, table)
        self._kept: tuple[tuple[int, int], Tensor, Tensor] | None = None

    def reset_parameters(self) -> None:
        """Initialise ``weight`` again as ``nn.Linear`` initialises its weight, as ``W_r`` was
        one (what a module built on the meta device runs after ``to_empty()``)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def extra_repr(self) -> str:
        parts = [f"{self.d_model}"]
        if self.encoding != "signed":
            parts.append(f"encoding={self.encoding!r}")
        if self.encoding_dtype != torch.float64:
            parts.append(f"encoding_dtype={self.encoding_dtype}")
        if self.legacy:
            parts.append(f"legacy={self.legacy!r}")
        if self.legacy == "espnet":
            parts.append(f"legacy_max_len={self.legacy_max_len}")
        return ", ".join(parts)

    def forward(self, top: int, bottom: int) -> Float[Tensor, "P D"]:
        """``(top - bottom + 1, d_model)``: ``W_r r(d)`` for ``d = top, top - 1, ..., bottom``
        (legacy: the toolkit's table of ``top + 1`` frames, projected)."""
        if torch.compiler.is_compiling() or transforms_active():
            # Traced lengths stay symbolic: int() or a comparison would fix them to the example's.
            # Under torch.func's transforms the weight is a wrapper: a projection kept from it
            # would outlive the transform.
            return self._project(top, bottom)
        top, bottom = int(top), int(bottom)
        if top < bottom:
            raise ValueError(f"top ({top}) must be >= bottom ({bottom})")
        weight = self.weight
        if (
            (torch.is_grad_enabled() and weight.requires_grad)
            # autocast runs F.linear in its own dtype: a table kept from outside it would not be
            or _autocast_on(weight)
            or weight.device.type == "meta"
        ):
            return self._project(top, bottom)
        kept = self._kept
        if kept is not None and kept[0] == (top, bottom) and _same_bits(kept[1], weight):
            return kept[2]
        # Outside inference mode, so that a later call with gradients elsewhere may use it.
        with torch.inference_mode(False), torch.no_grad():
            table = self._project(top, bottom)
            self._kept = ((top, bottom), weight.detach().clone(), table)
        return table

    def _project(self, top: int, bottom: int) -> Tensor:
        """:meth:`forward`'s table, computed: mirrored where the table holds enough distances of
        each sign."""
        weight = self.weight
        mirrored = (
            not self.legacy
            and not torch.compiler.is_compiling()
            and not transforms_active()  # (its autograd.Function has no rule for torch.func)
            and min(top, -bottom) >= self._MIRROR_ROWS
            and not _autocast_on(weight)
        )
        if not mirrored:
            return nn.functional.linear(self._encodings(top, bottom), weight)
        negative = self._encodings(0, -max(top, -bottom))  # distances 0, -1, ..., -m
        return _relpos.mirrored_projection(
            weight, negative, top, bottom, odd=self.encoding != "symmetric"
        )

    def _encodings(self, top: int, bottom: int) -> Tensor:
        """Unprojected encodings ``(top - bottom + 1, d_model)`` of the distances ``top`` down to
        ``bottom``, or in legacy mode ``(top + 1, d_model)`` of that toolkit's positions, in
        ``weight``'s dtype."""
        weight = self.weight
        frames = top + 1
        if torch.compiler.is_compiling() or transforms_active():
            # Tracing: a table cached across calls would be a fake tensor left behind after
            # export, and its size a guard on the traced lengths; under torch.func's transforms,
            # one of the transform's wrappers, left behind after it returns (and a module that
            # copy.deepcopy and pickle refuse). Make exactly the rows needed.
            if self.legacy:
                return self._table(frames, weight.device).to(weight.device, weight.dtype)
            distances = torch.arange(top, bottom - 1, -1, device=weight.device)
            return self._sinusoids(distances).to(weight.dtype)
        max_len = self.legacy_max_len or 0
        if self.legacy == "espnet" and frames > max_len:
            # ESPnet rebuilds its table for an input longer than max_len: positions T-1 .. 0.
            with torch.inference_mode(False), torch.no_grad():
                return self._table(frames, weight.device).to(weight.device, weight.dtype)
        key = (weight.device, weight.dtype)
        need = {None: max(abs(top), abs(bottom), 1), "openspeech": frames, "espnet": max_len}
        size, table = self._tables.get(key, (0, weight.new_empty(1, self.d_model)))
        if size < need[self.legacy]:
            grown = max(need[self.legacy], 2 * size)
            size = need[self.legacy] if self.legacy == "espnet" else grown
            # A table made under inference_mode could never be saved for a later backward.
            with torch.inference_mode(False), torch.no_grad():
                table = self._table(size, weight.device).to(weight.device, weight.dtype)
            self._tables[key] = (size, table)
        if self.legacy:
            return table[:frames]
        return table[size - top : size - bottom + 1]  # rows of distances top .. bottom

    def _table(self, size: int, device: torch.device) -> Tensor:
        """The encodings of distances ``size .. -size``, or in legacy mode the toolkit's table for
        an input of ``size`` frames (float32, as the toolkit computes it)."""
        if self.legacy == "openspeech":
            return _relpos.openspeech_sinusoid(size, self.d_model)
        if self.legacy == "espnet":
            max_len = cast(int, self.legacy_max_len)
            return _relpos.espnet_legacy_sinusoid(size, self.d_model, max_len)
        return self._sinusoids(torch.arange(size, -size - 1, -1, device=device))

    def _sinusoids(self, distances: Tensor) -> Tensor:
        """The unprojected ``r(d)`` of ``distances`` as ``encoding`` and ``encoding_dtype`` say."""
        if self.encoding == "symmetric":
            distances = distances.abs()
        if self.encoding_dtype == torch.float32:
            return _relpos.float32_sinusoid(distances, self.d_model)
        return _relpos.relative_sinusoid(distances, self.d_model)


def _autocast_on(t: Tensor) -> bool:
    """Whether ``torch.autocast`` is on for ``t``'s device: never for a device autocast does not
    know, such as "meta" (torch refuses to be asked about it, a RuntimeError)."""
    kind = t.device.type
    return torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (a NaN equals itself, 0.0 is not -0.0): equal
    weights give a projection equal to the bit."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}.get(a.element_size())
    if bits is None or not a.is_floating_point():
        return bool(torch.equal(a, b))
    return bool(torch.equal(a.view(bits), b.detach().view(bits)))


def _check_encoding(encoding: object, encoding_dtype: object, legacy: object) -> None:
    """The checks of :class:`RelativePositionEmbedding`'s choice of encodings."""
    if legacy not in (None, "openspeech", "espnet"):
        raise ValueError(f"legacy must be None, 'openspeech' or 'espnet', got {legacy!r}")
    if encoding not in ("signed", "symmetric"):
        raise ValueError(f"encoding must be 'signed' or 'symmetric', got {encoding!r}")
    if legacy and encoding != "signed":
        raise ValueError(
            f"encoding={encoding!r} does not apply to legacy={legacy!r}, which reproduces that "
            "toolkit's own (absolute) encodings"
        )
    if encoding_dtype not in (torch.float64, torch.float32):
        raise ValueError(
            f"encoding_dtype must be torch.float64 or torch.float32, got {encoding_dtype!r}"
        )
    if legacy and encoding_dtype != torch.float64:
        raise ValueError(
            f"encoding_dtype={encoding_dtype} does not apply to legacy={legacy!r}, which "
            "reproduces that toolkit's own float32 table"
        )


def rows_by_offset(offsets: list[int]) -> list[tuple[int, list[int]]]:
    """The rows of each distinct offset, ``(offset, rows)`` in the order they first appear: the
    rows a rotary turns together, each batch row ``b`` at its own ``offsets[b]``.

    Found by comparing offsets, not with a set: under ``torch.compile`` an offset is a symbolic
    size, which a set (or a sort) makes a constant, so a graph would be compiled again at every
    step; a comparison is guarded as it stands (rows apart stay apart).

    >>> rows_by_offset([7, 3, 7])
    [(7, [0, 2]), (3, [1])]
    """
    groups: list[tuple[int, list[int]]] = []
    for b, offset in enumerate(offsets):
        for seen, rows in groups:
            if seen == offset:
                rows.append(b)
                break
        else:
            groups.append((offset, [b]))
    return groups


def rotary_positions(offset: int | Tensor, x: Tensor, dtype: torch.dtype) -> Tensor:
    """The positions a rotary turns ``x`` ``(..., T, Dh)`` to, in ``dtype``, shaped to broadcast
    against ``x``'s angles ``(..., T, Dh / 2)``: ``offset, ..., offset + T - 1``.

    ``offset``: an int, or an integer tensor of one offset per row of ``x``'s first dim ``(B,)``
    (or one, 0-d), on any device: read where ``x`` is, with no copy to the host, so that a
    compiled step takes each row's position as an input rather than as a constant of its graph.

    >>> rotary_positions(torch.tensor([5, 0]), torch.zeros(2, 1, 3, 4), torch.float32).squeeze()
    tensor([[5., 6., 7.],
            [0., 1., 2.]])
    """
    length = x.size(-2)
    if not isinstance(offset, Tensor):
        offset = check_int("offset", offset, minimum=0)
        if offset + length > _MAX_POSITION:
            raise ValueError(
                f"offset ({offset}) + length ({length}) must be at most 2^53 = "
                f"{_MAX_POSITION}: float64 cannot tell later positions apart"
            )
        return torch.arange(offset, offset + length, device=x.device).to(dtype)[:, None]
    if offset.dtype.is_floating_point or offset.dtype.is_complex or offset.dtype == torch.bool:
        raise TypeError(f"offset must be an int or an integer tensor, got {offset.dtype}")
    rows = x.size(0) if x.ndim > 2 else None
    if offset.ndim > 1 or (offset.ndim == 1 and offset.size(0) != rows):
        raise ValueError(
            f"offset must be one int per row of x's first dim, shape ({rows},), or 0-d, got "
            f"{tuple(offset.shape)} for x {tuple(x.shape)}"
        )
    first = offset.to(device=x.device, dtype=torch.int64)
    if offset.ndim == 1:
        first = first.reshape(-1, *[1] * (x.ndim - 1))  # (B, 1, ..., 1)
    steps = torch.arange(length, device=x.device)[:, None]  # (T, 1)
    return (first + steps).to(dtype)  # (integers added, then rounded once, as arange rounds)


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
    offset + T - 1`` and returns the same shape; ``offset`` may be a tensor of one offset per row
    of ``x``'s first dim (see :func:`rotary_positions`). :class:`~attnkit.MultiHeadAttention`
    calls it with ``offset = cache.position`` so that tokens decoded one at a time get the
    positions a full forward gives them (on a :class:`~attnkit.PagedKVCache`, whose rows each sit
    at their own, with the tensor of :meth:`~attnkit.PagedKVCache.next_positions`).

    >>> rope = RotaryEmbedding(8)
    >>> q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    >>> a = rope(q, offset=5) @ rope(k, offset=3).mT       # positions 5 and 3
    >>> b = rope(q, offset=12) @ rope(k, offset=10).mT     # positions 12 and 10: same distance
    >>> torch.allclose(a, b, atol=1e-5)
    True
    """

    #: ``forward`` takes a tensor of one offset per row (:func:`rotary_positions`): the modules
    #: rotate a paged cache's rows, each at its own position, in one call, from a tensor.
    per_row_offsets = True

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
        self, x: Float[Tensor, "*batch T Dh"], *, offset: int | Tensor = 0
    ) -> Float[Tensor, "*batch T Dh"]:
        check_float_tensor("x", x)
        if x.ndim < 2 or x.size(-1) != self.head_dim:
            raise ValueError(
                f"x must have shape (..., T, head_dim={self.head_dim}), got {tuple(x.shape)}"
            )
        work = _angle_dtype(x.dtype)
        half = self.head_dim // 2
        inv_freq = self.base ** (-torch.arange(half, dtype=work, device=x.device) / half)
        angle = rotary_positions(offset, x, work) * inv_freq  # (..., T, Dh / 2)
        angle = torch.cat((angle, angle), dim=-1)
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
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
