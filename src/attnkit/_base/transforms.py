"""torch.func's transforms and forward-mode derivatives, asked of torch in one place.

Under the transforms (grad, vjp, jacrev, jvp, vmap) tensors are wrappers without storage of their
own, and under vmap no value can be read on the host: code that compares storage or reads values
asks :func:`transforms_active` first. A tensor may carry a forward-mode tangent (torch.func.jvp,
torch.autograd.forward_ad's dual tensors), which only kernels made of torch's differentiable
operations carry on: :func:`carries_tangent`."""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor

__all__ = ["carries_tangent", "tracked_beneath", "transforms_active"]


def transforms_active() -> bool:
    """True inside any of torch.func's transforms."""
    return bool(torch._C._are_functorch_transforms_active())


def tracked_beneath(*tensors: Tensor | None) -> bool:
    """Whether any of ``tensors``, or a tensor it wraps, requires grad. Under ``vmap`` a batched
    tensor says ``requires_grad=False`` even when the tensor it wraps is one that autograd, outside
    the ``vmap``, tracks: the operations run on the wrapped tensor and are recorded there. Ask it
    only where :func:`transforms_active`."""
    functorch = torch._C._functorch
    for t in tensors:
        while t is not None:
            if t.requires_grad:
                return True
            t = functorch.get_unwrapped(t) if functorch.is_functorch_wrapped_tensor(t) else None
    return False


def carries_tangent(*tensors: Tensor | None) -> bool:
    """Whether any of ``tensors`` carries a forward-mode tangent (asked only inside a transform or
    a ``forward_ad.dual_level``: a call outside both pays one test)."""
    if fwAD._current_level < 0 and not transforms_active():
        return False
    return any(t is not None and fwAD.unpack_dual(t).tangent is not None for t in tensors)
