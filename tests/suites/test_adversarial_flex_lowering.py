"""The flex backend's lowering of masks and modifiers, probed as an outside reviewer would: masks
whose functions read tensors that need gradients, masks of one kind called twice with other data
or changed in place (no stale compiled kernel or BlockMask), and documents that are not contiguous
over several of FlexAttention's 128-key blocks. Outputs are checked against a float64 softmax
written out here and against the reference backend; compiled shapes are shared between checks to
keep the compiles few."""

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
