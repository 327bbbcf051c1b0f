"""The kernel on a whole call: plan_call's spec (the choice, the plan, the native operator's
arguments), the forward and backward against the reference, on both kernels."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention, masks
from attnkit._kernel.call import kernel_attention, native_arguments, plan_call
from attnkit._kernel.choice import native_serves
from attnkit.testing import assert_close


def qkv(t: int = 45) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randn(2, 4, t, 8, generator=g, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("native", [True, False])
def test_a_call_and_its_gradients_are_the_references(native: bool) -> None:
    q, k, v = (t.requires_grad_() for t in qkv())
    mask = masks.sliding_window(7, 2)
    out = kernel_attention(q, k, v, mask=mask, bias=None, scale=0.4, native=native, block_q=16)
    assert isinstance(out, torch.Tensor)
    want = attention(q, k, v, mask=mask, scale=0.4, backend="reference")
    assert_close(out, want)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    expected = torch.autograd.grad(want, (q, k, v), dout)
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b)


def test_native_arguments_are_the_specs_or_say_why_not() -> None:
    q, k, v = qkv()
    spec, dense, term_inputs = plan_call(q, k, v, mask=None, bias=None, scale=0.4, native=False)
    with pytest.raises(ValueError, match=r"does not serve this call: the eager kernel \(Chunked"):
        native_arguments(spec, q, k, v, dense, term_inputs)
    if not native_serves(torch.device("cpu"), None, False, True):
        pytest.skip("the native kernel is not available")
    spec, dense, term_inputs = plan_call(q, k, v, mask=masks.causal(), bias=None, scale=0.4)
    args, kwargs = native_arguments(spec, q, k, v, dense, term_inputs)
    assert spec.native is not None
    assert args[3] is spec.plan.offsets
    assert args[4] is spec.plan.visits
    assert kwargs["band"] == [float("-inf"), 0.0]
    out, _ = torch.ops.attnkit.native_forward(*args, **kwargs)
    want = attention(q, k, v, causal=True, scale=0.4, backend="reference")
    assert_close(out.reshape(want.shape), want)
