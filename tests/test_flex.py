"""attnkit.flex against torch's own eager FlexAttention (values) and a float64 dense formula
(gradients, captured tensors included); score_mod in attention() and the backends."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import _native, flex
from attnkit._call import check_attention_args
from attnkit.backends import Chunked
from attnkit.testing import assert_close

torch_flex = pytest.importorskip("torch.nn.attention.flex_attention")

T_Q, T_K, H, HKV, D = 37, 45, 4, 2, 8
SMALL = Chunked(block_q=16, block_k=16)  # several tiles, partial ones included, for every test

# ------------------------------------------------------------------------------------------------
# The mask_mods and score_mods FlexAttention's documentation shows

DOCS = torch.tensor([0] * 12 + [1] * 20 + [2] * 13)  # documents of the T_K=45 positions


def causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return q >= kv


def sliding_window(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return (q >= kv) & (q - kv <= 7)


def prefix_lm(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return (kv <= q) | (kv < 10)


def document(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return DOCS[q] == DOCS[kv]


MASK_MODS: dict[str, Callable[..., Tensor] | None] = {
    "none": None,
    "causal": causal,
    "sliding_window": sliding_window,
    "prefix_lm": prefix_lm,
    "document": document,
    "document_causal": flex.and_masks(document, causal),
    "or_masks": flex.or_masks(sliding_window, lambda b, h, q, kv: kv < 3),
}

SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def relative(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return s + 0.1 * (q - kv)


def alibi(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return s + SLOPES[h] * (kv - q)


def softcap(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return 2.0 * torch.tanh(s / 2.0)


def head_offset(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return s + h - 1.5 * b


def squared(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return s * s


def sin_cos(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return torch.sin(torch.cos(s))


def by_value(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return torch.where(s > 0.8, -math.inf, s)  # a mask by the score's own value


SCORE_MODS: dict[str, Callable[..., Tensor] | None] = {
    "none": None,
    "relative": relative,
    "alibi": alibi,
    "softcap": softcap,
    "head_offset": head_offset,
    "squared": squared,
    "sin_cos": sin_cos,
    "by_value": by_value,
}


def _qkv(dtype: torch.dtype = torch.float64, b: int = 2, kb: int | None = None) -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    kb = b if kb is None else kb
    return [
        torch.randn(b, H, T_Q, D, generator=g, dtype=dtype),
        torch.randn(kb, HKV, T_K, D, generator=g, dtype=dtype),
        torch.randn(kb, HKV, T_K, D, generator=g, dtype=dtype),
    ]


def _torch_flex(q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> tuple[Tensor, Tensor]:
    """torch's eager flex_attention (no gradients: it has no CPU backward), output and lse."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile()"
        out, aux = torch_flex.flex_attention(
            q, k, v, return_aux=torch_flex.AuxRequest(lse=True), enable_gqa=True, **kwargs
        )
    return out, aux.lse


def _torch_block_mask(fn: Callable[..., Tensor] | None, b: int | None = None) -> object:
    if fn is None:
        return None
    return torch_flex.create_block_mask(fn, b, None, T_Q, T_K, device="cpu")


# ------------------------------------------------------------------------------------------------
# Values against torch's FlexAttention


@pytest.mark.parametrize(
    ("mod_name", "mask_name"),
    [(m, "none") for m in SCORE_MODS]
    + [
        (m, mask)
        for m, mask in zip(SCORE_MODS, ["causal", "document_causal", "prefix_lm"] * 3, strict=False)
    ],
)
def test_flex_attention_matches_torch(mod_name: str, mask_name: str) -> None:
    q, k, v = _qkv()
    mod, mask_mod = SCORE_MODS[mod_name], MASK_MODS[mask_name]
    want, want_lse = _torch_flex(q, k, v, score_mod=mod, block_mask=_torch_block_mask(mask_mod))
    ours = None if mask_mod is None else flex.create_block_mask(mask_mod, None, None, T_Q, T_K)
    got, aux = flex.flex_attention(
        q, k, v, mod, ours, enable_gqa=True, return_aux=flex.AuxRequest(lse=True)
    )
    assert_close(got, want)
    assert aux.lse is not None
    torch.testing.assert_close(aux.lse, want_lse.to(aux.lse.dtype))


@pytest.mark.parametrize("mask_name", [m for m in MASK_MODS if m != "none"])
def test_torch_block_masks_are_accepted(mask_name: str) -> None:
    """A BlockMask from torch's own create_block_mask, batch-dependent (B=2) for the document."""
    q, k, v = _qkv(torch.float32)
    block_mask = _torch_block_mask(MASK_MODS[mask_name], b=2)
    want, want_lse = _torch_flex(q, k, v, score_mod=alibi, block_mask=block_mask)
    got, lse = flex.flex_attention(q, k, v, alibi, block_mask, enable_gqa=True, return_lse=True)
    assert_close(got, want)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_torch_block_mask_from_kv_blocks_keeps_its_block_table() -> None:
    """A BlockMask built from block tables (mask_mod noop): the listed blocks are its mask."""
    q, k, v = _qkv()
    q, k, v = q[..., :32, :], k[..., :32, :], v[..., :32, :]
    # blocks of 16: query block 0 sees key block 0; query block 1 sees key blocks 0 and 1
    num = torch.tensor([1, 2], dtype=torch.int32).view(1, 1, 2)
    idx = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32).view(1, 1, 2, 2)
    block_mask = torch_flex.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, seq_lengths=(32, 32))
    got = flex.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    dense = torch.zeros(32, 32, dtype=torch.bool)
    dense[:16, :16] = True
    dense[16:, :] = True
    want = attnkit.attention(q, k, v, mask=dense, backend="reference")
    assert_close(got, want)


def test_keys_with_batch_one_are_shared() -> None:
    q, k, v = _qkv(b=3, kb=1)
    # torch asks for a block mask of the queries' batch then; attnkit does not need one
    want, _ = _torch_flex(q, k, v, score_mod=head_offset, block_mask=_torch_block_mask(causal, 3))
    got = flex.flex_attention(
        q, k, v, head_offset, flex.create_block_mask(causal, 3, H, T_Q, T_K), enable_gqa=True
    )
    assert_close(got, want)
    assert_close(
        flex.flex_attention(q, k, v, head_offset, enable_gqa=True),
        _torch_flex(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1), score_mod=head_offset)[0],
    )


def test_return_lse_forms_and_scale() -> None:
    q, k, v = _qkv()
    want, want_lse = _torch_flex(q, k, v, scale=0.3)
    out, lse = flex.flex_attention(q, k, v, scale=0.3, enable_gqa=True, return_lse=True)
    out2, aux = flex.flex_attention(
        q, k, v, scale=0.3, enable_gqa=True, return_aux=torch_flex.AuxRequest(lse=True)
    )
    assert_close(out, want)
    assert_close(out2, want)
    torch.testing.assert_close(lse, want_lse)
    assert aux.lse is not None
    torch.testing.assert_close(aux.lse, want_lse)


# ------------------------------------------------------------------------------------------------
# Gradients against a float64 dense formula


def _dense_flex(
    q: Tensor, k: Tensor, v: Tensor, mod: Callable[..., Tensor] | None, mask_mod: object
) -> Tensor:
    """softmax(mod(q k^T / sqrt(D)) masked) v, written out; a row with no key gives 0."""
    b, h, tq, d = q.shape
    tk = k.size(-2)
    g = h // k.size(1)
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ kk.transpose(-1, -2) / math.sqrt(d)
    idx = (
        torch.arange(b).view(-1, 1, 1, 1),
        torch.arange(h).view(1, -1, 1, 1),
        torch.arange(tq).view(1, 1, -1, 1),
        torch.arange(tk).view(1, 1, 1, -1),
    )
    if mod is not None:
        s = mod(s, *idx).expand(s.shape)
    if callable(mask_mod):
        s = s.masked_fill(~mask_mod(*idx), -math.inf)
    empty = (s == -math.inf).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    return p @ vv


def _grads(fn: Callable[[], Tensor], tensors: list[Tensor]) -> list[Tensor]:
    for t in tensors:
        t.grad = None
    out = fn()
    (out * torch.linspace(-1, 1, out.size(-1), dtype=out.dtype)).sum().backward()
    return [out.detach(), *[t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors]]


@pytest.mark.parametrize(
    ("mod_name", "mask_name"),
    [
        ("relative", "causal"),
        ("alibi", "sliding_window"),
        ("softcap", "document"),
        ("head_offset", "prefix_lm"),
        ("squared", "causal"),
        ("sin_cos", "document"),
        ("by_value", "sliding_window"),
    ],
)
def test_gradients_match_the_dense_formula(mod_name: str, mask_name: str) -> None:
    q, k, v = (t.requires_grad_() for t in _qkv())
    mod, mask_mod = SCORE_MODS[mod_name], MASK_MODS[mask_name]
    block_mask = flex.create_block_mask(mask_mod, None, None, T_Q, T_K)  # type: ignore[arg-type]
    got = _grads(lambda: flex.flex_attention(q, k, v, mod, block_mask, enable_gqa=True), [q, k, v])
    want = _grads(lambda: _dense_flex(q, k, v, mod, mask_mod), [q, k, v])
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


BIAS_TABLE = torch.randn(T_Q + T_K, dtype=torch.float64, requires_grad=True)


def global_bias(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return s + BIAS_TABLE[q - kv + T_K]  # FlexAttention's "learnable bias" recipe


def test_gradients_reach_captured_tensors() -> None:
    """Closures, defaults and globals: each captured tensor gets its gradient, in float64 and
    through the chunked kernel's tiles."""
    q, k, v = (t.requires_grad_() for t in _qkv())
    per_head = torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=torch.float64, requires_grad=True)
    table = torch.randn(H, T_Q, T_K, dtype=torch.float64, requires_grad=True)

    def closure(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return s * per_head[h] + table[h, qi, kv]

    def default(
        s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor, scale: Tensor = per_head
    ) -> Tensor:
        return torch.tanh(s * scale[h])

    for mod, captured in (
        (closure, [per_head, table]),
        (default, [per_head]),
        (global_bias, [BIAS_TABLE]),
    ):
        tensors = [q, k, v, *captured]
        for backend in (SMALL, "chunked", "reference"):
            got = _grads(
                lambda m=mod, be=backend: attnkit.attention(
                    q, k, v, score_mod=m, causal=True, backend=be
                ),
                tensors,
            )
            want = _grads(
                lambda m=mod: _dense_flex(q, k, v, m, lambda b, h, qi, kv: kv <= qi + T_K - T_Q),
                tensors,
            )
            for a, b in zip(got, want, strict=True):
                assert_close(a, b)


def test_a_derived_captured_tensor_gets_its_gradient_through_the_graph() -> None:
    q, k, v = _qkv()
    param = torch.randn(H, dtype=torch.float64, requires_grad=True)

    def make_mod() -> Callable[..., Tensor]:
        scaled = param * 2.0  # not a leaf: its gradient flows on to param

        def mod(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
            return s + scaled[h]

        return mod

    got = _grads(lambda: attnkit.attention(q, k, v, score_mod=make_mod(), backend=SMALL), [param])
    want = _grads(lambda: _dense_flex(q, k, v, make_mod(), None), [param])
    assert_close(got[1], want[1])
    assert float(want[1].abs().sum()) > 0


_HIDDEN = torch.ones(H, requires_grad=True)


def _hidden_bias() -> Tensor:
    return _HIDDEN


def test_a_tensor_it_cannot_see_is_refused() -> None:
    q, k, v = _qkv(torch.float32)

    def mod(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return s + _hidden_bias()[h]

    with pytest.raises(ValueError, match=r"require grad which attnkit cannot see \(shapes \(4\)\)"):
        flex.flex_attention(q, k, v, mod, enable_gqa=True)
    with torch.no_grad():  # nothing to differentiate: nothing to refuse
        flex.flex_attention(q, k, v, mod, enable_gqa=True)


# ------------------------------------------------------------------------------------------------
# Masked pairs and empty rows


def test_masked_pairs_stay_masked_whatever_the_score_mod_returns() -> None:
    q, k, v = (t.requires_grad_() for t in _qkv())

    def poison(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return torch.where(qi >= kv, s, math.nan)  # NaN exactly where the mask hides

    bm = flex.create_block_mask(causal, None, None, T_Q, T_K)
    got = _grads(lambda: flex.flex_attention(q, k, v, poison, bm, enable_gqa=True), [q, k, v])
    want = _grads(lambda: _dense_flex(q, k, v, None, causal), [q, k, v])
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("backend", [SMALL, "reference"])
def test_a_row_the_score_mod_empties_gives_zero_and_zero_gradients(backend: object) -> None:
    q, k, v = (t.requires_grad_() for t in _qkv())

    def drop_row_5(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return torch.where(qi == 5, -math.inf, s)

    out, lse = attnkit.attention(
        q,
        k,
        v,
        score_mod=drop_row_5,
        return_lse=True,
        backend=backend,  # type: ignore[arg-type]
    )
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    assert bool((lse[:, :, 5] == -math.inf).all())
    out.sum().backward()
    assert q.grad is not None
    assert bool(torch.isfinite(q.grad).all())
    assert torch.equal(q.grad[:, :, 5], torch.zeros_like(q.grad[:, :, 5]))


# ------------------------------------------------------------------------------------------------
# attention(score_mod=...), the backends, errors


def test_score_mod_composes_with_softcap_bias_and_mask_in_documented_order() -> None:
    """mod(cap(s) + bias), masked: chunked tiles against reference, float32 against float64."""
    q, k, v = _qkv(torch.float32)
    bias = torch.randn(H, T_Q, T_K)
    kwargs = dict(score_mod=squared, softcap=3.0, bias=bias, mask=attnkit.masks.sliding_window(9))
    got = attnkit.attention(q, k, v, backend=SMALL, **kwargs)  # type: ignore[arg-type]
    q64, k64, v64 = (t.double() for t in (q, k, v))
    s = q64 @ k64.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(D)
    s = 3.0 * torch.tanh(s / 3.0)
    s = (s + bias.double()) ** 2
    s = s.masked_fill(~attnkit.masks.sliding_window(9).dense(T_Q, T_K), -math.inf)
    want = torch.softmax(s, -1) @ v64.repeat_interleave(2, 1)
    assert_close(got, want, dtype=torch.float32, conditioning=10.0)


def test_backends_that_do_not_apply_a_score_mod_decline_it() -> None:
    q = _qkv(torch.float32)[0]
    report = attnkit.explain(q, q, q, score_mod=squared)
    assert "score_mod=squared" in str(report)
    assert "does not apply a score_mod" in " ".join(report.reasons["sdpa"])
    assert report.chosen == "chunked"
    mine = attnkit.Backend("mine", lambda q, k, v, **kw: q)
    with pytest.raises(attnkit.BackendError, match="does not apply a score_mod"):
        attnkit.attention(q, q, q, score_mod=squared, backend=mine)
    with pytest.raises(TypeError, match=r"score_mod must be a function .*; got float"):
        check_attention_args(q, q, q, mask=None, bias=None, causal=False, scale=None, score_mod=3.0)


CAP_T = torch.tensor(2.5)

SOFTCAPS: dict[str, tuple[Callable[..., Tensor], float]] = {
    "c * tanh(s / c)": (lambda s, b, h, q, kv: 2.5 * torch.tanh(s / 2.5), 2.5),
    "tanh(s / c) * c": (lambda s, b, h, q, kv: torch.tanh(s / 2.5) * 2.5, 2.5),
    "methods": (lambda s, b, h, q, kv: s.div(2.5).tanh().mul(2.5), 2.5),
    "0-d tensor": (lambda s, b, h, q, kv: CAP_T * torch.tanh(s / CAP_T), 2.5),
}


def _chunked_notes(**kwargs: object) -> str:
    q, k, v = _qkv(torch.float32)
    report = attnkit.explain(q, k, v, backend="chunked", **kwargs)  # type: ignore[arg-type]
    return " ".join(report.notes["chunked"])


@pytest.mark.parametrize("name", SOFTCAPS)
def test_a_softcap_score_mod_runs_as_softcap(name: str) -> None:
    """Recognised: the same output as attention(softcap=c) (the very same computation), and the
    gradients of the per-tile path and of the float64 formula."""
    mod, cap = SOFTCAPS[name]
    assert f"recognised as softcap={cap}" in _chunked_notes(score_mod=mod)
    q, k, v = (t.requires_grad_() for t in _qkv(torch.float32))
    got = _grads(lambda: flex.flex_attention(q, k, v, mod, enable_gqa=True), [q, k, v])
    fused = _grads(lambda: attnkit.attention(q, k, v, softcap=cap), [q, k, v])
    assert torch.equal(got[0], fused[0])
    # A partial is never recognised: this is the per-tile score_mod path.
    per_tile = functools.partial(mod)
    assert "recognised" not in _chunked_notes(score_mod=per_tile)
    eager = _grads(lambda: attnkit.attention(q, k, v, score_mod=per_tile), [q, k, v])
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = _grads(lambda: _dense_flex(q64, k64, v64, mod, None), [q64, k64, v64])
    for a, b, c, w in zip(got, fused, eager, want, strict=True):
        assert_close(a, w, dtype=torch.float32)
        assert_close(b, w, dtype=torch.float32)
        assert_close(c, w, dtype=torch.float32)


def test_a_softcap_score_mod_after_softcap_or_bias_is_not_rewritten() -> None:
    """cap(cap(s)) and cap(s + bias) are not softcap=c: the per-tile path, and right."""
    mod, cap = SOFTCAPS["c * tanh(s / c)"]
    q, k, v = _qkv(torch.float32)
    bias = torch.randn(H, T_Q, T_K)
    for kwargs in ({"softcap": 3.0}, {"bias": bias}):
        notes = _chunked_notes(score_mod=mod, **kwargs)
        assert "recognised" not in notes
        assert "does not fuse a score_mod" in notes
        got = attnkit.attention(q, k, v, score_mod=mod, **kwargs)  # type: ignore[arg-type]
        s = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(D)
        s = 3.0 * torch.tanh(s / 3.0) if "softcap" in kwargs else s + bias.double()
        want = torch.softmax(cap * torch.tanh(s / cap), -1) @ v.double().repeat_interleave(2, 1)
        assert_close(got, want, dtype=torch.float32)


def test_softcap_look_alikes_keep_the_per_tile_path() -> None:
    grad = torch.tensor(2.5, requires_grad=True)
    for mod in (
        lambda s, b, h, q, kv: 2.5 * torch.tanh(s / 2.0),
        lambda s, b, h, q, kv: grad * torch.tanh(s / grad),
        lambda s, b, h, q, kv: 2.5 * torch.tanh(s / 2.5) + 0.0 * (q - kv),
    ):
        assert "does not fuse a score_mod" in _chunked_notes(score_mod=mod)


def test_flex_api_errors_name_the_argument() -> None:
    q, k, v = _qkv(torch.float32)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flex.flex_attention(q, k, v)
    with pytest.raises(ValueError, match=r"block_mask was made for .*\(1, 1, 10, 45\)"):
        flex.flex_attention(
            q, k, v, block_mask=flex.create_block_mask(causal, None, None, 10, T_K), enable_gqa=True
        )
    with pytest.raises(ValueError, match=r"batch size of query \(2\) or 1"):
        flex.flex_attention(
            q, k[:1].expand(3, -1, -1, -1), v[:1].expand(3, -1, -1, -1), enable_gqa=True
        )
    with pytest.raises(ValueError, match="max_scores"):
        flex.flex_attention(q, k, v, enable_gqa=True, return_aux=flex.AuxRequest(max_scores=True))
    with pytest.raises(ValueError, match="4-d"):
        flex.flex_attention(q[0], k[0], v[0], enable_gqa=True)
    with pytest.raises(TypeError, match="block_mask must be a BlockMask"):
        flex.flex_attention(
            q, k, v, block_mask=torch.ones(T_Q, T_K, dtype=torch.bool), enable_gqa=True
        )


def test_block_mask_is_lazy_and_dense_on_request() -> None:
    calls = []

    def counted(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        calls.append(1)
        return q >= kv

    bm = flex.create_block_mask(counted, None, None, 1 << 20, 1 << 20)
    assert not calls  # nothing evaluated, nothing (Q_LEN, KV_LEN) stored
    assert bm.shape == (1, 1, 1 << 20, 1 << 20)
    assert bm.seq_lengths == (1 << 20, 1 << 20)
    small = flex.create_block_mask(causal, 2, None, 3, 4)
    want = torch_flex.create_mask(causal, 2, 1, 3, 4, device="cpu")
    assert torch.equal(small.to_dense(), want)
    assert "mask_mod=causal" in repr(small)
    assert torch.equal(flex.noop_mask(*[torch.zeros(1, dtype=torch.long)] * 4), torch.tensor(True))


@pytest.mark.parametrize("backend", [SMALL, "chunked"])
def test_a_score_mod_far_from_the_raw_scores_needs_no_offset_assumption(backend: object) -> None:
    """Small q and k would let the kernel take offset 0; a shift of 100 (softmax-invariant) must
    not overflow there: 2^(100 log2(e)) is beyond float32."""
    q, k, v = (0.01 * t for t in _qkv(torch.float32))

    def shift(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return s + 100.0

    got = attnkit.attention(q, k, v, score_mod=shift, causal=True, backend=backend)  # type: ignore[arg-type]
    assert_close(
        got, attnkit.attention(q.double(), k.double(), v.double(), causal=True), dtype=torch.float32
    )


# ------------------------------------------------------------------------------------------------
# A bias by distance as a score_mod runs as a DistanceBias (in the native kernel)

HEAD_TABLE = torch.randn(H, T_Q + T_K, dtype=torch.float64)


def t5_buckets(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    """T5's scheme, shortened: exact buckets near, logarithmic ones far, per head."""
    d = (kv - q).abs()
    far = 4 + (torch.log(d.clamp(min=1).to(s.dtype) / 4) * 2).to(torch.int64)
    return s + HEAD_TABLE[h, torch.where(d < 4, d, far).clamp(max=T_Q + T_K - 1)]


BY_DISTANCE: dict[str, Callable[..., Tensor]] = {
    "relative": relative,
    "alibi": alibi,
    "head_offset": head_offset,  # b and h only
    "learnable": global_bias,
    "per head": lambda s, b, h, q, kv: s + HEAD_TABLE[h, q - kv + T_K],
    "t5": t5_buckets,
    "minus": lambda s, b, h, q, kv: s - HEAD_TABLE[h, kv - q + T_Q],
    "torch.add": lambda s, b, h, q, kv: torch.add(HEAD_TABLE[h, q - kv + T_K], s),
    "method": lambda s, b, h, q, kv: s.add(0.25 * (q - kv).abs() - b),
    "wraps": lambda s, b, h, q, kv: s + HEAD_TABLE[h, q - kv],  # negative indices wrap, as torch's
}

NOT_BY_DISTANCE: dict[str, Callable[..., Tensor]] = {
    "query alone": lambda s, b, h, q, kv: s + HEAD_TABLE[h, q],
    "sum of indices": lambda s, b, h, q, kv: s + 0.1 * (q + kv),
    "product": lambda s, b, h, q, kv: s + 0.01 * q * kv,
    "bias minus score": lambda s, b, h, q, kv: 0.1 * (q - kv) - s,
    "scaled score": lambda s, b, h, q, kv: 2 * s + 0.1 * (q - kv),
    "score twice": lambda s, b, h, q, kv: s + s,
    "alpha": lambda s, b, h, q, kv: torch.add(s, 0.1 * (q - kv), alpha=2.0),
    "partial": functools.partial(relative),
    # an index read alone, beside or instead of the distance
    "query minus a constant": lambda s, b, h, q, kv: s + 0.3 * (q - 3),
    "key minus a constant": lambda s, b, h, q, kv: s + 0.3 * (kv - 3),
    "constant minus the key": lambda s, b, h, q, kv: s + 0.3 * (3 - kv),
    "query alone, plain": lambda s, b, h, q, kv: s + q,
    "key alone": lambda s, b, h, q, kv: s + 0.1 * kv,
    "twice the query minus the key": lambda s, b, h, q, kv: s + 0.1 * (q * 2 - kv),
    "distance times the query": lambda s, b, h, q, kv: s + 0.01 * (q - kv) * q,
    "|query minus a constant|": lambda s, b, h, q, kv: s + 0.1 * (q - 3).abs(),
    # a function of the distance, but not spelled as one: not taken, and right all the same
    "shifted query minus the key": lambda s, b, h, q, kv: s + 0.1 * ((q - 3) - kv),
}


@pytest.mark.parametrize("name", BY_DISTANCE)
def test_a_bias_by_distance_is_recognised(name: str) -> None:
    q, k, v = _qkv(torch.float32)
    notes = attnkit.explain(q, k, v, score_mod=BY_DISTANCE[name], backend="chunked").notes
    assert "recognised as score + a bias by distance" in " ".join(notes["chunked"])
    assert "does not fuse" not in " ".join(notes["chunked"])  # native, or why it is not built
    assert any(n.startswith("native kernel") for n in notes["chunked"]) == _native.load()


@pytest.mark.parametrize("name", NOT_BY_DISTANCE)
def test_other_score_mods_are_not_taken_for_a_bias_by_distance(name: str) -> None:
    notes = _chunked_notes(score_mod=NOT_BY_DISTANCE[name])
    assert "recognised" not in notes
    assert "does not fuse a score_mod" in notes


@pytest.mark.parametrize(
    ("name", "mask_name", "native"),
    [
        ("relative", "causal", True),
        ("alibi", "sliding_window", True),
        ("head_offset", "document_causal", True),
        ("learnable", "none", True),
        ("per head", "prefix_lm", False),
        ("t5", "causal", True),
        ("minus", "document", False),
        ("wraps", "none", True),
    ],
)
def test_a_bias_by_distance_equals_the_per_tile_path_and_the_formula(
    name: str, mask_name: str, native: bool
) -> None:
    """Recognised (native or eager kernel) against the same function as a partial (never
    recognised: tile by tile) and the float64 dense formula; values and gradients, the captured
    table's included. GQA, Tq != Tk and a batch of 2 throughout."""
    mod, mask_mod = BY_DISTANCE[name], MASK_MODS[mask_name]
    q, k, v = (t.requires_grad_() for t in _qkv())
    tensors = [q, k, v, BIAS_TABLE]
    mask = None if mask_mod is None else flex.create_block_mask(mask_mod, None, None, T_Q, T_K).mask
    backend = Chunked(block_q=16, block_k=16, native=native)

    def run(m: Callable[..., Tensor]) -> Tensor:
        return attnkit.attention(q, k, v, mask=mask, score_mod=m, backend=backend)

    got = _grads(lambda: run(mod), tensors)
    per_tile = _grads(lambda: run(functools.partial(mod)), tensors)
    want = _grads(lambda: _dense_flex(q, k, v, mod, mask_mod), tensors)
    for a, b, w in zip(got, per_tile, want, strict=True):
        assert_close(a, w)
        assert_close(b, w)


def test_a_bias_by_distance_in_float32_and_without_gradients() -> None:
    q, k, v = _qkv(torch.float32)
    table = HEAD_TABLE.float()

    def mod(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return s + table[h, qi - kv + T_K]

    with torch.no_grad():
        got = flex.flex_attention(q, k, v, mod, enable_gqa=True)
    want = _dense_flex(q.double(), k.double(), v.double(), mod, None)
    assert_close(got, want, dtype=torch.float32)
    out, lse = _torch_flex(q, k, v, score_mod=mod)
    got, got_lse = flex.flex_attention(q, k, v, mod, enable_gqa=True, return_lse=True)
    assert_close(got, out, dtype=torch.float32)
    assert_close(got_lse, lse, dtype=torch.float32)


def test_a_bias_by_distance_that_fails_on_some_distance_keeps_the_per_tile_path() -> None:
    """Its table is computed at every distance of the call; where the function raises for one,
    the call runs tile by tile, which meets the same error only if a tile holds that distance."""
    q, k, v = _qkv()
    short = torch.randn(T_Q, dtype=torch.float64)  # distances q - kv >= 0 only, and not all

    def mod(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return s + short[qi - kv + T_Q]

    assert "recognised" not in _chunked_notes(score_mod=mod)
    with pytest.raises(IndexError):
        attnkit.attention(q, k, v, score_mod=mod)


# ------------------------------------------------------------------------------------------------
# What a score_mod may return: its input, a view of it, its input written in place, a new tensor


def _per_score(mod: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``mod`` applied as torch's FlexAttention applies it: on 0-d tensors, one score at a time
    (vmapped over kv_idx, q_idx, h and b), so the float64 dense formula built on it has torch's
    semantics and gradients."""
    fn = mod
    for dims in (
        (0, None, None, None, 0),
        (0, None, None, 0, None),
        (0, None, 0, None, None),
        (0, 0, None, None, None),
    ):
        fn = torch.vmap(fn, in_dims=dims)

    def per_score(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        out: Tensor = fn(s, b.flatten(), h.flatten(), q.flatten(), kv.flatten())
        return out.to(s.dtype)  # a float32 constant in float64 scores, as attnkit takes it

    return per_score


def _in_place_add(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    s += 0.1 * (q - kv)
    return s


def _written_then_viewed(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    s.mul_(0.5)
    return s[...]


AS_GIVEN: dict[str, Callable[..., Tensor]] = {
    "identity": lambda s, b, h, q, kv: s,
    "view_as": lambda s, b, h, q, kv: s.view_as(s),
    "s[...]": lambda s, b, h, q, kv: s[...],
    "reshape": lambda s, b, h, q, kv: s.reshape(s.shape),
    "mul_": lambda s, b, h, q, kv: s.mul_(2.0),
    "+=": _in_place_add,
    "tanh_": lambda s, b, h, q, kv: s.tanh_(),
    "written then viewed": _written_then_viewed,
    "a new tensor": lambda s, b, h, q, kv: s * 1.0,
}


@pytest.mark.parametrize("heads", [(H, H), (H, HKV)], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", AS_GIVEN)
def test_a_score_mod_may_return_its_input_a_view_or_write_it_in_place(
    name: str, heads: tuple[int, int]
) -> None:
    """Forward in float32 and float64 against torch's FlexAttention; with one query head per
    key/value head the tile it gets is the kernel's own buffer."""
    mod = AS_GIVEN[name]
    h, hkv = heads
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, h, T_Q, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, hkv, T_K, D, generator=g, dtype=torch.float64) for _ in range(2))
    bm = _torch_block_mask(causal)
    want, want_lse = _torch_flex(q, k, v, score_mod=mod, block_mask=bm)
    for dtype in (torch.float64, torch.float32):
        qd, kd, vd = (t.to(dtype) for t in (q, k, v))
        got, lse = flex.flex_attention(qd, kd, vd, mod, bm, enable_gqa=hkv != h, return_lse=True)
        assert_close(got, want, dtype=dtype)
        assert_close(lse, want_lse, dtype=dtype)


@pytest.mark.parametrize("backend", [SMALL, "chunked", "reference"], ids=str)
@pytest.mark.parametrize("heads", [(H, H), (H, HKV)], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", AS_GIVEN)
def test_a_score_mod_that_returns_its_input_trains(
    name: str, heads: tuple[int, int], backend: object
) -> None:
    """Values and gradients in float64 against the dense formula with the score_mod applied one
    score at a time, as torch does; the attnkit.flex call and attention() on several tiles."""
    mod = AS_GIVEN[name]
    h, hkv = heads
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, h, T_Q, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(2, hkv, T_K, D, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    want = _grads(lambda: _dense_flex(q, k, v, _per_score(mod), causal), [q, k, v])
    bm = flex.create_block_mask(causal, None, None, T_Q, T_K)
    got = _grads(lambda: flex.flex_attention(q, k, v, mod, bm, enable_gqa=hkv != h), [q, k, v])
    tiles = _grads(
        lambda: attnkit.attention(
            q,
            k,
            v,
            mask=bm.mask,
            scale=D**-0.5,
            score_mod=mod,
            backend=backend,  # type: ignore[arg-type]
        ),
        [q, k, v],
    )
    for a, b, w in zip(got, tiles, want, strict=True):
        assert_close(a, w)
        assert_close(b, w)


# ------------------------------------------------------------------------------------------------
# A score_mod maps each score to one score: what is not elementwise is refused

BIAS_4D = torch.randn(2, H, T_Q, T_K, dtype=torch.float64)
MIXER = torch.randn(T_K, T_K, dtype=torch.float64)


def _mix_keys(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return s @ MIXER[: s.size(-1), : s.size(-1)]  # each score a sum over the tile's keys


NOT_ELEMENTWISE: dict[str, Callable[..., Tensor]] = {
    "sum": lambda s, b, h, q, kv: s.sum(),
    "mean": lambda s, b, h, q, kv: s - s.mean(),
    "max": lambda s, b, h, q, kv: s - s.amax(),
    "max per row": lambda s, b, h, q, kv: s - s.amax(-1, keepdim=True),
    "min, kept shape": lambda s, b, h, q, kv: s.min() + 0.0 * s,
    "softmax": lambda s, b, h, q, kv: torch.softmax(s, -1),
    "first key": lambda s, b, h, q, kv: s[..., :1],
    "first key, kept shape": lambda s, b, h, q, kv: s[..., :1] + 0.0 * s,
    "first query": lambda s, b, h, q, kv: s[..., :1, :],
    "cumsum": lambda s, b, h, q, kv: s.cumsum(-1),
    "cumsum over queries": lambda s, b, h, q, kv: s.cumsum(-2),
    "flip": lambda s, b, h, q, kv: s.flip(-1),
    "roll": lambda s, b, h, q, kv: s.roll(1, -1),
    "scores times their transpose": lambda s, b, h, q, kv: s @ s.transpose(-1, -2),
    "matmul over keys": _mix_keys,
    "mean over heads": lambda s, b, h, q, kv: s - s.mean(1, keepdim=True),
    "mean over the batch": lambda s, b, h, q, kv: s - s.mean(0, keepdim=True),
    "mean of kv_idx": lambda s, b, h, q, kv: s + kv.to(s.dtype).mean(),
    "flipped kv_idx": lambda s, b, h, q, kv: s + 0.1 * kv.flip(-1),
}


@pytest.mark.parametrize("name", NOT_ELEMENTWISE)
def test_a_score_mod_that_is_not_elementwise_is_refused(name: str) -> None:
    """torch calls a score_mod on one score; attnkit on tiles, where these would give results
    that depend on the tile (or torch would raise): each is a ValueError, with or without
    gradients, naming what FlexAttention requires."""
    mod = NOT_ELEMENTWISE[name]
    q, k, v = _qkv()
    for needs_grad in (False, True):
        args = [t.detach().requires_grad_(needs_grad) for t in (q, k, v)]
        with pytest.raises(ValueError, match=r"FlexAttention requires a score_mod to map each"):
            flex.flex_attention(*args, mod, enable_gqa=True)
        with pytest.raises(ValueError, match=r"elementwise"):
            flex.flex_attention(*args, mod, enable_gqa=True)


def test_the_refusal_quotes_what_the_probe_saw() -> None:
    q, k, v = _qkv()
    with pytest.raises(
        ValueError,
        match=r"not elementwise: on a probe tile \(2, 2, 3, 4\) and on its sub-tile \(1, 1, 2, 3\)"
        r" .* at b=1, h=\d, q_idx=\d, kv_idx=\d\. FlexAttention requires",
    ):
        flex.flex_attention(q, k, v, NOT_ELEMENTWISE["sum"], enable_gqa=True)
    with pytest.raises(ValueError, match=r"returned a view of other scores of its score tile"):
        flex.flex_attention(q, k, v, NOT_ELEMENTWISE["first key"], enable_gqa=True)
    with pytest.raises(ValueError, match=r"returned shape \(2, 2, 3, 3\), which does not"):
        flex.flex_attention(
            q, k, v, NOT_ELEMENTWISE["scores times their transpose"], enable_gqa=True
        )


@pytest.mark.parametrize("backend", [SMALL, "reference"], ids=str)
def test_attention_refuses_a_view_of_other_scores_on_every_tile(backend: object) -> None:
    """attention(score_mod=...) checks each tile's result: a slice of the scores is refused there
    too."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"returned a view of other scores"):
        attnkit.attention(q, k, v, score_mod=NOT_ELEMENTWISE["first key"], backend=backend)  # type: ignore[arg-type]


ELEMENTWISE: dict[str, Callable[..., Tensor]] = {
    "identity": lambda s, b, h, q, kv: s,
    "score * 2": lambda s, b, h, q, kv: s * 2,
    "score + (q_idx - kv_idx)": lambda s, b, h, q, kv: s + (q - kv),
    "softcap": lambda s, b, h, q, kv: 3.0 * torch.tanh(s / 3.0),
    "alibi": lambda s, b, h, q, kv: s + SLOPES.double()[h] * (kv - q),
    "bias[b, h, q_idx, kv_idx]": lambda s, b, h, q, kv: s + BIAS_4D[b, h, q, kv],
    "causal by where": lambda s, b, h, q, kv: torch.where(q >= kv, s, -math.inf),
    "relu": lambda s, b, h, q, kv: torch.relu(s),
    "score + q_idx * 0.5": lambda s, b, h, q, kv: s + q * 0.5,
    "a constant": lambda s, b, h, q, kv: torch.tensor(0.5, dtype=torch.float64),
    "a float32 constant": lambda s, b, h, q, kv: torch.tensor(0.0),
    "indices only": lambda s, b, h, q, kv: 0.05 * (q - 2 * kv).to(torch.float64),
    "by its own value": by_value,
}


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_an_elementwise_score_mod_is_accepted_and_matches_torch(name: str) -> None:
    """Forward against torch's FlexAttention; values and gradients (q, k, v) in float64 against
    the dense formula with the score_mod applied one score at a time, as torch applies it. A
    result that only broadcasts to the tile (a constant, a function of the indices) is taken
    as the tile's, as torch broadcasts it over the scores."""
    mod = ELEMENTWISE[name]
    q, k, v = _qkv()
    want, want_lse = _torch_flex(q, k, v, score_mod=mod)
    got, lse = flex.flex_attention(q, k, v, mod, enable_gqa=True, return_lse=True)
    # torch computes on in the returned float32 constant's dtype; attnkit in the scores' float64
    within = torch.float32 if name == "a float32 constant" else torch.float64
    assert_close(got, want, dtype=within)
    assert_close(lse, want_lse, dtype=within)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grads = _grads(lambda: flex.flex_attention(q, k, v, mod, enable_gqa=True), [q, k, v])
    tiles = _grads(
        lambda: attnkit.attention(q, k, v, scale=D**-0.5, score_mod=mod, backend=SMALL), [q, k, v]
    )
    formula = _grads(lambda: _dense_flex(q, k, v, _per_score(mod), None), [q, k, v])
    for a, b, w in zip(grads, tiles, formula, strict=True):
        assert_close(a, w)
        assert_close(b, w)


# ------------------------------------------------------------------------------------------------
# torch BlockMasks whose query and key blocks differ in size


def _from_table(table: Tensor, block_size: tuple[int, int], q_len: int, kv_len: int) -> Tensor:
    """The bool ``(Q_LEN, KV_LEN)`` mask a block table ``(q_blocks, kv_blocks)`` lists, written
    out block by block."""
    bq, bk = block_size
    return table.repeat_interleave(bq, 0).repeat_interleave(bk, 1)[:q_len, :kv_len]


@pytest.mark.parametrize(
    ("block_size", "lengths"),
    [
        ((128, 64), (200, 300)),
        ((64, 128), (200, 300)),
        ((128, 64), (300, 200)),
        ((64, 128), (64, 256)),
    ],
)
@pytest.mark.parametrize("mask_name", ["causal", "sliding_window", "prefix_lm", "documents"])
def test_torch_block_masks_with_unequal_block_sizes(
    block_size: tuple[int, int], lengths: tuple[int, int], mask_name: str
) -> None:
    """BLOCK_SIZE (query block, key block): a torch BlockMask read with the two swapped indexes
    its block table wrongly."""
    q_len, kv_len = lengths
    docs = torch.arange(max(lengths)) // 70

    def documents(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return docs[q] == docs[kv]

    mask_mod = {"causal": causal, "sliding_window": sliding_window, "prefix_lm": prefix_lm}.get(
        mask_name, documents
    )
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, q_len, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, kv_len, D, generator=g, dtype=torch.float64) for _ in range(2))
    block_mask = torch_flex.create_block_mask(
        mask_mod, None, None, q_len, kv_len, device="cpu", BLOCK_SIZE=block_size
    )
    assert tuple(block_mask.BLOCK_SIZE) == block_size
    want, want_lse = _torch_flex(q, k, v, score_mod=relative, block_mask=block_mask)
    got, lse = flex.flex_attention(q, k, v, relative, block_mask, return_lse=True)
    assert_close(got, want)
    assert_close(lse, want_lse)


@pytest.mark.parametrize(
    ("block_size", "lengths", "rows"),
    [
        ((32, 16), (64, 96), [[0, 2], [1, 3, 4]]),
        ((16, 32), (96, 64), [[0], [1, 0], [1], [0, 1], [1, 0], [0]]),
        # lengths at which the swapped block sizes still index inside the table
        ((32, 16), (16, 96), [[0, 2, 5]]),
        ((16, 32), (96, 16), [[0], [], [0], [], [0], [0]]),
    ],
)
def test_a_block_table_with_unequal_block_sizes_is_read_block_by_block(
    block_size: tuple[int, int], lengths: tuple[int, int], rows: list[list[int]]
) -> None:
    """from_kv_blocks with no mask_mod: the block table alone is the mask, and a query block or
    a key block read at the other's size would be another mask."""
    q_len, kv_len = lengths
    kv_blocks = -(-kv_len // block_size[1])
    num = torch.tensor([len(r) for r in rows], dtype=torch.int32).view(1, 1, -1)
    idx = torch.tensor([r + [0] * (kv_blocks - len(r)) for r in rows], dtype=torch.int32)
    block_mask = torch_flex.BlockMask.from_kv_blocks(
        num, idx.view(1, 1, len(rows), kv_blocks), BLOCK_SIZE=block_size, seq_lengths=lengths
    )
    table = torch.zeros(len(rows), kv_blocks, dtype=torch.bool)
    for i, r in enumerate(rows):
        table[i, r] = True
    dense = _from_table(table, block_size, q_len, kv_len)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, H, q_len, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, H, kv_len, D, generator=g, dtype=torch.float64) for _ in range(2))
    got = flex.flex_attention(q, k, v, head_offset, block_mask)
    want = _dense_flex(q, k, v, head_offset, lambda b, h, qi, kv: dense[qi, kv])
    assert_close(got, want)


@pytest.mark.parametrize("name", [*BY_DISTANCE, *NOT_BY_DISTANCE])
def test_a_score_mod_is_right_whether_or_not_it_is_a_bias_by_distance(name: str) -> None:
    """Taken for a bias by distance or not: the forward equals torch's FlexAttention, and values
    and gradients (the captured table's included) the float64 formula, in the native kernel
    where it is built and in the eager one."""
    mod = {**BY_DISTANCE, **NOT_BY_DISTANCE}[name]
    q, k, v = _qkv()
    bm = _torch_block_mask(causal)
    want, want_lse = _torch_flex(q, k, v, score_mod=mod, block_mask=bm)
    got, lse = flex.flex_attention(q, k, v, mod, bm, enable_gqa=True, return_lse=True)
    assert_close(got, want)
    assert_close(lse, want_lse)
    tensors = [t.requires_grad_() for t in (q, k, v)] + [BIAS_TABLE]
    mask = flex.create_block_mask(causal, None, None, T_Q, T_K).mask
    formula = _grads(lambda: _dense_flex(q, k, v, _per_score(mod), causal), tensors)
    for native in (True, False):
        backend = Chunked(block_q=16, block_k=16, native=native)
        got_grads = _grads(
            lambda be=backend: attnkit.attention(
                q, k, v, mask=mask, scale=D**-0.5, score_mod=mod, backend=be
            ),
            tensors,
        )
        for a, w in zip(got_grads, formula, strict=True):
            assert_close(a, w)
