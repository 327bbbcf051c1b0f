"""What torch's own suites ask of ``scaled_dot_product_attention`` and ``nn.MultiheadAttention``,
asked of :func:`attnkit.attention`, :class:`attnkit.MultiHeadAttention` and
:mod:`attnkit.interop.torch`.

torch's tests probe masks broadcast from every legal shape, bool and float (``-inf``) masks with
fully masked rows, causal masks with ``Tq != Tk``, grouped-query heads (``enable_gqa``), an explicit
scale, dropout, empty dims, strided and expanded inputs, every float dtype, gradients on some inputs
only, ``gradcheck``, ``torch.compile`` and ``vmap``; and for the module ``key_padding_mask`` with
``attn_mask`` (2-d and 3-d, bool and float), ``need_weights`` and ``average_attn_weights``,
``kdim``/``vdim``, ``batch_first=False``, ``add_bias_kv`` and ``add_zero_attn``.

Where attnkit follows torch the answer is torch's, computed in float64; where attnkit documents a
convention of its own the answer is the float64 statement of attnkit's formula below:

* ``causal=True`` aligns the queries bottom-right (torch's ``causal_lower_right``), where torch's
  ``is_causal`` is top-left (attnkit's ``masks.causal(align="top_left")``);
* a query with no visible key gets output 0 and zero gradients, where ``nn.MultiheadAttention``
  gives NaN;
* q, k and v share their batch dims (torch broadcasts them), inputs have a head dim (torch also
  takes ``(T, D)``), ``dropout_p < 1`` and a bias in q's dtype.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import jaxtyping
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right

from attnkit import BackendError, MultiHeadAttention, attention, masks
from attnkit.interop.torch import from_torch, from_torch_masks, to_torch
from attnkit.testing import assert_close

from ..helpers import brute_force

F64 = torch.float64
BACKENDS = ["auto", "reference", "chunked", "sdpa"]

pytestmark = [
    # attnkit's hint that a mask may be in torch's convention: these masks are random on purpose
    pytest.mark.filterwarnings("ignore:mask lets no query:UserWarning"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]


def _ref(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    """attnkit's documented attention in float64 (``tests/helpers.brute_force``, row by row from
    the definition): the keys ``mask`` (True = may attend) and the bottom-right causal band leave
    visible, key/value head ``h // (H / Hkv)`` for query head ``h``; a row with no visible key is
    0 (and so are its gradients)."""
    return brute_force(q, k, v, **kwargs)[0]


def _qkv(
    *shapes: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0
) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=F64).to(dtype) for s in shapes]


def _bool(shape: tuple[int, ...], seed: int, p: float = 0.35) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) > p


# -- attention(): masks --------------------------------------------------------------------------

B, H, TQ, TK, D = 2, 4, 5, 7, 8
MASK_SHAPES = [
    (TK,),
    (1, TK),
    (TQ, 1),
    (TQ, TK),
    (H, TQ, TK),
    (1, TQ, TK),
    (H, 1, TK),
    (B, 1, TQ, TK),
    (B, 1, 1, TK),
    (1, H, 1, TK),
    (1, 1, TQ, TK),
    (B, H, TQ, TK),
]


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
def test_masks_and_biases_broadcast_from_every_legal_shape(shape: tuple[int, ...]) -> None:
    """A bool mask, a float bias and a 0/-inf float mask of each broadcastable shape, on every
    backend: as torch reads its ``attn_mask`` (bool True = may attend, float added)."""
    q, k, v = _qkv((B, H, TQ, D), (B, H, TK, D), (B, H, TK, D))
    keep = _bool(shape, 1)
    (bias,) = _qkv(shape, seed=2)
    inf_mask = torch.zeros(shape).masked_fill(~keep, -math.inf)
    for backend in BACKENDS:
        assert_close(attention(q, k, v, mask=keep, backend=backend), _ref(q, k, v, mask=keep))
        assert_close(attention(q, k, v, bias=bias, backend=backend), _ref(q, k, v, bias=bias))
        assert_close(
            attention(q, k, v, bias=inf_mask, backend=backend), _ref(q, k, v, bias=inf_mask)
        )
    # torch's SDPA reads the same masks the same way (its math in float64; it takes no 1-d mask)
    theirs = keep if keep.ndim > 1 else keep[None]
    assert_close(
        attention(q, k, v, mask=keep),
        F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=theirs),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_are_zero_with_zero_gradients(backend: str) -> None:
    """Rows hidden whole by a bool mask or by a -inf bias: output 0, as torch's SDPA gives for a
    bool mask, and gradients that are finite everywhere and 0 for those queries."""
    q, k, v = _qkv((B, 3, 4, D), (B, 3, 6, D), (B, 3, 6, D))
    keep = _bool((B, 1, 4, 6), 3)
    keep[:, :, 1] = False
    keep[0, :, 2] = False
    inf_bias = torch.zeros(B, 1, 4, 6).masked_fill(~keep, -math.inf)
    want = _ref(q, k, v, mask=keep)
    torch_out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=keep)
    assert_close(want, torch_out, dtype=F64)
    for kwargs in ({"mask": keep}, {"bias": inf_bias.requires_grad_()}):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, backend=backend, **kwargs)
        assert_close(out, want)
        assert bool((out[:, :, 1] == 0).all())
        out.square().sum().backward()
        for t in [*leaves, kwargs.get("bias")]:
            if t is not None:
                assert t.grad is not None
                assert bool(torch.isfinite(t.grad).all())
        assert bool((leaves[0].grad[:, :, 1] == 0).all())


@pytest.mark.parametrize(("tq", "tk"), [(1, 1), (1, 7), (7, 1), (3, 7), (7, 3), (5, 5)])
def test_causal_is_bottom_right_and_top_left_is_torchs_is_causal(tq: int, tk: int) -> None:
    """``causal=True`` is torch's ``causal_lower_right`` (queries end where the keys end; with
    ``Tq > Tk`` the first rows see nothing and are 0); ``masks.causal(align="top_left")`` is torch's
    ``is_causal=True``."""
    q, k, v = _qkv((B, H, tq, D), (B, H, tk, D), (B, H, tk, D))
    qd, kd, vd = q.double(), k.double(), v.double()
    top_left = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
    for backend in BACKENDS:
        out = attention(q, k, v, causal=True, backend=backend)
        assert_close(out, _ref(q, k, v, causal=True))
        if tq <= tk:
            want = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=causal_lower_right(tq, tk))
            assert_close(out, want)
        tl = attention(q, k, v, mask=masks.causal(align="top_left"), backend=backend)
        assert_close(tl, top_left)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 1), (4, 2), (6, 3), (8, 8)])
def test_grouped_query_heads_are_torchs_enable_gqa(heads: int, kv_heads: int) -> None:
    q, k, v = _qkv((B, heads, 5, D), (B, kv_heads, 7, D), (B, kv_heads, 7, 6))
    keep = _bool((B, heads, 5, 7), 4)
    want = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=keep, enable_gqa=True
    )
    for backend in BACKENDS:
        assert_close(attention(q, k, v, mask=keep, backend=backend), want)
        assert_close(attention(q, k, v, causal=True, backend=backend), _ref(q, k, v, causal=True))


@pytest.mark.parametrize("scale", [0.0, 1.0, 0.01, 3.5, -0.7, 2])
def test_explicit_scale_is_torchs(scale: float) -> None:
    q, k, v = _qkv((B, H, 5, D), (B, H, 7, D), (B, H, 7, 12))
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale)
    for backend in BACKENDS:
        assert_close(attention(q, k, v, scale=scale, backend=backend), want)
        assert_close(
            attention(q, k, v, scale=scale, causal=True, backend=backend),
            _ref(q, k, v, scale=scale, causal=True),
        )


# -- attention(): dropout, empty dims, layouts, dtypes --------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_keeps_or_drops_each_weight_scaled_as_torch_does(backend: str) -> None:
    """With ``v`` the identity the output is the dropped weights themselves: each is 0 or
    ``w / (1 - p)`` (torch's scaling), about a fraction ``p`` of the visible ones is dropped, a
    masked pair stays 0, and the same ``torch.manual_seed`` draws the same pattern."""
    p, tq, tk = 0.3, 48, 32
    q, k = _qkv((B, H, tq, 16), (B, H, tk, 16), seed=5)
    v = torch.eye(tk).expand(B, H, tk, tk)
    keep = _bool((B, 1, tq, tk), 6, p=0.25)
    for kwargs in ({}, {"causal": True, "mask": keep}):
        weights = _ref(q, k, v, **kwargs)  # (B, H, Tq, Tk): v is the identity
        torch.manual_seed(11)
        out = attention(q, k, v, dropout_p=p, backend=backend, **kwargs)
        torch.manual_seed(11)
        assert torch.equal(out, attention(q, k, v, dropout_p=p, backend=backend, **kwargs))
        visible = weights > 0
        ratio = out.double()[visible] / (weights[visible] / (1 - p))
        kept, dropped = (ratio - 1).abs() < 1e-4, ratio.abs() < 1e-6
        assert bool((kept | dropped).all())
        assert abs(dropped.double().mean().item() - p) < 0.03
        assert bool((out[~visible] == 0).all())


def test_module_dropout_is_off_in_eval_and_distributed_as_torchs_in_training() -> None:
    """With both extra tokens: eval is torch's output; in training the output varies from call
    to call with torch's mean and spread over many draws (dropout is unbiased and drops as
    torch's does, the extra tokens' weights too), and the weights returned are those before
    dropout (attnkit's documented choice: torch returns them after)."""
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(
        8, 2, dropout=0.5, add_bias_kv=True, add_zero_attn=True, batch_first=True
    ).double()
    ours = from_torch(theirs.eval())
    (x,) = _qkv((1, 3, 8), dtype=F64)
    plain, plain_w = ours(x, need_weights=True)
    assert_close(plain, theirs(x, x, x, need_weights=False)[0])
    ours.train()
    theirs.train()
    assert_close(ours(x, need_weights=True)[1], plain_w)
    with torch.no_grad():
        draws = torch.stack([ours(x) for _ in range(200)])
        torch_draws = torch.stack([theirs(x, x, x, need_weights=False)[0] for _ in range(200)])
    assert not torch.equal(draws[0], draws[1])
    spread = torch_draws.std(0)
    assert (draws.mean(0) - plain).abs().max().item() < 0.3 * spread.max().item()
    assert abs((draws.std(0) / spread).mean().item() - 1) < 0.1


@pytest.mark.parametrize(
    ("q_shape", "kv_shape"),
    [
        ((2, 4, 0, 8), (2, 4, 7, 8)),
        ((2, 4, 5, 8), (2, 4, 0, 8)),
        ((2, 4, 0, 8), (2, 4, 0, 8)),
        ((0, 4, 5, 8), (0, 4, 7, 8)),
        ((2, 4, 5, 0), (2, 4, 7, 0)),
    ],
    ids=str,
)
def test_empty_dims(q_shape: tuple[int, ...], kv_shape: tuple[int, ...]) -> None:
    """Empty query, key, batch and head-size dims: torch's results (``Tk = 0``: every query sees
    nothing, output 0 as torch's SDPA gives, and zero gradients)."""
    q, k = _qkv(q_shape, kv_shape)
    (v,) = _qkv((*kv_shape[:-1], 6))
    scale = 1.0 if q_shape[-1] == 0 else None  # (any scale: the scores are all 0)
    theirs = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale)
    assert_close(attention(q, k, v), theirs)
    for backend, causal in itertools.product(BACKENDS, (False, True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, causal=causal, backend=backend)
        assert_close(out, _ref(q, k, v, causal=causal, scale=scale))
        out.sum().backward()
        assert leaves[0].grad is not None
        if kv_shape[-2] == 0:
            assert bool((out == 0).all())
            assert bool((leaves[0].grad == 0).all())


def test_zero_heads_are_refused() -> None:
    q, k, v = _qkv((2, 0, 5, 8), (2, 0, 7, 8), (2, 0, 7, 8))
    with pytest.raises(ValueError, match="at least one head"):
        attention(q, k, v)


def _layouts() -> dict[str, tuple[Tensor, Tensor, Tensor]]:
    """q, k, v ``(2, 4, T, 16)`` in the layouts torch's tests build: transposed from ``(B, T, H,
    D)``, expanded (stride 0) over batch or heads, every other element of the last dim, a slice
    of a longer sequence, and the dims permuted."""
    q, k, v = _qkv((2, 9, 4, 16), (2, 11, 4, 16), (2, 11, 4, 16), seed=7)
    wide_q, wide_k = _qkv((2, 4, 9, 32), (2, 4, 11, 32), seed=8)
    long_v, one_k, one_v = _qkv((2, 4, 20, 16), (1, 1, 11, 16), (2, 1, 11, 16), seed=9)
    (rev_q,) = _qkv((16, 9, 4, 2), seed=10)
    return {
        "transposed": (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
        "expanded": (
            q.transpose(1, 2)[:1].expand(2, -1, -1, -1),
            one_k.expand(2, 4, 11, 16),
            one_v.expand(2, 4, 11, 16),
        ),
        "strided last dim": (wide_q[..., ::2], wide_k[..., ::2], v.transpose(1, 2)),
        "sliced and permuted": (rev_q.permute(3, 2, 1, 0), k.transpose(1, 2), long_v[:, :, 3:14]),
    }


@pytest.mark.parametrize(
    "layout", ["transposed", "expanded", "strided last dim", "sliced and permuted"]
)
def test_strided_and_expanded_inputs(layout: str) -> None:
    q, k, v = _layouts()[layout]
    pad = _bool((2, 1, 1, 11), 12)
    expanded_mask = _bool((1, 1, 1, 11), 13).expand(2, 4, 9, 11)
    transposed_mask = _bool((11, 9), 14).t()
    (bias_row,) = _qkv((11,), seed=15)
    for backend in BACKENDS:
        for kwargs in (
            {"mask": pad},
            {"mask": expanded_mask, "bias": bias_row.expand(2, 4, 9, 11)},
            {"mask": transposed_mask, "causal": True},
        ):
            assert_close(attention(q, k, v, backend=backend, **kwargs), _ref(q, k, v, **kwargs))


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_qkv_views_and_their_gradient(backend: str) -> None:
    """q, k and v as views of one packed projection ``(B, T, 3*H*D)`` (rows 3*H*D apart, as torch's
    packed tests and a fused QKV projection make them), the gradient flowing into the packed
    tensor; and a head size of 1 whose elements are 2 apart."""
    (packed,) = _qkv((2, 9, 3 * 4 * 8), seed=52)

    def split(t: Tensor) -> list[Tensor]:
        return [part.view(2, 9, 4, 8).transpose(1, 2) for part in t.split(32, -1)]

    (grad,) = _qkv((2, 4, 9, 8), seed=53)
    pad = _bool((2, 1, 1, 9), 54)
    for kwargs in ({"causal": True}, {"mask": pad}):
        leaf, exact = packed.clone().requires_grad_(), packed.double().requires_grad_()
        out = attention(*split(leaf), backend=backend, **kwargs)
        out.backward(grad)
        _ref(*split(exact), **kwargs).backward(grad.double())
        assert_close(out, _ref(*split(exact), **kwargs))
        assert_close(leaf.grad, exact.grad)
    q, k, v = (t[..., :1] for t in _qkv((2, 4, 5, 2), (2, 4, 7, 2), (2, 4, 7, 2), seed=55))
    assert_close(attention(q, k, v, causal=True, backend=backend), _ref(q, k, v, causal=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_every_float_dtype_against_float64(dtype: torch.dtype) -> None:
    q, k, v = _qkv((2, 4, 9, 16), (2, 2, 11, 16), (2, 2, 11, 8), dtype=dtype)
    keep = _bool((9, 11), 16)
    keep[3] = False
    (bias,) = _qkv((1, 4, 9, 11), dtype=dtype, seed=17)
    for backend in BACKENDS:
        for kwargs in (
            {},
            {"causal": True},
            {"mask": keep},
            {"bias": bias},
            {"mask": keep, "bias": bias, "causal": True},
        ):
            out = attention(q, k, v, backend=backend, **kwargs)
            assert out.dtype == dtype
            assert_close(out, _ref(q, k, v, **kwargs))


# -- attention(): gradients, compile, vmap ---------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_of_the_inputs_that_need_them(backend: str) -> None:
    """Gradients on any subset of q, k, v (and a broadcast bias) equal float64 autograd on the
    formula; inputs that need none get none."""
    q, k, v, g = _qkv((2, 4, 6, 8), (2, 2, 9, 8), (2, 2, 9, 8), (2, 4, 6, 8), seed=18)
    keep = _bool((2, 1, 6, 9), 19)
    for needs in itertools.product((False, True), repeat=3):
        kwargs: dict[str, Any] = [{}, {"causal": True}, {"mask": keep}][sum(needs) % 3]
        leaves = [t.clone().requires_grad_(n) for t, n in zip((q, k, v), needs, strict=True)]
        exact = [t.double().requires_grad_(n) for t, n in zip((q, k, v), needs, strict=True)]
        if not any(needs):
            assert not attention(*leaves, backend=backend, **kwargs).requires_grad
            continue
        attention(*leaves, backend=backend, **kwargs).backward(g)
        _ref(*exact, **kwargs).backward(g.double())
        for leaf, want, need in zip(leaves, exact, needs, strict=True):
            if need:
                assert_close(leaf.grad, want.grad)
            else:
                assert leaf.grad is None
    for shape in [(9,), (6, 9), (4, 1, 9), (2, 1, 1, 9)]:
        (bias,) = _qkv(shape, seed=20)
        leaf, exact = bias.clone().requires_grad_(), bias.double().requires_grad_()
        attention(q, k, v, bias=leaf, backend=backend).backward(g)
        _ref(q, k, v, bias=exact).backward(g.double())
        assert_close(leaf.grad, exact.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_in_float64(backend: str) -> None:
    """torch.autograd.gradcheck on small shapes: grouped heads, causal with ``Tq < Tk``, a mask
    with an empty row, and a bias that needs gradients."""
    q, k, v, bias = _qkv((1, 2, 2, 3), (1, 1, 4, 3), (1, 1, 4, 2), (1, 2, 2, 4), dtype=F64)
    keep = torch.tensor([[True, False, True, True], [False, False, False, False]])
    leaves = [t.requires_grad_() for t in (q, k, v, bias)]
    for kwargs in ({"causal": True}, {"mask": keep}):
        assert torch.autograd.gradcheck(
            lambda q, k, v, b, kw=kwargs: attention(q, k, v, bias=b, backend=backend, **kw),
            leaves,
            fast_mode=True,
        )


def test_second_derivatives_exact_on_reference_and_refused_loudly_by_chunked() -> None:
    """gradgradcheck holds on the reference (torch's differentiable operations); the chunked
    kernel's backward is differentiable once, and a second derivative through it raises rather
    than returning a wrong number."""
    q, k, v = _qkv((1, 2, 2, 3), (1, 1, 4, 3), (1, 1, 4, 2), dtype=F64)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradgradcheck(
        lambda q, k, v: attention(q, k, v, causal=True, backend="reference"),
        leaves,
        fast_mode=True,
    )
    out = attention(*leaves, causal=True, backend="chunked")
    (dq,) = torch.autograd.grad(out.square().sum(), leaves[0], create_graph=True)
    with pytest.raises(RuntimeError, match="chunked kernel computes first-order gradients only"):
        dq.square().sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_call_and_its_gradients_equal_the_formula(backend: str) -> None:
    """The same call under torch.compile (aot_eager, fullgraph): causal with ``Tq < Tk``, a mask
    with an empty row and a bias with a ``-inf`` row; outputs and gradients."""
    q, k, v = _qkv((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), seed=22)
    keep = _bool((2, 1, 5, 7), 23)
    keep[0, 0, 2] = False
    (bias,) = _qkv((1, 4, 5, 7), seed=24)
    bias[..., 1, :] = -math.inf
    kwargs = {"causal": True, "mask": keep, "bias": bias}
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: attention(q, k, v, backend=backend, **kwargs),
        backend="aot_eager",
        fullgraph=True,
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    out = compiled(*leaves)
    out.square().sum().backward()
    want = _ref(*exact, **kwargs)
    want.square().sum().backward()
    assert_close(out, want)
    for leaf, e in zip(leaves, exact, strict=True):
        assert_close(leaf.grad, e.grad)


def test_compiled_causal_call_over_dynamic_shapes() -> None:
    """One dynamic-shape graph for causal calls of several ``(Tq, Tk)``: the bottom-right offset
    is a symbol, not a constant of the first call."""
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: attention(q, k, v, causal=True), backend="aot_eager", dynamic=True
    )
    for tq, tk in [(3, 7), (4, 9), (9, 4), (5, 5)]:
        q, k, v = _qkv((2, 4, tq, 8), (2, 4, tk, 8), (2, 4, tk, 8), seed=tq * 10 + tk)
        assert_close(compiled(q, k, v), _ref(q, k, v, causal=True))


@pytest.mark.parametrize("backend", ["auto", "reference", "chunked"])
def test_vmap_over_an_inference_call(backend: str) -> None:
    """torch.func.vmap over a call without gradients equals each example's call."""
    q, k, v = _qkv((3, 2, 4, 6, 8), (3, 2, 4, 6, 8), (3, 2, 4, 6, 8), seed=25)
    for kwargs in ({}, {"causal": True}, {"mask": _bool((6, 6), 26)}):
        got = torch.vmap(lambda q, k, v, kw=kwargs: attention(q, k, v, backend=backend, **kw))(
            q, k, v
        )
        assert_close(got, _ref(q, k, v, **kwargs))


def test_sdpa_refuses_an_inference_call_under_vmap_with_the_reason() -> None:
    """Without gradients the sdpa backend screens torch's output for the non-finite policy by
    reading its values on the host, which vmap cannot: it says so (and auto takes chunked)."""
    q, k, v = _qkv((3, 2, 4, 6, 8), (3, 2, 4, 6, 8), (3, 2, 4, 6, 8), seed=27)
    with pytest.raises(BackendError, match=r"torch\.func\.vmap cannot"):
        torch.vmap(lambda q, k, v: attention(q, k, v, backend="sdpa"))(q, k, v)


@pytest.mark.parametrize("backend", ["auto", "reference", "sdpa", "chunked"])
def test_vmap_over_a_call_whose_inputs_autograd_tracks(backend: str) -> None:
    """vmap inside autograd: the inputs say ``requires_grad=False`` under vmap, yet autograd
    outside it tracks them, so the call needs gradients. Each backend's gradients equal the
    formula's, or it refuses with the reason (chunked must read whether q, k and v are finite,
    which vmap cannot): never a call that silently gives no gradients."""
    q, k, v = _qkv((3, 2, 4, 6, 8), (3, 2, 2, 6, 8), (3, 2, 2, 6, 8), dtype=F64, seed=28)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    exact = [t.clone().requires_grad_() for t in (q, k, v)]

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attention(q, k, v, causal=True, backend=backend)

    if backend == "chunked":
        with pytest.raises(BackendError, match=r"torch\.func\.vmap cannot"):
            torch.vmap(call)(*leaves)
        return
    torch.vmap(call)(*leaves).square().sum().backward()
    _ref(*exact, causal=True).square().sum().backward()
    for leaf, want in zip(leaves, exact, strict=True):
        assert_close(leaf.grad, want.grad)


def test_what_attnkit_refuses_where_torch_broadcasts_or_accepts() -> None:
    """attnkit's documented limits, each a clear error: torch broadcasts q, k and v's batch dims,
    takes ``(T, D)`` inputs, ``dropout_p=1`` and a float mask of another dtype than q's; and
    torch's keyword names get attnkit's in the message."""
    q, k, v = _qkv((2, 4, 6, 8), (1, 4, 7, 8), (1, 4, 7, 8))
    # (the shape annotations, checked in the tests, refuse these two before attnkit's checks)
    with pytest.raises((ValueError, jaxtyping.TypeCheckError)):
        attention(q, k, v)
    with pytest.raises((ValueError, jaxtyping.TypeCheckError)):
        attention(q[0, 0], k[0, 0], v[0, 0])
    k, v = k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        attention(q, k, v, dropout_p=1.0)
    with pytest.raises(TypeError, match="dtype of q"):
        attention(q, k, v, bias=torch.zeros(6, 7, dtype=F64))
    for name, advice in [("is_causal", "causal=True"), ("attn_mask", "mask="), ("enable_gqa", "")]:
        with pytest.raises(TypeError, match=f"instead of {name}=, pass {advice}"):
            attention(q, k, v, **{name: True})


# -- MultiHeadAttention and interop with torch's modules ------------------------------------------

E, NH = 16, 4


def _torch_masks(
    attn_dims: int | None, padding: bool, dtype: torch.dtype, seed: int, tq: int, tk: int
) -> tuple[Tensor | None, Tensor | None]:
    """torch's ``attn_mask`` ``(Tq, Tk)`` or ``(B*H, Tq, Tk)`` and ``key_padding_mask`` ``(B,
    Tk)``, True = may NOT attend; as float masks, -inf there plus a small additive term."""
    shapes: list[tuple[int, ...] | None] = [
        None if attn_dims is None else ((tq, tk) if attn_dims == 2 else (B * NH, tq, tk)),
        (B, tk) if padding else None,
    ]
    out: list[Tensor | None] = []
    for i, shape in enumerate(shapes):
        if shape is None:
            out.append(None)
            continue
        blocked = ~_bool(shape, seed + i, p=0.3)
        if dtype != torch.bool:
            (extra,) = _qkv(shape, dtype=dtype, seed=seed + 10 + i)
            out.append((extra * 0.1).masked_fill(blocked, -math.inf))
        else:
            out.append(blocked)
    return out[0], out[1]


MODULES = {
    "plain": {},
    "no bias": {"bias": False},
    "kdim vdim": {"kdim": 6, "vdim": 10},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn": {"add_zero_attn": True},
    "all": {"kdim": 6, "vdim": 10, "add_bias_kv": True, "add_zero_attn": True},
}


def _module_pair(options: dict[str, Any]) -> tuple[nn.MultiheadAttention, MultiHeadAttention]:
    torch.manual_seed(29)
    theirs = nn.MultiheadAttention(E, NH, batch_first=True, **options).double().eval()
    if theirs.in_proj_bias is not None:
        with torch.no_grad():
            theirs.in_proj_bias.normal_()
            theirs.out_proj.bias.normal_()
    return theirs, from_torch(theirs)


@pytest.mark.parametrize("name", list(MODULES))
def test_multihead_equals_torch_with_every_mask_torch_takes(name: str) -> None:
    """from_torch's copy, given from_torch_masks' translation of each combination torch's tests
    use (attn_mask 2-d or 3-d, key_padding_mask, bool or float), returns torch's output and
    weights, averaged or per head. Where every key of a query is masked torch gives NaN and
    attnkit (documented) attends nothing: the output projection's bias, and weights 0."""
    theirs, ours = _module_pair(MODULES[name])
    tq, tk = 5, 7
    x, key, value = _qkv((B, tq, E), (B, tk, ours.kdim), (B, tk, ours.vdim), dtype=F64, seed=30)
    combos = itertools.product((None, 2, 3), (False, True), (torch.bool, F64))
    for i, (attn_dims, padding, dtype) in enumerate(combos):
        if attn_dims is None and not padding and dtype == F64:
            continue
        attn_mask, pad = _torch_masks(attn_dims, padding, dtype, 31 + i, tq, tk)
        average = i % 2 == 0
        want, want_w = theirs(
            x, key, value, attn_mask=attn_mask, key_padding_mask=pad,
            average_attn_weights=average,
        )  # fmt: skip
        mask, bias = from_torch_masks(attn_mask, pad, num_heads=NH, dtype=F64)
        got, got_w = ours(
            x, key, value, mask=mask, bias=bias, need_weights=True, average_weights=average
        )
        assert_close(ours(x, key, value, mask=mask, bias=bias), got)
        rows = torch.isfinite(want).all(-1)  # (B, Tq): the queries torch answers
        assert_close(got[rows], want[rows])
        assert_close(got_w[torch.isfinite(want_w)], want_w[torch.isfinite(want_w)])
        if ours.bias_k is None and not ours.add_zero_attn:
            assert torch.equal(rows, torch.isfinite(want).any(-1))
            out_bias = theirs.out_proj.bias
            out_bias = torch.zeros(E, dtype=F64) if out_bias is None else out_bias
            assert_close(got[~rows], out_bias.expand_as(got)[~rows])
            nothing = ~torch.isfinite(want_w)
            assert bool((got_w[nothing] == 0).all())
        else:  # the extra tokens are seen by every query: torch answers every one
            assert bool(rows.all())


@pytest.mark.parametrize(("tq", "tk"), [(3, 6), (6, 3)])
def test_multihead_causal_with_extra_tokens_is_torchs_lower_right_mask(tq: int, tk: int) -> None:
    """``causal=True`` with ``Tq != Tk`` is torch's attn_mask blocking ``j > i + Tk - Tq``; the
    learned token and the zero key stay visible to every query, as torch pads its mask for them
    (so with ``Tq > Tk`` the first queries see only them)."""
    theirs, ours = _module_pair(MODULES["all"])
    x, key, value = _qkv((B, tq, E), (B, tk, 6), (B, tk, 10), dtype=F64, seed=56)
    blocked = ~torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
    want, want_w = theirs(x, key, value, attn_mask=blocked)
    got, got_w = ours(x, key, value, causal=True, need_weights=True)
    assert_close(got, want)
    assert_close(got_w, want_w)


def test_multihead_self_and_cross_attention_paths_equal_torch() -> None:
    """Self-attention (one projection), cross-attention on one memory (keys and values from one
    projection) and three inputs: torch's outputs; torch's MultiheadAttention is batch_first=False
    by default, taken with batch_first=True and transposed inputs."""
    torch.manual_seed(32)
    theirs = nn.MultiheadAttention(E, NH).double().eval()
    with pytest.raises(ValueError, match="batch_first=False"):
        from_torch(theirs)
    ours = from_torch(theirs, batch_first=True)
    x, memory, value = _qkv((6, B, E), (9, B, E), (9, B, E), dtype=F64, seed=33)
    _, pad = _torch_masks(None, True, torch.bool, 34, 6, 9)
    mask, _ = from_torch_masks(None, pad, num_heads=NH)

    def batch_first(t: Tensor) -> Tensor:
        return t.transpose(0, 1)

    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=F64)
    want = theirs(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
    assert_close(batch_first(ours(batch_first(x), causal=True)), want)
    want = theirs(x, memory, memory, key_padding_mask=pad, need_weights=False)[0]
    assert_close(batch_first(ours(batch_first(x), batch_first(memory), mask=mask)), want)
    want = theirs(x, memory, value, key_padding_mask=pad, need_weights=False)[0]
    got = ours(batch_first(x), batch_first(memory), batch_first(value), mask=mask)
    assert_close(batch_first(got), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_multihead_in_half_precision_equals_torch_in_float64(dtype: torch.dtype) -> None:
    """torch's test_multihead_attention_dtype: the module in float16/bfloat16 (its parameters
    rounded) against torch's in float64 on the same rounded parameters and inputs."""
    theirs, ours = _module_pair(MODULES["all"])
    ours = ours.to(dtype)
    theirs.load_state_dict({n: p.to(dtype).double() for n, p in theirs.state_dict().items()})
    x, key, value = _qkv((B, 5, E), (B, 7, 6), (B, 7, 10), dtype=dtype, seed=35)
    _, pad = _torch_masks(None, True, torch.bool, 36, 5, 7)
    mask, _ = from_torch_masks(None, pad, num_heads=NH, dtype=dtype)
    got, got_w = ours(x, key, value, mask=mask, need_weights=True)
    want, want_w = theirs(x.double(), key.double(), value.double(), key_padding_mask=pad)
    assert got.dtype == dtype
    assert_close(got, want)
    assert_close(got_w, want_w, dtype=dtype)


def test_multihead_gradients_equal_torch() -> None:
    """Gradients of the inputs and of every parameter, torch's names for torch's tensors."""
    theirs, ours = _module_pair(MODULES["all"])
    x, key, value = _qkv((B, 5, E), (B, 7, 6), (B, 7, 10), dtype=F64, seed=37)
    attn_mask, pad = _torch_masks(2, True, torch.bool, 38, 5, 7)
    mask, _ = from_torch_masks(attn_mask, pad, num_heads=NH)
    inputs = [t.requires_grad_() for t in (x, key, value)]
    want = theirs(*inputs, attn_mask=attn_mask, key_padding_mask=pad, need_weights=False)[0]
    theirs_grads = torch.autograd.grad(want.square().sum(), [*inputs, *theirs.parameters()])
    got = ours(*inputs, mask=mask)
    ours_grads = torch.autograd.grad(got.square().sum(), [*inputs, *ours.parameters()])
    assert [n for n, _ in theirs.named_parameters()] == [n for n, _ in ours.named_parameters()]
    for g, w in zip(ours_grads, theirs_grads, strict=True):
        assert_close(g, w)


@pytest.mark.parametrize(("batch", "tq", "tk"), [(0, 3, 4), (2, 0, 4), (2, 3, 0)])
def test_multihead_with_empty_dims(batch: int, tq: int, tk: int) -> None:
    """An empty batch, no queries, or no keys: torch's output (with no keys every query attends
    nothing and gets the output projection's bias)."""
    theirs, ours = _module_pair(MODULES["plain"])
    x, memory = _qkv((batch, tq, E), (batch, tk, E), dtype=F64, seed=39)
    got = ours(x, memory)
    assert_close(got, theirs(x, memory, memory, need_weights=False)[0])
    if tk == 0:
        assert_close(got, theirs.out_proj.bias.expand(batch, tq, E))


def test_to_torch_and_back_compute_the_same() -> None:
    """to_torch of a module with kdim/vdim and both extra tokens, batch_first=False: torch's
    module computes what it computes, and from_torch of that is the module again."""
    torch.manual_seed(40)
    ours = MultiHeadAttention(E, NH, kdim=6, vdim=10, add_bias_kv=True, add_zero_attn=True)
    ours = ours.double().eval()
    theirs = to_torch(ours, batch_first=False)
    x, key, value = _qkv((6, B, E), (8, B, 6), (8, B, 10), dtype=F64, seed=41)
    want = theirs(x, key, value, need_weights=False)[0]
    for module in (ours, from_torch(theirs, batch_first=True)):
        got = module(x.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1))
        assert_close(got.transpose(0, 1), want)


def test_compiled_module_equals_torch() -> None:
    theirs, ours = _module_pair(MODULES["all"])
    x, key, value = _qkv((B, 5, E), (B, 7, 6), (B, 7, 10), dtype=F64, seed=42)
    _, pad = _torch_masks(None, True, torch.bool, 43, 5, 7)
    mask, _ = from_torch_masks(None, pad, num_heads=NH)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x, k, v: ours(x, k, v, mask=mask, need_weights=True),
        backend="aot_eager",
        fullgraph=True,
    )
    got, got_w = compiled(x, key, value)
    want, want_w = theirs(x, key, value, key_padding_mask=pad)
    assert_close(got, want)
    assert_close(got_w, want_w)


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_layers_equal_torch(norm_first: bool) -> None:
    """from_torch of torch's encoder and decoder layers (post- and pre-norm), eval: a bool
    src_mask with src_key_padding_mask, causal self-attention (torch's float causal mask with
    is_causal), and the decoder's causal self-attention with memory padding."""
    torch.manual_seed(44)
    encoder = nn.TransformerEncoderLayer(
        E, NH, 24, activation="gelu", norm_first=norm_first, batch_first=True
    )
    decoder = nn.TransformerDecoderLayer(E, NH, 24, norm_first=norm_first, batch_first=True)
    encoder, decoder = encoder.double().eval(), decoder.double().eval()
    ours_enc, ours_dec = from_torch(encoder), from_torch(decoder)
    x, memory = _qkv((B, 6, E), (B, 8, E), dtype=F64, seed=45)
    src_mask, pad = _torch_masks(2, True, torch.bool, 46, 6, 6)
    pad[:, 0] = False  # (torch's fast path gives padded rows other numbers; see below)
    mask, _ = from_torch_masks(src_mask, pad, num_heads=NH)
    with torch.no_grad():
        want = encoder(x, src_mask=src_mask, src_key_padding_mask=pad)
        rows = torch.isfinite(want).all(-1)
        assert_close(ours_enc(x, mask=mask)[rows], want[rows])
        causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=F64)
        assert_close(ours_enc(x, causal=True), encoder(x, src_mask=causal, is_causal=True))
        _, memory_pad = _torch_masks(None, True, torch.bool, 47, 6, 8)
        memory_pad[:, 0] = False
        memory_mask, _ = from_torch_masks(None, memory_pad, num_heads=NH)
        want = decoder(
            x, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=memory_pad
        )
        assert_close(ours_dec(x, memory, causal=True, memory_mask=memory_mask), want)


def test_transformer_layers_take_torchs_float_masks_as_a_bias() -> None:
    """torch's layers take float masks (added to the scores) as well as bool ones; from_torch_masks
    turns them into a bias, which the converted layers take: ``bias=`` for the self-attention and
    the decoder's ``memory_bias=`` for the cross-attention. (torch's answer is its layer's own
    path with gradients: its inference fast path, under no_grad, reads such a mask otherwise.)"""
    torch.manual_seed(48)
    encoder = nn.TransformerEncoderLayer(E, NH, 24, batch_first=True).double().eval()
    decoder = nn.TransformerDecoderLayer(E, NH, 24, batch_first=True).double().eval()
    ours_enc, ours_dec = from_torch(encoder), from_torch(decoder)
    x, memory = _qkv((B, 6, E), (B, 8, E), dtype=F64, seed=49)
    src_mask, pad = _torch_masks(2, True, F64, 50, 6, 6)
    src_mask[:, 0] = pad[:, 0] = 0.0  # (every query sees a key: torch's rows are all finite)
    mask, bias = from_torch_masks(src_mask, pad, num_heads=NH, dtype=F64)
    assert mask is None
    assert bias is not None
    leaf, exact = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = encoder(exact, src_mask=src_mask, src_key_padding_mask=pad)
    got = ours_enc(leaf, bias=bias)
    assert_close(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    assert_close(leaf.grad, exact.grad)
    for ours_p, theirs_p in zip(ours_enc.parameters(), encoder.parameters(), strict=True):
        assert_close(ours_p.grad, theirs_p.grad)
    memory_mask, memory_pad = _torch_masks(2, True, F64, 51, 6, 8)
    memory_mask[:, 0] = memory_pad[:, 0] = 0.0
    _, memory_bias = from_torch_masks(memory_mask, memory_pad, num_heads=NH, dtype=F64)
    _, self_bias = from_torch_masks(src_mask, None, num_heads=NH, dtype=F64)
    want = decoder(
        x, memory, tgt_mask=src_mask, memory_mask=memory_mask, memory_key_padding_mask=memory_pad
    )
    got = ours_dec(x, memory, bias=self_bias, memory_bias=memory_bias, causal=False)
    assert_close(got, want)
