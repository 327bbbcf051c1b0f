"""Whether tensors hold NaN or inf: one host read, asked once per call by the checks of a call and
by the kernel that picks its path.

The fastest read is the native kernel's ``torch.ops.attnkit.all_finite``, but the operators live
in :mod:`attnkit._native`, above the call's checks: :mod:`attnkit._native` tells this module, when
it is imported, how to ask whether they are loaded (:func:`use_operator_when`), so imports run one
way. Until then no operator can be loaded, and a sum is read instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from .transforms import transforms_active

__all__ = ["finite", "finite_if_readable", "use_operator_when"]

# How to ask whether the operators are loaded (attnkit._native.loaded), once that module is
# imported; empty before.
_operator_loaded: list[Callable[[], bool]] = []

_OPERATOR_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def use_operator_when(loaded: Callable[[], bool]) -> None:
    """Read with ``torch.ops.attnkit.all_finite`` whenever ``loaded()`` says the operators are
    loaded (what :mod:`attnkit._native` tells this module)."""
    _operator_loaded[:] = [loaded]


def finite(*tensors: Tensor) -> bool:
    """True when none of ``tensors`` holds NaN or inf (one host synchronisation).

    CPU tensors of float32, float64, bfloat16 or float16, once the native kernel is loaded: one
    read of each in one parallel region, exact. Otherwise a sum each: a sum is NaN or inf when
    any term is, and one sum is a fraction of ``isfinite().all()``'s cost. It can also overflow on
    finite values far beyond any activation's scale (1e32 in float32); the answer is then False,
    which only costs the caller its careful path.
    """
    answer = finite_if_readable(*tensors)
    if answer is None:
        raise RuntimeError(
            "attnkit reads whether q, k and v hold NaN or inf before this call (it picks the "
            "kernel that follows the non-finite policy), and torch.func.vmap cannot read a "
            "value: vmap (and vmap over grad, per-example gradients) runs with "
            "backend='reference' or backend='sdpa'; grad, vjp and jacrev run on every backend"
        )
    return answer


def finite_if_readable(*tensors: Tensor) -> bool | None:
    """:func:`finite`, or None where the values cannot be read (under torch.func.vmap): the
    backends that need to know read them themselves."""
    try:
        return _finite(*tensors)
    except RuntimeError:
        if not transforms_active():
            raise
        return None


def _finite(*tensors: Tensor) -> bool:
    if (
        _operator_loaded
        and _operator_loaded[0]()
        and all(t.device.type == "cpu" and t.dtype in _OPERATOR_DTYPES for t in tensors)
    ):
        return bool(torch.ops.attnkit.all_finite([t.detach() for t in tensors]))
    sums = [
        t.detach().sum(dtype=torch.promote_types(t.dtype, torch.float32))
        for t in tensors
        if t.numel()
    ]
    if not sums:
        return True
    total = float(torch.stack(sums).sum()) if len(sums) > 1 else float(sums[0])
    return math.isfinite(total)
