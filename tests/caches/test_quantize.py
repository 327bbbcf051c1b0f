"""Writing keys and values into a quantized cache (``attnkit.caches._quantize``): each element
within the format's step of the input, scales of the documented shapes, saturation with a given
scale, the arguments refused with their values quoted, and attention over what was written equal
to attention over the dequantized values and near the unquantized one."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention
from attnkit.caches._quantize import FLOAT8, quantize_fp8, quantize_int8


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 5


def test_int8_elements_lie_within_half_a_step() -> None:
    x = _x(2, 3, 40, 16)
    xq, scale = quantize_int8(x)
    assert xq.dtype == torch.int8
    assert scale.shape == (2, 3, 40, 1)
    assert scale.dtype == torch.float32
    err = (xq.float() * scale - x).abs()
    assert bool((err <= scale / 2 * (1 + 1e-6)).all())
    # each row's largest magnitude is the format's largest number
    assert torch.equal(xq.abs().amax(-1), torch.full((2, 3, 40), 127, dtype=torch.int8))


def test_int8_rows_of_zeros_stay_zero() -> None:
    x = _x(1, 2, 5, 8)
    x[0, 1, 3] = 0
    xq, scale = quantize_int8(x)
    assert scale[0, 1, 3].item() == 1.0
    assert not xq[0, 1, 3].any()


@pytest.mark.parametrize("dtype", FLOAT8)
def test_float8_elements_within_the_formats_rounding(dtype: torch.dtype) -> None:
    x = _x(2, 3, 40, 16)
    xq, scale = quantize_fp8(x, dtype)
    assert xq.dtype == dtype
    assert scale.shape == (2, 3, 1, 1)
    back = xq.float() * scale
    normal = x.abs() >= torch.finfo(dtype).smallest_normal * scale
    rel = ((back - x).abs() / x.abs())[normal]
    bound = 2.0**-4 if dtype == torch.float8_e4m3fn else 2.0**-3
    assert float(rel.max()) <= bound
    assert float((xq.float().abs().amax((-2, -1)) - torch.finfo(dtype).max).abs().max()) == 0


@pytest.mark.parametrize("dtype", FLOAT8)
def test_float8_with_the_caches_scale_saturates(dtype: torch.dtype) -> None:
    x = _x(1, 2, 10, 8)
    _, scale = quantize_fp8(x[..., :5, :], dtype)
    later = x[..., 5:, :] * 100  # far beyond the first tokens' range
    xq, same = quantize_fp8(later, dtype, scale=scale)
    assert torch.equal(same, scale)
    assert not xq.float().isnan().any()
    assert float(xq.float().abs().max()) == torch.finfo(dtype).max


def test_arguments_refused_with_their_values() -> None:
    with pytest.raises(TypeError, match="x must be a float16, bfloat16, float32 or float64 tensor, "
                       "got int8"):  # fmt: skip
        quantize_int8(torch.zeros(2, 3, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., Hkv, T, D\), got \(5\)"):
        quantize_int8(torch.zeros(5))
    with pytest.raises(TypeError, match=r"dtype must be torch\.float8_e4m3fn or "
                       r"torch\.float8_e5m2, got int8"):  # fmt: skip
        quantize_fp8(torch.zeros(1, 2, 3), torch.int8)
    with pytest.raises(ValueError, match=r"scale must be broadcastable to \(\.\.\., Hkv, 1, 1\) = "
                       r"\(1, 2, 1, 1\), got \(3, 1, 1\)"):  # fmt: skip
        quantize_fp8(torch.zeros(1, 2, 4, 3), scale=torch.ones(3, 1, 1))


@pytest.mark.parametrize("kind", ["int8", "e4m3fn", "e5m2"])
def test_attention_over_a_written_cache(kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 1, 32, generator=g)
    k, v = (torch.randn(2, 2, 200, 32, generator=g) for _ in "kv")
    if kind == "int8":
        (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    else:
        dtype = torch.float8_e4m3fn if kind == "e4m3fn" else torch.float8_e5m2
        (kq, ks), (vq, vs) = quantize_fp8(k, dtype), quantize_fp8(v, dtype)
    out = attention(q, kq, vq, k_scale=ks, v_scale=vs, causal=True)
    deq = attention(
        q.double(), kq.double() * ks, vq.double() * vs, causal=True, backend="reference"
    )
    exact = attention(q.double(), k.double(), v.double(), causal=True, backend="reference")
    torch.testing.assert_close(out.double(), deq, rtol=1e-5, atol=1e-6)
    err = float((out.double() - exact).norm() / exact.norm())
    assert err < {"int8": 2e-2, "e4m3fn": 6e-2, "e5m2": 1.2e-1}[kind]
