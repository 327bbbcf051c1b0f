"""Every fast backend equals the float64 reference: outputs, gradients, edge cases, precisions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

from attnkit import attention
from attnkit.testing import assert_close

from ..helpers import blocked, brute_force
from ..strategies import Case, cases

FAST = ["sdpa", "chunked"]
ALL = ["reference", *FAST]


def run(backend: str, case: Case, blocks: tuple[int, int] = (5, 3)) -> torch.Tensor:
    return attention(case.q, case.k, case.v, backend=blocked(backend, *blocks), **case.kwargs())


@pytest.mark.parametrize("backend", FAST)
@given(case=cases(), blocks=st.tuples(st.integers(1, 9), st.integers(1, 9)))
def test_equals_reference_float64(backend: str, case: Case, blocks: tuple[int, int]) -> None:
    expected = attention(case.q, case.k, case.v, backend="reference", **case.kwargs())
    assert_close(run(backend, case, blocks), expected)


@given(case=cases(max_len=7))
@settings(max_examples=25)
def test_reference_equals_brute_force(case: Case) -> None:
    out, w = attention(
        case.q, case.k, case.v, backend="reference", return_weights=True, **case.kwargs()
    )
    out_bf, w_bf = brute_force(case.q, case.k, case.v, **case.kwargs())
    assert_close(out, out_bf)
    assert_close(w, w_bf)


@pytest.mark.parametrize("backend", FAST)
@given(case=cases(max_len=12), blocks=st.tuples(st.integers(1, 6), st.integers(1, 6)))
@settings(max_examples=30)
def test_gradients_equal_reference(backend: str, case: Case, blocks: tuple[int, int]) -> None:
    leaves = [t.requires_grad_() for t in (case.q, case.k, case.v)]
    if case.bias is not None:
        leaves.append(case.bias.requires_grad_())
    cot = torch.randn(*case.q.shape[:-1], case.v.size(-1), dtype=torch.float64)

    def grads(backend: str) -> tuple[torch.Tensor, ...]:
        out = run(backend, case, blocks)
        return torch.autograd.grad(out, leaves, cot, allow_unused=True, materialize_grads=True)

    for got, want in zip(grads(backend), grads("reference"), strict=True):
        assert_close(got, want)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(backend: str, causal: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(4, 6, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    mask = torch.rand(2, 1, 6, 5, generator=gen) < 0.7
    mask[0, 0, 2] = False

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, mask=mask, bias=b, causal=causal, backend=blocked(backend, 4, 2))

    # fast_mode: the Jacobian against finite differences along random directions (two calls
    # of f a direction, not one a coordinate); test_gradients_equal_reference compares every
    # element of every backend's gradients with the reference's.
    assert gradcheck(f, (q, k, v, bias), fast_mode=True)


@pytest.mark.parametrize("backend", ALL)
def test_fully_masked_rows_are_zero_with_zero_gradients(backend: str) -> None:
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k = torch.randn(1, 2, 6, 8, requires_grad=True)
    v = torch.randn(1, 2, 6, 8, requires_grad=True)
    mask = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    mask[..., 1, :] = False
    out = attention(q, k, v, mask=mask, backend=blocked(backend, 2, 2))
    assert torch.equal(out[:, :, 1], torch.zeros(1, 2, 8))
    assert out.isfinite().all()
    out.square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None
        assert t.grad.isfinite().all()
    assert torch.equal(q.grad[:, :, 1], torch.zeros(1, 2, 8))
    # The other rows are untouched by the empty one: same result as without it.
    rest = attention(q[:, :, [0, 2, 3]], k, v, mask=mask[..., [0, 2, 3], :], backend="reference")
    assert_close(out[:, :, [0, 2, 3]].double(), rest.double(), dtype=torch.float32)


@pytest.mark.parametrize("backend", ALL)
def test_more_queries_than_keys_causal(backend: str) -> None:
    # Bottom-right alignment: with Tq=5, Tk=2 the first three queries see no key at all.
    q, k, v = torch.randn(1, 5, 4), torch.randn(1, 2, 4), torch.randn(1, 2, 4)
    out = attention(q, k, v, causal=True, backend=backend)
    assert torch.equal(out[:, :3], torch.zeros(1, 3, 4))
    assert_close(out[:, 3], v[:, 0].double(), dtype=torch.float32)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize(("tq", "tk"), [(0, 5), (4, 0), (0, 0)])
def test_empty_sequences(backend: str, tq: int, tk: int) -> None:
    q = torch.randn(2, 3, tq, 4, requires_grad=True)
    k = torch.randn(2, 3, tk, 4, requires_grad=True)
    v = torch.randn(2, 3, tk, 5, requires_grad=True)
    out = attention(q, k, v, backend=backend)
    assert torch.equal(out, torch.zeros(2, 3, tq, 5))
    out.sum().backward()
    assert q.grad is not None
    assert torch.equal(q.grad, torch.zeros_like(q))


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@given(
    case=cases(max_len=16, allow_empty=False),
    blocks=st.tuples(st.integers(1, 8), st.integers(1, 8)),
)
@settings(max_examples=20)
def test_low_precision_within_tolerance(
    backend: str, dtype: torch.dtype, case: Case, blocks: tuple[int, int]
) -> None:
    low = case.to(dtype)
    # The spec is the float64 reference on the *rounded* inputs: only the arithmetic is judged.
    expected = attention(
        low.q.double(),
        low.k.double(),
        low.v.double(),
        backend="reference",
        mask=low.mask,
        bias=None if low.bias is None else low.bias.double(),
        causal=low.causal,
    )
    out = run(backend, low, blocks)
    assert out.dtype == dtype
    assert_close(out, expected)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_logits_of_magnitude_1e4_do_not_overflow(backend: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 64, 16, generator=gen)
    k = torch.randn(1, 2, 64, 16, generator=gen)
    v = torch.randn(1, 2, 64, 16, generator=gen)
    # Rescale each query so its largest logit is exactly +-1e4, and put the largest scores in the
    # *last* key block, so that the chunked kernel's first offset is far too low.
    k[..., -8:, :] *= 4
    logits = q @ k.transpose(-1, -2) / 4
    q = q * (1e4 / logits.abs().amax(-1, keepdim=True))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    expected = attention(q.double(), k.double(), v.double(), backend="reference")
    out = attention(q, k, v, backend=blocked(backend, 16, 16))
    assert out.isfinite().all()
    assert_close(out, expected)


@pytest.mark.parametrize("backend", ALL)
def test_grouped_query_equals_repeated_heads(backend: str) -> None:
    q = torch.randn(2, 6, 7, 4, dtype=torch.float64)
    k = torch.randn(2, 2, 9, 4, dtype=torch.float64)
    v = torch.randn(2, 2, 9, 3, dtype=torch.float64)
    mask = torch.rand(2, 6, 7, 9) < 0.8
    got = attention(q, k, v, mask=mask, causal=True, backend=blocked(backend, 3, 4))
    # Head h of q uses key/value head h // (H / Hkv): repeat_interleave, not repeat.
    kr, vr = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    want = attention(q, kr, vr, mask=mask, causal=True, backend="reference")
    assert_close(got, want)


@pytest.mark.parametrize("backend", ALL)
def test_non_contiguous_inputs(backend: str) -> None:
    # The layout multi-head modules produce: (B, T, H, D) transposed to (B, H, T, D).
    q = torch.randn(2, 7, 4, 8, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(2, 9, 2, 8, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(2, 9, 2, 5, dtype=torch.float64).transpose(1, 2)
    got = attention(q, k, v, causal=True, backend=blocked(backend, 3, 4))
    want = attention(
        q.contiguous(), k.contiguous(), v.contiguous(), causal=True, backend="reference"
    )
    assert_close(got, want)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "chunked"])
def test_dropout_is_unbiased(backend: str) -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    plain = attention(q, k, v, backend=backend)
    # 4000 draws: two calls of 2000 batch rows of the same q, k, v, each row drawn on its own.
    many = [t.expand(2000, -1, -1, -1) for t in (q, k, v)]
    draws = torch.cat([attention(*many, dropout_p=0.3, backend=backend) for _ in range(2)])
    # Each draw differs from the plain output, and from the next call's; their mean converges to
    # the plain output (inverted dropout).
    assert not torch.allclose(draws[0], plain)
    assert not torch.allclose(draws[:2000], draws[2000:])
    assert torch.allclose(draws.mean(0), plain[0], atol=0.05)
