"""The reference backend against the formula written out independently here, in float64:
``softmax(q k^T * scale (softcapped) + bias, masked, with sinks) v`` with grouped-query heads,
dropout drawn from torch's generator, the weights, and the non-finite policy."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import attention, masks
from attnkit._call import check_attention_args
from attnkit.backends import Reference
from attnkit.testing import assert_close


def randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def formula(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    visible: Tensor | None = None,
    bias: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Output and weights ``(B, H, Tq, Tk)``: key heads repeated for their query heads, a sink is
    one more logit per row with nothing to attend, a row with no visible key has weights 0."""
    g = q.size(-3) // k.size(-3)
    k, v = k.repeat_interleave(g, -3), v.repeat_interleave(g, -3)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if visible is not None:
        s = torch.where(visible, s, -math.inf)
    top = s.amax(-1, keepdim=True)
    if sinks is not None:
        top = torch.maximum(top, sinks[:, None, None])
    top = torch.where(top.isinf(), 0.0, top)
    e = torch.exp(s - top)
    denominator = e.sum(-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + torch.exp(sinks[:, None, None] - top)
    w = e / torch.where(denominator > 0, denominator, 1.0)  # an empty row: 0 / 1
    kept = F.dropout(w, dropout_p) if dropout_p else w
    return torch.einsum("bhqk,bhkd->bhqd", kept, v), w


def inputs(
    seed: int, b: int = 2, h: int = 4, hkv: int = 2, tq: int = 5, tk: int = 7
) -> list[Tensor]:
    return [
        randn(b, h, tq, 6, seed=seed),
        randn(b, hkv, tk, 6, seed=seed + 1),
        randn(b, hkv, tk, 3, seed=seed + 2),
    ]


def visible_of(seed: int, shape: tuple[int, ...]) -> Tensor:
    vis = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < 0.7
    vis[..., 1, :] = False  # a query with no visible key
    return vis


CASES = {
    "plain": {},
    "scale": {"scale": 0.9},
    "mask": {"mask": True},
    "bias": {"bias": True},
    "bias-minus-inf": {"bias": True, "minus_inf": True},
    "softcap": {"softcap": 1.5, "bias": True},
    "sinks": {"sinks": True, "mask": True},
    "everything": {"mask": True, "bias": True, "softcap": 2.0, "sinks": True, "scale": 0.7},
}


@pytest.mark.parametrize("name", CASES)
def test_equals_the_formula_with_its_weights_and_gradients(name: str) -> None:
    case = CASES[name]
    q, k, v = inputs(seed=1)
    scale = float(case.get("scale", 1 / math.sqrt(6)))  # type: ignore[arg-type]
    visible = visible_of(10, (2, 1, 5, 7)) if case.get("mask") else None
    bias = randn(4, 5, 7, seed=11) if case.get("bias") else None
    if bias is not None and case.get("minus_inf"):
        bias[0, 2, :3] = -math.inf  # -inf in a bias masks those pairs
        bias[1, 3] = -math.inf  # and may empty a row
    softcap = case.get("softcap")
    sinks = randn(4, seed=12) if case.get("sinks") else None
    dout = randn(2, 4, 5, 3, seed=13)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, weights = attention(
        *leaves,
        mask=visible,
        bias=bias,
        scale=scale,
        softcap=softcap,  # type: ignore[arg-type]
        sinks=sinks,
        return_weights=True,
        backend="reference",
    )
    want, want_w = formula(
        *leaves, scale=scale, visible=visible, bias=bias, softcap=softcap, sinks=sinks
    )  # type: ignore[arg-type]
    assert_close(out, want)
    assert_close(weights, want_w)
    got_grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    want_grads = torch.autograd.grad(want, leaves, dout)
    for got, expected in zip(got_grads, want_grads, strict=True):
        assert_close(got, expected)
    rows = weights.sum(-1)
    if sinks is None:  # every row with a visible key sums to 1; an empty one to 0
        assert_close(rows, (want_w > 0).any(-1).double())
    else:
        assert bool((rows < 1).all())  # the sink takes a share of every row


def test_causal_is_bottom_right() -> None:
    q, k, v = inputs(seed=2, tq=3, tk=6)
    out = attention(q, k, v, causal=True, backend="reference")
    visible = torch.arange(6) <= torch.arange(3).unsqueeze(-1) + 3  # query i sits at key i + 3
    want, _ = formula(q, k, v, scale=1 / math.sqrt(6), visible=visible)
    assert_close(out, want)


@pytest.mark.parametrize("p", [0.25, 0.6])
def test_dropout_drops_the_weights_drawn_from_torchs_generator(p: float) -> None:
    q, k, v = inputs(seed=3)
    torch.manual_seed(1234)
    got = attention(q, k, v, dropout_p=p, backend="reference")
    torch.manual_seed(1234)
    want, _ = formula(q, k, v, scale=1 / math.sqrt(6), dropout_p=p)
    assert_close(got, want)
    plain, _ = formula(q, k, v, scale=1 / math.sqrt(6))
    assert (got - plain).abs().max() > 0.1  # it did drop something
    torch.manual_seed(99)
    assert (attention(q, k, v, dropout_p=p, backend="reference") - got).abs().max() > 0  # the seed


def test_weights_are_before_dropout() -> None:
    q, k, v = inputs(seed=4)
    torch.manual_seed(0)
    _, weights = attention(q, k, v, dropout_p=0.5, return_weights=True, backend="reference")
    assert_close(weights, formula(q, k, v, scale=1 / math.sqrt(6))[1])


def test_non_finite_values_reach_exactly_the_outputs_that_see_them() -> None:
    q, k, v = inputs(seed=5, b=1, h=2, hkv=1, tq=4, tk=6)
    v[0, 0, 5, 1] = math.nan  # key 5: hidden from every query but the last
    k[0, 0, 5] = math.nan
    visible = torch.ones(4, 6, dtype=torch.bool)
    visible[:3, 5] = False
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, mask=visible, backend="reference")
    assert isinstance(out, Tensor)
    assert bool(out[:, :, :3].isfinite().all())  # masked NaN never matters
    assert bool(out[:, :, 3].isnan().all())  # the last query sees a NaN score
    clean = [t.clone() for t in (q, k, v)]
    clean[1][0, 0, 5] = 0.0
    clean[2][0, 0, 5] = 0.0
    want, _ = formula(*clean, scale=1 / math.sqrt(6), visible=visible)
    assert_close(out[:, :, :3], want[:, :, :3])
    # Nor does it reach the gradients of the queries that do not see it.
    dq, _, _ = torch.autograd.grad(out[:, :, :3].sum(), leaves)
    assert bool(dq[:, :, :3].isfinite().all())


def test_cost_says_it_materialises_the_scores() -> None:
    q, k, v = inputs(seed=6)
    call = check_attention_args(q, k, v, mask=masks.causal(), bias=None, causal=False, scale=None)
    assert Reference().cost(call) == [
        "would materialise the scores (..., H, Tq, Tk) = (2, 4, 5, 7); auto takes it only when "
        "nothing else can"
    ]
    assert Reference().check(call) == []


def test_a_minus_inf_bias_hides_a_non_finite_value_as_a_mask_does() -> None:
    q, k, v = inputs(seed=7, b=1, h=2, hkv=2, tq=3, tk=4)
    v[0, 1, 2, 0] = math.inf
    bias = torch.zeros(3, 4, dtype=torch.float64)
    bias[:2, 2] = -math.inf  # only the last query sees key 2
    out = attention(q, k, v, bias=bias, backend="reference")
    assert isinstance(out, Tensor)
    assert bool(out[:, :, :2].isfinite().all())
    assert bool(out[0, 1, 2, 0].isnan())  # inf * weight, then NaN: a visible non-finite value
    assert bool(out[0, 0].isfinite().all())  # another head's values are finite


def test_a_nan_query_gives_weight_0_at_its_masked_pairs() -> None:
    # A masked pair influences no output (the weights included): a NaN query's weights are NaN
    # at the keys it sees, 0 at the others; the other rows are untouched.
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    q[0, 0, 1, 0] = float("nan")
    _, w = attention(q, k, k, causal=True, return_weights=True, backend="reference")
    assert w[0, 0, 1, :2].isnan().all()
    assert torch.equal(w[0, 0, 1, 2:], torch.zeros(2, dtype=torch.float64))
    clean = q.clone()
    clean[0, 0, 1] = 0.0
    _, want = attention(clean, k, k, causal=True, return_weights=True, backend="reference")
    assert torch.equal(w[0, 0, [0, 2, 3]], want[0, 0, [0, 2, 3]])
