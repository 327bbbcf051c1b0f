"""Packed documents, one fused call each: documents alone or with causal take the path (and cost
nothing), short documents and other masks are written out; documents combined with a window or
with key padding must not take it. The documents of the last test are long (256 tokens), so that
the path would be taken if the guard let them in."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention, explain, masks
from attnkit.backends.sdpa import sdpa_cost
from attnkit.testing import assert_close

from .helpers import call_of, randn, reference


@pytest.mark.parametrize("causal", [False, True])
def test_packed_documents_are_one_fused_call_each(causal: bool) -> None:
    q, k, v = (
        randn(1, 2, 512, 16, seed=7),
        randn(1, 2, 512, 16, seed=8),
        randn(1, 2, 512, 16, seed=9),
    )
    docs = masks.documents([256, 256])
    text = str(explain(q, k, v, mask=docs, causal=causal, backend="sdpa"))
    assert "one fused call per document: 2 calls" in text
    assert sdpa_cost(call_of(q, k, v, mask=docs, causal=causal)) == []
    got = attention(q, k, v, mask=docs, causal=causal, backend="sdpa")
    assert_close(got, reference(q, k, v, mask=docs, causal=causal))
    # The documents really are separate: the second one's output ignores the first's values.
    v2 = v.clone()
    v2[..., :256, :] += 1.0
    again = attention(q, k, v2, mask=docs, causal=causal, backend="sdpa")
    assert torch.equal(again[..., 256:, :], got[..., 256:, :])


def test_short_documents_and_other_masks_are_written_out_and_cost_so() -> None:
    q = randn(1, 2, 64, 8, seed=10)
    short = masks.documents([32, 32])  # shorter than a call per document is worth
    (cost,) = sdpa_cost(call_of(q, q, q, mask=short))
    assert cost == f"would materialise the mask {short!r} as a (Tq, Tk) = (64, 64) tensor"
    assert_close(attention(q, q, q, mask=short, backend="sdpa"), reference(q, q, q, mask=short))
    window = masks.sliding_window(5) & masks.documents([40, 24])
    assert_close(attention(q, q, q, mask=window, backend="sdpa"), reference(q, q, q, mask=window))


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, 2, 512, 8, dtype=torch.float64, generator=g) for _ in range(3))  # type: ignore[return-value]


MASKS = {
    "docs": masks.documents([256, 256]),
    "docs & causal": masks.documents([256, 256]) & masks.causal(),
    "docs & window": masks.documents([256, 256]) & masks.sliding_window(16),
    "window & docs": masks.sliding_window(16) & masks.documents([256, 256]),
    "docs & causal & window": masks.documents([256, 256])
    & masks.causal()
    & masks.sliding_window(16, 16),
    "docs & padding": masks.documents([256, 256]) & masks.key_padding([400, 512]),
    "padding & docs": masks.key_padding([400, 300]) & masks.documents([200, 312]),
    "docs | window": masks.documents([256, 256]) | masks.sliding_window(16),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_sdpa_on_long_documents_with_other_masks_matches_the_reference(name: str) -> None:
    q, k, v = _qkv()
    mask = MASKS[name]
    with torch.no_grad():
        got = attention(q, k, v, mask=mask, backend="sdpa")
    want = attention(q, k, v, mask=mask, backend="reference")
    assert_close(got, want)
