"""What the ranks say to each other (``attnkit.distributed._comm``): point-to-point exchanges that
arrive whole, from the right rank, matched by tag and counted in bytes; the agreement on arguments
that makes every rank raise when one rank rejects its own; the checks of the process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from attnkit.distributed._comm import Peers, agree, nbytes, require_group

from .harness import run_ranks


def test_nbytes_counts_every_tensors_elements_at_their_size() -> None:
    tensors = [torch.zeros(2, 3), torch.zeros(5, dtype=torch.float16), torch.zeros(0, 4)]
    assert nbytes(tensors) == 2 * 3 * 4 + 5 * 2
    assert nbytes([torch.zeros(4, 6).t()]) == 4 * 6 * 4  # a view counts its own elements
    assert nbytes([]) == 0


def test_require_group_says_how_to_make_one() -> None:
    assert not dist.is_initialized()
    with pytest.raises(
        RuntimeError,
        match=r"^ring_attention needs an initialised process group: call "
        r"torch\.distributed\.init_process_group\(\) first",
    ):
        require_group(None, "ring_attention")


def test_require_group_refuses_what_is_not_a_process_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    require_group(None, "ulysses_attention")  # the default group
    with pytest.raises(
        TypeError, match=r"group must be a torch.distributed ProcessGroup or None, got \[0, 1\]"
    ):
        require_group([0, 1], "ulysses_attention")  # type: ignore[arg-type]


def _message(sender: int, tag: int) -> torch.Tensor:
    """What ``sender`` sends under ``tag``: a non-contiguous view, so the send must copy it."""
    return (torch.arange(12.0).view(3, 4) + 100 * sender + 10 * tag).t()


def ranks_exchange(rank: int, world: int) -> dict[str, object]:
    """On 3 ranks: a ring exchange, two tags in flight at once, one-way exchanges, and an
    exchange within the group of world ranks 1 and 2."""
    peers = Peers(None)
    assert (peers.rank, peers.world_size) == (rank, world)
    like = [torch.empty(4, 3), torch.empty(2, dtype=torch.int64)]
    ints = torch.tensor([rank, -rank])
    got = peers.exchange((rank + 1) % world, [_message(rank, 0), ints], (rank - 1) % world, like)
    before = (rank - 1) % world
    received = got.wait()
    assert torch.equal(received[0], _message(before, 0))
    assert torch.equal(received[1], torch.tensor([before, -before]))
    assert peers.sent == 12 * 4 + 2 * 8

    # Two messages of one shape between the same ranks, received in the opposite order to the
    # one they were sent in: the tags keep them apart.
    if rank == 0:
        first = peers.exchange(1, [_message(0, 1)], None, [], tag=1)
        second = peers.exchange(1, [_message(0, 2)], None, [], tag=2)
        assert first.wait() == []
        assert second.wait() == []
    elif rank == 1:
        second = peers.exchange(None, [], 0, [torch.empty(4, 3)], tag=2)
        first = peers.exchange(None, [], 0, [torch.empty(4, 3)], tag=1)
        assert torch.equal(second.wait()[0], _message(0, 2))
        assert torch.equal(first.wait()[0], _message(0, 1))
    nothing = peers.exchange(None, [_message(rank, 0)], None, like)
    assert nothing.requests == []
    assert nothing.wait() == []

    # Within a group the peers are the group's ranks; the messages go to the world's ranks.
    group = dist.new_group([1, 2])
    if rank > 0:
        inner = Peers(group)
        me = rank - 1
        assert (inner.rank, inner.world_size) == (me, 2)
        pending = inner.exchange(1 - me, [_message(rank, 3)], 1 - me, [torch.empty(4, 3)], tag=3)
        assert torch.equal(pending.wait()[0], _message(3 - rank, 3))
        assert inner.sent == 12 * 4
    return {"sent": peers.sent}


def ranks_talk(rank: int, world: int) -> tuple[dict[str, object], list[str]]:
    """Both conversations in one start of the ranks."""
    return ranks_exchange(rank, world), ranks_agree(rank, world)


@pytest.fixture(scope="module")
def talks() -> list[tuple[dict[str, object], list[str]]]:
    return run_ranks(ranks_talk, 3)


def test_exchanges_arrive_whole_from_the_right_rank(
    talks: list[tuple[dict[str, object], list[str]]],
) -> None:
    sent = [exchanged["sent"] for exchanged, _ in talks]
    # Rank 0 sent two more messages of 12 floats (the tags); a one-way exchange that sends to
    # nobody counts nothing.
    assert sent == [12 * 4 + 2 * 8 + 2 * 12 * 4, 12 * 4 + 2 * 8, 12 * 4 + 2 * 8]


def ranks_agree(rank: int, world: int) -> list[str]:
    """On 3 ranks: what ``agree`` returns and raises, one outcome per case, in this rank's
    words."""
    outcomes = []
    description = {"heads": 8, "shape": (2, 8, 16, 64)}
    facts = agree(None, "f", None, description, facts={"finite": rank != 2})
    outcomes.append(f"facts {facts}")

    own = "q must be 4-D" if rank == 1 else None
    try:
        facts = agree(None, "f", own, description, facts=rank)
        outcomes.append(f"returned {facts}")
    except ValueError as e:
        outcomes.append(str(e))

    uneven = {"heads": 8, "shape": (2, 8, 16 + (rank == 2), 64)}
    for shape_fields in ((), ("shape",)):
        try:
            agree(None, "f", None, uneven, shape_fields=shape_fields)
            outcomes.append("no error")
        except ValueError as e:
            outcomes.append(str(e))
    return outcomes


def test_every_rank_raises_when_one_rejects_or_they_disagree(
    talks: list[tuple[dict[str, object], list[str]]],
) -> None:
    ranks = [agreed for _, agreed in talks]
    facts = "facts [{'finite': True}, {'finite': True}, {'finite': False}]"
    assert [r[0] for r in ranks] == [facts] * 3
    # The rank that rejected its arguments returns (and raises its own error); the others raise.
    rejected = "f: rank 1 rejected its arguments, so none ran: q must be 4-D"
    assert [r[1] for r in ranks] == [rejected, "returned [0, 1, 2]", rejected]
    shapes = "rank 0: (2, 8, 16, 64), rank 1: (2, 8, 16, 64), rank 2: (2, 8, 17, 64)"
    plain = f"f needs the same shape on every rank, got {shapes}"
    assert [r[2] for r in ranks] == [plain] * 3
    hint = " (each rank holds an equal shard: a sequence length that does not divide evenly"
    assert all(r[3].startswith(plain + hint) for r in ranks)
