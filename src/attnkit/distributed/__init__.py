"""Attention over a sequence split across processes, on ``torch.distributed`` (gloo, nccl).

* :func:`ring_attention`: exact attention, forward and backward, with each rank holding an equal
  shard of the sequence; k/v blocks travel around the ring of ranks.
* :func:`shard_zigzag` / :func:`unshard_zigzag`: the layout that balances causal work.
* :class:`RingBackend` / :func:`register_ring_backend`: ring attention as an ``attention()``
  backend, so that modules such as :class:`attnkit.MultiHeadAttention` run it.

Importing this package needs no process group; calling :func:`ring_attention` does.
"""

from .backend import register_ring_backend
from .layout import shard_zigzag, unshard_zigzag
from .ring import RingBackend, ring_attention

__all__ = [
    "RingBackend",
    "register_ring_backend",
    "ring_attention",
    "shard_zigzag",
    "unshard_zigzag",
]
