"""The device a call runs on, as the rules that route it see it: :func:`target`.

Every rule that depends on where a call runs reads the :class:`Target` of the call's device:
which of torch's SDPA kernels serves it (flash, cuDNN, memory-efficient or math), whether torch's
compiled FlexAttention runs there with gradients and with which ``kernel_options``, and how
``auto`` weighs a slow path against a cost. For a call on a real device the target is that device
as it is (vendor, NVIDIA compute capability, cuDNN, Triton). Inside :func:`assuming`, which
``explain(..., device="cuda")`` uses, it is the device asked about, on any machine: the decision a
GPU makes is taken by the same rules on a laptop, and tested without a GPU.

Only torch and the standard library are imported here: the backends' rules and the dispatcher
both read this module.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "GPU_TYPES",
    "Target",
    "assuming",
    "compiled_refusal",
    "flex_kernel_options",
    "on_gpu",
    "parse_device",
    "readable",
    "slow_paths_cost_more",
    "target",
]

#: torch's device types of the GPUs whose compiled kernels (Triton) attnkit routes calls to:
#: NVIDIA's and AMD's (ROCm builds of torch name their devices "cuda") and Intel's.
GPU_TYPES = ("cuda", "xpu")

# What explain(device=...) assumes of a GPU it cannot see: an H100 (sm_90) for "cuda", an MI300
# for "rocm", an Intel data-center GPU for "xpu".
_ASSUMED_CAPABILITY = (9, 0)


@dataclass(frozen=True)
class Target:
    """A device as the routing rules see it.

    ``type`` is torch's device type (``"cpu"``, ``"cuda"``, ``"xpu"``, ``"meta"``, ...);
    ``vendor`` ``"nvidia"``, ``"amd"`` or ``"intel"`` for a GPU (``""`` otherwise);
    ``capability`` NVIDIA's compute capability (``(9, 0)`` for an H100), None elsewhere;
    ``cudnn`` the cuDNN version torch runs (``91500`` is 9.15.0), None where unknown or absent;
    ``present``: False when :func:`assuming` stands in for a device this process does not
    see; ``triton``: whether torch.compile generates GPU kernels there (Triton installed);
    ``flash_cute``: whether FlexAttention's FlashAttention-4 backend (``flash_attn.cute``) is
    installed.
    """

    type: str
    vendor: str = ""
    capability: tuple[int, int] | None = None
    cudnn: int | None = None
    present: bool = True
    triton: bool = True
    flash_cute: bool = False

    @property
    def gpu(self) -> bool:
        return self.type in GPU_TYPES

    def describe(self) -> str:
        """``cuda (NVIDIA sm_90, assumed), torch 2.13``: what the rules were asked about."""
        parts = []
        if self.vendor:
            parts.append({"nvidia": "NVIDIA", "amd": "AMD ROCm", "intel": "Intel"}[self.vendor])
        if self.capability is not None:
            parts.append(f"sm_{self.capability[0]}{self.capability[1]}")
        if self.cudnn is not None:
            parts.append(f"cuDNN {self.cudnn // 10000}.{self.cudnn // 100 % 100}")
        if self.gpu and not self.triton:
            parts.append("no Triton")
        if not self.present:
            parts.append("assumed: torch sees no such device")
        inside = f" ({', '.join(parts)})" if parts else ""
        return f"{self.type}{inside}, torch {torch_version_str()}"


def torch_version_str() -> str:
    """torch's version without its local part: ``2.13.0``."""
    return torch.__version__.split("+")[0]


def torch_version() -> tuple[int, int]:
    """torch's ``(major, minor)``."""
    major, minor = torch_version_str().split(".")[:2]
    return int(major), int(minor)


_ASSUMED: contextvars.ContextVar[Target | None] = contextvars.ContextVar(
    "attnkit_assumed_device", default=None
)


@contextlib.contextmanager
def assuming(device: Target) -> Iterator[None]:
    """Within: a call on a device of ``device.type`` is routed as on ``device`` (see
    :func:`target`), and its tensors, which are elsewhere (on ``meta`` or another device), are
    not read (see :func:`readable`)."""
    token = _ASSUMED.set(device)
    try:
        yield
    finally:
        _ASSUMED.reset(token)


def target(device: torch.device) -> Target:
    """The one answer to "what is this device" that every routing rule reads: the device
    :func:`assuming` stands in for, else the device itself (read once per device).

    Traceable: while torch.compile traces a call (``explain()`` never runs there) it reads no
    context variable and probes nothing it cannot trace."""
    if not torch.compiler.is_compiling():
        assumed = _ASSUMED.get()
        if assumed is not None and assumed.type == device.type:
            return assumed
        found = _SEEN.get((device.type, device.index))  # (what _present keeps, read first)
        if found is not None:
            return found
    return _present(device.type, device.index)


def on_gpu(device: torch.device) -> bool:
    """``target(device).gpu``, from the device's type alone: the target of a device is of its
    type (the device itself, or the one :func:`assuming` stands in for it), so a rule that only
    asks whether a call runs on a GPU need not look the device up."""
    return device.type in GPU_TYPES


def readable(device: torch.device) -> bool:
    """Whether a call on ``device`` holds tensors that can be read to describe it (a block
    plan): not on ``meta``, and not a device :func:`assuming` stands in for (the call's tensors
    are elsewhere)."""
    if device.type == "meta":
        return False
    if torch.compiler.is_compiling():
        return True
    assumed = _ASSUMED.get()
    return assumed is None or assumed.type != device.type


_SEEN: dict[tuple[str, int | None], Target] = {}


@functools.cache
def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return False


@functools.cache
def _triton() -> bool:
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return bool(has_triton())


def _present(kind: str, index: int | None) -> Target:
    """A device torch sees, as it is (``index`` None: the current one), described once."""
    if kind not in GPU_TYPES:  # nothing to probe
        if torch.compiler.is_compiling():
            # (not looked up while traced: the graph would guard on the cache's contents and
            # be traced again once an eager call fills it)
            return Target(kind, triton=False)
        found = _SEEN.get((kind, index))
        if found is None:
            found = _SEEN[(kind, index)] = Target(kind, triton=False)
        return found
    found = _SEEN.get((kind, index))
    if found is not None:
        return found
    if torch.compiler.is_compiling():
        # a GPU first seen while torch.compile traces: what tracing can read, not kept
        amd = torch.version.hip is not None
        cap = None if amd or kind != "cuda" else torch.cuda.get_device_capability(index)
        vendor = "intel" if kind == "xpu" else "amd" if amd else "nvidia"
        return Target(kind, vendor, None if cap is None else (cap[0], cap[1]))
    found = _probe(kind, index)
    _SEEN[(kind, index)] = found
    return found


def _probe(kind: str, index: int | None) -> Target:
    """What a GPU torch sees is: vendor, compute capability, cuDNN, Triton."""
    if kind == "cuda" and torch.cuda.is_available():
        amd = torch.version.hip is not None
        cap = None if amd else tuple(torch.cuda.get_device_capability(index))
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        return Target(
            "cuda",
            "amd" if amd else "nvidia",
            (cap[0], cap[1]) if cap is not None else None,
            None if amd else cudnn,
            triton=_triton(),
            flash_cute=_installed("flash_attn.cute"),
        )
    if kind == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        return Target("xpu", "intel", triton=_triton())
    return _assumed(kind, "amd" if kind == "cuda" and torch.version.hip else "")


def _assumed(kind: str, vendor: str) -> Target:
    """What explain(device=...) assumes of a GPU this process does not see."""
    if kind == "xpu":
        return Target("xpu", "intel", present=False)
    if vendor == "amd":
        return Target("cuda", "amd", present=False)
    return Target("cuda", "nvidia", _ASSUMED_CAPABILITY, present=False)


_NAMES = {"cuda": ("cuda", ""), "rocm": ("cuda", "amd"), "xpu": ("xpu", ""), "cpu": ("cpu", "")}


def parse_device(device: object) -> Target:
    """``explain(device=...)``'s argument as a :class:`Target`: ``"cuda"`` (NVIDIA, or AMD on
    torch's ROCm builds, which name their GPUs so), ``"rocm"`` (an AMD GPU, which torch names
    ``"cuda"``), ``"xpu"``, ``"cpu"``, or a ``torch.device`` of those. The GPU an enclosing
    :func:`assuming` describes, else the device itself where this process has it, else the GPU
    the rules assume (NVIDIA: an H100, sm_90)."""
    text = str(device) if isinstance(device, torch.device) else device
    if not isinstance(text, str):
        raise TypeError(
            f"device must be a str or torch.device ('cuda', 'rocm', 'xpu' or 'cpu'), got "
            f"{type(device).__name__}"
        )
    kind, _, index = text.partition(":")
    if kind not in _NAMES or (index and not index.isdigit()):
        raise ValueError(
            f"device must be 'cuda', 'rocm', 'xpu' or 'cpu' (optionally with ':index'), got "
            f"{device!r}"
        )
    torch_type, vendor = _NAMES[kind]
    assumed = _ASSUMED.get()
    if assumed is not None and assumed.type == torch_type and vendor in ("", assumed.vendor):
        return assumed  # a GPU described by an enclosing assuming(...)
    found = _present(torch_type, int(index) if index else None)
    if not found.present or (vendor and found.vendor != vendor):
        return _assumed(torch_type, vendor or found.vendor)
    return found


def slow_paths_cost_more(device: Target) -> bool:
    """How ``auto`` weighs a backend's slow path against another's cost (a ``(Tq, Tk)`` tensor
    written out). On a CPU, a slow path is a blocked or eager kernel within a small factor of a
    fused one, so a cost weighs more. On a GPU, a slow path is a Python loop of small kernels
    (attnkit's eager kernel) or torch's math kernel, an order of magnitude slower than one fused
    kernel, while the GPU's memory reads a written-out mask at full speed: the slow path weighs
    more."""
    return device.gpu


def compiled_refusal(device: Target) -> str | None:
    """Why torch's compiled FlexAttention does not run with gradients on ``device`` (None: it
    does, with Triton on CUDA, ROCm and XPU)."""
    if not _installed("torch.nn.attention.flex_attention"):
        return f"torch {torch_version_str()} has no FlexAttention"
    if not device.gpu:
        return (
            f"torch's compiled FlexAttention has no backward on {device.type} (its CPU form "
            "serves inference only)"
        )
    if not device.triton:
        return "torch.compile cannot generate GPU kernels here: Triton is not installed"
    return None


def flex_kernel_options(
    device: Target, dtype: torch.dtype, head_dims: tuple[int, int], captures_grads: bool
) -> tuple[dict[str, str], str]:
    """The ``kernel_options`` for torch's compiled FlexAttention on ``device``, and why.

    FlexAttention's FlashAttention-4 backend (``{"BACKEND": "FLASH"}``) runs on NVIDIA Hopper and
    Blackwell (sm_90, sm_100) where ``flash_attn.cute`` is installed, in float16/bfloat16, for
    equal head sizes of 64 or 128, when no tensor the score_mod captures needs gradients (torch
    raises otherwise). Everywhere else, torch's default: its Triton kernels."""
    why = None
    cap = device.capability
    if torch_version() < (2, 9):
        why = f"torch {torch_version_str()} has no FLASH backend"
    elif device.vendor != "nvidia" or cap is None or cap[0] not in (9, 10):
        why = "the FLASH backend runs on NVIDIA sm_90/sm_100 only"
    elif not device.flash_cute:
        why = "flash_attn.cute (FlashAttention-4) is not installed"
    elif dtype not in (torch.float16, torch.bfloat16):
        why = f"the FLASH backend takes float16/bfloat16, not {str(dtype).removeprefix('torch.')}"
    elif head_dims[0] != head_dims[1] or head_dims[0] not in (64, 128):
        dk, dv = head_dims
        why = f"the FLASH backend takes head sizes 64 or 128, not Dk={dk}, Dv={dv}"
    elif captures_grads:
        why = "the FLASH backend gives no gradients to tensors the score_mod captures"
    if why is not None:
        return {}, f"kernel_options={{}}: torch's Triton kernels ({why})"
    return {"BACKEND": "FLASH"}, "kernel_options={'BACKEND': 'FLASH'}: FlashAttention-4"
