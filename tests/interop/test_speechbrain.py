"""SpeechBrain's ``RelPosMHAXL`` fed by ``RelPosEncXL``, loaded into attnkit.

The module is a stand-in with SpeechBrain's parameter names and shapes (no SpeechBrain code); its
forward and its encoding are re-stated here from SpeechBrain's published math, in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

import attnkit
from tests.interop.helpers import agrees

E, H = 12, 3
DH = E // H
F64 = torch.float64


class RelPosMHAXL(nn.Module):  # SpeechBrain's names and shapes
    def __init__(self, *, vbias: bool = False, mask_pos_future: bool = False) -> None:
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = E, H, DH
        self.in_proj_weight = nn.Parameter(torch.empty(3 * E, E, dtype=F64))
        self.vbias: bool | None = True if vbias else None
        if vbias:
            self.value_bias_weight = nn.Parameter(torch.empty(E, dtype=F64))
        self.dropout_att = nn.Dropout(0.0)
        self.out_proj = nn.Linear(E, E, dtype=F64)
        self.linear_pos = nn.Linear(E, E, bias=False, dtype=F64)
        self.pos_bias_u = nn.Parameter(torch.empty(DH, H, dtype=F64))  # (head_dim, num_heads)
        self.pos_bias_v = nn.Parameter(torch.empty(DH, H, dtype=F64))
        self.scale = 1 / math.sqrt(E)
        self.mask_pos_future = mask_pos_future


def make(seed: int = 0, **kw: bool) -> RelPosMHAXL:
    m = RelPosMHAXL(**kw)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64))
    return m


def randn(*shape: int, seed: int = 1) -> Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def rel_pos_enc_xl(t: int, *, signed: bool = False, exact: bool = False) -> Tensor:
    """``RelPosEncXL``: rows of distances ``T-1 .. 0`` (the past, flipped), then ``-1 .. -(T-1)``
    (the future) whose sines are the past's (``signed=True``: of the negative distance). Computed
    in float32 as SpeechBrain does (``exact=True``: in float64), returned in float64."""
    work = F64 if exact else torch.float32
    f = torch.exp(torch.arange(0, E, 2, dtype=work) * -(math.log(10000.0) / E))
    p = torch.arange(t, dtype=work)[:, None]
    past = torch.zeros(t, E, dtype=work)
    future = torch.zeros(t, E, dtype=work)
    past[:, 0::2], past[:, 1::2] = torch.sin(p * f), torch.cos(p * f)
    future[:, 0::2] = torch.sin(-p * f) if signed else torch.sin(p * f)
    future[:, 1::2] = torch.cos(-p * f)
    return torch.cat([past.flip(0), future[1:]]).to(F64)  # (2T-1, E)


def speechbrain_attention(
    m: RelPosMHAXL,
    x: Tensor,
    key_padding_mask: Tensor | None = None,
    *,
    signed: bool = False,
    layout: str = "per_head",
    u_read: str = "view",
    exact: bool = False,
) -> Tensor:
    """``m(x, x, x, pos_embs, key_padding_mask=...)``: SpeechBrain's self-attention path.

    ``layout="blocks"`` reads ``in_proj_weight`` as its cross-attention path does, and
    ``u_read="transpose"`` transposes the biases instead of viewing them: the readings the
    loader must not take, as negative controls."""
    b, t, _ = x.shape
    if layout == "per_head":
        q, k, v = nn.functional.linear(x, m.in_proj_weight).view(b, t, H, 3 * DH).chunk(3, -1)
    else:
        q, k, v = (nn.functional.linear(x, w).view(b, t, H, DH) for w in m.in_proj_weight.chunk(3))
    if m.vbias is not None:
        v = v + m.value_bias_weight.view(1, 1, H, DH)
    pos = rel_pos_enc_xl(t, signed=signed, exact=exact)
    p_k = m.linear_pos(pos).view(1, -1, H, DH)

    def bias(p: Tensor) -> Tensor:
        return p.view(1, 1, H, DH) if u_read == "view" else p.T.reshape(1, 1, H, DH)

    q_u = (q + bias(m.pos_bias_u)).transpose(1, 2)
    q_v = (q + bias(m.pos_bias_v)).transpose(1, 2)
    ac = (q_u * m.scale) @ k.permute(0, 2, 3, 1)
    bd = (q_v * m.scale) @ p_k.permute(0, 2, 3, 1)  # (B, H, T, 2T-1)
    # rel_shift: zero column on the left, rows re-read, the first dropped, future masked, cropped
    _, _, qlen, pos_len = bd.shape
    bd = nn.functional.pad(bd, (1, 0)).view(b, H, -1, qlen)[:, :, 1:].reshape(b, H, qlen, pos_len)
    if m.mask_pos_future:
        bd = bd * torch.tril(torch.ones(qlen, pos_len, dtype=F64), pos_len - qlen)
    scores = ac + bd[..., : pos_len // 2 + 1]
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask.view(b, 1, 1, t), float("-inf"))
    attn = scores.softmax(-1)
    if key_padding_mask is not None:
        attn = attn.masked_fill(key_padding_mask.view(b, 1, 1, t), 0.0)
    out = (attn @ v.transpose(1, 2)).transpose(1, 2).reshape(b, t, E)
    result: Tensor = m.out_proj(out)
    return result


def padding(lengths: list[int], t: int) -> Tensor:
    """SpeechBrain's ``key_padding_mask``: True = padding."""
    return torch.arange(t) >= torch.tensor(lengths)[:, None]


@pytest.mark.parametrize("vbias", [False, True])
@pytest.mark.parametrize("mask_pos_future", [False, True])
def test_relative_attention_equals_its_math(vbias: bool, mask_pos_future: bool) -> None:
    theirs = make(vbias=vbias, mask_pos_future=mask_pos_future)
    ours = attnkit.interop.speechbrain.relative_attention(theirs)
    assert ours.encoding == "symmetric"
    assert ours.scale == 1 / math.sqrt(E)
    x = randn(3, 9, E)
    pad = padding([9, 5, 0], 9)
    with torch.no_grad():
        want = speechbrain_attention(theirs, x, pad)
        for backend in ("reference", "sdpa", "chunked"):
            agrees(ours(x, mask=~pad[:, None, None, :], backend=backend), want)


def test_signed_encoding_loads_with_encoding_signed() -> None:
    theirs = make(seed=2)
    ours = attnkit.interop.speechbrain.relative_attention(theirs, encoding="signed")
    x = randn(2, 8, E, seed=3)
    with torch.no_grad():
        agrees(ours(x), speechbrain_attention(theirs, x, signed=True))


@pytest.mark.parametrize("encoding", ["symmetric", "signed"])
def test_exact_sinusoids_with_encoding_dtype_float64(encoding: str) -> None:
    theirs = make(seed=6)
    ours = attnkit.interop.speechbrain.relative_attention(
        theirs,
        encoding=encoding,  # type: ignore[arg-type]
        encoding_dtype=torch.float64,
    )
    x = randn(2, 300, E, seed=7)
    signed = encoding == "signed"
    with torch.no_grad():
        got = ours(x)
        agrees(got, speechbrain_attention(theirs, x, signed=signed, exact=True))
        # SpeechBrain's own float32 table is another function at a few hundred frames.
        assert (got - speechbrain_attention(theirs, x, signed=signed)).abs().max() > 1e-8


def test_each_mapping_matters() -> None:
    # Negative controls: each misreading of SpeechBrain's layout is far off, so the test above
    # can fail. The symmetric encoding against the signed one is the issue's ~20 on outputs of ~20.
    theirs = make(seed=4)
    ours = attnkit.interop.speechbrain.relative_attention(theirs)
    x = randn(2, 9, E, seed=5)
    with torch.no_grad():
        got = ours(x)
        assert (got - speechbrain_attention(theirs, x, signed=True)).abs().max() > 1.0
        assert (got - speechbrain_attention(theirs, x, layout="blocks")).abs().max() > 1.0
        assert (got - speechbrain_attention(theirs, x, u_read="transpose")).abs().max() > 1e-1
        unpermuted = attnkit.interop.speechbrain.relative_attention(theirs)
        unpermuted.pos_proj.weight.copy_(theirs.linear_pos.weight)
        assert (unpermuted(x) - got).abs().max() > 1e-1


@pytest.mark.usefixtures("no_shape_checks")
def test_relative_attention_refuses_what_it_cannot_reproduce() -> None:
    with pytest.raises(TypeError, match="takes SpeechBrain's RelPosMHAXL, got Linear"):
        attnkit.interop.speechbrain.relative_attention(nn.Linear(2, 2))
    m = make()
    del m.in_proj_weight
    with pytest.raises(ValueError, match=r"without in_proj_weight \(vdim != embed_dim\)"):
        attnkit.interop.speechbrain.relative_attention(m)
    with pytest.raises(ValueError, match="encoding must be 'symmetric' or 'signed', got 'none'"):
        attnkit.interop.speechbrain.relative_attention(make(), encoding="none")  # type: ignore[arg-type]
