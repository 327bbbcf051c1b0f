"""Promises at the edges of the modifiers: softcap over its whole range, masked garbage with every
modifier (softcap, sinks, bias, score terms), the values a sink or a score term may hold.

Each test is written as an adversarial user would: the documented promise, on every backend that
serves the call, compared with the float64 reference or with a property that needs no reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import attention, masks
from attnkit.scores import ScoreTerm
from attnkit.testing import assert_close

from ..helpers import blocked

# The backends that serve every modifier with gradients; "small" is the kernel with blocks of 2x3,
# so that small inputs span partial, full and skipped blocks.
GRAD_BACKENDS = ["reference", "chunked", "small"]


def backend_of(name: str) -> str | attnkit.Backend:
    return blocked("chunked", 2, 3) if name == "small" else name


def randn(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------
# softcap: exact for every cap > 0


CAPS = [1e-300, 3e-39, 1e-30, 1e-3, 0.5, 1.0, 30.0, 50.0, 64.0, 100.0, 3000.0, 1e5, 1e12]
CAPS += [1e30, 3e38, 1e39, 1e300, 1.5e308]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_softcap_matches_the_float64_reference_for_any_cap(
    dtype: torch.dtype, backend: str
) -> None:
    q, k, v = (randn(1, 2, 9, 8, seed=i).to(dtype) for i in range(3))
    cot = randn(1, 2, 9, 8, seed=3)
    for softcap in CAPS:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, causal=True, softcap=softcap, backend=backend_of(backend))
        grads = torch.autograd.grad(out, leaves, cot.to(dtype))
        exact = [t.double().requires_grad_() for t in (q, k, v)]
        want = attention(*exact, causal=True, softcap=softcap, backend="reference")
        want_grads = torch.autograd.grad(want, exact, cot)
        for name, got, expected in zip(
            ("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads), strict=True
        ):
            try:
                assert_close(got, expected, dtype=dtype)
            except AssertionError as err:
                raise AssertionError(f"softcap={softcap}, {name}: {err}") from None


@pytest.mark.parametrize("softcap", [1e12, 1e30, 1e300])
def test_a_huge_softcap_is_no_cap(softcap: float) -> None:
    q, k, v = (randn(1, 2, 9, 8, seed=i) for i in range(3))
    want = attention(q, k, v, causal=True, backend="reference")
    assert_close(attention(q, k, v, causal=True, softcap=softcap, backend="reference"), want)


@pytest.mark.parametrize("softcap", [1e-30, 3e-39, 1e-300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_a_tiny_softcap_is_a_hard_limit(softcap: float, dtype: torch.dtype, backend: str) -> None:
    # Every capped score lies in [-softcap, softcap]: the weights are uniform over visible keys.
    q, k, v = (randn(1, 2, 9, 8, seed=i).to(dtype) for i in range(3))
    out = attention(q, k, v, causal=True, softcap=softcap, backend=backend_of(backend))
    mean = v.double().cumsum(-2) / torch.arange(1, 10, dtype=torch.float64)[:, None]
    assert_close(out, mean, dtype=dtype)


def test_softcap_refuses_what_is_not_a_positive_number() -> None:
    q = randn(1, 1, 3, 4)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"softcap must be a finite number > 0, got"):
            attention(q, q, q, softcap=bad)


# --------------------------------------------------------------------------------------------------
# Masked garbage never reaches a gradient, with every modifier


class Slopes(ScoreTerm):
    """An ALiBi-like term whose slopes receive gradients, with -inf at key ``hidden``: a term may
    mask a pair, as a -inf bias does."""

    def __init__(self, slopes: Tensor, hidden: int) -> None:
        self.slopes, self.hidden = slopes, hidden

    def inputs(self) -> tuple[Tensor, ...]:
        return (self.slopes,)

    def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
        (slopes,) = inputs
        out = -slopes[:, None, None] * (k_pos - q_pos).abs()  # (H, rows, keys)
        return out.masked_fill(k_pos == self.hidden, -math.inf)


MODIFIERS = ["softcap", "sinks", "bias", "term", "all"]


def modified_call(
    modifier: str, backend: str, garbage: float | None, empty_query: bool = False
) -> list[Tensor]:
    """Output and gradients (q, k, v, then the modifier's tensors) of a padded call with
    ``modifier``. ``garbage`` fills what the call masks: the padded keys and values of row 1, key 1
    (hidden by the -inf of the bias or the term), and with ``empty_query`` query 2 of row 0, which
    the mask leaves without a visible key."""
    b, h, tq, tk = 2, 2, 5, 7
    q, k, v = randn(b, h, tq, 8, seed=1), randn(b, 1, tk, 8, seed=2), randn(b, 1, tk, 4, seed=3)
    mask: Tensor | masks.Mask = masks.key_padding([7, 4])
    if empty_query:
        mask = torch.ones(b, 1, tq, tk, dtype=torch.bool)
        mask[0, :, 2] = False
        mask[1, :, :, 4:] = False
    extra: dict[str, object] = {}
    params: list[Tensor] = []
    if modifier in ("softcap", "all"):
        extra["softcap"] = 2.0
    if modifier in ("sinks", "all"):
        extra["sinks"] = sinks = randn(h, seed=4).requires_grad_()
        params.append(sinks)
    if modifier in ("bias", "all"):
        bias = randn(h, tq, tk, seed=5)
        bias[..., 1] = -math.inf
        extra["bias"] = bias = bias.requires_grad_()
        params.append(bias)
    if modifier == "term":
        slopes = attnkit.alibi_slopes(h).double().requires_grad_()
        extra["bias"] = Slopes(slopes, hidden=1)
        params.append(slopes)
    if garbage is not None:
        k, v = k.clone(), v.clone()
        k[1, :, 4:], v[1, :, 4:] = garbage, garbage
        if modifier in ("bias", "term", "all"):
            k[:, :, 1], v[:, :, 1] = garbage, garbage
        if empty_query:
            q = q.clone()
            q[0, :, 2] = garbage
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, mask=mask, backend=backend_of(backend), **extra)  # type: ignore[call-overload]
    cot = randn(*out.shape, seed=6)
    return [out, *torch.autograd.grad(out, [*leaves, *params], cot)]


@pytest.mark.parametrize("modifier", MODIFIERS)
@pytest.mark.parametrize("empty_query", [False, True])
@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_masked_garbage_reaches_no_gradient_with_any_modifier(
    modifier: str, empty_query: bool, backend: str
) -> None:
    clean = modified_call(modifier, backend, None, empty_query)
    for garbage in (math.nan, math.inf, -math.inf):
        dirty = modified_call(modifier, backend, garbage, empty_query)
        names = ["out", "dq", "dk", "dv", "d(modifier)", "d(modifier)"]
        for name, got, want in zip(names, dirty, clean, strict=False):
            # A masked pair's key or value gets gradient 0 in both; the rest is the clean one.
            assert got.isfinite().all(), (garbage, name)
            assert_close(got, want)
        if empty_query:  # the query that sees nothing: output 0, gradient 0
            assert torch.equal(dirty[0][0, :, 2], torch.zeros_like(dirty[0][0, :, 2]))
            assert torch.equal(dirty[1][0, :, 2], torch.zeros_like(dirty[1][0, :, 2]))


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_issue_example_nan_padding_with_softcap(backend: str) -> None:
    q = randn(1, 1, 4, 8, seed=1).float().requires_grad_()
    k, v = randn(1, 1, 4, 8, seed=2).float(), randn(1, 1, 4, 8, seed=3).float()
    k[..., 3, :] = math.nan
    k.requires_grad_()
    out = attention(q, k, v, mask=masks.key_padding([3]), softcap=5.0, backend=backend_of(backend))
    dq, dk = torch.autograd.grad(out.sum(), [q, k])
    assert dq.isfinite().all()
    assert dk.isfinite().all()
    assert torch.equal(dk[..., 3, :], torch.zeros_like(dk[..., 3, :]))


# --------------------------------------------------------------------------------------------------
# Sinks: a logit that may be -inf (no sink), never NaN or +inf


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("backend", ["auto", "reference", "chunked", "sdpa"])
def test_a_nan_or_infinite_sink_is_an_error(value: float, backend: str) -> None:
    q = randn(1, 2, 5, 8)
    sinks = torch.tensor([value, 0.0], dtype=torch.float64)
    what = "NaN" if math.isnan(value) else r"\+inf"
    with pytest.raises(
        ValueError, match=rf"sinks holds {what}: a sink may be -inf \(no sink\) but not NaN"
    ):
        attention(q, q, q, sinks=sinks, backend=backend)


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_a_minus_inf_sink_is_no_sink_even_for_a_query_that_sees_nothing(backend: str) -> None:
    q, k, v = (randn(1, 2, 5, 8, seed=i) for i in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask[2] = False  # query 2 sees nothing
    sinks = torch.tensor([-math.inf, 0.5], dtype=torch.float64, requires_grad=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, mask=mask, sinks=sinks, backend=backend_of(backend))
    want = attention(q, k, v, mask=mask, backend="reference")
    assert_close(out[0, 0], want[0, 0])  # head 0: no sink
    assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2]))
    grads = torch.autograd.grad(out.sum(), [*leaves, sinks])
    for g in grads:
        assert g.isfinite().all()
    assert grads[-1][0] == 0.0  # a sink of weight 0 everywhere has gradient 0


# --------------------------------------------------------------------------------------------------
# Score terms: finite or -inf, never NaN or +inf


class Broken(ScoreTerm):
    """A term whose tiles hold ``value`` at the pair (query 3, key 2), whatever its inputs."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.slopes = torch.ones(2, dtype=torch.float64)

    def inputs(self) -> tuple[Tensor, ...]:
        return (self.slopes,)

    def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
        (slopes,) = inputs
        spot = (q_pos == 3) & (k_pos == 2)
        return (slopes[:, None, None] * 0.1 * (k_pos - q_pos)).masked_fill(spot, self.value)


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("backend", ["auto", "reference", "chunked", "small", "sdpa"])
def test_a_term_holding_nan_or_plus_inf_is_an_error(value: float, backend: str) -> None:
    q = randn(1, 2, 6, 8)
    with torch.no_grad(), pytest.raises(ValueError, match=r"bias: Broken\.tile\(\) returned"):
        attention(q, q, q, bias=Broken(value), backend=backend_of(backend))


@pytest.mark.parametrize("backend", ["reference", "chunked", "small"])
def test_a_term_is_checked_with_gradients_too(backend: str) -> None:
    q = randn(1, 2, 6, 8).requires_grad_()
    with pytest.raises(ValueError, match=r"bias: Broken\.tile\(\) returned NaN"):
        attention(q, q, q, bias=Broken(math.nan), causal=True, backend=backend_of(backend))


@pytest.mark.parametrize("backend", ["reference", "chunked", "small"])
def test_a_term_may_hide_its_broken_pair_behind_the_mask(backend: str) -> None:
    # Key 2 is masked for query 3: what the term holds there never matters.
    q = randn(1, 2, 6, 8)
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[3, 2] = False
    got = attention(q, q, q, bias=Broken(math.nan), mask=mask, backend=backend_of(backend))
    want = attention(q, q, q, bias=Broken(0.0), mask=mask, backend="reference")
    assert_close(got, want)


@pytest.mark.parametrize("backend", ["reference", "chunked", "small"])
def test_a_term_with_nan_inputs_spoils_what_they_reach(backend: str) -> None:
    # A NaN in a term's input is a NaN in the call's inputs (rule 2), not a broken term.
    q = randn(1, 2, 6, 8)
    slopes = torch.tensor([math.nan, 0.5], dtype=torch.float64)
    out = attention(q, q, q, bias=Slopes(slopes, hidden=-1), backend=backend_of(backend))
    assert out[:, 0].isnan().all()
    assert_close(out[:, 1], attention(q, q, q, bias=Slopes(slopes.nan_to_num(), -1))[:, 1])


@pytest.mark.parametrize("backend", ["reference", "chunked", "small"])
def test_a_minus_inf_term_masks_that_pair(backend: str) -> None:
    q, k, v = (randn(1, 2, 6, 8, seed=i) for i in range(3))
    slopes = attnkit.alibi_slopes(2).double()
    got = attention(q, k, v, bias=Slopes(slopes, hidden=4), backend=backend_of(backend))
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[:, 4] = False
    want = attention(q, k, v, bias=Slopes(slopes, hidden=-1), mask=mask, backend="reference")
    assert_close(got, want)


# --------------------------------------------------------------------------------------------------
# Integers beyond int64: a ValueError naming the argument; a window's reach saturates

HUGE = 10**30


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: attnkit.MultiHeadAttention(8, 2).make_cache(1, HUGE), "max_len"),
        (lambda: attnkit.MultiHeadAttention(8, 2).make_cache(2**63, 4), "batch_size"),
        (lambda: masks.key_padding([2**63, 1]), r"lengths\[0\]"),
        (lambda: masks.documents([HUGE, 0]), r"lengths\[0\]"),
        (lambda: masks.documents([2**62, 2**62]), "lengths must sum"),
        (lambda: masks.documents([[1, 2], [2**63 - 1, 1]]), r"lengths\[1\] must sum"),
        (lambda: masks.causal().dense(HUGE), "q_len"),
        (lambda: masks.causal().dense(4, HUGE), "kv_len"),
        (lambda: attnkit.RotaryEmbedding(8)(randn(1, 2, 5, 8), offset=2**70), "offset"),
        (lambda: attnkit.RotaryEmbedding(8)(randn(1, 2, 5, 8), offset=2**63 - 1), "offset"),
        (lambda: attnkit.backends.SDPA(block_q=HUGE), "block_q"),
        (lambda: attnkit.MultiHeadAttention(HUGE, 2), "d_model"),
        (lambda: attnkit.RelativeMultiHeadAttention(HUGE, 2), "d_model"),
    ],
)
def test_an_integer_past_int64_is_a_value_error_naming_it(call: object, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        call()  # type: ignore[operator]


def test_a_window_longer_than_any_sequence_is_unbounded() -> None:
    q, k, v = (randn(1, 2, 6, 8, seed=i) for i in range(3))
    full = attention(q, k, v, backend="reference")
    for backend in ("auto", "reference", "chunked", "sdpa"):
        got = attention(q, k, v, mask=masks.sliding_window(HUGE, HUGE), backend=backend)
        assert_close(got, full)
    past = attention(q, k, v, mask=masks.sliding_window(HUGE), backend="chunked")
    assert_close(past, attention(q, k, v, causal=True, backend="reference"))
    dense = masks.sliding_window(HUGE, 2).dense(6)
    assert torch.equal(dense.reshape(6, 6), torch.ones(6, 6, dtype=torch.bool).tril(2))


@pytest.mark.parametrize("size", [HUGE, 2**63 - 1])
def test_a_block_larger_than_the_sequence_is_the_sequence(size: int) -> None:
    q, k, v = (randn(1, 2, 6, 8, seed=i) for i in range(3))
    backend = attnkit.backends.Chunked(block_q=size, block_k=size, fused_rows=size)
    got = attention(q, k, v, causal=True, backend=backend)
    assert_close(got, attention(q, k, v, causal=True, backend="reference"))


def test_a_conformer_context_past_any_sequence_is_unbounded() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 5, 8)
    layer = attnkit.ConformerLayer(8, 2, context=(HUGE, 0)).eval()
    bounded = attnkit.ConformerLayer(8, 2, context=(4, 0)).eval()
    bounded.load_state_dict(layer.state_dict())
    torch.testing.assert_close(layer(x), bounded(x))  # 4 back reaches every earlier frame of 5


@pytest.mark.parametrize(
    "argv",
    [
        ["explain", "-t", str(10**20)],
        ["explain", "--heads", str(10**19)],
        ["explain", "--kv-len", str(-(2**63) - 1)],
        ["demo", "--steps", str(HUGE)],
        ["demo", "--seed", str(HUGE)],
        ["bench", "--threads", str(HUGE)],
    ],
)
def test_the_cli_names_an_integer_past_int64(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from attnkit.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    option = argv[1]
    assert f"argument {option}" in err or f"/{option}" in err
    assert "must be" in err
    assert "Exception raised from" not in err
    assert "Traceback" not in err


def test_the_cli_gives_one_line_for_an_overflow(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Sizes that fit an int64 each may still overflow together in Python code torch runs.
    from attnkit import cli
    from attnkit.cli import main

    def run(args: object) -> int:
        raise OverflowError("cannot fit 'int' into an index-sized integer")

    monkeypatch.setattr(cli.explain, "run", run)
    with pytest.raises(SystemExit) as exit_:
        main(["explain"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == "attnkit explain: error: cannot fit 'int' into an index-sized integer\n"
