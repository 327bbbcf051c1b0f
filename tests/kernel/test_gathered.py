"""The gathered kernel (``attnkit._kernel.gathered``): index masks served by reading each query's
selected keys, against the float64 reference, forward and backward, with every modifier; which
calls it serves and what explain() says; and that a call whose (Tq, Tk) tensor would be large
allocates none."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks
from attnkit._kernel.gathered import Selection, selection
from attnkit.backends import Chunked
from attnkit.caches.view import CacheView
from attnkit.masks import Mask
from attnkit.scores import DistanceBias
from attnkit.testing import assert_close

F64 = torch.float64


def _randn(*shape: int, seed: int, dtype: torch.dtype = F64) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()


def _indices(b: int, h: int, tq: int, k: int, tk: int, seed: int, kind: str = "random") -> Tensor:
    """Random positions (with repeats and -1), or each row's sorted distinct keys, or causal
    ones (each query picks among the keys at or before it, as an indexer's top-k would)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "sorted":
        return torch.rand(b, h, tq, tk, generator=g).argsort(-1)[..., :k].sort(-1).values
    if kind == "causal":
        at = torch.arange(tq).view(1, 1, tq, 1) + (tk - tq) + 1
        return (torch.rand(b, h, tq, k, generator=g) * at).long()
    idx = torch.randint(-1, tk, (b, h, tq, k), generator=g)
    idx[..., 1] = idx[..., 0]  # a repeat in every row
    return idx


def _compare(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask,
    inputs: tuple[Tensor, ...] = (),
    **kwargs: object,
) -> None:
    """The chunked backend (which must take the gathered kernel) against the reference, on the
    outputs, the log-sum-exp and the gradients of every input that needs one."""
    with attnkit.record_dispatch() as calls:
        out, lse = attnkit.attention(
            q, k, v, mask=mask, backend="chunked", return_lse=True, **kwargs
        )
    assert calls[0].kernel is not None
    assert calls[0].kernel.startswith("gathered"), calls[0].kernel
    want, want_lse = attnkit.attention(
        q, k, v, mask=mask, backend="reference", return_lse=True, **kwargs
    )
    assert_close(out, want, dtype=q.dtype)
    assert torch.equal(lse == -torch.inf, want_lse == -torch.inf)
    finite = want_lse > -torch.inf
    assert_close(lse[finite], want_lse[finite], dtype=q.dtype)
    g = torch.Generator().manual_seed(9)
    w, wl = torch.randn(out.shape, generator=g, dtype=F64), torch.randn(lse.shape, generator=g)
    wl = wl.to(F64).masked_fill(~finite, 0.0)
    tensors = (q, k, v, *inputs)

    def loss(o: Tensor, lse_: Tensor) -> Tensor:
        return (o.to(F64) * w).sum() + (lse_.masked_fill(~finite, 0.0).to(F64) * wl).sum()

    got = torch.autograd.grad(loss(out, lse), tensors, retain_graph=True)
    expected = torch.autograd.grad(loss(want, want_lse), tensors)
    for a, e in zip(got, expected, strict=True):
        assert_close(a, e, dtype=q.dtype)


@pytest.mark.parametrize("kind", ["random", "sorted", "causal"])
@pytest.mark.parametrize("heads", [1, 2, 4], ids=lambda h: f"Hi={h}")
def test_index_masks_equal_the_reference(kind: str, heads: int) -> None:
    # 4 query heads on 2 key/value heads; Hi = 1 (shared), Hkv or H selections.
    q, k, v = _randn(2, 4, 24, 8, seed=1), _randn(2, 2, 40, 8, seed=2), _randn(2, 2, 40, 6, seed=3)
    idx = _indices(2, heads, 24, 6, 40, seed=4, kind=kind)
    _compare(q, k, v, masks.key_indices(idx), scale=0.7)
    _compare(q, k, v, masks.key_indices(idx) & masks.causal())


def test_rows_with_no_key_give_zero_and_lse_minus_inf() -> None:
    q, k, v = _randn(1, 2, 12, 4, seed=5), _randn(1, 2, 32, 4, seed=6), _randn(1, 2, 32, 4, seed=7)
    idx = _indices(1, 1, 12, 3, 32, seed=8)
    idx[0, 0, :4] = -1  # no key at all
    idx[0, 0, 4:8] = 31  # keys the causal mask hides from them (queries at 20..23)
    mask = masks.key_indices(idx) & masks.causal()
    out, lse = attnkit.attention(q, k, v, mask=mask, backend="chunked", return_lse=True)
    assert not out[0, :, :8].any()
    assert bool((lse[0, :, :8] == -torch.inf).all())
    _compare(q, k, v, mask)


def test_sinks_with_values_of_no_width() -> None:
    # attention_stats asks the log-sum-exp of a call with values of Dv = 0; with sinks the
    # folding of the sinks inferred a size of 0 elements (-1) and failed
    q, k, sinks = (
        _randn(*shape, seed=seed, dtype=torch.float32).detach()
        for shape, seed in (((2, 4, 24, 8), 9), ((2, 2, 40, 8), 10), ((4,), 11))
    )
    mask = masks.key_indices(_indices(2, 2, 24, 6, 40, seed=12))
    out, lse = attnkit.attention(
        q, k, k[..., :0], mask=mask, sinks=sinks, backend="chunked", return_lse=True
    )
    _, want = attnkit.attention(
        q.double(), k.double(), k.double(), mask=mask, sinks=sinks.double(),
        backend="reference", return_lse=True,
    )  # fmt: skip
    assert out.shape == (2, 4, 24, 0)
    assert_close(lse, want)


CASE = Callable[[Tensor, Tensor], dict[str, object]]


@pytest.mark.parametrize(
    "modifier",
    [
        pytest.param(lambda t, q: {"softcap": 1.5}, id="softcap"),
        pytest.param(lambda t, q: {"sinks": t[0, 0, 0, :4] * 3}, id="sinks"),
        pytest.param(lambda t, q: {"bias": t}, id="bias"),
        pytest.param(lambda t, q: {"bias": t[:, :1, :, :]}, id="bias-broadcast"),
        pytest.param(
            lambda t, q: {"bias": DistanceBias(torch.cat([t[0, :, 0], t[0, :, 1, :15]], -1), -31)},
            id="distance",
        ),
        pytest.param(
            lambda t, q: {
                "score_mod": lambda s, b, h, i, j: s * (1 + t[0, 0, 0, 0]) - (i - j) * 0.05
            },
            id="score_mod",
        ),
    ],
)
def test_every_modifier_equals_the_reference(modifier: CASE) -> None:
    # GQA (4 on 2), Tq < Tk (queries at the last keys), softcap with bias where they stack.
    q, k, v = (
        _randn(2, 4, 16, 8, seed=10),
        _randn(2, 2, 32, 8, seed=11),
        _randn(2, 2, 32, 8, seed=12),
    )
    table = _randn(2, 4, 16, 32, seed=13)
    kwargs = modifier(table, q)
    idx = _indices(2, 2, 16, 5, 32, seed=14, kind="causal")
    mask = masks.key_indices(idx) & masks.causal()
    inputs = () if "softcap" in kwargs else (table,)
    _compare(q, k, v, mask, inputs, **kwargs)


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32-bias"])
def test_one_batch_row_of_one_key_head_shared_by_query_heads(dtype: torch.dtype) -> None:
    # B = 1, Hkv = Hi = 1, H = 4 (an absorbed MLA decode's layout): the queries' rows are one
    # view of q that the sparse products read (float64, or a bias keeps float32 off the native
    # kernel), where they once failed to flatten a chunk.
    q = _randn(1, 4, 3, 8, seed=40, dtype=dtype)
    k, v = _randn(1, 1, 32, 8, seed=41, dtype=dtype), _randn(1, 1, 32, 6, seed=42, dtype=dtype)
    table = _randn(1, 4, 3, 32, seed=43, dtype=dtype)
    idx = _indices(1, 1, 3, 4, 32, seed=44, kind="causal")
    kwargs: dict[str, object] = {"bias": table} if dtype != F64 else {}
    _compare(q, k, v, masks.key_indices(idx) & masks.causal(), (table,) if kwargs else (), **kwargs)


def test_block_indices_and_composition_with_readable_masks() -> None:
    q, k, v = (
        _randn(2, 4, 20, 8, seed=15),
        _randn(2, 2, 64, 8, seed=16),
        _randn(2, 2, 64, 8, seed=17),
    )
    blocks = _indices(2, 2, 20, 3, 16, seed=18)
    dense = torch.rand(2, 1, 20, 64, generator=torch.Generator().manual_seed(19)) > 0.3
    for mask in [
        masks.block_indices(blocks, block=4) & masks.sliding_window(30),
        masks.block_indices(blocks, block=4) & masks.key_padding([64, 41]),
        masks.key_indices(_indices(2, 1, 20, 8, 64, seed=20)) & dense,
        masks.key_indices(_indices(2, 1, 20, 8, 64, seed=21))
        & masks.key_indices(_indices(2, 4, 20, 24, 64, seed=22)),
        masks.key_indices(_indices(2, 1, 20, 6, 64, seed=23))
        | masks.key_indices(_indices(2, 2, 20, 6, 64, seed=24)),
    ]:
        _compare(q, k, v, mask)


def test_float32_and_bfloat16_at_their_tolerances() -> None:
    idx = _indices(1, 1, 64, 16, 256, seed=25, kind="causal")
    mask = masks.key_indices(idx) & masks.causal()
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (
            _randn(1, 4, *s, seed=26 + i, dtype=dtype)
            for i, s in enumerate([(64, 32), (256, 32), (256, 32)])
        )
        out = attnkit.attention(q, k, v, mask=mask, backend="chunked")
        ref = attnkit.attention(
            *(t.detach().double() for t in (q, k, v)), mask=mask, backend="reference"
        )
        assert out.dtype == dtype
        assert_close(out, ref, dtype=dtype)


def test_which_calls_are_gathered_and_what_explain_says() -> None:
    idx = _indices(1, 1, 8, 4, 64, seed=27)
    gathered = masks.key_indices(idx)
    assert selection(None, None, 0.0, 64) is None
    assert selection(masks.causal(), None, 0.0, 64) is None
    assert "dropout" in str(selection(gathered, None, 0.1, 64))
    wide = selection(gathered, None, 0.0, 12)
    assert wide == (
        "each query may attend 4 of Tk = 12 keys: above 25% of them a scan, which reuses each "
        "key across a block of queries, is as fast as a gather"
    )
    odd = masks.from_fn(lambda b, h, i, j: j != 3)
    assert (
        selection(gathered & odd, None, 0.0, 64)
        == "from_fn(<lambda>) cannot be read at the gathered keys"
    )
    assert "beyond its index masks" in str(selection(gathered | masks.causal(), None, 0.0, 64))
    q = torch.randn(1, 2, 8, 16)
    k = torch.randn(1, 2, 64, 16)
    text = str(attnkit.explain(q, k, k, mask=gathered & masks.causal()))
    assert "mask key_indices(indices (1, 1, 8, 4)) & causal()" in text
    assert "gathered: each query's 4 selected keys of Tk = 64 read by position" in text
    text = str(attnkit.explain(q, k, k, mask=gathered & odd))
    assert "index mask scanned, not gathered: from_fn(<lambda>) cannot be read" in text
    # the scanning kernel serves what the gathered one does not, exactly
    out = attnkit.attention(q, k, k, mask=gathered & odd, backend="chunked")
    assert_close(out, attnkit.attention(q, k, k, mask=gathered & odd, backend="reference"))


def test_an_index_mask_anded_with_others_compiles_into_one_graph() -> None:
    # On the rows of a cache the selection is read while tracing: the narrowest of two index
    # masks ANDed with a window was picked by ``min(key=)``, which torch.compile cannot trace
    # (fullgraph=True refused the call). The narrowest gathers, the graph equals the eager call
    # and each row equals the reference over its own keys.
    wide_idx = torch.tensor([0, 2, 4, 8, 11, 12]).view(1, 1, 1, 6)
    narrow_idx = torch.tensor([2, 8, 11, 12]).view(1, 1, 1, 4)

    def both(end: int) -> Mask:  # (entries past a row's keys are ignored on a cache)
        wide, narrow = (
            masks.key_indices(i.masked_fill(i >= end, -1)) for i in (wide_idx, narrow_idx)
        )
        return wide & narrow & masks.sliding_window(6)

    mask = both(16)
    found = selection(mask, None, 0.0, 64)
    assert isinstance(found, Selection)
    assert [c.width for c in found.covers] == [4]
    g = torch.Generator().manual_seed(29)
    k, v = (torch.randn(2, 2, 16, 8, generator=g) for _ in "kv")
    q = torch.randn(2, 4, 1, 8, generator=g)

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        view = CacheView(k, v, kv_range=[(0, 9), (0, 13)])
        return attnkit.attention(q, view, mask=mask, backend="chunked")

    torch._dynamo.reset()
    got = torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v)
    torch._dynamo.reset()
    assert torch.equal(got, call(q, k, v))
    for n, end in enumerate((9, 13)):
        ref = attnkit.attention(
            *(t[n : n + 1].double() for t in (q, k[:, :, :end], v[:, :, :end])),
            mask=both(end),
            backend="reference",
        )
        assert_close(got[n : n + 1], ref, dtype=torch.float32)


def test_a_long_call_allocates_no_query_by_key_tensor() -> None:
    # Tq = Tk = 16384: a (Tq, Tk) bool mask would be 256 MiB, float scores 1 GiB per head.
    tq = tk = 1 << 14
    g = torch.Generator().manual_seed(28)
    q, k, v = (torch.randn(1, 2, tq, 8, generator=g) for _ in range(3))
    idx = _indices(1, 1, tq, 8, tk, seed=29, kind="causal")
    mask = masks.key_indices(idx) & masks.causal()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = attnkit.attention(q, k, v, mask=mask, backend="chunked")
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest < tq * tk // 16, largest  # the largest one allocation, far below (Tq, Tk)
    # a few rows against the formula over their own keys
    for t in (0, 5000, tq - 1):
        keys = sorted(set(idx[0, 0, t].tolist()))
        w = torch.softmax(q[0, 1, t] @ k[0, 1, keys].T / 8**0.5, -1)
        torch.testing.assert_close(out[0, 1, t], w @ v[0, 1, keys], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tq", [8, 16])
def test_nan_in_a_key_no_query_selects_reaches_no_output(tq: int) -> None:
    # A NaN reaches exactly the outputs whose visible keys hold it. Queries that select fewer
    # keys than a row holds (8 x 3 < 32) are gathered without reading every key first (the
    # kernel never reads the NaN); more of them (16 x 3) are read first, and non-finite inputs go
    # to the scanning kernel's careful mode.
    q, k, v = (t.detach() for t in (_randn(1, 2, tq, 4, seed=30), _randn(1, 2, 32, 4, seed=31),
                                    _randn(1, 2, 32, 4, seed=32)))  # fmt: skip
    idx = _indices(1, 1, tq, 3, 32, seed=33).clamp(0, 30)
    k[0, 0, 31] = torch.nan
    v[0, 1, 31] = torch.nan
    mask = masks.key_indices(idx)
    with attnkit.record_dispatch() as calls:
        out = attnkit.attention(q, k, v, mask=mask, backend="chunked")
    assert str(calls[0].kernel).startswith("gathered") == (tq == 8)
    assert bool(out.isfinite().all())
    assert_close(out, attnkit.attention(q, k, v, mask=mask, backend="reference"))


@pytest.mark.parametrize("where", ["key", "value", "query", "inf key"])
def test_a_non_finite_selected_row_of_a_decode_step_reaches_its_outputs(where: str) -> None:
    # A decode step over a long cache: its output is read instead of every key. A NaN or inf in a
    # row the step selects reaches the outputs the formula's reaches, through the careful mode.
    q, k, v = (t.detach().float() for t in (_randn(2, 4, 1, 8, seed=34),
                                            _randn(2, 2, 256, 8, seed=35),
                                            _randn(2, 2, 256, 8, seed=36)))  # fmt: skip
    idx = _indices(2, 1, 1, 16, 256, seed=37, kind="sorted")
    chosen = int(idx[1, 0, 0, 5])
    if where == "key":
        k[1, 0, chosen, 3] = torch.nan
    elif where == "value":
        v[1, 1, chosen, 2] = torch.nan
    elif where == "query":
        q[0, 2, 0, 1] = torch.inf
    else:
        k[1, 1, chosen, 0] = torch.inf
    mask = masks.key_indices(idx)
    with attnkit.record_dispatch() as calls:
        out = attnkit.attention(q, k, v, mask=mask, backend="chunked")
    assert not str(calls[0].kernel).startswith("gathered")
    expected = attnkit.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    assert out.isnan().equal(expected.isnan())
    assert bool(out.isnan().any())
    assert_close(out.nan_to_num(), expected.nan_to_num().float())


def test_a_decode_step_reads_its_selected_keys_only() -> None:
    # One query a row selecting 64 of 4096 keys, its values a view of the keys' rows (a latent
    # cache's layout): neither a pass over every key for NaN nor a copy of the values.
    g = torch.Generator().manual_seed(38)
    latents = torch.randn(2, 1, 4096, 96, generator=g)
    q = torch.randn(2, 8, 1, 96, generator=g)
    idx = torch.randint(0, 4096, (2, 1, 1, 64), generator=g)
    mask = masks.key_indices(idx)
    with torch.profiler.profile(record_shapes=True) as prof:
        out = attnkit.attention(q, latents, latents[..., :64], mask=mask, backend="chunked")
    whole = [
        e.name
        for e in prof.events()
        if e.name in ("attnkit::all_finite", "aten::copy_", "aten::clone")
        and any(len(s) > 2 and 4096 in s for s in e.input_shapes)
    ]
    assert whole == []
    expected = attnkit.attention(
        q.double(), latents.double(), latents[..., :64].double(), mask=mask, backend="reference"
    )
    assert_close(out, expected.float())


# --------------------------------------------------------------------------------------------------
# The native kernel (csrc/gathered.cpp): float32, bfloat16 and float16 calls without a dense
# bias, score term or score_mod


def _compare_native(
    shapes: tuple[tuple[int, ...], ...],
    mask: Mask,
    dtype: torch.dtype = torch.float32,
    **kwargs: object,
) -> None:
    """The chunked backend on ``dtype`` inputs, which must take the native gathered kernel,
    against the float64 reference on the same values: outputs, log-sum-exp and the gradients
    of q, k, v (and sinks), at ``dtype``'s tolerances."""
    low = [_randn(*s, seed=40 + i, dtype=dtype) for i, s in enumerate(shapes)]
    high = [t.detach().double().requires_grad_() for t in low]
    sinks = kwargs.pop("sinks", None)
    low_kw, high_kw = dict(kwargs), dict(kwargs)
    leaves_low, leaves_high = list(low), list(high)
    if isinstance(sinks, Tensor):
        s_low = sinks.detach().to(dtype).requires_grad_()
        s_high = s_low.detach().double().requires_grad_()
        low_kw["sinks"], high_kw["sinks"] = s_low, s_high
        leaves_low.append(s_low)
        leaves_high.append(s_high)
    with attnkit.record_dispatch() as calls:
        out, lse = attnkit.attention(*low, mask=mask, backend="chunked", return_lse=True, **low_kw)
    assert "the native kernel" in str(calls[0].kernel), calls[0].kernel
    want, want_lse = attnkit.attention(
        *high, mask=mask, backend="reference", return_lse=True, **high_kw
    )
    assert out.dtype == dtype
    assert_close(out, want, dtype=dtype)
    assert torch.equal(lse == -torch.inf, want_lse == -torch.inf)
    finite = want_lse > -torch.inf
    assert_close(lse[finite], want_lse[finite], dtype=dtype)
    g = torch.Generator().manual_seed(9)
    w = torch.randn(out.shape, generator=g, dtype=F64)
    wl = torch.randn(lse.shape, generator=g, dtype=F64).masked_fill(~finite, 0.0)

    def loss(o: Tensor, lse_: Tensor) -> Tensor:
        return (o.to(F64) * w).sum() + (lse_.masked_fill(~finite, 0.0).to(F64) * wl).sum()

    got = torch.autograd.grad(loss(out, lse), leaves_low)
    expected = torch.autograd.grad(loss(want, want_lse), leaves_high)
    for a, e in zip(got, expected, strict=True):
        assert a.dtype == dtype
        assert_close(a, e, dtype=dtype)


@pytest.mark.parametrize("kind", ["random", "sorted", "causal"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(1, 2), (2, 2), (4, 2), (1, 4), (1, 1)])
@pytest.mark.parametrize("dim", [64, 24])
def test_native_kernel_equals_the_reference(kind: str, heads: int, kv_heads: int, dim: int) -> None:
    # Hi = 1 (shared by all heads), Hkv, or H selections; MHA, GQA and MQA; rows of 64 (the
    # kernel's unrolled loops) and 24 (its loops of any length) elements.
    shapes = ((2, 4, 40, dim), (2, kv_heads, 96, dim), (2, kv_heads, 96, dim))
    idx = _indices(2, heads, 40, 20, 96, seed=4, kind=kind)
    _compare_native(shapes, masks.key_indices(idx), scale=0.3)
    _compare_native(shapes, masks.key_indices(idx) & masks.causal())


def test_native_kernel_rows_with_no_key_repeats_and_none() -> None:
    idx = _indices(1, 1, 24, 12, 64, seed=8)
    idx[0, 0, :4] = -1  # no key at all
    idx[0, 0, 4:8] = 63  # one key, repeated, that the causal mask hides (queries at 40..43)
    idx[0, 0, 8:12, :6] = idx[0, 0, 8:12, 6:]  # every key twice
    shapes = ((1, 2, 24, 64), (1, 2, 64, 64), (1, 2, 64, 64))
    _compare_native(shapes, masks.key_indices(idx) & masks.causal())


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"softcap": 1.5}, id="softcap"),
        pytest.param({"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}, id="sinks"),
        pytest.param({"softcap": 2.0, "sinks": torch.tensor([1.0, 0.0, -1.0, 3.0])}, id="both"),
    ],
)
def test_native_kernel_softcap_and_sinks(extra: dict[str, object]) -> None:
    shapes = ((2, 4, 32, 64), (2, 2, 80, 64), (2, 2, 80, 64))
    idx = _indices(2, 1, 32, 16, 80, seed=14, kind="causal")
    _compare_native(shapes, masks.key_indices(idx) & masks.causal(), **extra)


def test_native_kernel_bands_key_padding_and_blocks() -> None:
    shapes = ((2, 4, 20, 32), (2, 2, 64, 32), (2, 2, 64, 32))
    blocks = _indices(2, 2, 20, 3, 16, seed=18)
    for mask in [
        masks.block_indices(blocks, block=4) & masks.sliding_window(30),
        masks.block_indices(blocks, block=4) & masks.key_padding([64, 41]) & masks.causal(),
        masks.key_indices(_indices(2, 1, 20, 6, 64, seed=23))
        | masks.key_indices(_indices(2, 2, 20, 6, 64, seed=24)),
    ]:
        _compare_native(shapes, mask)


@pytest.mark.parametrize(
    ("threads", "batch", "heads", "kv_heads", "sel_heads"),
    [
        (1, 1, 4, 2, 1),  # one thread
        (3, 1, 4, 2, 1),  # fewer key/value heads than threads: query parts, their rows summed
        (3, 1, 8, 4, 2),  # more key/value heads than threads, two selections
        (2, 1, 4, 1, 4),  # one key/value head read with four selections, by two threads
        (3, 2, 4, 2, 2),  # batch rows
    ],
)
@pytest.mark.parametrize("dim", [64, 24])
def test_native_backward_cut_across_threads(
    threads: int, batch: int, heads: int, kv_heads: int, sel_heads: int, dim: int
) -> None:
    # The backward's threads own dk and dv rows by key/value head, and where there are fewer
    # (batch row, key/value head) pairs than threads they cut the queries into parts, each adding
    # into rows of its own that are summed at the end: every cut gives the reference's gradients.
    shapes = ((batch, heads, 48, dim), (batch, kv_heads, 128, dim), (batch, kv_heads, 128, dim))
    idx = _indices(batch, sel_heads, 48, 24, 128, seed=50, kind="causal")
    idx[..., :4, :] = -1  # rows with no key
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _compare_native(shapes, masks.key_indices(idx) & masks.causal(), scale=0.3)
        _compare_native(shapes, masks.key_indices(idx) & masks.key_padding([100, 90][:batch]))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_on_token_major_rows_at_a_power_of_two_stride(dtype: torch.dtype) -> None:
    # Keys and values as a model's projections give them, (B, T, Hkv, D) transposed: a key's
    # heads 2 KiB (float32) or 1 KiB apart, which the forward copies into padded runs.
    def rows(seed: int, t: int) -> Tensor:
        return _randn(1, t, 8, 64, seed=seed, dtype=dtype).transpose(1, 2).requires_grad_()

    q, k, v = rows(60, 64), rows(61, 96), rows(62, 96)
    idx = _indices(1, 1, 64, 24, 96, seed=63, kind="causal")
    mask = masks.key_indices(idx) & masks.causal()
    with attnkit.record_dispatch() as calls:
        out = attnkit.attention(q, k, v, mask=mask, backend="chunked")
    assert "the native kernel" in str(calls[0].kernel), calls[0].kernel
    high = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = attnkit.attention(*high, mask=mask, backend="reference")
    assert_close(out, want, dtype=dtype)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    got = torch.autograd.grad((out.to(F64) * w).sum(), (q, k, v))
    expected = torch.autograd.grad((want * w).sum(), high)
    for a, e in zip(got, expected, strict=True):
        assert_close(a, e, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_kernel_reads_reduced_keys_as_they_are(dtype: torch.dtype) -> None:
    shapes = ((1, 4, 48, 64), (1, 2, 256, 64), (1, 2, 256, 64))
    idx = _indices(1, 1, 48, 32, 256, seed=25, kind="causal")
    _compare_native(shapes, masks.key_indices(idx) & masks.causal(), dtype=dtype)


def test_what_the_native_kernel_leaves_to_the_sparse_products() -> None:
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 64, 16)
    idx = _indices(1, 1, 8, 4, 64, seed=27)
    dense = torch.rand(1, 1, 8, 64, generator=torch.Generator().manual_seed(3)) > 0.5
    cases = [
        ({"mask": masks.key_indices(idx)}, "the native kernel"),
        ({"mask": masks.key_indices(idx), "bias": torch.randn(1, 2, 8, 64)},
         "torch's sparse products: the native kernel does not add a dense bias"),
        ({"mask": masks.key_indices(idx) & dense},
         "torch's sparse products: the native kernel reads bands and key masks at the pairs, "
         "not tensor(1, 1, 8, 64)"),
    ]  # fmt: skip
    for kwargs, words in cases:
        text = str(attnkit.explain(q, k, k, **kwargs))  # type: ignore[arg-type]
        assert words in text, text
        with attnkit.record_dispatch() as calls:
            out = attnkit.attention(q, k, k, backend="chunked", **kwargs)  # type: ignore[arg-type]
        assert words in str(calls[0].kernel)
        wide = {n: t.double() if n == "bias" else t for n, t in kwargs.items()}
        ref = attnkit.attention(q.double(), k.double(), k.double(), backend="reference", **wide)  # type: ignore[arg-type]
        assert_close(out, ref, dtype=torch.float32)
    # float64 and Chunked(native=False) take the sparse products too
    with attnkit.record_dispatch() as calls:
        attnkit.attention(q.double(), k.double(), k.double(), mask=masks.key_indices(idx),
                          backend="chunked")  # fmt: skip
    assert "float64" in str(calls[0].kernel)
    text = str(attnkit.explain(q, k, k, mask=masks.key_indices(idx),
                               backend=Chunked(native=False)))  # fmt: skip
    assert "torch's sparse products: Chunked(native=False)" in text
