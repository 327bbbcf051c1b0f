"""ring_attention on 2 and 3 gloo ranks against single-process attention, in float64.

Spawning ranks costs seconds, so each world size gets one run that makes every check
(:func:`ring_checks`); the test functions below read its report.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import jaxtyping
import pytest
import torch
import torch.distributed as dist

import attnkit
from attnkit import masks
from attnkit._kernel import fused, problem
from attnkit.distributed import RingBackend, ring_attention, shard_zigzag
from attnkit.testing import assert_close

from .harness import run_ranks

B, H, HKV, DK, DV = 2, 4, 2, 8, 6  # grouped-query attention, Dv != Dk
CHUNK = 5  # T = 2 * W * CHUNK: zigzag chunks of 5, contiguous shards of 10


def full_inputs(t: int, dtype: torch.dtype, seed: int = 0, dv: int = DV) -> dict[str, torch.Tensor]:
    """The whole sequence's q, k, v, output gradient and a key mask (the same on every rank).

    Batch 0 pads its last 3 keys; batch 1 pads its first half, so under causality its first
    queries see no key at all (their output and gradients must be 0, not NaN).
    """
    g = torch.Generator().manual_seed(seed)
    pad = torch.cat(
        [
            masks.padding_mask([t - 3], max_len=t),
            masks.padding_mask([t // 2 - 1], max_len=t, side="left"),
        ]
    )
    return {
        "q": torch.randn(B, H, t, DK, generator=g).to(dtype),
        "k": torch.randn(B, HKV, t, DK, generator=g).to(dtype),
        "v": torch.randn(B, HKV, t, dv, generator=g).to(dtype),
        "dout": torch.randn(B, H, t, dv, generator=g).to(dtype),
        "mask": pad,
    }


def shard(x: torch.Tensor, layout: str, rank: int, world: int, dim: int = -2) -> torch.Tensor:
    if layout == "zigzag":
        return shard_zigzag(x, rank, world, dim=dim)
    return x.chunk(world, dim)[rank]


def compare_with_single_process(
    rank: int,
    world: int,
    *,
    layout: str,
    causal: bool,
    masked: bool,
    dtype: torch.dtype = torch.float64,
    group: dist.ProcessGroup | None = None,
    ring: RingBackend | None = None,
    window: int | None = None,
    dv: int = DV,
) -> None:
    """This rank's output and q/k/v gradients equal its shard of the whole sequence's, through
    ``ring_attention`` or through ``attention()`` with the backend ``ring``."""
    t = 2 * world * CHUNK
    x = full_inputs(t, dtype, dv=dv)
    mask = x["mask"] if masked else None
    band = None if window is None else masks.sliding_window(window, right=1)
    spec_mask = mask if band is None else (band if mask is None else band & mask)
    # The spec: float64 reference attention on the whole sequence, on the same rounded inputs.
    whole = {n: x[n].double().clone().requires_grad_() for n in ("q", "k", "v")}
    want = attnkit.attention(
        whole["q"], whole["k"], whole["v"], mask=spec_mask, causal=causal, backend="reference"
    )
    want.backward(x["dout"].double())

    local = {n: shard(x[n], layout, rank, world).clone().requires_grad_() for n in ("q", "k", "v")}
    local_mask = None if mask is None else shard(mask, layout, rank, world, dim=-1)
    if band is not None:  # a structured mask: every rank asks it at global positions
        local_mask = band if local_mask is None else band & local_mask
    if ring is None:
        got = ring_attention(
            local["q"],
            local["k"],
            local["v"],
            causal=causal,
            mask=local_mask,
            layout=layout,
            group=group,
        )
    else:
        got = attnkit.attention(
            local["q"], local["k"], local["v"], causal=causal, mask=local_mask, backend=ring
        )
    got.backward(shard(x["dout"], layout, rank, world))
    case = f"layout={layout} causal={causal} masked={masked} {dtype}, rank {rank} of {world}"
    pairs = [("output", got, want)] + [
        (f"d{n}", local[n].grad, whole[n].grad) for n in ("q", "k", "v")
    ]
    for what, actual, expected in pairs:
        assert actual is not None
        assert expected is not None
        expected = shard(expected, layout, rank, world)
        assert actual.dtype == dtype, (case, what)
        if dtype == torch.float64:
            torch.testing.assert_close(
                actual, expected, atol=1e-8, rtol=1e-8, msg=lambda m, w=what: f"{case}, {w}: {m}"
            )
        else:
            assert_close(actual, expected)


def count_score_blocks(rank: int, world: int, layout: str, causal: bool) -> int:
    """Score blocks this rank computes for one forward, with CHUNK x CHUNK blocks and tiles."""
    computed = []
    original = problem.Problem.scores

    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        computed.append(1)
        return original(self, *args, **kwargs)

    t = 2 * world * CHUNK
    x = full_inputs(t, torch.float64)
    ring = RingBackend(layout=layout, block_q=CHUNK, block_k=CHUNK, tile_blocks=(1, 1, 1))
    problem.Problem.scores = counting  # type: ignore[method-assign]
    try:
        attnkit.attention(
            *(shard(x[n], layout, rank, world) for n in ("q", "k", "v")),
            causal=causal,
            backend=ring,
        )
    finally:
        problem.Problem.scores = original  # type: ignore[method-assign]
    return sum(computed)


def count_plans(rank: int, world: int) -> tuple[int, int]:
    """Block plans made by one windowed, padded zigzag call's forward, and by its backward."""
    from attnkit.distributed import ring as ring_module

    made = []
    original = ring_module.make_plan

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return original(*args, **kwargs)

    t = 2 * world * CHUNK
    x = full_inputs(t, torch.float64)
    local = {n: shard(x[n], "zigzag", rank, world).requires_grad_() for n in ("q", "k", "v")}
    mask = masks.sliding_window(4, right=1) & shard(x["mask"], "zigzag", rank, world, dim=-1)
    ring = RingBackend(layout="zigzag", block_q=4, block_k=3)
    ring_module.make_plan = counting  # type: ignore[assignment]
    try:
        out = attnkit.attention(local["q"], local["k"], local["v"], mask=mask, backend=ring)
        forward = len(made)
        out.backward(shard(x["dout"], "zigzag", rank, world))
    finally:
        ring_module.make_plan = original
    return forward, len(made) - forward


def largest_saved_numel(rank: int, world: int) -> int:
    """The largest tensor the autograd graph keeps for one causal zigzag call, in elements."""
    t = 2 * world * CHUNK
    x = full_inputs(t, torch.float64)
    local = [shard(x[n], "zigzag", rank, world).clone().requires_grad_() for n in ("q", "k", "v")]
    sizes: list[int] = []

    def pack(saved: torch.Tensor) -> torch.Tensor:
        sizes.append(saved.numel())
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved):
        ring_attention(*local, causal=True, layout="zigzag", mask=None)
    return max(sizes)


def error_message(call: Callable[[], object]) -> str:
    """The ``TypeError``/``ValueError`` a call raises, as ``'TypeName: message'``."""
    try:
        call()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("no error raised")


def bad_calls(rank: int, world: int) -> dict[str, str]:
    """Calls that must fail on every rank, promptly: the messages each rank raised."""
    x = full_inputs(2 * world * CHUNK, torch.float64)
    q, k, v = (shard(x[n], "contiguous", rank, world) for n in ("q", "k", "v"))
    uneven_q = x["q"][..., :-1, :].chunk(world, -2)[rank]  # T - 1 does not divide by W
    errors = {
        "uneven": error_message(
            lambda: ring_attention(uneven_q, uneven_q[:, :HKV], uneven_q[:, :HKV])
        ),
        "one rank's bad mask": error_message(
            lambda: ring_attention(q, k, v, mask=torch.ones(q.size(-2)) if rank == 1 else None)
        ),
        "causal differs": error_message(lambda: ring_attention(q, k, v, causal=rank == 0)),
        "odd zigzag": error_message(
            lambda: ring_attention(q[..., 1:, :], k[..., 1:, :], v[..., 1:, :], layout="zigzag")
        ),
        "query mask": error_message(
            lambda: ring_attention(
                q, k, v, mask=torch.ones(q.size(-2), k.size(-2), dtype=torch.bool)
            )
        ),
    }
    # Nothing was left in flight: the ring still works after every rank raised.
    compare_with_single_process(rank, world, layout="contiguous", causal=False, masked=False)
    return errors


def ring_checks(rank: int, world: int) -> dict[str, Any]:
    """Every check of one world size, in one spawned run (see the module docstring)."""
    # Blocks of 4 queries by 3 keys, with ragged ends against the chunk size of 5: every piece of
    # the ring spans several blocks, and with one block per tile, several tiles.
    for tiles in ((1, 1, 1), (4, 16, 4)):
        for layout in ("contiguous", "zigzag"):
            ring = RingBackend(layout=layout, block_q=4, block_k=3, tile_blocks=tiles)
            for causal in (False, True):
                for masked in (False, True):
                    compare_with_single_process(
                        rank, world, layout=layout, causal=causal, masked=masked, ring=ring
                    )
    compare_with_single_process(
        rank, world, layout="zigzag", causal=True, masked=True, dtype=torch.float32
    )
    # Fully visible stretches through torch's fused CPU kernel (which needs Dv = Dk), merged with
    # the partial blocks around them (and, in the backward, given the call's final output and lse).
    real = fused._FUSED
    assert real is not None
    fused_calls = [0, 0]

    def counted(i: int) -> Callable[..., Any]:
        def op(*args: Any, **kw: Any) -> Any:
            fused_calls[i] += 1
            return real[i](*args, **kw)

        return op

    fused._FUSED = (counted(0), counted(1))
    try:
        for layout in ("contiguous", "zigzag"):
            ring = RingBackend(layout=layout, block_q=4, block_k=3, fused_rows=4)
            for causal in (False, True):
                for masked in (False, True):
                    compare_with_single_process(
                        rank, world, layout=layout, causal=causal, masked=masked, ring=ring, dv=DK
                    )
    finally:
        fused._FUSED = real
    for layout in ("contiguous", "zigzag"):  # a window across shards, with and without padding
        ring = RingBackend(layout=layout, block_q=4, block_k=3)
        for masked in (False, True):
            compare_with_single_process(
                rank, world, layout=layout, causal=False, masked=masked, ring=ring, window=4
            )
    if world == 3:  # a subgroup: ranks 1 and 2 form a ring of their own
        pair = dist.new_group([1, 2])
        if rank > 0:
            compare_with_single_process(
                rank - 1, 2, layout="zigzag", causal=True, masked=True, group=pair
            )
        dist.barrier()
    report: dict[str, Any] = {"saved": largest_saved_numel(rank, world), "fused": fused_calls}
    report["plans"] = count_plans(rank, world)
    report["blocks"] = {
        (layout, causal): count_score_blocks(rank, world, layout, causal)
        for layout in ("contiguous", "zigzag")
        for causal in (False, True)
    }
    jaxtyping.config.update("jaxtyping_disable", True)  # attnkit's own checks, on every rank
    report["errors"] = bad_calls(rank, world)
    return report


@functools.cache
def reports(world: int) -> list[dict[str, Any]]:
    return run_ranks(ring_checks, world)


WORLDS = pytest.mark.parametrize("world", [2, 3])


@WORLDS
def test_output_and_gradients_equal_single_process(world: int) -> None:
    # Plain, causal, zigzag, padded, float32, a subgroup: compare_with_single_process asserts in
    # each rank; a failure there fails this test with the rank's traceback.
    assert len(reports(world)) == world
    # ... and the runs with fused stretches did go through torch's fused kernel, both ways.
    for report in reports(world):
        assert min(report["fused"]) > 0, report["fused"]


@WORLDS
def test_causal_skips_blocks_above_the_diagonal_and_zigzag_balances_them(world: int) -> None:
    blocks = [r["blocks"] for r in reports(world)]
    # Each rank holds 2 chunks; blocks are chunk x chunk. Without causality, 2 x 2W blocks each.
    assert [b["contiguous", False] for b in blocks] == [4 * world] * world
    assert [b["zigzag", False] for b in blocks] == [4 * world] * world
    # Contiguous: rank r's own block is a 2 x 2 triangle (3 blocks) plus r whole earlier shards.
    assert [b["contiguous", True] for b in blocks] == [3 + 4 * r for r in range(world)]
    # Zigzag: the same total, spread evenly: 3 on the diagonal and half of each other shard.
    assert [b["zigzag", True] for b in blocks] == [3 + 2 * (world - 1)] * world


@WORLDS
def test_the_backward_reuses_the_forwards_block_plans(world: int) -> None:
    for forward, backward in (r["plans"] for r in reports(world)):
        assert forward > 0
        assert backward == 0


@WORLDS
def test_autograd_keeps_only_this_ranks_shard(world: int) -> None:
    local = B * H * 2 * CHUNK * DK  # one rank's q; the whole sequence's is W times larger
    assert all(r["saved"] <= local for r in reports(world))


@WORLDS
def test_bad_arguments_raise_on_every_rank_instead_of_hanging(world: int) -> None:
    errors = [r["errors"] for r in reports(world)]
    shards = [(2 * world * CHUNK - 1 + world - 1 - r) // world for r in range(world)]
    for r, e in enumerate(errors):
        assert e["uneven"].startswith("ValueError: ring_attention needs the same q shape")
        assert f"rank {world - 1}: ({B}, {H}, {shards[-1]}, {DK})" in e["uneven"]
        assert "does not divide evenly" in e["uneven"]
        assert e["causal differs"] == (
            "ValueError: ring_attention needs the same mask on every rank, got "
            + ", ".join(f"rank {i}: {repr('causal()') if i == 0 else None}" for i in range(world))
        )
        assert "local lengths must be even, got Tq=9 and Tk=9" in e["odd zigzag"]
        assert e["query mask"].startswith("ValueError: ring_attention: key masks only (..., 1, Tk)")
        bad_mask = e["one rank's bad mask"]
        if r == 1:
            assert bad_mask.startswith("TypeError: mask must be a bool tensor, got float32")
        else:
            assert re.match(
                r"ValueError: ring_attention: rank 1 rejected its arguments, so none ran: "
                r"mask must be a bool tensor, got float32",
                bad_mask,
            )


def test_no_process_group_is_a_clear_error() -> None:
    assert not dist.is_initialized()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match=r"needs an initialised process group: call "):
        ring_attention(q, q, q)


def test_importing_attnkit_needs_no_process_group() -> None:
    assert attnkit.distributed.ring_attention is ring_attention
    assert not dist.is_initialized()
