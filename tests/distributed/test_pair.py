"""The kernel on pairs of shards, in one process: a call cut into rectangles of its scores, each
computed on its own (native operator or eager kernel) and merged, equals the call."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import attnkit
from attnkit import _native, masks
from attnkit._kernel import delta_of, merge
from attnkit._kernel.rect import RectSettings
from attnkit.distributed._pair import (
    Rect,
    ShardKeys,
    backward_pair,
    forward_pair,
    per_query,
    plan_pair,
)
from attnkit.masks import Geometry
from attnkit.scores import DistanceBias, RelativePositionTerm, ScoreTerm

AVAILABLE, WHY = _native.status()
B, H, T, D, DH = 2, 2, 30, 8, 4
CUTS = [(0, 10), (10, 20), (20, 30)]  # three "ranks" of 10 queries and 10 keys


class Linear(ScoreTerm):
    """A term of one's own: ``w[h] * (k_pos - q_pos)``, asked at the call's positions."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return (self.w,)

    def tile(
        self, inputs: tuple[torch.Tensor, ...], q_pos: torch.Tensor, k_pos: torch.Tensor
    ) -> torch.Tensor:
        (w,) = inputs
        return w[:, None, None] * (k_pos - q_pos).to(w.dtype)


def settings(native: bool, term: ScoreTerm | None, dropout: float = 0.0) -> RectSettings:
    geo = Geometry((B,), H, T, T, torch.device("cpu"), torch.float64)
    return RectSettings(
        geo=geo,
        groups=1,
        scale=D**-0.5,
        softcap=None,
        term=term,
        dropout=(dropout, 1234) if dropout else None,
        score_mod=None,
        native=native,
        kernel="",
        careful=False,
        zero_offset=None,
        fused_rows=None,
        blocks=(4, 8),
        dtype=torch.float64,
    )


TERMS = ("none", "position", "distance", "own term")


def make_term(kind: str, x: dict[str, torch.Tensor]) -> ScoreTerm | None:
    if kind == "position":
        return RelativePositionTerm(x["qv"], x["enc"], 0.5)
    if kind == "distance":
        return DistanceBias(x["table"], -(T - 1))
    if kind == "own term":
        return Linear(x["w"])
    return None


@pytest.mark.parametrize("term", TERMS)
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("mask", ["window", "documents & causal", "key mask & window", "from_fn"])
def test_pairs_merged_equal_the_whole_call(native: bool, term: str, mask: str) -> None:
    if native and not AVAILABLE:
        pytest.skip(f"native kernel: {WHY}")
    if native and term == "own term":
        pytest.skip("the native kernel does not fuse a term of one's own")
    g = torch.Generator().manual_seed(3)
    x = {
        "q": torch.randn(B, H, T, D, generator=g, dtype=torch.float64),
        "k": torch.randn(B, H, T, D, generator=g, dtype=torch.float64),
        "v": torch.randn(B, H, T, D, generator=g, dtype=torch.float64),
        "qv": torch.randn(B, H, T, DH, generator=g, dtype=torch.float64),
        "enc": torch.randn(H, 2 * T - 1, DH, generator=g, dtype=torch.float64),
        "table": torch.randn(H, 2 * T - 1, generator=g, dtype=torch.float64),
        "w": torch.randn(H, generator=g, dtype=torch.float64),
        "dout": torch.randn(B, H, T, D, generator=g, dtype=torch.float64),
    }
    keys = torch.rand(B, 1, 1, T, generator=g) > 0.3
    whole_mask: Any = {
        "causal": masks.causal(),
        "window": masks.sliding_window(4, right=3),
        "documents & causal": masks.documents([7, 13, 10]) & masks.causal(),
        "key mask & window": masks.sliding_window(6) & keys,
        "from_fn": masks.from_fn(lambda b, h, i, j: (i * j + h) % 4 != 1),
    }[mask]
    leaves = {n: t.clone().requires_grad_() for n, t in x.items() if n != "dout"}
    want = attnkit.attention(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        mask=whole_mask,
        bias=make_term(term, leaves),
        scale=D**-0.5,
        backend="reference",
    )
    want.backward(x["dout"])

    with torch.no_grad():  # as inside ring attention's autograd function
        check_pairs(native, term, mask, x, keys, whole_mask, want, leaves)


def check_pairs(
    native: bool,
    term: str,
    mask: str,
    x: dict[str, torch.Tensor],
    keys: torch.Tensor,
    whole_mask: Any,
    want: torch.Tensor,
    leaves: dict[str, torch.Tensor],
) -> None:
    s = settings(native, make_term(term, x))
    q5 = x["q"].unsqueeze(2)  # (B, Hkv, G, T, D)
    out = torch.zeros((*q5.shape[:-1], D), dtype=torch.float64)
    lse = torch.full(q5.shape[:-1], float("-inf"), dtype=torch.float64)
    plans = {}
    for qa, qb in CUTS:
        # The "rank" of queries qa:qb, whose local rows (of q and of a position term's qv) are the
        # whole call's here, with its rows at qa:qb.
        inputs = () if s.term is None else tuple(s.term.inputs())
        for ka, kb in CUTS:
            # It has received keys ka:kb (with their key mask).
            rect = Rect(qa, qa, qb - qa, 0, ka, kb - ka)
            pair_mask = whole_mask
            if mask == "key mask & window":
                pair_mask = masks.sliding_window(6) & ShardKeys(keys[..., ka:kb], ka)
            p = plan_pair(s, pair_mask, rect, inputs)
            plans[qa, ka] = (p, inputs)
            if p is None:
                continue
            o, o_lse = forward_pair(s, p, q5, x["k"][:, :, ka:kb], x["v"][:, :, ka:kb], inputs, ())
            merge(out[:, :, :, qa:qb], lse[:, :, :, qa:qb], o, o_lse)
    torch.testing.assert_close(out.squeeze(2), want, atol=1e-10, rtol=1e-10)

    dout5 = x["dout"].unsqueeze(2)
    delta = delta_of(out, dout5)
    dq, dk, dv = (torch.zeros(B, H, T, D, dtype=torch.float64) for _ in range(3))
    dterm: list[torch.Tensor | None] = []
    for (qa, ka), (p, inputs) in plans.items():
        if p is None:
            continue
        n = p.rect.nq
        kb = ka + p.rect.nk
        grads = backward_pair(
            s, p, q5, x["k"][:, :, ka:kb], x["v"][:, :, ka:kb], inputs, (),
            (out, lse, delta, dout5), tuple(True for _ in inputs), fold=False,
        )  # fmt: skip
        dq[:, :, qa : qa + n] += grads.dq.squeeze(2)
        dk[:, :, ka:kb] += grads.dk
        dv[:, :, ka:kb] += grads.dv
        dterm = dterm or [None] * len(inputs)
        for i, (d, rowed) in enumerate(zip(grads.dterm, per_query(s.term), strict=True)):
            assert d is not None
            if rowed:  # qv's rows of this "rank"
                full = torch.zeros_like(x["qv"])
                full[:, :, qa : qa + n] = d
                d = full
            dterm[i] = d if dterm[i] is None else dterm[i] + d
    for name, got, leaf in (("dq", dq, "q"), ("dk", dk, "k"), ("dv", dv, "v")):
        torch.testing.assert_close(got, leaves[leaf].grad, atol=1e-10, rtol=1e-10, msg=name)
    term_leaves = {"position": ("qv", "enc"), "distance": ("table",), "own term": ("w",)}
    for name, got in zip(term_leaves.get(term, ()), dterm, strict=True):
        torch.testing.assert_close(got, leaves[name].grad, atol=1e-10, rtol=1e-10, msg=name)


def test_an_empty_rectangle_has_no_plan() -> None:
    s = settings(False, None)
    # Queries 0:10 under a causal mask see none of the keys 20:30.
    assert plan_pair(s, masks.causal(), Rect(0, 0, 10, 0, 20, 10), ()) is None
    assert plan_pair(s, masks.causal(), Rect(0, 20, 10, 0, 0, 10), ()) is not None
