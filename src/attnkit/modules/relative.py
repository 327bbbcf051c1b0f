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
only the blocks in the band: time grows linearly with ``T``, and the attention's memory beyond
its inputs and output does not grow at all. The kernel takes such a call's query blocks a
stretch at a time, every head of a stretch before the next (the plan's query ordering, which
:meth:`RelativeMultiHeadAttention.explain` prints), so that a long input's keys are read from
memory once.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from .._base.checks import check_bool, check_input, check_int, check_positive, present, shape_str
from .._base.hints import torch_keywords
from .._base.shapes import Bool, Float
from .._base.transforms import transforms_active
from ..attention import Explanation, attention, check_backend, explain
from ..backends.base import Backend
from ..masks import Geometry, Mask, check_mask, visibility
from ..scores import RelativePositionTerm
from . import capture
from ._shards import SequenceShards
from .positional import RelativePositionEmbedding

__all__ = ["RelativeMultiHeadAttention"]


class RelativeMultiHeadAttention(nn.Module):
    """Multi-head attention with Transformer-XL relative positions (Conformer's self-attention).

    A forward projects its inputs, makes one :func:`attnkit.attention` call whose ``bias`` is the
    position term, and projects the result: the position term's encodings come from the position
    module ``pos_proj`` (a :class:`~attnkit.RelativePositionEmbedding` unless another is given).

    Args:
        d_model: model size; inputs and output are ``(B, T, d_model)``.
        num_heads: heads; ``d_model`` must be a multiple of it (``head_dim = d_model / num_heads``).
        dropout: dropout on the attention weights in training mode (as openspeech does). The
            kernel regenerates its dropout mask in the backward, so memory stays O(T).
        proj_bias: whether the query, key, value and output projections have a bias (the
            position projection never has one).
        encoding, encoding_dtype: which encodings ``r(d)`` the default position module computes,
            and in what precision: see :class:`~attnkit.RelativePositionEmbedding`
            (``"signed"`` in float64 by default; ``"symmetric"`` is SpeechBrain's, float32 the
            toolkits' own tables). Only with the default ``pos_proj``.
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
            diagonal. Self-attention only. A ``pos_proj`` given must have the same ``legacy``.
        legacy_max_len: with ``legacy="espnet"``, the ``max_len`` of the
            ``LegacyRelPositionalEncoding`` (ESPnet's default 5000; espnet2's
            ``max_pos_emb_len``): its encodings are of the positions ``L - 1`` down to ``L - T``
            with ``L = max(legacy_max_len, T)``, so the number matters. ``None`` otherwise. Only
            with the default ``pos_proj``.
        pos_proj: the position module, ``None`` (default) for a
            :class:`~attnkit.RelativePositionEmbedding` of the arguments above. Any module
            called as ``pos_proj(top, bottom)`` that returns the ``(top - bottom + 1, d_model)``
            projected encodings ``W_r r(d)`` of the distances ``top`` down to ``bottom`` (a
            query's position minus a key's) serves.
        backend: passed to :func:`attnkit.attention` (``"auto"`` picks the fastest that fits).

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (``nn.Linear``), ``pos_proj``
    (the position module; its ``weight`` is ``W_r``), ``pos_bias_u`` and ``pos_bias_v`` (``u``
    and ``v``, ``(num_heads, head_dim)``).

    A call asks ``pos_proj`` for the distances it can see: ``Tq + Tk - 1`` of them (``2T - 1``
    for self-attention), or a sliding window's alone. :func:`attnkit.relative_encoding` gives the
    unprojected table (its layout, row order and precision) for reading or for mapping other
    weights.

    >>> import torch, attnkit
    >>> m = attnkit.RelativeMultiHeadAttention(64, 4)
    >>> x = torch.randn(2, 10, 64)
    >>> pad = attnkit.masks.padding_mask([10, 7])       # (B, 1, 1, T), True = real token
    >>> m(x, mask=pad).shape
    torch.Size([2, 10, 64])
    >>> torch.allclose(m(x[:, -3:], x), m(x)[:, -3:], atol=1e-6)  # queries are the last positions
    True
    """

    #: This rank's place in a sequence split across processes, set by
    #: :func:`attnkit.distributed.sequence_parallel`; ``None`` in one process. The position
    #: module's table is then the whole sequence's, on every rank (replicated).
    sequence_shards: SequenceShards | None = None

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
        pos_proj: nn.Module | None = None,
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
        proj_bias = check_bool("proj_bias", proj_bias)
        self.backend = check_backend(backend)
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.dropout = float(dropout)
        self.legacy = legacy
        default_scale = 1.0 / math.sqrt(d_model if legacy == "openspeech" else self.head_dim)
        # A one-element tuple, not a float attribute: torch.compile(dynamic=True) traces a module's
        # float attributes as symbolic values, which attention()'s checks of the scale cannot take;
        # the elements of a tuple stay constants.
        self._scale = (default_scale if scale is None else check_positive("scale", scale),)
        self._default_scale = default_scale

        def linear() -> nn.Linear:
            return nn.Linear(d_model, d_model, bias=proj_bias, device=device, dtype=dtype)

        # Made in this order, W_r fourth, so that a seeded module draws the weights it always has.
        self.q_proj, self.k_proj, self.v_proj = linear(), linear(), linear()
        self.pos_proj = self._position_module(
            pos_proj, encoding, encoding_dtype, legacy_max_len, device, dtype
        )
        self.out_proj = linear()
        self.pos_bias_u = nn.Parameter(
            torch.empty(num_heads, self.head_dim, device=device, dtype=dtype)
        )
        self.pos_bias_v = nn.Parameter(
            torch.empty(num_heads, self.head_dim, device=device, dtype=dtype)
        )
        self._reset_position_biases()

    def reset_parameters(self) -> None:
        """Initialise every parameter again, as the constructor does: the projections (and
        ``pos_proj``, where it has a ``reset_parameters``) as ``nn.Linear`` initialises them,
        Xavier-uniform ``pos_bias_u`` and ``pos_bias_v``. What a module built on the meta device
        runs after ``to_empty()``."""
        for module in (self.q_proj, self.k_proj, self.v_proj, self.pos_proj, self.out_proj):
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
        self._reset_position_biases()

    def _reset_position_biases(self) -> None:
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)

    def _position_module(
        self,
        given: nn.Module | None,
        encoding: str,
        encoding_dtype: torch.dtype,
        legacy_max_len: int | None,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> nn.Module:
        """``pos_proj``: the one given, or a :class:`RelativePositionEmbedding` of the arguments
        that describe it (which a given one must leave at their defaults)."""
        if given is None:
            return RelativePositionEmbedding(
                self.d_model,
                encoding=encoding,  # type: ignore[arg-type]
                encoding_dtype=encoding_dtype,
                legacy=self.legacy,
                legacy_max_len=legacy_max_len,
                device=device,
                dtype=dtype,
            )
        if not isinstance(given, nn.Module):
            raise TypeError(f"pos_proj must be an nn.Module, got {type(given).__name__}")
        described = {
            "encoding": (encoding, "signed"),
            "encoding_dtype": (encoding_dtype, torch.float64),
            "legacy_max_len": (legacy_max_len, None),
        }
        for name, (value, default) in described.items():
            if value != default:
                raise ValueError(
                    f"{name}={value!r} describes the default position module; with pos_proj "
                    f"given, pass it to that module ({type(given).__name__})"
                )
        theirs = getattr(given, "legacy", None)
        if theirs != self.legacy:
            raise ValueError(
                f"pos_proj has legacy={theirs!r} and this module legacy={self.legacy!r}: a "
                "legacy attention needs its toolkit's position module, and only it"
            )
        return given

    @property
    def scale(self) -> float:
        """What the summed scores are multiplied by: ``1/sqrt(head_dim)`` unless the constructor's
        ``scale=`` said otherwise (``1/sqrt(d_model)`` with ``legacy="openspeech"``)."""
        return self._scale[0]

    @property
    def encoding(self) -> str | None:
        """The position module's ``encoding`` (``"signed"`` or ``"symmetric"``; None for a
        module that does not say)."""
        return getattr(self.pos_proj, "encoding", None)

    @property
    def encoding_dtype(self) -> torch.dtype | None:
        """The position module's ``encoding_dtype`` (None for a module that does not say)."""
        return getattr(self.pos_proj, "encoding_dtype", None)

    @property
    def legacy_max_len(self) -> int | None:
        """The position module's ``legacy_max_len`` (with ``legacy="espnet"``)."""
        return getattr(self.pos_proj, "legacy_max_len", None)

    def extra_repr(self) -> str:
        parts = [f"{self.d_model}, {self.num_heads}, dropout={self.dropout}"]
        if self.legacy:
            parts.append(f"legacy={self.legacy!r}")
        if self.scale != self._default_scale:
            parts.append(f"scale={self.scale:.6g}")
        return ", ".join(parts)

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
        if self.sequence_shards is not None:
            self._check_sharded(need_weights)
        elif mask is not None:  # across processes, the distributed call checks the whole mask
            scores = (query.size(0), self.num_heads, query.size(1), key.size(1))
            check_mask("mask", mask, scores)
        for name, flag in (("causal", causal), ("need_weights", need_weights)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if backend is not None:
            check_backend(backend)

    def _check_sharded(self, need_weights: object) -> None:
        """What a call on one rank's shard of a sequence cannot do, refused with the reason."""
        if self.legacy:
            raise ValueError(
                f"legacy={self.legacy!r} reads absolute encodings of the whole sequence in one "
                "process; a sequence split across processes needs the Transformer-XL form "
                "(legacy=None)"
            )
        if need_weights is True or capture.is_capturing(self):
            raise ValueError(
                "no attention weights from a sequence split across processes: they would be the "
                "whole sequence's (Tq, Tk) matrix on every rank"
            )

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
        b, tq, _ = query.shape
        tk = key.size(1)
        h, dh = self.num_heads, self.head_dim
        qu, qv = self._biased_queries(query)  # (B, H, Tq, Dh) each
        k = self.k_proj(key).view(b, tk, h, dh).transpose(1, 2)  # (B, H, Tk, Dh)
        v = self.v_proj(value).view(b, tk, h, dh).transpose(1, 2)  # (B, H, Tk, Dh)
        shards = self.sequence_shards
        dropout_p = self.dropout if self.training else 0.0
        if shards is not None:
            # The distances are the whole sequence's: every rank's table holds them all.
            w = shards.world_size
            term = self._position_term(qv, self._positions(mask, causal, b, tq * w, tk * w))
            out = shards.attention(
                qu, k, v, mask=mask, bias=term, causal=causal, scale=self.scale, sinks=None,
                dropout_p=dropout_p, return_lse=False,
            )  # fmt: skip
        else:
            term = self._position_term(qv, self._positions(mask, causal, b, tq, tk))
            out = attention(
                qu,
                k,
                v,
                mask=mask,
                bias=term,
                causal=causal,
                scale=self.scale,
                dropout_p=dropout_p,
                return_weights=need_weights or capturing,
                backend=self.backend if backend is None else backend,
            )
        weights = None
        if isinstance(out, tuple):
            out, weights = out
            if capturing:
                capture.record(self, weights)
        result: Tensor = self.out_proj(out.transpose(1, 2).reshape(b, tq, self.d_model))
        if need_weights:
            return result, present(weights, "weights")
        return result

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
            # torch.func's wrappers have no storage to compare (and may wrap tracked tensors)
            or transforms_active()
            # a q_proj replaced by one that returns its input (nn.Identity) must not write to it
            or q.untyped_storage().data_ptr() == query.untyped_storage().data_ptr()
        )
        if owned:
            qu = q.add_(u)
            qv = qu + (self.pos_bias_v - self.pos_bias_u).to(q.dtype)
            return qu.transpose(1, 2), qv.transpose(1, 2)
        return (q + u).transpose(1, 2), (q + self.pos_bias_v.to(q.dtype)).transpose(1, 2)

    def _positions(
        self, mask: Tensor | Mask | None, causal: bool, b: int, tq: int, tk: int
    ) -> tuple[int, int]:
        """The distances ``i' - j`` a call can need, largest first: ``Tk - 1 .. 1 - Tq``, cut to
        what a structured mask (a sliding window, causal) leaves visible. A legacy call asks for
        them all (its table has a row per frame)."""
        top, bottom = tk - 1, 1 - tq
        seen = None if self.legacy else visibility(mask, causal)  # as attention() folds them
        if seen is not None:
            lo, hi = seen.distances(Geometry((b,), self.num_heads, tq, tk, torch.device("cpu")))
            # j - i' in [lo, hi]  <=>  i' - j in [-hi, -lo]
            top = int(min(top, -lo)) if lo > -math.inf else top
            bottom = int(max(bottom, -hi)) if hi < math.inf else bottom
        return top, min(bottom, top)

    def _position_term(self, qv: Tensor, distances: tuple[int, int]) -> RelativePositionTerm:
        """The position term of a call whose ``q + pos_bias_v`` is ``qv`` ``(B, H, Tq, Dh)`` and
        whose distances run ``distances = (top, bottom)``: ``pos_proj``'s table per head."""
        top, bottom = distances
        enc = self.pos_proj(top, bottom)  # (P, D)
        enc = enc.view(-1, self.num_heads, self.head_dim).transpose(0, 1)  # (H, P, Dh)
        if self.legacy:
            enc = nn.functional.pad(enc, (0, 0, 1, 0))  # the zero column of the toolkit's shift
            return RelativePositionTerm(qv, enc, self.scale, legacy=True)
        return RelativePositionTerm(qv, enc, self.scale, max_distance=top)

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
        :func:`attnkit.explain` for the one call the module makes (an attention call whose bias
        is the position term), its block plan included. Runs nothing.

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

        top, bottom = self._positions(mask, causal, b, tq, tk)
        rows = tk + 1 if self.legacy else top - bottom + 1  # the legacy table's zero row too
        term = RelativePositionTerm(
            shaped(b, h, tq, dh),
            shaped(h, rows, dh),
            self.scale,
            **({"legacy": True} if self.legacy else {"max_distance": top}),
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
