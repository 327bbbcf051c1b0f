"""Promises at the edges of the modifiers: softcap over its whole range, masked garbage with every
modifier (softcap, sinks, bias, score terms), the values a sink or a score term may hold.

Each test is written as an adversarial user would: the documented promise, on every backend that
serves the call, compared with the float64 reference or with a property that needs no reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import attention, masks
from attnkit.scores import ScoreTerm
from attnkit.testing import assert_close

from .helpers import blocked

# The backends that serve every modifier with gradients; "small" is the kernel with blocks of 2x3,
# so that small inputs span partial, full and skipped blocks.
GRAD_BACKENDS = ["reference", "chunked", "small"]


def backend_of(name: str) -> str | attnkit.Backend:
    return blocked("chunked", 2, 3) if name == "small" else name


def randn(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------
# softcap: exact for every cap > 0


CAPS = [1e-300, 3e-39, 1e-30, 1e-3, 0.5, 1.0, 30.0, 50.0, 64.0, 100.0, 3000.0, 1e5, 1e12]
CAPS += [1e30, 1e39, 1e300]


@pytest.mark.parametrize("softcap", CAPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_softcap_matches_the_float64_reference_for_any_cap(
    softcap: float, dtype: torch.dtype, backend: str
) -> None:
    q, k, v = (randn(1, 2, 9, 8, seed=i).to(dtype) for i in range(3))
    cot = randn(1, 2, 9, 8, seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, causal=True, softcap=softcap, backend=backend_of(backend))
    grads = torch.autograd.grad(out, leaves, cot.to(dtype))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = attention(*exact, causal=True, softcap=softcap, backend="reference")
    want_grads = torch.autograd.grad(want, exact, cot)
    assert_close(out, want, dtype=dtype)
    for got, expected in zip(grads, want_grads, strict=True):
        assert_close(got, expected, dtype=dtype)


@pytest.mark.parametrize("softcap", [1e12, 1e30, 1e300])
def test_a_huge_softcap_is_no_cap(softcap: float) -> None:
    q, k, v = (randn(1, 2, 9, 8, seed=i) for i in range(3))
    want = attention(q, k, v, causal=True, backend="reference")
    assert_close(attention(q, k, v, causal=True, softcap=softcap, backend="reference"), want)


@pytest.mark.parametrize("softcap", [1e-30, 3e-39, 1e-300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_a_tiny_softcap_is_a_hard_limit(softcap: float, dtype: torch.dtype, backend: str) -> None:
    # Every capped score lies in [-softcap, softcap]: the weights are uniform over visible keys.
    q, k, v = (randn(1, 2, 9, 8, seed=i).to(dtype) for i in range(3))
    out = attention(q, k, v, causal=True, softcap=softcap, backend=backend_of(backend))
    mean = v.double().cumsum(-2) / torch.arange(1, 10, dtype=torch.float64)[:, None]
    assert_close(out, mean, dtype=dtype)


def test_softcap_refuses_what_is_not_a_positive_number() -> None:
    q = randn(1, 1, 3, 4)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"softcap must be a finite number > 0, got"):
            attention(q, q, q, softcap=bad)


# --------------------------------------------------------------------------------------------------
# Masked garbage never reaches a gradient, with every modifier


class Slopes(ScoreTerm):
    """An ALiBi-like term whose slopes receive gradients, with -inf at key ``hidden``: a term may
    mask a pair, as a -inf bias does."""

    def __init__(self, slopes: Tensor, hidden: int) -> None:
        self.slopes, self.hidden = slopes, hidden

    def inputs(self) -> tuple[Tensor, ...]:
        return (self.slopes,)

    def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
        (slopes,) = inputs
        out = -slopes[:, None, None] * (k_pos - q_pos).abs()  # (H, rows, keys)
        return out.masked_fill(k_pos == self.hidden, -math.inf)


MODIFIERS = ["softcap", "sinks", "bias", "term", "all"]


def modified_call(
    modifier: str, backend: str, garbage: float | None, empty_query: bool = False
) -> list[Tensor]:
    """Output and gradients (q, k, v, then the modifier's tensors) of a padded call with
    ``modifier``. ``garbage`` fills what the call masks: the padded keys and values of row 1, key 1
    (hidden by the -inf of the bias or the term), and with ``empty_query`` query 2 of row 0, which
    the mask leaves without a visible key."""
    b, h, tq, tk = 2, 2, 5, 7
    q, k, v = randn(b, h, tq, 8, seed=1), randn(b, 1, tk, 8, seed=2), randn(b, 1, tk, 4, seed=3)
    mask: Tensor | masks.Mask = masks.key_padding([7, 4])
    if empty_query:
        mask = torch.ones(b, 1, tq, tk, dtype=torch.bool)
        mask[0, :, 2] = False
        mask[1, :, :, 4:] = False
    extra: dict[str, object] = {}
    params: list[Tensor] = []
    if modifier in ("softcap", "all"):
        extra["softcap"] = 2.0
    if modifier in ("sinks", "all"):
        extra["sinks"] = sinks = randn(h, seed=4).requires_grad_()
        params.append(sinks)
    if modifier in ("bias", "all"):
        bias = randn(h, tq, tk, seed=5)
        bias[..., 1] = -math.inf
        extra["bias"] = bias = bias.requires_grad_()
        params.append(bias)
    if modifier == "term":
        slopes = attnkit.alibi_slopes(h).double().requires_grad_()
        extra["bias"] = Slopes(slopes, hidden=1)
        params.append(slopes)
    if garbage is not None:
        k, v = k.clone(), v.clone()
        k[1, :, 4:], v[1, :, 4:] = garbage, garbage
        if modifier in ("bias", "term", "all"):
            k[:, :, 1], v[:, :, 1] = garbage, garbage
        if empty_query:
            q = q.clone()
            q[0, :, 2] = garbage
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, mask=mask, backend=backend_of(backend), **extra)  # type: ignore[call-overload]
    cot = randn(*out.shape, seed=6)
    return [out, *torch.autograd.grad(out, [*leaves, *params], cot)]


@pytest.mark.parametrize("modifier", MODIFIERS)
@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("empty_query", [False, True])
@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_masked_garbage_reaches_no_gradient_with_any_modifier(
    modifier: str, garbage: float, empty_query: bool, backend: str
) -> None:
    clean = modified_call(modifier, backend, None, empty_query)
    dirty = modified_call(modifier, backend, garbage, empty_query)
    for name, got, want in zip(["out", "dq", "dk", "dv", "d1", "d2"], dirty, clean, strict=False):
        assert got.isfinite().all(), name
        # A masked pair's key or value gets gradient 0 in both; everything else is the clean one.
        assert_close(got, want)
    if empty_query:  # the query that sees nothing: output 0, gradient 0
        assert torch.equal(dirty[0][0, :, 2], torch.zeros_like(dirty[0][0, :, 2]))
        assert torch.equal(dirty[1][0, :, 2], torch.zeros_like(dirty[1][0, :, 2]))


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_issue_example_nan_padding_with_softcap(backend: str) -> None:
    q = randn(1, 1, 4, 8, seed=1).float().requires_grad_()
    k, v = randn(1, 1, 4, 8, seed=2).float(), randn(1, 1, 4, 8, seed=3).float()
    k[..., 3, :] = math.nan
    k.requires_grad_()
    out = attention(q, k, v, mask=masks.key_padding([3]), softcap=5.0, backend=backend_of(backend))
    dq, dk = torch.autograd.grad(out.sum(), [q, k])
    assert dq.isfinite().all() and dk.isfinite().all()
    assert torch.equal(dk[..., 3, :], torch.zeros_like(dk[..., 3, :]))


# --------------------------------------------------------------------------------------------------
# Sinks: a logit that may be -inf (no sink), never NaN or +inf


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("backend", ["auto", "reference", "chunked", "sdpa"])
def test_a_nan_or_infinite_sink_is_an_error(value: float, backend: str) -> None:
    q = randn(1, 2, 5, 8)
    sinks = torch.tensor([value, 0.0], dtype=torch.float64)
    what = "NaN" if math.isnan(value) else r"\+inf"
    with pytest.raises(ValueError, match=rf"sinks holds {what}: a sink may be -inf"):
        attention(q, q, q, sinks=sinks, backend=backend)


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_a_minus_inf_sink_is_no_sink_even_for_a_query_that_sees_nothing(backend: str) -> None:
    q, k, v = (randn(1, 2, 5, 8, seed=i) for i in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask[2] = False  # query 2 sees nothing
    sinks = torch.tensor([-math.inf, 0.5], dtype=torch.float64, requires_grad=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, mask=mask, sinks=sinks, backend=backend_of(backend))
    want = attention(q, k, v, mask=mask, backend="reference")
    assert_close(out[0, 0], want[0, 0])  # head 0: no sink
    assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2]))
    grads = torch.autograd.grad(out.sum(), [*leaves, sinks])
    for g in grads:
        assert g.isfinite().all()
    assert grads[-1][0] == 0.0  # a sink of weight 0 everywhere has gradient 0


# --------------------------------------------------------------------------------------------------
# Score terms: finite or -inf, never NaN or +inf


class Broken(ScoreTerm):
    """A term whose tiles hold ``value`` at the pair (query 3, key 2), whatever its inputs."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.slopes = torch.ones(2, dtype=torch.float64)

    def inputs(self) -> tuple[Tensor, ...]:
        return (self.slopes,)

    def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
        (slopes,) = inputs
        spot = (q_pos == 3) & (k_pos == 2)
        return (slopes[:, None, None] * 0.1 * (k_pos - q_pos)).masked_fill(spot, self.value)


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("backend", ["auto", "reference", "chunked", "small", "sdpa"])
def test_a_term_holding_nan_or_plus_inf_is_an_error(value: float, backend: str) -> None:
    q = randn(1, 2, 6, 8)
    with torch.no_grad(), pytest.raises(ValueError, match=r"bias: Broken\.tile\(\) returned"):
        attention(q, q, q, bias=Broken(value), backend=backend_of(backend))


@pytest.mark.parametrize("backend", ["reference", "chunked", "small"])
def test_a_term_is_checked_with_gradients_too(backend: str) -> None:
    q = randn(1, 2, 6, 8).requires_grad_()
    with pytest.raises(ValueError, match=r"bias: Broken\.tile\(\) returned NaN"):
        attention(q, q, q, bias=Broken(math.nan), causal=True, backend=backend_of(backend))


@pytest.mark.parametrize("backend", ["reference", "chunked", "small"])
def test_a_term_may_hide_its_broken_pair_behind_the_mask(backend: str) -> None:
    # Key 2 is masked for query 3: what the term holds there never matters.
    q = randn(1, 2, 6, 8)
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[3, 2] = False
    got = attention(q, q, q, bias=Broken(math.nan), mask=mask, backend=backend_of(backend))
    want = attention(q, q, q, bias=Broken(0.0), mask=mask, backend="reference")
    assert_close(got, want)


@pytest.mark.parametrize("backend", ["reference", "chunked", "small"])
def test_a_term_with_nan_inputs_spoils_what_they_reach(backend: str) -> None:
    # A NaN in a term's input is a NaN in the call's inputs (rule 2), not a broken term.
    q = randn(1, 2, 6, 8)
    slopes = torch.tensor([math.nan, 0.5], dtype=torch.float64)
    out = attention(q, q, q, bias=Slopes(slopes, hidden=-1), backend=backend_of(backend))
    assert out[:, 0].isnan().all()
    assert_close(out[:, 1], attention(q, q, q, bias=Slopes(slopes.nan_to_num(), -1))[:, 1])


@pytest.mark.parametrize("backend", ["reference", "chunked", "small"])
def test_a_minus_inf_term_masks_that_pair(backend: str) -> None:
    q, k, v = (randn(1, 2, 6, 8, seed=i) for i in range(3))
    slopes = attnkit.alibi_slopes(2).double()
    got = attention(q, k, v, bias=Slopes(slopes, hidden=4), backend=backend_of(backend))
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[:, 4] = False
    want = attention(q, k, v, bias=Slopes(slopes, hidden=-1), mask=mask, backend="reference")
    assert_close(got, want)
