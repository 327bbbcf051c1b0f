"""The ``flash_attn`` backend: the flash-attn package's kernels, where it is installed.

torch's own GPU kernels serve most calls, but none takes packed sequences: SDPA serves packed
documents one fused call per document, FlexAttention through a ``BlockMask``. flash-attn's
``flash_attn_varlen_func`` runs them as one kernel over ``cu_seqlens``, and its sliding windows
skip the keys outside them. A GPU user who has flash-attn installed gets it for those calls, and
``explain()`` says so; without it, nothing changes (never a dependency).

It serves, on NVIDIA GPUs from sm_80 and on AMD GPUs, in float16 and bfloat16, with head sizes up
to 256 (multiples of 8) and grouped-query heads: calls without a mask, with a band (causal,
bottom-right as flash-attn's; sliding windows) and packed documents (alone or with a band), with
softcap, dropout and ``return_lse``; and decode steps on a KV cache read where it lies
(``attention(q, view)``) through ``flash_attn_with_kvcache``. Everything else (a bias, a score
term or ``score_mod``, sinks, key padding, the weights) it declines, with the reason, and
``auto`` goes on to the next backend. It is in ``auto``'s order after ``sdpa`` (whose flash
kernel serves plain and causal calls) and before ``flex``.

``attnkit.flash_attn``'s stand-in for the package (``attnkit.flash_attn.install()``) is not the
package: calls never go round in a circle through it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import itertools
import math
import sys
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from .._base.devices import target
from .._call import AttentionCall
from ..caches.view import band_of
from ..masks import Mask
from .base import Backend, CallInputs, Output

__all__ = ["FlashAttnPackage", "flash_attn_installed", "package"]

_HALF = (torch.float16, torch.bfloat16)
_FUNCTIONS = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache")
#: flash-attn reads a paged cache in pages of a multiple of this many keys.
PAGE_MULTIPLE = 256


@functools.cache
def _importable() -> bool:
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


def package() -> ModuleType | None:
    """The flash-attn package, imported, or None: not installed, only attnkit's stand-in
    (``attnkit.flash_attn.install()``), or a module without flash-attn's functions."""
    found = sys.modules.get("flash_attn")
    if found is None:
        if not _importable():
            return None
        try:
            found = importlib.import_module("flash_attn")
        except ImportError:  # installed for another torch or CUDA: its extension fails to load
            return None
    if getattr(found, "__name__", "").startswith("attnkit"):
        return None
    if not all(callable(getattr(found, name, None)) for name in _FUNCTIONS):
        return None
    return found


def flash_attn_installed() -> bool:
    """Whether the flash-attn package is installed (attnkit's stand-in does not count), without
    importing it (``import attnkit`` does not load its CUDA extension; the first call it may serve
    does)."""
    found = sys.modules.get("flash_attn")
    if found is not None:
        return not getattr(found, "__name__", "").startswith("attnkit")
    return _importable()


def _window(band: tuple[float, float, str], q_len: int, kv_len: int) -> tuple[int, int] | None:
    """flash-attn's ``window_size`` for a band, ``-1`` for a side without bound; None where its
    bottom-right band cannot say it (top-left with ``Tq != Tk``, a band without the diagonal, or
    queries before the first key)."""
    lo, hi, align = band
    if (align != "bottom_right" and q_len != kv_len) or q_len > kv_len or lo > 0 or hi < 0:
        return None
    return (-1 if lo == -math.inf else int(-lo)), (-1 if hi == math.inf else int(hi))


def _shape(mask: Mask | None, q_len: int, kv_len: int) -> tuple[tuple[int, int], Any] | str:
    """``(window_size, document starts or None)`` of a mask flash-attn serves, or why not."""
    if mask is None:
        return (-1, -1), None
    bands = [p for p in mask.parts if p.band is not None] if mask.op == "and" else []
    others = [p for p in mask.parts if p not in bands] if mask.op == "and" else [mask]
    if mask.band is not None:
        bands, others = [mask], []
    if len(bands) > 1 or len(others) > 1:
        return f"{mask.describe()}: flash-attn takes one band and packed documents, no more"
    window = (-1, -1)
    if bands:
        found = _window(bands[0].band, q_len, kv_len)  # type: ignore[arg-type]
        if found is None:
            return f"{bands[0].describe()}: not a band flash-attn's bottom-right windows say"
        window = found
    if not others:
        return window, None
    starts = others[0].document_starts() if q_len == kv_len else None
    if starts is None:
        return (
            f"{mask.describe()}: flash-attn serves no mask but bands and packed documents "
            "(sdpa takes key padding, flex any mask)"
        )
    return window, starts


def _bounds(lo: float, hi: float) -> tuple[int, int]:
    """flash-attn's ``window_size`` of a band of distances ``lo <= j - p_i <= hi``."""
    return (-1 if lo == -math.inf else int(-lo)), (-1 if hi == math.inf else int(hi))


def _cache_refusal(call: AttentionCall) -> str | None:
    """Why ``flash_attn_with_kvcache`` cannot read a call's cache where it lies (None: it can)."""
    view = call.cache
    if view is None:
        return None
    if view.quantized:  # (its scales per token and page are not flash-attn's per-row descale)
        return "reads no int8/float8 cache view (chunked reads it in place, reference dequantizes)"
    band = band_of(call.mask)
    if band is None or band[0] > 0 or band[1] < 0:
        return "flash_attn_with_kvcache takes a band holding each query's own position"
    if call.requires_grad or call.dropout_p:
        return "flash_attn_with_kvcache has no backward and no dropout"
    if view.q_lens is not None:
        return "flash_attn_with_kvcache takes no padding queries (the view's q_lens)"
    if view.block_table is not None and view.page_size % PAGE_MULTIPLE:
        return f"flash-attn reads pages of a multiple of {PAGE_MULTIPLE} keys, not {view.page_size}"
    if view.block_table is not None and any(start for start, _ in view.kv_range):
        return "flash-attn reads a paged cache's rows from their first key"
    return None


class FlashAttnPackage(Backend):
    """The flash-attn package's kernels as a backend (see :mod:`attnkit.backends.flash_package`).

    It reads a KV cache where it lies (``attention(q, view)``) through
    ``flash_attn_with_kvcache``: a contiguous cache, or pages of a multiple of 256 keys through a
    block table."""

    accepts_cache = True

    def __init__(self) -> None:
        super().__init__("flash_attn")

    def check(self, call: AttentionCall) -> list[str]:
        reasons = []
        if package() is None:
            reasons.append("the flash-attn package is not installed")
        device = target(call.device)
        cap = device.capability
        if device.vendor != "amd" and (device.vendor != "nvidia" or cap is None or cap < (8, 0)):
            reasons.append(
                f"flash-attn runs on NVIDIA GPUs from sm_80 and AMD GPUs, not {call.device}"
            )
        if call.dtype not in _HALF:
            reasons.append(f"flash-attn takes float16/bfloat16, not {str(call.dtype)[6:]}")
        if call.qk_dim != call.v_dim or call.qk_dim > 256 or call.qk_dim % 8:
            reasons.append(
                f"flash-attn takes one head size up to 256, a multiple of 8, not Dk={call.qk_dim}, "
                f"Dv={call.v_dim}"
            )
        if call.cache is not None:
            refused = _cache_refusal(call)
            reasons += [refused] if refused is not None else []
        elif not torch.compiler.is_compiling():
            shape = _shape(call.mask, call.q_len, call.kv_len)
            reasons += [shape] if isinstance(shape, str) else []
        if torch.compiler.is_compiling():
            reasons.append("torch.compile/export is tracing (the documents' starts are read)")
        added = call.bias_shape is not None or call.score_term is not None
        if added or call.score_mod is not None:
            reasons.append("flash-attn adds nothing to the scores but a softcap")
        if call.sinks:
            reasons.append("flash-attn's kernels have no sinks")
        if call.return_weights:
            reasons.append("does not return attention weights (only reference does)")
        if call.forward_ad:
            reasons.append("computes no forward-mode derivative (reference does)")
        if call.finite is False:
            reasons.append(
                "q, k or v hold NaN/inf: flash-attn's backward would let masked ones into the "
                "gradients"
            )
        return reasons

    def notes(self, call: AttentionCall) -> list[str]:
        band = band_of(call.mask)
        if call.cache is not None and band is not None:
            return [
                f"flash_attn_with_kvcache, window_size={_bounds(*band)}, the cache read in place"
            ]
        shape = _shape(call.mask, call.q_len, call.kv_len)
        if isinstance(shape, str):
            return []
        window, starts = shape
        if starts is None:
            return [f"flash_attn_func, window_size={window}"]
        batch = math.prod(call.batch_shape)
        rows = starts if len(starts) == batch else starts * batch  # one row: every row's
        n = sum(sum(b > a for a, b in itertools.pairwise(row)) for row in rows)
        return [f"flash_attn_varlen_func over {n} packed sequences, window_size={window}"]

    def run(self, call: AttentionCall, inputs: CallInputs) -> Output:
        if call.cache is not None:
            return _kvcache(call, inputs)
        pkg = package()
        shape = _shape(call.mask, call.q_len, call.kv_len)
        if pkg is None or isinstance(shape, str):
            raise RuntimeError(
                f"attnkit internal error: flash_attn ran a call it declines ({shape})"
            )
        window, starts = shape
        batch = math.prod(call.batch_shape)
        q, k, v = (
            t.reshape(batch, *t.shape[-3:]).transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v)
        )
        causal = window == (-1, 0)
        common: dict[str, Any] = {
            "dropout_p": call.dropout_p,
            "softmax_scale": call.scale,
            "causal": causal,
            "window_size": (-1, -1) if causal else window,
            "softcap": call.softcap or 0.0,
            "return_attn_probs": call.return_lse,
        }
        if starts is None:
            result = pkg.flash_attn_func(q, k, v, **common)
            out: Tensor = result[0] if call.return_lse else result
            lse: Tensor | None = result[1] if call.return_lse else None
        else:
            out, lse = _varlen(pkg, q, k, v, starts, common, call.return_lse)
        out = out.transpose(1, 2).reshape(*call.batch_shape, call.num_heads, call.q_len, call.v_dim)
        if lse is None:
            return out
        return out, _no_key_lse(out, lse.reshape(*call.batch_shape, call.num_heads, call.q_len))


def _varlen(
    pkg: ModuleType,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    starts: list[list[int]],
    common: dict[str, Any],
    want_lse: bool,
) -> tuple[Tensor, Tensor | None]:
    """Packed documents as flash-attn's variable-length call: each batch row's documents one
    after another, ``cu_seqlens`` their bounds in the rows laid end to end."""
    batch, length = q.size(0), q.size(1)
    rows = starts if len(starts) == batch else starts * batch
    bounds = sorted({r * length + s for r, row in enumerate(rows) for s in row})
    cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    longest = max(b - a for a, b in itertools.pairwise(bounds)) if len(bounds) > 1 else 0
    flat = [t.reshape(batch * length, *t.shape[2:]) for t in (q, k, v)]
    result = pkg.flash_attn_varlen_func(*flat, cu, cu, longest, longest, **common)
    out: Tensor = result[0] if want_lse else result
    lse: Tensor | None = result[1] if want_lse else None
    out = out.reshape(batch, length, *out.shape[1:])
    if lse is not None:  # (H, total) -> (B, H, T)
        lse = lse.reshape(lse.size(0), batch, length).transpose(0, 1)
    return out, lse


def _no_key_lse(out: Tensor, lse: Tensor) -> Tensor:
    """flash-attn's log-sum-exp ``(..., H, Tq)`` in attnkit's convention: flash-attn writes
    ``+inf`` for a query that sees no key (its output row 0), attnkit ``-inf`` (no weight, as
    :func:`attnkit.merge_attention` reads it). A row whose scores hold NaN or inf has ``+inf``
    too, but its output is not 0, and keeps it."""
    empty = (lse == math.inf) & (out == 0).all(-1)
    return lse.masked_fill(empty, -math.inf)


def _kvcache(call: AttentionCall, inputs: CallInputs) -> Output:
    """A call on a cache view as ``flash_attn_with_kvcache``: each row's queries against its
    keys ``start <= j < end`` (``cache_leftpad``, ``cache_seqlens``), aligned to their end as
    attnkit's, pages through the view's block table."""
    pkg, view, band = package(), call.cache, band_of(call.mask)
    if pkg is None or view is None or band is None or _cache_refusal(call) is not None:
        raise RuntimeError("attnkit internal error: flash_attn ran a cache call it declines")
    device = inputs.q.device
    ends = torch.tensor([e for _, e in view.kv_range], dtype=torch.int32, device=device)
    starts = [s for s, _ in view.kv_range]
    window = _bounds(*band)
    causal = window == (-1, 0)
    table = None if view.block_table is None else view.block_table.to(device, torch.int32)
    leftpad = torch.tensor(starts, dtype=torch.int32, device=device) if any(starts) else None
    result = pkg.flash_attn_with_kvcache(
        inputs.q.transpose(1, 2),  # (N, Tq, H, D)
        inputs.k.transpose(1, 2),  # pages (X, page, Hkv, D), as flash-attn lays them
        inputs.v.transpose(1, 2),
        cache_seqlens=ends,
        cache_leftpad=leftpad,
        block_table=table,
        softmax_scale=call.scale,
        causal=causal,
        window_size=(-1, -1) if causal else window,
        softcap=call.softcap or 0.0,
        return_softmax_lse=call.return_lse,
    )
    out: Tensor = (result[0] if call.return_lse else result).transpose(1, 2)
    return (out, _no_key_lse(out, result[1])) if call.return_lse else out
