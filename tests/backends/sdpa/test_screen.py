"""The non-finite screen: torch's output that breaks attnkit's policy (NaN/inf, or a zero row
that neither the mask nor the values explain) is handed over to the kernel, visibly; outputs the
mask or the values explain are trusted."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from attnkit import attention, explain, masks, record_dispatch
from attnkit.backends import SDPA
from attnkit.backends.sdpa.screen import empty_rows, screened, trustworthy
from attnkit.masks import Mask
from attnkit.testing import assert_close


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def reference(q: Tensor, k: Tensor, v: Tensor, **kw: object) -> Tensor:
    out = attention(q.double(), k.double(), v.double(), backend="reference", **kw)  # type: ignore[arg-type]
    assert isinstance(out, Tensor)
    return out


# --------------------------------------------------------------------------------------------------
# The non-finite policy: served, or handed over visibly


def served(q: Tensor, k: Tensor, v: Tensor, backend: SDPA, **kw: object) -> tuple[Tensor, str, int]:
    before = backend.handovers
    with torch.no_grad(), record_dispatch() as calls:
        out = attention(q, k, v, backend=backend, **kw)  # type: ignore[arg-type]
    assert isinstance(out, Tensor)
    (dispatch,) = calls
    return out, dispatch.served_by, backend.handovers - before


@pytest.mark.parametrize("mask", [masks.key_padding([5]), masks.causal()])
def test_nan_in_a_masked_value_is_handed_to_the_kernel(mask: Mask) -> None:
    q, k, v = randn(1, 2, 6, 8, seed=21), randn(1, 2, 6, 8, seed=22), randn(1, 2, 6, 4, seed=23)
    v[0, 1, 5, 2] = math.nan  # the last key: hidden by both masks from every query but the last
    backend = SDPA()
    out, by, handed = served(q, k, v, backend, mask=mask)
    assert (by, handed) == ("chunked", 1)
    want = reference(q, k, v, mask=mask)
    assert torch.equal(out.isnan(), want.isnan())  # NaN exactly where a visible key's value is NaN
    assert_close(out.nan_to_num(), want.nan_to_num())
    assert "hands the call to chunked if torch's output breaks" in str(
        explain(q, k, v, mask=mask, backend=backend)
    )


def test_with_dropout_the_hand_over_goes_to_the_kernel() -> None:
    # The kernel drops in O(T) memory too: no call needs the materialising reference for it.
    q, k, v = randn(1, 1, 4, 8, seed=24), randn(1, 1, 4, 8, seed=25), randn(1, 1, 4, 4, seed=26)
    v[0, 0, 3] = math.nan
    out, by, handed = served(q, k, v, SDPA(), mask=masks.key_padding([3]), dropout_p=0.5)
    assert (by, handed) == ("chunked", 1)
    assert out.isfinite().all()  # the masked NaN never reaches the output


def test_finite_outputs_and_zeros_the_mask_or_values_explain_are_trusted() -> None:
    q, k, v = randn(1, 2, 6, 8, seed=27), randn(1, 2, 6, 8, seed=28), randn(1, 2, 6, 4, seed=29)
    backend = SDPA()
    out, by, handed = served(q, k, v, backend, causal=True)
    assert (by, handed) == ("sdpa", 0)
    v[0, 0] = 0.0  # the first head's output rows are exactly 0: its values explain it
    out, by, handed = served(q, k, v, backend)
    assert (by, handed) == ("sdpa", 0)
    assert torch.equal(out[0, 0], torch.zeros(6, 4))
    rows = torch.ones(6, 6, dtype=torch.bool)
    rows[2] = False  # a query with no visible key: 0 by the mask
    out, by, handed = served(q, k, randn(1, 2, 6, 4, seed=30), backend, mask=rows)
    assert (by, handed) == ("sdpa", 0)
    assert torch.equal(out[0, :, 2], torch.zeros(2, 4))


def test_a_zero_row_nothing_explains_is_handed_over() -> None:
    # A NaN query whose row torch computes as 0 (or NaN): neither mask nor values explain it.
    q, k, v = randn(1, 1, 4, 8, seed=31), randn(1, 1, 4, 8, seed=32), randn(1, 1, 4, 4, seed=33)
    q[0, 0, 1] = math.nan
    out, by, handed = served(q, k, v, SDPA())
    assert (by, handed) == ("chunked", 1)
    assert bool(out[0, 0, 1].isnan().all())
    assert bool(out[0, 0, [0, 2, 3]].isfinite().all())


def test_zero_rows_are_trusted_only_where_the_mask_hides_every_key() -> None:
    out = randn(1, 2, 4, 8, seed=34)
    out[0, 1, 2] = 0.0  # query 2 of head 1: exactly 0
    hidden = torch.ones(4, 6, dtype=torch.bool)
    hidden[2] = False  # query 2 sees no key
    assert empty_rows(hidden)[:, 0].tolist() == [False, False, True, False]  # type: ignore[index]
    assert not screened(out)  # the fast test cannot tell: the exact one can
    assert trustworthy(out, hidden)
    biased = torch.zeros(4, 6).masked_fill(~hidden, -math.inf)  # the same as a float mask
    assert trustworthy(out, biased)
    assert not trustworthy(out, None)  # nothing explains the zero row: torch hid a NaN
    hidden[2, 0] = True
    assert not trustworthy(out, hidden)
    assert empty_rows(None) is None
