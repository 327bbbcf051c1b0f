"""Cache bookkeeping and attention statistics at their edges, each checked against the float64
reference or the documented contract: a rewind after an eviction (``position`` and ``length``
move back together), the rewinds a streaming cache can and cannot make right when its ring has
just filled, and a query given a log-sum-exp of ``-inf`` (no weight, entropy 0) on both passes
of :func:`attnkit.attention_stats`.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import KVCache, StreamingKVCache, attention_stats
from attnkit.testing import assert_close

F64 = torch.float64
D = 8


def randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).float()


def state(cache: object) -> dict[str, object]:
    """A cache's attributes, tensors cloned."""
    return {
        name: value.clone() if isinstance(value, Tensor) else value
        for name, value in vars(cache).items()
    }


def assert_same(before: dict[str, object], after: dict[str, object]) -> None:
    assert before.keys() == after.keys()
    for name, value in before.items():
        if isinstance(value, Tensor):
            other = after[name]
            assert isinstance(other, Tensor), name
            assert torch.equal(value, other), name
        else:
            assert value == after[name], name


# KVCache: rewind after keep


def test_rewind_after_keep_counts_positions_back_too() -> None:
    cache = KVCache(1, 8, 1, D)
    cache.update(randn(1, 1, 6, D, seed=21), randn(1, 1, 6, D, seed=22))
    cache.keep(torch.tensor([[[1, 3, 5]]]))  # length 3, position 6
    cache.update(randn(1, 1, 2, D, seed=23), randn(1, 1, 2, D, seed=24))
    cache.rewind(4)  # forget the 1 token held past 4: the position goes back by 1 too
    assert (cache.length, cache.position) == (4, 7)
    cache.rewind(0)
    assert (cache.length, cache.position) == (0, 3)


# StreamingKVCache: S = 1, W = 3, so the ring is full after 4 tokens


def streaming(position: int) -> StreamingKVCache:
    cache = StreamingKVCache(1, 1, D, sink_tokens=1, window=3)
    for i in range(position):
        cache.update(randn(1, 1, 1, D, seed=100 + i), randn(1, 1, 1, D, seed=200 + i))
    return cache


def test_a_staged_step_on_a_just_full_ring_refuses_a_rewind_past_it() -> None:
    cache = streaming(4)  # S + W tokens: every slot holds one, none written twice yet
    cache.stage(randn(1, 1, 1, D, seed=30), randn(1, 1, 1, D, seed=31))  # over token 1's slot
    before = state(cache)
    with pytest.raises(ValueError, match=r"cannot rewind to position 3"):
        cache.rewind(3)  # a query at 3 attends token 1, which the staged step wrote over
    assert_same(before, state(cache))


def streamed(cache: StreamingKVCache, q: Tensor) -> Tensor:
    """One query over every token the cache holds, from the float64 reference (in slot order:
    a single query attends all of them, so their order does not matter)."""
    keys, values = (t[:, :, : cache.length] for t in (cache.k_cache, cache.v_cache))
    return attnkit.attention(q.double(), keys.double(), values.double(), backend="reference")


@pytest.mark.parametrize("position", [4, 6], ids=["just-full", "wrapped"])
def test_rewinding_a_staged_step_on_a_full_ring_puts_the_oldest_token_back(position: int) -> None:
    cache = streaming(position)
    q = randn(1, 1, 1, D, seed=34)
    want = streamed(cache, q)
    cache.stage(randn(1, 1, 1, D, seed=35), randn(1, 1, 1, D, seed=36))  # over a held token
    cache.rewind(position)
    assert cache.position == position
    assert_close(attnkit.attention(q, cache.view(), None), want, dtype=torch.float32)


# attention_stats: a given log-sum-exp of -inf


def nan_row(q: Tensor) -> Tensor:
    """q with a NaN in the last query of head 0: the eager pass serves the call (the native
    one takes finite q and k only), and only that query's statistics are NaN."""
    q = q.clone()
    q[0, 0, -1, 0] = float("nan")
    return q


@pytest.mark.parametrize("kernel", ["native", "eager"])
def test_a_given_lse_of_minus_inf_gives_the_query_no_weight_and_entropy_0(kernel: str) -> None:
    q, k = randn(1, 2, 4, D, seed=42), randn(1, 2, 4, D, seed=43)
    _, lse = attnkit.attention(q, k, k, return_lse=True)
    lse = lse.clone()
    lse[0, 1, 2] = float("-inf")  # head 1's query 2, which sees every key
    if kernel == "eager":
        q = nan_row(q)
    ref = attention_stats(q, k, lse=lse, backend="reference")
    got = attention_stats(q, k, lse=lse)
    for a, b in zip(
        (ref.key_mass, ref.key_max, ref.entropy),
        (got.key_mass, got.key_max, got.entropy),
        strict=True,
    ):
        assert a[0, 1].isfinite().all()
        assert_close(b[0, 1], a[0, 1], dtype=torch.float32)
    assert ref.entropy[0, 1, 2] == 0
    assert got.entropy[0, 1, 2] == 0
    # the other queries' weights as without the stale row: the reference's from its weights
    _, w = attnkit.attention(
        q[:, 1:].double(),
        k[:, 1:].double(),
        k[:, 1:].double(),
        return_weights=True,
        backend="reference",
    )
    w[..., 2, :] = 0
    assert_close(got.key_mass[0, 1], w.sum(-2)[0, 0], dtype=torch.float32)
