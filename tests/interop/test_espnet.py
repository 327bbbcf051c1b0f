"""ESPnet's and NeMo's relative attention and ESPnet's Conformer layer, loaded into attnkit.

Each toolkit module is a stand-in with the toolkit's parameter names and shapes (no toolkit code),
and each forward is re-stated here from the toolkit's published math, in float64, as plain
functions: the rel_shift is ESPnet's pad-and-reshape written out, the mask is ESPnet's (True =
real, ``finfo.min`` fill, re-masked to 0 after the softmax) or NeMo's (True = blocked, -10000).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnkit
from attnkit import masks
from tests.interop.helpers import agrees

E, H = 12, 3  # d_model, heads
DK = E // H
F64 = torch.float64

# --------------------------------------------------------------------------------------------------
# Stand-ins: the toolkits' parameter names and shapes, nothing else


class RelPositionMultiHeadedAttention(nn.Module):  # ESPnet
    def __init__(self, n_head: int = H, n_feat: int = E, *, bias: bool = True) -> None:
        super().__init__()
        self.h, self.d_k = n_head, n_feat // n_head
        for name in ("linear_q", "linear_k", "linear_v", "linear_out"):
            setattr(self, name, nn.Linear(n_feat, n_feat, bias=bias, dtype=F64))
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False, dtype=F64)
        self.pos_bias_u = nn.Parameter(torch.empty(n_head, self.d_k, dtype=F64))
        self.pos_bias_v = nn.Parameter(torch.empty(n_head, self.d_k, dtype=F64))
        self.dropout = nn.Dropout(0.0)
        self.zero_triu = False
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()


class LegacyRelPositionMultiHeadedAttention(RelPositionMultiHeadedAttention):  # ESPnet
    pass


class RelPositionMultiHeadAttention(RelPositionMultiHeadedAttention):  # NeMo
    pass


def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return module


def randn(*shape: int, seed: int = 1) -> Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------
# The toolkits' math, re-stated


def interleaved_table(positions: Tensor, dim: int) -> Tensor:
    """``pe[:, 2k] = sin(p f_k)`` and ``pe[:, 2k+1] = cos(p f_k)``, with
    ``f_k = exp(-2k ln(10000) / dim)``, in ``positions``' dtype."""
    f = torch.exp(torch.arange(0, dim, 2, dtype=positions.dtype) * -(math.log(10000.0) / dim))
    pe = torch.zeros(positions.numel(), dim, dtype=positions.dtype)
    pe[:, 0::2] = torch.sin(positions[:, None] * f)
    pe[:, 1::2] = torch.cos(positions[:, None] * f)
    return pe


def rel_shift(x: Tensor, crop: int | None) -> Tensor:
    """ESPnet's shift: a zero column on the left, the rows re-read one shorter, the first dropped,
    then (current class) only the first ``crop`` columns kept."""
    b, h, t1, p = x.shape
    padded = torch.cat([x.new_zeros(b, h, t1, 1), x], dim=-1)  # (B, H, T1, P+1)
    shifted = padded.view(b, h, p + 1, t1)[:, :, 1:].reshape(b, h, t1, p)
    return shifted if crop is None else shifted[..., :crop]


def espnet_attention(
    m: nn.Module,
    x: Tensor,
    mask: Tensor | None,
    *,
    legacy: bool = False,
    max_len: int = 5000,
    nemo: bool = False,
    exact: bool = False,
) -> Tensor:
    """``m(x, x, x, pos_emb, mask)`` with ``pos_emb`` from the matching encoding module, whose
    table is computed in float32 (``exact=True``: the float64 sinusoids instead).

    ESPnet mask ``(B, 1, T)`` True = real; NeMo mask ``(B, T, T)`` True = blocked.
    """
    b, t, _ = x.shape
    if legacy:  # LegacyRelPositionalEncoding: reversed positions of a max(max_len, T) table
        size = max(max_len, t)
        positions = torch.arange(size - 1, -1, -1.0, dtype=torch.float32)
        pos_emb = interleaved_table(positions, E).to(F64)[:t]  # ESPnet's float32 table
    else:  # RelPositionalEncoding: distances T-1 .. -(T-1)
        distances = torch.arange(t - 1, -t, -1, dtype=F64 if exact else torch.float32)
        pos_emb = interleaved_table(distances, E).to(F64)
    q = m.linear_q(x).view(b, t, H, DK)
    k = m.linear_k(x).view(b, t, H, DK).transpose(1, 2)
    v = m.linear_v(x).view(b, t, H, DK).transpose(1, 2)
    p = m.linear_pos(pos_emb).view(1, -1, H, DK).transpose(1, 2)
    ac = (q + m.pos_bias_u).transpose(1, 2) @ k.transpose(-2, -1)
    bd = (q + m.pos_bias_v).transpose(1, 2) @ p.transpose(-2, -1)
    bd = rel_shift(bd, None if legacy else t)
    scores = (ac + bd) / math.sqrt(DK)
    if mask is None:
        attn = scores.softmax(-1)
    elif nemo:
        blocked = mask.unsqueeze(1)
        attn = scores.masked_fill(blocked, -10000.0).softmax(-1).masked_fill(blocked, 0.0)
    else:
        blocked = mask.unsqueeze(1).eq(0)
        fill = torch.finfo(scores.dtype).min
        attn = scores.masked_fill(blocked, fill).softmax(-1).masked_fill(blocked, 0.0)
    out = (attn @ v).transpose(1, 2).reshape(b, t, E)
    result: Tensor = m.linear_out(out)
    return result


def espnet_mask(lengths: list[int], t: int) -> Tensor:
    """ESPnet's ``(B, 1, T)``, True = real frame."""
    return (torch.arange(t) < torch.tensor(lengths)[:, None]).unsqueeze(1)


# --------------------------------------------------------------------------------------------------
# Relative attention


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("exact", [False, True])
def test_relative_attention_equals_espnets_math(bias: bool, exact: bool) -> None:
    # ESPnet's float32 table by default; with encoding_dtype=float64 both use the exact sinusoids.
    theirs = randomize(RelPositionMultiHeadedAttention(bias=bias))
    dtype = torch.float64 if exact else torch.float32
    ours = attnkit.interop.espnet.relative_attention(theirs, encoding_dtype=dtype)
    x = randn(3, 9, E)
    mask = espnet_mask([9, 6, 0], 9)  # the last sequence is all padding: rows of zeros
    with torch.no_grad():
        want = espnet_attention(theirs, x, mask, exact=exact)
        for backend in ("reference", "sdpa", "chunked"):
            got = ours(x, mask=mask.unsqueeze(1), backend=backend)
            agrees(got, want)
    if bias:  # ESPnet's empty rows: uniform weights zeroed, so linear_out's bias alone
        agrees(got[2], theirs.linear_out.bias.expand(9, E))


def test_relative_attention_is_nemos_math_too() -> None:
    theirs = randomize(RelPositionMultiHeadAttention(), seed=3)
    ours = attnkit.interop.espnet.relative_attention(theirs)
    x = randn(2, 8, E, seed=4)
    blocked = ~espnet_mask([8, 5], 8).expand(2, 8, 8)  # NeMo: (B, T, T), True = blocked
    with torch.no_grad():
        agrees(ours(x, mask=~blocked.unsqueeze(1)), espnet_attention(theirs, x, blocked, nemo=True))


def test_float32_table_matters_at_long_distances() -> None:
    # At a few hundred frames ESPnet's float32 angles are off by ~1e-5 radians: the default load
    # reproduces them, the exact sinusoids do not (the negative control of the option).
    theirs = randomize(RelPositionMultiHeadedAttention(), seed=8)
    x = randn(1, 400, E, seed=9)
    with torch.no_grad():
        want = espnet_attention(theirs, x, None)
        agrees(attnkit.interop.espnet.relative_attention(theirs)(x), want)
        exact = attnkit.interop.espnet.relative_attention(theirs, encoding_dtype=torch.float64)
        assert (exact(x) - want).abs().max() > 1e-8
        agrees(exact(x), espnet_attention(theirs, x, None, exact=True))


def test_unpermuted_linear_pos_is_far_off() -> None:
    # The negative control: ESPnet's linear_pos copied as it is (interleaved columns against
    # attnkit's sines-then-cosines table) is a different function.
    theirs = randomize(RelPositionMultiHeadedAttention())
    ours = attnkit.interop.espnet.relative_attention(theirs)
    with torch.no_grad():
        ours.pos_proj.weight.copy_(theirs.linear_pos.weight)
        x = randn(2, 9, E)
        assert (ours(x) - espnet_attention(theirs, x, None)).abs().max() > 1e-2


@pytest.mark.parametrize(("t", "max_len"), [(9, 5000), (9, 20), (9, 6)])
def test_relative_attention_legacy_equals_espnets_legacy_math(t: int, max_len: int) -> None:
    theirs = randomize(LegacyRelPositionMultiHeadedAttention(), seed=5)
    ours = attnkit.interop.espnet.relative_attention(theirs, max_len=max_len)
    assert ours.legacy == "espnet"
    assert ours.legacy_max_len == max_len
    x = randn(2, t, E, seed=6)
    mask = espnet_mask([t, t - 3], t)
    with torch.no_grad():
        want = espnet_attention(theirs, x, mask, legacy=True, max_len=max_len)
        for backend in ("reference", "sdpa", "chunked"):
            agrees(ours(x, mask=mask.unsqueeze(1), backend=backend), want)
        # The legacy class loaded as the current one is far off: the modes are not interchangeable.
        current = attnkit.interop.espnet.relative_attention(
            randomize(RelPositionMultiHeadedAttention(), seed=5)
        )
        assert (current(x, mask=mask.unsqueeze(1)) - want).abs().max() > 1e-2


@pytest.mark.usefixtures("no_shape_checks")
def test_relative_attention_refuses_what_it_cannot_reproduce() -> None:
    m = RelPositionMultiHeadedAttention()
    m.zero_triu = True
    with pytest.raises(ValueError, match="zero_triu=True"):
        attnkit.interop.espnet.relative_attention(m)
    m = RelPositionMultiHeadedAttention()
    m.q_norm = nn.LayerNorm(DK)  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"RelPositionMultiHeadedAttention.q_norm is LayerNorm"):
        attnkit.interop.espnet.relative_attention(m)
    with pytest.raises(TypeError, match="got MultiHeadedAttention"):
        attnkit.interop.espnet.relative_attention(type("MultiHeadedAttention", (nn.Module,), {})())
    m = RelPositionMultiHeadedAttention()
    m.linear_k = nn.Linear(E, E, bias=False, dtype=F64)
    with pytest.raises(ValueError, match="only some projections have a bias"):
        attnkit.interop.espnet.relative_attention(m)
    m = RelPositionMultiHeadedAttention()
    m.pos_bias_u = nn.Parameter(torch.zeros(DK, H, dtype=F64))
    with pytest.raises(ValueError, match=r"pos_bias_u \(H, dh\) is \(4, 3\), expected \(3, 4\)"):
        attnkit.interop.espnet.relative_attention(m)
    odd = RelPositionMultiHeadedAttention(n_head=3, n_feat=9)
    with pytest.raises(ValueError, match="d_model must be even for a sinusoidal table, got 9"):
        attnkit.interop.espnet.relative_attention(odd)


# --------------------------------------------------------------------------------------------------
# Conformer layer


class Swish(nn.Module):  # ESPnet's activation: x * sigmoid(x)
    pass


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_ff: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(E, d_ff, dtype=F64)
        self.w_2 = nn.Linear(d_ff, E, dtype=F64)
        self.dropout = nn.Dropout(0.0)
        self.activation = Swish()


class ConvolutionModule(nn.Module):
    def __init__(self, kernel_size: int) -> None:
        super().__init__()
        self.pointwise_conv1 = nn.Conv1d(E, 2 * E, 1, dtype=F64)
        self.depthwise_conv = nn.Conv1d(
            E, E, kernel_size, padding=(kernel_size - 1) // 2, groups=E, dtype=F64
        )
        self.norm = nn.BatchNorm1d(E, dtype=F64)
        self.pointwise_conv2 = nn.Conv1d(E, E, 1, dtype=F64)
        self.activation = Swish()


class EncoderLayer(nn.Module):
    def __init__(self, kernel_size: int = 5, d_ff: int = 20, legacy: bool = False) -> None:
        super().__init__()
        attn = LegacyRelPositionMultiHeadedAttention if legacy else RelPositionMultiHeadedAttention
        self.self_attn = attn()
        self.feed_forward = PositionwiseFeedForward(d_ff)
        self.feed_forward_macaron = PositionwiseFeedForward(d_ff)
        self.conv_module = ConvolutionModule(kernel_size)
        for name in ("norm_ff", "norm_mha", "norm_ff_macaron", "norm_conv", "norm_final"):
            setattr(self, name, nn.LayerNorm(E, eps=1e-12, dtype=F64))  # ESPnet's LayerNorm
        self.dropout = nn.Dropout(0.0)
        self.ff_scale = 0.5
        self.normalize_before = True
        self.concat_after = False


def espnet_layer(layer: EncoderLayer, x: Tensor, mask: Tensor, *, legacy: bool = False) -> Tensor:
    """ESPnet's ``EncoderLayer.forward((x, pos_emb), mask)`` in eval mode, as released: the
    convolution module takes no mask."""

    def ff(module: PositionwiseFeedForward, h: Tensor) -> Tensor:
        hidden = module.w_1(h)
        out: Tensor = module.w_2(hidden * torch.sigmoid(hidden))
        return out

    def conv(module: ConvolutionModule, h: Tensor) -> Tensor:
        h = F.glu(module.pointwise_conv1(h.transpose(1, 2)), dim=1)
        h = module.depthwise_conv(h)  # padded frames included: ESPnet's convolution sees them
        bn = module.norm
        h = (h - bn.running_mean[:, None]) / torch.sqrt(bn.running_var[:, None] + bn.eps)
        h = h * bn.weight[:, None] + bn.bias[:, None]
        out: Tensor = module.pointwise_conv2(h * torch.sigmoid(h)).transpose(1, 2)
        return out

    x = x + 0.5 * ff(layer.feed_forward_macaron, layer.norm_ff_macaron(x))
    x = x + espnet_attention(layer.self_attn, layer.norm_mha(x), mask, legacy=legacy)
    x = x + conv(layer.conv_module, layer.norm_conv(x))
    x = x + 0.5 * ff(layer.feed_forward, layer.norm_ff(x))
    out: Tensor = layer.norm_final(x)
    return out


def espnet_encoder_layer(seed: int = 0, **kw: object) -> EncoderLayer:
    layer = randomize(EncoderLayer(**kw), seed=seed)  # type: ignore[arg-type]
    bn = layer.conv_module.norm
    gen = torch.Generator().manual_seed(seed + 1)
    bn.running_mean.copy_(torch.randn(E, generator=gen, dtype=F64))
    bn.running_var.copy_(torch.rand(E, generator=gen, dtype=F64) + 0.5)
    return layer.eval()  # type: ignore[return-value]


@pytest.mark.parametrize("legacy", [False, True])
def test_conformer_layer_equals_espnets_math_unpadded(legacy: bool) -> None:
    # Unpadded input: ESPnet's convolution module lets padded frames into the depthwise
    # convolution, attnkit's does not, so the two are compared where there is no padding.
    theirs = espnet_encoder_layer(legacy=legacy)
    ours = attnkit.interop.espnet.conformer_layer(theirs)
    assert not ours.training
    x = randn(2, 11, E, seed=7)
    with torch.no_grad():
        want = espnet_layer(theirs, x, espnet_mask([11, 11], 11), legacy=legacy)
        agrees(ours(x), want)
        agrees(ours(x, mask=torch.ones(2, 11, dtype=torch.bool)), want)


def test_conformer_layer_padded_is_espnet_alone() -> None:
    # On a padded batch attnkit gives each sequence what ESPnet gives it alone; ESPnet's own
    # padded batch differs at the last (kernel_size - 1) / 2 real frames, where its depthwise
    # convolution reads the padded frames.
    theirs = espnet_encoder_layer(seed=2, kernel_size=5)
    ours = attnkit.interop.espnet.conformer_layer(theirs)
    x = randn(2, 10, E, seed=8)
    with torch.no_grad():
        got = ours(x, mask=masks.padding_mask([10, 6]))
        alone = espnet_layer(theirs, x[1:, :6], espnet_mask([6], 6))
        agrees(got[1, :6], alone[0])
        agrees(got[0], espnet_layer(theirs, x[:1], espnet_mask([10], 10))[0])
        espnet_padded = espnet_layer(theirs, x, espnet_mask([10, 6], 10))
    gap = (espnet_padded[1, :6] - alone[0]).abs().amax(-1)
    assert gap[:4].max() < 1e-12  # frames further than 2 from the padding: unaffected
    assert gap[4:].min() > 1e-3  # the last two real frames: ESPnet lets the padding in


@pytest.mark.usefixtures("no_shape_checks")
def test_conformer_layer_refuses_what_it_cannot_reproduce() -> None:
    layer = espnet_encoder_layer()
    layer.normalize_before = False
    with pytest.raises(ValueError, match=r"only normalize_before=True \(pre-norm\)"):
        attnkit.interop.espnet.conformer_layer(layer)
    layer = espnet_encoder_layer()
    layer.feed_forward_macaron = None  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"EncoderLayer\.feed_forward_macaron is missing or None"):
        attnkit.interop.espnet.conformer_layer(layer)
    layer = espnet_encoder_layer()
    layer.conv_module.activation = nn.Tanh()
    with pytest.raises(ValueError, match=r"activation Tanh\(\) has no attnkit equivalent"):
        attnkit.interop.espnet.conformer_layer(layer)
    layer = espnet_encoder_layer()
    layer.concat_after = True
    with pytest.raises(ValueError, match="concat_after=True has no attnkit equivalent"):
        attnkit.interop.espnet.conformer_layer(layer)
