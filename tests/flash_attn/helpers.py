"""flash-attn's semantics written out in float64 from its docstrings (not from attnkit), and the
inputs the flash_attn tests share.

Per batch row and head: scores ``q k^T * scale``, softcap, ALiBi ``-slope * |i + Tk - Tq - j|``,
the band ``i + Tk - Tq - left <= j <= i + Tk - Tq + right`` (``causal``: ``right = 0``), a softmax
whose empty rows give 0, and the natural-log LSE. Packed sequences are checked one sequence at a
time, the KV cache one row at a time on the keys it holds after the append.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] = (-1, -1),
    softcap: float = 0.0,
    slopes: Tensor | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out (B, Tq, H, Dv), lse (B, H, Tq))`` for ``(B, T, H, D)`` inputs, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    batch, tq, heads, d = q.shape
    tk, hkv = k.size(1), k.size(2)
    k = k.repeat_interleave(heads // hkv, dim=2)
    v = v.repeat_interleave(heads // hkv, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, k) * (d**-0.5 if scale is None else scale)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(tq)[:, None] + tk - tq  # each query's key position
    j = torch.arange(tk)[None, :]
    left, right = (None if w is None or w == -1 else w for w in window)
    if causal:
        right = 0
    visible = torch.ones(tq, tk, dtype=torch.bool)
    if left is not None:
        visible &= j >= i - left
    if right is not None:
        visible &= j <= i + right
    if slopes is not None:
        per_row = slopes.double().reshape(-1, heads)[:, :, None, None]  # (B|1, H, 1, 1)
        s = s - per_row * (i - j).abs()
    s = s.masked_fill(~visible, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double()[None, :, None, None].expand(batch, -1, tq, 1)], -1)
    lse = torch.logsumexp(s, -1)  # (B, H, Tq); -inf for an empty row
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("bhts,bshd->bthd", p, v), lse


def rotate(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """flash-attn's rotary embedding of ``x`` ``(T, H, D)`` at ``positions`` ``(T,)``: the first
    ``rotary_dim`` dims rotated as pairs ``(2i, 2i+1)`` (interleaved) or ``(i, i + rd/2)``."""
    rd = 2 * cos.size(-1)
    c, s = cos[positions].double(), sin[positions].double()  # (T, rd/2)
    if interleaved:
        c = c.repeat_interleave(2, -1)[:, None]
        s = s.repeat_interleave(2, -1)[:, None]
        x1, x2 = x[..., :rd:2], x[..., 1:rd:2]
        half = torch.stack((-x2, x1), -1).flatten(-2)
    else:
        c, s = torch.cat([c, c], -1)[:, None], torch.cat([s, s], -1)[:, None]
        x1, x2 = x[..., : rd // 2], x[..., rd // 2 : rd]
        half = torch.cat((-x2, x1), -1)
    return torch.cat([x[..., :rd] * c + half * s, x[..., rd:]], -1)


def grads(out: Tensor, inputs: tuple[Tensor, ...], weight: Tensor) -> tuple[Tensor, ...]:
    return torch.autograd.grad((out.double() * weight).sum(), inputs)


def cu(lengths: list[int]) -> Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)


def kv_call(paged: bool) -> dict[str, Any]:
    """A valid flash_attn_with_kvcache call that writes 2 new tokens per row, by keyword: rotary,
    ALiBi, sinks and softcap on, two rows at different lengths, pages of 4 when ``paged``."""
    g = torch.Generator().manual_seed(21)

    def r(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    batch, heads, hkv, d, capacity, new = 2, 4, 2, 8, 12, 2
    angles = r(16, 2) * 3
    call: dict[str, Any] = dict(
        q=r(batch, 1, heads, d),
        k=r(batch, new, hkv, d),
        v=r(batch, new, hkv, 6),
        rotary_cos=angles.cos(),
        rotary_sin=angles.sin(),
        cache_seqlens=torch.tensor([3, 7], dtype=torch.int32),
        causal=True,
        softcap=5.0,
        alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64),
        learnable_sink=r(heads),
    )
    if paged:  # 3 pages a row, in a shuffled pool of 7 (page 6 belongs to no row)
        call["block_table"] = torch.tensor([[4, 0, 2], [5, 1, 3]], dtype=torch.int32)
        call["k_cache"], call["v_cache"] = r(7, 4, hkv, d), r(7, 4, hkv, 6)
    else:
        call["k_cache"], call["v_cache"] = r(batch, capacity, hkv, d), r(batch, capacity, hkv, 6)
    return call


def snapshot(call: dict[str, Any]) -> dict[str, Tensor]:
    return {name: t.clone() for name, t in call.items() if isinstance(t, Tensor)}


def assert_unchanged(call: dict[str, Any], before: dict[str, Tensor]) -> None:
    """Every tensor of the call holds the bits it held (NaN arguments included)."""
    for name, t in before.items():
        now = call[name]
        assert (now.dtype, now.shape) == (t.dtype, t.shape), f"{name} changed"
        same = torch.equal(now.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8))
        assert same, f"{name} changed"


def fa_inputs(fn: str) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(24)

    def r(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "flash_attn_func": (r(2, 5, 4, 8), r(2, 6, 2, 8), r(2, 6, 2, 8)),
        "flash_attn_qkvpacked_func": (r(2, 5, 3, 4, 8),),
        "flash_attn_kvpacked_func": (r(2, 5, 4, 8), r(2, 6, 2, 2, 8)),
        "flash_attn_varlen_func": (r(9, 4, 8), r(11, 2, 8), r(11, 2, 8), cu([4, 5]), cu([5, 6])),
        "flash_attn_varlen_qkvpacked_func": (r(9, 3, 4, 8), cu([4, 5])),
        "flash_attn_varlen_kvpacked_func": (r(9, 4, 8), r(11, 2, 2, 8), cu([4, 5]), cu([5, 6])),
        "varlen_mask": ([0, 4, 9],),
    }[fn]
