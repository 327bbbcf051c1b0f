"""torch.func's transforms: whether they are active (attnkit._base.transforms), and attention()
under them: grad, vjp and jacrev through every backend's kernel, vmap over a call, and
per-example gradients (vmap over grad), against autograd on the reference, example by
example."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, jacrev, jvp, vjp, vmap

from attnkit import attention, masks
from attnkit._base.transforms import carries_tangent, transforms_active
from attnkit.backends import BackendError
from attnkit.testing import assert_close

F64 = torch.float64
# torch's notice that an operator without a batching rule runs once per example under vmap, and
# the deprecation its forward-mode decompositions raise when they load
pytestmark = [
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
]


def test_transforms_active_inside_each_transform_only() -> None:
    seen: list[bool] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(transforms_active())
        return x.sum()

    probe(torch.ones(2))
    grad(probe)(torch.ones(2))
    vmap(probe)(torch.ones(3, 2))
    jacrev(probe)(torch.ones(2))
    assert seen == [False, True, True, True]
    assert not transforms_active()


def _qkv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 5, 8, generator=g, dtype=F64)
    k, v = (torch.randn(2, 2, 12, 8, generator=g, dtype=F64) for _ in range(2))
    return q, k, v


def _loss(backend: str) -> Callable[..., torch.Tensor]:
    window = masks.sliding_window(6, 0)
    return lambda q, k, v: attention(q, k, v, mask=window, backend=backend).square().sum()


@pytest.mark.parametrize("backend", ["chunked", "sdpa", "reference", "auto"])
def test_grad_vjp_and_jacrev_equal_autograd_on_the_reference(backend: str) -> None:
    q, k, v = _qkv()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    _loss("reference")(*leaves).backward()
    got = grad(_loss(backend), argnums=(0, 1, 2))(q, k, v)
    for g, leaf in zip(got, leaves, strict=True):
        assert_close(g, leaf.grad)
    window = masks.sliding_window(6, 0)
    out, pull = vjp(lambda q: attention(q, k, v, mask=window, backend=backend), q)
    assert_close(pull(torch.ones_like(out))[0], vjp(
        lambda q: attention(q, k, v, mask=window, backend="reference"), q
    )[1](torch.ones_like(out))[0])  # fmt: skip
    jac = jacrev(lambda q: attention(q[None], k[:1], v[:1], backend=backend))(q[0, :, :2])
    ref = torch.autograd.functional.jacobian(
        lambda q: attention(q[None], k[:1], v[:1], backend="reference"), q[0, :, :2]
    )
    assert_close(jac, ref)


def test_per_example_gradients_run_where_values_need_not_be_read() -> None:
    """vmap over grad: auto takes a backend that reads no value on the host and equals autograd
    example by example; the chunked backend, which must read whether q, k and v are finite
    before a call with gradients, refuses with the reason."""
    q, k, v = _qkv(1)

    def one(backend: str) -> Callable[..., tuple[torch.Tensor, ...]]:
        def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attention(q[None], k[None], v[None], causal=True, backend=backend).sum()

        return vmap(grad(loss, argnums=(0, 1)))

    for backend in ("auto", "reference", "sdpa"):
        dq, dk = one(backend)(q, k, v)
        for b in range(2):
            leaves = [q[b : b + 1].clone().requires_grad_(), k[b : b + 1].clone().requires_grad_()]
            attention(*leaves, v[b : b + 1], causal=True, backend="reference").sum().backward()
            assert_close(dq[b], leaves[0].grad[0])
            assert_close(dk[b], leaves[1].grad[0])
    with pytest.raises(BackendError, match=r"torch\.func\.vmap cannot"):
        one("chunked")(q, k, v)


def test_vmap_over_an_inference_call_equals_each_call() -> None:
    q, k, v = _qkv(2)
    with torch.no_grad():
        got = vmap(
            lambda q, k, v: attention(q[None], k[None], v[None], causal=True, backend="chunked")[0]
        )(q, k, v)
        for b in range(2):
            want = attention(*(t[b : b + 1] for t in (q, k, v)), causal=True, backend="reference")
            assert_close(got[b], want[0])


def test_a_module_under_torch_func_equals_autograd() -> None:
    """MultiHeadAttention through functional_call: grad of its parameters equals autograd's, and
    per-example gradients (vmap over grad) equal autograd example by example."""
    from torch.func import functional_call

    from attnkit import MultiHeadAttention

    torch.manual_seed(3)
    module = MultiHeadAttention(32, 4, num_kv_heads=2).double()
    x = torch.randn(2, 6, 32, dtype=F64)
    params = {n: p.detach() for n, p in module.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(module, p, (x,), {"causal": True}).square().sum()

    got = grad(loss)(params, x)
    module.zero_grad()
    loss(dict(module.named_parameters()), x).backward()
    for name, p in module.named_parameters():
        assert_close(got[name], p.grad)
    per_example = vmap(grad(lambda p, x: loss(p, x[None])), in_dims=(None, 0))(params, x)
    for b in range(2):
        module.zero_grad()
        loss(dict(module.named_parameters()), x[b : b + 1]).backward()
        for name, p in module.named_parameters():
            assert_close(per_example[name][b], p.grad)


def test_carries_tangent_sees_jvp_and_dual_tensors_only() -> None:

    x = torch.randn(3)
    seen: list[bool] = []

    def probe(t: torch.Tensor) -> torch.Tensor:
        seen.append(carries_tangent(t, x, None))
        return t * 2

    probe(x)
    jvp(probe, (x,), (torch.ones(3),))
    grad(lambda t: probe(t).sum())(x)
    with fwAD.dual_level():
        probe(fwAD.make_dual(x, torch.ones(3)))
        probe(x)
    assert seen == [False, True, False, True, False]


def test_forward_mode_derivatives_run_on_a_backend_that_carries_them() -> None:
    """jvp and forward_ad's dual tensors through auto equal the reference's jvp, which a finite
    difference confirms; the chunked and sdpa kernels, which would drop the tangent (the chunked
    backend gave 0 silently), refuse with the reason."""

    q, k, v = _qkv(4)
    tangent = torch.randn_like(q)

    def call(backend: str) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda q: attention(q, k, v, causal=True, backend=backend)

    _, want = jvp(call("reference"), (q,), (tangent,))
    eps = 1e-6
    ref = call("reference")
    difference = (ref(q + eps * tangent) - ref(q - eps * tangent)) / (2 * eps)
    torch.testing.assert_close(difference, want, atol=1e-7, rtol=1e-6)  # (its own error: eps^2)
    assert_close(jvp(call("auto"), (q,), (tangent,))[1], want)
    with fwAD.dual_level():
        out = attention(fwAD.make_dual(q, tangent), k, v, causal=True)
        assert_close(fwAD.unpack_dual(out).tangent, want)
    for backend in ("chunked", "sdpa"):
        with pytest.raises(BackendError, match="forward-mode derivative"):
            jvp(call(backend), (q,), (tangent,))
