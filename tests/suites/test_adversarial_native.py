"""The native CPU kernel (``backend="chunked"`` on a CPU) under inputs a hostile caller picks:
degenerate and odd shapes, grouped heads down to one key/value head for 64 query heads, views
with stride 0, transposed, offset and misaligned data, reduced dtypes, NaN behind a mask, and
calls from several Python threads at once. Every output and gradient equals the float64
reference (threads: bit for bit the single-threaded call)."""

from __future__ import annotations

import threading

import pytest
import torch

from attnkit import BackendError, _native, attention, masks

pytestmark = pytest.mark.skipif(not _native.load(), reason=f"native kernel: {_native.status()[1]}")


def _largest(t: torch.Tensor) -> float:
    return float(t.detach().abs().max()) if t.numel() else 0.0


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tol: float, **kw: object) -> None:
    """Output and gradients of the chunked backend against the float64 reference."""
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attention(*ins, backend="chunked", **kw)  # type: ignore[arg-type]
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    grads = torch.autograd.grad(out, ins, cot) if out.numel() else (None, None, None)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention(*ref_in, backend="reference", **kw)  # type: ignore[arg-type]
    assert _largest(out.double() - ref) <= tol
    if out.numel():
        refs = torch.autograd.grad(ref, ref_in, cot.double())
        for got, want in zip(grads, refs, strict=True):
            assert got is not None
            assert _largest(got.double() - want) <= tol * max(1.0, _largest(want))


SHAPES = [  # B, H, Hkv, Tq, Tk, Dk, Dv
    (1, 1, 1, 1, 1, 1, 1),
    (2, 4, 2, 5, 7, 3, 17),
    (1, 64, 1, 3, 40, 8, 8),
    (1, 2, 1, 1, 3000, 65, 3),
    (1, 2, 2, 130, 257, 17, 65),
    (2, 3, 3, 0, 5, 4, 4),
    (2, 3, 3, 5, 0, 4, 4),
    (0, 2, 2, 5, 5, 4, 4),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_odd_shapes_equal_the_reference(shape: tuple[int, ...], causal: bool) -> None:
    b, h, hkv, tq, tk, dk, dv = shape
    g = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(b, h, tq, dk, generator=g)
    k, v = torch.randn(b, hkv, tk, dk, generator=g), torch.randn(b, hkv, tk, dv, generator=g)
    _check(q, k, v, 2e-5, causal=causal)


def test_views_of_every_kind_equal_the_reference() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 4, 32, generator=g).transpose(1, 2)  # (B, T, H, D) projections
    _check(x, x, x, 2e-5, causal=True)
    q = torch.randn(1, 1, 1, 32, generator=g).expand(2, 4, 7, 32)  # stride 0
    k = torch.randn(1, 1, 9, 32, generator=g).expand(2, 4, 9, 32)
    _check(q, k, k, 2e-5, causal=True)
    _check(q[:, :, :1], k, k, 2e-5)  # the decode path
    y = torch.randn(2, 4, 32, 9, generator=g).transpose(-1, -2)  # columns not contiguous
    _check(y, y, y, 2e-5)
    z = torch.randn(2, 4, 9, 65, generator=g)[..., 1:]  # a storage offset
    _check(z, z, z, 2e-5)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 1e-2), (torch.bfloat16, 6e-2)])
def test_misaligned_reduced_dtypes_equal_the_reference(dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator().manual_seed(1)
    flat = torch.randn(2 * 4 * 300 * 33 + 1, generator=g).to(dtype)
    x = flat[1:].view(2, 4, 300, 33)  # data starts at an odd element: 2 bytes off alignment
    _check(x[:, :, :40], x, x, tol, causal=True)
    _check(x[:, :, :1], x, x, tol)


def test_nan_behind_a_mask_never_reaches_an_output() -> None:
    g = torch.Generator().manual_seed(2)
    for tq in (1, 20):
        q = torch.randn(2, 4, tq, 16, generator=g)
        k, v = torch.randn(2, 2, 30, 16, generator=g), torch.randn(2, 2, 30, 16, generator=g)
        k[0, 0, 4, 0], v[0, 1, 5, 0] = float("inf"), float("nan")
        _check(q, k, v, 2e-5, mask=masks.key_padding([4, 30]))


def test_calls_from_several_python_threads_equal_the_single_threaded_ones() -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 8, 100, 32, generator=g)
    k, v = (torch.randn(2, 2, 2000, 32, generator=g) for _ in range(2))

    def calls() -> list[torch.Tensor]:
        qq = q.clone().requires_grad_()
        out = attention(qq, k[:, :, :100], v[:, :, :100], backend="chunked", causal=True)
        (dq,) = torch.autograd.grad(out.sum(), qq)
        one = attention(q[:, :, :1], k, v, backend="chunked")
        return [out.detach(), dq, one]

    want = calls()
    got: dict[int, list[torch.Tensor]] = {}

    def work(i: int) -> None:
        for _ in range(2):
            got[i] = calls()

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert sorted(got) == [0, 1, 2, 3]
    for outs in got.values():
        for a, b in zip(outs, want, strict=True):
            assert torch.equal(a, b)


def test_vmap_over_an_inference_call_of_many_queries() -> None:
    # Beyond the decode path's 16 queries the kernel reads whether q, k and v hold NaN or inf
    # before it runs, which vmap cannot: chunked refuses with that reason and auto runs the
    # reference (sdpa refuses an inference call under vmap too).
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 2, 20, 8, generator=g)
    k, v = (torch.randn(3, 1, 20, 8, generator=g) for _ in range(2))
    want = attention(q.double(), k.double(), v.double(), causal=True, backend="reference")
    got = torch.vmap(lambda a, b, c: attention(a, b, c, causal=True))(q, k, v)
    assert _largest(got.double() - want) <= 2e-5
    with pytest.raises(BackendError, match=r"torch\.func\.vmap cannot") as refused:
        torch.vmap(lambda a, b, c: attention(a, b, c, causal=True, backend="chunked"))(q, k, v)
    assert "needs gradients" not in str(refused.value)
