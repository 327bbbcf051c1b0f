"""RelativeMultiHeadAttention against MultiHeadAttention and openspeech's module: time and memory.

float32 on the CPU, torch's default threads. Six measurements, each printed as a table:

* ``speed``: B=4 T=1024 D=512 H=8, forward under ``torch.inference_mode``: attnkit's
  MultiHeadAttention, RelativeMultiHeadAttention (its default sdpa path, its chunked path, which
  is what a training forward runs, and ``legacy="openspeech"``) and openspeech's own
  RelativeMultiHeadAttention, fed its absolute encoding, when the ``openspeech-core`` package is
  installed. Medians of interleaved torch.utils.benchmark rounds; "ratio" is time /
  MultiHeadAttention's. "paired" is the median of the ratios taken round by round in 20 more
  rounds of 3 calls each, the order reversed every other round: a drift of a shared machine's
  speed then lands on both sides of each ratio (see :func:`paired_ratios`).
* ``train-speed``: training steps (forward + backward) of both modules at the same size, the
  paired ratio from 30 rounds of one step each, with its quartiles.
* ``load``: the forward of both modules (B=4 T=1024) in 10 rounds on a quiet machine, then 10
  with another process spinning on one core (started and stopped by the script): the busy
  median and the worst busy round over the quiet median.
* ``dropout``: a RelativeMultiHeadAttention training step at B=1 T=4096 with attention dropout
  0.1 against none: time and extra peak memory (dropout decisions are regenerated in the
  backward, never stored).
* ``memory``: B=1 T=16384 D=512 H=8 inference: one call's time and the peak resident memory it
  adds beyond its inputs and output, in a fresh process
  (:func:`attnkit.cli.measure.extra_peak_memory`). One ``(H, T, T)`` float32 score tensor would
  be 8 GiB; openspeech's module holds several, so it is not run there.
* ``training``: B=1 T=8192 D=512 H=8, forward and backward: time, extra peak memory, and the
  largest tensor autograd saves for the backward (against one ``(T, T)`` float32 matrix).

    python benchmarks/bench_relative.py                 # all three (a few minutes)
    python benchmarks/bench_relative.py --only speed    # or memory, training
    python benchmarks/bench_relative.py --quick         # smaller T everywhere, for a smoke run
    python benchmarks/bench_relative.py --json docs/benchmarks/data/relative.json

openspeech's module is the one openspeech-core 0.4.0 ships. Install it without its dependencies,
``pip install --no-deps openspeech-core==0.4.0``: they serve openspeech's training stack
(Lightning, Hydra, wandb, librosa), and the module needs only torch. The script imports the
module's two files from the installed package without running ``openspeech/__init__.py``, which
would import that stack.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import types
from collections.abc import Callable
from importlib import metadata
from typing import Any

import torch
from torch import nn

import attnkit
from attnkit.cli.measure import extra_peak_memory, time_side_by_side
from attnkit.modules import _relpos

import results

D, H = 512, 8
OPENSPEECH = "openspeech (openspeech-core)"


def load_openspeech() -> type[nn.Module] | None:
    """openspeech-core's RelativeMultiHeadAttention, or None when the package is not installed."""
    try:
        root = metadata.distribution("openspeech-core").locate_file("openspeech")
    except metadata.PackageNotFoundError:
        return None
    # Empty parent packages, so that importing the module does not run openspeech/__init__.py.
    for name, path in (("openspeech", root), ("openspeech.modules", root / "modules")):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
    from openspeech.modules.relative_multi_head_attention import (  # type: ignore[import-not-found]
        RelativeMultiHeadAttention,
    )

    cls: type[nn.Module] = RelativeMultiHeadAttention
    return cls


def build(
    label: str, b: int, t: int, train: bool, dropout: float = 0.0
) -> tuple[Callable[[], Any], int]:
    """A call of one candidate on fresh inputs; module-level so a child process can run it."""
    torch.manual_seed(0)
    x = torch.randn(b, t, D)
    module: nn.Module
    if label == "MultiHeadAttention":
        module = attnkit.MultiHeadAttention(D, H, dropout=dropout)
        call: Callable[[], Any] = lambda: module(x)  # noqa: E731
    elif label.startswith("Relative"):
        legacy = "openspeech" if "legacy" in label else None
        backend = "chunked" if "chunked" in label else "auto"
        module = attnkit.RelativeMultiHeadAttention(D, H, legacy=legacy, dropout=dropout)
        call = lambda: module(x, backend=backend)  # noqa: E731
    elif label == OPENSPEECH:
        theirs = load_openspeech()
        assert theirs is not None
        module = theirs(D, H, 0.0)
        pos = _relpos.openspeech_sinusoid(t, D).expand(b, t, D)
        call = lambda: module(x, x, x, pos)  # noqa: E731
    else:
        raise ValueError(f"unknown candidate {label!r}")
    if train:
        module.train()

        def step() -> None:
            call().sum().backward()

        return step, 0
    module.eval()

    def infer() -> Any:
        with torch.inference_mode():
            return call()

    return infer, b * t * D * 4


def largest_saved(label: str, b: int, t: int) -> int:
    """Elements of the largest tensor autograd keeps for the backward of one forward."""
    sizes = [0]

    def pack(x: torch.Tensor) -> torch.Tensor:
        sizes.append(x.numel())
        return x

    torch.manual_seed(0)
    module: nn.Module = (
        attnkit.MultiHeadAttention(D, H)
        if label == "MultiHeadAttention"
        else attnkit.RelativeMultiHeadAttention(D, H)
    )
    x = torch.randn(b, t, D)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        module(x)
    return max(sizes)


def paired_ratios(
    fns: dict[str, Callable[[], Any]], base: str, pairs: int, number: int
) -> dict[str, list[float]]:
    """Each callable's time over ``base``'s, once per round: ``pairs`` rounds, each timing
    every callable for ``number`` calls back to back, in an order reversed every other round, so
    that a drift of the machine's speed (another tenant, a clock change) lands on both sides of a
    ratio alike."""
    from torch.utils import benchmark

    names = list(fns)
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for i in range(pairs):
        seconds = {}
        for name in names if i % 2 == 0 else names[::-1]:
            timer = benchmark.Timer(
                "fn()", globals={"fn": fns[name]}, num_threads=torch.get_num_threads()
            )
            seconds[name] = timer.timeit(number).median
        for name in names:
            ratios[name].append(seconds[name] / seconds[base])
    return ratios


def _paired_fields(ratios: list[float]) -> dict[str, float]:
    """The median of a candidate's per-round ratios and their quartiles."""
    low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios * 3)
    return {
        "paired_ratio": statistics.median(ratios),
        "paired_low": low,
        "paired_high": high,
        "pairs": len(ratios),
    }


def speed(quick: bool) -> list[dict[str, Any]]:
    b, t = (2, 512) if quick else (4, 1024)
    labels = [
        "MultiHeadAttention",
        "RelativeMultiHeadAttention",
        "Relative backend=chunked",
        "Relative legacy=openspeech",
    ]
    if load_openspeech() is not None:
        labels.append(OPENSPEECH)
    else:
        print("openspeech-core is not installed: its row is skipped", file=sys.stderr)
    fns = {lab: build(lab, b, t, train=False)[0] for lab in labels}
    times = time_side_by_side(fns, rounds=2 if quick else 5, min_run_time=0.5 if quick else 2.0)
    pairs = paired_ratios(fns, "MultiHeadAttention", 4 if quick else 20, 3)
    base = times["MultiHeadAttention"]
    theirs = times.get(OPENSPEECH)
    print(f"\nforward, B={b} T={t} D={D} H={H} float32, inference_mode")
    print(f"{'candidate':<30} {'ms':>9} {'/ MHA':>7} {'paired / MHA':>13} {'/ openspeech':>13}")
    rows = []
    for lab in labels:
        vs_theirs = f"{times[lab] / theirs:.2f}" if theirs else ""
        paired = _paired_fields(pairs[lab])
        print(
            f"{lab:<30} {times[lab] * 1e3:>9.1f} {times[lab] / base:>7.2f} "
            f"{paired['paired_ratio']:>13.2f} {vs_theirs:>13}"
        )
        rows.append(
            {
                "what": "speed",
                "candidate": lab,
                "B": b,
                "T": t,
                "seconds": times[lab],
                "ratio": times[lab] / base,
                **paired,
            }
        )
    return rows


def train_speed(quick: bool) -> list[dict[str, Any]]:
    """Training steps (forward + backward) of both modules at the speed table's size."""
    b, t = (2, 512) if quick else (4, 1024)
    labels = ["MultiHeadAttention", "RelativeMultiHeadAttention"]
    fns = {lab: build(lab, b, t, train=True)[0] for lab in labels}
    times = time_side_by_side(fns, rounds=2 if quick else 5, min_run_time=0.5 if quick else 2.0)
    pairs = paired_ratios(fns, "MultiHeadAttention", 4 if quick else 30, 1)
    base = times["MultiHeadAttention"]
    print(f"\ntraining step (forward + backward), B={b} T={t} D={D} H={H} float32")
    print(f"{'candidate':<30} {'ms':>9} {'/ MHA':>7} {'paired / MHA':>13} {'quartiles':>12}")
    rows = []
    for lab in labels:
        paired = _paired_fields(pairs[lab])
        quartiles = f"{paired['paired_low']:.2f}-{paired['paired_high']:.2f}"
        print(
            f"{lab:<30} {times[lab] * 1e3:>9.1f} {times[lab] / base:>7.2f} "
            f"{paired['paired_ratio']:>13.2f} {quartiles:>12}"
        )
        rows.append(
            {
                "what": "train-speed",
                "candidate": lab,
                "B": b,
                "T": t,
                "seconds": times[lab],
                "ratio": times[lab] / base,
                **paired,
            }
        )
    return rows


def _spin() -> None:
    while True:
        pass


def _rounds(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each callable in each of ``rounds`` interleaved rounds."""
    from torch.utils import benchmark

    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
            samples[name].append(timer.blocked_autorange(min_run_time=0.3).median)
    return samples


def load(quick: bool) -> list[dict[str, Any]]:
    """Forward calls on a quiet machine, then with another process spinning on one core."""
    b, t = (2, 512) if quick else (4, 1024)
    rounds = 3 if quick else 10
    labels = ["MultiHeadAttention", "RelativeMultiHeadAttention"]
    fns = {lab: build(lab, b, t, train=False)[0] for lab in labels}
    for fn in fns.values():
        fn()
    quiet = _rounds(fns, rounds)
    spinner = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    spinner.start()
    try:
        busy = _rounds(fns, rounds)
    finally:
        spinner.terminate()
        spinner.join()
    print(f"\nforward, B={b} T={t}, {rounds} rounds quiet then {rounds} with one core busy")
    print(f"{'candidate':<30} {'quiet ms':>9} {'busy ms':>8} {'median x':>9} {'worst x':>8}")
    rows = []
    for lab in labels:
        q, w = statistics.median(quiet[lab]), statistics.median(busy[lab])
        worst = max(busy[lab]) / q
        print(f"{lab:<30} {q * 1e3:>9.1f} {w * 1e3:>8.1f} {w / q:>9.2f} {worst:>8.2f}")
        rows.append(
            {
                "what": "load",
                "candidate": lab,
                "B": b,
                "T": t,
                "quiet_seconds": q,
                "busy_seconds": w,
                "busy_worst_seconds": max(busy[lab]),
            }
        )
    return rows


def dropout(quick: bool) -> list[dict[str, Any]]:
    """A RelativeMultiHeadAttention training step with attention dropout 0.1 against none."""
    t = 1024 if quick else 4096
    label = "RelativeMultiHeadAttention"
    fns = {p: build(label, 1, t, True, p)[0] for p in (0.0, 0.1)}
    times = time_side_by_side(fns, rounds=2 if quick else 3, min_run_time=0.5 if quick else 2.0)
    print(f"\ntraining step of {label}, B=1 T={t} D={D} H={H} float32: attention dropout")
    print(f"{'dropout':<10} {'s':>7} {'/ none':>7} {'extra MiB':>10} {'/ none':>7}")
    mems = {p: extra_peak_memory(build, label, 1, t, True, p) for p in fns}
    rows = []
    for p in fns:
        mem, base = mems[p], mems[0.0]
        mib = "" if mem is None else f"{mem / 2**20:.0f}"
        vs = "" if mem is None or not base else f"{mem / base:.2f}"
        print(f"{p:<10} {times[p]:>7.3f} {times[p] / times[0.0]:>7.2f} {mib:>10} {vs:>7}")
        rows.append(
            {
                "what": "dropout",
                "candidate": label,
                "dropout": p,
                "B": 1,
                "T": t,
                "seconds": times[p],
                "extra_bytes": mem,
            }
        )
    return rows


def memory(quick: bool) -> list[dict[str, Any]]:
    t = 4096 if quick else 16384
    print(f"\ninference, B=1 T={t} D={D} H={H} float32: one call's time and extra peak memory")
    print(f"{'candidate':<30} {'s':>7} {'extra MiB':>10} {'one (H,T,T) MiB':>16}")
    rows = []
    for lab in ["MultiHeadAttention", "RelativeMultiHeadAttention", "Relative legacy=openspeech"]:
        fn, _ = build(lab, 1, t, False)
        seconds = time_side_by_side({lab: fn}, rounds=1, min_run_time=0.1)[lab]
        del fn
        mem = extra_peak_memory(build, lab, 1, t, False)
        mib = "" if mem is None else f"{mem / 2**20:.0f}"
        print(f"{lab:<30} {seconds:>7.2f} {mib:>10} {H * t * t * 4 / 2**20:>16.0f}", flush=True)
        rows.append(
            {
                "what": "memory",
                "candidate": lab,
                "B": 1,
                "T": t,
                "seconds": seconds,
                "extra_bytes": mem,
            }
        )
    return rows


def training(quick: bool) -> list[dict[str, Any]]:
    t = 2048 if quick else 8192
    print(f"\ntraining step (forward + backward), B=1 T={t} D={D} H={H} float32")
    print(
        f"{'candidate':<30} {'s':>7} {'extra MiB':>10} {'largest saved MiB':>18} {'(T,T) MiB':>10}"
    )
    rows = []
    for lab in ["MultiHeadAttention", "RelativeMultiHeadAttention"]:
        fn, _ = build(lab, 1, t, train=True)
        seconds = time_side_by_side({lab: fn}, rounds=1, min_run_time=0.1)[lab]
        del fn
        mem = extra_peak_memory(build, lab, 1, t, True)
        saved = largest_saved(lab, 1, t)
        mib = "" if mem is None else f"{mem / 2**20:.0f}"
        print(
            f"{lab:<30} {seconds:>7.2f} {mib:>10} {saved * 4 / 2**20:>18.0f} "
            f"{t * t * 4 / 2**20:>10.0f}",
            flush=True,
        )
        rows.append(
            {
                "what": "training",
                "candidate": lab,
                "B": 1,
                "T": t,
                "seconds": seconds,
                "extra_bytes": mem,
                "largest_saved": saved,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        choices=["speed", "train-speed", "load", "dropout", "memory", "training"],
        action="append",
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer rounds")
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    rows = []
    sections = (
        ("speed", speed),
        ("train-speed", train_speed),
        ("load", load),
        ("dropout", dropout),
        ("memory", memory),
        ("training", training),
    )
    for name, fn in sections:
        if args.only is None or name in args.only:
            rows += fn(args.quick)
    if args.json:
        results.save(args.json, "relative", rows, config={"D": D, "H": H, "dtype": "float32"})


if __name__ == "__main__":
    main()
