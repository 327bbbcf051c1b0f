"""attention()'s entry points given arguments at the edge of what they take: each gives the float64
reference's result or a clear error naming the argument."""

from __future__ import annotations

import pytest
import torch

import attnkit


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 4, 3, generator=g)
    k, v = (torch.randn(2, 2, 5, 3, generator=g) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("backend", ["auto", "sdpa", "chunked", "reference"])
def test_a_0d_bias_is_refused_naming_the_argument_on_every_backend(
    backend: str, no_shape_checks: None
) -> None:
    # bias is (..., Tk) at least: a 0-d one reached torch's SDPA (auto's pick), which failed
    # with an IndexError of its own.
    q, k, v = inputs()
    with pytest.raises(ValueError, match=r"bias must have at least one dim \(\.\.\., Tk\)"):
        attnkit.attention(q, k, v, bias=torch.tensor(0.5), backend=backend)
    with pytest.raises(ValueError, match=r"bias must have at least one dim"):
        attnkit.explain(q, k, v, bias=torch.tensor(0.5), backend=backend)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "chunked", "reference"])
@pytest.mark.parametrize("shape", [(1,), (5,), (4, 1), (2, 1, 5)])
def test_a_bias_of_few_dims_broadcasts_on_every_backend(
    backend: str, shape: tuple[int, ...]
) -> None:
    q, k, v = inputs()
    bias = torch.randn(shape, generator=torch.Generator().manual_seed(1)).requires_grad_()
    got = attnkit.attention(q, k, v, bias=bias, backend=backend)
    (dbias,) = torch.autograd.grad(got.sin().sum(), bias)
    b64 = bias.detach().double().requires_grad_()
    want = attnkit.attention(q.double(), k.double(), v.double(), bias=b64, backend="reference")
    (dwant,) = torch.autograd.grad(want.sin().sum(), b64)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dbias.double(), dwant, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("name", "meant"),
    [("SDPA", "sdpa"), ("refrence", "reference"), ("chunk", "chunked"), (" auto", "auto")],
)
def test_a_misspelled_backend_is_named_with_the_one_meant(name: str, meant: str) -> None:
    q, k, v = inputs()
    with pytest.raises(ValueError, match=rf"unknown backend '{name}'; did you mean '{meant}'\?"):
        attnkit.attention(q, k, v, backend=name)
    with pytest.raises(ValueError, match=r"unknown backend 'xyz'; choose 'auto' or one of"):
        attnkit.attention(q, k, v, backend="xyz")
