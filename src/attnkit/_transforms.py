"""Whether torch.func's transforms (grad, vjp, jacrev, vmap) are active, asked of torch in one
place. Under them tensors are wrappers without storage of their own, and under vmap no value can
be read on the host: code that compares storage or reads values asks here first."""

from __future__ import annotations

import torch

__all__ = ["transforms_active"]


def transforms_active() -> bool:
    """True inside any of torch.func's transforms."""
    return bool(torch._C._are_functorch_transforms_active())
