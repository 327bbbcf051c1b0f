"""Merging two parts of a row's keys by log-sum-exp (``attnkit._kernel.merge``) against the softmax
of the whole row."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit._kernel import merge
from attnkit.testing import assert_close

from .helpers import randn


def test_merge_of_two_parts_is_the_softmax_of_the_whole_row() -> None:
    s, v = randn(3, 10, seed=11), randn(3, 10, 4, seed=12)
    s[1, :6] = -math.inf  # row 1 sees none of the first part's keys
    s[2] = -math.inf  # row 2 sees no key at all

    def part(lo: int, hi: int) -> tuple[Tensor, Tensor]:
        lse = torch.logsumexp(s[:, lo:hi], -1)
        w = torch.exp(s[:, lo:hi] - lse.masked_fill(lse == -math.inf, 0.0).unsqueeze(-1))
        return (w.unsqueeze(1) @ v[:, lo:hi]).squeeze(1), lse

    out, lse = part(0, 6)
    merge(out, lse, *part(6, 10))
    want, want_lse = part(0, 10)
    assert_close(out, want)
    assert torch.equal(lse[2], torch.tensor(-math.inf, dtype=torch.float64))
    assert_close(lse[:2], want_lse[:2])
    assert torch.equal(out[2], torch.zeros(4, dtype=torch.float64))  # no NaN from -inf - -inf
