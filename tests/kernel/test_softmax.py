"""The online softmax (``attnkit._kernel.softmax``): its forward and backward against the formula
in float64, directly and through ``Chunked`` with small blocks; ``merge``, ``finish``,
``sink_grad`` and ``delta_of``; exactness at every score level (the zero offset, base 2, the
overflow guard); and the one rule for a query with no visible key."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from attnkit import attention, masks
from attnkit._kernel import (
    Problem,
    backward,
    delta_of,
    finish,
    forward,
    make_plan,
    merge,
    sink_grad,
)
from attnkit.backends import Chunked
from attnkit.masks import Geometry, Mask, visibility
from attnkit.testing import assert_close

CPU = torch.device("cpu")


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float64) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def formula(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    visible: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Output and log-sum-exp ``(N, H, Tq)`` (sinks included), in float64, from the definition:
    grouped key heads repeated, masked pairs out of the softmax, an empty row gives 0 and -inf."""
    g = q.size(1) // k.size(1)
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ kk.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    with_sinks = (
        s if sinks is None else torch.cat([s, sinks[:, None, None].expand(*s.shape[:-1], 1)], -1)
    )
    lse = torch.logsumexp(with_sinks, -1)
    w = torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0).unsqueeze(-1))
    return w @ vv, lse


def problem(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    mask: Mask | None = None,
    softcap: float | None = None,
    block: tuple[int, int] = (4, 4),
) -> Problem:
    """The kernel's problem for ``(N, H, T, D)`` tensors: queries ``(N, Hkv, G, Tq, Dk)``, keys and
    values ``(N * Hkv, Tk, D)``, the plan cut in blocks of ``block``."""
    n, h, tq, dk = q.shape
    hkv, tk = k.shape[1:3]
    geo = Geometry((n,), h, tq, tk, q.device)
    plan = make_plan(
        mask, geo, q_start=0, q_len=tq, k_start=0, kv_len=tk, block_q=block[0], block_k=block[1]
    )
    return Problem(
        q5=q.view(n, hkv, h // hkv, tq, dk),
        k3=k.reshape(n * hkv, tk, dk),
        v3=v.reshape(n * hkv, tk, v.size(-1)),
        scale=scale,
        plan=plan,
        geo=geo,
        mask=mask,
        softcap=softcap,
    )


CASES = [
    pytest.param({}, id="plain"),
    pytest.param({"mask": masks.causal()}, id="causal"),
    pytest.param({"mask": masks.sliding_window(3, right=2)}, id="window"),
    pytest.param({"mask": masks.documents([4, 9, 4])}, id="documents"),
    pytest.param({"mask": masks.causal(), "softcap": 2.5}, id="causal-softcap"),
]


@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_of_a_problem_equal_the_formula(case: dict[str, object]) -> None:
    # Grouped-query attention (4 query heads, 2 key heads), Dv != Dk, blocks of 4 x 4 over 17 keys.
    mask = case.get("mask")
    softcap = case.get("softcap")
    assert mask is None or isinstance(mask, Mask)
    assert softcap is None or isinstance(softcap, float)
    q, k, v = randn(2, 4, 17, 8, seed=1), randn(2, 2, 17, 8, seed=2), randn(2, 2, 17, 5, seed=3)
    dout = randn(2, 4, 17, 5, seed=4)
    scale = 0.4
    p = problem(q, k, v, scale, mask, softcap)
    out5, lse5 = forward(p)
    out, lse = out5.flatten(1, 2), lse5.flatten(1, 2)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    geo = Geometry((2,), 4, 17, 17, CPU)
    visible = None if mask is None else mask.tile(geo, 0, 17, 0, 17).expand(2, 4, 17, 17)
    want, want_lse = formula(*leaves, scale, visible, softcap)
    assert_close(out, want)
    assert_close(lse, want_lse)

    dout5 = dout.view(out5.shape)
    grads = backward(p, out5, lse5, delta_of(out5, dout5), dout5, bias_grad=False, term_grads=False)
    want_grads = torch.autograd.grad(want, leaves, dout)
    assert_close(grads.dq.flatten(1, 2), want_grads[0])
    assert_close(grads.dk.view(k.shape), want_grads[1])
    assert_close(grads.dv.view(v.shape), want_grads[2])


@pytest.mark.parametrize(
    "mask", [None, masks.causal(), masks.sliding_window(2) | masks.documents([5, 6])]
)
def test_through_chunked_with_small_blocks_equals_the_reference(mask: Mask | None) -> None:
    q, k, v = randn(1, 4, 11, 6, seed=5), randn(1, 2, 11, 6, seed=6), randn(1, 2, 11, 6, seed=7)
    bias, sinks = randn(11, 11, seed=8), randn(4, seed=9)
    dout = randn(1, 4, 11, 6, seed=10)
    small = Chunked(block_q=3, block_k=4, fused_rows=None)

    def run(backend: object) -> list[Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias, sinks)]
        qq, kk, vv, b, s = leaves
        out = attention(qq, kk, vv, mask=mask, bias=b, sinks=s, softcap=4.0, backend=backend)
        assert isinstance(out, Tensor)
        return [out, *torch.autograd.grad(out, leaves, dout)]

    for got, want in zip(run(small), run("reference"), strict=True):
        assert_close(got, want)


def test_merge_of_two_parts_is_the_softmax_of_the_whole_row() -> None:
    s, v = randn(3, 10, seed=11), randn(3, 10, 4, seed=12)
    s[1, :6] = -math.inf  # row 1 sees none of the first part's keys
    s[2] = -math.inf  # row 2 sees no key at all

    def part(lo: int, hi: int) -> tuple[Tensor, Tensor]:
        lse = torch.logsumexp(s[:, lo:hi], -1)
        w = torch.exp(s[:, lo:hi] - lse.masked_fill(lse == -math.inf, 0.0).unsqueeze(-1))
        return (w.unsqueeze(1) @ v[:, lo:hi]).squeeze(1), lse

    out, lse = part(0, 6)
    merge(out, lse, *part(6, 10))
    want, want_lse = part(0, 10)
    assert_close(out, want)
    assert torch.equal(lse[2], torch.tensor(-math.inf, dtype=torch.float64))
    assert_close(lse[:2], want_lse[:2])
    assert torch.equal(out[2], torch.zeros(4, dtype=torch.float64))  # no NaN from -inf - -inf


def test_finish_folds_the_sinks_into_the_denominator() -> None:
    q, k, v = randn(1, 4, 6, 8, seed=13), randn(1, 2, 6, 8, seed=14), randn(1, 2, 6, 3, seed=15)
    sinks = randn(4, seed=16)
    visible = torch.ones(6, 6, dtype=torch.bool).tril()
    visible[2] = False  # a query with no key: stays 0 with a sink
    plain, plain_lse = formula(q, k, v, 0.5, visible)
    out, lse = finish(
        plain.view(1, 2, 2, 6, 3).clone(), plain_lse.view(1, 2, 2, 6), sinks.view(2, 2)
    )
    want, want_lse = formula(q, k, v, 0.5, visible, sinks=sinks)
    assert_close(out.flatten(1, 2), want)
    assert_close(lse.flatten(1, 2), want_lse)
    assert torch.equal(out[:, :, :, 2], torch.zeros(1, 2, 2, 3, dtype=torch.float64))
    same, same_lse = finish(plain, plain_lse, None)
    assert same is plain
    assert same_lse is plain_lse


def test_sink_grad_is_autograd_of_the_formula() -> None:
    q, k, v = randn(2, 4, 5, 8, seed=17), randn(2, 2, 5, 8, seed=18), randn(2, 2, 5, 3, seed=19)
    sinks, dout = randn(4, seed=20).requires_grad_(), randn(2, 4, 5, 3, seed=21)
    out, lse = formula(q, k, v, 0.3, sinks=sinks)
    (want,) = torch.autograd.grad(out, sinks, dout)
    delta = (dout * out).sum(-1).detach()
    got = sink_grad(
        lse.detach().view(2, 2, 2, 5), delta.view(2, 2, 2, 5), sinks.detach().view(2, 2)
    )
    assert_close(got.flatten(), want)


def test_delta_of_is_the_row_sum_of_dout_times_out_in_the_outputs_dtype() -> None:
    out, dout = randn(2, 1, 3, 4, 5, seed=22, dtype=torch.float32), randn(2, 1, 3, 4, 5, seed=23)
    got = delta_of(out, dout.half())
    assert got.dtype == torch.float32
    assert got.shape == (2, 1, 3, 4)
    want = (dout.half().double() * out.double()).sum(-1)
    assert_close(got, want)


# Scores near these levels (natural units) take each of the forward's and backward's ways: within
# 2^+-32 in base 2 (about 22 in natural units) the offset is 0, beyond it per-row offsets.
LEVELS = [-200.0, -22.0, -21.0, 0.0, 21.0, 23.0, 200.0, 700.0]


@pytest.mark.parametrize("level", LEVELS)
def test_every_score_level_is_exact_in_float64(level: float) -> None:
    # float64 leaves nothing to rounding but reassociation: the base-2 scores, the zero offset and
    # the exp(-lse) folded into dO must give the formula to 1e-10, output, log-sum-exp and grads.
    q, k, v = randn(1, 2, 12, 4, seed=24), randn(1, 2, 12, 4, seed=25), randn(1, 2, 12, 3, seed=26)
    q = torch.cat([q, torch.ones(1, 2, 12, 1, dtype=torch.float64)], -1)
    k = torch.cat(
        [k, torch.full((1, 2, 12, 1), level, dtype=torch.float64)], -1
    )  # every score +level
    dout = randn(1, 2, 12, 3, seed=27)
    p = problem(q, k, v, 1.0, masks.causal(), block=(4, 3))
    out5, lse5 = forward(p)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want, want_lse = formula(*leaves, 1.0, torch.ones(12, 12, dtype=torch.bool).tril())
    assert_close(out5.flatten(1, 2), want)
    assert_close(lse5.flatten(1, 2), want_lse)  # natural units, though computed in base 2
    grads = backward(
        p,
        out5,
        lse5,
        delta_of(out5, dout.view(out5.shape)),
        dout.view(out5.shape),
        bias_grad=False,
        term_grads=False,
    )
    want_grads = torch.autograd.grad(want, leaves, dout)
    assert_close(grads.dq.flatten(1, 2), want_grads[0], conditioning=max(1.0, abs(level)))
    assert_close(grads.dk.view(k.shape), want_grads[1], conditioning=max(1.0, abs(level)))
    assert_close(grads.dv.view(v.shape), want_grads[2])


def test_scores_far_above_the_first_blocks_take_the_guarded_path() -> None:
    # The first key block's scores are about 0, so the offset is taken as 0; a later block's are
    # 100 higher, 2^144 in float32 overflows to inf: the guard must redo the query block with
    # rescaling, and the result equal the formula.
    q = torch.ones(1, 1, 4, 1)
    k = torch.cat([torch.zeros(4), torch.full((4,), 100.0)]).view(1, 1, 8, 1)
    k = k + randn(1, 1, 8, 1, seed=28, dtype=torch.float32) * 0.1
    v = randn(1, 1, 8, 2, seed=29, dtype=torch.float32)
    out5, lse5 = forward(problem(q, k, v, 1.0, block=(4, 4)))
    want, want_lse = formula(q.double(), k.double(), v.double(), 1.0)
    assert bool(out5.isfinite().all())
    assert_close(out5.flatten(1, 2), want, dtype=torch.float32)
    assert_close(lse5.flatten(1, 2), want_lse, dtype=torch.float32)


def test_a_query_with_no_visible_key_gives_zero_and_minus_inf_with_zero_gradients() -> None:
    q, k, v = randn(1, 2, 7, 4, seed=30), randn(1, 2, 9, 4, seed=31), randn(1, 2, 9, 3, seed=32)
    visible = torch.rand(1, 2, 7, 9, generator=torch.Generator().manual_seed(33)) < 0.6
    visible[0, 0, 1] = False
    visible[0, :, 5] = False
    visible[0, 1, :, 4:] = False
    mask = visibility(visible, False)
    assert mask is not None
    dout = randn(1, 2, 7, 3, seed=34)
    p = problem(q, k, v, 0.5, mask, block=(2, 4))
    out5, lse5 = forward(p)
    out, lse = out5.flatten(1, 2), lse5.flatten(1, 2)
    empty = ~visible.any(-1)
    assert bool(empty.any())
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert bool((lse[empty] == -math.inf).all())
    assert bool(lse[~empty].isfinite().all())
    grads = backward(
        p,
        out5,
        lse5,
        delta_of(out5, dout.view(out5.shape)),
        dout.view(out5.shape),
        bias_grad=False,
        term_grads=False,
    )
    dq = grads.dq.flatten(1, 2)
    assert bool(dq.isfinite().all())
    assert torch.equal(dq[empty], torch.zeros_like(dq[empty]))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want, _ = formula(*leaves, 0.5, visible)
    want_grads = torch.autograd.grad(want, leaves, dout)
    assert_close(out, want)
    assert_close(dq, want_grads[0])
    assert_close(grads.dk.view(k.shape), want_grads[1])
    assert_close(grads.dv.view(v.shape), want_grads[2])
