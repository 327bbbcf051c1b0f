"""The ``ATTNKIT_*`` environment variables, each read one way.

A switch (``ATTNKIT_NATIVE``, ``ATTNKIT_SHAPE_CHECKS``) takes ``1``, ``on``, ``true``, ``yes`` or
``0``, ``off``, ``false``, ``no``, in any case and with spaces around; unset or empty, its
default. A number (``ATTNKIT_BUILD_TIMEOUT``, ``ATTNKIT_BENCH_THREADS``) takes a decimal in its
range. A choice (``ATTNKIT_SHARE``, ``ATTNKIT_BF16_DOTS``) takes one of its words, in any case
and with spaces around.

Any other value warns, naming the variable, the value, what is accepted and the default taken
instead, once per variable and value, and the default runs. Not an error: the variables are read
while ``import attnkit`` runs (``ATTNKIT_SHAPE_CHECKS``) or at every call (``ATTNKIT_NATIVE``), and
an exception there would make the package unusable until the environment is fixed, where the
default is a working choice. Not silence either: ``ATTNKIT_NATIVE=off`` once kept the native
kernel on without a word.

Only the standard library is imported here, so that the package's lowest modules can read their
variables.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from typing import Any

__all__ = ["choice", "number", "switch", "switch_value"]

ON = ("1", "on", "true", "yes")
OFF = ("0", "off", "false", "no")

_warned: set[tuple[str, str]] = set()
_LOCK = threading.Lock()


def switch_value(text: str | None) -> bool | None:
    """What a switch's text says: True, False, or None when it is unset, empty, or no spelling
    of either (:func:`switch` tells those apart)."""
    if text is None:
        return None
    word = text.strip().lower()
    if word in ON:
        return True
    if word in OFF:
        return False
    return None


# The answers of switch() (read at every call, ATTNKIT_NATIVE) for each variable, default and
# entry of the environment as the OS holds it: an entry that changes is read anew. Values that
# warn are not kept (each is read the long way, which warns once per variable and value).
_SWITCHES: dict[tuple[str, bool, object], bool] = {}
_KEYS: dict[str, object] = {}  # each variable's name as os.environ keys its entries


def _entry(name: str) -> tuple[bool, Any]:
    """``(True, raw)``: the environment's own entry for ``name`` (None where unset), what
    ``os.environ.get(name)`` decodes, read without the decoding; ``(False, None)`` where
    ``os.environ`` is not CPython's mapping of them (replaced by a plain mapping)."""
    env = os.environ
    data = getattr(env, "_data", None)
    if type(data) is not dict or not isinstance(env, os._Environ):
        return False, None
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = env.encodekey(name)
    return True, data.get(key)


def switch(name: str, default: bool) -> bool:
    """The switch ``name`` from the environment: ``default`` when unset or empty, or (after a
    warning) when it is no spelling of on or off."""
    direct, raw = _entry(name)
    if direct:
        known = _SWITCHES.get((name, default, raw))
        if known is not None:
            return known
        text = None if raw is None else os.environ.decodevalue(raw)
    else:
        text = os.environ.get(name)
    if text is None or not text.strip():
        value = default
    else:
        spelt = switch_value(text)
        if spelt is None:
            _warn(
                name,
                text,
                f"which is neither on ({', '.join(ON)}) nor off ({', '.join(OFF)}), in any "
                f"case; taken as {'on' if default else 'off'}, the default",
            )
            return default
        value = spelt
    if direct:
        if len(_SWITCHES) >= 64:  # (a process that sets ever new values: kept bounded)
            _SWITCHES.clear()
        _SWITCHES[(name, default, raw)] = value
    return value


def number(name: str, default: float, *, minimum: float, integer: bool = False) -> float:
    """The number ``name`` from the environment, at least ``minimum`` (a whole one with
    ``integer``; ``inf`` is a number, NaN is not): ``default`` when unset or empty, or (after a
    warning) when it is no such number."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        value = math.nan
    if not value >= minimum:  # (NaN too)
        kind = "a whole number" if integer else "a number"
        _warn(name, text, f"which is not {kind} >= {minimum:g}; taken as {default:g}, the default")
        return default
    return value


def choice(name: str, words: tuple[str, ...], default: str) -> str:
    """The choice ``name`` from the environment, one of ``words`` (lower case): ``default`` when
    unset or empty, or (after a warning) when it is none of them."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    word = text.strip().lower()
    if word not in words:
        _warn(name, text, f"which is none of {', '.join(words)}; taken as {default}, the default")
        return default
    return word


def _warn(name: str, text: str, why: str) -> None:
    with _LOCK:
        if (name, text) in _warned:
            return
        _warned.add((name, text))
    warnings.warn(f"attnkit: {name}={text!r}, {why}", RuntimeWarning, stacklevel=3)
