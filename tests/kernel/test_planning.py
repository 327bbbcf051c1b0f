"""A call's block plan: made once per mask and geometry (Mask.plan_key), a changed mask making a
new one; the decode path's mask and key blocks; the one maker of plans, for a whole call or a
rectangle of it."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import torch

from attnkit import attention, masks
from attnkit._kernel import make_plan
from attnkit._kernel import planning as planning_module
from attnkit._kernel.planning import block_plan
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
    for i in range(3 * planning_module._PLANS_KEPT):
        attention(q, k, v, mask=Counted(("bounded", i)), backend=Chunked(block_q=8, block_k=8))
    assert len(planning_module._PLANS) == planning_module._PLANS_KEPT
    # ... and of visits: a plan of 15 visits (blocks of 8 under j <= i, 40 x 40) fits in 40
    # twice, not three times, and a plan larger than the bound is not kept at all.
    monkeypatch.setattr(planning_module, "_PLANS_VISITS", 40)
    for i in range(3):
        attention(q, k, v, mask=Counted(("visits", i)), backend=Chunked(block_q=8, block_k=8))
    assert [entry[2] for entry in planning_module._PLANS.values()] == [15, 15]
    assert planning_module._PLANS_HELD == [30]  # the count kept as plans come and go
    monkeypatch.setattr(planning_module, "_PLANS_VISITS", 10)
    big = Counted("too big")
    for _ in range(2):
        attention(q, k, v, mask=big, backend=Chunked(block_q=8, block_k=8))
    assert big.asked == 2


def test_a_band_that_hides_nothing_plans_as_no_mask() -> None:
    """Causal under one new query hides no cached key: the decode step plans as with no mask
    (no band to ask about, the same plan), and two new queries keep the band (the first may not
    see the second's key)."""
    g = torch.Generator().manual_seed(4)
    k = torch.randn(1, 2, 300, 8, generator=g, dtype=torch.float64)
    for tq, banded in ((1, False), (2, True)):
        q = torch.randn(1, 2, tq, 8, generator=g, dtype=torch.float64)
        geo = Geometry((1,), 2, tq, 300, q.device)
        mask, keys = planning_module.decode_plan(masks.causal(), geo, None)
        assert (mask is not None) == banded
        assert keys == 300
        with torch.inference_mode():
            out = attention(q, k, k, causal=True, backend="chunked")
        assert_close(out, attention(q, k, k, causal=True, backend="reference"))
    wide = Geometry((1,), 2, 1, 300, torch.device("cpu"))
    assert planning_module.decode_plan(masks.sliding_window(299, 0), wide, None)[0] is None
    assert planning_module.decode_plan(masks.sliding_window(298, 0), wide, None)[0] is not None
    assert planning_module.decode_plan(masks.causal(align="top_left"), wide, None)[0] is not None


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("rect", [None, (8, 20, 4, 30)])
def test_one_maker_plans_a_call_or_a_rectangle_of_it(
    native: bool, rect: tuple[int, int, int, int] | None
) -> None:
    """block_plan's grid is make_plan's for the same rectangle; the eager kernel's visits are the
    grid's own, the native kernel's cover the same pairs (a visit's rows see a key of it)."""
    mask = masks.sliding_window(6, 2) & masks.key_padding([37, 30])
    geo = Geometry((2,), 2, 40, 40, torch.device("cpu"))
    q0, nq, k0, nk = (0, 40, 0, 40) if rect is None else rect
    plan = block_plan(mask, geo, native=native, block_q=8, block_k=8, rect=rect)
    grid = make_plan(mask, geo, q_start=q0, q_len=nq, k_start=k0, kv_len=nk, block_q=8, block_k=8)
    assert plan.grid == grid
    assert (plan.q_len, plan.kv_len, plan.shift) == (nq, nk, geo.shift + q0 - k0)
    dense = mask.dense(40, 40, batch_size=2, num_heads=2)[..., q0 : q0 + nq, k0 : k0 + nk]
    seen = dense.flatten(0, 1).any(0)  # (nq, nk): a pair some batch row or head sees
    covered = torch.zeros(nq, nk, dtype=torch.bool)
    for b in range(len(grid.blocks)):
        for ks, ke, r0, r1, _, _ in plan.visits[plan.offsets[b] : plan.offsets[b + 1]].tolist():
            covered[b * 8 + r0 : b * 8 + r1, ks:ke] = True
    assert not (seen & ~covered).any()  # every visible pair is visited
    if not native:
        rows = [
            [v.ks, v.ke, v.r0, v.r1, int(v.partial), -1] for qb in grid.blocks for v in qb.visits
        ]
        assert plan.visits.tolist() == rows
