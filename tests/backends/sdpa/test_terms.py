"""A score term beside torch's kernel, one fused call per block of queries: equal to the
reference whether the term's tiles go to torch as they are or are copied into one float mask."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from attnkit import attention
from attnkit.backends import SDPA
from attnkit.scores import RelativePositionTerm
from attnkit.testing import assert_close


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize(("block_q", "product_q"), [(3, 2), (4, 8)])
def test_score_term_without_gradients_equals_the_reference(block_q: int, product_q: int) -> None:
    # A relative-position term, with a causal mask and a dense bias: per block of queries, the
    # block's term + bias, masked, is torch's float mask.
    q, k, v = randn(2, 2, 10, 8, seed=11), randn(2, 2, 10, 8, seed=12), randn(2, 2, 10, 8, seed=13)
    qv, enc = randn(2, 2, 10, 8, seed=14), randn(2, 19, 8, seed=15)
    term = RelativePositionTerm(qv, enc, 0.5)
    backend = SDPA(block_q=block_q, product_q=product_q, term_keys=4)
    with torch.no_grad():
        got = attention(q, k, v, bias=term, causal=True, backend=backend)
        want = attention(
            q.double(),
            k.double(),
            v.double(),
            bias=RelativePositionTerm(qv.double(), enc.double(), 0.5),
            causal=True,
            backend="reference",
        )
    assert_close(got, want)
