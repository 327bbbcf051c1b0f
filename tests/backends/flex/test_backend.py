"""The flex backend: backend="flex" on the CPU runs torch's compiled FlexAttention for inference
(unfused where the log-sum-exp is needed) and equals the float64 reference; it declines what it
cannot serve with reasons explain() shows, hands non-finite inputs to chunked visibly, and auto
never takes it on the CPU. Three kinds of call are compiled here, seconds each the first time."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks
from attnkit._base import devices
from attnkit._base.devices import Target
from attnkit.backends.base import record_dispatch
from attnkit.backends.flex import Flex, flex_available
from attnkit.backends.flex.backend import cpu_compile_refusal, kernel_options
from attnkit.modules.positional import alibi_term
from attnkit.testing import assert_close

from .helpers import HKV, B, H, call_of, qkv, randn, reference, selection


def _squared(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return s * s / 4


def test_compiled_inference_equals_the_reference() -> None:
    # One compiled kernel holds every kind of mask_mod and score_mod piece at once: packed
    # documents, a window off the diagonal, key padding, a from_fn mask, softcap, ALiBi and a
    # score_mod; with fewer queries than keys (bottom-right) and grouped-query heads. (The
    # unfused form runs every other kind and both alignments: test_lowering.py.)
    def early(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx < 30

    mask = (masks.documents([20, 20]) & masks.sliding_window(6, right=-1)) | (
        masks.key_padding([8, 3]) & masks.from_fn(early)
    )
    q, k, v = qkv(24, 40)
    kw = {
        "mask": mask,
        "softcap": 5.0,
        "bias": alibi_term(attnkit.alibi_slopes(H), 24, 40),
        "score_mod": _squared,
    }
    with torch.no_grad(), record_dispatch() as calls:
        out = attnkit.attention(q, k, v, backend="flex", **kw)
    assert [c.served_by for c in calls] == ["flex"]
    assert_close(out, reference(q, k, v, **kw))  # type: ignore[arg-type]


def test_compiled_index_masks_equal_the_reference() -> None:
    # One compiled kernel reads two bitmaps: a selection per key/value head (grouped-query
    # heads), with repeats, -1 and a query that selects nothing, ANDed with causal, or'ed with
    # NSA-style selected blocks shared by every head; query 1 selects nothing in either and gets
    # 0. A second call of the same kind (other indices, sorted) reuses the kernel.
    tq, tk = 24, 40
    q, k, v = qkv(tq, tk)
    for seed in (0, 1):
        keys = selection(B, HKV, tq, tk, 7, seed=20 + seed)
        picked = selection(1, 1, tq, tk // 8, 2, seed=30 + seed)
        if seed:
            keys, picked = keys.sort(-1).values, picked.sort(-1).values
        mask = (masks.key_indices(keys) & masks.causal()) | masks.block_indices(picked, block=8)
        with torch.no_grad(), record_dispatch() as calls:
            out = attnkit.attention(q, k, v, mask=mask, backend="flex")
        assert [c.served_by for c in calls] == ["flex"]
        assert_close(out, reference(q, k, v, mask=mask))
        assert bool((out[:, :, 1] == 0).all())


def test_sinks_and_the_lse_on_the_cpu() -> None:
    q, k, v = qkv(12, 20)
    sinks = randn(H, seed=4)
    kw = {"mask": masks.sliding_window(3) & masks.key_padding([20, 0]), "sinks": sinks}
    out, lse = attnkit.attention(q, k, v, backend="flex", return_lse=True, **kw)  # type: ignore[call-overload]
    want, want_lse = reference(q, k, v, return_lse=True, **kw)  # type: ignore[misc]
    assert_close(out, want)
    assert_close(lse, want_lse)
    assert bool((out[1] == 0).all())  # no visible key: 0


def test_a_masked_nan_is_handed_to_chunked() -> None:
    q, k, v = qkv(8, 8)
    k[:, :, 6] = float("nan")  # keys the padding hides
    v[:, :, 7] = float("inf")
    kw = {"mask": masks.key_padding([6, 4])}
    with record_dispatch() as calls:
        out = attnkit.attention(q, k, v, backend="flex", **kw)  # type: ignore[arg-type]
    assert calls[0].handovers
    assert calls[0].handovers[0][:2] == ("flex", "chunked")
    assert "lets through from masked keys" in calls[0].handovers[0][2]
    assert_close(out, reference(q, k, v, **kw))  # type: ignore[arg-type]


def test_a_query_whose_visible_keys_are_all_nan_gives_nan() -> None:
    # torch's compiled kernel gives such a query 0, as one with no visible key: a zero row of the
    # output sends a call whose inputs hold NaN to chunked; the padding queries' zero rows (no
    # visible key) stay 0.
    q, k, v = qkv(8, 8)
    k[0, :, :3] = float("nan")  # row 0's first document: its queries see only these keys
    kw = {"mask": masks.documents([3, 5]) & masks.key_padding([8, 0])}
    with record_dispatch() as calls:
        out = attnkit.attention(q, k, v, backend="flex", **kw)  # type: ignore[arg-type]
    assert calls[0].handovers[0][:2] == ("flex", "chunked")
    expected = reference(q, k, v, **kw)
    assert bool(out[0, :, :3].isnan().all())
    assert bool((out[1] == 0).all())
    assert_close(out.nan_to_num(), expected.nan_to_num())  # type: ignore[union-attr]


def test_what_it_declines_and_why() -> None:
    q, k, v = qkv(8, 8)
    grad = call_of(q.requires_grad_(), k, v, causal=True)
    assert any("computes no gradients (inference only)" in r for r in Flex().check(grad))
    report = str(attnkit.explain(q, k, v, dropout_p=0.1, backend="flex"))
    assert "FlexAttention has no dropout (dropout_p=0.1)" in report
    report = str(attnkit.explain(q, k, v, return_weights=True, backend="flex"))
    assert "FlexAttention returns no attention weights" in report
    meta = call_of(*(torch.empty(1, 2, 8, 4, device="meta") for _ in range(3)))
    assert any("not on meta" in r for r in Flex().check(meta))


def test_auto_never_takes_flex_on_the_cpu() -> None:
    q, k, v = qkv(16, 16)
    calls: list[dict[str, object]] = [
        {},
        {"causal": True},
        {"mask": masks.sliding_window(4)},
        {"softcap": 2.0, "mask": masks.documents([8, 8])},
        {"score_mod": _squared},
        {"sinks": randn(H, seed=1), "return_lse": True},
    ]
    for kw in calls:
        for grad in (False, True):
            qq = q.detach().requires_grad_(grad)
            chosen = attnkit.explain(qq, k, v, **kw).chosen  # type: ignore[arg-type]
            assert chosen not in ("flex", None), (kw, grad, chosen)
    costs = Flex().cost(call_of(q, k, v))
    assert costs
    assert "auto leaves CPU calls" in costs[0]


def test_the_backend_is_registered_as_flex() -> None:
    # The package is backends/flex (beside attnkit.flex, FlexAttention's API); the name a call
    # passes as backend= is "flex", in auto's order after sdpa and before chunked.
    assert Flex().name == "flex"
    names = attnkit.available_backends()
    assert ("flex" in names) == flex_available()
    if flex_available():
        assert names.index("sdpa") < names.index("flex") < names.index("chunked")


def test_float64_on_the_cpu_runs_unfused() -> None:
    # torch's CPU compile of FlexAttention refuses float64; the backend serves it unfused.
    q, k, v = (torch.randn(1, 2, 9, 16, dtype=torch.float64) for _ in range(3))
    mask = masks.sliding_window(3) & masks.key_padding([7])
    with torch.no_grad():
        got = attnkit.attention(q, k, v, mask=mask, backend="flex")
    want = attnkit.attention(q, k, v, mask=mask, backend="reference")
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert "float64 on the CPU runs flex_attention's unfused form" in str(
        attnkit.explain(q, k, v, mask=mask, backend="flex")
    )


def test_tensors_that_require_grad_under_no_grad_and_inference_mode() -> None:
    # Under no_grad / inference_mode the call needs no gradients, so flex serves it on the CPU;
    # torch's CPU FlexAttention refuses any input whose requires_grad is set, whatever the grad
    # mode, so the backend hands it detached tensors.
    q, k, v = (torch.randn(1, 2, 9, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)
    kw = {"mask": masks.sliding_window(3), "sinks": sinks, "return_lse": True}
    want, want_lse = attnkit.attention(q, k, v, backend="reference", **kw)  # type: ignore[call-overload]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            out, lse = attnkit.attention(q, k, v, backend="flex", **kw)  # type: ignore[call-overload]
        torch.testing.assert_close(out, want.detach(), atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse, want_lse.detach(), atol=1e-12, rtol=1e-12)


def test_a_cpu_torch_cannot_compile_for_runs_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where torch's CPU kernel is not built (macOS, no AVX2, ATEN_CPU_CAPABILITY=default) or no
    # C++ compiler is on PATH, the call crashed in inductor's lowering ("torch.compile on current
    # platform is not supported for CPU") while explain() said it compiles.
    q, k, v = (randn(1, 2, 11, 4, seed=s) for s in (7, 8, 9))
    mask = masks.sliding_window(3)
    want = reference(q, k, v, mask=mask)
    for patch in ("capability", "compiler"):
        with monkeypatch.context() as m:
            if patch == "capability":
                m.setenv("ATEN_CPU_CAPABILITY", "default")
            else:
                m.setattr(shutil, "which", lambda name: None)
            why = cpu_compile_refusal()
            assert why is not None
            assert ("AVX2" if patch == "capability" else "C++ compiler") in why
            with torch.no_grad():
                out = attnkit.attention(q, k, v, mask=mask, backend="flex")
            report = str(attnkit.explain(q, k, v, mask=mask, backend="flex"))
        assert_close(out, want)
        assert "torch cannot compile FlexAttention for this CPU" in report
        assert "torch.compile(flex_attention)" not in report


def test_deterministic_training_under_a_mask_keeps_to_triton() -> None:
    # torch's FLASH backward under a BlockMask raises when deterministic algorithms are on
    # (NotImplementedError before sm_100, missing dQ write-order tables on sm_100): the backend
    # asked for FLASH there all the same.
    h100 = Target("cuda", "nvidia", (9, 0), present=False, flash_cute=True)
    q = torch.empty(1, 2, 256, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    window = masks.sliding_window(32)

    def options_of(t: Tensor) -> tuple[dict[str, str], str]:
        return kernel_options(attnkit.explain(t, t, t, mask=window, device="cuda").call)

    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    with devices.assuming(h100):
        assert options_of(q)[0] == {"BACKEND": "FLASH"}
        try:
            torch.use_deterministic_algorithms(True)
            options, why = options_of(q)
            inference = options_of(q.detach())
            report = str(attnkit.explain(q, q, q, mask=window, device="cuda"))
        finally:
            torch.use_deterministic_algorithms(before, warn_only=warn_only)
    assert options == {}
    assert "deterministic algorithms are on" in why
    assert "deterministic algorithms are on" in report
    assert inference[0] == {"BACKEND": "FLASH"}  # no backward: FLASH serves it


def test_gpus_compile_flex_with_dynamic_lengths_and_the_cpu_per_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A second length of a kind compiles one kernel for every length on a GPU (torch's default),
    # not a kernel per length up to torch's limit and then the unfused form; torch's CPU template
    # does not build every mask_mod with symbolic sizes, so the CPU compiles per shape.
    from attnkit.backends.flex import backend as flex_backend

    made: dict[bool, object] = {}

    def compile_(fn: object, **kwargs: object) -> object:
        made[kwargs["dynamic"] is None] = kwargs["dynamic"]
        return fn

    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(flex_backend, "_COMPILED", {})
    flex_backend._compiled(True)
    flex_backend._compiled(False)
    flex_backend._compiled(True)  # made once per kind of device
    assert made == {True: None, False: False}


def test_compiled_calls_run_under_a_raised_recompile_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every kind of call attnkit lowers compiles flex_attention itself, so a model's kinds share
    # torch's per-function limit (8): attnkit's calls raise it while they run, and only then.
    from attnkit.backends.flex import backend as flex_backend

    config = torch._dynamo.config
    seen: list[int] = []

    def compiled(*args: Tensor, **kwargs: object) -> Tensor:
        seen.append(config.recompile_limit)
        return args[0]

    monkeypatch.setattr(flex_backend, "_compiled", lambda gpu: compiled)
    q, k, v = qkv(8, 8)
    call = attnkit.explain(q, k, v, causal=True).call
    lowered = flex_backend.lower_call(call, q, k, v, None)
    with config.patch(recompile_limit=8):
        flex_backend.run_lowered(lowered, lse=False, compiled=True)
        assert seen == [flex_backend.RECOMPILE_LIMIT]
        assert config.recompile_limit == 8
    with config.patch(recompile_limit=1000):  # a higher limit of the user's stays
        flex_backend.run_lowered(lowered, lse=False, compiled=True)
    assert seen[-1] == 1000
