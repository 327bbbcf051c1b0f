"""Calls entering ``attention()`` as an outside reviewer would try them: lengths of every integer
kind, a batch of one, rows padded to nothing, views of caches kept after the cache changed, and
what ``explain()`` says of each, each number against the float64 reference.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import attnkit

F64 = torch.float64


def reference(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None) -> Tensor:
    """Softmax attention in float64 over the pairs ``keep`` allows (a query that sees no key
    gives 0)."""
    scores = (q.to(F64) @ k.to(F64).transpose(-1, -2)) / q.size(-1) ** 0.5
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v.to(F64)


def padding_keep(lengths: list[int], tk: int) -> Tensor:
    """``(B, 1, 1, Tk)``: key ``j`` of row ``b`` exists where ``j < lengths[b]``."""
    return (torch.arange(tk)[None, :] < torch.tensor(lengths)[:, None])[:, None, None]


def decoded_paged_cache() -> tuple[attnkit.PagedKVCache, attnkit.MultiHeadAttention]:
    """A paged cache of two sequences of 7 tokens each, in pages of 4, written by a module."""
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    cache = mha.make_paged_cache(num_blocks=16, page_size=4, max_seqs=2)
    with torch.no_grad():
        mha(torch.randn(2, 7, 32), causal=True, cache=cache)
    return cache, mha


# --------------------------------------------------------------------------------------------------
# A view kept after its cache changed


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("backend", ["reference", "chunked", "auto"])
def test_a_paged_view_kept_after_free_is_refused_by_name(backend: str, grad: bool) -> None:
    """After ``free(1)`` the block table's row 1 names no page (-1), while a view taken before
    still says the row holds 7 tokens: a call on that view refuses, naming the entry, on every
    path (the gather of the reference backend and of gradients included), and never reads page
    -1 (the pool's last page) as the row's keys."""
    cache, _ = decoded_paged_cache()
    view = cache.view()
    q = torch.randn(2, 4, 1, 8, requires_grad=grad)
    k0, v0 = view.row(1)
    fresh = attnkit.attention(q, view, backend=backend)
    want = reference(q[1:], k0.repeat_interleave(2, 1), v0.repeat_interleave(2, 1))
    torch.testing.assert_close(fresh[1:].to(F64), want, atol=1e-5, rtol=0)
    cache.free(1)
    native = backend != "reference" and not grad  # the native kernel checks the table itself
    error = RuntimeError if native else ValueError
    with pytest.raises(error, match=r"block_table\[1, 0\] = -1 is not a page"):
        attnkit.attention(q, view, backend=backend)
