"""attnkit: attention for PyTorch.

One mask convention (bool, True = may attend), a readable reference implementation of every variant,
and fast paths that are tested equal to it.
"""

from . import distributed, masks
from ._checks import AttentionCall
from .attention import (
    Backend,
    BackendError,
    Explanation,
    attention,
    backends,
    explain,
    register_backend,
    unregister_backend,
)
from .capture import AttentionMaps, capture_attention

__version__ = "0.1.0"

__all__ = [
    "AttentionCall",
    "AttentionMaps",
    "Backend",
    "BackendError",
    "Explanation",
    "__version__",
    "attention",
    "backends",
    "capture_attention",
    "distributed",
    "explain",
    "masks",
    "register_backend",
    "unregister_backend",
]
