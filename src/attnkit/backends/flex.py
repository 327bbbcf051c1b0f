"""Deprecated: :mod:`attnkit.backends.torch_flex` (under this name the backend was easily taken for
:mod:`attnkit.flex`, FlexAttention's API). Kept for one release: each name read from here warns,
naming the new spelling. The backend's registry name stays ``"flex"``.
"""

from __future__ import annotations

# Through the package: no module under backends/ imports another backend (this one is an alias).
from .. import backends as _package
from .._deprecated import moved_names

__all__: list[str] = []

__getattr__ = moved_names(
    __name__,
    {
        "Flex": (lambda: _package.torch_flex.Flex, "attnkit.backends.torch_flex.Flex"),
        "flex_available": (
            lambda: _package.torch_flex.flex_available,
            "attnkit.backends.torch_flex.flex_available",
        ),
    },
)
