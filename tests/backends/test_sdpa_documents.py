"""sdpa's per-document path (one fused call per packed document) serves documents alone or with
causal, and nothing else: documents combined with a window or with key padding must not take it.
The documents are long (256 tokens), so that the path would be taken if the guard let them in."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention, masks
from attnkit.testing import assert_close


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
