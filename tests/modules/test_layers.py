"""Transformer layers against torch's, the encoder-decoder Transformer, injected attention."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import attnkit
from attnkit import (
    MultiHeadAttention,
    RelativeMultiHeadAttention,
    StreamingKVCache,
    Transformer,
    TransformerDecoderLayer,
    TransformerEncoderLayer,
    masks,
)
from attnkit.interop.torch import from_torch_masks
from attnkit.testing import assert_close

F64 = torch.float64


def randomize(module: nn.Module) -> None:
    """Non-trivial LayerNorm affines and biases (torch initialises them to 1 and 0)."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=0.3).add_(1.0 if p.ndim == 1 else 0.0)


def torch_padding(lengths: list[int], t: int) -> Tensor:
    """torch's key_padding_mask: True = padding."""
    return ~masks.padding_mask(lengths, max_len=t)[:, 0, 0]


@settings(max_examples=30)
@given(
    h=st.integers(1, 3),
    dh=st.integers(1, 4),
    d_ff=st.integers(1, 12),
    activation=st.sampled_from(["relu", "gelu"]),
    norm_first=st.booleans(),
    bias=st.booleans(),
    batch_first=st.booleans(),
    train=st.booleans(),
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_encoder_layer_from_torch(
    h: int,
    dh: int,
    d_ff: int,
    activation: str,
    norm_first: bool,
    bias: bool,
    batch_first: bool,
    train: bool,
    lengths: list[int],
    seed: int,
) -> None:
    torch.manual_seed(seed)
    d, b, t = h * dh, len(lengths), max(lengths)
    theirs = nn.TransformerEncoderLayer(
        d,
        h,
        d_ff,
        dropout=0.0,
        activation=activation,
        norm_first=norm_first,
        bias=bias,
        batch_first=batch_first,
        dtype=torch.float64,
    )
    randomize(theirs)
    theirs.train(train)
    ours = attnkit.interop.torch.from_torch(theirs, batch_first=True)  # fed x batch-first
    assert ours.training is train
    x = torch.randn(b, t, d, dtype=torch.float64)
    kpm = torch_padding(lengths, t)
    mask, _ = from_torch_masks(key_padding_mask=kpm, num_heads=h)
    # In eval without grad torch takes its fused fast path; in training its Python path.
    with torch.set_grad_enabled(train):
        want = theirs(x if batch_first else x.transpose(0, 1), src_key_padding_mask=kpm)
        got = ours(x, mask=mask)
    assert_close(got, want if batch_first else want.transpose(0, 1))


def test_encoder_layer_gradients_match_torch() -> None:
    torch.manual_seed(0)
    theirs = nn.TransformerEncoderLayer(
        12, 3, 20, dropout=0.0, batch_first=True, dtype=torch.float64
    )
    randomize(theirs)
    ours = attnkit.interop.torch.from_torch(theirs)
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 5, 12, dtype=torch.float64)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)  # torch: True = blocked
    theirs(x, src_mask=causal).backward(g)
    want = [x.grad.clone(), *(p.grad for p in theirs.parameters())]  # type: ignore[union-attr]
    x.grad = None
    ours(x, causal=True).backward(g)
    got = [x.grad, *(p.grad for p in ours.parameters())]
    assert len(got) == len(want)
    for a, w in zip(got, want, strict=True):
        assert_close(a, w)  # type: ignore[arg-type]


@settings(max_examples=20)
@given(
    norm_first=st.booleans(),
    activation=st.sampled_from(["relu", "gelu"]),
    t=st.integers(1, 5),
    mem_lengths=st.lists(st.integers(1, 6), min_size=1, max_size=2),
    seed=st.integers(0, 2**16),
)
def test_decoder_layer_from_torch(
    norm_first: bool, activation: str, t: int, mem_lengths: list[int], seed: int
) -> None:
    torch.manual_seed(seed)
    theirs = nn.TransformerDecoderLayer(
        8,
        2,
        16,
        dropout=0.0,
        activation=activation,
        norm_first=norm_first,
        batch_first=True,
        dtype=torch.float64,
    )
    randomize(theirs)
    ours = attnkit.interop.torch.from_torch(theirs).eval()
    b, tm = len(mem_lengths), max(mem_lengths)
    x = torch.randn(b, t, 8, dtype=torch.float64)
    memory = torch.randn(b, tm, 8, dtype=torch.float64)
    kpm = torch_padding(mem_lengths, tm)
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    want = theirs(x, memory, tgt_mask=causal, memory_key_padding_mask=kpm)
    memory_mask, _ = from_torch_masks(key_padding_mask=kpm, num_heads=2)
    assert_close(ours(x, memory, memory_mask=memory_mask), want)  # causal by default
    want = theirs(x, memory, memory_key_padding_mask=kpm)
    assert_close(ours(x, memory, memory_mask=memory_mask, causal=False), want)


# torch warns that its pre-norm encoder cannot use nested tensors; nothing to act on.
@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
def test_transformer_matches_torch_pre_norm() -> None:
    torch.manual_seed(0)
    theirs = nn.Transformer(
        16, 4, 2, 2, 24, dropout=0.0, norm_first=True, batch_first=True, dtype=torch.float64
    )
    randomize(theirs)
    ours = Transformer(
        16,
        4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=24,
        norm_first=True,
        dtype=torch.float64,
    )
    for i in range(2):
        ours.encoder_layers[i] = attnkit.interop.torch.from_torch(theirs.encoder.layers[i])
        ours.decoder_layers[i] = attnkit.interop.torch.from_torch(theirs.decoder.layers[i])
    ours.encoder_norm.load_state_dict(theirs.encoder.norm.state_dict())
    ours.decoder_norm.load_state_dict(theirs.decoder.norm.state_dict())
    src = torch.randn(2, 7, 16, dtype=torch.float64)
    tgt = torch.randn(2, 5, 16, dtype=torch.float64)
    src_pad = torch_padding([7, 4], 7)
    want = theirs(
        src,
        tgt,
        tgt_mask=nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64),
        src_key_padding_mask=src_pad,
        memory_key_padding_mask=src_pad,
    )
    pad = masks.padding_mask([7, 4])
    assert_close(ours(src, tgt, src_mask=pad, memory_mask=pad), want)


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_decoding_through_the_cache_equals_the_full_forward(norm_first: bool) -> None:
    torch.manual_seed(0)
    model = Transformer(
        16,
        4,
        num_encoder_layers=2,
        num_decoder_layers=3,
        num_kv_heads=2,
        norm_first=norm_first,
        dtype=torch.float64,
    ).eval()
    src = torch.randn(2, 6, 16, dtype=torch.float64)
    tgt = torch.randn(2, 7, 16, dtype=torch.float64)
    pad = masks.padding_mask([6, 3])
    with torch.no_grad():
        full = model(src, tgt, src_mask=pad, memory_mask=pad)
        memory = model.encode(src, mask=pad)
        cache = model.make_cache(2, max_len=7)
        steps = [model.decode(tgt[:, :3], memory, memory_mask=pad, cache=cache)]  # prompt
        steps += [
            model.decode(tgt[:, i : i + 1], memory, memory_mask=pad, cache=cache)
            for i in range(3, 7)
        ]
    assert [c.length for c in cache] == [7, 7, 7]
    assert_close(torch.cat(steps, 1), full)  # float64: 1e-10
    with pytest.raises(ValueError, match=r"one KVCache per decoder layer \(3\), got 1"):
        model.decode(tgt, memory, cache=cache[:1])


def test_encoder_layer_as_a_decoder_only_block_with_cache() -> None:
    torch.manual_seed(0)
    layer = TransformerEncoderLayer(16, 4, norm_first=True, dtype=torch.float64).eval()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    assert isinstance(layer.self_attn, MultiHeadAttention)
    cache = layer.self_attn.make_cache(1, 6)
    with torch.no_grad():
        full = layer(x, causal=True)
        steps = [layer(x[:, i : i + 1], causal=True, cache=cache) for i in range(6)]
    assert_close(torch.cat(steps, 1), full)


class Recorder(nn.Module):
    """A self-attention built elsewhere: plain MultiHeadAttention that records its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = MultiHeadAttention(8, 2, dtype=torch.float64)
        self.calls: list[dict[str, object]] = []

    def forward(self, x: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        self.calls.append({"mask": mask, "causal": causal})
        out: Tensor = self.inner(x, mask=mask, causal=causal)
        return out


def test_layers_take_attention_built_elsewhere() -> None:
    torch.manual_seed(0)
    rec = Recorder()
    layer = TransformerEncoderLayer(8, attention=rec, d_ff=16, dtype=torch.float64).eval()
    plain = TransformerEncoderLayer(8, 2, 16, dtype=torch.float64).eval()
    plain.self_attn.load_state_dict(rec.inner.state_dict())
    plain.ffn.load_state_dict(layer.ffn.state_dict())
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    pad = masks.padding_mask([5, 2])
    assert_close(layer(x, mask=pad, causal=True), plain(x, mask=pad, causal=True))
    assert rec.calls == [{"mask": pad, "causal": True}]
    assert "self_attn.inner.in_proj_weight" in dict(layer.named_parameters())
    # A cross-attention on a memory of another width (kdim = vdim = 3), built elsewhere.
    cross = MultiHeadAttention(8, 2, kdim=3, vdim=3, dtype=torch.float64)
    dec = TransformerDecoderLayer(8, 2, cross_attention=cross, dtype=torch.float64).eval()
    assert dec.cross_attn is cross
    randomize(dec)
    y = torch.randn(2, 3, 8, dtype=torch.float64)
    memory = torch.randn(2, 4, 3, dtype=torch.float64)
    memory_pad = masks.padding_mask([4, 2])
    assert_close(
        dec(y, memory, memory_mask=memory_pad), decoder_by_hand(dec, y, memory, memory_pad)
    )


def decoder_by_hand(
    dec: TransformerDecoderLayer, x: Tensor, memory: Tensor, memory_mask: Tensor
) -> Tensor:
    """A post-norm decoder layer in float64 from its definition: causal self-attention, then
    cross-attention on ``memory``, then the ReLU feed-forward, each as ``norm(x + sublayer(x))``;
    attention as explicit softmax weights over the heads' projections."""

    def mha(m: nn.Module, q_in: Tensor, kv_in: Tensor, allowed: Tensor) -> Tensor:
        h, dh = m.num_heads, m.head_dim
        params = {n: p.detach().double() for n, p in m.named_parameters()}
        if "in_proj_weight" in params:
            wq, wk, wv = params["in_proj_weight"].chunk(3)
        else:
            wq, wk, wv = params["q_proj_weight"], params["k_proj_weight"], params["v_proj_weight"]
        bq, bk, bv = params["in_proj_bias"].chunk(3)
        b, tq, tk = q_in.size(0), q_in.size(1), kv_in.size(1)
        q = (q_in @ wq.T + bq).view(b, tq, h, dh).transpose(1, 2)
        k = (kv_in @ wk.T + bk).view(b, tk, h, dh).transpose(1, 2)
        v = (kv_in @ wv.T + bv).view(b, tk, h, dh).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2) / dh**0.5).masked_fill(~allowed, float("-inf"))
        heads = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, tq, h * dh)
        out: Tensor = heads @ params["out_proj.weight"].T + params["out_proj.bias"]
        return out

    def norm(m: nn.LayerNorm, t: Tensor) -> Tensor:
        mean, var = t.mean(-1, keepdim=True), t.var(-1, unbiased=False, keepdim=True)
        out: Tensor = (t - mean) / (var + m.eps).sqrt() * m.weight.detach() + m.bias.detach()
        return out

    t = x.size(1)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    x = norm(dec.norm1, x + mha(dec.self_attn, x, x, causal))
    x = norm(dec.norm2, x + mha(dec.cross_attn, x, memory, memory_mask))
    ffn = dec.ffn
    hidden = (x @ ffn.linear1.weight.detach().T + ffn.linear1.bias.detach()).relu()
    return norm(dec.norm3, x + hidden @ ffn.linear2.weight.detach().T + ffn.linear2.bias.detach())


@pytest.mark.usefixtures("no_shape_checks")
def test_errors() -> None:
    with pytest.raises(ValueError, match=r"pass num_heads, or a ready-made attention= module"):
        TransformerEncoderLayer(8)
    with pytest.raises(
        ValueError, match=r"num_heads, rotary configure the attention attnkit builds"
    ):
        TransformerEncoderLayer(8, 2, attention=Recorder(), rotary=nn.Identity())
    with pytest.raises(TypeError, match=r"attention must be an nn.Module, got str"):
        TransformerEncoderLayer(8, attention="mha")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pass num_heads, or ready-made attention= and cross_att"):
        TransformerDecoderLayer(8, attention=Recorder())
    with pytest.raises(ValueError, match=r"memory_dim configure the attention attnkit builds"):
        TransformerDecoderLayer(8, 2, memory_dim=3, cross_attention=Recorder())
    with pytest.raises(ValueError, match=r"d_model \(10\) is not divisible by num_heads \(4\)"):
        TransformerEncoderLayer(10, 4)
    with pytest.raises(ValueError, match=r"activation must be one of"):
        TransformerEncoderLayer(8, 2, activation="tanh")
    torch_layer = nn.TransformerEncoderLayer(8, 2, activation=nn.Tanh())
    with pytest.raises(ValueError, match=r"activation Tanh\(\) has no attnkit equivalent"):
        attnkit.interop.torch.from_torch(torch_layer)
    with pytest.raises(ValueError, match=r"num_encoder_layers must be >= 0, got -1"):
        Transformer(8, 2, num_encoder_layers=-1)


def test_dropout_in_training_only() -> None:
    torch.manual_seed(0)
    layer = TransformerEncoderLayer(16, 4, dropout=0.3, dtype=torch.float64)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    layer.eval()
    a = layer(x)
    assert torch.equal(a, layer(x))
    layer.train()
    assert not torch.allclose(layer(x), a)


def test_encoder_layer_exports_with_a_mask() -> None:
    torch.manual_seed(0)
    layer = TransformerEncoderLayer(16, 4, norm_first=True).eval()
    x = torch.randn(2, 6, 16)
    pad = masks.padding_mask([6, 4])
    exported = torch.export.export(layer, (x,), {"mask": pad, "causal": True})
    assert_close(exported.module()(x, mask=pad, causal=True), layer(x, mask=pad, causal=True))


def test_encoder_layer_with_relative_attention() -> None:
    torch.manual_seed(0)
    rel = RelativeMultiHeadAttention(16, 4, dtype=torch.float64)
    layer = TransformerEncoderLayer(16, attention=rel, dtype=torch.float64).eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    pad = masks.padding_mask([5, 3])
    h = layer.norm1(x + rel(x, mask=pad))  # post-norm, composed by hand
    assert_close(layer(x, mask=pad), layer.norm2(h + layer.ffn(h)))


# --------------------------------------------------------------------------------------------------
# A decoding step that fails changes no cache


class Interrupted(nn.Module):
    """Stands in for a sublayer that fails after the self-attention appended to its cache."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error
        self.calls = 0

    def forward(self, *args: object, **kwargs: object) -> Tensor:
        self.calls += 1
        raise self.error


@pytest.mark.usefixtures("no_shape_checks")
def test_transformer_decode_step_is_all_or_nothing() -> None:
    torch.manual_seed(0)
    model = Transformer(
        16, 4, num_encoder_layers=1, num_decoder_layers=3, dtype=torch.float64
    ).eval()
    src = torch.randn(2, 5, 16, dtype=torch.float64)
    tgt = torch.randn(2, 4, 16, dtype=torch.float64)
    with torch.no_grad():
        full = model(src, tgt)
        memory = model.encode(src)
        cache = model.make_cache(2, max_len=4)
        steps = [model.decode(tgt[:, :2], memory, cache=cache)]
        # A mask that does not fit the keys held after the step (S = 3): refused in layer 0.
        with pytest.raises(ValueError, match=r"mask of shape \(1, 1, 1, 4\) does not broadcast"):
            model.decode(
                tgt[:, 2:3], memory, mask=torch.ones(1, 1, 1, 4, dtype=torch.bool), cache=cache
            )
        assert [c.length for c in cache] == [2, 2, 2]
        # A failure in the last layer, after layers 0 and 1 (and its own self-attention)
        # appended: Ctrl-C in its feed-forward, then an error in its cross-attention.
        last = model.decoder_layers[2]
        ffn, cross = last.ffn, last.cross_attn
        for name, error in (("ffn", KeyboardInterrupt()), ("cross_attn", RuntimeError("boom"))):
            broken = Interrupted(error)
            setattr(last, name, broken)
            with pytest.raises(type(error)):
                model.decode(tgt[:, 2:3], memory, cache=cache)
            assert broken.calls == 1
            assert [c.length for c in cache] == [2, 2, 2], name
        last.ffn, last.cross_attn = ffn, cross
        steps += [model.decode(tgt[:, i : i + 1], memory, cache=cache) for i in (2, 3)]
    assert [c.length for c in cache] == [4, 4, 4]
    assert_close(torch.cat(steps, 1), full)
    with pytest.raises(ValueError, match=r"cache\[0\] and cache\[2\] are the same KVCache"):
        model.decode(tgt[:, :1], memory, cache=[cache[0], cache[1], cache[0]])


class AppendsThenFails(nn.Module):
    """A self-attention built elsewhere that appends to the cache, then fails when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = MultiHeadAttention(8, 2, dtype=torch.float64)
        self.fail = False

    def forward(
        self, x: Tensor, *, mask: Tensor | None, causal: bool, cache: object = None
    ) -> Tensor:
        out: Tensor = self.inner(x, mask=mask, causal=causal, cache=cache)
        if self.fail:
            raise ValueError("the module built elsewhere refused the call")
        return out


@pytest.mark.usefixtures("no_shape_checks")
def test_layer_with_attention_built_elsewhere_rewinds_its_cache() -> None:
    torch.manual_seed(0)
    attn = AppendsThenFails()
    layer = TransformerEncoderLayer(8, attention=attn, d_ff=16, dtype=torch.float64).eval()
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    cache = attn.inner.make_cache(1, 4)
    with torch.no_grad():
        full = layer(x, causal=True)
        steps = [layer(x[:, :2], causal=True, cache=cache)]
        attn.fail = True
        with pytest.raises(ValueError, match="refused the call"):
            layer(x[:, 2:3], causal=True, cache=cache)
        assert cache.length == 2
        attn.fail = False
        steps += [layer(x[:, i : i + 1], causal=True, cache=cache) for i in (2, 3)]
    assert_close(torch.cat(steps, 1), full)


@pytest.mark.usefixtures("no_shape_checks")
@pytest.mark.parametrize("chunks", [[6, 1, 1, 1], [2, 1, 5, 1]], ids=["steps", "chunk"])
def test_transformer_decode_step_through_streaming_caches_is_all_or_nothing(chunks) -> None:
    # A streaming cache lets tokens go as it takes new ones: a step that fails in a later layer
    # must still leave the earlier layers' caches at the position they had, or their rotary
    # positions and windows drift apart from the other layers'.
    torch.manual_seed(0)
    model = Transformer(16, 4, num_encoder_layers=1, num_decoder_layers=2, dtype=F64).eval()
    src, tgt = torch.randn(1, 5, 16, dtype=F64), torch.randn(1, sum(chunks), 16, dtype=F64)
    with torch.no_grad():
        memory = model.encode(src)
        want = model.decode(tgt, memory, mask=_sink_window(sum(chunks), 1, 3))
        cache = [StreamingKVCache(1, 4, 4, sink_tokens=1, window=3, dtype=F64) for _ in range(2)]
        last, steps, at = model.decoder_layers[1], [], 0
        for t in chunks:
            ffn = last.ffn
            last.ffn = Interrupted(RuntimeError("boom"))
            with pytest.raises(RuntimeError, match="boom"):
                model.decode(tgt[:, at : at + t], memory, cache=cache)
            assert [c.position for c in cache] == [at, at]
            last.ffn = ffn
            steps.append(model.decode(tgt[:, at : at + t], memory, cache=cache))
            at += t
    assert_close(torch.cat(steps, 1), want)


def _sink_window(n: int, sinks: int, window: int) -> Tensor:
    """Which of ``n`` tokens each may attend in a streaming cache: the sinks and its window."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= i) & ((j < sinks) | (j > i - window))


def test_transformer_refuses_a_float_mask_saying_what_to_pass() -> None:
    # torch's nn.Transformer takes float masks (generate_square_subsequent_mask); attnkit's
    # Transformer takes bool ones: the error says what a 0/-inf mask is in its terms.
    torch.manual_seed(0)
    model = attnkit.Transformer(8, 2, num_encoder_layers=1, num_decoder_layers=1).eval()
    src, tgt = torch.randn(1, 4, 8), torch.randn(1, 3, 8)
    causal = nn.Transformer.generate_square_subsequent_mask(3)
    # forward's own check, past the annotations' runtime check that the tests turn on
    forward = inspect.unwrap(attnkit.Transformer.forward)
    with pytest.raises(TypeError, match=r"tgt_mask must be a bool .* \(tgt_mask == 0\)"):
        forward(model, src, tgt, tgt_mask=causal)
    with pytest.raises(TypeError, match=r"memory_mask .* takes no additive scores"):
        forward(model, src, tgt, memory_mask=torch.zeros(3, 4))
    # what the error says: the bool mask gives the decoder's causal result
    assert_close(model(src, tgt, tgt_mask=causal == 0), model(src, tgt))
