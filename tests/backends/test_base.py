"""The backend protocol, used as a user would: from its documentation alone."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import AttentionCall, masks
from attnkit.backends import Backend, CallInputs


class LoopBackend(Backend):
    """A user's backend: one query at a time, asking the mask for each row's tile."""

    def __init__(self) -> None:
        super().__init__("loop", auto=True)
        self.calls = 0

    def check(self, call: AttentionCall) -> list[str]:
        reasons = []
        if call.softcap is not None or call.sinks or call.dropout_p or call.return_weights:
            reasons.append("plain attention only")
        if call.bias_shape is not None or call.score_term is not None:
            reasons.append("no bias")
        return reasons

    def notes(self, call: AttentionCall) -> list[str]:
        return [f"one query at a time: {call.q_len} rows"]

    def run(self, call: AttentionCall, inputs: CallInputs) -> Tensor:
        self.calls += 1
        q, k, v = inputs.q, inputs.k, inputs.v
        g = call.groups
        k = k.repeat_interleave(g, dim=-3)
        v = v.repeat_interleave(g, dim=-3)
        geo = call.geometry
        rows = []
        for i in range(call.q_len):
            s = (q[..., i : i + 1, :] @ k.transpose(-1, -2)) * call.scale  # (..., H, 1, Tk)
            if call.mask is not None:  # one batch dim in these tests: tiles broadcast as they are
                s = s.masked_fill(~call.mask.tile(geo, i, i + 1, 0, call.kv_len), float("-inf"))
            w = torch.softmax(s, -1).nan_to_num(0.0)
            rows.append(w @ v)
        return torch.cat(rows, -2)


def test_a_users_backend_serves_a_structured_mask_and_speaks_in_explain() -> None:
    backend = LoopBackend()
    attnkit.register_backend("loop", backend, auto=True)
    try:
        q = torch.randn(2, 4, 9, 8, dtype=torch.float64)
        kv = torch.randn(2, 2, 9, 8, dtype=torch.float64)
        mask = masks.sliding_window(3) & masks.key_padding([9, 5])
        out = attnkit.attention(q, kv, kv, mask=mask)
        assert backend.calls == 1
        want = attnkit.attention(q, kv, kv, mask=mask, backend="reference")
        torch.testing.assert_close(out, want)
        report = attnkit.explain(q, kv, kv, mask=mask)
        assert report.chosen == "loop"
        assert "one query at a time: 9 rows" in str(report)
        # What it cannot serve goes elsewhere, and explain() says why.
        report = attnkit.explain(q, kv, kv, mask=mask, softcap=3.0)
        assert report.chosen != "loop"
        assert report.reasons["loop"] == ["plain attention only"]
    finally:
        attnkit.unregister_backend("loop")


class EveryOther(masks.Mask):
    """A user's mask: key j is visible to query i iff i and j have the same parity (and j <= i).
    It implements only tile() and describe(): every backend must serve it."""

    def describe(self) -> str:
        return "every_other()"

    def tile(self, geo: masks.Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        i = torch.arange(qs, qe, device=geo.device)[:, None]
        j = torch.arange(ks, ke, device=geo.device)
        return (((i - j) % 2 == 0) & (j <= i))[None, None]  # (1, 1, rows, keys)


@pytest.mark.parametrize("backend", ["reference", "chunked", "sdpa", "auto"])
def test_a_users_mask_works_in_every_backend(backend: str) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ours = EveryOther()
    dense = ours.dense(40)
    out = attnkit.attention(q, k, v, mask=ours, backend=backend)
    want = attnkit.attention(q, k, v, mask=dense, backend="reference")
    torch.testing.assert_close(out, want)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    wants = torch.autograd.grad(want.sum(), (q, k, v))
    for g, w in zip(grads, wants, strict=True):
        torch.testing.assert_close(g, w)
    small = attnkit.backends.Chunked(block_q=8, block_k=8)
    torch.testing.assert_close(attnkit.attention(q, k, v, mask=ours, backend=small), want)
    assert repr(ours & masks.causal()) == "every_other() & causal()"


def test_function_backends_still_register() -> None:
    seen: list[float] = []

    def fn(q: Tensor, k: Tensor, v: Tensor, **kw: object) -> Tensor:
        seen.append(kw["scale"])  # type: ignore[arg-type]
        return attnkit.attention(q, k, v, backend="reference")

    attnkit.register_backend("fn", fn, notes=lambda call: ["a note"])
    try:
        q = torch.randn(1, 1, 4, 16)
        attnkit.attention(q, q, q, backend="fn")
        assert seen == [0.25]
        assert "a note" in str(attnkit.explain(q, q, q, backend="fn"))
    finally:
        attnkit.unregister_backend("fn")


def test_a_handover_is_counted_and_recorded() -> None:
    # A NaN in a query: torch gives that row 0 (its safe softmax), attnkit's policy NaN; sdpa
    # hands the call to chunked, visibly.
    q = torch.randn(1, 2, 6, 8)
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    q[0, 0, 2] = float("nan")
    sdpa = attnkit.backends.SDPA()
    with attnkit.record_dispatch() as calls:
        out = attnkit.attention(q, k, v, mask=torch.ones(6, 6, dtype=torch.bool), backend=sdpa)
    assert out[0, 0, 2].isnan().all()
    assert sdpa.handovers == 1
    assert [(c.chosen, c.served_by) for c in calls] == [("sdpa", "chunked")]
    assert calls[0].handovers[0][2] == "torch's output broke the non-finite policy"
    note = str(attnkit.explain(q, k, v, backend="sdpa"))
    assert "hands the call to chunked" in note


def test_a_zero_value_head_is_not_recomputed() -> None:
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    v[1, 0] = 0.0  # a legitimately zero value head
    sdpa = attnkit.backends.SDPA()
    out = attnkit.attention(q, k, v, backend=sdpa)
    assert sdpa.handovers == 0
    torch.testing.assert_close(out, attnkit.attention(q, k, v, backend="reference"))
    # ...but a NaN query in that head still is (torch would hide it as 0).
    q[1, 0, 3] = float("nan")
    out = attnkit.attention(q, k, v, backend=sdpa)
    assert sdpa.handovers == 1
    assert out[1, 0, 3].isnan().all()


def test_explain_names_the_backend_attention_runs_for_non_finite_inputs() -> None:
    q = torch.randn(1, 2, 9, 8, requires_grad=True)
    k = torch.randn(1, 1, 9, 8)
    k[..., 8, :] = float("nan")
    mask = masks.key_padding([8])
    with attnkit.record_dispatch() as calls:
        out = attnkit.attention(q, k, k, mask=mask)
    report = attnkit.explain(q, k, k, mask=mask)
    assert report.chosen == calls[0].chosen == "chunked"
    assert "non-finite values in q/k/v" in str(report)
    out.sum().backward()
    assert q.grad is not None
    assert math.isfinite(float(q.grad.sum()))


class Declining(Backend):
    """A user's backend that hands every call over, by the registered name of another."""

    def __init__(self, to: str) -> None:
        super().__init__("declining")
        self.to = to

    def run(self, call: AttentionCall, inputs: CallInputs) -> Tensor:
        out = self.hand_over(call, inputs, self.to, "not today")
        return out[0] if isinstance(out, tuple) else out


def test_a_hand_over_names_its_target_and_the_dispatcher_resolves_it_when_the_call_runs() -> None:
    q = torch.randn(1, 2, 6, 8)
    served: list[str] = []

    def first(q: Tensor, k: Tensor, v: Tensor, **kw: object) -> Tensor:
        served.append("first")
        return attnkit.attention(q, k, v, backend="reference")

    def second(q: Tensor, k: Tensor, v: Tensor, **kw: object) -> Tensor:
        served.append("second")
        return attnkit.attention(q, k, v, backend="reference")

    declining = Declining("target")
    attnkit.register_backend("target", first)
    try:
        with attnkit.record_dispatch() as calls:
            attnkit.attention(q, q, q, backend=declining)
        # the name is looked up when the call runs: a backend registered in its place serves
        attnkit.register_backend("target", second, replace=True)
        attnkit.attention(q, q, q, backend=declining)
    finally:
        attnkit.unregister_backend("target")
    assert served == ["first", "second"]
    assert declining.handovers == 2
    assert calls[0].handovers == [("declining", "target", "not today")]
    assert calls[0].served_by == "target"


def test_a_hand_over_to_a_name_not_registered_or_a_backend_that_cannot_serve_is_an_error() -> None:
    q = torch.randn(1, 2, 6, 8)
    with pytest.raises(
        attnkit.BackendError,
        match=r"hands the call to 'nowhere' \(not today\), which is not registered; "
        r"registered: sdpa",
    ):
        attnkit.attention(q, q, q, backend=Declining("nowhere"))
    # chunked returns no weights: handing it a call that asks for them is refused, not run
    declining = Declining("chunked")
    declining.check = lambda call: []  # type: ignore[method-assign]
    with pytest.raises(
        attnkit.BackendError,
        match=r"handed the call to 'chunked' \(not today\), which cannot serve it: does not "
        r"return attention weights",
    ):
        attnkit.attention(q, q, q, return_weights=True, backend=declining)
    assert declining.handovers == 0
    # outside a call of attention() there is no registry to look the name up in
    call = attnkit.explain(q, q, q).call
    with pytest.raises(attnkit.BackendError, match=r"outside a call of attnkit\.attention\(\)"):
        declining.run(call, CallInputs(q, q, q))


def test_a_backend_with_a_slow_path_is_passed_over_for_one_without() -> None:
    q = torch.randn(1, 2, 6, 8)
    slow_for_causal = Backend(
        "careful",
        lambda q, k, v, **kw: attnkit.attention(q, k, v, backend="reference"),  # type: ignore[misc]
        slower=lambda call: ["walks every row twice for causal calls"] if call.causal else [],
    )
    attnkit.register_backend("careful", slow_for_causal, auto=True)
    try:
        assert attnkit.explain(q, q, q).chosen == "careful"  # first in the order, fast path
        report = attnkit.explain(q, q, q, causal=True)
        assert report.chosen == "sdpa"
        assert report.slower["careful"] == ["walks every row twice for causal calls"]
        assert "  careful    avoided: walks every row twice for causal calls" in str(report)
        with attnkit.record_dispatch() as calls:
            attnkit.attention(q, q, q, causal=True)
        assert calls[0].chosen == "sdpa"
        # ... but preferred to a backend with costs: with weights asked for, only reference
        # (which materialises the scores) competes
        report = attnkit.explain(q, q, q, causal=True, return_weights=True)
        assert report.chosen == "careful"
        assert "  reference  avoided: would materialise the scores" in str(report)
    finally:
        attnkit.unregister_backend("careful")
