"""Quantized keys and values: int8 or float8 ``k`` and ``v`` with a float scale per row.

``attention(q, k, v, k_scale=..., v_scale=...)`` takes ``k`` and ``v`` as ``torch.int8``,
``torch.float8_e4m3fn`` or ``torch.float8_e5m2``; the keys the call sees are
``(k.float() * k_scale).to(q.dtype)``, and the values likewise. The scales are float tensors
broadcastable to ``(*batch, Hkv, Tk, 1)``: one per token and key/value head, one per head
(``(Hkv, 1, 1)``), one for the whole cache, or any shape between. Here: the checks of those
arguments (messages quote the values), and the dequantized tensors that a backend which does not
read quantized values itself receives.

What a call may hand over, on every backend alike:

* Scales are tensors (a Python number or list is refused, naming the argument: a cache's scales
  live beside it as tensors, and a tensor is what torch.compile and export take as an input), of
  any float dtype, on q's device. Their values are not checked: zero, negative, NaN and inf
  scales follow the formula, so a NaN or inf scale reaches the outputs of the queries that see
  its keys, as a NaN key would (the non-finite policy).
* ``k`` and ``v`` are quantized together, in one dtype: int8 keys with float8 or float values
  (or the reverse) are refused, naming both dtypes.
* int8 is read over its whole range, ``-128`` included (``-128 * scale``); attnkit's own
  writers store ``-127..127`` (symmetric), so a cache they fill never holds ``-128``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .checks import broadcasts_to, dtype_str, shape_str
from .finite import finite_if_readable

__all__ = [
    "QUANTIZED",
    "QuantizedKV",
    "check_kv_scales",
    "dequantize",
    "is_quantized",
    "stand_in",
]

#: The dtypes of quantized keys and values.
QUANTIZED = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_quantized(t: object) -> bool:
    """Whether ``t`` is a tensor of a quantized dtype (:data:`QUANTIZED`)."""
    return isinstance(t, Tensor) and t.dtype in QUANTIZED


def _check_scale(name: str, scale: object, x: Tensor, q: Tensor) -> Tensor:
    """``scale`` for the quantized ``x`` (named ``name``): a float tensor on q's device,
    broadcastable to ``(*batch, Hkv, Tk, 1)``."""
    arg = f"{name}_scale"
    if scale is None:
        what = "keys" if name == "k" else "values"
        raise TypeError(
            f"{name} of {dtype_str(x.dtype)} needs {arg}= (a float tensor broadcastable to "
            f"{shape_str((*x.shape[:-1], 1))}): the {what} used are {name}.float() * {arg}"
        )
    if not isinstance(scale, Tensor):
        raise TypeError(f"{arg} must be a float tensor, got {type(scale).__name__}")
    if scale.dtype not in _FLOATS:
        raise TypeError(
            f"{arg} must be float16, bfloat16, float32 or float64, got {dtype_str(scale.dtype)}"
        )
    if scale.device != q.device:
        raise ValueError(f"{arg} must be on q's device ({q.device}), got {scale.device}")
    target = (*x.shape[:-1], 1)
    if scale.shape != target and not broadcasts_to(tuple(scale.shape), target):
        raise ValueError(
            f"{arg} must be broadcastable to (*batch, Hkv, Tk, 1) = {shape_str(target)} (one "
            f"scale per token and key/value head, or fewer), got {shape_str(scale.shape)}"
        )
    return scale


def check_kv_scales(
    q: object, k: object, v: object, k_scale: object, v_scale: object
) -> tuple[Tensor, Tensor] | None:
    """``(k_scale, v_scale)`` checked for quantized ``k`` and ``v``; None for a call whose keys
    and values are not quantized (and which gives no scales). The other arguments' own checks
    (shapes, devices, q's dtype) are ``attention()``'s, on the dequantized shapes."""
    quantized = is_quantized(k) or is_quantized(v)
    if not quantized:
        if k_scale is not None or v_scale is not None:
            got = dtype_str(k.dtype) if isinstance(k, Tensor) else type(k).__name__
            raise TypeError(
                f"k_scale and v_scale are for int8/float8 k and v "
                f"(torch.int8, torch.float8_e4m3fn, torch.float8_e5m2), got k of {got}"
            )
        return None
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        raise TypeError("q, k and v must be tensors")
    if k.dtype != v.dtype:
        raise TypeError(
            f"quantized k and v must share a dtype, got k {dtype_str(k.dtype)} and v "
            f"{dtype_str(v.dtype)}"
        )
    if q.dtype not in _FLOATS:
        raise TypeError(
            f"q must be float16, bfloat16, float32 or float64 (the dtype the call computes in) "
            f"with {dtype_str(k.dtype)} k and v, got q of {dtype_str(q.dtype)}"
        )
    return _check_scale("k", k_scale, k, q), _check_scale("v", v_scale, v, q)


@dataclass(frozen=True)
class QuantizedKV:
    """A call's quantized keys and values: their dtype and their checked scales (float tensors
    broadcastable to ``(*batch, Hkv, Tk, 1)``)."""

    dtype: torch.dtype
    k_scale: Tensor
    v_scale: Tensor

    def describe(self) -> str:
        """``int8 k and v, scales (2, 8, 4096, 1) and (8, 1, 1)``."""
        return (
            f"{dtype_str(self.dtype)} k and v, scales {shape_str(self.k_scale.shape)} and "
            f"{shape_str(self.v_scale.shape)}"
        )

    def __repr__(self) -> str:
        return f"QuantizedKV({self.describe()})"

    def finite(self, q: Tensor, k: Tensor, v: Tensor) -> bool | None:
        """Whether ``q`` and the keys and values the call reads (``k`` and ``v`` dequantized
        with these scales) hold no NaN or inf, as a call that needs gradients asks of its
        inputs (None where no value can be read, under torch.func.vmap)."""
        with torch.no_grad():
            keys = dequantize(k, self.k_scale, q.dtype)
            values = dequantize(v, self.v_scale, q.dtype)
        return finite_if_readable(q, keys, values)


def dequantize(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """The keys or values a quantized ``x`` stands for, in ``dtype``: ``x.float() * scale``
    (differentiable in ``scale``)."""
    return (x.float() * scale).to(dtype)


def stand_in(x: Tensor, dtype: torch.dtype, scale: Tensor | None = None) -> Tensor:
    """A tensor of ``x``'s shape in ``dtype`` that holds no memory of its own (zeros, one element
    expanded): what the checks of ``attention()``'s arguments read in place of quantized keys or
    values; needing gradients where its ``scale`` does (under grad mode)."""
    zero = torch.zeros((), dtype=dtype, device=x.device)
    if scale is not None and scale.requires_grad and torch.is_grad_enabled():
        # 0 from the scale, not a leaf made with requires_grad=True, which torch.compile
        # cannot trace in a call whose scales need gradients
        zero = zero + scale.flatten()[:0].sum().to(dtype)
    return zero.expand(x.shape)
