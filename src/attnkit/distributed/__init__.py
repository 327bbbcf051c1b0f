"""Attention over a sequence split across processes, on ``torch.distributed`` (gloo, nccl).

* :func:`ring_attention`: exact attention, forward and backward, with each rank holding an equal
  shard of the sequence; ranks send each other the keys their queries meet.
* :class:`Layout`, :func:`shard_zigzag` / :func:`unshard_zigzag`: which positions each rank
  holds; the zigzag layout balances causal work.
* :class:`ShardPlan`: which ranks' queries meet which ranks' keys, and what they send.
* :class:`RingBackend` / :func:`register_ring_backend`: ring attention as an ``attention()``
  backend, so that modules such as :class:`attnkit.MultiHeadAttention` run it.

Importing this package needs no process group; calling :func:`ring_attention` does.
"""

from .backend import register_ring_backend
from .layout import Layout, shard_zigzag, unshard_zigzag
from .plan import ShardPlan
from .ring import RingBackend, ring_attention

__all__ = [
    "Layout",
    "RingBackend",
    "ShardPlan",
    "register_ring_backend",
    "ring_attention",
    "shard_zigzag",
    "unshard_zigzag",
]
