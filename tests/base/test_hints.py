"""The mistakes people bring from torch: its mask convention (warned once) and its keyword names
(an error naming attnkit's), in attnkit._base.hints and where the modules use it."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import attnkit
from attnkit import ConformerLayer, MultiHeadAttention, RelativeMultiHeadAttention
from attnkit._base import hints as _hints
from attnkit.testing import assert_close


@pytest.fixture(autouse=True)
def fresh_warnings() -> Iterator[None]:
    saved = set(_hints._warned)
    _hints._warned.clear()
    yield
    _hints._warned.clear()
    _hints._warned.update(saved)


def torch_key_padding(lengths: list[int], t: int) -> torch.Tensor:
    """torch's convention: True = padding."""
    return torch.arange(t)[None, :] >= torch.tensor(lengths)[:, None]


def test_a_torch_key_padding_mask_warns_once_and_names_the_conversion() -> None:
    kpm = torch_key_padding([5, 3], 5)  # sequence 0 has no padding: all False
    with pytest.warns(UserWarning, match="lets no query of batch element 0 .of 2. attend") as rec:
        _hints.warn_torch_convention(kpm[:, None, None, :])
    message = str(rec[0].message)
    assert "attnkit.interop.torch.from_torch_masks(" in message
    assert "True = may NOT attend" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _hints.warn_torch_convention(kpm[:, None, None, :])  # once per process


def test_a_torch_causal_mask_warns() -> None:
    with pytest.warns(UserWarning, match=r"strictly upper triangle of a \(4, 4\)"):
        _hints.warn_torch_convention(torch.ones(4, 4, dtype=torch.bool).triu(1))


@pytest.mark.parametrize(
    "mask",
    [
        torch.ones(4, 4, dtype=torch.bool).tril(),  # attnkit's causal mask
        ~torch_key_padding([5, 3], 5)[:, None, None, :],  # attnkit's key padding
        torch.zeros(2, 3, 4, dtype=torch.bool),  # (H, Tq, Tk): no batch dims to judge
        torch.ones(1, 1, 4, 4, dtype=torch.bool).triu(0),  # includes the diagonal
        torch.empty(2, 1, 1, 5, dtype=torch.bool, device="meta"),
    ],
)
def test_masks_in_attnkit_convention_do_not_warn(mask: torch.Tensor) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _hints.warn_torch_convention(mask)


def test_modules_warn_for_a_mask_in_torch_convention() -> None:
    x = torch.randn(2, 5, 8)
    kpm = torch_key_padding([5, 3], 5)
    for module in (MultiHeadAttention(8, 2), RelativeMultiHeadAttention(8, 2)):
        _hints._warned.clear()
        with pytest.warns(UserWarning, match="from_torch_masks"):
            module(x, mask=kpm[:, None, None, :])
    _hints._warned.clear()
    with pytest.warns(UserWarning, match="from_torch_masks"):
        ConformerLayer(8, 2, kernel_size=3).eval()(x, mask=kpm)


def test_the_conversion_the_warning_names_gives_torch_s_result() -> None:
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    ours = attnkit.interop.torch.from_torch(theirs).eval()
    x = torch.randn(2, 5, 8)
    kpm = torch_key_padding([5, 3], 5)
    mask, bias = attnkit.interop.torch.from_torch_masks(key_padding_mask=kpm, num_heads=2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ours(x, mask=mask, bias=bias)
        want, _ = theirs(x, x, x, key_padding_mask=kpm, need_weights=False)
    assert_close(got[1, :3], want[1, :3])
    assert_close(got[0], want[0])


def test_torch_keywords_name_attnkit_s_argument() -> None:
    @_hints.torch_keywords
    def call(q: int, *, causal: bool = False, need_weights: bool = False) -> int:
        return q

    assert call(1, causal=True) == 1
    assert call(1, need_weights=True) == 1  # a name it takes is its own
    with pytest.raises(TypeError, match=r"call\(\) takes no is_causal= .torch's name.: instead"):
        call(1, is_causal=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"instead of attn_mask=, pass mask= .bool, True = may"):
        call(1, attn_mask=None)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("keyword", "advice"),
    [
        ("is_causal", "pass causal=True"),
        ("attn_mask", "from_torch_masks"),
        ("key_padding_mask", "mask=attnkit.masks.key_padding(lengths)"),
    ],
)
def test_modules_name_attnkit_s_argument_for_torch_s(keyword: str, advice: str) -> None:
    x = torch.randn(1, 3, 8)
    modules = [
        MultiHeadAttention(8, 2),
        RelativeMultiHeadAttention(8, 2),
        ConformerLayer(8, 2, kernel_size=3),
        attnkit.TransformerEncoderLayer(8, 2),
    ]
    for module in modules:
        with pytest.raises(TypeError, match=f"takes no {keyword}= .torch's name.") as err:
            module(x, **{keyword: True})
        assert advice in str(err.value)


@pytest.mark.parametrize("average", [True, False])
def test_torch_s_average_attn_weights_names_average_weights(average: bool) -> None:
    # MultiHeadAttention.forward(average_attn_weights=...) got Python's plain "unexpected keyword
    # argument": it names average_weights=, which gives torch's weights; elsewhere the advice is
    # to average the per-head weights.
    torch.manual_seed(1)
    theirs = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    ours = attnkit.interop.torch.from_torch(theirs).eval()
    x = torch.randn(2, 5, 8)
    with pytest.raises(TypeError, match=r"instead of average_attn_weights=, pass average_weights="):
        ours(x, need_weights=True, average_attn_weights=average)  # type: ignore[call-overload]
    q = x[:, None]
    with pytest.raises(TypeError, match=r"weights.mean\(dim=-3\) averages them"):
        attnkit.attention(q, q, q, average_attn_weights=average)  # type: ignore[call-arg]
    with torch.no_grad():
        got_out, got = ours(x, need_weights=True, average_weights=average)
        want_out, want = theirs(x, x, x, need_weights=True, average_attn_weights=average)
    assert_close(got_out, want_out)
    assert_close(got, want)


def test_the_padding_hint_only_for_a_b_tk_mask() -> None:
    assert "key_padding(valid=mask)" in _hints.padding_mask_hint((2, 7), (2, 4, 5, 7))
    assert "mask[:, None, None, :]" in _hints.padding_mask_hint((2, 7), (2, 4, 5, 7))
    assert _hints.padding_mask_hint((3, 7), (2, 4, 5, 7)) == ""
    assert _hints.padding_mask_hint((2, 1, 7), (2, 4, 5, 7)) == ""


def test_attention_itself_names_torch_s_keywords_and_warns_at_the_callers_line() -> None:
    q = torch.randn(2, 2, 5, 8)
    with pytest.raises(TypeError, match=r"attention\(\) takes no is_causal= .*pass causal=True"):
        attnkit.attention(q, q, q, is_causal=True)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"explain\(\) takes no attn_mask="):
        attnkit.explain(q, q, q, attn_mask=None)  # type: ignore[call-arg]
    kpm = torch_key_padding([5, 3], 5)[:, None, None, :]  # True = padding: row 0 sees nothing
    with pytest.warns(UserWarning, match="from_torch_masks") as record:
        attnkit.attention(q, q, q, mask=kpm)
    assert record[0].filename == __file__  # the user's line, not attnkit's
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        attnkit.attention(q, q, q, mask=kpm)


@pytest.mark.parametrize(
    ("keyword", "advice"),
    [
        ("src_key_padding_mask", "mask=attnkit.masks.key_padding(lengths)"),
        ("tgt_key_padding_mask", "mask=attnkit.masks.key_padding(lengths)"),
        ("memory_key_padding_mask", "memory_mask=attnkit.masks.key_padding(memory_lengths)"),
        ("src_is_causal", "causal=True"),
        ("tgt_is_causal", "causal unless given causal=False"),
        ("memory_is_causal", "memory_mask=attnkit.masks.causal()"),
    ],
)
def test_layers_name_attnkit_s_argument_for_torch_s_transformer_names(
    keyword: str, advice: str
) -> None:
    # torch's nn.TransformerEncoderLayer / DecoderLayer / Transformer keywords
    x = torch.randn(1, 3, 8)
    calls = [
        lambda **kw: attnkit.TransformerEncoderLayer(8, 2)(x, **kw),
        lambda **kw: attnkit.TransformerDecoderLayer(8, 2)(x, x, **kw),
        lambda **kw: attnkit.Transformer(8, 2, num_encoder_layers=1, num_decoder_layers=1)(
            x, x, **kw
        ),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=f"takes no {keyword}= .torch's name.") as err:
            call(**{keyword: None})
        assert advice in str(err.value)
    with pytest.raises(TypeError, match="torch's bool src_mask is True = may NOT attend"):
        attnkit.TransformerEncoderLayer(8, 2)(x, src_mask=None)
