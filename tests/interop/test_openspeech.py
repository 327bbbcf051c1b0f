"""Loading openspeech's RelativeMultiHeadAttention (``attnkit.interop.openspeech``), through an
independent test double of its module."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

import attnkit
from attnkit.modules import _relpos as relpos
from attnkit.testing import assert_close
from tests.modules.test_relative import ALL, randn, run, small


def openspeech_encoding(length: int, dim: int) -> Tensor:
    """openspeech's PositionalEncoding as its docs give it: absolute positions, sin/cos
    interleaved, a float32 table of 5000 positions of which the Conformer takes the first T."""
    pos = torch.arange(5000, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.empty(5000, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table[:length]


class Wrapped(nn.Module):
    """openspeech's ``Linear``: an ``nn.Linear`` kept in ``.linear``."""

    def __init__(self, n: int, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(n, n, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.linear(x)
        return out


class OpenspeechDouble(nn.Module):
    """What openspeech's RelativeMultiHeadAttention computes, per its formula.

    Inputs (batch, time, dim); ``pos_embedding`` is an absolute encoding (batch, time, dim); mask
    True = blocked, (batch, 1, time) or (batch, time, time), filled with -1e4. Position scores
    ``(q + v) . pos`` are shifted by padding a zero column on the left, reading the (T, T+1)
    result as (T+1, T) and dropping its first row. Both terms are divided by sqrt(dim).
    """

    def __init__(self, dim: int, num_heads: int, dropout_p: float, wrapped: bool) -> None:
        super().__init__()

        def lin(bias: bool = True) -> nn.Module:
            return Wrapped(dim, bias) if wrapped else nn.Linear(dim, dim, bias=bias)

        self.dim, self.num_heads, self.d_head = dim, num_heads, dim // num_heads
        self.query_proj, self.key_proj, self.value_proj = lin(), lin(), lin()
        self.pos_proj, self.out_proj = lin(bias=False), lin()
        self.u_bias = nn.Parameter(torch.randn(num_heads, self.d_head))
        self.v_bias = nn.Parameter(torch.randn(num_heads, self.d_head))
        self.dropout = nn.Dropout(dropout_p)

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, pos_embedding: Tensor, mask: Tensor
    ) -> Tensor:
        b, t, _ = query.shape

        def heads(x: Tensor) -> Tensor:  # (B, T, dim) -> (B, H, T, d_head)
            return x.view(b, -1, self.num_heads, self.d_head).transpose(1, 2)

        q = self.query_proj(query).view(b, t, self.num_heads, self.d_head)
        k, v = heads(self.key_proj(key)), heads(self.value_proj(value))
        p = heads(self.pos_proj(pos_embedding))
        content = (q + self.u_bias).transpose(1, 2) @ k.transpose(-1, -2)
        raw = (q + self.v_bias).transpose(1, 2) @ p.transpose(-1, -2)  # (B, H, T, T)
        padded = torch.cat([raw.new_zeros(b, self.num_heads, t, 1), raw], dim=-1)
        shifted = padded.reshape(b, self.num_heads, t + 1, t)[:, :, 1:].reshape(raw.shape)
        score = (content + shifted) / math.sqrt(self.dim)
        score = score.masked_fill(mask.unsqueeze(1), -1e4)
        attn = self.dropout(torch.softmax(score, -1))
        out = (attn @ v).transpose(1, 2).reshape(b, t, self.dim)
        result: Tensor = self.out_proj(out)
        return result


@pytest.mark.parametrize("wrapped", [False, True])
@pytest.mark.parametrize("backend", ALL)
def test_relative_attention_reproduces_it(wrapped: bool, backend: str) -> None:
    torch.manual_seed(0)
    theirs = OpenspeechDouble(16, 4, dropout_p=0.1, wrapped=wrapped).double().eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.5)
    ours = attnkit.interop.openspeech.relative_attention(theirs)
    assert ours.legacy == "openspeech"
    assert ours.dropout == 0.1
    assert not ours.training
    x = randn(3, 13, 16)
    pos = openspeech_encoding(13, 16).double().expand(3, 13, 16)
    padding = torch.arange(13) >= torch.tensor([13, 9, 1]).unsqueeze(-1)
    blocked = [padding.unsqueeze(1), torch.rand(3, 13, 13) < 0.5]  # (B, 1, T), (B, T, T)
    blocked[1][:, :, 0] = False  # every query keeps a key: see the next test for empty rows
    for os_mask in blocked:
        want = theirs(x, x, x, pos, os_mask)  # openspeech: True = blocked
        got = run(ours, x, mask=~os_mask.unsqueeze(1), backend=small(backend, (4, 5), 4))
        assert_close(got, want)


def test_relative_attention_empty_rows_differ_as_documented() -> None:
    theirs = OpenspeechDouble(8, 2, dropout_p=0.0, wrapped=False).double().eval()
    ours = attnkit.interop.openspeech.relative_attention(theirs)
    x = randn(1, 5, 8)
    os_mask = torch.zeros(1, 5, 5, dtype=torch.bool)
    os_mask[0, 2] = True  # query 2 may attend nothing
    pos = openspeech_encoding(5, 8).double().expand(1, 5, 8)
    want = theirs(x, x, x, pos, os_mask)
    got = ours(x, mask=~os_mask.unsqueeze(1))
    rows = [0, 1, 3, 4]
    assert_close(got[:, rows], want[:, rows])
    with torch.no_grad():
        mean_value = theirs.value_proj(x).mean(1)  # openspeech: -1e4 everywhere, uniform weights
        assert_close(want[:, 2], theirs.out_proj(mean_value))
        assert_close(got[:, 2], ours.out_proj.bias.expand(1, 8))  # attnkit: attention output 0


def test_legacy_encoding_is_openspeech_bit_for_bit() -> None:
    assert torch.equal(relpos.openspeech_sinusoid(37, 16), openspeech_encoding(37, 16))


@pytest.mark.usefixtures("no_shape_checks")
def test_bad_modules_are_named() -> None:
    double = OpenspeechDouble(8, 2, 0.0, wrapped=False)
    double.pos_proj = nn.Identity()  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"OpenspeechDouble.pos_proj to be an nn.Linear"):
        attnkit.interop.openspeech.relative_attention(double)


@pytest.mark.parametrize("without", ["query_proj", "key_proj", "value_proj", "out_proj"])
def test_projections_of_which_only_some_have_a_bias_are_refused(without: str) -> None:
    # attnkit's proj_bias is one flag for the four projections; a module with a bias on only some
    # of them was loaded from query_proj's, dropping the others' biases (a wrong output).
    torch.manual_seed(0)
    theirs = OpenspeechDouble(8, 2, 0.0, wrapped=False).double().eval()
    setattr(theirs, without, nn.Linear(8, 8, bias=False, dtype=torch.float64))
    with pytest.raises(
        ValueError, match=rf"only some projections have a bias: .*'{without}': False"
    ):
        attnkit.interop.openspeech.relative_attention(theirs)
    for name in ("query_proj", "key_proj", "value_proj", "out_proj"):  # none has one: it loads
        setattr(theirs, name, nn.Linear(8, 8, bias=False, dtype=torch.float64))
    ours = attnkit.interop.openspeech.relative_attention(theirs)
    x = randn(2, 5, 8)
    pos = openspeech_encoding(5, 8).double().expand(2, 5, 8)
    assert_close(ours(x), theirs(x, x, x, pos, torch.zeros(2, 1, 5, dtype=torch.bool)))
