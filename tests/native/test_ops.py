"""The native kernel's operators: schemas, fake kernels and autograd that torch's own checker
(``torch.library.opcheck``) accepts over a grid of calls, results equal to the float64 reference
when called directly, and arguments that a user can get wrong refused with an error."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

from attnkit import _native, attention, masks, scores
from attnkit._kernel.call import native_arguments, plan_call
from attnkit.testing import assert_close

pytestmark = pytest.mark.skipif(not _native.load(), reason=f"native kernel: {_native.status()[1]}")

MASKS = {
    "none": lambda: None,
    "causal": lambda: masks.causal(),
    "window": lambda: masks.sliding_window(6, 2),
    "padding": lambda: masks.key_padding([11, 3]),
    "documents": lambda: masks.documents([[5, 6], [11]]),
    "tiles": lambda: masks.from_fn(lambda b, h, i, j: (i + j) % 3 != 0),
}


def _call(
    mask: str,
    dtype: torch.dtype,
    *,
    gqa: bool = False,
    tq: int = 9,
    bias: bool = False,
    softcap: float | None = None,
    dropout: float = 0.0,
    term: str | None = None,
    dv: int = 8,
) -> tuple[tuple[object, ...], dict[str, object]]:
    """The operator's arguments for one call (B=2, H=4, Tk=11, Dk=8, Dv=dv), its inputs needing
    gradients."""
    g = torch.Generator().manual_seed(hash((mask, gqa, tq, bias, term)) % 1000)
    hkv = 2 if gqa else 4
    q = torch.randn(2, 4, tq, 8, generator=g, dtype=dtype)
    k, v = (torch.randn(2, hkv, 11, d, generator=g, dtype=dtype) for d in (8, dv))
    dense = torch.randn(2, 4, tq, 11, generator=g, dtype=dtype) if bias else None
    added: torch.Tensor | scores.ScoreTerm | None = dense
    term_inputs: tuple[torch.Tensor, ...] = ()
    if term == "position":
        qv = torch.randn(2, 4, tq, 8, generator=g, dtype=dtype)
        enc = torch.randn(4, tq + 11 - 1, 8, generator=g, dtype=dtype)
        added = scores.RelativePositionTerm(qv, enc, 0.3)
        term_inputs = (qv, enc)
    elif term == "distance":
        table = torch.randn(4, tq + 11 - 1, generator=g, dtype=dtype)
        added = scores.DistanceBias(table, first=-(11 - 1))
        term_inputs = (table,)
    spec, _, _ = plan_call(
        q,
        k,
        v,
        mask=MASKS[mask](),
        bias=added,
        scale=0.35,
        softcap=softcap,
        block_q=4,
        block_k=8,
        dropout_p=dropout,
        seed=1234 if dropout else None,
    )
    args, kwargs = native_arguments(spec, q, k, v, dense, term_inputs)
    args = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
    return args, kwargs


def _backward(
    args: tuple[object, ...],
    kwargs: dict[str, object],
    out: tuple[torch.Tensor, torch.Tensor],
    dout: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """native_backward's (dq, dk, dv) for ``dout``, from native_forward's ``(out, lse)``, as the
    kernel's backward phase calls it."""
    lse = out[1]
    delta = (dout * out[0]).sum(-1)
    dq, dk, dv, *_ = torch.ops.attnkit.native_backward(dout, lse, delta, *args, **kwargs)
    return dq, dk, dv


CASES = [
    *(
        pytest.param(m, d, {}, id=f"{m}-{str(d)[6:]}")
        for m, d in itertools.product(MASKS, (torch.float32, torch.float64))
    ),
    pytest.param("causal", torch.float32, {"gqa": True}, id="gqa"),
    pytest.param("causal", torch.float32, {"tq": 5}, id="tq<tk"),
    pytest.param("window", torch.float64, {"bias": True}, id="bias"),
    pytest.param("padding", torch.float32, {"softcap": 4.0}, id="softcap"),
    pytest.param("documents", torch.float64, {"dropout": 0.25}, id="dropout"),
    pytest.param("causal", torch.float64, {"term": "position"}, id="position"),
    pytest.param("window", torch.float32, {"term": "position", "gqa": True}, id="position-gqa"),
    pytest.param("none", torch.float64, {"term": "distance"}, id="distance-bias"),
    pytest.param("padding", torch.float32, {"term": "distance", "softcap": 3.0}, id="alibi-like"),
]
# Values of another size than the queries and keys (Dv != Dk): the fake kernels give the output
# and the gradients their sizes from v, not q.
VALUE_SIZES = [
    pytest.param("window", torch.float64, {"dv": 5}, id="dv<dk"),
    pytest.param("padding", torch.float32, {"dv": 13, "gqa": True}, id="dv>dk-gqa"),
    pytest.param("causal", torch.float64, {"dv": 3, "bias": True}, id="dv-bias"),
    pytest.param("window", torch.float32, {"dv": 6, "term": "position"}, id="dv-position"),
]


@pytest.mark.parametrize(("mask", "dtype", "kw"), CASES + VALUE_SIZES)
def test_opcheck_native_forward(mask: str, dtype: torch.dtype, kw: dict[str, object]) -> None:
    args, kwargs = _call(mask, dtype, **kw)  # type: ignore[arg-type]
    torch.library.opcheck(torch.ops.attnkit.native_forward.default, args, kwargs)


@pytest.mark.parametrize(("mask", "dtype", "kw"), CASES[::3] + VALUE_SIZES)
def test_opcheck_native_backward(mask: str, dtype: torch.dtype, kw: dict[str, object]) -> None:
    args, kwargs = _call(mask, dtype, **kw)  # type: ignore[arg-type]
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    out, lse = torch.ops.attnkit.native_forward(*args, **kwargs)
    dout = torch.randn_like(out)
    delta = (dout * out).sum(-1)
    position = args[8] is not None
    flags = {"bias_grad": args[5] is not None, "qv_grad": position, "enc_grad": position}
    torch.library.opcheck(
        torch.ops.attnkit.native_backward.default, (dout, lse, delta, *args), {**kwargs, **flags}
    )


@pytest.mark.parametrize(
    ("mask", "kw"),
    [
        ("causal", {}),
        ("padding", {}),
        ("tiles", {}),
        ("window", {"bias": True}),
        ("causal", {"term": "position", "gqa": True}),
    ],
)
def test_bfloat16_queries_give_the_rounded_output_and_a_float32_lse(
    mask: str, kw: dict[str, object]
) -> None:
    # bfloat16 queries with bfloat16 keys and values (what an inference call passes): the output
    # in bfloat16, equal to the same call's with the queries in float32 rounded; lse the same,
    # in float32 (as the bias and the position term's inputs); the operator checks out on them.
    args, kwargs = _call(mask, torch.bfloat16, **kw)  # type: ignore[arg-type]
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    assert args[0].dtype == torch.float32
    assert args[1].dtype == torch.bfloat16
    out32, lse32 = torch.ops.attnkit.native_forward(*args, **kwargs)
    q16 = args[0].bfloat16()  # type: ignore[union-attr]
    out16, lse16 = torch.ops.attnkit.native_forward(q16, *args[1:], **kwargs)
    assert out16.dtype == torch.bfloat16
    assert lse16.dtype == torch.float32
    assert torch.equal(out16, out32.bfloat16())
    assert torch.equal(lse16, lse32)
    torch.library.opcheck(torch.ops.attnkit.native_forward.default, (q16, *args[1:]), kwargs)


def test_bfloat16_queries_need_bfloat16_keys_and_values() -> None:
    args, kwargs = _plain()
    with pytest.raises(RuntimeError, match="bfloat16 queries take bfloat16 keys and values"):
        torch.ops.attnkit.native_forward(args[0].bfloat16(), *args[1:], **kwargs)  # type: ignore[union-attr]


PLAIN = [c for c in CASES if not {"dropout", "term"} & set(c.values[2])]  # type: ignore[arg-type]
PLAIN_VALUE_SIZES = [c for c in VALUE_SIZES if "term" not in c.values[2]]  # type: ignore[operator]


@pytest.mark.parametrize(("mask", "dtype", "kw"), PLAIN[::2] + PLAIN_VALUE_SIZES)
def test_the_operators_gradients_equal_the_reference(
    mask: str, dtype: torch.dtype, kw: dict[str, object]
) -> None:
    # The operators called directly, the backward with the forward's log-sum-exp and
    # rowsum(dO * O), against attention()'s reference on the same call (layouts: q (N, Hkv, G,
    # Tq, D), k and v (N, Hkv, Tk, D)).
    args, kwargs = _call(mask, dtype, **kw)  # type: ignore[arg-type]
    q5, k4, v4 = args[:3]
    out, lse = torch.ops.attnkit.native_forward(*args, **kwargs)
    cot = torch.randn_like(out)
    grads = _backward(args, kwargs, (out, lse), cot)
    q = q5.detach().flatten(1, 2).double().requires_grad_()  # type: ignore[union-attr]
    k, v = (t.detach().double().requires_grad_() for t in (k4, v4))  # type: ignore[union-attr]
    bias = None if args[5] is None else args[5].detach().flatten(1, 2).double()  # type: ignore[union-attr]
    want = attention(
        q,
        k,
        v,
        mask=MASKS[mask](),
        bias=bias,
        scale=0.35,
        softcap=kw.get("softcap"),  # type: ignore[arg-type]
        backend="reference",
    )
    wants = torch.autograd.grad(want, (q, k, v), cot.flatten(1, 2).double())
    assert_close(out.flatten(1, 2), want, dtype=dtype)
    for got, ref in zip(grads, wants, strict=True):
        assert_close(got.reshape(ref.shape), ref, dtype=dtype)


@pytest.mark.parametrize(("mask", "dtype", "kw"), PLAIN_VALUE_SIZES)
def test_compiled_operators_with_values_of_another_size_equal_the_reference(
    mask: str, dtype: torch.dtype, kw: dict[str, object]
) -> None:
    # native_forward and native_backward in one graph (fullgraph, traced from the fake kernels),
    # between products that read the output's last size and dout's: Dv, not Dk.
    args, kwargs = _call(mask, dtype, **kw)  # type: ignore[arg-type]
    q5, k4, v4 = args[:3]
    dv = v4.size(-1)  # type: ignore[union-attr]
    w = torch.randn(dv, 3, generator=torch.Generator().manual_seed(dv), dtype=dtype)
    cot = torch.randn(
        (*q5.shape[:-1], 3),
        generator=torch.Generator().manual_seed(1),
        dtype=dtype,  # type: ignore[union-attr]
    )

    def f(q5: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rest = (q5, k4, v4, *args[3:])
        out, lse = torch.ops.attnkit.native_forward(*rest, **kwargs)
        return (out @ w, *_backward(rest, kwargs, (out, lse), cot @ w.T))

    torch._dynamo.reset()
    try:
        got, *grads = torch.compile(f, backend="aot_eager", fullgraph=True)(q5, k4, v4)
    finally:
        torch._dynamo.reset()
    q = q5.detach().flatten(1, 2).double().requires_grad_()  # type: ignore[union-attr]
    k, v = (t.detach().double().requires_grad_() for t in (k4, v4))  # type: ignore[union-attr]
    bias = None if args[5] is None else args[5].detach().flatten(1, 2).double()  # type: ignore[union-attr]
    out = attention(q, k, v, mask=MASKS[mask](), bias=bias, scale=0.35, backend="reference")
    want = out @ w.double()
    wants = torch.autograd.grad(want, (q, k, v), cot.flatten(1, 2).double())
    assert_close(got.flatten(1, 2), want, dtype=dtype)
    for a, ref in zip(grads, wants, strict=True):
        assert_close(a.reshape(ref.shape), ref, dtype=dtype)


@pytest.mark.parametrize("paged", [False, True])
def test_opcheck_native_cache_forward_with_values_of_another_size(paged: bool) -> None:
    # Rows of a cache (contiguous, one page per row; or pages of 8 keys through a block table),
    # values of 5 numbers to keys of 8.
    g = torch.Generator().manual_seed(6)
    q5 = torch.randn(2, 2, 2, 3, 8, generator=g)
    if paged:
        k, v = (torch.randn(7, 2, 8, d, generator=g) for d in (8, 5))
        table = torch.tensor([[3, 0, 5], [6, 1, 2]])
    else:
        k, v = (torch.randn(2, 2, 24, d, generator=g) for d in (8, 5))
        table = None
    ranges = torch.tensor([[0, 24], [5, 19]])
    args = (q5, k, v, table, ranges, None, None, None)
    kwargs = {"scale": 0.3, "band": [-9.0, 2.0], "softcap": 2.0}
    out, _ = torch.ops.attnkit.native_cache_forward(*args, **kwargs)
    assert out.shape == (2, 2, 2, 3, 5)
    torch.library.opcheck(torch.ops.attnkit.native_cache_forward.default, args, kwargs)


def test_settings_are_arguments_and_change_no_result() -> None:
    args, kwargs = _call("window", torch.float32, term="position")
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    base, _ = torch.ops.attnkit.native_forward(*args, **kwargs)
    for tiles, skew in ((False, False), (True, False), (False, True)):
        other, _ = torch.ops.attnkit.native_forward(
            *args, **{**kwargs, "register_tiles": tiles, "skewed_position": skew}
        )
        assert_close(other, base, dtype=torch.float32)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_query_ordering_changes_no_bit(dropout: float) -> None:
    # Stretches of query blocks order the forward's items, every head of a stretch before the
    # next; each item computes what it computes in any order, to the bit (dropout included).
    args, kwargs = _call("window", torch.float32, term="position", tq=23, dropout=dropout)
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    base, base_lse = torch.ops.attnkit.native_forward(*args, **{**kwargs, "stretch": 0})
    for stretch in (1, 2, 4, 5, 6, 100):  # 6 query blocks of 4
        out, lse = torch.ops.attnkit.native_forward(*args, **{**kwargs, "stretch": stretch})
        assert torch.equal(out, base)
        assert torch.equal(lse, base_lse)


def _plain() -> tuple[tuple[torch.Tensor, ...], dict[str, object]]:
    args, kwargs = _call("causal", torch.float32)
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args), kwargs  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda a, k: ((*a[:4], a[4][:-1], *a[5:]), k), "offsets run from"),
        (lambda a, k: ((*a[:4], a[4] * 1000, *a[5:]), k), "lies outside query block"),
        (lambda a, k: ((*a[:3], a[3][:-1], *a[4:]), k), "query blocks, but the plan's offsets"),
        (lambda a, k: ((*a[:3], a[3].int(), *a[4:]), k), "contiguous int64 offsets"),
        (lambda a, k: (a, {**k, "block_q": 0}), "block sizes must be positive"),
        (lambda a, k: (a, {**k, "stretch": -1}), "stretch must be >= 0 query blocks, got -1"),
        (lambda a, k: ((*a[:1], a[1][:, :1], *a[2:]), k), "do not fit together"),
        (lambda a, k: ((*a[:2], a[2].double(), *a[3:]), k), "k and v must have q's dtype"),
        (lambda a, k: (a, {**k, "dropout_p": 1.5}), "dropout_p must be in [0, 1)"),
        (lambda a, k: (a, {**k, "band": [1.0]}), "band is [lo, hi]"),
        (
            lambda a, k: ((*a[:6], torch.ones(1, 3, dtype=torch.uint8), *a[7:]), k),
            "key_ok must be contiguous uint8",
        ),
        (
            lambda a, k: ((*a[:5], torch.zeros(2, 2, 2, 9, 3), *a[6:]), k),
            "does not broadcast",
        ),
    ],
)
def test_a_wrong_argument_is_refused_not_followed(edit: object, words: str) -> None:
    args, kwargs = edit(*_plain())  # type: ignore[operator]
    with pytest.raises(RuntimeError, match=re.escape(words)):
        torch.ops.attnkit.native_forward(*args, **kwargs)


def test_all_finite_finds_a_bad_element_and_refuses_other_dtypes() -> None:
    x = torch.randn(3, 5, 7)
    assert torch.ops.attnkit.all_finite([x, x.double()])
    x[2, 4, 6] = float("nan")
    assert not torch.ops.attnkit.all_finite([torch.ones(2), x])
    y = x.to(torch.bfloat16)
    assert not torch.ops.attnkit.all_finite([y])
    assert not torch.ops.attnkit.all_finite([x.half()])
    y[2, 4, 6] = 3.0
    assert torch.ops.attnkit.all_finite([y, y.half()])
    with pytest.raises(RuntimeError, match="float32, float64, bfloat16 or float16"):
        torch.ops.attnkit.all_finite([torch.ones(2, dtype=torch.int64)])


def test_an_inference_call_skips_the_operators_autograd_layer_only_without_a_graph() -> None:
    """no_graph hands a call straight to the kernel exactly when nothing records a graph: grad
    mode off, or no input requiring grad; never while a functorch transform is active."""
    from attnkit._native.ops import no_graph

    below = type(torch._C._AutoDispatchBelowAutograd())
    plain, leaf = torch.randn(3), torch.randn(3, requires_grad=True)
    assert isinstance(no_graph((plain, None)), below)
    assert not isinstance(no_graph((plain, leaf)), below)
    with torch.no_grad():
        assert isinstance(no_graph((plain, leaf)), below)

    seen: list[bool] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(isinstance(no_graph((plain,)), below))
        return x.sum()

    torch.func.grad(probe)(torch.randn(3))
    torch.func.vmap(probe)(torch.randn(2, 3))
    assert seen == [False, False]


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad", "plain inputs"])
def test_a_decode_call_without_a_graph_equals_the_graph_call(grad_mode: str) -> None:
    """The same decode step with and without gradients: the same output and log-sum-exp (the
    call that records no graph runs the operator below autograd, and hands back its lse as a
    view); the graph call's gradients still reach q, k and v."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 2, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 40, 16, generator=g, dtype=torch.float64) for _ in range(2))
    mask = masks.sliding_window(9, 0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out_g, lse_g = attention(*leaves, mask=mask, return_lse=True, backend="chunked")
    (out_g.sum() + lse_g.sum()).backward()
    context = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}.get(grad_mode)
    with context() if context is not None else torch.enable_grad():
        out, lse = attention(q, k, v, mask=mask, return_lse=True, backend="chunked")
    assert not out.requires_grad
    assert not lse.requires_grad
    assert torch.equal(out, out_g.detach())
    assert torch.equal(lse, lse_g.detach())
    ref_out, ref_lse = attention(q, k, v, mask=mask, return_lse=True, backend="reference")
    assert_close(out, ref_out)
    assert_close(lse, ref_lse)
    assert all(t.grad is not None and bool(t.grad.abs().sum() > 0) for t in leaves)


def _gathered_call(
    dtype: torch.dtype, *, heads: int = 1, key_ok: bool = False, band: bool = False
) -> tuple[tuple[object, ...], dict[str, object]]:
    """gathered_forward's arguments: 4 query heads on 2 key/value heads, ``heads`` selections
    of 6 sorted keys (with -1 and a repeat) among 20."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 7, 16, generator=g)
    k, v = (torch.randn(2, 2, 20, d, generator=g).to(dtype) for d in (16, 8))
    keys = torch.randint(-1, 20, (2, heads, 7, 6), generator=g)
    keys[..., 1] = keys[..., 0]
    ok = torch.rand(2, 20, generator=g) > 0.3 if key_ok else None
    kwargs = {"scale": 0.4, "softcap": 0.0, "band": [-math.inf, 0.0, 13.0] if band else []}
    return (q, k, v, keys.sort(-1).values, ok), kwargs


GATHERED = [
    (torch.float32, {}),
    (torch.float32, {"heads": 2, "key_ok": True, "band": True}),
    (torch.bfloat16, {"heads": 4, "band": True}),
    (torch.float16, {"key_ok": True}),
]


@pytest.mark.parametrize(("dtype", "kw"), GATHERED)
def test_opcheck_gathered_forward_and_backward(dtype: torch.dtype, kw: dict[str, object]) -> None:
    args, kwargs = _gathered_call(dtype, **kw)  # type: ignore[arg-type]
    torch.library.opcheck(torch.ops.attnkit.gathered_forward.default, args, kwargs)
    out, lse = torch.ops.attnkit.gathered_forward(*args, **kwargs)
    dout = torch.randn_like(out)
    delta = (dout * out).sum(-1)
    q, k, v, keys, ok = args
    torch.library.opcheck(
        torch.ops.attnkit.gathered_backward.default,
        (dout, q, k, v, keys, lse, delta, ok),
        kwargs,
    )


def _gathered_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    ok: torch.Tensor | None,
    scale: float,
    softcap: float,
    band: list[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """gathered_forward's ``(out, lse)`` in float64, from its definition: query t of head h
    attends the distinct keys its selection row names (not -1) that lie in every band and that
    ``ok`` keeps, through a dense (Tq, Tk) mask."""
    b, h, tq, _ = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    sel = keys.expand(b, -1, -1, -1).repeat_interleave(h // keys.shape[1], dim=1)
    allowed = torch.zeros(b, h, tq, tk + 1, dtype=torch.bool)
    allowed.scatter_(-1, sel.clamp(min=-1) % (tk + 1), True)  # -1 lands in the extra column
    allowed = allowed[..., :tk]
    i, j = torch.arange(tq).view(tq, 1), torch.arange(tk).view(1, tk)
    for lo, hi, offset in zip(band[::3], band[1::3], band[2::3], strict=True):
        allowed &= (j - (i + offset) >= lo) & (j - (i + offset) <= hi)
    if ok is not None:
        allowed &= ok.view(ok.shape[0], 1, 1, tk)
    kk, vv = (t.double().repeat_interleave(h // hkv, dim=1) for t in (k, v))
    s = scale * q.double() @ kk.transpose(-1, -2)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)
    weights = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return weights @ vv.double(), lse


@pytest.mark.parametrize("span", [0, 7, 32])
@pytest.mark.parametrize(
    ("dtype", "heads", "softcap"),
    [(torch.float32, 1, 0.0), (torch.float32, 2, 2.5), (torch.bfloat16, 1, 0.0)],
)
def test_gathered_forward_in_stretches_equals_its_definition(
    span: int, dtype: torch.dtype, heads: int, softcap: float
) -> None:
    # Rows of 64 (the unrolled loops) and more selected keys per query than one piece of the
    # forward holds, walked in stretches of `span` keys (0: the kernel's own) whose pieces run
    # past a stretch's end; enough queries that the kernel lays each key's heads side by side.
    g = torch.Generator().manual_seed(21)
    q = torch.randn(2, 4, 24, 64, generator=g)
    k, v = (torch.randn(2, 2, 96, 64, generator=g).to(dtype) for _ in range(2))
    keys = torch.randint(-1, 96, (2, heads, 24, 40), generator=g)
    keys[..., 1] = keys[..., 0]
    keys[0, 0, 3] = -1  # a query with no key
    keys = keys.sort(-1).values
    ok = torch.rand(2, 96, generator=g) > 0.2
    kwargs = {"scale": 0.2, "softcap": softcap, "band": [-math.inf, 0.0, 70.0]}
    out, lse = torch.ops.attnkit.gathered_forward(q, k, v, keys, ok, span=span, **kwargs)
    want, want_lse = _gathered_reference(q, k, v, keys, ok, **kwargs)  # type: ignore[arg-type]
    assert torch.equal(lse == -math.inf, want_lse == -math.inf)
    assert bool((want_lse == -math.inf).any())
    finite = want_lse > -math.inf
    assert_close(out, want.float(), dtype=torch.float32)
    assert_close(lse[finite], want_lse[finite].float(), dtype=torch.float32)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_gathered_forward_of_one_query_splits_its_heads_among_threads(threads: int) -> None:
    # A decode step: one query, one selection head for 8 query heads of 8 key/value heads. With
    # more threads than blocks, the heads are cut into parts, one an item: same numbers.
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 8, 1, 64, generator=g)
    k, v = (torch.randn(1, 8, 300, 64, generator=g) for _ in range(2))
    keys = torch.randint(-1, 300, (1, 1, 1, 48), generator=g).sort(-1).values
    kwargs = {"scale": 0.125, "softcap": 0.0, "band": []}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = torch.ops.attnkit.gathered_forward(q, k, v, keys, None, span=0, **kwargs)
    finally:
        torch.set_num_threads(before)
    want, want_lse = _gathered_reference(q, k, v, keys, None, **kwargs)  # type: ignore[arg-type]
    assert_close(out, want.float(), dtype=torch.float32)
    assert_close(lse, want_lse.float(), dtype=torch.float32)


def test_gathered_operators_refuse_what_they_cannot_read() -> None:
    (q, k, v, keys, ok), kwargs = _gathered_call(torch.float32)
    with pytest.raises(RuntimeError, match="q in float32"):
        torch.ops.attnkit.gathered_forward(q.double(), k, v, keys, ok, **kwargs)
    with pytest.raises(RuntimeError, match="keys in int64"):
        torch.ops.attnkit.gathered_forward(q, k, v, keys.int(), ok, **kwargs)
    with pytest.raises(RuntimeError, match="selection heads must divide H = 4"):
        torch.ops.attnkit.gathered_forward(q, k, v, keys.expand(2, 3, 7, 6), ok, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_forward_reads_values_that_are_a_view_of_the_keys(dtype: torch.dtype) -> None:
    # A latent cache's values are the first columns of its keys' rows (strided rows): the forward
    # reads them in place, with the results of the same values made contiguous, and opcheck holds.
    (q, k, _, keys, ok), kwargs = _gathered_call(dtype)
    v = k[..., :8]
    torch.library.opcheck(torch.ops.attnkit.gathered_forward.default, (q, k, v, keys, ok), kwargs)
    out, lse = torch.ops.attnkit.gathered_forward(q, k, v, keys, ok, **kwargs)
    want, want_lse = torch.ops.attnkit.gathered_forward(q, k, v.contiguous(), keys, ok, **kwargs)
    assert torch.equal(out, want)
    assert torch.equal(lse, want_lse)


def test_vmap_over_the_kernels_calls_them_per_example_without_torch_warning(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # torch.vmap over inference calls the native kernel's decode path serves (a per-example
    # evaluation): each example's call, stacked, equal to a loop over examples; vmapped dims
    # anywhere, on some inputs only, nested, or of size 0; torch's fallback for operators without
    # a rule would print a warning of a missing batching rule (to the process's stderr), and
    # fails on a vmapped dim of size 0.
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 4, 8, generator=g)
    k = torch.randn(5, 2, 3, 6, 8, generator=g)
    with torch.inference_mode(False), torch.no_grad():
        got = torch.vmap(lambda kk: attention(q, kk, kk, causal=True))(k)
        want = torch.stack([attention(q, kk, kk, causal=True, backend="reference") for kk in k])
        assert_close(got, want, dtype=torch.float32)
        xs = torch.randn(2, 3, 4, 1, 5, 8, generator=g)
        got2, lse = torch.vmap(
            torch.vmap(lambda t: attention(t, t, t, return_lse=True), in_dims=1), in_dims=2
        )(xs)
        for i, j in itertools.product(range(4), range(3)):
            x = xs[:, j, i]
            o, ll = attention(x, x, x, return_lse=True, backend="reference")
            assert_close(got2[i, j], o, dtype=torch.float32)
            assert_close(lse[i, j], ll, dtype=torch.float32)
        empty = torch.vmap(lambda t: attention(t, t, t))(torch.randn(0, 1, 2, 5, 8))
        assert empty.shape == (0, 1, 2, 5, 8)
    assert "batching rule" not in capfd.readouterr().err
