"""bfloat16 products in the native kernel (the forward's q k^T and p v, the backward's five
products, on the CPU's matrix unit where it has one, AMX, else as AVX512-BF16's dot products where
it has those; elsewhere the float32 products): equal
to the float64 reference within bfloat16's tolerance, and to the float32 products' result, for
every shape of visit the plan makes (odd starts and ends, ragged tails, groups of query heads,
head sizes that differ)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

import attnkit
from attnkit import _native, attention, masks
from attnkit._native.kernel import BF16_PRODUCTS
from attnkit.backends import Chunked
from attnkit.testing import assert_close

AVAILABLE, WHY = _native.status()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"native kernel: {WHY}")

# The products run in bfloat16 only where the CPU multiplies bfloat16; elsewhere these tests check
# the float32 products of bfloat16 inputs, which must hold as well.
IN_BF16 = BF16_PRODUCTS is not None


def qkv(
    b: int, h: int, hkv: int, tq: int, tk: int, dk: int, dv: int, seed: int = 0
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(b, h, tq, dk, generator=g).bfloat16(),
        torch.randn(b, hkv, tk, dk, generator=g).bfloat16(),
        torch.randn(b, hkv, tk, dv, generator=g).bfloat16(),
    ]


DOCUMENTS = masks.documents([61, 0, 77, 62])
PADDING = masks.key_padding([31, 0])  # the second batch row sees no key
CASES: dict[str, tuple[tuple[int, ...], dict[str, Any], tuple[int, int]]] = {
    # (B, H, Hkv, Tq, Tk, Dk, Dv), attention keywords, blocks
    "causal": ((1, 4, 4, 300, 300, 64, 64), {"causal": True}, (128, 256)),
    "rectangle, groups": ((2, 4, 2, 70, 333, 32, 48), {}, (32, 64)),
    "odd window": ((1, 2, 2, 129, 129, 64, 64), {"mask": masks.sliding_window(37)}, (16, 32)),
    "odd keys, odd widths": ((1, 2, 1, 33, 101, 16, 6), {"causal": True}, (8, 16)),
    "documents": ((1, 2, 2, 200, 200, 128, 128), {"mask": DOCUMENTS}, (32, 48)),
    "padding": ((2, 2, 2, 40, 57, 8, 8), {"mask": PADDING}, (8, 16)),
    "1,024 keys": ((1, 2, 2, 64, 1024, 64, 64), {}, (64, 256)),
    "softcap": ((1, 2, 2, 100, 101, 16, 16), {"softcap": 5.0}, (32, 32)),
    # widths that are multiples of 32 take the products in the tiles directly, 32 x 32 at a time:
    # blocks, visits and lengths that are not
    "tiles, odd blocks": ((2, 6, 2, 77, 203, 96, 32), {"causal": True}, (48, 80)),
    "tiles, softcap": ((1, 2, 1, 50, 61, 32, 64), {"softcap": 4.0, "causal": True}, (16, 48)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_products_equal_the_reference(case: str) -> None:
    shape, kw, (bq, bk) = CASES[case]
    q, k, v = qkv(*shape)
    want = attention(q.double(), k.double(), v.double(), backend="reference", **kw)
    fast = attention(q, k, v, backend=Chunked(block_q=bq, block_k=bk), **kw)
    wide = attention(q, k, v, backend=Chunked(block_q=bq, block_k=bk, register_tiles=False), **kw)
    assert fast.dtype == torch.bfloat16
    assert_close(fast, want)
    # The probabilities rounded to bfloat16 for p v move an output by a few of its own roundings.
    torch.testing.assert_close(fast.double(), wide.double(), atol=2e-2, rtol=2e-2)
    if case == "padding":
        assert fast[1].abs().max() == 0


@pytest.mark.parametrize("unit", [True, False], ids=["bfloat16 products", "float32 products"])
@pytest.mark.parametrize("case", ["causal", "odd window", "padding", "odd keys, odd widths"])
def test_an_inference_call_gives_the_output_of_the_same_call_with_gradients(
    case: str, unit: bool
) -> None:
    # Without gradients the kernel reads the bfloat16 queries as they are and writes the output
    # rounded to bfloat16 (on the matrix unit; elsewhere it converts them itself); with them it
    # takes the queries in float32 and keeps a float32 output for the backward, rounded after.
    # Both round the same float32 numbers.
    shape, kw, (bq, bk) = CASES[case]
    q, k, v = qkv(*shape)
    backend = Chunked(block_q=bq, block_k=bk, register_tiles=unit)
    quick = attention(q, k, v, backend=backend, **kw)
    kept = attention(q.clone().requires_grad_(), k, v, backend=backend, **kw)
    assert quick.dtype == kept.dtype == torch.bfloat16
    assert torch.equal(quick, kept.detach())


def test_explain_says_where_the_products_run() -> None:
    q = torch.zeros(1, 2, 64, 32, dtype=torch.bfloat16)
    said = str(attnkit.explain(q, q, q, causal=True, backend=Chunked()))
    assert ("bfloat16 products on" in said) == IN_BF16
    if IN_BF16:
        assert f"bfloat16 products on {BF16_PRODUCTS}" in said
    wide = str(attnkit.explain(q, q, q, causal=True, backend=Chunked(register_tiles=False)))
    assert "bfloat16 products" not in wide
    assert "bfloat16 products" not in str(attnkit.explain(q.float(), q.float(), q.float()))


def test_a_row_without_keys_is_zero_and_its_lse_minus_infinity() -> None:
    q, k, v = qkv(2, 2, 2, 20, 33, 16, 16)
    out, lse = attention(
        q,
        k,
        v,
        mask=masks.key_padding([33, 0]),
        backend=Chunked(block_q=8, block_k=16),
        return_lse=True,
    )
    assert out[1].abs().max() == 0
    assert torch.isneginf(lse[1]).all()
    assert torch.isfinite(lse[0]).all()


def test_lse_equals_the_reference() -> None:
    q, k, v = qkv(1, 4, 2, 150, 260, 64, 64, seed=3)
    _, lse = attention(q, k, v, causal=True, backend=Chunked(), return_lse=True)
    _, want = attention(
        q.double(), k.double(), v.double(), causal=True, backend="reference", return_lse=True
    )
    torch.testing.assert_close(lse.double(), want, atol=2e-2, rtol=1e-2)


def test_nan_in_a_key_makes_only_the_rows_that_see_it_nan() -> None:
    q, k, v = qkv(1, 2, 2, 64, 64, 16, 16, seed=4)
    k[0, 0, 40, 3] = float("nan")
    out = attention(q, k, v, causal=True, backend=Chunked(block_q=16, block_k=32))
    assert torch.isnan(out[0, 0, 40:]).all()
    assert not torch.isnan(out[0, 0, :40]).any()
    assert not torch.isnan(out[0, 1]).any()


def test_layouts_of_the_callers_tensors() -> None:
    # k and v as views of (B, T, H, D) memory, as projections give: rows strided by H * D.
    q, k, v = qkv(2, 4, 4, 96, 96, 32, 32, seed=5)
    tk, tv = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    got = attention(q, tk, tv, causal=True, backend=Chunked(block_q=32, block_k=64))
    want = attention(q, k, v, causal=True, backend=Chunked(block_q=32, block_k=64))
    assert torch.equal(got, want)


@pytest.mark.skipif(not IN_BF16, reason="this CPU has no bfloat16 products")
def test_on_a_cpu_with_bfloat16_products_the_products_run_there() -> None:
    # Their p v takes the probabilities rounded to bfloat16, so its output differs from the
    # float32 products' in low bits (as torch's own bfloat16 attention does): equal outputs would
    # mean the products never ran there.
    q, k, v = qkv(1, 8, 8, 256, 256, 64, 64, seed=6)
    fast = attention(q, k, v, causal=True, backend=Chunked())
    wide = attention(q, k, v, causal=True, backend=Chunked(register_tiles=False))
    assert not torch.equal(fast, wide)
    torch.testing.assert_close(fast.double(), wide.double(), atol=2e-2, rtol=2e-2)


def grads_of(
    backend: str | Chunked,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dtype: torch.dtype,
    **kw: Any,
) -> list[torch.Tensor]:
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    if isinstance(kw.get("bias"), torch.Tensor):
        kw = {**kw, "bias": kw["bias"].to(dtype)}
    out = attention(leaves[0], leaves[1], leaves[2], backend=backend, **kw)
    cot = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(dtype)
    return [out, *torch.autograd.grad(out, leaves, cot)]


BACKWARD_CASES = {
    **CASES,
    "dropout": ((1, 2, 2, 64, 80, 32, 32), {"causal": True, "dropout_p": 0.3}, (16, 32)),
    "bias": ((1, 2, 2, 48, 70, 16, 16), {"bias": "dense"}, (16, 32)),
}


@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_bf16_backward_equals_the_reference(case: str) -> None:
    shape, kw, (bq, bk) = BACKWARD_CASES[case]
    b, h, hkv, tq, tk, dk, dv = shape
    q, k, v = qkv(b, h, hkv, tq, tk, dk, dv, seed=7)
    kw = dict(kw)
    if kw.get("bias") == "dense":
        kw["bias"] = torch.randn(h, tq, tk, generator=torch.Generator().manual_seed(8)).bfloat16()
    fast = Chunked(block_q=bq, block_k=bk)
    wide = Chunked(block_q=bq, block_k=bk, register_tiles=False)
    if "dropout_p" in kw:  # the same dropout mask in every call: the same seed
        torch.manual_seed(0)
        got = grads_of(fast, q, k, v, torch.bfloat16, **kw)
        torch.manual_seed(0)
        want = grads_of(wide, q, k, v, torch.bfloat16, **kw)
        for a, w in zip(got, want, strict=True):
            torch.testing.assert_close(a.double(), w.double(), atol=3e-2, rtol=3e-2)
        return
    want = grads_of("reference", q, k, v, torch.float64, **kw)
    got = grads_of(fast, q, k, v, torch.bfloat16, **kw)
    for a, w in zip(got, want, strict=True):
        assert a.dtype == torch.bfloat16
        assert_close(a, w)


def test_bf16_gradients_of_shared_heads_sum_every_query_head() -> None:
    # Four query heads per key/value head, split into stretches of query blocks across threads:
    # dk and dv sum every head's and every stretch's part.
    q, k, v = qkv(2, 8, 2, 200, 200, 64, 64, seed=9)
    want = grads_of("reference", q, k, v, torch.float64, causal=True)
    for threads in (1, 2):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = grads_of(Chunked(block_q=16, block_k=64), q, k, v, torch.bfloat16, causal=True)
        finally:
            torch.set_num_threads(previous)
        for a, w in zip(got, want, strict=True):
            assert_close(a, w)


DEGENERATE = [
    # (B, H, Hkv, Tq, Tk, Dk, Dv)
    (1, 2, 2, 40, 37, 8, 0),  # values of width 0
    (0, 2, 2, 40, 37, 8, 8),  # an empty batch
    (1, 2, 2, 40, 1, 2, 2),  # one key
    (1, 2, 2, 40, 37, 2, 1),  # odd value width
    (1, 2, 1, 33, 0, 8, 8),  # no keys
    (1, 2, 2, 40, 37, 3, 5),  # odd key width: no whole words to pack
    # widths in the tiles: one key, few queries against many keys, wide heads (no queries kept
    # in tiles), the last rows of the batch
    (1, 2, 2, 17, 1, 32, 32),
    (2, 4, 1, 19, 1000, 64, 64),
    (1, 1, 1, 33, 17, 256, 96),
    (3, 2, 2, 50, 50, 128, 32),
]


def test_degenerate_shapes_neither_crash_nor_differ_from_the_reference() -> None:
    # In a child process: a product of width 0 handed to the matrix unit's GEMM (or one of a
    # single row or column to the dot products) must not be able to take the test run down.
    code = f"""
import torch, attnkit
from attnkit.backends import Chunked
from attnkit.testing import assert_close
for shape in {DEGENERATE!r}:
    b, h, hkv, tq, tk, dk, dv = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, tq, dk, generator=g).bfloat16().requires_grad_()
    k = torch.randn(b, hkv, tk, dk, generator=g).bfloat16().requires_grad_()
    v = torch.randn(b, hkv, tk, dv, generator=g).bfloat16().requires_grad_()
    out = attnkit.attention(q, k, v, causal=True, backend=Chunked(block_q=16, block_k=16))
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    with torch.no_grad():  # bfloat16 queries in, a bfloat16 output out
        quick = attnkit.attention(q, k, v, causal=True, backend=Chunked(block_q=16, block_k=16))
    assert torch.equal(quick, out.detach()), shape
    want = attnkit.attention(
        q.double(), k.double(), v.double(), causal=True, backend="reference"
    )
    wgrads = torch.autograd.grad(want.sum(), (q, k, v))
    assert_close(out, want)
    for a, w in zip(grads, wgrads):
        assert_close(a, w, dtype=torch.bfloat16)
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
