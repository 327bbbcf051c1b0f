"""Differential fuzzing: random calls and modules, every backend against the float64 reference.

Hypothesis draws shapes (empty sequences, Tq > Tk with causal), masks (fully masked rows, nothing
visible, padding), biases (with ``-inf`` entries: float masks), scales, layouts, dtypes and module
configurations, and checks that

* every backend agrees with ``reference`` run in float64 on the same rounded inputs and
  parameters, at :data:`attnkit.testing.TOLERANCES`, outputs and gradients;
* finite inputs give finite outputs (and so do ``-inf`` biases: those rows are masked rows);
* every bad argument raises ``ValueError`` or ``TypeError`` whose message names the argument.

``make test`` runs the default profile (60 examples per test); ``HYPOTHESIS_PROFILE=thorough``
runs 1000 per test.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

import attnkit
from attnkit import BackendError, attention, masks
from attnkit.backends import SDPA, Backend, Chunked
from attnkit.testing import assert_close

from ..helpers import attnkit_checks_only
from ..strategies import Case, cases

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
BACKENDS = ["reference", "sdpa", "chunked"]


def small(backend: str, sizes: tuple[int, int]) -> str | Backend:
    """``backend`` with blocks of a few rows, so that small inputs span many blocks ("eager": the
    chunked backend on its eager kernel)."""
    block_q, block_k = sizes
    if backend in ("chunked", "eager"):
        return Chunked(block_q=block_q, block_k=block_k, native=backend == "chunked")
    if backend == "sdpa":
        return SDPA(block_q=block_q)
    return backend


def widened(t: Tensor | None) -> Tensor | None:
    """float64 holding exactly the values of ``t`` (the spec sees what the call saw)."""
    return None if t is None or not t.is_floating_point() else t.double()


blocks = st.tuples(st.integers(1, 7), st.integers(1, 7))


def conditioning(case: Case) -> float:
    """How far the visible logits go beyond the ~16 the tolerances are made for (at least 1)."""
    q, k = case.q.detach().double(), case.k.detach().double()
    k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
    scale = q.size(-1) ** -0.5 if case.scale is None else case.scale
    logits = q @ k.transpose(-1, -2) * scale
    if case.bias is not None:
        logits = logits + case.bias.detach().double()
    visible = logits.isfinite()
    if case.mask is not None:
        visible = visible & case.mask
    if case.causal:
        visible = visible & masks.causal_mask(q.size(-2), k.size(-2))
    largest = float(logits[visible].abs().max()) if visible.any() else 0.0
    return max(1.0, largest / 16)


# --------------------------------------------------------------------------------------------------
# attention(): every backend against the reference


@given(
    case=cases(edges=True),
    dtype=st.sampled_from(DTYPES),
    # "eager": the chunked backend on its eager kernel (Chunked(native=False)).
    backend=st.sampled_from([*BACKENDS, "eager"]),
    sizes=blocks,
    grad=st.booleans(),
)
def test_every_backend_agrees_with_reference(
    case: Case, dtype: torch.dtype, backend: str, sizes: tuple[int, int], grad: bool
) -> None:
    low = case.to(dtype)
    leaves = [low.q, low.k, low.v] + ([] if low.bias is None else [low.bias])
    spec = [t.detach().double() for t in leaves]
    if grad:
        leaves = [t.requires_grad_() for t in leaves]
        spec = [t.requires_grad_() for t in spec]

    def call(tensors: list[Tensor], backend: str | Backend) -> Tensor:
        q, k, v, *bias = tensors
        return attention(
            q,
            k,
            v,
            mask=low.mask,
            bias=bias[0] if bias else None,
            causal=low.causal,
            scale=low.scale,
            backend=backend,
        )

    out = call(leaves, small(backend, sizes))
    want = call(spec, "reference")
    assert out.dtype == dtype
    assert out.isfinite().all(), "finite inputs gave a non-finite output"
    assert_close(out, want, conditioning=conditioning(low))

    if grad:
        cot = torch.randn(
            out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
        )
        got = torch.autograd.grad(out, leaves, cot.to(dtype), materialize_grads=True)
        ref = torch.autograd.grad(want, spec, cot, materialize_grads=True)
        for name, g, r in zip(("q", "k", "v", "bias"), got, ref, strict=False):
            assert g.isfinite().all(), f"non-finite gradient of {name}"
            assert_close(g, r, dtype=dtype, conditioning=conditioning(low))


# --------------------------------------------------------------------------------------------------
# Modules: every backend (and every path of relative attention) against the float64 reference


def randn(gen: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def draw_mask(
    draw: st.DrawFn, gen: torch.Generator, b: int, h: int, tq: int, tk: int
) -> Tensor | None:
    """None, key padding (sequences of length 0 included), or a per-query mask with empty rows."""
    kind = draw(st.sampled_from(["none", "padding", "per query"]))
    if kind == "padding":
        return masks.padding_mask([draw(st.integers(0, tk)) for _ in range(b)], max_len=tk)
    if kind == "per query":
        mask = torch.rand(b, draw(st.sampled_from([1, h])), tq, tk, generator=gen) < 0.7
        if tq:
            mask[..., draw(st.integers(0, tq - 1)), :] = False  # a query that sees nothing
        return mask
    return None


@dataclass
class Call:
    """A module call: positional tensors and keyword arguments, in float64."""

    args: list[Tensor]
    kwargs: dict[str, object]

    def run(self, m: nn.Module, dtype: torch.dtype) -> Tensor | tuple[Tensor, Tensor]:
        """``m`` on the inputs rounded to ``dtype``, then cast to ``m``'s own dtype (float64 for
        the spec: the same values)."""
        own = next(m.parameters()).dtype

        def cast(t: object) -> object:
            if not isinstance(t, Tensor) or not t.is_floating_point():
                return t
            return t.to(dtype).to(own)

        out: Tensor | tuple[Tensor, Tensor] = m(
            *[cast(t) for t in self.args], **{k: cast(v) for k, v in self.kwargs.items()}
        )
        return out

    def but(self, **kwargs: object) -> Call:
        return Call(self.args, {**self.kwargs, **kwargs})


def rounded_pair(m: nn.Module, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """``m`` in ``dtype``, and the float64 copy of those rounded parameters (the spec)."""
    low = copy.deepcopy(m).to(dtype)
    return low, copy.deepcopy(low).double()


def compare(
    low: nn.Module,
    call: Call,
    spec: nn.Module,
    spec_call: Call,
    dtype: torch.dtype,
    grad: bool,
    conditioning: float = 1.0,
) -> None:
    """Outputs (and weights) of ``low`` against ``spec``; with ``grad`` the parameter gradients,
    compared in float32/float64 (half-precision GEMMs round their sums in the backward).
    ``conditioning`` widens the outputs' tolerance (see :func:`attnkit.testing.assert_close`)."""
    with torch.set_grad_enabled(grad):
        got = call.run(low, dtype)
        want = spec_call.run(spec, dtype)
    got_all = got if isinstance(got, tuple) else (got,)
    want_all = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got_all, want_all, strict=True):
        assert g.dtype == dtype
        assert g.isfinite().all(), "finite inputs gave a non-finite output"
        assert_close(g, w, conditioning=conditioning)
    if not grad:
        return
    cot = randn(torch.Generator().manual_seed(1), *got_all[0].shape)
    (got_all[0].double() * cot).sum().backward()
    (want_all[0] * cot).sum().backward()
    for (name, p), q in zip(low.named_parameters(), spec.parameters(), strict=True):
        assert p.grad is not None, name
        assert p.grad.isfinite().all(), name
        if dtype in (torch.float32, torch.float64):
            assert q.grad is not None, name
            assert_close(p.grad, q.grad)


def set_backend(model: nn.Module, backend: str | Backend) -> nn.Module:
    """Every MultiHeadAttention inside ``model`` on ``backend``."""
    for module in model.modules():
        if isinstance(module, attnkit.MultiHeadAttention):
            module.backend = backend
    return model


@given(data=st.data())
def test_multihead_attention_agrees_with_reference(data: st.DataObject) -> None:
    draw = data.draw
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    hkv = draw(st.integers(1, 3))
    h = hkv * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([2, 4, 5]))
    d_model = draw(st.sampled_from([6, 8]))
    cross = draw(st.booleans())
    kdim = draw(st.sampled_from([None, 5])) if cross else None
    vdim = draw(st.sampled_from([None, 3])) if cross else None
    rotary = head_dim % 2 == 0 and draw(st.booleans())
    torch.manual_seed(draw(st.integers(0, 2**16)))
    m = attnkit.MultiHeadAttention(
        d_model,
        h,
        kdim=kdim,
        vdim=vdim,
        head_dim=head_dim,
        v_head_dim=draw(st.sampled_from([None, 3])),
        num_kv_heads=hkv,
        proj_bias=draw(st.booleans()),
        rotary=attnkit.RotaryEmbedding(head_dim) if rotary else None,
    ).eval()
    b, tq = draw(st.integers(1, 2)), draw(st.integers(0, 9))
    tk = draw(st.integers(0, 9)) if cross else tq
    args = [randn(gen, b, tq, d_model)]
    if cross:
        args += [randn(gen, b, tk, kdim or d_model), randn(gen, b, tk, vdim or d_model)]
    backend = draw(st.sampled_from(["auto", *BACKENDS]))
    # Weights asked of a path without them: refused, drawn now and then only (the rest serves).
    refuse = backend in ("sdpa", "chunked") and draw(st.integers(0, 9)) == 0
    need_weights = refuse or (backend in ("auto", "reference") and draw(st.booleans()))
    call = Call(
        args,
        {
            "mask": draw_mask(draw, gen, b, h, tq, tk),
            "bias": randn(gen, draw(st.sampled_from([1, h])), tq, tk)
            if draw(st.booleans())
            else None,
            "causal": draw(st.booleans()),
            "need_weights": need_weights,
            "average_weights": draw(st.booleans()),
        },
    )
    dtype = draw(st.sampled_from(DTYPES))
    low, spec = rounded_pair(m, dtype)
    set_backend(low, small(backend, draw(blocks)))
    set_backend(spec, "reference")
    if refuse:
        with pytest.raises(BackendError, match="weights"):
            call.run(low, dtype)
        return
    compare(low, call, spec, call, dtype, draw(st.booleans()))


@given(data=st.data())
def test_relative_attention_agrees_with_reference(data: st.DataObject) -> None:
    draw = data.draw
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    h = draw(st.integers(1, 3))
    d_model = h * draw(st.sampled_from([2, 3, 4]))
    legacy = draw(st.sampled_from([None, None, "openspeech"]))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    m = attnkit.RelativeMultiHeadAttention(
        d_model, h, legacy=legacy, proj_bias=draw(st.booleans())
    ).eval()
    b, tq = draw(st.integers(1, 2)), draw(st.integers(0, 9))
    tk = tq if legacy else draw(st.integers(0, 9))  # openspeech's shift is self-attention only
    args = [randn(gen, b, tq, d_model)]
    if tk != tq or draw(st.booleans()):
        args.append(randn(gen, b, tk, d_model))
    backend = draw(st.sampled_from(["auto", *BACKENDS]))
    # What a path cannot do it refuses with the reason, never serving the call differently. Such
    # calls are drawn now and then; the others are ones the path serves.
    reasons = {
        "sdpa": ["weights", "without gradients", "score term"],
        "chunked": ["weights"],
    }.get(backend, [])
    refusal = draw(st.sampled_from(reasons)) if reasons and draw(st.integers(0, 9)) == 0 else None
    need_weights = refusal == "weights" or (not reasons and draw(st.booleans()))
    grad = refusal == "without gradients" or (backend != "sdpa" and draw(st.booleans()))
    if refusal == "score term":
        dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    elif backend == "sdpa":
        dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    else:
        dtype = draw(st.sampled_from(DTYPES))
    call = Call(
        args,
        {
            "mask": draw_mask(draw, gen, b, h, tq, tk),
            "causal": draw(st.booleans()),
            "need_weights": need_weights,
            "backend": small(backend, draw(blocks)),
        },
    )
    low, spec = rounded_pair(m, dtype)
    if refusal:
        with pytest.raises(BackendError, match=refusal), torch.set_grad_enabled(grad):
            call.run(low, dtype)
        return
    compare(low, call, spec, call.but(backend="reference"), dtype, grad)


@given(data=st.data())
def test_transformer_layers_agree_with_reference(data: st.DataObject) -> None:
    draw = data.draw
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["encoder layer", "decoder layer", "transformer"]))
    h = draw(st.sampled_from([1, 2]))
    d_model = 4 * h
    options: dict[str, object] = {
        "dropout": 0.0,
        "norm_first": draw(st.booleans()),
        "activation": draw(st.sampled_from(["relu", "gelu", "swiglu"])),
        "num_kv_heads": draw(st.sampled_from([None, 1])),
    }
    torch.manual_seed(draw(st.integers(0, 2**16)))
    b, t, tm = draw(st.integers(1, 2)), draw(st.integers(0, 7)), draw(st.integers(0, 7))
    x, memory = randn(gen, b, t, d_model), randn(gen, b, tm, d_model)
    if kind == "encoder layer":
        m: nn.Module = attnkit.TransformerEncoderLayer(d_model, h, **options)  # type: ignore[arg-type]
        call = Call([x], {"mask": draw_mask(draw, gen, b, h, t, t), "causal": draw(st.booleans())})
    elif kind == "decoder layer":
        m = attnkit.TransformerDecoderLayer(d_model, h, **options)  # type: ignore[arg-type]
        call = Call(
            [x, memory],
            {
                "mask": draw_mask(draw, gen, b, h, t, t),
                "memory_mask": draw_mask(draw, gen, b, h, t, tm),
                "causal": draw(st.booleans()),
            },
        )
    else:
        m = attnkit.Transformer(
            d_model,
            h,
            num_encoder_layers=1,
            num_decoder_layers=1,
            **options,  # type: ignore[arg-type]
        )
        call = Call(
            [memory, x],
            {
                "src_mask": draw_mask(draw, gen, b, h, tm, tm),
                "tgt_mask": draw_mask(draw, gen, b, h, t, t),
                "memory_mask": draw_mask(draw, gen, b, h, t, tm),
            },
        )
    dtype = draw(st.sampled_from(DTYPES))
    low, spec = rounded_pair(m.eval(), dtype)
    set_backend(low, small(draw(st.sampled_from(["auto", *BACKENDS])), draw(blocks)))
    set_backend(spec, "reference")
    # A whole Transformer (an encoder layer, a decoder layer and their final norms) rounds its
    # activations in half precision at about twice the steps of one layer: its outputs get twice a
    # layer's tolerance (with reference attention too, torch's half-precision linear and norm
    # kernels alone exceeded one layer's on CPUs without AVX-512).
    half = dtype in (torch.float16, torch.bfloat16)
    compare(
        low,
        call,
        spec,
        call,
        dtype,
        draw(st.booleans()),
        2.0 if kind == "transformer" and half else 1.0,
    )


# --------------------------------------------------------------------------------------------------
# Bad input: ValueError or TypeError, and the message names the argument


def assert_names(err: pytest.ExceptionInfo[Exception], name: str) -> None:
    message = str(err.value)
    assert re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message), (
        f"the message does not name {name!r}: {message}"
    )


not_a_bool = st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=3))
not_a_number = st.one_of(
    st.none(), st.booleans(), st.text(max_size=3), st.just([1.0]), st.just(torch.tensor(0.5))
)
not_a_tensor = st.one_of(st.none(), st.integers(), st.lists(st.floats(), max_size=3))


@st.composite
def shape_not_broadcasting_to(draw: st.DrawFn, target: tuple[int, ...]) -> tuple[int, ...]:
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=len(target) + 1)))
    ok = len(shape) <= len(target) and all(
        s in (1, t) for s, t in zip(reversed(shape), reversed(target), strict=False)
    )
    if ok:  # make one trailing dim clash
        shape = (*shape[:-1], target[-1] + 1)
    return shape


@st.composite
def bad_attention_calls(draw: st.DrawFn) -> tuple[str, list[object], dict[str, object]]:
    """(the argument at fault, positional arguments, keyword arguments) of an attention() call
    that must be refused. q (2, 4, 5, 8), k and v (2, 2, 6, 8): the scores are (2, 4, 5, 6)."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(2, 4, 5, 8, generator=gen)
    k = torch.randn(2, 2, 6, 8, generator=gen)
    v = torch.randn(2, 2, 6, 8, generator=gen)
    args: list[object] = [q, k, v]
    kwargs: dict[str, object] = {}
    scores = (2, 4, 5, 6)
    arguments = ["q", "k", "v", "mask", "bias", "causal", "scale", "dropout_p", "return_weights"]
    fault = draw(st.sampled_from([*arguments, "backend", "backend that cannot"]))
    position = {"q": 0, "k": 1, "v": 2}.get(fault)
    if position is not None:
        t = args[position]
        assert isinstance(t, Tensor)
        how = draw(st.sampled_from(["not a tensor", "dtype", "dims", "size"]))
        if how == "not a tensor":
            args[position] = draw(st.one_of(not_a_tensor, st.just(t.numpy())))
        elif how == "dtype":
            args[position] = t.to(draw(st.sampled_from([torch.int64, torch.bool, torch.float64])))
        elif how == "dims":
            args[position] = t[(0,) * draw(st.integers(1, 3))]
        else:  # a size that clashes: heads, keys or the q/k size (Tq and Dv may be anything)
            dim = draw(st.sampled_from({"q": [-3, -1], "k": [-3, -2, -1], "v": [-3, -2]}[fault]))
            shape = list(t.shape)
            shape[dim] = shape[dim] + draw(st.integers(1, 3))
            if fault == "q" and dim == -3:
                shape[-3] = draw(st.sampled_from([3, 5, 7]))  # not a multiple of Hkv = 2
            args[position] = torch.randn(shape, generator=gen)
    elif fault == "mask":
        kwargs["mask"] = draw(
            st.one_of(
                not_a_tensor.filter(lambda x: x is not None),
                st.just(torch.ones(scores)),  # float: belongs in bias
                st.just(torch.ones(scores, dtype=torch.int64)),
                shape_not_broadcasting_to(scores).map(lambda s: torch.ones(s, dtype=torch.bool)),
                st.just(torch.ones(scores, dtype=torch.bool, device="meta")),
            )
        )
    elif fault == "bias":
        kwargs["bias"] = draw(
            st.one_of(
                not_a_tensor.filter(lambda x: x is not None),
                st.just(torch.ones(scores, dtype=torch.bool)),
                st.just(torch.ones(scores, dtype=torch.int32)),
                st.just(torch.ones(scores, dtype=torch.float64)),  # not q's dtype
                shape_not_broadcasting_to(scores).map(torch.zeros),
            )
        )
    elif fault in ("causal", "return_weights"):
        kwargs[fault] = draw(not_a_bool)
    elif fault == "scale":
        kwargs["scale"] = draw(
            st.one_of(
                not_a_number.filter(lambda x: x is not None),
                st.sampled_from([math.inf, -math.inf, math.nan]),
            )
        )
    elif fault == "dropout_p":
        kwargs["dropout_p"] = draw(
            st.one_of(
                not_a_number,
                st.floats().filter(lambda p: not 0.0 <= p < 1.0),
                st.integers().filter(lambda p: p != 0),
            )
        )
    elif fault == "backend":
        kwargs["backend"] = draw(
            st.one_of(
                st.none(),
                st.integers(),
                st.text(max_size=8).filter(
                    lambda b: b != "auto" and b not in attnkit.available_backends()
                ),
            )
        )
    else:  # a BackendError (a ValueError) names what the backend lacks
        kwargs.update(backend="chunked", return_weights=True)
        fault = "return_weights"
    return fault, args, kwargs


@given(call=bad_attention_calls())
def test_bad_attention_arguments_are_named(
    call: tuple[str, list[object], dict[str, object]],
) -> None:
    fault, args, kwargs = call
    with attnkit_checks_only():
        with pytest.raises((TypeError, ValueError)) as err:
            attention(*args, **kwargs)  # type: ignore[arg-type]
        assert_names(err, fault)
        if kwargs.get("backend") != "chunked":  # explain() reports what cannot serve, no raise
            with pytest.raises((TypeError, ValueError)) as err:
                attnkit.explain(*args, **kwargs)  # type: ignore[arg-type]
            assert_names(err, fault)


# Constructors and helpers: each argument with a bad value of its kind. Kinds: "int" (>= 1),
# "int0" (>= 0), "bool", "probability", "base" (a number > 1), "eps" (a number > 0), "lengths"
# (a sequence of ints >= 0), or a tuple of the accepted strings. None is valid for optional
# arguments, so it is drawn for required ones only.
BAD_VALUES = {
    "int": st.one_of(st.integers(max_value=0), st.floats(), st.text(max_size=2), st.booleans()),
    "int0": st.one_of(st.integers(max_value=-1), st.floats(), st.text(max_size=2), st.booleans()),
    "bool": st.one_of(st.integers(), st.floats(), st.text(max_size=2)),
    "probability": st.one_of(
        st.floats().filter(lambda p: not 0.0 <= p < 1.0), st.text(max_size=2), st.booleans()
    ),
    "base": st.one_of(st.floats(max_value=1.0), st.text(max_size=2), st.booleans()),
    "eps": st.one_of(st.floats(max_value=0.0), st.text(max_size=2), st.booleans()),
    "lengths": st.one_of(
        st.integers(),
        st.text(min_size=1, max_size=3),
        st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
        st.lists(st.floats(), min_size=1, max_size=3),
        st.just(torch.tensor([1.0, 2.0])),
    ),
}


@dataclass
class Target:
    """A callable, arguments that work, and the kind of each argument the fuzzer may spoil."""

    fn: Callable[..., object]
    valid: dict[str, object]
    kinds: dict[str, str | tuple[str, ...]]
    required: tuple[str, ...] = ()


LAYER_KINDS: dict[str, str | tuple[str, ...]] = {
    "d_model": "int",
    "num_heads": "int",
    "d_ff": "int",
    "dropout": "probability",
    "activation": ("relu", "gelu", "swiglu"),
    "norm_first": "bool",
    "layer_norm_eps": "eps",
    "bias": "bool",
    "num_kv_heads": "int",
}
TARGETS = {
    "MultiHeadAttention": Target(
        attnkit.MultiHeadAttention,
        {"d_model": 8, "num_heads": 2},
        {
            **dict.fromkeys(
                ["d_model", "num_heads", "kdim", "vdim", "head_dim", "v_head_dim", "num_kv_heads"],
                "int",
            ),
            "proj_bias": "bool",
            "dropout": "probability",
        },
        ("d_model", "num_heads"),
    ),
    "RelativeMultiHeadAttention": Target(
        attnkit.RelativeMultiHeadAttention,
        {"d_model": 8, "num_heads": 2},
        {
            "d_model": "int",
            "num_heads": "int",
            "dropout": "probability",
            "proj_bias": "bool",
            "legacy": ("openspeech",),
        },
        ("d_model", "num_heads"),
    ),
    "TransformerEncoderLayer": Target(
        attnkit.TransformerEncoderLayer, {"d_model": 8, "num_heads": 2}, LAYER_KINDS, ("d_model",)
    ),
    "TransformerDecoderLayer": Target(
        attnkit.TransformerDecoderLayer,
        {"d_model": 8, "num_heads": 2},
        {**LAYER_KINDS, "memory_dim": "int"},
        ("d_model",),
    ),
    "Transformer": Target(
        attnkit.Transformer,
        {"d_model": 8, "num_heads": 2, "num_encoder_layers": 1, "num_decoder_layers": 1},
        {**LAYER_KINDS, "num_encoder_layers": "int0", "num_decoder_layers": "int0"},
        ("d_model", "num_heads", "num_encoder_layers", "num_decoder_layers"),
    ),
    "PositionwiseFeedForward": Target(
        attnkit.PositionwiseFeedForward,
        {"d_model": 8, "d_ff": 16},
        {
            "d_model": "int",
            "d_ff": "int",
            "activation": ("relu", "gelu", "swiglu"),
            "dropout": "probability",
            "bias": "bool",
        },
        ("d_model", "d_ff"),
    ),
    "RotaryEmbedding": Target(
        attnkit.RotaryEmbedding, {"head_dim": 8}, {"head_dim": "int", "base": "base"}, ("head_dim",)
    ),
    "SinusoidalPositionalEncoding": Target(
        attnkit.SinusoidalPositionalEncoding,
        {"d_model": 8},
        {"d_model": "int", "base": "base", "dropout": "probability"},
        ("d_model",),
    ),
    "KVCache": Target(
        attnkit.KVCache,
        {"batch_size": 2, "max_len": 8, "num_kv_heads": 2, "head_dim": 4},
        dict.fromkeys(["batch_size", "max_len", "num_kv_heads", "head_dim", "v_head_dim"], "int"),
        ("batch_size", "max_len", "num_kv_heads", "head_dim"),
    ),
    "causal_mask": Target(
        masks.causal_mask, {"q_len": 3}, {"q_len": "int0", "kv_len": "int0"}, ("q_len",)
    ),
    "sliding_window_mask": Target(
        masks.sliding_window_mask,
        {"q_len": 3, "left": 1},
        {"q_len": "int0", "kv_len": "int0", "left": "int0", "right": "int0"},
        ("q_len", "left"),
    ),
    "padding_mask": Target(
        masks.padding_mask,
        {"lengths": [3, 1]},
        {"lengths": "lengths", "max_len": "int0", "side": ("right", "left")},
        ("lengths",),
    ),
    "block_diagonal_mask": Target(
        masks.block_diagonal_mask,
        {"q_lens": [2, 3], "kv_lens": [1, 4]},
        {"q_lens": "lengths", "kv_lens": "lengths"},
        ("q_lens",),
    ),
    "alibi_bias": Target(
        attnkit.alibi_bias,
        {"num_heads": 2, "q_len": 3},
        {"num_heads": "int", "q_len": "int0", "kv_len": "int0"},
        ("num_heads", "q_len"),
    ),
}


@st.composite
def bad_constructor_calls(draw: st.DrawFn) -> tuple[str, Target, dict[str, object]]:
    target = TARGETS[draw(st.sampled_from(sorted(TARGETS)))]
    name = draw(st.sampled_from(sorted(target.kinds)))
    kind = target.kinds[name]
    if isinstance(kind, tuple):
        value = draw(st.one_of(st.integers(), st.text(max_size=6).filter(lambda s: s not in kind)))
    else:
        value = draw(BAD_VALUES[kind])
    if name in target.required and draw(st.integers(0, 9)) == 0:
        value = None
    return name, target, {**target.valid, name: value}


@given(call=bad_constructor_calls())
def test_bad_constructor_and_helper_arguments_are_named(
    call: tuple[str, Target, dict[str, object]],
) -> None:
    name, target, kwargs = call
    with attnkit_checks_only(), pytest.raises((TypeError, ValueError)) as err:
        target.fn(**kwargs)
    assert_names(err, name)


# Module calls: each argument with a bad value of its kind.
B, T, TM, D = 2, 5, 4, 8


@dataclass
class ModuleCall:
    """A module (or method) with arguments that work, and the kind of each argument: ("seq",
    width) for a (..., width) input in the parameters' dtype (float32), ("mask", scores) for a
    bool mask broadcasting to scores, "flag", "bias" (float, scores (B, H, T, T)), "cache",
    "backend"."""

    fn: Callable[..., object]
    valid: dict[str, object]
    kinds: dict[str, object]
    optional: tuple[str, ...] = ()  # arguments for which None is a valid value


def seq(width: int, length: int = T) -> Tensor:
    return torch.randn(B, length, width)


MODULE_CALLS = {
    "MultiHeadAttention": ModuleCall(
        attnkit.MultiHeadAttention(D, 2, kdim=6, vdim=6),
        {"query": seq(D), "key": seq(6, TM), "value": seq(6, TM)},
        {
            "query": ("seq", D),
            "key": ("seq", 6),
            "value": ("seq", 6),
            "mask": ("mask", (B, 2, T, TM)),
            "bias": "bias",
            "causal": "flag",
            "need_weights": "flag",
            "average_weights": "flag",
            "cache": "cache",
        },
        ("key", "value"),
    ),
    "RelativeMultiHeadAttention": ModuleCall(
        attnkit.RelativeMultiHeadAttention(D, 2),
        {"query": seq(D)},
        {
            "query": ("seq", D),
            "key": ("seq", D),
            "value": ("seq", D),
            "mask": ("mask", (B, 2, T, T)),
            "causal": "flag",
            "need_weights": "flag",
            "backend": "backend",
        },
        ("key", "value", "backend"),  # backend=None: the module's own
    ),
    "TransformerEncoderLayer": ModuleCall(
        attnkit.TransformerEncoderLayer(D, 2, norm_first=True),
        {"x": seq(D)},
        {"x": ("seq", D), "mask": ("mask", (B, 2, T, T)), "causal": "flag", "cache": "cache"},
    ),
    "TransformerDecoderLayer": ModuleCall(
        attnkit.TransformerDecoderLayer(D, 2, memory_dim=6),
        {"x": seq(D), "memory": seq(6, TM)},
        {
            "x": ("seq", D),
            "memory": ("seq", 6),
            "mask": ("mask", (B, 2, T, T)),
            "memory_mask": ("mask", (B, 2, T, TM)),
            "causal": "flag",
        },
    ),
    "Transformer": ModuleCall(
        attnkit.Transformer(D, 2, num_encoder_layers=1, num_decoder_layers=1),
        {"src": seq(D, TM), "tgt": seq(D)},
        {
            "src": ("seq", D),
            "tgt": ("seq", D),
            "src_mask": ("mask", (B, 2, TM, TM)),
            "tgt_mask": ("mask", (B, 2, T, T)),
            "memory_mask": ("mask", (B, 2, T, TM)),
        },
    ),
    "PositionwiseFeedForward": ModuleCall(
        attnkit.PositionwiseFeedForward(D, 16), {"x": seq(D)}, {"x": ("seq", D)}
    ),
    "SinusoidalPositionalEncoding": ModuleCall(
        attnkit.SinusoidalPositionalEncoding(D), {"x": seq(D)}, {"x": ("seq", D, "any float")}
    ),
    "KVCache.update": ModuleCall(
        attnkit.KVCache(B, 8, 2, 4).update,
        {"k": torch.randn(B, 2, 3, 4), "v": torch.randn(B, 2, 3, 4)},
        {"k": ("seq", 4), "v": ("seq", 4)},
    ),
}


@st.composite
def bad_tensor_input(draw: st.DrawFn, width: int, optional: bool, any_float: bool) -> object:
    """Not a tensor, not float, float64 (the parameters are float32), or a clashing width."""
    how = draw(st.sampled_from(["not a tensor", "dtype", "shape"]))
    if how == "not a tensor":
        bad = st.one_of(st.integers(), st.lists(st.floats(), max_size=3), st.text(max_size=2))
        return draw(bad if optional else st.one_of(st.none(), bad))
    if how == "dtype":
        dtype = draw(
            st.sampled_from([torch.int64, torch.bool, *([] if any_float else [torch.float64])])
        )
        return torch.ones(B, T, width).to(dtype)
    shape = draw(st.lists(st.integers(1, 9), min_size=1, max_size=5))
    if shape[-1] == width:
        shape[-1] += 1  # no layout takes it, whatever the leading dims
    return torch.randn(shape)


@st.composite
def bad_module_calls(draw: st.DrawFn) -> tuple[str, ModuleCall, dict[str, object]]:
    target = MODULE_CALLS[draw(st.sampled_from(sorted(MODULE_CALLS)))]
    name = draw(st.sampled_from(sorted(target.kinds)))
    kind = target.kinds[name]
    value: object
    if isinstance(kind, tuple) and kind[0] == "seq":
        value = draw(bad_tensor_input(kind[1], name in target.optional, "any float" in kind))
    elif isinstance(kind, tuple):  # a mask
        scores = kind[1]
        value = draw(
            st.one_of(
                st.integers(),
                st.just(torch.ones(scores)),
                st.just(torch.ones(scores, dtype=torch.int64)),
                shape_not_broadcasting_to(scores).map(lambda s: torch.ones(s, dtype=torch.bool)),
            )
        )
    elif kind == "flag":
        value = draw(not_a_bool)
    elif kind == "bias":
        value = draw(
            st.one_of(
                st.integers(),
                st.just(torch.zeros(B, 2, T, T, dtype=torch.bool)),
                st.just(torch.zeros(B, 2, T, TM, dtype=torch.float64)),
                shape_not_broadcasting_to((B, 2, T, TM)).map(torch.zeros),
            )
        )
    elif kind == "cache":
        value = draw(
            st.one_of(
                st.integers(),
                st.text(max_size=2),
                st.just(attnkit.KVCache(B, 8, 1, 4)),  # heads that do not fit
                st.just(attnkit.KVCache(B + 1, 8, 2, 4)),  # batch that does not fit
                st.just(attnkit.KVCache(B, 2, 2, 4)),  # too short for T tokens
            )
        )
    else:  # a backend: None is the module's own where the argument is optional
        nothing = st.nothing() if name in target.optional else st.none()
        value = draw(st.one_of(st.integers(), nothing, st.text(max_size=5)))
    return name, target, {**target.valid, name: value}


@given(call=bad_module_calls())
def test_bad_module_inputs_are_named(call: tuple[str, ModuleCall, dict[str, object]]) -> None:
    name, target, kwargs = call
    with attnkit_checks_only(), torch.no_grad(), pytest.raises((TypeError, ValueError)) as err:
        target.fn(**kwargs)
    assert_names(err, name)
