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


# --------------------------------------------------------------------------------------------------
# Structured masks, each with its dense meaning written out here independently of attnkit.masks


@dataclass
class Structured:
    """A structured mask and the bool ``(B, H, Tq, Tk)`` tensor it means (True = may attend)."""

    mask: object  # an attnkit.masks.Mask
    dense: Tensor
    label: str


def _positions(tq: int, tk: int) -> tuple[Tensor, Tensor]:
    """``(Tq, 1)`` bottom-right query positions and ``(1, Tk)`` key positions."""
    return torch.arange(tq).unsqueeze(-1) + (tk - tq), torch.arange(tk).unsqueeze(0)


@st.composite
def structured_masks(
    draw: st.DrawFn, b: int, h: int, tq: int, tk: int, depth: int = 1
) -> Structured:
    """A structured mask for calls with ``b`` batch rows, ``h`` heads, ``tq``/``tk`` lengths."""
    from attnkit import masks

    qpos, kpos = _positions(tq, tk)
    full = (b, h, tq, tk)
    kind = draw(
        st.sampled_from(
            ["causal", "top_left", "window", "documents", "ids", "padding", "valid", "fn", "tensor"]
            + (["and", "or"] if depth else [])
        )
    )
    if kind == "causal":
        return Structured(masks.causal(), (kpos <= qpos).expand(full), kind)
    if kind == "top_left":
        i = torch.arange(tq).unsqueeze(-1)
        return Structured(masks.causal(align="top_left"), (kpos <= i).expand(full), kind)
    if kind == "window":
        left, right = draw(st.integers(0, 6)), draw(st.integers(0, 4))
        d = kpos - qpos
        dense = (d >= -left) & (d <= right)
        return Structured(masks.sliding_window(left, right), dense.expand(full), kind)
    if kind in ("documents", "ids"):
        per_row = kind == "documents" and b > 1 and draw(st.booleans())
        rows = []
        for _ in range(b if per_row else 1):
            cuts = sorted(draw(st.lists(st.integers(0, tk), min_size=0, max_size=3)))
            bounds = [0, *cuts, tk]
            rows.append([bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)])
        ids = torch.tensor(
            [[s for s, n in enumerate(r) for _ in range(n)] for r in rows], dtype=torch.long
        )
        ids = ids.reshape(len(rows), tk)
        if kind == "ids":  # arbitrary labels, not in order
            labels = torch.tensor(draw(st.permutations([7, -3, 11, 0, 5])))
            ids = labels[ids]
            mask = masks.documents(ids=ids if b == 1 or draw(st.booleans()) else ids[0])
        else:
            mask = masks.documents(rows if per_row else rows[0])
        # Query i belongs to the document of key position i + Tk - Tq (none before key 0).
        dense = torch.zeros(ids.size(0), tq, tk, dtype=torch.bool)
        for i in range(tq):
            p = i + tk - tq
            if p >= 0:
                dense[:, i] = ids == ids[:, p : p + 1]
        return Structured(mask, dense.unsqueeze(1).expand(full), kind)
    if kind in ("padding", "valid"):
        lengths = draw(st.lists(st.integers(0, tk), min_size=b, max_size=b))
        side = draw(st.sampled_from(["right", "left"]))
        j = torch.arange(tk)
        valid = torch.stack(
            [(j < n) if side == "right" else (j >= tk - n) for n in lengths]
        ).reshape(b, tk)
        if kind == "valid":
            mask = masks.key_padding(valid=valid)
        else:
            mask = masks.key_padding(lengths, side=side)
        return Structured(mask, valid[:, None, None, :].expand(full), kind)
    if kind == "fn":
        prefix = draw(st.integers(0, 5))
        heads_differ = draw(st.booleans())

        def prefix_lm(bb: Tensor, hh: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            keep = (kv_idx <= q_idx) | (kv_idx < prefix)
            return keep & (hh % 2 == 0) if heads_differ else keep

        i = torch.arange(tq).view(1, 1, tq, 1)
        jj = torch.arange(tk).view(1, 1, 1, tk)
        hh = torch.arange(h).view(1, h, 1, 1)
        dense = (jj <= i) | (jj < prefix)
        if heads_differ:
            dense = dense & (hh % 2 == 0)
        return Structured(masks.from_fn(prefix_lm), dense.expand(full), kind)
    if kind == "tensor":  # per head and position (batch-dependent tensors: see cases())
        shape = _broadcast_shape(draw, full[1:])
        seed = draw(st.integers(0, 2**16))
        t = torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < 0.7
        return Structured(masks.causal() & t, (kpos <= qpos) & t.expand(full), "causal & tensor")
    a = draw(structured_masks(b, h, tq, tk, depth - 1))
    c = draw(structured_masks(b, h, tq, tk, depth - 1))
    if kind == "and":
        return Structured(a.mask & c.mask, a.dense & c.dense, f"({a.label}) & ({c.label})")  # type: ignore[operator]
    return Structured(a.mask | c.mask, a.dense | c.dense, f"({a.label}) | ({c.label})")  # type: ignore[operator]
