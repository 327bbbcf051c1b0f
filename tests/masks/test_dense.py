"""The dense masks (``attnkit.masks.causal_mask``, ``sliding_window_mask``, ``padding_mask``,
``block_diagonal_mask``, ``combine_masks``): each equals its definition written out here, and bad
arguments are explained."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnkit import masks

lengths = st.integers(0, 9)


@given(tq=lengths, tk=lengths)
def test_causal_mask_definition(tq: int, tk: int) -> None:
    want = torch.tensor(
        [[j <= i + tk - tq for j in range(tk)] for i in range(tq)], dtype=torch.bool
    )
    assert torch.equal(masks.causal_mask(tq, tk), want.reshape(tq, tk))


@given(tq=lengths, tk=lengths, left=lengths, right=lengths)
def test_sliding_window_definition(tq: int, tk: int, left: int, right: int) -> None:
    want = torch.tensor(
        [[-left <= j - (i + tk - tq) <= right for j in range(tk)] for i in range(tq)],
        dtype=torch.bool,
    ).reshape(tq, tk)
    assert torch.equal(masks.sliding_window_mask(tq, tk, left=left, right=right), want)


def test_sliding_window_with_left_past_the_start_is_causal() -> None:
    assert torch.equal(masks.sliding_window_mask(6, left=6), masks.causal_mask(6))


@given(lens=st.lists(lengths, min_size=1, max_size=4), extra=st.integers(0, 3))
def test_padding_mask_definition(lens: list[int], extra: int) -> None:
    t = max(lens) + extra
    right = masks.padding_mask(lens, t)
    left = masks.padding_mask(torch.tensor(lens), t, side="left")
    assert right.shape == left.shape == (len(lens), 1, 1, t)
    for b, n in enumerate(lens):
        assert right[b, 0, 0].tolist() == [True] * n + [False] * (t - n)
        assert left[b, 0, 0].tolist() == [False] * (t - n) + [True] * n


@given(q_lens=st.lists(lengths, min_size=1, max_size=4), data=st.data())
def test_block_diagonal_definition(q_lens: list[int], data: st.DataObject) -> None:
    kv_lens = data.draw(st.lists(lengths, min_size=len(q_lens), max_size=len(q_lens)))
    q_seg = [s for s, n in enumerate(q_lens) for _ in range(n)]
    kv_seg = [s for s, n in enumerate(kv_lens) for _ in range(n)]
    want = torch.tensor([[a == b for b in kv_seg] for a in q_seg], dtype=torch.bool)
    got = masks.block_diagonal_mask(q_lens, kv_lens)
    assert torch.equal(got, want.reshape(len(q_seg), len(kv_seg)))


def test_combine_masks() -> None:
    a = masks.causal_mask(4)
    b = masks.padding_mask([2, 4])
    assert masks.combine_masks() is None
    assert masks.combine_masks(None, None) is None
    assert masks.combine_masks(None, a) is a
    assert torch.equal(masks.combine_masks(a, b), a & b)


BAD = [
    (lambda: masks.causal_mask(-1), ValueError, "q_len must be >= 0, got -1"),
    (lambda: masks.causal_mask(3, 2.0), TypeError, "kv_len must be an int, got 2.0"),
    (lambda: masks.sliding_window_mask(3, left=-2), ValueError, "left must be >= 0, got -2"),
    (
        lambda: masks.padding_mask([3, 1], side="top"),
        ValueError,
        "side must be 'right' or 'left', got 'top'",
    ),
    (
        lambda: masks.padding_mask([3, 5], max_len=4),
        ValueError,
        "max_len (4) is shorter than the longest length (5)",
    ),
    (
        lambda: masks.padding_mask(torch.tensor([1.0, 2.0])),
        TypeError,
        "lengths must be a 1-d integer tensor, got torch.float32 of shape (2,)",
    ),
    (
        lambda: masks.padding_mask(torch.tensor([1, -2])),
        ValueError,
        "lengths must be >= 0, got [1, -2]",
    ),
    (
        lambda: masks.block_diagonal_mask([1, 2], [3]),
        ValueError,
        "q_lens and kv_lens must list as many segments, got 2 and 1",
    ),
    (
        lambda: masks.combine_masks(masks.causal_mask(3), torch.ones(3)),
        TypeError,
        "combine_masks() takes bool tensors or None; argument 1 is torch.float32",
    ),
    (
        lambda: masks.combine_masks(masks.causal_mask(3), masks.causal_mask(4)),
        ValueError,
        "argument 1 of shape (4, 4) does not broadcast with the masks before it, of shape (3, 3)",
    ),
]


@pytest.mark.usefixtures("no_shape_checks")
@pytest.mark.parametrize(("call", "exc", "message"), BAD)
def test_bad_arguments(call, exc: type[Exception], message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(exc, match=re.escape(message)):
        call()
