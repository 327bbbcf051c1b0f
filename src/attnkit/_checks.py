"""Argument validation shared by every entry point.

Every check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value),
names the argument, and quotes the shapes or values it saw. Nothing here touches tensor data, so the
checks also run on ``device="meta"`` tensors (which is how ``explain`` and the CLI describe a call
without allocating it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
from torch import Tensor

_T = TypeVar("_T")

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dim_str(size: int | torch.SymInt) -> str:
    """One size in a message, never specialising a symbolic one.

    While torch.compile/export trace with dynamic shapes a size may be a ``SymInt``: ``int()``
    would fix it to the traced value, an f-string would too (a recompilation per length), and
    ``str()`` does not trace. Dynamo cannot tell a symbolic size from a constant one here
    (``isinstance`` and ``type`` both say int), so under dynamo every size prints as ``?``; the
    decisions made from the messages' sizes are unaffected. Non-strict export prints the symbol.
    """
    if torch.compiler.is_dynamo_compiling():
        return "?"
    return str(size)


def shape_str(shape: tuple[int, ...] | torch.Size) -> str:
    """``(2, 8, 128, 64)``: shapes in messages, without the ``torch.Size`` noise."""
    return "(" + ", ".join(dim_str(s) for s in shape) + ")"


def _dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class AttentionCall:
    """Everything about an ``attention()`` call that decides which backend can serve it.

    It holds shapes, dtypes and flags, never tensor data. Backends receive it in their ``check``
    and ``cost`` functions; ``explain()`` reports it.

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
    mask_shape: tuple[int, ...] | None
    bias_shape: tuple[int, ...] | None
    bias_requires_grad: bool
    causal: bool
    scale: float
    dropout_p: float
    return_weights: bool
    requires_grad: bool

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1 for plain multi-head attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def scores_shape(self) -> tuple[int, ...]:
        """The full ``(..., H, Tq, Tk)`` score shape that masks and biases broadcast to."""
        return (*self.batch_shape, self.num_heads, self.q_len, self.kv_len)

    def describe(self) -> str:
        """One line: ``q (2, 8, 128, 64), k/v (2, 2, 256, 64|64) float32 on cpu, causal, ...``."""
        b = self.batch_shape
        parts = [
            f"q {shape_str((*b, self.num_heads, self.q_len, self.qk_dim))}, "
            f"k {shape_str((*b, self.num_kv_heads, self.kv_len, self.qk_dim))}, "
            f"v {shape_str((*b, self.num_kv_heads, self.kv_len, self.v_dim))} "
            f"{_dtype_str(self.dtype)} on {self.device}"
        ]
        if self.mask_shape is not None:
            parts.append(f"mask {shape_str(self.mask_shape)}")
        if self.bias_shape is not None:
            grad = " (requires grad)" if self.bias_requires_grad else ""
            parts.append(f"bias {shape_str(self.bias_shape)}{grad}")
        if self.causal:
            parts.append("causal")
        if self.dropout_p:
            parts.append(f"dropout_p={self.dropout_p}")
        if self.return_weights:
            parts.append("return_weights")
        return ", ".join(parts)


def check_int(name: str, value: object, *, minimum: int = 1) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``, else TypeError/ValueError.

    A ``torch.SymInt`` (a length while torch.export traces with dynamic shapes) is an int here.
    """
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return cast(int, value)  # a SymInt stands for an int in the traced program


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool: a flag given 0, "yes" or None is a mistake, not a truth value."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_positive(name: str, value: object) -> float:
    """``value`` as a float if it is a finite number > 0 (an epsilon, a scale)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number > 0, got {value!r}")
    if not 0.0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_probability(name: str, value: object) -> float:
    """``value`` as a float if it is a number in [0, 1) (a dropout rate)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1), got {value!r}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return float(value)


def present(value: _T | None, what: str) -> _T:
    """``value``, known not to be None by the caller's logic (and checked even under ``-O``)."""
    if value is None:
        raise RuntimeError(f"attnkit internal error: {what} is None here; please report it")
    return value


def _require_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_float_tensor(name: str, t: object) -> Tensor:
    """``t`` if it is a floating-point tensor, else TypeError naming ``name``."""
    t = _require_tensor(name, t)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {_dtype_str(t.dtype)}")
    return t


def check_mask(
    name: str, mask: object, target: tuple[int, ...], legend: str = "(B, H, Tq, Tk)"
) -> Tensor:
    """``mask`` if it is a bool tensor that broadcasts to ``target``, else TypeError/ValueError.

    ``name`` is the argument as the caller knows it (``memory_mask``, ``src_mask``, ...).
    """
    mask = _require_tensor(name, mask)
    if mask.dtype != torch.bool:
        hint = (
            "; a float tensor of additive scores belongs in bias= (mask is boolean, "
            "True = may attend)"
            if mask.is_floating_point()
            else "; convert it with mask.bool() (True = may attend)"
        )
        raise TypeError(f"{name} must be a bool tensor, got {_dtype_str(mask.dtype)}{hint}")
    check_broadcastable(name, mask, target, legend)
    return mask


def check_input(
    name: str, t: object, shape: str, width: int | None, params: Tensor | None
) -> Tensor:
    """A module's input: a float ``(B, T, width)`` tensor in the dtype and on the device of the
    module's parameters (of which ``params`` is one; None for a module without any). ``shape``
    writes the layout for the message, e.g. ``"(B, Tq, d_model=8)"``; ``width=None`` leaves the
    last dim to the caller.

    Inside ``torch.autocast`` the dtype may differ from the parameters': autocast casts both.
    """
    t = check_float_tensor(name, t)
    if t.ndim != 3 or (width is not None and t.size(-1) != width):
        raise ValueError(f"{name} must have shape {shape}, got {shape_str(t.shape)}")
    if params is not None:
        check_like_parameters(name, t, params)
    return t


def check_like_parameters(name: str, t: Tensor, params: Tensor) -> None:
    """Raise unless ``t`` can meet the parameters ``params``: same device, same dtype (or any
    float dtype inside ``torch.autocast``, which casts both)."""
    if t.device != params.device:
        raise ValueError(
            f"{name} is on {t.device} but the module's parameters are on {params.device}"
        )
    if t.dtype == params.dtype:
        return
    device = t.device.type
    if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
        raise TypeError(
            f"{name} is {_dtype_str(t.dtype)} but the module's parameters are "
            f"{_dtype_str(params.dtype)}: convert one of them (module.to(dtype)), or run "
            "under torch.autocast"
        )


def check_broadcastable(name: str, t: Tensor, target: tuple[int, ...], legend: str) -> None:
    """Raise ``ValueError`` unless ``t`` broadcasts to ``target`` (trailing dims aligned)."""
    ok = t.ndim <= len(target) and all(
        s in (1, want) for s, want in zip(reversed(t.shape), reversed(target), strict=False)
    )
    if not ok:
        raise ValueError(
            f"{name} of shape {shape_str(t.shape)} does not broadcast to "
            f"{legend} = {shape_str(target)}"
        )


def check_attention_args(
    q: object,
    k: object,
    v: object,
    *,
    mask: object,
    bias: object,
    causal: object,
    scale: object,
    dropout_p: object,
    return_weights: object,
) -> AttentionCall:
    """Validate the arguments of ``attention()`` and describe the call."""
    q = _require_tensor("q", q)
    k = _require_tensor("k", k)
    v = _require_tensor("v", v)
    if q.ndim < 3:
        raise ValueError(
            f"q must have shape (..., H, Tq, Dk) with 3 or more dims, got {q.ndim}-d "
            f"{shape_str(q.shape)}"
        )
    for name, t in (("k", k), ("v", v)):
        if t.ndim != q.ndim:
            raise ValueError(
                f"{name} must have as many dims as q ({q.ndim}), got {t.ndim}-d "
                f"{shape_str(t.shape)} "
                f"for q {shape_str(q.shape)}"
            )
    batch = tuple(q.shape[:-3])
    if tuple(k.shape[:-3]) != batch or tuple(v.shape[:-3]) != batch:
        raise ValueError(
            f"q, k and v must share their batch dims (...): got q {shape_str(q.shape)}, "
            f"k {shape_str(k.shape)}, v {shape_str(v.shape)}"
        )
    num_heads, q_len, qk_dim = q.shape[-3:]
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
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"the heads of q (H={num_heads}) must be a multiple of the heads of k and v "
            f"(Hkv={num_kv_heads}); got q {shape_str(q.shape)}, k {shape_str(k.shape)}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"{name} must be float16, bfloat16, float32 or float64, got {_dtype_str(t.dtype)}"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            f"q, k and v must share a dtype, got q {_dtype_str(q.dtype)}, k {_dtype_str(k.dtype)}, "
            f"v {_dtype_str(v.dtype)}"
        )
    if not q.device == k.device == v.device:
        raise ValueError(
            f"q, k and v must be on one device, got q on {q.device}, k on {k.device}, "
            f"v on {v.device}"
        )

    scores = (*batch, num_heads, q_len, kv_len)
    legend = "(..., H, Tq, Tk)"
    if mask is not None:
        mask = check_mask("mask", mask, scores, legend)
        if mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
    if bias is not None:
        bias = _require_tensor("bias", bias)
        if not bias.is_floating_point():
            hint = "; a boolean mask belongs in mask=" if bias.dtype == torch.bool else ""
            raise TypeError(f"bias must be a float tensor, got {_dtype_str(bias.dtype)}{hint}")
        if bias.dtype != q.dtype:
            raise TypeError(
                f"bias must have the dtype of q ({_dtype_str(q.dtype)}), got "
                f"{_dtype_str(bias.dtype)}; use bias.to(q.dtype)"
            )
        check_broadcastable("bias", bias, scores, legend)
        if bias.device != q.device:
            raise ValueError(f"bias is on {bias.device} but q is on {q.device}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights must be a bool, got {return_weights!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(qk_dim) if qk_dim else 1.0
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {scale!r}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    dropout_p = check_probability("dropout_p", dropout_p)

    return AttentionCall(
        batch_shape=batch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        q_len=q_len,
        kv_len=kv_len,
        qk_dim=qk_dim,
        v_dim=v.shape[-1],
        dtype=q.dtype,
        device=q.device,
        mask_shape=None if mask is None else tuple(mask.shape),
        bias_shape=None if bias is None else tuple(bias.shape),
        bias_requires_grad=bias is not None and bias.requires_grad,
        causal=causal,
        scale=float(scale),
        dropout_p=float(dropout_p),
        return_weights=return_weights,
        requires_grad=any(t.requires_grad for t in (q, k, v))
        or (bias is not None and bias.requires_grad),
    )
