"""Ring attention as a registered backend, so modules that call ``attention()`` run it unchanged.

>>> import attnkit
>>> from attnkit.distributed import register_ring_backend
>>> register_ring_backend("ring", layout="zigzag")  # needs no process group yet
>>> "ring" in attnkit.available_backends()
True
>>> attnkit.unregister_backend("ring")

A model opts in by name, e.g. ``attnkit.MultiHeadAttention(512, 8, backend="ring")``, or with the
backend object itself, ``backend=attnkit.distributed.RingBackend(layout="zigzag")``.

Each rank then feeds the model its shard of the sequence (and its shard of a key padding mask);
every attention call of the model runs across the ranks. Position information must come from the
*global* positions: add it before sharding, as a rotary or positional table that starts at 0 on
every rank would not know where the rank's shard lies.
"""

from __future__ import annotations

from torch.distributed import ProcessGroup

from ..attention import register_backend
from .layout import Layout
from .ring import RingBackend

__all__ = ["register_ring_backend"]


def register_ring_backend(
    name: str = "ring",
    *,
    layout: str | Layout = "contiguous",
    group: ProcessGroup | None = None,
    replace: bool = False,
) -> None:
    """Register :func:`~attnkit.distributed.ring_attention` as backend ``name``.

    ``attention(q, k, v, ..., backend=name)`` then treats q, k, v and the mask as this rank's
    shards of a sequence laid out as ``layout`` across ``group`` (see ``ring_attention``). The
    backend is never picked by ``backend="auto"``: a model opts in by name, on every rank.
    Registering needs no process group; calling the backend does.
    """
    ring = RingBackend(layout=layout, group=group, name=name)
    register_backend(name, ring, auto=False, replace=replace)
