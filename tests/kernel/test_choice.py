"""Which kernel serves a call: the native kernel's decode path for an inference call of few
queries (one visit where nothing could be skipped), its blocked forward, or the eager kernel, and
the plan each one runs with."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from attnkit import attention, masks
from attnkit._call import AttentionCall, describe_call
from attnkit._kernel import call as call_module
from attnkit._kernel import choice as choice_module
from attnkit.backends import Chunked
from attnkit.masks import Mask
from attnkit.testing import assert_close


def qkv(seed: int = 0, t: int = 40) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, t, 8, generator=g, dtype=torch.float64) for _ in range(3)]


DECODE_MASKS = {
    "none": (None, True),
    "causal": (masks.causal(), True),
    "window": (masks.sliding_window(300, 0), True),
    "top-left causal": (masks.causal(align="top_left"), True),
    "padding": (masks.key_padding([700, 90]), False),
    "tiles": (masks.from_fn(lambda b, h, i, j: j % 3 != 0), False),
}


@pytest.mark.parametrize("name", list(DECODE_MASKS))
def test_a_decode_step_runs_one_visit_where_nothing_could_be_skipped(name: str) -> None:
    """An inference decode step on the native kernel reads its keys in one visit under no mask
    or a band (a band still cut at its edges), and keeps the default blocks, whose empty ones it
    skips, under any other mask. Either way the result is the reference's, and the backend's
    block_plan is the plan the call runs with."""
    if not choice_module.native_serves(torch.device("cpu"), None, False, True):
        pytest.skip("the native kernel is not available")
    mask, one_block = DECODE_MASKS[name]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 1000, 8, generator=g, dtype=torch.float64) for _ in range(2))
    with torch.inference_mode():
        spec, _, _ = call_module.plan_call(q, k, v, mask=mask, bias=None, scale=0.3)
        out = attention(q, k, v, mask=mask, scale=0.3, backend="chunked")
    plan = spec.plan
    assert spec.unchecked
    assert (plan.block_k == 1000) == one_block
    if one_block:  # a few visits whatever the cache's length, cut at the band's edges
        assert plan.num_visits <= 3
        first, last = int(plan.visits[0, 0]), int(plan.visits[-1, 1])
        seen = {"none": (0, 1000), "causal": (0, 1000), "window": (699, 1000)}
        lo, hi = seen.get(name, (0, 1))  # top-left: the one query is at key 0
        assert lo - 16 < first <= lo
        assert last == hi or (name == "top-left causal" and last <= 16)
    assert_close(out, attention(q, k, v, mask=mask, scale=0.3, backend="reference"))
    call = _inference_call(q, k, v, mask)
    assert Chunked().block_plan(call).block_k == plan.block_k


@pytest.mark.parametrize(("tq", "block_q"), [(1, None), (16, None), (17, None), (8, 4), (4, 4)])
def test_the_backend_and_the_call_agree_on_the_decode_path(tq: int, block_q: int | None) -> None:
    """The decode path takes at most one block of queries and at most its few rows: the plan the
    backend reports and the plan the call runs with are both one visit there, default blocks
    elsewhere."""
    if not choice_module.native_serves(torch.device("cpu"), None, False, True):
        pytest.skip("the native kernel is not available")
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, tq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 1000, 8, generator=g, dtype=torch.float64) for _ in range(2))
    decode = choice_module.decode_sized(tq, block_q)
    assert decode == (tq <= 16 and tq <= (block_q or tq))
    with torch.inference_mode():
        spec, _, _ = call_module.plan_call(
            q, k, v, mask=None, bias=None, scale=0.3, block_q=block_q
        )
    reported = Chunked(block_q=block_q).block_plan(_inference_call(q, k, v, None))
    assert (reported.block_k == 1000) == decode
    assert spec.unchecked == decode
    if decode:
        assert spec.plan.block_k == reported.block_k


def _inference_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask | None
) -> AttentionCall:
    with torch.inference_mode():
        return describe_call(q, k, v, mask=mask, bias=None, causal=False)


def test_a_call_with_gradients_keeps_the_default_blocks() -> None:
    """The one-visit plan is the decode path's alone: a decode step that records a graph (its
    backward runs on blocks) plans with the default key blocks."""
    q, k, v = (t.requires_grad_() for t in qkv(t=600))
    spec, _, _ = call_module.plan_call(q[:, :, :1], k, v, mask=None, bias=None, scale=0.3)
    assert spec.plan.block_k < 600


def test_a_call_with_nan_runs_the_eager_kernel_and_says_why() -> None:
    serves = choice_module.native_serves(torch.device("cpu"), None, False, True)
    q, k, v = (t.requires_grad_() for t in qkv(t=50))
    spec, _, _ = call_module.plan_call(q, k, v, mask=masks.causal(), bias=None, scale=0.3)
    assert (spec.kernel == "native kernel") == serves
    assert (spec.native is not None) == serves
    assert (spec.plan.band is not None) == serves  # the native kernel's cut: a band
    bad = q.detach().clone()
    bad[0, 0, 3, 1] = float("nan")
    spec, _, _ = call_module.plan_call(
        bad.requires_grad_(), k, v, mask=masks.causal(), bias=None, scale=0.3
    )
    assert spec.careful
    assert spec.native is None
    assert spec.plan.band is None  # the eager kernel's plan: the grid's own visits
    if serves:
        assert spec.kernel == "the eager kernel (non-finite values in q/k/v)"


@pytest.mark.parametrize("name", list(DECODE_MASKS))
@pytest.mark.parametrize("tq", [1, 4])
def test_a_quantized_call_is_planned_as_choose_plans_it(name: str, tq: int) -> None:
    """int8 keys and values read in place: the plan quantized_decode finds, which plan_call
    then takes rather than deciding again, is the one choose gives the same call, and the
    output is that of the keys and values dequantized first (float64 reference)."""
    if not choice_module.native_serves(torch.device("cpu"), None, False, True):
        pytest.skip("native kernel unavailable")
    mask = DECODE_MASKS[name][0]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, tq, 16, generator=g)
    k8, v8 = (torch.randint(-127, 128, (2, 2, 700, 16), generator=g).to(torch.int8) for _ in "kv")
    ks, vs = (torch.rand(2, 2, 700, 1, generator=g) / 50 for _ in "kv")
    geo = masks.Geometry((2,), 4, tq, 700, q.device)
    asked: dict[str, Any] = dict(
        mask=mask, geo=geo, term=None, block_q=None, block_k=None, native=True
    )
    why, plan = choice_module.quantized_decode(
        q, groups=2, score_mod=False, wants_grads=False, **asked
    )
    assert why is None
    assert plan is not None
    chosen, given = (
        choice_module.choose(
            q,
            k8,
            v8,
            term_inputs=(),
            is_finite=None,
            score_mod=False,
            wants_grads=False,
            plain=True,
            scale=0.25,
            decode=decode,
            **asked,
        )
        for decode in (None, plan)
    )
    assert _fields(chosen) == _fields(given)
    assert _fields(chosen.plan) == _fields(plan)
    with torch.no_grad():
        got = attention(q, k8, v8, mask=mask, k_scale=ks, v_scale=vs, backend="chunked")
        want = attention(
            q.double(), k8.double() * ks.double(), v8.double() * vs.double(), mask=mask,
            backend="reference",
        )  # fmt: skip
    assert_close(got, want)


def _fields(obj: object) -> list[object]:
    """A dataclass's fields, tensors as lists (a plan's tiles are made anew for each call)."""
    return [
        v.tolist() if isinstance(v, torch.Tensor) else repr(v) if hasattr(v, "offsets") else v
        for v in (getattr(obj, f.name) for f in dataclasses.fields(obj))  # type: ignore[arg-type]
    ]
