"""Packed sequences as a mask (``attnkit.flash_attn._varlen``): documents when the lengths agree,
each sequence aligned bottom-right on its own keys otherwise, and block states that are sound
without a (Tq, Tk) tensor."""

from __future__ import annotations

import torch

from attnkit import flash_attn as fa
from attnkit import masks


def test_varlen_mask_is_documents_when_lengths_agree() -> None:
    m = fa.varlen_mask(torch.tensor([0, 3, 5]), causal=True)
    assert repr(m) == "documents(lengths=[3, 2]) & causal()"
    assert fa.varlen_mask([0, 4]) is None


def test_structured_masks_keep_memory_linear() -> None:
    """The varlen mask with different query and key lengths answers block states without a
    (Tq, Tk) tensor, and they are sound."""
    m = fa.varlen_mask([0, 3, 10, 11], [0, 8, 12, 30], causal=True, window_size=(4, 0))
    assert m is not None
    dense = m.dense(11, 30)[0, 0]
    geo = masks.Geometry((1,), 1, 11, 30, torch.device("cpu"))
    states = m.block_states(geo, (0, 11, 2), (0, 30, 2))
    for bi, qs in enumerate(range(0, 11, 2)):
        for bj, ks in enumerate(range(0, 30, 2)):
            block = dense[qs : qs + 2, ks : ks + 2]
            assert int(states[bi, bj]) != masks.EMPTY or not block.any()
            assert int(states[bi, bj]) != masks.FULL or block.all()
    assert (states == masks.EMPTY).any()
    assert (states == masks.FULL).any()
