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


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_a_block_wider_than_a_cache_rows_keys_is_read_as_its_keys(backend: str) -> None:
    # Rows of 10 and 6 keys on pages: a block of 2^62 keys is each row's keys (a dense call
    # reads it as Tk keys); written out whole it was a tensor of 2^62 offsets.
    g = torch.Generator().manual_seed(3)
    cache = attnkit.PagedKVCache(num_blocks=8, page_size=4, num_kv_heads=2, head_dim=8, max_seqs=2)
    cache.schedule([10, 6])
    cache.stage(*(torch.randn(2, 2, 10, 8, generator=g) for _ in range(2)))
    cache.commit()
    q = torch.randn(2, 4, 3, 8, generator=g)
    idx = torch.zeros(2, 1, 3, 2, dtype=torch.long)
    idx[0, ..., 1] = -1  # none, beside the block
    mask = masks.block_indices(idx, block=2**62) & masks.causal()
    got = attnkit.attention(q, cache.view(), None, mask=mask, backend=backend)
    for n in range(2):
        k, v = (t.double() for t in cache.view().row(n))
        want = attnkit.attention(q[n : n + 1].double(), k, v, causal=True, backend="reference")
        torch.testing.assert_close(got[n : n + 1].double(), want, atol=1e-5, rtol=1e-5)


def test_values_of_no_dims_are_gathered_forward_and_backward() -> None:
    # float64 takes torch's sparse products: the backward's reshape(-1, 0) of the output's
    # gradient (no elements) had no size to infer.
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64) for n in (3, 40))
    v = torch.zeros(1, 2, 40, 0, dtype=torch.float64)
    q.requires_grad_()
    k.requires_grad_()
    idx = torch.randint(-1, 40, (1, 1, 3, 4), generator=g)
    grads = []
    for backend in ("chunked", "reference"):
        out = attnkit.attention(q, k, v, mask=masks.key_indices(idx), backend=backend)
        assert out.shape == (1, 2, 3, 0)
        grads.append(torch.autograd.grad(out.sum(), (q, k)))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)
        assert not a.any()


@pytest.mark.parametrize("backend", ["chunked", "auto"])
def test_torch_func_grad_and_vmap_over_an_index_mask(backend: str) -> None:
    # The gathered kernel's autograd function has no rules for torch.func's transforms: under
    # them the scanning kernel serves the call (it raised "must override the setup_context").
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 2, n, 8, generator=g, dtype=torch.float64) for n in (5, 40, 40))
    mask = masks.key_indices(torch.randint(-1, 40, (1, 1, 5, 4), generator=g)) & masks.causal()

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> torch.Tensor:
        out = attnkit.attention(q[None], k[None], v[None], mask=mask, backend=backend)
        return out.square().sum()

    for n in range(3):
        got = torch.func.grad(loss)(q[n], k[n], v[n], backend)
        want = torch.func.grad(loss)(q[n], k[n], v[n], "reference")
        torch.testing.assert_close(got, want)
    got = torch.func.vmap(lambda *t: attnkit.attention(*t, mask=mask, backend=backend))(
        q[:, None], k[:, None], v[:, None]
    )
    want = attnkit.attention(q, k, v, mask=mask, backend="reference")
    torch.testing.assert_close(got[:, 0], want)
