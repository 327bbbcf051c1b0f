"""The thresholds of sdpa's CPU cost model, each beside the measurement that set it.

``auto`` sends a call from torch's SDPA to attnkit's kernel on a CPU where the kernel was measured
to be the faster. Each :class:`Threshold` says from which size (``least``, counted in ``unit``) that
holds, on which kind of CPU, by which benchmark command, and what it measured; ``quoted`` is the
figure ``explain()`` gives with the rule. ``least=0`` is a rule that holds at every size. To move
a threshold, rerun its command on its kind of CPU, change the entry here, and record
``tests/backends/sdpa/auto_choices.json`` again: its diff shows the calls whose backend moved.

The figures are the native kernel's time over torch's ("0.74x": the native kernel took 0.74 of
torch's time) unless the entry says otherwise; B=1 H=8 D=64 unless it gives other sizes. The runs
that the commands wrote are kept in ``docs/benchmarks/data/`` and described in the inference guide
(``docs/guide/inference.md``, "What auto picks and why").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["THRESHOLDS", "Threshold", "Thresholds"]

MIB: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class Threshold:
    """From which size a kind of call goes to attnkit's kernel, and the measurement behind it."""

    least: int  # the size from which torch's kernel is the slower; 0: every size
    unit: str  # what ``least`` counts
    cpu: str  # the kind of CPU it was measured on
    command: str  # the benchmark run that measured it
    measured: str  # what it measured
    quoted: str = ""  # the figure explain() gives with the rule ("" for none)


@dataclass(frozen=True, slots=True)
class Thresholds:
    """The cost model's thresholds, one per rule (the rules are in ``costs.py``)."""

    float_training: Threshold
    float_decode_bytes: Threshold
    float_forward_scores: Threshold
    reduced_training: Threshold
    reduced_decode_bytes: Threshold
    float16_forward_scores: Threshold
    matrix_grouped_decode_bytes: Threshold
    matrix_prefill_length: Threshold
    matrix_training_scores: Threshold
    dot_grouped_decode_bytes: Threshold
    dot_unmasked_scores: Threshold
    dot_bfloat16_forward_scores: Threshold
    dot_reduced_decode_reads: Threshold
    dot_ungrouped_decode_bytes: Threshold


_EPYC_AVX512 = "AMD EPYC with AVX-512, one thread"
_EPYC_AVX2 = "AMD EPYC with AVX2, no bfloat16/float16 products (2 cores)"
_XEON_AMX = "Intel Xeon with AMX-BF16 (Sapphire Rapids on; 2 cores)"
_ZEN4 = "AMD EPYC, Zen 4: AVX512-BF16, no AMX (2 cores)"

THRESHOLDS: Final = Thresholds(
    # float32/float64 on every CPU
    float_training=Threshold(
        least=0,
        unit="scores",
        cpu="AMD EPYC (2 cores)",
        command="python benchmarks/bench_training.py (docs/benchmarks/data/training.json)",
        measured="float32 forward and backward, q, k and v views of one projection: 0.89x at B=4 "
        "T=1024, 0.66x causal; 0.92x at B=1 T=4096, 0.85x causal: torch's CPU backward is its "
        "slow half",
    ),
    float_decode_bytes=Threshold(
        least=8 * MIB,
        unit="bytes of keys and values, a decode step",
        cpu=_EPYC_AVX512,
        command="python benchmarks/bench_auto.py (medians of 15 rounds)",
        measured="one query, float32: 0.43x at 256 MiB, 0.87x at 16 MiB, 1.00x at 8 MiB, 2.28x at "
        "2 MiB, 2.71x at 0.5 MiB (the inference guide's table)",
    ),
    float_forward_scores=Threshold(
        least=8 * 128 * 128,
        unit="scores (B * H * Tq * Tk)",
        cpu=_EPYC_AVX512,
        command="python benchmarks/bench_auto.py (medians of 15 rounds)",
        measured="float32 Tq = Tk: 1.22x at T=64, 0.94x at T=96, 0.74x at T=128, 0.45-0.67x at "
        "T=256, 0.46-0.60x at T=1024 (the inference guide's table)",
        quoted="1.3-2.5x",  # torch's time over a blocked kernel's, the inverse of 0.4-0.74x
    ),
    # bfloat16/float16 where torch's kernels have no products of the dtype
    reduced_training=Threshold(
        least=0,
        unit="scores",
        cpu=f"{_EPYC_AVX2}; and {_ZEN4}",
        command="python benchmarks/bench_native.py --cases causal --dtype bfloat16 float16 "
        "--backward (T=4096, 2 threads)",
        measured="forward and backward, causal T=4096: 0.16x torch's time in bfloat16 (528 ms "
        "against 3335), 0.09x in float16 (710 ms against 8058); 0.53x in bfloat16 with "
        "AVX512-BF16",
        quoted="1.9-11x",  # torch's time over the native kernel's
    ),
    reduced_decode_bytes=Threshold(
        least=1 * MIB,
        unit="bytes of keys and values, a decode step",
        cpu=_EPYC_AVX2,
        command="python benchmarks/bench_auto.py --dtype bfloat16 float16 float32 --rounds 5 "
        "(docs/benchmarks/data/auto.json)",
        measured="one thread: bfloat16 1.86x at 0.25 MiB, 0.53x at 1 MiB, 0.07-0.17x from 2 MiB; "
        "float16 0.97x at 0.25 MiB, 0.32x at 1 MiB, 0.04-0.10x from 2 MiB",
    ),
    float16_forward_scores=Threshold(
        least=8 * 128 * 128,
        unit="scores (B * H * Tq * Tk)",
        cpu=_EPYC_AVX2,
        command="python benchmarks/bench_auto.py --dtype bfloat16 float16 float32 --rounds 5 "
        "(docs/benchmarks/data/auto.json)",
        measured="float16 Tq = Tk, one thread: 1.00x at T=64, 0.68x at T=96, 0.53-0.55x at "
        "T=128, 0.51-0.62x at T=256; 0.65x causal at T=4096, two threads; on "
        "Zen 4 0.30-0.60x from T=64 (auto-avx512bf16.json)",
        quoted="1.5-3.3x",  # torch's time over the native kernel's
    ),
    # CPUs with AMX, where torch's kernels are fast in every dtype
    matrix_grouped_decode_bytes=Threshold(
        least=16 * MIB,
        unit="bytes of keys and values shared by query heads, a decode step",
        cpu=_XEON_AMX,
        command="python benchmarks/bench_auto.py --dtype float16 bfloat16 float32 --rounds 3 "
        "--long (docs/benchmarks/data/auto-amx.json), and decode steps at two threads",
        measured="4 query heads per key/value head, two threads: 0.45-0.52x in float32 from "
        "32 MiB, 0.52-0.77x in bfloat16 from 16 MiB; one query head per key/value head: "
        "1.4-1.9x at 16-32 MiB, and 1.0-6.9x below 8 MiB",
    ),
    matrix_prefill_length=Threshold(
        least=1024,
        unit="queries and keys (each), bfloat16 inference, head widths multiples of 32",
        cpu=_XEON_AMX,
        command="python benchmarks/bench_auto.py --dtype bfloat16 --long, and the same shapes "
        "with two threads",
        measured="one thread: 0.70-0.72x causal at T=1024-2048, 0.93x unmasked at T=1024; two: "
        "0.84-0.86x and 0.85-0.97x; T=512: 0.9-1.03x causal, 1.18-1.38x unmasked; T=256: "
        "1.3-1.5x",
        quoted="0.7-0.97x",
    ),
    matrix_training_scores=Threshold(
        least=4 * 8 * 512 * 512,
        unit="scores (B * H * Tq * Tk), bfloat16 training",
        cpu=_XEON_AMX,
        command="python benchmarks/bench_training.py --dtype bfloat16 --shapes 1x256 4x512 "
        "1x1024 1x4096 (docs/benchmarks/data/training-bf16-amx.json)",
        measured="forward and backward, two threads: 0.56-0.94x from B=4 T=512 on, 0.98-1.04x "
        "at B=1 T=256",
        quoted="0.56-0.94x",
    ),
    # CPUs with AVX512-BF16 and no AMX
    dot_grouped_decode_bytes=Threshold(
        least=4 * MIB,
        unit="bytes of keys and values shared by query heads, a decode step",
        cpu=_ZEN4,
        command="python benchmarks/bench_auto.py --dtype bfloat16 float16 float32 --rounds 5 "
        "--long (docs/benchmarks/data/auto-avx512bf16.json)",
        measured="float32, one thread, 4 query heads per key/value head: 0.84x at 4 MiB, "
        "0.41-0.55x from 8 MiB; one query head per key/value head: 1.54x at 16 MiB",
    ),
    dot_unmasked_scores=Threshold(
        least=8 * 768 * 768,
        unit="scores (B * H * Tq * Tk), float32/float64 inference without a mask",
        cpu=_ZEN4,
        command="python benchmarks/bench_backends.py --inference "
        "(docs/benchmarks/data/auto_inference-avx512bf16.json), and bench_auto.py one thread",
        measured="float32: 0.92-0.94x at T=768-2048 with one thread and with two, 0.71-0.90x at "
        "T=4096, 0.86-0.95x at T=8192; 1.01-1.09x at T=256-512; float64 0.95-1.0x at "
        "T=512-2048",
        quoted="0.71-0.94x",
    ),
    dot_bfloat16_forward_scores=Threshold(
        least=8 * 128 * 128,
        unit="scores (B * H * Tq * Tk), bfloat16 inference, even widths of q and k",
        cpu=_ZEN4,
        command="python benchmarks/bench_auto.py --dtype bfloat16 float16 float32 --rounds 5 "
        "--long (docs/benchmarks/data/auto-avx512bf16.json)",
        measured="bfloat16, one thread: 1.42x at T=64, 1.03x at T=96, 0.85x at T=128, 0.60x at "
        "T=256, 0.36-0.40x causal at T=256-4096",
        quoted="0.36-0.85x",
    ),
    dot_reduced_decode_reads=Threshold(
        least=256 * 1024,
        unit="bytes torch reads in a bfloat16/float16 decode step: the keys and values once per "
        "query head",
        cpu=_ZEN4,
        command="python benchmarks/bench_auto.py --dtype bfloat16 float16 float32 --rounds 5 "
        "--long --short-decode (docs/benchmarks/data/auto-avx512bf16.json)",
        measured="one thread, 1, 4 and 8 query heads per key/value head: bfloat16 1.99-2.39x at "
        "64 KiB, 0.73-0.81x at 256 KiB, 0.20-0.27x at 1 MiB; float16 1.08-1.29x at 64 KiB, "
        "0.44x at 256 KiB",
        quoted="0.2-0.81x",
    ),
    dot_ungrouped_decode_bytes=Threshold(
        least=64 * MIB,
        unit="bytes of keys and values, one query head per key/value head, a float32/float64 "
        "decode step",
        cpu=_ZEN4,
        command="python benchmarks/bench_auto.py --dtype float32 --rounds 5 --long-decode",
        measured="float32, one and two threads, two runs: H=8 D=64 0.75-0.79x at 64 MiB, "
        "0.69-1.30x at 32 MiB, 1.28-2.34x at 8-16 MiB; H=8-32 D=128 0.42-0.55x at 32-64 MiB, "
        "0.69-1.17x at 16 MiB, 1.09-1.84x at 8 MiB",
        quoted="0.42-0.79x",
    ),
)
