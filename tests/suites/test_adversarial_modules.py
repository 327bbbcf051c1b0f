"""attnkit's modules under hostile use: degenerate shapes, independent re-statements of their
formulas, and torch's modules as the reference for every mask form torch takes.

Each test compares numbers: a float64 re-statement written here from the papers' formulas (not
from attnkit's code), torch's own modules, or the module on other inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import attnkit
from attnkit import masks
from attnkit.interop.torch import from_torch, from_torch_masks
from attnkit.testing import assert_close

F64 = torch.float64
D = 16
HEADS = 4


def randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------
# Empty sequences


def _self(module: nn.Module) -> Callable[[Tensor], Tensor]:
    return lambda x: module(x)


def _decoder(module: nn.Module) -> Callable[[Tensor], Tensor]:
    memory = randn(2, 3, D, seed=9)
    return lambda x: module(x, memory)


EMPTY: dict[
    str, Callable[[], tuple[nn.Module, Callable[[nn.Module], Callable[[Tensor], Tensor]]]]
] = {
    "multihead": lambda: (attnkit.MultiHeadAttention(D, HEADS, dtype=F64), _self),
    "relative": lambda: (attnkit.RelativeMultiHeadAttention(D, HEADS, dtype=F64), _self),
    "conformer": lambda: (attnkit.ConformerLayer(D, HEADS, kernel_size=5, dtype=F64), _self),
    "conformer-context": lambda: (
        attnkit.ConformerLayer(D, HEADS, kernel_size=3, context=(2, 1), dtype=F64),
        _self,
    ),
    "encoder-layer": lambda: (attnkit.TransformerEncoderLayer(D, HEADS, dtype=F64), _self),
    "decoder-layer": lambda: (attnkit.TransformerDecoderLayer(D, HEADS, dtype=F64), _decoder),
    "feed-forward": lambda: (attnkit.PositionwiseFeedForward(D, 24, dtype=F64), _self),
}


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(EMPTY))
def test_every_module_takes_an_empty_sequence(name: str, training: bool) -> None:
    # T = 0 gives (B, 0, D) and a backward, as torch's own layers do; the rows of a longer call
    # do not depend on it (the same module on a batch of 5 frames is unchanged by the empty call).
    torch.manual_seed(0)
    module, call = EMPTY[name]()
    module.train(training)
    x = randn(2, 5, D, seed=1)
    module.eval()
    with torch.no_grad():
        before = call(module)(x)
    module.train(training)
    empty = randn(2, 0, D, seed=2).requires_grad_()
    out = call(module)(empty)
    assert out.shape == (2, 0, D)
    (grad,) = torch.autograd.grad(out.sum(), empty)
    assert grad.shape == (2, 0, D)
    module.eval()
    with torch.no_grad():
        assert_close(call(module)(x), before)


# --------------------------------------------------------------------------------------------------
# Relative attention: Transformer-XL's formula with its pad-and-reshape relative shift


def _rel_shift(bd: Tensor) -> Tensor:
    """Transformer-XL's shift of ``(B, H, Tq, P)`` scores against the distances ``Tk - 1 .. 1 -
    Tq`` (``P = Tq + Tk - 1``): pad a zero column, read the rows as ``(P + 1, Tq)``, drop the
    first, and keep ``Tk`` columns; row ``i`` then holds the distances ``a_i - j``."""
    b, h, tq, p = bd.shape
    padded = torch.cat([bd.new_zeros(b, h, tq, 1), bd], dim=-1).view(b, h, p + 1, tq)
    return padded[:, :, 1:].reshape(b, h, tq, p)[..., : p - tq + 1]


def _transformer_xl(
    m: attnkit.RelativeMultiHeadAttention, q_in: Tensor, kv_in: Tensor, allowed: Tensor
) -> Tensor:
    """``((q + u) . k + (q + v) . W_r r(a_i - j)) / sqrt(dh)``, r sinusoidal (sines | cosines)."""
    b, tq, _ = q_in.shape
    tk = kv_in.size(1)
    dh = D // HEADS

    def heads(t: Tensor) -> Tensor:
        return t.view(b, -1, HEADS, dh).transpose(1, 2)

    q, k, v = heads(m.q_proj(q_in)), heads(m.k_proj(kv_in)), heads(m.v_proj(kv_in))
    distance = torch.arange(tk - 1, -tq, -1, dtype=F64)[:, None]
    freq = torch.pow(10000.0, -torch.arange(0, D, 2, dtype=F64) / D)
    r = torch.cat([torch.sin(distance * freq), torch.cos(distance * freq)], dim=-1)
    r = (r @ m.pos_proj.weight.T).view(-1, HEADS, dh).transpose(0, 1)  # (H, P, dh)
    ac = (q + m.pos_bias_u[:, None]) @ k.transpose(-1, -2)
    bd = _rel_shift((q + m.pos_bias_v[:, None]) @ r.transpose(-1, -2))
    scores = ((ac + bd) / math.sqrt(dh)).masked_fill(~allowed, -math.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return m.out_proj((weights @ v).transpose(1, 2).reshape(b, tq, D))


@pytest.mark.parametrize("backend", ["reference", "chunked"])
@pytest.mark.parametrize(("tq", "tk"), [(1, 1), (4, 4), (7, 7), (5, 8), (6, 9)])
@pytest.mark.parametrize("window", [None, (2, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_relative_attention_is_transformer_xl_with_its_rel_shift(
    backend: str, tq: int, tk: int, window: tuple[int, int] | None, causal: bool
) -> None:
    # Odd and even lengths, memory before the queries (tk > tq), padding, causal and windowed:
    # outputs and input gradients equal the shifted formula.
    torch.manual_seed(tq * 10 + tk)
    m = attnkit.RelativeMultiHeadAttention(D, HEADS, dtype=F64, backend=backend)
    with torch.no_grad():
        m.pos_bias_u.normal_()
        m.pos_bias_v.normal_()
    x = randn(2, tk, D, seed=tk).requires_grad_()
    lengths = [tk, max(1, tk - 2)]
    mask: masks.Mask = masks.key_padding(lengths)
    pos = torch.arange(tq)[:, None] + tk - tq  # a_i
    key = torch.arange(tk)[None]
    allowed = (key < torch.tensor(lengths)[:, None, None])[:, None]  # (B, 1, 1, Tk)
    if causal:
        allowed = allowed & (key <= pos)
    if window is not None:
        left, right = window
        mask = mask & masks.sliding_window(left, right)
        allowed = allowed & (key - pos >= -left) & (key - pos <= right)
    got = m(x[:, -tq:], x, mask=mask, causal=causal)
    want = _transformer_xl(m, x[:, -tq:], x, allowed)
    assert_close(got, want)
    grad = randn(*got.shape, seed=3)
    assert_close(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(want, x, grad)[0])


# --------------------------------------------------------------------------------------------------
# torch.nn.MultiheadAttention's mask forms, rows torch leaves NaN


@pytest.mark.parametrize(
    "config",
    [{}, {"bias": False}, {"kdim": 5, "vdim": 7}, {"add_bias_kv": True, "add_zero_attn": True}],
    ids=["packed", "no-bias", "kdim-vdim", "extra-tokens"],
)
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
def test_float_masks_with_blocked_rows_equal_torch_where_torch_is_finite(
    config: dict[str, object],
) -> None:
    # A 3-D float attn_mask (B*H, Tq, Tk) with a row of -inf: torch returns NaN for that query
    # (unless add_zero_attn or bias_k leave it a key); attnkit returns 0 from the attention, as
    # documented for a query with no key, and torch's numbers everywhere else.
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(12, 3, batch_first=True, dtype=F64, **config).eval()  # type: ignore[arg-type]
    ours = from_torch(theirs).eval()
    kdim, vdim = int(config.get("kdim", 12)), int(config.get("vdim", 12))  # type: ignore[call-overload]
    q, k, v = randn(2, 5, 12, seed=1), randn(2, 7, kdim, seed=2), randn(2, 7, vdim, seed=3)
    attn_mask = randn(2 * 3, 5, 7, seed=4)
    attn_mask[4, 2] = -math.inf  # batch 1, head 1, query 2
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[0, 5:] = True
    want, _ = theirs(q, k, v, attn_mask=attn_mask, key_padding_mask=kpm)
    _, want_w = theirs(
        q, k, v, attn_mask=attn_mask, key_padding_mask=kpm, average_attn_weights=False
    )
    mask, bias = from_torch_masks(attn_mask, kpm, num_heads=3, dtype=F64)
    got, got_w = ours(q, k, v, mask=mask, bias=bias, need_weights=True, average_weights=False)
    assert got.isfinite().all()
    assert got_w.isfinite().all()
    if "add_zero_attn" in config:  # the extra keys stay visible to every query, as in torch
        assert_close(got, want)
        assert_close(got_w, want_w)
        return
    # torch: NaN weights for the blocked head's row, so NaN in the whole output row; attnkit:
    # that head's weights and attention output are 0, the other heads' are torch's.
    assert want_w[1, 1, 2].isnan().all()
    assert want[1, 2].isnan().all()
    assert (got_w[1, 1, 2] == 0).all()
    assert_close(got_w, want_w.nan_to_num(0.0))
    w_v = theirs.in_proj_weight[24:] if theirs.in_proj_weight is not None else theirs.v_proj_weight
    b_v = theirs.in_proj_bias[24:] if theirs.in_proj_bias is not None else None
    heads = nn.functional.linear(v, w_v, b_v).view(2, 7, 3, 4).transpose(1, 2)
    expected = theirs.out_proj((want_w.nan_to_num(0.0) @ heads).transpose(1, 2).reshape(2, 5, 12))
    assert_close(got, expected)
    assert_close(got[want.isfinite()].view(-1), want[want.isfinite()].view(-1))
