"""Attention over a sequence split across processes, on ``torch.distributed`` (gloo, nccl).

* :func:`ring_attention`: exact attention, forward and backward, with each rank holding an equal
  shard of the sequence; ranks send each other the keys their queries meet.
* :class:`Layout`, :func:`shard_zigzag` / :func:`unshard_zigzag`: which positions each rank
  holds; the zigzag layout balances causal work, :func:`balance_documents` packed documents'.
* :class:`ShardPlan`: which ranks' queries meet which ranks' keys, and what they send.
* :func:`ulysses_attention`: the same call by an all-to-all over heads (and, with more ranks than
  heads, the all-to-all within groups of ranks and the ring across them).
* :func:`parallel_attention` and :func:`explain`: the strategy that sends the least, and why.
* :func:`cost`: each strategy's modelled bytes, messages, arithmetic and time per rank on a
  :class:`Hardware` (:data:`GPU_NODES`, :data:`CPU_GLOO`), from 2 to thousands of ranks.
* :class:`RingBackend` / :func:`register_ring_backend`, :class:`UlyssesBackend`: the strategies
  as ``attention()`` backends, so that modules such as :class:`attnkit.MultiHeadAttention` run
  them.
* :func:`sequence_parallel` and :class:`SequenceParallel`: a model's modules (attention, relative
  attention, the Conformer with its convolution and BatchNorm) on one rank's shard of the
  sequence.

Importing this package needs no process group; calling :func:`ring_attention` does.
"""

from .backend import register_ring_backend
from .costs import CPU_GLOO, GPU_NODES, INFINIBAND, NVLINK, Cost, Hardware, Link
from .layout import Layout, balance_documents, shard_zigzag, unshard_zigzag
from .plan import ShardPlan
from .ring import RingBackend, ring_attention
from .sequence import SequenceParallel, sequence_parallel
from .strategy import Strategy, cost, explain, parallel_attention
from .ulysses import UlyssesBackend, ulysses_attention

__all__ = [
    "CPU_GLOO",
    "GPU_NODES",
    "INFINIBAND",
    "NVLINK",
    "Cost",
    "Hardware",
    "Layout",
    "Link",
    "RingBackend",
    "SequenceParallel",
    "ShardPlan",
    "Strategy",
    "UlyssesBackend",
    "balance_documents",
    "cost",
    "explain",
    "parallel_attention",
    "register_ring_backend",
    "ring_attention",
    "sequence_parallel",
    "shard_zigzag",
    "ulysses_attention",
    "unshard_zigzag",
]
