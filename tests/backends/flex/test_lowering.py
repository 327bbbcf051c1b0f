"""A call as FlexAttention's arguments: every mask kind and every modifier, lowered and run through
flex_attention (its unfused form: the same mask_mod, score_mod and BlockMask the compiled kernel
takes), equals the float64 reference, output and log-sum-exp; and what cannot be lowered says
why, on any device."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks
from attnkit.backends.flex import lowering_refusal
from attnkit.modules.positional import alibi_term
from attnkit.scores import DistanceBias, RelativePositionTerm
from attnkit.testing import assert_close

from .helpers import B, D, H, call_of, catalogue, qkv, randn, reference, unfused

# fewer queries than keys (a cache, bottom-right); test_mask_mod.py and test_block_mask.py have
# Tq == Tk and more queries than keys too
SIZES = [(10, 24)]


def _check(q: Tensor, k: Tensor, v: Tensor, **kw: object) -> None:
    out, lse = unfused(q, k, v, **kw)
    want, want_lse = reference(q, k, v, return_lse=True, **kw)  # type: ignore[misc]
    assert_close(out, want)
    assert_close(lse, want_lse)


@pytest.mark.parametrize(("tq", "tk"), SIZES)
@pytest.mark.parametrize("kind", list(catalogue(24, 24)))
def test_every_mask_kind(kind: str, tq: int, tk: int) -> None:
    q, k, v = qkv(tq, tk)
    _check(q, k, v, mask=catalogue(tq, tk)[kind]())


def _squared(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return s * s / 4


def _modifiers(tq: int, tk: int) -> dict[str, dict[str, object]]:
    relative = RelativePositionTerm(
        randn(B, H, tq, D, seed=7), randn(H, tq + tk - 1, D, seed=8), 0.3
    )
    return {
        "scale": {"scale": 0.2, "causal": True},
        "softcap": {"softcap": 2.0, "mask": masks.sliding_window(4)},
        "alibi": {"bias": alibi_term(attnkit.alibi_slopes(H), tq, tk), "causal": True},
        "distance table per row": {
            "bias": DistanceBias(randn(B, 1, tq + tk + 3, seed=9), first=-(tk + 1)),
            "mask": masks.key_padding([tk - 2, 3]),
        },
        "dense bias, broadcast": {"bias": randn(1, tq, 1, seed=10).expand(H, tq, tk)},
        "dense bias per row": {"bias": randn(B, 1, tq, tk, seed=11), "softcap": 3.0},
        "bias with -inf": {
            "bias": torch.where(randn(tq, tk, seed=12) > 0.5, float("-inf"), 0.0),
            "score_mod": _squared,
        },
        "relative term, window": {"bias": relative, "mask": masks.sliding_window(3, right=2)},
        "relative term, causal": {"bias": relative, "causal": True},
        "score_mod and softcap": {"score_mod": _squared, "softcap": 4.0, "causal": True},
    }


# What reads the pair's distance or position runs in both alignments; the rest with fewer queries
ALIGNED = ("alibi", "distance table per row", "relative term, window", "relative term, causal")


@pytest.mark.parametrize(
    ("kind", "tq", "tk"),
    [(kind, 10, 24) for kind in _modifiers(24, 24)] + [(kind, 24, 10) for kind in ALIGNED],
)
def test_every_modifier(kind: str, tq: int, tk: int) -> None:
    q, k, v = qkv(tq, tk)
    _check(q, k, v, **_modifiers(tq, tk)[kind])


def test_plain_heads_and_a_value_size_of_its_own() -> None:
    q, k, _ = qkv(12, 20, hkv=H)
    v = randn(B, H, 20, 2 * D, seed=3)
    _check(q, k, v, mask=masks.sliding_window(4, right=1))


def test_a_query_with_no_visible_key_gives_zero() -> None:
    q, k, v = qkv(16, 16)
    out, lse = unfused(q, k, v, mask=masks.key_padding([16, 0]) & masks.causal())
    assert bool((out[1] == 0).all())
    assert bool((lse[1] == float("-inf")).all())
    bias = torch.zeros(16, 16).index_fill(0, torch.tensor([3]), float("-inf"))
    out, lse = unfused(q, k, v, bias=bias)
    assert bool((out[:, :, 3] == 0).all())
    assert bool((lse[:, :, 3] == float("-inf")).all())


def _meta(tq: int = 8, tk: int = 8) -> tuple[Tensor, Tensor, Tensor]:
    return (torch.empty(B, H, t, D, device="meta") for t in (tq, tk, tk))  # type: ignore[return-value]


class _Odd(masks.Mask):
    def tile(self, geo: masks.Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        return ((torch.arange(ks, ke) - torch.arange(qs, qe)[:, None]) % 2 == 1)[None, None]


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (
            {"dropout_p": 0.1, "mask": masks.causal()},
            "FlexAttention has no dropout (dropout_p=0.1)",
        ),
        ({"return_weights": True}, "returns no attention weights"),
        ({"mask": masks.causal() & _Odd()}, "_Odd is of a class of its own"),
    ],
)
def test_what_cannot_be_lowered_says_why_on_any_device(kw: dict[str, object], words: str) -> None:
    call = call_of(*_meta(), **kw)
    why = lowering_refusal(call)
    assert why is not None
    assert words in why
    assert lowering_refusal(call_of(*_meta(), mask=masks.causal())) is None


def test_empty_sizes_are_refused() -> None:
    why = lowering_refusal(call_of(*_meta(0, 8)))
    assert why is not None
    assert "(B=2, Hkv=4, Tq=0, Tk=8, Dk=8, Dv=8)" in why
