"""Shape annotations, checked at runtime on request, free otherwise.

attnkit annotates public tensors as ``Float[Tensor, "*batch H Tq Dk"]``. jaxtyping is a test extra,
not a runtime dependency: without it the annotations degrade to plain ``Tensor``.

Public functions carry :func:`shape_checked`. With ``ATTNKIT_SHAPE_CHECKS=1`` in the environment
when attnkit is imported (the test suite sets it; you can too, in your own tests) each call is
checked against its annotations by jaxtyping and beartype, so the annotations cannot drift from the
code.
Otherwise the decorator returns the function unchanged: no wrapper, no cost. Where jaxtyping or
beartype cannot be imported the checks cannot run: a warning says so once, at import, and
attnkit runs without them (an import that failed would take the whole package with it).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from .env import switch

if TYPE_CHECKING:
    from jaxtyping import Bool, Float, Int
else:
    try:
        from jaxtyping import Bool, Float, Int
    except ImportError:  # pragma: no cover - exercised only without the test extras

        class _Untyped:
            def __class_getitem__(cls, item: Any) -> Any:
                return item[0]

        Bool = Float = Int = _Untyped

__all__ = ["Bool", "Float", "Int", "shape_checked"]


def _shape_checks() -> bool:
    """Whether ``ATTNKIT_SHAPE_CHECKS`` asks for the checks and their libraries can be
    imported (a warning when it asks and they cannot)."""
    if not switch("ATTNKIT_SHAPE_CHECKS", False):
        return False
    missing = []
    for name in ("jaxtyping", "beartype"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        warnings.warn(
            f"attnkit: ATTNKIT_SHAPE_CHECKS is on, but the shape checks need jaxtyping and "
            f'beartype (pip install "attnkit[test]", or ".[test]" from a checkout) and '
            f"{' and '.join(missing)} cannot be "
            "imported: attnkit runs without the checks",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


SHAPE_CHECKS = _shape_checks()

_F = TypeVar("_F", bound=Callable[..., Any])


def shape_checked(fn: _F) -> _F:
    """Check ``fn``'s jaxtyping annotations on every call when ``ATTNKIT_SHAPE_CHECKS=1``."""
    if not SHAPE_CHECKS:
        return fn
    from beartype import BeartypeConf, beartype
    from jaxtyping import jaxtyped

    # PEP 484's numeric tower: an int where a float is annotated (scale=1), as the code takes it.
    checked = jaxtyped(typechecker=beartype(conf=BeartypeConf(is_pep484_tower=True)))(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # torch.compile/export trace the plain function: the checker's internals do not trace.
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        return checked(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
