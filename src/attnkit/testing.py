"""Tolerances for comparing attnkit results with the float64 reference, kept in one place.

Every fast path is tested against the ``reference`` backend run in float64 on the *same* (already
rounded) inputs, so the tolerance only has to cover the arithmetic of the dtype under test:

==========  ======  ======  ==============================================================
dtype       atol    rtol    why
==========  ======  ======  ==============================================================
float64     1e-10   1e-10   reassociation only (blocked sums, fused kernels)
float32     2e-5    1e-4    ~1e-7 rounding per operation, summed over up to thousands of keys
bfloat16    3e-2    3e-2    8-bit mantissa: the output itself is rounded to ~0.4%
float16     4e-3    4e-3    11-bit mantissa: the output itself is rounded to ~0.05%
==========  ======  ======  ==============================================================

The figures assume outputs of order 1 (values drawn from a standard normal); :func:`assert_close`
scales ``atol`` by the largest reference magnitude when it is bigger than 1. They also assume
logits (scaled scores plus bias) up to about 16 in magnitude: a logit ``s`` rounded in a dtype moves
its weight by ``|s| * eps``, whatever the kernel, so larger logits need ``conditioning=`` (the
differential fuzzing passes ``max(1, max|s| / 16)``).

The same table judges everything attnkit's tests compare with float64, the differential fuzzing
of ``tests/suites/test_fuzz.py`` included: every backend's output and its gradients (q, k, v,
bias) in each dtype against the reference on the rounded inputs; every module converted to a dtype
against a float64 copy of its *rounded* parameters; and modules kept in float32 and run under
``torch.autocast(dtype=...)``, whose projections round their inputs and weights on the way in (pass
``dtype=`` the autocast dtype there: an output that leaves through a LayerNorm is float32).

float16 and bfloat16 compute the softmax, its running sums and the kernels' backward in float32,
so the error is that of rounding the inputs and the output, not of summing thousands of keys in 8
or 11 bits.

Users who register their own backend can test it the same way::

    expected = attention(q.double(), k.double(), v.double(), backend="reference")
    assert_close(attention(q, k, v, backend="mine"), expected)
"""

from __future__ import annotations

import torch
from torch import Tensor

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 1e-4),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (4e-3, 4e-3),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for results computed in ``dtype``."""
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance for {dtype}; known: {', '.join(map(str, TOLERANCES))}")
    return TOLERANCES[dtype]


def assert_close(
    actual: Tensor,
    expected: Tensor,
    *,
    dtype: torch.dtype | None = None,
    conditioning: float = 1.0,
) -> None:
    """Assert ``actual`` matches the float64 ``expected`` within the tolerance of ``dtype``.

    ``dtype`` defaults to ``actual.dtype``. NaN never matches, and shapes must agree exactly.
    ``conditioning`` (>= 1) widens both tolerances for ill-conditioned inputs, such as logits far
    above 16 in magnitude.
    """
    if not conditioning >= 1.0:
        raise ValueError(f"conditioning must be >= 1, got {conditioning!r}")
    atol, rtol = tolerance(dtype or actual.dtype)
    scale = max(1.0, float(expected.detach().abs().max())) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.to(torch.float64),
        expected.to(torch.float64),
        atol=atol * scale * conditioning,
        rtol=rtol * conditioning,
    )
