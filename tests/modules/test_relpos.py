"""The encoding tables of relative attention (``attnkit.modules._relpos``) against their formulas:
float64 sinusoids of signed distances, the toolkits' float32 tables, openspeech's absolute and
ESPnet's legacy reversed ones."""

from __future__ import annotations

import math

import torch

from attnkit.modules import _relpos as relpos


def sinusoid(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """``(P, dim)``: ``sin(p w_k)`` in the first half, ``cos(p w_k)`` in the second, with
    ``w_k = 10000^(-2k / dim)``, in float64."""
    w = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angle = positions.double().unsqueeze(-1) * w
    return torch.cat([angle.sin(), angle.cos()], -1)


def test_relative_sinusoid_is_the_formula_in_float64() -> None:
    d = torch.arange(-6, 7)
    got = relpos.relative_sinusoid(d, 8)
    assert got.dtype == torch.float64
    assert torch.allclose(got, sinusoid(d, 8), atol=1e-12)
    assert torch.allclose(got[6], torch.tensor([0.0] * 4 + [1.0] * 4, dtype=torch.float64))


def test_float32_tables_are_the_formula_to_float32_rounding() -> None:
    d = torch.arange(-40, 41)
    got = relpos.float32_sinusoid(d, 16)
    assert got.dtype == torch.float32
    assert got.shape == (81, 16)
    assert torch.allclose(got.double(), sinusoid(d, 16), atol=1e-5)
    assert not torch.equal(got.double(), relpos.relative_sinusoid(d, 16))  # rounded, on purpose


def test_openspeech_table_is_interleaved_absolute_positions() -> None:
    got = relpos.openspeech_sinusoid(9, 6)
    assert got.shape == (9, 6)
    want = sinusoid(torch.arange(9), 6)
    assert torch.allclose(got[:, 0::2].double(), want[:, :3], atol=1e-6)
    assert torch.allclose(got[:, 1::2].double(), want[:, 3:], atol=1e-6)
    longer = relpos.openspeech_sinusoid(relpos.OPENSPEECH_MAX_LEN + 3, 6)
    assert longer.shape == (relpos.OPENSPEECH_MAX_LEN + 3, 6)
    assert torch.equal(longer[:9], got)


def test_espnet_legacy_table_counts_down_from_its_length() -> None:
    got = relpos.espnet_legacy_sinusoid(4, 6, max_len=10)
    want = sinusoid(torch.tensor([9, 8, 7, 6]), 6)  # positions L - 1 ... L - T, L = 10
    assert torch.allclose(got[:, 0::2].double(), want[:, :3], atol=1e-6)
    assert torch.allclose(got[:, 1::2].double(), want[:, 3:], atol=1e-6)
    # An input longer than max_len makes the table that long: positions T - 1 ... 0.
    long = relpos.espnet_legacy_sinusoid(5, 6, max_len=3)
    want = sinusoid(torch.arange(4, -1, -1), 6)
    assert torch.allclose(long[:, 0::2].double(), want[:, :3], atol=1e-6)
    assert math.isclose(float(long[-1, 1]), 1.0)  # position 0: cos 0
