"""The shared block protocol: ``Geometry``, ``band_visibility`` (against a loop over pairs),
``block_edges``, ``block_reduce`` and ``states_from``."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnkit.masks._blocks import (
    EMPTY,
    FULL,
    PARTIAL,
    Geometry,
    band_visibility,
    block_edges,
    block_reduce,
    states_from,
)

CPU = torch.device("cpu")


def test_geometry_places_queries_bottom_right() -> None:
    geo = Geometry((2, 3), 4, 3, 7, CPU)
    assert geo.batch == 6
    assert geo.shift == 4
    assert geo.dtype == torch.float32
    assert geo.q_positions(1, 3).tolist() == [[5], [6]]  # the last query sits at the last key
    assert geo.k_positions(2, 5).tolist() == [[2, 3, 4]]
    assert Geometry((), 1, 5, 2, CPU).q_positions(0, 5).flatten().tolist() == [-3, -2, -1, 0, 1]
    assert Geometry((), 1, 0, 0, CPU).batch == 1  # no batch dims: one row


bounds = st.one_of(st.just(math.inf), st.integers(0, 6).map(float))


@given(tq=st.integers(0, 8), tk=st.integers(0, 8), left=bounds, right=bounds)
def test_band_visibility_is_the_loop_over_pairs(
    tq: int, tk: int, left: float, right: float
) -> None:
    geo = Geometry((), 1, tq, tk, CPU)
    got = band_visibility(geo.q_positions(0, tq), geo.k_positions(0, tk), -left, right)
    want = [[-left <= j - (i + tk - tq) <= right for j in range(tk)] for i in range(tq)]
    assert got.dtype == torch.bool
    assert got.expand(tq, tk).tolist() == want


def test_causal_is_the_band_minus_infinity_to_zero() -> None:
    i, j = torch.arange(4).unsqueeze(-1), torch.arange(4)
    assert torch.equal(
        band_visibility(i, j, -math.inf, 0), torch.ones(4, 4, dtype=torch.bool).tril()
    )
    assert bool(band_visibility(i, j, -math.inf, math.inf).all())


@pytest.mark.parametrize(("start", "stop", "block"), [(0, 10, 4), (3, 9, 3), (5, 6, 8), (0, 8, 8)])
def test_block_edges_cover_the_range_once(start: int, stop: int, block: int) -> None:
    first, last = block_edges(start, stop, block)
    covered = [
        p for a, b in zip(first.tolist(), last.tolist(), strict=True) for p in range(a, b + 1)
    ]
    assert covered == list(range(start, stop))
    assert all(b - a + 1 <= block for a, b in zip(first.tolist(), last.tolist(), strict=True))


@given(
    n=st.integers(1, 13),
    block=st.integers(1, 5),
    start=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_block_reduce_is_any_and_all_of_each_block(
    n: int, block: int, start: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(3, n, 2, generator=g) < 0.5
    anys, alls = block_reduce(t, start, start + n, block, dim=1)
    blocks = range(0, n, block)
    assert anys.shape == alls.shape == (3, len(blocks), 2)
    for b, lo in enumerate(blocks):
        part = t[:, lo : lo + block]
        assert torch.equal(anys[:, b], part.any(1))
        assert torch.equal(alls[:, b], part.all(1))


def test_block_reduce_broadcasts_a_size_one_dim() -> None:
    t = torch.tensor([[True], [False]])  # (2, 1): the same for every key
    anys, alls = block_reduce(t, 0, 10, 4, dim=1)
    assert anys.tolist() == alls.tolist() == [[True] * 3, [False] * 3]


def test_states_from_empty_and_full() -> None:
    empty = torch.tensor([True, False, False, True])
    full = torch.tensor([False, True, False, True])  # an empty block that is "full" is empty
    states = states_from(empty, full)
    assert states.dtype == torch.uint8
    assert states.tolist() == [EMPTY, FULL, PARTIAL, EMPTY]
    assert len({EMPTY, PARTIAL, FULL}) == 3
