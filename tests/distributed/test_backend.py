"""``register_ring_backend``: ring attention under a name that ``attention()`` and the modules
take, with the layout and the process group it was registered with, never picked by ``auto``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import attnkit
from attnkit import masks
from attnkit.distributed import Layout, register_ring_backend

from .harness import run_ranks

B, H, HKV, T, D = 1, 4, 2, 24, 8


def _whole(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, T, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, T, D, generator=g, dtype=torch.float64)
    return q, k, v


def _errors(rank: int, name: str, layout: Layout) -> dict[str, float]:
    """The largest difference between this rank's output through backend ``name`` and its shard
    of the reference on the whole sequence, per mask."""
    q, k, v = _whole(0)
    shard = [layout.shard(t, rank) for t in (q, k, v)]
    errors = {}
    for label, mask in {
        "causal": masks.causal(),
        "window": masks.sliding_window(3),
        "window both ways": masks.sliding_window(2, right=5),
    }.items():
        got = attnkit.attention(*shard, mask=mask, backend=name)
        want = attnkit.attention(q, k, v, mask=mask, backend="reference")
        errors[label] = float((got - layout.shard(want, rank)).abs().max())
    return errors


def ranks_use_the_registered_layout_and_group(rank: int, world: int) -> dict[str, float]:
    """On 3 ranks: the backend registered with layout "zigzag" (by name, on the default group),
    then replaced by one with a Layout object on a group of ranks 1 and 2, each against the
    reference."""
    errors = {}
    register_ring_backend("ring-zz", layout="zigzag")
    try:
        for label, e in _errors(rank, "ring-zz", Layout.zigzag(world)).items():
            errors[f"zigzag {label}"] = e
        # The group's rank 0 (world rank 1) holds chunks 2 and 0, its rank 1 chunks 1 and 3:
        # neither contiguous nor zigzag.
        odd = Layout(((2, 0), (1, 3)))
        group = dist.new_group([1, 2])  # every rank takes part in making it
        register_ring_backend("ring-zz", layout=odd, group=group, replace=True)
        if rank > 0:
            for label, e in _errors(rank - 1, "ring-zz", odd).items():
                errors[f"odd layout on a group {label}"] = e
    finally:
        attnkit.unregister_backend("ring-zz")
    return errors


def test_the_registered_backend_runs_ring_attention_with_its_layout_and_group() -> None:
    everyone = run_ranks(ranks_use_the_registered_layout_and_group, 3)
    assert [len(errors) for errors in everyone] == [3, 6, 6]
    for rank, errors in enumerate(everyone):
        for label, error in errors.items():
            assert error < 1e-12, f"rank {rank}, {label}: {error}"


def test_registering_needs_no_process_group_and_auto_never_picks_it() -> None:
    assert not dist.is_initialized()
    register_ring_backend("ring-reg")
    try:
        assert "ring-reg" in attnkit.available_backends()
        q = torch.randn(1, 2, 8, 4)
        assert attnkit.explain(q, q, q, causal=True).chosen != "ring-reg"
        # Calling it is where a process group is needed, and the error says how to make one.
        with pytest.raises(RuntimeError, match=r"needs an initialised process group"):
            attnkit.attention(q, q, q, causal=True, backend="ring-reg")
    finally:
        attnkit.unregister_backend("ring-reg")
    assert "ring-reg" not in attnkit.available_backends()


def test_a_second_registration_under_one_name_needs_replace() -> None:
    register_ring_backend("ring-twice")
    try:
        with pytest.raises(
            ValueError, match=r"backend 'ring-twice' is already registered; pass replace=True"
        ):
            register_ring_backend("ring-twice", layout="zigzag")
        register_ring_backend("ring-twice", layout="zigzag", replace=True)
        assert attnkit.available_backends().count("ring-twice") == 1
    finally:
        attnkit.unregister_backend("ring-twice")
    with pytest.raises(ValueError, match=r"backend 'sdpa' is built in and cannot be replaced"):
        register_ring_backend("sdpa", replace=True)
