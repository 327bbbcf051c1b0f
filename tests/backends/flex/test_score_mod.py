"""What a call adds to its scores as one score_mod: run through attnkit's own kernel (chunked),
with the lowered mask_mod as the mask, its output and the gradients of q, k, v and of every tensor
the scores were made from equal the reference's for the call as given. (FlexAttention's CPU form
has no backward: this is how the lowering's gradients are checked here.)"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks
from attnkit.backends.flex.mask_mod import lower_mask
from attnkit.backends.flex.score_mod import lower_scores, relative_width
from attnkit.modules.positional import alibi_term
from attnkit.scores import DistanceBias, RelativePositionTerm, ScoreTerm
from attnkit.testing import assert_close

from .helpers import B, D, H, call_of, qkv, randn

TQ, TK = 10, 16


class _Linear(ScoreTerm):
    """A score term of its own class: ``w[h] * (k_pos - q_pos)``."""

    def __init__(self, w: Tensor) -> None:
        self.w = w

    def inputs(self) -> tuple[Tensor, ...]:
        return (self.w,)

    def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return inputs[0][:, None, None] * (k_pos - q_pos)


def _squared(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return s * s / 4


def _cases() -> dict[str, tuple[dict[str, object], tuple[Tensor, ...]]]:
    """Each call's arguments and the tensors whose gradients are compared."""
    slopes = attnkit.alibi_slopes(H).double().requires_grad_()
    table = randn(B, H, TQ + TK - 1, seed=4, dtype=torch.float64).requires_grad_()
    bias = randn(B, 1, TQ, 1, seed=5, dtype=torch.float64).requires_grad_()
    qv = randn(B, H, TQ, D, seed=6, dtype=torch.float64).requires_grad_()
    enc = randn(H, TQ + TK - 1, D, seed=7, dtype=torch.float64).requires_grad_()
    w = randn(H, seed=8, dtype=torch.float64).requires_grad_()
    return {
        "alibi": ({"bias": alibi_term(slopes, TQ, TK), "causal": True}, (slopes,)),
        "distance table, padding": (
            {"bias": DistanceBias(table, first=-(TK - 1)), "mask": masks.key_padding([TK, 5])},
            (table,),
        ),
        "dense bias, softcap": ({"bias": bias, "softcap": 2.0, "causal": True}, (bias,)),
        "relative, window": (
            {"bias": RelativePositionTerm(qv, enc, 0.5), "mask": masks.sliding_window(3)},
            (qv, enc),
        ),
        "relative, documents": (
            {"bias": RelativePositionTerm(qv, enc, 0.5), "mask": masks.documents([7, 9])},
            (qv, enc),
        ),
        "a term of its own": ({"bias": _Linear(w), "mask": masks.sliding_window(4, 2)}, (w,)),
        "score_mod, softcap": ({"score_mod": _squared, "softcap": 3.0, "causal": True}, ()),
    }


@pytest.mark.parametrize("kind", list(_cases()))
def test_the_lowered_scores_have_the_references_gradients(kind: str) -> None:
    kw, inputs = _cases()[kind]
    q, k, v = (t.double().requires_grad_() for t in qkv(TQ, TK))
    call = call_of(q, k, v, **kw)
    bias = kw.get("bias")
    score_mod, _ = lower_scores(call, bias if isinstance(bias, Tensor) else None, torch.float64)
    mask = None
    if call.mask is not None:
        mask = masks.from_fn(lower_mask(call.mask, call.geometry))
    out = attnkit.attention(q, k, v, mask=mask, score_mod=score_mod, backend="chunked")
    want = attnkit.attention(q, k, v, backend="reference", **kw)  # type: ignore[call-overload]
    assert_close(out, want)
    grad = randn(*out.shape, seed=9, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v, *inputs), grad, retain_graph=True)
    expected = torch.autograd.grad(want, (q, k, v, *inputs), grad)
    for g, e in zip(got, expected, strict=True):
        assert_close(g, e)


def test_the_relative_term_reads_only_the_windows_distances() -> None:
    q, k, v = qkv(64, 64)
    term = RelativePositionTerm(randn(B, H, 64, D, seed=1), randn(H, 127, D, seed=2), 0.5)
    window = call_of(q, k, v, bias=term, mask=masks.sliding_window(5, right=2))
    assert relative_width(term, window.geometry, window.mask.distances(window.geometry)) == 8
    _, added = lower_scores(window, None, torch.float32)
    assert added is not None
    assert added.values.shape == (B, H, 64, 8)
    causal = call_of(q, k, v, bias=term, causal=True)
    _, added = lower_scores(causal, None, torch.float32)
    assert added is not None
    assert added.values.shape == (B, H, 64, 64)


def test_a_plain_call_has_no_score_mod() -> None:
    q, k, v = qkv(8, 8)
    assert lower_scores(call_of(q, k, v, causal=True), None, torch.float32) == (None, None)
    mod, added = lower_scores(call_of(q, k, v, score_mod=_squared), None, torch.float32)
    assert mod is _squared
    assert added is None
