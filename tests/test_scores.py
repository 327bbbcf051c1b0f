"""Score terms: the protocol with autograd gradients, and Transformer-XL's term with windows."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import attention, masks, scores
from attnkit.backends import SDPA, Chunked
from attnkit.scores import RelativePositionTerm, ScoreShape, ScoreTerm
from attnkit.testing import assert_close


class T5Bias(ScoreTerm):
    """T5's bucketed relative bias: a learned (buckets, H) table read at the bucket of j - i'."""

    def __init__(self, table: Tensor, max_distance: int = 20) -> None:
        self.table, self.max_distance = table, max_distance

    def inputs(self) -> tuple[Tensor, ...]:
        return (self.table,)

    def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
        (table,) = inputs
        half = table.size(0) // 2
        d = k_pos - q_pos
        exact = half // 2
        scaled = torch.log(d.abs().clamp(min=1).double() / exact) / math.log(
            self.max_distance / exact
        )
        far = (exact + (scaled * (half - exact)).long()).clamp(max=half - 1)
        bucket = torch.where(d.abs() < exact, d.abs(), far) + half * (d > 0)
        return table[bucket].permute(2, 0, 1)  # (H, rows, keys)


def t5_dense(table: Tensor, tq: int, tk: int, max_distance: int = 20) -> Tensor:
    """The same bias written out one pair at a time, from T5's bucketing rule."""
    half = table.size(0) // 2
    exact = half // 2
    out = torch.zeros(table.size(1), tq, tk, dtype=table.dtype)
    for i in range(tq):
        for j in range(tk):
            d = j - (i + tk - tq)
            n = abs(d)
            if n < exact:
                b = n
            else:
                scaled = math.log(n / exact) / math.log(max_distance / exact) * (half - exact)
                b = min(exact + int(scaled), half - 1)
            out[:, i, j] = table[b + (half if d > 0 else 0)]
    return out


@pytest.mark.parametrize("backend", ["reference", "chunked", "sdpa"])
def test_a_t5_bias_written_as_a_term_equals_its_dense_form(backend: str) -> None:
    g = torch.Generator().manual_seed(0)
    table = torch.randn(16, 3, dtype=torch.float64, generator=g)
    q = torch.randn(2, 3, 9, 8, dtype=torch.float64, generator=g)
    kv = torch.randn(2, 3, 40, 8, dtype=torch.float64, generator=g)
    fast = {"chunked": Chunked(block_q=4, block_k=8), "sdpa": SDPA(block_q=4)}
    chosen = fast.get(backend, backend)
    mask = masks.key_padding([40, 29])
    dense_table = table.clone().requires_grad_()
    want = attention(q, kv, kv, bias=t5_dense(dense_table, 9, 40), mask=mask)
    if backend == "sdpa":  # no gradients through a term there
        with torch.no_grad():
            got = attention(q, kv, kv, bias=T5Bias(table), mask=mask, backend=chosen)
        assert_close(got, want)
        return
    lazy_table = table.clone().requires_grad_()
    got = attention(q, kv, kv, bias=T5Bias(lazy_table), mask=mask, backend=chosen)
    assert_close(got, want)
    cot = torch.randn(got.shape, dtype=torch.float64, generator=g)
    (want * cot).sum().backward()
    (got * cot).sum().backward()
    assert lazy_table.grad is not None
    assert dense_table.grad is not None
    assert_close(lazy_table.grad, dense_table.grad)


class _KeepingBlock(scores.TermBlock):
    """A dense bias's block that keeps the score gradients it is handed and adds them up only in
    flush(), as the protocol allows."""

    def __init__(self, bias: Tensor, qs: int, qe: int, grads: list[Tensor | None] | None) -> None:
        self.bias, self.qs, self.qe, self.grads = bias, qs, qe, grads
        self.kept: list[tuple[int, int, int, Tensor]] = []

    def tile(self, ks: int, ke: int) -> Tensor:
        return self.bias[:, self.qs : self.qe, ks:ke].detach()

    def backward(self, ks: int, ke: int, ds: Tensor, row0: int) -> None:
        self.kept.append((ks, ke, row0, ds))

    def flush(self) -> None:
        if self.grads is None:
            return
        grad = self.grads[0]
        if grad is None:
            grad = self.grads[0] = torch.zeros_like(self.bias)
        for ks, ke, row0, ds in self.kept:
            r0 = self.qs + row0
            grad[:, r0 : r0 + ds.size(-2), ks:ke] += ds.sum(0)
        self.kept.clear()


class _KeepingTerm(ScoreTerm):
    def __init__(self, bias: Tensor) -> None:
        self.bias = bias  # (H, Tq, Tk)

    def inputs(self) -> tuple[Tensor, ...]:
        return (self.bias,)

    def block(
        self,
        inputs: tuple[Tensor, ...],
        shape: ScoreShape,
        qs: int,
        qe: int,
        key_lo: int,
        key_hi: int,
        *,
        grads: list[Tensor | None] | None,
    ) -> scores.TermBlock:
        return _KeepingBlock(inputs[0], qs, qe, grads)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_a_term_block_may_keep_the_score_gradients_until_flush(softcap: float | None) -> None:
    """The kernel reuses its work buffers from one tile to the next; what it hands a term's block
    must stay the block's own."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 24, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 2, 40, 8, dtype=torch.float64, generator=g) for _ in range(2))
    table = torch.randn(2, 24, 40, dtype=torch.float64, generator=g)
    mask = masks.key_padding([40, 31])
    dense = table.clone().requires_grad_()
    want = attention(q, k, v, bias=dense, mask=mask, softcap=softcap)
    lazy = table.clone().requires_grad_()
    got = attention(
        q,
        k,
        v,
        bias=_KeepingTerm(lazy),
        mask=mask,
        softcap=softcap,
        backend=Chunked(block_q=8, block_k=8),
    )
    assert_close(got, want)
    if softcap is None:  # sdpa: the block's (H, rows, keys) tiles become torch's float mask
        with torch.no_grad():
            served = attention(
                q, k, v, bias=_KeepingTerm(table), mask=mask, backend=SDPA(block_q=8)
            )
        assert_close(served, want)
    cot = torch.randn(got.shape, dtype=torch.float64, generator=g)
    (want * cot).sum().backward()
    (got * cot).sum().backward()
    assert lazy.grad is not None
    assert dense.grad is not None
    assert_close(lazy.grad, dense.grad)


def test_a_term_never_exists_whole_in_the_kernel() -> None:
    seen: list[tuple[int, ...]] = []

    class Spy(ScoreTerm):
        def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
            seen.append((q_pos.size(0), k_pos.size(1)))
            return (k_pos - q_pos).double() * 0.01

    q = torch.randn(1, 2, 64, 8, dtype=torch.float64)
    attention(q, q, q, bias=Spy(), causal=True, backend=Chunked(block_q=16, block_k=8))
    assert max(r * k for r, k in seen) == 16 * 8
    assert len(seen) == 2 + 4 + 6 + 8  # per query block, the key blocks up to the diagonal


@pytest.mark.usefixtures("no_shape_checks")
def test_a_term_that_returns_nonsense_is_named() -> None:
    class Wrong(ScoreTerm):
        def __init__(self, out: object) -> None:
            self.out = out

        def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
            return self.out  # type: ignore[return-value]

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match=r"bias: Wrong\.tile\(\) must return a float tensor"):
        attention(q, q, q, bias=Wrong(torch.ones(4, 4, dtype=torch.long)), backend="chunked")
    with pytest.raises(ValueError, match=re.escape("Wrong.tile() returned (3, 4, 4), which does")):
        attention(q, q, q, bias=Wrong(torch.ones(3, 4, 4)), backend="reference")

    class Inputs(ScoreTerm):
        def inputs(self) -> tuple[Tensor, ...]:
            return ([1.0],)  # type: ignore[return-value]

    with pytest.raises(TypeError, match=r"Inputs\.inputs\(\) must return tensors, item 0 is list"):
        attention(q, q, q, bias=Inputs())


def test_relative_term_with_a_window_table_equals_the_full_table() -> None:
    # With a sliding window only the window's distances are needed; a table of just those (and a
    # max_distance saying where it starts) gives the same attention as the whole table.
    g = torch.Generator().manual_seed(0)
    tq = tk = 30
    qu, k, v, qv = (torch.randn(1, 2, tq, 4, dtype=torch.float64, generator=g) for _ in range(4))
    full = torch.randn(2, tq + tk - 1, 4, dtype=torch.float64, generator=g)  # distances 29..-29
    window = masks.sliding_window(3, right=2)  # distances i' - j in [-2, 3]
    part = full[:, (tk - 1) - 3 : (tk - 1) + 2 + 1]  # rows of distances 3 .. -2
    want = attention(qu, k, v, bias=RelativePositionTerm(qv, full, 0.5), mask=window, scale=0.5)
    for backend in ("reference", Chunked(block_q=4, block_k=5), SDPA(block_q=4)):
        term = RelativePositionTerm(qv, part, 0.5, max_distance=3)
        got = attention(qu, k, v, bias=term, mask=window, scale=0.5, backend=backend)
        assert_close(got, want)
    # The check can fail: the window table read as if it started at the largest distance.
    wrong = attention(qu, k, v, bias=RelativePositionTerm(qv, part, 0.5), mask=window, scale=0.5)
    assert (wrong - want).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("qv", "enc", "scale", "error", "words"),
    [
        ((2, 4, 5, 7), (4, 10, 8), 0.5, ValueError, r"qv \(2, 4, 5, 7\) and enc \(4, 10, 8\)"),
        ((2, 4, 5, 8), (3, 10, 8), 0.5, ValueError, r"qv \(2, 4, 5, 8\) and enc \(3, 10, 8\)"),
        ((2, 4, 5, 8), (10, 8), 0.5, ValueError, r"enc \(10, 8\)"),
        ((2, 4, 5, 8), (4, 10, 8), "legacy", ValueError, r"Tq = 5, Tk = 6 and enc \(4, 10, 8\)"),
        ((4, 5, 8), (4, 10, 8), 0.5, ValueError, r"qv \(4, 5, 8\)"),
        (
            (2, 4, 3, 8),
            (4, 10, 8),
            0.5,
            ValueError,
            r"\(B, H, Tq\) = \(2, 4, 5\), got \(2, 4, 3, 8\)",
        ),
        (
            (3, 4, 5, 8),
            (4, 10, 8),
            0.5,
            ValueError,
            r"\(B, H, Tq\) = \(2, 4, 5\), got \(3, 4, 5, 8\)",
        ),
        ((1, 4, 5, 8), (4, 10, 8), 0.5, ValueError, r"= \(2, 4, 5\), got \(1, 4, 5, 8\)"),
        (
            (2, 2, 5, 8),
            (2, 10, 8),
            0.5,
            ValueError,
            r"\(B, H, Tq\) = \(2, 4, 5\), got \(2, 2, 5, 8\)",
        ),
        ((2, 4, 5, 8), (4, 10, 8), "1", TypeError, r"scale must be a float, got '1'"),
        ((2, 4, 5, 8), (4, 10, 8), math.nan, ValueError, r"scale must be finite, got nan"),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "chunked", "reference", "flex"])
def test_a_relative_term_that_does_not_fit_the_call_is_named(
    qv: tuple[int, ...],
    enc: tuple[int, ...],
    scale: object,
    error: type[Exception],
    words: str,
    backend: str,
) -> None:
    # Each of these reached a kernel and failed there with torch's own words (a bmm's sizes, a
    # reshape, the native kernel's check), or ran: a term is checked before anything reads it.
    q = torch.randn(2, 4, 5, 8)
    k = v = torch.randn(2, 2, 6, 8)

    def call() -> None:
        legacy = scale == "legacy"
        term = RelativePositionTerm(
            torch.randn(*qv),
            torch.randn(*enc),
            0.5 if legacy else scale,
            legacy=legacy,  # type: ignore[arg-type]
        )
        attention(q, k, v, bias=term, backend=backend)

    with pytest.raises(error, match=words):
        call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_relative_term_of_one_table_for_every_head_serves_each_backend(
    dtype: torch.dtype,
) -> None:
    # An enc of one head ran on the reference and flex but failed in the native kernel (float32)
    # and in sdpa; it broadcasts over the heads, with its gradient summed over them.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 2, 6, 8, dtype=torch.float64, generator=g) for _ in range(2))
    qv = torch.randn(2, 4, 5, 8, dtype=torch.float64, generator=g)
    enc = torch.randn(1, 10, 8, dtype=torch.float64, generator=g, requires_grad=True)
    window = masks.sliding_window(3)
    whole = RelativePositionTerm(qv, enc.expand(4, -1, -1), 0.5)
    want = attention(q, k, v, bias=whole, mask=window, backend="reference")
    (want_grad,) = torch.autograd.grad(want.sum(), enc)
    q, k, v, qv = (t.to(dtype) for t in (q, k, v, qv))
    for backend in ("chunked", "reference", "flex", "sdpa"):
        mine = enc.detach().to(dtype).requires_grad_(backend in ("chunked", "reference"))
        got = attention(
            q, k, v, bias=RelativePositionTerm(qv, mine, 0.5), mask=window, backend=backend
        )
        assert_close(got, want.to(dtype))
        if mine.requires_grad:
            (grad,) = torch.autograd.grad(got.sum(), mine)
            assert_close(grad, want_grad.to(dtype))


@pytest.mark.parametrize("mask", [None, "causal", "window", "padding"])
def test_relative_products_per_tile_equal_the_reference(
    monkeypatch: pytest.MonkeyPatch, mask: str | None
) -> None:
    # Over long inputs the position term's product is computed for each tile's keys instead of
    # once per query block, and the sdpa backend asks for the tiles a few keys at a time. Here
    # every product is per tile: outputs and gradients of qv and enc must not change. (The eager
    # kernel; the native kernel's per-visit products are tested in tests/native.)
    windows: list[tuple[int, int]] = []
    set_window = scores._RelativeBlock._set_window

    def spy(block: scores._RelativeBlock, lo: int, hi: int) -> None:
        windows.append((lo, hi))
        set_window(block, lo, hi)

    monkeypatch.setattr(scores._RelativeBlock, "_set_window", spy)
    g = torch.Generator().manual_seed(1)
    b, h, tq, tk, dh = 2, 2, 23, 31, 4
    qu, qv = (torch.randn(b, h, tq, dh, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = (torch.randn(b, h, tk, dh, dtype=torch.float64, generator=g) for _ in range(2))
    enc = torch.randn(h, tq + tk - 1, dh, dtype=torch.float64, generator=g)
    given = {
        None: None,
        "causal": masks.causal(),
        "window": masks.sliding_window(6, right=3),
        "padding": masks.key_padding([31, 12]),
    }[mask]
    leaves = [t.requires_grad_() for t in (qu, k, v, qv, enc)]
    dout = torch.randn(b, h, tq, dh, dtype=torch.float64, generator=g)

    def run(backend: object) -> tuple[Tensor, tuple[Tensor, ...]]:
        term = RelativePositionTerm(qv, enc, 0.5, whole_width=0)
        out = attention(qu, k, v, bias=term, mask=given, scale=0.5, backend=backend)
        return out, torch.autograd.grad(out, leaves, dout) if out.requires_grad else ()

    want, want_grads = run("reference")
    got, got_grads = run(Chunked(block_q=5, block_k=8, native=False))
    assert_close(got, want)
    for a, w in zip(got_grads, want_grads, strict=True):
        assert_close(a, w)
    assert len(windows) > 2 * len(range(0, tq, 5))  # per tile, in the forward and the backward
    with torch.no_grad():
        assert_close(run(SDPA(block_q=8, product_q=4, term_keys=7))[0], want)


def test_windowed_relative_attention_is_dense_band_attention_with_a_window_sized_table() -> None:
    torch.manual_seed(0)
    m = attnkit.RelativeMultiHeadAttention(16, 2, dtype=torch.float64)
    rows: list[int] = []
    m.pos_proj.register_forward_hook(lambda mod, args, out: rows.append(out.size(0)))
    x = torch.randn(2, 50, 16, dtype=torch.float64)
    pad = masks.key_padding([50, 37])
    band = masks.sliding_window_mask(50, left=4, right=3) & masks.padding_mask([50, 37])
    want = m(x, mask=band)  # a dense band: the whole table of 99 distances
    for backend in ("chunked", "reference"):
        got = m(x, mask=masks.sliding_window(4, right=3) & pad, backend=backend)
        assert_close(got, want)
    with torch.no_grad():
        got = m(x, mask=masks.sliding_window(4, right=3) & pad, backend="sdpa")
    assert_close(got, want)
    assert rows == [99] + [4 + 3 + 1] * 3


def test_score_shape_positions_are_bottom_right() -> None:
    shape = ScoreShape((1,), 1, 2, 5, torch.device("cpu"), torch.float32)
    assert shape.q_positions(0, 2).flatten().tolist() == [3, 4]
    assert shape.k_positions(1, 3).flatten().tolist() == [1, 2]


# ------------------------------------------------------------------------------------------------
# A bias by distance


def _distance_dense(table: Tensor, first: int, tq: int, tk: int) -> Tensor:
    """table[..., (k_pos - q_pos) - first] written out one pair at a time (bottom-right)."""
    out = torch.zeros(*table.shape[:-1], tq, tk, dtype=table.dtype)
    for i in range(tq):
        for j in range(tk):
            out[..., i, j] = table[..., j - (i + tk - tq) - first]
    return out


@pytest.mark.parametrize(
    ("lead", "heads", "kv_heads", "tq", "tk", "mask"),
    [
        ((), 4, 4, 37, 53, None),
        ((4,), 4, 2, 53, 37, masks.causal()),
        ((2, 4), 4, 1, 60, 60, masks.sliding_window(9)),
        ((4,), 4, 4, 1, 70, None),  # one query: a decoding step
    ],
)
@pytest.mark.parametrize("backend", ["reference", Chunked(block_q=16, block_k=16), "native=False"])
def test_a_distance_bias_equals_its_dense_form(
    lead: tuple[int, ...],
    heads: int,
    kv_heads: int,
    tq: int,
    tk: int,
    mask: masks.Mask | None,
    backend: object,
) -> None:
    """Values and gradients (the table's included) against the same bias written out, in
    float64; GQA, Tq != Tk both ways, per-batch tables and a table longer than needed."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, tq, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (
        torch.randn(2, kv_heads, tk, 8, dtype=torch.float64, generator=g, requires_grad=True)
        for _ in range(2)
    )
    first = -(tk - 1) - 3
    table = torch.randn(*lead, tq + tk + 5, dtype=torch.float64, generator=g, requires_grad=True)
    if backend == "native=False":
        backend = Chunked(native=False)
    tensors = [q, k, v, table]

    def grads(bias: object, be: object) -> list[Tensor]:
        out = attention(q, k, v, bias=bias, mask=mask, backend=be)  # type: ignore[arg-type]
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
        return [out, *torch.autograd.grad((out * weights).sum(), tensors)]

    got = grads(scores.DistanceBias(table, first), backend)
    want = grads(_distance_dense(table, first, tq, tk), "reference")
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


def test_a_distance_bias_must_hold_every_distance_of_the_call() -> None:
    q = torch.randn(1, 2, 10, 8)
    k = torch.randn(1, 2, 12, 8)
    exact = scores.DistanceBias(torch.randn(21), first=-11)
    attention(q, k, k, bias=exact)
    for table, first, what in (
        (torch.randn(20), -11, "distances -11 to 8, and the call .* -11 to 9"),
        (torch.randn(21), -10, "distances -10 to 10, and the call .* -11 to 9"),
    ):
        with pytest.raises(ValueError, match=what):
            attention(q, k, k, bias=scores.DistanceBias(table, first))
        with pytest.raises(ValueError, match=what):
            attention(q, k, k, bias=scores.DistanceBias(table, first), backend="reference")
    with pytest.raises(ValueError, match=r"has H=3, the call H=2"):
        attention(q, k, k, bias=scores.DistanceBias(torch.randn(3, 21), -11))
    with pytest.raises(TypeError, match="table must be a float tensor"):
        scores.DistanceBias(torch.arange(21), -11)
    with pytest.raises(ValueError, match=r"\(L,\), \(H, L\) or \(B, H, L\)"):
        scores.DistanceBias(torch.randn(1, 1, 1, 21), -11)
    notes = attnkit.explain(q, k, k, bias=exact).notes["chunked"]
    assert "does not fuse" not in " ".join(notes)  # native, or why it is not built
    assert any(n.startswith("native kernel") for n in notes) == attnkit._native.load()
