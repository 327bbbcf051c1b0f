"""attnkit's native CPU kernel, as PyTorch operators (``torch.ops.attnkit.*``).

The C++ sources in ``csrc/`` (one concept per file: register tiles, bfloat16 products on the
matrix unit, the position term, the plan's reading, the scores, forward, backward, the decode
path, the finiteness check, the operators' registration) become one library: shipped in a
wheel built with the kernel, else compiled on first use and cached (see
:mod:`attnkit._native.build`). Loading it registers the operators; :mod:`attnkit._native.ops`
adds their fake kernels; :mod:`attnkit._native.kernel` marshals a planned call (its
block plan is :mod:`attnkit._kernel`'s, as is the choice of kernel) into the operators' arguments.

``ATTNKIT_NATIVE=0`` (or ``off``, ``false``, ``no``) turns the kernel off. A kernel that cannot
be loaded or built never breaks an import or a call: calls then run the eager kernel
(:mod:`attnkit._kernel`), a warning says why once, and :func:`status` (what ``explain()``
prints) says why too, without building.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._base.finite import use_operator_when
from .build import cache_dir, state
from .build import load as _load_library
from .build import loaded as _loaded_library

__all__ = ["cache_dir", "load", "loaded", "ready", "state", "status"]


# Set once the operators are loaded and their fake kernels registered (they stay so: a library
# is never unloaded).
_READY: list[bool] = []


def load() -> bool:
    """Make the operators available in this process, building them on first use if needed;
    False when they are not (:func:`status` says why). Never raises. ``ATTNKIT_NATIVE`` is read
    at every call (see :mod:`attnkit._base.env`)."""
    if not _load_library():
        return False
    if not _READY:
        from .ops import register

        register()
        _READY.append(True)
    return True


def ready() -> bool:
    """Whether :func:`load` made the operators available in this process, without reading
    ``ATTNKIT_NATIVE`` again: for a call that the kernel's choice already gave the native kernel
    (which loaded it), in the same call."""
    return bool(_READY)


def loaded() -> bool:
    """Whether the operators are loaded in this process (never loads or builds them; for
    helpers that are only faster with them, such as :func:`attnkit._base.finite.finite`)."""
    return _loaded_library()


# attnkit._base.finite reads with the all_finite operator once it is loaded (that module sits below
# this one, so it is told rather than importing it).
use_operator_when(loaded)


def _status() -> tuple[bool, str]:
    s = state()
    return s.available, s.why


def _constant_while_traced(fn: Callable[[], tuple[bool, str]]) -> Callable[[], tuple[bool, str]]:
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo`` (seconds,
    at every ``import attnkit``): that decorator only marks the function so. (A test checks the
    mark is still torch's.)"""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


# While torch.compile traces a call, the answer is taken as it is now (the files and tools it
# looks at are outside the graph; the operator itself decides again when it runs).
_traced_status = _constant_while_traced(_status)


def status() -> tuple[bool, str]:
    """Whether calls would run the native kernel, and how or why not, without building or
    loading anything (a kernel still to be compiled on first use counts as available)."""
    if torch.compiler.is_compiling():
        return _traced_status()
    return _status()
