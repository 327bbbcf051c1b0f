"""Attention statistics (``attnkit.attention_stats``) against the forward they describe.

B=1, H=8, D=64, causal, float32, T=32768 (``--t`` scales it down). Side by side in interleaved
``torch.utils.benchmark`` rounds, medians:

* forward: ``attnkit.attention(q, k, v, causal=True)`` with ``auto`` (the native kernel on CPUs
  where it builds), the baseline of every ratio;
* forward + lse: the same with ``return_lse=True``, what a caller runs to have the log-sum-exp;
* stats (lse given): ``attention_stats(q, k, causal=True, lse=lse)``: one pass over the plan;
* stats: ``attention_stats(q, k, causal=True)``: the log-sum-exp pass, then the same pass;
* stats (lse given), eager loop (``--eager``): the pass as a loop of PyTorch operations over the
  eager kernel's plan (``attnkit._kernel.stats.kernel_stats``), what serves a call the native
  pass does not take, for comparison.

``--busy`` keeps one core busy with a spinning process while the calls are timed (a machine
shared with other work): threads of a parallel region that wait for each other then spin on the
cores the others need, under GNU OpenMP's default wait policy (``OMP_WAIT_POLICY`` unset).

"extra MiB" is the peak resident memory a call adds beyond its inputs and its result, measured in
a fresh process (see ``attnkit.cli.measure``); the statistics' own outputs are ``3 * H * T``
floats. "GMAC/s" counts the multiply-adds of the visible pairs' products (``q k^T`` for the
statistics pass, ``q k^T`` and ``p v`` for the forward; the log-sum-exp pass adds one ``q k^T``).

    python benchmarks/bench_stats.py                           # T=32768 (several minutes)
    python benchmarks/bench_stats.py --t 4096 --rounds 5       # a quick look
    python benchmarks/bench_stats.py --threads 1                # one thread: no parallel regions
    python benchmarks/bench_stats.py --busy                     # one core kept busy meanwhile
    python benchmarks/bench_stats.py --json docs/benchmarks/data/stats.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator

import torch

import attnkit
from attnkit import masks
from attnkit._kernel.stats import kernel_stats
from attnkit.cli.measure import extra_peak_memory, time_side_by_side

import results

H, D = 8, 64


def _inputs(t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # (B, T, H, D) projections viewed as (B, H, T, D), as a model's attention sees them
    return tuple(  # type: ignore[return-value]
        torch.randn(1, t, H, D, generator=g).transpose(1, 2) for _ in range(3)
    )


def build(case: str, t: int) -> tuple[Callable[[], object], int]:
    """The call of ``case`` on fresh inputs, and the bytes of its result."""
    q, k, v = _inputs(t)
    out_bytes = 4 * H * t * D
    stats_bytes = 4 * 3 * H * t
    # (read by the cases with lse given alone)
    lse = torch.empty(0)
    if "given" in case:
        lse = attnkit.attention(q, k, v, causal=True, return_lse=True)[1]
    calls: dict[str, tuple[Callable[[], object], int]] = {
        "forward": (lambda: attnkit.attention(q, k, v, causal=True), out_bytes),
        "forward + lse": (
            lambda: attnkit.attention(q, k, v, causal=True, return_lse=True),
            out_bytes + 4 * H * t,
        ),
        "stats (lse given)": (
            lambda: attnkit.attention_stats(q, k, causal=True, lse=lse),
            stats_bytes,
        ),
        "stats": (lambda: attnkit.attention_stats(q, k, causal=True), stats_bytes),
        "stats (lse given), eager loop": (
            lambda: kernel_stats(q, k, lse, mask=masks.causal(), bias=None, scale=D**-0.5),
            stats_bytes,
        ),
    }
    fn, size = calls[case]

    def call() -> object:
        with torch.inference_mode():
            return fn()

    return call, size


CASES = ["forward", "forward + lse", "stats (lse given)", "stats"]


def _macs(case: str, t: int) -> float:
    """Multiply-adds of the visible pairs' products."""
    pairs = H * t * (t + 1) / 2
    per_pair = {"forward": 2, "forward + lse": 2, "stats": 2}.get(case, 1)
    return pairs * D * per_pair


@contextlib.contextmanager
def busy_core(on: bool) -> Iterator[None]:
    """One core kept busy by a spinning process for the block's time (nothing when not ``on``)."""
    if not on:
        yield
        return
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spin.kill()
        spin.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=int, default=32768, help="sequence length (default 32768)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-run-time", type=float, default=0.5)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--threads", type=int, help="torch's threads (default: torch's own)")
    parser.add_argument("--busy", action="store_true", help="keep one core busy meanwhile")
    parser.add_argument("--eager", action="store_true", help="also time the eager loop's pass")
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    t = args.t
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["ATTNKIT_BENCH_THREADS"] = str(args.threads)  # the memory children's
    load = "one core busy with a spinning process" if args.busy else "quiet"
    policy = os.environ.get("OMP_WAIT_POLICY", "default")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}; "
        f"B=1 H={H} T={t} D={D} causal float32; {load}; OMP_WAIT_POLICY {policy}"
    )
    cases = [*CASES, "stats (lse given), eager loop"] if args.eager else CASES
    fns = {case: build(case, t)[0] for case in cases}
    with busy_core(args.busy):
        times = time_side_by_side(fns, rounds=args.rounds, min_run_time=args.min_run_time)
    base = times["forward"]
    print("\n| call | ms | / forward | GMAC/s | extra MiB | result MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for case in cases:
        # (forward + lse: the forward's memory and its log-sum-exp, not measured apart)
        skip = args.no_memory or case in ("forward + lse", "stats (lse given), eager loop")
        mem = None if skip else extra_peak_memory(build, case, t)
        size = build(case, 8)[1] * t // 8  # result bytes scale with T
        mib = "" if mem is None else f"{mem / 2**20:.1f}"
        rate = _macs(case, t) / times[case] / 1e9
        print(
            f"| {case} | {times[case] * 1e3:.0f} | {times[case] / base:.2f} | {rate:.1f} | "
            f"{mib} | {size / 2**20:.1f} |",
            flush=True,
        )
        rows.append(
            {
                "case": case,
                "seconds": times[case],
                "ratio_to_forward": times[case] / base,
                "gmacs": rate,
                "extra_bytes": mem,
                "result_bytes": size,
            }
        )
    if args.json:
        config = {
            "B": 1, "H": H, "T": t, "D": D, "dtype": "float32", "rounds": args.rounds,
            "threads": torch.get_num_threads(), "busy": args.busy, "omp_wait_policy": policy,
        }  # fmt: skip
        results.save(args.json, "stats", rows, config=config)


if __name__ == "__main__":
    main()
