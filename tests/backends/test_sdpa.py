"""The sdpa backend: attnkit's conventions on top of torch's kernel (bottom-right causal, packed
documents one fused call each, score terms without gradients), the reasons it gives in ``check``
and ``cost``, and its visible hand-over when torch's output breaks the non-finite policy."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import attnkit
from attnkit import attention, explain, masks, record_dispatch
from attnkit._call import AttentionCall, check_attention_args
from attnkit.backends import SDPA
from attnkit.backends import sdpa as sdpa_module
from attnkit.backends.sdpa import sdpa_check, sdpa_cost
from attnkit.masks import Mask
from attnkit.scores import RelativePositionTerm
from attnkit.testing import assert_close


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def reference(q: Tensor, k: Tensor, v: Tensor, **kw: object) -> Tensor:
    out = attention(q.double(), k.double(), v.double(), backend="reference", **kw)  # type: ignore[arg-type]
    assert isinstance(out, Tensor)
    return out


def call_of(q: Tensor, k: Tensor, v: Tensor, **kw: object) -> AttentionCall:
    args: dict[str, object] = {"mask": None, "bias": None, "causal": False, "scale": None}
    args.update(kw)
    return check_attention_args(q, k, v, **args)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# Conventions


def test_causal_is_bottom_right_where_torch_is_top_left() -> None:
    q, k, v = randn(1, 2, 3, 8, seed=1), randn(1, 2, 7, 8, seed=2), randn(1, 2, 7, 4, seed=3)
    ours = attention(q, k, v, causal=True, backend="sdpa")
    assert_close(ours, reference(q, k, v, causal=True))
    torch_top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (ours - torch_top_left).abs().max() > 0.1  # the conventions differ when Tq != Tk
    top_left = attention(q, k, v, mask=masks.causal(align="top_left"), backend="sdpa")
    assert_close(top_left, torch_top_left.double())
    # Tq == Tk: the two agree, and torch's is_causal serves the call without a mask.
    square = attention(q, q, q, causal=True, backend="sdpa")
    assert_close(square, F.scaled_dot_product_attention(q, q, q, is_causal=True).double())


def test_one_query_causal_sees_every_key() -> None:
    q, k, v = randn(2, 2, 1, 8, seed=4), randn(2, 2, 9, 8, seed=5), randn(2, 2, 9, 8, seed=6)
    got = attention(q, k, v, causal=True, backend="sdpa")
    assert_close(got, F.scaled_dot_product_attention(q, k, v).double())


@pytest.mark.parametrize("causal", [False, True])
def test_packed_documents_are_one_fused_call_each(causal: bool) -> None:
    q, k, v = (
        randn(1, 2, 512, 16, seed=7),
        randn(1, 2, 512, 16, seed=8),
        randn(1, 2, 512, 16, seed=9),
    )
    docs = masks.documents([256, 256])
    text = str(explain(q, k, v, mask=docs, causal=causal, backend="sdpa"))
    assert "one fused call per document: 2 calls" in text
    assert sdpa_cost(call_of(q, k, v, mask=docs, causal=causal)) == []
    got = attention(q, k, v, mask=docs, causal=causal, backend="sdpa")
    assert_close(got, reference(q, k, v, mask=docs, causal=causal))
    # The documents really are separate: the second one's output ignores the first's values.
    v2 = v.clone()
    v2[..., :256, :] += 1.0
    again = attention(q, k, v2, mask=docs, causal=causal, backend="sdpa")
    assert torch.equal(again[..., 256:, :], got[..., 256:, :])


def test_short_documents_and_other_masks_are_written_out_and_cost_so() -> None:
    q = randn(1, 2, 64, 8, seed=10)
    short = masks.documents([32, 32])  # shorter than a call per document is worth
    (cost,) = sdpa_cost(call_of(q, q, q, mask=short))
    assert cost == f"would materialise the mask {short!r} as a (Tq, Tk) = (64, 64) tensor"
    assert_close(attention(q, q, q, mask=short, backend="sdpa"), reference(q, q, q, mask=short))
    window = masks.sliding_window(5) & masks.documents([40, 24])
    assert_close(attention(q, q, q, mask=window, backend="sdpa"), reference(q, q, q, mask=window))


@pytest.mark.parametrize(("block_q", "product_q"), [(3, 2), (4, 8)])
def test_score_term_without_gradients_equals_the_reference(block_q: int, product_q: int) -> None:
    # A relative-position term, with a causal mask and a dense bias: per block of queries, the
    # block's term + bias, masked, is torch's float mask.
    q, k, v = randn(2, 2, 10, 8, seed=11), randn(2, 2, 10, 8, seed=12), randn(2, 2, 10, 8, seed=13)
    qv, enc = randn(2, 2, 10, 8, seed=14), randn(2, 19, 8, seed=15)
    term = RelativePositionTerm(qv, enc, 0.5)
    backend = SDPA(block_q=block_q, product_q=product_q, term_keys=4)
    with torch.no_grad():
        got = attention(q, k, v, bias=term, causal=True, backend=backend)
        want = attention(
            q.double(),
            k.double(),
            v.double(),
            bias=RelativePositionTerm(qv.double(), enc.double(), 0.5),
            causal=True,
            backend="reference",
        )
    assert_close(got, want)


# --------------------------------------------------------------------------------------------------
# What it says about a call


def test_check_gives_each_reason_it_cannot_serve() -> None:
    q = randn(1, 2, 4, 8, seed=16)
    assert sdpa_check(call_of(q, q, q, causal=True, bias=torch.zeros(4, 4))) == []
    assert sdpa_check(call_of(q, q, q, return_weights=True, softcap=3.0, sinks=torch.zeros(2))) == [
        "does not return attention weights (only reference does)",
        "torch's kernel has no softcap",
        "torch's kernel has no sinks",
    ]
    term = RelativePositionTerm(
        randn(1, 2, 4, 8, seed=17).requires_grad_(), randn(1, 7, 8, seed=18), 1.0
    )
    (reason,) = sdpa_check(call_of(q, q, q, bias=term))
    assert reason.startswith("serves a score term only without gradients")
    half = q.half()
    half_term = RelativePositionTerm(half, randn(1, 7, 8, seed=18).half(), 1.0)
    (reason,) = sdpa_check(call_of(half, half, half, bias=half_term))
    assert (
        reason
        == "its float mask would round the score term to float16; chunked keeps it in float32"
    )
    bad = q.clone()
    bad[0, 0, 0, 0] = math.nan
    bad.requires_grad_()
    (reason,) = sdpa_check(call_of(bad, q, q, check_finite=True))
    assert reason == (
        "q, k or v hold NaN/inf and gradients are needed: torch's backward would let masked ones "
        "into the gradients"
    )


def test_cost_says_what_it_would_materialise() -> None:
    q, k = randn(1, 2, 3, 8, seed=19), randn(1, 2, 5, 8, seed=20)
    assert sdpa_cost(call_of(q, k, k, causal=True)) == [
        "would materialise a (Tq, Tk) = (3, 5) causal mask: Tq != Tk (3 != 5) and torch's "
        "is_causal is top-left aligned"
    ]
    assert sdpa_cost(call_of(q, q, q, causal=True, bias=torch.zeros(3, 3))) == [
        "would materialise a (Tq, Tk) = (3, 3) causal mask: torch does not take is_causal "
        "together with a mask or bias"
    ]
    bias = torch.zeros(3, 5, requires_grad=True)
    assert sdpa_cost(call_of(q, k, k, bias=bias)) == [
        "would keep the probabilities (..., H, Tq, Tk) = (1, 2, 3, 5) for the backward: torch "
        "computes a bias gradient only in its math kernel"
    ]
    # Nothing to write out: no mask, a causal square call, key padding, a tensor given as is.
    assert sdpa_cost(call_of(q, q, q)) == []
    assert sdpa_cost(call_of(q, q, q, causal=True)) == []
    assert sdpa_cost(call_of(q, k, k, mask=masks.key_padding([4]))) == []
    assert sdpa_cost(call_of(q, k, k, mask=torch.ones(3, 5, dtype=torch.bool))) == []


# --------------------------------------------------------------------------------------------------
# The non-finite policy: served, or handed over visibly


def served(q: Tensor, k: Tensor, v: Tensor, backend: SDPA, **kw: object) -> tuple[Tensor, str, int]:
    before = backend.handovers
    with torch.no_grad(), record_dispatch() as calls:
        out = attention(q, k, v, backend=backend, **kw)  # type: ignore[arg-type]
    assert isinstance(out, Tensor)
    (dispatch,) = calls
    return out, dispatch.served_by, backend.handovers - before


@pytest.mark.parametrize("mask", [masks.key_padding([5]), masks.causal()])
def test_nan_in_a_masked_value_is_handed_to_the_kernel(mask: Mask) -> None:
    q, k, v = randn(1, 2, 6, 8, seed=21), randn(1, 2, 6, 8, seed=22), randn(1, 2, 6, 4, seed=23)
    v[0, 1, 5, 2] = math.nan  # the last key: hidden by both masks from every query but the last
    backend = SDPA()
    out, by, handed = served(q, k, v, backend, mask=mask)
    assert (by, handed) == ("chunked", 1)
    want = reference(q, k, v, mask=mask)
    assert torch.equal(out.isnan(), want.isnan())  # NaN exactly where a visible key's value is NaN
    assert_close(out.nan_to_num(), want.nan_to_num())
    assert "hands the call to chunked if torch's output breaks" in str(
        explain(q, k, v, mask=mask, backend=backend)
    )


def test_with_dropout_the_hand_over_goes_to_the_kernel() -> None:
    # The kernel drops in O(T) memory too: no call needs the materialising reference for it.
    q, k, v = randn(1, 1, 4, 8, seed=24), randn(1, 1, 4, 8, seed=25), randn(1, 1, 4, 4, seed=26)
    v[0, 0, 3] = math.nan
    out, by, handed = served(q, k, v, SDPA(), mask=masks.key_padding([3]), dropout_p=0.5)
    assert (by, handed) == ("chunked", 1)
    assert out.isfinite().all()  # the masked NaN never reaches the output


def test_finite_outputs_and_zeros_the_mask_or_values_explain_are_trusted() -> None:
    q, k, v = randn(1, 2, 6, 8, seed=27), randn(1, 2, 6, 8, seed=28), randn(1, 2, 6, 4, seed=29)
    backend = SDPA()
    out, by, handed = served(q, k, v, backend, causal=True)
    assert (by, handed) == ("sdpa", 0)
    v[0, 0] = 0.0  # the first head's output rows are exactly 0: its values explain it
    out, by, handed = served(q, k, v, backend)
    assert (by, handed) == ("sdpa", 0)
    assert torch.equal(out[0, 0], torch.zeros(6, 4))
    rows = torch.ones(6, 6, dtype=torch.bool)
    rows[2] = False  # a query with no visible key: 0 by the mask
    out, by, handed = served(q, k, randn(1, 2, 6, 4, seed=30), backend, mask=rows)
    assert (by, handed) == ("sdpa", 0)
    assert torch.equal(out[0, :, 2], torch.zeros(2, 4))


def test_a_zero_row_nothing_explains_is_handed_over() -> None:
    # A NaN query whose row torch computes as 0 (or NaN): neither mask nor values explain it.
    q, k, v = randn(1, 1, 4, 8, seed=31), randn(1, 1, 4, 8, seed=32), randn(1, 1, 4, 4, seed=33)
    q[0, 0, 1] = math.nan
    out, by, handed = served(q, k, v, SDPA())
    assert (by, handed) == ("chunked", 1)
    assert bool(out[0, 0, 1].isnan().all())
    assert bool(out[0, 0, [0, 2, 3]].isfinite().all())


def test_repr_and_constructor_checks(no_shape_checks: None) -> None:
    assert repr(SDPA(block_q=64, product_q=16)) == "SDPA(block_q=64, product_q=16)"
    with pytest.raises(ValueError, match="block_q must be >= 1, got 0"):
        SDPA(block_q=0)
    with pytest.raises(TypeError, match=r"term_keys must be an int, got 2\.5"):
        SDPA(term_keys=2.5)  # type: ignore[arg-type]
    assert isinstance(attnkit.backends.SDPA(), attnkit.Backend)


def test_dropout_is_unbiased_and_a_fully_dropped_row_is_not_redrawn() -> None:
    # Query 0 of a causal call sees key 0 only: with dropout 0.5 its output is 2 * v0 or 0, each
    # with probability 1/2. Redrawing the rows that came out 0 (as if torch had hidden a NaN)
    # would bias the mean towards 2 * v0.
    torch.manual_seed(0)
    b, t = 4000, 6
    q = torch.randn(b, 1, t, 4)
    k = torch.randn(b, 1, t, 4)
    v = torch.ones(b, 1, t, 4)
    sdpa = attnkit.backends.SDPA()
    out = attnkit.attention(q, k, v, causal=True, dropout_p=0.5, backend=sdpa)
    assert sdpa.handovers == 0
    mean = float(out[:, 0, 0].mean())
    assert abs(mean - 1.0) < 0.1, mean  # std of the mean: 1 / sqrt(4000) = 0.016


def _check_choice(
    shape: tuple[int, ...], dtype: torch.dtype, chosen: str, words: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """explain() of an inference call of ``shape`` (B, H, Hkv, Tq, Tk, D) picks ``chosen`` and
    says ``words`` of sdpa (None: nothing); the call's q and k/v."""
    if chosen == "chunked" and not attnkit._native.status()[0]:
        pytest.skip("the native kernel is not available: chunked would run the eager kernel")
    b, h, hkv, tq, tk, d = shape
    q = torch.zeros(b, h, tq, d, dtype=dtype)
    kv = torch.zeros(b, hkv, tk, d, dtype=dtype)
    report = attnkit.explain(q, kv, kv)
    assert report.chosen == chosen
    slower = " ".join(report.slower["sdpa"])
    assert (words in slower) if words else not slower
    return q, kv


@pytest.mark.parametrize(
    ("shape", "dtype", "chosen", "words"),
    [
        # (B, H, Hkv, Tq, Tk, D)
        ((8, 32, 8, 1, 4096, 128), torch.float32, "chunked", "decodes slower on CPUs: 256 MiB"),
        ((1, 8, 8, 1, 512, 64), torch.float32, "sdpa", None),  # 2 MiB: torch's smaller call wins
        ((1, 8, 8, 256, 256, 64), torch.float32, "chunked", "runs slower on CPUs at this size"),
        ((1, 8, 8, 64, 64, 64), torch.float64, "sdpa", None),  # 32768 scores
        ((1, 8, 8, 1024, 1024, 64), torch.bfloat16, "sdpa", None),  # torch's own bf16 kernel
        # bfloat16/float16 decode steps: the native kernel reads the cache once, as it is
        ((8, 32, 8, 1, 4096, 128), torch.bfloat16, "chunked", "128 MiB of bfloat16 keys"),
        ((1, 8, 8, 4, 4096, 64), torch.float16, "chunked", "decodes slower on CPUs: 8 MiB"),
        ((1, 8, 8, 1, 512, 64), torch.float16, "chunked", "1 MiB of float16 keys"),
        ((1, 8, 8, 1, 128, 64), torch.bfloat16, "sdpa", None),  # 0.25 MiB: torch's smaller call
        ((1, 8, 8, 256, 256, 64), torch.float16, "chunked", "torch's float16 CPU forward"),
    ],
)
def test_auto_runs_inference_where_the_cost_model_says_it_is_faster(
    monkeypatch: pytest.MonkeyPatch,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    chosen: str,
    words: str | None,
) -> None:
    monkeypatch.setattr(sdpa_module, "_register_tiles", lambda: True)  # a CPU with AVX-512
    monkeypatch.setattr(sdpa_module, "_products_in", lambda dtype: False)  # no bf16 products
    monkeypatch.setattr(sdpa_module, "_matrix_unit", lambda: False)
    monkeypatch.setattr(sdpa_module, "_bf16_dot", lambda: False)
    q, kv = _check_choice(shape, dtype, chosen, words)
    half = dtype in (torch.bfloat16, torch.float16)
    with torch.enable_grad():  # training: torch's CPU backward is the slow half, whatever the size
        q.requires_grad_(not half)
        assert ("trains slower" in " ".join(attnkit.explain(q, kv, kv).slower["sdpa"])) == (
            not half
        )


def _bf16_products_cpu(monkeypatch: pytest.MonkeyPatch, matrix_unit: bool) -> None:
    """auto's view of a CPU with AVX-512 and bfloat16 products: with AMX (torch's bfloat16
    kernels on the matrix unit) or with AVX512-BF16 alone (the native kernel's dot products)."""
    monkeypatch.setattr(sdpa_module, "_register_tiles", lambda: True)
    monkeypatch.setattr(
        sdpa_module, "_products_in", lambda dtype: matrix_unit and dtype == torch.bfloat16
    )
    monkeypatch.setattr(sdpa_module, "_matrix_unit", lambda: matrix_unit)
    monkeypatch.setattr(sdpa_module, "_bf16_dot", lambda: not matrix_unit)


# (B, H, Hkv, Tq, Tk, D), dtype, chosen, words of sdpa's reason
_AMX_CHOICES = [
    # torch's kernels are fast in every dtype there
    ((8, 32, 8, 1, 4096, 128), torch.float32, "chunked", "256 MiB of keys and values shared"),
    ((1, 32, 8, 1, 4096, 128), torch.float32, "chunked", "shared by 4 query heads"),
    ((1, 32, 32, 1, 1024, 128), torch.float32, "sdpa", None),  # one query head per cache
    ((1, 8, 2, 1, 4096, 64), torch.float32, "sdpa", None),  # 4 MiB
    ((8, 32, 8, 1, 4096, 128), torch.bfloat16, "chunked", "128 MiB of bfloat16 keys"),
    ((1, 32, 8, 1, 4096, 128), torch.bfloat16, "chunked", "16 MiB of bfloat16 keys"),
    ((1, 32, 8, 1, 2048, 128), torch.bfloat16, "sdpa", None),  # 8 MiB
    ((1, 32, 32, 1, 4096, 128), torch.bfloat16, "sdpa", None),  # one query head per cache
    ((1, 8, 8, 256, 256, 64), torch.float32, "sdpa", None),  # no mask: nothing to skip
    ((1, 8, 8, 1024, 1024, 64), torch.float32, "sdpa", None),  # at any size
    ((1, 8, 8, 256, 256, 64), torch.float16, "sdpa", None),  # torch's float16 is fast here
    # but not its float16 decode (no float16 products): the rule of other CPUs
    ((1, 8, 8, 1, 4096, 64), torch.float16, "chunked", "8 MiB of float16 keys"),
    ((1, 8, 8, 512, 512, 64), torch.bfloat16, "sdpa", None),  # below 1,024 queries
]
_DOT_CHOICES = [
    # torch's float32 kernels as fast as with AMX, but for grouped decode steps from 4 MiB; its
    # bfloat16 and float16 ones as slow as without products
    ((8, 32, 8, 1, 4096, 128), torch.float32, "chunked", "from 4 MiB on CPUs with AVX512"),
    ((1, 8, 2, 1, 4096, 64), torch.float32, "chunked", "4 MiB of keys and values shared"),
    ((1, 8, 2, 1, 2048, 64), torch.float32, "sdpa", None),  # 2 MiB
    ((1, 8, 8, 1, 4096, 64), torch.float32, "sdpa", None),  # one query head per cache
    ((1, 8, 8, 256, 256, 64), torch.float32, "sdpa", None),  # no mask: nothing to skip
    ((1, 8, 8, 512, 512, 64), torch.float32, "sdpa", None),  # below 8 * 768 * 768 scores
    # but from there the native kernel's register tiles outrun torch's BLAS calls
    ((1, 8, 8, 768, 768, 64), torch.float32, "chunked", "4718592 scores without a mask"),
    ((1, 8, 8, 1024, 1024, 64), torch.float64, "chunked", "AVX512-BF16 and no AMX"),
    ((1, 32, 32, 1, 4096, 128), torch.bfloat16, "chunked", "64 MiB of bfloat16 keys"),
    ((1, 8, 8, 1, 512, 64), torch.bfloat16, "chunked", "1 MiB of bfloat16 keys"),
    ((1, 8, 8, 1, 128, 64), torch.bfloat16, "sdpa", None),  # 0.25 MiB
    ((1, 8, 8, 128, 128, 64), torch.bfloat16, "chunked", "AVX512-BF16's dot products"),
    ((1, 8, 8, 4096, 4096, 128), torch.bfloat16, "chunked", "AVX512-BF16's dot products"),
    ((1, 8, 8, 64, 64, 64), torch.bfloat16, "sdpa", None),  # below 8 x 128 x 128 scores
    ((1, 8, 8, 256, 256, 64), torch.float16, "chunked", "torch's float16 CPU forward"),
    ((1, 8, 8, 1, 4096, 64), torch.float16, "chunked", "8 MiB of float16 keys"),
]


@pytest.mark.parametrize(
    ("matrix_unit", "shape", "dtype", "chosen", "words"),
    [(True, *c) for c in _AMX_CHOICES] + [(False, *c) for c in _DOT_CHOICES],
)
def test_on_cpus_with_bfloat16_products_auto_takes_the_faster_backend(
    monkeypatch: pytest.MonkeyPatch,
    matrix_unit: bool,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    chosen: str,
    words: str | None,
) -> None:
    # matrix_unit: an Intel Xeon with AMX; else AVX512-BF16 alone (AMD's Zen 4)
    _bf16_products_cpu(monkeypatch, matrix_unit=matrix_unit)
    _check_choice(shape, dtype, chosen, words)
    # A causal prefill still halves its work in the native kernel (where it is available).
    full = torch.zeros(1, 8, 1024, 64)
    causal = attnkit.explain(full, full, full, causal=True).chosen
    assert causal == ("chunked" if attnkit._native.status()[0] else "sdpa")


def test_on_cpus_with_avx512_bf16_alone_auto_trains_bfloat16_natively(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch's backward is its slow half without AMX, whatever the size
    if not attnkit._native.status()[0]:
        pytest.skip("the native kernel is not available: chunked would run the eager kernel")
    _bf16_products_cpu(monkeypatch, matrix_unit=False)
    q = torch.zeros(1, 8, 256, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.enable_grad():
        report = attnkit.explain(q, q.detach(), q.detach())
    assert report.chosen == "chunked"
    assert "without a matrix unit for bfloat16" in " ".join(report.slower["sdpa"])


@pytest.mark.parametrize("tiles", [False, True])
def test_without_avx512_full_attention_inference_stays_with_torch(
    monkeypatch: pytest.MonkeyPatch, tiles: bool
) -> None:
    # Without register tiles a blocked kernel multiplies through the BLAS as torch does: with no
    # mask there is nothing for it to skip, so torch keeps the call; a causal call it halves.
    if not attnkit._native.status()[0]:
        pytest.skip("the native kernel is not available: chunked would run the eager kernel")
    monkeypatch.setattr(sdpa_module, "_register_tiles", lambda: tiles)
    monkeypatch.setattr(sdpa_module, "_products_in", lambda dtype: False)
    monkeypatch.setattr(sdpa_module, "_matrix_unit", lambda: False)
    monkeypatch.setattr(sdpa_module, "_bf16_dot", lambda: False)
    q = torch.zeros(1, 8, 1024, 64)
    assert attnkit.explain(q, q, q).chosen == ("chunked" if tiles else "sdpa")
    assert attnkit.explain(q, q, q, causal=True).chosen == "chunked"
    assert attnkit.explain(q, q, q, mask=masks.sliding_window(64)).chosen == "chunked"


@pytest.mark.parametrize("products", [False, True])
def test_auto_trains_bfloat16_natively_on_cpus_without_bfloat16_products(
    monkeypatch: pytest.MonkeyPatch, products: bool
) -> None:
    # torch's bfloat16 backward is its slow half where the CPU has no bfloat16 products; where it
    # has them, torch's kernels use them and keep the call (as they keep float16 prefill).
    if not attnkit._native.status()[0]:
        pytest.skip("the native kernel is not available: chunked would run the eager kernel")
    monkeypatch.setattr(sdpa_module, "_products_in", lambda dtype: products)
    monkeypatch.setattr(sdpa_module, "_matrix_unit", lambda: False)
    monkeypatch.setattr(sdpa_module, "_bf16_dot", lambda: False)
    q = torch.zeros(1, 8, 256, 64, dtype=torch.bfloat16, requires_grad=True)
    kv = torch.zeros(1, 8, 256, 64, dtype=torch.bfloat16)
    with torch.enable_grad():
        report = attnkit.explain(q, kv, kv)
    slower = " ".join(report.slower["sdpa"])
    assert (
        "trains slower on CPUs: torch's CPU backward is its slow half in bfloat16" in slower
    ) == (not products)
    assert report.chosen == ("sdpa" if products else "chunked")
    half = torch.zeros(1, 8, 256, 64, dtype=torch.float16)
    assert attnkit.explain(half, half, half).chosen == ("sdpa" if products else "chunked")
    with torch.enable_grad():
        report = attnkit.explain(half.requires_grad_(), half, half)
    assert ("slow half in float16" in " ".join(report.slower["sdpa"])) == (not products)


@pytest.mark.parametrize(
    ("shape", "dtype", "chosen", "words"),
    [
        # (B, H, Hkv, Tq, Tk, D)
        ((1, 8, 8, 1024, 1024, 64), torch.bfloat16, "chunked", "from 1024 queries and keys"),
        ((1, 8, 8, 4096, 4096, 128), torch.bfloat16, "chunked", "matrix unit (AMX)"),
        ((4, 8, 8, 512, 512, 64), torch.bfloat16, "sdpa", None),  # torch's smaller call wins
        ((1, 8, 8, 1024, 1024, 80), torch.bfloat16, "sdpa", None),  # not in the tiles
        ((1, 8, 8, 1024, 1024, 64), torch.float16, "sdpa", None),  # no float16 products there
    ],
)
def test_on_cpus_with_a_matrix_unit_auto_sends_long_bfloat16_inference_to_the_native_kernel(
    monkeypatch: pytest.MonkeyPatch,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    chosen: str,
    words: str | None,
) -> None:
    _bf16_products_cpu(monkeypatch, matrix_unit=True)
    _check_choice(shape, dtype, chosen, words)


def test_auto_trains_bfloat16_natively_on_cpus_with_a_matrix_unit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # There the native kernel runs the products of both passes on the unit; torch keeps the
    # forward alone (its bfloat16 prefill is faster) and float16 (no products on the unit).
    if not attnkit._native.status()[0]:
        pytest.skip("the native kernel is not available: chunked would run the eager kernel")
    monkeypatch.setattr(sdpa_module, "_products_in", lambda dtype: dtype == torch.bfloat16)
    monkeypatch.setattr(sdpa_module, "_matrix_unit", lambda: True)
    monkeypatch.setattr(sdpa_module, "_bf16_dot", lambda: False)
    q = torch.zeros(4, 8, 512, 64, dtype=torch.bfloat16, requires_grad=True)
    kv = torch.zeros(4, 8, 512, 64, dtype=torch.bfloat16)
    with torch.enable_grad():
        report = attnkit.explain(q, kv, kv)
        assert report.chosen == "chunked"
        assert "matrix unit (AMX)" in " ".join(report.slower["sdpa"])
        # A small step stays with torch: its per-call costs are smaller.
        small = q[:1, :, :256].detach().requires_grad_()
        assert attnkit.explain(small, kv[:1, :, :256], kv[:1, :, :256]).chosen == "sdpa"
    assert attnkit.explain(q.detach(), kv, kv).chosen == "sdpa"
