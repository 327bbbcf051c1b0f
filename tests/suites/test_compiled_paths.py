"""torch.compile(fullgraph=True) of ``attention()`` on the calls a model makes: every graph equals
eager execution, and a change of the padding lengths' values compiles nothing again."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import attnkit

B, H, T, D = 2, 4, 17, 16


def _inputs(seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, D, generator=g) for _ in range(3))  # type: ignore[return-value]


def _padding_bias(lengths: Tensor, q_len: int, kv_len: int) -> Tensor:
    """An additive float mask, ``-inf`` past each row's length: what a model builds itself."""
    hidden = torch.arange(kv_len) >= lengths[:, None, None, None]
    return torch.zeros(lengths.numel(), 1, q_len, kv_len).masked_fill(hidden, -math.inf)


@pytest.mark.parametrize("bias_kind", ["padding", "dense"])
def test_float_bias_without_a_mask_compiles_in_one_graph(bias_kind: str) -> None:
    """A dense float bias and no mask: the cost model's CPU questions are answered without a
    graph break (reading the CPU's capability inside the graph was one)."""
    torch._dynamo.reset()
    q, k, v = _inputs()

    def fn(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> Tensor:
        if bias_kind == "padding":
            bias = _padding_bias(lengths, q.shape[-2], k.shape[-2])
        else:
            bias = (
                lengths.to(q.dtype)[:, None, None, None]
                * 0.01
                * q[..., :1]
                * k[..., 0][..., None, :]
            )
        return attnkit.attention(q, k, v, bias=bias)

    compiled = torch.compile(fn, fullgraph=True)
    for lengths in (torch.tensor([T, 9]), torch.tensor([4, T])):
        with torch.no_grad():
            torch.testing.assert_close(compiled(q, k, v, lengths), fn(q, k, v, lengths))


def _generic(w: Tensor) -> object:
    def score_mod(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return s + w[h] * (q_idx * kv_idx) * 1e-3

    return score_mod


def _by_distance(w: Tensor) -> object:
    def score_mod(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return s + w[h, q_idx - kv_idx + T]

    return score_mod


@pytest.mark.parametrize(("kind", "shape"), [("generic", (H,)), ("distance", (H, 2 * T))])
def test_score_mod_made_in_the_compiled_step_trains(kind: str, shape: tuple[int, ...]) -> None:
    """A score_mod defined inside the compiled function (FlexAttention's idiom), capturing a
    tensor that needs gradients: one graph, and the loss and every gradient (the captured
    tensor's included) equal eager execution's. torch.compile cannot read such a function's
    closure, which attnkit looks into for captured tensors."""
    torch._dynamo.reset()
    make = _generic if kind == "generic" else _by_distance

    def loss(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, w: Tensor) -> Tensor:
        mask = attnkit.masks.causal() & attnkit.masks.key_padding(lengths)
        out = attnkit.attention(q, k, v, mask=mask, score_mod=make(w))  # type: ignore[arg-type]
        return out.square().mean()

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    lengths = torch.tensor([T, 11])
    eager = [t.clone().requires_grad_() for t in (*_inputs(1), w)]
    traced = [t.clone().requires_grad_() for t in (*_inputs(1), w)]
    expected = loss(*eager[:3], lengths, eager[3])
    got = torch.compile(loss, fullgraph=True)(*traced[:3], lengths, traced[3])
    expected.backward()
    got.backward()
    torch.testing.assert_close(got, expected)
    for a, b in zip(traced, eager, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "form", ["mask & tensor", "tensor & mask", "mask | tensor", "tensor | mask"]
)
def test_a_mask_combined_with_a_bool_tensor_compiles(form: str) -> None:
    """A structured mask and a bool tensor joined by ``&`` or ``|`` (either side) inside the
    compiled function: one graph, equal to eager. torch.compile takes an operator with a tensor
    operand for a tensor operation unless the other operand says otherwise."""
    torch._dynamo.reset()
    q, k, v = _inputs(2)

    def fn(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> Tensor:
        structured = attnkit.masks.key_padding(lengths)
        lower = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        mask = {
            "mask & tensor": lambda: structured & lower,
            "tensor & mask": lambda: lower & structured,
            "mask | tensor": lambda: structured | lower,
            "tensor | mask": lambda: lower | structured,
        }[form]()
        return attnkit.attention(q, k, v, mask=mask)

    compiled = torch.compile(fn, fullgraph=True)
    for lengths in (torch.tensor([T, 9]), torch.tensor([0, 5])):
        with torch.no_grad():
            torch.testing.assert_close(compiled(q, k, v, lengths), fn(q, k, v, lengths))


def test_a_mask_and_a_float_tensor_is_still_refused() -> None:
    """The hook that lets torch.compile combine a mask with a bool tensor keeps eager's refusal
    of other operands, with attnkit's message, on either side."""
    floats = torch.ones(3, 3)
    with pytest.raises(TypeError, match="combines with masks and bool tensors"):
        attnkit.masks.causal() & floats
    with pytest.raises(TypeError, match="combines with masks and bool tensors"):
        floats | attnkit.masks.causal()
