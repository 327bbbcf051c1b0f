"""Fully visible stretches of a call through torch's fused CPU attention kernel.

**Fully visible stretches** of the plan (see :func:`~attnkit._kernel.plan.split_runs`) go, on
CPUs and when it computes the same thing, to torch's fused CPU attention kernel (the kernel behind
its SDPA on CPUs): one call per run and query group, merged with the rest of each row by
log-sum-exp (:func:`~attnkit._kernel.merge.merge`). Its backward, given the call's final output
and log-sum-exp, computes exactly those keys' share of the gradients, because the probabilities
``exp(S - lse)`` and ``rowsum(dO * O)`` it forms are the whole row's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from .plan import Run

__all__ = ["FUSED_ROWS", "FusedWork", "fused_backward", "fused_forward", "fused_serves"]

# Fully visible work of at least this many queries goes to torch's fused CPU kernel, whose tiles
# are tallest (and fastest) from 768 queries up.
FUSED_ROWS = 768


def _fused_ops() -> (
    tuple[Callable[..., tuple[Tensor, Tensor]], Callable[..., tuple[Tensor, ...]]] | None
):
    """torch's fused CPU attention forward and backward (the kernel behind its SDPA on CPUs)."""
    try:
        return (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        )
    except (AttributeError, RuntimeError):  # a build without them: the kernel does the work
        return None


_FUSED = _fused_ops()


def _fused() -> tuple[Callable[..., tuple[Tensor, Tensor]], Callable[..., tuple[Tensor, ...]]]:
    """The fused ops, for a problem whose runs were split off because they exist."""
    if _FUSED is None:
        raise RuntimeError("attnkit internal error: runs planned without torch's fused kernel")
    return _FUSED


def fused_serves(
    device: torch.device,
    dtype: torch.dtype,
    dk: int,
    dv: int,
    *,
    softcap: float | None,
    added: bool,
) -> bool:
    """Whether torch's fused CPU kernel computes what a call asks of its fully visible blocks:
    plain ``softmax(q k^T * scale) v`` (no softcap, nothing ``added`` to the scores) in float32 or
    float64 on the CPU, keys and values of one width."""
    return (
        _FUSED is not None
        and device.type == "cpu"
        and dtype in (torch.float32, torch.float64)
        and dk == dv
        and softcap is None
        and not added
    )


class FusedWork(Protocol):
    """What the fused kernel reads of a call: its runs and the tensors they cover, in the kernel's
    layout (:class:`~attnkit._kernel.problem.Problem` is one). Declared here, by its reader, so
    that the problem can ask :func:`fused_serves` without the two modules importing each other.

    ``q5`` is ``(B, Hkv, G, Tq, Dk)``, ``k3``/``v3`` are ``(B*Hkv, Tk, D)``; ``n``, ``hkv``,
    ``g``: ``B``, ``Hkv``, ``G``.
    """

    @property
    def q5(self) -> Tensor: ...
    @property
    def k3(self) -> Tensor: ...
    @property
    def v3(self) -> Tensor: ...
    @property
    def scale(self) -> float: ...
    @property
    def n(self) -> int: ...
    @property
    def hkv(self) -> int: ...
    @property
    def g(self) -> int: ...
    @property
    def runs(self) -> tuple[Run, ...]: ...


def _kv4(p: FusedWork, run: Run) -> tuple[Tensor, Tensor]:
    """The run's keys and values as ``(B, Hkv, keys, D)`` views."""
    k4 = p.k3.unflatten(0, (p.n, p.hkv))[:, :, run.ks : run.ke]
    return k4, p.v3.unflatten(0, (p.n, p.hkv))[:, :, run.ks : run.ke]


def fused_forward(p: FusedWork, out: Tensor, lse: Tensor) -> None:
    """The problem's runs through torch's fused kernel, one call per run and query group (the
    ``G`` query heads that share a key head are ``G`` calls on views, no copies)."""
    op = _fused()[0]
    for run in p.runs:
        k4, v4 = _kv4(p, run)
        for g in range(p.g):
            o, lse_g = op(p.q5[:, :, g, run.qs : run.qe], k4, v4, scale=p.scale)
            out[:, :, g, run.qs : run.qe] = o
            lse[:, :, g, run.qs : run.qe] = lse_g


def _unit_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_backward(
    p: FusedWork, out: Tensor, lse: Tensor, dout: Tensor, dq5: Tensor, dk: Tensor, dv: Tensor
) -> None:
    """Add the runs' gradients. Given the call's final output and log-sum-exp, the fused
    backward of a run's keys computes exactly their share: the probabilities ``exp(S - lse)`` and
    ``rowsum(dO * O)`` are those of the whole row."""
    op = _fused()[1]
    out, dout = _unit_stride(out), _unit_stride(dout)
    dk4, dv4 = dk.unflatten(0, (p.n, p.hkv)), dv.unflatten(0, (p.n, p.hkv))
    for run in p.runs:
        k4, v4 = _kv4(p, run)
        rows = slice(run.qs, run.qe)
        for g in range(p.g):
            dq_g, dk_g, dv_g = op(
                dout[:, :, g, rows],
                p.q5[:, :, g, rows],
                k4,
                v4,
                out[:, :, g, rows],
                lse[:, :, g, rows],
                0.0,
                False,
                scale=p.scale,
            )
            dq5[:, :, g, rows] += dq_g
            dk4[:, :, run.ks : run.ke] += dk_g
            dv4[:, :, run.ks : run.ke] += dv_g
