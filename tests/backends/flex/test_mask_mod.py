"""Every attnkit mask as a FlexAttention mask_mod: written out by torch (create_mask, which calls
it as FlexAttention does), it equals the mask attnkit writes out, in both alignments."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_mask

from attnkit import masks
from attnkit.backends.flex.mask_mod import lower_mask, mask_refusal

from .helpers import B, H, catalogue, dense_of

SIZES = [(24, 24), (10, 24), (24, 10)]  # Tq == Tk, fewer queries (a cache), more queries


@pytest.mark.parametrize(("tq", "tk"), SIZES)
@pytest.mark.parametrize("kind", list(catalogue(24, 24)))
def test_the_mask_mod_is_the_mask(kind: str, tq: int, tk: int) -> None:
    mask = catalogue(tq, tk)[kind]()
    m = mask if isinstance(mask, masks.Mask) else masks.visibility(mask, False)
    assert m is not None
    assert mask_refusal(m) is None
    geo = masks.Geometry((B,), H, tq, tk, torch.device("cpu"))
    got = create_mask(lower_mask(m, geo), B, H, tq, tk, device="cpu")
    torch.testing.assert_close(got, dense_of(mask, tq, tk))


class _Odd(masks.Mask):
    """A mask of its own class: every key at an odd distance."""

    def tile(self, geo: masks.Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        i = torch.arange(qs, qe)[:, None]
        return ((torch.arange(ks, ke) - i) % 2 == 1)[None, None]


class _OddWithMod(_Odd):
    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx - q_idx) % 2 == 1


def test_a_mask_of_its_own_class_needs_a_mask_mod() -> None:
    why = mask_refusal(masks.causal() & _Odd())
    assert why is not None
    assert "_Odd is of a class of its own" in why
    assert "mask_mod" in why
    geo = masks.Geometry((B,), H, 6, 6, torch.device("cpu"))
    with pytest.raises(ValueError, match="class of its own"):
        lower_mask(_Odd(), geo)
    mask = _OddWithMod() & masks.causal()
    assert mask_refusal(mask) is None
    got = create_mask(lower_mask(mask, geo), B, H, 6, 6, device="cpu")
    torch.testing.assert_close(got, dense_of(mask, 6, 6))
