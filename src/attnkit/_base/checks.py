"""Argument validation shared by every entry point.

Every check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value),
names the argument, and quotes the shapes or values it saw. Only :func:`check_logits` touches tensor
data (and not on ``device="meta"`` or while torch.compile/export trace), so the checks also run on
meta tensors (which is how ``explain`` and the CLI describe a call without allocating it).
"""

from __future__ import annotations

import argparse
import math
import numbers
from collections.abc import Sequence
from typing import TypeVar, cast

import torch
from torch import Tensor

_T = TypeVar("_T")

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dim_str(size: int | torch.SymInt) -> str:
    """One size in a message, never specialising a symbolic one.

    While torch.compile/export trace with dynamic shapes a size may be a ``SymInt``: ``int()``
    would fix it to the traced value, an f-string would too (a recompilation per length), and
    ``str()`` does not trace. Dynamo cannot tell a symbolic size from a constant one here
    (``isinstance`` and ``type`` both say int), so under dynamo every size prints as ``?``; the
    decisions made from the messages' sizes are unaffected. Non-strict export prints the symbol.
    """
    if torch.compiler.is_dynamo_compiling():
        return "?"
    return str(size)


def one_or(size: int | torch.SymInt, want: int | torch.SymInt) -> bool:
    """Whether ``size`` is 1 or ``want``: a dimension that broadcasts to ``want``.

    Spelled with ``==``, not ``size in (1, want)``: while dynamo traces with dynamic shapes
    ``want`` may be a ``SymInt``, and dynamo answers ``in`` on a tuple holding one by identity
    (``2 in (1, s0)`` is False with ``s0 == 2``), so a right call would be refused.
    """
    return size == 1 or size == want


def shape_str(shape: tuple[int, ...] | torch.Size) -> str:
    """``(2, 8, 128, 64)``: shapes in messages, without the ``torch.Size`` noise."""
    return "(" + ", ".join([dim_str(s) for s in shape]) + ")"


def dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


#: The largest size, length or position torch holds (an int64): every integer argument fits it.
INT_MAX = 2**63 - 1


def check_int(name: str, value: object, *, minimum: int = 1, saturate: bool = False) -> int:
    """``value`` if it is an int (not a bool; numpy's integers count, as Python ints) from
    ``minimum`` to :data:`INT_MAX`, else TypeError/ValueError naming ``name``.

    ``saturate``: for a size that only bounds a window (a sliding window's reach, a block size),
    where any value past every sequence means the same, a larger value is taken as ``INT_MAX``.
    A ``torch.SymInt`` (a length while torch.export traces with dynamic shapes) is an int here.
    """
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        value = int(value)  # numpy's integers (lengths read from an array), as Python's
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if isinstance(value, int) and value > INT_MAX:
        if saturate:
            return INT_MAX
        raise ValueError(f"{name} must be at most 2**63 - 1 = {INT_MAX} (an int64), got {value}")
    return cast(int, value)  # a SymInt stands for an int in the traced program


def int_arg(text: str) -> int:
    """A command-line integer (argparse's ``type=``) that fits an int64, else argparse's error
    with :func:`check_int`'s reason (argparse names the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    try:
        return check_int("the value", value, minimum=-INT_MAX - 1)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def check_lengths(name: str, lengths: object) -> list[int]:
    """A sequence of ints >= 0, each checked; a lone int is a TypeError naming ``name``."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(lengths).__name__}")
    return [check_int(f"{name}[{i}]", n, minimum=0) for i, n in enumerate(lengths)]


def plain_number(value: object) -> object:
    """numpy's real scalars (``np.float32(0.125)``, a rate read from an array) as Python's float or
    int; anything else as it is (a check after this one refuses what is not a number)."""
    if type(value).__module__ == "numpy" and isinstance(value, numbers.Real):
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    return value


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool: a flag given 0, "yes" or None is a mistake, not a truth value."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_positive(name: str, value: object) -> float:
    """``value`` as a float if it is a finite number > 0 (an epsilon, a scale)."""
    value = plain_number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number > 0, got {value!r}")
    if not 0.0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_probability(name: str, value: object) -> float:
    """``value`` as a float if it is a number in [0, 1) (a dropout rate)."""
    value = plain_number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1), got {value!r}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return float(value)


def present(value: _T | None, what: str) -> _T:
    """``value``, known not to be None by the caller's logic (and checked even under ``-O``)."""
    if value is None:
        raise RuntimeError(f"attnkit internal error: {what} is None here; please report it")
    return value


def require_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_float_tensor(name: str, t: object) -> Tensor:
    """``t`` if it is a floating-point tensor, else TypeError naming ``name``."""
    t = require_tensor(name, t)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {dtype_str(t.dtype)}")
    return t


def check_input(
    name: str, t: object, shape: str, width: int | None, params: Tensor | None
) -> Tensor:
    """A module's input: a float ``(B, T, width)`` tensor in the dtype and on the device of the
    module's parameters (of which ``params`` is one; None for a module without any). ``shape``
    writes the layout for the message, e.g. ``"(B, Tq, d_model=8)"``; ``width=None`` leaves the
    last dim to the caller.

    Inside ``torch.autocast`` the dtype may differ from the parameters': autocast casts both.
    """
    t = check_float_tensor(name, t)
    if t.ndim != 3 or (width is not None and t.size(-1) != width):
        raise ValueError(f"{name} must have shape {shape}, got {shape_str(t.shape)}")
    if params is not None:
        check_like_parameters(name, t, params)
    return t


def check_like_parameters(name: str, t: Tensor, params: Tensor) -> None:
    """Raise unless ``t`` can meet the parameters ``params``: same device, same dtype (or any
    float dtype inside ``torch.autocast``, which casts both)."""
    if t.device != params.device:
        raise ValueError(
            f"{name} is on {t.device} but the module's parameters are on {params.device}"
        )
    if t.dtype == params.dtype:
        return
    device = t.device.type
    if not (torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)):
        raise TypeError(
            f"{name} is {dtype_str(t.dtype)} but the module's parameters are "
            f"{dtype_str(params.dtype)}: convert one of them (module.to(dtype)), or run "
            "under torch.autocast"
        )


def check_broadcastable(name: str, t: Tensor, target: tuple[int, ...], legend: str) -> None:
    """Raise ``ValueError`` unless ``t`` broadcasts to ``target`` (trailing dims aligned)."""
    ok = t.ndim <= len(target) and all(
        one_or(s, want) for s, want in zip(reversed(t.shape), reversed(target), strict=False)
    )
    if not ok:
        raise ValueError(
            f"{name} of shape {shape_str(t.shape)} does not broadcast to "
            f"{legend} = {shape_str(target)}"
        )


def check_logits(name: str, t: Tensor, what: str) -> None:
    """Raise unless ``t`` holds logits: finite or ``-inf``, never NaN or ``+inf``, which would make
    the softmax undefined. ``what`` says what -inf means there, as in "a sink may be -inf (no
    sink)". One host synchronisation; skipped on meta tensors and while torch.compile/export
    trace."""
    if torch.compiler.is_compiling() or t.device.type == "meta" or not t.numel():
        return
    top = float(t.detach().max())  # NaN propagates through max, +inf is the max
    if math.isnan(top) or top == math.inf:
        raise ValueError(
            f"{name} holds {'NaN' if math.isnan(top) else '+inf'}: {what} but not NaN or +inf, "
            "which would make the softmax undefined"
        )


def spec_text(x: object, numbers: list[object] | None = None) -> str:
    """JSON text of nested lists of numbers, strings, bools and None (infinities as JSON's
    ``Infinity``), written in plain Python: torch.compile traces this where it cannot trace the
    json module's C encoder. :func:`spec_read` reads it back. (How masks and score terms travel
    as an operator's string arguments.)

    A symbolic integer (a size while torch.compile or torch.export traces with dynamic shapes)
    cannot be text: it is appended to ``numbers``, which travel beside the text, and written as
    ``{"n": index}``."""
    if x is None:
        return "null"
    # A symbolic integer cannot be written while tracing; dynamo tells it from a plain int only
    # by what it does, so every int goes to ``numbers`` then.
    symbolic = isinstance(x, torch.SymInt) or (
        isinstance(x, int) and not isinstance(x, bool) and torch.compiler.is_compiling()
    )
    if symbolic and numbers is not None:
        numbers.append(x)
        return '{"n":' + str(len(numbers) - 1) + "}"
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if x != x:
            return "NaN"
        if x in (math.inf, -math.inf):
            return "Infinity" if x > 0 else "-Infinity"
        return repr(x)
    if isinstance(x, str):
        return '"' + x.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(x, list | tuple):
        return "[" + ",".join(spec_text(y, numbers) for y in x) + "]"
    raise TypeError(f"spec_text: cannot write a {type(x).__name__}")


def spec_read(text: str, numbers: Sequence[object] = ()) -> object:
    """What :func:`spec_text` wrote, its symbolic integers taken from ``numbers``."""
    import json

    def fill(x: object) -> object:
        if isinstance(x, dict):
            return numbers[x["n"]]
        if isinstance(x, list):
            return [fill(y) for y in x]
        return x

    return fill(json.loads(text))


def broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to exactly ``target``, by torch's rule: plain
    comparisons of the sizes (torch.broadcast_shapes costs tens of microseconds a call, a share
    of a decode step's checks, and raises inside a compiled function where this returns
    False)."""
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target), strict=False))
