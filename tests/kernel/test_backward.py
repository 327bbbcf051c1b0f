"""The online softmax's backward (``attnkit._kernel.backward``) against autograd of the formula in
float64: masks, grouped heads and softcap, every score level (the zero offset, base 2, exp(-lse)
folded into dO), and ``delta_of``."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit._kernel import backward, delta_of, forward
from attnkit.masks import Geometry, Mask
from attnkit.testing import assert_close

from .helpers import CPU, formula, problem, randn

CASES = [
    pytest.param({}, id="plain"),
    pytest.param({"mask": masks.causal()}, id="causal"),
    pytest.param({"mask": masks.sliding_window(3, right=2)}, id="window"),
    pytest.param({"mask": masks.documents([4, 9, 4])}, id="documents"),
    pytest.param({"mask": masks.causal(), "softcap": 2.5}, id="causal-softcap"),
]


@pytest.mark.parametrize("case", CASES)
def test_backward_of_a_problem_is_autograd_of_the_formula(case: dict[str, object]) -> None:
    # Grouped-query attention (4 query heads, 2 key heads), Dv != Dk, blocks of 4 x 4 over 17 keys.
    mask = case.get("mask")
    softcap = case.get("softcap")
    assert mask is None or isinstance(mask, Mask)
    assert softcap is None or isinstance(softcap, float)
    q, k, v = randn(2, 4, 17, 8, seed=1), randn(2, 2, 17, 8, seed=2), randn(2, 2, 17, 5, seed=3)
    dout = randn(2, 4, 17, 5, seed=4)
    scale = 0.4
    p = problem(q, k, v, scale, mask, softcap)
    out5, lse5 = forward(p)
    out, lse = out5.flatten(1, 2), lse5.flatten(1, 2)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    geo = Geometry((2,), 4, 17, 17, CPU)
    visible = None if mask is None else mask.tile(geo, 0, 17, 0, 17).expand(2, 4, 17, 17)
    want, want_lse = formula(*leaves, scale, visible, softcap)
    assert_close(out, want)
    assert_close(lse, want_lse)

    dout5 = dout.view(out5.shape)
    grads = backward(p, out5, lse5, delta_of(out5, dout5), dout5, bias_grad=False, term_grads=False)
    want_grads = torch.autograd.grad(want, leaves, dout)
    assert_close(grads.dq.flatten(1, 2), want_grads[0])
    assert_close(grads.dk.view(k.shape), want_grads[1])
    assert_close(grads.dv.view(v.shape), want_grads[2])


def test_delta_of_is_the_row_sum_of_dout_times_out_in_the_outputs_dtype() -> None:
    out, dout = randn(2, 1, 3, 4, 5, seed=22, dtype=torch.float32), randn(2, 1, 3, 4, 5, seed=23)
    got = delta_of(out, dout.half())
    assert got.dtype == torch.float32
    assert got.shape == (2, 1, 3, 4)
    want = (dout.half().double() * out.double()).sum(-1)
    assert_close(got, want)


# Scores near these levels (natural units) take each of the forward's and backward's ways: within
# 2^+-32 in base 2 (about 22 in natural units) the offset is 0, beyond it per-row offsets.
LEVELS = [-200.0, -22.0, -21.0, 0.0, 21.0, 23.0, 200.0, 700.0]


@pytest.mark.parametrize("level", LEVELS)
def test_every_score_level_is_exact_in_float64(level: float) -> None:
    # float64 leaves nothing to rounding but reassociation: the base-2 scores, the zero offset and
    # the exp(-lse) folded into dO must give the formula to 1e-10, output, log-sum-exp and grads.
    q, k, v = randn(1, 2, 12, 4, seed=24), randn(1, 2, 12, 4, seed=25), randn(1, 2, 12, 3, seed=26)
    q = torch.cat([q, torch.ones(1, 2, 12, 1, dtype=torch.float64)], -1)
    k = torch.cat(
        [k, torch.full((1, 2, 12, 1), level, dtype=torch.float64)], -1
    )  # every score +level
    dout = randn(1, 2, 12, 3, seed=27)
    p = problem(q, k, v, 1.0, masks.causal(), block=(4, 3))
    out5, lse5 = forward(p)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want, want_lse = formula(*leaves, 1.0, torch.ones(12, 12, dtype=torch.bool).tril())
    assert_close(out5.flatten(1, 2), want)
    assert_close(lse5.flatten(1, 2), want_lse)  # natural units, though computed in base 2
    grads = backward(
        p,
        out5,
        lse5,
        delta_of(out5, dout.view(out5.shape)),
        dout.view(out5.shape),
        bias_grad=False,
        term_grads=False,
    )
    want_grads = torch.autograd.grad(want, leaves, dout)
    assert_close(grads.dq.flatten(1, 2), want_grads[0], conditioning=max(1.0, abs(level)))
    assert_close(grads.dk.view(k.shape), want_grads[1], conditioning=max(1.0, abs(level)))
    assert_close(grads.dv.view(v.shape), want_grads[2])


def _penalty(backend: str, q: torch.Tensor, w: torch.Tensor, mask: Mask | None = None) -> None:
    """A gradient penalty through attention: the gradient of q, then a backward through it."""
    out = attnkit.attention(q @ w, q, q, mask=mask, causal=mask is None, backend=backend)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    dq.square().sum().backward()


def test_second_derivatives_name_the_backends_that_take_them() -> None:
    # The chunked backend's backward is first-order: differentiating its gradients failed with
    # torch's "element 0 of tensors does not require grad" (the gradient had no graph), or, where
    # another path to the input had one (q @ w below), left the kernel's part out of the second
    # derivative without an error. Both now raise an error naming the backends that serve it.
    g = torch.Generator().manual_seed(31)
    q = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 8, generator=g, dtype=torch.float64, requires_grad=True)
    with attnkit.record_dispatch() as calls:
        attnkit.attention(q, q, q, causal=True)
    assert calls[0].chosen == "chunked"  # what auto takes for a call that needs gradients
    message = "attnkit's chunked kernel computes first-order gradients only"
    for backend in ("auto", "chunked"):
        with pytest.raises(RuntimeError, match=message) as caught:
            _penalty(backend, q, w)
        assert 'backend="reference"' in str(caught.value)
        assert "SDPBackend.MATH" in str(caught.value)
    idx = torch.tensor([0, 2, 1, 4, 3, 5]).view(1, 1, 6, 1)  # one key a query: gathered
    with attnkit.record_dispatch() as calls, pytest.raises(RuntimeError, match=message):
        _penalty("chunked", q, w, masks.key_indices(idx))  # the gathered kernel's backward
    assert str(calls[0].kernel).startswith("gathered")
    # The first-order gradients under create_graph=True are the reference's.
    out = attnkit.attention(q, q, q, causal=True, backend="chunked")
    (got,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    ref = attnkit.attention(q, q, q, causal=True, backend="reference")
    (want,) = torch.autograd.grad(ref.sum(), q)
    assert_close(got, want)
    q.grad = w.grad = None
    _penalty("reference", q, w)  # the way out: torch's operations, differentiated twice
    want = q.grad.clone()
    q.grad = None
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        _penalty("sdpa", q, w)
    assert_close(q.grad, want)
