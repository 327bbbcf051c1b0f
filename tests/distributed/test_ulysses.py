"""ulysses_attention (the all-to-all over heads, and its hybrid with the ring) and
parallel_attention on 2, 3 and 4 gloo ranks against attention() in one process.

The checks run in tests/distributed/test_ring.py's one run of 4 processes
(:func:`ulysses_checks`, called for each group there); the tests below read their report.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import attnkit
from attnkit import BackendError
from attnkit.distributed import (
    UlyssesBackend,
    parallel_attention,
    ring_attention,
    ulysses_attention,
)

from .harness import run_ranks
from .test_ring import (
    DK,
    DV,
    HKV,
    B,
    H,
    T,
    compare,
    error_message,
    failure_of,
    long_and_seeded,
    ranks_of,
    whole_inputs,
)

# Every case of test_ring.py's CASES that does not drop out (the all-to-all leaves dropout to the
# ring), with every kind of mask, term and modifier.
CASES = [
    "no mask",
    "top-left causal",
    "documents & causal",
    "key_padding (whole lengths)",
    "from_fn",
    "dense key mask | documents",
    "position term, window",
    "ALiBi, causal",
    "distance bias, documents",
    "return_lse",
    "score_mod",
    "position term, softcap, sinks, documents & causal",
]
# With 2 heads on 4 ranks: all-to-all within pairs of ranks, the ring across them.
HYBRID = ["causal", "dense key mask & window", "position term, softcap, sinks, documents & causal"]


def ulysses_checks(rank: int, world: int, group: dist.ProcessGroup | None) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for layout in ("contiguous", "zigzag"):
        for case in CASES:
            _, sent, chosen = compare(case, rank, world, layout, group, strategy=ulysses_attention)
            report[layout, case] = (chosen, sent)
    if world == 4:
        x = whole_inputs(torch.float64, heads=2)
        for case in HYBRID:
            for layout in ("contiguous", "zigzag"):
                _, sent, chosen = compare(
                    case, rank, world, layout, group, inputs=x, strategy=ulysses_attention
                )
                report["hybrid", layout, case] = (chosen, sent)
    for case in ("window left and right", "causal", "dropout"):
        _, _, chosen = compare(case, rank, world, "zigzag", group, strategy=parallel_attention)
        report["parallel", case] = chosen[0]
    # A call the all-to-all cannot serve is refused on every rank before anything moves.
    q = torch.zeros(1, H, 4, DK)
    try:
        attnkit.attention(q, q, q, dropout_p=0.1, backend=UlyssesBackend(group=group))
    except BackendError as e:
        report["dropout"] = str(e)
    return report


WORLDS = pytest.mark.parametrize("world", [2, 3, 4])


@WORLDS
def test_every_case_equals_one_process(world: int) -> None:
    # Asserted in each rank (output, lse, every gradient); here: every case ran.
    for report in ranks_of(world):
        got = report["ulysses"]
        assert all((layout, case) in got for layout in ("contiguous", "zigzag") for case in CASES)


@WORLDS
def test_the_all_to_all_moves_its_share_of_q_k_v_and_the_output(world: int) -> None:
    for report in ranks_of(world):
        chosen, sent = report["ulysses"]["contiguous", "no mask"]
        if world == 3:  # 4 heads do not divide among 3 ranks: no head to split, the ring alone
            assert chosen == ["ulysses", "ring"]
            continue
        # (W-1)/W of q, k and v (the 2 key/value heads repeated to 4 where they do not divide)
        # and of the output; the call in one process runs on each rank's heads.
        kv_heads = HKV if HKV % world == 0 else H
        elements = B * (H * T // world * (DK + DV) + kv_heads * T // world * (DK + DV))
        assert sent["forward"] == elements * 8 * (world - 1) // world
        assert chosen[0] == "ulysses"
        assert chosen[1] != "ring"


def test_more_ranks_than_heads_exchange_heads_in_groups_and_ring_across_them() -> None:
    for report in ranks_of(4):
        hybrid = {k: v for k, v in report["ulysses"].items() if k[0] == "hybrid"}
        assert len(hybrid) == 2 * len(HYBRID)
        for key, (chosen, sent) in hybrid.items():
            assert chosen[:2] == ["ulysses", "ring"], key
            assert sent["forward"] > 0


@WORLDS
def test_parallel_attention_takes_the_strategy_explain_names(world: int) -> None:
    for report in ranks_of(world):
        got = report["ulysses"]
        # A window sends a neighbour a few keys; dropout runs on the ring only.
        assert got["parallel", "window left and right"] == "ring"
        assert got["parallel", "dropout"] == "ring"
        assert got["parallel", "causal"] in ("ring", "ulysses")
        assert "dropout: a rank computing some heads" in got["dropout"]


def seeded_apart_checks(
    rank: int, world: int, group: dist.ProcessGroup | None, seed: int
) -> dict[tuple[str, ...], str | None]:
    """parallel_attention with dropout on ranks seeded ``seed`` each (rank 0's: 7), against one
    process under rank 0's seed; run by test_ring.py's groups of 2 ranks. None: it agreed."""
    report: dict[tuple[str, ...], str | None] = {}
    for layout in ("contiguous", "zigzag"):
        for case in ("dropout", "dropout, position term"):
            report["parallel seeded apart", layout, case] = failure_of(
                compare, case, rank, world, layout, group, strategy=parallel_attention,
                rank_seed=seed,
            )  # fmt: skip
    return report


@pytest.mark.parametrize("case", ["dropout", "dropout, position term"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_parallel_attention_drops_out_under_rank_0s_seed(layout: str, case: str) -> None:
    # The ranks seeded apart: parallel_attention (the ring, for dropout) equals one process under
    # the seed of the group's first rank, as ring_attention promises.
    for r, report in enumerate(long_and_seeded()):
        assert report["parallel seeded apart", layout, case] is None, f"rank {r % 2}"


def empty_and_odd_calls(rank: int, world: int) -> dict[str, Any]:
    """The all-to-all on calls with no rows (B = 0, T = 0) and on zigzag shards of an odd
    length, which its chunks cannot cut; both strategies given other sinks on each rank, and
    under torch.autocast: the outputs (with their lse) or the errors."""
    report: dict[str, Any] = {}
    for name, shape in (("B=0", (0, 2, 4, 3)), ("T=0", (1, 2, 0, 3))):
        q = torch.randn(*shape, dtype=torch.float64)
        v = torch.randn(*shape[:-1], 5, dtype=torch.float64)
        for strategy in (ulysses_attention, parallel_attention):
            got = strategy(q, q, v, return_lse=True, layout="zigzag")
            assert isinstance(got, tuple)
            report[name, strategy.__name__] = (tuple(got[0].shape), tuple(got[1].shape))
    odd = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    for strategy in (ulysses_attention, parallel_attention):
        report["odd", strategy.__name__] = error_message(
            lambda f=strategy: f(odd, odd, odd, layout="zigzag")
        )
    # Sinks are held whole by every rank: a rank with other values would weigh its rows apart.
    q = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    sinks = torch.tensor([0.5, float(rank)], dtype=torch.float64)
    for strategy in (ring_attention, ulysses_attention):
        report["sinks", strategy.__name__] = error_message(
            lambda f=strategy: f(q, q, q, sinks=sinks)
        )
    # Under torch.autocast, as attention(): the inputs in bfloat16, the output too.
    g = torch.Generator().manual_seed(3)
    whole = [torch.randn(1, 2, 8, 4, generator=g) for _ in range(3)]
    want = attnkit.attention(*(t.bfloat16().double() for t in whole), causal=True)
    for strategy in (ring_attention, ulysses_attention, parallel_attention):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = strategy(*(t.chunk(world, -2)[rank] for t in whole), causal=True)
        error = (got.double() - want.chunk(world, -2)[rank]).abs().max().item()
        report["autocast", strategy.__name__] = (got.dtype, error < 2e-2)
    return report


def test_edge_calls_give_attentions_result_or_a_clear_error() -> None:
    # No rows, odd zigzag shards, other sinks on each rank, torch.autocast.
    for report in run_ranks(empty_and_odd_calls, 2):
        for strategy in ("ulysses_attention", "parallel_attention"):
            # Empty outputs of the call's shape (their value is all there is: nothing).
            assert report["B=0", strategy] == ((0, 2, 4, 5), (0, 2, 4))
            assert report["T=0", strategy] == ((1, 2, 0, 5), (1, 2, 0))
            # Shards of 3 rows cannot be cut into zigzag's 2 chunks per rank: every strategy
            # says so, rather than reshaping the exchanged rows wrongly.
            message = report["odd", strategy]
            assert message.startswith("ValueError"), message
            assert "must divide by 2, got Tq=3 and Tk=3" in message, message
        for strategy in ("ring_attention", "ulysses_attention", "parallel_attention"):
            assert report["autocast", strategy] == (torch.bfloat16, True), strategy
        for strategy in ("ring_attention", "ulysses_attention"):
            assert report["sinks", strategy] == (
                f"ValueError: {strategy} needs the same sinks on every rank, got rank 0: "
                "[0.5, 0.0], rank 1: [0.5, 1.0]"
            )
