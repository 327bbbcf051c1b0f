"""RelativeMultiHeadAttention: the formula, its properties, the blocked path, openspeech legacy."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.autograd import gradcheck
from torch.func import functional_call

from attnkit import (
    BackendError,
    RelativeMultiHeadAttention,
    RelativePositionEmbedding,
    _native,
    attention,
    capture_attention,
    masks,
    record_dispatch,
)
from attnkit._kernel import plan as plan_module
from attnkit.backends import SDPA, Backend, Chunked
from attnkit.backends import chunked as chunked_module
from attnkit.backends.sdpa import terms as sdpa_terms
from attnkit.modules import _relpos as relpos
from attnkit.scores import RelativePositionTerm, ScoreShape
from attnkit.testing import assert_close

# --------------------------------------------------------------------------------------------------
# Helpers


def make(
    d: int = 12, h: int = 3, *, legacy: str | None = None, seed: int = 0, **kw: object
) -> RelativeMultiHeadAttention:
    """A float64 module with every parameter drawn at a scale where each term matters."""
    torch.manual_seed(seed)
    m = RelativeMultiHeadAttention(d, h, legacy=legacy, dtype=torch.float64, **kw)  # type: ignore[arg-type]
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.6)
    return m


def randn(*shape: int, seed: int = 1) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def small(backend: str, block: tuple[int, int] = (3, 4), sdpa: int = 3) -> str | Backend:
    """``backend`` with small blocks, so small inputs span many of them: ``block`` is the chunked
    kernel's ``(block_q, block_k)``, ``sdpa`` the queries per fused call."""
    if backend == "chunked":
        return Chunked(block_q=block[0], block_k=block[1])
    if backend == "sdpa":
        return SDPA(block_q=sdpa)
    return backend


def run(
    m: RelativeMultiHeadAttention, *args: Tensor, backend: str | Backend, **kw: object
) -> Tensor:
    """``m(*args, backend=backend)``; the sdpa path has no backward, so it runs under no_grad."""
    sdpa = backend == "sdpa" or isinstance(backend, SDPA)
    with torch.no_grad() if sdpa else contextlib.nullcontext():
        out = m(*args, backend=backend, **kw)
    assert isinstance(out, Tensor)
    return out


def random_mask(kind: str, tq: int, tk: int, seed: int) -> Tensor | None:
    """A bool mask of one of the shapes callers pass, ~30% False, so some rows are empty."""
    shapes = {"full": (2, 3, tq, tk), "keys": (2, 1, 1, tk), "vector": (tk,)}
    if kind not in shapes:
        return None
    return torch.rand(*shapes[kind], generator=torch.Generator().manual_seed(seed)) < 0.7


FAST = ["sdpa", "chunked"]
ALL = [*FAST, "reference"]


def sinusoid(d: int, dim: int) -> Tensor:
    """r(d) straight from the formula, one float at a time: sines, then cosines."""
    half = (dim + 1) // 2
    freqs = [10000.0 ** (-2.0 * k / dim) for k in range(half)]
    values = [math.sin(d * f) for f in freqs] + [math.cos(d * f) for f in freqs][: dim - half]
    return torch.tensor(values, dtype=torch.float64)


def brute_force(
    m: RelativeMultiHeadAttention,
    query: Tensor,
    key: Tensor,
    mask: Tensor | None = None,
    causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """The module's formula scored one (i, j) pair at a time, in float64, with no shifting."""
    b, tq, d = query.shape
    tk = key.size(1)
    h, dh = m.num_heads, m.head_dim
    with torch.no_grad():
        q = m.q_proj(query).view(b, tq, h, dh)
        k = m.k_proj(key).view(b, tk, h, dh)
        v = m.v_proj(key).view(b, tk, h, dh)
        u, vb = m.pos_bias_u, m.pos_bias_v
        allowed = torch.ones(b, h, tq, tk, dtype=torch.bool)
        if mask is not None:
            allowed = allowed & mask
        ctx = torch.zeros(b, tq, h, dh, dtype=torch.float64)
        weights = torch.zeros(b, h, tq, tk, dtype=torch.float64)
        for bi in range(b):
            for hi in range(h):
                for i in range(tq):
                    pos_i = i + tk - tq  # queries are the last tq positions
                    keys = [j for j in range(tk) if allowed[bi, hi, i, j]]
                    keys = [j for j in keys if not (causal and j > pos_i)]
                    if not keys:
                        continue
                    scores = []
                    for j in keys:
                        r = (sinusoid(pos_i - j, d) @ m.pos_proj.weight.T).view(h, dh)[hi]
                        content = (q[bi, i, hi] + u[hi]) @ k[bi, j, hi]
                        position = (q[bi, i, hi] + vb[hi]) @ r
                        scores.append((content + position) / math.sqrt(dh))
                    w = torch.softmax(torch.stack(scores), 0)
                    for wj, j in zip(w, keys, strict=True):
                        weights[bi, hi, i, j] = wj
                        ctx[bi, i, hi] += wj * v[bi, j, hi]
        return m.out_proj(ctx.reshape(b, tq, d)), weights


# --------------------------------------------------------------------------------------------------
# The formula


@given(
    tq=st.integers(1, 5),
    extra=st.integers(0, 3),
    causal=st.booleans(),
    masked=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=12)
def test_equals_brute_force(tq: int, extra: int, causal: bool, masked: bool, seed: int) -> None:
    m = make(seed=seed)
    tk = tq + extra
    x = randn(2, tk, 12, seed=seed)
    mask = None
    if masked:
        mask = torch.rand(2, 1, tq, tk, generator=torch.Generator().manual_seed(seed)) < 0.7
        mask[0, 0, 0] = False  # a query with no visible key
    want, want_w = brute_force(m, x[:, -tq:], x, mask, causal)
    for backend in FAST:
        fast = small(backend, (2, 3), 2)
        assert_close(run(m, x[:, -tq:], x, mask=mask, causal=causal, backend=fast), want)
    ref, w = m(x[:, -tq:], x, mask=mask, causal=causal, need_weights=True)
    assert_close(ref, want)
    assert_close(w, want_w)


def test_more_queries_than_keys_take_negative_positions() -> None:
    # Tq > Tk: the first queries sit before position 0; the formula still holds.
    m = make()
    q, kv = randn(1, 6, 12, seed=2), randn(1, 3, 12, seed=3)
    want, _ = brute_force(m, q, kv, causal=True)
    for backend in FAST:
        assert_close(run(m, q, kv, causal=True, backend=small(backend, (4, 2), 4)), want)


def test_encodings_are_sinusoids_of_distances() -> None:
    distances = torch.arange(5, -6, -1)
    table = relpos.relative_sinusoid(distances, 7)
    for row, d in zip(table, distances.tolist(), strict=True):
        assert_close(row, sinusoid(d, 7))
    # The sines are odd in the distance and the cosines even: left and right differ.
    assert_close(table[0, :4], -table[-1, :4])
    assert_close(table[0, 4:], table[-1, 4:])


def test_one_encoding_per_distance_the_call_needs() -> None:
    m = make()
    rows: list[int] = []
    m.pos_proj.register_forward_hook(lambda mod, args, out: rows.append((*args, out.size(0))))
    m(randn(1, 10, 12))
    m(randn(1, 4, 12), randn(1, 9, 12))
    assert rows == [(9, -9, 2 * 10 - 1), (8, -3, 4 + 9 - 1)]
    # The sinusoids (which hold no parameter) are computed once and kept; a longer call extends
    # them.
    tables = m.pos_proj._tables
    ((_, table),) = tables.values()
    m(randn(1, 6, 12))
    assert tables[(table.device, table.dtype)][1] is table
    m(randn(1, 40, 12))
    assert tables[(table.device, table.dtype)][0] >= 39  # distances -39 .. 39


@pytest.mark.parametrize("legacy", [None, "openspeech"])
@pytest.mark.parametrize("backend", ALL)
def test_empty_sequences(legacy: str | None, backend: str) -> None:
    m = make(legacy=legacy)
    assert run(m, randn(2, 0, 12), backend=backend).shape == (2, 0, 12)
    if legacy is None:  # no key at all: attention gives 0, the output is out_proj's bias
        got = run(m, randn(2, 3, 12), randn(2, 0, 12), backend=backend)
        assert_close(got, m.out_proj.bias.detach().expand(2, 3, 12))


def test_training_after_an_inference_mode_call() -> None:
    # The cached encodings must not be inference tensors, or the backward could not save them;
    # and the step after the inference call must compute what the formula says, gradients too.
    m = make()
    untouched = copy.deepcopy(m)  # never called under inference mode
    x = randn(1, 5, 12)
    cot = randn(1, 5, 12, seed=2)
    with torch.inference_mode():
        m(x)
    out = m(x)
    assert_close(out, brute_force(m, x, x)[0])
    out.backward(cot)
    untouched(x).backward(cot)
    params = dict(m.named_parameters())
    for key, p in untouched.named_parameters():
        assert params[key].grad is not None, key
        assert_close(params[key].grad, p.grad)  # type: ignore[arg-type]
    # The float64 formula (no autograd in it) differentiated numerically along one random
    # direction of every parameter at once: central differences, within 2e-11 of autograd here.
    h = 1e-6
    direction = {k: randn(*p.shape, seed=3 + i) for i, (k, p) in enumerate(params.items())}

    def loss_at(step: float) -> float:
        moved = copy.deepcopy(m)
        with torch.no_grad():
            for k, p in moved.named_parameters():
                p.add_(direction[k], alpha=step)
        return float((brute_force(moved, x, x)[0] * cot).sum())

    numeric = (loss_at(h) - loss_at(-h)) / (2 * h)
    analytic = sum(float((params[k].grad * d).sum()) for k, d in direction.items())  # type: ignore[operator]
    assert math.isclose(analytic, numeric, rel_tol=1e-8), (analytic, numeric)


@pytest.mark.parametrize("backend", ALL)
def test_inference_adds_the_bias_in_place_only_to_its_own_tensor(backend: str) -> None:
    # Where no gradient flows to q, forward adds pos_bias_u to q_proj's output in place (one
    # (B, T, d_model) tensor fewer): the result is still the formula's, and a q_proj that
    # returns its input (nn.Identity) leaves the caller's tensor as it was.
    m = make()
    x = randn(2, 7, 12)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            assert_close(m(x, backend=backend), brute_force(m, x, x)[0])
    m.q_proj = nn.Identity()  # type: ignore[assignment]
    kept = x.clone()
    with torch.inference_mode():
        out = m(x, backend=backend)
    assert torch.equal(x, kept)
    assert_close(out, brute_force(m, x, x)[0])


@pytest.mark.parametrize(
    "window", [(3, 2), (4, 0), (0, 5), (6, -2)], ids=["both sides", "past", "future", "off"]
)
def test_long_banded_call_is_one_attention_call_in_stretches_of_queries(
    window: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long call under a band alone is one attention() call, in inference and training alike;
    # the kernel takes its query blocks a stretch at a time (the plan's query ordering, which
    # explain() prints), and the whole is exactly the formula, on every side of the band and at
    # the ragged end.
    # Stretches of 2 query blocks: (B, H, block_q) = (2, 3, 8)
    monkeypatch.setattr(plan_module, "STRETCH_ROWS", 2 * (2 * 3 * 8))
    m = make()
    band = masks.sliding_window(*window)
    lo, hi = band.distances(masks.Geometry((1,), 3, 10, 10, torch.device("cpu")))
    t = 77
    x = randn(2, t, 12)
    allowed = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        allowed[i, max(i + int(lo), 0) : max(min(i + int(hi) + 1, t), 0)] = True
    want = brute_force(m, x, x, mask=allowed)[0]
    chunked = Chunked(block_q=8, block_k=16)
    for context in (torch.inference_mode, contextlib.nullcontext):
        with context(), record_dispatch() as calls:
            got = m(x, mask=band, backend=chunked)
        assert len(calls) == 1
        assert_close(got, want)
    report = str(m.explain(x, mask=band, backend=chunked))
    native = "native kernel" in report
    ordering = (
        "query ordering: stretches of 2 query blocks, every head of a stretch before the next"
    )
    assert (ordering in report) is native


def test_the_position_module_is_injected(monkeypatch: pytest.MonkeyPatch) -> None:
    # pos_proj= takes any module called as pos_proj(top, bottom) for the projected encodings of
    # those distances; the default is a RelativePositionEmbedding of the constructor's arguments,
    # drawn where the nn.Linear W_r was (a seeded module's weights are what they always were).
    class Wrapped(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, top: int, bottom: int) -> Tensor:
            out: Tensor = self.inner(top, bottom)
            return out

    m = make(encoding="symmetric")
    inner = copy.deepcopy(m.pos_proj)
    given = RelativeMultiHeadAttention(12, 3, pos_proj=Wrapped(inner), dtype=torch.float64)
    given.load_state_dict(
        {
            k.replace("pos_proj.weight", "pos_proj.inner.weight"): p
            for k, p in m.state_dict().items()
        }
    )
    x = randn(2, 9, 12)
    window = masks.sliding_window(3, 2)
    assert_close(given(x, mask=window), m(x, mask=window))
    assert given.encoding is None
    assert m.encoding == "symmetric"
    parts = ("q_proj", "k_proj", "v_proj", "out_proj")
    keys = [f"{part}.{name}" for part in parts for name in ("weight", "bias")]
    assert sorted(m.state_dict()) == sorted([*keys, "pos_bias_u", "pos_bias_v", "pos_proj.weight"])
    torch.manual_seed(5)
    drawn = [nn.Linear(12, 12) for _ in range(3)] + [nn.Linear(12, 12, bias=False)]
    torch.manual_seed(5)
    ours = RelativeMultiHeadAttention(12, 3)
    for linear, part in zip(drawn, ("q_proj", "k_proj", "v_proj", "pos_proj"), strict=True):
        assert torch.equal(ours.get_parameter(f"{part}.weight"), linear.weight)


@pytest.mark.usefixtures("no_shape_checks")
def test_a_given_position_module_refuses_the_arguments_of_the_default() -> None:
    pos = RelativePositionEmbedding(8)
    with pytest.raises(ValueError, match="encoding='symmetric' describes the default position"):
        RelativeMultiHeadAttention(8, 2, encoding="symmetric", pos_proj=pos)
    with pytest.raises(ValueError, match=r"encoding_dtype=torch\.float32 describes the default"):
        RelativeMultiHeadAttention(8, 2, encoding_dtype=torch.float32, pos_proj=pos)
    with pytest.raises(
        ValueError, match="pos_proj has legacy=None and this module legacy='openspeech'"
    ):
        RelativeMultiHeadAttention(8, 2, legacy="openspeech", pos_proj=pos)
    with pytest.raises(TypeError, match=r"pos_proj must be an nn\.Module, got str"):
        RelativeMultiHeadAttention(8, 2, pos_proj="sinusoid")  # type: ignore[arg-type]


@pytest.mark.parametrize("encoding", ["signed", "symmetric"])
@pytest.mark.parametrize(("top", "bottom"), [(9, -9), (3, -11), (11, -3), (0, -5)])
def test_mirrored_projection_equals_the_whole_table(encoding: str, top: int, bottom: int) -> None:
    # The projection of distances top .. bottom from those of 0 .. -m alone equals the whole
    # table's product, and so does weight's gradient, for an odd dimension too (one more sine).
    for d in (12, 13):
        pos = RelativePositionEmbedding(d, encoding=encoding, dtype=torch.float64)  # type: ignore[arg-type]
        w = pos.weight
        whole = pos._encodings(top, bottom) @ w.t()
        negative = pos._encodings(0, -max(top, -bottom))
        got = relpos.mirrored_projection(w, negative, top, bottom, odd=encoding == "signed")
        cot = randn(*whole.shape, seed=d)
        assert_close(got, whole)
        assert_close(torch.autograd.grad(got, w, cot)[0], torch.autograd.grad(whole, w, cot)[0])


def test_module_projects_a_table_of_both_signs_mirrored(monkeypatch: pytest.MonkeyPatch) -> None:
    # Training and inference with the mirrored projection equal the formula, gradients too (here
    # for tables of 2 or more distances of each sign); a hook on pos_proj sees the call.
    mirrored = []
    original = relpos.mirrored_projection

    def counted(*args: object, **kw: object) -> Tensor:
        mirrored.append(1)
        return original(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(relpos, "mirrored_projection", counted)
    x, cot = randn(2, 9, 12), randn(2, 9, 12, seed=2)
    want = make()
    got = make()
    monkeypatch.setattr(RelativePositionEmbedding, "_MIRROR_ROWS", 10**9)
    want(x).backward(cot)
    window = masks.sliding_window(3, 4)
    with torch.no_grad():
        want_window = want(x, mask=window)
    assert not mirrored
    monkeypatch.setattr(RelativePositionEmbedding, "_MIRROR_ROWS", 2)
    out = got(x)
    out.backward(cot)
    assert len(mirrored) == 1
    assert_close(out, brute_force(got, x, x)[0])
    for (name, a), b in zip(got.named_parameters(), want.parameters(), strict=True):
        try:
            assert_close(a.grad, b.grad)  # type: ignore[arg-type]
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
    with torch.no_grad():
        assert_close(got(x, mask=window), want_window)
    assert len(mirrored) == 2
    seen = []
    got.pos_proj.register_forward_hook(lambda *_: seen.append(1))
    got(x)
    assert seen == [1]
    assert len(mirrored) == 3


# --------------------------------------------------------------------------------------------------
# Properties


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("causal", [False, True])
def test_queries_are_the_last_positions(backend: str, causal: bool) -> None:
    m = make()
    x = randn(2, 11, 12)
    chosen = small(backend)
    full = run(m, x, causal=causal, backend=chosen)
    for n in (1, 4, 11):
        assert_close(run(m, x[:, -n:], x, causal=causal, backend=chosen), full[:, -n:])


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_does_not_change_real_tokens(backend: str, side: str) -> None:
    m = make()
    x = randn(2, 7, 12)
    junk = randn(2, 5, 12, seed=9) * 3
    padded = torch.cat([junk, x] if side == "left" else [x, junk], dim=1)
    real = slice(5, 12) if side == "left" else slice(0, 7)
    keep = torch.zeros(12, dtype=torch.bool)
    keep[real] = True
    chosen = small(backend, (4, 3), 4)
    want = run(m, x, backend=chosen)
    got = run(m, padded, mask=keep.view(1, 1, 1, 12), backend=chosen)
    assert_close(got[:, real], want)


def test_openspeech_legacy_is_not_padding_invariant() -> None:
    # The property above can fail: openspeech's absolute encodings depend on T.
    m = make(legacy="openspeech")
    x = randn(1, 7, 12)
    padded = torch.cat([x, randn(1, 5, 12, seed=9)], dim=1)
    keep = (torch.arange(12) < 7).view(1, 1, 1, 12)
    got = m(padded, mask=keep)[:, :7]
    assert (got - m(x)).abs().max() > 1e-3


def test_not_permutation_equivariant() -> None:
    m = make()
    x = randn(2, 9, 12)
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(0))
    moved = m(x[:, perm])
    assert (moved - m(x)[:, perm]).abs().max() > 1e-2
    # Without the position term it is equivariant, so the check above can tell them apart.
    with torch.no_grad():
        m.pos_proj.weight.zero_()
    assert_close(m(x[:, perm]), m(x)[:, perm])


# --------------------------------------------------------------------------------------------------
# The blocked path against the reference path


@given(
    tq=st.integers(1, 14),
    extra=st.integers(0, 6),
    causal=st.booleans(),
    legacy=st.booleans(),
    mask_kind=st.sampled_from(["none", "full", "keys", "vector"]),
    block=st.tuples(st.integers(1, 6), st.integers(1, 6)),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=25)
def test_chunked_equals_reference_with_gradients(
    tq: int,
    extra: int,
    causal: bool,
    legacy: bool,
    mask_kind: str,
    block: tuple[int, int],
    seed: int,
) -> None:
    m = make(legacy="openspeech" if legacy else None, seed=seed)
    tk = tq if legacy else tq + extra
    key = randn(2, tk, 12, seed=seed).requires_grad_()
    query = key[:, -tq:]
    mask = random_mask(mask_kind, tq, tk, seed)
    leaves = [key, *m.parameters()]
    cot = randn(2, tq, 12, seed=seed + 1)

    def run(backend: str | Backend) -> list[Tensor]:
        out = m(query, key, mask=mask, causal=causal, backend=backend)
        grads = torch.autograd.grad(out, leaves, cot, materialize_grads=True)
        return [out, *grads]

    want = run("reference")
    for native in (True, False):  # the native kernel fuses the position term; the eager one too
        fast = run(Chunked(block_q=block[0], block_k=block[1], native=native))
        for got, w in zip(fast, want, strict=True):
            assert_close(got, w)


@given(
    tq=st.integers(1, 14),
    extra=st.integers(0, 6),
    causal=st.booleans(),
    legacy=st.booleans(),
    mask_kind=st.sampled_from(["none", "full", "keys", "vector"]),
    block_q=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=25)
def test_sdpa_equals_reference(
    tq: int,
    extra: int,
    causal: bool,
    legacy: bool,
    mask_kind: str,
    block_q: int,
    seed: int,
) -> None:
    m = make(legacy="openspeech" if legacy else None, seed=seed)
    tk = tq if legacy else tq + extra
    x = randn(2, tk, 12, seed=seed)
    mask = random_mask(mask_kind, tq, tk, seed)
    fast = SDPA(block_q=block_q)
    got = run(m, x[:, -tq:], x, mask=mask, causal=causal, backend=fast)
    assert_close(got, m(x[:, -tq:], x, mask=mask, causal=causal, backend="reference"))


@pytest.mark.parametrize(("legacy", "causal"), [(None, False), (None, True), ("openspeech", False)])
def test_gradcheck(legacy: str | None, causal: bool) -> None:
    m = make(6, 2, legacy=legacy)
    x = randn(2, 5, 6).requires_grad_()
    mask = torch.rand(2, 1, 5, 5, generator=torch.Generator().manual_seed(3)) < 0.8
    names = ["pos_bias_u", "pos_bias_v", "pos_proj.weight", "q_proj.weight"]
    params = [m.get_parameter(n).detach().clone().requires_grad_() for n in names]

    def f(x: Tensor, *p: Tensor) -> Tensor:
        kw = {"mask": mask, "causal": causal, "backend": Chunked(block_q=2, block_k=3)}
        out = functional_call(m, dict(zip(names, p, strict=True)), (x,), kw)
        assert isinstance(out, Tensor)
        return out

    assert gradcheck(f, (x, *params))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_kernel_within_tolerance(dtype: torch.dtype) -> None:
    # The attention core in float32 / bfloat16 against float64 on the same rounded inputs.
    g = torch.Generator().manual_seed(0)
    qu, k, v, qv = (torch.randn(2, 3, 40, 8, generator=g).to(dtype) for _ in range(4))
    enc = torch.randn(3, 79, 8, generator=g).to(dtype)
    mask = masks.padding_mask([40, 31])

    def run(
        qu: Tensor, k: Tensor, v: Tensor, qv: Tensor, enc: Tensor, backend: str | Backend
    ) -> Tensor:
        term = RelativePositionTerm(qv, enc, 8**-0.5)
        return attention(
            qu, k, v, bias=term, mask=mask, causal=True, scale=8**-0.5, backend=backend
        )

    got = run(qu, k, v, qv, enc, Chunked(block_q=16, block_k=8))
    spec = [t.double() for t in (qu, k, v, qv, enc)]
    expected = run(*spec, "reference")
    assert got.dtype == dtype
    assert_close(got, expected)


def test_float32_module_within_tolerance() -> None:
    m64 = make()
    m32 = copy.deepcopy(m64).float()
    m64 = copy.deepcopy(m32).double()  # the float64 spec on the rounded parameters
    x = randn(2, 30, 12).float()
    got = m32(x, causal=True, backend=Chunked(block_q=8, block_k=8))
    assert_close(got, m64(x.double(), causal=True, backend="reference"), dtype=torch.float32)


def test_training_saves_no_score_sized_tensor() -> None:
    t = 384
    sizes: dict[str, int] = {}
    for backend in ("chunked", "reference"):
        m = make(16, 2)
        x = randn(1, t, 16).requires_grad_()
        seen: list[int] = []

        def pack(s: Tensor, seen: list[int] = seen) -> Tensor:
            seen.append(s.numel())
            return s

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
            m(x, backend=backend)
        sizes[backend] = max(seen)
    assert sizes["chunked"] < t * t // 8
    assert sizes["reference"] >= t * t  # the check can fail: the reference path does save them


# --------------------------------------------------------------------------------------------------
# Which path, weights, capture, dropout


def test_weights_and_capture() -> None:
    m = make()
    model = nn.ModuleDict({"encoder": nn.ModuleList([m])})
    x = randn(2, 6, 12)
    mask = masks.padding_mask([6, 4])
    fast = m(x, mask=mask)
    out, w = m(x, mask=mask, need_weights=True)
    assert_close(out, fast)
    assert w.shape == (2, 3, 6, 6)
    assert_close(w.sum(-1), torch.ones(2, 3, 6, dtype=torch.float64))
    assert torch.equal(w[1, :, :, 4:], torch.zeros(3, 6, 2, dtype=torch.float64))
    with capture_attention(model) as maps:
        captured = m(x, mask=mask)
    assert_close(captured, fast)
    assert list(maps) == ["encoder.0"]
    assert_close(maps["encoder.0"][0], w)


def test_dropout_applies_in_training_only() -> None:
    m = make(dropout=0.5)
    x = randn(1, 8, 12)
    m.train()
    torch.manual_seed(0)
    a, b = m(x), m(x)
    assert (a - b).abs().max() > 1e-3  # weights are dropped
    torch.manual_seed(0)
    c, d = m(x, backend="chunked"), m(x, backend="chunked")  # the kernel's dropout, in O(T)
    assert (c - d).abs().max() > 1e-3
    torch.manual_seed(0)
    assert torch.equal(m(x, backend="chunked"), c)
    m.eval()
    assert_close(m(x), m(x, backend="reference"))


def test_chunked_cannot_return_weights() -> None:
    m = make()
    with pytest.raises(BackendError, match="does not return attention weights"):
        m(randn(1, 4, 12), need_weights=True, backend="chunked")


def test_sdpa_refuses_gradients_and_half_precision() -> None:
    m = make()
    x = randn(1, 4, 12)
    with pytest.raises(BackendError, match=r"(?s)backend 'sdpa' cannot .* only without gradients"):
        m(x, backend="sdpa")
    with torch.no_grad(), pytest.raises(BackendError, match="round the score term"):
        m.bfloat16()(x.bfloat16(), backend="sdpa")


def test_auto_takes_the_first_path_that_serves_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[str] = []
    spies = [
        (sdpa_terms, "blocked_term", "sdpa"),
        (chunked_module, "kernel_attention", "chunked"),
        (RelativePositionTerm, "dense", "reference"),
    ]
    for owner, name, label in spies:
        original = getattr(owner, name)

        def spy(*args: object, _label: str = label, _f: object = original, **kw: object) -> object:
            taken.append(_label)
            return _f(*args, **kw)  # type: ignore[operator]

        monkeypatch.setattr(owner, name, spy)
    m = make()
    x = randn(1, 4, 12)
    with torch.inference_mode():
        m(x)  # on the CPU the native kernel fuses the term: chunked, else sdpa
    with torch.no_grad():
        m.bfloat16()(x.bfloat16())  # the sdpa mask would round the position term
        m.double()
    m(x)  # parameters require grad: the chunked kernel has a backward
    m(x, need_weights=True)
    first = "chunked" if _native.status()[0] else "sdpa"
    assert taken == [first, "chunked", "chunked", "reference"]
    monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    with torch.inference_mode():
        m(x)
    assert taken[-1] == "sdpa"  # without the native kernel sdpa serves inference


# --------------------------------------------------------------------------------------------------
# legacy="openspeech" (loading openspeech's module is tested in tests/interop/test_openspeech.py)


def test_legacy_shift_is_what_the_docstring_says() -> None:
    # On and below the diagonal: the encoding of position T-1-(i-j); just above it: 0; further
    # right: query i+1 against position j-i-2.
    t = 6
    qv, enc = randn(1, 1, t, 4), randn(1, t, 4, seed=2)
    padded = nn.functional.pad(enc, (0, 0, 1, 0))
    term = RelativePositionTerm(qv, padded, 1.0, legacy=True)
    shape = ScoreShape((1,), 1, t, t, qv.device, torch.float64)
    got = term.dense((qv, padded), shape)
    for i in range(t):
        for j in range(t):
            if j <= i:
                want = qv[0, 0, i] @ enc[0, t - 1 - (i - j)]
            elif j == i + 1:
                want = torch.tensor(0.0, dtype=torch.float64)
            else:
                want = qv[0, 0, i + 1] @ enc[0, j - i - 2]
            assert_close(got[0, 0, i, j], want)


def test_default_mode_differs_from_legacy() -> None:
    legacy = make(legacy="openspeech")
    exact = make()
    exact.load_state_dict(legacy.state_dict())
    x = randn(1, 7, 12)
    assert exact.scale == 1 / math.sqrt(4)  # 1/sqrt(head_dim)
    assert legacy.scale == 1 / math.sqrt(12)
    assert (exact(x) - legacy(x)).abs().max() > 1e-2


# --------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.usefixtures("no_shape_checks")
def test_bad_arguments_quote_values() -> None:
    with pytest.raises(ValueError, match=r"d_model \(10\) must be divisible by num_heads \(4\)"):
        RelativeMultiHeadAttention(10, 4)
    with pytest.raises(
        ValueError, match="legacy must be None, 'openspeech' or 'espnet', got 'fairseq'"
    ):
        RelativeMultiHeadAttention(8, 2, legacy="fairseq")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.5"):
        RelativeMultiHeadAttention(8, 2, dropout=1.5)
    m = make()
    x = randn(2, 5, 12)
    with pytest.raises(ValueError, match=r"query must be \(B, T, d_model=12\), got \(2, 5, 8\)"):
        m(randn(2, 5, 8))
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        m(x, mask=torch.ones(2, 1, 1, 5))
    with pytest.raises(ValueError, match=r"mask of shape \(3, 1, 1, 5\) does not broadcast"):
        m(x, mask=torch.ones(3, 1, 1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="unknown backend 'flash'; choose 'auto' or one of: sdpa"):
        m(x, backend="flash")
    legacy = make(legacy="openspeech")
    with pytest.raises(ValueError, match="got Tq=2 and Tk=5"):
        legacy(x[:, :2], x)


# --------------------------------------------------------------------------------------------------
# Modes for other toolkits' checkpoints: encoding=, scale=, legacy="espnet"
# (their agreement with ESPnet's and SpeechBrain's math is tested in tests/interop/)

MODES: list[dict[str, object]] = [
    {"encoding": "symmetric"},
    {"scale": 0.2},
    {"encoding": "symmetric", "scale": 1 / math.sqrt(12)},
    {"encoding_dtype": torch.float32},
    {"encoding": "symmetric", "encoding_dtype": torch.float32},
    {"legacy": "espnet", "legacy_max_len": 20},
    {"legacy": "espnet", "legacy_max_len": 4},  # shorter than the inputs: ESPnet's rebuilt table
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
@pytest.mark.parametrize("backend", FAST)
def test_modes_fast_paths_equal_reference(mode: dict[str, object], backend: str) -> None:
    m = make(**mode)
    x = randn(2, 7, 12)
    mask = masks.padding_mask([7, 5])
    want = m(x, mask=mask, backend="reference")
    assert_close(run(m, x, mask=mask, backend=small(backend, (2, 3), 2)), want)
    if backend == "chunked":  # and the chunked backward
        x.requires_grad_()
        chunked = Chunked(block_q=2, block_k=3)
        got = torch.autograd.grad(m(x, backend=chunked).sum(), [x, *m.parameters()])
        expected = torch.autograd.grad(m(x, backend="reference").sum(), [x, *m.parameters()])
        for g, e in zip(got, expected, strict=True):
            assert_close(g, e)


def test_symmetric_encoding_cannot_tell_past_from_future() -> None:
    # With r(|d|) the scores depend on |i - j| only: reversing time reverses the output. The
    # signed encoding tells keys before a query from keys after it, so it does not.
    x = randn(1, 9, 12)
    for encoding, equivariant in (("symmetric", True), ("signed", False)):
        m = make(encoding=encoding)
        flipped = m(x.flip(1)).flip(1)
        assert torch.allclose(flipped, m(x), atol=1e-12) is equivariant
    # Same weights, only the encoding differs: a different function.
    signed, symmetric = make(), make(encoding="symmetric")
    assert (signed(x) - symmetric(x)).abs().max() > 1e-2


def test_scale_multiplies_both_terms() -> None:
    # scale=s is the default module with its scores multiplied by s * sqrt(head_dim): the same as
    # scaling q (hence q + u and q + v) when u and v are scaled too.
    m, scaled = make(), make(scale=0.75 / math.sqrt(4))
    x = randn(2, 6, 12)
    with torch.no_grad():
        for p in (m.q_proj.weight, m.q_proj.bias, m.pos_bias_u, m.pos_bias_v):
            p.mul_(0.75)
    assert_close(m(x), scaled(x))
    assert scaled.scale == 0.75 / 2
    assert "scale=0.375" in repr(scaled)
    assert "scale" not in repr(make())


def test_espnet_legacy_table_length_is_max_len_or_the_input() -> None:
    # L = max(legacy_max_len, T): a table shorter than the input is ESPnet's rebuilt one.
    x = randn(1, 7, 12)
    short, exact = make(legacy="espnet", legacy_max_len=3), make(legacy="espnet", legacy_max_len=7)
    assert_close(short(x), exact(x))
    longer = make(legacy="espnet", legacy_max_len=30)
    assert (longer(x) - exact(x)).abs().max() > 1e-3
    # ESPnet's positions L-1 .. L-T, interleaved, computed in float32 like ESPnet's.
    table = relpos.espnet_legacy_sinusoid(3, 6, 10)
    f = torch.exp(torch.arange(0, 6, 2).float() * -(math.log(10000.0) / 6))
    for row, position in enumerate([9.0, 8.0, 7.0]):
        want = torch.stack([torch.sin(position * f), torch.cos(position * f)], -1).flatten()
        assert torch.equal(table[row], want)


def test_float32_encodings_are_the_toolkits_table() -> None:
    # ESPnet's, NeMo's and SpeechBrain's expression, every step in float32, interleaved; attnkit's
    # table holds the same numbers with the sines first.
    distances = torch.arange(300, -301, -1)
    f = torch.exp(torch.arange(0, 8, 2, dtype=torch.float32) * -(math.log(10000.0) / 8))
    angle = distances.float()[:, None] * f
    theirs = torch.stack([angle.sin(), angle.cos()], -1).flatten(1)  # sin w0, cos w0, sin w1, ...
    ours = relpos.float32_sinusoid(distances, 8)
    assert torch.equal(ours, theirs[:, [0, 2, 4, 6, 1, 3, 5, 7]])
    # ~1e-5 off the sinusoids at 300 frames: what encoding_dtype=torch.float32 is for.
    error = (ours.double() - relpos.relative_sinusoid(distances, 8)).abs().max()
    assert 1e-6 < error < 1e-4
    m = make(encoding_dtype=torch.float32)
    assert "encoding_dtype=torch.float32" in repr(m)
    assert (m(randn(1, 5, 12)) - make()(randn(1, 5, 12))).abs().max() < 1e-5


@pytest.mark.usefixtures("no_shape_checks")
def test_mode_arguments_quote_values() -> None:
    with pytest.raises(
        ValueError,
        match=r"encoding_dtype must be torch\.float64 or torch\.float32, got torch\.float16",
    ):
        RelativeMultiHeadAttention(8, 2, encoding_dtype=torch.float16)
    with pytest.raises(
        ValueError, match=r"encoding_dtype=torch\.float32 does not apply to legacy="
    ):
        RelativeMultiHeadAttention(8, 2, encoding_dtype=torch.float32, legacy="openspeech")
    with pytest.raises(ValueError, match="encoding must be 'signed' or 'symmetric', got 'odd'"):
        RelativeMultiHeadAttention(8, 2, encoding="odd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="encoding='symmetric' does not apply to legacy='espnet'"):
        RelativeMultiHeadAttention(8, 2, encoding="symmetric", legacy="espnet")
    with pytest.raises(ValueError, match="legacy_max_len applies to legacy='espnet' only, got "):
        RelativeMultiHeadAttention(8, 2, legacy_max_len=100)
    with pytest.raises(ValueError, match="legacy_max_len must be >= 1, got 0"):
        RelativeMultiHeadAttention(8, 2, legacy="espnet", legacy_max_len=0)
    with pytest.raises(ValueError, match="scale must be a finite number > 0, got -1"):
        RelativeMultiHeadAttention(8, 2, scale=-1)
    legacy = make(legacy="espnet")
    with pytest.raises(ValueError, match="legacy='espnet' reproduces espnet's self-attention"):
        legacy(randn(1, 2, 12), randn(1, 5, 12))


def test_explain_describes_the_call_the_module_makes(monkeypatch: pytest.MonkeyPatch) -> None:
    m = make()
    x = randn(1, 40, 12)
    window = masks.sliding_window(4, right=4)
    report = m.explain(x, mask=window)
    assert report.chosen == "chunked"  # parameters need gradients: the kernel has a backward
    assert "bias relative position term (9 distances)" in str(report)
    with torch.no_grad():  # the native kernel fuses the position term, else sdpa
        assert m.explain(x, mask=window).chosen == ("chunked" if _native.status()[0] else "sdpa")
        assert m.explain(x, need_weights=True).chosen == "reference"
    # The report names what the forward really runs.
    ran: list[str] = []
    original = chunked_module.kernel_attention

    def spy(*args: object, **kw: object) -> Tensor:
        ran.append("chunked")
        return original(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(chunked_module, "kernel_attention", spy)
    m(x, mask=window)
    assert ran == ["chunked"]


@pytest.mark.parametrize("t", [5, 24])
def test_vmap_over_the_module_equals_a_loop_over_examples(t: int) -> None:
    # torch.func.vmap over a whole module (per-example evaluation): its projections are batched
    # wrappers without storage, and the call's position term is read for nothing; 5 queries take
    # the native kernel's decode path, 24 the reference.
    torch.manual_seed(0)
    m = RelativeMultiHeadAttention(16, 2).eval().double()
    x = torch.randn(3, 2, t, 16, dtype=torch.float64)
    with torch.no_grad():
        got = torch.vmap(m)(x)
        want = torch.stack([m(e) for e in x])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
