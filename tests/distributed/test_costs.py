"""The cost model: its bytes are what the ranks send (gloo groups of 2, 3 and 4 processes), and
its times behave as the strategies do."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch

from attnkit import masks
from attnkit.distributed import CPU_GLOO, GPU_NODES, Hardware, Link, cost

from .harness import run_ranks

SHARD, D = 256, 8
HEADS = {2: 6, 3: 6, 4: 4}  # heads divide among the ranks: the all-to-all serves every case
HYBRID_HEADS = 2  # fewer heads than 4 ranks: the all-to-all within pairs, the ring across them


def cases(world: int) -> dict[str, tuple[dict[str, Any], str]]:
    t = SHARD * world
    inside = [SHARD // 2 - 28, SHARD // 2 + 28] * world  # within the chunks of both layouts
    crossing = [t // 3, t // 2, t - t // 3 - t // 2]
    return {
        "causal": ({"causal": True}, "zigzag"),
        "causal, contiguous": ({"causal": True}, "contiguous"),
        "window 100": ({"mask": masks.sliding_window(100)}, "contiguous"),
        "window 100, zigzag": ({"mask": masks.sliding_window(100, right=30)}, "zigzag"),
        "documents inside shards": ({"mask": masks.documents(inside)}, "contiguous"),
        "documents across shards": (
            {"mask": masks.documents(crossing) & masks.causal()},
            "contiguous",
        ),
    }


def sent_by_the_ranks(rank: int, world: int, group: Any) -> dict[str, dict[str, list[int]]]:
    """Forward and backward bytes this rank's calls record, per case and strategy, in a group of
    ``world`` ranks (the hybrid: on the whole world's group only)."""
    import functools

    import attnkit
    from attnkit.distributed import ring_attention, ulysses_attention

    out: dict[str, dict[str, list[int]]] = {}
    strategies = {
        "ring": functools.partial(ring_attention, group=group),
        "ulysses": functools.partial(ulysses_attention, group=group),
    }
    for heads, names in ((HEADS[world], ("ring", "ulysses")), (HYBRID_HEADS, ("hybrid",))):
        if "hybrid" in names and world != 4:
            continue
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(1, heads, SHARD, D, generator=g) for _ in range(3))
        for case, (kwargs, layout) in cases(world).items():
            for name in names:
                fn = strategies["ulysses" if name == "hybrid" else name]
                leaves = [x.clone().requires_grad_() for x in (q, k, v)]
                with attnkit.record_dispatch() as record:
                    fn(*leaves, **kwargs, layout=layout).sum().backward()
                fwd = sum(r.sent.get("forward", 0) for r in record)
                bwd = sum(r.sent.get("backward", 0) for r in record)
                out[f"{case} {name}"] = {"forward": [fwd], "backward": [bwd]}
    return out


def every_group(rank: int, world: int) -> dict[int, dict[str, dict[str, list[int]]]]:
    """Groups of 2 side by side, then 3 ranks, then all 4, in one run of 4 processes."""
    import torch.distributed as dist

    assert world == 4
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    three = dist.new_group([0, 1, 2])
    out = {2: sent_by_the_ranks(rank % 2, 2, pairs[rank // 2])}
    if rank < 3:
        out[3] = sent_by_the_ranks(rank, 3, three)
    out[4] = sent_by_the_ranks(rank, 4, None)
    return out


@functools.cache
def reports() -> list[dict[int, dict[str, dict[str, list[int]]]]]:
    # Rank 3 waits for the group of 3 in its next collective: a generous timeout.
    return run_ranks(every_group, 4, timeout=300, group_timeout=200)


def measured(world: int) -> dict[str, dict[str, list[int]]]:
    """Each case's bytes on every rank of one group of ``world`` ranks (the first pair for 2)."""
    ranks = [r[world] for r in reports() if world in r][:world]
    return {
        key: {p: [r[key][p][0] for r in ranks] for p in ("forward", "backward")} for key in ranks[0]
    }


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_models_bytes_are_what_each_rank_sends(world: int) -> None:
    got = measured(world)
    for case, (kwargs, layout) in cases(world).items():
        runs = [(HEADS[world], ("ring", "ulysses"))]
        if world == 4:
            runs.append((HYBRID_HEADS, ("hybrid",)))
        for heads, names in runs:
            q = torch.empty(1, heads, SHARD, D, device="meta")
            model = cost(
                q, q, q, **kwargs, layout=layout, world_size=world, hardware=CPU_GLOO,
                backward=True,
            )  # fmt: skip
            for name in names:
                c = model[name]
                assert c is not None, (case, name)
                want = got[f"{case} {name}"]
                assert list(c.sent) == want["forward"], (case, name)
                assert list(c.sent_backward) == want["backward"], (case, name)
    # The figures say what they should: documents inside the shards exchange nothing on the ring.
    assert got["documents inside shards ring"]["forward"] == [0] * world
    assert got["window 100 ring"]["forward"][0] > 0


def shard(heads: int = 8, t: int = 2048, d: int = 64) -> torch.Tensor:
    return torch.empty(1, heads, t, d, device="meta")


def test_a_windows_traffic_per_rank_does_not_grow_with_the_ranks() -> None:
    q = shard()
    sent = []
    for world in (2, 4, 16, 64):
        c = cost(q, q, q, mask=masks.sliding_window(256), world_size=world, hardware=GPU_NODES)
        ring = c["ring"]
        assert ring is not None
        sent.append(max(ring.sent))
        assert ring.steps == 1  # one neighbour, however many ranks
    assert sent == [256 * 8 * 128 * 4] * 4


def test_the_all_to_alls_bytes_per_rank_fall_as_one_over_w_at_a_fixed_length() -> None:
    t = 8192
    for world in (2, 4, 8):
        q = shard(heads=8, t=t // world)
        c = cost(q, q, q, causal=True, world_size=world, hardware=GPU_NODES)["ulysses"]
        assert c is not None
        # q, k, v and the output of one shard, (W - 1) / W of it.
        assert max(c.sent) == 4 * (t // world) * 8 * 64 * 4 * (world - 1) // world
        assert c.messages == 4 * (world - 1)


def test_the_ring_hides_its_messages_behind_arithmetic_until_they_outlast_it() -> None:
    q = shard()
    cpu = dataclasses.replace(CPU_GLOO, overhead=0.0)
    fast = dataclasses.replace(cpu, local=Link("instant", 1e30, 0.0))
    fast = dataclasses.replace(fast, remote=fast.local)
    slow = dataclasses.replace(cpu, local=Link("slow", 1e6, 0.0))
    slow = dataclasses.replace(slow, remote=slow.local)
    for hw in (fast, cpu, slow):
        ring = cost(q, q, q, world_size=4, hardware=hw)["ring"]
        assert ring is not None
        assert ring.seconds >= ring.compute
        assert ring.seconds <= ring.compute + ring.communication + 1e-9
    # The host's share of a call, once per pass.
    with_host = cost(q, q, q, world_size=4, hardware=CPU_GLOO, backward=True)["ring"]
    without = cost(q, q, q, world_size=4, hardware=cpu, backward=True)["ring"]
    assert with_host is not None
    assert without is not None
    assert with_host.seconds - without.seconds == pytest.approx(2 * CPU_GLOO.overhead)
    # Instant links: the call is its arithmetic. Slow ones: its messages, one step after another.
    ring = cost(q, q, q, world_size=4, hardware=fast)["ring"]
    assert ring is not None
    assert ring.seconds == pytest.approx(ring.compute)
    ring = cost(q, q, q, world_size=4, hardware=slow)["ring"]
    assert ring is not None
    one_shard = 2048 * 8 * 128 * 4
    assert ring.seconds > 3 * one_shard / 1e6
    # Arithmetic: 4 * H * D FLOP per visible pair, the whole shard against every shard.
    assert ring.compute == pytest.approx(4 * 8 * 64 * 2048 * 8192 / CPU_GLOO.flops)


def test_documents_within_shards_cost_their_arithmetic_only() -> None:
    q = shard()
    c = cost(
        q, q, q, mask=masks.documents([1024] * 8), world_size=4, hardware=GPU_NODES, backward=True
    )["ring"]
    assert c is not None
    assert (c.sent, c.sent_backward, c.steps) == ((0,) * 4, (0,) * 4, 0)
    assert c.exposed == pytest.approx(0.0, abs=1e-4)  # the argument check's latency only


def test_between_nodes_the_slower_link_sets_the_ring_and_the_all_to_all() -> None:
    q = shard(heads=16)
    one_node = Hardware("one node", 1e30, GPU_NODES.local, GPU_NODES.remote, 16)
    two_nodes = dataclasses.replace(one_node, ranks_per_node=8)
    for name in ("ring", "ulysses"):
        a = cost(q, q, q, world_size=16, hardware=one_node)[name]
        b = cost(q, q, q, world_size=16, hardware=two_nodes)[name]
        assert a is not None
        assert b is not None
        assert b.seconds > 1.5 * a.seconds, name


def test_more_ranks_than_heads_model_the_hybrid_only() -> None:
    q = shard(heads=4)
    c = cost(q, q, q, causal=True, layout="zigzag", world_size=16, hardware=GPU_NODES)
    assert c["ulysses"] is None
    hybrid = c["hybrid"]
    assert hybrid is not None
    # The all-to-all within groups of 4, then the ring across 4 groups.
    assert hybrid.steps == 4 + 3
