"""The kernel's two phases on a planned call, in the kernel's layout: the output, the log-sum-exp
and every gradient (q, k, v, a dense bias, a position term's inputs) equal the float64
reference's, on both kernels."""

from __future__ import annotations

import pytest
import torch

from attnkit import _native, attention, masks, scores
from attnkit._kernel import delta_of
from attnkit._kernel.call import plan_call
from attnkit._kernel.phases import kernel_backward, kernel_forward
from attnkit.testing import assert_close

B, H, HKV, TQ, TK, D = 2, 4, 2, 13, 21, 8


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "q": r(B, H, TQ, D),
        "k": r(B, HKV, TK, D),
        "v": r(B, HKV, TK, D),
        "bias": r(B, H, TQ, TK),
        "qv": r(B, H, TQ, D),
        "enc": r(H, TQ + TK - 1, D),
        "dout": r(B, H, TQ, D),
    }


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("added", ["bias", "position"])
def test_the_phases_give_the_references_output_lse_and_gradients(native: bool, added: str) -> None:
    if native and not _native.load():
        pytest.skip(f"native kernel: {_native.status()[1]}")
    x = _inputs()
    leaves = {n: t.clone().requires_grad_() for n, t in x.items() if n != "dout"}
    mask = masks.sliding_window(6, 3)

    def term(t: dict[str, torch.Tensor]) -> torch.Tensor | scores.ScoreTerm:
        return t["bias"] if added == "bias" else scores.RelativePositionTerm(t["qv"], t["enc"], 0.5)

    want, want_lse = attention(
        leaves["q"], leaves["k"], leaves["v"], mask=mask, bias=term(leaves), scale=0.3,
        return_lse=True, backend="reference",
    )  # fmt: skip
    want.backward(x["dout"])

    spec, dense, term_inputs = plan_call(
        x["q"], x["k"], x["v"], mask=mask, bias=term(x), scale=0.3, native=native, block_q=4,
        block_k=8,
    )  # fmt: skip
    assert (spec.native is not None) == native, spec.kernel
    q5 = x["q"].unflatten(1, (HKV, -1))
    bias5 = None if dense is None else dense.unflatten(1, (HKV, -1))
    out5, lse = kernel_forward(spec, q5, x["k"], x["v"], bias5, term_inputs)
    assert_close(out5.flatten(1, 2), want)
    assert_close(lse.flatten(1, 2), want_lse)

    dout5 = x["dout"].unflatten(1, (HKV, -1))
    rows = (out5, lse, delta_of(out5, dout5), dout5)
    needs = tuple(True for _ in term_inputs)
    term_inputs = tuple(t.detach().requires_grad_() for t in term_inputs)  # (eager: whose grads)
    with torch.no_grad():  # as inside a backward
        grads = kernel_backward(
            spec, q5, x["k"], x["v"], bias5, rows, bias_grad=dense is not None,
            term_inputs=term_inputs, term_needs=needs,
        )  # fmt: skip
    assert_close(grads.dq.flatten(1, 2), leaves["q"].grad)
    assert_close(grads.dk, leaves["k"].grad)
    assert_close(grads.dv, leaves["v"].grad)
    if added == "bias":
        assert grads.dbias5 is not None
        assert_close(grads.dbias5.flatten(1, 2), leaves["bias"].grad)
    else:
        for got, name in zip(grads.dterm, ("qv", "enc"), strict=True):
            assert got is not None
            assert_close(got, leaves[name].grad)
