"""flash-attn's Python API, served by attnkit on any device.

The functions of ``flash_attn`` (flash-attn 2's ``flash_attn_interface``) with the same names,
argument order, defaults, ``(batch, seqlen, nheads, headdim)`` layouts and semantics, so code
written for flash-attn runs on the CPU, on Apple's GPUs and anywhere else torch runs::

    # before                                    # after
    from flash_attn import flash_attn_func      from attnkit.flash_attn import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True) out = flash_attn_func(q, k, v, causal=True)

or, for code you cannot edit (a Hub model's remote code, a library), once at start-up::

    import attnkit.flash_attn
    attnkit.flash_attn.install()    # "flash_attn" now imports this module, unless it is installed

Each function is one :func:`attnkit.attention` call: the ``(B, T, H, D)`` tensors go in as
``(B, H, T, D)`` views (``q.transpose(1, 2)``, no copy), ``causal`` and ``window_size`` become a
structured band mask, ``cu_seqlens`` become :func:`attnkit.masks.documents` (or, with different
query and key lengths per sequence, :func:`varlen_mask`), ``alibi_slopes`` a lazy
:class:`~attnkit.scores.ScoreTerm` (no ``(Tq, Tk)`` bias is written out). attnkit's backends
then serve the call as any other, O(T) memory included; :func:`attnkit.explain` tells which.

Conventions, as flash-attn's:

* queries are aligned **bottom-right** to the keys: query ``i`` sits at key position
  ``i + Tk - Tq`` (per sequence with ``cu_seqlens``, per batch row with a KV cache);
* ``causal``: query ``i`` may attend key ``j`` iff ``j <= i + Tk - Tq``::

      Tq=2, Tk=5        Tq=5, Tk=2
      1 1 1 1 0         0 0
      1 1 1 1 1         0 0
                        0 0
                        1 0
                        1 1

  A query with no visible key gets output 0 (and zero gradients);
* ``window_size=(left, right)``: query ``i`` may attend the keys
  ``i + Tk - Tq - left <= j <= i + Tk - Tq + right``, bounds inclusive; ``-1`` or None is no bound
  on that side. ``causal=True`` sets ``right = 0``. Other negative bounds are flash-attn 4's:
  a band that leaves out the diagonal (``(None, -11)``: only keys at least 11 before). A band
  with no key (``left + right < 0``) is a ``ValueError``;
* ``softmax_scale`` multiplies ``q k^T`` (default ``1 / sqrt(headdim)``); ``softcap > 0`` caps the
  scaled scores, ``softcap * tanh(s / softcap)``; ``alibi_slopes`` ``(nheads,)`` or
  ``(batch, nheads)`` then add ``-slope * |i + Tk - Tq - j|``; ``dropout_p`` drops attention
  weights and scales the kept ones by ``1 / (1 - p)`` (drawn from torch's generator:
  ``torch.manual_seed`` makes it repeatable);
* the log-sum-exp ``softmax_lse`` is the natural log of each row's softmax denominator over the
  scaled (capped, biased) scores, ``(batch, nheads, seqlen_q)``, or ``(nheads, total_q)`` with
  ``cu_seqlens``.

Where attnkit and flash-attn differ, on purpose:

* attnkit accepts what flash-attn refuses: any head size (the query/key size and the value size
  may differ), float32 and float64, any page size of a paged cache;
* a query with no visible key has ``softmax_lse = -inf`` (the log of an empty sum), where
  flash-attn 2 writes ``+inf``: with ``-inf`` the usual merge of partial attentions by their LSE
  gives such a part weight 0, as it must;
* ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)`` as flash-attn, and
  ``S_dmask`` is what flash-attn makes of it: an empty tensor when ``dropout_p == 0`` (so asking
  for the LSE costs no ``(Tq, Tk)`` tensor); with ``dropout_p > 0`` the softmax weights
  ``(batch, nheads, seqlen_q, seqlen_k)`` before dropout, correctly normalised (flash-attn's
  unnormalised, sign-encoded dropout pattern is not reproduced). For the weights of any call use
  ``attnkit.attention(..., return_weights=True)``;
* the output is returned contiguous, as flash-attn's, and differentiable (the KV-cache function
  too, although flash-attn's has no backward);
* ``deterministic`` is accepted and changes nothing: attnkit's backward is deterministic;
  ``num_splits`` and ``max_seqlen_q``/``max_seqlen_k`` (launch sizes for flash-attn's kernels)
  are accepted and not needed.

Keyword-only additions: ``learnable_sink`` (flash-attn 4's name; ``s_aux`` in the flash-attn 3
builds that serve GPT-OSS) ``(nheads,)``: one logit per head that joins every row's softmax
denominator and attends to nothing (attnkit's ``sinks=``), included in ``softmax_lse``.

Shape letters: ``B`` batch, ``Tq``/``Tk`` query/key lengths, ``H`` query heads, ``Hkv`` key/value
heads (a divisor of ``H``: grouped-query attention), ``D`` head size (``Dv`` of the values).
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

from ._call import check_attention_args
from ._checks import check_bool, check_logits, check_probability, dtype_str, shape_str
from .attention import attention
from .masks import EMPTY, FULL, PARTIAL, Geometry, Mask, band_visibility, causal, documents
from .masks import sliding_window as _sliding_window
from .scores import ScoreTerm

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "install",
    "varlen_mask",
]

_Window = tuple[int | None, int | None]
_Result = Tensor | tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]


# --------------------------------------------------------------------------------------------------
# Arguments


def _band(window_size: object, is_causal: object) -> tuple[float, float]:
    """``(lo, hi)``: the pairs with ``lo <= j - i' <= hi`` may attend (``i'`` the query's key
    position, bottom-right), from flash-attn's ``window_size`` and ``causal``."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"causal must be a bool, got {is_causal!r}")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right), got {window_size!r}")
    bounds = []
    for side, x in zip(("left", "right"), window_size, strict=True):
        if x is None or (type(x) is int and x == -1):
            bounds.append(math.inf)
        elif isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(
                f"window_size {side} bound must be an int or None (-1 or None: no bound), got {x!r}"
            )
        else:
            bounds.append(float(x))
    lo, hi = -bounds[0], bounds[1]
    if is_causal:
        hi = 0.0
    if lo > hi:
        raise ValueError(
            f"window_size={tuple(window_size)!r}{' with causal=True' if is_causal else ''} holds "
            f"no key: the band runs from {lo:g} to {hi:g} keys from the diagonal"
        )
    return lo, hi


def _band_mask(lo: float, hi: float, q_len: int, kv_len: int) -> Mask | None:
    """The band ``lo <= j - i' <= hi`` over ``q_len`` queries and ``kv_len`` keys as attnkit's
    structured mask: None (every pair), :func:`~attnkit.masks.causal`, or a sliding window whose
    unbounded side reaches past every key."""
    if lo == -math.inf and hi == math.inf:
        return None
    if lo == -math.inf and hi == 0:
        return causal()
    # j - i' lies in [-(Tk - 1), Tq - 1]: a bound of Tk on the left (Tq on the right) is none;
    # an unbounded side also reaches past the other bound, so the band is never empty.
    right = max(q_len, int(lo)) if hi == math.inf else int(hi)
    left = max(kv_len, -right) if lo == -math.inf else int(-lo)
    return _sliding_window(left, right)


def _four_d(name: str, t: object, layout: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.ndim != 4:
        raise ValueError(f"{name} must be {layout}, got shape {shape_str(t.shape)}")
    return t


def _lengths(name: str, cu: object, total: int) -> list[int]:
    """The sequence lengths that cumulative lengths ``cu`` describe (one host read)."""
    if isinstance(cu, Tensor):
        if cu.ndim != 1 or cu.is_floating_point() or cu.dtype == torch.bool:
            raise TypeError(
                f"{name} must be a 1-d integer tensor (batch + 1,), got {dtype_str(cu.dtype)} of "
                f"shape {shape_str(cu.shape)}"
            )
        values = [int(x) for x in cu.tolist()]
    elif isinstance(cu, Sequence) and all(type(x) is int for x in cu):
        values = list(cu)
    else:
        raise TypeError(f"{name} must be a 1-d integer tensor (batch + 1,), got {cu!r}")
    lengths = [b - a for a, b in itertools.pairwise(values)]
    if not values or values[0] != 0 or min(lengths, default=0) < 0 or values[-1] != total:
        raise ValueError(
            f"{name} must start at 0, never decrease and end at the {total} packed tokens, got "
            f"{values}"
        )
    return lengths


def _sinks(learnable_sink: object, s_aux: object, q: Tensor, heads: int) -> Tensor | None:
    """The sinks as attention() takes them: ``(H,)`` logits in q's dtype, each finite or -inf."""
    if learnable_sink is not None and s_aux is not None:
        raise TypeError("give the sinks once: learnable_sink or s_aux, not both")
    name, sinks = ("learnable_sink", learnable_sink) if s_aux is None else ("s_aux", s_aux)
    if sinks is None:
        return None
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
        got = dtype_str(sinks.dtype) if isinstance(sinks, Tensor) else type(sinks).__name__
        raise TypeError(f"{name} must be a float tensor (nheads,), got {got}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(
            f"{name} must be (nheads,) = ({heads},), one logit per query head, got "
            f"{shape_str(sinks.shape)}"
        )
    sinks = sinks.to(q.dtype)  # flash-attn keeps them in bfloat16; attnkit wants q's dtype
    check_logits(name, sinks, "a sink may be -inf (no sink)")
    return sinks


def _softcap(softcap: object) -> float | None:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a number (0.0: no softcap), got {softcap!r}")
    # NaN is neither < 0 nor > 0: without the explicit range it would pass as "no softcap".
    if not 0.0 <= softcap < math.inf:
        raise ValueError(f"softcap must be a finite number > 0, or 0.0 for none, got {softcap!r}")
    return float(softcap) if softcap > 0 else None


def _softmax_scale(softmax_scale: object, dtype: torch.dtype) -> float | None:
    """``softmax_scale`` if it is None (``1 / sqrt(headdim)``) or a finite number that the scores'
    dtype (q's, at least float32) holds."""
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(
            f"softmax_scale must be a float or None (1 / sqrt(headdim)), got {softmax_scale!r}"
        )
    work = torch.promote_types(dtype, torch.float32)
    limit = torch.finfo(work).max
    if not abs(softmax_scale) <= limit:  # also NaN, which fails every comparison
        raise ValueError(
            f"softmax_scale must be finite and at most {limit:.3g} in magnitude (the largest "
            f"{dtype_str(work)}, in which the scores are computed), got {softmax_scale!r}"
        )
    return float(softmax_scale)


def _slopes(alibi_slopes: object, heads: int, rows: int, dtype: torch.dtype) -> Tensor:
    """``alibi_slopes`` as ``(rows|1, H)`` in the dtype the bias is computed in."""
    if not isinstance(alibi_slopes, Tensor) or not alibi_slopes.is_floating_point():
        got = (
            dtype_str(alibi_slopes.dtype)
            if isinstance(alibi_slopes, Tensor)
            else type(alibi_slopes).__name__
        )
        raise TypeError(f"alibi_slopes must be a float tensor (nheads,) or (batch, nheads), {got}")
    s = alibi_slopes
    if s.shape not in ((heads,), (rows, heads)):
        raise ValueError(
            f"alibi_slopes must be (nheads,) = ({heads},) or (batch, nheads) = ({rows}, {heads}), "
            f"got {shape_str(s.shape)}"
        )
    if s.device.type != "meta" and not torch.compiler.is_compiling() and s.numel():
        bad = ~torch.isfinite(s)
        if bool(bad.any()):  # one host read; the message's details only when it fails
            at = [int(i) for i in bad.nonzero()[0]]
            where = ", ".join(map(str, at))
            raise ValueError(
                f"alibi_slopes must be finite, got alibi_slopes[{where}] = "
                f"{float(s[tuple(at)])}: a NaN or infinite slope makes the scores it touches "
                "NaN or infinite"
            )
    return s.reshape(-1, heads).to(torch.float64 if dtype == torch.float64 else torch.float32)


# --------------------------------------------------------------------------------------------------
# The masks and the ALiBi term of packed sequences and caches


def _block_range(t: Tensor, start: int, stop: int, block: int) -> tuple[Tensor, Tensor]:
    """Per block of ``block`` columns of ``t[:, start:stop]``: the minimum and the maximum."""
    n = -(-(stop - start) // block)
    part = t[:, start:stop]
    pad = n * block - (stop - start)
    if pad:
        part = torch.cat([part, part[:, -1:].expand(-1, pad)], 1)
    blocks = part.unflatten(1, (n, block))
    return blocks.amin(-1), blocks.amax(-1)  # (rows, n)


class _Sequences(Mask):
    """Sequences whose queries and keys are packed separately: query ``i`` may attend key ``j``
    iff both belong to the same sequence and ``lo <= j - diag[i] <= hi``, where ``diag[i]`` is
    the key position of query ``i``'s diagonal (its sequence's queries aligned bottom-right to
    that sequence's keys). ``q_seq`` and ``diag`` are ``(R, Tq)``, ``k_seq`` is ``(R, Tk)``
    (``R`` = 1 or the batch; -1 marks a key no query may attend)."""

    def __init__(
        self, q_seq: Tensor, diag: Tensor, k_seq: Tensor, lo: float, hi: float, what: str
    ) -> None:
        self.q_seq, self.diag, self.k_seq = q_seq, diag, k_seq
        self.lo, self.hi, self.what = lo, hi, what
        self._devices: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}

    def describe(self) -> str:
        return self.what

    def check(self, geo: Geometry, name: str) -> None:
        rows, q_len = self.q_seq.shape
        if (q_len, self.k_seq.size(1)) != (geo.q_len, geo.kv_len) or rows not in (1, geo.batch):
            raise ValueError(
                f"{name}: {self.describe()} describes {rows} x {q_len} queries x "
                f"{self.k_seq.size(1)} keys, the call has B={geo.batch}, Tq={geo.q_len}, "
                f"Tk={geo.kv_len}"
            )

    def _on(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        if self.q_seq.device == device:
            return self.q_seq, self.diag, self.k_seq
        if device not in self._devices:
            self._devices[device] = (
                self.q_seq.to(device),
                self.diag.to(device),
                self.k_seq.to(device),
            )
        return self._devices[device]

    def tile(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        q_seq, diag, k_seq = self._on(geo.device)
        same = q_seq[:, qs:qe, None] == k_seq[:, None, ks:ke]  # (R, rows, keys)
        j = torch.arange(ks, ke, device=geo.device)
        return (same & band_visibility(diag[:, qs:qe, None], j, self.lo, self.hi)).unsqueeze(1)

    def block_states(
        self, geo: Geometry, q: tuple[int, int, int], k: tuple[int, int, int]
    ) -> Tensor:
        q_seq, diag, k_seq = (t.cpu() for t in self._on(geo.device))
        (q0, q1, bq), (k0, k1, bk) = q, k
        qmin, qmax = (t.unsqueeze(-1) for t in _block_range(q_seq, q0, q1, bq))
        dmin, dmax = (t.unsqueeze(-1) for t in _block_range(diag, q0, q1, bq))
        kmin, kmax = (t.unsqueeze(-2) for t in _block_range(k_seq, k0, k1, bk))
        first = torch.arange(k0, k1, bk)
        last = torch.clamp(first + bk - 1, max=k1 - 1)
        # j - diag over a block pair runs from first - dmax to last - dmin.
        near, far = first - dmax, last - dmin
        empty = (qmax < kmin) | (kmax < qmin) | (kmax < 0) | (far < self.lo) | (near > self.hi)
        one = (qmin == qmax) & (kmin == kmax) & (qmin == kmin) & (kmin >= 0)
        full = one & (near >= self.lo) & (far <= self.hi)
        e, f = empty.all(0), full.all(0)
        return torch.where(e, EMPTY, torch.where(f, FULL, PARTIAL)).to(torch.uint8)


def _sequences(
    q_lengths: list[int], k_lengths: list[int], lo: float, hi: float, device: torch.device
) -> Mask | None:
    """The mask of packed sequences: :func:`~attnkit.masks.documents` (with the band) when every
    sequence has as many queries as keys, else a mask that aligns each sequence on its own."""
    total_q, total_k = sum(q_lengths), sum(k_lengths)
    if q_lengths == k_lengths:
        band = _band_mask(lo, hi, total_q, total_k)
        docs = documents(q_lengths) if len(q_lengths) > 1 else None
        if docs is None or band is None:
            return docs if band is None else band
        return docs & band
    n = torch.arange(len(q_lengths))
    q_seq = torch.repeat_interleave(n, torch.tensor(q_lengths, dtype=torch.long))
    k_seq = torch.repeat_interleave(n, torch.tensor(k_lengths, dtype=torch.long))
    q_end = torch.tensor(q_lengths).cumsum(0)
    k_end = torch.tensor(k_lengths).cumsum(0)
    # Query i of sequence s sits at key position k_end[s] - (q_end[s] - i).
    diag = torch.arange(total_q) + (k_end - q_end)[q_seq]
    what = f"flash_attn varlen (queries {q_lengths}, keys {k_lengths}; band {lo:g}..{hi:g})"
    return _Sequences(
        q_seq[None].to(device), diag[None].to(device), k_seq[None].to(device), lo, hi, what
    )


def varlen_mask(
    cu_seqlens_q: Tensor | Sequence[int],
    cu_seqlens_k: Tensor | Sequence[int] | None = None,
    *,
    causal: bool = False,
    window_size: _Window = (-1, -1),
) -> Mask | None:
    """The mask :func:`flash_attn_varlen_func` applies to packed sequences, for
    :func:`attnkit.attention` over ``(1, H, total_q, D)`` queries and ``(1, Hkv, total_k, D)``
    keys.

    Tokens attend only within their sequence; each sequence's queries are aligned bottom-right to
    its keys, and ``causal``/``window_size`` apply within it as in flash-attn. With the same
    lengths for queries and keys it is ``masks.documents(lengths)`` ANDed with the band; None
    when nothing is masked (one sequence, no band).

    >>> varlen_mask([0, 2, 5], causal=True)
    documents(lengths=[2, 3]) & causal()
    >>> varlen_mask([0, 1, 3], [0, 3, 5], causal=True).dense(3, 5)[0, 0].int()
    tensor([[1, 1, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [0, 0, 0, 1, 1]], dtype=torch.int32)
    """
    lo, hi = _band(window_size, causal)
    q_total = int(cu_seqlens_q[-1]) if len(cu_seqlens_q) else 0
    q_lengths = _lengths("cu_seqlens_q", cu_seqlens_q, q_total)
    if cu_seqlens_k is None:
        k_lengths = q_lengths
    else:
        k_total = int(cu_seqlens_k[-1]) if len(cu_seqlens_k) else 0
        k_lengths = _lengths("cu_seqlens_k", cu_seqlens_k, k_total)
    if len(q_lengths) != len(k_lengths):
        raise ValueError(
            f"cu_seqlens_q describes {len(q_lengths)} sequences and cu_seqlens_k "
            f"{len(k_lengths)}: they must describe the same sequences"
        )
    device = cu_seqlens_q.device if isinstance(cu_seqlens_q, Tensor) else torch.device("cpu")
    return _sequences(q_lengths, k_lengths, lo, hi, device)


class _ALiBi(ScoreTerm):
    """flash-attn's ALiBi: ``-slope[h] * |j - diag[i]|``, computed tile by tile.

    ``slopes`` ``(R, Tq|1, H)`` (per row and, for packed sequences, per query's sequence);
    ``diag`` ``(R, Tq)`` the key position of each query's diagonal, or None for the call's own
    bottom-right alignment; ``shift`` = ``Tk - Tq`` of the call, which maps the positions the
    kernel hands over back to query indices.
    """

    def __init__(self, slopes: Tensor, diag: Tensor | None, shift: int) -> None:
        self.slopes, self.diag, self.shift = slopes, diag, shift

    def inputs(self) -> tuple[Tensor, ...]:
        return (self.slopes,)

    def describe(self) -> str:
        return "flash_attn alibi_slopes"

    def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
        (slopes,) = inputs
        i = q_pos[:, 0] - self.shift
        if self.diag is None:
            at = q_pos.unsqueeze(0)  # (1, rows, 1)
        else:
            at = self.diag.to(q_pos.device)[:, i].unsqueeze(-1)  # (R, rows, 1)
        s = slopes if slopes.size(1) == 1 else slopes[:, i]  # (R, rows|1, H)
        distance = (k_pos - at).abs().to(slopes.dtype)  # (R|1, rows, keys)
        return -(s.permute(0, 2, 1).unsqueeze(-1) * distance.unsqueeze(1))  # (R, H, rows, keys)


# --------------------------------------------------------------------------------------------------
# The call


def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | None,
    bias: ScoreTerm | None,
    dropout_p: float,
    softmax_scale: float | None,
    softcap: float | None,
    sinks: Tensor | None,
    want_lse: bool,
    want_probs: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One :func:`attnkit.attention` call on ``(B, H, T, D)`` views: the output ``(B, Tq, H,
    Dv)``, the LSE ``(B, H, Tq)`` if wanted, the weights if wanted (``softmax_scale`` and
    ``softcap`` already checked: softcap None for none)."""
    result = attention(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        scale=softmax_scale,
        softcap=softcap,
        sinks=sinks,
        dropout_p=dropout_p,
        return_weights=want_probs,
        return_lse=want_lse,
    )
    lse = probs = None
    if isinstance(result, tuple):
        out, *rest = result
        if want_probs:
            probs = rest.pop(0)
        if want_lse:
            lse = rest.pop(0)
    else:
        out = result
    return out.transpose(1, 2).contiguous(), lse, probs


def _finish(out: Tensor, lse: Tensor | None, probs: Tensor | None, asked: bool) -> _Result:
    """flash-attn's return value: ``out``, or ``(out, softmax_lse, S_dmask)`` when asked."""
    if not asked or lse is None:
        return out
    if probs is None:  # flash-attn's S_dmask without dropout: nothing
        probs = out.new_empty((0,))
    return out, lse, probs


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Tensor | None = None,
    s_aux: Tensor | None = None,
) -> _Result:
    """flash-attn's ``flash_attn_func``: attention over ``(B, T, H, D)`` tensors.

    Args:
        q: ``(B, Tq, H, D)``.
        k: ``(B, Tk, Hkv, D)``.
        v: ``(B, Tk, Hkv, Dv)``.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic:
            as in flash-attn (see the module's conventions).
        return_attn_probs: also return ``softmax_lse`` ``(B, H, Tq)`` and ``S_dmask``.
        learnable_sink, s_aux: ``(H,)`` attention-sink logits (flash-attn 4's and 3's names).

    Returns:
        ``out`` ``(B, Tq, H, Dv)``, or ``(out, softmax_lse, S_dmask)``.

    >>> import torch
    >>> q, k, v = torch.randn(2, 5, 8, 16), torch.randn(2, 7, 2, 16), torch.randn(2, 7, 2, 16)
    >>> out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    >>> out.shape, lse.shape
    (torch.Size([2, 5, 8, 16]), torch.Size([2, 8, 5]))
    """
    q = _four_d("q", q, "(batch, seqlen_q, nheads, headdim)")
    k = _four_d("k", k, "(batch, seqlen_k, nheads_k, headdim)")
    v = _four_d("v", v, "(batch, seqlen_k, nheads_k, headdim_v)")
    lo, hi = _band(window_size, causal)
    check_bool("deterministic", deterministic)
    asked = check_bool("return_attn_probs", return_attn_probs)
    p = check_probability("dropout_p", dropout_p)
    cap = _softcap(softcap)
    scale = _softmax_scale(softmax_scale, q.dtype)
    batch, q_len, heads = q.shape[:3]
    kv_len = k.size(1)
    bias = None
    if alibi_slopes is not None:
        slopes = _slopes(alibi_slopes, heads, batch, q.dtype)
        bias = _ALiBi(slopes.unsqueeze(1), None, kv_len - q_len)
    out, lse, probs = _attend(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        mask=_band_mask(lo, hi, q_len, kv_len),
        bias=bias,
        dropout_p=p,
        softmax_scale=scale,
        softcap=cap,
        sinks=_sinks(learnable_sink, s_aux, q, heads),
        want_lse=asked,
        want_probs=asked and p > 0,
    )
    return _finish(out, lse, probs, asked)


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Tensor | None = None,
    s_aux: Tensor | None = None,
) -> _Result:
    """flash-attn's ``flash_attn_qkvpacked_func``: ``qkv`` ``(B, T, 3, H, D)``, split into views;
    otherwise :func:`flash_attn_func`."""
    if not isinstance(qkv, Tensor) or qkv.ndim != 5 or qkv.size(2) != 3:
        got = shape_str(qkv.shape) if isinstance(qkv, Tensor) else type(qkv).__name__
        raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got {got}")
    q, k, v = qkv.unbind(2)
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=learnable_sink,
        s_aux=s_aux,
    )


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Tensor | None = None,
    s_aux: Tensor | None = None,
) -> _Result:
    """flash-attn's ``flash_attn_kvpacked_func``: ``kv`` ``(B, Tk, 2, Hkv, D)``, split into
    views; otherwise :func:`flash_attn_func`."""
    if not isinstance(kv, Tensor) or kv.ndim != 5 or kv.size(2) != 2:
        got = shape_str(kv.shape) if isinstance(kv, Tensor) else type(kv).__name__
        raise ValueError(f"kv must be (batch, seqlen_k, 2, nheads_k, headdim), got {got}")
    k, v = kv.unbind(2)
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=learnable_sink,
        s_aux=s_aux,
    )


def _three_d(name: str, t: object, layout: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.ndim != 3:
        raise ValueError(f"{name} must be {layout}, got shape {shape_str(t.shape)}")
    return t


def _pages(cache: Tensor, block_table: Tensor, lengths: list[int]) -> Tensor:
    """The packed ``(sum(lengths), Hkv, D)`` tokens of a paged ``(blocks, page, Hkv, D)`` cache:
    sequence ``b`` holds its first ``lengths[b]`` tokens in the pages ``block_table[b]``."""
    page = cache.size(1)
    rows = torch.repeat_interleave(
        torch.arange(len(lengths), device=block_table.device),
        torch.tensor(lengths, device=block_table.device),
    )
    starts = torch.tensor([0, *lengths], device=block_table.device).cumsum(0)[:-1]
    t = torch.arange(sum(lengths), device=block_table.device) - starts[rows]
    blocks = block_table.long()[rows, t // page]
    return cache[blocks.to(cache.device), (t % page).to(cache.device)]


def _check_block_table(block_table: object, rows: int) -> Tensor:
    if not isinstance(block_table, Tensor):
        raise TypeError(
            "block_table must be an integer tensor (batch, max_blocks) of page numbers, got "
            f"{type(block_table).__name__}"
        )
    if (
        block_table.is_floating_point()
        or block_table.is_complex()
        or block_table.dtype == torch.bool
    ):
        raise TypeError(
            "block_table must be an integer tensor (batch, max_blocks) of page numbers, got "
            f"{dtype_str(block_table.dtype)}"
        )
    if block_table.ndim != 2 or block_table.size(0) != rows:
        raise ValueError(
            f"block_table must be (batch, max_blocks) with batch = {rows}, got shape "
            f"{shape_str(block_table.shape)}"
        )
    return block_table


def _pages_used(lengths: list[int], page: int) -> list[int]:
    """How many pages of ``page`` tokens each sequence of ``lengths`` tokens fills."""
    return [-(-n // page) if page else 0 for n in lengths]


def _page_table(table: Tensor, used: list[int], pages: int, what: str) -> Tensor:
    """``table`` as int64 indices, after checking that the first ``used[b]`` entries of each row
    ``b`` are pages of the ``pages`` that ``what`` holds; the entries past them, which name no
    page the call reads, are replaced by 0 so that gathering whole rows cannot fail on them.

    Indexing would take a negative entry from the end (another sequence's page, read or written
    without a word) and fail on one past the end with an IndexError naming nothing: both are
    refused here, with one host read.
    """
    if not table.numel() or table.device.type == "meta" or torch.compiler.is_compiling():
        return table.long()
    cols = torch.arange(table.size(1), device=table.device)
    needed = cols < torch.tensor(used, device=table.device)[:, None]
    bad = needed & ((table < 0) | (table >= pages))
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        numbered = f", numbered 0 to {pages - 1}" if pages else ""
        raise ValueError(
            f"block_table[{row}, {col}] = {int(table[row, col])} is not a page: {what} holds "
            f"{pages} pages{numbered} (row {row} reads its first {used[row]} entries)"
        )
    return torch.where(needed, table.long(), 0)


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | Tensor | None = None,
    max_seqlen_k: int | Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Tensor | None = None,
    *,
    learnable_sink: Tensor | None = None,
    s_aux: Tensor | None = None,
) -> _Result:
    """flash-attn's ``flash_attn_varlen_func``: packed sequences without padding.

    Args:
        q: ``(total_q, H, D)``, the sequences' queries one after the other.
        k: ``(total_k, Hkv, D)``; with ``block_table``, a paged cache ``(blocks, page, Hkv, D)``.
        v: ``(total_k, Hkv, Dv)``, or paged like ``k``.
        cu_seqlens_q: ``(batch + 1,)`` integers: sequence ``s`` has the queries
            ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]``.
        cu_seqlens_k: ``(batch + 1,)``, the same for the keys (a sequence may have more keys than
            queries: its queries are aligned bottom-right to its keys).
        max_seqlen_q, max_seqlen_k: accepted, not needed.
        block_table: ``(batch, max_blocks)``: sequence ``s``'s keys are the first
            ``cu_seqlens_k[s + 1] - cu_seqlens_k[s]`` tokens of its pages.
        others: as :func:`flash_attn_func`; ``alibi_slopes`` may be ``(batch, H)``, one row per
            sequence.

    Returns:
        ``out`` ``(total_q, H, Dv)``, or ``(out, softmax_lse, S_dmask)`` with ``softmax_lse``
        ``(H, total_q)`` and ``S_dmask`` ``(H, total_q, total_k)`` (zero across sequences) when
        ``dropout_p > 0``.

    >>> import torch
    >>> q = torch.randn(5, 4, 16)                  # two sequences of 2 and 3 tokens
    >>> cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    >>> flash_attn_varlen_func(q, q, q, cu, cu, 3, 3, causal=True).shape
    torch.Size([5, 4, 16])
    """
    q = _three_d("q", q, "(total_q, nheads, headdim)")
    q_lengths = _lengths("cu_seqlens_q", cu_seqlens_q, q.size(0))
    rows = len(q_lengths)
    if block_table is not None:
        k = _four_d("k", k, "(num_blocks, page_block_size, nheads_k, headdim) with block_table")
        v = _four_d("v", v, "(num_blocks, page_block_size, nheads_k, headdim_v) with block_table")
        table = _check_block_table(block_table, rows)
        total = int(cu_seqlens_k[-1]) if len(cu_seqlens_k) else 0
        k_lengths = _lengths("cu_seqlens_k", cu_seqlens_k, total)
        capacity = table.size(1) * k.size(1)
        if max(k_lengths, default=0) > capacity:
            raise ValueError(
                f"cu_seqlens_k gives a sequence {max(k_lengths)} keys, more than its "
                f"{table.size(1)} pages of {k.size(1)} hold"
            )
        if v.shape[:2] != k.shape[:2]:
            raise ValueError(
                f"k {shape_str(k.shape)} and v {shape_str(v.shape)} must be the same pages "
                "(num_blocks, page_block_size, ...)"
            )
        used = _pages_used(k_lengths, k.size(1))
        table = _page_table(table, used, k.size(0), f"the paged k {shape_str(k.shape)}")
        k, v = _pages(k, table, k_lengths), _pages(v, table, k_lengths)
    else:
        k = _three_d("k", k, "(total_k, nheads_k, headdim)")
        v = _three_d("v", v, "(total_k, nheads_k, headdim_v)")
        k_lengths = _lengths("cu_seqlens_k", cu_seqlens_k, k.size(0))
    if len(k_lengths) != rows:
        raise ValueError(
            f"cu_seqlens_q describes {rows} sequences and cu_seqlens_k {len(k_lengths)}: they "
            "must describe the same sequences"
        )
    lo, hi = _band(window_size, causal)
    check_bool("deterministic", deterministic)
    asked = check_bool("return_attn_probs", return_attn_probs)
    p = check_probability("dropout_p", dropout_p)
    cap = _softcap(softcap)
    scale = _softmax_scale(softmax_scale, q.dtype)
    bias = None
    if alibi_slopes is not None:
        slopes = _slopes(alibi_slopes, q.size(1), rows, q.dtype)
        if slopes.size(0) > 1:  # one row per sequence: each query takes its sequence's
            seq = torch.repeat_interleave(
                torch.arange(rows, device=slopes.device),
                torch.tensor(q_lengths, device=slopes.device),
            )
            slopes = slopes[seq]
        else:
            slopes = slopes.expand(1, -1)
        starts_q = torch.tensor([0, *q_lengths]).cumsum(0)
        starts_k = torch.tensor([0, *k_lengths]).cumsum(0)
        seq_of = torch.repeat_interleave(torch.arange(rows), torch.tensor(q_lengths))
        diag = torch.arange(q.size(0)) + (starts_k[1:] - starts_q[1:])[seq_of]
        bias = _ALiBi(slopes.unsqueeze(0), diag.unsqueeze(0), k.size(0) - q.size(0))
    out, lse, probs = _attend(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        mask=_sequences(q_lengths, k_lengths, lo, hi, q.device),
        bias=bias,
        dropout_p=p,
        softmax_scale=scale,
        softcap=cap,
        sinks=_sinks(learnable_sink, s_aux, q, q.size(1)),
        want_lse=asked,
        want_probs=asked and p > 0,
    )
    return _finish(
        out[0], None if lse is None else lse[0], None if probs is None else probs[0], asked
    )


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int | Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Tensor | None = None,
    s_aux: Tensor | None = None,
) -> _Result:
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: ``qkv`` ``(total, 3, H, D)``, split
    into views; otherwise :func:`flash_attn_varlen_func`."""
    if not isinstance(qkv, Tensor) or qkv.ndim != 4 or qkv.size(1) != 3:
        got = shape_str(qkv.shape) if isinstance(qkv, Tensor) else type(qkv).__name__
        raise ValueError(f"qkv must be (total, 3, nheads, headdim), got {got}")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=learnable_sink,
        s_aux=s_aux,
    )


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | Tensor | None = None,
    max_seqlen_k: int | Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Tensor | None = None,
    s_aux: Tensor | None = None,
) -> _Result:
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: ``kv`` ``(total_k, 2, Hkv, D)``, split
    into views; otherwise :func:`flash_attn_varlen_func`."""
    if not isinstance(kv, Tensor) or kv.ndim != 4 or kv.size(1) != 2:
        got = shape_str(kv.shape) if isinstance(kv, Tensor) else type(kv).__name__
        raise ValueError(f"kv must be (total_k, 2, nheads_k, headdim), got {got}")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=learnable_sink,
        s_aux=s_aux,
    )


# --------------------------------------------------------------------------------------------------
# The KV cache


def _per_row(name: str, value: object, rows: int, default: int) -> list[int]:
    """An int, or a ``(rows,)`` integer tensor, as one int per row (one host read)."""
    if value is None:
        return [default] * rows
    if type(value) is int:
        return [value] * rows
    if (
        not isinstance(value, Tensor)
        or value.is_floating_point()
        or value.dtype == torch.bool
        or value.shape != (rows,)
    ):
        got = (
            f"{dtype_str(value.dtype)} of shape {shape_str(value.shape)}"
            if isinstance(value, Tensor)
            else repr(value)
        )
        raise ValueError(f"{name} must be an int or an integer tensor ({rows},), got {got}")
    return [int(x) for x in value.tolist()]


def _rotary(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """``x`` ``(B, T, H, D)`` with its first ``2 * cos.size(-1)`` dims rotated at ``positions``
    ``(B, T)``: pairs ``(2i, 2i + 1)`` when ``interleaved`` (GPT-J), else ``(i, i + d/2)``
    (GPT-NeoX)."""
    half = cos.size(-1)
    c = cos[positions].unsqueeze(2).to(x.dtype)  # (B, T, 1, half)
    s = sin[positions].unsqueeze(2).to(x.dtype)
    part, rest = x[..., : 2 * half], x[..., 2 * half :]
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]
        turned = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = part[..., :half], part[..., half:]
        turned = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((turned, rest), dim=-1)


def _check_cache(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """The cache's shapes against each other and against q's heads and head size."""
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache {shape_str(k_cache.shape)} and v_cache {shape_str(v_cache.shape)} must agree "
            "on all but the head size"
        )
    heads, kv_heads = q.size(2), k_cache.size(2)
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"q's nheads ({heads}) must be a multiple of the cache's nheads_k ({kv_heads}); got "
            f"q {shape_str(q.shape)}, k_cache {shape_str(k_cache.shape)}"
        )
    if q.size(3) != k_cache.size(3):
        raise ValueError(
            f"q's headdim ({q.size(3)}) must be k_cache's ({k_cache.size(3)}); got q "
            f"{shape_str(q.shape)}, k_cache {shape_str(k_cache.shape)}"
        )


def _check_new(name: str, new: Tensor, cache: Tensor, cache_name: str) -> None:
    """New keys or values against the cache they are written into."""
    if new.shape[2:] != cache.shape[2:]:
        raise ValueError(
            f"{name} {shape_str(new.shape)} must have {cache_name}'s (nheads_k, headdim) = "
            f"{shape_str(cache.shape[2:])}"
        )
    if not new.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {dtype_str(new.dtype)}")
    if new.device != cache.device:
        raise ValueError(f"{name} is on {new.device} but {cache_name} is on {cache.device}")


def _rotary_table(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor) or not t.is_floating_point():
        got = dtype_str(t.dtype) if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{name} must be a float tensor (seqlen_ro, rotary_dim / 2), got {got}")
    if t.ndim != 2:
        raise ValueError(
            f"{name} must be (seqlen_ro, rotary_dim / 2), got shape {shape_str(t.shape)}"
        )
    return t


def _check_rotary(cos: object, sin: object, head_dim: int, reach: int) -> tuple[Tensor, Tensor]:
    """``rotary_cos`` and ``rotary_sin``: float ``(seqlen_ro, rotary_dim / 2)`` tables of at least
    ``reach`` positions, with ``rotary_dim`` at most ``head_dim``."""
    cos = _rotary_table("rotary_cos", cos)
    sin = _rotary_table("rotary_sin", sin)
    if sin.shape != cos.shape:
        raise ValueError(
            f"rotary_sin {shape_str(sin.shape)} must have rotary_cos's shape {shape_str(cos.shape)}"
        )
    half = cos.size(1)
    if 2 * half > head_dim:
        raise ValueError(
            f"rotary_cos has {half} columns (rotary_dim / 2) and so rotates {2 * half} dims, more "
            f"than the headdim of {head_dim}: it may have at most {head_dim // 2} columns, got "
            f"shape {shape_str(cos.shape)}"
        )
    if reach > cos.size(0):
        raise ValueError(
            f"rotary_cos has {cos.size(0)} positions, fewer than the {reach} this call reaches "
            "(cache_seqlens plus the new tokens, and the queries' positions)"
        )
    return cos, sin


def _attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention() takes a tensor of ``dtype`` in: under torch.autocast it casts
    float16, bfloat16 and float32 to autocast's dtype, and float64 stays (torch's SDPA rule)."""
    kind = device.type
    if (
        dtype in (torch.float16, torch.bfloat16, torch.float32)
        and torch.amp.is_autocast_available(kind)
        and torch.is_autocast_enabled(kind)
    ):
        return torch.get_autocast_dtype(kind)
    return dtype


def _stand_in(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A tensor of ``shape`` with ``t``'s device and the dtype attention() takes it in, and no
    data: one zero, expanded."""
    return torch.zeros((), dtype=_attention_dtype(t.dtype, t.device), device=t.device).expand(shape)


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    block_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    learnable_sink: Tensor | None = None,
    s_aux: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """flash-attn's ``flash_attn_with_kvcache``: decoding with a preallocated (or paged) cache.

    With ``k`` and ``v`` the new keys and values are first written into ``k_cache``/``v_cache``
    **in place**, at positions ``cache_seqlens[b]``, ``cache_seqlens[b] + 1``, ... of row ``b``;
    the queries then attend the row's keys ``cache_leftpad[b] <= j < cache_seqlens[b] +
    seqlen_new``, aligned bottom-right to them.

    Args:
        q: ``(B, Tq, H, D)``.
        k_cache, v_cache: ``(B_cache, capacity, Hkv, D|Dv)``, or with ``block_table`` pages
            ``(blocks, page, Hkv, D|Dv)`` (any page size).
        k, v: ``(B, seqlen_new, Hkv, D|Dv)`` new keys and values, or None.
        rotary_cos, rotary_sin: ``(seqlen_ro, rotary_dim / 2)``: rotate the first ``rotary_dim``
            dims of ``k`` at its positions ``cache_seqlens[b] - cache_leftpad[b] + t``, and of
            ``q`` at the same positions when ``causal`` or windowed (else all at
            ``cache_seqlens[b] - cache_leftpad[b]``), pairs as ``rotary_interleaved`` says
            (True: dims ``(0, 1), (2, 3), ...``; False: ``(0, rotary_dim / 2), ...``, GPT-NeoX).
            Needs ``k`` and ``v``, as in flash-attn.
        cache_seqlens: an int or ``(B,)``: the tokens each row holds before this call (None: the
            whole capacity, and no ``k``/``v``).
        cache_batch_idx: ``(B,)``: the cache rows of the batch rows (default ``0..B-1``).
        cache_leftpad: ``(B,)``: each row's keys start there (default 0).
        block_table: ``(B, max_blocks)``: the pages of each row, in order.
        num_splits: accepted, not needed.
        return_softmax_lse: also return ``softmax_lse`` ``(B, H, Tq)``.
        others: as :func:`flash_attn_func`.

    Returns:
        ``out`` ``(B, Tq, H, Dv)``, or ``(out, softmax_lse)``.

    >>> import torch
    >>> k_cache, v_cache = torch.zeros(2, 16, 2, 8), torch.zeros(2, 16, 2, 8)
    >>> q, k, v = torch.randn(2, 1, 4, 8), torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
    >>> out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([3, 5]),
    ...                               causal=True)
    >>> out.shape, bool(k_cache[1, 5].eq(k[1, 0]).all())   # k was written at position 5 of row 1
    (torch.Size([2, 1, 4, 8]), True)
    """
    # Every check comes before the new tokens are written: a refused call leaves the cache as it
    # was, so the caller can fix the call and repeat it.
    q = _four_d("q", q, "(batch, seqlen_q, nheads, headdim)")
    paged = block_table is not None
    layout = (
        "(num_blocks, page_block_size, nheads_k, headdim)"
        if paged
        else ("(batch_cache, seqlen_cache, nheads_k, headdim)")
    )
    k_cache = _four_d("k_cache", k_cache, layout)
    v_cache = _four_d("v_cache", v_cache, layout)
    batch, q_len, heads = q.shape[:3]
    lo, hi = _band(window_size, causal)
    want_lse = check_bool("return_softmax_lse", return_softmax_lse)
    check_bool("rotary_interleaved", rotary_interleaved)
    _check_cache(q, k_cache, v_cache)
    cap = _softcap(softcap)
    scale = _softmax_scale(softmax_scale, q.dtype)
    sinks = _sinks(learnable_sink, s_aux, q, heads)
    if paged:
        table = _check_block_table(block_table, batch)
        capacity = table.size(1) * k_cache.size(1)
    else:
        capacity = k_cache.size(1)
        if cache_batch_idx is None and k_cache.size(0) != batch:
            raise ValueError(
                f"k_cache holds {k_cache.size(0)} rows for a batch of {batch}: pass "
                "cache_batch_idx to say which rows"
            )
    if (k is None) != (v is None):
        raise TypeError("k and v come together: give both new keys and values, or neither")
    if k is not None and cache_seqlens is None:
        raise TypeError("cache_seqlens is needed with k and v: it says where they are written")
    seen = _per_row("cache_seqlens", cache_seqlens, batch, capacity)
    start = _per_row("cache_leftpad", cache_leftpad, batch, 0)
    rows = list(range(batch))
    if cache_batch_idx is not None:
        rows = _per_row("cache_batch_idx", cache_batch_idx, batch, 0)
        if rows and (min(rows) < 0 or max(rows) >= k_cache.size(0)):
            raise ValueError(
                f"cache_batch_idx must index the {k_cache.size(0)} cache rows, got {rows}"
            )
    new = 0
    if k is not None and v is not None:
        k = _four_d("k", k, "(batch, seqlen_new, nheads_k, headdim)")
        v = _four_d("v", v, "(batch, seqlen_new, nheads_k, headdim_v)")
        if k.shape[:3] != v.shape[:3] or k.size(0) != batch:
            raise ValueError(
                f"k {shape_str(k.shape)} and v {shape_str(v.shape)} must be (batch={batch}, "
                "seqlen_new, nheads_k, ...)"
            )
        _check_new("k", k, k_cache, "k_cache")
        _check_new("v", v, v_cache, "v_cache")
        new = k.size(1)
    lengths = [s + new for s in seen]
    if max(lengths, default=0) > capacity or min(seen, default=0) < 0:
        raise ValueError(
            f"cache_seqlens {seen} + {new} new tokens do not fit the cache's {capacity} positions"
        )
    if any(not 0 <= a <= n for a, n in zip(start, seen, strict=True)):
        raise ValueError(f"cache_leftpad {start} must lie in 0..cache_seqlens {seen}")
    if paged:
        used = _pages_used(lengths, k_cache.size(1))
        table = _page_table(table, used, k_cache.size(0), f"k_cache {shape_str(k_cache.shape)}")

    if rotary_cos is not None or rotary_sin is not None:
        if rotary_cos is None or rotary_sin is None or k is None or v is None:
            raise TypeError(
                "rotary_cos and rotary_sin come together, and with k and v (the new tokens they "
                "rotate), as in flash-attn"
            )
        # flash-attn's rule: causal or windowed queries sit at their own positions.
        positional = causal or not (lo == -math.inf and hi == math.inf)
        base = [s - a for s, a in zip(seen, start, strict=True)]
        reach = max((b + max(new, q_len if positional else 1) for b in base), default=0)
        cos, sin = _check_rotary(rotary_cos, rotary_sin, q.size(3), max(reach, *lengths, 0))
        at = torch.tensor(base, device=q.device)
        k_pos = at[:, None] + torch.arange(new, device=q.device)
        q_pos = at[:, None] + (torch.arange(q_len, device=q.device) if positional else 0)
        q_pos = q_pos.expand(batch, q_len)
        q = _rotary(q, cos, sin, q_pos, rotary_interleaved)
        k = _rotary(k, cos, sin, k_pos, rotary_interleaved)

    kv_len = max(lengths, default=0)
    uniform = all(n == kv_len for n in lengths) and not any(start)
    diag = torch.arange(q_len)[None] + (torch.tensor(lengths) - q_len)[:, None]  # (B, Tq)
    if uniform:
        mask = _band_mask(lo, hi, q_len, kv_len)
    else:
        j = torch.arange(kv_len)
        k_seq = ((j >= torch.tensor(start)[:, None]) & (j < torch.tensor(lengths)[:, None])).long()
        what = f"flash_attn kv cache (keys {start}..{lengths}; band {lo:g}..{hi:g})"
        mask = _Sequences(
            torch.ones(batch, q_len, dtype=torch.long).to(q.device),
            diag.to(q.device),
            (k_seq * 2 - 1).to(q.device),  # 1: a key of the row, -1: none
            lo,
            hi,
            what,
        )
    bias = None
    if alibi_slopes is not None:
        slopes = _slopes(alibi_slopes, heads, batch, q.dtype)
        bias = _ALiBi(slopes.unsqueeze(1), None if uniform else diag.to(q.device), kv_len - q_len)
    # What attention() checks of the call it will get (dtypes, devices, the mask's and the score
    # term's fit), asked now on stand-ins without data.
    kv_heads = k_cache.size(2)
    check_attention_args(
        _stand_in(q, (batch, heads, q_len, q.size(3))),
        _stand_in(k_cache, (batch, kv_heads, kv_len, k_cache.size(3))),
        _stand_in(v_cache, (batch, kv_heads, kv_len, v_cache.size(3))),
        mask=mask,
        bias=bias,
        causal=False,
        scale=scale,
        softcap=cap,
        sinks=None if sinks is None else _stand_in(sinks, tuple(sinks.shape)),
    )

    cache_rows = torch.tensor(rows, dtype=torch.long)
    if k is not None and v is not None and new:
        at = torch.tensor(seen)[:, None] + torch.arange(new)  # (B, new) positions in each row
        if paged:
            page = k_cache.size(1)
            where = (table[torch.arange(batch)[:, None], (at // page).to(table.device)], at % page)
        else:
            where = (cache_rows[:, None].expand(batch, new), at)
        index = tuple(w.to(k_cache.device) for w in where)
        k_cache.index_put_(index, k.to(k_cache.dtype))
        v_cache.index_put_(index, v.to(v_cache.dtype))

    if paged:
        pages = table[:, : _pages_used([kv_len], k_cache.size(1))[0]].to(k_cache.device)
        keys = k_cache[pages].flatten(1, 2)[:, :kv_len]
        values = v_cache[pages].flatten(1, 2)[:, :kv_len]
    elif cache_batch_idx is not None:
        keys = k_cache[cache_rows.to(k_cache.device), :kv_len]
        values = v_cache[cache_rows.to(v_cache.device), :kv_len]
    else:
        keys, values = k_cache[:, :kv_len], v_cache[:, :kv_len]

    out, lse, _ = _attend(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        mask=mask,
        bias=bias,
        dropout_p=0.0,
        softmax_scale=scale,
        softcap=cap,
        sinks=sinks,
        want_lse=want_lse,
        want_probs=False,
    )
    return (out, lse) if want_lse and lse is not None else out


# --------------------------------------------------------------------------------------------------
# Standing in for flash-attn


def install() -> str:
    """Let ``import flash_attn`` find this module when flash-attn is not installed.

    Registers ``sys.modules["flash_attn"]`` and ``sys.modules["flash_attn.flash_attn_interface"]``
    as aliases of :mod:`attnkit.flash_attn`, so code that does ``from flash_attn import
    flash_attn_func`` runs unchanged. A real flash-attn install is never shadowed: if one can be
    imported, nothing is registered. Returns what it did, in one line.

    Only the attention functions are there: ``flash_attn.bert_padding``, ``flash_attn.layers``,
    ``flash_attn.ops`` and ``flash_attn.modules`` are not.
    """
    this = sys.modules[__name__]
    if sys.modules.get("flash_attn") is this:
        return "flash_attn already stands for attnkit.flash_attn"
    if "flash_attn" in sys.modules or importlib.util.find_spec("flash_attn") is not None:
        found = sys.modules.get("flash_attn")
        where = getattr(found, "__file__", None) or getattr(
            importlib.util.find_spec("flash_attn"), "origin", None
        )
        return f"flash_attn is installed ({where}); nothing was aliased"
    sys.modules["flash_attn"] = this
    sys.modules["flash_attn.flash_attn_interface"] = this
    return (
        "flash_attn and flash_attn.flash_attn_interface now import attnkit.flash_attn "
        "(flash-attn is not installed)"
    )


def _uninstall() -> None:
    """Remove the aliases :func:`install` registered (for tests)."""
    this = sys.modules[__name__]
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        if sys.modules.get(name) is this:
            del sys.modules[name]
