"""Hypothesis strategies for attention calls: shapes, masks with empty rows, biases, GQA."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import Tensor


@dataclass
class Case:
    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor | None
    bias: Tensor | None
    causal: bool
    scale: float | None = None

    def kwargs(self) -> dict[str, object]:
        kw: dict[str, object] = {"mask": self.mask, "bias": self.bias, "causal": self.causal}
        if self.scale is not None:
            kw["scale"] = self.scale
        return kw

    def to(self, dtype: torch.dtype) -> Case:
        def cast(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(dtype)

        return Case(
            self.q.to(dtype),
            self.k.to(dtype),
            self.v.to(dtype),
            self.mask,
            cast(self.bias),
            self.causal,
            self.scale,
        )

    def __repr__(self) -> str:
        m = None if self.mask is None else tuple(self.mask.shape)
        b = None if self.bias is None else tuple(self.bias.shape)
        return (
            f"Case(q={tuple(self.q.shape)}, k={tuple(self.k.shape)}, v={tuple(self.v.shape)}, "
            f"mask={m}, bias={b}, causal={self.causal}, scale={self.scale}, "
            f"contiguous={self.q.is_contiguous()})"
        )


def _broadcast_shape(draw: st.DrawFn, full: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to ``full``: some leading dims dropped, some dims set to 1."""
    drop = draw(st.integers(0, len(full) - 1))
    return tuple(s if draw(st.booleans()) else 1 for s in full[drop:])


@st.composite
def cases(
    draw: st.DrawFn,
    *,
    max_len: int = 24,
    masks: bool = True,
    biases: bool = True,
    allow_empty: bool = True,
    edges: bool = False,
) -> Case:
    """Random attention calls in float64, with masks that leave some queries nothing to attend.

    ``edges=True`` also draws what breaks attention code (for the differential fuzzing): masks that
    are all False or pad the keys, biases with ``-inf`` entries (a float mask), large logits,
    ``scale`` (0 included), and q, k, v laid out as ``(..., T, H, D)`` transposed, as modules pass
    them.
    """
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    hkv = draw(st.integers(1, 3))
    h = hkv * draw(st.sampled_from([1, 1, 2, 3]))
    lo = 0 if allow_empty else 1
    tq = draw(st.integers(lo, max_len))
    tk = draw(st.integers(lo, max_len))
    dk = draw(st.integers(1, 8))
    dv = draw(st.integers(1, 8))

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def heads(hh: int, t: int, d: int) -> Tensor:
        if edges and draw(st.booleans()):  # (..., T, H, D) memory, seen as (..., H, T, D)
            return randn(*batch, t, hh, d).transpose(-2, -3)
        return randn(*batch, hh, t, d)

    q, k, v = heads(h, tq, dk), heads(hkv, tk, dk), heads(hkv, tk, dv)
    if edges:
        q = q * draw(st.sampled_from([1.0, 1.0, 40.0]))  # logits in the hundreds
    full = (*batch, h, tq, tk)
    mask = None
    if masks and draw(st.booleans()):
        shape = _broadcast_shape(draw, full)
        keep = draw(st.floats(0.2, 1.0))
        mask = torch.rand(*shape, generator=gen) < keep
        if mask.ndim >= 2 and mask.size(-2) > 1 and draw(st.booleans()):
            mask[..., 0, :] = False  # a query that may attend nothing
        if edges:
            kind = draw(st.sampled_from(["random", "random", "none visible", "padding"]))
            if kind == "none visible":
                mask = torch.zeros(shape, dtype=torch.bool)
            elif kind == "padding":  # (..., 1, 1, Tk): the last keys of each sequence are padding
                lengths = torch.randint(0, tk + 1, (*batch, 1, 1, 1), generator=gen)
                mask = torch.arange(tk) < lengths
    bias = None
    if biases and draw(st.booleans()):
        bias = randn(*_broadcast_shape(draw, full)) * draw(st.sampled_from([0.5, 3.0]))
        if edges and draw(st.booleans()):  # a float mask: -inf where a key is excluded
            bias = bias.masked_fill(torch.rand(bias.shape, generator=gen) < 0.3, float("-inf"))
    causal = draw(st.booleans())
    scale = draw(st.sampled_from([None, None, 0.0, 0.1, 2.0])) if edges else None
    return Case(q, k, v, mask, bias, causal, scale)
