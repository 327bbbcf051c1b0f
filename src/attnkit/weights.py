"""Saving and loading a module's weights (its state dict) without unpickling arbitrary objects.

* :func:`save` writes ``.safetensors`` files with safetensors (the ``cli`` extra installs it).
* :func:`load` reads them with safetensors, and any other file with
  ``torch.load(weights_only=True)``, which refuses pickled code.

:func:`load_state_dict` checks a state dict against a module before loading it and reports every
missing, unexpected or mis-shaped parameter with both shapes, instead of torch's first error.

>>> import torch, attnkit
>>> m = attnkit.MultiHeadAttention(16, 4)
>>> state = m.state_dict()
>>> state["out_proj.weight"] = torch.zeros(8, 16)
>>> attnkit.weights.load_state_dict(m, state, source="ckpt.safetensors")
Traceback (most recent call last):
    ...
ValueError: ckpt.safetensors does not fit MultiHeadAttention:
  out_proj.weight: shape (8, 16) in ckpt.safetensors, (16, 16) in the module
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping

import torch
from torch import Tensor, nn

__all__ = ["load", "load_state_dict", "save"]


def _shape(t: Tensor) -> str:
    return str(tuple(t.shape))


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else "(no message)"


def _refusal(err: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler objected to, without its advice on unsafe loading."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "WeightsUnpickler error:" in line:
            detail = line.split("WeightsUnpickler error:", 1)[1].strip()
            if not detail and i + 1 < len(lines):  # the reason can be on the next line
                detail = lines[i + 1]
            return detail
    return _first_line(err)


def load_state_dict(
    module: nn.Module, state: Mapping[str, Tensor], *, source: str = "the state dict"
) -> None:
    """``module.load_state_dict(state)`` (strict), after listing everything that does not fit.

    Raises ``ValueError`` naming each missing or unexpected key and each parameter whose shape
    differs, with both shapes.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    expected = module.state_dict()
    problems = []
    for key, want in expected.items():
        if key not in state:
            problems.append(f"{key}: missing from {source} (the module has shape {_shape(want)})")
        elif not isinstance(state[key], Tensor):
            problems.append(f"{key}: a {type(state[key]).__name__} in {source}, not a tensor")
        elif state[key].shape != want.shape:
            problems.append(
                f"{key}: shape {_shape(state[key])} in {source}, {_shape(want)} in the module"
            )
    problems += [
        f"{key}: in {source} but not in the module" for key in state if key not in expected
    ]
    if problems:
        raise ValueError(
            f"{source} does not fit {type(module).__name__}:\n  " + "\n  ".join(problems)
        )
    module.load_state_dict(dict(state))


def save(module: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write ``module``'s state dict as a safetensors file (tensors only: nothing to unpickle)."""
    from safetensors.torch import save_file

    if not str(path).endswith(".safetensors"):
        raise ValueError(f"save() writes .safetensors files, got {os.fspath(path)!r}")
    save_file({k: v.detach().contiguous() for k, v in module.state_dict().items()}, str(path))


def load(path: str | os.PathLike[str], module: nn.Module | None = None) -> dict[str, Tensor]:
    """Read a state dict, and load it into ``module`` (checked) when one is given.

    ``.safetensors`` files go through safetensors; anything else through
    ``torch.load(weights_only=True)``, which refuses to run pickled code.

    Raises ``ValueError`` naming the file when it cannot be read as a checkpoint (truncated,
    damaged, holding pickled objects, not a dict) or does not fit ``module``; ``OSError`` when it
    cannot be opened (missing, no permission).
    """
    name = os.fspath(path)
    if name.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(name)
        except SafetensorError as err:  # a plain Exception: say which file, as ValueError
            raise ValueError(f"{name} is not a readable safetensors file: {err}") from None
    else:
        # Opened here, so that a file that is missing or forbidden raises its OSError from open();
        # whatever torch.load raises after that is about the content.
        with open(name, "rb") as f:
            try:
                loaded = torch.load(f, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as err:
                reason = _refusal(err)
                if "Unsupported global" in reason:  # a class or function to import and call
                    raise ValueError(
                        f"{name} holds more than tensors (or is damaged), and attnkit does not "
                        "unpickle arbitrary objects: torch.load(weights_only=True) refused it: "
                        f"{reason}"
                    ) from None
                raise ValueError(
                    f"{name} is not a readable torch checkpoint (truncated or damaged?): {reason}"
                ) from None
            except MemoryError:
                raise
            except Exception as err:
                # A truncated or damaged file fails deep inside torch.load, as whatever its reader
                # hit first: RuntimeError or OSError (the zip reader), EOFError (an empty file)...
                raise ValueError(
                    f"{name} is not a readable torch checkpoint (truncated or damaged?): "
                    f"{type(err).__name__}: {_first_line(err)}"
                ) from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{name} holds a {type(loaded).__name__}, not a state dict")
        state = loaded
    if module is not None:
        load_state_dict(module, state, source=name)
    return state
