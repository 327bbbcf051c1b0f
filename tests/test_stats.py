"""``attention_stats`` against the float64 reference's weights: column sums, column maxima and row
entropies for every mask kind, grouped heads (per query head and per key/value head), softcap,
sinks, a dense bias and a score term, a score_mod, padding, ``Tk = 0`` and fully masked rows,
with and without a given log-sum-exp; its checks read as ``attention()``'s; and the memory it
allocates stays far below one ``(Tq, Tk)`` matrix."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

import attnkit
from attnkit import AttentionStats, _native, attention_stats, masks
from attnkit.scores import ScoreTerm
from attnkit.testing import assert_close

from .helpers import LargestTensor, attnkit_checks_only
from .strategies import structured_masks


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float64) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


class _ALiBi(ScoreTerm):
    """-slope[h] * |j - i'|, computed tile by tile."""

    def __init__(self, slopes: Tensor) -> None:
        self.slopes = slopes

    def inputs(self) -> tuple[Tensor, ...]:
        return (self.slopes,)

    def tile(self, inputs: tuple[Tensor, ...], q_pos: Tensor, k_pos: Tensor) -> Tensor:
        (slopes,) = inputs
        return -slopes[:, None, None] * (k_pos - q_pos).abs()


def expected(q: Tensor, k: Tensor, **kw: object) -> tuple[Tensor, Tensor, Tensor]:
    """Column sums, column maxima and row entropies of the float64 reference's weights."""
    _, w = attnkit.attention(
        q.double(), k.double(), k.double(), return_weights=True, backend="reference", **kw
    )  # type: ignore[call-overload, misc]
    top = w.amax(-2) if w.size(-2) else w.new_zeros((*w.shape[:-2], w.size(-1)))
    entropy = torch.where(w > 0, -w * w.log(), torch.zeros_like(w)).sum(-1)
    return w.sum(-2), top, entropy


def check(stats: AttentionStats, want: tuple[Tensor, Tensor, Tensor], dtype: torch.dtype) -> None:
    for got, ref in zip((stats.key_mass, stats.key_max, stats.entropy), want, strict=True):
        assert got.dtype == torch.promote_types(dtype, torch.float32)
        assert_close(got, ref, dtype=dtype)


B, H, HKV, TQ, TK, D = 2, 4, 2, 37, 45, 8
LENGTHS = torch.tensor([0, 30])  # batch row 0: every key padded, every row fully masked

CASES = [
    pytest.param({}, id="plain"),
    pytest.param({"causal": True}, id="causal"),
    pytest.param({"mask": masks.causal(align="top_left")}, id="causal-top-left"),
    pytest.param({"mask": masks.sliding_window(6, right=2)}, id="window"),
    pytest.param({"mask": masks.documents([10, 20, 15])}, id="documents"),
    pytest.param({"mask": masks.key_padding(LENGTHS)}, id="padding"),
    pytest.param({"mask": masks.key_padding(LENGTHS), "causal": True}, id="padding-causal"),
    pytest.param(
        {"mask": masks.from_fn(lambda b, h, i, j: (j <= i) | (j < 3))}, id="from-fn-prefix-lm"
    ),
    pytest.param({"mask": _randn(H, TQ, TK, seed=9) > 0.3}, id="dense-bool-tensor"),
    pytest.param({"causal": True, "softcap": 2.0}, id="softcap"),
    pytest.param({"causal": True, "sinks": "sinks"}, id="sinks"),
    pytest.param({"bias": "bias"}, id="dense-bias"),
    pytest.param({"bias": "bias-with-inf"}, id="bias-with-minus-inf"),
    pytest.param({"bias": "bias", "mask": masks.key_padding(LENGTHS)}, id="padding-bias"),
    pytest.param({"bias": "term", "causal": True}, id="score-term"),
    pytest.param(
        {"score_mod": lambda s, b, h, i, j: s - 0.1 * (i - j).abs(), "causal": True},
        id="score-mod",
    ),
]


def _arguments(case: dict[str, object], dtype: torch.dtype) -> dict[str, object]:
    """The case's arguments, its tensors drawn in ``dtype``."""
    kw = dict(case)
    if kw.get("sinks") == "sinks":
        kw["sinks"] = torch.tensor([0.5, -1.0, float("-inf"), 2.0], dtype=dtype)
    if kw.get("bias") == "bias":
        kw["bias"] = _randn(B, 1, TQ, TK, seed=7).to(dtype)
    elif kw.get("bias") == "bias-with-inf":
        bias = _randn(H, TQ, TK, seed=8)
        kw["bias"] = bias.masked_fill(bias > 1.0, float("-inf")).to(dtype)
    elif kw.get("bias") == "term":
        kw["bias"] = _ALiBi(torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=dtype))
    return kw


# What the native pass does not take: a score_mod, a score term it does not fuse.
EAGER_ONLY = {"score-term", "score-mod"}
NATIVE = "native kernel"


@pytest.fixture(params=["native", "eager"])
def stats_pass(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which pass the test asks for: the native kernel's where it serves the call (and the
    kernel builds), or the eager kernel's loop, forced."""
    if request.param == "eager":
        monkeypatch.setattr(attnkit.stats, "stats_refusal", lambda *a: "the eager kernel (forced)")
    elif not _native.load():
        pytest.skip(f"native kernel: {_native.status()[1]}")
    return str(request.param)


def _served(calls: list[attnkit.Dispatch]) -> str | None:
    """The kernel the recorded attention_stats call says served it."""
    (mine,) = [c for c in calls if c.chosen == "attention_stats"]
    return mine.kernel


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("with_lse", [False, True], ids=["one-pass-lse", "given-lse"])
def test_stats_equal_the_reference_weights_statistics(
    case: dict[str, object], with_lse: bool, stats_pass: str
) -> None:
    q, k = _randn(B, H, TQ, D, seed=1), _randn(B, HKV, TK, D, seed=2)
    kw = _arguments(case, torch.float64)
    lse = None
    if with_lse:
        _, lse = attnkit.attention(q, k, k, return_lse=True, **kw)  # type: ignore[call-overload, misc]
    with attnkit.record_dispatch() as calls:
        stats = attention_stats(q, k, lse=lse, **kw)  # type: ignore[arg-type]
    check(stats, expected(q, k, **kw), torch.float64)
    eager_only = [c.values[0] for c in CASES if c.id in EAGER_ONLY]
    native = stats_pass == "native" and not any(case is c for c in eager_only)
    served = _served(calls)
    assert (served == NATIVE) if native else (served != NATIVE and "eager kernel" in str(served))
    # the reference form, written from the same weights, says the same
    check(attention_stats(q, k, lse=lse, backend="reference", **kw), expected(q, k, **kw), q.dtype)  # type: ignore[arg-type]


FLOAT32 = {"causal", "padding-causal", "softcap", "sinks", "score-term", "padding-bias"}


@pytest.mark.parametrize("case", [c for c in CASES if c.id in FLOAT32])
def test_float32_stats_are_within_float32_tolerance_of_float64(
    case: dict[str, object], stats_pass: str
) -> None:
    q, k = _randn(B, H, TQ, D, seed=3).float(), _randn(B, HKV, TK, D, seed=4).float()
    kw32 = _arguments(case, torch.float32)
    kw64 = _arguments(case, torch.float64)
    _, lse = attnkit.attention(q, k, k, return_lse=True, **kw32)  # type: ignore[call-overload, misc]
    want = expected(q, k, **kw64)
    check(attention_stats(q, k, **kw32), want, torch.float32)  # type: ignore[arg-type]
    check(attention_stats(q, k, lse=lse, **kw32), want, torch.float32)  # type: ignore[arg-type]


def test_per_kv_head_sums_the_mass_and_maxes_the_maximum_over_a_group(stats_pass: str) -> None:
    q, k = _randn(B, H, TQ, D, seed=5), _randn(B, HKV, TK, D, seed=6)
    mass, top, entropy = expected(q, k, causal=True)
    stats = attention_stats(q, k, causal=True, per_kv_head=True)
    g = H // HKV
    assert_close(stats.key_mass, mass.unflatten(1, (HKV, g)).sum(2), dtype=torch.float64)
    assert_close(stats.key_max, top.unflatten(1, (HKV, g)).amax(2), dtype=torch.float64)
    assert_close(stats.entropy, entropy, dtype=torch.float64)  # per query head still
    assert stats.key_mass.shape == (B, HKV, TK)


def test_a_query_with_no_visible_key_has_entropy_zero_and_gives_nothing(stats_pass: str) -> None:
    q, k = _randn(1, 2, 6, 4, seed=1), _randn(1, 2, 9, 4, seed=2)
    # causal with Tq > Tk... here top-left from a shifted window: the first 3 queries see no key
    mask = masks.from_fn(lambda b, h, i, j: (j <= i - 3) & (i >= 3))
    stats = attention_stats(q, k, mask=mask)
    assert torch.equal(stats.entropy[..., :3], torch.zeros(1, 2, 3, dtype=torch.float64))
    check(stats, expected(q, k, mask=mask), torch.float64)
    # every weight a row gives out: 1 for the others
    assert_close(stats.key_mass.sum(-1), torch.full((1, 2), 3.0, dtype=torch.float64))


def test_a_nan_query_reaches_only_the_keys_it_sees(stats_pass: str) -> None:
    # The non-finite policy: a NaN query's row is NaN where it attends, and a masked pair
    # influences no output, so a key that query cannot see keeps a finite mass and maximum.
    q, k = _randn(1, 2, 6, 4, seed=3), _randn(1, 2, 6, 4, seed=4)
    q[0, 0, 2, 1] = float("nan")  # query 2 of head 0 sees keys 0..2 (causal)
    stats = attention_stats(q, k, causal=True)
    want = attention_stats(q, k, causal=True, backend="reference")
    for name in ("key_mass", "key_max", "entropy"):
        got, exact = getattr(stats, name), getattr(want, name)
        assert torch.equal(got.isnan(), exact.isnan()), name
        torch.testing.assert_close(got.nan_to_num(7.0), exact.nan_to_num(7.0))
    assert stats.key_mass[0, 0, :3].isnan().all()
    assert stats.key_mass[0, 0, 3:].isfinite().all()
    assert stats.key_mass[0, 1].isfinite().all()


def test_entropy_of_uniform_weights_is_log_of_the_keys_seen() -> None:
    # all keys equal: query i (causal, Tq = Tk) spreads its weight evenly over i + 1 keys
    q, k = _randn(1, 1, 8, 4, seed=1), torch.ones(1, 1, 8, 4, dtype=torch.float64)
    stats = attention_stats(q, k, causal=True)
    want = torch.log(torch.arange(1, 9, dtype=torch.float64))
    assert_close(stats.entropy[0, 0], want, dtype=torch.float64)
    assert_close(stats.key_max[0, 0, -1], torch.tensor(1.0 / 8, dtype=torch.float64))


@pytest.mark.parametrize(("tq", "tk"), [(5, 0), (0, 5), (0, 0)])
def test_no_keys_or_no_queries(tq: int, tk: int, stats_pass: str) -> None:
    q, k = _randn(2, 4, tq, 8, seed=1), _randn(2, 2, tk, 8, seed=2)
    for backend in ("auto", "reference"):
        stats = attention_stats(
            q, k, causal=True, sinks=torch.zeros(4, dtype=q.dtype), backend=backend
        )
        assert stats.key_mass.shape == stats.key_max.shape == (2, 4, tk)
        assert stats.entropy.shape == (2, 4, tq)
        for t in (stats.key_mass, stats.key_max, stats.entropy):
            assert not t.any()


def test_checks_read_as_attentions() -> None:
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 3, 6, 8)
    with attnkit_checks_only():
        with pytest.raises(ValueError, match="multiple of the heads") as theirs:
            attnkit.attention(q, k, k)
        with pytest.raises(ValueError, match="multiple of the heads") as ours:
            attention_stats(q, k)
        # the same words, of q and k: attention_stats takes no values
        assert str(ours.value) == str(theirs.value).replace("k and v", "k")
        assert "Hkv=3" in str(ours.value)
        wrong = [  # each of attention()'s shape, dtype and device checks, of the keys
            torch.randn(2, 3, 6, 8),
            torch.randn(1, 0, 6, 8),
            torch.randn(1, 2, 6, 8, dtype=torch.float64),
            torch.randn(1, 2, 6, 8, device="meta"),
        ]
        for keys in wrong:
            with pytest.raises((TypeError, ValueError)) as error:
                attention_stats(q, keys)
            assert " v " not in str(error.value), error.value
            assert ", v" not in str(error.value), error.value
            assert str(error.value).startswith(("q and k", "k must")), str(error.value)
        k = torch.randn(1, 2, 6, 8)
        with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(4,\)"):
            attention_stats(q, k, sinks=torch.zeros(3))
        with pytest.raises(
            ValueError, match=r"lse must have shape \(\.\.\., H, Tq\) = \(1, 4, 5\)"
        ):
            attention_stats(q, k, lse=torch.zeros(1, 4, 6))
        with pytest.raises(TypeError, match="lse must be a float tensor"):
            attention_stats(q, k, lse=torch.zeros(1, 4, 5, dtype=torch.long))
        with pytest.raises(TypeError, match="per_kv_head must be a bool, got 1"):
            attention_stats(q, k, per_kv_head=1)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="got 'sdpa'"):
            attention_stats(q, k, backend="sdpa")
        with pytest.raises(TypeError, match="is_causal"):
            attention_stats(q, k, is_causal=True)  # type: ignore[call-arg]


@pytest.mark.parametrize("with_lse", [False, True])
def test_no_tensor_of_the_scores_size_is_allocated(with_lse: bool) -> None:
    # 2048 x 2048 scores per head: the reference writes 8M weights; the pass's largest tensor is a
    # tile of the plan (a few tens of thousands) or an output (H x T)
    t, h = 2048, 1
    q, k = torch.randn(1, h, t, 16), torch.randn(1, h, t, 16)
    lse = attnkit.attention(q, k, k, causal=True, return_lse=True)[1] if with_lse else None
    with LargestTensor() as seen:
        attention_stats(q, k, causal=True, lse=lse)
    assert seen.largest <= h * t * t // 16, seen.largest
    with LargestTensor() as dense:
        attention_stats(q, k, causal=True, lse=lse, backend="reference")
    assert dense.largest >= h * t * t  # the property can fail: the dense form does


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_against_the_reference(data: st.DataObject) -> None:
    b = data.draw(st.integers(1, 2))
    hkv = data.draw(st.integers(1, 2))
    h = hkv * data.draw(st.integers(1, 3))
    tq, tk = data.draw(st.integers(0, 24)), data.draw(st.integers(0, 24))
    d = data.draw(st.integers(1, 6))
    mask = data.draw(structured_masks(b, h, tq, tk)).mask
    seed = data.draw(st.integers(0, 2**16))
    q, k = _randn(b, h, tq, d, seed=seed), _randn(b, hkv, tk, d, seed=seed + 1)
    kw: dict[str, object] = {"mask": mask}
    if data.draw(st.booleans()):
        kw["softcap"] = data.draw(st.floats(0.5, 20.0))
    if data.draw(st.booleans()):
        kw["sinks"] = _randn(h, seed=seed + 2)
    per_kv = data.draw(st.booleans())
    stats = attention_stats(q, k, per_kv_head=per_kv, **kw)  # type: ignore[arg-type]
    mass, top, entropy = expected(q, k, **kw)
    if per_kv:
        mass = mass.unflatten(-2, (hkv, h // hkv)).sum(-2)
        top = top.unflatten(-2, (hkv, h // hkv)).amax(-2)
    check(stats, (mass, top, entropy), torch.float64)
    assert math.isfinite(float(stats.entropy.sum()))


def test_no_graph_and_no_autocast_rounding() -> None:
    q = _randn(1, 2, 9, 8, seed=1, dtype=torch.float32).requires_grad_()
    k = _randn(1, 2, 9, 8, seed=2, dtype=torch.float32)
    plain = attention_stats(q, k, causal=True)
    assert not plain.key_mass.requires_grad
    assert not plain.entropy.requires_grad
    # inside autocast both passes read the float32 inputs as given, not rounded to bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = attention_stats(q, k, causal=True)
    for a, b in zip(
        (cast.key_mass, cast.key_max, cast.entropy),
        (plain.key_mass, plain.key_max, plain.entropy),
        strict=True,
    ):
        assert_close(a, b, dtype=torch.float32)


def _selection(heads: int, seed: int) -> Tensor:
    """Each query's keys for an index mask: random, a repeat in every row, -1 entries, and a
    query of batch row 0 with none."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, TK, (B, heads, TQ, 6), generator=g)
    idx[..., 1] = idx[..., 0]
    idx[0, :, 3] = -1
    return idx


INDEX_CASES = [
    pytest.param({"mask": masks.key_indices(_selection(1, 20))}, id="key-indices-shared"),
    pytest.param(
        {"mask": masks.key_indices(_selection(HKV, 21)), "causal": True, "softcap": 2.0},
        id="key-indices-causal-softcap",
    ),
    pytest.param(
        {"mask": masks.block_indices(_selection(H, 22) // 8, block=8), "sinks": "sinks"},
        id="block-indices-sinks",
    ),
]


@pytest.mark.parametrize("case", INDEX_CASES)
def test_stats_with_index_masks_equal_the_reference_weights_statistics(
    case: dict[str, object],
) -> None:
    # Index masks are masks like the others: with a given log-sum-exp and through the reference.
    q, k = _randn(B, H, TQ, D, seed=23), _randn(B, HKV, TK, D, seed=24)
    kw = _arguments(case, torch.float64)
    _, lse = attnkit.attention(q, k, k, return_lse=True, **kw)  # type: ignore[call-overload, misc]
    want = expected(q, k, **kw)
    check(attention_stats(q, k, lse=lse, **kw), want, torch.float64)  # type: ignore[arg-type]
    check(attention_stats(q, k, backend="reference", **kw), want, torch.float64)  # type: ignore[arg-type]


def test_stats_with_an_index_mask_in_one_pass() -> None:
    q, k = _randn(B, H, TQ, D, seed=25), _randn(B, HKV, TK, D, seed=26)
    mask = masks.key_indices(_selection(1, 27))
    check(attention_stats(q, k, mask=mask), expected(q, k, mask=mask), torch.float64)


def test_a_compiled_function_calls_it_between_its_graphs() -> None:
    # The pass reads whether q and k are finite to choose its kernel: traced, that read failed
    # (attnkit::all_finite on fake tensors) and took down the whole compiled function.
    q = _randn(B, H, TQ, D, seed=40, dtype=torch.float32)
    k = _randn(B, HKV, TK, D, seed=41, dtype=torch.float32)

    def h2o_step(q: Tensor, k: Tensor, mass: Tensor) -> Tensor:
        out, lse = attnkit.attention(q, k, k, causal=True, return_lse=True)
        stats = attention_stats(q, k, causal=True, lse=lse, per_kv_head=True)
        return mass + stats.key_mass + out.sum() * 0

    mass = torch.zeros(B, HKV, TK)
    got = torch.compile(h2o_step, backend="eager")(q, k, mass)
    _, w = attnkit.attention(q.double(), k.double(), k.double(), causal=True,
                             return_weights=True, backend="reference")  # fmt: skip
    assert_close(got, w.unflatten(1, (HKV, H // HKV)).sum((2, 3)))


def test_torch_export_refuses_it_in_its_own_words() -> None:
    # An exported program is one graph, with no eager code between graphs for the pass's read
    # of whether q and k are finite: the read met fake tensors and failed deep in the kernel's
    # choice (attnkit::all_finite: CPU tensors, got one on meta).
    class Stats(torch.nn.Module):
        def forward(self, q: Tensor, k: Tensor) -> Tensor:
            return attention_stats(q, k, causal=True).key_mass

    q = _randn(1, 2, 3, 8, seed=42, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"attention_stats cannot run inside torch.export: .*"
                       r"compute the statistics outside the exported program"):  # fmt: skip
        torch.export.export(Stats(), (q, q))


def test_a_cache_view_or_quantized_keys_are_refused_in_its_own_words() -> None:
    # attention()'s checks spoke of values attention_stats never takes: "attention(q, view)
    # reads the keys and values from the cache view: v must be None, got CacheView".
    cache = attnkit.KVCache(1, 8, 2, 4, kv_dtype=torch.int8)
    cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    q = torch.randn(1, 4, 1, 4)
    with attnkit_checks_only():
        with pytest.raises(TypeError, match=r"keys k as a tensor .* got a CacheView \(1 row"):
            attention_stats(q, cache.view())  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"float keys, got k of int8: give them dequantized"):
            attention_stats(q, cache.k_cache)
