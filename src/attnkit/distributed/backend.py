"""Ring attention as a registered backend, so modules that call ``attention()`` run it unchanged.

>>> import attnkit
>>> from attnkit.distributed import register_ring_backend
>>> register_ring_backend("ring", layout="zigzag")  # needs no process group yet
>>> "ring" in attnkit.available_backends()
True
>>> attnkit.unregister_backend("ring")

A model opts in by name, e.g. ``attnkit.MultiHeadAttention(512, 8, backend="ring")``.

Each rank then feeds the model its shard of the sequence (and its shard of a key padding mask);
every attention call of the model goes around the ring. Position information must come from the
*global* positions: add it before sharding, as a rotary or positional table that starts at 0 on
every rank would not know where the rank's shard lies.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed import ProcessGroup

from .._checks import AttentionCall
from ..attention import register_backend
from .layout import LAYOUTS
from .ring import ring_attention

__all__ = ["register_ring_backend"]


def _check(call: AttentionCall) -> list[str]:
    """Why the ring backend cannot serve a call (empty when it can)."""
    reasons = []
    if call.bias_shape is not None:
        reasons.append("no bias: a (Tq, Tk) bias cannot be sharded along with the keys")
    if call.dropout_p:
        reasons.append("no dropout")
    if call.return_weights:
        reasons.append("no weights: they would be the whole sequence's (Tq, Tk) matrix")
    if call.mask_shape is not None and len(call.mask_shape) >= 2 and call.mask_shape[-2] != 1:
        reasons.append(
            "key masks only (..., 1, Tk): a mask that depends on the query cannot travel"
        )
    if call.causal and call.q_len != call.kv_len:
        reasons.append(f"causal needs Tq = Tk on each rank, got {call.q_len} and {call.kv_len}")
    return reasons


def register_ring_backend(
    name: str = "ring",
    *,
    layout: str = "contiguous",
    group: ProcessGroup | None = None,
    replace: bool = False,
) -> None:
    """Register :func:`~attnkit.distributed.ring_attention` as backend ``name``.

    ``attention(q, k, v, ..., backend=name)`` then treats q, k, v and the mask as this rank's
    shards of a sequence laid out as ``layout`` across ``group`` (see ``ring_attention``). The
    backend is never picked by ``backend="auto"``: a model opts in by name, on every rank.
    Registering needs no process group; calling the backend does.
    """
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")

    def ring(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        causal: bool,
        scale: float,
        dropout_p: float,
        return_weights: bool,
    ) -> Tensor:
        # _check has turned away bias, dropout and weights before the registry calls this.
        return ring_attention(
            q, k, v, causal=causal, mask=mask, layout=layout, scale=scale, group=group
        )

    register_backend(name, ring, check=_check, auto=False, replace=replace)
