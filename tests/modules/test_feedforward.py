"""PositionwiseFeedForward: each activation against its formula, dropout, errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from attnkit import PositionwiseFeedForward
from attnkit.testing import assert_close


def gelu_erf(x: Tensor) -> Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", "swiglu"])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_formula(activation: str, bias: bool) -> None:
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(6, 10, activation=activation, bias=bias, dtype=torch.float64)
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    w1, w2 = ffn.linear1.weight, ffn.linear2.weight
    b1 = ffn.linear1.bias if bias else torch.zeros(w1.size(0), dtype=torch.float64)
    b2 = ffn.linear2.bias if bias else torch.zeros(6, dtype=torch.float64)
    h = x @ w1.T + b1
    if activation == "relu":
        h = h.clamp(min=0)
    elif activation == "gelu":
        h = gelu_erf(h)
    elif activation == "silu":
        h = h / (1 + torch.exp(-h))  # Swish: x * sigmoid(x)
    else:
        gate, value = h[..., :10], h[..., 10:]  # W and V of SwiGLU, packed in linear1
        h = gate * torch.sigmoid(gate) * value
    assert_close(ffn(x), h @ w2.T + b2)


def test_swiglu_packs_two_projections() -> None:
    ffn = PositionwiseFeedForward(8, 12, activation="swiglu")
    assert ffn.linear1.weight.shape == (24, 8)
    assert ffn.linear2.weight.shape == (8, 12)


def test_dropout_in_training_only() -> None:
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(8, 64, dropout=0.5, dtype=torch.float64)
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    ffn.eval()
    a = ffn(x)
    assert torch.equal(a, ffn(x))
    ffn.train()
    assert not torch.allclose(ffn(x), a)


def test_any_leading_dims() -> None:
    ffn = PositionwiseFeedForward(4, 8, dtype=torch.float64)
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    assert_close(ffn(x)[1, 2], ffn(x[1, 2]))


@pytest.mark.usefixtures("no_shape_checks")
def test_errors() -> None:
    with pytest.raises(
        ValueError, match=r"activation must be one of 'relu', 'gelu', 'silu', 'swiglu', got 'tanh'"
    ):
        PositionwiseFeedForward(4, 8, activation="tanh")
    with pytest.raises(ValueError, match=r"d_ff must be >= 1, got 0"):
        PositionwiseFeedForward(4, 0)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got -0.1"):
        PositionwiseFeedForward(4, 8, dropout=-0.1)
