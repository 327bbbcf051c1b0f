"""``finite()``: whether tensors hold NaN or inf, read by the native operator once it is loaded,
else by sums."""

from __future__ import annotations

import torch

from attnkit import _native
from attnkit._base.finite import finite, use_operator_when


def test_finite() -> None:
    x = torch.ones(3, 4)
    assert finite(x, x.double(), torch.ones(2, dtype=torch.bfloat16))
    assert finite()  # nothing to look at
    assert finite(torch.empty(0))
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[1, 2] = bad
        assert not finite(x, y)
    # +inf and -inf together are NaN in the sum, still not finite
    y = x.clone()
    y[0, 0], y[0, 1] = float("inf"), -float("inf")
    assert not finite(y)
    # float16 sums in float32: 70000 is more than float16 holds, but it is finite
    assert finite(torch.full((7,), 10000.0, dtype=torch.float16))


def test_the_native_operator_reads_once_attnkit_native_says_it_is_loaded() -> None:
    # Finite values whose float32 sum overflows: the sums read them as not finite, the
    # operator exactly. attnkit._native tells attnkit._base.finite how to ask whether it is loaded.
    big = torch.full((4,), 3e38)
    try:
        use_operator_when(lambda: False)
        assert not finite(big)
        use_operator_when(_native.loaded)
        available = _native.load()
        assert finite(big) is available
    finally:
        use_operator_when(_native.loaded)
