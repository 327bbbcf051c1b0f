"""Old spellings kept for one release: each use warns with a ``DeprecationWarning`` that names the
new spelling, then does what the new spelling does.

* :func:`alias`: a function under its old name;
* :func:`alias_method`: a class's old class method or method, attached by the module that now
  holds the function (so that the class's own module need not know it);
* :func:`moved_names`: a module's ``__getattr__`` for the names that moved elsewhere.

Every message starts ``attnkit.<old> is deprecated``, which is what the test suite's warning
filter turns into an error: a test that uses an old spelling without expecting the warning fails.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, Literal, TypeVar

__all__ = ["alias", "alias_method", "message", "moved_names"]

_F = TypeVar("_F", bound=Callable[..., Any])


def message(old: str, new: str) -> str:
    """``attnkit.<old> is deprecated ...: use <new>``, the words every alias warns with."""
    return f"{old} is deprecated and will be removed in the next release: use {new}"


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(message(old, new), DeprecationWarning, stacklevel=stacklevel + 1)


def alias(fn: _F, old: str, new: str) -> _F:
    """``fn`` under the old name ``old``: warns on each call, naming ``new``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _warn(old, new, 2)
        return fn(*args, **kwargs)

    wrapper.__doc__ = f"Deprecated: {new}."
    return wrapper  # type: ignore[return-value]


def alias_method(
    cls: type,
    name: str,
    fn: Callable[..., Any],
    new: str,
    *,
    kind: Literal["classmethod", "method"] = "classmethod",
) -> None:
    """Attach ``cls.<name>``, an old spelling of ``fn`` (named ``new``): a class method whose
    arguments go to ``fn`` as they are, or a method that passes its instance as ``fn``'s first
    argument. Each call warns."""
    old = f"attnkit.{cls.__name__}.{name}"

    def method(*args: Any, **kwargs: Any) -> Any:
        _warn(old, new, 2)
        return fn(*args, **kwargs)

    def through_class(_cls: type, *args: Any, **kwargs: Any) -> Any:
        _warn(old, new, 2)
        return fn(*args, **kwargs)

    chosen = through_class if kind == "classmethod" else method
    chosen.__name__, chosen.__qualname__ = name, f"{cls.__name__}.{name}"
    chosen.__doc__ = f"Deprecated: {new}."
    setattr(cls, name, classmethod(chosen) if kind == "classmethod" else chosen)


def moved_names(
    module: str, moved: dict[str, tuple[Callable[[], object], str]]
) -> Callable[[str], object]:
    """A module ``__getattr__`` for the names that left ``module``: ``moved[name]`` is
    ``(get, new)``, where ``get()`` returns the object and ``new`` spells it. Reading the name
    warns; any other name is an ``AttributeError``, as Python raises."""

    def __getattr__(name: str) -> object:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        get, new = moved[name]
        _warn(f"{module}.{name}", new, 2)
        return get()

    return __getattr__
