"""Shared test helpers: a brute-force attention, flash-attn's formula restated, the chunked backend
with small blocks, and a mark for tests that need a C++ compiler."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import shutil
from collections.abc import Iterator

import jaxtyping
import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit

#: torch.compile's CPU backend (inductor) compiles C++: without a compiler it cannot run.
needs_cxx = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None,
    reason="torch.compile's CPU backend compiles C++, and no C++ compiler is on PATH",
)


def brute_force(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention one query row at a time, straight from the definition, in float64.

    Written independently of attnkit's backends: no GQA views, no -inf tricks; a key is either in
    the row's softmax or not. ``softcap`` caps ``q . k * scale`` before the bias; a sink adds
    ``exp(sink[h])`` to each row's denominator and nothing to its output.
    """
    q, k, v = q.double(), k.double(), v.double()
    batch = q.shape[:-3]
    h, tq, dk = q.shape[-3:]
    hkv, tk, dv = v.shape[-3:]
    scale = 1.0 / math.sqrt(dk) if scale is None else scale
    full = (*batch, h, tq, tk)
    allowed = torch.ones(full, dtype=torch.bool) if mask is None else mask.expand(full)
    add = torch.zeros(full, dtype=torch.float64) if bias is None else bias.double().expand(full)
    out = torch.zeros(*batch, h, tq, dv, dtype=torch.float64)
    weights = torch.zeros(full, dtype=torch.float64)
    for b in itertools.product(*[range(n) for n in batch]):
        for head in range(h):
            kv_head = head // (h // hkv)
            for i in range(tq):
                keys = [
                    j
                    for j in range(tk)
                    if allowed[(*b, head, i, j)] and not (causal and j > i + tk - tq)
                ]
                raw = [(q[(*b, head, i)] * k[(*b, kv_head, j)]).sum() * scale for j in keys]
                if softcap is not None:
                    raw = [softcap * torch.tanh(s / softcap) for s in raw]
                logits = (
                    torch.stack([s + add[(*b, head, i, j)] for s, j in zip(raw, keys, strict=True)])
                    if keys
                    else torch.zeros(0, dtype=torch.float64)
                )
                if not keys or torch.isinf(logits).all():
                    continue
                if sinks is None:
                    w = torch.softmax(logits, 0)
                else:
                    e = torch.exp(logits - logits.max())
                    w = e / (e.sum() + torch.exp(sinks[head].double() - logits.max()))
                for wj, j in zip(w, keys, strict=True):
                    weights[(*b, head, i, j)] = wj
                    out[(*b, head, i)] += wj * v[(*b, kv_head, j)]
    return out, weights


def blocked(backend: str, block_q: int, block_k: int) -> str | attnkit.Backend:
    """``backend``, with small blocks when it is the chunked kernel, so small inputs span many,
    and fully visible stretches of two query blocks or more given to torch's fused kernel (merged
    with the partial blocks around them), so small inputs take that path too."""
    if backend == "chunked":
        return attnkit.backends.Chunked(block_q=block_q, block_k=block_k, fused_rows=2 * block_q)
    return backend


@contextlib.contextmanager
def attnkit_checks_only() -> Iterator[None]:
    """jaxtyping's annotation checks off, so that attnkit's own argument validation answers."""
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


class LargestTensor(TorchDispatchMode):
    """The most elements any torch operation's output held, over the operations run while
    active: what an O(T) promise bounds (no ``(Tq, Tk)`` tensor made)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def flash_attn_formula(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    window: tuple[int, int],
    softcap: float,
    slopes: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """flash-attn's attention for one sequence, restated from its reference (``attention_ref``):
    queries aligned to the end of the keys, ``window = (left, right)`` (-1: unbounded), ALiBi
    ``slopes``; ``q (Tq, H, D)``, ``k (Tk, Hkv, D)``, ``v (Tk, Hkv, Dv)``, ``slopes (H,)``;
    ``(out (Tq, H, Dv), lse (H, Tq))`` in float64."""
    q, k, v = q.double(), k.double(), v.double()
    tq, heads, d = q.shape
    tk, kv_heads = k.shape[:2]
    k = k.repeat_interleave(heads // kv_heads, 1)
    v = v.repeat_interleave(heads // kv_heads, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * (d**-0.5 if scale is None else scale)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    diag = torch.arange(tq)[:, None] + (tk - tq)
    j = torch.arange(tk)[None, :]
    if slopes is not None:
        s = s - slopes.double()[:, None, None] * (diag - j).abs()
    left, right = window[0], 0 if causal else window[1]
    seen = torch.ones(tq, tk, dtype=torch.bool)
    if left >= 0:
        seen &= j >= diag - left
    if right >= 0:
        seen &= j <= diag + right
    s = s.masked_fill(~seen, -math.inf)
    lse = torch.logsumexp(s, -1)
    probs = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v), lse
