"""What a GPU runs, decided without one: ``explain(..., device="cuda")`` on meta tensors names
``sdpa`` or ``flex`` for every mask kind and modifier (and says why when a call goes elsewhere),
by the rules the dispatcher of a real call on a GPU reads; on the CPU nothing changes and ``auto``
never takes ``flex``."""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit._base import devices
from attnkit.attention import _choose, _decide
from attnkit.backends.flex import lowering_refusal
from attnkit.modules.positional import alibi_slopes, alibi_term
from attnkit.scores import DistanceBias, RelativePositionTerm

B, H, T, D = 2, 8, 1024, 64
META = torch.device("meta")


def qkv(
    dtype: torch.dtype = torch.bfloat16, tq: int = T, tk: int = T, hkv: int = H, grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    def t(h: int, n: int) -> torch.Tensor:
        return torch.empty(B, h, n, D, device=META, dtype=dtype).requires_grad_(grad)

    return t(H, tq), t(hkv, tk), t(hkv, tk)


def _window(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return (q - kv).abs() <= 64


def _selection(heads: int, k: int) -> torch.Tensor:
    """A sparse-attention indexer's choice: ``k`` keys (or blocks) for each query."""
    return torch.empty(B, heads, T, k, device=META, dtype=torch.long)


# (name, the call's keyword arguments beyond q, k, v, the inputs, the backend a GPU runs, and the
# words explain() says about it)
Case = tuple[str, Callable[[], dict[str, Any]], Callable[[], tuple[Any, ...]], str, str]
lengths = [T, T // 2]
CASES: list[Case] = [
    ("plain", dict, qkv, "sdpa", "torch's flash kernel"),
    ("causal", lambda: {"causal": True}, qkv, "sdpa", "torch's flash kernel"),
    ("causal, training", lambda: {"causal": True}, lambda: qkv(grad=True), "sdpa", "flash"),
    ("GQA, causal", lambda: {"causal": True}, lambda: qkv(hkv=2), "sdpa", "flash"),
    (
        "key padding",
        lambda: {"mask": masks.key_padding(lengths)},
        qkv,
        "sdpa",
        "torch's memory-efficient kernel (flash: takes no attn_mask)",
    ),
    (
        "key padding, float32",
        lambda: {"mask": masks.key_padding(lengths)},
        lambda: qkv(torch.float32),
        "sdpa",
        "memory-efficient",
    ),
    (
        "causal, Tq < Tk, top-left (torch's is_causal)",
        lambda: {"mask": masks.causal(align="top_left")},
        lambda: qkv(tq=T // 4),
        "sdpa",
        "memory-efficient kernel (flash: takes is_causal only with Tq == Tk",
    ),
    (
        "decode step over padded keys",
        lambda: {"mask": masks.key_padding(lengths)},
        lambda: qkv(tq=1, hkv=2),
        "sdpa",
        "memory-efficient",
    ),
    (
        "causal + key padding",
        lambda: {"mask": masks.causal() & masks.key_padding(lengths)},
        qkv,
        "flex",
        "mask causal() & key_padding",
    ),
    (
        "causal, Tq < Tk, bottom-right",
        lambda: {"causal": True},
        lambda: qkv(tq=T // 4),
        "flex",
        "mask causal() as a mask_mod",
    ),
    (
        "causal, Tq > Tk, top-left",
        lambda: {"mask": masks.causal(align="top_left")},
        lambda: qkv(tq=T, tk=T // 2),
        "sdpa",
        "memory-efficient",
    ),
    # A decode step or a short chunk against a cache: the mask's dense form is small next to
    # the keys and values, and FlexAttention would compile once per length of the cache.
    (
        "decode step, sliding window",
        lambda: {"mask": masks.sliding_window(128)},
        lambda: qkv(tq=1, hkv=2),
        "sdpa",
        "memory-efficient",
    ),
    (
        "a chunk of 16 queries against a cache, causal & key padding",
        lambda: {"mask": masks.causal() & masks.key_padding(lengths)},
        lambda: qkv(tq=16, hkv=2),
        "sdpa",
        "memory-efficient",
    ),
    ("sliding window", lambda: {"mask": masks.sliding_window(128)}, qkv, "flex", "mask_mod"),
    (
        "sliding window both sides",
        lambda: {"mask": masks.sliding_window(64, 64)},
        qkv,
        "flex",
        "mask_mod",
    ),
    ("documents", lambda: {"mask": masks.documents([256, 512, 256])}, qkv, "flex", "mask_mod"),
    (
        "documents, causal",
        lambda: {"mask": masks.documents([256, 768]), "causal": True},
        qkv,
        "flex",
        "mask_mod",
    ),
    (
        "documents by ids",
        lambda: {"mask": masks.documents(ids=torch.arange(T, device=META) // 100)},
        qkv,
        "flex",
        "mask_mod",
    ),
    ("from_fn", lambda: {"mask": masks.from_fn(_window)}, qkv, "flex", "mask_mod"),
    (
        "a | b",
        lambda: {"mask": masks.sliding_window(32) | masks.key_padding([8, 8])},
        qkv,
        "flex",
        "mask_mod",
    ),
    (
        "a dense bool mask",
        lambda: {"mask": torch.ones(T, T, device=META, dtype=torch.bool)},
        qkv,
        "sdpa",
        "memory-efficient",
    ),
    ("softcap", lambda: {"causal": True, "softcap": 30.0}, qkv, "flex", "softcap=30.0"),
    ("softcap, training", lambda: {"softcap": 30.0}, lambda: qkv(grad=True), "flex", "softcap"),
    (
        "sinks",
        lambda: {"causal": True, "sinks": torch.zeros(H, device=META, dtype=torch.bfloat16)},
        qkv,
        "flex",
        "sinks folded in through the log-sum-exp",
    ),
    ("return_lse", lambda: {"causal": True, "return_lse": True}, qkv, "flex", "mask_mod"),
    (
        "ALiBi",
        lambda: {
            "causal": True,
            "bias": alibi_term(alibi_slopes(H).to(META), T, T),
        },
        lambda: qkv(torch.float32),
        "flex",
        "score_mod: DistanceBias",
    ),
    (
        "a bias by distance",
        lambda: {"bias": DistanceBias(torch.zeros(H, 2 * T - 1, device=META), first=1 - T)},
        lambda: qkv(torch.float32, grad=True),
        "flex",
        "score_mod: DistanceBias",
    ),
    (
        "dense bias that needs gradients",
        lambda: {
            "bias": torch.zeros(H, T, T, device=META, dtype=torch.bfloat16, requires_grad=True)
        },
        qkv,
        "flex",
        "the bias read by index",
    ),
    (
        "dense bias",
        lambda: {"bias": torch.zeros(H, T, T, device=META, dtype=torch.bfloat16)},
        qkv,
        "sdpa",
        "memory-efficient",
    ),
    (
        "relative position term, windowed",
        lambda: {
            "mask": masks.sliding_window(128),
            "bias": RelativePositionTerm(
                torch.zeros(B, H, T, D, device=META),
                torch.zeros(H, 2 * T - 1, D, device=META),
                1 / math.sqrt(D),
            ),
        },
        lambda: qkv(torch.float32),
        "flex",
        "position term as q . r",
    ),
    (
        "score_mod",
        lambda: {"score_mod": lambda s, b, h, q, kv: s - (q - kv).abs()},
        qkv,
        "flex",
        "score_mod",
    ),
    ("float64, causal", lambda: {"causal": True}, lambda: qkv(torch.float64), "flex", "mask_mod"),
    (
        "key indices per key/value head & causal (sdpa would write the (Tq, Tk) mask)",
        lambda: {"mask": masks.key_indices(_selection(2, 256)) & masks.causal()},
        lambda: qkv(hkv=2),
        "flex",
        "a bit a key for each query and selection head: 0.5 MiB, where the same selection",
    ),
    (
        "block indices, training",
        lambda: {"mask": masks.block_indices(_selection(1, 16), block=64)},
        lambda: qkv(grad=True),
        "flex",
        "read from a bitmap, a bit a block of 64 keys",
    ),
]


def explained(kwargs: dict[str, Any], inputs: tuple[Any, ...], device: str) -> attnkit.Explanation:
    return attnkit.explain(*inputs, **kwargs, device=device)


@pytest.mark.parametrize(("name", "kwargs", "inputs", "backend", "words"), CASES)
def test_what_a_gpu_runs(
    name: str,
    kwargs: Callable[[], dict[str, Any]],
    inputs: Callable[[], tuple[Any, ...]],
    backend: str,
    words: str,
) -> None:
    decision = explained(kwargs(), inputs(), "cuda")
    text = str(decision)
    assert decision.chosen == backend, text
    assert words in text, text
    assert "device: cuda (NVIDIA, sm_90" in text or torch.cuda.is_available()
    # the eager kernel is never taken while a fused kernel can serve the call
    assert "chunked    avoided: runs the eager kernel" in text, text


@pytest.mark.parametrize(("name", "kwargs", "inputs", "backend", "words"), CASES)
def test_a_call_on_the_gpu_is_routed_as_explained(
    name: str,
    kwargs: Callable[[], dict[str, Any]],
    inputs: Callable[[], tuple[Any, ...]],
    backend: str,
    words: str,
) -> None:
    # the dispatcher's own path (_choose, which attention() takes) on the call as on the GPU
    decision = explained(kwargs(), inputs(), "cuda")
    on_gpu = dataclasses.replace(decision.call, device=torch.device("cuda"))
    with devices.assuming(devices.parse_device("cuda")):
        assert _choose(on_gpu, "auto").name == backend
        assert _decide(on_gpu, "auto").chosen == backend


@pytest.mark.parametrize(("name", "kwargs", "inputs", "backend", "words"), CASES)
def test_flex_lowers_every_call_it_is_given(
    name: str,
    kwargs: Callable[[], dict[str, Any]],
    inputs: Callable[[], tuple[Any, ...]],
    backend: str,
    words: str,
) -> None:
    # what goes to flex on a GPU is what FlexAttention can express, on any device
    call = explained(kwargs(), inputs(), "cuda").call
    if backend == "flex":
        assert lowering_refusal(call) is None


@pytest.mark.parametrize(("name", "kwargs", "inputs", "backend", "words"), CASES)
def test_the_cpu_is_unchanged_and_never_takes_flex(
    name: str,
    kwargs: Callable[[], dict[str, Any]],
    inputs: Callable[[], tuple[Any, ...]],
    backend: str,
    words: str,
) -> None:
    on_cpu = explained(kwargs(), inputs(), "cpu")
    assert on_cpu.chosen != "flex", str(on_cpu)
    assert "device:" not in str(on_cpu)
    assert on_cpu.device is None


@pytest.mark.parametrize(
    ("name", "kwargs", "inputs", "backend", "why"),
    [
        (
            "dropout under a sliding window: flex has no dropout, sdpa's fused kernel takes the "
            "mask written out",
            {"mask": masks.sliding_window(128), "dropout_p": 0.1},
            qkv,
            "sdpa",
            "chosen, the best that can serve it, although it would materialise the mask",
        ),
        (
            "dropout and softcap: no fused kernel takes both",
            {"causal": True, "softcap": 30.0, "dropout_p": 0.1},
            qkv,
            "chunked",
            "sdpa       cannot: torch's kernel has no softcap",
        ),
        (
            "the weights: only the reference returns them",
            {"causal": True, "return_weights": True},
            qkv,
            "reference",
            "flex       cannot:",
        ),
    ],
)
def test_what_goes_elsewhere_says_why(
    name: str,
    kwargs: dict[str, Any],
    inputs: Callable[[], tuple[Any, ...]],
    backend: str,
    why: str,
) -> None:
    text = str(explained(kwargs, inputs(), "cuda"))
    assert f"auto picks: {backend}" in text, text
    assert why in text, text


def test_the_math_kernel_is_a_cost_on_gpus() -> None:
    # head sizes that no fused kernel of torch takes with a mask: sdpa would write out the scores
    q = torch.empty(B, H, T, 60, device=META, dtype=torch.bfloat16)
    text = str(attnkit.explain(q, q, q, mask=masks.key_padding(lengths), device="cuda"))
    assert "would run torch's math kernel on cuda" in text, text
    assert "auto picks: flex" in text


def test_rocm_and_xpu() -> None:
    q, k, v = qkv(hkv=2)
    text = str(attnkit.explain(q, k, v, mask=masks.key_padding(lengths), device="rocm"))
    assert "device: cuda (AMD ROCm" in text
    # ROCm's memory-efficient kernel takes no grouped heads: torch would run its math kernel
    assert "auto picks: flex" in text, text
    assert "no grouped-query heads on ROCm" in text, text
    text = str(attnkit.explain(q, k, v, mask=masks.sliding_window(64), device="xpu"))
    assert "auto picks: flex" in text, text
    assert "device: xpu (Intel" in text, text


def test_the_device_argument_is_checked() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match="device must be 'cuda', 'rocm', 'xpu' or 'cpu'"):
        attnkit.explain(q, k, v, device="tpu")


def test_explaining_for_a_gpu_reads_no_tensor() -> None:
    # CPU tensors explained for a GPU: the CPU's block plan and native kernel are not the GPU's
    q = torch.randn(1, 2, 64, 16)
    text = str(attnkit.explain(q, q, q, mask=masks.sliding_window(8), device="cuda"))
    assert "block plan" not in text, text
    assert "native kernel" not in text.replace("the native kernel runs on CPUs", ""), text


def test_flexattention_kernel_options_one_rule_for_explain_and_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flex_backend = importlib.import_module("attnkit.backends.flex.backend")
    h100 = dataclasses.replace(devices.parse_device("cuda"), flash_cute=True)
    q, k, v = qkv()
    with devices.assuming(h100):
        text = str(attnkit.explain(q, k, v, mask=masks.sliding_window(128), device="cuda"))
        assert "kernel_options={'BACKEND': 'FLASH'}: FlashAttention-4" in text, text
        call = dataclasses.replace(attnkit.explain(q, k, v, softcap=5.0, device="cuda").call)
        assert flex_backend.kernel_options(call)[0] == {"BACKEND": "FLASH"}
        bias = torch.zeros(H, T, T, device=META, dtype=torch.bfloat16, requires_grad=True)
        trained = attnkit.explain(*qkv(grad=True), bias=bias, device="cuda").call
        assert flex_backend.kernel_options(trained)[0] == {}  # a captured tensor needs gradients
    # what run() hands torch's compiled FlexAttention
    seen: dict[str, Any] = {}

    def compiled(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return args[0]

    monkeypatch.setattr(flex_backend, "_compiled", lambda gpu: compiled)
    lowered = flex_backend.lower_call(call, *(torch.zeros(2, H, 16, D) for _ in range(3)), None)
    flex_backend.run_lowered(lowered, lse=False, compiled=True, options={"BACKEND": "FLASH"})
    assert seen["kernel_options"] == {"BACKEND": "FLASH"}
