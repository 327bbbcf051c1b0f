"""Every cache call through ``attention()`` and compiled training steps with tensor lengths,
probed as an outside reviewer would: each number against the float64 reference over exactly the
tokens a cache holds, every backend name, explain() against what ran, and refusals that are
``ValueError``/``TypeError`` naming the argument, never a crash.

* The door: ``attention(q, CacheView)`` in a contiguous cache and in pages of both layouts
  (flash-attn's token-major pages viewed head-major, vLLM's head-major ones), rows of different
  lengths (an empty row and a row of zero real queries among them), chunks of several queries,
  every mask a row can be read with (bands, bool tensors, index masks, ``&`` and ``|``), softcap,
  sinks, a bias by distance, a scale, grouped heads; rows that share their keys with the masks
  that say which keys exist (key padding from a list and from int32/int64 tensors, documents from
  lengths, tensors and ids); modules decoding in chunks into every cache kind.
* Compiled training: ``torch.compile(fullgraph=True, dynamic=True)`` of a step whose padding
  lengths are an int32 tensor and whose q, k, v are transposed ``(B, T, H, D)`` views, gradients
  asked of some inputs only, equal to the float64 reference at two lengths in one graph; the
  ``flex`` backend's refusal to train on the CPU; lengths outside ``[0, Tk]`` refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import CacheView, masks
from attnkit.testing import assert_close

F64 = torch.float64
BACKENDS = ("reference", "chunked", "sdpa", "flex", "auto")

# --------------------------------------------------------------------------------------------------
# A cache of rows of their own, in three layouts


N, H, HKV, D, L, PAGE = 3, 4, 2, 8, 11, 3
RANGES = [(0, 7), (2, 5), (0, 11)]


def _pages(t: Tensor, order: Tensor) -> Tensor:
    """``(N, Hkv, L, D)`` rows as shuffled head-major pages ``(X, Hkv, PAGE, D)``, row ``n``'s
    pages ``order.view(N, -1)[n]``."""
    per = -(-t.size(2) // PAGE)
    padded = t.new_zeros(t.size(0), t.size(1), per * PAGE, t.size(3))
    padded[:, :, : t.size(2)] = t
    blocks = padded.unflatten(2, (per, PAGE)).transpose(1, 2).flatten(0, 1)
    pages = torch.empty_like(blocks)
    pages[order] = blocks
    return pages


def _views(k: Tensor, v: Tensor, q_lens: tuple[int, ...] | None) -> dict[str, CacheView]:
    gen = torch.Generator().manual_seed(7)
    order = torch.randperm(N * -(-L // PAGE), generator=gen)
    table = order.view(N, -1).int()
    kp, vp = _pages(k, order), _pages(v, order)
    # flash-attn's pages are token-major (X, page, Hkv, D): a head-major view of them, no copy.
    kf, vf = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (kp, vp))
    return {
        "contiguous": CacheView(k, v, RANGES, q_lens=q_lens),
        "vllm pages": CacheView(kp, vp, RANGES, table, q_lens),
        "flash pages": CacheView(kf, vf, RANGES, table.long(), q_lens),
    }


def _band(m: int, width: int, lo: float, hi: float) -> Tensor:
    """``(1, 1, m, width)``: query ``i`` (at key ``width - m + i``) sees keys ``lo..hi`` away."""
    d = torch.arange(width)[None] - (torch.arange(m)[:, None] + width - m)
    return ((d >= lo) & (d <= hi))[None, None]


def _expected(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    counts: tuple[int, ...],
    row_mask: Callable[[int, int, int, int], Tensor | None],
    slopes: Tensor | None = None,
    **kw: Any,
) -> Tensor:
    """Each row's real queries against its own keys, dense, in the float64 reference; its padding
    queries 0."""
    out = torch.zeros(*q.shape[:-1], v.size(-1), dtype=F64)
    for n, ((s, e), m) in enumerate(zip(RANGES, counts, strict=True)):
        if not m:
            continue
        extra = dict(kw)
        if slopes is not None:  # ALiBi written out: -slope * |key - query position|
            d = torch.arange(e - s)[None] - (torch.arange(m)[:, None] + e - s - m)
            extra["bias"] = -slopes[:, None, None] * d.abs().double()
        out[n, :, :m] = attnkit.attention(
            q[n : n + 1, :, :m], k[n : n + 1, :, s:e], v[n : n + 1, :, s:e],
            mask=row_mask(n, m, s, e), backend="reference", **extra,
        )[0]  # fmt: skip
    return out


def _row_cases(
    q_len: int, gen: torch.Generator
) -> dict[str, tuple[dict[str, Any], Callable[[int, int, int, int], Tensor | None]]]:
    """Each mask kind a row of its own takes: the call's arguments and each row's dense mask."""
    dense = torch.rand(N, H, q_len, L, generator=gen) > 0.4
    idx = torch.randint(-1, L, (N, H, q_len, 3), generator=gen)

    def chosen(n: int, m: int, s: int, e: int) -> Tensor:
        out = torch.zeros(1, H, m, e - s, dtype=torch.bool)
        for h in range(H):
            for i in range(m):
                for j in idx[n, h, i].tolist():
                    if s <= j < e:  # an entry outside the row's keys is ignored
                        out[0, h, i, j - s] = True
        return out

    return {
        "none": ({}, lambda n, m, s, e: None),
        "causal=True": ({"causal": True}, lambda n, m, s, e: _band(m, e - s, -math.inf, 0)),
        "sliding_window": (
            {"mask": masks.sliding_window(2)},
            lambda n, m, s, e: _band(m, e - s, -2, 0),
        ),
        "window | bool tensor": (
            {"mask": masks.sliding_window(1) | masks.from_tensor(dense)},
            lambda n, m, s, e: _band(m, e - s, -1, 0) | dense[n : n + 1, :, :m, s:e],
        ),
        "bool tensor & causal": (
            {"mask": dense, "causal": True},
            lambda n, m, s, e: dense[n : n + 1, :, :m, s:e] & _band(m, e - s, -math.inf, 0),
        ),
        "key_indices": ({"mask": masks.key_indices(idx)}, chosen),
    }


@pytest.mark.parametrize("q_lens", [None, (2, 0, 1)])
def test_rows_of_their_own_equal_the_reference_in_every_layout_and_backend(
    q_lens: tuple[int, ...] | None,
) -> None:
    """Rows of lengths 7, 3 and 11 (starting at 0 and 2), two queries a row (or 2, 0 and 1 real
    ones), every mask kind such a call takes times softcap, sinks, ALiBi and a scale, in three
    layouts: what the backends that read rows give equals the reference over each row's keys;
    sdpa and flex refuse by name."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(N, HKV, L, D, generator=gen, dtype=F64)
    v = torch.randn(N, HKV, L, D + 2, generator=gen, dtype=F64)
    q = torch.randn(N, H, 2, D, generator=gen, dtype=F64)
    counts = q_lens or (2,) * N
    slopes = attnkit.alibi_slopes(H).double()
    sinks = torch.randn(H, generator=gen, dtype=F64)
    modifiers: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "plain": ({}, {}),
        "softcap": ({"softcap": 1.5}, {"softcap": 1.5}),
        "sinks": ({"sinks": sinks}, {"sinks": sinks}),
        "scale": ({"scale": 0.3}, {"scale": 0.3}),
        "alibi": ({"bias": attnkit.alibi_term(slopes, 2, L)}, {"slopes": slopes}),
    }
    views = _views(k, v, q_lens)
    cases = _row_cases(2, gen)
    # Every mask in every layout; every modifier with a mask of each kind (band, tensor, index).
    grid = [(layout, name, "plain") for layout in views for name in cases]
    grid += [
        (layout, name, mod)
        for layout, name in zip(
            views, ("causal=True", "bool tensor & causal", "key_indices"), strict=True
        )
        for mod in modifiers
        if mod != "plain"
    ]
    for layout, mask_name, mod_name in grid:
        view, (call, rows), (given, spec) = views[layout], cases[mask_name], modifiers[mod_name]
        want = _expected(q, k, v, counts, rows, **spec)
        for backend in ("reference", "chunked", "auto"):
            with torch.no_grad():
                got = attnkit.attention(q, view, backend=backend, **call, **given)
            where = f"{layout}, {mask_name}, {mod_name}, {backend}"
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=where)
    for backend in ("sdpa", "flex"):  # rows of their own on the CPU: refused, by name
        with pytest.raises(attnkit.BackendError, match=f"{backend} +cannot: read"):
            attnkit.attention(q, views["vllm pages"], causal=True, backend=backend)


def _shared_masks(width: int) -> dict[str, dict[str, Any]]:
    """Masks that say which keys exist, over a stretch of ``width`` keys shared by 3 rows."""
    short = [width, max(width - 2, 0), 0]
    half = [width // 2, width - width // 2]
    return {
        "key_padding(list)": {"mask": masks.key_padding(short)},
        "key_padding(int64)": {"mask": masks.key_padding(torch.tensor(short))},
        "key_padding(int32) & causal": {
            "mask": masks.causal() & masks.key_padding(torch.tensor(short, dtype=torch.int32))
        },
        "key_padding(left)": {"mask": masks.key_padding(short, side="left")},
        "documents(list)": {"mask": masks.documents(half)},
        "documents(tensor) & causal": {
            "mask": masks.documents(torch.tensor(half, dtype=torch.int32)) & masks.causal()
        },
        "documents(ids)": {"mask": masks.documents(ids=torch.arange(width) // 3)},
        "window | key_padding": {
            "mask": masks.sliding_window(1) | masks.key_padding([min(1, width), 0, 0])
        },
        "from_fn": {"mask": masks.from_fn(lambda b, h, i, j: j % 2 == 0)},
    }


@pytest.mark.parametrize("stretch", [(2, 9), (0, 0), (3, 3)], ids=["2..9", "empty", "3..3"])
def test_rows_that_share_their_keys_take_every_mask_on_every_backend(
    stretch: tuple[int, int],
) -> None:
    """Three rows attending the same stretch (a non-empty one, none at all, none from key 3) with
    0, 1 or 3 queries: the call is the dense call on the stretch, every mask kind included, in
    float64 and bfloat16 (sinks with it), on every backend that can serve it; flex refuses a
    view by name."""
    s, e = stretch
    gen = torch.Generator().manual_seed(1)
    for dtype in (F64, torch.bfloat16) if e > s else (F64,):
        k = torch.randn(N, HKV, 10, D, generator=gen).to(dtype)
        v = torch.randn(N, HKV, 10, D, generator=gen).to(dtype)
        view = CacheView(k, v, [(s, e)] * N)
        sinks = torch.randn(H, generator=gen).to(dtype)
        for tq in (0, 1, 3):
            q = torch.randn(N, H, tq, D, generator=gen).to(dtype)
            for name, call in _shared_masks(e - s).items():
                for extra in ({}, {"sinks": sinks}):
                    spec = {a: b.double() for a, b in extra.items()}
                    want = attnkit.attention(
                        q.double(), k[:, :, s:e].double(), v[:, :, s:e].double(),
                        backend="reference", **call, **spec,
                    )  # fmt: skip
                    for backend in ("reference", "chunked", "sdpa", "auto"):
                        if backend == "sdpa" and extra:  # torch's kernel has no sinks
                            with pytest.raises(attnkit.BackendError, match=r"sdpa +cannot"):
                                attnkit.attention(q, view, backend=backend, **call, **extra)
                            continue
                        with torch.no_grad():
                            got = attnkit.attention(q, view, backend=backend, **call, **extra)
                        assert got.dtype == dtype, (tq, name, backend)
                        assert_close(got, want, dtype=dtype)
        with pytest.raises(attnkit.BackendError, match=r"flex +cannot: reads no KV cache view"):
            attnkit.attention(q, view, backend="flex")


def test_explain_names_the_backend_that_runs_each_cache_call() -> None:
    """explain() and record_dispatch() agree on every cache call: shared and own rows, decode
    steps and chunks, with and without gradients, float32 and bfloat16, a long grouped cache."""
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        for grad in (False, True):
            for b, h, hkv, length in ((2, 4, 2, 40), (1, 32, 8, 1024)):
                k = torch.randn(b, hkv, length, 64, generator=gen).to(dtype)
                for ranges in ([(0, length)] * b, [(0, length - i) for i in range(b)]):
                    for tq in (1, 17):
                        q = torch.randn(b, h, tq, 64, generator=gen).to(dtype)
                        q.requires_grad_(grad)
                        for call in ({}, {"causal": True}, {"mask": masks.sliding_window(5)}):
                            view = CacheView(k, k, ranges)
                            with torch.set_grad_enabled(grad):
                                chosen = attnkit.explain(q, view, **call).chosen
                                with attnkit.record_dispatch() as calls:
                                    attnkit.attention(q, view, **call)
                            assert [c.chosen for c in calls] == [chosen], (dtype, grad, ranges)


# --------------------------------------------------------------------------------------------------
# Modules decoding in chunks into every cache kind


E = 16
CHUNKS = [(0, 4), (4, 7), (7, 8), (8, 9)]  # a prompt, a chunk into the cache, two steps


def _caches(mha: attnkit.MultiHeadAttention, b: int) -> dict[str, Callable[[], Any]]:
    return {
        "KVCache": lambda: mha.make_cache(b, 16),
        "KVCache int8": lambda: mha.make_cache(b, 16, kv_dtype=torch.int8),
        "PagedKVCache flash": lambda: mha.make_paged_cache(16, 3, max_seqs=b),
        "PagedKVCache vllm int8": lambda: mha.make_paged_cache(
            16, 3, max_seqs=b, layout="vllm", kv_dtype=torch.int8
        ),
        "StreamingKVCache": lambda: attnkit.StreamingKVCache(
            b, mha.num_kv_heads, mha.head_dim, sink_tokens=2, window=16, dtype=F64
        ),
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_module_decoding_in_chunks_equals_the_whole_sequence(backend: str) -> None:
    """A grouped MultiHeadAttention decoding 9 tokens as a 4-token prompt, a 3-token chunk into the
    cache and two steps, causal, a window and a bool tensor mask, equals the same module on the
    whole sequence (int8 caches within their quantization error); a backend that cannot read a
    cache's view refuses by name and leaves the cache empty."""
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(E, 4, num_kv_heads=2).double().eval()
    x = torch.randn(2, 9, E, dtype=F64)
    dense = torch.rand(2, 1, 9, 9) > 0.3
    cases: dict[str, tuple[Callable[[int, int], Any], bool]] = {
        "causal": (lambda tq, tk: None, True),
        "window & causal": (lambda tq, tk: masks.sliding_window(2) & masks.causal(), False),
        "bool tensor | eye": (
            lambda tq, tk: dense[..., tk - tq : tk, :tk] | torch.eye(tk, dtype=torch.bool)[-tq:],
            True,
        ),
    }
    for name, (mask, causal) in cases.items():
        mha.backend = "reference"
        with torch.no_grad():
            want = mha(x, mask=mask(9, 9), causal=causal)
        mha.backend = backend
        for kind, make in _caches(mha, 2).items():
            cache = make()
            # flex reads no cache view; sdpa no pages and no int8/float8 rows: refused by name,
            # and the refused call holds nothing. (On the CPU flex runs inference only.)
            views = "Streaming" not in kind  # a float streaming cache hands over tensors
            if backend == "flex" and not views:
                continue  # (torch compiles FlexAttention per shape on the CPU: slow, and tested)
            if (backend == "flex" and views) or (
                backend == "sdpa" and ("int8" in kind or "Paged" in kind)
            ):
                with (
                    torch.no_grad(),
                    pytest.raises(attnkit.BackendError, match=f"{backend} +cannot"),
                ):
                    mha(x[:, :4], mask=mask(4, 4), causal=causal, cache=cache)
                assert cache.length == 0, kind
                continue
            with torch.no_grad():
                got = torch.cat(
                    [
                        mha(x[:, a:e], mask=mask(e - a, e), causal=causal, cache=cache)
                        for a, e in CHUNKS
                    ],
                    1,
                )
            tol = 5e-2 if "int8" in kind else 1e-9
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=f"{name}, {kind}")


# --------------------------------------------------------------------------------------------------
# Refusals


def test_a_view_without_key_value_heads_is_refused_by_name() -> None:
    """Pages of zero key/value heads: a ValueError naming Hkv (a ZeroDivisionError before, from
    the check that H is a multiple of Hkv)."""
    pages = torch.randn(2, 0, 8, 4)
    with pytest.raises(ValueError, match=r"at least one key/value head \(Hkv = k.shape\[1\]"):
        CacheView(pages, pages, [(0, 5), (1, 8)])
    # The dense call says the same of its keys.
    with pytest.raises(ValueError, match="at least one head"):
        attnkit.attention(torch.randn(2, 0, 1, 4), pages, pages)


# --------------------------------------------------------------------------------------------------
# Compiled training with tensor lengths


def _step(backend: str, softcap: float | None, sinks: Tensor | None) -> Callable[..., Tensor]:
    def loss(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> Tensor:
        # (B, T, H, D) views, as a projection's output is laid out before its heads are moved.
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        mask = masks.causal() & masks.key_padding(lengths)
        out = attnkit.attention(q, k, v, mask=mask, backend=backend, softcap=softcap, sinks=sinks)
        return out.square().sum()

    return loss


def test_a_compiled_step_with_int32_lengths_and_transposed_views_equals_the_reference() -> None:
    """One graph for two lengths (``error_on_recompile``), grouped heads, softcap and sinks, int32
    lengths, q, k, v transposed views with gradients asked of q and v only: loss and gradients
    equal the float64 reference."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    sinks = torch.randn(4, generator=gen)
    step = torch.compile(_step("auto", 2.0, sinks), fullgraph=True, dynamic=True)
    spec = _step("reference", 2.0, sinks.double())
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in (10, 14):
            q, k, v = (torch.randn(2, t, h, 8, generator=gen) for h in (4, 2, 2))
            q.requires_grad_()
            v.requires_grad_()
            lengths = torch.tensor([t, t - 4], dtype=torch.int32)
            got = step(q, k, v, lengths)
            dq, dv = torch.autograd.grad(got, (q, v))
            q64, k64, v64 = (x.detach().double() for x in (q, k, v))
            q64.requires_grad_()
            v64.requires_grad_()
            want = spec(q64, k64, v64, lengths)
            wq, wv = torch.autograd.grad(want, (q64, v64))
            assert_close(got.reshape(1), want.reshape(1), conditioning=4.0)
            assert_close(dq, wq, conditioning=4.0)
            assert_close(dv, wv, conditioning=4.0)
        # Lengths outside [0, Tk] are refused when the graph runs (same shapes: no new graph).
        for bad in ([t + 1, 0], [-1, t]):
            with pytest.raises((ValueError, RuntimeError), match=r"lie in \[0, Tk\]|negative"):
                step(q, k, v, torch.tensor(bad, dtype=torch.int32))


def test_flex_refuses_to_train_on_the_cpu_by_name_eager_and_compiled(no_shape_checks: None) -> None:
    """torch's FlexAttention on the CPU is for inference: a call with gradients asked of
    ``backend="flex"`` is a BackendError that says so, eager and compiled (not torch's error from
    inside its kernel). (Without the test suite's shape checks: a call that raises
    while dynamo traces it leaves jaxtyping's checker confused, which users never run.)"""
    q = torch.randn(2, 4, 8, 8, requires_grad=True)
    mask = masks.causal() & masks.key_padding(torch.tensor([8, 5]))
    reason = "flex +cannot: torch's FlexAttention on the CPU computes no gradients"
    with pytest.raises(attnkit.BackendError, match=reason):
        attnkit.attention(q, q, q, mask=mask, backend="flex")

    def loss(q: Tensor, lengths: Tensor) -> Tensor:
        padded = masks.causal() & masks.key_padding(lengths)
        return attnkit.attention(q, q, q, mask=padded, backend="flex").sum()

    torch._dynamo.reset()
    with pytest.raises(attnkit.BackendError, match=reason):
        torch.compile(loss, dynamic=True)(q, torch.tensor([8, 5]))


# --------------------------------------------------------------------------------------------------
# Context parallelism through attention()


def ranks_attend_through_the_door(rank: int, world: int) -> dict[str, str | float]:
    """This rank's largest difference (outputs and gradients of q, k, v) between the ring and the
    all-to-all as ``attention()`` backends on its zigzag shards and its shard of the reference on
    the whole sequence; and what a cache view gets from them."""
    from attnkit.distributed import Layout, register_ring_backend
    from attnkit.distributed.ulysses import UlyssesBackend

    register_ring_backend("door-ring", layout="zigzag")
    attnkit.register_backend(
        "door-ulysses", UlyssesBackend(layout="zigzag", name="door-ulysses"), auto=False
    )
    lay = Layout.zigzag(world)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 32, 8, generator=gen, dtype=F64) for h in (4, 2, 2))
    call = {
        "mask": masks.causal() & masks.key_padding(torch.tensor([11, 13], dtype=torch.int32)),
        "softcap": 2.0,
        "sinks": torch.randn(4, generator=gen, dtype=F64),
    }
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attnkit.attention(*whole, backend="reference", **call)
    wants = [want, *torch.autograd.grad(want.square().sum(), whole)]
    result: dict[str, str | float] = {}
    try:
        for name in ("door-ring", "door-ulysses"):
            shard = [lay.shard(t, rank).clone().requires_grad_() for t in (q, k, v)]
            got = attnkit.attention(*shard, backend=name, **call)
            gots = [got, *torch.autograd.grad(got.square().sum(), shard)]
            result[name] = max(
                float((a - lay.shard(b, rank)).abs().max())
                for a, b in zip(gots, wants, strict=True)
            )
            try:
                attnkit.attention(q[:, :, :1], CacheView(k, v, [(0, 32), (0, 29)]), backend=name)
                result[f"{name} view"] = "served"
            except attnkit.BackendError as err:
                result[f"{name} view"] = str(err)
    finally:
        attnkit.unregister_backend("door-ring")
        attnkit.unregister_backend("door-ulysses")
    return result


def test_ring_and_ulysses_through_attention_equal_the_reference_and_refuse_a_cache() -> None:
    """Two gloo ranks, grouped heads, softcap, sinks and causal padding from an int32 tensor of the
    whole sequence's lengths: each rank's output and gradients equal its shard of the reference,
    through both strategies as backends; a cache view is refused by name, not crashed on."""
    from tests.distributed.harness import run_ranks

    for result in run_ranks(ranks_attend_through_the_door, 2):
        for name in ("door-ring", "door-ulysses"):
            assert isinstance(result[name], float)
            assert result[name] < 1e-12, result
            assert f"backend '{name}' cannot serve this call" in str(result[f"{name} view"])


def test_a_process_whose_first_call_is_compiled_traces_it_in_one_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The call's description is made without its dataclass ``__init__`` after the first call has
    read the class's fields; while torch.compile traced the first call of a process, reading them
    was a graph break (dataclasses.fields), so ``fullgraph=True`` failed on any call."""
    from attnkit._base import records

    monkeypatch.setattr(records, "_DEFAULTS", {})  # as in a new process
    q = torch.randn(2, 4, 8, 8)
    mask = masks.causal() & masks.key_padding(torch.tensor([8, 5]))
    step = torch.compile(
        lambda q: attnkit.attention(q, q, q, mask=mask), fullgraph=True, backend="eager"
    )
    assert_close(step(q), attnkit.attention(q.double(), q.double(), q.double(), mask=mask))


def test_a_compiled_call_on_pages_of_rows_that_share_their_keys_runs() -> None:
    """Two rows of the same stretch of pages, the view passed into a function compiled with
    ``dynamic=True`` (as a compiled module gets a PagedKVCache's view): equal to the reference at
    two lengths. The rows' ends were each a symbol of their own, found equal while tracing, and
    inductor's code named the first row's, which it never bound: NameError."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    pages = torch.randn(8, 2, 4, 8, generator=gen)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    step = torch.compile(lambda q, view: attnkit.attention(q, view, causal=True), dynamic=True)
    for end in (5, 9):
        q = torch.randn(2, 4, 2, 8, generator=gen)
        view = CacheView(pages, pages, [(1, end)] * 2, table)
        with torch.no_grad():
            got = step(q, view)
        assert_close(got, attnkit.attention(q.double(), view.to(F64), causal=True))
