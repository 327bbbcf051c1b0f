"""The flex backend on the calls its other tests do not make: several batch dims with masks and
biases broadcast over some of them, strided inputs as transformers hands them over, more queries
than keys, rows a bias or score_mod hides whole (with sinks and the log-sum-exp), Transformer-XL's
position term under windows at ``Tq != Tk``. Each runs in float64 (flex_attention's unfused form
on the CPU, the lowering exactly as compiled) and equals the reference backend to rounding, the
``-inf`` of every hidden row's log-sum-exp included."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks
from attnkit.backends.flex.backend import cpu_compile_refusal
from attnkit.scores import DistanceBias, RelativePositionTerm

D = 8


def _randn(*shape: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _both(q: Tensor, k: Tensor, v: Tensor, **kw: object) -> None:
    """flex's output (and log-sum-exp) equal reference's, ``-inf`` where reference's is."""
    with attnkit.record_dispatch() as seen:
        got = attnkit.attention(q, k, v, backend="flex", **kw)  # type: ignore[call-overload]
    assert [d.chosen for d in seen] == ["flex"]
    want = attnkit.attention(q, k, v, backend="reference", **kw)  # type: ignore[call-overload]
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a == -math.inf, b == -math.inf)
        torch.testing.assert_close(a.nan_to_num(0.0, 0.0, 0.0), b.nan_to_num(0.0, 0.0, 0.0))


def _mb(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Batch dims (2, 3), 4 query heads over 2 key/value heads, 17 positions."""
    return (
        _randn(2, 3, 4, 17, D, seed=seed),
        _randn(2, 3, 2, 17, D, seed=seed + 1),
        _randn(2, 3, 2, 17, D, seed=seed + 2),
    )


LENGTHS = torch.tensor([17, 5, 0, 9, 11, 3])  # one per flattened batch row


@pytest.mark.parametrize(
    "kind",
    ["padding", "dense over the first dim", "bias over the second dim", "documents", "indices"],
)
def test_several_batch_dims(kind: str) -> None:
    """Masks and biases of the flattened batch rows, or broadcast over one of two batch dims."""
    q, k, v = _mb(0)
    g = torch.Generator().manual_seed(9)
    kw: dict[str, object] = {
        "padding": {"mask": masks.causal() & masks.key_padding(LENGTHS)},
        "dense over the first dim": {"mask": torch.rand(2, 1, 1, 17, 17, generator=g) > 0.4},
        "bias over the second dim": {"bias": _randn(1, 3, 4, 17, 17, seed=3)},
        "documents": {
            "mask": masks.documents(ids=torch.randint(0, 3, (6, 17), generator=g).sort(-1).values)
        },
        "indices": {"mask": masks.key_indices(torch.randint(-1, 17, (6, 2, 17, 4), generator=g))},
    }[kind]
    _both(q, k, v, **kw)


def test_several_batch_dims_with_sinks_and_the_lse() -> None:
    q, k, v = _mb(4)
    _both(q, k, v, mask=masks.key_padding(LENGTHS), sinks=_randn(4, seed=5), return_lse=True)


def test_strided_inputs_and_a_value_size_of_its_own() -> None:
    """(B, T, H, D) tensors transposed to (B, H, T, D), without a copy, as transformers passes
    them; values 5 wide against keys 7 wide."""
    q = _randn(2, 17, 4, 7, seed=6).transpose(1, 2)
    k = _randn(2, 33, 2, 7, seed=7).transpose(1, 2)
    v = _randn(2, 33, 2, 5, seed=8).transpose(1, 2)
    padding = masks.key_padding(torch.tensor([33, 20]))
    _both(q, k, v, mask=masks.sliding_window(5) & padding, softcap=2.0, return_lse=True)
    slopes = attnkit.alibi_slopes(4).double()
    _both(q, k, v, mask=masks.causal(), bias=attnkit.alibi_term(slopes, 17, 33))


@pytest.mark.parametrize(
    "mask",
    [masks.causal(), masks.documents([2, 2]), masks.sliding_window(1, right=2)],
    ids=["causal", "documents", "window"],
)
def test_more_queries_than_keys(mask: masks.Mask) -> None:
    """Queries before every key (bottom-right alignment) see none: output 0, lse -inf."""
    q, k, v = _randn(2, 4, 9, D, seed=10), _randn(2, 2, 4, D, seed=11), _randn(2, 2, 4, D, seed=12)
    _both(q, k, v, mask=mask, return_lse=True)


def test_rows_a_bias_or_a_score_mod_hides_whole() -> None:
    """A row the bias makes all -inf, under a score_mod and with sinks; a row the score_mod
    makes all -inf."""
    q, k, v = (
        _randn(2, 4, 17, D, seed=13),
        _randn(2, 2, 17, D, seed=14),
        _randn(2, 2, 17, D, seed=15),
    )
    bias = _randn(2, 1, 17, 17, seed=16)
    bias[:, :, 3] = -math.inf

    def double(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return s * 2

    def hide_row_2(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.where(q_idx == 2, -math.inf, s)

    _both(q, k, v, bias=bias, score_mod=double, return_lse=True)
    _both(q, k, v, bias=bias, sinks=_randn(4, seed=17), return_lse=True)
    _both(q, k, v, score_mod=hide_row_2, return_lse=True)
    sinks = torch.tensor([-math.inf, 0.0, 3.0, -math.inf], dtype=torch.float64)
    _both(q, k, v, mask=masks.key_padding(torch.tensor([0, 17])), sinks=sinks, return_lse=True)


@pytest.mark.parametrize(("tq", "tk"), [(17, 17), (5, 17), (1, 17), (17, 40)])
def test_position_terms_under_windows(tq: int, tk: int) -> None:
    """Transformer-XL's term read over the window's distances only, and a per-row distance
    table, at every alignment of queries and keys."""
    q, k, v = (
        _randn(2, 4, tq, D, seed=18),
        _randn(2, 4, tk, D, seed=19),
        _randn(2, 4, tk, D, seed=20),
    )
    enc = _randn(4, tq + tk - 1, D, seed=21)
    for mask in (masks.sliding_window(3), masks.sliding_window(2, right=2), masks.causal()):
        term = RelativePositionTerm(_randn(2, 4, tq, D, seed=22), enc, 0.3)
        _both(q, k, v, bias=term, mask=mask)
    table = DistanceBias(_randn(2, 4, tq + tk - 1, seed=23), first=-(tk - 1))
    _both(q, k, v, bias=table, mask=masks.causal() & masks.key_padding(torch.tensor([tk, 1])))


def _constant(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return torch.tensor(0.0)


def _by_key_alone(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return s * 0 + kv_idx * 0.25


def _in_place(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return s.mul_(2)


@pytest.mark.skipif(cpu_compile_refusal() is not None, reason="torch cannot compile flex here")
@pytest.mark.parametrize(
    "score_mod", [_constant, _by_key_alone, _in_place], ids=lambda f: f.__name__
)
def test_compiled_score_mods_that_ignore_or_write_the_scores(score_mod: object) -> None:
    """torch's compiled CPU FlexAttention computed a score_mod whose result does not read the
    score (a constant, ``score * 0 + x``) wrongly (by more than 1), and failed to build one that
    writes the scores in place; both are elementwise, and equal the reference in float32."""
    q, k, v = (t.float() for t in (_randn(2, 4, 17, D, seed=s) for s in (24, 25, 26)))
    got = attnkit.attention(q, k, v, score_mod=score_mod, mask=masks.causal(), backend="flex")  # type: ignore[arg-type]
    want = attnkit.attention(
        q.double(),
        k.double(),
        v.double(),
        score_mod=score_mod,
        mask=masks.causal(),
        backend="reference",  # type: ignore[arg-type]
    )
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


@pytest.mark.skipif(cpu_compile_refusal() is not None, reason="torch cannot compile flex here")
@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.randn(1, 1, generator=g).expand(17, 17),  # every stride 0
        lambda g: torch.randn(1, 1, 1, 17, generator=g).expand(2, 4, 17, 17),
        lambda g: torch.randn(4, 17, 17, generator=g)[:, :1, :1].expand(4, 17, 17),
        lambda g: torch.randn(17, 1, generator=g).expand(17, 17),
        lambda g: torch.randn(2, 1, 1, 1, generator=g).expand(2, 4, 17, 17),
    ],
    ids=["all-strides-0", "key-row", "a-value-a-head", "query-column", "a-value-a-row"],
)
def test_compiled_bias_broadcast_by_zero_strides(make: Any) -> None:
    """A bias broadcast by stride 0 in every dim (one value in its storage) failed to build in
    torch's compiled CPU FlexAttention; the dims it broadcasts are read as one value."""
    g = torch.Generator().manual_seed(30)
    bias = make(g)
    q, k, v = (t.float() for t in (_randn(2, 4, 17, D, seed=s) for s in (27, 28, 29)))
    got = attnkit.attention(q, k, v, bias=bias, mask=masks.causal(), backend="flex")
    want = attnkit.attention(
        q.double(),
        k.double(),
        v.double(),
        bias=bias.double(),
        mask=masks.causal(),
        backend="reference",
    )
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
