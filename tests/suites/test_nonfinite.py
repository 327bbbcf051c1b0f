"""The non-finite policy, on every backend and through the modules.

(a) a masked (q, k) pair never influences any output or gradient, whatever q, k, v or bias hold
there; (b) a non-finite value in a visible input reaches exactly the outputs that depend on it, in
every backend alike; (c) a query with no visible key gives 0 with zero gradients; (d) a bias may
hold -inf (a mask) but not NaN or +inf, and scale must be finite and representable.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import attnkit
from attnkit import attention, masks
from attnkit.testing import assert_close

from ..helpers import blocked

BACKENDS = ["auto", "sdpa", "chunked", "reference"]
GARBAGE = [float("nan"), float("inf"), -float("inf"), 3e38]


def padded_call(tq: int = 5, tk: int = 9, real: tuple[int, ...] = (6, 3)) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    b = len(real)
    return {
        "q": torch.randn(b, 2, tq, 8, dtype=torch.float64, generator=g),
        "k": torch.randn(b, 2, tk, 8, dtype=torch.float64, generator=g),
        "v": torch.randn(b, 2, tk, 4, dtype=torch.float64, generator=g),
        "pad": masks.padding_mask(list(real), max_len=tk),
    }


def spoil_padding(x: dict[str, Tensor], value: float) -> dict[str, Tensor]:
    """The same call with ``value`` in every padded key and value position."""
    out = {n: t.clone() for n, t in x.items()}
    hidden = ~x["pad"][:, :, 0, :, None]  # (B, 1, Tk, 1)
    out["k"] = out["k"].masked_fill(hidden, value)
    out["v"] = out["v"].masked_fill(hidden, value)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", GARBAGE)
@pytest.mark.parametrize("structured", [False, True])
def test_garbage_in_padding_changes_no_output_and_no_gradient(
    backend: str, value: float, structured: bool
) -> None:
    clean = padded_call()
    dirty = spoil_padding(clean, value)
    mask = masks.key_padding([6, 3], side="right") if structured else clean["pad"]
    if backend == "sdpa" and value != 3e38:
        # torch's backward would spread the NaN: sdpa serves such calls only without gradients.
        with torch.no_grad():
            want = attention(clean["q"], clean["k"], clean["v"], mask=mask, backend="sdpa")
            got = attention(dirty["q"], dirty["k"], dirty["v"], mask=mask, backend="sdpa")
        assert_close(got, want)
        with pytest.raises(attnkit.BackendError, match="gradients are needed"):
            attention(
                dirty["q"].requires_grad_(), dirty["k"], dirty["v"], mask=mask, backend="sdpa"
            )
        return
    results = []
    for x in (clean, dirty):
        leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v")]
        out = attention(*leaves, mask=mask, causal=False, backend=blocked(backend, 2, 3))
        cot = torch.randn(
            out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
        )
        grads = torch.autograd.grad(out, leaves, cot)
        results.append((out, *grads))
    (out, dq, dk, dv), (out2, dq2, dk2, dv2) = results
    assert_close(out2, out)
    assert_close(dq2, dq)
    real = clean["pad"][:, :, 0, :, None]
    for got, want in ((dk2, dk), (dv2, dv)):
        assert_close(got * real, want * real)  # real keys: the clean gradients
        assert torch.equal(got.masked_fill(real, 0.0), torch.zeros_like(got))  # padded: 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_garbage_in_queries_that_see_nothing_gives_zero(backend: str) -> None:
    x = padded_call(real=(6, 0))  # row 1 has no real key: every one of its queries sees nothing
    q = x["q"].clone()
    q[1] = float("nan")
    if backend == "sdpa":  # no gradients for NaN inputs there (see the test above)
        with torch.no_grad():
            out = attention(q, x["k"], x["v"], mask=x["pad"], backend="sdpa")
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        return
    q.requires_grad_()
    k = x["k"].clone().requires_grad_()
    out = attention(q, k, x["v"], mask=x["pad"], backend=blocked(backend, 2, 3))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].isfinite().all()
    dq, dk = torch.autograd.grad(out.sum(), [q, k])
    assert torch.equal(dq[1], torch.zeros_like(dq[1]))
    assert dk.isfinite().all()  # the NaN queries' zero weights never multiply into dk


def nan_pattern(backend: str, q: Tensor, k: Tensor, v: Tensor, **kw: object) -> Tensor:
    out = attention(q, k, v, backend=blocked(backend, 2, 3), **kw)  # type: ignore[call-overload]
    assert not out.isinf().any()  # non-finite results are NaN
    return out.isnan()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_query_reaches_its_own_row_only(backend: str) -> None:
    x = padded_call()
    q = x["q"].clone()
    q[0, 1, 2, 0] = float("nan")
    spoiled = nan_pattern(backend, q, x["k"], x["v"])
    want = torch.zeros_like(spoiled)
    want[0, 1, 2] = True
    assert torch.equal(spoiled, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_key_reaches_the_queries_that_see_it(backend: str) -> None:
    x = padded_call(tq=6, tk=6, real=(6,))
    k = x["k"].clone()
    k[0, 0, 3, 1] = float("nan")
    spoiled = nan_pattern(backend, x["q"], k, x["v"], causal=True)
    want = torch.zeros_like(spoiled)
    want[0, 0, 3:] = True  # queries 3..5 see key 3
    assert torch.equal(spoiled, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_bad_value_entry_reaches_only_its_dim_of_the_queries_that_see_it(
    backend: str, value: float
) -> None:
    x = padded_call(tq=6, tk=6, real=(6,))
    v = x["v"].clone()
    v[0, 1, 2, 3] = value
    spoiled = nan_pattern(backend, x["q"], x["k"], v, causal=True)
    want = torch.zeros_like(spoiled)
    want[0, 1, 2:, 3] = True  # queries 2..5 of head 1 see key 2; only value dim 3 is spoiled
    assert torch.equal(spoiled, want)


@given(data=st.data())
@settings(max_examples=40)
def test_every_backend_agrees_on_what_is_spoiled(data: st.DataObject) -> None:
    # Random NaN/inf anywhere, random masks: all backends give NaN at the same places and agree
    # elsewhere with the reference.
    draw = data.draw
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    b, h, tq, tk = 2, 2, draw(st.integers(1, 7)), draw(st.integers(1, 7))
    q, k, v = (torch.randn(b, h, t, 4, dtype=torch.float64, generator=g) for t in (tq, tk, tk))
    for t in (q, k, v):
        spots = torch.rand(t.shape, generator=g) < draw(st.sampled_from([0.0, 0.02, 0.1]))
        t.masked_fill_(spots, draw(st.sampled_from(GARBAGE[:3])))
    mask = torch.rand(b, 1, tq, tk, generator=g) < 0.6
    causal = draw(st.booleans())
    want = attention(q, k, v, mask=mask, causal=causal, backend="reference")
    for backend in ("auto", "sdpa", "chunked"):
        got = attention(q, k, v, mask=mask, causal=causal, backend=blocked(backend, 2, 3))
        assert torch.equal(got.isnan(), want.isnan()), backend
        assert torch.equal(got.isinf(), want.isinf()), backend
        finite = want.isfinite()
        assert_close(got[finite], want[finite])


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "reference"])
def test_minus_inf_bias_masks_that_pair_even_against_nan_values(backend: str) -> None:
    x = padded_call(tq=4, tk=5, real=(5,))
    v = x["v"].clone()
    v[0, :, 4] = float("nan")
    bias = torch.zeros(4, 5, dtype=torch.float64)
    bias[:, 4] = -float("inf")  # key 4 excluded by the bias alone
    got = attention(x["q"], x["k"], v, bias=bias, backend=blocked(backend, 2, 3))
    want = attention(x["q"][..., :4, :], x["k"][..., :4, :], v[..., :4, :], backend="reference")
    assert_close(got, want)


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "reference"])
def test_a_row_excluded_by_the_bias_alone_has_zero_gradients(backend: str) -> None:
    # No bool mask: only the -inf bias empties row 1. Without the empty-row rule the chunked
    # backward gives NaN here.
    q = torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 5, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(3, 5, dtype=torch.float64)
    bias[1] = -float("inf")
    bias.requires_grad_()
    out = attention(q, k, k, bias=bias, backend=blocked(backend, 2, 2))
    assert torch.equal(out[0, 0, 1], torch.zeros(4, dtype=torch.float64))
    dq, dk, dbias = torch.autograd.grad(out.square().sum(), [q, k, bias])
    for g in (dq, dk, dbias):
        assert g.isfinite().all()
    assert torch.equal(dq[0, 0, 1], torch.zeros(4, dtype=torch.float64))
    assert torch.equal(dbias[1], torch.zeros(5, dtype=torch.float64))


def test_chunked_rescues_values_that_would_overflow_the_lazy_offset() -> None:
    # |v| ~ 1e22 and a logit 40 above the first key block's in a later block: exp(40) * 1e22
    # overflows float32 unless the block is redone with the textbook rescaling.
    q = torch.ones(1, 1, 2, 1)
    k = torch.zeros(1, 1, 16, 1)
    k[..., 8:, :] = 40.0
    v = torch.full((1, 1, 16, 3), 1e22)
    got = attention(q, k, v, scale=1.0, backend=blocked("chunked", 2, 8))
    want = attention(q.double(), k.double(), v.double(), scale=1.0, backend="reference")
    assert got.isfinite().all()
    assert_close(got.double() / 1e22, want / 1e22, dtype=torch.float32)


@pytest.mark.usefixtures("no_shape_checks")
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bias": torch.full((4, 6), float("inf"))}, "bias holds +inf: a bias may hold -inf"),
        ({"bias": torch.full((4, 6), float("nan"))}, "bias holds NaN: a bias may hold -inf"),
        ({"scale": 1e300}, "scale must be finite and at most 3.4e+38 in magnitude"),
        ({"scale": -math.inf}, "scale must be finite and at most 3.4e+38 in magnitude"),
    ],
)
def test_bad_bias_and_scale_values(kwargs: dict[str, object], message: str) -> None:
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match=re.escape(message)):
        attention(q, k, k, **kwargs)  # type: ignore[arg-type]
    # float64 takes a scale beyond float32's range.
    attention(q.double(), k.double(), k.double(), scale=1e300)


def test_training_with_nan_padding_does_not_go_through_sdpa() -> None:
    x = spoil_padding(padded_call(), float("nan"))
    q = x["q"].requires_grad_()
    report = str(attnkit.explain(q, x["k"], x["v"], mask=x["pad"]))
    assert "auto picks: chunked" in report  # explain() decides from what attention() sees
    with pytest.raises(attnkit.BackendError, match="hold NaN/inf and gradients are needed"):
        attention(q, x["k"], x["v"], mask=x["pad"], backend="sdpa")
    out = attention(q, x["k"], x["v"], mask=x["pad"])  # auto: the chunked kernel
    (dq,) = torch.autograd.grad(out.sum(), [q])
    assert dq.isfinite().all()


@pytest.mark.parametrize("module", ["multihead", "relative"])
def test_modules_keep_padding_garbage_out(module: str) -> None:
    torch.manual_seed(0)
    m = (
        attnkit.MultiHeadAttention(16, 2, dtype=torch.float64)
        if module == "multihead"
        else attnkit.RelativeMultiHeadAttention(16, 2, dtype=torch.float64)
    )
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    dirty = x.clone()
    dirty[1, 4:] = float("nan")  # row 1 has 4 real frames
    pad = masks.key_padding([7, 4])
    with torch.no_grad():
        want = m(x, mask=pad)
        got = m(dirty, mask=pad)
    assert_close(got[0], want[0])
    assert_close(got[1, :4], want[1, :4])
    assert got[1, 4:].isnan().all()  # the padded queries themselves are garbage: they stay so


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("spoil", ["nan_query", "zero_values", "none"])
def test_sdpa_checks_big_outputs_in_either_layout(layout: str, spoil: str) -> None:
    # Outputs over 65536 elements take the fast screen (one matrix-vector product), in torch's
    # (B, T, H, D) layout as well as in (B, H, T, D). A NaN query must come out NaN in its row
    # only, and values that are zero for one batch row (a zero output no mask explains) must still
    # give what the reference gives, whichever layout the inputs have.
    g = torch.Generator().manual_seed(0)
    shape = (2, 300, 4, 64) if layout == "bthd" else (2, 4, 300, 64)
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    if layout == "bthd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if spoil == "nan_query":
        q[0, 1, 7, 3] = float("nan")
    elif spoil == "zero_values":
        v[1] = 0.0
    with torch.no_grad():
        out = attention(q, k, v, backend="sdpa")
        want = attention(q.double(), k.double(), v.double(), backend="reference")
    nan = torch.zeros(out.shape[:-1], dtype=torch.bool)
    if spoil == "nan_query":
        nan[0, 1, 7] = True
    assert torch.equal(out.isnan().any(-1), nan)
    assert_close(out.masked_fill(nan[..., None], 0), want.masked_fill(nan[..., None], 0))


def test_screen_of_big_outputs() -> None:
    from attnkit.backends.sdpa.screen import screened, trustworthy

    out = torch.randn(2, 4, 300, 64)
    assert screened(out)
    assert screened(out.transpose(1, 2).contiguous().transpose(1, 2))
    for value in (float("nan"), float("inf"), 0.0):
        bad = out.clone()
        bad[1, 2, 5] = value
        assert not screened(bad)
        assert not trustworthy(bad, None)
    # A row orthogonal to the screen's weights is a false alarm: the exact test still trusts it.
    w = torch.rand(64, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.5
    w = w * torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0).double()
    odd = out.double()
    odd[1, 2, 5] = 0.0
    odd[1, 2, 5, 0], odd[1, 2, 5, 1] = w[1], -w[0]  # dot product w[0] w[1] - w[1] w[0] = 0
    assert not screened(odd)
    assert trustworthy(odd, None)
