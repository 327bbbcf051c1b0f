"""The contiguous and zigzag layouts of a sequence over ranks (no processes needed)."""

from __future__ import annotations

import re

import pytest
import torch

from attnkit import masks
from attnkit.distributed import Layout, balance_documents, shard_zigzag, unshard_zigzag
from attnkit.distributed.layout import LAYOUTS, layout_of


def test_zigzag_shards_hold_chunks_r_and_2w_minus_1_minus_r() -> None:
    x = torch.arange(24).view(1, 1, 24, 1)  # W = 3: 6 chunks of 4
    chunks = x.view(6, 4)
    for r in range(3):
        got = shard_zigzag(x, r, 3).flatten()
        assert torch.equal(got, torch.cat([chunks[r], chunks[5 - r]]))
    mask = masks.padding_mask([20], max_len=24)  # (1, 1, 1, 24): the sequence is dim -1
    assert torch.equal(
        unshard_zigzag([shard_zigzag(mask, r, 3, dim=-1) for r in range(3)], dim=-1), mask
    )
    assert torch.equal(unshard_zigzag([shard_zigzag(x, r, 3) for r in range(3)]), x)


def test_zigzag_errors_quote_values(no_shape_checks: None) -> None:
    x = torch.zeros(1, 2, 10, 4)
    with pytest.raises(
        ValueError,
        match=r"length 10 \(dim -2 of \(1, 2, 10, 4\)\) does not divide "
        r"into 2 \* world_size = 6 equal chunks; pad it to a multiple of 6",
    ):
        shard_zigzag(x, 0, 3)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size\) = \[0, 2\), got 2"):
        shard_zigzag(x, 2, 2)
    with pytest.raises(TypeError, match=r"world_size must be an int, got 2\.0"):
        shard_zigzag(x, 0, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dim=4 is out of range for a 4-d tensor"):
        shard_zigzag(x, 0, 1, dim=4)
    with pytest.raises(ValueError, match=r"rank 0: \(1, 2, 4, 4\), rank 1: \(1, 2, 6, 4\)"):
        unshard_zigzag([x[..., :4, :], x[..., :6, :]])
    with pytest.raises(ValueError, match=r"length along dim -2 must be even; got \(1, 2, 5, 4\)"):
        unshard_zigzag([x[..., :5, :]])
    with pytest.raises(TypeError, match="non-empty sequence of tensors"):
        unshard_zigzag([])


@pytest.mark.parametrize(("layout", "world"), [("contiguous", 3), ("zigzag", 3), ("zigzag", 1)])
def test_segments_name_the_global_positions_each_rank_holds(layout: str, world: int) -> None:
    # Every rank's runs, laid out at their global starts, cover the sequence once; they are
    # where the layout's shard puts each position.
    length = 12  # local length; the sequence is world * length
    positions = torch.arange(world * length).view(1, 1, -1, 1)
    lay = layout_of(layout, world)
    covered = []
    for rank in range(world):
        runs = lay.segments(rank, length)
        local = [g + i for _, g, n in runs for i in range(n)]
        assert [s for s, _, _ in runs] == sorted(s for s, _, _ in runs)
        assert sum(n for _, _, n in runs) == length
        assert lay.shard(positions, rank).flatten().tolist() == local
        if layout == "zigzag":
            assert shard_zigzag(positions, rank, world).flatten().tolist() == local
        else:
            assert positions.chunk(world, dim=-2)[rank].flatten().tolist() == local
        covered += local
    assert sorted(covered) == list(range(world * length))
    assert set(LAYOUTS) == {"contiguous", "zigzag"}


def test_a_layout_of_any_chunks_shards_and_unshards() -> None:
    # Chunks in any order, several per rank; runs of chunks that follow each other merge.
    lay = Layout(((3, 0, 1), (2, 4, 5)))
    x = torch.arange(18).view(1, 18, 1)
    shards = [lay.shard(x, r) for r in range(2)]
    assert shards[0].flatten().tolist() == [9, 10, 11, 0, 1, 2, 3, 4, 5]
    assert lay.segments(0, 9) == [(0, 9, 3), (3, 0, 6)]
    assert lay.segments(1, 9) == [(0, 6, 3), (3, 12, 6)]
    assert torch.equal(lay.unshard(shards), x)
    assert (lay.world_size, lay.count, lay.per_rank) == (2, 6, 3)
    assert [lay.owner(c) for c in range(6)] == [0, 0, 1, 0, 1, 1]


def test_layout_errors_quote_values() -> None:
    with pytest.raises(ValueError, match=r"the same number of chunks .* got \[2, 1\] chunks"):
        Layout(((0, 1), (2,)))
    with pytest.raises(
        ValueError, match=r"each chunk 0..3 exactly once, got \(\(0, 1\), \(1, 3\)\)"
    ):
        Layout(((0, 1), (1, 3)))
    with pytest.raises(ValueError, match=r"does not divide into 4 equal chunks"):
        Layout.zigzag(2).shard(torch.zeros(1, 6, 2), 0)
    with pytest.raises(ValueError, match=r"the layout has 3 ranks but the group has 2"):
        layout_of(Layout.contiguous(3), 2)
    with pytest.raises(ValueError, match=r"layout must be one of 'contiguous', 'zigzag' or a"):
        layout_of("spiral", 2)


def work_per_rank(layout: Layout, lengths: list[int], causal: bool) -> list[int]:
    """The (query, key) pairs each rank's queries attend under documents(lengths) (& causal)."""
    t = sum(lengths)
    mask = masks.documents(lengths) & masks.causal() if causal else masks.documents(lengths)
    rows = mask.dense(t)[0, 0].sum(-1)
    return [int(layout.shard(rows, r, dim=0).sum()) for r in range(layout.world_size)]


@pytest.mark.parametrize("causal", [False, True])
def test_balanced_documents_even_the_work_that_contiguous_shards_do_not(causal: bool) -> None:
    lengths = [700, *([20] * 15), 24]  # one long document among short ones: 1024 tokens
    contiguous = work_per_rank(Layout.contiguous(4), lengths, causal)
    balanced_layout = balance_documents(lengths, 4, causal=causal, chunks_per_rank=16)
    balanced = work_per_rank(balanced_layout, lengths, causal)
    assert sum(balanced) == sum(contiguous)
    assert max(contiguous) / min(contiguous) > 30
    assert max(balanced) / min(balanced) < 1.03  # chunks of 16 tokens: even to a few percent
    assert all(len(c) == 16 for c in balanced_layout.chunks)


def test_balanced_documents_errors_quote_values() -> None:
    with pytest.raises(ValueError, match=r"hold 100 tokens, which do not divide into world_size"):
        balance_documents([50, 50], 3)
    with pytest.raises(ValueError, match=r"lengths must be >= 0, got \[-1, 13\]"):
        balance_documents([-1, 13], 3, chunks_per_rank=1)


@pytest.mark.parametrize(
    ("world_size", "exc", "message"),
    [
        (0, ValueError, "world_size must be >= 1, got 0"),
        (-1, ValueError, "world_size must be >= 1, got -1"),
        (2.0, TypeError, "world_size must be an int, got 2.0"),
        (None, TypeError, "world_size must be an int, got None"),
    ],
)
def test_layouts_refuse_a_world_size_that_is_no_count_of_ranks(
    world_size: object, exc: type[Exception], message: str
) -> None:
    for make in (
        Layout.contiguous,
        Layout.zigzag,
        lambda w: layout_of("zigzag", w),
        lambda w: layout_of(Layout.contiguous(2), w),
    ):
        with pytest.raises(exc, match=re.escape(message)):
            make(world_size)


def test_unshard_refuses_shards_that_do_not_cut_into_the_ranks_chunks() -> None:
    lay = Layout.zigzag(2)
    x = torch.arange(8.0).view(1, 8, 1)
    assert torch.equal(lay.unshard([lay.shard(x, r) for r in range(2)]), x)
    # Shards of 7 rows would be read as chunks of 3: a row of each lost, with no error.
    with pytest.raises(ValueError, match=r"divides into the 2 chunks .* got \(1, 7, 1\), \(1, 7"):
        lay.unshard([torch.zeros(1, 7, 1), torch.zeros(1, 7, 1)])
    # Shards of different lengths would be cut by the first one's length.
    with pytest.raises(ValueError, match=r"share one shape .* got \(4\), \(2\)"):
        lay.unshard([torch.zeros(4), torch.zeros(2)], dim=0)
