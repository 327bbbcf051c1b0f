"""The kernel on rectangles of a call: a call cut into rectangles of its scores, each run through
the kernel's own phases and merged by log-sum-exp, equals the float64 reference (output and every
gradient) on both kernels; and the choice made once for a call cut so."""

from __future__ import annotations

import pytest
import torch

from attnkit import _native, attention, masks, scores
from attnkit._call import check_attention_args
from attnkit._kernel import delta_of, merge
from attnkit._kernel.rect import (
    RectSettings,
    backward_rect,
    forward_rect,
    per_query,
    plan_rect,
    rect_settings,
)
from attnkit.masks import Geometry
from attnkit.testing import assert_close

B, H, HKV, T, D = 1, 4, 2, 24, 8
CUTS = [(0, 7), (7, 16), (16, 24)]  # rectangles of unequal sides


def _settings(native: bool, term: scores.ScoreTerm | None) -> RectSettings:
    return RectSettings(
        geo=Geometry((B,), H, T, T, torch.device("cpu"), torch.float64),
        groups=H // HKV,
        scale=0.3,
        softcap=None,
        term=term,
        dropout=None,
        score_mod=None,
        native=native,
        kernel="",
        careful=False,
        zero_offset=None,
        fused_rows=None,
        blocks=(4, 8),
        dtype=torch.float64,
    )


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("term", [False, True])
def test_rectangles_merged_equal_the_whole_call(native: bool, term: bool) -> None:
    if native and not _native.load():
        pytest.skip(f"native kernel: {_native.status()[1]}")
    g = torch.Generator().manual_seed(8)
    x = {
        n: torch.randn(*shape, generator=g, dtype=torch.float64)
        for n, shape in {
            "q": (B, H, T, D), "k": (B, HKV, T, D), "v": (B, HKV, T, D), "qv": (B, H, T, D),
            "enc": (H, 2 * T - 1, D), "dout": (B, H, T, D),
        }.items()
    }  # fmt: skip
    mask = masks.sliding_window(9, 2) & masks.key_padding([20])
    leaves = {n: t.clone().requires_grad_() for n, t in x.items() if n != "dout"}

    def position(t: dict[str, torch.Tensor]) -> scores.ScoreTerm | None:
        return scores.RelativePositionTerm(t["qv"], t["enc"], 0.5) if term else None

    want = attention(
        leaves["q"], leaves["k"], leaves["v"], mask=mask, bias=position(leaves), scale=0.3,
        backend="reference",
    )  # fmt: skip
    want.backward(x["dout"])

    s = _settings(native, position(x))
    inputs = () if s.term is None else (x["qv"], x["enc"])
    q5, dout5 = x["q"].unflatten(1, (HKV, -1)), x["dout"].unflatten(1, (HKV, -1))
    out = torch.zeros_like(q5)
    lse = torch.full(q5.shape[:-1], float("-inf"), dtype=torch.float64)
    specs = {}
    for qa, qb in CUTS:
        rows = tuple(
            t[:, :, qa:qb] if a else t for t, a in zip(inputs, per_query(s.term), strict=True)
        )
        for ka, kb in CUTS:
            spec = plan_rect(s, mask, (qa, qb - qa, ka, kb - ka), rows)
            if spec is None:
                continue
            assert (spec.native is not None) == native
            specs[qa, qb, ka, kb] = (spec, rows)
            o, o_lse = forward_rect(
                spec, q5[:, :, :, qa:qb], x["k"][:, :, ka:kb], x["v"][:, :, ka:kb], rows, ()
            )
            merge(out[:, :, :, qa:qb], lse[:, :, :, qa:qb], o, o_lse)
    assert len(specs) < len(CUTS) ** 2  # the window hides some rectangles whole
    assert_close(out.flatten(1, 2), want)

    delta = delta_of(out, dout5)
    dq, dk, dv = torch.zeros_like(q5), torch.zeros_like(x["k"]), torch.zeros_like(x["v"])
    dqv, denc = torch.zeros_like(x["qv"]), torch.zeros_like(x["enc"])
    for (qa, qb, ka, kb), (spec, rows) in specs.items():
        call_rows = tuple(t[:, :, :, qa:qb] for t in (out, lse, delta, dout5))
        with torch.no_grad():  # as inside ring attention's backward
            gr = backward_rect(
                spec, q5[:, :, :, qa:qb], x["k"][:, :, ka:kb], x["v"][:, :, ka:kb], rows, (),
                call_rows, tuple(True for _ in rows), fold=False,  # type: ignore[arg-type]
            )  # fmt: skip
        dq[:, :, :, qa:qb] += gr.dq
        dk[:, :, ka:kb] += gr.dk
        dv[:, :, ka:kb] += gr.dv
        if term:
            dqv[:, :, qa:qb] += gr.dterm[0]
            denc += gr.dterm[1]
    assert_close(dq.flatten(1, 2), leaves["q"].grad)
    assert_close(dk, leaves["k"].grad)
    assert_close(dv, leaves["v"].grad)
    if term:
        assert_close(dqv, leaves["qv"].grad)
        assert_close(denc, leaves["enc"].grad)


def test_the_choice_for_a_cut_call_says_why_the_eager_kernel_runs() -> None:
    q = torch.randn(1, 2, 16, 8)
    geo = Geometry((1,), 2, 64, 64, q.device, q.dtype)

    def choose(native: bool, dropout_p: float = 0.0, finite: bool = True) -> RectSettings:
        call = check_attention_args(
            q, q, q, mask=masks.causal(), bias=None, causal=False, scale=None, dropout_p=dropout_p
        )
        return rect_settings(
            call, geo, finite=finite, norms=(1.0, 1.0, 1.0), seed=7, blocks=(None, 32),
            fused_rows=None, native=native, off="the eager kernel (asked)",
        )  # fmt: skip

    off = choose(False)
    assert (off.native, off.kernel, off.careful) == (False, "the eager kernel (asked)", False)
    assert off.blocks[1] == 32
    dropped = choose(True, dropout_p=0.1)
    assert not dropped.native
    assert "dropout across ranks" in dropped.kernel
    assert dropped.dropout == (0.1, 7)
    assert choose(False, finite=False).careful
    if _native.load():
        on = choose(True)
        assert (on.native, on.kernel, on.zero_offset) == (True, "native kernel", None)
