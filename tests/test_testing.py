"""``attnkit.testing``: the per-dtype tolerances, and an ``assert_close`` that scales with the
reference's magnitude, never matches NaN, and widens only by ``conditioning``."""

from __future__ import annotations

import re

import pytest
import torch

from attnkit.testing import TOLERANCES, assert_close, tolerance


def test_tolerances_grow_as_the_dtype_shrinks() -> None:
    assert tolerance(torch.float64) == (1e-10, 1e-10)
    assert tolerance(torch.float32) == (2e-5, 1e-4)
    order = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    atols = [tolerance(d)[0] for d in order]
    assert atols == sorted(atols)
    assert set(TOLERANCES) == set(order)
    with pytest.raises(
        ValueError, match=re.escape("no tolerance for torch.int32; known: torch.float64")
    ):
        tolerance(torch.int32)


def test_within_and_beyond_the_tolerance_of_the_dtype() -> None:
    want = torch.linspace(-1, 1, 11, dtype=torch.float64)
    assert_close(want + 1e-11, want)
    with pytest.raises(AssertionError):
        assert_close(want + 1e-9, want)
    assert_close((want + 1e-5).float(), want)  # float32: 2e-5 absolute
    with pytest.raises(AssertionError):
        assert_close((want + 1e-3).float(), want)
    assert_close((want + 1e-3).float(), want, dtype=torch.bfloat16)  # judged as bfloat16


def test_atol_scales_with_the_largest_reference_magnitude() -> None:
    want = torch.tensor([1000.0, 0.0], dtype=torch.float64)
    assert_close(want + torch.tensor([0.0, 5e-8], dtype=torch.float64), want)  # 1e-10 * 1000
    with pytest.raises(AssertionError):
        assert_close(want + torch.tensor([0.0, 5e-7], dtype=torch.float64), want)


def test_conditioning_widens_both_tolerances() -> None:
    want = torch.ones(3, dtype=torch.float64)
    with pytest.raises(AssertionError):
        assert_close(want + 1e-9, want)
    assert_close(want + 1e-9, want, conditioning=100.0)
    with pytest.raises(ValueError, match=re.escape("conditioning must be >= 1, got 0.5")):
        assert_close(want, want, conditioning=0.5)
    with pytest.raises(ValueError, match=re.escape("conditioning must be >= 1, got nan")):
        assert_close(want, want, conditioning=float("nan"))


def test_nan_never_matches_and_shapes_must_agree() -> None:
    nan = torch.tensor([float("nan")], dtype=torch.float64)
    with pytest.raises(AssertionError):
        assert_close(nan, nan)
    with pytest.raises(AssertionError):
        assert_close(torch.zeros(2, 1, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    assert_close(torch.zeros(0), torch.zeros(0, dtype=torch.float64))  # nothing to compare
