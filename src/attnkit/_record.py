"""What :func:`~attnkit.record_dispatch` records: each call's backend, its hand-overs and the
kernel that served it.

The dispatcher appends one :class:`Dispatch` per call; a backend that hands a call over adds the
hand-over to it, and the chunked backend's kernel says which kernel ran (the native one, or the
eager one and why). Inside compiled and exported graphs, where the dispatcher ran while tracing,
attnkit's operator appends the record when it runs.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

from ._call import AttentionCall

__all__ = [
    "Dispatch",
    "begin_call",
    "current",
    "end_call",
    "note_handover",
    "note_kernel",
    "note_served",
    "record_dispatch",
    "recording",
]


@dataclass
class Dispatch:
    """One :func:`~attnkit.attention` call as :func:`record_dispatch` saw it: the backend chosen,
    and every hand-over from one backend to another with its reason, in order."""

    call: AttentionCall
    chosen: str
    handovers: list[tuple[str, str, str]] = field(default_factory=list)  # (from, to, why)
    #: the kernel that computed the output, where the backend says (the chunked backend: "native
    #: kernel", or "the eager kernel (why)", the words explain() uses)
    kernel: str | None = None
    #: bytes this process sent to the others of a process group for the call, by pass
    #: (``"forward"``, then ``"backward"`` once it has run): what attnkit.distributed's
    #: strategies exchange; empty for a call in one process
    sent: dict[str, int] = field(default_factory=dict)

    @property
    def served_by(self) -> str:
        """The backend that computed the output."""
        return self.handovers[-1][1] if self.handovers else self.chosen


# The records of the blocks open in this context, innermost last (the one calls go to).
_RECORD: contextvars.ContextVar[tuple[list[Dispatch], ...]] = contextvars.ContextVar(
    "attnkit_dispatch_record", default=()
)


@contextlib.contextmanager
def record_dispatch() -> Iterator[list[Dispatch]]:
    """Record every :func:`~attnkit.attention` call in the block: which backend was chosen and
    which (after a hand-over) served it.

    >>> import torch, attnkit
    >>> q = torch.randn(1, 2, 8, 4)
    >>> with attnkit.record_dispatch() as calls:
    ...     _ = attnkit.attention(q, q, q, softcap=5.0)
    >>> [(c.chosen, c.served_by) for c in calls]
    [('chunked', 'chunked')]

    A block belongs to the context that opened it (a :mod:`contextvars` context): calls of
    other threads are not recorded, unless they run in a copy of it (``asyncio.to_thread``
    makes one), where each call's record holds its own kernel and hand-overs. Calls go to the
    innermost block open. Blocks closed out of order (two generators, each with a block open
    around its ``yield``, run in turns) each remove their own record: once a block is closed
    nothing more is added to its record, and calls go to the blocks still open.
    """
    record: list[Dispatch] = []
    _RECORD.set((*_RECORD.get(), record))
    try:
        yield record
    finally:
        # (by identity rather than ContextVar.reset(): a reset restores the value this block
        # found, which holds a block closed since, and would leave it recording)
        _RECORD.set(tuple(r for r in _RECORD.get() if r is not record))


def recording() -> list[Dispatch] | None:
    """The active record of :func:`record_dispatch`, if any (what the dispatcher appends to)."""
    records = _RECORD.get()
    return records[-1] if records else None


# The record of the call the dispatcher runs in this context, which notes of its kernel and
# hand-overs go to: not the record's last entry, which a call in another thread that shares the
# record (asyncio.to_thread copies the context, the record with it) may have appended since.
_CALL: contextvars.ContextVar[Dispatch | None] = contextvars.ContextVar(
    "attnkit_dispatch_call", default=None
)


def begin_call(call: AttentionCall, chosen: str) -> contextvars.Token[Dispatch | None] | None:
    """Where a record is open, append the call that backend ``chosen`` is about to serve, and
    make it the call that notes go to in this context until :func:`end_call` (the dispatcher
    does, around ``backend.run``); None where nothing is recorded."""
    record = recording()
    if record is None:
        return None
    dispatch = Dispatch(call, chosen)
    record.append(dispatch)
    return _CALL.set(dispatch)


def end_call(token: contextvars.Token[Dispatch | None] | None) -> None:
    """Undo :func:`begin_call`."""
    if token is not None:
        _CALL.reset(token)


def current() -> Dispatch | None:
    """The record of the call being dispatched, if one is being recorded (a distributed call
    keeps it, to add its backward's bytes to :attr:`Dispatch.sent` when that runs): the one
    :func:`begin_call` made in this context, else (a call served without the dispatcher) the
    record's last."""
    noted = _CALL.get()
    if noted is not None:
        return noted
    record = recording()
    return record[-1] if record else None


def note_kernel(kernel: str) -> None:
    """Record which kernel serves the call being recorded (see :attr:`Dispatch.kernel`)."""
    noted = current()
    if noted is not None:
        noted.kernel = kernel


def note_handover(source: str, to: str, why: str) -> None:
    """Record that backend ``source`` handed the call being recorded to ``to``, and why."""
    noted = current()
    if noted is not None:
        noted.handovers.append((source, to, why))


def note_served(call: AttentionCall, by: str, kernel: str) -> None:
    """Record a call that ``by`` served without the dispatcher, as :func:`attnkit.attention` would
    have been asked it (a KV cache that the native kernel reads in place, see
    :mod:`attnkit._kernel.cache`)."""
    record = recording()
    if record is not None:
        record.append(Dispatch(call, by, kernel=kernel))
