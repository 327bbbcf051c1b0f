"""explain(): which strategy runs a call across ranks, and why (no processes needed)."""

from __future__ import annotations

import re

import pytest
import torch

from attnkit import masks
from attnkit.distributed import GPU_NODES, cost, explain
from attnkit.scores import RelativePositionTerm


def shard(heads: int, t: int = 2048, device: str = "meta") -> torch.Tensor:
    return torch.empty(1, heads, t, 64, device=device)


def test_a_short_reach_takes_the_ring_a_long_one_the_all_to_all() -> None:
    q = shard(8)
    window = explain(q, q, q, mask=masks.sliding_window(256), world_size=4)
    assert window.chosen == "ring"
    # A window of 256 over shards of 2048: k and v of 256 keys, 8 heads of 64, float32.
    assert window.sent["ring"] == 256 * 8 * 128 * 4
    # The all-to-all: 3/4 of q, k, v and the output.
    assert window.sent["ulysses"] == 4 * 2048 * 8 * 64 * 4 * 3 // 4
    causal = explain(q, q, q, causal=True, layout="zigzag", world_size=4)
    assert causal.chosen == "ulysses"
    assert causal.sent["ring"] == 6144 * 8 * 128 * 4  # rank 3: its whole shard to 3 ranks
    inside = explain(q, q, q, mask=masks.documents([1024] * 8), world_size=4)
    assert (inside.chosen, inside.sent["ring"]) == ("ring", 0)


def test_more_ranks_than_heads_take_the_hybrid_and_dropout_the_ring() -> None:
    q = shard(2)
    found = explain(q, q, q, causal=True, world_size=4)
    assert found.chosen == "hybrid"
    assert "the 2 heads do not divide among the 4 ranks" in found.reasons["ulysses"][0]
    dropped = explain(q, q, q, causal=True, world_size=4, dropout_p=0.1)
    assert dropped.chosen == "ring"
    assert dropped.sent["ulysses"] is None
    assert "ulysses  cannot: dropout" in str(dropped)


def test_the_kernel_line_says_dropout_across_ranks_runs_the_eager_kernel() -> None:
    q = shard(2, 256, "cpu")
    dropped = explain(q, q, q, causal=True, world_size=4, dropout_p=0.1)
    assert str(dropped).splitlines()[-1] == (
        "each rank's kernel: the eager kernel (dropout across ranks)"
    )
    plain = explain(q, q, q, causal=True, world_size=4)
    assert str(plain).splitlines()[-1] == "each rank's kernel: native kernel"


def test_the_report_names_every_strategy_and_draws_the_ring() -> None:
    q = shard(4, 64, "cpu")
    qv = torch.empty(1, 4, 64, 8)
    enc = torch.empty(4, 4 * 128 - 1, 8)
    text = str(
        explain(
            q, q, q, bias=RelativePositionTerm(qv, enc, 1.0), causal=True, world_size=2,
            strategy="ring",
        )
    )  # fmt: skip
    lines = text.splitlines()
    assert lines[1] == "ring picks: ring"
    assert lines[2].startswith("  ring     chosen: sends ")
    assert lines[3].startswith("  ulysses  could serve it: sends ")
    assert "ShardPlan: 2 ranks, 2 chunks of 64 queries and 64 keys (contiguous)" in text
    assert lines[-1] == "each rank's kernel: native kernel"


def test_explain_errors_quote_values() -> None:
    q = shard(4)
    with pytest.raises(ValueError, match=r"strategy must be one of 'auto', 'ring', 'ulysses', "):
        explain(q, q, q, world_size=2, strategy="mesh")
    with pytest.raises(ValueError, match=r"explain\(\) needs world_size=, or an initialised"):
        explain(q, q, q)
    with pytest.raises(ValueError, match=r"covers 100 positions but the call has Tk = 4096"):
        explain(q, q, q, mask=masks.documents([100]), world_size=2)


def test_with_a_hardware_the_report_says_each_strategys_modelled_time() -> None:
    from attnkit.distributed import GPU_NODES, cost

    q = shard(8)
    found = explain(q, q, q, causal=True, layout="zigzag", world_size=4, hardware=GPU_NODES)
    lines = str(found).splitlines()
    at = lines.index(f"modelled per call on {GPU_NODES.name} (forward):")
    ring, ulysses = found.costs["ring"], found.costs["ulysses"]
    assert ring is not None
    assert ulysses is not None
    assert lines[at + 1].startswith("  ring     ")
    assert lines[at + 2].startswith("  ulysses  ")
    assert found.costs == cost(
        q, q, q, causal=True, layout="zigzag", world_size=4, hardware=GPU_NODES
    )
    # The bytes the choice is made by are the model's.
    assert found.sent["ring"] == max(ring.sent)
    assert found.sent["ulysses"] == max(ulysses.sent)
    assert "modelled" not in str(explain(q, q, q, causal=True, world_size=4))


@pytest.mark.parametrize(
    ("world_size", "exc", "message"),
    [
        (0, ValueError, "world_size must be >= 1, got 0"),
        (-2, ValueError, "world_size must be >= 1, got -2"),
        (1.5, TypeError, "world_size must be an int, got 1.5"),
        (4.0, TypeError, "world_size must be an int, got 4.0"),
        (True, TypeError, "world_size must be an int, got True"),
        ("4", TypeError, "world_size must be an int, got '4'"),
    ],
)
def test_a_world_size_that_is_no_count_of_ranks_is_refused(
    world_size: object, exc: type[Exception], message: str
) -> None:
    """explain() and cost() take world_size from the caller: a count of ranks, from 1. Zero used
    to speak of "[] chunks per rank", True of "attention across True ranks"."""
    q = shard(4, 64)
    with pytest.raises(exc, match=re.escape(message)):
        explain(q, q, q, world_size=world_size)  # type: ignore[arg-type]
    with pytest.raises(exc, match=re.escape(message)):
        cost(q, q, q, world_size=world_size, hardware=GPU_NODES)  # type: ignore[arg-type]
    assert explain(q, q, q, world_size=1).chosen is not None  # one rank is a world


def test_a_shard_that_the_layouts_chunks_do_not_cut_is_refused_by_every_strategy() -> None:
    # Zigzag gives each rank two chunks: a local length of 7 cannot be cut into them, for the
    # all-to-all (which reorders the chunks into the whole sequence) as for the ring.
    q = shard(4, t=7)
    found = explain(q, q, q, layout="zigzag", world_size=2)
    assert found.chosen is None
    for name in ("ring", "ulysses"):
        assert any("divide by 2, got Tq=7 and Tk=7" in r for r in found.reasons[name]), name
    assert explain(
        shard(4, t=8), shard(4, t=8), shard(4, t=8), layout="zigzag", world_size=2
    ).chosen


def test_a_hardware_that_is_not_one_is_a_type_error() -> None:
    q = shard(4)
    with pytest.raises(TypeError, match=r"hardware must be an attnkit\.distributed\.Hardware"):
        explain(q, q, q, world_size=2, hardware="gpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="backward must be a bool"):
        explain(q, q, q, world_size=2, hardware=GPU_NODES, backward=1)  # type: ignore[arg-type]
