"""Dropout's mask: kept at its rate, independent between pairs, the same block by block."""

from __future__ import annotations

import torch

from attnkit._kernel import dropout_mask


def test_dropout_mask_keeps_at_the_rate_and_independently() -> None:
    keep = dropout_mask(12345, 0.25, (2, 3, 64, 96)).double()
    n = keep.numel()
    # The keep rate within 4 standard deviations of 0.75.
    assert abs(float(keep.mean()) - 0.75) < 4 * (0.75 * 0.25 / n) ** 0.5
    # Neighbours along every axis are uncorrelated (correlation within 4 / sqrt(pairs)).
    centred = keep - keep.mean()
    for dim in range(4):
        a, b = (
            centred.narrow(dim, 0, keep.size(dim) - 1),
            centred.narrow(dim, 1, keep.size(dim) - 1),
        )
        corr = float((a * b).mean() / centred.square().mean())
        assert abs(corr) < 4 / a.numel() ** 0.5, (dim, corr)
    # Another seed gives another mask.
    assert (dropout_mask(12346, 0.25, (2, 3, 64, 96)).double() != keep).float().mean() > 0.3


def test_dropout_mask_blocks_are_parts_of_the_whole() -> None:
    whole = dropout_mask(99, 0.5, (2, 3, 40, 50))
    block = dropout_mask(99, 0.5, (2, 3, 40, 50), queries=(8, 24), keys=(10, 45))
    assert torch.equal(block, whole[:, :, 8:24, 10:45])
