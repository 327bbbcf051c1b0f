"""Plans are made once per mask and geometry (Mask.plan_key), and a changed mask makes a new one."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import torch

from attnkit import attention, masks
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
    monkeypatch.setattr(call_module, "_PLANS_VISITS", 10)
    big = Counted("too big")
    for _ in range(2):
        attention(q, k, v, mask=big, backend=Chunked(block_q=8, block_k=8))
    assert big.asked == 2
