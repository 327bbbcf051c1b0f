"""The ``flex`` backend: a call lowered to torch's FlexAttention and run there.

On CUDA (ROCm's included) and Intel GPUs torch compiles ``flex_attention`` with the call's
``score_mod`` and ``mask_mod`` into one fused kernel, forward and backward: the backend serves
every call :func:`~.lowering.lowering_refusal` accepts there, with gradients. On the CPU torch's
compiled FlexAttention serves inference only, and without the log-sum-exp: the backend serves CPU
calls that need no gradients, compiled, and those that need the log-sum-exp (``return_lse``,
sinks) through ``flex_attention``'s eager form, which writes the scores out, as it does every
call where torch cannot compile FlexAttention for the CPU (:func:`cpu_compile_refusal`: macOS,
no AVX2, no C++ compiler). ``auto`` leaves CPU calls to attnkit's kernel (a ``cost``), so there
``backend="flex"`` runs only when asked for: what a GPU would compute, checked on a machine
without one.

attnkit's promises hold on this path: a query with no visible key gives 0 (and a log-sum-exp of
``-inf``), as FlexAttention gives; a NaN or inf in q, k or v, which torch's kernel would let
through from masked keys (a masked value times a zero weight), sends the call to attnkit's kernel
(``chunked``), which follows the non-finite policy: a hand-over ``record_dispatch()`` records.
Calls that need gradients bring their inputs' finiteness with them (``call.finite``, declined when
False); for the others the backend reads its output (one host read): FlexAttention's output is
finite whenever the inputs are.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..._base.devices import flex_kernel_options, readable, target
from ..._base.finite import finite
from ..._base.transforms import transforms_active
from ..._call import AttentionCall
from ..._score_mod import ScoreMod
from ..._score_mod import describe as describe_score_mod
from ...scores import DistanceBias, RelativePositionTerm
from ..base import Backend, CallInputs, Output
from .block_mask import BLOCK, plan_of
from .lowering import Lowered, lower_call, lowering_refusal
from .mask_mod import bitmap_bytes, index_masks
from .score_mod import relative_width
from .sinks import fold_sinks

__all__ = ["GRADIENT_DEVICES", "Flex", "cpu_compile_refusal", "flex_available", "run_lowered"]

#: Devices where torch's compiled FlexAttention runs with gradients.
GRADIENT_DEVICES = ("cuda", "xpu")

_LOCK = threading.Lock()
_COMPILED: dict[bool, Callable[..., Any]] = {}

#: The recompile limit attnkit's compiled FlexAttention calls run under (torch's own, when
#: higher): every kind of call attnkit lowers compiles ``flex_attention`` itself, so the kinds of
#: one model share torch's per-function limit (8 by default), past which torch runs the rest
#: unfused, the (..., H, Tq, Tk) scores written out.
RECOMPILE_LIMIT = 64


def _flex_module() -> Any | None:
    try:
        from torch.nn.attention import flex_attention
    except ImportError:  # a torch without FlexAttention
        return None
    return flex_attention


def flex_available() -> bool:
    """Whether this torch has FlexAttention (``torch.nn.attention.flex_attention``)."""
    return _flex_module() is not None


def _compiled(gpu: bool = True) -> Callable[..., Any]:
    """``torch.compile(flex_attention)``, made once per process and kind of device: torch
    compiles it once per structure of score_mod and mask_mod (not per captured tensor). On GPUs
    with torch's default dynamic shapes, as its own front ends compile it: the first length of a
    kind compiles for that length, a second one compiles a kernel for every length (its sizes
    symbolic), so a model whose lengths vary, or a decode step over a growing cache, compiles a
    few times, not once per length. On the CPU once per shape (``dynamic=False``): torch's CPU
    template does not build every mask_mod with symbolic sizes."""
    with _LOCK:
        if gpu not in _COMPILED:
            module = _flex_module()
            if module is None:
                raise RuntimeError("attnkit internal error: flex ran without FlexAttention")
            dynamic = None if gpu else False
            _COMPILED[gpu] = torch.compile(module.flex_attention, dynamic=dynamic)
        return _COMPILED[gpu]


def _recompile_limit() -> Any:
    """A context in which torch compiles ``flex_attention`` up to :data:`RECOMPILE_LIMIT` times
    (or its own limit, if higher); a no-op where torch has no such setting."""
    config = torch._dynamo.config
    name = next((n for n in ("recompile_limit", "cache_size_limit") if hasattr(config, n)), None)
    if name is None or getattr(config, name) >= RECOMPILE_LIMIT:
        return contextlib.nullcontext()
    return config.patch({name: RECOMPILE_LIMIT})


def _eager(*args: Any, **kwargs: Any) -> Any:
    """``flex_attention`` unfused (the CPU's form with the log-sum-exp), without its advice to
    compile it: the compiled form has no log-sum-exp there."""
    module = _flex_module()
    if module is None:
        raise RuntimeError("attnkit internal error: flex ran without FlexAttention")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return module.flex_attention(*args, **kwargs)


def cpu_compile_refusal() -> str | None:
    """Why torch cannot compile FlexAttention for this CPU (None: it can), by the rules of
    torch's CPU kernel: it needs AVX2 (and ``ATEN_CPU_CAPABILITY`` other than ``default``), is
    not built on macOS nor beside an Intel GPU, and inductor builds it with a C++ compiler
    (``$CXX``, else ``g++``, on PATH). Builds nothing; the unfused form serves those calls."""
    if sys.platform == "darwin":
        return "torch compiles it for Linux and Windows CPUs, not macOS"
    avx2 = getattr(torch.cpu, "_is_avx2_supported", lambda: True)()
    if not avx2 or os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        return "its CPU kernel needs AVX2 (and ATEN_CPU_CAPABILITY other than 'default')"
    if torch.xpu.is_available():
        return "torch compiles it for the Intel GPU present, not the CPU"
    config = sys.modules.get("torch._inductor.config")  # read when loaded, never imported here
    cxx = config.cpp.cxx if config is not None else (os.environ.get("CXX", "g++"),)
    search = tuple(cxx) if isinstance(cxx, (list, tuple)) else (cxx,)
    if not any(c is not None and shutil.which(c) for c in search):
        named = ", ".join(c for c in search if c is not None)
        return f"inductor builds it with a C++ compiler, and {named or 'none'} is not on PATH"
    return None


def runs_compiled(call: AttentionCall) -> tuple[bool, str | None]:
    """Whether ``call`` runs torch's compiled FlexAttention (else its unfused form, which writes
    the scores out), and why not: one rule for the run and for ``explain()``."""
    if call.device.type != "cpu":
        return True, None
    if call.dtype == torch.float64:
        return False, (
            "float64 on the CPU runs flex_attention's unfused form (torch's CPU compile takes "
            "float32 and the half types)"
        )
    if call.return_lse or call.sinks:
        return False, (
            "on the CPU the log-sum-exp comes from flex_attention's unfused form (torch's CPU "
            "compile has none)"
        )
    why = cpu_compile_refusal()
    if why is not None:
        return False, (
            f"torch cannot compile FlexAttention for this CPU ({why}): flex_attention's "
            "unfused form runs, the (..., H, Tq, Tk) scores written out"
        )
    return True, None


def kernel_options(call: AttentionCall) -> tuple[dict[str, str], str]:
    """The ``kernel_options`` torch's compiled FlexAttention gets for ``call`` on its device, and
    why (:func:`attnkit._base.devices.flex_kernel_options`; the score_mod's captured tensors
    count as needing gradients whenever the call does)."""
    added = call.bias_shape is not None or call.score_term is not None or call.score_mod is not None
    captures = call.requires_grad and (added or call.sinks)
    dims = (call.qk_dim, call.v_dim)
    options, why = flex_kernel_options(target(call.device), call.dtype, dims, captures)
    # torch's FLASH backward under a BlockMask is deterministic only on sm_100 with dQ
    # write-order tables (which a BlockMask from the plan has not): elsewhere it raises.
    strict = torch.are_deterministic_algorithms_enabled()
    strict = strict and not torch.is_deterministic_algorithms_warn_only_enabled()
    if options and strict and call.mask is not None and call.requires_grad:
        return {}, (
            "kernel_options={}: torch's Triton kernels (deterministic algorithms are on, and "
            "the FLASH backend's backward under a block mask raises there)"
        )
    return options, why


def run_lowered(
    lowered: Lowered, *, lse: bool, compiled: bool, options: dict[str, str] | None = None
) -> tuple[Tensor, Tensor | None]:
    """``flex_attention`` on a lowered call: ``(out (B, H, Tq, Dv), lse (B, H, Tq) or None)``,
    torch's compiled form when ``compiled`` (with ``options`` as its ``kernel_options``), else
    its eager one."""
    module = _flex_module()
    if module is None:
        raise RuntimeError("attnkit internal error: flex ran without FlexAttention")
    aux = module.AuxRequest(lse=True) if lse else None
    if compiled:
        fn = _compiled(lowered.q.device.type != "cpu")
        extra = {"kernel_options": options} if options else {}
        kwargs = lowered.kwargs()
        if lowered.q.device.type == "cpu" and lowered.score_mod is not None:
            kwargs["score_mod"] = _on_its_own_scores(lowered.score_mod)
        with _recompile_limit():
            result = fn(lowered.q, lowered.k, lowered.v, return_aux=aux, **kwargs, **extra)
    else:
        result = _eager(lowered.q, lowered.k, lowered.v, return_aux=aux, **lowered.kwargs())
    if aux is None:
        return result, None
    return result[0], result[1].lse


def _on_its_own_scores(score_mod: ScoreMod) -> ScoreMod:
    """``score_mod`` as torch's compiled CPU FlexAttention computes it right: on a copy of the
    scores (its template fails to build a score_mod that writes them in place), with a result
    that reads them (one that does not, a constant, ``score * 0 + x`` or a function of the
    indices alone, comes out wrong there), and in the scores' dtype (a result of another one,
    ``score.double() * 2`` in a float32 call, comes out wrong too). The result is the function's
    wherever the score is not NaN; a NaN score (from a NaN in q or k) stays NaN, and the backend
    hands such a call to attnkit's kernel."""

    def on_its_own_scores(
        score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        modified = score_mod(score.clone(), b, h, q_idx, kv_idx)
        return torch.where(torch.isnan(score), score, modified).to(score.dtype)

    return on_its_own_scores


class Flex(Backend):
    """torch's FlexAttention as a backend (see :mod:`attnkit.backends.flex`)."""

    accepts_score_mod = True

    def __init__(self) -> None:
        super().__init__("flex")

    def check(self, call: AttentionCall) -> list[str]:
        reasons = []
        if _flex_module() is None:
            reasons.append("this torch has no torch.nn.attention.flex_attention")
        device = call.device.type
        if device == "cpu" and call.requires_grad:
            reasons.append(
                "torch's FlexAttention on the CPU computes no gradients (inference only); "
                "attnkit's kernel (chunked) serves score_mods and masks with gradients"
            )
        elif device not in (*GRADIENT_DEVICES, "cpu"):
            reasons.append(
                f"torch's compiled FlexAttention runs on CUDA, ROCm and XPU (and on the CPU "
                f"for inference), not on {device}"
            )
        if torch.compiler.is_compiling():
            reasons.append(
                "the lowering reads the mask's block plan, which torch.compile/export cannot "
                "trace (call flex_attention directly inside a compiled model)"
            )
        if transforms_active():
            reasons.append("torch.func's transforms are active (FlexAttention's kernel has none)")
        refusal = lowering_refusal(call)
        if refusal is not None:
            reasons.append(refusal)
        if call.finite is False:
            reasons.append(
                "q, k or v hold NaN/inf: torch's kernel would let masked ones into the outputs "
                "and gradients"
            )
        return reasons

    def cost(self, call: AttentionCall) -> list[str]:
        if call.device.type != "cpu":
            return []
        return [
            "runs torch's FlexAttention on the CPU, compiled once per shape and mask kind "
            "(seconds each), or unfused with the (..., H, Tq, Tk) scores written out where the "
            "log-sum-exp is needed: auto leaves CPU calls to the kernels made for it"
        ]

    def notes(self, call: AttentionCall) -> list[str]:
        compiled, unfused = runs_compiled(call)
        notes = []
        if compiled and target(call.device).gpu:
            notes.append(
                "torch.compile(flex_attention): compiles once per kind of mask, then again for "
                "dynamic lengths (a kernel for every length)"
            )
        elif compiled:
            notes.append("torch.compile(flex_attention): compiles once per shape and kind of mask")
        if target(call.device).gpu:
            notes.append(kernel_options(call)[1])
        if call.mask is not None:
            notes.append(f"mask {call.mask.describe()} as a mask_mod")
            notes += _bitmap_notes(call)
            if readable(call.device):  # not meta, nor a device explain() describes
                plan = plan_of(call.mask, call.geometry, call.groups, (BLOCK, BLOCK))
                notes.append(f"BlockMask from the block plan: {plan.grid.describe()}")
        notes += _score_notes(call)
        if call.sinks:
            notes.append("sinks folded in through the log-sum-exp: out * sigmoid(lse - sink)")
        if unfused is not None:
            notes.append(unfused)
        return notes

    def run(self, call: AttentionCall, inputs: CallInputs) -> Output:
        q, k, v = inputs.q, inputs.k, inputs.v
        on_cpu = call.device.type == "cpu"
        if on_cpu:
            # A CPU call here needs no gradients (check), but its tensors may still say
            # requires_grad (under torch.no_grad or inference_mode), which torch's CPU
            # FlexAttention refuses whatever the grad mode.
            q, k, v = q.detach(), k.detach(), v.detach()
        lowered = lower_call(call, q, k, v, inputs.bias)
        lse_needed = call.return_lse or inputs.sinks is not None
        compiled = runs_compiled(call)[0]
        options = kernel_options(call)[0] if target(call.device).gpu else None
        out, lse = run_lowered(lowered, lse=lse_needed, compiled=compiled, options=options)
        if _leaked(call, out, q, k, v):
            return self.hand_over(
                call,
                inputs,
                "chunked",
                "q, k or v hold a NaN or inf, which torch's FlexAttention lets through from "
                "masked keys, and turns into zeros where a query's visible keys all give NaN",
            )
        if inputs.sinks is not None and lse is not None:
            out, lse = fold_sinks(out, lse, inputs.sinks)
        out = out.reshape(*call.batch_shape, *out.shape[1:])
        if not call.return_lse or lse is None:
            return out
        return out, lse.reshape(*call.batch_shape, *lse.shape[1:])


def _leaked(call: AttentionCall, out: Tensor, q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the output breaks the non-finite policy, or may: FlexAttention's output is finite
    unless q, k or v hold a NaN or inf, and then only the exact policy can tell a value the mask
    hides (a masked value times a zero weight) from one it shows. A query whose visible keys all
    give NaN scores comes out 0 there, as a query with no visible key does: so an output that is
    finite but has a row of zeros is trusted only once q, k and v are read to be finite (a
    zero row is otherwise a masked query, and the read costs a fraction of the call). One host
    read of the output, the smallest tensor of the call; none for a call whose inputs are known
    to be finite, or while torch.compile traces."""
    if call.finite is True or torch.compiler.is_compiling() or out.device.type == "meta":
        return False
    if not finite(out):
        return True
    zero_rows = out.numel() > 0 and bool((out == 0).all(-1).any())
    return zero_rows and not finite(q, k, v)


def _bitmap_notes(call: AttentionCall) -> list[str]:
    """What each index mask's bitmap holds, against the ``(Tq, Tk)`` masks other paths write."""
    geo = call.geometry
    notes = []
    for mask in index_masks(call.mask):
        rows, heads, q_len, _ = mask.indices.shape
        size = bitmap_bytes(mask, geo)
        dense = rows * heads * q_len * geo.kv_len  # a bool (Tq, Tk) mask per selection head
        unit = "key" if mask.block == 1 else f"block of {mask.block} keys"
        notes.append(
            f"{mask.describe()} read from a bitmap, a bit a {unit} for each query and selection "
            f"head: {_mib(size)}, where the same selection as (Tq, Tk) masks (what sdpa's "
            f"kernels read) takes {_mib(dense)} as bool and {_mib(dense * call.dtype.itemsize)} "
            f"as {str(call.dtype).removeprefix('torch.')}"
        )
    return notes


def _mib(size: int) -> str:
    return f"{size / 2**20:.3g} MiB"


def _score_notes(call: AttentionCall) -> list[str]:
    """What the score_mod computes, and the size of what it reads."""
    parts = []
    if call.softcap is not None:
        parts.append(f"softcap={call.softcap}")
    if call.bias_shape is not None:
        parts.append("the bias read by index")
    term = call.score_term
    if term is not None:
        parts.append(f"{term.describe()} read by index")
    if call.score_mod is not None:
        parts.append(describe_score_mod(call.score_mod))
    notes = [f"score_mod: {', then '.join(parts)}"] if parts else []
    if isinstance(term, RelativePositionTerm) and not term.legacy:
        geo = call.geometry
        reach = call.mask.distances(geo) if call.mask is not None else (-float("inf"), float("inf"))
        width = relative_width(term, geo, reach)
        bound = "the mask's window" if width < geo.q_len + geo.kv_len - 1 else "no window: O(T^2)"
        notes.append(f"position term as q . r over {width} distances per query ({bound})")
    elif term is not None and not isinstance(term, DistanceBias):
        notes.append(f"{term.describe()} written out dense, (B, H, Tq, Tk): O(T^2)")
    return notes
