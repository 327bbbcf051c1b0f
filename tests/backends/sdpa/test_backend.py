"""The sdpa backend's adapter: attnkit's conventions on top of torch's kernel (bottom-right
causal, one query seeing every key), the reasons it gives in ``check`` and ``cost``, its
constructor, and dropout drawn by torch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit import attention, masks
from attnkit.backends import SDPA
from attnkit.backends.sdpa import sdpa_check, sdpa_cost
from attnkit.scores import RelativePositionTerm
from attnkit.testing import assert_close

from .helpers import call_of, randn, reference

# --------------------------------------------------------------------------------------------------
# Conventions


def test_causal_is_bottom_right_where_torch_is_top_left() -> None:
    q, k, v = randn(1, 2, 3, 8, seed=1), randn(1, 2, 7, 8, seed=2), randn(1, 2, 7, 4, seed=3)
    ours = attention(q, k, v, causal=True, backend="sdpa")
    assert_close(ours, reference(q, k, v, causal=True))
    torch_top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (ours - torch_top_left).abs().max() > 0.1  # the conventions differ when Tq != Tk
    top_left = attention(q, k, v, mask=masks.causal(align="top_left"), backend="sdpa")
    assert_close(top_left, torch_top_left.double())
    # Tq == Tk: the two agree, and torch's is_causal serves the call without a mask.
    square = attention(q, q, q, causal=True, backend="sdpa")
    assert_close(square, F.scaled_dot_product_attention(q, q, q, is_causal=True).double())


def test_one_query_causal_sees_every_key() -> None:
    q, k, v = randn(2, 2, 1, 8, seed=4), randn(2, 2, 9, 8, seed=5), randn(2, 2, 9, 8, seed=6)
    got = attention(q, k, v, causal=True, backend="sdpa")
    assert_close(got, F.scaled_dot_product_attention(q, k, v).double())


# --------------------------------------------------------------------------------------------------
# What it says about a call


def test_check_gives_each_reason_it_cannot_serve() -> None:
    q = randn(1, 2, 4, 8, seed=16)
    assert sdpa_check(call_of(q, q, q, causal=True, bias=torch.zeros(4, 4))) == []
    assert sdpa_check(call_of(q, q, q, return_weights=True, softcap=3.0, sinks=torch.zeros(2))) == [
        "does not return attention weights (only reference does)",
        "torch's kernel has no softcap",
        "torch's kernel has no sinks",
    ]
    term = RelativePositionTerm(
        randn(1, 2, 4, 8, seed=17).requires_grad_(), randn(1, 7, 8, seed=18), 1.0
    )
    (reason,) = sdpa_check(call_of(q, q, q, bias=term))
    assert reason.startswith("serves a score term only without gradients")
    half = q.half()
    half_term = RelativePositionTerm(half, randn(1, 7, 8, seed=18).half(), 1.0)
    (reason,) = sdpa_check(call_of(half, half, half, bias=half_term))
    assert (
        reason
        == "its float mask would round the score term to float16; chunked keeps it in float32"
    )
    bad = q.clone()
    bad[0, 0, 0, 0] = math.nan
    bad.requires_grad_()
    (reason,) = sdpa_check(call_of(bad, q, q, check_finite=True))
    assert reason == (
        "q, k or v hold NaN/inf and gradients are needed: torch's backward would let masked ones "
        "into the gradients"
    )


def test_cost_says_what_it_would_materialise() -> None:
    q, k = randn(1, 2, 3, 8, seed=19), randn(1, 2, 5, 8, seed=20)
    assert sdpa_cost(call_of(q, k, k, causal=True)) == [
        "would materialise a (Tq, Tk) = (3, 5) causal mask: Tq != Tk (3 != 5) and torch's "
        "is_causal is top-left aligned"
    ]
    assert sdpa_cost(call_of(q, q, q, causal=True, bias=torch.zeros(3, 3))) == [
        "would materialise a (Tq, Tk) = (3, 3) causal mask: torch does not take is_causal "
        "together with a mask or bias"
    ]
    bias = torch.zeros(3, 5, requires_grad=True)
    assert sdpa_cost(call_of(q, k, k, bias=bias)) == [
        "would keep the probabilities (..., H, Tq, Tk) = (1, 2, 3, 5) for the backward: torch "
        "computes a bias gradient only in its math kernel"
    ]
    # Nothing to write out: no mask, a causal square call, key padding, a tensor given as is.
    assert sdpa_cost(call_of(q, q, q)) == []
    assert sdpa_cost(call_of(q, q, q, causal=True)) == []
    assert sdpa_cost(call_of(q, k, k, mask=masks.key_padding([4]))) == []
    assert sdpa_cost(call_of(q, k, k, mask=torch.ones(3, 5, dtype=torch.bool))) == []


def test_repr_and_constructor_checks(no_shape_checks: None) -> None:
    assert repr(SDPA(block_q=64, product_q=16)) == "SDPA(block_q=64, product_q=16)"
    with pytest.raises(ValueError, match="block_q must be >= 1, got 0"):
        SDPA(block_q=0)
    with pytest.raises(TypeError, match=r"term_keys must be an int, got 2\.5"):
        SDPA(term_keys=2.5)  # type: ignore[arg-type]
    assert isinstance(attnkit.backends.SDPA(), attnkit.Backend)


def test_dropout_is_unbiased_and_a_fully_dropped_row_is_not_redrawn() -> None:
    # Query 0 of a causal call sees key 0 only: with dropout 0.5 its output is 2 * v0 or 0, each
    # with probability 1/2. Redrawing the rows that came out 0 (as if torch had hidden a NaN)
    # would bias the mean towards 2 * v0.
    torch.manual_seed(0)
    b, t = 4000, 6
    q = torch.randn(b, 1, t, 4)
    k = torch.randn(b, 1, t, 4)
    v = torch.ones(b, 1, t, 4)
    sdpa = attnkit.backends.SDPA()
    out = attnkit.attention(q, k, v, causal=True, dropout_p=0.5, backend=sdpa)
    assert sdpa.handovers == 0
    mean = float(out[:, 0, 0].mean())
    assert abs(mean - 1.0) < 0.1, mean  # std of the mean: 1 / sqrt(4000) = 0.016
