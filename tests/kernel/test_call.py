"""Plans are made once per mask and geometry (Mask.plan_key), and a changed mask makes a new one."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import torch

from attnkit import attention, masks
from attnkit._call import AttentionCall, describe_call
from attnkit._kernel import call as call_module
from attnkit.backends import Chunked
from attnkit.masks import Geometry, Mask
from attnkit.testing import assert_close


class Counted(Mask):
    """Queries see keys ``j <= i`` and ``j % 3 != 0``; counts the plans made of it (its
    :meth:`block_states` is what a plan asks)."""

    def __init__(self, key: Hashable | None) -> None:
        self.key, self.asked = key, 0

    def block_states(
        self, geo: Geometry, q: tuple[int, int, int], k: tuple[int, int, int]
    ) -> torch.Tensor:
        self.asked += 1
        return super().block_states(geo, q, k)

    def tile(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> torch.Tensor:
        i = torch.arange(qs, qe).unsqueeze(-1) + geo.shift
        j = torch.arange(ks, ke)
        return ((j <= i) & (j % 3 != 0))[None, None]

    @property
    def plan_key(self) -> Hashable | None:
        return self.key


def qkv(seed: int = 0, t: int = 40) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, t, 8, generator=g, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("native", [True, False])
def test_equal_keys_share_one_plan(native: bool) -> None:
    backend = Chunked(block_q=8, block_k=8, native=native)
    q, k, v = qkv()
    first, second = Counted(("counted", native)), Counted(("counted", native))
    a = attention(q, k, v, mask=first, backend=backend)
    assert first.asked > 0
    b = attention(q, k, v, mask=second, backend=backend)
    assert second.asked == 0  # the plan (and the native kernel's visits) came from the cache
    assert_close(a, b)
    dense = first.tile(*_geo(q), 0, 40, 0, 40)
    assert_close(b, attention(q, k, v, mask=dense, backend="reference"))


def _geo(q: torch.Tensor) -> tuple[Geometry]:
    return (Geometry((2,), 2, q.size(-2), q.size(-2), torch.device("cpu")),)


def test_a_mask_without_a_key_is_asked_every_call() -> None:
    q, k, v = qkv()
    mask = Counted(None)
    attention(q, k, v, mask=mask, backend=Chunked(block_q=8, block_k=8))
    asked = mask.asked
    attention(q, k, v, mask=mask, backend=Chunked(block_q=8, block_k=8))
    assert mask.asked == 2 * asked > 0  # a plan per call


def test_another_geometry_makes_another_plan() -> None:
    mask = Counted("another geometry")
    for t in (40, 41):
        q, k, v = qkv(t=t)
        before = mask.asked
        got = attention(q, k, v, mask=mask, backend=Chunked(block_q=8, block_k=8))
        assert mask.asked > before
        want = attention(q, k, v, mask=mask.tile(*_geo(q), 0, t, 0, t), backend="reference")
        assert_close(got, want)


@pytest.mark.parametrize("native", [True, False])
def test_a_mask_tensor_written_in_place_makes_a_new_plan(native: bool) -> None:
    # Tensors are named by identity and version: an in-place write must not reuse the plan of
    # what the tensor held before.
    backend = Chunked(block_q=8, block_k=8, native=native)
    q, k, v = qkv()
    valid = torch.ones(2, 40, dtype=torch.bool)
    mask = masks.key_padding(valid=valid) & masks.causal()
    before = attention(q, k, v, mask=mask, backend=backend)
    valid[:, 20:] = False
    got = attention(q, k, v, mask=mask, backend=backend)
    want = attention(q, k, v, mask=masks.key_padding(valid=valid.clone()) & masks.causal())
    assert_close(got, want)
    assert (got - before).abs().max() > 0.1  # the write changed the answer


def test_keys_name_what_the_masks_hide() -> None:
    assert masks.causal().plan_key == masks.causal().plan_key
    assert masks.causal().plan_key != masks.causal(align="top_left").plan_key
    assert masks.sliding_window(4, 2).plan_key != masks.sliding_window(4, 3).plan_key
    lengths = masks.documents([3, 5])
    assert lengths.plan_key is not None
    assert lengths.plan_key != masks.documents([3, 5]).plan_key  # tensors: by identity
    both = masks.causal() & masks.sliding_window(4, 0)
    assert both.plan_key == (masks.causal() & masks.sliding_window(4, 0)).plan_key
    assert masks.from_fn(lambda b, h, i, j: i >= j).plan_key is None
    dense = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    assert (masks.causal() & dense).plan_key is None  # a kept plan would keep the tensor alive
    assert (masks.causal() & masks.from_fn(lambda b, h, i, j: i >= j)).plan_key is None
    with torch.inference_mode():  # no version counter: no key
        assert masks.key_padding(valid=torch.ones(1, 4, dtype=torch.bool)).plan_key is None


def test_the_cache_keeps_a_bounded_number_of_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = qkv()
    for i in range(3 * call_module._PLANS_KEPT):
        attention(q, k, v, mask=Counted(("bounded", i)), backend=Chunked(block_q=8, block_k=8))
    assert len(call_module._PLANS) == call_module._PLANS_KEPT
    # ... and of visits: a plan of 15 visits (blocks of 8 under j <= i, 40 x 40) fits in 40
    # twice, not three times, and a plan larger than the bound is not kept at all.
    monkeypatch.setattr(call_module, "_PLANS_VISITS", 40)
    for i in range(3):
        attention(q, k, v, mask=Counted(("visits", i)), backend=Chunked(block_q=8, block_k=8))
    assert [entry[2] for entry in call_module._PLANS.values()] == [15, 15]
    assert call_module._PLANS_HELD == [30]  # the count kept as plans come and go
    monkeypatch.setattr(call_module, "_PLANS_VISITS", 10)
    big = Counted("too big")
    for _ in range(2):
        attention(q, k, v, mask=big, backend=Chunked(block_q=8, block_k=8))
    assert big.asked == 2


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
    if not call_module.native_serves(torch.device("cpu"), None, False, True):
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
    if not call_module.native_serves(torch.device("cpu"), None, False, True):
        pytest.skip("the native kernel is not available")
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, tq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 1000, 8, generator=g, dtype=torch.float64) for _ in range(2))
    decode = call_module.decode_sized(tq, block_q)
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


def test_a_band_that_hides_nothing_plans_as_no_mask() -> None:
    """Causal under one new query hides no cached key: the decode step plans as with no mask
    (no band to ask about, the same plan), and two new queries keep the band (the first may not
    see the second's key)."""
    g = torch.Generator().manual_seed(4)
    k = torch.randn(1, 2, 300, 8, generator=g, dtype=torch.float64)
    for tq, banded in ((1, False), (2, True)):
        q = torch.randn(1, 2, tq, 8, generator=g, dtype=torch.float64)
        geo = Geometry((1,), 2, tq, 300, q.device)
        mask, keys = call_module.decode_plan(masks.causal(), geo, None)
        assert (mask is not None) == banded
        assert keys == 300
        with torch.inference_mode():
            out = attention(q, k, k, causal=True, backend="chunked")
        assert_close(out, attention(q, k, k, causal=True, backend="reference"))
    wide = Geometry((1,), 2, 1, 300, torch.device("cpu"))
    assert call_module.decode_plan(masks.sliding_window(299, 0), wide, None)[0] is None
    assert call_module.decode_plan(masks.sliding_window(298, 0), wide, None)[0] is not None
    assert call_module.decode_plan(masks.causal(align="top_left"), wide, None)[0] is not None
