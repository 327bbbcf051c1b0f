"""``SequenceShards``: what a module needs to know when it holds one rank's shard of a sequence.

:func:`attnkit.distributed.sequence_parallel` sets a module's ``sequence_shards`` to an object
that answers this protocol (:class:`attnkit.distributed.SequenceParallel`); it is ``None`` in one
process. The modules read it, so that they need not import the process-group code:

* attention runs across the ranks (:meth:`SequenceShards.attention`), with masks and score terms
  that describe the whole sequence;
* positions are the whole sequence's (:meth:`SequenceShards.segments`): rotary angles, the
  relative module's distances;
* a convolution over time reads its neighbours' frames (:meth:`SequenceShards.halo`);
* statistics over the sequence (BatchNorm's) are sums over every rank
  (:meth:`SequenceShards.all_reduce`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from ..masks import Mask
from ..scores import ScoreTerm

__all__ = ["SequenceShards"]


@runtime_checkable
class SequenceShards(Protocol):
    """One rank's place in a sequence split across the ranks of a process group."""

    @property
    def world_size(self) -> int:
        """The number of ranks the sequence is split across."""
        ...

    def segments(self, length: int) -> list[tuple[int, int, int]]:
        """The runs of consecutive positions this rank holds, ``(local start, global start,
        length)``, for a shard of ``length`` positions."""
        ...

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | Mask | None,
        bias: ScoreTerm | None,
        causal: bool,
        scale: float | None,
        sinks: Tensor | None,
        dropout_p: float,
        return_lse: bool,
        softcap: float | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """This rank's shard of :func:`attnkit.attention` on the whole sequence."""
        ...

    def halo(self, x: Tensor, reach: int) -> list[Tensor]:
        """Each segment of ``x`` (``(..., T)``, time last) with ``reach`` frames of the whole
        sequence on either side (zeros past its ends): ``(..., n + 2 reach)`` per segment."""
        ...

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of ``x`` over the ranks, differentiable."""
        ...
