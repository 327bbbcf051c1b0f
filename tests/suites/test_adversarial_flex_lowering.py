"""The flex backend's lowering of masks and modifiers, probed as an outside reviewer would: masks
whose functions read tensors that need gradients, masks of one kind called twice with other data
or changed in place (no stale compiled kernel or BlockMask), and score_mods whose results come in
another dtype than the scores'. Outputs are checked against a float64 softmax written out here;
compiled shapes are shared between checks to keep the compiles few."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks

B, H, HKV, T, D = 2, 4, 2, 40, 8


def _qkv(t: int = T, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, t, D), (B, HKV, t, D), (B, HKV, t, D))
    return tuple(torch.randn(*s, generator=g, dtype=dtype) for s in shapes)


def _formula(q: Tensor, k: Tensor, v: Tensor, visible: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(D)) v in float64 over the pairs ``visible`` (broadcast to (B, H, Tq,
    Tk)), grouped-query heads repeated; 0 for a query that sees no key."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.size(-1))
    s = s.masked_fill(~visible, -math.inf)
    w = torch.softmax(s, -1).nan_to_num(0.0)
    return w @ v


def _flex(q: Tensor, k: Tensor, v: Tensor, **kw: object) -> Tensor:
    with attnkit.record_dispatch() as seen:
        out = attnkit.attention(q, k, v, backend="flex", **kw)  # type: ignore[call-overload]
    assert [d.chosen for d in seen] == ["flex"]
    assert isinstance(out, Tensor)
    return out


def test_a_mask_mod_reading_a_tensor_that_needs_gradients_is_refused_by_name() -> None:
    """torch's FlexAttention asserts on a mask_mod that captures a tensor needing gradients (a
    learned table, an nn.Parameter), even under no_grad and in its unfused form: flex refuses such
    a call with the reason, and auto serves it right."""
    q, k, v = _qkv()
    table = torch.nn.Parameter(
        torch.randn(H, 2 * T - 1, generator=torch.Generator().manual_seed(3))
    )

    def learned(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (table[h, q_idx - kv_idx + T - 1] > 0) | (q_idx == kv_idx)

    mask = masks.from_fn(learned) & masks.causal()
    with torch.no_grad():
        with pytest.raises(attnkit.BackendError, match="mask_mod reads a tensor that needs"):
            attnkit.attention(q, k, v, mask=mask, backend="flex")
        got = attnkit.attention(q, k, v, mask=mask)
    i = torch.arange(T)
    visible = (table[:, i[:, None] - i[None, :] + T - 1] > 0) | torch.eye(T, dtype=torch.bool)
    visible = visible & torch.ones(T, T, dtype=torch.bool).tril()
    torch.testing.assert_close(got.double(), _formula(q, k, v, visible), atol=2e-6, rtol=0)


def _selected(indices: Tensor, tq: int, tk: int) -> Tensor:
    """The bool (B, Hi, Tq, Tk) pairs ``indices`` (B, Hi, Tq, k) selects (-1: none)."""
    dense = torch.zeros(*indices.shape[:3], tk + 1, dtype=torch.bool)
    dense.scatter_(-1, indices.where(indices >= 0, tk), True)
    return dense[..., :tk]


def test_one_index_mask_kind_with_new_and_rewritten_indices() -> None:
    """key_indices & causal, three calls of one compiled kind: a mask, another of new indices,
    then the first mask again after its indices are rewritten in place. Each output is that
    call's selection's: no BlockMask, bitmap or plan of an earlier call is read again."""
    q, k, v = _qkv(seed=1)
    g = torch.Generator().manual_seed(5)
    first = torch.randint(-1, T, (B, HKV, T, 5), generator=g)
    second = torch.randint(-1, T, (B, HKV, T, 5), generator=g)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = masks.key_indices(first) & masks.causal()
    with torch.no_grad():
        for indices, call_mask in ((first, mask), (second, None), (first, mask)):
            if call_mask is None:  # between the calls of `mask`: another one, then a rewrite
                call_mask = masks.key_indices(second) & masks.causal()
            got = _flex(q, k, v, mask=call_mask)
            seen = _selected(indices, T, T).repeat_interleave(H // HKV, 1) & causal
            torch.testing.assert_close(got.double(), _formula(q, k, v, seen), atol=2e-6, rtol=0)
            if indices is second:
                first.copy_(torch.randint(-1, T, first.shape, generator=g))


def test_a_score_mod_that_returns_another_float_dtype() -> None:
    """A score_mod's result is taken in the scores' dtype (float32 here), whatever dtype it comes
    in: ``score.double() * 2`` is the scores doubled, compiled on the CPU as everywhere, and a
    float64 constant weights every visible key alike."""
    q, k, v = _qkv(seed=4)
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def doubled(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score.double() * 2

    def constant(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.tensor(0.5, dtype=torch.float64)  # every visible key weighted alike

    with torch.no_grad():
        got = _flex(q, k, v, mask=masks.causal(), score_mod=doubled)
        alike = _flex(q, k, v, mask=masks.causal(), score_mod=constant)
    torch.testing.assert_close(got.double(), _formula(q * 2, k, v, causal), atol=2e-6, rtol=0)
    torch.testing.assert_close(alike.double(), _formula(q * 0, k, v, causal), atol=2e-6, rtol=0)
