"""The sdpa backend: torch's fused ``scaled_dot_product_attention``.

torch picks its own kernel (flash, memory-efficient, cuDNN or math) for the device and inputs; this
adapter translates attnkit's conventions, which differ from torch's in three places:

* attnkit's causal alignment is bottom-right and torch's ``is_causal`` top-left (they agree when
  ``Tq == Tk``), and torch refuses ``is_causal`` together with a mask: such calls, and every
  structured mask other than key padding, need a bool mask written out, a cost
  (:func:`sdpa_cost`) that ``auto`` avoids where another backend has none.
* attnkit's ``bias`` is torch's float ``attn_mask``; with a mask as well, the two are merged.
* A :class:`~attnkit.scores.ScoreTerm` (no gradients) is served one block of queries at a time,
  with the block's term, bias and mask as the float ``attn_mask`` of one fused call: memory
  O(B * H * block * Tk).

torch's kernels do not follow attnkit's non-finite policy by themselves (a NaN in a masked key
reaches the output; a query whose scores are all NaN gets 0). So, outside torch.compile, the
backend looks at its output, one small reduction over ``(..., H, Tq)``: if it holds NaN/inf, or a
query whose row is not empty got exactly 0, the call is handed over to the backend registered as
``chunked`` (attnkit's kernel), which applies the policy exactly. Calls that need gradients are
not given to this backend at all when their inputs hold NaN/inf (torch's backward would let
masked ones into the gradients).
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .._call import AttentionCall
from .._checks import check_int, dim_str, shape_str
from .._kernel import make_plan, no_autocast
from .._native.kernel import BF16_DOT, MATRIX_UNIT, cpu_has
from ..masks import Geometry, Mask
from ..scores import ScoreTerm
from .base import Backend, CallInputs

__all__ = ["SDPA", "sdpa_check", "sdpa_cost", "sdpa_slower"]

#: The registered name of the backend a call goes to when torch's output breaks the policy.
EXACT = "chunked"

#: The dtypes in which torch's CPU backward is its slow half.
_CPU_SLOW_BACKWARD = (torch.float32, torch.float64)

# Inference on CPUs in float32/float64: from how many scores (B * H * Tq * Tk) torch's CPU
# forward takes longer than a blocked kernel's (attnkit's native kernel: 0.94x torch's time at
# B=1 H=8 T=96, 0.74x at T=128, 0.4-0.67x from T=256 on, one thread; the measurements are in the
# inference guide), and, for a decode step of at most _DECODE_QUERIES queries, from how many
# bytes of keys and values (torch reads a key/value head's cache once per query head of its
# group, and its per-call cost is smaller: 0.87x at 16 MiB, even at 8 MiB, 2.3x at 2 MiB).
_CPU_FORWARD_SCORES = 8 * 128 * 128
_CPU_DECODE_BYTES = 8 << 20
# bfloat16/float16 inference (the native kernel reads their keys and values as they are and computes
# in float32; the measurements are in the inference guide): decode steps from 1 MiB of keys and
# values (torch's CPU kernel reads each key/value head once per query head: 0.53x its time in
# bfloat16 and 0.32x in float16 at 1 MiB, 1.86x and 0.97x at 0.25 MiB, one thread), and float16
# calls from _CPU_FORWARD_SCORES scores (torch's float16 CPU forward is slower than its float32
# one: 0.55x at T=128, 0.65x at T=4096 causal). bfloat16 prefill stays with torch: without
# bfloat16 products in the vector unit the native kernel runs it at its float32 speed, which torch's
# bfloat16 kernel matches (1.04x at T=4096 causal, 1.2-2.4x below T=256).
# On CPUs whose matrix unit multiplies bfloat16 (AMX-BF16) or float16 (AMX-FP16), which torch's
# kernels use, only the decode rule holds (it is about memory traffic, not products).
# Training in bfloat16/float16 goes to the native kernel on CPUs without that unit: torch's
# CPU backward is its slow half there (fwd+bwd at T=4096 causal: the native kernel 0.16x torch's
# time in bfloat16, 0.09x in float16, AVX2; 0.53x in bfloat16 with AVX512-BF16); bfloat16
# training also on CPUs with AMX, where the native kernel runs both passes' products on the
# matrix unit (see _matrix_unit).
_CPU_DECODE_BYTES_REDUCED = 1 << 20
_REDUCED = (torch.bfloat16, torch.float16)
# On CPUs with AMX (Intel's Xeons from Sapphire Rapids on, with AVX512-BF16 and AVX512-FP16)
# torch's CPU kernels are fast in every dtype, and the rules above do not hold (measured side by
# side on a 2-core Intel Xeon with AMX-BF16; the figures are in the inference guide). A decode
# step goes to the native kernel only when query heads share key/value heads (torch reads a
# shared head's cache once per query head) and from 16 MiB of keys and values: 0.45-0.52x
# torch's time in float32 from 32 MiB, 0.52-0.77x in bfloat16 from 16 MiB, two threads; with one
# query head per key/value head torch reads each cache once and is faster (1.4-1.9x at 16-32 MiB,
# even at 128-256 MiB), as it is below 8 MiB (1.0-6.9x). Prefill without a mask stays with torch
# in float32 (the native kernel took 1.2-1.5x its time at T=128-256, one thread) and in float16
# (1.3-1.6x at T=128-256, 1.13x at T=4096 causal).
_CPU_DECODE_BYTES_GROUPED = 16 << 20
# On CPUs with AVX512-BF16 but no AMX (measured on a 2-core AMD EPYC, Zen 4; the figures are in
# the inference guide) torch's float32 kernels are as fast as there, its bfloat16 and float16 ones
# not: float32 follows the rules of CPUs with AMX, but for grouped decode steps, from 4 MiB, and
# for calls without a mask (_CPU_UNMASKED_SCORES_DOT);
# bfloat16 and float16 follow the rules of CPUs without bfloat16 products, and bfloat16 prefill
# goes to the native kernel from _CPU_FORWARD_SCORES scores, where its products run as
# AVX512-BF16's dot products.
_CPU_DECODE_BYTES_GROUPED_DOT = 4 << 20
# There, float32 and float64 calls without a mask go to the native kernel from this many scores,
# where its register tiles outrun torch's BLAS calls (float32, B=1 H=8 D=64: 0.92-0.94x torch's
# time at T=768-2048 with one thread and with two, 0.71-0.90x at T=4096, 0.86-0.95x at 8192; 1.01-
# 1.09x at T=256-512; float64 even, 0.95-1.0x at T=512-2048). On CPUs with AMX torch keeps them.
_CPU_UNMASKED_SCORES_DOT = 8 * 768 * 768


# What the CPU multiplies on its matrix unit, read once at import: the checks are not traceable
# by torch.compile, and a compiled call consults them while it is traced.
_CPU_PRODUCTS = {
    torch.bfloat16: MATRIX_UNIT,
    torch.float16: cpu_has("_is_amx_fp16_supported"),
}


def _products_in(dtype: torch.dtype) -> bool:
    """Whether torch's CPU kernels multiply ``dtype`` (bfloat16 or float16) on the CPU's matrix
    unit (AMX), where they are fast in it."""
    return _CPU_PRODUCTS.get(dtype, False)


def _matrix_unit() -> bool:
    """Whether this CPU has AMX tiles, where the native kernel runs bfloat16 products on the
    matrix unit (see _CPU_MATRIX_PREFILL_LENGTH and _CPU_MATRIX_TRAIN_SCORES)."""
    return MATRIX_UNIT


def _bf16_dot() -> bool:
    """Whether this CPU has AVX512-BF16 but no AMX, where the native kernel runs bfloat16
    products as AVX512-BF16's dot products (see _CPU_DECODE_BYTES_GROUPED_DOT)."""
    return BF16_DOT and not MATRIX_UNIT


# bfloat16 inference on CPUs with AMX goes to the native kernel from this many queries and keys,
# for heads whose widths are multiples of 32 (whose products it runs in the unit's tiles): it took
# 0.70-0.72x torch's time causal at T=1024-2048 and 0.93x unmasked at T=1024 (B=1 H=8 D=64, one
# thread), 0.84-0.86x and 0.85-0.97x with two; below, torch's per-call costs are smaller (T=512:
# 0.9-1.03x causal, 1.18-1.38x unmasked; T=256: 1.3-1.5x).
_CPU_MATRIX_PREFILL_LENGTH = 1024
# bfloat16 training on CPUs with AMX goes to the native kernel from this many scores (B * H * Tq
# * Tk): forward and backward took 0.56-0.94x torch's time from B=4 T=512 on and 0.98-1.04x at
# T=256, where torch's per-call costs are smaller (H=8 D=64, two threads; bench_training.py
# --dtype bfloat16).
_CPU_MATRIX_TRAIN_SCORES = 4 * 8 * 512 * 512


def _scores(call: AttentionCall) -> int:
    """The scores a call computes, B * H * Tq * Tk (a mask's holes included)."""
    return math.prod(call.batch_shape) * call.num_heads * call.q_len * call.kv_len


def _fast_torch_cpu() -> bool:
    """Whether this CPU has AVX512-BF16 (with AMX or without), where torch's float32 CPU kernels
    are fast (see _CPU_DECODE_BYTES_GROUPED and _CPU_DECODE_BYTES_GROUPED_DOT)."""
    return _matrix_unit() or _bf16_dot()


def _grouped_decode(call: AttentionCall, size: int) -> list[str]:
    """On such CPUs, why torch decodes slower: the step reads enough of shared key/value heads'
    caches (``size`` bytes) for the native kernel's single read of each to beat torch's one read
    per query head; else nothing."""
    least, cpus = _CPU_DECODE_BYTES_GROUPED, "CPUs with AMX"
    if not _matrix_unit():
        least, cpus = _CPU_DECODE_BYTES_GROUPED_DOT, "CPUs with AVX512-BF16 and no AMX"
    if call.num_heads == call.num_kv_heads or size < least:
        return []
    name = "" if call.dtype not in _REDUCED else str(call.dtype).removeprefix("torch.") + " "
    return [
        f"decodes slower on CPUs: {size / 2**20:.0f} MiB of {name}keys and values shared by "
        f"{call.num_heads // call.num_kv_heads} query heads each, which torch reads once per "
        f"query head and the native kernel once (from {least >> 20} MiB on {cpus})"
    ]


@functools.cache
def _register_tiles() -> bool:
    """Whether this CPU has AVX-512, where a blocked kernel computes its products in register
    tiles (elsewhere it calls the BLAS per block, as torch's CPU forward does)."""
    try:
        return torch.backends.cpu.get_cpu_capability() == "AVX512"
    except (AttributeError, RuntimeError):
        return False


_DECODE_QUERIES = 16

# A score term's tiles are asked for this many keys at a time: a term that computes a product per
# tile (relative positions over long inputs) then keeps it in the CPU's caches.
TERM_KEYS = 1024


def _batched(t: Tensor, batch: tuple[int, ...]) -> Tensor:
    """``(B|1, ...)`` with the batch dims flattened -> ``(*batch|1, ...)``."""
    if t.size(0) == 1:
        return t.reshape(*(1,) * len(batch), *t.shape[1:])
    return t.reshape(*batch, *t.shape[1:])


def _is_causal(call_q: int, call_k: int, mask: Mask | None, has_bias: bool) -> bool | None:
    """True: torch's ``is_causal`` serves the mask; False: no mask at all; None: write it out."""
    if mask is None:
        return False
    band = mask.band
    if band is not None and band[:2] == (-math.inf, 0) and not has_bias:
        if band[2] == "top_left":  # torch's own alignment
            return True
        if call_q <= 1:  # one query, bottom-right: it sees every key
            return False
        if call_q == call_k:
            return True
    return None


# Packed documents go to torch one document at a time (as variable-length kernels do) when they
# are long enough for a call per document to cost less than the blocked kernel. The cuts come from
# the mask's document starts, not from a BlockPlan: a plan is block-granular, a cut must be exact.
MIN_DOCUMENT_MEAN = 128


def _documents(mask: Mask | None, q_len: int, kv_len: int) -> tuple[list[list[int]], bool] | None:
    """``(bounds, causal)`` when the mask is packed documents (alone or with causal) that torch can
    serve one document at a time: per batch row (one row when all rows share them) the positions
    where documents start, then ``Tk``; ``causal`` whether each document is causal inside. None for
    any other mask, for ``Tq != Tk``, for documents whose ids are not contiguous runs, and for
    documents shorter than ``MIN_DOCUMENT_MEAN`` on average."""
    if mask is None or q_len != kv_len or not kv_len:
        return None
    parts = mask.parts if mask.op == "and" else (mask,)
    causal = [p for p in parts if p.band is not None and p.band[:2] == (-math.inf, 0)]
    if len(parts) - len(causal) != 1:
        return None
    bounds = next(p for p in parts if p not in causal).document_starts()
    if bounds is None or kv_len < MIN_DOCUMENT_MEAN * max(len(b) - 1 for b in bounds):
        return None
    return bounds, bool(causal)


def _per_document(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bounds: list[list[int]],
    causal: bool,
    scale: float,
    dropout_p: float,
) -> Tensor:
    """One fused call per document of each batch row, the outputs joined along the queries."""
    gqa = q.size(-3) != k.size(-3)

    def row(q: Tensor, k: Tensor, v: Tensor, cuts: list[int]) -> Tensor:
        pieces = []
        for a, b in itertools.pairwise(cuts):
            if b > a:
                pieces.append(
                    F.scaled_dot_product_attention(
                        q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], dropout_p=dropout_p,
                        is_causal=causal, scale=scale, enable_gqa=gqa,
                    )
                )  # fmt: skip
        return torch.cat(pieces, -2)

    if len(bounds) == 1:
        return row(q, k, v, bounds[0])
    batch = q.shape[:-3]
    q3, k3, v3 = (t.reshape(-1, *t.shape[-3:]) for t in (q, k, v))
    out = torch.stack([row(q3[b], k3[b], v3[b], bounds[b]) for b in range(len(bounds))])
    return out.reshape(*batch, *out.shape[-3:])


def _cheap_mask(mask: Mask) -> bool:
    """The mask's dense form costs nothing new: a tensor given as is, or key padding."""
    return mask.tensor is not None or mask.keys_only


def sdpa_check(call: AttentionCall) -> list[str]:
    """Why torch's SDPA cannot serve a call (empty when it can)."""
    reasons = []
    if call.return_weights:
        reasons.append("does not return attention weights (only reference does)")
    if call.return_lse:
        reasons.append("torch's SDPA returns no log-sum-exp (chunked and reference do)")
    if call.softcap is not None:
        reasons.append("torch's kernel has no softcap")
    if call.sinks:
        reasons.append("torch's kernel has no sinks")
    if call.forward_ad:
        reasons.append(
            "torch's fused kernels compute no forward-mode derivative (torch.func.jvp, "
            "torch.autograd.forward_ad): reference does"
        )
    if call.score_term is not None:
        if torch.compiler.is_compiling():
            reasons.append(
                "torch.compile/export is tracing: its loop over blocks of queries would unroll "
                "per block"
            )
        if call.requires_grad:
            reasons.append(
                "serves a score term only without gradients (torch would keep each block's "
                "probabilities for the backward); use torch.no_grad() or inference_mode()"
            )
        if call.dtype in (torch.float16, torch.bfloat16):
            reasons.append(
                f"its float mask would round the score term to {str(call.dtype)[6:]}; chunked "
                "keeps it in float32"
            )
    if call.finite is False and call.requires_grad:
        reasons.append(
            "q, k or v hold NaN/inf and gradients are needed: torch's backward would let masked "
            "ones into the gradients"
        )
    return reasons


def sdpa_cost(call: AttentionCall) -> list[str]:
    """Why ``auto`` should prefer another backend although torch's SDPA could serve the call."""
    costs = []
    mask = call.mask
    if (
        mask is not None
        and call.score_term is None
        and _is_causal(call.q_len, call.kv_len, mask, call.bias_shape is not None) is None
        and not _cheap_mask(mask)
        and (call.bias_shape is not None or _documents(mask, call.q_len, call.kv_len) is None)
    ):
        size = shape_str((call.q_len, call.kv_len))
        if call.causal and call.q_len != call.kv_len:
            why = (
                f"a (Tq, Tk) = {size} causal mask: Tq != Tk ({dim_str(call.q_len)} != "
                f"{dim_str(call.kv_len)}) and torch's is_causal is top-left aligned"
            )
        elif call.causal:
            why = (
                f"a (Tq, Tk) = {size} causal mask: torch does not take is_causal together with "
                "a mask or bias"
            )
        else:
            why = f"the mask {mask!r} as a (Tq, Tk) = {size} tensor"
        costs.append(f"would materialise {why}")
    if call.bias_requires_grad and call.score_term is None:
        costs.append(
            f"would keep the probabilities (..., H, Tq, Tk) = {shape_str(call.scores_shape)} for "
            "the backward: torch computes a bias gradient only in its math kernel"
        )
    return costs


def sdpa_slower(call: AttentionCall) -> list[str]:
    """The slow paths torch's SDPA would take for a call it can serve."""
    slow = []
    term = call.score_term
    if term is not None:
        slow.append(
            f"would add the {term.describe()} beside torch's kernel, one fused call per block of "
            "queries with the block's term written out"
        )
    if call.requires_grad and call.device.type == "cpu" and call.dtype in _CPU_SLOW_BACKWARD:
        # A training step spends most of its attention time in the backward, and torch's CPU
        # backward is its slow half in float32/float64.
        slow.append(
            "trains slower on CPUs: torch's CPU backward is its slow half in float32/float64"
        )
    elif (
        call.requires_grad
        and call.device.type == "cpu"
        and call.dtype in _REDUCED
        and not _products_in(call.dtype)
    ):
        name = str(call.dtype).removeprefix("torch.")
        slow.append(
            f"trains slower on CPUs: torch's CPU backward is its slow half in {name} on CPUs "
            f"without a matrix unit for {name} (1.9-11x the native kernel's training step at "
            f"T=4096)"
        )
    elif (
        call.requires_grad
        and call.device.type == "cpu"
        and call.dtype == torch.bfloat16
        and _matrix_unit()
        and _scores(call) >= _CPU_MATRIX_TRAIN_SCORES
    ):
        slow.append(
            f"trains slower on CPUs with a matrix unit (AMX): the native kernel runs a bfloat16 "
            f"training step's products there too (0.56-0.94x torch's time from "
            f"{_CPU_MATRIX_TRAIN_SCORES} scores on)"
        )
    elif call.device.type == "cpu" and call.dtype in _CPU_SLOW_BACKWARD:
        slow += _slow_forward(call)
    elif call.device.type == "cpu" and call.dtype in _REDUCED and not call.requires_grad:
        slow += _slow_reduced_inference(call)
    return slow


def _decode_bytes(call: AttentionCall) -> int:
    """The bytes of keys and values a call reads."""
    batch = math.prod(call.batch_shape)
    size = batch * call.num_kv_heads * call.kv_len * (call.qk_dim + call.v_dim)
    return size * call.dtype.itemsize


def _slow_reduced_inference(call: AttentionCall) -> list[str]:
    """Why torch's CPU forward serves a bfloat16/float16 inference call slower than the native
    kernel (see _CPU_DECODE_BYTES_REDUCED), or nothing."""
    name = str(call.dtype).removeprefix("torch.")
    if call.q_len > _DECODE_QUERIES:
        if (
            call.dtype == torch.bfloat16
            and _matrix_unit()
            and min(call.q_len, call.kv_len) >= _CPU_MATRIX_PREFILL_LENGTH
            and call.qk_dim % 32 == 0
            and call.v_dim % 32 == 0
        ):
            return [
                f"runs slower on CPUs with a matrix unit (AMX) from "
                f"{_CPU_MATRIX_PREFILL_LENGTH} queries and keys: the native kernel runs a "
                f"bfloat16 forward's products in the unit's tiles (0.7-0.97x torch's time; heads "
                f"whose widths are multiples of 32)"
            ]
        scores = _scores(call)
        if (
            call.dtype == torch.bfloat16
            and _bf16_dot()
            and scores >= _CPU_FORWARD_SCORES
            and call.qk_dim % 2 == 0
        ):
            return [
                f"runs slower on CPUs with AVX512-BF16 and no AMX at this size: {scores} scores, "
                f"where the native kernel runs a bfloat16 forward's products as AVX512-BF16's dot "
                f"products (0.36-0.85x torch's time; bfloat16 from {_CPU_FORWARD_SCORES} on)"
            ]
        if (
            call.dtype == torch.float16
            and scores >= _CPU_FORWARD_SCORES
            and not _products_in(torch.float16)
            and not _matrix_unit()
        ):
            return [
                f"runs slower on CPUs at this size: {scores} scores, where torch's float16 CPU "
                f"forward takes 1.5-3.3x the native kernel's time (float16 from "
                f"{_CPU_FORWARD_SCORES} on)"
            ]
        return []
    size = _decode_bytes(call)
    # (float16 on a CPU with AMX-BF16 only: torch's float16 decode is as slow as on any CPU
    # without float16 products, 0.36-0.74x the native kernel's time at 2-8 MiB)
    if _products_in(call.dtype):
        return _grouped_decode(call, size)
    if size < _CPU_DECODE_BYTES_REDUCED:
        return []
    return [
        f"decodes slower on CPUs: {size / 2**20:.0f} MiB of {name} keys and values, which torch "
        f"reads once per query head and the native kernel once, converting them in registers "
        f"(bfloat16/float16 from {_CPU_DECODE_BYTES_REDUCED >> 20} MiB on)"
    ]


def _slow_forward(call: AttentionCall) -> list[str]:
    """Why torch's CPU forward serves an inference call in float32/float64 slower than a blocked
    kernel (see _CPU_FORWARD_SCORES), or nothing."""
    if call.q_len <= _DECODE_QUERIES:
        size = _decode_bytes(call)
        if _fast_torch_cpu():
            return _grouped_decode(call, size)
        if size >= _CPU_DECODE_BYTES:
            return [
                f"decodes slower on CPUs: {size / 2**20:.0f} MiB of keys and values, which "
                f"torch reads once per query head (float32/float64 from "
                f"{_CPU_DECODE_BYTES >> 20} MiB on)"
            ]
        return []
    scores = _scores(call)
    if call.mask is None and _register_tiles() and _bf16_dot():
        if scores < _CPU_UNMASKED_SCORES_DOT:
            return []
        return [
            f"runs slower on CPUs with AVX512-BF16 and no AMX at this size: {scores} scores "
            f"without a mask, where the native kernel's register tiles take 0.71-0.94x torch's "
            f"float32 time (float32/float64 from {_CPU_UNMASKED_SCORES_DOT} on)"
        ]
    if call.mask is None and (not _register_tiles() or _fast_torch_cpu()):
        # Nothing to skip, and the BLAS per block: torch's forward is as fast (a blocked kernel
        # without AVX-512 took 0.97-1.37x its time at B=1 H=8 T=256-4096, float32, two threads;
        # with AMX, see _CPU_DECODE_BYTES_GROUPED).
        return []
    if scores >= _CPU_FORWARD_SCORES:
        return [
            f"runs slower on CPUs at this size: {scores} scores, where torch's CPU forward takes "
            f"1.3-2.5x a blocked kernel's time (float32/float64 from {_CPU_FORWARD_SCORES} on)"
        ]
    return []


def _empty_rows(mask: Tensor | None, attn_mask: Tensor | None) -> Tensor | None:
    """Bool ``(..., Tq, 1)`` rows with no key they may attend, or None when there are none."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        return ~attn_mask.any(-1, keepdim=True)
    return (attn_mask == float("-inf")).all(-1, keepdim=True)


_SCREEN_WEIGHTS: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}
# Outputs of up to this many rows are screened in float32 (see _screened).
_SCREEN_WIDENED_ROWS = 4096


def _screened(out: Tensor) -> bool:
    """A fast sufficient test: True when no row holds NaN or inf and no row is all zeros.

    Each row's dot product with a fixed vector of non-zero weights is one matrix-vector product
    (per-row reductions cost several times more, and a decode step reads back a few numbers
    instead of two reductions' results): a non-finite row gives a non-finite product, a zero row
    gives 0. A product that is 0 or overflows for a finite, non-zero row is a false alarm, which
    only sends the caller to the exact test."""
    d = out.size(-1)
    if out.is_contiguous():
        rows = out.view(-1, d)
    elif out.ndim >= 3 and out.transpose(-3, -2).is_contiguous():  # torch's (B, T, H, D) layout
        rows = out.transpose(-3, -2).view(-1, d)
    else:
        return False
    if rows.size(0) <= _SCREEN_WIDENED_ROWS and out.dtype in _REDUCED and out.device.type == "cpu":
        # A bfloat16/float16 product right after torch's CPU attention was measured at about a
        # millisecond per decode step on a CPU with AMX, a few microseconds in float32.
        rows = rows.float()
    key = (d, rows.dtype, rows.device)
    weights = _SCREEN_WEIGHTS.get(key)
    if weights is None:
        g = torch.Generator().manual_seed(0)
        w = torch.rand(d, generator=g, dtype=torch.float64).add_(0.5)  # in [0.5, 1.5): never 0
        w = w * torch.where(torch.arange(d) % 2 == 0, 1.0, -1.0).double()
        weights = _SCREEN_WEIGHTS.setdefault(key, w.to(rows.device, rows.dtype))
    products = torch.mv(rows, weights)
    if products.numel() <= 256:  # a decode step: one read of a few numbers
        values = products.tolist()
        return 0.0 not in values and math.isfinite(sum(values))  # a NaN or inf makes the sum one
    low, high = torch.aminmax(products.abs_())
    return bool(low.item() > 0) and math.isfinite(high.item())


def _explained_by_values(
    peaks: Tensor, q: Tensor, k: Tensor, v: Tensor, dropout: bool = False
) -> Tensor:
    """Bool like ``peaks`` ``(..., H, Tq)``: rows whose zero output the inputs explain, when the
    row's query and its head's keys are finite (torch gives 0 for a row of NaN scores too, which
    attnkit's policy makes NaN): its head's values are all 0, or, with dropout, every weight of
    the row was dropped (a legitimate draw, which must not be redrawn)."""
    hkv = k.size(-3)
    finite_k = torch.isfinite(k).flatten(-2).all(-1)  # (..., Hkv)
    head_ok = finite_k if dropout else finite_k & (v == 0).flatten(-2).all(-1)
    head_ok = head_ok.repeat_interleave(q.size(-3) // hkv, dim=-1)  # (..., H)
    return head_ok.unsqueeze(-1) & torch.isfinite(q).all(-1)  # (..., H, Tq)


def _trustworthy(
    out: Tensor,
    attn_mask: Tensor | None,
    empty: Tensor | None = None,
    qkv: tuple[Tensor, Tensor, Tensor] | None = None,
    dropout: bool = False,
) -> bool:
    """Whether torch's output follows attnkit's rules: no NaN/inf, and exact zeros only in the rows
    that have no visible key (``empty``, or the rows ``attn_mask`` hides whole) or whose head's
    values are all zero (``qkv`` given). A few small reductions in the common case (a decode
    step's cost). On the meta device there are no values to screen: a shape is all it says."""
    if not out.numel() or out.device.type == "meta":
        return True
    if _screened(out):
        return True
    # (..., H, Tq) largest magnitude per row: NaN and inf show, and so does a row of zeros.
    peaks = out.abs().amax(-1)
    low, high = torch.aminmax(peaks)
    if not math.isfinite(high.item()):
        return False
    if low.item() > 0:
        return True
    if empty is None:
        empty = _empty_rows(None, attn_mask)
        empty = None if empty is None else empty.squeeze(-1)
    explained = torch.zeros((), dtype=torch.bool, device=out.device)
    if empty is not None:
        explained = explained | empty
    if qkv is not None:
        explained = explained | _explained_by_values(peaks, *qkv, dropout=dropout)
    # A zero row nothing explains: torch hid a NaN.
    return bool(((peaks == 0) <= explained.expand_as(peaks)).all())


def _plain(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None,
    bias: Tensor | None,
    scale: float,
    dropout_p: float,
) -> tuple[Tensor, Tensor | None]:
    """One fused call; returns the output and the float/bool mask torch saw."""
    batch = tuple(q.shape[:-3])
    h, tq, _ = q.shape[-3:]
    tk = k.size(-2)
    is_causal = False
    attn_mask: Tensor | None = None
    causal = _is_causal(tq, tk, mask, bias is not None)
    if causal is None and mask is not None:
        geo = Geometry(batch, h, tq, tk, q.device)
        attn_mask = _batched(mask.tile(geo, 0, tq, 0, tk), batch)
    elif causal:
        is_causal = True
    if bias is not None:
        attn_mask = bias if attn_mask is None else bias.masked_fill(~attn_mask, float("-inf"))
    if attn_mask is not None and attn_mask.ndim < 2:
        attn_mask = attn_mask.unsqueeze(0)  # torch wants (..., Tq|1, Tk); ours may be just (Tk,)
    if scale == 0.0:
        # torch's causal kernels scale their -inf too (0 * -inf = NaN, torch 2.13 CPU): zero
        # queries with scale 1 give the same all-zero scores and the same zero gradient of q.
        q, scale = q * 0.0, 1.0
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.size(-3) != k.size(-3),
    )
    empty = _empty_rows(None, attn_mask)
    if empty is not None and q.device.type != "cpu":
        # On CPU torch >= 2.5 returns 0 for a query with no visible key (its math and flash kernels
        # use a safe softmax); the CUDA kernels have differed between releases, so make sure.
        out = out.masked_fill(empty, 0.0)
    return out, attn_mask


def _blocked_term(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None,
    bias: Tensor | None,
    term: ScoreTerm,
    scale: float,
    dropout_p: float,
    block_q: int,
    product_q: int,
    term_keys: int = TERM_KEYS,
) -> tuple[Tensor, bool]:
    """A score term without gradients: per block of queries, one fused call whose float mask is
    the block's term (+ bias, masked with -inf). Keys no query of the block may see are left out.
    Returns the output and whether it looked trustworthy.

    torch takes a strided float mask as it is, so a term whose tiles are views of its own product
    (relative positions) reaches the fused kernel without a copy when nothing is added to it.
    """
    batch = tuple(q.shape[:-3])
    h, tq, _ = q.shape[-3:]
    hkv, tk, dv = v.shape[-3:]
    n = math.prod(batch)
    q4, k4, v4 = (t.reshape(n, *t.shape[-3:]) for t in (q, k, v))
    bias4 = None
    if bias is not None:
        bias4 = bias.reshape((1,) * (len(batch) + 3 - bias.ndim) + tuple(bias.shape))
        bias4 = bias4.expand(*batch, *bias4.shape[len(batch) :]).reshape(-1, *bias4.shape[-3:])
    geo = Geometry(batch, h, tq, tk, q.device)
    work = torch.promote_types(q.dtype, torch.float32)
    shape = Geometry(batch, h, tq, tk, q.device, work)
    inputs = tuple(term.inputs())
    empties: list[Tensor] = []  # (B, H, rows): queries of each block that see no key
    # The plan says which keys each block of queries can see (64-key resolution).
    plan = make_plan(
        mask, geo, q_start=0, q_len=tq, k_start=0, kv_len=tk, block_q=block_q, block_k=64
    )
    # (B, Tq, H, Dv) memory, so that a caller's merge of the heads is a view, not a copy.
    out = q.new_empty(n, tq, h, dv).transpose(1, 2)
    buffer: Tensor | None = None  # for masks that must be written: reused, not one per block
    for qb in plan.blocks:
        qs, qe = qb.qs, qb.qe
        lo, hi = qb.key_range
        if hi <= lo:  # no query of the block sees a key
            out[:, :, qs:qe] = 0.0
            empties.append(torch.ones((), dtype=torch.bool, device=q.device).expand(n, h, qe - qs))
            continue
        covered = sum(vt.ke - vt.ks for vt in qb.visits) == hi - lo
        masked = mask is not None and (not covered or any(vt.partial for vt in qb.visits))
        full = (n, h, qe - qs, hi - lo)
        if qe - qs <= product_q:
            tb = term.block(inputs, shape, qs, qe, lo, hi, grads=None)
            attn_mask = tb.tile(lo, hi)  # (B|1, H|1, rows, keys)
            writable = tb.writable and tuple(attn_mask.shape) == full
        else:
            # Products of a few rows waste little (a product spans rows - 1 more distances than
            # keys); one fused call over many rows costs less per query: copy the products' tiles
            # into one float mask.
            if buffer is None:
                widest = max(b.key_range[1] - b.key_range[0] for b in plan.blocks)
                buffer = torch.empty(n * h * block_q * widest, dtype=work, device=q.device)
            attn_mask = buffer[: math.prod(full)].view(full)
            for ps in range(qs, qe, product_q):
                pe = min(ps + product_q, qe)
                tb = term.block(inputs, shape, ps, pe, lo, hi, grads=None)
                for ks in range(lo, hi, term_keys):
                    ke = min(ks + term_keys, hi)
                    attn_mask[:, :, ps - qs : pe - qs, ks - lo : ke - lo] = tb.tile(ks, ke)
            writable = True
        if bias4 is not None or masked:
            if not writable:
                if buffer is None:
                    widest = max(b.key_range[1] - b.key_range[0] for b in plan.blocks)
                    buffer = torch.empty(n * h * block_q * widest, dtype=work, device=q.device)
                attn_mask = buffer[: math.prod(full)].view(full).copy_(attn_mask)
            if bias4 is not None:
                attn_mask.add_((bias4[..., qs:qe, :] if bias4.size(-2) != 1 else bias4)[..., lo:hi])
            if masked and mask is not None:
                hidden = ~mask.tile(geo, qs, qe, lo, hi)
                attn_mask.masked_fill_(hidden, float("-inf"))
        block = F.scaled_dot_product_attention(
            q4[:, :, qs:qe],
            k4[:, :, lo:hi],
            v4[:, :, lo:hi],
            attn_mask=attn_mask.to(q.dtype),
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=h != hkv,
        )
        if bias4 is not None:  # a -inf bias may empty a row too
            empty = (attn_mask == float("-inf")).all(-1)
        elif masked:
            empty = hidden.all(-1)
        if masked or bias4 is not None:
            if q.device.type != "cpu":
                block = block.masked_fill(empty.unsqueeze(-1), 0.0)
            empties.append(empty.expand(n, h, qe - qs))
        else:
            empties.append(torch.zeros((), dtype=torch.bool, device=q.device).expand(n, h, qe - qs))
        out[:, :, qs:qe] = block
    trusted = torch.compiler.is_compiling() or _trustworthy(
        out, None, torch.cat(empties, -1) if empties else None, (q4, k4, v4), dropout_p > 0
    )
    return out.reshape(*batch, h, tq, dv), trusted


class SDPA(Backend):
    """torch's SDPA as a backend; ``block_q``, ``product_q`` and ``term_keys`` size the blocks of a
    call with a score term: queries per fused call, queries per product of the term (when
    ``product_q >= block_q`` the term's tiles go to torch as they are, without a copy), and keys
    per tile asked of the term.

    When torch's output breaks attnkit's non-finite policy (NaN/inf, or a zero row that neither
    the mask nor the values explain), the call is handed over to the backend registered as
    ``chunked`` (dropout included: it drops in O(T) memory too), visibly: :attr:`handovers`
    counts it and :func:`~attnkit.record_dispatch` records it; ``explain()`` says when it can
    happen.
    """

    def __init__(
        self, *, block_q: int = 192, product_q: int = 64, term_keys: int = TERM_KEYS
    ) -> None:
        super().__init__("sdpa")
        self.block_q = check_int("block_q", block_q)
        self.product_q = check_int("product_q", product_q)
        self.term_keys = check_int("term_keys", term_keys)

    def check(self, call: AttentionCall) -> list[str]:
        return sdpa_check(call)

    def cost(self, call: AttentionCall) -> list[str]:
        return sdpa_cost(call)

    def slower(self, call: AttentionCall) -> list[str]:
        return sdpa_slower(call)

    def notes(self, call: AttentionCall) -> list[str]:
        notes = []
        plain = call.bias_shape is None and call.score_term is None
        if call.mask is not None and plain:
            docs = _documents(call.mask, call.q_len, call.kv_len)  # the documents' lengths: no data
            if docs:
                n = sum(sum(b > a for a, b in itertools.pairwise(row)) for row in docs[0])
                notes.append(f"one fused call per document: {n} calls")
        if not call.requires_grad:
            notes.append(
                f"hands the call to {EXACT} if torch's output breaks the non-finite policy "
                "(NaN/inf, or a zero row that neither the mask nor the values explain)"
            )
        return notes

    def run(self, call: AttentionCall, inputs: CallInputs) -> Tensor:
        q, k, v = inputs.q, inputs.k, inputs.v
        mask, scale, dropout_p = call.mask, call.scale, call.dropout_p
        if call.score_term is not None:
            with no_autocast(q.device):
                out, trusted = _blocked_term(
                    q, k, v, mask, None, call.score_term, scale, dropout_p, self.block_q,
                    self.product_q, self.term_keys,
                )  # fmt: skip
        else:
            bias = inputs.bias
            # Documents read their lengths on the host: not while torch.compile traces.
            docs = None
            if bias is None and not torch.compiler.is_compiling():
                docs = _documents(mask, q.size(-2), k.size(-2))
            if docs:
                out, attn_mask = _per_document(q, k, v, *docs, scale, dropout_p), None
            else:
                out, attn_mask = _plain(q, k, v, mask, bias, scale, dropout_p)
            trusted = (
                torch.compiler.is_compiling()
                or (torch.is_grad_enabled() and out.requires_grad)
                or _trustworthy(out, attn_mask, qkv=(q, k, v), dropout=dropout_p > 0)
            )
        if trusted:
            return out
        # NaN/inf in the result, or a zero no mask explains: let attnkit's kernel apply the
        # policy (dropout included: it drops in O(T) memory too).
        result = self.hand_over(call, inputs, EXACT, "torch's output broke the non-finite policy")
        return result[0] if isinstance(result, tuple) else result

    def __repr__(self) -> str:
        return f"SDPA(block_q={self.block_q}, product_q={self.product_q})"
