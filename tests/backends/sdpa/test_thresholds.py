"""The cost model's thresholds: each is read, and is where the answer changes (a call at it goes to
the native kernel, the same call goes to torch once the threshold moves past it), and each names
a measurement whose benchmark and data file exist."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from attnkit.backends import SDPA
from attnkit.backends.sdpa import costs
from attnkit.backends.sdpa.thresholds import THRESHOLDS, Threshold, Thresholds

from .test_costs import AMX, KINDS, ZEN4, Spec, fake_cpu

ROOT = pathlib.Path(__file__).resolve().parents[3]
NAMES = [field.name for field in dataclasses.fields(Thresholds)]

# Each threshold: a kind of CPU, and a call exactly at it (B, H, Hkv, Tq, Tk, Dk, Dv).
AT = {
    "float_training": (KINDS["AVX-512"], Spec((1,), 8, 8, 16, 16, 8, 8, "f32", grad=True)),
    "float_decode_bytes": (KINDS["AVX-512"], Spec((1,), 8, 8, 1, 2048, 64, 64, "f32")),
    "float_forward_scores": (KINDS["AVX-512"], Spec((1,), 8, 8, 128, 128, 64, 64, "f32")),
    "reduced_training": (ZEN4, Spec((1,), 8, 8, 16, 16, 8, 8, "bf16", grad=True)),
    "reduced_decode_bytes": (KINDS["AVX-512"], Spec((1,), 8, 8, 1, 512, 64, 64, "bf16")),
    "float16_forward_scores": (KINDS["AVX2"], Spec((1,), 8, 8, 128, 128, 64, 64, "f16")),
    "matrix_grouped_decode_bytes": (AMX, Spec((1,), 32, 8, 1, 2048, 128, 128, "f32")),
    "matrix_prefill_length": (AMX, Spec((1,), 8, 8, 1024, 1024, 64, 64, "bf16")),
    "matrix_training_scores": (AMX, Spec((4,), 8, 8, 512, 512, 64, 64, "bf16", grad=True)),
    "dot_grouped_decode_bytes": (ZEN4, Spec((1,), 8, 2, 1, 4096, 64, 64, "f32")),
    "dot_unmasked_scores": (ZEN4, Spec((1,), 8, 8, 768, 768, 64, 64, "f32")),
    "dot_bfloat16_forward_scores": (ZEN4, Spec((1,), 8, 8, 128, 128, 64, 64, "bf16")),
    # 8 query heads reading one key/value head of 128 tokens: 8 x 128 x 256 bytes
    "dot_reduced_decode_reads": (ZEN4, Spec((1,), 8, 1, 1, 128, 64, 64, "bf16")),
    # 8 heads of 16,384 tokens of 64 + 64 in float32
    "dot_ungrouped_decode_bytes": (ZEN4, Spec((1,), 8, 8, 1, 16384, 64, 64, "f32")),
}


def test_every_threshold_has_a_call_at_it() -> None:
    assert sorted(AT) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_threshold_is_where_the_answer_changes(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    state, spec = AT[name]
    fake_cpu(monkeypatch.setattr, state)
    call, sdpa = spec.call(), SDPA()
    rule: Threshold = getattr(THRESHOLDS, name)
    (at,) = sdpa.slower(call)  # at the threshold torch is the slower, and explain() quotes it
    assert rule.quoted in at
    # A threshold of 0 (every size) moves past every call.
    moved = dataclasses.replace(rule, least=rule.least + 1 if rule.least else 1 << 62)
    monkeypatch.setattr(costs, "_T", dataclasses.replace(THRESHOLDS, **{name: moved}))
    assert sdpa.slower(call) == []


@pytest.mark.parametrize("name", NAMES)
def test_each_threshold_names_its_measurement(name: str) -> None:
    rule: Threshold = getattr(THRESHOLDS, name)
    assert rule.least >= 0
    assert rule.unit
    assert rule.cpu
    # The figures: ratios of the two kernels' times ("0.74x").
    assert re.search(r"\d\.\d+x", rule.measured), rule.measured
    assert not rule.quoted or re.fullmatch(r"[\d.]+-[\d.]+x", rule.quoted), rule.quoted
    # The command runs a benchmark that exists; a data file it names exists too.
    script = re.match(r"python (benchmarks/\w+\.py)", rule.command)
    assert script, rule.command
    assert (ROOT / script[1]).is_file(), rule.command
    for data in re.findall(r"docs/benchmarks/data/[\w-]+\.json", rule.command):
        assert (ROOT / data).is_file(), data
