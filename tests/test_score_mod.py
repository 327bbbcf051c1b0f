"""Score mods: which captured tensors are found, what is refused, how a tile's result is checked."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import Tensor

from attnkit._score_mod import apply, captured_tensors, check_captured, index_tensors

TABLE = torch.randn(8, requires_grad=True)
FROZEN = torch.randn(8)


def global_mod(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return s + TABLE[h] + FROZEN[h]


class Biased(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(8))

    def forward(self, s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + self.bias[h]

    def mod(self, s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + self.bias[h]


def test_captured_tensors_are_found_where_they_can_be() -> None:
    w = torch.ones(8, requires_grad=True)
    d = torch.ones(8, requires_grad=True)

    def closure(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s * w[h]

    def default(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, d: Tensor = d) -> Tensor:
        return s * d[h]

    def partial(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor, p: Tensor) -> Tensor:
        return s * p[h]

    module = Biased()
    assert captured_tensors(closure) == (w,)
    assert captured_tensors(default) == (d,)
    assert captured_tensors(global_mod) == (TABLE,)  # FROZEN needs no gradient
    assert captured_tensors(functools.partial(partial, p=w)) == (w,)
    assert captured_tensors(module) == (module.bias,)
    assert captured_tensors(module.mod) == (module.bias,)
    assert captured_tensors(lambda s, b, h, q, kv: s * 2) == ()


def test_a_hidden_tensor_is_refused_and_a_seen_one_is_not() -> None:
    hidden = torch.ones(3, requires_grad=True)

    def helper() -> Tensor:
        return hidden

    def mod(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + helper()[h]

    with pytest.raises(ValueError, match=r"cannot see \(shapes \(3\)\)"):
        check_captured(mod, captured_tensors(mod), torch.float32, torch.device("cpu"))
    derived = hidden * 2.0  # a non-leaf seen in the closure: its graph is its own business

    def seen(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + derived[h]

    check_captured(seen, captured_tensors(seen), torch.float32, torch.device("cpu"))


def test_a_tiles_result_is_checked_and_broadcast() -> None:
    idx = index_tensors(2, 3, 4, 9, 0, 6, torch.device("cpu"))
    assert [tuple(i.shape) for i in idx] == [(2, 1, 1, 1), (1, 3, 1, 1), (1, 1, 5, 1), (1, 1, 1, 6)]
    assert idx[2].flatten().tolist() == [4, 5, 6, 7, 8]
    s = torch.zeros(2, 3, 5, 6)
    out = apply(lambda s, b, h, q, kv: (q - kv).float(), s, idx)
    assert out.shape == s.shape
    assert torch.equal(out[1, 2], (idx[2] - idx[3]).float()[0, 0])
    with pytest.raises(TypeError, match=r"must return a float tensor .*, got torch.bool"):
        apply(lambda s, b, h, q, kv: q > kv, s, idx)
    with pytest.raises(ValueError, match=r"returned shape \(7\), which does not broadcast"):
        apply(lambda s, b, h, q, kv: torch.zeros(7), s, idx)
