"""The grid flash-attn's own tests run, asked of ``attnkit.flash_attn``: dtypes, odd head sizes,
``seqlen_q != seqlen_k`` (bottom-right), MQA/GQA, causal, local windows, softcap, ALiBi per head
and per batch row, dropout's returned weights, packed sequences with empty ones and generous
``max_seqlen``, paged keys, and the KV-cache call with every row option, rotary tables included.

Every number is checked against the float64 statement of flash-attn's documented math below,
written here from its docstrings (not from attnkit); a row with no visible key gives output 0 and
(attnkit's documented choice) ``softmax_lse = -inf``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import attnkit.flash_attn as fa
from attnkit.testing import assert_close

_Window = tuple[int, int]


def _ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    window: _Window = (-1, -1),
    softcap: float = 0.0,
    slopes: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out (B, Tq, H, Dv), lse (B, H, Tq), probs (B, H, Tq, Tk))`` in float64: flash-attn's
    attention over ``(B, T, H, D)`` inputs, queries aligned bottom-right to the keys."""
    q, k, v = q.double(), k.double(), v.double()
    tq, heads, d = q.shape[1:]
    tk, hkv = k.shape[1:3]
    k = k.repeat_interleave(heads // hkv, dim=2)
    v = v.repeat_interleave(heads // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (d**-0.5 if scale is None else scale)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    diag = torch.arange(tq)[:, None] + (tk - tq)  # each query's key position
    j = torch.arange(tk)[None, :]
    left, right = window
    if causal:
        right = 0
    seen = torch.ones(tq, tk, dtype=torch.bool)
    if left >= 0:
        seen &= j >= diag - left
    if right >= 0:
        seen &= j <= diag + right
    if slopes is not None:
        s = s - slopes.double().reshape(-1, heads, 1, 1) * (diag - j).abs()
    s = s.masked_fill(~seen, -math.inf)
    lse = torch.logsumexp(s, -1)
    probs = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse, probs


def _same_lse(lse: Tensor, want: Tensor, dtype: torch.dtype) -> None:
    """Finite entries within ``dtype``'s tolerance; an empty row's LSE is -inf."""
    assert lse.dtype == torch.float32 or lse.dtype == torch.float64
    empty = torch.isinf(want)
    assert torch.equal(lse[empty], torch.full_like(lse[empty], -math.inf))
    assert_close(lse[~empty], want[~empty], dtype=dtype)


def _grid() -> list[tuple[Any, ...]]:
    """A deterministic slice of flash-attn's product grid, every axis value present."""
    axes = itertools.product(
        [torch.float32, torch.bfloat16, torch.float16],
        [40, 59, 111, 256],
        [(1, 7), (5, 3), (7, 7), (3, 12), (1, 1)],
        [(4, 4), (4, 2), (4, 1)],
        [False, True],
        [(-1, -1), (2, 0), (0, 0), (1, 3), (-1, 1), (3, -1)],
        [(0.0, None), (5.0, None), (0.0, "h"), (3.0, "bh")],
    )
    return [c for n, c in enumerate(axes) if n % 97 == 0]


@pytest.mark.parametrize(
    ("dtype", "d", "lengths", "heads", "causal", "window", "cap_alibi"), _grid()
)
def test_func_matches_flash_attn_math(
    dtype: torch.dtype,
    d: int,
    lengths: tuple[int, int],
    heads: tuple[int, int],
    causal: bool,
    window: _Window,
    cap_alibi: tuple[float, str | None],
) -> None:
    g = torch.Generator().manual_seed(d * 31 + lengths[0])
    (tq, tk), (h, hkv), (softcap, alibi) = lengths, heads, cap_alibi
    q = torch.randn(2, tq, h, d, generator=g).to(dtype)
    k = torch.randn(2, tk, hkv, d, generator=g).to(dtype)
    v = torch.randn(2, tk, hkv, d, generator=g).to(dtype)
    slopes = None if alibi is None else torch.rand(2 if alibi == "bh" else 1, h, generator=g)
    if slopes is not None and alibi == "h":
        slopes = slopes[0]
    out, lse, s_dmask = fa.flash_attn_func(
        q, k, v, 0.0, None, causal, window, softcap, slopes, return_attn_probs=True
    )
    want, want_lse, _ = _ref(q, k, v, causal=causal, window=window, softcap=softcap, slopes=slopes)
    assert out.dtype == dtype
    assert out.is_contiguous()
    assert s_dmask.numel() == 0
    assert lse.shape == (2, h, tq)
    assert lse.dtype == torch.float32
    assert_close(out, want)
    _same_lse(lse, want_lse, dtype)


def test_packed_layouts_are_views_of_the_same_call() -> None:
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 6, 3, 4, 40, generator=g, dtype=torch.float64)
    kv = torch.randn(2, 9, 2, 2, 40, generator=g, dtype=torch.float64)
    q = qkv[:, :, 0]
    got = fa.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(2, 0))
    want, _, _ = _ref(*qkv.unbind(2), causal=True, window=(2, 0))
    assert_close(got, want)
    slopes = torch.rand(4, generator=g, dtype=torch.float64)
    got = fa.flash_attn_kvpacked_func(q, kv, softcap=2.0, alibi_slopes=slopes)
    want, _, _ = _ref(q, *kv.unbind(2), softcap=2.0, slopes=slopes)
    assert_close(got, want)


@pytest.mark.parametrize(
    "kw",
    [
        dict(causal=True),
        dict(window_size=(2, 1), softcap=4.0),
        dict(alibi_slopes="bh", causal=True),
        dict(softmax_scale=0.3, window_size=(-1, 0)),
    ],
    ids=["causal", "window-softcap", "alibi-causal", "scale"],
)
def test_func_gradients_match_flash_attn_math(kw: dict[str, Any]) -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 4, 24, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 6, 2, 24, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 6, 2, 20, generator=g, dtype=torch.float64, requires_grad=True)
    if kw.get("alibi_slopes") == "bh":
        kw = {**kw, "alibi_slopes": torch.rand(2, 4, generator=g, dtype=torch.float64)}
    w = torch.randn(2, 4, 4, 20, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((fa.flash_attn_func(q, k, v, **kw) * w).sum(), (q, k, v))
    ref_kw = dict(
        causal=kw.get("causal", False),
        window=kw.get("window_size", (-1, -1)),
        softcap=kw.get("softcap", 0.0),
        slopes=kw.get("alibi_slopes"),
        scale=kw.get("softmax_scale"),
    )
    want = torch.autograd.grad((_ref(q, k, v, **ref_kw)[0] * w).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


def test_dropout_returns_the_softmax_and_drops_its_entries() -> None:
    """``return_attn_probs`` with dropout: ``S_dmask`` is the softmax before dropout, and with the
    values an identity each output row shows the dropped weights: 0 or ``p / (1 - dropout_p)``."""
    g = torch.Generator().manual_seed(4)
    batch, tq, tk, h = 2, 5, 8, 2
    q = torch.randn(batch, tq, h, 16, generator=g, dtype=torch.float64)
    k = torch.randn(batch, tk, h, 16, generator=g, dtype=torch.float64)
    v = torch.eye(tk, dtype=torch.float64)[None, :, None, :].expand(batch, tk, h, tk)
    torch.manual_seed(0)
    out, lse, probs = fa.flash_attn_func(q, k, v, 0.4, causal=True, return_attn_probs=True)
    torch.manual_seed(0)
    again = fa.flash_attn_func(q, k, v, 0.4, causal=True)
    _, want_lse, want_probs = _ref(q, k, v, causal=True)
    assert probs.shape == (batch, h, tq, tk)
    assert_close(probs, want_probs)
    assert_close(lse, want_lse)
    assert torch.equal(out, again)
    kept = out.permute(0, 2, 1, 3)  # (B, H, Tq, Tk): weight j of each row, dropped or scaled
    scaled = want_probs / 0.6
    assert bool(((kept - scaled).abs().lt(1e-12) | kept.eq(0)).all())
    dropped = kept.eq(0) & want_probs.gt(0)
    assert 0 < int(dropped.sum()) < int(want_probs.gt(0).sum())
    cu = _cu([2, 3])  # packed sequences: the output is the same with or without the weights
    torch.manual_seed(1)
    packed, _, _ = fa.flash_attn_varlen_func(
        q[0], k[0, :5], k[0, :5], cu, cu, 3, 3, 0.3, return_attn_probs=True
    )
    torch.manual_seed(1)
    assert torch.equal(
        packed, fa.flash_attn_varlen_func(q[0], k[0, :5], k[0, :5], cu, cu, 3, 3, 0.3)
    )


def test_paged_varlen_dropout_is_the_same_with_or_without_weights() -> None:
    """Packed sequences on pages: asking for the weights changes neither the output of a seed nor
    what the weights are (each sequence's softmax over its own keys, zero across sequences)."""
    g = torch.Generator().manual_seed(12)
    q = torch.randn(5, 2, 16, generator=g, dtype=torch.float64)
    pages = torch.randn(4, 16, 2, 16, generator=g, dtype=torch.float64)
    values = torch.randn(4, 16, 2, 16, generator=g, dtype=torch.float64)
    cq, ck = _cu([2, 3]), _cu([7, 13])
    table = torch.tensor([[0, 3], [1, 2]], dtype=torch.int32)
    torch.manual_seed(0)
    plain = fa.flash_attn_varlen_func(q, pages, values, cq, ck, 3, 13, 0.3, block_table=table)
    torch.manual_seed(0)
    out, _, probs = fa.flash_attn_varlen_func(
        q, pages, values, cq, ck, 3, 13, 0.3, block_table=table, return_attn_probs=True
    )
    assert torch.equal(out, plain)
    keys = [pages[table[s]].flatten(0, 1)[:n] for s, n in enumerate([7, 13])]
    assert probs.shape == (2, 5, 20)
    for s, (qs, ks) in enumerate([(slice(0, 2), slice(0, 7)), (slice(2, 5), slice(7, 20))]):
        _, _, want = _ref(q[None, qs], keys[s][None], keys[s][None])
        assert_close(probs[:, qs, ks], want[0])
    assert not bool(probs[:, :2, 7:].any())
    assert not bool(probs[:, 2:, :7].any())


@pytest.mark.parametrize(
    ("tq", "tk", "causal", "window", "alibi", "softcap"),
    [
        (113, 203, True, (17, 0), "bh", 4.0),
        (256, 512, False, (64, 64), "h", 0.0),
        (300, 1, False, (-1, -1), None, 0.0),
        (239, 239, False, (100, -1), "h", 2.0),
    ],
)
def test_func_across_many_blocks(
    tq: int, tk: int, causal: bool, window: _Window, alibi: str | None, softcap: float
) -> None:
    """Lengths that cross the kernels' blocks unevenly, where a block plan decides what is
    empty, full or partial."""
    g = torch.Generator().manual_seed(tq + tk)
    q = torch.randn(2, tq, 6, 40, generator=g)
    k = torch.randn(2, tk, 2, 40, generator=g)
    v = torch.randn(2, tk, 2, 40, generator=g)
    slopes = (
        None if alibi is None else torch.rand(*((2, 6) if alibi == "bh" else (6,)), generator=g)
    )
    out, lse, _ = fa.flash_attn_func(
        q, k, v, 0.0, None, causal, window, softcap, slopes, return_attn_probs=True
    )
    want, want_lse, _ = _ref(q, k, v, causal=causal, window=window, softcap=softcap, slopes=slopes)
    assert_close(out, want)
    _same_lse(lse, want_lse, torch.float32)


def test_varlen_across_many_blocks() -> None:
    g = torch.Generator().manual_seed(10)
    q_lengths, k_lengths = [64, 0, 130, 7, 200], [129, 1, 257, 63, 0]
    q = torch.randn(sum(q_lengths), 4, 32, generator=g)
    k = torch.randn(sum(k_lengths), 2, 32, generator=g)
    v = torch.randn(sum(k_lengths), 2, 32, generator=g)
    slopes = torch.rand(5, 4, generator=g)
    cq, ck = _cu(q_lengths), _cu(k_lengths)
    out, lse, _ = fa.flash_attn_varlen_func(
        q, k, v, cq, ck, 200, 257, causal=True, window_size=(40, 0), alibi_slopes=slopes,
        softcap=4.0, return_attn_probs=True,
    )  # fmt: skip
    for s in range(5):
        qs, ks = slice(int(cq[s]), int(cq[s + 1])), slice(int(ck[s]), int(ck[s + 1]))
        if not q_lengths[s]:
            continue
        want, want_lse, _ = _ref(
            q[None, qs], k[None, ks], v[None, ks], causal=True, window=(40, 0), softcap=4.0,
            slopes=slopes[s],
        )  # fmt: skip
        assert_close(out[qs], want[0])
        _same_lse(lse[:, qs], want_lse[0], torch.float32)


def _cu(lengths: list[int]) -> Tensor:
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


VARLEN = [
    ([3, 0, 4, 1], [3, 0, 4, 1]),
    ([2, 0, 1, 3], [5, 2, 0, 3]),
    ([1, 3], [4, 0]),
    ([0, 0], [0, 0]),
    ([4], [9]),
]


@pytest.mark.parametrize(("q_lengths", "k_lengths"), VARLEN)
@pytest.mark.parametrize(
    "kw",
    [dict(causal=True), dict(window_size=(1, 0), alibi_slopes="bh"), dict(alibi_slopes="h")],
    ids=["causal", "window-alibi-bh", "alibi-h"],
)
@pytest.mark.parametrize("page", [None, 16, 256])
def test_varlen_matches_each_sequence_alone(
    q_lengths: list[int], k_lengths: list[int], kw: dict[str, Any], page: int | None
) -> None:
    """Each sequence as its own flash_attn_func call (an empty one has no output rows), with
    ``max_seqlen`` larger than any sequence, on packed keys or on pages of 16 or 256."""
    g = torch.Generator().manual_seed(len(q_lengths) + sum(k_lengths))
    n, h, hkv, d = len(q_lengths), 4, 2, 24
    q = torch.randn(sum(q_lengths), h, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(k_lengths), hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(k_lengths), hkv, d, generator=g, dtype=torch.float64)
    alibi = kw.get("alibi_slopes")
    if alibi is not None:
        shape = (n, h) if alibi == "bh" else (h,)
        kw = {**kw, "alibi_slopes": torch.rand(*shape, generator=g, dtype=torch.float64)}
    cq, ck = _cu(q_lengths), _cu(k_lengths)
    keys, values, table = k, v, None
    if page is not None:  # each sequence's keys on pages of a shuffled pool with a spare page
        per = max(1, -(-max(k_lengths) // page))
        table = torch.randperm(n * per + 1, generator=g)[: n * per].view(n, per).to(torch.int32)
        keys = torch.randn(n * per + 1, page, hkv, d, generator=g, dtype=torch.float64)
        values = torch.randn_like(keys)
        for s in range(n):
            for t in range(k_lengths[s]):
                keys[table[s, t // page], t % page] = k[int(ck[s]) + t]
                values[table[s, t // page], t % page] = v[int(ck[s]) + t]
    big_q, big_k = max(q_lengths) + 5, max(k_lengths) + 7
    out, lse, _ = fa.flash_attn_varlen_func(
        q, keys, values, cq, ck, big_q, big_k, return_attn_probs=True, block_table=table, **kw
    )
    assert out.shape == q.shape
    assert lse.shape == (h, q.size(0))
    slopes = kw.get("alibi_slopes")
    for s in range(n):
        qs, ks = slice(int(cq[s]), int(cq[s + 1])), slice(int(ck[s]), int(ck[s + 1]))
        own = slopes[s] if slopes is not None and slopes.ndim == 2 else slopes
        want, want_lse, _ = _ref(
            q[None, qs], k[None, ks], v[None, ks],
            causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)), slopes=own,
        )  # fmt: skip
        assert_close(out[qs], want[0])
        _same_lse(lse[:, qs], want_lse[0], torch.float64)


def test_varlen_packed_layouts_match_the_unpacked_call() -> None:
    g = torch.Generator().manual_seed(6)
    lengths = [3, 0, 5]
    qkv = torch.randn(8, 3, 4, 16, generator=g, dtype=torch.float64)
    cu = _cu(lengths)
    got = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 9, causal=True)
    assert_close(got, fa.flash_attn_varlen_func(*qkv.unbind(1), cu, cu, 9, 9, causal=True))
    kv = torch.randn(10, 2, 2, 16, generator=g, dtype=torch.float64)
    ck = _cu([4, 1, 5])
    got = fa.flash_attn_varlen_kvpacked_func(qkv[:, 0], kv, cu, ck, 5, 5, window_size=(2, 2))
    want = fa.flash_attn_varlen_func(qkv[:, 0], *kv.unbind(1), cu, ck, 5, 5, window_size=(2, 2))
    assert_close(got, want)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, at: Tensor, interleaved: bool) -> Tensor:
    """``x`` ``(T, H, D)`` rotated at positions ``at`` ``(T,)`` in float64, flash-attn's pairs:
    ``(2i, 2i + 1)`` interleaved, else ``(i, i + rotary_dim / 2)``."""
    half = cos.size(1)
    c, s = cos[at].double()[:, None], sin[at].double()[:, None]
    x = x.double()
    if interleaved:
        a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        turned = torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)
    else:
        a, b = x[..., :half], x[..., half : 2 * half]
        turned = torch.cat((a * c - b * s, a * s + b * c), -1)
    return torch.cat((turned, x[..., 2 * half :]), -1)


def _kv_grid() -> list[tuple[Any, ...]]:
    axes = itertools.product(
        [None, 16, 256],  # page size (None: a dense cache)
        [False, True],  # cache_batch_idx
        [False, True],  # cache_leftpad
        [0, 2],  # new tokens
        [1, 3],  # seqlen_q
        [False, True],  # causal
        [(-1, -1), (4, 0)],
        [False, True],  # rotary
        [True, False],  # rotary_interleaved
        [False, True],  # cache_seqlens an int
    )
    keep = []
    for n, c in enumerate(axes):
        page, batch_idx, _, new, _, _, _, rotary = c[:8]
        if (page is not None and batch_idx) or (rotary and not new):
            continue
        if n % 23 == 0 or (rotary and c[2] and n % 5 == 0):
            keep.append(c)
    return keep


@pytest.mark.parametrize(
    (
        "page", "batch_idx", "leftpad", "new", "tq", "causal", "window", "rotary", "interleaved",
        "int_seqlens",
    ),
    _kv_grid(),
)  # fmt: skip
def test_kvcache_matches_flash_attn_math(
    page: int | None,
    batch_idx: bool,
    leftpad: bool,
    new: int,
    tq: int,
    causal: bool,
    window: _Window,
    rotary: bool,
    interleaved: bool,
    int_seqlens: bool,
) -> None:
    """New tokens written in place at ``cache_seqlens`` (nothing else written), rotated at their
    cache index ``cache_seqlens[b] + t`` (``cache_leftpad`` included, as flash-attn's kernel and
    tests do), queries at ``cache_seqlens[b]`` (``+ t`` when causal or local); each row attends
    its keys ``cache_leftpad[b] <= j < cache_seqlens[b] + new``."""
    g = torch.Generator().manual_seed(7 + new + tq)
    batch, h, hkv, d, capacity = 3, 4, 2, 32, 40
    cache_rows = 5 if batch_idx else batch

    def r(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    full_k, full_v = r(cache_rows, capacity, hkv, d), r(cache_rows, capacity, hkv, d)
    q, k, v = r(batch, tq, h, d), r(batch, new, hkv, d), r(batch, new, hkv, d)
    seen = [7, 7, 7] if int_seqlens else [5, 0, 17]
    pad = ([2, 0, 4] if int_seqlens else [2, 0, 9]) if leftpad else [0, 0, 0]
    rows = [3, 0, 4] if batch_idx else [0, 1, 2]
    angles = torch.rand(64, 8, generator=g, dtype=torch.float64) * 6
    cos, sin = angles.cos(), angles.sin()
    slopes = torch.rand(h, generator=g, dtype=torch.float64)
    k_cache, v_cache, table = full_k.clone(), full_v.clone(), None
    if page is not None:
        per = -(-capacity // page)
        table = torch.randperm(batch * per + 1, generator=g)[: batch * per].view(batch, per)
        k_cache = r(batch * per + 1, page, hkv, d)
        v_cache = r(batch * per + 1, page, hkv, d)
        for b, t in itertools.product(range(batch), range(capacity)):
            k_cache[table[b, t // page], t % page] = full_k[b, t]
            v_cache[table[b, t // page], t % page] = full_v[b, t]
    before = k_cache.clone()
    out, lse = fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, k if new else None, v if new else None,
        cos if rotary else None, sin if rotary else None,
        7 if int_seqlens else torch.tensor(seen, dtype=torch.int32),
        torch.tensor(rows, dtype=torch.int32) if batch_idx else None,
        torch.tensor(pad, dtype=torch.int32) if leftpad else None,
        None if table is None else table.to(torch.int32),
        None, causal, window, 0.0, interleaved, slopes, num_splits=3, return_softmax_lse=True,
    )  # fmt: skip
    assert out.shape == (batch, tq, h, d)
    assert lse.shape == (batch, h, tq)
    written = set()
    for b in range(batch):
        n, row = seen[b], rows[b]
        k_new, q_b = k[b], q[b]
        if rotary:
            k_new = _rotate(k[b], cos, sin, torch.arange(new) + n, interleaved)
            steps = torch.arange(tq) if causal or window != (-1, -1) else torch.zeros(tq).long()
            q_b = _rotate(q[b], cos, sin, steps + n, interleaved)
        keys = torch.cat([full_k[row, pad[b] : n], k_new])
        values = torch.cat([full_v[row, pad[b] : n], v[b]])
        want, want_lse, _ = _ref(
            q_b[None], keys[None], values[None], causal=causal, window=window, slopes=slopes
        )
        assert_close(out[b], want[0])
        _same_lse(lse[b], want_lse[0], torch.float64)
        for t in range(n, n + new):
            at = (row, t) if table is None else (int(table[b, t // page]), t % page)
            assert_close(k_cache[at], k_new[t - n])
            written.add(at)
    changed = {tuple(x) for x in (k_cache != before).any(-1).any(-1).nonzero().tolist()}
    assert changed <= written


def test_kvcache_rows_with_no_key_give_zero() -> None:
    """``cache_seqlens`` 0 and no new tokens: the row attends nothing (output 0, LSE -inf), and a
    causal row with more queries than keys leaves its first queries empty."""
    g = torch.Generator().manual_seed(8)
    k_cache = torch.randn(2, 8, 1, 16, generator=g, dtype=torch.float64)
    v_cache = torch.randn(2, 8, 1, 16, generator=g, dtype=torch.float64)
    q = torch.randn(2, 3, 2, 16, generator=g, dtype=torch.float64)
    seqlens = torch.tensor([0, 2], dtype=torch.int32)
    out, lse = fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, causal=True, return_softmax_lse=True
    )
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    want, want_lse, _ = _ref(q[1:], k_cache[1:, :2], v_cache[1:, :2], causal=True)
    assert_close(out[1:], want)
    _same_lse(lse, torch.cat([torch.full_like(want_lse, -math.inf), want_lse]), torch.float64)


def _r(*shape: int) -> Tensor:
    return torch.randn(*shape)


REFUSED: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    ("heads", lambda: fa.flash_attn_func(_r(2, 3, 6, 16), _r(2, 5, 4, 16), _r(2, 5, 4, 16)),
     ValueError, "must be a multiple of the key/value heads"),
    ("dtypes", lambda: fa.flash_attn_func(
        _r(2, 3, 4, 16).half(), _r(2, 5, 4, 16).bfloat16(), _r(2, 5, 4, 16).bfloat16()),
     TypeError, "must share a dtype"),
    ("dropout 1", lambda: fa.flash_attn_func(_r(1, 2, 1, 8), _r(1, 2, 1, 8), _r(1, 2, 1, 8), 1.0),
     ValueError, "dropout_p must be in [0, 1)"),
    ("alibi", lambda: fa.flash_attn_func(
        _r(2, 3, 4, 16), _r(2, 5, 4, 16), _r(2, 5, 4, 16), alibi_slopes=_r(3, 4)),
     ValueError, "alibi_slopes must be (nheads,) = (4,) or (batch, nheads) = (2, 4)"),
    ("cu end", lambda: fa.flash_attn_varlen_func(
        _r(5, 4, 16), _r(5, 4, 16), _r(5, 4, 16), _cu([2, 2]), _cu([2, 3]), 3, 3),
     ValueError, "cu_seqlens_q must start at 0, never decrease and end at the 5 packed tokens"),
    ("cu count", lambda: fa.flash_attn_varlen_func(
        _r(5, 4, 16), _r(5, 4, 16), _r(5, 4, 16), _cu([2, 3]), _cu([5]), 3, 5),
     ValueError, "cu_seqlens_q describes 2 sequences and cu_seqlens_k 1"),
    ("seqlens over", lambda: fa.flash_attn_with_kvcache(
        _r(2, 1, 4, 16), _r(2, 8, 2, 16), _r(2, 8, 2, 16), cache_seqlens=torch.tensor([9, 3])),
     ValueError, "do not fit the cache's 8 positions"),
    ("batch idx", lambda: fa.flash_attn_with_kvcache(
        _r(2, 1, 4, 16), _r(2, 8, 2, 16), _r(2, 8, 2, 16), cache_seqlens=3,
        cache_batch_idx=torch.tensor([0, 2])),
     ValueError, "cache_batch_idx must index the 2 cache rows, got [0, 2]"),
    ("page", lambda: fa.flash_attn_with_kvcache(
        _r(2, 1, 4, 16), _r(4, 16, 2, 16), _r(4, 16, 2, 16), cache_seqlens=torch.tensor([3, 20]),
        block_table=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)),
     ValueError, "block_table[1, 1] = 4 is not a page"),
    ("paged batch idx", lambda: fa.flash_attn_with_kvcache(
        _r(2, 1, 4, 16), _r(4, 16, 2, 16), _r(4, 16, 2, 16), cache_seqlens=3,
        cache_batch_idx=torch.tensor([1, 0]),
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)),
     ValueError, "cache_batch_idx is for a cache of rows, not with block_table"),
    ("num_splits", lambda: fa.flash_attn_with_kvcache(
        _r(2, 1, 4, 16), _r(2, 8, 2, 16), _r(2, 8, 2, 16), cache_seqlens=3, num_splits="2"),
     TypeError, "num_splits must be an int (0: flash-attn's choice), got '2'"),
    ("descale", lambda: fa.flash_attn_with_kvcache(
        _r(2, 1, 4, 16), _r(2, 8, 2, 16), _r(2, 8, 2, 16), cache_seqlens=3,
        k_descale=torch.ones(2, 2)),
     TypeError, "k_descale is for a float8 cache"),
    ("rotary alone", lambda: fa.flash_attn_with_kvcache(
        _r(2, 1, 4, 16), _r(2, 8, 2, 16), _r(2, 8, 2, 16), rotary_cos=_r(8, 4),
        rotary_sin=_r(8, 4), cache_seqlens=3),
     TypeError, "rotary_cos and rotary_sin come together, and with k and v"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "error", "words"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
def test_what_flash_attn_refuses_is_refused_by_name(
    call: Callable[[], object], error: type[Exception], words: str
) -> None:
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value)


def test_kvcache_rotates_bfloat16_in_float32_as_flash_attn() -> None:
    """flash-attn rotates in float32 and rounds once to the cache's dtype: the bfloat16 keys it
    writes are the exact rotation rounded once (a rounding after each product and sum moves
    about a third of them by one step)."""
    g = torch.Generator().manual_seed(9)
    batch, hkv, d, new = 2, 2, 64, 16
    k_cache = torch.zeros(batch, 32, hkv, d, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    q = torch.randn(batch, 1, 4, d, generator=g).bfloat16()
    k = torch.randn(batch, new, hkv, d, generator=g).bfloat16()
    v = torch.randn(batch, new, hkv, d, generator=g).bfloat16()
    angles = torch.rand(32, d // 2, generator=g) * 6
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    for interleaved in (True, False):
        k_cache.zero_()
        fa.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cos, sin, 3, rotary_interleaved=interleaved
        )
        for b in range(batch):
            exact = _rotate(k[b], cos, sin, torch.arange(new) + 3, interleaved).bfloat16()
            differ = k_cache[b, 3 : 3 + new] != exact
            assert float(differ.float().mean()) < 0.01


def test_window_bounds_read_from_numpy_are_ints() -> None:
    """flash-attn's binding takes any integer for a window bound (numpy's, read from a config
    array, included), as attnkit takes numpy numbers for its other arguments."""
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(13)
    q = torch.randn(1, 6, 2, 8, generator=g, dtype=torch.float64)
    got = fa.flash_attn_func(q, q, q, window_size=(np.int64(2), np.int32(0)))
    want, _, _ = _ref(q, q, q, window=(2, 0))
    assert_close(got, want)
