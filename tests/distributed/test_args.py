"""The arguments of a call across ranks (no processes needed): what stays with the keys, what
every rank evaluates, and what is checked against the whole sequence."""

from __future__ import annotations

import pytest
import torch

from attnkit import masks
from attnkit.distributed._args import Travel, leaves, split_mask, validated, whole_geometry
from attnkit.scores import RelativePositionTerm


def test_a_dense_key_shard_travels_and_the_rest_stays() -> None:
    pad = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    mask = (masks.sliding_window(4) & pad) | masks.documents([20, 28])
    structure, travel, reasons = split_mask(mask, 12)
    assert reasons == []
    assert [tuple(t.shape) for t in travel] == [(2, 1, 1, 12)]
    parts = leaves(structure)
    assert [type(p).__name__ for p in parts] == ["_Window", "Travel", "_Documents"]
    assert isinstance(parts[1], Travel)
    assert structure.op == "or"


def test_masks_that_cannot_run_across_ranks_say_why() -> None:
    query_mask = torch.ones(12, 12, dtype=torch.bool)
    assert "depends on the query" in split_mask(masks.causal() & query_mask, 12)[2][0]
    wrong = torch.ones(1, 1, 1, 48, dtype=torch.bool)  # the whole sequence's, not the shard's
    assert "its last dimension must be the shard's Tk = 12" in split_mask(wrong, 12)[2][0]
    same = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # one value for every key: it stays
    assert split_mask(masks.causal() & same, 12)[1] == []


def test_structured_masks_are_checked_against_the_whole_sequence() -> None:
    q = torch.randn(2, 4, 12, 8)
    call = validated(
        q, q, q, mask=masks.documents([20, 28]), bias=None, causal=True, scale=None,
        softcap=None, sinks=None, dropout_p=0.0, return_lse=False, score_mod=None, world=4,
    )  # fmt: skip
    assert call.causal
    assert repr(call.mask) == "causal() & documents(lengths=[20, 28])"
    assert (whole_geometry(call, 4).q_len, whole_geometry(call, 4).kv_len) == (48, 48)
    with pytest.raises(ValueError, match=r"covers 12 positions but the call has Tk = 48 keys"):
        validated(
            q, q, q, mask=masks.documents([12]), bias=None, causal=False, scale=None,
            softcap=None, sinks=None, dropout_p=0.0, return_lse=False, score_mod=None, world=4,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"qv \(2, 4, 48, 3\) must be this rank's rows"):
        validated(
            q, q, q, mask=None, bias=RelativePositionTerm(torch.randn(2, 4, 48, 3),
            torch.randn(4, 95, 3), 1.0), causal=False, scale=None, softcap=None, sinks=None,
            dropout_p=0.0, return_lse=False, score_mod=None, world=4,
        )  # fmt: skip
