"""attention(): conventions, return values, the registry, auto's choices, explain(), bad input."""

from __future__ import annotations

import re

import jaxtyping
import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import BackendError, attention, explain, masks
from attnkit.backends.flash_package import flash_attn_installed
from attnkit.testing import assert_close

from .helpers import brute_force, needs_cxx


def qkv(
    b: int = 2, h: int = 4, hkv: int = 4, tq: int = 5, tk: int = 5, d: int = 8, **kw: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.randn(b, h, tq, d, **kw),
        torch.randn(b, hkv, tk, d, **kw),
        torch.randn(b, hkv, tk, d, **kw),
    )


# --------------------------------------------------------------------------------------------------
# Conventions


def test_mask_true_means_may_attend() -> None:
    q, k, v = qkv(tq=3, tk=4, dtype=torch.float64)
    mask = torch.tensor([True, False, True, False])
    out = attention(q, k, v, mask=mask)
    # Dropping the masked keys altogether gives the same result.
    assert_close(out, attention(q, k[..., [0, 2], :], v[..., [0, 2], :]))


def test_causal_is_bottom_right_and_equals_its_mask() -> None:
    q, k, v = qkv(tq=3, tk=7, dtype=torch.float64)
    got = attention(q, k, v, causal=True)
    assert_close(got, attention(q, k, v, mask=masks.causal_mask(3, 7)))
    # The last query sees every key; the first sees all but the last two.
    assert_close(got[..., -1, :], attention(q[..., -1:, :], k, v)[..., 0, :])
    assert_close(got[..., 0, :], attention(q[..., :1, :], k[..., :5, :], v[..., :5, :])[..., 0, :])


def test_causal_and_mask_combine_by_and() -> None:
    q, k, v = qkv(tq=6, tk=6, dtype=torch.float64)
    pad = masks.padding_mask([4, 6])
    got = attention(q, k, v, mask=pad, causal=True)
    assert_close(got, attention(q, k, v, mask=masks.combine_masks(pad, masks.causal_mask(6))))


def test_bias_is_added_to_scaled_scores() -> None:
    q, k, v = qkv(tq=3, tk=4, dtype=torch.float64)
    bias = torch.randn(4, 3, 4, dtype=torch.float64)
    out, w = attention(q, k, v, bias=bias, scale=0.3, return_weights=True)
    want = torch.softmax(q @ k.transpose(-1, -2) * 0.3 + bias, -1)
    assert_close(w, want)
    assert_close(out, want @ v)


def test_weights_match_brute_force_and_sum_to_one() -> None:
    q, k, v = qkv(tq=4, tk=6, dtype=torch.float64)
    mask = torch.rand(2, 1, 4, 6) < 0.6
    mask[1, 0, 2] = False
    out, w = attention(q, k, v, mask=mask, causal=True, return_weights=True)
    bf_out, bf_w = brute_force(q, k, v, mask=mask, causal=True)
    assert_close(out, bf_out)
    assert_close(w, bf_w)
    rows = w.sum(-1)
    visible = (mask & masks.causal_mask(4, 6)).expand(2, 4, 4, 6).any(-1)
    assert_close(rows, visible.double())  # 1 where a key is visible, 0 for the empty row


def test_batch_dims_any_number() -> None:
    q = torch.randn(2, 3, 4, 5, 8, dtype=torch.float64)
    k = torch.randn(2, 3, 4, 6, 8, dtype=torch.float64)
    out = attention(q, k, k)
    assert out.shape == (2, 3, 4, 5, 8)
    assert_close(out[1, 2], attention(q[1, 2], k[1, 2], k[1, 2]))  # (H, T, D): no batch dims


def test_return_weights_returns_pair_and_uses_reference() -> None:
    q, k, v = qkv()
    res = attention(q, k, v, return_weights=True)
    assert isinstance(res, tuple)
    assert len(res) == 2
    out, w = res
    assert w.shape == (2, 4, 5, 5)
    assert_close(
        out.double(), attention(q, k, v, backend="reference").double(), dtype=torch.float32
    )


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "reference"])
def test_half_precision_returns_input_dtype_and_the_float64_values(backend: str) -> None:
    q, k, v = qkv(dtype=torch.bfloat16)
    spec = attention(q.double(), k.double(), v.double(), causal=True, backend="reference")
    out = attention(q, k, v, causal=True, backend=backend)
    assert out.dtype == torch.bfloat16
    assert_close(out, spec)
    if backend == "reference":
        _, w = attention(q, k, v, return_weights=True, backend=backend)
        _, w_spec = attention(q.double(), k.double(), v.double(), return_weights=True)
        assert w.dtype == torch.bfloat16
        assert_close(w, w_spec)


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "reference"])
def test_default_scale_is_one_over_root_dk(backend: str) -> None:
    # Against softmax(q k^T / sqrt(Dk)) v written out, with Dk != Dv, so a scale taken from the
    # wrong size (or none at all) shows.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 5, 9, dtype=torch.float64, generator=g) * 2
    k = torch.randn(1, 2, 7, 9, dtype=torch.float64, generator=g)
    v = torch.randn(1, 2, 7, 4, dtype=torch.float64, generator=g)
    want = torch.softmax(q @ k.transpose(-1, -2) / 3.0, -1) @ v
    assert_close(attention(q, k, v, backend=backend), want)


# --------------------------------------------------------------------------------------------------
# The registry and auto


CHOICES = [
    ({}, "sdpa"),
    ({"causal": True}, "sdpa"),
    ({"mask": torch.ones(2, 1, 1, 5, dtype=torch.bool)}, "sdpa"),
    ({"bias": torch.zeros(4, 5, 5)}, "sdpa"),
    ({"dropout_p": 0.1}, "sdpa"),
    ({"return_weights": True}, "reference"),
    # causal with a padding mask: torch would need a materialised (B, 1, Tq, Tk) mask.
    ({"causal": True, "mask": torch.ones(2, 1, 1, 5, dtype=torch.bool)}, "chunked"),
    # a bias that requires grad runs torch's math kernel, which keeps the probabilities.
    ({"bias": torch.zeros(4, 5, 5, requires_grad=True)}, "chunked"),
    # dropout and a materialised mask: the kernel's dropout needs no (Tq, Tk) mask or weights.
    ({"causal": True, "mask": torch.ones(5, 5, dtype=torch.bool), "dropout_p": 0.1}, "chunked"),
]


@pytest.mark.parametrize(("kwargs", "expected"), CHOICES)
def test_auto_choice(kwargs: dict[str, object], expected: str) -> None:
    q, k, v = qkv()
    assert explain(q, k, v, **kwargs).chosen == expected


def test_auto_causal_with_fewer_queries_avoids_materialising() -> None:
    q, k, v = qkv(tq=3, tk=9)
    assert explain(q, k, v, causal=True).chosen == "chunked"
    assert explain(q[..., -1:, :], k, v, causal=True).chosen == "sdpa"  # one query sees all


def test_auto_really_runs_the_chosen_backend() -> None:
    calls = []

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
        calls.append(kw)
        return torch.zeros(*q.shape[:-1], v.size(-1))

    attnkit.register_backend("spy", spy, auto=True)
    try:
        assert attnkit.available_backends()[0] == "spy"
        q, k, v = qkv()
        assert torch.equal(attention(q, k, v), torch.zeros(2, 4, 5, 8))
        assert len(calls) == 1
        assert calls[0]["scale"] == pytest.approx(8**-0.5)
    finally:
        attnkit.unregister_backend("spy")
    assert "spy" not in attnkit.available_backends()


def test_user_backend_with_check_is_skipped_by_auto_and_refused_when_forced() -> None:
    def never(call: attnkit.AttentionCall) -> list[str]:
        return [f"only handles Tq > 100, got {call.q_len}"]

    attnkit.register_backend("big", lambda q, k, v, **kw: q, check=never, auto=True)
    try:
        q, k, v = qkv()
        assert explain(q, k, v).chosen == "sdpa"
        with pytest.raises(BackendError, match="only handles Tq > 100, got 5"):
            attention(q, k, v, backend="big")
    finally:
        attnkit.unregister_backend("big")


def test_register_checks_check_and_cost_and_keeps_built_ins() -> None:
    fn = lambda q, k, v, **kw: q  # noqa: E731
    with pytest.raises(TypeError, match=r"backend 'x': check must be a function of the call"):
        attnkit.register_backend("x", fn, check=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"backend 'x': cost must be a function of the call"):
        attnkit.register_backend("x", fn, cost="cheap")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="backend 'x': auto must be a bool, got 1"):
        attnkit.register_backend("x", fn, auto=1)  # type: ignore[arg-type]
    for name in ("sdpa", "chunked", "reference"):
        with pytest.raises(
            ValueError, match=f"backend '{name}' is built in and cannot be replaced"
        ):
            attnkit.register_backend(name, fn, replace=True)
    assert "x" not in attnkit.available_backends()  # nothing half-registered
    assert attnkit.available_backends() == ["sdpa", "flex", "chunked", "reference"]


def test_replacing_a_user_backend_keeps_its_place_in_auto() -> None:
    fn = lambda q, k, v, **kw: torch.zeros(*q.shape[:-1], v.size(-1))  # noqa: E731
    attnkit.register_backend("first", fn, auto=True)
    attnkit.register_backend("second", fn, auto=True)
    try:
        order = attnkit.available_backends()
        assert order[:2] == ["second", "first"]
        attnkit.register_backend("first", fn, auto=True, replace=True)
        assert attnkit.available_backends() == order
    finally:
        attnkit.unregister_backend("first")
        attnkit.unregister_backend("second")


def test_a_check_returning_nonsense_is_named() -> None:
    attnkit.register_backend("odd", lambda q, k, v, **kw: q, check=lambda call: "no")  # type: ignore[arg-type, return-value]
    try:
        q, k, v = qkv()
        with pytest.raises(TypeError, match=r"backend 'odd': check\(call\) must return a list"):
            attention(q, k, v, backend="odd")
    finally:
        attnkit.unregister_backend("odd")


def test_registry_changes_while_other_threads_call_attention() -> None:
    import threading

    q, k, v = qkv(tq=3, tk=3)
    want = attention(q, k, v)
    errors: list[BaseException] = []
    stop = threading.Event()

    def call() -> None:
        while not stop.is_set():
            try:
                assert_close(attention(q, k, v), want)
                explain(q, k, v)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)
                return

    def churn() -> None:
        fn = lambda q, k, v, **kw: attention(q, k, v, backend="sdpa")  # noqa: E731
        for i in range(300):
            attnkit.register_backend(f"t{i % 3}", fn, auto=i % 2 == 0, replace=True)
            if i % 5 == 0:
                attnkit.unregister_backend(f"t{i % 3}")

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        churn()
    finally:
        stop.set()
        for t in threads:
            t.join()
        for name in list(attnkit.available_backends()):
            if name.startswith("t"):
                attnkit.unregister_backend(name)
    assert not errors, errors[0]


@pytest.mark.usefixtures("no_shape_checks")
def test_registry_errors() -> None:
    assert attnkit.available_backends() == ["sdpa", "flex", "chunked", "reference"]
    with pytest.raises(ValueError, match="'sdpa' is built in and cannot be replaced"):
        attnkit.register_backend("sdpa", lambda *a, **k: None, replace=True)
    with pytest.raises(ValueError, match="other than 'auto'"):
        attnkit.register_backend("auto", lambda *a, **k: None)
    with pytest.raises(TypeError, match="fn must be callable, got int"):
        attnkit.register_backend("x", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="built in"):
        attnkit.unregister_backend("reference")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        attnkit.unregister_backend("nope")


def test_forced_backend_that_cannot_raises_with_reasons() -> None:
    q, k, v = qkv()
    with pytest.raises(BackendError) as err:
        attention(q, k, v, return_weights=True, backend="chunked")
    msg = str(err.value)
    assert "backend 'chunked' cannot serve this call" in msg
    assert "does not return attention weights (return_weights=True" in msg
    assert "q (2, 4, 5, 8)" in msg  # the call is quoted
    with pytest.raises(BackendError, match="does not return attention weights"):
        attention(q, k, v, return_weights=True, backend="sdpa")


def test_unknown_backend_lists_the_known_ones() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match="unknown backend 'flash'; choose 'auto' or one of: sdpa"):
        attention(q, k, v, backend="flash")


def test_explain_report_reads_well() -> None:
    q = torch.empty(2, 8, 128, 64, device="meta")
    kv = torch.empty(2, 2, 256, 64, device="meta")
    report = str(
        explain(
            q, kv, kv, mask=torch.ones(2, 1, 1, 256, dtype=torch.bool, device="meta"), causal=True
        )
    )
    assert report.splitlines() == [
        "attention call: q (2, 8, 128, 64), k (2, 2, 256, 64), v (2, 2, 256, 64) float32 on meta, "
        "mask (2, 1, 1, 256), causal",
        "auto picks: chunked",
        "  sdpa       avoided: would materialise a (Tq, Tk) = (128, 256) causal mask: "
        "Tq != Tk (128 != 256) and torch's is_causal is top-left aligned",
        "  flex       cannot: torch's compiled FlexAttention runs on CUDA, ROCm and XPU "
        "(and on the CPU for inference), not on meta",
        "  chunked    chosen",
        "  reference  avoided: would materialise the scores (..., H, Tq, Tk) = (2, 8, 128, 256); "
        "auto takes it only when nothing else can",
    ]


# --------------------------------------------------------------------------------------------------
# Bad input: the message names the argument and quotes what it saw


BAD = [
    (
        lambda q, k, v: ([q, k, v], {"mask": torch.zeros(5, 5)}),
        TypeError,
        "mask must be a bool tensor, got float32; a float tensor of additive scores belongs in "
        "bias=",
    ),
    (
        lambda q, k, v: ([q, k, v], {"mask": torch.zeros(5, 5, dtype=torch.int64)}),
        TypeError,
        "mask must be a bool tensor, got int64; convert it with mask.bool()",
    ),
    (
        lambda q, k, v: ([q, k, v], {"bias": torch.zeros(5, 5, dtype=torch.bool)}),
        TypeError,
        "bias must be a float tensor, got bool; a boolean mask belongs in mask=",
    ),
    (
        lambda q, k, v: ([q, k, v], {"bias": torch.zeros(5, 5, dtype=torch.float64)}),
        TypeError,
        "bias must have the dtype of q (float32), got float64",
    ),
    (
        lambda q, k, v: ([q, k, v], {"mask": torch.ones(3, 5, 5, dtype=torch.bool)}),
        ValueError,
        "mask of shape (3, 5, 5) does not broadcast to (..., H, Tq, Tk) = (2, 4, 5, 5)",
    ),
    (
        lambda q, k, v: ([q, k, v], {"bias": torch.zeros(1, 1, 1, 5, 6)}),
        ValueError,
        "bias of shape (1, 1, 1, 5, 6) does not broadcast to (..., H, Tq, Tk) = (2, 4, 5, 5)",
    ),
    (
        lambda q, k, v: ([q[0, 0], k, v], {}),
        ValueError,
        "q must have shape (..., H, Tq, Dk) with 3 or more dims, got 2-d (5, 8)",
    ),
    (
        lambda q, k, v: ([q, k[0], v], {}),
        ValueError,
        "k must have as many dims as q (4), got 3-d (4, 5, 8)",
    ),
    (lambda q, k, v: ([q, k[:1], v], {}), ValueError, "q, k and v must share their batch dims"),
    (
        lambda q, k, v: ([q, k, v[..., :3, :]], {}),
        ValueError,
        "k and v must agree on (Hkv, Tk): got k (2, 4, 5, 8) and v (2, 4, 3, 8)",
    ),
    (
        lambda q, k, v: ([q, k[..., :6], v], {}),
        ValueError,
        "q and k must share the last dim Dk: got q (2, 4, 5, 8) (Dk=8) and k (2, 4, 5, 6) (Dk=6)",
    ),
    (
        lambda q, k, v: ([q, k[:, :3], v[:, :3]], {}),
        ValueError,
        "the heads of q (H=4) must be a multiple of the heads of k and v (Hkv=3)",
    ),
    (
        lambda q, k, v: ([q, k.double(), v], {}),
        TypeError,
        "q, k and v must share a dtype, got q float32, k float64, v float32",
    ),
    (
        lambda q, k, v: ([q.long(), k.long(), v.long()], {}),
        TypeError,
        "q must be float16, bfloat16, float32 or float64, got int64",
    ),
    (
        lambda q, k, v: ([q, k.to("meta"), v], {}),
        ValueError,
        "q, k and v must be on one device, got q on cpu, k on meta, v on cpu",
    ),
    (
        lambda q, k, v: ([q, k, v], {"dropout_p": 1.0}),
        ValueError,
        "dropout_p must be in [0, 1), got 1.0",
    ),
    (
        lambda q, k, v: ([q, k, v], {"dropout_p": -0.1}),
        ValueError,
        "dropout_p must be in [0, 1), got -0.1",
    ),
    (
        lambda q, k, v: ([q, k, v], {"dropout_p": "0.1"}),
        TypeError,
        "dropout_p must be a float in [0, 1), got '0.1'",
    ),
    (
        lambda q, k, v: ([q, k, v], {"scale": float("nan")}),
        ValueError,
        "scale must be finite and at most 3.4e+38 in magnitude (the largest float32, in which the "
        "scores are computed), got nan",
    ),
    (lambda q, k, v: ([q, k, v], {"causal": 1}), TypeError, "causal must be a bool, got 1"),
    (
        lambda q, k, v: ([q, k, v], {"backend": 3}),
        TypeError,
        "backend must be 'auto', the name of a registered backend or an attnkit.Backend, got int",
    ),
    (lambda q, k, v: ([q.numpy(), k, v], {}), TypeError, "q must be a torch.Tensor, got ndarray"),
    (
        lambda q, k, v: ([q, k, v], {"mask": torch.ones(5, 5, dtype=torch.bool, device="meta")}),
        ValueError,
        "mask is on meta but q is on cpu",
    ),
    (
        lambda q, k, v: (
            [q, k, v],
            {"mask": masks.causal() & torch.ones(5, 5, dtype=torch.bool, device="meta")},
        ),
        ValueError,
        "mask holds a tensor on meta but q is on cpu",
    ),
    (
        lambda q, k, v: ([q, k, v], {"bias": torch.zeros(5, 5, device="meta")}),
        ValueError,
        "bias is on meta but q is on cpu",
    ),
]


@pytest.mark.usefixtures("no_shape_checks")
@pytest.mark.parametrize(("make", "exc", "message"), BAD)
def test_bad_input(make, exc: type[Exception], message: str) -> None:  # type: ignore[no-untyped-def]
    args, kwargs = make(*qkv())
    with pytest.raises(exc, match=re.escape(message)):
        attention(*args, **kwargs)
    with pytest.raises(exc, match=re.escape(message)):
        explain(*args, **kwargs)


def test_shape_annotations_are_checked_at_runtime() -> None:
    # With ATTNKIT_SHAPE_CHECKS=1 (set by conftest.py) a q/k mismatch is caught by the annotations
    # themselves, before attnkit's own validation: the annotations cannot drift from the code.
    q, k, v = qkv()
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'k'"):
        attention(q, k[..., :6], v)


# --------------------------------------------------------------------------------------------------
# Tracing: under torch.compile / torch.export auto avoids the chunked kernel's Python block loop


@needs_cxx
def test_compile_fullgraph_and_export_match_eager() -> None:
    q, k, _ = qkv(tq=16, tk=16)
    pad = masks.padding_mask([16, 11])

    class Attend(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return attention(q, k, k, mask=m, causal=True)

    eager = Attend()(q, k, pad)
    assert explain(q, k, k, mask=pad, causal=True).chosen == "chunked"  # eager: no O(T^2) mask
    compiled = torch.compile(Attend(), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, pad), eager)
    exported = torch.export.export(Attend(), (q, k, pad)).module()
    torch.testing.assert_close(exported(q, k, pad), eager)


@pytest.mark.skipif(flash_attn_installed(), reason="the flash-attn package is installed")
def test_a_builtin_backend_this_process_lacks_says_what_it_needs() -> None:
    # Without the flash-attn package the flash_attn backend is not registered: naming it used to
    # answer "unknown backend ... a backend of your own must be registered".
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="where the flash-attn package is installed") as err:
        attention(q, q, q, backend="flash_attn")
    assert "a backend of your own" not in str(err.value)


def test_a_refused_backend_under_compile_fullgraph_says_why() -> None:
    # The refusal's report used to gather every backend's notes, one of which reads a block plan
    # under a lock that dynamo cannot enter: the error named a lock, not the reason.
    q = torch.randn(1, 2, 8, 4)

    def attend(q: Tensor) -> Tensor:
        return attention(q, q, q, mask=masks.sliding_window(2), backend="flex")

    with pytest.raises(Exception, match=re.escape("torch.compile/export cannot trace")) as err:
        torch.compile(attend, fullgraph=True, backend="eager")(q)
    assert "context manager" not in str(err.value)


@pytest.mark.usefixtures("no_shape_checks")
def test_autocast_dtype_errors_say_what_autocast_did() -> None:
    # float64 stays float64 under autocast while float32 becomes bfloat16: the message says so,
    # instead of naming a dtype the caller never passed without a word about why.
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    bias = torch.zeros(3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError) as err:
        attention(q, q, q, bias=bias)
    message = str(err.value)
    assert "bias must have the dtype of q (float64), got bfloat16" in message
    assert "inside torch.autocast, float16/bfloat16/float32 inputs are cast to bfloat16" in message


# --------------------------------------------------------------------------------------------------
# The log-sum-exp, and merging partial attentions


def _lse_formula(q: Tensor, k: Tensor, mask: Tensor, scale: float, sinks: Tensor | None) -> Tensor:
    """logsumexp over the visible scores (and the sink), written out in float64."""
    g = q.size(-3) // k.size(-3)
    s = (q @ k.repeat_interleave(g, -3).transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[:, None, None].expand(*s.shape[:-1], 1)], -1)
    return torch.logsumexp(s, -1)


@pytest.mark.parametrize("backend", ["chunked", "reference", "auto"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_lse_is_the_log_of_the_softmax_denominator(backend: str, with_sinks: bool) -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 11, 8, dtype=torch.float64, generator=g)
    k = torch.randn(2, 2, 13, 8, dtype=torch.float64, generator=g)
    sinks = torch.randn(4, dtype=torch.float64, generator=g) if with_sinks else None
    mask = masks.causal() & masks.key_padding([13, 0])  # row 1 sees nothing
    out, lse = attention(q, k, k, mask=mask, sinks=sinks, return_lse=True, backend=backend)
    dense = mask.dense(11, 13, batch_size=2)
    want = _lse_formula(q, k, dense, 8**-0.5, sinks)
    torch.testing.assert_close(lse, want)
    if not with_sinks:
        assert (lse[1] == float("-inf")).all()
    torch.testing.assert_close(out, attention(q, k, k, mask=mask, sinks=sinks, backend="reference"))


@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_merged_halves_equal_the_whole_call_forward_and_backward(backend: str) -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 9, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 20, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 20, 8, dtype=torch.float64, generator=g, requires_grad=True)
    window = masks.sliding_window(4)  # the first half of the keys is out of reach of most queries
    whole = attention(q, k, v, mask=window, backend="reference")
    dense = window.dense(9, 20)
    parts = [
        attention(
            q, k[..., a:b, :], v[..., a:b, :], mask=dense[..., a:b], return_lse=True,
            backend=backend,
        )
        for a, b in ((0, 10), (10, 20))
    ]  # fmt: skip
    out, lse = attnkit.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(out, whole)
    torch.testing.assert_close(lse, _lse_formula(q, k, dense, 8**-0.5, None))
    dout = torch.randn_like(whole)
    want = torch.autograd.grad(whole, (q, k, v), dout)
    got = torch.autograd.grad(out, (q, k, v), dout)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w)


def test_lse_gradients_equal_the_references() -> None:
    g = torch.Generator().manual_seed(5)
    leaves = [
        torch.randn(1, 2, 7, 4, dtype=torch.float64, generator=g, requires_grad=True)
        for _ in range(3)
    ]
    sinks = torch.randn(2, dtype=torch.float64, generator=g, requires_grad=True)
    weights = torch.randn(1, 2, 7, dtype=torch.float64, generator=g)

    def grads(backend: str) -> tuple[Tensor, ...]:
        _, lse = attention(*leaves, causal=True, sinks=sinks, return_lse=True, backend=backend)
        q, k, _ = leaves  # the lse does not depend on the values
        return torch.autograd.grad((lse * weights).sum(), (q, k, sinks))

    for a, w in zip(grads("chunked"), grads("reference"), strict=True):
        torch.testing.assert_close(a, w)


def test_sdpa_gives_no_lse_and_auto_goes_elsewhere() -> None:
    q = torch.randn(1, 2, 5, 8)
    report = attnkit.explain(q, q, q, return_lse=True)
    assert report.chosen == "chunked"
    assert "returns no log-sum-exp" in report.reasons["sdpa"][-1]
    with pytest.raises(ValueError, match="as many outputs as log-sum-exps"):
        attnkit.merge_attention([q], [])
    with pytest.raises(ValueError, match=r"and every lse \(1, 2, 5\)"):
        attnkit.merge_attention([q], [q])
