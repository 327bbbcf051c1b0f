"""What the kernel's tests share: seeded float64 tensors, the formula, a problem in small blocks."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit._kernel import Problem, make_plan
from attnkit.masks import Geometry, Mask

CPU = torch.device("cpu")


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float64) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def formula(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    visible: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Output and log-sum-exp ``(N, H, Tq)`` (sinks included), in float64, from the definition:
    grouped key heads repeated, masked pairs out of the softmax, an empty row gives 0 and -inf."""
    g = q.size(1) // k.size(1)
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ kk.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    with_sinks = (
        s if sinks is None else torch.cat([s, sinks[:, None, None].expand(*s.shape[:-1], 1)], -1)
    )
    lse = torch.logsumexp(with_sinks, -1)
    w = torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0).unsqueeze(-1))
    return w @ vv, lse


def problem(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    mask: Mask | None = None,
    softcap: float | None = None,
    block: tuple[int, int] = (4, 4),
    fused_rows: int | None = None,
) -> Problem:
    """The kernel's problem for ``(N, H, T, D)`` tensors: queries ``(N, Hkv, G, Tq, Dk)``, keys and
    values ``(N * Hkv, Tk, D)``, the plan cut in blocks of ``block``; ``fused_rows`` as
    :class:`~attnkit._kernel.Problem`'s."""
    n, h, tq, dk = q.shape
    hkv, tk = k.shape[1:3]
    geo = Geometry((n,), h, tq, tk, q.device)
    plan = make_plan(
        mask, geo, q_start=0, q_len=tq, k_start=0, kv_len=tk, block_q=block[0], block_k=block[1]
    )
    return Problem(
        q5=q.view(n, hkv, h // hkv, tq, dk),
        k3=k.reshape(n * hkv, tk, dk),
        v3=v.reshape(n * hkv, tk, v.size(-1)),
        scale=scale,
        plan=plan,
        geo=geo,
        mask=mask,
        softcap=softcap,
        fused_rows=fused_rows,
    )
