"""Index masks given what a careless or hostile caller passes: each input gives the float64
formula's answer or a clear error that names the argument, never an error from deep in torch."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
@pytest.mark.parametrize("make", [masks.key_indices, lambda i: masks.block_indices(i, block=2)])
def test_wide_unsigned_indices_are_refused_when_made(dtype: torch.dtype, make: object) -> None:
    # torch's CPU kernels take no minimum or comparison of these dtypes: a call would fail in
    # the entries' check with "aminmax_cpu not implemented for 'UInt32'".
    idx = torch.tensor([[[[0, 2], [1, -1]]]]).clamp_min(0).to(dtype)
    with pytest.raises(TypeError, match=rf"int64, int32, int16, int8 or uint8, got {dtype}"):
        make(idx)  # type: ignore[operator]


def test_sparse_indices_are_refused_when_made() -> None:
    idx = torch.tensor([[[[0, 2], [1, 0]]]]).to_sparse()
    with pytest.raises(TypeError, match=r"dense \(strided\) tensor .* layout torch.sparse_coo"):
        masks.key_indices(idx)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8])
def test_narrow_integer_indices_equal_int64_ones(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (4, 40, 40))
    idx = torch.randint(0, 40, (1, 1, 4, 3), generator=g)
    for backend in ("reference", "chunked"):
        got = attnkit.attention(q, k, v, mask=masks.key_indices(idx.to(dtype)), backend=backend)
        want = attnkit.attention(q, k, v, mask=masks.key_indices(idx), backend="reference")
        torch.testing.assert_close(got, want)
