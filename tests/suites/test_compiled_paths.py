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
