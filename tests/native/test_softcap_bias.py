"""Softcap with something added to the scores, in the native kernel, against the float64 reference.

Capped scores alone lie in ``[-softcap, softcap]``, so the native forward runs their softmax without
a running maximum. Once a bias or a score term is added that bound is gone: logits of +-200 make
``exp`` overflow (inf, then NaN) or underflow (a row of zeros) in float32 without the maximum.
These tests give the kernel such logits, so that taking the bounded path with anything added fails
them.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import _native, attention, masks
from attnkit.scores import DistanceBias, RelativePositionTerm, ScoreTerm
from attnkit.testing import assert_close

AVAILABLE, WHY = _native.status()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"native kernel: {WHY}")

CAP = 5.0
B, H, HKV, TQ, TK, D, DV = 2, 4, 2, 37, 45, 8, 6
# Far past what exp holds in the dtype the softmax runs in (float32 for float32 and bfloat16)
BIG = {torch.float32: 200.0, torch.bfloat16: 200.0, torch.float64: 1000.0}


def _qkv(seed: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, H, TQ, D, generator=g, dtype=torch.float64),
        torch.randn(B, HKV, TK, D, generator=g, dtype=torch.float64),
        torch.randn(B, HKV, TK, DV, generator=g, dtype=torch.float64),
        torch.randn(B, H, TQ, DV, generator=g, dtype=torch.float64),  # the output's cotangent
    ]


def _capped_scores(q: Tensor, k: Tensor) -> Tensor:
    k = k.double().repeat_interleave(H // HKV, dim=1)
    s = q.double() @ k.transpose(-1, -2) * D**-0.5
    return CAP * torch.tanh(s / CAP)


def _breaks_the_bounded_path(logits: Tensor, dtype: torch.dtype, mask: masks.Mask | None) -> None:
    """The data can fail the tests: exp of these logits without a running maximum, in the dtype
    the kernel's softmax runs in, overflows in some rows and is 0 for every key of others."""
    work = torch.promote_types(dtype, torch.float32)
    if mask is not None:
        visible = mask.dense(TQ, TK)[0, 0]
        logits = logits.masked_fill(~visible, -torch.inf)
    sums = logits.to(work).exp().sum(-1)
    assert bool((sums == torch.inf).any())
    assert bool((sums == 0).any())


def _run(
    backend: str, leaves: list[Tensor], cot: Tensor, make: object, mask: masks.Mask | None
) -> list[Tensor]:
    """The output and the gradients of every leaf (q, k, v, then the bias's or term's inputs)."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    bias = make(*leaves[3:])  # type: ignore[operator]
    out = attention(*leaves[:3], bias=bias, mask=mask, softcap=CAP, backend=backend)
    return [out, *torch.autograd.grad(out, leaves, cot.to(out.dtype))]


def _compare(
    leaves: list[Tensor],
    cot: Tensor,
    make: object,
    mask: masks.Mask | None,
    dtype: torch.dtype,
    biggest: float,
) -> None:
    native = [t.to(dtype) for t in leaves]
    how = attnkit.explain(*native[:3], bias=make(*native[3:]), softcap=CAP, backend="chunked")  # type: ignore[operator]
    assert "native kernel" in str(how), str(how)
    got = _run("chunked", native, cot, make, mask)
    want = _run("reference", [t.double() for t in native], cot, make, mask)
    names = ["out", "dq", "dk", "dv", *(f"d(bias input {i})" for i in range(len(leaves) - 3))]
    for name, a, w in zip(names, got, want, strict=True):
        assert bool(w.isfinite().all()), name  # the reference itself is well defined
        try:
            # A logit s rounded in the dtype moves its weight by |s| eps (see attnkit.testing)
            assert_close(a, w, dtype=dtype, conditioning=max(1.0, biggest / 16))
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


MASKS = {"none": None, "causal": masks.causal()}
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", list(MASKS))
def test_softcap_with_a_dense_bias_far_beyond_the_cap(dtype: torch.dtype, mask: str) -> None:
    # Rows of query 0, 2, 4, ... get +-BIG at random: their exp overflows. The other rows get
    # -BIG at every key: their exp is 0 everywhere, though their softmax is that of the capped
    # scores.
    q, k, v, cot = _qkv(1)
    big = BIG[dtype]
    g = torch.Generator().manual_seed(2)
    signs = torch.randint(0, 2, (B, H, TQ, TK), generator=g).double() * 2 - 1
    odd = (torch.arange(TQ) % 2 == 1)[:, None]
    bias = torch.where(odd, -big, signs * big)
    _breaks_the_bounded_path(_capped_scores(q, k) + bias, dtype, MASKS[mask])
    _compare([q, k, v, bias], cot, lambda b: b, MASKS[mask], dtype, big + CAP)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", list(MASKS))
def test_softcap_with_a_distance_bias_far_beyond_the_cap(dtype: torch.dtype, mask: str) -> None:
    # A bias by distance (T5's, ALiBi's form), which the native kernel reads as a bias: +-BIG at
    # random in heads 1-3, -BIG at every distance in head 0.
    q, k, v, cot = _qkv(3)
    big = BIG[dtype]
    g = torch.Generator().manual_seed(4)
    width = TQ + TK - 1  # distances -(TK - 1) .. TQ - 1
    table = (torch.randint(0, 2, (H, width), generator=g).double() * 2 - 1) * big
    table[0] = -big
    first = -(TK - 1)
    j = torch.arange(TK)[None, :]
    i = torch.arange(TQ)[:, None] + TK - TQ  # bottom-right: key j is at distance j - i
    dense = table[:, j - i - first]  # (H, TQ, TK)
    _breaks_the_bounded_path(_capped_scores(q, k) + dense, dtype, MASKS[mask])

    def make(t: Tensor) -> ScoreTerm:
        return DistanceBias(t, first)

    _compare([q, k, v, table], cot, make, MASKS[mask], dtype, big + CAP)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("mask", list(MASKS))
def test_softcap_with_a_position_term_far_beyond_the_cap(dtype: torch.dtype, mask: str) -> None:
    # Transformer-XL's position term, which the native kernel computes itself: large random
    # products in heads 1-3, and in head 0 the same large negative term at every pair.
    q, k, v, cot = _qkv(5)
    g = torch.Generator().manual_seed(6)
    reach = 30.0 if dtype == torch.float32 else 150.0
    qv = torch.randn(B, H, TQ, D, generator=g, dtype=torch.float64) * reach
    enc = torch.randn(H, TQ + TK - 1, D, generator=g, dtype=torch.float64)
    qv[:, 0], enc[0] = -reach, 1.0  # head 0: -reach * D at every pair
    geo = masks.Geometry((B,), H, TQ, TK, torch.device("cpu"))
    dense = RelativePositionTerm(qv, enc, 1.0).dense((qv, enc), geo)
    _breaks_the_bounded_path(_capped_scores(q, k) + dense, dtype, MASKS[mask])

    def make(qv: Tensor, enc: Tensor) -> ScoreTerm:
        return RelativePositionTerm(qv, enc, 1.0)

    biggest = float(dense.abs().max()) + CAP
    _compare([q, k, v, qv, enc], cot, make, MASKS[mask], dtype, biggest)
