"""The flex backend: where it declines (every call on the CPU), and why; it runs only on CUDA."""

from __future__ import annotations

import torch
from torch import Tensor

import attnkit
from attnkit import flex
from attnkit.backends.torch_flex import Flex, flex_available


def squared(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return s * s


def causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return q >= kv


def test_flex_backend_declines_on_cpu_with_reasons() -> None:
    q = torch.randn(1, 2, 8, 4)
    call = attnkit.explain(q, q, q, score_mod=squared).call
    reasons = Flex().check(call)
    assert any("CUDA only" in r and "chunked" in r for r in reasons)
    plain = attnkit.explain(q, q, q, softcap=2.0, mask=attnkit.masks.causal()).call
    reasons = Flex().check(plain)
    assert any("has no mask_mod" in r for r in reasons)
    assert any("softcap" in r for r in reasons)
    mod_mask = flex.create_block_mask(causal, None, None, 8, 8).mask
    assert not any(
        "has no mask_mod" in r for r in Flex().check(attnkit.explain(q, q, q, mask=mod_mask).call)
    )
    assert Flex.accepts_score_mod


def test_flex_is_in_autos_order_only_where_it_can_run() -> None:
    names = attnkit.available_backends()
    assert ("flex" in names) == flex_available()
    if flex_available():
        assert names.index("sdpa") < names.index("flex") < names.index("chunked")


def test_the_backend_is_registered_as_flex() -> None:
    # The module is torch_flex (beside attnkit.flex, FlexAttention's API); the name a call
    # passes as backend= is "flex".
    assert Flex().name == "flex"
