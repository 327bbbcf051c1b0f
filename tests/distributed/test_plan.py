"""The shard plan: which ranks' queries meet which ranks' keys, asked of the mask once (no
processes needed)."""

from __future__ import annotations

import pytest
import torch

from attnkit import masks
from attnkit.distributed import Layout, ShardPlan
from attnkit.distributed.plan import UNIT
from attnkit.masks import Geometry


def geo(t: int, kv: int | None = None) -> Geometry:
    return Geometry((1,), 2, t, t if kv is None else kv, torch.device("cpu"))


def test_a_window_needs_the_last_keys_of_one_neighbour() -> None:
    plan = ShardPlan(masks.sliding_window(512), geo(4 * 8192), Layout.contiguous(4))
    for rank in range(4):
        for src in range(4):
            want = (8192 - 512, 8192) if src == rank - 1 else (0, 8192) if src == rank else None
            assert plan.needs(rank, src) == want, (rank, src)
    assert plan.distances() == [1]
    steps = plan.steps(2)
    assert [(s.send_to, s.send, s.recv_from, s.recv) for s in steps] == [
        (3, (7680, 8192), 1, (7680, 8192))
    ]
    assert plan.steps(3)[0].send_to is None  # the last rank's keys meet no later query
    assert [plan.keys_sent(r) for r in range(4)] == [512, 512, 512, 0]


def test_documents_inside_shards_need_no_exchange_and_crossing_ones_their_span() -> None:
    inside = ShardPlan(masks.documents([100, 924] * 4), geo(4096), Layout.zigzag(2))
    assert inside.distances() == []
    assert inside.steps(0) == []
    # A document from 900 to 1300 crosses contiguous shards of 1024: rank 1 needs rank 0's keys
    # from 900 (rounded down to UNIT), rank 0 needs rank 1's up to 1300 - 1024 (rounded up).
    crossing = ShardPlan(masks.documents([900, 400, 2796]), geo(4096), Layout.contiguous(4))
    assert crossing.needs(1, 0) == (900 // UNIT * UNIT, 1024)
    assert crossing.needs(0, 1) == (0, -(-276 // UNIT) * UNIT)
    assert crossing.needs(2, 0) is None
    assert crossing.distances() == [1, 2, 3]  # the last document spans ranks 1 to 3


def test_causal_zigzag_meets_every_rank_and_sends_half_shards() -> None:
    plan = ShardPlan(masks.causal(), geo(8 * 64), Layout.zigzag(4))
    assert plan.distances() == [1, 2, 3]
    # Rank 0 holds chunks 0 and 7: its first chunk is seen by every later rank, its last by none.
    assert [plan.needs(r, 0) for r in (1, 2, 3)] == [(0, 64)] * 3
    # Rank 3 holds chunks 3 and 4, both seen by rank 0's chunk 7.
    assert plan.needs(0, 3) == (0, 128)
    assert str(plan).splitlines()[1] == (
        "12 of 12 pairs of ranks meet, in 3 steps (distances 1, 2, 3); keys sent per rank: "
        "192, 256, 320, 384"
    )


def test_whole_sequence_key_padding_leaves_out_the_padding() -> None:
    plan = ShardPlan(masks.key_padding([1500]), geo(4096), Layout.contiguous(4))
    assert [plan.needs(r, 1) for r in range(4)] == [(0, 512)] * 4  # 1500 - 1024, rounded up
    assert [plan.needs(r, s) for r in range(4) for s in (2, 3)] == [None] * 8


@pytest.mark.parametrize("layout", [Layout.contiguous(3), Layout.zigzag(3)])
def test_every_pair_that_meets_is_in_the_plan(layout: Layout) -> None:
    # The plan must never leave out keys a query sees: check it against the dense mask.
    t = 6 * 40
    mask = masks.documents([50, 70, 10, 110]) & masks.sliding_window(30, right=5)
    plan = ShardPlan(mask, geo(t), layout)
    dense = mask.dense(t)[0, 0]
    c = t // layout.count
    for dst in range(3):
        rows = torch.cat([torch.arange(i * c, (i + 1) * c) for i in layout.chunks[dst]])
        for src in range(3):
            cols = torch.cat([torch.arange(i * c, (i + 1) * c) for i in layout.chunks[src]])
            seen = dense[rows][:, cols].any(0).nonzero().flatten()
            span = plan.needs(dst, src)
            if not len(seen):
                assert span is None
                continue
            assert span is not None
            assert span[0] <= int(seen[0])
            assert int(seen[-1]) < span[1]


def test_a_plan_draws_its_ranks() -> None:
    plan = ShardPlan(masks.documents([1024] * 2 + [2048]), geo(4096), Layout.contiguous(4))
    assert plan.picture() == "█···\n·█··\n··██\n··██"
    assert "0 of" not in plan.describe()
    assert repr(plan).startswith("ShardPlan(4 ranks, 4 chunks of 1024 queries")
