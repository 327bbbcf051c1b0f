"""attnkit's operator in ONNX export: written as its dense form while ``torch.onnx.export`` runs.

A compiled or exported call on the ``chunked`` backend is one node of attnkit's operator
(``torch.ops.attnkit.attention``, :mod:`attnkit._kernel.operator`), which ONNX has no translation
for. ``torch.onnx.export(..., dynamo=True)`` captures the program with ``torch.export`` (the node
kept), then retraces it to decompose what its translation table lacks, and only then translates.
That retrace is where the node becomes the dense formula (:func:`attnkit.decompositions`, the
``reference`` backend's arithmetic, its mask and score term rebuilt from the node's text and
tensors), so that a model exports with no argument of attnkit's, and so does a program exported
earlier with ``torch.export``.

Why a dispatch rule and not a decomposition table: the exporter builds its translations afresh for
each export (torchlib's, and the call's own ``custom_translation_table``), and the only
decompositions it takes without being asked are torch's global table's. An entry there would also
reach every fake-tensor trace with dynamic shapes, which prefers that table to the operator's own
fake kernel: a compiled program would then be traced with the dense form's strides, not the
operator's, and fail. The rule here is one for the mode that records traced graphs
(``ProxyTorchDispatchMode``): it writes the dense form only while
``torch.onnx.is_in_onnx_export()``, and in every other trace records the operator as the mode
itself would.

The native kernel's operators (``torch.ops.attnkit.native_forward``, the decode and cache
operators) never reach a traced graph: they run inside this operator's kernel when a program
runs, and the cache path declines while torch.compile or torch.export traces.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch._ops import OpOverload
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode

from ._kernel.operator import attention_op
from .backends.reference import decompositions

__all__ = ["exporting_to_onnx", "register"]

_registered: list[bool] = []


def exporting_to_onnx() -> bool:
    """Whether ``torch.onnx.export`` is running (without importing ``torch.onnx`` when nothing
    has: then no export is)."""
    onnx = sys.modules.get("torch.onnx")
    return onnx is not None and bool(onnx.is_in_onnx_export())


def _dense_while_exporting(
    mode: ProxyTorchDispatchMode,
    func: OpOverload,
    types: tuple[Any, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    if not exporting_to_onnx():
        return ProxyTorchDispatchMode.__torch_dispatch__(mode, func, types, args, kwargs)
    # The mode is off while a rule runs: back on, it records the dense form's operators.
    with mode:
        return decompositions()[func](*args, **kwargs)


def register() -> None:
    """Attach the rule to attnkit's operator (once)."""
    if _registered:
        return
    torch.library.register_torch_dispatch(
        attention_op, ProxyTorchDispatchMode, _dense_while_exporting
    )
    _registered.append(True)


register()
