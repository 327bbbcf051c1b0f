"""Gradients of packed projections without copies: the columns a view holds, joint gradient
buffers, and a split whose backward returns them as they are."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import _native
from attnkit.backends import Chunked
from attnkit.modules._packing import columns_of, joint_grads, split_packed
from attnkit.testing import assert_close


def heads(x: torch.Tensor, h: int) -> torch.Tensor:
    """(B, T, h * D) -> (B, h, T, D), a view."""
    return x.unflatten(-1, (h, -1)).transpose(1, 2)


def test_columns_of_a_head_view_and_of_what_is_not_columns() -> None:
    base = torch.randn(2, 5, 24)
    q, k, v = base.split([8, 8, 8], dim=-1)
    assert columns_of(heads(q, 2), base) == (0, 8)
    assert columns_of(heads(k, 4), base) == (8, 8)
    assert columns_of(v, base) == (16, 8)
    assert columns_of(base, base) == (0, 24)
    assert columns_of(base[:, :3], base) is None  # not every row
    assert columns_of(base[..., ::2], base) is None  # not a run of columns
    assert columns_of(base[:1, :1, :4].expand(2, 5, 4), base) is None  # rows repeated
    assert columns_of(torch.randn(2, 5, 8), base) is None  # another tensor
    assert columns_of(base.view(10, 24).t()[:8], base) == (0, 8)  # the same elements, transposed


def test_joint_grads_are_views_of_one_new_tensor_laid_out_as_the_inputs() -> None:
    base = torch.randn(2, 5, 24)
    q, k, v = (heads(t, 2) for t in base.split([8, 8, 8], dim=-1))
    joint = joint_grads(q, k, v)
    assert joint is not None
    for got, like in zip(joint, (q, k, v), strict=True):
        assert got.shape == like.shape
        assert got.stride() == like.stride()
        assert got._base is joint[0]._base
        assert got._base is not base
    # Views that overlap (one tensor as q, k and v) get gradients of their own: they add up.
    x = heads(base[..., :8], 2)
    assert joint_grads(x, x, x) is None
    assert joint_grads(q, k, torch.randn(2, 2, 5, 4)) is None


def _split_grads(split: object, used: tuple[int, ...], joined: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 12, generator=g, requires_grad=True)
    parts = split(x * 1.0, [4, 4, 4])  # type: ignore[operator]
    weights = torch.randn(3, 3, 7, 4, generator=g)
    if joined:
        # Gradients that are one tensor's columns, as joint_grads makes them.
        class Joint(torch.autograd.Function):
            @staticmethod
            def forward(
                ctx: object, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor
            ) -> torch.Tensor:
                return (a * weights[0]).sum() + (b * weights[1]).sum() + (c * weights[2]).sum()

            @staticmethod
            def backward(ctx: object, go: torch.Tensor) -> tuple[torch.Tensor, ...]:
                buf = torch.empty(3, 7, 12)
                out = buf.split([4, 4, 4], dim=-1)
                for o, w in zip(out, weights, strict=True):
                    o.copy_(w * go)
                return out

        Joint.apply(*parts).backward()
    else:
        sum(((parts[i] * weights[i]).sum() for i in used), torch.zeros(())).backward()
    assert x.grad is not None
    return x.grad


@pytest.mark.parametrize("used", [(0, 1, 2), (0,), (1, 2)])
def test_split_packed_gives_torchs_gradients(used: tuple[int, ...]) -> None:
    want = _split_grads(lambda x, s: x.split(s, -1), used, joined=False)
    assert_close(_split_grads(split_packed, used, joined=False), want.double())


def test_split_packed_takes_joint_gradients_without_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    want = _split_grads(lambda x, s: x.split(s, -1), (0, 1, 2), joined=True)
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **kw: cats.append(1) or real_cat(*a, **kw))
    got = _split_grads(split_packed, (0, 1, 2), joined=True)
    assert not cats
    assert_close(got, want.double())


@pytest.mark.skipif(not _native.status()[0], reason="needs the native kernel")
def test_self_attention_training_step_concatenates_no_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # MultiHeadAttention's packed projection: the native backward writes dq, dk, dv into one
    # tensor and the split returns it; its gradients are torch.nn.MultiheadAttention's.
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(32, 4, batch_first=True).double()
    ours = attnkit.interop.torch.from_torch(theirs).float()
    ours.backend = Chunked()
    x = torch.randn(2, 50, 32, dtype=torch.float64, requires_grad=True)
    cot = torch.randn(2, 50, 32, dtype=torch.float64)
    theirs(x, x, x, need_weights=False)[0].backward(cot)
    xs = x.detach().float().requires_grad_()
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **kw: cats.append(1) or real_cat(*a, **kw))
    ours(xs).backward(cot.float())
    assert not cats
    assert theirs.in_proj_weight.grad is not None
    assert ours.in_proj_weight.grad is not None
    assert_close(ours.in_proj_weight.grad, theirs.in_proj_weight.grad)
    assert xs.grad is not None
    assert x.grad is not None
    assert_close(xs.grad, x.grad)


@pytest.mark.skipif(not _native.status()[0], reason="needs the native kernel")
def test_one_view_as_q_k_and_v_sums_its_gradients() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 40, 24, generator=g, dtype=torch.float64)
    cot = torch.randn(2, 3, 40, 8, generator=g, dtype=torch.float64)
    grads = []
    for backend, dtype in ((Chunked(), torch.float32), ("reference", torch.float64)):
        leaf = x.to(dtype).requires_grad_()
        view = heads(leaf * 1.0, 3)
        out = attnkit.attention(view, view, view, causal=True, backend=backend)
        (grad,) = torch.autograd.grad(out, leaf, cot.to(dtype))
        grads.append(grad)
    assert_close(grads[0], grads[1])
