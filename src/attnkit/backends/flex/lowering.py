"""A call as FlexAttention's arguments: the lowering, and why a call has none.

:func:`lowering_refusal` says, from the call's description alone (on any device, ``meta``
included, reading no tensor), why FlexAttention cannot express a call; :func:`lower_call` writes
one it can as ``flex_attention``'s arguments: the mask as a ``mask_mod`` and its ``BlockMask``
from the call's block plan (:mod:`.mask_mod`, :mod:`.block_mask`), what the call adds to the
scores as one ``score_mod`` (:mod:`.score_mod`), the scale, grouped-query heads
(``enable_gqa``), the batch dims flattened. Sinks are folded in after the kernel
(:mod:`.sinks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..._call import AttentionCall
from ..._score_mod import ScoreMod
from .block_mask import BLOCK, block_mask
from .mask_mod import MaskMod, lower_mask, mask_refusal
from .score_mod import Added, lower_scores

__all__ = ["Lowered", "lower_call", "lowering_refusal"]


def lowering_refusal(call: AttentionCall) -> str | None:
    """Why FlexAttention cannot express ``call`` (None: it can), whatever the device: what it
    has no argument for (dropout, the weights, forward-mode derivatives), empty sizes, and a mask
    that has no ``mask_mod``. Reads no tensor data (a call on ``meta`` tensors is answered)."""
    reasons = []
    if call.return_weights:
        reasons.append(
            "FlexAttention returns no attention weights (return_weights=True: only reference does)"
        )
    if call.dropout_p:
        reasons.append(
            f"FlexAttention has no dropout (dropout_p={call.dropout_p}): attnkit's kernel "
            "(chunked) draws it under any mask"
        )
    if call.forward_ad:
        reasons.append(
            "FlexAttention computes no forward-mode derivative (torch.func.jvp, "
            "torch.autograd.forward_ad): reference does"
        )
    n = 1
    for s in call.batch_shape:
        n *= s
    sizes = (n, call.num_kv_heads, call.q_len, call.kv_len, call.qk_dim, call.v_dim)
    if 0 in sizes:
        reasons.append(
            "FlexAttention needs a batch row, a head, a query, a key and head sizes of 1 or more "
            f"(B={n}, Hkv={call.num_kv_heads}, Tq={call.q_len}, Tk={call.kv_len}, "
            f"Dk={call.qk_dim}, Dv={call.v_dim})"
        )
    why = mask_refusal(call.mask)
    if why is not None:
        reasons.append(why)
    return "; ".join(reasons) if reasons else None


@dataclass(frozen=True)
class Lowered:
    """``flex_attention``'s arguments for one call: ``q (B, H, Tq, Dk)``, ``k``, ``v (B, Hkv,
    Tk, D)`` with the batch dims flattened, the ``score_mod``, the ``block_mask`` (None: every
    pair), ``scale`` and ``enable_gqa``; ``mask_mod`` and ``added`` say what was lowered."""

    q: Tensor
    k: Tensor
    v: Tensor
    score_mod: ScoreMod | None
    block_mask: Any
    scale: float
    enable_gqa: bool
    mask_mod: MaskMod | None
    added: Added | None

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``flex_attention`` (but the return_aux request)."""
        return {
            "score_mod": self.score_mod,
            "block_mask": self.block_mask,
            "scale": self.scale,
            "enable_gqa": self.enable_gqa,
        }


def lower_call(
    call: AttentionCall,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    *,
    block: tuple[int, int] = (BLOCK, BLOCK),
) -> Lowered:
    """``call`` with its tensors as FlexAttention's arguments (see :class:`Lowered`); ``block``
    is the BlockMask's block of queries and of keys. A call :func:`lowering_refusal` refuses is
    a ``ValueError`` naming why."""
    why = lowering_refusal(call)
    if why is not None:
        raise ValueError(f"FlexAttention cannot express the call {call.describe()}: {why}")
    geo = call.geometry
    work = torch.promote_types(call.dtype, torch.float32)
    score_mod, added = lower_scores(call, bias, work)
    mask_mod, blocks = None, None
    if call.mask is not None:
        mask_mod = lower_mask(call.mask, geo)
        blocks = block_mask(call.mask, geo, mask_mod, groups=call.groups, block=block)

    def flat(t: Tensor) -> Tensor:
        return t.reshape(geo.batch, *t.shape[-3:])

    return Lowered(
        flat(q),
        flat(k),
        flat(v),
        score_mod,
        blocks,
        call.scale,
        call.num_kv_heads != call.num_heads,
        mask_mod,
        added,
    )
