"""Structured masks, softcap and sinks on every backend that takes them, against the float64 spec.

The spec for a structured mask is the reference backend on the dense bool tensor the mask means
(written out independently in tests/strategies.py); for softcap and sinks it is a brute-force
attention written from the definition (tests/helpers.py).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import BackendError, _native, attention, explain, masks
from attnkit.testing import assert_close

from ..helpers import blocked, brute_force
from ..strategies import structured_masks

BACKENDS = ["sdpa", "chunked", "reference"]


def draw_call(data: st.DataObject) -> dict[str, object]:
    """Shapes of a call: batch dims (none, one or two), GQA, Tq != Tk, empty lengths."""
    draw = data.draw
    batch = tuple(draw(st.lists(st.integers(1, 2), min_size=0, max_size=2)))
    hkv = draw(st.integers(1, 2))
    return {
        "batch": batch,
        "h": hkv * draw(st.sampled_from([1, 2, 3])),
        "hkv": hkv,
        "tq": draw(st.integers(0, 13)),
        "tk": draw(st.integers(0, 13)),
        "dk": draw(st.integers(1, 6)),
        "dv": draw(st.integers(1, 6)),
        "seed": draw(st.integers(0, 2**16)),
    }


def tensors(c: dict[str, object]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(int(c["seed"]))  # type: ignore[call-overload]
    batch: tuple[int, ...] = c["batch"]  # type: ignore[assignment]

    def randn(*shape: object) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)  # type: ignore[call-overload]

    return [
        randn(*batch, c["h"], c["tq"], c["dk"]),
        randn(*batch, c["hkv"], c["tk"], c["dk"]),
        randn(*batch, c["hkv"], c["tk"], c["dv"]),
    ]


@given(data=st.data(), blocks=st.tuples(st.integers(1, 5), st.integers(1, 5)))
@settings(max_examples=40)
def test_structured_masks_equal_their_dense_form(
    data: st.DataObject, blocks: tuple[int, int]
) -> None:
    c = draw_call(data)
    batch: tuple[int, ...] = c["batch"]  # type: ignore[assignment]
    b, h, tq, tk = math.prod(batch), int(c["h"]), int(c["tq"]), int(c["tk"])  # type: ignore[call-overload]
    s = data.draw(structured_masks(b, h, tq, tk))
    dense = s.dense.reshape(*batch, h, tq, tk)
    leaves = [t.requires_grad_() for t in tensors(c)]
    want = attention(*leaves, mask=dense, backend="reference")
    cot = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want_grads = torch.autograd.grad(want, leaves, cot)
    for backend in BACKENDS:
        got = attention(*leaves, mask=s.mask, backend=blocked(backend, *blocks))
        assert_close(got, want)
        for g, w in zip(torch.autograd.grad(got, leaves, cot), want_grads, strict=True):
            assert_close(g, w)


@given(
    data=st.data(),
    softcap=st.sampled_from([None, 0.5, 3.0, 30.0]),
    sinks=st.booleans(),
    bias=st.booleans(),
    blocks=st.tuples(st.integers(1, 5), st.integers(1, 5)),
)
@settings(max_examples=30)
def test_softcap_and_sinks_equal_their_definition(
    data: st.DataObject, softcap: float | None, sinks: bool, bias: bool, blocks: tuple[int, int]
) -> None:
    c = draw_call(data)
    c["batch"] = c["batch"][:1]  # type: ignore[index]
    c["tq"], c["tk"] = min(int(c["tq"]), 7), min(int(c["tk"]), 7)  # type: ignore[call-overload]
    batch: tuple[int, ...] = c["batch"]  # type: ignore[assignment]
    h, tq, tk = int(c["h"]), int(c["tq"]), int(c["tk"])  # type: ignore[call-overload]
    g = torch.Generator().manual_seed(2)
    q, k, v = tensors(c)
    q = q * 3  # logits past the cap
    s = data.draw(structured_masks(math.prod(batch), h, tq, tk))
    mask = s.dense.reshape(*batch, h, tq, tk)
    kw: dict[str, object] = {
        "softcap": softcap,
        "sinks": torch.randn(h, generator=g, dtype=torch.float64) if sinks else None,
        "bias": torch.randn(h, tq, tk, generator=g, dtype=torch.float64) if bias else None,
    }
    want, weights = brute_force(q, k, v, mask=mask, **kw)  # type: ignore[arg-type]
    out, w = attention(q, k, v, mask=s.mask, return_weights=True, backend="reference", **kw)  # type: ignore[call-overload]
    assert_close(out, want)
    assert_close(w, weights)

    leaves = [t.requires_grad_() for t in (q, k, v)]
    leaves += [t.requires_grad_() for t in (kw["sinks"], kw["bias"]) if isinstance(t, torch.Tensor)]
    cot = torch.randn(want.shape, dtype=torch.float64, generator=g)
    spec = attention(*leaves[:3], mask=mask, backend="reference", **kw)  # type: ignore[call-overload]
    spec_grads = torch.autograd.grad(spec, leaves, cot, materialize_grads=True)
    got = attention(*leaves[:3], mask=s.mask, backend=blocked("chunked", *blocks), **kw)  # type: ignore[call-overload]
    assert_close(got, spec)
    got_grads = torch.autograd.grad(got, leaves, cot, materialize_grads=True)
    for a, b in zip(got_grads, spec_grads, strict=True):
        assert_close(a, b)


def test_sinks_shrink_every_row_and_leave_empty_rows_at_zero() -> None:
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([0.0, 5.0], dtype=torch.float64, requires_grad=True)
    pad = masks.key_padding(valid=torch.tensor([[True] * 6]))
    empty = masks.from_fn(lambda b, h, q_idx, kv_idx: q_idx != 2)  # query 2 sees nothing
    _, w = attention(q, kv, kv, mask=pad & empty, sinks=sinks, return_weights=True)
    for backend in ("reference", "chunked"):
        out = attention(q, kv, kv, mask=pad & empty, sinks=sinks, backend=backend)
        assert torch.equal(out[:, :, 2], torch.zeros(1, 2, 8, dtype=torch.float64))
        rows = w.sum(-1)
        assert (rows[0, :, [0, 1, 3]] < 1).all()
        assert (rows[0, 1, [0, 1, 3]] < rows[0, 0, [0, 1, 3]]).all()  # a larger sink takes more
        grads = torch.autograd.grad(out[:, :, 2].sum() + 0 * out.sum(), [q, sinks])
        assert torch.equal(grads[0], torch.zeros_like(q))
        assert torch.equal(grads[1], torch.zeros_like(sinks))


def test_softcap_bounds_the_scores() -> None:
    q = torch.randn(1, 1, 3, 4, dtype=torch.float64) * 100
    k = torch.randn(1, 1, 5, 4, dtype=torch.float64)
    _, w = attention(q, k, k, softcap=2.0, scale=1.0, return_weights=True)
    logits = w.log()
    spread = logits.amax(-1) - logits.amin(-1)  # scores within [-2, 2]: spread at most 4
    assert (spread <= 4 + 1e-9).all()
    _, uncapped = attention(q, k, k, scale=1.0, return_weights=True)
    assert (uncapped.log().amax(-1) - uncapped.log().amin(-1) > 4).any()  # the check can fail


def test_explain_says_which_backends_take_each_modifier() -> None:
    q = torch.empty(1, 4, 256, 16, device="meta")
    sinks = torch.empty(4, device="meta")
    report = str(explain(q, q, q, softcap=30.0, sinks=sinks, causal=True))
    assert "softcap=30.0, sinks" in report
    assert "auto picks: chunked" in report
    assert "sdpa       cannot: torch's kernel has no softcap; torch's kernel has no sinks" in report
    report = str(explain(q, q, q, mask=masks.documents([50, 50, 156])))
    assert "mask documents(lengths=[50, 50, 156])" in report
    assert "sdpa       avoided: would materialise the mask documents" in report
    report = str(explain(q, q, q, mask=masks.documents([100, 156])))  # long enough: a call each
    assert "auto picks: sdpa" in report
    assert "one fused call per document: 2 calls" in report
    with pytest.raises(BackendError, match="torch's kernel has no sinks"):
        attention(q, q, q, sinks=sinks, backend="sdpa")


@pytest.mark.usefixtures("no_shape_checks")
@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"softcap": 0.0}, ValueError, "softcap must be a finite number > 0, got 0.0"),
        ({"softcap": -1}, ValueError, "softcap must be a finite number > 0, got -1"),
        ({"softcap": math.inf}, ValueError, "softcap must be a finite number > 0, got inf"),
        ({"softcap": "30"}, TypeError, "softcap must be a number > 0 or None, got '30'"),
        (
            {"sinks": torch.zeros(3)},
            ValueError,
            "sinks must have shape (H,) = (4,), one logit per query head, got (3)",
        ),
        (
            {"sinks": torch.zeros(4, dtype=torch.float64)},
            TypeError,
            "sinks must have the dtype of q (float32), got float64; use sinks.to(q.dtype)",
        ),
        ({"sinks": torch.zeros(4, dtype=torch.long)}, TypeError, "sinks must be a float tensor"),
        ({"sinks": [0.0] * 4}, TypeError, "sinks must be a float tensor (H,) or None, got list"),
        (
            {"mask": masks.documents([3, 3])},
            ValueError,
            "mask: documents(lengths=[3, 3]) covers 6 positions but the call has Tk = 7 keys",
        ),
        (
            {"mask": masks.key_padding([7, 7, 7])},
            ValueError,
            "mask: key_padding(lengths=[7, 7, 7]) has 3 batch rows but the call has B = 2",
        ),
        ({"mask": [True]}, TypeError, "mask must be a bool tensor (True = may attend) or an"),
    ],
)
def test_bad_modifiers_are_named(
    kwargs: dict[str, object], exc: type[Exception], message: str
) -> None:
    q = torch.randn(2, 4, 5, 8)
    kv = torch.randn(2, 4, 7, 8)
    with pytest.raises(exc, match=re.escape(message)):
        attention(q, kv, kv, **kwargs)  # type: ignore[arg-type]


def test_top_left_causal_is_what_a_static_cache_means() -> None:
    # A cache preallocated for 6 keys holds 2 real ones; 2 new queries sit at positions 0 and 1.
    q = torch.randn(1, 2, 2, 8, dtype=torch.float64)
    kv = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    want = attention(q, kv[:, :, :2], kv[:, :, :2], causal=True)
    for backend in BACKENDS:
        got = attention(q, kv, kv, mask=masks.causal(align="top_left"), backend=backend)
        assert_close(got, want)
    assert (attention(q, kv, kv, causal=True) - want).abs().max() > 1e-3  # bottom-right differs


def test_the_kernel_reuses_one_plan_for_forward_and_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plans = []
    original = attnkit._kernel.planning.make_plan

    def counting(*args: object, **kw: object) -> object:
        plans.append(1)
        return original(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(attnkit._kernel.planning, "make_plan", counting)
    q = torch.randn(1, 2, 40, 8, requires_grad=True)
    out = attention(q, q, q, mask=masks.sliding_window(5), backend="chunked")
    out.sum().backward()
    assert plans == [1]


@pytest.mark.parametrize(
    "docs",
    [
        pytest.param(lambda: masks.documents([300, 0, 400, 324]), id="lengths"),
        pytest.param(lambda: masks.documents([[300, 724], [1000, 24]]), id="per-row"),
        pytest.param(lambda: masks.documents(ids=torch.tensor([4] * 500 + [2] * 524)), id="ids"),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_serves_long_documents_one_call_each(docs: object, causal: bool) -> None:
    # Packed documents of 128 tokens or more on average go to torch one document at a time (no
    # (Tq, Tk) mask is written): the same numbers as the reference, gradients included.
    mask = docs()  # type: ignore[operator]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1024, 16, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 1024, 16, dtype=torch.float64, generator=g) for _ in range(2))
    k.requires_grad_(True)
    v.requires_grad_(True)
    # (auto runs such calls in the native kernel on CPUs, in inference and training alike)
    report = explain(q, k, v, mask=mask, causal=causal, backend="sdpa")
    assert "one fused call per document" in str(report)
    assert "would materialise" not in str(report)
    out = attention(q, k, v, mask=mask, causal=causal, backend="sdpa")
    want = attention(q, k, v, mask=mask, causal=causal, backend="reference")
    assert_close(out, want)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b)


def test_short_or_scattered_documents_stay_on_the_kernel() -> None:
    q = torch.randn(1, 2, 1024, 16)
    short = masks.documents([64] * 16)  # a call per 64-token document costs more than it saves
    scattered = masks.documents(ids=torch.arange(1024) % 2)  # a document in pieces
    for mask in (short, scattered):
        e = explain(q, q, q, mask=mask)
        assert e.chosen == "chunked"
        assert "would materialise" in " ".join(e.costs["sdpa"])
        assert_close(attention(q, q, q, mask=mask, backend="sdpa"), attention(q, q, q, mask=mask))


@pytest.mark.skipif(not _native.load(), reason="needs the native kernel")
def test_training_on_cpus_prefers_the_native_kernel() -> None:
    """torch's CPU backward is the slower: auto trains float32/float64 in the native kernel, and
    keeps torch's kernel for small inference calls and bfloat16 prefill (bfloat16 training: see
    tests/backends/sdpa/test_costs.py, it depends on the CPU's bfloat16 products)."""
    q = torch.randn(1, 2, 64, 16, requires_grad=True)
    report = explain(q, q, q)
    assert report.chosen == "chunked"
    assert "trains slower on CPUs" in " ".join(report.slower["sdpa"])
    assert "  sdpa       avoided: trains slower on CPUs" in str(report)
    assert not report.costs["sdpa"]
    with torch.no_grad():
        assert explain(q, q, q).chosen == "sdpa"
    with torch.no_grad():
        assert explain(*(q.to(torch.bfloat16) for _ in range(3))).chosen == "sdpa"
