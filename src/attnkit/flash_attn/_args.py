"""flash-attn's arguments, checked, in attnkit's terms: the band of ``causal`` and ``window_size``,
layouts, cumulative sequence lengths, sinks, softcap, ``softmax_scale`` and ALiBi's slopes.

Each check raises with the argument's name and value, in flash-attn's words for the layouts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .._base.checks import check_logits, dtype_str, plain_number, shape_str
from ..caches._quantize import FLOAT8
from ..masks import Mask, causal
from ..masks import sliding_window as _sliding_window

__all__ = [
    "band",
    "band_mask",
    "descaled_q",
    "descales",
    "four_d",
    "host_ints",
    "lengths_of",
    "scale_of",
    "sinks_of",
    "slopes_of",
    "softcap_of",
    "three_d",
]


def band(window_size: object, is_causal: object) -> tuple[float, float]:
    """``(lo, hi)``: the pairs with ``lo <= j - i' <= hi`` may attend (``i'`` the query's key
    position, bottom-right), from flash-attn's ``window_size`` and ``causal``."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"causal must be a bool, got {is_causal!r}")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right), got {window_size!r}")
    bounds = []
    for side, given in zip(("left", "right"), window_size, strict=True):
        x = plain_number(given)  # numpy's ints, as flash-attn's binding takes them
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


def band_mask(lo: float, hi: float, q_len: int, kv_len: int) -> Mask | None:
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


def four_d(name: str, t: object, layout: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.ndim != 4:
        raise ValueError(f"{name} must be {layout}, got shape {shape_str(t.shape)}")
    return t


def host_ints(name: str, t: Tensor, why: str) -> list[int]:
    """The ints ``t`` holds (one host read). A tensor on the meta device holds none: it is
    refused by name, ``why`` saying what its values decide. Such an argument is a few ints that
    the call cannot run without (the outputs' shapes do not depend on them, but the call's mask,
    its checks and where it writes do), so it is asked for on a device that holds them rather
    than invented."""
    if t.device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device, which holds no values to read, and its values {why}: "
            "pass it on the CPU (the call's other tensors may stay on the meta device)"
        )
    return [int(x) for x in t.tolist()]


def lengths_of(name: str, cu: object, total: int | None) -> list[int]:
    """The sequence lengths that cumulative lengths ``cu`` describe (one host read); they must
    end at ``total`` packed tokens (None: at whatever ``cu`` ends)."""
    if isinstance(cu, Tensor):
        if cu.ndim != 1 or cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
            raise TypeError(
                f"{name} must be a 1-d integer tensor (batch + 1,), got {dtype_str(cu.dtype)} of "
                f"shape {shape_str(cu.shape)}"
            )
        values = host_ints(name, cu, "say where each sequence starts")
    elif isinstance(cu, Sequence) and all(type(x) is int for x in cu):
        values = list(cu)
    else:
        raise TypeError(f"{name} must be a 1-d integer tensor (batch + 1,), got {cu!r}")
    lengths = [b - a for a, b in itertools.pairwise(values)]
    ends = total is None or (bool(values) and values[-1] == total)
    if not values or values[0] != 0 or min(lengths, default=0) < 0 or not ends:
        end = "" if total is None else f" at the {total} packed tokens"
        raise ValueError(f"{name} must start at 0, never decrease and end{end}, got {values}")
    return lengths


def sinks_of(learnable_sink: object, s_aux: object, q: Tensor, heads: int) -> Tensor | None:
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


def softcap_of(softcap: object) -> float | None:
    softcap = plain_number(softcap)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a number (0.0: no softcap), got {softcap!r}")
    # NaN is neither < 0 nor > 0: without the explicit range it would pass as "no softcap".
    if not 0.0 <= softcap < math.inf:
        raise ValueError(f"softcap must be a finite number > 0, or 0.0 for none, got {softcap!r}")
    return float(softcap) if softcap > 0 else None


def scale_of(softmax_scale: object, dtype: torch.dtype) -> float | None:
    """``softmax_scale`` if it is None (``1 / sqrt(headdim)``) or a finite number that the scores'
    dtype (q's, at least float32) holds."""
    if softmax_scale is None:
        return None
    softmax_scale = plain_number(softmax_scale)
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


def slopes_of(alibi_slopes: object, heads: int, rows: int, dtype: torch.dtype) -> Tensor:
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


def three_d(name: str, t: object, layout: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.ndim != 3:
        raise ValueError(f"{name} must be {layout}, got shape {shape_str(t.shape)}")
    return t


def descales(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_descale: object,
    k_descale: object,
    v_descale: object,
    names: tuple[str, str] = ("k_cache", "v_cache"),
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """flash-attn 3's float8 descale factors, each a float32 ``(B, Hkv)`` tensor or None: given
    for float8 inputs only (float8 keys and values default to 1). ``k`` and ``v`` are
    ``(B, T, Hkv, D)`` (or a cache's pages), named ``names`` in the errors."""
    batch, hkv = q.size(0), k.size(2)
    kn, vn = names
    if torch.int8 in (k.dtype, v.dtype):
        int8 = (
            "attnkit's KVCache or PagedKVCache(kv_dtype=torch.int8)"
            if kn == "k_cache"
            else "attnkit.attention(q, k, v, k_scale=..., v_scale=...)"
        )
        raise TypeError(
            f"{kn} and {vn} must be float, or float8 with k_descale/v_descale (as in "
            f"flash-attn 3), got {dtype_str(k.dtype)} and {dtype_str(v.dtype)}: int8 keys and "
            f"values with their scales go to {int8}"
        )
    quantized = k.dtype in FLOAT8
    if quantized != (v.dtype in FLOAT8) or (quantized and k.dtype != v.dtype):
        raise TypeError(
            f"{kn} and {vn} must share a float8 dtype or be float, got "
            f"{dtype_str(k.dtype)} and {dtype_str(v.dtype)}"
        )
    if q.dtype in FLOAT8 and not quantized and k.dtype != torch.bfloat16:
        raise TypeError(
            f"a float8 q is read in bfloat16 (q.float() * q_descale), so {kn} and {vn} must be "
            f"float8 or bfloat16, got q {dtype_str(q.dtype)} and {kn} {dtype_str(k.dtype)}"
        )
    found: list[Tensor | None] = []
    for name, d, given in (
        ("q_descale", q_descale, q.dtype in FLOAT8 or quantized),
        ("k_descale", k_descale, quantized),
        ("v_descale", v_descale, quantized),
    ):
        if d is None:
            one = torch.ones(batch, hkv, device=q.device) if given and name != "q_descale" else None
            found.append(one)
            continue
        if not given:
            raise TypeError(
                f"{name} is for a float8 {'cache' if kn == 'k_cache' else 'k and v'} "
                f"(torch.float8_e4m3fn, torch.float8_e5m2), got {kn} of {dtype_str(k.dtype)}"
            )
        if not isinstance(d, Tensor) or not d.is_floating_point() or d.dtype in FLOAT8:
            raise TypeError(f"{name} must be a float tensor (batch, nheads_k), got {d!r}")
        if d.shape != (batch, hkv) or d.device != q.device:
            raise ValueError(
                f"{name} must be (batch, nheads_k) = ({batch}, {hkv}) on {q.device}, got "
                f"{shape_str(d.shape)} on {d.device}"
            )
        found.append(d.float())
    return found[0], found[1], found[2]


def descaled_q(q: Tensor, q_descale: Tensor | None) -> Tensor:
    """``q (B, Tq, H, D)`` times its descale factors ``(B, Hkv)`` (each shared by the ``H /
    Hkv`` query heads of a key/value head); float8 queries in bfloat16."""
    fp8 = q.dtype in FLOAT8
    work = q.float() if fp8 else q
    if q_descale is not None:
        groups = q_descale.repeat_interleave(q.size(2) // q_descale.size(1), dim=1)  # (B, H)
        work = (work.float() * groups[:, None, :, None]).to(work.dtype)
    return work.to(torch.bfloat16) if fp8 else work
