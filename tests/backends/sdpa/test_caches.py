"""sdpa on a KV cache view, on GPUs: every row's stretch and band as one bool mask over views of a
contiguous cache or a paged cache's pages gathered, checked against the float64 reference on each
row's own keys; declined on the CPU (the native kernel reads caches there)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit._base import devices
from attnkit._call import check_attention_args
from attnkit.backends import SDPA
from attnkit.backends.base import CallInputs
from attnkit.caches.view import CacheView
from attnkit.testing import assert_close

H100 = devices.Target("cuda", "nvidia", (9, 0), present=False)
RANGES = [(0, 20), (5, 40), (7, 7)]  # a row from its first key, one left-padded, one empty


def checked(q: torch.Tensor, view: CacheView, **kwargs: Any) -> Any:
    defaults: dict[str, Any] = {"mask": None, "bias": None, "causal": False, "scale": None}
    return check_attention_args(q, view, None, **{**defaults, **kwargs})


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"causal": True}, {"mask": masks.sliding_window(6)}],
)
@pytest.mark.parametrize("q_lens", [None, (3, 1, 0)])
@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("paged", [False, True])
def test_every_row_reads_its_own_stretch(
    kwargs: dict[str, Any], q_lens: Any, hkv: int, paged: bool
) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 3, 8, generator=gen, dtype=torch.float64)
    if paged:  # pages of 16 keys, each row's in a scrambled order
        cache = torch.randn(9, hkv, 16, 8, generator=gen, dtype=torch.float64)
        table = torch.tensor([[4, 0, 7], [2, 8, 1], [3, 5, 6]])
        view = CacheView(cache, cache.flip(-1), RANGES, table, q_lens=q_lens)
    else:
        cache = torch.randn(3, hkv, 48, 8, generator=gen, dtype=torch.float64)
        view = CacheView(cache, cache.flip(-1), RANGES, q_lens=q_lens)
    call = checked(q, view, **kwargs)
    got = SDPA().run(call, CallInputs(q, view.k, view.v))
    want = attnkit.attention(q, view, **kwargs, backend="reference")
    assert_close(got, want)
    assert not got[2].any()  # the empty row gives 0


def on_gpu(view: CacheView, **kwargs: Any) -> list[str]:
    q = torch.empty(view.rows, 4, 1, 8, device="meta", dtype=torch.bfloat16)
    call = dataclasses.replace(checked(q, view, **kwargs), device=torch.device("cuda"))
    with devices.assuming(H100):
        return SDPA().check(call)


def test_what_it_reads_where() -> None:
    cache = torch.empty(3, 2, 48, 8, device="meta", dtype=torch.bfloat16)
    view = CacheView(cache, cache, RANGES)
    assert on_gpu(view, causal=True) == []
    assert any("no softcap" in r for r in on_gpu(view, causal=True, softcap=2.0))
    pages = torch.zeros(6, 2, 16, 8, dtype=torch.bfloat16)
    paged = CacheView(
        pages, pages, [(0, 20), (0, 9), (0, 3)], torch.tensor([[0, 1], [2, 3], [4, 5]])
    )
    paged = dataclasses.replace(paged, k=pages.to("meta"), v=pages.to("meta"))
    assert on_gpu(paged, causal=True) == []
    q = torch.empty(3, 4, 1, 8, device="meta", dtype=torch.bfloat16)
    refused = SDPA().check(checked(q, view, causal=True))
    assert any(
        "reads a KV cache view on meta only as views of a contiguous cache's rows" in r
        for r in refused
    )


@pytest.mark.parametrize("kind", ["decode", "prefill", "window"])
def test_a_contiguous_cache_whose_rows_share_their_keys_is_the_dense_call(kind: str) -> None:
    """A contiguous cache whose rows attend the same stretch (a batch decoding in step) is read
    as views of its rows, on the CPU too: the dense call, equal to the formula."""
    gen = torch.Generator().manual_seed(3)
    cache = attnkit.KVCache(2, 64, 2, 8, dtype=torch.float64)
    cache.update(*torch.randn(2, 2, 2, 40, 8, generator=gen, dtype=torch.float64))
    tq = {"decode": 1, "prefill": 5, "window": 5}[kind]
    q = torch.randn(2, 4, tq, 8, generator=gen, dtype=torch.float64)
    mask = masks.sliding_window(7) if kind == "window" else None
    call = checked(q, cache.view(), causal=True, mask=mask)
    assert call.dense_views is not None
    assert call.dense_views.cache is None
    assert SDPA().check(call) == []
    got = SDPA().run(call, CallInputs(q, cache.view().k, cache.view().v))
    keys, values = cache.view().dense()
    want = attnkit.attention(q, keys, values, causal=True, mask=mask, backend="reference")
    assert_close(got, want)
    with attnkit.record_dispatch() as seen:
        attnkit.attention(q, cache.view(), causal=True, mask=mask)
        attnkit.attention(q, keys, values, causal=True, mask=mask)
    # auto serves the view as it serves the dense call (a decode step: torch's kernel)
    assert seen[0].chosen == seen[1].chosen == ("sdpa" if kind == "decode" else "chunked"), seen


def test_rows_of_their_own_lengths_on_the_cpu_stay_with_the_native_read() -> None:
    cache = torch.zeros(2, 2, 48, 8)
    view = CacheView(cache, cache, [(0, 40), (0, 30)])
    call = checked(torch.zeros(2, 4, 1, 8), view, causal=True)
    assert call.dense_views is None
    refused = SDPA().check(call)
    assert any("only as views of a contiguous cache's rows" in r for r in refused), refused


def test_a_decode_step_on_a_gpu_runs_a_fused_kernel() -> None:
    cache = torch.empty(2, 2, 4096, 64, device="meta", dtype=torch.bfloat16)
    view = CacheView(cache, cache, [(0, 1000), (0, 4000)])
    step = torch.empty(2, 8, 1, 64, device="meta", dtype=torch.bfloat16)
    text = str(attnkit.explain(step, view, causal=True, device="cuda"))
    if "flash_attn  chosen" not in text:  # where the flash-attn package is installed, it reads it
        assert "auto picks: sdpa" in text, text
        assert "runs torch's memory-efficient kernel" in text, text
    assert "(2, 1, 1, 4000) bool mask" in text, text
    # on the CPU the native kernel reads the cache where it lies, as before
    on_cpu = attnkit.explain(step, view, causal=True, device="cpu")
    assert on_cpu.chosen == "chunked", str(on_cpu)


def test_a_paged_cache_is_gathered_and_says_so() -> None:
    pages = torch.empty(8, 2, 256, 64, device="meta", dtype=torch.bfloat16)
    table = torch.arange(8).reshape(2, 4)
    view = CacheView(pages, pages, [(0, 1000), (0, 700)], table, trusted=True)
    step = torch.empty(2, 8, 1, 64, device="meta", dtype=torch.bfloat16)
    text = str(attnkit.explain(step, view, causal=True, device="cuda"))
    assert "would gather the pages into dense keys and values (2, 2, 1000)" in text, text
    assert "chunked    avoided: " in text, text
