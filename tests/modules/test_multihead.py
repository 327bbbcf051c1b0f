"""MultiHeadAttention: against an independent float64 formula and against torch's module."""

from __future__ import annotations

import collections
import copy
import math
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import attnkit
from attnkit import MultiHeadAttention, masks
from attnkit.interop.torch import from_torch_masks
from attnkit.testing import assert_close

from ..helpers import attnkit_checks_only, needs_cxx

# --------------------------------------------------------------------------------------------------
# An independent formula: explicit per-head weights, GQA by repeating key/value heads, softmax over
# the allowed keys only; add_bias_kv and add_zero_attn as torch does them, by appending keys and
# values that every query may attend.


def formula(
    m: MultiHeadAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """Output (B, Tq, D) and per-head weights (B, H, Tq, Tk + extra tokens) of ``m``, in
    float64."""
    h, hkv, dh, dhv = m.num_heads, m.num_kv_heads, m.head_dim, m.v_head_dim
    params = {n: p.detach().double() for n, p in m.named_parameters()}
    if "in_proj_weight" in params:
        wq, wk, wv = params["in_proj_weight"].split([h * dh, hkv * dh, hkv * dhv])
    else:
        wq, wk, wv = params["q_proj_weight"], params["k_proj_weight"], params["v_proj_weight"]
    bq = bk = bv = None
    if "in_proj_bias" in params:
        bq, bk, bv = params["in_proj_bias"].split([h * dh, hkv * dh, hkv * dhv])
    b, tq, tk = query.size(0), query.size(1), key.size(1)
    q = F.linear(query.double(), wq, bq).view(b, tq, h, dh).transpose(1, 2)
    k = F.linear(key.double(), wk, bk).view(b, tk, hkv, dh).transpose(1, 2)
    v = F.linear(value.double(), wv, bv).view(b, tk, hkv, dhv).transpose(1, 2)
    if "bias_k" in params:
        k = torch.cat([k, params["bias_k"].view(1, hkv, 1, dh).expand(b, -1, -1, -1)], 2)
        v = torch.cat([v, params["bias_v"].view(1, hkv, 1, dhv).expand(b, -1, -1, -1)], 2)
    if m.add_zero_attn:
        k = torch.cat([k, k.new_zeros(b, hkv, 1, dh)], 2)
        v = torch.cat([v, v.new_zeros(b, hkv, 1, dhv)], 2)
    k = k.repeat_interleave(h // hkv, dim=1)  # query head i uses key/value head i // (H / Hkv)
    v = v.repeat_interleave(h // hkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(dh)  # (B, H, Tq, Tk + extra)
    allowed = torch.ones(b, h, tq, tk, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if causal:
        i = torch.arange(tq)[:, None]
        j = torch.arange(tk)
        allowed = allowed & (j <= i + tk - tq)
    extra = scores.size(-1) - tk  # the appended tokens: visible to every query
    allowed = torch.cat([allowed, allowed.new_ones(b, h, tq, extra)], -1)
    weights = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    heads = (weights @ v).transpose(1, 2).reshape(b, tq, h * dhv)
    out = F.linear(heads, params["out_proj.weight"], params.get("out_proj.bias"))
    return out, weights


@st.composite
def configs(draw: st.DrawFn) -> dict[str, object]:
    hkv = draw(st.integers(1, 3))
    h = hkv * draw(st.sampled_from([1, 2, 3]))
    sizes = draw(st.sampled_from(["even", "head_dim", "both"]))
    dh = draw(st.integers(1, 5))
    kw: dict[str, object] = {"num_kv_heads": hkv, "proj_bias": draw(st.booleans())}
    d_model = h * dh
    if sizes != "even":
        d_model = draw(st.integers(1, 12))
        kw["head_dim"] = dh
    if sizes == "both":
        kw["v_head_dim"] = draw(st.integers(1, 5))
    if draw(st.booleans()):
        kw["kdim"] = draw(st.integers(1, 7))
        kw["vdim"] = draw(st.integers(1, 7))
    kw["add_bias_kv"] = draw(st.booleans())
    kw["add_zero_attn"] = draw(st.booleans())
    return {"d_model": d_model, "num_heads": h, **kw}


@given(
    cfg=configs(),
    b=st.integers(1, 2),
    tq=st.integers(1, 6),
    tk=st.integers(1, 6),
    self_attention=st.booleans(),
    shared_memory=st.booleans(),
    causal=st.booleans(),
    masked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_formula(
    cfg: dict[str, object],
    b: int,
    tq: int,
    tk: int,
    self_attention: bool,
    shared_memory: bool,
    causal: bool,
    masked: bool,
    seed: int,
) -> None:
    torch.manual_seed(seed)
    m = MultiHeadAttention(**cfg, dtype=torch.float64)  # type: ignore[arg-type]
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()  # biases too: zeros would hide a bias applied to the wrong rows
    query = torch.randn(b, tq, m.d_model, dtype=torch.float64)
    if self_attention and m.in_proj_weight is not None:
        key = value = query
        tk = tq
    elif shared_memory and m.kdim == m.vdim:
        # Cross-attention on one memory, passed as key and value (or as key alone): keys and
        # values are then projected from one tensor, in one GEMM when the weights are packed.
        key = value = torch.randn(b, tk, m.kdim, dtype=torch.float64)
    else:
        key = torch.randn(b, tk, m.kdim, dtype=torch.float64)
        value = torch.randn(b, tk, m.vdim, dtype=torch.float64)
    mask = torch.rand(b, 1, tq, tk) < 0.7 if masked else None
    out, w = m(
        query,
        None if key is query else key,
        None if value is key else value,
        mask=mask,
        causal=causal,
        need_weights=True,
        average_weights=False,
    )
    want_out, want_w = formula(m, query, key, value, mask=mask, causal=causal)
    assert_close(out, want_out)
    assert_close(w, want_w)
    # The fast path (no weights) computes the same output.
    assert_close(m(query, key, value, mask=mask, causal=causal), want_out)


def test_average_weights_and_per_head() -> None:
    m = MultiHeadAttention(12, 3, dtype=torch.float64)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    mem = torch.randn(2, 7, 12, dtype=torch.float64)
    _, per_head = m(x, mem, need_weights=True, average_weights=False)
    _, avg = m(x, mem, need_weights=True)
    assert per_head.shape == (2, 3, 5, 7)
    assert avg.shape == (2, 5, 7)
    assert_close(avg, per_head.mean(1))
    assert_close(avg.sum(-1), torch.ones(2, 5, dtype=torch.float64))


def test_gqa_parameters_are_hkv_heads_wide() -> None:
    m = MultiHeadAttention(64, 8, num_kv_heads=2, head_dim=16, v_head_dim=4)
    assert m.in_proj_weight is not None
    assert m.in_proj_weight.shape == (8 * 16 + 2 * 16 + 2 * 4, 64)
    assert m.out_proj.weight.shape == (64, 8 * 4)
    cache = m.make_cache(3, 10)
    assert cache.k_cache.shape == (3, 2, 10, 16)
    assert cache.v_cache.shape == (3, 2, 10, 4)


def test_projections_without_bias_and_separate() -> None:
    m = MultiHeadAttention(8, 2, kdim=5, vdim=3, proj_bias=False)
    names = {n for n, _ in m.named_parameters()}
    assert names == {"q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"}


def test_dropout_in_training_only() -> None:
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, dropout=0.5, dtype=torch.float64)
    plain = MultiHeadAttention(16, 4, dtype=torch.float64)
    plain.load_state_dict(m.state_dict())
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    m.eval()
    assert_close(m(x), plain(x))
    m.train()
    out, w = m(x, need_weights=True)
    assert (out - plain(x)).abs().max() > 1e-3  # dropout changed the output
    assert_close(w, plain(x, need_weights=True)[1])  # the weights are taken before dropout
    assert not torch.equal(m(x), m(x))  # fresh dropout each call


# --------------------------------------------------------------------------------------------------
# add_bias_kv and add_zero_attn: extra tokens that every query sees


def test_extra_tokens_in_cached_decoding_equal_the_whole_call() -> None:
    # The learned token is merged into each call, not cached: decoding step by step with a cache
    # (rotary positions, grouped-query heads, causal) gives the output of the whole sequence.
    torch.manual_seed(0)
    m = MultiHeadAttention(
        16,
        4,
        num_kv_heads=2,
        rotary=attnkit.RotaryEmbedding(4),
        add_bias_kv=True,
        add_zero_attn=True,
        dtype=torch.float64,
    )
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    full, full_w = m(x, causal=True, need_weights=True, average_weights=False)
    assert full_w.shape == (2, 4, 6, 6 + 2)
    assert_close(full_w.sum(-1), torch.ones(2, 4, 6, dtype=torch.float64))
    cache = m.make_cache(2, 6)
    with torch.no_grad():
        steps = [m(x[:, :3], causal=True, cache=cache)]
        steps += [m(x[:, i : i + 1], causal=True, cache=cache) for i in range(3, 5)]
        # The last step sees 6 keys (5 cached), then the learned token and the zero key.
        last, w = m(x[:, 5:], causal=True, cache=cache, need_weights=True, average_weights=False)
    assert_close(torch.cat([*steps, last], 1), full)
    assert_close(w, full_w[:, :, 5:])


@pytest.mark.filterwarnings("ignore:mask lets no query")  # meant: no query sees a key
def test_a_query_that_sees_no_key_still_sees_the_extra_tokens() -> None:
    torch.manual_seed(1)
    m = MultiHeadAttention(4, 2, add_bias_kv=True, add_zero_attn=True, dtype=torch.float64)
    hidden = torch.zeros(1, 1, 3, 5, dtype=torch.bool)  # no query may attend any key
    x, mem = torch.randn(1, 3, 4, dtype=torch.float64), torch.randn(1, 5, 4, dtype=torch.float64)
    out, w = m(x, mem, mask=hidden, need_weights=True, average_weights=False)
    want_out, want_w = formula(m, x, mem, mem, mask=hidden)
    assert_close(out, want_out)
    assert_close(w, want_w)
    assert torch.equal(w[..., :5], torch.zeros(1, 2, 3, 5, dtype=torch.float64))
    # Each row splits between the learned token (score s) and the zero key (score 0).
    q = F.linear(x, *(t[:4] for t in (m.in_proj_weight, m.in_proj_bias)))  # type: ignore[index]
    s = (q.view(1, 3, 2, 2).transpose(1, 2) * m.bias_k.view(2, 1, 2)).sum(-1) / math.sqrt(2)  # type: ignore[union-attr]
    assert_close(w[..., 5], torch.sigmoid(s).detach())
    assert_close(w[..., 6], torch.sigmoid(-s).detach())


@pytest.mark.filterwarnings("ignore:mask lets no query")  # meant: no query sees a key
def test_the_learned_tokens_weight_is_dropped_in_training() -> None:
    # With every key hidden, each head's output is the learned value times the token's weight,
    # which dropout keeps (scaled by 1 / (1 - p)) or drops, independently per query and head.
    torch.manual_seed(2)
    m = MultiHeadAttention(4, 2, add_bias_kv=True, dropout=0.5, dtype=torch.float64).train()
    with torch.no_grad():
        m.out_proj.weight.copy_(torch.eye(4))  # the heads' outputs, as they are
    hidden = torch.zeros(1, 1, 200, 3, dtype=torch.bool)
    x, mem = torch.randn(1, 200, 4, dtype=torch.float64), torch.randn(1, 3, 4, dtype=torch.float64)
    out, w = m(x, mem, mask=hidden, need_weights=True, average_weights=False)
    assert_close(w[..., -1], torch.ones(1, 2, 200, dtype=torch.float64))  # before dropout
    heads = out.detach().view(200, 2, 2)
    value = m.bias_v.detach().view(2, 2)  # type: ignore[union-attr]
    kept = (heads - 2 * value).abs().amax(-1) < 1e-12
    dropped = heads.abs().amax(-1) == 0
    assert torch.all(kept | dropped)
    assert 100 < int(kept.sum()) < 300  # of 400 draws at p = 0.5
    assert_close(m.eval()(x, mem, mask=hidden).view(200, 2, 2), value.expand(200, 2, 2))


def test_extra_tokens_are_captured_with_the_weights() -> None:
    m = MultiHeadAttention(8, 2, add_bias_kv=True, add_zero_attn=True)
    x = torch.randn(2, 3, 8)
    with attnkit.capture_attention(m) as maps:
        _, w = m(x, need_weights=True, average_weights=False)
    [captured] = maps[""]
    assert captured.shape == (2, 2, 3, 3 + 2)
    assert torch.equal(captured, w.detach())


def test_extra_tokens_parameters_and_repr() -> None:
    m = MultiHeadAttention(12, 4, num_kv_heads=2, head_dim=2, v_head_dim=5, add_bias_kv=True)
    assert m.bias_k is not None
    assert m.bias_v is not None
    assert (m.bias_k.shape, m.bias_v.shape) == ((1, 1, 2 * 2), (1, 1, 2 * 5))
    assert "add_bias_kv=True" in repr(m)
    assert "add_zero_attn=True" in repr(MultiHeadAttention(8, 2, add_zero_attn=True))
    plain = MultiHeadAttention(8, 2)
    assert "bias_k" not in plain.state_dict()
    assert "add_" not in repr(plain)
    # The module's call, as explain() describes it: the zero key is a sink, the learned token
    # needs the log-sum-exp.
    both = MultiHeadAttention(8, 2, add_bias_kv=True, add_zero_attn=True)
    assert "sinks, return_lse" in str(both.explain(torch.randn(1, 3, 8)))


def test_calls_attention_once_without_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    real = attnkit.modules.multihead.attend

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(bool(kwargs.get("return_weights", False)))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attnkit.modules.multihead, "attend", spy)
    m = MultiHeadAttention(16, 4)
    m(torch.randn(2, 5, 16), causal=True)
    assert calls == [False]
    m(torch.randn(2, 5, 16), need_weights=True)
    assert calls == [False, True]
    # The learned token is merged into the one call's output, not a second call.
    MultiHeadAttention(16, 4, add_bias_kv=True, add_zero_attn=True)(torch.randn(2, 5, 16))
    assert calls == [False, True, False]


def test_self_attention_uses_one_projection_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    shapes: list[tuple[int, ...]] = []
    real = F.linear

    def spy(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        shapes.append(tuple(w.shape))
        return real(x, w, b)

    monkeypatch.setattr(attnkit.modules.multihead.F, "linear", spy)
    m = MultiHeadAttention(16, 4, num_kv_heads=2, head_dim=3, v_head_dim=2)
    x = torch.randn(2, 5, 16)
    m(x)
    # q, k, v in one GEMM (12 + 6 + 4 rows), then the output projection (an nn.Linear).
    assert shapes == [(22, 16), (16, 8)]
    shapes.clear()
    m(x, torch.randn(2, 3, 16))  # cross-attention: k and v in one GEMM, then q
    assert shapes == [(10, 16), (12, 16), (16, 8)]


def test_fully_masked_row_is_zero_not_nan() -> None:
    m = MultiHeadAttention(8, 2)
    mask = torch.ones(1, 1, 3, 4, dtype=torch.bool)
    mask[..., 1, :] = False
    out, w = m(torch.randn(1, 3, 8), torch.randn(1, 4, 8), mask=mask, need_weights=True)
    assert out.isfinite().all()
    assert_close(w[:, 1], torch.zeros(1, 4))
    # The query that sees nothing gets only the output projection's bias.
    assert_close(out[0, 1], m.out_proj.bias.detach())


# --------------------------------------------------------------------------------------------------
# torch.nn.MultiheadAttention


@st.composite
def torch_cases(draw: st.DrawFn) -> dict[str, object]:
    h = draw(st.integers(1, 4))
    e = h * draw(st.integers(1, 4))
    kdim = draw(st.sampled_from([None, e, e + 2]))
    vdim = draw(st.sampled_from([None, e, e + 1]))
    b, tq = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    self_attention = kdim in (None, e) and vdim in (None, e) and draw(st.booleans())
    tk = tq if self_attention else draw(st.integers(1, 6))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    attn_mask = key_padding_mask = None
    kind = draw(st.sampled_from(["none", "bool", "bool3d", "float"]))
    if kind != "none":
        shape = (b * h, tq, tk) if kind == "bool3d" else (tq, tk)
        if kind == "float":
            attn_mask = torch.randn(shape, generator=gen, dtype=torch.float64)
        else:
            attn_mask = torch.rand(shape, generator=gen) < 0.4  # True = blocked in torch
            attn_mask[..., 0] = False  # every query keeps a key: torch gives NaN otherwise
    pad = draw(st.sampled_from(["none", "bool", "float"]))
    if pad == "bool":
        key_padding_mask = torch.rand(b, tk, generator=gen) < 0.4
        key_padding_mask[:, 0] = False
    elif pad == "float":
        key_padding_mask = torch.randn(b, tk, generator=gen, dtype=torch.float64)
    return {
        "module": {
            "embed_dim": e,
            "num_heads": h,
            "kdim": kdim,
            "vdim": vdim,
            "bias": draw(st.booleans()),
            "batch_first": draw(st.booleans()),
            "add_bias_kv": draw(st.booleans()),
            "add_zero_attn": draw(st.booleans()),
        },
        "shapes": (b, tq, tk),
        "self_attention": self_attention,
        "attn_mask": attn_mask,
        "key_padding_mask": key_padding_mask,
        "grad": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


# torch warns when attn_mask and key_padding_mask differ in kind (bool and float); it still works.
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@settings(max_examples=40)
@given(case=torch_cases())
def test_from_torch_matches_torch(case: dict[str, object]) -> None:
    cfg: dict[str, object] = case["module"]  # type: ignore[assignment]
    b, tq, tk = case["shapes"]  # type: ignore[misc]
    torch.manual_seed(case["seed"])  # type: ignore[arg-type]
    theirs = nn.MultiheadAttention(**cfg, dtype=torch.float64).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(std=0.5)
    ours = attnkit.interop.torch.from_torch(theirs, batch_first=True)  # fed batch-first inputs
    e = theirs.embed_dim
    query = torch.randn(b, tq, e, dtype=torch.float64)
    if case["self_attention"]:
        key = value = query
    else:
        key = torch.randn(b, tk, theirs.kdim, dtype=torch.float64)
        value = torch.randn(b, tk, theirs.vdim, dtype=torch.float64)

    def to_theirs(t: Tensor) -> Tensor:
        return t if theirs.batch_first else t.transpose(0, 1)

    am, kpm = case["attn_mask"], case["key_padding_mask"]
    mask, bias = from_torch_masks(am, kpm, num_heads=theirs.num_heads, dtype=torch.float64)  # type: ignore[arg-type]
    with torch.set_grad_enabled(bool(case["grad"])):
        # Self-attention passes one tensor three times: torch's fast path needs `query is key`.
        tq_in = to_theirs(query)
        tk_in = tq_in if case["self_attention"] else to_theirs(key)
        tv_in = tq_in if case["self_attention"] else to_theirs(value)
        want = theirs(tq_in, tk_in, tv_in, attn_mask=am, key_padding_mask=kpm, need_weights=False)[
            0
        ]
        got = ours(query, key, value, mask=mask, bias=bias)
        assert_close(got, to_theirs(want))
        want, want_w = theirs(
            tq_in, tk_in, tv_in, attn_mask=am, key_padding_mask=kpm, average_attn_weights=False
        )
        got, got_w = ours(
            query, key, value, mask=mask, bias=bias, need_weights=True, average_weights=False
        )
        assert_close(got, to_theirs(want))
        assert_close(got_w, want_w)


def test_gradients_match_torch() -> None:
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(12, 3, batch_first=True, dtype=torch.float64)
    ours = attnkit.interop.torch.from_torch(theirs)
    x = torch.randn(2, 6, 12, dtype=torch.float64, requires_grad=True)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    g = torch.randn(2, 6, 12, dtype=torch.float64)
    theirs(x, x, x, key_padding_mask=pad, need_weights=False)[0].backward(g)
    want = [x.grad.clone(), *(p.grad for p in theirs.parameters())]  # type: ignore[union-attr]
    x.grad = None
    mask, _ = from_torch_masks(key_padding_mask=pad, num_heads=3)
    ours(x, mask=mask).backward(g)
    got = [x.grad, *(p.grad for p in ours.parameters())]
    for a, w in zip(got, want, strict=True):
        assert_close(a, w)  # type: ignore[arg-type]


def test_to_torch_round_trip() -> None:
    torch.manual_seed(1)
    for kw in ({}, {"kdim": 5, "vdim": 7}, {"proj_bias": False}):
        ours = MultiHeadAttention(8, 2, dtype=torch.float64, **kw)  # type: ignore[arg-type]
        for batch_first in (True, False):
            theirs = attnkit.interop.torch.to_torch(ours, batch_first=batch_first)
            assert theirs.batch_first is batch_first
            back = attnkit.interop.torch.from_torch(theirs, batch_first=True)
            for (n1, p1), (n2, p2) in zip(
                ours.named_parameters(), back.named_parameters(), strict=True
            ):
                assert n1 == n2
                assert torch.equal(p1, p2)
        x = torch.randn(2, 4, 8, dtype=torch.float64)
        mem = torch.randn(2, 3, ours.kdim, dtype=torch.float64)
        val = torch.randn(2, 3, ours.vdim, dtype=torch.float64)
        theirs = attnkit.interop.torch.to_torch(ours)
        assert_close(ours(x, mem, val), theirs(x, mem, val, need_weights=False)[0])


def test_to_and_from_torch_refuse_what_has_no_equivalent() -> None:
    with pytest.raises(ValueError, match=r"num_kv_heads \(2\) != num_heads \(4\)"):
        attnkit.interop.torch.to_torch(MultiHeadAttention(16, 4, num_kv_heads=2))
    with pytest.raises(ValueError, match=r"head_dim \(8\) and v_head_dim \(8\) must both be"):
        attnkit.interop.torch.to_torch(MultiHeadAttention(16, 4, head_dim=8))
    half = nn.MultiheadAttention(8, 2, add_bias_kv=True, batch_first=True)
    half.bias_v = None
    with pytest.raises(
        ValueError,
        match=re.escape(
            "from_torch(): bias_k is set (1, 1, 8) but bias_v is None; torch's add_bias_kv=True "
            "sets both"
        ),
    ):
        attnkit.interop.torch.from_torch(half)
    with pytest.raises(TypeError, match="got Linear"):
        attnkit.interop.torch.from_torch(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_from_torch_masks() -> None:
    am = torch.tensor([[False, True], [False, False]])  # torch: True = blocked
    kpm = torch.tensor([[False, False], [False, True]])
    mask, bias = from_torch_masks(am, kpm, num_heads=2)
    assert bias is None
    assert mask is not None
    want = ~am & ~kpm[:, None, None, :]  # (B, 1, Tq, Tk)
    assert torch.equal(mask.expand(2, 1, 2, 2), want)
    fm = torch.tensor([[0.0, -1.0], [2.0, 0.0]])
    mask, bias = from_torch_masks(fm, kpm, num_heads=2, dtype=torch.float64)
    assert bias is not None
    assert bias.dtype == torch.float64
    assert torch.equal(bias, fm.double())
    assert torch.equal(mask, ~kpm[:, None, None, :])  # type: ignore[arg-type]
    per_head = torch.zeros(4, 2, 2, dtype=torch.bool)
    per_head[3, 0, 1] = True
    mask, _ = from_torch_masks(per_head, num_heads=2)
    assert mask is not None
    assert mask.shape == (2, 2, 2, 2)
    assert not mask[1, 1, 0, 1]
    with pytest.raises(
        ValueError, match=r"\(B\*H, Tq, Tk\) with H = num_heads \(3\), got \(4, 2, 2\)"
    ):
        from_torch_masks(per_head, num_heads=3)


@pytest.mark.parametrize("name", ["key_padding_mask", "attn_mask"])
@pytest.mark.parametrize(
    "dtype", [torch.bool, torch.float64, torch.float32, torch.uint8, torch.int64, torch.int8]
)
def test_from_torch_masks_follows_torch_for_each_dtype(name: str, dtype: torch.dtype) -> None:
    # What torch.nn.MultiheadAttention itself does with a mask of this dtype is the spec: the
    # same output, or (where torch refuses the dtype) a TypeError naming the argument.
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64).eval()
    ours = attnkit.interop.torch.from_torch(theirs)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    pad = torch.tensor([[0, 0, 1], [0, 1, 1]])  # 1 = padding in bool; a score of +1 in float
    mask_in = (pad if name == "key_padding_mask" else pad[:1].expand(3, 3)).to(dtype)
    try:
        want = theirs(x, x, x, **{name: mask_in}, need_weights=False)[0]  # type: ignore[arg-type]
    except AssertionError:  # torch: "only bool and floating types of ... are supported"
        want = None
    if want is None:
        words = rf"{name} must be a bool tensor .* got {str(dtype).removeprefix('torch.')}\."
        with pytest.raises(TypeError, match=words):
            from_torch_masks(**{name: mask_in}, num_heads=2)  # type: ignore[arg-type]
        return
    mask, bias = from_torch_masks(**{name: mask_in}, num_heads=2, dtype=torch.float64)  # type: ignore[arg-type]
    assert_close(ours(x, mask=mask, bias=bias), want)


@pytest.mark.usefixtures("no_shape_checks")
def test_from_torch_masks_refuses_what_is_not_a_mask() -> None:
    with pytest.raises(TypeError, match=r"key_padding_mask must be a torch.Tensor .* got list"):
        from_torch_masks(key_padding_mask=[[False, True]], num_heads=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"attn_mask must be a torch.Tensor .* got ndarray"):
        from_torch_masks(torch.zeros(2, 2).numpy(), num_heads=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"attn_mask must be a bool tensor .* got uint8"):
        from_torch_masks(torch.zeros(2, 2, dtype=torch.uint8), num_heads=2)
    with pytest.raises(
        TypeError, match=r"dtype must be a floating-point torch.dtype, got torch.int"
    ):
        from_torch_masks(torch.zeros(2, 2), num_heads=2, dtype=torch.int32)


# --------------------------------------------------------------------------------------------------
# Errors name the argument and quote the values


@pytest.mark.usefixtures("no_shape_checks")
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"d_model": 30, "num_heads": 4},
            ValueError,
            r"d_model \(30\) is not divisible by num_heads \(4\)",
        ),
        (
            {"d_model": 24, "num_heads": 6, "num_kv_heads": 4},
            ValueError,
            r"num_heads \(6\) is not divisible by num_kv_heads \(4\)",
        ),
        ({"d_model": 8, "num_heads": 0}, ValueError, r"num_heads must be >= 1, got 0"),
        ({"d_model": 8.0, "num_heads": 2}, TypeError, r"d_model must be an int, got 8.0"),
        (
            {"d_model": 8, "num_heads": 2, "dropout": 1.5},
            ValueError,
            r"dropout must be in \[0, 1\), got 1.5",
        ),
        ({"d_model": 8, "num_heads": 2, "kdim": -1}, ValueError, r"kdim must be >= 1, got -1"),
        (
            {"d_model": 8, "num_heads": 2, "rotary": attnkit.RotaryEmbedding(6)},
            ValueError,
            r"rotary.head_dim \(6\) must equal the head_dim .* \(4\)",
        ),
        (
            {"d_model": 8, "num_heads": 2, "add_bias_kv": 1},
            TypeError,
            r"add_bias_kv must be a bool, got 1",
        ),
        (
            {"d_model": 8, "num_heads": 2, "add_zero_attn": "yes"},
            TypeError,
            r"add_zero_attn must be a bool, got 'yes'",
        ),
        (
            {"d_model": 8, "num_heads": 2, "rotary": "rope"},
            TypeError,
            r"rotary must be an nn.Module or None, got str",
        ),
    ],
)
def test_constructor_errors(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        MultiHeadAttention(**kwargs)  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_shape_checks")
def test_backend_is_checked_when_the_module_is_built() -> None:
    names = ", ".join(attnkit.available_backends())
    with pytest.raises(
        ValueError,
        match=rf"unknown backend 'nope'; choose 'auto' or one of: {names} \(a backend of your "
        r"own must be registered with attnkit.register_backend before it is named\)",
    ):
        MultiHeadAttention(8, 2, backend="nope")
    with pytest.raises(
        TypeError, match=r"backend must be 'auto', .* or an attnkit.Backend, got int"
    ):
        MultiHeadAttention(8, 2, backend=3)  # type: ignore[arg-type]
    # A backend registered before the module is built serves it; a Backend object is taken as is.
    calls: list[int] = []

    def mine(q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> Tensor:
        calls.append(q.size(-2))
        out: Tensor = attnkit.attention(q, k, v, **kwargs, backend="reference")  # type: ignore[arg-type]
        return out

    attnkit.register_backend("mine-for-test", mine)
    try:
        m = MultiHeadAttention(8, 2, backend="mine-for-test", dtype=torch.float64)
        x = torch.randn(1, 3, 8, dtype=torch.float64)
        assert_close(m(x), formula(m, x, x, x)[0])
        assert calls == [3]
    finally:
        attnkit.unregister_backend("mine-for-test")
    obj = attnkit.Backend("an-object", mine)
    assert MultiHeadAttention(8, 2, backend=obj).backend is obj


@pytest.mark.usefixtures("no_shape_checks")
def test_forward_errors() -> None:
    m = MultiHeadAttention(8, 2, kdim=6)
    with pytest.raises(
        ValueError, match=r"query must have shape \(B, Tq, d_model=8\), got \(2, 5, 7\)"
    ):
        m(torch.randn(2, 5, 7), torch.randn(2, 3, 6), torch.randn(2, 3, 8))
    with pytest.raises(
        ValueError, match=r"key must have shape \(B=2, Tk, kdim=6\), got \(2, 5, 8\)"
    ):
        m(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"key and value must have the same length Tk"):
        m(torch.randn(2, 5, 8), torch.randn(2, 3, 6), torch.randn(2, 4, 8))
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        MultiHeadAttention(8, 2)(torch.randn(1, 3, 8), mask=torch.ones(3, 3))
    with pytest.raises(
        ValueError, match=r"mask of shape \(4\) does not broadcast to .* \(1, 2, 3, 3\)"
    ):
        MultiHeadAttention(8, 2)(torch.randn(1, 3, 8), mask=masks.padding_mask([4])[0, 0, 0])


def test_shape_annotations_are_checked() -> None:
    m = MultiHeadAttention(8, 2)
    with pytest.raises(Exception, match="query"):
        m(torch.randn(2, 5))  # type: ignore[arg-type]


@needs_cxx
def test_compiles_to_one_graph_including_cached_decoding() -> None:
    """A compiled decoder steps through more tokens than dynamo's recompile limit (8): the cache's
    length is a symbolic size, not a constant that changes at every step (with fullgraph=True,
    passing the limit is an error)."""
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, num_kv_heads=2, rotary=attnkit.RotaryEmbedding(4)).eval()
    torch._dynamo.reset()  # a fresh recompile budget: forward's code is shared by every instance
    # dynamic=True: symbolic lengths, as a decoder meets them (the prompt, then single steps).
    compiled = torch.compile(m, fullgraph=True, dynamic=True)
    x = torch.randn(2, 15, 16)
    try:
        with torch.no_grad():
            full = m(x, causal=True)
            assert_close(compiled(x, causal=True), full)
            cache = m.make_cache(2, 15)
            steps = [compiled(x[:, :3], causal=True, cache=cache)]
            steps += [compiled(x[:, i : i + 1], causal=True, cache=cache) for i in range(3, 15)]
    finally:
        torch._dynamo.reset()
    assert_close(torch.cat(steps, 1), full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_against_float64(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, num_kv_heads=2, dtype=dtype)
    ref = MultiHeadAttention(32, 4, num_kv_heads=2, dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    x = torch.randn(2, 24, 32).to(dtype)
    pad = masks.padding_mask([24, 17])
    got = m(x, mask=pad, causal=True)
    assert got.dtype == dtype
    assert_close(got, ref(x.double(), mask=pad, causal=True))


def test_explain_describes_the_call_the_module_makes() -> None:
    m = MultiHeadAttention(16, 4, num_kv_heads=2)
    x = torch.randn(2, 10, 16)
    report = m.explain(x, mask=attnkit.masks.sliding_window(3))
    assert "q (2, 4, 10, 4), k (2, 2, 10, 4), v (2, 2, 10, 4) float32 on cpu" in str(report)
    assert report.chosen == "chunked"
    cache = m.make_cache(2, 32)
    with torch.no_grad():
        m(x, cache=cache)
        step = m.explain(x[:, :1], cache=cache)
    assert "k, v 2 rows of keys 0..11, 0..11 of a contiguous cache" in str(step)  # the cached keys
    # rows in step on a contiguous cache: the dense call on views of them, which auto gives
    # torch's kernel at this size, as it gives the same call on the keys as tensors
    assert step.chosen == "sdpa"
    keys = torch.zeros(2, 2, 11, 4)
    assert attnkit.explain(torch.zeros(2, 4, 1, 4), keys, keys, causal=True).chosen == "sdpa"
    assert cache.length == 10  # explain wrote nothing
    assert m.explain(x, need_weights=True).chosen == "reference"


@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_explain_describes_a_streaming_cache_call_as_it_runs(kv_dtype: torch.dtype | None) -> None:
    # forward takes a StreamingKVCache; explain() took only the caches with stand_in()
    # (AttributeError). A step reads the held slots in place, a chunk or a step with a mask of
    # its own the tokens in time order with the cache's mask: explain() describes what runs.
    m = MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    for t, mask in ((1, None), (1, masks.sliding_window(2)), (4, None)):
        cache = attnkit.StreamingKVCache(2, 2, 8, sink_tokens=2, window=6, kv_dtype=kv_dtype)
        x = torch.randn(2, t, 32)
        with torch.no_grad():
            m(torch.randn(2, 5, 32), causal=True, cache=cache)
            said = m.explain(x, causal=True, mask=mask, cache=cache)
            assert cache.position == 5  # explain wrote nothing
            with attnkit.record_dispatch() as calls:
                m(x, causal=True, mask=mask, cache=cache)
        ran = calls[-1].call
        assert (said.call.q_len, said.call.kv_len) == (ran.q_len, ran.kv_len), (t, mask)
        assert str(said.call.mask) == str(ran.mask), (t, mask)
        assert (said.call.cache is None) == (ran.cache is None), (t, mask)
        assert said.chosen == calls[-1].served_by, (t, mask)


def test_from_torch_refuses_a_sequence_first_module_and_says_how() -> None:
    theirs = nn.MultiheadAttention(8, 2, dtype=torch.float64).eval()  # batch_first=False
    with pytest.raises(ValueError, match="has batch_first=False, so it takes") as err:
        attnkit.interop.torch.from_torch(theirs)
    assert "from_torch(m, batch_first=True)" in str(err.value)
    with pytest.raises(ValueError, match="takes batch-first inputs"):
        attnkit.interop.torch.from_torch(theirs, batch_first=False)
    with pytest.raises(ValueError, match="batch_first=False"):
        attnkit.interop.torch.from_torch(nn.TransformerEncoderLayer(8, 2))
    # As the message says: the copy, given the inputs transposed, gives torch's result.
    ours = attnkit.interop.torch.from_torch(theirs, batch_first=True)
    x = torch.randn(5, 3, 8, dtype=torch.float64)  # (T, B, E), torch's default layout
    with torch.no_grad():
        want, _ = theirs(x, x, x)
        got = ours(x.transpose(0, 1)).transpose(0, 1)
    assert_close(got, want)


def test_a_forward_checks_each_argument_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # The module checks its inputs; the attention call checks the caller's mask, bias and causal;
    # q, k, v and the sinks the module built are not checked again (a check of the sinks reads
    # them: a host synchronisation per call).
    seen: collections.Counter[str] = collections.Counter()
    for name in ("_check_qkv", "_check_scores", "_check_sinks", "check_input"):
        module = attnkit._call if hasattr(attnkit._call, name) else attnkit.modules.multihead
        real = getattr(module, name)

        def counted(*args: object, _real: Any = real, _name: str = name, **kw: object) -> object:
            seen[_name] += 1
            return _real(*args, **kw)

        monkeypatch.setattr(module, name, counted)
    m = MultiHeadAttention(16, 4, add_zero_attn=True)
    m(torch.randn(2, 5, 16), mask=masks.key_padding([5, 3]), causal=True)
    assert seen == {"check_input": 1, "_check_scores": 1}
    seen.clear()
    m(torch.randn(2, 5, 16), torch.randn(2, 7, 16))  # cross-attention: query and key
    assert seen == {"check_input": 2, "_check_scores": 1}
    # ... while attention() called directly checks everything it is given
    seen.clear()
    q = torch.randn(1, 4, 5, 4)
    attnkit.attention(q, q, q, sinks=torch.zeros(4))
    assert seen == {"_check_qkv": 1, "_check_scores": 1, "_check_sinks": 1}


def test_the_caller_s_arguments_are_still_checked_with_attention_s_words() -> None:
    m = MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16)
    with attnkit_checks_only():
        with pytest.raises(TypeError, match=r"causal must be a bool, got 1"):
            m(x, causal=1)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^mask .*\(3, 5\)"):
            m(x, mask=torch.ones(3, 5, dtype=torch.bool))
        with pytest.raises(TypeError, match=r"bias must have the dtype of q \(float32\)"):
            m(x, bias=torch.zeros(5, 5, dtype=torch.float64))


def test_a_rotary_module_that_changes_its_input_is_refused() -> None:
    class Truncating(nn.Module):
        head_dim = 4

        def forward(self, x: Tensor, offset: int = 0) -> Tensor:
            return x[..., :-1, :]

    m = MultiHeadAttention(16, 4, rotary=Truncating())
    with pytest.raises(
        ValueError,
        match=re.escape(
            "rotary must return a tensor of its input's shape and dtype, (2, 4, 5, 4) "
            "torch.float32, got (2, 4, 4, 4) torch.float32"
        ),
    ):
        m(torch.randn(2, 5, 16))


@pytest.mark.parametrize("paged", [False, True])
def test_make_cache_quantized_decodes_near_the_full_precision_cache(paged: bool) -> None:
    # An int8 cache from make_cache quantizes what the module stores: its decode steps differ from
    # a float32 cache's by int8's rounding (a scale per token and head), not more, not zero.
    torch.manual_seed(0)
    mha = MultiHeadAttention(64, 8, num_kv_heads=2).eval()
    x = torch.randn(2, 9, 64)

    def decode(kv_dtype: torch.dtype | None) -> Tensor:
        if paged:
            cache = mha.make_paged_cache(16, 4, max_seqs=2, kv_dtype=kv_dtype)
        else:
            cache = mha.make_cache(2, 16, kv_dtype=kv_dtype)
        with torch.no_grad():
            outs = [mha(x[:, :5], cache=cache, causal=True)]
            outs += [mha(x[:, t : t + 1], cache=cache, causal=True) for t in range(5, 9)]
        return torch.cat(outs, 1)

    full, int8 = decode(None), decode(torch.int8)
    error = ((int8 - full).norm() / full.norm()).item()
    assert 1e-5 < error < 3e-2, error


def test_a_bias_of_a_streaming_step_falls_on_the_held_tokens_in_time_order() -> None:
    # The module hands its bias to the streaming cache, which then reads a step's held tokens in
    # time order (in the ring's order the bias fell on the wrong tokens once the ring wrapped).
    torch.manual_seed(0)
    sinks, window, n = 1, 3, 9
    m = attnkit.MultiHeadAttention(16, 2).double().eval()
    cache = attnkit.StreamingKVCache(1, 2, 8, sink_tokens=sinks, window=window, dtype=torch.float64)
    x = torch.randn(1, n, 16, dtype=torch.float64)
    with torch.no_grad():
        for t in range(n):
            held = [p for p in range(t + 1) if p < sinks or t - p < window]
            bias = torch.linspace(-2, 2, len(held), dtype=torch.float64)[None]  # (Tq, Tk)
            got = m(x[:, t : t + 1], cache=cache, causal=True, bias=bias)
            whole = torch.zeros(t + 1, t + 1, dtype=torch.float64)
            whole[t, held] = bias[0]
            visible = torch.zeros(t + 1, t + 1, dtype=torch.bool)
            for i in range(t + 1):
                visible[i, [p for p in range(i + 1) if p < sinks or i - p < window]] = True
            want = m(x[:, : t + 1], mask=visible, bias=whole)[:, t:]
            torch.testing.assert_close(got, want)


def test_the_weights_of_a_streaming_step_are_the_held_tokens_in_time_order() -> None:
    torch.manual_seed(0)
    sinks, window, n = 1, 3, 9
    m = attnkit.MultiHeadAttention(16, 2).double().eval()
    cache = attnkit.StreamingKVCache(1, 2, 8, sink_tokens=sinks, window=window, dtype=torch.float64)
    x = torch.randn(1, n, 16, dtype=torch.float64)
    visible = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        visible[i, [p for p in range(i + 1) if p < sinks or i - p < window]] = True
    with torch.no_grad():
        _, whole = m(x, mask=visible, need_weights=True)  # (1, n, n), averaged over heads
        for t in range(n):
            _, got = m(x[:, t : t + 1], cache=cache, causal=True, need_weights=True)
            held = [p for p in range(t + 1) if p < sinks or t - p < window]
            torch.testing.assert_close(got[0, 0], whole[0, t, held])


# --------------------------------------------------------------------------------------------------
# A cached call that fails after its new tokens were staged leaves the cache as it was


class _Refused(RuntimeError):
    pass


def _held(cache: Any) -> list[tuple[Tensor, Tensor]]:
    """Copies of each row's keys and values as the cache's view reads them (dequantized,
    float32; a contiguous cache's rows are views of its buffers)."""
    view = cache.view()
    rows = (view.row(n) for n in range(len(view.kv_range)))
    return [(k.clone(), v.clone()) for k, v in rows]


def _failing_cache(kind: str, m: MultiHeadAttention) -> Any:
    if kind.startswith("paged"):
        layout = kind.split("-")[1]
        return m.make_paged_cache(16, 4, max_seqs=2, layout=layout)  # type: ignore[arg-type]
    if kind.startswith("streaming"):
        kv = torch.int8 if kind.endswith("int8") else None
        # (1 sink, a window of 4: the 9 tokens held already wrapped the ring)
        return attnkit.StreamingKVCache(2, 2, 8, sink_tokens=1, window=4, kv_dtype=kv)
    return m.make_cache(2, 16, kv_dtype=torch.int8 if kind.endswith("int8") else None)


@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize(
    "kind", ["kv", "kv-int8", "paged-flash", "paged-vllm", "streaming", "streaming-int8"]
)
def test_a_call_that_fails_after_staging_leaves_the_cache_as_it_was(kind: str, new: int) -> None:
    # out_proj raises after attention() read the staged tokens: the error reaches the caller as
    # it was raised, the view holds the committed tokens only (a streaming step's slot gets its
    # token back), a stray commit() adds nothing, and the next call attends the right tokens.
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    cache = _failing_cache(kind, m)
    x, failed = torch.randn(2, 9 + new, 32), torch.randn(2, new, 32)
    raised = _Refused("out_proj refused")

    def refuse(*_: object) -> None:
        raise raised

    with torch.no_grad():
        m(x[:, :9], causal=True, cache=cache)
        before = _held(cache)
        hook = m.out_proj.register_forward_pre_hook(refuse)
        with pytest.raises(_Refused) as info:
            m(failed, causal=True, cache=cache)
        hook.remove()
        assert info.value is raised
        for _ in range(2):  # as the call left it, and after a stray commit()
            after = _held(cache)
            assert len(after) == len(before)
            for (k0, v0), (k1, v1) in zip(before, after, strict=True):
                assert torch.equal(k0, k1)
                assert torch.equal(v0, v1)
            cache.commit()
        got = m(x[:, 9:], causal=True, cache=cache)
    visible = torch.ones(9 + new, 9 + new, dtype=torch.bool).tril()
    if kind.startswith("streaming"):  # the sink and each query's window of 4
        distance = torch.arange(9 + new)[:, None] - torch.arange(9 + new)
        visible &= (distance < 4) | (torch.arange(9 + new) < 1)
    with torch.no_grad():
        want = copy.deepcopy(m).double()(x.double(), mask=visible)[:, 9:]
    if kind.endswith("int8"):  # int8's rounding of the held keys and values, not more
        assert ((got.double() - want).norm() / want.norm()).item() < 3e-2
    else:
        assert_close(got, want)
