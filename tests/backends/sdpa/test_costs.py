"""The cost model: where torch's SDPA is slower than attnkit's kernel on CPUs, and so where ``auto``
sends a call, on each kind of CPU (faked by replacing the model's capability probes).

The sweep compares every answer with ``auto_choices.json``, recorded from the model before its
thresholds moved into ``thresholds.py``: a grid of calls (each dtype, sizes on both sides of each
threshold, masks, decode steps and prefill, training and inference, CPU and meta tensors) on every
combination of the five capabilities the model reads. A recorded table, not a copy of the old
formulas: it holds what the old code answered, with nothing transcribed by hand, and a change of a
threshold that is meant shows as a diff of the table when it is recorded again
(``python -m tests.backends.sdpa.test_costs --record``).
"""

from __future__ import annotations

import importlib
import itertools
import json
import pathlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks
from attnkit._call import AttentionCall, check_attention_args
from attnkit.backends import SDPA
from attnkit.scores import RelativePositionTerm

# The module whose probes say what the CPU has (the tests replace them).
PROBES = importlib.import_module("attnkit.backends.sdpa.costs")
TABLE = pathlib.Path(__file__).with_name("auto_choices.json")

# What the model asks of the CPU: AVX-512 register tiles, a matrix unit (AMX), AVX512-BF16 without
# AMX, and whether torch's kernels multiply bfloat16 / float16 on the matrix unit.
FEATURES = ("tiles", "amx", "dot", "bf16", "fp16")
CPU_STATES = [
    frozenset(f for f, on in zip(FEATURES, bits, strict=True) if on)
    for bits in itertools.product((False, True), repeat=len(FEATURES))
]
# The CPUs that exist, among those states.
KINDS = {
    "AVX2": frozenset(),
    "AVX-512": frozenset({"tiles"}),
    "AVX512-BF16 without AMX (Zen 4)": frozenset({"tiles", "dot"}),
    "AMX-BF16 (Sapphire Rapids)": frozenset({"tiles", "amx", "bf16"}),
    "AMX-BF16 and AMX-FP16 (Granite Rapids)": frozenset({"tiles", "amx", "bf16", "fp16"}),
}


def state_name(state: frozenset[str]) -> str:
    return ",".join(f for f in FEATURES if f in state) or "-"


def fake_cpu(setattr: Callable[[object, str, object], None], state: frozenset[str]) -> None:
    """The model's view of a CPU with the capabilities in ``state``."""
    setattr(PROBES, "_register_tiles", lambda: "tiles" in state)
    setattr(PROBES, "_matrix_unit", lambda: "amx" in state)
    setattr(PROBES, "_bf16_dot", lambda: "dot" in state)
    products = {torch.bfloat16: "bf16" in state, torch.float16: "fp16" in state}
    setattr(PROBES, "_products_in", lambda dtype: products.get(dtype, False))


DTYPES = {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16, "f16": torch.float16}


@dataclass(frozen=True)
class Spec:
    """One call of the sweep: shapes ``(*batch, H|Hkv, T, D)``, a dtype, a mask by name."""

    batch: tuple[int, ...]
    h: int
    hkv: int
    tq: int
    tk: int
    dk: int
    dv: int
    dtype: str
    mask: str = "none"
    grad: bool = False
    device: str = "cpu"

    def key(self) -> str:
        b = "x".join(map(str, self.batch))
        shape = f"B={b} H={self.h}/{self.hkv} T={self.tq}/{self.tk} D={self.dk}/{self.dv}"
        extra = (" grad" if self.grad else "") + (f" {self.device}" if self.device != "cpu" else "")
        return f"{shape} {self.dtype} {self.mask}{extra}"

    def arguments(self) -> tuple[Tensor, Tensor, Tensor, dict[str, object]]:
        """q, k, v and attention()'s keyword arguments. Inference calls read no value: their
        tensors are left unwritten (the largest caches are never touched)."""
        dtype = DTYPES[self.dtype]
        new = torch.zeros if self.grad else torch.empty
        kw = {"dtype": dtype, "device": self.device}
        q = new(*self.batch, self.h, self.tq, self.dk, **kw)  # type: ignore[operator]
        k = new(*self.batch, self.hkv, self.tk, self.dk, **kw)  # type: ignore[operator]
        v = new(*self.batch, self.hkv, self.tk, self.dv, **kw)  # type: ignore[operator]
        if self.grad:
            q.requires_grad_()
        return q, k, v, self._mask_arguments(q)

    def _mask_arguments(self, q: Tensor) -> dict[str, object]:
        tq, tk, rows = self.tq, self.tk, self.batch[0]
        halves = [tk // 2, tk - tk // 2]
        makers: dict[str, Callable[[], dict[str, object]]] = {
            "none": dict,
            "causal": lambda: {"causal": True},
            "top_left": lambda: {"mask": masks.causal(align="top_left")},
            "window": lambda: {"mask": masks.sliding_window(64)},
            "padding": lambda: {"mask": masks.key_padding([tk - 1] * rows)},
            "docs": lambda: {"mask": masks.documents(halves)},
            "docs_causal": lambda: {"mask": masks.documents(halves), "causal": True},
            "docs_short": lambda: {"mask": masks.documents([tk // 4] * 3 + [tk - 3 * (tk // 4)])},
            "dense": lambda: {"mask": torch.ones(tq, tk, dtype=torch.bool, device=q.device)},
            "bias": lambda: {"bias": q.new_zeros(tq, tk)},
            "bias_causal": lambda: {"bias": q.new_zeros(tq, tk), "causal": True},
            "bias_grad": lambda: {"bias": q.new_zeros(tq, tk).requires_grad_()},
            "term": lambda: {"bias": self._term(q)},
        }
        return makers[self.mask]()

    def _term(self, q: Tensor) -> RelativePositionTerm:
        qv = torch.zeros(*q.shape, dtype=q.dtype, requires_grad=self.grad)
        enc = torch.zeros(self.h, self.tq + self.tk - 1, self.dk, dtype=q.dtype)
        return RelativePositionTerm(qv, enc, 1.0)

    def call(self) -> AttentionCall:
        q, k, v, kw = self.arguments()
        args: dict[str, object] = {"mask": None, "bias": None, "causal": False, "scale": None}
        return check_attention_args(q, k, v, **{**args, **kw}, check_finite=self.grad)  # type: ignore[arg-type]


# (batch, H, Hkv, Tq, Tk, Dk, Dv): each threshold's size and the size just below it.
PREFILL = [
    ((1,), 8, 8, 127, 127, 64, 64),
    ((1,), 8, 8, 128, 128, 64, 64),  # 8 * 128 * 128 scores
    ((1,), 8, 8, 128, 127, 64, 64),
    ((1,), 2, 2, 256, 255, 64, 64),
    ((1,), 2, 2, 256, 256, 64, 64),  # 8 * 128 * 128 again, from fewer heads
    ((1,), 8, 8, 128, 128, 63, 63),  # an odd width: no pairs for AVX512-BF16's dot products
    ((1,), 8, 2, 256, 256, 64, 64),  # grouped
    ((2, 4), 8, 8, 64, 64, 32, 32),  # two batch dims
    ((1,), 8, 8, 767, 767, 64, 64),
    ((1,), 8, 8, 768, 768, 64, 64),  # 8 * 768 * 768 scores
    ((1,), 8, 8, 1023, 1023, 64, 64),
    ((1,), 8, 8, 1024, 1024, 64, 64),  # 1024 queries and keys
    ((1,), 8, 8, 1024, 1023, 64, 64),
    ((1,), 8, 8, 1023, 1024, 64, 64),
    ((1,), 8, 8, 1024, 1024, 80, 80),  # widths not multiples of 32
    ((1,), 8, 8, 1024, 1024, 64, 80),
    ((1,), 8, 8, 1024, 1024, 96, 96),
    ((1,), 8, 8, 17, 4096, 64, 64),  # one query more than a decode step
]
DECODE = [
    ((1,), 8, 8, 16, 2048, 64, 64),  # the most queries of a decode step
    ((1,), 8, 8, 1, 511, 64, 64),
    ((1,), 8, 8, 1, 512, 64, 64),  # 1 MiB in bfloat16/float16
    ((1,), 8, 8, 1, 2047, 64, 64),
    ((1,), 8, 8, 1, 2048, 64, 64),  # 8 MiB in float32, 4 MiB in bfloat16/float16
    ((1,), 8, 8, 1, 2048, 64, 32),
    ((1,), 8, 8, 1, 4095, 64, 64),
    ((1,), 8, 8, 1, 4096, 64, 64),  # 16 MiB in float32
    ((1,), 8, 2, 1, 4095, 64, 64),
    ((1,), 8, 2, 1, 4096, 64, 64),  # 4 MiB in float32, shared by 4 query heads
    ((1,), 32, 8, 1, 511, 128, 128),
    ((1,), 32, 8, 1, 512, 128, 128),  # 4 MiB in float32
    ((1,), 32, 8, 1, 1023, 128, 128),
    ((1,), 32, 8, 1, 1024, 128, 128),  # 8 MiB in float32, 4 MiB in bfloat16/float16
    ((1,), 32, 8, 1, 2047, 128, 128),
    ((1,), 32, 8, 1, 2048, 128, 128),  # 16 MiB in float32, 8 MiB in bfloat16/float16
    ((1,), 32, 8, 1, 4095, 128, 128),
    ((1,), 32, 8, 1, 4096, 128, 128),  # 16 MiB in bfloat16/float16
    ((1,), 32, 32, 1, 4096, 128, 128),  # one query head per key/value head
    ((8,), 32, 8, 1, 4096, 128, 128),  # 256 MiB in float32
]
TRAINING = [
    ((1,), 8, 8, 127, 127, 64, 64),
    ((1,), 8, 8, 128, 128, 64, 64),
    ((4,), 8, 8, 511, 511, 64, 64),
    ((4,), 8, 8, 512, 512, 64, 64),  # 4 * 8 * 512 * 512 scores
    ((1,), 8, 8, 1024, 1023, 64, 64),
    ((1,), 8, 8, 1024, 1024, 64, 64),  # the same number of scores
    ((1,), 8, 8, 1, 2048, 64, 64),
]
# Masks that change what torch is given (written out, one call per document, is_causal, ...).
MASKED = [((1,), 8, 8, t, t, 64, 64) for t in (128, 768, 1024)] + [((1,), 8, 8, 1, 2048, 64, 64)]
SQUARE_MASKS = ["top_left", "docs", "docs_causal", "docs_short"]
ANY_MASKS = ["window", "padding", "dense", "bias", "bias_causal", "bias_grad"]


def _grid() -> Iterator[Spec]:
    for dtype in DTYPES:
        for shape in PREFILL + DECODE:
            for mask in ("none", "causal"):
                yield Spec(*shape, dtype, mask)  # type: ignore[arg-type]
        for shape in MASKED:
            square = shape[3] == shape[4]
            for mask in ANY_MASKS + (SQUARE_MASKS if square else []):
                yield Spec(*shape, dtype, mask)  # type: ignore[arg-type]
        for shape in TRAINING:
            for mask in ("none", "causal"):
                yield Spec(*shape, dtype, mask, grad=True)  # type: ignore[arg-type]
        for shape in [((1,), 8, 8, 1, 4096, 64, 64), ((1,), 8, 8, 1024, 1024, 64, 64)]:
            for mask, grad in itertools.product(("none", "causal"), (False, True)):
                yield Spec(*shape, dtype, mask, grad=grad, device="meta")  # type: ignore[arg-type]
        for grad in (False, True):
            yield Spec((2,), 2, 2, 10, 10, 8, 8, dtype, "term", grad=grad)
            yield Spec((1,), 8, 8, 128, 128, 64, 64, dtype, "term", grad=grad)


SPECS = list(_grid())


def sdpa_answers(sdpa: SDPA, call: AttentionCall) -> dict[str, list[str]]:
    """What the backend says of a call: why it cannot serve it, what it would spend, where it
    would be slower (asked only where it can serve it, as auto asks)."""
    check, cost = sdpa.reasons(call)
    return {"check": check, "cost": cost, "slower": [] if check else sdpa.slower_reasons(call)}


def auto_choices(spec: Spec, setattr: Callable[[object, str, object], None]) -> list[str]:
    """The backend auto picks for the call on each kind of CPU."""
    q, k, v, kw = spec.arguments()
    chosen = []
    for state in KINDS.values():
        fake_cpu(setattr, state)
        chosen.append(str(attnkit.explain(q, k, v, **kw).chosen))  # type: ignore[arg-type]
    return chosen


def runs(indices: list[int]) -> str:
    """``[3, 3, 3, 7]`` -> ``"3*3 7"``."""
    return " ".join(
        f"{i}*{n}" if (n := len(list(group))) > 1 else str(i)
        for i, group in itertools.groupby(indices)
    )


def unruns(text: str) -> list[int]:
    """:func:`runs` read back."""
    out = []
    for token in text.split():
        index, _, count = token.partition("*")
        out += [int(index)] * int(count or 1)
    return out


def record(setattr: Callable[[object, str, object], None]) -> dict[str, object]:
    """The sweep as the table holds it: the distinct answers, and for each call the index of its
    answer on each CPU state (in runs) and the backend auto picks on each kind of CPU."""
    sdpa, answers, index = SDPA(), [], {}
    calls: dict[str, dict[str, str]] = {}
    for spec in SPECS:
        call, row = spec.call(), []
        for state in CPU_STATES:
            fake_cpu(setattr, state)
            text = json.dumps(sdpa_answers(sdpa, call))
            if text not in index:
                index[text] = len(answers)
                answers.append(json.loads(text))
            row.append(index[text])
        chosen = " ".join(auto_choices(spec, setattr))
        calls[spec.key()] = {"answers": runs(row), "chosen": chosen}
    return {
        "environment": environment(),
        "cpu_states": [state_name(s) for s in CPU_STATES],
        "kinds": {name: state_name(s) for name, s in KINDS.items()},
        "answers": answers,
        "calls": calls,
    }


def environment() -> dict[str, object]:
    """What ``chosen`` depends on besides sdpa's answers: whether the native kernel serves the
    chunked backend, and the CPU's instruction set (the other backends read both)."""
    return {
        "native": attnkit._native.status()[0],
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


# --------------------------------------------------------------------------------------------------
# auto's choice on each kind of CPU, by example


AMX = KINDS["AMX-BF16 (Sapphire Rapids)"]
ZEN4 = KINDS["AVX512-BF16 without AMX (Zen 4)"]


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
    fake_cpu(monkeypatch.setattr, KINDS["AVX-512"])  # no bfloat16 products
    q, kv = _check_choice(shape, dtype, chosen, words)
    half = dtype in (torch.bfloat16, torch.float16)
    with torch.enable_grad():  # training: torch's CPU backward is the slow half, whatever the size
        q.requires_grad_(not half)
        assert ("trains slower" in " ".join(attnkit.explain(q, kv, kv).slower["sdpa"])) == (
            not half
        )


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
    # and from 64 MiB, past the last-level cache, the native kernel streams it faster
    ((1, 8, 8, 1, 16384, 64), torch.float32, "chunked", "64 MiB of keys and values, one query"),
    ((1, 32, 32, 1, 1024, 128), torch.float32, "sdpa", None),  # 32 MiB
    ((1, 8, 8, 256, 256, 64), torch.float32, "sdpa", None),  # no mask: nothing to skip
    ((1, 8, 8, 512, 512, 64), torch.float32, "sdpa", None),  # below 8 * 768 * 768 scores
    # but from there the native kernel's register tiles outrun torch's BLAS calls
    ((1, 8, 8, 768, 768, 64), torch.float32, "chunked", "4718592 scores without a mask"),
    ((1, 8, 8, 1024, 1024, 64), torch.float64, "chunked", "AVX512-BF16 and no AMX"),
    # torch's bfloat16/float16 decode is slow there: from 256 KiB read over the query heads
    ((1, 32, 32, 1, 4096, 128), torch.bfloat16, "chunked", "65536 KiB of bfloat16 keys"),
    ((1, 8, 8, 1, 512, 64), torch.bfloat16, "chunked", "1024 KiB of bfloat16 keys"),
    ((1, 8, 8, 1, 128, 64), torch.bfloat16, "chunked", "256 KiB of bfloat16 keys"),
    ((1, 8, 8, 1, 64, 64), torch.bfloat16, "sdpa", None),  # 128 KiB
    ((1, 32, 8, 1, 16, 128), torch.bfloat16, "chunked", "256 KiB of bfloat16 keys"),
    ((1, 32, 8, 1, 8, 128), torch.bfloat16, "sdpa", None),  # 128 KiB read, 32 KiB held
    ((1, 16, 16, 1, 64, 64), torch.float16, "chunked", "256 KiB of float16 keys"),
    ((1, 8, 8, 128, 128, 64), torch.bfloat16, "chunked", "AVX512-BF16's dot products"),
    ((1, 8, 8, 4096, 4096, 128), torch.bfloat16, "chunked", "AVX512-BF16's dot products"),
    ((1, 8, 8, 64, 64, 64), torch.bfloat16, "sdpa", None),  # below 8 x 128 x 128 scores
    ((1, 8, 8, 256, 256, 64), torch.float16, "chunked", "torch's float16 CPU forward"),
    ((1, 8, 8, 1, 4096, 64), torch.float16, "chunked", "8192 KiB of float16 keys"),
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
    fake_cpu(monkeypatch.setattr, AMX if matrix_unit else ZEN4)
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
    fake_cpu(monkeypatch.setattr, ZEN4)
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
    fake_cpu(monkeypatch.setattr, KINDS["AVX-512" if tiles else "AVX2"])
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
    fake_cpu(monkeypatch.setattr, frozenset({"tiles", "bf16", "fp16"} if products else {"tiles"}))
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
    fake_cpu(monkeypatch.setattr, AMX)
    _check_choice(shape, dtype, chosen, words)


def test_auto_trains_bfloat16_natively_on_cpus_with_a_matrix_unit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # There the native kernel runs the products of both passes on the unit; torch keeps the
    # forward alone (its bfloat16 prefill is faster) and float16 (no products on the unit).
    if not attnkit._native.status()[0]:
        pytest.skip("the native kernel is not available: chunked would run the eager kernel")
    fake_cpu(monkeypatch.setattr, AMX)
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


# --------------------------------------------------------------------------------------------------
# The sweep


@pytest.fixture(scope="module")
def table() -> dict[str, object]:
    return json.loads(TABLE.read_text())  # type: ignore[no-any-return]


def test_the_sweep_is_the_recorded_one(table: dict[str, object]) -> None:
    # A grid that changed would compare nothing for the calls it lost.
    assert [spec.key() for spec in SPECS] == list(table["calls"])  # type: ignore[call-overload]
    assert table["cpu_states"] == [state_name(s) for s in CPU_STATES]
    assert len(set(SPECS)) == len(SPECS) == 552


def test_sdpa_answers_every_call_on_every_cpu_as_recorded(
    monkeypatch: pytest.MonkeyPatch, table: dict[str, object]
) -> None:
    answers: list[dict[str, list[str]]] = table["answers"]  # type: ignore[assignment]
    recorded: dict[str, dict[str, str]] = table["calls"]  # type: ignore[assignment]
    sdpa, wrong = SDPA(), []
    for spec in SPECS:
        call = spec.call()
        want = unruns(recorded[spec.key()]["answers"])
        for state, index in zip(CPU_STATES, want, strict=True):
            fake_cpu(monkeypatch.setattr, state)
            got = sdpa_answers(sdpa, call)
            if got != answers[index]:
                wrong.append(f"{spec.key()} on {state_name(state)}: {got} != {answers[index]}")
    assert not wrong, f"{len(wrong)} answers changed:\n" + "\n".join(wrong[:10])


def test_auto_picks_the_recorded_backend_on_each_kind_of_cpu(
    monkeypatch: pytest.MonkeyPatch, table: dict[str, object]
) -> None:
    # The whole decision, through explain(): each call on one kind of CPU, the kinds in turn (an
    # explain() of every call on every kind takes half a minute). sdpa's answers above, on every
    # state, are what decides its place in auto's order; this checks that the order reads them
    # as recorded. Where the other backends answer as where the table was recorded (they read the
    # native kernel's availability and the CPU's instruction set).
    if table["environment"] != environment():
        pytest.skip(f"recorded on {table['environment']}, here {environment()}")
    recorded: dict[str, dict[str, str]] = table["calls"]  # type: ignore[assignment]
    kinds = list(KINDS.items())
    wrong = []
    for i, spec in enumerate(SPECS):
        kind, state = kinds[i % len(kinds)]
        fake_cpu(monkeypatch.setattr, state)
        q, k, v, kw = spec.arguments()
        got = str(attnkit.explain(q, k, v, **kw).chosen)  # type: ignore[arg-type]
        want = recorded[spec.key()]["chosen"].split()[i % len(kinds)]
        if got != want:
            wrong.append(f"{spec.key()} on {kind}: {got}, recorded {want}")
    assert not wrong, f"{len(wrong)} choices changed:\n" + "\n".join(wrong[:10])


def layout(table: dict[str, object]) -> str:
    """The table as JSON with one answer, and one call, a line."""
    lines = []
    for name, value in table.items():
        if isinstance(value, list):
            items = [json.dumps(item) for item in value]
        elif name == "calls":
            items = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()]  # type: ignore[attr-defined]
        else:
            lines.append(f"{json.dumps(name)}: {json.dumps(value)}")
            continue
        start, end = ("[", "]") if isinstance(value, list) else ("{", "}")
        lines.append(f"{json.dumps(name)}: {start}\n" + ",\n".join(items) + f"\n{end}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


if __name__ == "__main__" and "--record" in sys.argv:
    TABLE.write_text(layout(record(setattr)))
    print(f"wrote {TABLE}")
