"""ConformerLayer: padding never reaches a real frame; its convolution module and masked BatchNorm.

Its agreement with ESPnet's Conformer block is tested in tests/interop/test_espnet.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.autograd import gradcheck

from attnkit import ConformerLayer, RelativeMultiHeadAttention, masks
from attnkit.modules.conformer import ConformerConvolution, _masked_batch_norm
from attnkit.testing import assert_close

F64 = torch.float64


def make(seed: int = 0, **kw: object) -> ConformerLayer:
    torch.manual_seed(seed)
    layer = ConformerLayer(16, 4, 32, kernel_size=5, dropout=0.0, dtype=F64, **kw)  # type: ignore[arg-type]
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
        layer.conv.norm.running_mean.normal_()
        layer.conv.norm.running_var.uniform_(0.5, 1.5)
    return layer


def randn(*shape: int, seed: int = 1) -> Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def lengths_mask(lengths: list[int], t: int, side: str = "right") -> Tensor:
    """``(B, T)``, True at real frames."""
    idx = torch.arange(t)
    n = torch.tensor(lengths)[:, None]
    return idx < n if side == "right" else idx >= t - n


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("garbage", [float("nan"), 1e6, float("inf")])
def test_padding_never_reaches_real_frames(side: str, garbage: float) -> None:
    layer = make().eval()
    x = randn(2, 10, 16)
    valid = lengths_mask([10, 6], 10, side)
    y = layer(x, mask=valid)
    dirty = x.masked_fill(~valid[..., None], garbage)
    assert_close(layer(dirty, mask=valid)[valid], y[valid])
    # The padded sequence gives what it gives alone.
    alone = x[1:, 4:] if side == "left" else x[1:, :6]
    assert_close(y[1][valid[1]], layer(alone)[0])
    # And the (B, 1, 1, T) padding mask of attnkit.masks is the same thing.
    if side == "right":
        assert_close(layer(x, mask=masks.padding_mask([10, 6])), y)


def test_padding_never_reaches_real_frames_in_training() -> None:
    layer = make(seed=1).train()  # dropout 0: training differs by BatchNorm's batch statistics
    x = randn(3, 9, 16, seed=2)
    valid = lengths_mask([9, 4, 7], 9)
    dirty = x.masked_fill(~valid[..., None], float("nan")).requires_grad_()
    y = layer(dirty, mask=valid)
    clean = make(seed=1).train()
    assert_close(y[valid], clean(x, mask=valid)[valid])
    y[valid].square().sum().backward()
    assert dirty.grad is not None
    assert torch.isfinite(dirty.grad).all()
    assert (dirty.grad[~valid] == 0).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


def test_convolution_masks_before_the_depthwise_conv() -> None:
    # The negative control: without the mask, the GLU's output at padded frames (pointwise1's bias
    # at least) reaches the last (kernel_size - 1) / 2 real frames.
    torch.manual_seed(0)
    conv = ConformerConvolution(8, 5, dtype=F64).eval()
    x = randn(1, 9, 8).masked_fill(~lengths_mask([6], 9)[..., None], 0.0)  # zero padding
    alone = conv(x[:, :6])
    assert_close(conv(x, lengths_mask([6], 9))[:, :6], alone)
    leak = (conv(x)[0, :6] - alone[0]).abs().amax(-1)
    assert leak[:4].max() < 1e-12
    assert leak[4:].min() > 1e-3


def test_masked_batch_norm_is_batch_norm_over_real_frames() -> None:
    torch.manual_seed(0)
    theirs, ours = nn.BatchNorm1d(4, dtype=F64), nn.BatchNorm1d(4, dtype=F64)
    with torch.no_grad():
        for bn in (theirs, ours):
            bn.weight.copy_(torch.tensor([1.0, 2.0, -1.0, 0.5]))
            bn.bias.copy_(torch.tensor([0.0, 1.0, 2.0, 3.0]))
    x = randn(3, 4, 7) * 3 + 1
    keep = lengths_mask([7, 2, 5], 7).unsqueeze(1)  # (B, 1, T)
    x = x.masked_fill(~keep, float("nan"))

    def real_frames(t: Tensor) -> Tensor:
        return t.transpose(1, 2)[keep[:, 0]].T.unsqueeze(0)  # (1, C, N): the real frames in a row

    for momentum in (0.1, 0.1, None):  # the running statistics too, then the cumulative average
        ours.momentum = theirs.momentum = momentum
        want = theirs(real_frames(x))
        assert_close(real_frames(_masked_batch_norm(x, keep, ours)), want)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert_close(getattr(ours, name).double(), getattr(theirs, name).double())


def test_masked_batch_norm_gradients() -> None:
    bn = nn.BatchNorm1d(3, dtype=F64)
    keep = lengths_mask([5, 3], 5).unsqueeze(1)
    x = randn(2, 3, 5).requires_grad_()
    assert gradcheck(lambda t: _masked_batch_norm(t, keep, bn), (x,))


def test_left_context_window_in_chunks_equals_dense_band_mask() -> None:
    # Streaming with a limited left context: each chunk of queries attends its own keys and the
    # `left` frames before them (queries are the last positions of the keys given), and that is the
    # dense call with the band mask, row for row.
    torch.manual_seed(0)
    attn = RelativeMultiHeadAttention(16, 4, dtype=F64)
    x = randn(2, 13, 16)
    left, chunk = 3, 4
    dense = attn(x, mask=masks.sliding_window_mask(13, left=left))
    for start in range(0, 13, chunk):
        end = min(start + chunk, 13)
        lo = max(0, start - left)
        band = masks.sliding_window_mask(end - start, end - lo, left=left)
        assert_close(attn(x[:, start:end], x[:, lo:end], mask=band), dense[:, start:end])


def test_injected_attention_and_submodules() -> None:
    attn = RelativeMultiHeadAttention(16, 4, encoding="symmetric", dtype=F64)
    layer = ConformerLayer(16, d_ff=24, kernel_size=3, attention=attn, dtype=F64)
    assert layer.attn is attn
    assert layer.ff1.linear1.out_features == 24
    assert layer.conv.depthwise.kernel_size == (3,)
    assert layer(randn(2, 5, 16)).shape == (2, 5, 16)
    assert ConformerLayer(8, 2).ff2.linear1.out_features == 32  # d_ff defaults to 4 * d_model


@pytest.mark.usefixtures("no_shape_checks")
def test_bad_arguments_quote_values() -> None:
    with pytest.raises(ValueError, match="kernel_size must be odd \\(same padding\\), got 4"):
        ConformerLayer(8, 2, kernel_size=4)
    with pytest.raises(ValueError, match="pass num_heads, or a ready-made attention= module"):
        ConformerLayer(8)
    with pytest.raises(ValueError, match="num_heads and attn_dropout configure the attention"):
        ConformerLayer(8, 2, attention=RelativeMultiHeadAttention(8, 2))
    with pytest.raises(ValueError, match="activation must be one of 'silu', 'relu', 'gelu'"):
        ConformerLayer(8, 2, activation="tanh")
    layer = ConformerLayer(8, 2)
    x = torch.randn(2, 5, 8)
    with pytest.raises(TypeError, match="mask must be a bool tensor \\(True = real frame\\)"):
        layer(x, mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"mask must be a padding mask \(B, T\) or \(B, 1, 1, T\)"):
        layer(x, mask=torch.ones(2, 1, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, 8\), got \(2, 5, 6\)"):
        layer(torch.randn(2, 5, 6))
    with pytest.raises(ValueError, match="more than one real frame per channel, got 1"):
        layer.train()(x[:1, :2], mask=torch.tensor([[True, False]]))


def test_context_is_a_window_and_key_padding_a_mask() -> None:
    # context=(left, right) attends like the dense band mask; masks.key_padding says which frames
    # are real, as the bool padding mask does.
    torch.manual_seed(0)
    layer = ConformerLayer(16, 2, kernel_size=5, context=(3, 2), dtype=torch.float64).eval()
    x = torch.randn(2, 30, 16, dtype=torch.float64)
    lengths = [30, 21]
    band = masks.sliding_window_mask(30, left=3, right=2)
    want_layer = copy.deepcopy(layer)
    want_layer.context = None
    want_layer.attn = _BandAttention(want_layer.attn, band)
    with torch.no_grad():
        got = layer(x, mask=masks.key_padding(lengths))
        want = want_layer(x, mask=masks.padding_mask(lengths))
    assert_close(got[0], want[0])
    assert_close(got[1, :21], want[1, :21])
    with pytest.raises(TypeError, match="a window over the frames is the layer's context"):
        layer(x, mask=masks.causal())


class _BandAttention(torch.nn.Module):
    """Relative attention with a dense band mask ANDed to the layer's padding mask."""

    def __init__(self, attn: torch.nn.Module, band: torch.Tensor) -> None:
        super().__init__()
        self.attn, self.band = attn, band

    def forward(self, x: torch.Tensor, *, mask: object = None) -> torch.Tensor:
        dense = (
            self.band if mask is None else mask.dense(x.size(1), batch_size=x.size(0)) & self.band
        )  # type: ignore[attr-defined]
        out: torch.Tensor = self.attn(x, mask=dense)
        return out


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("kernel_size", [1, 5])
def test_empty_sequences_give_an_empty_output(training: bool, kernel_size: int) -> None:
    # T = 0 as the attention modules take it: torch's Conv1d refuses an input shorter than its
    # kernel, so the convolution of no frames is no frames; the running statistics stay as
    # nn.BatchNorm1d leaves them on an empty batch, and a backward through it runs.
    torch.manual_seed(0)
    layer = ConformerLayer(16, 4, 32, kernel_size=kernel_size, dropout=0.0, dtype=F64)
    layer.train(training)
    bn = copy.deepcopy(layer.conv.norm)
    x = randn(2, 0, 16).requires_grad_()
    y = layer(x)
    assert y.shape == (2, 0, 16)
    bn(torch.zeros(2, 16, 0, dtype=F64))
    assert_close(layer.conv.norm.running_mean, bn.running_mean)
    assert_close(layer.conv.norm.running_var, bn.running_var)
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert grad.shape == (2, 0, 16)
    if not training:  # a padding mask of no frames, in eval mode
        assert layer(x, mask=torch.ones(2, 0, dtype=torch.bool)).shape == (2, 0, 16)
