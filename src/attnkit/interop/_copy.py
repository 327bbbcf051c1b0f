"""What the loaders share: reading a toolkit module's parts and copying them, shapes checked."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor, nn

from .._base.checks import shape_str

_M = TypeVar("_M", bound=nn.Module)


def part(module: nn.Module, name: str, kind: type[_M], who: str) -> _M:
    """``module.<name>``, which must be a ``kind`` (an ``nn.Linear``, a ``Conv1d``, ...)."""
    value = getattr(module, name, None)
    if not isinstance(value, kind):
        raise TypeError(
            f"{who} needs {type(module).__name__}.{name} to be an {kind.__name__}, got "
            f"{type(value).__name__}"
        )
    return value


def tensor(module: nn.Module, name: str, who: str) -> Tensor:
    value = getattr(module, name, None)
    if not isinstance(value, Tensor):
        raise TypeError(
            f"{who} needs {type(module).__name__}.{name} to be a tensor, got {type(value).__name__}"
        )
    return value


def integer(module: nn.Module, name: str, who: str) -> int:
    value = getattr(module, name, None)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{who} needs {type(module).__name__}.{name} to be an int, got {value!r}")
    return value


def dropout_p(module: nn.Module, name: str) -> float:
    """The probability of ``module.<name>`` if it is an ``nn.Dropout``, else 0."""
    value = getattr(module, name, None)
    return float(value.p) if isinstance(value, nn.Dropout) else 0.0


def copy(dst: Tensor, src: Tensor, name: str, who: str) -> None:
    """``dst.copy_(src)`` for same shapes only: ``copy_`` would broadcast a wrong one."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(
            f"{who}: {name} is {shape_str(src.shape)}, expected {shape_str(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src)


def copy_linear(
    dst: nn.Linear, src: nn.Linear, name: str, who: str, *, weight: Tensor | None = None
) -> None:
    """``src``'s weight (or ``weight``, a mapped copy of it) and bias into ``dst``; a missing bias
    is copied as zeros (``x + 0`` is ``x`` exactly)."""
    copy(dst.weight, src.weight if weight is None else weight, f"{name}.weight", who)
    if dst.bias is None:
        if src.bias is not None:
            raise ValueError(f"{who}: {name} has a bias, where the attnkit module has none")
        return
    if src.bias is None:
        with torch.no_grad():
            dst.bias.zero_()
    else:
        copy(dst.bias, src.bias, f"{name}.bias", who)


def halves_from_interleaved(dim: int) -> Tensor:
    """Columns that turn a projection of interleaved encodings (``sin w_0, cos w_0, sin w_1,
    ...``) into one of attnkit's (every sine, then every cosine): ``W[:, halves_from_interleaved(
    dim)]``. See :func:`attnkit.relative_encoding`."""
    return torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])
