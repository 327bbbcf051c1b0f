"""Precision: every backend and module in float32, bfloat16 and float16, and under torch.autocast.

The spec is always float64: the reference backend (or a float64 copy of a module) on the inputs and
parameters *rounded to the dtype under test*, so that only the arithmetic is judged, at the
per-dtype tolerances of :data:`attnkit.testing.TOLERANCES`. Under autocast the modules keep their
float32 parameters, and the spec is their float64 copy.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnkit
from attnkit import attention, masks
from attnkit.testing import assert_close

from ..helpers import blocked

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HALF = [torch.bfloat16, torch.float16]
BACKENDS = ["reference", "sdpa", "chunked"]


def randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------
# attention(): every backend, forward and backward


def attention_inputs() -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, k, v, bias and mask: GQA, causal with Tq < Tk (every call here is causal), a padding
    mask with one query that sees nothing, and a bias."""
    q = randn(2, 4, 20, 8, seed=1)
    k = randn(2, 2, 24, 8, seed=2)
    v = randn(2, 2, 24, 6, seed=3)
    bias = randn(4, 20, 24, seed=4)
    mask = masks.padding_mask([24, 17]).expand(2, 1, 20, 24).clone()
    mask[1, 0, 3] = False  # a fully masked row: output 0, gradient 0
    return q, k, v, bias, mask


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_backend_forward_and_backward_in_each_dtype(backend: str, dtype: torch.dtype) -> None:
    *tensors, mask = attention_inputs()
    low = [t.to(dtype).requires_grad_() for t in tensors]
    spec = [t.detach().double().requires_grad_() for t in low]  # the same rounded values
    cot = randn(2, 4, 20, 6, seed=5).to(dtype)

    small = blocked(backend, 8, 8)  # many blocks, partly masked ones included
    out = attention(*low[:3], bias=low[3], mask=mask, causal=True, backend=small)
    want = attention(*spec[:3], bias=spec[3], mask=mask, causal=True, backend="reference")
    assert out.dtype == dtype
    assert_close(out, want)

    out.backward(cot)
    want.backward(cot.double())
    for name, got, ref in zip(("q", "k", "v", "bias"), low, spec, strict=True):
        assert got.grad is not None, name
        assert ref.grad is not None, name
        assert got.grad.dtype == dtype, name
        assert_close(got.grad, ref.grad)


def gradient_error(backend: str, dtype: torch.dtype, seed: int) -> float:
    """Largest gradient error against float64, relative to each gradient's largest entry, on
    logits of magnitude ~100: a near one-hot softmax, where rowsum(dO * O) cancels."""
    q = (randn(3, 1, 5, seed=seed) * 40).to(dtype)
    k, v = randn(3, 18, 5, seed=seed + 1000).to(dtype), randn(3, 18, 5, seed=seed + 2000).to(dtype)
    cot = randn(3, 1, 5, seed=seed + 3000).double()
    low = [t.clone().requires_grad_() for t in (q, k, v)]
    spec = [t.double().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(attention(*low, backend=backend), low, cot.to(dtype))
    ref = torch.autograd.grad(attention(*spec, backend="reference"), spec, cot)
    return max(
        float((g.double() - r).abs().max() / r.abs().max().clamp_min(1))
        for g, r in zip(got, ref, strict=True)
    )


@pytest.mark.parametrize("dtype", HALF)
def test_chunked_gradients_are_as_accurate_as_torch_sdpa(dtype: torch.dtype) -> None:
    # The chunked backward once took O rounded to the input dtype for rowsum(dO * O): 20-30x the
    # error of torch's kernel here.
    ours = max(gradient_error("chunked", dtype, seed) for seed in range(40))
    torch_sdpa = max(gradient_error("sdpa", dtype, seed) for seed in range(40))
    assert ours <= 1.25 * torch_sdpa, (ours, torch_sdpa)


# --------------------------------------------------------------------------------------------------
# Modules


T, S = 20, 13  # query and memory lengths


@dataclass
class Subject:
    """A module and a call of it: float inputs, then keyword arguments (masks, flags, biases)."""

    build: Callable[[], nn.Module]
    inputs: Callable[[], list[Tensor]]
    kwargs: Callable[[], dict[str, object]] = dict

    def make(self) -> nn.Module:
        torch.manual_seed(0)
        return self.build().eval()

    def run(self, m: nn.Module, cast: Callable[[Tensor], Tensor] = lambda t: t) -> Tensor:
        """``m`` on the inputs, its float tensors (biases included) passed through ``cast``."""

        def each(t: object) -> object:
            return cast(t) if isinstance(t, Tensor) and t.is_floating_point() else t

        out: Tensor = m(
            *[each(t) for t in self.inputs()], **{k: each(v) for k, v in self.kwargs().items()}
        )
        return out


def rounded_to(dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    return lambda t: t.to(dtype)


def rounded_then_widened(dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    """float64 holding the values of ``dtype``: the spec sees the inputs the module saw."""
    return lambda t: t.to(dtype).double()


def x_only() -> list[Tensor]:
    return [randn(2, T, 32, seed=10)]


def pad_t() -> Tensor:
    return masks.padding_mask([T, T - 6])


def pad_s() -> Tensor:
    return masks.padding_mask([S, S - 4])


def relative(backend: str) -> Subject:
    return Subject(
        lambda: attnkit.RelativeMultiHeadAttention(32, 4),
        x_only,
        lambda: {"mask": pad_t(), "causal": True, "backend": backend},
    )


def multihead(backend: str) -> Subject:
    return Subject(
        lambda: attnkit.MultiHeadAttention(
            32, 4, num_kv_heads=2, rotary=attnkit.RotaryEmbedding(8), backend=backend
        ),
        x_only,
        lambda: {"mask": pad_t(), "causal": True, "bias": attnkit.alibi_bias(4, T)},
    )


SUBJECTS: dict[str, Subject] = {
    **{f"multihead-{b}": multihead(b) for b in ("auto", *BACKENDS)},
    "multihead-cross": Subject(
        lambda: attnkit.MultiHeadAttention(32, 4, kdim=24, vdim=20, head_dim=6, v_head_dim=5),
        lambda: [x_only()[0], randn(2, S, 24, seed=11), randn(2, S, 20, seed=12)],
        lambda: {"mask": pad_s()},
    ),
    **{f"relative-{b}": relative(b) for b in ("auto", "chunked", "reference")},
    "encoder_layer": Subject(
        lambda: attnkit.TransformerEncoderLayer(32, 4, dropout=0.0),
        x_only,
        lambda: {"mask": pad_t()},
    ),
    "decoder_layer": Subject(
        lambda: attnkit.TransformerDecoderLayer(32, 4, dropout=0.0, norm_first=True),
        lambda: [x_only()[0], randn(2, S, 32, seed=13)],
        lambda: {"memory_mask": pad_s()},
    ),
    "transformer": Subject(
        lambda: attnkit.Transformer(
            32, 4, num_encoder_layers=2, num_decoder_layers=2, num_kv_heads=2, dropout=0.0
        ),
        lambda: [randn(2, S, 32, seed=13), x_only()[0]],
        lambda: {"src_mask": pad_s(), "memory_mask": pad_s()},
    ),
    "feedforward": Subject(
        lambda: attnkit.PositionwiseFeedForward(32, 64, activation="swiglu"), x_only
    ),
    "sinusoidal": Subject(lambda: attnkit.SinusoidalPositionalEncoding(32), x_only),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SUBJECTS)
def test_module_in_each_dtype(name: str, dtype: torch.dtype) -> None:
    subject = SUBJECTS[name]
    m = subject.make().to(dtype)
    spec = copy.deepcopy(m).double()  # float64 on the rounded parameters
    with torch.no_grad():
        got = subject.run(m, rounded_to(dtype))
        want = subject.run(spec, rounded_then_widened(dtype))
    assert got.dtype == dtype
    assert_close(got, want)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", [n for n in SUBJECTS if n != "sinusoidal"])  # it has no weights
def test_module_trains_in_each_dtype(name: str, dtype: torch.dtype) -> None:
    subject = SUBJECTS[name]
    m = subject.make()
    for ffn in m.modules():
        # ReLU's derivative jumps at 0: a pre-activation that rounds to the other side of 0 moves
        # a weight gradient by a whole token's term (20% in bfloat16, whatever the kernels do).
        # GELU has the same weights and a continuous derivative, so the rounding is what is judged.
        if isinstance(ffn, attnkit.PositionwiseFeedForward) and ffn.activation == "relu":
            ffn.activation = "gelu"
    m = m.to(dtype).train()
    spec = copy.deepcopy(m).double()  # float64 on the rounded parameters
    want = subject.run(spec, rounded_then_widened(dtype))
    cot = randn(*want.shape, seed=20)
    # The same cotangent through both: their gradients are comparable entry by entry.
    subject.run(m, rounded_to(dtype)).backward(cot.to(dtype))
    want.backward(cot)
    grads = [
        (key, p.grad, ref.grad)
        for (key, p), ref in zip(m.named_parameters(), spec.parameters(), strict=True)
    ]
    largest = max(float(ref.abs().max()) for _, _, ref in grads if ref is not None)
    for key, got, ref in grads:
        assert got is not None, key
        assert ref is not None, key
        assert got.dtype == dtype, key
        # Judged relative to the gradient's largest entry: weight gradients are sums over every
        # token and can be far below 1, where an absolute tolerance would accept anything. A
        # gradient that is zero but for float64 rounding (a key projection's bias: softmax
        # ignores a shift shared by every key) is judged on the scale of the largest gradient.
        top = float(ref.abs().max())
        scale = top if top > 1e-9 * largest else largest
        assert_close(got.double() / scale, ref / scale, dtype=dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_cached_decoding_in_each_dtype(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    m = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2, rotary=attnkit.RotaryEmbedding(8))
    m = m.to(dtype).eval()
    x = randn(2, 9, 32, seed=14).to(dtype)
    with torch.no_grad():
        cache = m.make_cache(2, 9)
        steps = [m(x[:, :4], causal=True, cache=cache)]
        steps += [m(x[:, i : i + 1], causal=True, cache=cache) for i in range(4, 9)]
        want = copy.deepcopy(m).double()(x.double(), causal=True)
    assert cache.k_cache.dtype == dtype
    assert_close(torch.cat(steps, 1), want)


# --------------------------------------------------------------------------------------------------
# torch.autocast


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", HALF)
def test_attention_under_autocast_casts_like_sdpa(backend: str, dtype: torch.dtype) -> None:
    q, k, v, bias, mask = attention_inputs()  # float32, the bias too
    with torch.autocast("cpu", dtype=dtype):
        got = attention(q, k, v, bias=bias, mask=mask, causal=True, backend=backend)
        theirs = F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1))
    # What torch's SDPA does under autocast: everything in the autocast dtype...
    assert got.dtype == theirs.dtype == dtype
    # ...so the call is the one made with inputs of that dtype, bit for bit.
    cq, ck, cv, cb = (t.to(dtype) for t in (q, k, v, bias))
    assert torch.equal(got, attention(cq, ck, cv, bias=cb, mask=mask, causal=True, backend=backend))


def test_autocast_leaves_float64_alone() -> None:
    # As autocast's own rule: float64 is never lowered, so a float64 call stays exact.
    q, k, v, bias, mask = (t.double() if t.is_floating_point() else t for t in attention_inputs())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attention(q, k, v, bias=bias, mask=mask, causal=True)
    assert got.dtype == torch.float64
    assert torch.equal(got, attention(q, k, v, bias=bias, mask=mask, causal=True))


def test_chunked_backward_called_inside_autocast() -> None:
    # The chunked kernel's backward picks its own dtypes: called inside the autocast region it
    # gives the gradients it gives outside. (torch's own ops follow autocast in a backward run
    # inside it, which torch advises against; that part is not attnkit's to change.)
    q, k, v, bias, mask = attention_inputs()
    grads = []
    for inside in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = attention(*leaves[:3], bias=leaves[3], mask=mask, causal=True, backend="chunked")
            if inside:
                out.backward(torch.ones_like(out))
        if not inside:
            out.backward(torch.ones_like(out))
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads, strict=True):
        assert a is not None
        assert b is not None
        assert torch.equal(a, b)


def test_relative_backward_called_inside_autocast() -> None:
    subject = SUBJECTS["relative-chunked"]
    m = subject.make().train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        subject.run(m).float().square().mean().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in m.parameters())


def test_explain_describes_the_autocast_call() -> None:
    q, k, v, bias, mask = attention_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = str(attnkit.explain(q, k, v, bias=bias, mask=mask, causal=True))
    assert "bfloat16 on cpu" in report


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", SUBJECTS)
def test_module_under_autocast(name: str, dtype: torch.dtype) -> None:
    subject = SUBJECTS[name]
    m = subject.make()  # float32 parameters, as autocast expects
    spec = copy.deepcopy(m).double()
    with torch.no_grad():
        with torch.autocast("cpu", dtype=dtype):
            got = subject.run(m)
        want = subject.run(spec, rounded_to(torch.float64))
    # Attention outputs come out in the autocast dtype; a final LayerNorm's in float32.
    assert got.dtype in (dtype, torch.float32)
    assert_close(got, want, dtype=dtype)


@pytest.mark.parametrize("name", ["multihead-auto", "relative-auto", "transformer"])
def test_training_step_under_autocast(name: str) -> None:
    subject = SUBJECTS[name]
    m = subject.make().train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = subject.run(m).float().square().mean()
    loss.backward()
    for key, p in m.named_parameters():
        assert p.grad is not None, key
        assert p.grad.dtype == torch.float32, key
        assert p.grad.isfinite().all(), key


def test_relative_sdpa_path_refuses_autocast_half() -> None:
    # Under autocast the position term would be rounded to bfloat16 in SDPA's float mask: auto
    # takes the chunked path instead, and a forced sdpa path says why.
    m = SUBJECTS["relative-auto"].make()
    with (
        torch.no_grad(),
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(attnkit.BackendError, match=re.escape("round the score term")),
    ):
        m(x_only()[0], backend="sdpa")
