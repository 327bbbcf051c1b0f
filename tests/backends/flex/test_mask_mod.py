"""Every attnkit mask as a FlexAttention mask_mod: written out by torch (create_mask, which calls
it as FlexAttention does), it equals the mask attnkit writes out, in both alignments; an index
mask's bitmap holds each row's selection, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.nn.attention.flex_attention import create_mask

from attnkit import masks
from attnkit.backends.flex.block_mask import block_mask
from attnkit.backends.flex.mask_mod import lower_mask, mask_refusal, selection_bitmap

from ...helpers import LargestTensor
from .helpers import B, H, catalogue, dense_of, selection

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


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 3),
    slots=st.integers(1, 100),
    k=st.integers(1, 12),
    sort=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_selection_bitmap_is_the_dense_selection(
    rows: int, slots: int, k: int, sort: bool, seed: int
) -> None:
    # Bit s % 32 of word s // 32 (bit 31, the int32 sign bit, included) is set iff the row holds
    # s, however often; -1 sets nothing.
    idx = selection(rows, 2, 3, slots, k, seed=seed)
    if sort:
        idx = idx.sort(-1).values
    words = selection_bitmap(idx, slots, presorted=sort)
    assert words.dtype == torch.int32
    assert words.shape == (rows, 2, 3, -(-slots // 32))
    s = torch.arange(words.size(-1) * 32)
    bits = ((words[..., s // 32] >> (s % 32)) & 1).bool()
    want = torch.zeros(*idx.shape[:-1], slots + 1, dtype=torch.bool)
    want.scatter_(-1, torch.where(idx >= 0, idx, slots), True)
    torch.testing.assert_close(bits[..., :slots], want[..., :slots])
    assert not bits[..., slots:].any()


def test_bit_31_and_a_row_of_every_key() -> None:
    idx = torch.tensor([[31, 31, -1, 63, 0], [-1, -1, -1, -1, -1]])
    torch.testing.assert_close(
        selection_bitmap(idx, 64), torch.tensor([[-(2**31) + 1, -(2**31)], [0, 0]]).int()
    )
    every = torch.arange(64).flip(0).unsqueeze(0)
    assert bool((selection_bitmap(every, 64) == -1).all())  # all 32 bits of both words


def test_rows_packed_a_stretch_at_a_time() -> None:
    # 6 rows of 2**20 entries are packed in more than one stretch; each row holds its own keys
    # (the last one none).
    idx = torch.randint(-1, 70, (6, 2**20), generator=torch.Generator().manual_seed(3))
    idx[5] = -1
    words = selection_bitmap(idx, 70)
    s = torch.arange(3 * 32)
    for r in (0, 4, 5):
        seen = idx[r].unique()
        want = torch.zeros(3 * 32, dtype=torch.bool)
        want[seen[seen >= 0]] = True
        torch.testing.assert_close(((words[r, s // 32] >> (s % 32)) & 1).bool(), want)


def test_an_index_mask_is_lowered_without_a_dense_mask() -> None:
    # Lowered, with its BlockMask and a few pairs asked of its mask_mod, a selection of 8 keys a
    # query over 4096 keys makes nothing near Tq x Tk: the bitmap is Tq x Tk / 32 words.
    tq, tk = 64, 4096
    geo = masks.Geometry((B,), H, tq, tk, torch.device("cpu"))
    mask = masks.key_indices(selection(B, 2, tq, tk, 8, seed=2)) & masks.causal()
    with LargestTensor() as sizes:
        mod = lower_mask(mask, geo)
        block_mask(mask, geo, mod, block=(16, 128))
        i = torch.arange(tq)
        mod(i % B, i % H, i, i * 64)
    assert sizes.largest <= B * 2 * tq * tk // 32, sizes.largest
