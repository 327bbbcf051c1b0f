"""Deprecated: :mod:`attnkit.weights` (the name read as activation checkpointing, which this is
not). Kept for one release: each name read from here warns, naming the new spelling.

==================================  ==============================================
old spelling                        use
==================================  ==============================================
``checkpoint.save_checkpoint``      :func:`attnkit.weights.save`
``checkpoint.load_checkpoint``      :func:`attnkit.weights.load`
``checkpoint.load_state_dict``      :func:`attnkit.weights.load_state_dict`
==================================  ==============================================
"""

from __future__ import annotations

from . import weights
from ._deprecated import moved_names

__all__: list[str] = []

__getattr__ = moved_names(
    __name__,
    {
        "save_checkpoint": (lambda: weights.save, "attnkit.weights.save"),
        "load_checkpoint": (lambda: weights.load, "attnkit.weights.load"),
        "load_state_dict": (lambda: weights.load_state_dict, "attnkit.weights.load_state_dict"),
    },
)
