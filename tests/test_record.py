"""record_dispatch(): each call's backend, its hand-overs and the kernel that served it, in eager
and compiled code alike, agreeing with explain()."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import _native, masks
from attnkit.backends import Chunked


def test_each_call_is_recorded_with_its_backend_and_kernel() -> None:
    q = torch.randn(1, 2, 30, 8)
    with attnkit.record_dispatch() as calls:
        attnkit.attention(q, q, q, causal=True, backend="chunked")
        attnkit.attention(q, q, q, causal=True, backend=Chunked(native=False))
        attnkit.attention(q, q, q, backend="reference")
    assert [c.chosen for c in calls] == ["chunked", "chunked", "reference"]
    native = (
        "native kernel"
        if _native.load()
        else f"the eager kernel (native kernel: {_native.status()[1]})"
    )
    assert [c.kernel for c in calls] == [native, "the eager kernel (Chunked(native=False))", None]


def test_the_recorded_kernel_is_the_one_explain_names() -> None:
    for q, kw in (
        (torch.randn(1, 2, 30, 8), {"mask": masks.sliding_window(4)}),
        (torch.randn(1, 2, 30, 8).requires_grad_(), {"causal": True}),
        (torch.full((1, 2, 30, 8), float("inf")), {"causal": True}),  # non-finite: eager kernel
    ):
        with attnkit.record_dispatch() as calls:
            attnkit.attention(q, q, q, backend="chunked", **kw)  # type: ignore[arg-type]
        (call,) = calls
        assert call.kernel is not None
        assert call.kernel.split(" (")[0] in str(attnkit.explain(q, q, q, backend="chunked", **kw))  # type: ignore[arg-type]


def test_a_hand_over_is_recorded_with_its_reason() -> None:
    class Declining(attnkit.Backend):
        def __init__(self) -> None:
            super().__init__("declining")

        def run(self, call: attnkit.AttentionCall, inputs: attnkit.CallInputs) -> torch.Tensor:
            out = self.hand_over(call, inputs, Chunked(), "not today")
            return out[0] if isinstance(out, tuple) else out

    q = torch.randn(1, 2, 10, 8)
    with attnkit.record_dispatch() as calls:
        attnkit.attention(q, q, q, backend=Declining())
    (call,) = calls
    assert call.handovers == [("declining", "chunked", "not today")]
    assert call.served_by == "chunked"
    assert call.kernel is not None


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_calls_are_recorded_when_they_run() -> None:
    # (a call attnkit's operator serves: one that torch's SDPA serves inside a compiled graph
    # is torch's, and records nothing)
    q = torch.randn(1, 2, 30, 8)
    f = torch.compile(
        lambda q: attnkit.attention(q, q, q, mask=masks.sliding_window(3)), fullgraph=True
    )
    f(q)
    with attnkit.record_dispatch() as calls:
        f(q)
        f(q)
    assert [(c.chosen, c.call.q_len) for c in calls] == [("chunked", 30)] * 2


@pytest.fixture
def fresh_dynamo() -> object:
    torch._dynamo.reset()
    yield None
    torch._dynamo.reset()
