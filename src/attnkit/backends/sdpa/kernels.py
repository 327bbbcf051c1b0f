"""Which of torch's SDPA kernels serves a call on a GPU: flash, cuDNN, memory-efficient or math.

torch picks the kernel itself, at run time, by a fixed order of preference and each kernel's
limits (dtype, head sizes, an ``attn_mask``, ``is_causal`` with ``Tq != Tk``, dropout, the GPU's
compute capability). :func:`torch_kernel` states those rules for the arguments the adapter gives
torch (:class:`TorchArgs`) on a :class:`~attnkit._base.devices.Target`, so that ``auto`` and
``explain(..., device="cuda")`` know, without a GPU, whether a call reaches a fused kernel or the
math kernel (which writes out the scores and the probabilities: a cost ``auto`` avoids). The
switches a user sets (``torch.backends.cuda.enable_flash_sdp(False)``, the priority order,
deterministic algorithms) are read as torch reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from ..._base.devices import Target

__all__ = ["KERNELS", "KernelChoice", "TorchArgs", "torch_kernel"]

#: torch's names of its SDPA kernels, in the words explain() prints.
KERNELS = {0: "math", 1: "flash", 2: "memory-efficient", 3: "cuDNN"}
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TorchArgs:
    """What torch's kernel choice reads of one ``scaled_dot_product_attention`` call: ``mask``
    (an ``attn_mask`` is given, bool or float), ``causal`` (``is_causal=True``), the sizes, the
    dtype, dropout and whether any input needs gradients."""

    dtype: torch.dtype
    qk_dim: int
    v_dim: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    mask: bool
    causal: bool
    dropout_p: float
    requires_grad: bool


@dataclass(frozen=True)
class KernelChoice:
    """The kernel torch runs (a name of :data:`KERNELS`, or ``"fused"`` for a GPU whose kernels
    are not modelled kernel by kernel), and why each kernel before it in torch's order does not."""

    kernel: str
    passed_over: tuple[tuple[str, str], ...] = ()

    @property
    def fused(self) -> bool:
        return self.kernel != "math"

    def describe(self) -> str:
        """``torch's memory-efficient kernel (flash: takes no attn_mask)``."""
        why = "; ".join(f"{name}: {reason}" for name, reason in self.passed_over)
        return f"torch's {self.kernel} kernel" + (f" ({why})" if why else "")


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sm(device: Target) -> str:
    cap = device.capability
    return "an unknown compute capability" if cap is None else f"sm_{cap[0]}{cap[1]}"


def _in_range(device: Target, low: tuple[int, int], high: tuple[int, int] = (12, 1)) -> bool:
    return device.capability is not None and low <= device.capability <= high


def _flash(device: Target, a: TorchArgs) -> str | None:
    """Why torch's flash kernel does not serve the call (None: it does)."""
    if not _switches()[0]:
        return "turned off (torch.backends.cuda.enable_flash_sdp(False))"
    if a.mask:
        return "takes no attn_mask"
    limit = 512 if device.vendor == "amd" else 256
    if a.qk_dim != a.v_dim or a.qk_dim > limit:
        return f"needs Dk == Dv <= {limit}, got Dk={a.qk_dim}, Dv={a.v_dim}"
    if device.vendor == "nvidia" and not _in_range(device, (8, 0)):
        return f"runs on sm_80 to sm_121, not {_sm(device)}"
    if device.vendor == "nvidia" and a.requires_grad and _narrow_backward(device, a):
        return f"has no backward for head size {a.qk_dim} on {_sm(device)}"
    if a.causal and a.q_len != a.kv_len:
        return f"takes is_causal only with Tq == Tk, got Tq={a.q_len}, Tk={a.kv_len}"
    if a.dtype not in _HALF:
        return f"takes float16/bfloat16, not {_dtype(a.dtype)}"
    if not a.q_len or not a.kv_len:
        return "takes no empty sequence"
    return None


def _narrow_backward(device: Target, a: TorchArgs) -> bool:
    """flash's backward on consumer GPUs (sm_86-89, sm_120-121) lacks head sizes 193-224, and
    225-256 with dropout."""
    if not (_in_range(device, (8, 6), (8, 9)) or _in_range(device, (12, 0), (12, 1))):
        return False
    return not (a.qk_dim <= 192 or (not a.dropout_p and a.qk_dim > 224))


def _cudnn(device: Target, a: TorchArgs) -> str | None:
    """Why torch's cuDNN kernel does not serve the call (None: it does)."""
    if device.vendor != "nvidia":
        return "NVIDIA only"
    if not _switches()[3]:
        return "turned off (torch.backends.cuda.enable_cudnn_sdp(False))"
    if device.cudnn is not None and device.cudnn < 90000:
        return f"needs cuDNN 9, got {device.cudnn}"
    if _switches()[4]:
        return "is not deterministic (torch.use_deterministic_algorithms(True))"
    if a.dtype not in _HALF:
        return f"takes float16/bfloat16, not {_dtype(a.dtype)}"
    if not _in_range(device, (8, 0)):
        return f"runs on sm_80 to sm_121, not {_sm(device)}"
    if a.dropout_p * 16 != int(a.dropout_p * 16):
        return f"takes dropout in steps of 1/16, not {a.dropout_p}"
    limit = 256 if _hopper_or_blackwell(device) and (device.cudnn or 0) > 92200 else 128
    if max(a.qk_dim, a.v_dim) > limit or a.qk_dim % 8 or a.v_dim % 8:
        return f"takes head sizes that are multiples of 8 up to {limit}, not {a.qk_dim}, {a.v_dim}"
    if a.kv_len == 1:
        return "takes no single key (Tk=1)"
    if a.dropout_p and a.q_len == 1:
        return "takes no single query with dropout"
    return None


def _hopper_or_blackwell(device: Target) -> bool:
    cap = device.capability
    return cap is not None and (cap == (9, 0) or cap[0] == 10)


def _efficient(device: Target, a: TorchArgs) -> str | None:
    """Why torch's memory-efficient kernel does not serve the call (None: it does)."""
    if not _switches()[1]:
        return "turned off (torch.backends.cuda.enable_mem_efficient_sdp(False))"
    if device.vendor == "nvidia" and not _in_range(device, (5, 0)):
        return f"runs on sm_50 to sm_121, not {_sm(device)}"
    old = device.vendor == "nvidia" and not _in_range(device, (8, 0))
    dtypes = (torch.float16, torch.float32) if old else (*_HALF, torch.float32)
    if a.dtype not in dtypes:
        return f"takes {'/'.join(map(_dtype, dtypes))}, not {_dtype(a.dtype)}"
    align = 8 if a.dtype in _HALF else 4 if not old else 1
    if a.qk_dim % align or a.v_dim % align:
        return f"takes head sizes that are multiples of {align}, not {a.qk_dim}, {a.v_dim}"
    if device.vendor == "amd" and a.num_heads != a.num_kv_heads:
        return "takes no grouped-query heads on ROCm"
    if not a.q_len or not a.kv_len:
        return "takes no empty sequence"
    return None


_RULES: dict[int, Callable[[Target, TorchArgs], str | None]] = {
    1: _flash,
    2: _efficient,
    3: _cudnn,
}


_Switches = tuple[bool, bool, bool, bool, bool, tuple[int, ...]]


def _read_switches() -> _Switches:
    """The user's switches, as torch reads them: flash, memory-efficient, math and cuDNN on,
    deterministic algorithms, the order of preference."""
    cuda = torch.backends.cuda
    return (
        cuda.flash_sdp_enabled(),
        cuda.mem_efficient_sdp_enabled(),
        cuda.math_sdp_enabled(),
        cuda.cudnn_sdp_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        tuple(torch._C._get_sdp_priority_order()),
    )


# Constants while torch.compile traces a call (its guards do not watch torch's switches). Marked
# on the first GPU call, not at import: marking imports torch._dynamo, which `import attnkit`
# does not.
_MARKED: list[Callable[[], _Switches]] = []


def _switches() -> _Switches:
    if not _MARKED:
        if torch.compiler.is_compiling():  # a first call inside a trace: read as it runs
            return _read_switches()
        _MARKED.append(
            cast(Callable[[], _Switches], torch.compiler.assume_constant_result(_read_switches))
        )
    return _MARKED[0]()


def _order(device: Target) -> list[int]:
    """torch's order of preference: its current one, with cuDNN first where torch puts it first
    on its own (Hopper and Blackwell with cuDNN newer than 9.15), unless the user has set one."""
    order = list(_switches()[5])
    default = [1, 2, 0, 3, 4]
    if order == default and _hopper_or_blackwell(device) and (device.cudnn or 0) > 91500:
        order = [3, 1, 2, 0, 4]
    return [k for k in order if k in KERNELS]


def torch_kernel(device: Target, a: TorchArgs) -> KernelChoice:
    """The kernel torch's ``scaled_dot_product_attention`` runs for ``a`` on ``device`` (a GPU)."""
    if device.type == "xpu":
        # Intel's SDPA: one fused kernel (oneDNN) for float16/bfloat16/float32, math otherwise.
        if a.dtype == torch.float64:
            return KernelChoice("math", (("fused", "takes no float64"),))
        return KernelChoice("fused")
    passed: list[tuple[str, str]] = []
    for kernel in _order(device):
        if kernel == 0:
            if _switches()[2]:
                return KernelChoice("math", tuple(passed))
            passed.append(("math", "turned off (torch.backends.cuda.enable_math_sdp(False))"))
            continue
        why = _RULES[kernel](device, a)
        if why is None:
            return KernelChoice(KERNELS[kernel], tuple(passed))
        passed.append((KERNELS[kernel], why))
    return KernelChoice("none", tuple(passed))
