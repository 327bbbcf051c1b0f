"""What the loaders share (``attnkit.interop._copy``): parts read by name and kind, copies that
refuse a wrong shape instead of broadcasting it, and the column order of interleaved encodings."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from attnkit import relative_encoding
from attnkit.interop import _copy as copying


class Toolkit(nn.Module):
    """A stand-in for another toolkit's module, read through attribute names."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_q = nn.Linear(4, 4)
        self.no_bias = nn.Linear(4, 4, bias=False)
        self.pos_u = nn.Parameter(torch.randn(2, 2))
        self.heads = 2
        self.flag = True
        self.dropout = nn.Dropout(0.3)


def test_parts_are_read_by_name_and_kind() -> None:
    m = Toolkit()
    assert copying.part(m, "linear_q", nn.Linear, "from_x()") is m.linear_q
    assert copying.tensor(m, "pos_u", "from_x()") is m.pos_u
    assert copying.integer(m, "heads", "from_x()") == 2
    assert copying.dropout_p(m, "dropout") == 0.3
    assert copying.dropout_p(m, "missing") == 0.0  # no dropout module: none
    with pytest.raises(
        TypeError, match=re.escape("from_x() needs Toolkit.pos_u to be an Linear, got Parameter")
    ):
        copying.part(m, "pos_u", nn.Linear, "from_x()")
    with pytest.raises(
        TypeError, match=re.escape("from_x() needs Toolkit.nothing to be a tensor, got NoneType")
    ):
        copying.tensor(m, "nothing", "from_x()")
    with pytest.raises(
        TypeError, match=re.escape("from_x() needs Toolkit.flag to be an int, got True")
    ):
        copying.integer(m, "flag", "from_x()")


def test_copy_refuses_a_shape_that_would_broadcast() -> None:
    dst = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=re.escape("from_x(): w is (1, 4), expected (3, 4)")):
        copying.copy(dst, torch.ones(1, 4), "w", "from_x()")  # copy_ would fill every row
    assert torch.equal(dst, torch.zeros(3, 4))
    src = torch.randn(3, 4)
    copying.copy(dst, src, "w", "from_x()")
    assert torch.equal(dst, src)


def test_copy_linear_copies_weight_and_bias_and_zeros_a_missing_bias() -> None:
    m = Toolkit()
    dst = nn.Linear(4, 4)
    copying.copy_linear(dst, m.linear_q, "linear_q", "from_x()")
    assert torch.equal(dst.weight, m.linear_q.weight)
    assert torch.equal(dst.bias, m.linear_q.bias)
    copying.copy_linear(dst, m.no_bias, "no_bias", "from_x()")
    assert torch.equal(dst.bias, torch.zeros(4))
    x = torch.randn(2, 4)
    assert torch.equal(dst(x), m.no_bias(x))
    mapped = torch.randn(4, 4)
    copying.copy_linear(dst, m.linear_q, "linear_q", "from_x()", weight=mapped)
    assert torch.equal(dst.weight, mapped)
    with pytest.raises(
        ValueError,
        match=re.escape("from_x(): linear_q has a bias, where the attnkit module has none"),
    ):
        copying.copy_linear(nn.Linear(4, 4, bias=False), m.linear_q, "linear_q", "from_x()")
    with pytest.raises(
        ValueError, match=re.escape("from_x(): linear_q.weight is (4, 4), expected (4, 3)")
    ):
        copying.copy_linear(nn.Linear(3, 4), m.linear_q, "linear_q", "from_x()")


def test_halves_from_interleaved_turns_interleaved_encodings_into_attnkits() -> None:
    distances = torch.arange(-5, 6)
    interleaved = relative_encoding(distances, 8, layout="interleaved", dtype=torch.float64)
    halves = relative_encoding(distances, 8, dtype=torch.float64)
    columns = copying.halves_from_interleaved(8)
    assert columns.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(interleaved[:, columns], halves)
    # A projection of the interleaved table, its columns reordered, projects attnkit's table.
    w = torch.randn(3, 8, dtype=torch.float64)
    assert torch.allclose(interleaved @ w.T, halves @ w[:, columns].T, atol=1e-12)
