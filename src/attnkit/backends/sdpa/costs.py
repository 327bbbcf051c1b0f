"""The cost model: where torch's SDPA is slower than attnkit's kernel (:func:`sdpa_slower`).

``auto`` asks each backend for the slow paths it would take; sdpa names torch's on CPUs, where its
kernels lose to the native kernel in some dtypes, sizes and kinds of CPU, and a score term, which
it adds beside torch's kernel block by block. The sizes come from ``thresholds.py``, where each
sits beside its measurement; the rules that read them are here, by kind of CPU:

* every CPU: training in float32/float64 (torch's CPU backward is its slow half), decode steps
  from many bytes of keys and values (torch reads a key/value head's cache once per query head of
  its group), and other float32/float64 inference from many scores, except unmasked calls where
  the native kernel has nothing to skip and no register tiles (no AVX-512);
* CPUs without products of bfloat16/float16 in torch's kernels: training in those dtypes, their
  decode steps from fewer bytes (the native kernel reads them as they are), float16 inference
  from many scores; bfloat16 prefill stays with torch, which the native kernel matches there;
* CPUs with AMX, where torch's kernels are fast in every dtype: only grouped decode steps from
  many bytes, long bfloat16 inference and large bfloat16 training steps (the native kernel's
  products run on the matrix unit too); unmasked float32 and float16 prefill stay with torch;
* CPUs with AVX512-BF16 and no AMX: float32 as with AMX but for grouped decode steps from fewer
  bytes, decode steps without groups from caches past the last-level cache, and unmasked calls
  from many scores; bfloat16 prefill from many scores (the native
  kernel's products are AVX512-BF16's dot products); bfloat16/float16 decode steps from the bytes
  torch reads over its query heads (few: its reduced-precision decode is slow there); otherwise
  the rules of CPUs without products.

What the CPU has is read once (the probes ``_register_tiles``, ``_matrix_unit``, ``_bf16_dot``,
``_products_in``): the checks are not traceable by torch.compile, and a compiled call consults
them while it is traced.
"""

from __future__ import annotations

import math

import torch

from ..._call import AttentionCall
from ..._native.kernel import BF16_DOT, DECODE_QUERIES, MATRIX_UNIT, cpu_has
from .thresholds import THRESHOLDS

__all__ = ["sdpa_slower"]

_T = THRESHOLDS

#: The dtypes in which torch's CPU backward is its slow half.
_CPU_SLOW_BACKWARD = (torch.float32, torch.float64)
_REDUCED = (torch.bfloat16, torch.float16)

# The native kernel runs a bfloat16 forward's products in the matrix unit's tiles for heads whose
# widths are multiples of this (others go through the BLAS), and AVX512-BF16's dot products take
# pairs of q's and k's elements.
_TILE_WIDTH = 32
_DOT_PAIR = 2

# What the CPU multiplies on its matrix unit.
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
    matrix unit."""
    return MATRIX_UNIT


def _bf16_dot() -> bool:
    """Whether this CPU has AVX512-BF16 but no AMX, where the native kernel runs bfloat16
    products as AVX512-BF16's dot products."""
    return BF16_DOT and not MATRIX_UNIT


def _avx512() -> bool:
    try:
        return torch.backends.cpu.get_cpu_capability() == "AVX512"
    except (AttributeError, RuntimeError):
        return False


# Read at import, not under a cache: torch.compile traces through ``functools.cache`` into
# ``get_cpu_capability``, which it cannot put in a graph.
_AVX512 = _avx512()


def _register_tiles() -> bool:
    """Whether this CPU has AVX-512, where a blocked kernel computes its products in register
    tiles (elsewhere it calls the BLAS per block, as torch's CPU forward does)."""
    return _AVX512


def _fast_torch_cpu() -> bool:
    """Whether this CPU has AVX512-BF16 (with AMX or without), where torch's float32 CPU kernels
    are fast."""
    return _matrix_unit() or _bf16_dot()


def _scores(call: AttentionCall) -> int:
    """The scores a call computes, B * H * Tq * Tk (a mask's holes included)."""
    return math.prod(call.batch_shape) * call.num_heads * call.q_len * call.kv_len


def _decode_bytes(call: AttentionCall) -> int:
    """The bytes of keys and values a call reads."""
    batch = math.prod(call.batch_shape)
    size = batch * call.num_kv_heads * call.kv_len * (call.qk_dim + call.v_dim)
    return size * call.dtype.itemsize


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sdpa_slower(call: AttentionCall) -> list[str]:
    """The slow paths torch's SDPA would take for a call it can serve."""
    slow = []
    term = call.score_term
    if term is not None:
        slow.append(
            f"would add the {term.describe()} beside torch's kernel, one fused call per block of "
            "queries with the block's term written out"
        )
    if call.device.type != "cpu":
        return slow
    if call.requires_grad:
        return slow + _slow_training(call)
    if call.dtype in _CPU_SLOW_BACKWARD:
        return slow + _slow_forward(call)
    if call.dtype in _REDUCED:
        return slow + _slow_reduced_inference(call)
    return slow


def _slow_training(call: AttentionCall) -> list[str]:
    """Why torch's CPU kernels train slower than the native kernel, or nothing."""
    scores = _scores(call)
    if call.dtype in _CPU_SLOW_BACKWARD and scores >= _T.float_training.least:
        # A training step spends most of its attention time in the backward.
        return ["trains slower on CPUs: torch's CPU backward is its slow half in float32/float64"]
    rule = _T.reduced_training
    if call.dtype in _REDUCED and not _products_in(call.dtype) and scores >= rule.least:
        name = _name(call.dtype)
        return [
            f"trains slower on CPUs: torch's CPU backward is its slow half in {name} on CPUs "
            f"without a matrix unit for {name} ({rule.quoted} the native kernel's training step "
            f"at T=4096)"
        ]
    rule = _T.matrix_training_scores
    if call.dtype == torch.bfloat16 and _matrix_unit() and scores >= rule.least:
        return [
            f"trains slower on CPUs with a matrix unit (AMX): the native kernel runs a bfloat16 "
            f"training step's products there too ({rule.quoted} torch's time from "
            f"{rule.least} scores on)"
        ]
    return []


def _grouped_decode(call: AttentionCall) -> list[str]:
    """On CPUs with AVX512-BF16, why torch decodes slower: the step reads enough of shared
    key/value heads' caches for the native kernel's single read of each to beat torch's one read
    per query head; else nothing (and no bytes counted where no heads are shared)."""
    if call.num_heads == call.num_kv_heads:
        return _ungrouped_decode(call)
    size = _decode_bytes(call)
    least, cpus = _T.matrix_grouped_decode_bytes.least, "CPUs with AMX"
    if not _matrix_unit():
        least, cpus = _T.dot_grouped_decode_bytes.least, "CPUs with AVX512-BF16 and no AMX"
    if size < least:
        return []
    name = "" if call.dtype not in _REDUCED else _name(call.dtype) + " "
    return [
        f"decodes slower on CPUs: {size / 2**20:.0f} MiB of {name}keys and values shared by "
        f"{call.num_heads // call.num_kv_heads} query heads each, which torch reads once per "
        f"query head and the native kernel once (from {least >> 20} MiB on {cpus})"
    ]


def _ungrouped_decode(call: AttentionCall) -> list[str]:
    """On CPUs with AVX512-BF16 and no AMX, why torch decodes float32/float64 slower without
    grouped heads: a cache past the last-level cache, which the native kernel streams faster;
    else nothing."""
    rule = _T.dot_ungrouped_decode_bytes
    size = _decode_bytes(call)
    if _matrix_unit() or call.dtype not in _CPU_SLOW_BACKWARD or size < rule.least:
        return []
    return [
        f"decodes slower on CPUs with AVX512-BF16 and no AMX: {size / 2**20:.0f} MiB of keys and "
        f"values, one query head each ({rule.quoted} torch's time from {rule.least >> 20} MiB "
        f"on)"
    ]


def _slow_forward(call: AttentionCall) -> list[str]:
    """Why torch's CPU forward serves an inference call in float32/float64 slower than a blocked
    kernel, or nothing."""
    if call.q_len <= DECODE_QUERIES:
        if _fast_torch_cpu():
            return _grouped_decode(call)
        size = _decode_bytes(call)
        least = _T.float_decode_bytes.least
        if size >= least:
            return [
                f"decodes slower on CPUs: {size / 2**20:.0f} MiB of keys and values, which "
                f"torch reads once per query head (float32/float64 from {least >> 20} MiB on)"
            ]
        return []
    scores = _scores(call)
    if call.mask is None and _register_tiles() and _bf16_dot():
        rule = _T.dot_unmasked_scores
        if scores < rule.least:
            return []
        return [
            f"runs slower on CPUs with AVX512-BF16 and no AMX at this size: {scores} scores "
            f"without a mask, where the native kernel's register tiles take {rule.quoted} torch's "
            f"float32 time (float32/float64 from {rule.least} on)"
        ]
    if call.mask is None and (not _register_tiles() or _fast_torch_cpu()):
        # Nothing to skip, and the BLAS per block (or, with AMX, torch's fast float32 kernels):
        # torch's forward is as fast (the inference guide's measurements).
        return []
    rule = _T.float_forward_scores
    if scores >= rule.least:
        return [
            f"runs slower on CPUs at this size: {scores} scores, where torch's CPU forward takes "
            f"{rule.quoted} a blocked kernel's time (float32/float64 from {rule.least} on)"
        ]
    return []


def _slow_reduced_inference(call: AttentionCall) -> list[str]:
    """Why torch's CPU forward serves a bfloat16/float16 inference call slower than the native
    kernel, or nothing."""
    if call.q_len > DECODE_QUERIES:
        return _slow_reduced_prefill(call)
    # float16 on a CPU with AMX-BF16 only: torch's float16 decode is as slow as on any CPU without
    # float16 products.
    if _products_in(call.dtype):
        return _grouped_decode(call)
    if _bf16_dot():
        return _dot_reduced_decode(call)
    size = _decode_bytes(call)
    least = _T.reduced_decode_bytes.least
    if size < least:
        return []
    return [
        f"decodes slower on CPUs: {size / 2**20:.0f} MiB of {_name(call.dtype)} keys and values, "
        f"which torch reads once per query head and the native kernel once, converting them in "
        f"registers (bfloat16/float16 from {least >> 20} MiB on)"
    ]


def _dot_reduced_decode(call: AttentionCall) -> list[str]:
    """On CPUs with AVX512-BF16 and no AMX, why torch decodes bfloat16/float16 slower: its reads
    of the keys and values, once per query head, cost more than the native kernel's call from
    fewer bytes than elsewhere; else nothing."""
    reads = _decode_bytes(call) * (call.num_heads // max(call.num_kv_heads, 1))
    rule = _T.dot_reduced_decode_reads
    if reads < rule.least:
        return []
    return [
        f"decodes slower on CPUs with AVX512-BF16 and no AMX: torch reads "
        f"{reads / 2**10:.0f} KiB of {_name(call.dtype)} keys and values (once per query head), "
        f"where the native kernel reads them once, converting them in registers "
        f"({rule.quoted} torch's time from {rule.least >> 10} KiB on)"
    ]


def _slow_reduced_prefill(call: AttentionCall) -> list[str]:
    """:func:`_slow_reduced_inference` for more queries than a decode step."""
    rule = _T.matrix_prefill_length
    if (
        call.dtype == torch.bfloat16
        and _matrix_unit()
        and min(call.q_len, call.kv_len) >= rule.least
        and call.qk_dim % _TILE_WIDTH == 0
        and call.v_dim % _TILE_WIDTH == 0
    ):
        return [
            f"runs slower on CPUs with a matrix unit (AMX) from {rule.least} queries and keys: "
            f"the native kernel runs a bfloat16 forward's products in the unit's tiles "
            f"({rule.quoted} torch's time; heads whose widths are multiples of {_TILE_WIDTH})"
        ]
    scores = _scores(call)
    rule = _T.dot_bfloat16_forward_scores
    if (
        call.dtype == torch.bfloat16
        and _bf16_dot()
        and scores >= rule.least
        and call.qk_dim % _DOT_PAIR == 0
    ):
        return [
            f"runs slower on CPUs with AVX512-BF16 and no AMX at this size: {scores} scores, "
            f"where the native kernel runs a bfloat16 forward's products as AVX512-BF16's dot "
            f"products ({rule.quoted} torch's time; bfloat16 from {rule.least} on)"
        ]
    rule = _T.float16_forward_scores
    if (
        call.dtype == torch.float16
        and scores >= rule.least
        and not _products_in(torch.float16)
        and not _matrix_unit()
    ):
        return [
            f"runs slower on CPUs at this size: {scores} scores, where torch's float16 CPU "
            f"forward takes {rule.quoted} the native kernel's time (float16 from "
            f"{rule.least} on)"
        ]
    return []
