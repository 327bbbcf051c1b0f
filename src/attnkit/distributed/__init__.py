"""Attention over a sequence split across processes, on ``torch.distributed`` (gloo, nccl).

* :func:`ring_attention`: exact attention, forward and backward, with each rank holding an equal
  shard of the sequence; k/v blocks travel around the ring of ranks.
* :func:`shard_zigzag` / :func:`unshard_zigzag`: the layout that balances causal work.

Importing this package needs no process group; calling :func:`ring_attention` does.
"""

from .layout import shard_zigzag, unshard_zigzag
from .ring import ring_attention

__all__ = ["ring_attention", "shard_zigzag", "unshard_zigzag"]
