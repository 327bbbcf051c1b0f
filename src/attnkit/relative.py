"""``RelativeMultiHeadAttention``: Transformer-XL's relative positions, as in the Conformer.

Query ``i`` scores key ``j`` with a content term and a position term (Dai et al., 2019)::

    score(i, j) = ((q_i + u) . k_j  +  (q_i + v) . W_r r(a_i - j)) / sqrt(head_dim)

``u`` and ``v`` are learned per head, ``W_r`` is a projection without bias, and ``r(d)`` is the
sinusoidal encoding of the distance ``d``. Queries are the last ``Tq`` of the ``Tk`` positions
(``a_i = i + Tk - Tq``), so a streaming call with cached keys (Transformer-XL's memory) sees what
the full call sees. Distances for ``Tq=2, Tk=4``::

                 key j:  0  1  2  3
    query 0 (a_0 = 2):   2  1  0 -1
    query 1 (a_1 = 3):   3  2  1  0

A relative call is an :func:`attnkit.attention` call whose ``bias`` is the position term as a
:class:`~attnkit.scores.RelativePositionTerm`: the backend computes it one tile at a time, so
neither the ``(Tq, Tk)`` scores nor the ``(Tq, Tk, head_dim)`` encodings ever exist and memory is
O(T), in training too. On CPUs ``auto`` takes attnkit's native kernel, which fuses the term
(its product with the distances a block needs, the shift as index arithmetic), dropout included;
elsewhere, or without the native kernel, it takes torch's fused SDPA one block of queries at a
time with the block's term as its float mask when no gradient is needed, and attnkit's eager
kernel otherwise. The reference (materialised) serves the calls that need the weights, and every
call traced by ``torch.compile`` or ``torch.export``. ``attnkit.capture_attention`` and a
registered backend see a module's call like any other.

With a sliding-window mask (``mask=attnkit.masks.sliding_window(left, right)``, the limited context
of streaming Conformers) the encodings cover only the window's distances and the kernel computes
only the blocks in the band: time grows linearly with ``T`` and memory does not.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from . import _relpos, capture
from ._checks import (
    check_bool,
    check_input,
    check_int,
    check_positive,
    present,
    shape_str,
)
from ._hints import torch_keywords
from ._typing import Bool, Float
from .attention import Explanation, attention, check_backend, explain
from .backends.base import Backend
from .masks import Geometry, Mask, check_mask, visibility
from .scores import RelativePositionTerm

__all__ = ["RelativeMultiHeadAttention"]


class RelativeMultiHeadAttention(nn.Module):
    """Multi-head attention with Transformer-XL relative positions (Conformer's self-attention).

    Args:
        d_model: model size; inputs and output are ``(B, T, d_model)``.
        num_heads: heads; ``d_model`` must be a multiple of it (``head_dim = d_model / num_heads``).
        dropout: dropout on the attention weights in training mode (as openspeech does). The
            kernel regenerates its dropout mask in the backward, so memory stays O(T).
        proj_bias: whether the query, key, value and output projections have a bias (the
            position projection ``pos_proj`` never has one).
        encoding: which ``r(d)`` the position term projects. ``"signed"`` (default):
            ``r(d) = [sin(d w_k) | cos(d w_k)]``, whose sines tell a key ``d`` frames before the
            query from one ``d`` frames after it (Transformer-XL, ESPnet, NeMo).
            ``"symmetric"``: ``r(|d|)``, so the position term is the same for ``+d`` and ``-d``.
            That is what SpeechBrain's ``RelPosEncXL`` computes (its future half repeats the past
            half's sines); use it only to run models trained with it
            (:func:`attnkit.interop.speechbrain.relative_attention`).
        encoding_dtype: what the encodings' angles are computed in. ``torch.float64`` (default):
            the sinusoids to float64 rounding, whatever the parameters' dtype. ``torch.float32``:
            every step in float32 as ESPnet, NeMo and SpeechBrain compute their tables (their
            frequency formula, products and sines rounded to float32: ~1e-4 radians off at
            distance 1000), so that a model trained with those tables gets them;
            :mod:`attnkit.interop`'s loaders choose it. Legacy modes always use
            their toolkit's own table.
        scale: what the summed scores are multiplied by; ``None`` (default) for
            ``1/sqrt(head_dim)`` (``1/sqrt(d_model)`` with ``legacy="openspeech"``). SpeechBrain's
            ``RelPosMHAXL`` uses ``1/sqrt(d_model)``.
        legacy: ``None`` (default) for the formula above, or a toolkit whose relative attention is
            *not* a function of the distance, reproduced for its trained checkpoints:
            ``"openspeech"``, openspeech's ``RelativeMultiHeadAttention`` fed by its Conformer
            (see :func:`attnkit.interop.openspeech.relative_attention`), or ``"espnet"``, ESPnet's
            ``LegacyRelPositionMultiHeadedAttention`` fed by its ``LegacyRelPositionalEncoding``
            (see :func:`attnkit.interop.espnet.relative_attention`). Both feed absolute encodings
            through a pad-and-reshape shift that is a true relative shift only on and below the
            diagonal. Self-attention only.
        legacy_max_len: with ``legacy="espnet"``, the ``max_len`` of the
            ``LegacyRelPositionalEncoding`` (ESPnet's default 5000; espnet2's
            ``max_pos_emb_len``): its encodings are of the positions ``L - 1`` down to ``L - T``
            with ``L = max(legacy_max_len, T)``, so the number matters. ``None`` otherwise.
        backend: passed to :func:`attnkit.attention` (``"auto"`` picks the fastest that fits).

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (``nn.Linear``), ``pos_proj``
    (``W_r``, no bias), ``pos_bias_u`` and ``pos_bias_v`` (``u`` and ``v``, ``(num_heads,
    head_dim)``).

    Relative encodings ``r(d) = [sin(d w_k) | cos(d w_k)]``, ``w_k = 10000^(-2k / d_model)``, are
    computed once in float64 (or ``encoding_dtype``) for every distance a call needs (``Tq + Tk -
    1`` of them: ``2T - 1`` for self-attention) and cached per device and dtype:
    :func:`attnkit.relative_encoding` gives the table (its layout, row order and precision) for
    reading or for mapping other weights.

    >>> import torch, attnkit
    >>> m = attnkit.RelativeMultiHeadAttention(64, 4)
    >>> x = torch.randn(2, 10, 64)
    >>> pad = attnkit.masks.padding_mask([10, 7])       # (B, 1, 1, T), True = real token
    >>> m(x, mask=pad).shape
    torch.Size([2, 10, 64])
    >>> torch.allclose(m(x[:, -3:], x), m(x)[:, -3:], atol=1e-6)  # queries are the last positions
    True
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        dropout: float = 0.0,
        proj_bias: bool = True,
        encoding: Literal["signed", "symmetric"] = "signed",
        encoding_dtype: torch.dtype = torch.float64,
        scale: float | None = None,
        legacy: Literal["openspeech", "espnet"] | None = None,
        legacy_max_len: int | None = None,
        backend: str | Backend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        d_model, num_heads = check_int("d_model", d_model), check_int("num_heads", num_heads)
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
            raise TypeError(f"dropout must be a float in [0, 1), got {dropout!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
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
        if legacy == "espnet":
            legacy_max_len = check_int(
                "legacy_max_len", 5000 if legacy_max_len is None else legacy_max_len
            )
        elif legacy_max_len is not None:
            raise ValueError(
                f"legacy_max_len applies to legacy='espnet' only, got legacy_max_len="
                f"{legacy_max_len!r} with legacy={legacy!r}"
            )
        default_scale = 1.0 / math.sqrt(d_model if legacy == "openspeech" else d_model // num_heads)
        proj_bias = check_bool("proj_bias", proj_bias)
        self.backend = check_backend(backend)
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.dropout = float(dropout)
        self.encoding = encoding
        self.encoding_dtype = encoding_dtype
        self.legacy = legacy
        self.legacy_max_len = legacy_max_len
        # A one-element tuple, not a float attribute: torch.compile(dynamic=True) traces a module's
        # float attributes as symbolic values, which attention()'s checks of the scale cannot take;
        # the elements of a tuple stay constants.
        self._scale = (default_scale if scale is None else check_positive("scale", scale),)
        self._default_scale = default_scale

        def linear(with_bias: bool) -> nn.Linear:
            return nn.Linear(d_model, d_model, bias=with_bias, device=device, dtype=dtype)

        self.q_proj = linear(proj_bias)
        self.k_proj = linear(proj_bias)
        self.v_proj = linear(proj_bias)
        self.pos_proj = linear(False)
        self.out_proj = linear(proj_bias)
        self.pos_bias_u = nn.Parameter(
            torch.empty(num_heads, self.head_dim, device=device, dtype=dtype)
        )
        self.pos_bias_v = nn.Parameter(
            torch.empty(num_heads, self.head_dim, device=device, dtype=dtype)
        )
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)
        # (device, dtype) -> encodings of distances L .. -L (exact), or of the legacy positions.
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[int, Tensor]] = {}
        self._last_projection: tuple[tuple[object, ...], Tensor] | None = None

    @property
    def scale(self) -> float:
        """What the summed scores are multiplied by: ``1/sqrt(head_dim)`` unless the constructor's
        ``scale=`` said otherwise (``1/sqrt(d_model)`` with ``legacy="openspeech"``)."""
        return self._scale[0]

    def extra_repr(self) -> str:
        parts = [f"{self.d_model}, {self.num_heads}, dropout={self.dropout}"]
        if self.encoding != "signed":
            parts.append(f"encoding={self.encoding!r}")
        if self.encoding_dtype != torch.float64:
            parts.append(f"encoding_dtype={self.encoding_dtype}")
        if self.legacy:
            parts.append(f"legacy={self.legacy!r}")
        if self.legacy == "espnet":
            parts.append(f"legacy_max_len={self.legacy_max_len}")
        if self.scale != self._default_scale:
            parts.append(f"scale={self.scale:.6g}")
        return ", ".join(parts)

    # ----------------------------------------------------------------------------------------------
    # Encodings

    def _encodings(self, tq: int, tk: int, top: int, bottom: int) -> Tensor:
        """Unprojected encodings ``(top - bottom + 1, d_model)`` of the distances ``top`` down to
        ``bottom`` (of their absolute values with ``encoding="symmetric"``), or in legacy mode
        ``(T, d_model)`` of that toolkit's absolute positions."""
        weight = self.pos_proj.weight
        if torch.compiler.is_compiling():
            # Tracing: a table cached across calls would be a fake tensor left behind after
            # export, and its size a guard on the traced lengths; make exactly the rows needed.
            if self.legacy:
                return self._table(tk, weight.device).to(weight.device, weight.dtype)
            distances = torch.arange(top, bottom - 1, -1, device=weight.device)
            return self._sinusoids(distances).to(weight.dtype)
        max_len = self.legacy_max_len or 0
        if self.legacy == "espnet" and tk > max_len:
            # ESPnet rebuilds its table for an input longer than max_len: positions tk-1 .. 0.
            with torch.inference_mode(False), torch.no_grad():
                return self._table(tk, weight.device).to(weight.device, weight.dtype)
        key = (weight.device, weight.dtype)
        need = {None: max(abs(top), abs(bottom), 1), "openspeech": tk, "espnet": max_len}[
            self.legacy
        ]
        size, table = self._tables.get(key, (0, weight.new_empty(1, self.d_model)))
        if size < need:
            size = need if self.legacy == "espnet" else max(need, 2 * size)
            # A table made under inference_mode could never be saved for a later backward.
            with torch.inference_mode(False), torch.no_grad():
                table = self._table(size, weight.device).to(weight.device, weight.dtype)
            self._tables[key] = (size, table)
        if self.legacy:
            return table[:tk]
        return table[size - top : size - bottom + 1]  # rows of distances top .. bottom

    def _projected(self, tq: int, tk: int, top: int, bottom: int) -> Tensor:
        """``pos_proj`` of :meth:`_encodings`. Without gradients the result is kept for the next
        call with the same weights (checked by their version counter) and distances: in inference
        the projection of ``Tq + Tk - 1`` encodings is a fifth of the module's matmul work."""
        weight = self.pos_proj.weight
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and weight.requires_grad):
            return self._projection(tq, tk, top, bottom)
        key = (weight.data_ptr(), weight._version, weight.device, weight.dtype, tq, tk, top, bottom)
        if self._last_projection is not None and self._last_projection[0] == key:
            return self._last_projection[1]
        with torch.inference_mode(False), torch.no_grad():  # usable by a later training call
            out = self._projection(tq, tk, top, bottom)
        self._last_projection = (key, out)
        return out

    # The projection takes the mirrored path (see _projection) when the table holds at least this
    # many distances of each sign: a smaller table saves few products for the path's extra passes.
    _MIRROR_ROWS = 32

    def _projection(self, tq: int, tk: int, top: int, bottom: int) -> Tensor:
        """``pos_proj`` of :meth:`_encodings`. A table of both signs of distances is projected
        from its distances ``0, -1, ..., -m`` alone (:func:`attnkit._relpos.mirrored_projection`:
        half the products), where ``pos_proj`` is a plain ``nn.Linear`` without bias or hooks."""
        proj = self.pos_proj
        plain = (
            type(proj) is nn.Linear
            and proj.bias is None
            and not (proj._forward_hooks or proj._forward_pre_hooks)
            and not nn.modules.module._global_forward_hooks
            and not nn.modules.module._global_forward_pre_hooks
        )
        if (
            not plain
            or self.legacy
            or torch.compiler.is_compiling()
            or min(top, -bottom) < self._MIRROR_ROWS
            or torch.is_autocast_enabled(proj.weight.device.type)
        ):
            out: Tensor = proj(self._encodings(tq, tk, top, bottom))
            return out
        m = max(top, -bottom)
        negative = self._encodings(tq, tk, 0, -m)  # distances 0, -1, ..., -m
        return _relpos.mirrored_projection(
            proj.weight, negative, top, bottom, odd=self.encoding != "symmetric"
        )

    def _distances(
        self, mask: Tensor | Mask | None, causal: bool, b: int, tq: int, tk: int
    ) -> tuple[int, int]:
        """The distances ``i' - j`` a call can need, largest first: ``Tk - 1 .. 1 - Tq``, cut to
        what a structured mask (a sliding window, causal) leaves visible."""
        top, bottom = tk - 1, 1 - tq
        seen = visibility(mask, causal)  # the call's mask and causal, as attention() folds them
        if seen is not None:
            geo = Geometry((b,), self.num_heads, tq, tk, torch.device("cpu"))
            lo, hi = seen.distances(geo)
            # j - i' in [lo, hi]  <=>  i' - j in [-hi, -lo]
            top = int(min(top, -lo)) if lo > -math.inf else top
            bottom = int(max(bottom, -hi)) if hi < math.inf else bottom
        return top, min(bottom, top)

    def _table(self, size: int, device: torch.device) -> Tensor:
        """The encodings of distances ``size .. -size``, or in legacy mode the toolkit's table for
        an input of ``size`` frames (float32, as the toolkit computes it)."""
        if self.legacy == "openspeech":
            return _relpos.openspeech_sinusoid(size, self.d_model)
        if self.legacy == "espnet":
            return _relpos.espnet_legacy_sinusoid(
                size, self.d_model, present(self.legacy_max_len, "legacy_max_len")
            )
        return self._sinusoids(torch.arange(size, -size - 1, -1, device=device))

    def _sinusoids(self, distances: Tensor) -> Tensor:
        """The unprojected ``r(d)`` of ``distances`` as ``encoding`` and ``encoding_dtype`` say."""
        if self.encoding == "symmetric":
            distances = distances.abs()
        if self.encoding_dtype == torch.float32:
            return _relpos.float32_sinusoid(distances, self.d_model)
        return _relpos.relative_sinusoid(distances, self.d_model)

    # ----------------------------------------------------------------------------------------------
    # Forward

    def _check(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | Mask | None,
        causal: object,
        need_weights: object,
        backend: object,
    ) -> None:
        for name, t in (("query", query), ("key", key), ("value", value)):
            shape = f"(B, T, d_model={self.d_model})"
            if isinstance(t, Tensor) and (t.ndim != 3 or t.size(-1) != self.d_model):
                raise ValueError(f"{name} must be {shape}, got {shape_str(t.shape)}")
            check_input(name, t, shape, self.d_model, self.out_proj.weight)
        if key.size(0) != query.size(0) or value.shape[:2] != key.shape[:2]:
            raise ValueError(
                f"query (B, Tq, D), key and value (B, Tk, D) must share B and key/value Tk: got "
                f"query {shape_str(query.shape)}, key {shape_str(key.shape)}, "
                f"value {shape_str(value.shape)}"
            )
        if self.legacy and key.size(1) != query.size(1):
            raise ValueError(
                f"legacy={self.legacy!r} reproduces {self.legacy}'s self-attention, whose shift "
                f"needs as many keys as queries: got Tq={query.size(1)} and Tk={key.size(1)}"
            )
        if mask is not None:
            scores = (query.size(0), self.num_heads, query.size(1), key.size(1))
            check_mask("mask", mask, scores)
        for name, flag in (("causal", causal), ("need_weights", need_weights)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if backend is not None:
            check_backend(backend)

    def _biased_queries(self, query: Tensor) -> tuple[Tensor, Tensor]:
        """``q + pos_bias_u`` and ``q + pos_bias_v`` as ``(B, H, Tq, Dh)`` views of token-major
        tensors. Where no gradient flows to ``q``, ``pos_bias_u`` is added in place: a long input
        then allocates and writes one ``(B, Tq, d_model)`` tensor fewer."""
        b, tq, _ = query.shape
        h, dh = self.num_heads, self.head_dim
        q = self.q_proj(query).view(b, tq, h, dh)
        # .to: under torch.autocast q is in the autocast dtype and u, v (float32) would promote it.
        u = self.pos_bias_u.to(q.dtype)
        owned = not (
            q.requires_grad
            or torch.compiler.is_compiling()
            # a q_proj replaced by one that returns its input (nn.Identity) must not write to it
            or q.untyped_storage().data_ptr() == query.untyped_storage().data_ptr()
        )
        if owned:
            qu = q.add_(u)
            qv = qu + (self.pos_bias_v - self.pos_bias_u).to(q.dtype)
            return qu.transpose(1, 2), qv.transpose(1, 2)
        return (q + u).transpose(1, 2), (q + self.pos_bias_v.to(q.dtype)).transpose(1, 2)

    # A stretch of queries in _in_stretches is about this many bytes of one (B, T, d_model) tensor:
    # the six or so tensors of a stretch's call then stay in the CPU's last-level cache, and the
    # allocator reuses their memory from stretch to stretch.
    _STRETCH_BYTES = 1 << 23

    def _stretch(
        self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | Mask | None, causal: bool
    ) -> tuple[int, int, int] | None:
        """``(queries per stretch, lo, hi)`` for :meth:`_in_stretches` (the band's distances
        ``lo <= j - i <= hi``), or None where the call runs whole:
        only calls on the CPU without gradients or dropout, with as many keys as queries, under a
        band alone that is finite on both sides (:func:`attnkit.masks.sliding_window`), and long
        enough for two stretches."""
        if (
            not isinstance(mask, Mask)
            or mask.band is None
            or causal
            or self.legacy
            or torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or query.device.type != "cpu"
            or (self.training and self.dropout > 0)
            or key.size(1) != query.size(1)
            or any(t.requires_grad for t in (query, key, value))
        ):
            return None
        b, t, d = query.shape
        lo, hi = mask.distances(Geometry((b,), self.num_heads, t, t, query.device))
        if math.isinf(lo) or math.isinf(hi) or hi < lo:
            return None
        row_bytes = max(b * d * query.element_size(), 1)
        stretch = max(self._STRETCH_BYTES // row_bytes, 16 * int(hi - lo))
        return (stretch, int(lo), int(hi)) if t >= 2 * stretch else None

    def _in_stretches(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Mask,
        stretches: tuple[int, int, int],
        backend: str | Backend | None,
    ) -> Tensor:
        """The output of a long banded call, computed stretch by stretch of queries: the queries
        ``a:e`` see keys ``a + lo`` up to ``e - 1 + hi`` only, so each stretch is a call of its own
        on those keys. Its queries run on to ``e + hi`` (and are dropped after ``e``), so that the
        stretch's last query is its last key, as the module aligns them. Equal to the whole call:
        every pair, its position term and its mask are the same."""
        b, t = query.shape[:2]
        stretch, lo, hi = stretches
        out: Tensor | None = None
        for a in range(0, t, stretch):
            e = min(a + stretch, t)
            qe, ka = min(e + max(hi, 0), t), max(a + min(lo, 0), 0)
            keys = slice(ka, qe)
            part, _ = self._attend(
                query[:, a:qe], key[:, keys], value[:, keys], mask, False, False, False, backend
            )
            if out is None:
                out = part.new_empty(b, t, part.size(-1))
            out[:, a:e] = part[:, : e - a]
        return present(out, "the output")

    @torch_keywords
    def forward(
        self,
        query: Float[Tensor, "B Tq D"],
        key: Float[Tensor, "B Tk D"] | None = None,
        value: Float[Tensor, "B Tk D"] | None = None,
        *,
        mask: Bool[Tensor, "*#mb #Tk"] | Mask | None = None,
        causal: bool = False,
        need_weights: bool = False,
        backend: str | Backend | None = None,
    ) -> Float[Tensor, "B Tq D"] | tuple[Float[Tensor, "B Tq D"], Float[Tensor, "B H Tq Tk"]]:
        """Attend from ``query`` to ``key`` (default: ``query``) and ``value`` (default: ``key``).

        Args:
            query: ``(B, Tq, d_model)``.
            key: ``(B, Tk, d_model)``; ``Tk > Tq`` is memory or a KV prefix: queries are the last
                ``Tq`` positions, so ``m(x[:, -n:], x)`` is the last ``n`` rows of ``m(x)``.
            value: ``(B, Tk, d_model)``.
            mask: **True = may attend** (as everywhere in attnkit): a bool tensor broadcastable to
                ``(B, H, Tq, Tk)`` (:func:`attnkit.masks.padding_mask` gives ``(B, 1, 1, Tk)``) or
                a structured mask such as ``masks.sliding_window(64, 64) & masks.key_padding(n)``.
                torch's masks are the opposite (True = may NOT attend):
                :func:`attnkit.interop.torch.from_torch_masks` converts them.
            causal: query ``i`` may attend key ``j`` iff ``j <= i + Tk - Tq``; ANDed with ``mask``.
            need_weights: also return the per-head weights ``(B, H, Tq, Tk)``.
            backend: this call's backend, default the module's (see :func:`attnkit.attention`).
                A forced backend that cannot serve the call raises
                :class:`attnkit.BackendError` saying why.

        Returns:
            ``(B, Tq, d_model)``, or ``(output, weights)`` with ``need_weights``. A query with no
            key it may attend gets zeros from the attention (the output is then ``out_proj``'s
            bias).
        """
        key = query if key is None else key
        value = key if value is None else value
        self._check(query, key, value, mask, causal, need_weights, backend)
        capturing = capture.is_capturing(self)
        if not (need_weights or capturing):
            stretches = self._stretch(query, key, value, mask, causal)
            if stretches is not None and isinstance(mask, Mask):
                return self._in_stretches(query, key, value, mask, stretches, backend)
        result, weights = self._attend(
            query, key, value, mask, causal, need_weights, capturing, backend
        )
        if need_weights:
            return result, present(weights, "weights")
        return result

    def _attend(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | Mask | None,
        causal: bool,
        need_weights: bool,
        capturing: bool,
        backend: str | Backend | None,
    ) -> tuple[Tensor, Tensor | None]:
        """forward() after its checks, in one call: the output, and the weights when asked for
        (``need_weights`` or ``capturing``)."""
        b, tq, _ = query.shape
        tk = key.size(1)
        h, dh = self.num_heads, self.head_dim

        qu, qv = self._biased_queries(query)  # (B, H, Tq, Dh) each
        k = self.k_proj(key).view(b, tk, h, dh).transpose(1, 2)  # (B, H, Tk, Dh)
        v = self.v_proj(value).view(b, tk, h, dh).transpose(1, 2)  # (B, H, Tk, Dh)
        if self.legacy:
            enc = self._projected(tq, tk, 0, 0).view(-1, h, dh).transpose(0, 1)
            enc = nn.functional.pad(enc, (0, 0, 1, 0))  # the zero column of openspeech's shift
            term = RelativePositionTerm(qv, enc, self.scale, legacy=True)
        else:
            top, bottom = self._distances(mask, causal, b, tq, tk)
            enc = self._projected(tq, tk, top, bottom)  # (P, D)
            enc = enc.view(-1, h, dh).transpose(0, 1)  # (H, P, Dh)
            term = RelativePositionTerm(qv, enc, self.scale, max_distance=top)
        out = attention(
            qu,
            k,
            v,
            mask=mask,
            bias=term,
            causal=causal,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=need_weights or capturing,
            backend=self.backend if backend is None else backend,
        )
        weights = None
        if isinstance(out, tuple):
            out, weights = out
            if capturing:
                capture.record(self, weights)
        result: Tensor = self.out_proj(out.transpose(1, 2).reshape(b, tq, self.d_model))
        return result, weights

    def explain(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Tensor | Mask | None = None,
        causal: bool = False,
        need_weights: bool = False,
        backend: str | Backend | None = None,
    ) -> Explanation:
        """Which backend ``self(query, key, value, ...)`` would run its attention on, and why:
        :func:`attnkit.explain` for the call the module makes (an attention call whose bias is
        the position term). Runs nothing.

        >>> import torch, attnkit
        >>> m = attnkit.RelativeMultiHeadAttention(64, 4)
        >>> window = attnkit.masks.sliding_window(64, 64)
        >>> print(m.explain(torch.randn(1, 2000, 64), mask=window))  # doctest: +ELLIPSIS
        attention call: ... bias relative position term (129 distances)
        auto picks: chunked
        ...
        """
        key = query if key is None else key
        value = key if value is None else value
        self._check(query, key, value, mask, causal, need_weights, backend)
        b, tq, tk = query.size(0), query.size(1), key.size(1)
        h, dh = self.num_heads, self.head_dim
        ref = self.out_proj.weight

        # Tensors of the call's shapes that hold nothing (stride 0); they need gradients when the
        # module's call would.
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, *self.parameters()))

        def shaped(*size: int) -> Tensor:
            # zeros, not empty: explain() reads whether q, k and v are finite when the call
            # needs gradients, and uninitialised memory may hold NaN.
            base = torch.zeros((), dtype=ref.dtype, device=ref.device, requires_grad=grad)
            return base.expand(*size)

        if self.legacy:
            term = RelativePositionTerm(
                shaped(b, h, tq, dh), shaped(h, tk + 1, dh), self.scale, legacy=True
            )
        else:
            top, bottom = self._distances(mask, causal, b, tq, tk)
            term = RelativePositionTerm(
                shaped(b, h, tq, dh), shaped(h, top - bottom + 1, dh), self.scale, max_distance=top
            )
        return explain(
            shaped(b, h, tq, dh),
            shaped(b, h, tk, dh),
            shaped(b, h, tk, dh),
            mask=mask,
            bias=term,
            causal=causal,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=need_weights or capture.is_capturing(self),
            backend=self.backend if backend is None else backend,
        )
