"""Frozen dataclasses made on every call, without their ``__init__``: :func:`made`.

A frozen dataclass's generated ``__init__`` sets each field through ``object.__setattr__`` (the
class forbids plain assignment): one call a field, which for the call's description (27 fields)
and its kernel spec (21), made on every call, is a sizable part of a small call's time (a decode
step). :func:`made` sets the same fields, defaults included, in one update of the
instance's ``__dict__``: the object is the one ``cls(**values)`` makes (equal, same hash, same
repr) for a class whose ``__init__`` only assigns, the case it is for; a class with a
``__post_init__``, slots or default factories is made by its ``__init__``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch

__all__ = ["made"]

T = TypeVar("T")

# Per class: its fields' defaults, or None where only its __init__ makes it.
_DEFAULTS: dict[type, dict[str, Any] | None] = {}


def _defaults(cls: type) -> dict[str, Any] | None:
    if cls in _DEFAULTS:
        return _DEFAULTS[cls]
    fields = dataclasses.fields(cls)
    plain = (
        dataclasses.is_dataclass(cls)
        and not hasattr(cls, "__post_init__")
        and "__slots__" not in cls.__dict__
        and all(f.default_factory is dataclasses.MISSING and f.init for f in fields)
    )
    found = (
        {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
        if plain
        else None
    )
    _DEFAULTS[cls] = found
    return found


def made(cls: type[T], **values: Any) -> T:
    """``cls(**values)`` for a dataclass ``cls`` whose ``__init__`` only assigns its fields, made
    without calling it: ``values`` name fields of ``cls`` (they are not checked: the caller's
    are), the others take their defaults. While torch.compile traces, ``cls(**values)``."""
    if torch.compiler.is_compiling():
        # First: dynamo cannot trace dataclasses.fields() (a graph break, and under
        # fullgraph=True an error), which a process whose first call is compiled would reach.
        return cls(**values)
    defaults = _DEFAULTS[cls] if cls in _DEFAULTS else _defaults(cls)
    if defaults is None:
        return cls(**values)
    obj: T = object.__new__(cls)
    obj.__dict__.update(defaults)
    obj.__dict__.update(values)
    return obj
