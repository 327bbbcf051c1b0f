"""An ``attention()`` call: its arguments checked once, and its description for the backends.

Every check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value),
names the argument, and quotes the shapes or values it saw. Only two checks read tensor data, and
both are skipped while torch.compile/export trace: a ``bias`` must not hold NaN or ``+inf``, and
(for calls that need gradients) whether q, k and v hold any non-finite value. Everything else runs
on ``device="meta"`` tensors too, which is how ``explain`` describes a call without allocating it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple, NoReturn

import torch
from torch import Tensor

from ._base.checks import (
    check_broadcastable,
    check_logits,
    check_probability,
    dtype_str,
    plain_number,
    require_tensor,
    shape_str,
)
from ._base.finite import finite_if_readable
from ._base.quantized import QUANTIZED, QuantizedKV
from ._base.records import made
from ._base.transforms import carries_tangent, tracked_beneath, transforms_active
from ._score_mod import ScoreMod, captured_tensors, check_score_mod
from ._score_mod import describe as describe_score_mod
from .caches.view import CacheView, rows_refusal
from .masks import Geometry, Mask, check_mask, visibility
from .scores import DistanceBias, ScoreShape, ScoreTerm

__all__ = [
    "AttentionCall",
    "CheckedCall",
    "check_attention_args",
    "check_cache_call",
    "copy_call",
    "describe_call",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class AttentionCall:
    """Everything about an ``attention()`` call that decides which backend can serve it.

    It holds shapes, dtypes, flags and the call's structured mask and score term (descriptions, not
    data a backend would read here). Backends receive it in their ``check`` and ``cost`` functions;
    ``explain()`` reports it.

    Shape letters: ``H`` query heads, ``Hkv`` key/value heads (``H`` is a multiple of ``Hkv``),
    ``Tq`` and ``Tk`` query and key lengths, ``Dk`` and ``Dv`` the per-head sizes of keys and
    values.
    """

    batch_shape: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    q_len: int
    kv_len: int
    qk_dim: int
    v_dim: int
    dtype: torch.dtype
    device: torch.device
    #: the call's visibility, ``mask`` and ``causal`` together (a bool tensor is wrapped as is)
    mask: Mask | None
    #: the ``mask`` argument as given: a structured mask, or a tensor's shape
    given_mask: Mask | tuple[int, ...] | None
    #: the shape of a dense bool ``mask`` tensor, if one was given (alone or inside ``mask``)
    mask_shape: tuple[int, ...] | None
    causal: bool
    bias_shape: tuple[int, ...] | None
    bias_requires_grad: bool
    score_term: ScoreTerm | None
    softcap: float | None
    sinks: bool
    scale: float
    dropout_p: float
    return_weights: bool
    requires_grad: bool
    #: also return the natural-log log-sum-exp ``(..., H, Tq)``
    return_lse: bool = False
    #: False when q, k or v hold NaN/inf (checked for calls that need gradients); None: not checked
    finite: bool | None = None
    #: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to the scores after softcap and
    #: ``bias``, before the mask; only backends whose ``accepts_score_mod`` is True serve it
    score_mod: ScoreMod | None = None
    #: q, k, v, the bias or the sinks carry forward-mode tangents (torch.func.jvp,
    #: torch.autograd.forward_ad): only backends made of torch's differentiable operations serve it
    forward_ad: bool = False
    #: int8/float8 keys and values with their scales (``attention(..., k_scale=, v_scale=)``):
    #: a backend whose ``reads_quantized`` is True receives them as they are, any other the keys
    #: and values they stand for, dequantized by the dispatcher
    quantized: QuantizedKV | None = None
    #: the keys and values of a KV cache where they lie (``attention(q, view)``): row ``n`` of the
    #: batch attends its own stretch of keys; only backends whose ``accepts_cache`` is True serve
    #: it. The call's ``Tk`` is then the stretch the rows share, else the longest row's end.
    cache: CacheView | None = None

    @property
    def mask_given(self) -> str | None:
        """The ``mask`` argument as given, described (a structured mask's repr, or a tensor's
        shape); worked out when asked, as a mask's description may read its lengths."""
        if self.given_mask is None:
            return None
        if isinstance(self.given_mask, Mask):
            return repr(self.given_mask)
        return shape_str(self.given_mask)

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1 for plain multi-head attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def scores_shape(self) -> tuple[int, ...]:
        """The full ``(..., H, Tq, Tk)`` score shape that masks and biases broadcast to."""
        return (*self.batch_shape, self.num_heads, self.q_len, self.kv_len)

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.batch_shape, self.num_heads, self.q_len, self.kv_len, self.device)

    @property
    def dense_views(self) -> AttentionCall | None:
        """The dense call a cache call is when its keys are plain views of the cache: every row
        the same stretch of one page each (a contiguous cache), unquantized. Its ``k`` and ``v``
        are then ``view.k[:N, :, start:end]`` (and v's), nothing copied; None for any other call
        (worked out once a call in eager: a decode step asks it several times)."""
        view = self.cache
        if view is None:
            return None
        compiling = torch.compiler.is_compiling()
        if not compiling and "_dense_views" in self.__dict__:  # (asked before: read first)
            known: AttentionCall | None = self.__dict__["_dense_views"]
            return known
        dense = None
        if view.shared and view.block_table is None and not view.quantized:
            if compiling:
                return replace(self, cache=None)
            dense = copy_call(self, cache=None)
        if not compiling:
            self.__dict__["_dense_views"] = dense
        return dense

    def describe(self) -> str:
        """One line: ``q (2, 8, 128, 64), k (2, 2, 256, 64), v (...) float32 on cpu, causal``."""
        b = self.batch_shape
        kv = (
            f"k {shape_str((*b, self.num_kv_heads, self.kv_len, self.qk_dim))}, "
            f"v {shape_str((*b, self.num_kv_heads, self.kv_len, self.v_dim))}"
            if self.cache is None
            else f"k, v {self.cache.describe()}"
        )
        parts = [
            f"q {shape_str((*b, self.num_heads, self.q_len, self.qk_dim))}, {kv} "
            f"{dtype_str(self.dtype)} on {self.device}"
        ]
        if self.mask_given is not None:
            parts.append(f"mask {self.mask_given}")
        if self.causal:
            parts.append("causal")
        if self.bias_shape is not None:
            grad = " (requires grad)" if self.bias_requires_grad else ""
            parts.append(f"bias {shape_str(self.bias_shape)}{grad}")
        if self.score_term is not None:
            parts.append(f"bias {self.score_term.describe()}")
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap}")
        if self.score_mod is not None:
            parts.append(describe_score_mod(self.score_mod))
        if self.sinks:
            parts.append("sinks")
        if self.dropout_p:
            parts.append(f"dropout_p={self.dropout_p}")
        if self.return_weights:
            parts.append("return_weights")
        if self.return_lse:
            parts.append("return_lse")
        if self.finite is False:
            parts.append("non-finite values in q/k/v")
        return ", ".join(parts)

    def score_shape(self) -> ScoreShape:
        work = torch.promote_types(self.dtype, torch.float32)
        return Geometry(
            self.batch_shape, self.num_heads, self.q_len, self.kv_len, self.device, work
        )


def _check_scale(scale: object, qk_dim: int, dtype: torch.dtype) -> float:
    if scale is None:
        return 1.0 / math.sqrt(qk_dim) if qk_dim else 1.0
    work = torch.promote_types(dtype, torch.float32)
    scale = plain_number(scale)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {scale!r}")
    limit = torch.finfo(work).max
    # Comparisons, not math.isfinite: under torch.compile(dynamic=True) a module's float
    # attribute is a SymFloat, which dynamo compares but cannot pass to math (NaN fails both).
    if not -limit <= scale <= limit:
        raise ValueError(
            f"scale must be finite and at most {limit:.3g} in magnitude (the largest "
            f"{dtype_str(work)}, in which the scores are computed), got {scale!r}"
        )
    return float(scale)


def _check_softcap(softcap: object) -> float | None:
    if softcap is None:
        return None
    softcap = plain_number(softcap)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a number > 0 or None, got {softcap!r}")
    if not 0.0 < softcap < math.inf:
        raise ValueError(f"softcap must be a finite number > 0, got {softcap!r}")
    return float(softcap)


def _refuse_nested(name: str) -> NoReturn:
    """Raise the error for a nested tensor given as q, k or v (torch's variable-length batch,
    whose lengths no check or kernel here reads)."""
    raise TypeError(
        f"{name} is a nested tensor: attention takes dense (..., H, T, D) tensors. For sequences "
        "of different lengths, pad them to one length and pass mask=masks.key_padding(lengths), "
        "or pack them into one row and pass mask=masks.documents(lengths) (& masks.causal() "
        "for causal ones); t.to_padded_tensor(0.0) pads a nested tensor t"
    )


def _explain_qkv(q: object, k: object, v: object) -> NoReturn:
    """Raise the error that says what is wrong with q, k and v (they failed the quick check)."""
    q = require_tensor("q", q)
    k = require_tensor("k", k)
    v = require_tensor("v", v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.is_nested:
            _refuse_nested(name)
    if q.ndim < 3:
        raise ValueError(
            f"q must have shape (..., H, Tq, Dk) with 3 or more dims, got {q.ndim}-d "
            f"{shape_str(q.shape)}"
        )
    for name, t in (("k", k), ("v", v)):
        if t.ndim != q.ndim:
            raise ValueError(
                f"{name} must have as many dims as q ({q.ndim}), got {t.ndim}-d "
                f"{shape_str(t.shape)} for q {shape_str(q.shape)}"
            )
    batch = tuple(q.shape[:-3])
    if tuple(k.shape[:-3]) != batch or tuple(v.shape[:-3]) != batch:
        raise ValueError(
            f"q, k and v must share their batch dims (...): got q {shape_str(q.shape)}, "
            f"k {shape_str(k.shape)}, v {shape_str(v.shape)}"
        )
    num_heads, qk_dim = q.shape[-3], q.shape[-1]
    num_kv_heads, kv_len, k_dim = k.shape[-3:]
    if tuple(v.shape[-3:-1]) != (num_kv_heads, kv_len):
        raise ValueError(
            f"k and v must agree on (Hkv, Tk): got k {shape_str(k.shape)} and "
            f"v {shape_str(v.shape)}"
        )
    if k_dim != qk_dim:
        raise ValueError(
            f"q and k must share the last dim Dk: got q {shape_str(q.shape)} (Dk={qk_dim}) and "
            f"k {shape_str(k.shape)} (Dk={k_dim})"
        )
    if num_kv_heads == 0:
        raise ValueError(
            f"k and v must have at least one head (Hkv = k.shape[-3] >= 1); got q "
            f"{shape_str(q.shape)}, k {shape_str(k.shape)}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"the heads of q (H={num_heads}) must be a multiple of the heads of k and v "
            f"(Hkv={num_kv_heads}); got q {shape_str(q.shape)}, k {shape_str(k.shape)}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"{name} must be float16, bfloat16, float32 or float64, got {dtype_str(t.dtype)}"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            f"q, k and v must share a dtype, got q {dtype_str(q.dtype)}, k {dtype_str(k.dtype)}, "
            f"v {dtype_str(v.dtype)}"
        )
    if not q.device == k.device == v.device:
        raise ValueError(
            f"q, k and v must be on one device, got q on {q.device}, k on {k.device}, "
            f"v on {v.device}"
        )
    raise RuntimeError("attnkit internal error: q, k and v failed a check and passed another")


def _check_qkv(q: object, k: object, v: object) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v if they fit together; one quick test on every call (a decode step included),
    the messages worked out only when it fails."""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)) or (
        q.is_nested  # (before its shape: a strided nested tensor has none)
    ):
        _explain_qkv(q, k, v)
    qs, ks, vs = q.shape, k.shape, v.shape
    dt, dev = q.dtype, q.device
    nd = len(qs)
    if not (
        nd >= 3
        and len(ks) == nd
        and len(vs) == nd
        and ks[:-3] == qs[:-3]
        and vs[:-3] == qs[:-3]
        and vs[-3:-1] == ks[-3:-1]
        and ks[-1] == qs[-1]
        and ks[-3] != 0
        and qs[-3] % ks[-3] == 0
        and dt in _FLOAT_DTYPES
        and k.dtype == dt
        and v.dtype == dt
        and k.device == dev
        and v.device == dev
    ):
        _explain_qkv(q, k, v)
    return q, k, v


def _check_view(q: object, view: CacheView, v: object) -> tuple[Tensor, Tensor, Tensor, CacheView]:
    """q against a cache view (``attention(q, view)``), and stand-ins without data for the keys
    and values ``(N, Hkv, Tk, Dk|Dv)`` the call reads, which the other checks read as k and v."""
    if v is not None:
        raise TypeError(
            "attention(q, view) reads the keys and values from the cache view: v must be None, "
            f"got {type(v).__name__}"
        )
    q = require_tensor("q", q)
    if q.is_nested:
        _refuse_nested("q")
    rows, hkv, dk = view.rows, view.num_kv_heads, view.k.size(-1)
    if q.ndim != 4 or q.size(0) != rows or q.size(1) % hkv or q.size(-1) != dk:
        raise ValueError(
            f"q must be (N, H, Tq, Dk) for a cache view of N = {rows} rows, H a multiple of its "
            f"Hkv = {hkv} and Dk = {dk}, got {shape_str(q.shape)}"
        )
    if view.quantized:
        if not q.is_floating_point() or q.dtype in QUANTIZED:
            raise TypeError(
                f"q must be float16, bfloat16, float32 or float64 (the dtype the call computes in) "
                f"with a cache view of {dtype_str(view.k.dtype)} pages, got q of "
                f"{dtype_str(q.dtype)}"
            )
    elif q.dtype != view.k.dtype:
        raise TypeError(
            f"q, k and v must share a dtype, got q {dtype_str(q.dtype)}, k "
            f"{dtype_str(view.k.dtype)}, v {dtype_str(view.v.dtype)} (the cache view's pages)"
        )
    if q.device != view.k.device:
        raise ValueError(f"q is on {q.device} but the cache view's pages are on {view.k.device}")
    view = view.with_queries(q.size(2))
    if view.q_lens is not None and max(view.q_lens) > q.size(2):
        raise ValueError(
            f"the cache view's q_lens {list(view.q_lens)} are more than q's Tq = {q.size(2)} "
            "in a row"
        )
    zero = q.new_zeros(())  # (in q's dtype: a quantized view's keys are read in it)
    keys = zero.expand(rows, hkv, view.width, dk)
    return q, keys, zero.expand(rows, hkv, view.width, view.v.size(-1)), view


def _check_rows(view: CacheView, scores: _Scores, q: Tensor, score_mod: object) -> None:
    """A cache call whose rows attend stretches of their own: a band for a mask (each row's own
    keys already say which exist), a bias by distance or none, no score_mod."""
    if view.shared:
        return
    what = rows_refusal(visibility(scores.given, scores.causal))
    if what is not None:
        raise ValueError(
            f"mask: a cache call whose rows attend keys of their own takes bands (causal=True, "
            f"causal(), sliding_window()), index masks (key_indices(), block_indices()) and bool "
            f"tensors, joined by & and |, got {what}: each row's keys already say which keys exist"
        )
    term = scores.term
    if scores.dense is not None or (term is not None and not isinstance(term, DistanceBias)):
        got = term.describe() if term is not None else "a dense tensor"
        raise TypeError(
            "bias: a cache call whose rows attend keys of their own takes a bias by distance "
            f"(DistanceBias, attnkit.alibi_term), got {got}"
        )
    if term is not None:  # the distances of the real queries
        q_len = q.size(2) if view.q_lens is None else max(view.q_lens, default=0)
        term.check(Geometry((view.rows,), q.size(1), q_len, view.kv_len, q.device))
    if score_mod is not None:
        raise ValueError(
            "score_mod: a cache call whose rows attend keys of their own takes none (its indices "
            "would be each row's own)"
        )


def _check_mask_arg(
    mask: object, q: Tensor, scores: tuple[int, ...], legend: str
) -> tuple[Tensor | Mask | None, tuple[int, ...] | None]:
    """``mask`` and the shape of the one dense tensor it holds (None: none, or several)."""
    if mask is None:
        return None, None
    if isinstance(mask, Tensor):
        check_mask("mask", mask, scores, legend)
        if mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
        return mask, tuple(mask.shape)
    if isinstance(mask, Mask):
        *batch, heads, q_len, kv_len = scores
        mask.check(Geometry(tuple(batch), heads, q_len, kv_len, q.device), "mask")
        dense = [p.tensor for p in mask.parts if p.tensor is not None]
        for t in dense:
            if t.device != q.device:
                raise ValueError(f"mask holds a tensor on {t.device} but q is on {q.device}")
        return mask, tuple(dense[0].shape) if len(dense) == 1 else None
    raise TypeError(
        f"mask must be a bool tensor (True = may attend) or an attnkit.masks.Mask, got "
        f"{type(mask).__name__}"
    )


def _check_term(term: ScoreTerm, q: Tensor) -> bool:
    """Whether a score term's inputs need gradients; its inputs must be tensors on q's device."""
    for i, t in enumerate(term.inputs()):
        if not isinstance(t, Tensor):
            raise TypeError(
                f"bias: {term.describe()}.inputs() must return tensors, item {i} is "
                f"{type(t).__name__}"
            )
        if t.device != q.device:
            raise ValueError(
                f"bias: {term.describe()}'s input {i} is on {t.device} but q is on {q.device}"
            )
    return any(t.requires_grad for t in term.inputs())


def _check_term_fits(term: ScoreTerm | None, q: Tensor, k: Tensor, view: CacheView | None) -> None:
    """A score term asked whether it serves the call (its :meth:`~ScoreTerm.check`), before a
    kernel reads its tensors; the terms of cache rows that attend keys of their own are asked
    at their real queries by :func:`_check_rows`."""
    if term is None or (view is not None and not view.shared):
        return
    batch = tuple(q.shape[:-3])
    term.check(ScoreShape(batch, q.size(-3), q.size(-2), k.size(-2), q.device))


def _check_bias_arg(bias: object, q: Tensor, scores: tuple[int, ...], legend: str) -> Tensor:
    """A dense ``bias``: a float tensor in q's dtype and on its device, broadcastable to the
    scores, holding no NaN or +inf."""
    if not isinstance(bias, Tensor):
        raise TypeError(
            f"bias must be a float tensor or an attnkit.scores.ScoreTerm, got {type(bias).__name__}"
        )
    if not bias.is_floating_point():
        hint = "; a boolean mask belongs in mask=" if bias.dtype == torch.bool else ""
        raise TypeError(f"bias must be a float tensor, got {dtype_str(bias.dtype)}{hint}")
    if bias.dtype != q.dtype:
        raise TypeError(
            f"bias must have the dtype of q ({dtype_str(q.dtype)}), got "
            f"{dtype_str(bias.dtype)}; use bias.to(q.dtype)"
        )
    if bias.ndim == 0:
        # torch's SDPA and FlexAttention index a bias's last two dims: refused here, on every
        # backend, rather than failing in one of them.
        raise ValueError(
            f"bias must have at least one dim (..., Tk), got a 0-d tensor ({float(bias)}); one "
            "value added to every score changes no output: leave it out"
        )
    check_broadcastable("bias", bias, scores, legend)
    if bias.device != q.device:
        raise ValueError(f"bias is on {bias.device} but q is on {q.device}")
    check_logits("bias", bias, "a bias may hold -inf (that pair is then masked)")
    return bias


def _check_sinks(sinks: object, q: Tensor, num_heads: int) -> Tensor:
    """``(H,)`` float logits in q's dtype and on its device, each finite or -inf (no sink)."""
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
        got = dtype_str(sinks.dtype) if isinstance(sinks, Tensor) else type(sinks).__name__
        raise TypeError(f"sinks must be a float tensor (H,) or None, got {got}")
    if tuple(sinks.shape) != (num_heads,):
        raise ValueError(
            f"sinks must have shape (H,) = ({num_heads},), one logit per query head, got "
            f"{shape_str(sinks.shape)}"
        )
    if sinks.dtype != q.dtype:
        raise TypeError(
            f"sinks must have the dtype of q ({dtype_str(q.dtype)}), got "
            f"{dtype_str(sinks.dtype)}; use sinks.to(q.dtype)"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")
    check_logits("sinks", sinks, "a sink may be -inf (no sink)")
    return sinks


class _Scores(NamedTuple):
    """What the caller's ``mask``, ``causal`` and ``bias`` say about the scores, checked (a named
    tuple: made on every call, where a frozen dataclass's ``__init__`` costs several times
    more)."""

    given: Tensor | Mask | None
    mask_shape: tuple[int, ...] | None
    causal: bool
    term: ScoreTerm | None
    dense: Tensor | None
    bias_grad: bool


def _check_scores(q: Tensor, k: Tensor, mask: object, bias: object, causal: object) -> _Scores:
    """The caller's ``mask``, ``causal`` and ``bias``, checked against q and k."""
    qs = q.shape
    scores = (*qs[:-3], qs[-3], qs[-2], k.shape[-2])
    legend = "(..., H, Tq, Tk)"
    given, mask_shape = _check_mask_arg(mask, q, scores, legend)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    term = bias if isinstance(bias, ScoreTerm) else None
    dense = None if bias is None or term is not None else _check_bias_arg(bias, q, scores, legend)
    bias_grad = (
        _check_term(term, q) if term is not None else dense is not None and dense.requires_grad
    )
    return _Scores(given, mask_shape, causal, term, dense, bias_grad)


def check_attention_args(
    q: object,
    k: object,
    v: object,
    *,
    mask: object,
    bias: object,
    causal: object,
    scale: object,
    softcap: object = None,
    sinks: object = None,
    dropout_p: object = 0.0,
    return_weights: object = False,
    return_lse: object = False,
    score_mod: object = None,
    check_finite: bool = False,
) -> AttentionCall:
    """Validate the arguments of ``attention()`` and describe the call, once.

    ``check_finite``: for a call that needs gradients, also find out (one host synchronisation)
    whether q, k and v hold NaN/inf, so that backends whose backward would let masked ones into
    the gradients can decline it. Skipped while torch.compile traces and on ``meta`` tensors.
    """
    if isinstance(k, CacheView) and isinstance(k.checked_call, CheckedCall):
        call = k.checked_call.reuse(
            q, k, v, mask, bias, causal, scale, softcap, sinks, dropout_p, return_weights, score_mod
        )
        if call is not None and isinstance(return_lse, bool):
            return call if call.return_lse is return_lse else copy_call(call, return_lse=return_lse)
    view = None
    if isinstance(k, CacheView):
        q, k, v, view = _check_view(q, k, v)
    else:
        q, k, v = _check_qkv(q, k, v)
    scores = _check_scores(q, k, mask, bias, causal)
    sink_t = None if sinks is None else _check_sinks(sinks, q, q.shape[-3])
    mod = check_score_mod(score_mod)
    if view is not None:
        _check_rows(view, scores, q, mod)
    _check_term_fits(scores.term, q, k, view)
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights must be a bool, got {return_weights!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    # The common 0.0 without a call; anything else (False included) is checked.
    zero = type(dropout_p) is float and dropout_p == 0.0
    dropout = 0.0 if zero else check_probability("dropout_p", dropout_p)
    cap = None if softcap is None else _check_softcap(softcap)
    return _described(
        q,
        k,
        v,
        scores,
        scale=_check_scale(scale, q.shape[-1], q.dtype),
        softcap=cap,
        sinks=sink_t,
        dropout_p=dropout,
        return_weights=return_weights,
        return_lse=return_lse,
        score_mod=mod,
        check_finite=check_finite,
        cache=view,
    )


def describe_call(
    q: Tensor,
    k: Tensor | CacheView,
    v: Tensor | None,
    *,
    mask: object,
    bias: object,
    causal: object,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    return_lse: bool = False,
    check_finite: bool = False,
) -> AttentionCall:
    """The call a module makes: ``q``, ``k``, ``v``, ``sinks``, ``dropout_p`` and the flags are the
    module's own, built from its checked arguments and parameters, so they are not checked again;
    the caller's ``mask``, ``bias`` and ``causal``, which the module passes on, are checked here,
    once. The scale is ``1/sqrt(Dk)``. ``k`` may be a cache view (and ``v`` None): a module's call
    on its cache, checked as :func:`attention` checks one."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    if isinstance(k, CacheView) and isinstance(k.checked_call, CheckedCall):
        checked = k.checked_call
        call = checked.reuse(
            q, k, v, mask, bias, causal, checked.scale, None, sinks, dropout_p, return_weights
        )
        if call is not None and call.scale == scale:
            return call if call.return_lse is return_lse else copy_call(call, return_lse=return_lse)
    view = None
    if isinstance(k, CacheView):
        q, k, v, view = _check_view(q, k, v)
    if v is None:
        raise TypeError("describe_call: v is None without a cache view")
    scores = _check_scores(q, k, mask, bias, causal)
    if view is not None:
        _check_rows(view, scores, q, None)
    _check_term_fits(scores.term, q, k, view)
    return _described(
        q,
        k,
        v,
        scores,
        scale=scale,
        softcap=None,
        sinks=sinks,
        dropout_p=dropout_p,
        return_weights=return_weights,
        return_lse=return_lse,
        score_mod=None,
        check_finite=check_finite,
        cache=view,
    )


def _described(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scores: _Scores,
    *,
    scale: float,
    softcap: float | None,
    sinks: Tensor | None,
    dropout_p: float,
    return_weights: bool,
    return_lse: bool,
    score_mod: ScoreMod | None,
    check_finite: bool,
    cache: CacheView | None = None,
) -> AttentionCall:
    """The :class:`AttentionCall` of checked parts (``k`` and ``v`` stand-ins for a ``cache``'s
    pages, whose own tensors say whether they need gradients)."""
    scales: tuple[Tensor | None, ...] = ()
    if cache is not None:
        k, v = cache.k, cache.v
        scales = (cache.k_scale, cache.v_scale)  # (an int8/float8 view's scales, differentiable)
    requires_grad = torch.is_grad_enabled() and (
        scores.bias_grad
        or q.requires_grad
        or k.requires_grad
        or v.requires_grad
        or (bool(scales) and any(s is not None and s.requires_grad for s in scales))
        or (sinks is not None and sinks.requires_grad)
        or (score_mod is not None and bool(captured_tensors(score_mod)))
        # (under vmap, autograd outside it tracks tensors that say they need no gradients)
        or (transforms_active() and tracked_beneath(q, k, v, scores.dense, sinks))
    )
    is_finite = None
    if (
        check_finite
        and cache is None
        and requires_grad
        and q.device.type != "meta"
        and not torch.compiler.is_compiling()
    ):
        # (None under vmap, where no value can be read: the backends that must know refuse then)
        is_finite = finite_if_readable(q, k, v)
    given = scores.given
    qs, ks = q.shape, k.shape
    return made(
        AttentionCall,
        batch_shape=tuple(qs[:-3]),
        num_heads=qs[-3],
        num_kv_heads=ks[-3],
        q_len=qs[-2],
        kv_len=ks[-2] if cache is None else cache.width,
        qk_dim=qs[-1],
        v_dim=v.shape[-1],
        dtype=q.dtype,
        device=q.device,
        mask=None if given is None and not scores.causal else visibility(given, scores.causal),
        given_mask=given if isinstance(given, Mask) else scores.mask_shape,
        mask_shape=scores.mask_shape,
        causal=scores.causal,
        bias_shape=None if scores.dense is None else tuple(scores.dense.shape),
        bias_requires_grad=scores.bias_grad,
        score_term=scores.term,
        softcap=softcap,
        sinks=sinks is not None,
        scale=scale,
        dropout_p=dropout_p,
        return_weights=return_weights,
        requires_grad=requires_grad,
        return_lse=return_lse,
        finite=is_finite,
        score_mod=score_mod,
        forward_ad=carries_tangent(q, k, v, scores.dense, sinks),
        cache=cache,
    )


def copy_call(call: AttentionCall, **changes: object) -> AttentionCall:
    """``call`` with ``changes`` to its fields, the others as they are: no ``__init__`` and no
    check to run again (a decode step's worth of time), and none of the answers kept on the call
    (they are of its own fields)."""
    copy = object.__new__(AttentionCall)
    fields = call.__dict__.copy()
    fields.pop("_dense_views", None)
    fields.update(changes)
    copy.__dict__.update(fields)
    return copy


@dataclass(frozen=True, eq=False)
class CheckedCall:
    """A cache call checked before the cache wrote its new tokens, and the arguments it was
    checked with.

    A :class:`~attnkit.PagedKVCache` checks every argument of a step's attention call before it
    writes (so a refused call changes nothing), on the view the call will read once the new
    tokens are written; the view it then hands out carries this (``CacheView.checked_call``).
    :func:`attnkit.attention` (or a module's call) on that view with the same ``q``, ``mask``,
    ``bias``, ``sinks`` (the same objects), ``causal``, ``scale`` and ``softcap``, in the same
    grad mode and without dropout, weights or a ``score_mod``, takes :attr:`call` rather than
    describing and checking the call a second time: a step is checked once. Any other call on
    the view is checked as usual.
    """

    #: the call as described on the view before the write (its ``cache`` that view)
    call: AttentionCall
    q: Tensor
    mask: object
    bias: object
    causal: object
    scale: object
    softcap: object
    sinks: object
    #: ``torch.is_grad_enabled()``, ``q.requires_grad`` and the sinks' when checked
    grad: tuple[bool, bool, bool]
    #: the sinks' version counter when their values were checked (None: not a tensor, or one
    #: made under inference mode, which keeps none): sinks changed in place since are checked
    #: again, as they may now hold NaN
    sinks_version: int | None = None

    def reuse(
        self,
        q: object,
        view: CacheView,
        v: object,
        mask: object,
        bias: object,
        causal: object,
        scale: object,
        softcap: object,
        sinks: object,
        dropout_p: object = 0.0,
        return_weights: object = False,
        score_mod: object = None,
    ) -> AttentionCall | None:
        """The call on ``view`` (this call's view, or its copy for the call's queries) of these
        arguments, if they are the ones checked; else None (the call is to be checked)."""
        if (
            q is not self.q
            or mask is not self.mask
            or bias is not self.bias
            or sinks is not self.sinks
            or causal is not self.causal
            or type(scale) is not type(self.scale)
            or scale != self.scale
            or type(softcap) is not type(self.softcap)
            or softcap != self.softcap
            or v is not None
            or score_mod is not None
            or return_weights is not False
            or type(dropout_p) is not float
            or dropout_p != 0.0
            or self.grad != _grad(self.q, sinks)
            or torch.compiler.is_compiling()
            or _version(sinks) != self.sinks_version
        ):
            return None
        return copy_call(self.call, cache=view.with_queries(self.q.size(2)))


def _version(t: object) -> int | None:
    """A tensor's version counter (bumped by every in-place change); None for anything else
    and for a tensor made under inference mode, which keeps none."""
    if not isinstance(t, Tensor) or t.is_inference():
        return None
    return int(t._version)


def _grad(q: Tensor, sinks: object) -> tuple[bool, bool, bool]:
    sinks_grad = isinstance(sinks, Tensor) and sinks.requires_grad
    return torch.is_grad_enabled(), q.requires_grad, sinks_grad


def check_cache_call(
    q: object,
    view: CacheView,
    *,
    mask: object,
    bias: object,
    causal: object,
    scale: object,
    softcap: object,
    sinks: object,
) -> CheckedCall:
    """:func:`check_attention_args` of ``attention(q, view, ...)``, before the cache writes the
    tokens ``view`` will hold (raising what that call would raise), and the arguments checked:
    what the view the cache hands out then carries."""
    call = check_attention_args(
        q,
        view,
        None,
        mask=mask,
        bias=bias,
        causal=causal,
        scale=scale,
        softcap=softcap,
        sinks=sinks,
    )
    if not isinstance(q, Tensor):  # (check_attention_args refuses anything else)
        raise TypeError(f"q must be a tensor, got {type(q).__name__}")
    return CheckedCall(
        call, q, mask, bias, causal, scale, softcap, sinks, _grad(q, sinks), _version(sinks)
    )
