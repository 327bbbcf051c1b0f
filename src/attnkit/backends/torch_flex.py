"""The ``flex`` backend: a call with a ``score_mod`` or a ``mask_mod``, handed to torch's compiled
FlexAttention (``torch.nn.attention.flex_attention``) on CUDA.

(Not to be confused with :mod:`attnkit.flex`, FlexAttention's API on :func:`attnkit.attention`,
whose calls any backend that takes a ``score_mod`` may serve. The backend keeps the name ``flex``
in the registry, ``backend="flex"``: that names torch's FlexAttention, which is what serves the
call.)

There, torch compiles the score_mod and mask_mod into one fused kernel, forward and backward,
which beats attnkit's eager kernel (a Python call of the score_mod per tile). Everywhere else it
declines, and ``chunked`` serves the call: on the CPU torch's FlexAttention has no backward and its
eager form materialises the scores.

It serves calls whose mask is None or carries its ``mask_mod`` (the masks of
:mod:`attnkit.flex`), with nothing else added to the scores (no ``bias``, score term, softcap or
sinks: fold them into the score_mod), no dropout, no weights, and finite q, k and v (torch's
kernel does not keep masked NaN out of the gradients). It is in ``auto``'s order, after ``sdpa``
and before ``chunked``, where torch has CUDA and FlexAttention.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._call import AttentionCall
from .base import Backend, CallInputs, Output

__all__ = ["Flex", "flex_available"]

_LOCK = threading.Lock()
_COMPILED: list[Callable[..., Any]] = []


def _flex_module() -> Any | None:
    try:
        from torch.nn.attention import flex_attention
    except ImportError:  # a torch without FlexAttention
        return None
    return flex_attention


def flex_available() -> bool:
    """Whether torch has FlexAttention and CUDA, where this backend can serve calls."""
    return _flex_module() is not None and torch.cuda.is_available()


def _compiled() -> Callable[..., Any]:
    """``torch.compile(flex_attention)``, compiled once per process."""
    with _LOCK:
        if not _COMPILED:
            module = _flex_module()
            if module is None:
                raise RuntimeError("attnkit internal error: flex ran without FlexAttention")
            _COMPILED.append(torch.compile(module.flex_attention, dynamic=False))
        return _COMPILED[0]


def _mask_mod(call: AttentionCall) -> Callable[..., Tensor] | None:
    fn = getattr(call.mask, "mask_mod", None)
    return fn if callable(fn) else None


class Flex(Backend):
    """torch's compiled FlexAttention as a backend (see :mod:`attnkit.backends.torch_flex`)."""

    accepts_score_mod = True

    def __init__(self) -> None:
        super().__init__("flex")
        # torch's BlockMask of recent calls: made once per (mask_mod, sizes, device)
        self._block_masks: OrderedDict[tuple[object, ...], Any] = OrderedDict()

    def check(self, call: AttentionCall) -> list[str]:
        reasons = []
        if _flex_module() is None:
            reasons.append("this torch has no torch.nn.attention.flex_attention")
        if call.device.type != "cuda":
            reasons.append(
                f"torch's compiled FlexAttention is used on CUDA only; on {call.device.type} "
                "attnkit's kernel (chunked) serves score_mods and mask_mods, with gradients"
            )
        if call.mask is not None and _mask_mod(call) is None:
            reasons.append(
                f"the mask {call.mask.describe()} has no mask_mod (masks from attnkit.flex have)"
            )
        if call.score_mod is None and call.mask is None:
            reasons.append("no score_mod or mask_mod to compile (sdpa serves plain attention)")
        if call.bias_shape is not None or call.score_term is not None:
            reasons.append("does not add a bias or score term (fold it into the score_mod)")
        if call.softcap is not None:
            reasons.append("has no softcap argument (fold it into the score_mod)")
        if call.sinks:
            reasons.append("has no sinks")
        if call.dropout_p:
            reasons.append(f"has no dropout (dropout_p={call.dropout_p})")
        if call.return_weights:
            reasons.append("does not return attention weights (only reference does)")
        if call.finite is False:
            reasons.append(
                "q, k or v hold NaN/inf: torch's kernel would let masked ones into the gradients"
            )
        return reasons

    def notes(self, call: AttentionCall) -> list[str]:
        return ["torch.compile(flex_attention): compiles once per score_mod, mask_mod and shape"]

    def _block_mask(self, call: AttentionCall, n: int) -> Any | None:
        fn = _mask_mod(call)
        if fn is None:
            return None
        key = (fn, n, call.num_heads, call.q_len, call.kv_len, call.device)
        with _LOCK:
            found = self._block_masks.get(key)
            if found is not None:
                self._block_masks.move_to_end(key)
                return found
        module = _flex_module()
        if module is None:
            raise RuntimeError("attnkit internal error: flex ran without FlexAttention")
        made = module.create_block_mask(
            fn, n, call.num_heads, call.q_len, call.kv_len, device=call.device, _compile=True
        )
        with _LOCK:
            self._block_masks[key] = made
            while len(self._block_masks) > 8:
                self._block_masks.popitem(last=False)
        return made

    def run(self, call: AttentionCall, inputs: CallInputs) -> Output:
        module = _flex_module()
        if module is None:
            raise RuntimeError("attnkit internal error: flex ran without FlexAttention")
        n = 1
        for s in call.batch_shape:
            n *= s
        q = inputs.q.reshape(n, *inputs.q.shape[-3:])
        k = inputs.k.reshape(n, *inputs.k.shape[-3:])
        v = inputs.v.reshape(n, *inputs.v.shape[-3:])
        aux = module.AuxRequest(lse=True) if call.return_lse else None
        result = _compiled()(
            q,
            k,
            v,
            score_mod=call.score_mod,
            block_mask=self._block_mask(call, n),
            scale=call.scale,
            enable_gqa=call.num_kv_heads != call.num_heads,
            return_aux=aux,
        )
        out, extra = (result[0], result[1].lse) if aux is not None else (result, None)
        out = out.reshape(*call.batch_shape, *out.shape[1:])
        if extra is None:
            return out  # type: ignore[no-any-return]
        return out, extra.reshape(*call.batch_shape, *extra.shape[1:])
