"""What the ranks say to each other: the ring's point-to-point exchange, and the agreement on the
arguments that comes before it.

Everything goes through ``torch.distributed`` (gloo on CPU, nccl on GPU); there is no transport of
our own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from .._checks import shape_str


def require_group(group: ProcessGroup | None, caller: str) -> None:
    """Raise ``RuntimeError`` unless torch.distributed is usable with ``group``."""
    if not dist.is_available():
        raise RuntimeError(f"{caller} needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{caller} needs an initialised process group: call "
            "torch.distributed.init_process_group() first (torchrun sets up its environment), "
            "e.g. init_process_group('gloo') on CPU or init_process_group('nccl') on GPUs"
        )
    if group is not None and not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {group!r}")


@dataclass
class Pending:
    """An exchange in flight; :meth:`wait` returns the tensors received from the previous rank."""

    requests: list[dist.Work]
    received: list[Tensor]
    sent: list[Tensor]  # kept alive until the sends complete

    def wait(self) -> list[Tensor]:
        for request in self.requests:
            request.wait()
        return self.received


class Ring:
    """The ranks of ``group`` in a ring: each sends to ``rank + 1``, receives from ``rank - 1``."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # P2POp wants global ranks, which differ from the group's own ranks in a subgroup.
        self._next = self._global((self.rank + 1) % self.world_size)
        self._prev = self._global((self.rank - 1) % self.world_size)

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def exchange(self, tensors: Sequence[Tensor]) -> Pending:
        """Start sending ``tensors`` to the next rank and receiving their likes from the previous.

        Every rank must call this in the same order with tensors of the same shapes; the send and
        the receive go in one batch, which nccl needs to avoid a deadlock. With one rank the
        tensors come straight back.
        """
        if self.world_size == 1:
            return Pending([], list(tensors), [])
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self._next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self._prev, self.group) for r in received]
        return Pending(list(dist.batch_isend_irecv(ops)), received, sent)


def agree(
    group: ProcessGroup | None,
    caller: str,
    local_error: str | None,
    description: dict[str, object],
    shape_fields: Sequence[str] = (),
) -> None:
    """Check on every rank at once that every rank accepted its arguments and described them alike.

    A rank that raised alone would leave the others waiting forever for blocks it never sends, so
    each rank first learns the others' verdicts (one small all-gather) and raises ``ValueError`` if
    any other rank rejected its arguments or described them differently. A rank whose own check
    failed (``local_error``, the message) returns and raises its own error. ``description`` maps
    names to plain values that must agree; mismatches in ``shape_fields`` add a hint about uneven
    shards.
    """
    world_size = dist.get_world_size(group)
    everyone: list[tuple[str | None, dict[str, object]] | None] = [None] * world_size
    dist.all_gather_object(everyone, (local_error, description), group=group)
    if local_error is not None:
        return
    verdicts = [entry for entry in everyone if entry is not None]
    for rank, (error, _) in enumerate(verdicts):
        if error is not None:
            raise ValueError(f"{caller}: rank {rank} rejected its arguments, so none ran: {error}")
    for name in description:
        values = [desc[name] for _, desc in verdicts]
        if any(value != values[0] for value in values):
            quoted = ", ".join(f"rank {r}: {_quote(value)}" for r, value in enumerate(values))
            hint = (
                " (each rank holds an equal shard: a sequence length that does not divide evenly "
                "by the world size gives unequal shards)"
                if name in shape_fields
                else ""
            )
            raise ValueError(f"{caller} needs the same {name} on every rank, got {quoted}{hint}")


def _quote(value: object) -> str:
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
        return shape_str(value)
    return repr(value)
