"""What the interop tests share."""

from __future__ import annotations

from torch import Tensor

# Loaded modules agree with the toolkits' float64 math to rounding: well under the suite's float64
# tolerance (1e-10), which covers reassociation over thousands of keys.
TIGHT = 1e-12


def agrees(actual: Tensor, expected: Tensor, tol: float = TIGHT) -> float:
    """The largest difference, relative to ``max(1, max |expected|)``; asserted ``<= tol``."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    actual, expected = actual.detach(), expected.detach()
    scale = max(1.0, float(expected.abs().max()))
    err = float((actual - expected).abs().max()) / scale
    assert err <= tol, f"differs by {err:.3g} (relative to max(1, |expected|)), over {tol:g}"
    return err
