"""Writing keys and values into a quantized cache: int8 with a scale per token and key/value head,
float8 (``torch.float8_e4m3fn``, ``torch.float8_e5m2``) with a scale per key/value head.

Each function takes new keys or values ``x (..., Hkv, T, D)`` in any float dtype and returns
``(xq, scale)`` such that ``xq.float() * scale`` is the value ``attention(..., k_scale=scale)``
reads (see :mod:`attnkit._base.quantized`); a cache stores ``xq`` where the tokens go and their
scales beside them. Symmetric (no zero point): the largest magnitude of a row (int8) or of a head
(float8) maps to the format's largest number.

* int8: ``scale = amax(|x|, over D) / 127``, ``xq = round(x / scale)``: each element within half
  a step (``scale / 2``) of the input, about 1e-2 relative error on random data. A row of zeros
  gets the scale 1 (its elements are 0 whatever the scale).
* float8: ``scale = amax(|x|, over T and D) / max`` (448 for e4m3fn, 57344 for e5m2) on the first
  write, or the cache's scale for later tokens (``scale=``), ``xq = (x / scale).to(dtype)``
  rounded to nearest, finite values saturating at ``±max``: 3 and 2 bits of mantissa, a relative
  error of at most 2^-4 and 2^-3 in range. A scale is never below float32's smallest normal
  number (a head of magnitudes below about 1e-36 is read to within that number).

NaN and inf follow attnkit's non-finite policy (they reach the outputs that read them, never
hidden as a number): the largest magnitudes are those of the finite elements, so one NaN or inf
sets no scale. int8 has neither: a token holding one is stored with a NaN scale, so all its
elements read as NaN. float8 keeps NaN, and inf where the format has it (e5m2); e4m3fn, which
has no inf, stores it as NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor

from .._base.checks import dtype_str, shape_str

__all__ = [
    "FLOAT8",
    "READ_DTYPES",
    "check_dtype",
    "check_kv_dtype",
    "fp8_scale",
    "new_scales",
    "pickled_state",
    "quantize",
    "quantize_fp8",
    "quantize_int8",
    "unpickled_state",
]

#: The float8 formats a cache stores.
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_float(x: object) -> Tensor:
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dtype in FLOAT8:
        got = dtype_str(x.dtype) if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"x must be a float16, bfloat16, float32 or float64 tensor, got {got}")
    if x.dim() < 2:
        raise ValueError(f"x must be (..., Hkv, T, D), got {shape_str(x.shape)}")
    return x


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x (..., Hkv, T, D)`` as int8 ``(..., Hkv, T, D)`` and a float32 scale per token and
    key/value head ``(..., Hkv, T, 1)``.

    >>> x = torch.tensor([[[[0.5, -1.0, 0.25]]]])
    >>> xq, scale = quantize_int8(x)
    >>> xq.tolist(), round(scale.item() * 127, 6)
    ([[[[64, -127, 32]]]], 1.0)
    """
    x = _check_float(x).detach().float()
    finite = x.isfinite()
    x = x.where(finite, 0.0)  # (a decode step's write: each operation here is one per step)
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, 1.0)
    xq = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    # int8 holds no NaN or inf: the token's scale carries it (every element reads as NaN)
    return xq, scale.where(finite.all(-1, keepdim=True), float("nan"))


def _finite_magnitudes(x: Tensor, keep: Tensor) -> Tensor:
    """``|x|`` in float32 where ``keep`` (a bool tensor broadcastable to ``x``), else 0: what a
    scale is taken from (a NaN or inf, or a padding position, sets none)."""
    return x.float().abs().where(keep, 0.0)


def fp8_scale(x: Tensor, dtype: torch.dtype, real: Tensor | None = None) -> Tensor:
    """The float32 scale per key/value head ``(..., Hkv, 1, 1)`` that maps the largest finite
    magnitude of ``x (..., Hkv, T, D)`` to ``dtype``'s largest number (1 for a head without
    one), over the tokens ``real`` marks (a bool tensor broadcastable to ``x``; None: all)."""
    if x.size(-2) == 0 or x.size(-1) == 0:  # no token (a write of none): no magnitude, 1
        return torch.ones((*x.shape[:-2], 1, 1), device=x.device)
    keep = x.isfinite() if real is None else x.isfinite() & real
    amax = _finite_magnitudes(x.detach(), keep).amax((-2, -1), keepdim=True)
    # at least float32's smallest normal number: below ~1e-36 amax / max would round to 0 (or
    # lose its bits), and the head's zeros be stored as 0 / 0 = NaN
    scale = (amax / torch.finfo(dtype).max).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(amax > 0, scale, torch.ones_like(amax))


def quantize_fp8(
    x: Tensor, dtype: torch.dtype = torch.float8_e4m3fn, *, scale: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``x (..., Hkv, T, D)`` as ``dtype`` (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``)
    and a float32 scale per key/value head ``(..., Hkv, 1, 1)``: computed from ``x`` (a cache's
    first write), or ``scale`` as given (the cache's, for the tokens that follow; those beyond
    its range saturate at the format's largest number).

    >>> x = torch.tensor([[[[448.0, -2.0], [1.0, 0.5]]]])
    >>> xq, scale = quantize_fp8(x)
    >>> (xq.float() * scale).tolist(), scale.shape
    ([[[[448.0, -2.0], [1.0, 0.5]]]], torch.Size([1, 1, 1, 1]))
    """
    x = _check_float(x)
    if dtype not in FLOAT8:
        raise TypeError(
            f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype_str(dtype)}"
        )
    top = torch.finfo(dtype).max
    if scale is None:
        scale = fp8_scale(x, dtype)
    elif not isinstance(scale, Tensor) or not scale.is_floating_point():
        raise TypeError(f"scale must be a float tensor, got {type(scale).__name__}")
    else:
        want = (*x.shape[:-2], 1, 1)
        # (compared by hand: torch.broadcast_shapes costs a hundred microseconds a call)
        fits = scale.ndim <= len(want) and all(
            s in (1, w) for s, w in zip(reversed(scale.shape), reversed(want), strict=False)
        )
        if not fits:
            raise ValueError(
                f"scale must be broadcastable to (..., Hkv, 1, 1) = {shape_str(want)}, got "
                f"{shape_str(scale.shape)}"
            )
        scale = scale.float()
    y = x.detach().float() / scale
    # finite values saturate; NaN stays NaN, and inf too where the format has it (e4m3fn has
    # none: torch's conversion would saturate it, so it is NaN there)
    kept = float("nan") if dtype == torch.float8_e4m3fn else y
    return torch.where(x.isfinite(), y.clamp(-top, top), kept).to(dtype), scale


#: The dtypes a cache's keys and values are given and read in (its ``dtype``).
READ_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_dtype(dtype: object) -> torch.dtype:
    """A cache's ``dtype``, the one keys and values are given and read in: float16, bfloat16,
    float32 or float64 (None: torch's default dtype). An int8 or float8 store is ``kv_dtype``."""
    if dtype is None:
        return torch.get_default_dtype()
    if dtype in READ_DTYPES:
        return dtype
    got = dtype_str(dtype) if isinstance(dtype, torch.dtype) else repr(dtype)
    hint = ""
    if dtype == torch.int8 or dtype in FLOAT8:
        hint = f" (to store keys and values as {got}, pass kv_dtype={dtype} with a float dtype)"
    raise TypeError(
        "dtype must be torch.float16, torch.bfloat16, torch.float32 or torch.float64 (the dtype "
        f"keys and values are given and read in), got {got}{hint}"
    )


def check_kv_dtype(kv_dtype: object) -> torch.dtype | None:
    """A cache's ``kv_dtype``: None (keys and values stored in the compute dtype) or one of
    ``torch.int8``, ``torch.float8_e4m3fn``, ``torch.float8_e5m2``."""
    if kv_dtype is None or kv_dtype == torch.int8 or kv_dtype in FLOAT8:
        return kv_dtype
    got = dtype_str(kv_dtype) if isinstance(kv_dtype, torch.dtype) else repr(kv_dtype)
    raise TypeError(
        f"kv_dtype must be None, torch.int8, torch.float8_e4m3fn or torch.float8_e5m2, got {got}"
    )


def new_scales(pages: Tensor) -> Tensor:
    """The float32 scales of quantized pages ``(X, Hkv, page, D)``, all 1: one per token and
    key/value head ``(X, Hkv, page, 1)`` for int8, one per page and head ``(X, Hkv, 1, 1)``
    for float8."""
    per_token = pages.dtype == torch.int8
    shape = (*pages.shape[:2], pages.size(2) if per_token else 1, 1)
    return torch.ones(shape, dtype=torch.float32, device=pages.device)


def quantize(x: Tensor, dtype: torch.dtype, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``x (..., Hkv, T, D)`` as ``dtype`` with its scales: int8 a scale per token
    (:func:`quantize_int8`); float8 ``scale`` as given, or one per head from ``x`` when None
    (:func:`quantize_fp8`)."""
    if dtype == torch.int8:
        return quantize_int8(x)
    return quantize_fp8(x, dtype, scale=scale)


class _Float8Bytes(NamedTuple):
    """A float8 tensor as it pickles: its bytes (a ``uint8`` view) and its dtype."""

    data: Tensor
    dtype: torch.dtype


def _same_tuple(x: tuple[object, ...], items: list[object]) -> tuple[object, ...]:
    """``items`` as a tuple of ``x``'s type: a NamedTuple's fields by position."""
    if hasattr(x, "_fields"):
        named: Any = type(x)
        return cast(tuple[object, ...], named(*items))
    return tuple(items)


def _mapped(x: object, leaf: Callable[[object], object]) -> object:
    """``x`` with ``leaf`` applied to it and, where that leaves it as it is, to each value in
    it (of dicts, lists and tuples)."""
    y = leaf(x)
    if y is not x:
        return y
    if isinstance(x, dict):
        return type(x)((key, _mapped(value, leaf)) for key, value in x.items())
    if isinstance(x, list):
        return [_mapped(item, leaf) for item in x]
    if isinstance(x, tuple):
        return _same_tuple(x, [_mapped(item, leaf) for item in x])
    return x


def _to_pickle(x: object) -> object:
    if isinstance(x, Tensor) and x.dtype in FLOAT8:
        return _Float8Bytes(x.view(torch.uint8), x.dtype)
    return x


def _from_pickle(x: object) -> object:
    return x.data.view(x.dtype) if isinstance(x, _Float8Bytes) else x


def pickled_state(state: dict[str, Any]) -> dict[str, Any]:
    """A cache's ``__dict__`` as its ``__getstate__`` gives it to ``pickle``, ``copy`` and
    ``torch.save``: float8 tensors (in dicts, lists and tuples too) as their bytes, since torch's
    unpickler cannot rebuild a float8 tensor (it fails on loading, deep inside
    ``torch.serialization``). :func:`unpickled_state` turns them back."""
    return {key: _mapped(value, _to_pickle) for key, value in state.items()}


def unpickled_state(state: dict[str, Any]) -> dict[str, Any]:
    """The ``__dict__`` of a cache :func:`pickled_state` gave, its float8 tensors remade (views
    of the bytes, as they were)."""
    return {key: _mapped(value, _from_pickle) for key, value in state.items()}
