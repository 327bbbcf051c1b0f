"""What the ranks say to each other: point-to-point exchanges between peers, and the agreement on
the arguments that comes before any of them.

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

from .._base.checks import shape_str


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
    """An exchange in flight; :meth:`wait` returns the tensors received (empty when the exchange
    receives nothing)."""

    requests: list[dist.Work]
    received: list[Tensor]
    sent: list[Tensor]  # kept alive until the sends complete

    def wait(self) -> list[Tensor]:
        for request in self.requests:
            request.wait()
        self.requests, self.sent = [], []
        return self.received


def nbytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Peers:
    """The ranks of ``group``, exchanging tensors point to point: each exchange sends to at most
    one rank and receives from at most one, and counts the bytes it sends (:attr:`sent`)."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.sent = 0

    def _global(self, group_rank: int) -> int:
        # P2POp wants global ranks, which differ from the group's own ranks in a subgroup.
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def exchange(
        self,
        send_to: int | None,
        tensors: Sequence[Tensor],
        recv_from: int | None,
        likes: Sequence[Tensor],
        tag: int = 0,
    ) -> Pending:
        """Start sending ``tensors`` to rank ``send_to`` and receiving tensors shaped as ``likes``
        from rank ``recv_from`` (either may be None: nothing that way).

        The rank a tensor goes to must post the matching receive in the same order: every rank
        walks the same schedule. The send and the receive go in one batch, which nccl needs to
        avoid a deadlock. ``tag`` keeps apart messages of different kinds between two ranks
        (gloo matches messages by tag; nccl by order, which the schedule keeps).
        """
        ops = []
        sent: list[Tensor] = []
        received: list[Tensor] = []
        if send_to is not None:
            sent = [t.contiguous() for t in tensors]
            self.sent += nbytes(sent)
            peer = self._global(send_to)
            ops += [dist.P2POp(dist.isend, t, peer, self.group, tag) for t in sent]
        if recv_from is not None:
            received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in likes]
            peer = self._global(recv_from)
            ops += [dist.P2POp(dist.irecv, r, peer, self.group, tag) for r in received]
        requests = list(dist.batch_isend_irecv(ops)) if ops else []
        return Pending(requests, received, sent)


def agree(
    group: ProcessGroup | None,
    caller: str,
    local_error: str | None,
    description: dict[str, object],
    shape_fields: Sequence[str] = (),
    facts: object = None,
) -> list[object]:
    """Check on every rank at once that every rank accepted its arguments and described them alike.

    A rank that raised alone would leave the others waiting forever for blocks it never sends, so
    each rank first learns the others' verdicts (one small all-gather) and raises ``ValueError`` if
    any other rank rejected its arguments or described them differently. A rank whose own check
    failed (``local_error``, the message) returns and raises its own error. ``description`` maps
    names to plain values that must agree; mismatches in ``shape_fields`` add a hint about uneven
    shards. ``facts``: what this rank knows that may differ between ranks (whether its inputs are
    finite, its dropout seed), returned for every rank in rank order, from the same all-gather.
    """
    world_size = dist.get_world_size(group)
    everyone: list[tuple[str | None, dict[str, object], object] | None] = [None] * world_size
    dist.all_gather_object(everyone, (local_error, description, facts), group=group)
    verdicts = [entry for entry in everyone if entry is not None]
    if local_error is not None:
        return [f for _, _, f in verdicts]
    for rank, (error, _, _) in enumerate(verdicts):
        if error is not None:
            raise ValueError(f"{caller}: rank {rank} rejected its arguments, so none ran: {error}")
    for name in description:
        values = [desc[name] for _, desc, _ in verdicts]
        if any(value != values[0] for value in values):
            quoted = ", ".join(f"rank {r}: {_quote(value)}" for r, value in enumerate(values))
            hint = (
                " (each rank holds an equal shard: a sequence length that does not divide evenly "
                "by the world size gives unequal shards)"
                if name in shape_fields
                else ""
            )
            raise ValueError(f"{caller} needs the same {name} on every rank, got {quoted}{hint}")
    return [f for _, _, f in verdicts]


def _quote(value: object) -> str:
    if isinstance(value, tuple) and all(isinstance(v, int) for v in value):
        return shape_str(value)
    return repr(value)
