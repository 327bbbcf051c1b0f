"""attnkit.flex and ``backend="flex"`` across FlexAttention's own test grid.

score_mods (relative bias, ALiBi, tanh softcap, head offsets, captured tensors read at b, h,
q_idx and kv_idx, batch-dependent ones) times mask_mods (causal, bottom-right causal, sliding
window, prefix LM, documents from offsets, key padding read from a captured tensor, rows and
heads with no key, noop, and_masks / or_masks), with block masks from attnkit's and torch's
``create_block_mask`` (B and H None or given, BLOCK_SIZE other than 128, lengths that are not
multiples of it), against torch's own unfused ``flex_attention`` in float64 (output and
log-sum-exp); gradients (q, k, v, captured tensors, the log-sum-exp) and the decoding shapes
against the float64 ``reference`` backend; other dtypes against float64; what torch refuses;
``explain()`` against ``record_dispatch()``; one call under ``torch.compile``.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import flex
from attnkit.testing import assert_close

tf = pytest.importorskip("torch.nn.attention.flex_attention")

B, H, HKV, D, DV = 2, 4, 2, 8, 6
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
BIAS_BH = torch.linspace(-1.0, 1.0, B * H, dtype=torch.float64).view(B, H)
REL = torch.linspace(-0.5, 0.5, 2 * 300 + 1, dtype=torch.float64)  # a table by distance
LENGTHS = torch.tensor([10_000, 11])  # key padding: row 0 sees every key, row 1 the first 11

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _score_mods(tq: int, tk: int) -> dict[str, ScoreMod | None]:
    table = torch.linspace(-2.0, 2.0, tq * tk, dtype=torch.float64).view(tq, tk)
    return {
        "none": None,
        "relative": lambda s, b, h, q, kv: s + 0.1 * (q - kv),
        "alibi": lambda s, b, h, q, kv: s + SLOPES[h] * (kv - q),
        "tanh_softcap": lambda s, b, h, q, kv: 3.0 * torch.tanh(s / 3.0),
        "head_offset": lambda s, b, h, q, kv: s + h - 1.5 * b,
        "captured_bh": lambda s, b, h, q, kv: s + BIAS_BH[b, h],
        "captured_qkv": lambda s, b, h, q, kv: s + table[q, kv],
        "captured_distance": lambda s, b, h, q, kv: s + REL[kv - q + 300],
        "batch_dependent": lambda s, b, h, q, kv: torch.where(b == 0, s, 0.5 * s),
    }


def _mask_mods(tq: int, tk: int) -> dict[str, MaskMod]:
    offsets = torch.tensor([0, 5, tk // 2, tk])  # documents from their offsets
    doc = torch.zeros(max(tq, tk), dtype=torch.long)
    for start in offsets[1:-1].tolist():
        doc[start:] += 1
    shift = tk - tq

    def causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return q >= kv

    return {
        "causal": causal,
        "causal_bottom_right": lambda b, h, q, kv: q + shift >= kv,
        "sliding_window": lambda b, h, q, kv: (q + shift >= kv) & (q + shift - kv <= 5),
        "prefix_lm": lambda b, h, q, kv: (kv <= q) | (kv < 4),
        "documents": lambda b, h, q, kv: doc[q] == doc[kv],
        "key_padding": lambda b, h, q, kv: kv < LENGTHS[b],
        "empty_rows": lambda b, h, q, kv: (q % 3 != 0) & (kv <= q + shift),
        "empty_head": lambda b, h, q, kv: (h != 1) & (kv >= 0),
        "noop": flex.noop_mask,
        "and_masks": flex.and_masks(causal, lambda b, h, q, kv: kv % 2 == 0),
        "or_masks": flex.or_masks(lambda b, h, q, kv: q - kv == 3, lambda b, h, q, kv: kv == 0),
        "and_of_none": flex.and_masks(),
    }


def _qkv(tq: int, tk: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, H, tq, D, generator=g, dtype=torch.float64).to(dtype),
        torch.randn(B, HKV, tk, D, generator=g, dtype=torch.float64).to(dtype),
        torch.randn(B, HKV, tk, DV, generator=g, dtype=torch.float64).to(dtype),
    ]


def _torch(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """torch's unfused flex_attention (the CPU's form with the log-sum-exp): output and lse."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile()"
        out, aux = tf.flex_attention(
            q, k, v, return_aux=tf.AuxRequest(lse=True), enable_gqa=True, **kwargs
        )
    return out, aux.lse


def _same_lse(got: Tensor, want: Tensor, atol: float = 1e-10) -> None:
    """Equal log-sum-exps, ``-inf`` (a query that sees no key) where the other is ``-inf``."""
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert torch.equal(got == -math.inf, want == -math.inf)
    seen = want != -math.inf
    torch.testing.assert_close(got[seen], want[seen], atol=atol, rtol=atol)


# ------------------------------------------------------------------------------------------------
# Values against torch's own flex_attention, float64

GRID = (
    [("none", m, (37, 45)) for m in ("noop", "and_masks", "and_of_none", "empty_head")]
    + [(s, "causal", (37, 45)) for s in _score_mods(1, 1) if s != "none"]
    + [
        ("captured_qkv", "documents", (16, 257)),
        ("alibi", "sliding_window", (1, 300)),
        ("batch_dependent", "key_padding", (130, 129)),
        ("captured_bh", "empty_rows", (16, 257)),
        ("tanh_softcap", "empty_head", (130, 129)),
        ("captured_distance", "or_masks", (1, 300)),
        ("head_offset", "prefix_lm", (16, 257)),
        ("relative", "causal_bottom_right", (1, 300)),
    ]
)
# (B, H, BLOCK_SIZE) of the block masks, taken in turn: None/None/128, and given/given/(16, 32)
BLOCK_MASKS = [(None, None, 128), (B, H, (16, 32))]


@pytest.mark.parametrize(
    ("mod_name", "mask_name", "shape", "made"),
    [(*case, BLOCK_MASKS[i % 2]) for i, case in enumerate(GRID)],
)
def test_values_and_lse_match_torch(
    mod_name: str, mask_name: str, shape: tuple[int, int], made: tuple[Any, Any, Any]
) -> None:
    tq, tk = shape
    q, k, v = _qkv(tq, tk, seed=tq + tk)
    mod, mask_mod = _score_mods(tq, tk)[mod_name], _mask_mods(tq, tk)[mask_name]
    bb, hh, size = made
    theirs = tf.create_block_mask(mask_mod, bb, hh, tq, tk, device="cpu", BLOCK_SIZE=size)
    want, want_lse = _torch(q, k, v, score_mod=mod, block_mask=theirs, scale=0.7)
    ours = flex.create_block_mask(mask_mod, bb, hh, tq, tk, BLOCK_SIZE=size)
    for block_mask in (ours, theirs):
        got, aux = flex.flex_attention(
            q,
            k,
            v,
            mod,
            block_mask,
            scale=0.7,
            enable_gqa=True,
            return_aux=flex.AuxRequest(lse=True),
        )
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
        assert aux.lse is not None
        _same_lse(aux.lse, want_lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_other_dtypes_against_float64(dtype: torch.dtype) -> None:
    """Output in query's dtype, the log-sum-exp in float32 (as torch), both near float64."""
    q, k, v = _qkv(37, 45)
    mods, masks = _score_mods(37, 45), _mask_mods(37, 45)
    block_mask = flex.create_block_mask(masks["documents"], None, None, 37, 45)
    want, want_lse = _torch(
        q, k, v, score_mod=mods["alibi"], block_mask=_torch_of(masks["documents"], 37, 45)
    )
    low = [t.to(dtype) for t in (q, k, v)]
    got, lse = flex.flex_attention(
        *low, mods["alibi"], block_mask, enable_gqa=True, return_lse=True
    )
    assert got.dtype == dtype
    assert lse.dtype == torch.float32
    assert_close(got, want)
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)


def _torch_of(mask_mod: MaskMod, tq: int, tk: int) -> Any:
    return tf.create_block_mask(mask_mod, None, None, tq, tk, device="cpu")


def test_rows_with_no_key_give_zero_and_minus_inf_with_zero_gradients() -> None:
    """Rows the mask_mod empties and rows the score_mod empties (-inf everywhere): torch gives
    output 0 and lse -inf; attnkit too, with finite zero gradients for those rows."""
    tq, tk = 20, 33
    q, k, v = (t.requires_grad_() for t in _qkv(tq, tk))
    mask_mod = _mask_mods(tq, tk)["empty_rows"]

    def score_mod(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return torch.where(qi == 4, -math.inf, s)

    want, want_lse = _torch(
        q.detach(),
        k.detach(),
        v.detach(),
        score_mod=score_mod,
        block_mask=_torch_of(mask_mod, tq, tk),
    )
    block_mask = flex.create_block_mask(mask_mod, None, None, tq, tk)
    got, lse = flex.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(got.detach(), want, atol=1e-10, rtol=1e-10)
    _same_lse(lse.detach(), want_lse)
    empty = torch.zeros(tq, dtype=torch.bool)
    empty[::3], empty[4] = True, True
    assert got[:, :, empty].eq(0).all()
    assert lse[:, :, empty].eq(-math.inf).all()
    (got.sum() + lse.masked_fill(lse == -math.inf, 0).sum()).backward()
    assert q.grad is not None
    assert k.grad is not None
    assert v.grad is not None
    assert all(bool(t.isfinite().all()) for t in (q.grad, k.grad, v.grad))
    assert q.grad[:, :, empty].eq(0).all()


# ------------------------------------------------------------------------------------------------
# Gradients, decoding shapes, against the float64 reference backend


@pytest.mark.parametrize("tq", [1, 3, 16])
def test_decoding_gradients_of_captured_tensors_and_lse(tq: int) -> None:
    """Tq = 1..16 against 200 keys, a batch-dependent padding mask read from a captured tensor,
    a score_mod reading three captured tensors that need gradients (by b and h, by q_idx, by
    kv_idx): every gradient, the log-sum-exp's included, equals the reference backend's."""
    tk = 200
    q, k, v = (t.requires_grad_() for t in _qkv(tq, tk, seed=tq))
    g = torch.Generator().manual_seed(tq)
    bias = torch.randn(B, H, generator=g, dtype=torch.float64, requires_grad=True)
    by_q = torch.randn(tq, generator=g, dtype=torch.float64, requires_grad=True)
    by_kv = torch.randn(tk, generator=g, dtype=torch.float64, requires_grad=True)
    lengths, shift = torch.tensor([tk, tk // 3]), tk - tq

    def score_mod(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return s + bias[b, h] + by_q[qi] * by_kv[kv]

    def mask_mod(b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return (kv < lengths[b]) & (qi + shift >= kv)

    block_mask = flex.create_block_mask(mask_mod, B, None, tq, tk, BLOCK_SIZE=64)
    weights = torch.linspace(-1, 1, DV, dtype=torch.float64)
    leaves = [q, k, v, bias, by_q, by_kv]

    def grads(out: Tensor, lse: Tensor) -> list[Tensor]:
        got = torch.autograd.grad((out * weights).sum() + 0.3 * lse.sum(), leaves)
        return [out.detach(), lse.detach(), *got]

    ours = grads(
        *flex.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True, return_lse=True)
    )
    want = grads(
        *attnkit.attention(
            q,
            k,
            v,
            mask=block_mask.mask,
            score_mod=score_mod,
            backend="reference",
            return_lse=True,
        )
    )
    for got, expected in zip(ours, want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)


# ------------------------------------------------------------------------------------------------
# What torch accepts, attnkit accepts


@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype"),
    [
        (torch.float64, torch.float32),
        (torch.float32, torch.float16),
        (torch.float32, torch.float64),
        (torch.float32, torch.float8_e4m3fn),
    ],
)
def test_key_and_value_of_another_dtype_are_taken_as_torch_takes_them(
    q_dtype: torch.dtype, kv_dtype: torch.dtype
) -> None:
    """torch's flex_attention takes key and value in another floating dtype (low-precision
    ones, float8 included) and computes in query's: so does attnkit."""
    q, k, v = _qkv(9, 17)
    q = q.to(q_dtype)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    mod = _score_mods(9, 17)["relative"]  # no float64 capture: torch's lse keeps its dtype
    want, want_lse = _torch(q, k, v, score_mod=mod)
    got, lse = flex.flex_attention(q, k, v, mod, enable_gqa=True, return_lse=True)
    assert got.dtype == want.dtype
    assert lse.dtype == want_lse.dtype
    tol = 1e-12 if q_dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=tol, rtol=tol)


def test_key_and_value_of_another_dtype_get_gradients_in_their_dtype() -> None:
    q, k, v = _qkv(9, 17)
    k32, v32 = (t.float().requires_grad_() for t in (k, v))
    q.requires_grad_()
    out = flex.flex_attention(q, k32, v32, enable_gqa=True)
    out.sum().backward()
    assert k32.grad is not None
    assert k32.grad.dtype == torch.float32
    ref = attnkit.attention(q, k32.double(), v32.double(), backend="reference")
    assert_close(out, ref)


@pytest.mark.parametrize("kernel_options", [None, {}, {"BLOCK_M": 32, "BACKEND": "TRITON"}])
def test_kernel_options_torch_takes_are_taken(kernel_options: dict[str, Any] | None) -> None:
    q, k, v = _qkv(9, 17)
    want, _ = _torch(q, k, v, kernel_options=kernel_options)
    got = flex.flex_attention(q, k, v, enable_gqa=True, kernel_options=kernel_options)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


# ------------------------------------------------------------------------------------------------
# What torch refuses, attnkit refuses, saying why

_CAUSAL: MaskMod = lambda b, h, q, kv: q >= kv  # noqa: E731


def _call(**kwargs: Any) -> Callable[[Any], object]:
    """A flex_attention call of (2, 4, 16, 8) queries on (2, 2, 16, 8) keys, with ``kwargs``,
    made by ``api`` (torch's module or attnkit.flex)."""
    q, k, v = _qkv(16, 16)
    kwargs.setdefault("enable_gqa", True)

    def run(api: Any) -> object:
        kw = dict(kwargs)
        if callable(kw.get("block_mask")):  # made by the api under test
            kw["block_mask"] = kw["block_mask"](api)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return api.flex_attention(kw.pop("q", q), kw.pop("k", k), kw.pop("v", v), **kw)

    return run


REFUSED: dict[str, tuple[Callable[[Any], object], str]] = {
    "grouped heads without enable_gqa": (_call(enable_gqa=False), r"enable_gqa=True"),
    "heads not a multiple": (
        _call(
            k=torch.zeros(2, 3, 16, 8, dtype=torch.float64),
            v=torch.zeros(2, 3, 16, DV, dtype=torch.float64),
        ),
        r"H=4.*Hkv=3",
    ),
    "key head size": (_call(k=torch.zeros(2, 2, 16, 5, dtype=torch.float64)), r"Dk"),
    "three dims": (_call(q=torch.zeros(4, 16, 8, dtype=torch.float64)), r"4-d"),
    "lse twice": (
        _call(return_lse=True, return_aux=tf.AuxRequest(lse=True)),
        r"return_lse.*not both",
    ),
    "max_scores": (_call(return_aux=tf.AuxRequest(lse=True, max_scores=True)), r"max_scores"),
    "block mask too short": (
        _call(block_mask=lambda api: _made(api, None, None, 8, 16)),
        r"\(1, 1, 8, 16\).*\(2, 4, 16, 16\)",
    ),
    "kernel_options BACKEND": (
        _call(kernel_options={"BACKEND": "NOPE"}),
        r"BACKEND.*'NOPE'",
    ),
    "kernel_options OUTPUT_LOGSUMEXP": (
        _call(kernel_options={"OUTPUT_LOGSUMEXP": True}),
        r"OUTPUT_LOGSUMEXP.*return_aux",
    ),
    "kernel_options OUTPUT_MAX": (
        _call(kernel_options={"OUTPUT_MAX": True}),
        r"OUTPUT_MAX.*return_aux",
    ),
}


def _made(api: Any, b: int | None, h: int | None, tq: int, tk: int, **kw: Any) -> Any:
    extra = {"device": "cpu"} if api is tf else {}
    return api.create_block_mask(_CAUSAL, b, h, tq, tk, **extra, **kw)


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_torch_refuses_is_refused_with_a_reason(name: str) -> None:
    run, words = REFUSED[name]
    with pytest.raises(Exception):  # noqa: B017, PT011 (torch's own types vary)
        run(tf)
    with pytest.raises((ValueError, TypeError)) as info:
        run(flex)
    assert re.search(words, str(info.value)), str(info.value)


def test_a_sliced_torch_block_mask_is_refused_as_torch_refuses_it() -> None:
    block_mask = _made(tf, B, H, 16, 16, BLOCK_SIZE=8)[:, :]
    with pytest.raises(RuntimeError, match="sliced BlockMask"):
        _call(block_mask=lambda api: block_mask)(tf)
    with pytest.raises(RuntimeError, match="sliced BlockMask"):
        _call(block_mask=lambda api: block_mask)(flex)


@pytest.mark.parametrize(
    ("size", "error", "words"),
    [
        (0, ValueError, r"BLOCK_SIZE.*>= 1, got 0"),
        ((16, -4), ValueError, r"BLOCK_SIZE.*>= 1, got -4"),
        ((1, 2, 3), ValueError, r"BLOCK_SIZE.*\(1, 2, 3\)"),
        (16.0, TypeError, r"BLOCK_SIZE.*16\.0"),
    ],
)
def test_create_block_mask_refuses_a_block_size_torch_cannot_use(
    size: Any, error: type[Exception], words: str
) -> None:
    with pytest.raises(Exception):  # noqa: B017, PT011 (torch's own types vary)
        tf.create_block_mask(_CAUSAL, None, None, 16, 16, device="cpu", BLOCK_SIZE=size)
    with pytest.raises(error, match=words):
        flex.create_block_mask(_CAUSAL, None, None, 16, 16, BLOCK_SIZE=size)


# ------------------------------------------------------------------------------------------------
# explain() says what ran; backend="flex"


@pytest.mark.parametrize("requires_grad", [False, True])
def test_explain_names_the_backend_and_kernel_that_ran(requires_grad: bool) -> None:
    tq, tk = 16, 40
    q, k, v = (t.requires_grad_(requires_grad) for t in _qkv(tq, tk))
    cases: list[tuple[ScoreMod | None, MaskMod | None]] = [
        (None, None),
        (_score_mods(tq, tk)["tanh_softcap"], _mask_mods(tq, tk)["causal"]),
        (_score_mods(tq, tk)["captured_qkv"], _mask_mods(tq, tk)["documents"]),
    ]
    for mod, mask_mod in cases:
        block_mask = (
            None if mask_mod is None else flex.create_block_mask(mask_mod, None, None, tq, tk)
        )
        with attnkit.record_dispatch() as record:
            flex.flex_attention(q, k, v, mod, block_mask, enable_gqa=True)
        (ran,) = record
        mask = None if block_mask is None else block_mask.mask
        said = attnkit.explain(q, k, v, mask=mask, score_mod=mod, scale=1 / math.sqrt(D))
        assert said.chosen == ran.served_by
        assert mod is None or ran.served_by == "chunked"
        if ran.kernel is not None:
            assert ran.kernel in str(said), (ran.kernel, str(said))


def test_backend_flex_runs_what_explain_says_and_matches_the_reference() -> None:
    """float64 on the CPU: the unfused form, with the log-sum-exp."""
    tq, tk = 16, 257
    q, k, v = _qkv(tq, tk)
    mod = _score_mods(tq, tk)["captured_distance"]
    mask = flex.create_block_mask(_mask_mods(tq, tk)["sliding_window"], None, None, tq, tk).mask
    with attnkit.record_dispatch() as record:
        out, lse = attnkit.attention(
            q, k, v, mask=mask, score_mod=mod, backend="flex", return_lse=True
        )
    said = attnkit.explain(q, k, v, mask=mask, score_mod=mod, backend="flex", return_lse=True)
    assert said.chosen == record[0].served_by == "flex"
    assert "unfused" in str(said)
    want, want_lse = attnkit.attention(
        q, k, v, mask=mask, score_mod=mod, backend="reference", return_lse=True
    )
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    _same_lse(lse, want_lse)


def test_flex_attention_under_torch_compile() -> None:
    """One compiled call (compiling flex on the CPU takes seconds): a torch BlockMask, a
    captured per-head table, the log-sum-exp, fullgraph."""
    tq, tk = 24, 40
    q, k, v = (t.float() for t in _qkv(tq, tk))
    mod, mask_mod = _score_mods(tq, tk)["alibi"], _mask_mods(tq, tk)["documents"]
    block_mask = tf.create_block_mask(mask_mod, None, None, tq, tk, device="cpu", BLOCK_SIZE=16)

    def run(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        out, aux = flex.flex_attention(
            q, k, v, mod, block_mask, enable_gqa=True, return_aux=flex.AuxRequest(lse=True)
        )
        return out, aux.lse

    got, lse = torch.compile(run, fullgraph=True)(q, k, v)
    want, want_lse = _torch(
        q.double(), k.double(), v.double(), score_mod=mod, block_mask=block_mask
    )
    assert_close(got, want)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_aux_request_and_output_are_tuples_as_torch_s() -> None:
    """torch's AuxRequest and AuxOutput are named tuples: code unpacks and indexes them."""
    q, k, v = _qkv(9, 17)
    want, want_lse = _torch(q, k, v)
    out, (lse, max_scores) = flex.flex_attention(
        q, k, v, enable_gqa=True, return_aux=flex.AuxRequest(True)
    )
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)
    assert max_scores is None
    assert tuple(flex.AuxRequest(lse=True)) == tuple(tf.AuxRequest(lse=True)) == (True, False)
    assert flex.AuxOutput()._fields == tf.AuxOutput()._fields


@pytest.mark.parametrize(
    ("name", "mask_mod"),
    [
        ("min over the queries", lambda b, h, q, kv: kv <= q.min() + 5),
        ("max over the keys", lambda b, h, q, kv: q + 2 >= kv.max()),
        ("count of the keys", lambda b, h, q, kv: kv <= q + kv.numel() - 8),
        ("mean over the heads", lambda b, h, q, kv: (h.float().mean() < 1) & (q >= kv)),
    ],
)
def test_a_mask_mod_that_is_not_elementwise_is_refused(name: str, mask_mod: MaskMod) -> None:
    """torch calls a mask_mod on one pair at a time, where a reduction over an index tensor is
    that index; attnkit calls it on tiles, where it would be the tile's: refused, not run."""
    q, k, v = _qkv(300, 300)
    with pytest.raises(ValueError, match=r"mask_mod .* not elementwise.*\(b, h, q_idx, kv_idx\)"):
        flex.flex_attention(
            q,
            k,
            v,
            block_mask=flex.create_block_mask(mask_mod, None, None, 300, 300),
            enable_gqa=True,
        )
    theirs = tf.create_block_mask(mask_mod, None, None, 300, 300, device="cpu")
    with pytest.raises(ValueError, match=r"mask_mod .* not elementwise"):
        flex.flex_attention(q, k, v, block_mask=theirs, enable_gqa=True)


@pytest.mark.parametrize("key_batch", [B, 1])
@pytest.mark.parametrize("mod_name", ["distance_table", "softcap"])
def test_fused_score_mods_train_like_the_reference(mod_name: str, key_batch: int) -> None:
    """A bias by distance read from a table that needs gradients, and a softcap, run fused
    (the native kernel): values, lse and every gradient (the table's included) equal the
    reference's, with keys of batch 1 shared by every query row."""
    tq, tk = 37, 45
    q, k, v = _qkv(tq, tk, seed=7)
    k, v = k[:key_batch].requires_grad_(), v[:key_batch].requires_grad_()
    q.requires_grad_()
    g = torch.Generator().manual_seed(7)
    table = torch.randn(H, tq + tk, generator=g, dtype=torch.float64, requires_grad=True)
    mods: dict[str, ScoreMod] = {
        "distance_table": lambda s, b, h, qi, kv: s + table[h, kv - qi + tq],
        "softcap": lambda s, b, h, qi, kv: 2.5 * torch.tanh(s / 2.5),
    }
    mod = mods[mod_name]
    block_mask = flex.create_block_mask(_mask_mods(tq, tk)["sliding_window"], None, None, tq, tk)
    leaves = [q, k, v, table]

    def grads(out: Tensor, lse: Tensor) -> list[Tensor]:
        loss = 1.3 * out.sum() + lse.masked_fill(lse == -math.inf, 0).sum()
        got = torch.autograd.grad(loss, leaves, allow_unused=True)
        zeros = [torch.zeros_like(t) if d is None else d for t, d in zip(leaves, got, strict=True)]
        return [out, lse, *zeros]

    with attnkit.record_dispatch() as record:
        ours = grads(
            *flex.flex_attention(
                q, k, v, mod, block_mask, scale=0.6, enable_gqa=True, return_lse=True
            )
        )
    assert record[0].kernel == "native kernel"
    kk, vv = k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)
    want = grads(
        *attnkit.attention(
            q,
            kk,
            vv,
            mask=block_mask.mask,
            score_mod=mod,
            scale=0.6,
            backend="reference",
            return_lse=True,
        )
    )
    for got, expected in zip(ours, want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize(
    ("mask_mod", "error", "words"),
    [
        (lambda b, h, q, kv: (q >= kv)[None], ValueError, r"shape \(1, 1, 1, 20, 20\).*broadcast"),
        (
            lambda b, h, q, kv: torch.ones(3, 3, dtype=torch.bool),
            ValueError,
            r"\(3, 3\).*broadcast",
        ),
        (lambda b, h, q, kv: True, TypeError, r"bool tensor"),
        (lambda b, h, q, kv: (q >= kv).int(), TypeError, r"bool tensor.*int32"),
    ],
)
def test_a_mask_mod_of_the_wrong_shape_or_type_is_refused_saying_so(
    mask_mod: MaskMod, error: type[Exception], words: str
) -> None:
    q = torch.randn(1, 2, 20, 8)
    with pytest.raises(error, match=words):
        flex.flex_attention(
            q, q, q, block_mask=flex.create_block_mask(mask_mod, None, None, 20, 20)
        )


def test_a_mask_mod_is_probed_once_not_on_every_call() -> None:
    """The elementwise probe of a mask_mod (a host read on a GPU) runs on the first call with a
    mask_mod, not again on the calls of a training loop that reuse it."""
    probes = []

    def causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        if q.numel() == 7 and int(q.min()) == 1:  # the probe's tile without its first query
            probes.append(1)
        return q >= kv

    q, k, v = _qkv(40, 40)
    block_mask = flex.create_block_mask(causal, None, None, 40, 40)
    for _ in range(3):
        flex.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    assert len(probes) == 1
