"""attnkit.flex with a score_mod against the same call through attention()'s own arguments.

A softcap as a score_mod (``c * tanh(s / c)``) against ``attention(softcap=c)``: attnkit
recognises that score_mod and runs the call as ``softcap=c``, in the native kernel. An additive
relative bias as a score_mod (``s + table[q_idx - kv_idx]``) is recognised as a bias by distance
and runs as a ``DistanceBias`` table, in the native kernel too; it is timed against
``attention(bias=...)`` with that bias written out as a (T, T) tensor (``auto``'s choice, and the
chunked backend's). The rows "per tile" are the same functions wrapped in a
``functools.partial``, which is never recognised: the eager kernel applying them tile by tile.
B=1, H=8, D=64, float32 on the CPU, no mask; forward (no grad) and forward+backward.

Every round times each call once with torch.utils.benchmark (interleaved, so a slow minute of
the machine hurts all of them); "ratio" is flex's time over attention()'s in the same round,
given as the median over the rounds and their range. It also prints what recognising the
softcap costs per call (a cache lookup) and the first time (a torch.fx trace). ``--memory``
also measures the extra peak memory of flex's forward+backward in a fresh process.

    python benchmarks/bench_flex.py              # T = 4096
    python benchmarks/bench_flex.py --t 128 --rounds 5 --threads 1   # a busy machine: 1 thread
    python benchmarks/bench_flex.py --t 1024 --memory
    python benchmarks/bench_flex.py --busy      # with one core kept spinning by another process
    python benchmarks/bench_flex.py --rounds 5 --memory --json front_ends-flex.json
"""

from __future__ import annotations

import argparse
import functools
import statistics
import timeit
from collections.abc import Callable

import torch
from bench_native import Load
from torch import Tensor
from torch.utils import benchmark

import attnkit
from attnkit._score_mod import _SOFTCAPS, distance_bias_of, softcap_of
from attnkit.cli.measure import extra_peak_memory
from attnkit.flex import flex_attention
from attnkit.masks import Geometry

import results

B, H, D = 1, 8, 64
CAP = 20.0


def capped(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
    return CAP * torch.tanh(s / CAP)


def _inputs(t: int, grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, t, D, requires_grad=grad) for _ in range(3))
    table = torch.randn(2 * t) * 0.1
    return q, k, v, table


def calls(t: int, grad: bool) -> dict[str, Callable[[], object]]:
    """The calls at length ``t``, forward only or forward+backward."""
    q, k, v, table = _inputs(t, grad)
    pos = torch.arange(t)
    dense = table[pos[:, None] - pos[None, :] + t]  # (T, T)
    per_tile = functools.partial(capped)  # not a plain function: never recognised

    def relative(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return s + table[qi - kv + t]

    relative_per_tile = functools.partial(relative)

    def run(fn: Callable[[], Tensor]) -> Callable[[], object]:
        def go() -> object:
            if not grad:
                with torch.no_grad():
                    return fn()
            out = fn()
            out.sum().backward()
            return out

        return go

    return {
        "softcap: attention(softcap=)": run(lambda: attnkit.attention(q, k, v, softcap=CAP)),
        "softcap: flex score_mod": run(lambda: flex_attention(q, k, v, capped)),  # type: ignore[arg-type,return-value]
        "softcap: flex per tile": run(lambda: flex_attention(q, k, v, per_tile)),  # type: ignore[arg-type,return-value]
        "bias: attention(bias=)": run(lambda: attnkit.attention(q, k, v, bias=dense)),
        "bias: chunked(bias=)": run(
            lambda: attnkit.attention(q, k, v, bias=dense, backend="chunked")
        ),
        "bias: flex score_mod": run(lambda: flex_attention(q, k, v, relative)),  # type: ignore[arg-type,return-value]
        "bias: flex per tile": run(lambda: flex_attention(q, k, v, relative_per_tile)),  # type: ignore[arg-type,return-value]
    }


PAIRS = [
    ("softcap: attention(softcap=)", "softcap: flex score_mod"),
    ("softcap: attention(softcap=)", "softcap: flex per tile"),
    ("bias: attention(bias=)", "bias: flex score_mod"),
    ("bias: chunked(bias=)", "bias: flex score_mod"),
    ("bias: attention(bias=)", "bias: flex per tile"),
]


def time_rounds(
    fns: dict[str, Callable[[], object]], rounds: int, min_run_time: float
) -> dict[str, list[float]]:
    """Seconds per call of each callable in each of ``rounds`` interleaved rounds."""
    for fn in fns.values():  # warm-up: first-call costs (kernel selection, allocations)
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
            samples[name].append(timer.blocked_autorange(min_run_time=min_run_time).median)
    return samples


def ratio_text(base: list[float], other: list[float]) -> str:
    """``median [min-max]`` of the per-round ratios ``other / base``."""
    ratios = [o / b for b, o in zip(base, other, strict=True)]
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"


def recognition_cost() -> tuple[float, float]:
    """Seconds softcap_of takes on a score_mod it has seen (a lookup), and on a new one (a
    trace)."""
    softcap_of(capped)
    n = 2000
    hit = timeit.timeit(lambda: softcap_of(capped), number=n) / n
    cold = []
    for _ in range(5):
        _SOFTCAPS.clear()
        cold.append(timeit.timeit(lambda: softcap_of(capped), number=1))
    return hit, statistics.median(cold)


def table_cost(t: int) -> float:
    """Seconds distance_bias_of takes per call on the benchmark's bias score_mod once it has
    been traced: a lookup, two calls of the score_mod and the table's concatenation."""
    table = _inputs(t, grad=False)[3]

    def relative(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return s + table[qi - kv + t]

    geo = Geometry((B,), H, t, t, torch.device("cpu"))
    distance_bias_of(relative, geo, torch.float32)
    n = 200
    return timeit.timeit(lambda: distance_bias_of(relative, geo, torch.float32), number=n) / n


def _make_flex_train(t: int) -> tuple[Callable[[], object], int]:
    fns = calls(t, grad=True)
    return fns["softcap: flex score_mod"], 4 * B * H * t * D * 4


def _make_flex_bias_train(t: int) -> tuple[Callable[[], object], int]:
    fns = calls(t, grad=True)
    return fns["bias: flex score_mod"], 4 * B * H * t * D * 4


def time_pairs(t: int, rounds: int) -> list[dict[str, object]]:
    """Time every pair at length ``t``, forward then forward+backward; print each pair's times
    and ratio, and return them as the rows of the JSON."""
    rows: list[dict[str, object]] = []
    for grad in (False, True):
        samples = time_rounds(calls(t, grad), rounds=rounds, min_run_time=0.1)
        mode = "forward+backward" if grad else "forward"
        for base, flex in PAIRS:
            b, f = statistics.median(samples[base]), statistics.median(samples[flex])
            print(
                f"{mode:<17} {base:<30} {b * 1e3:9.2f} ms   {flex:<24} {f * 1e3:9.2f} ms   "
                f"ratio {ratio_text(samples[base], samples[flex])}"
            )
            ratios = [o / a for a, o in zip(samples[base], samples[flex], strict=True)]
            rows.append(
                {
                    "api": "flex",
                    "pass": mode,
                    "call": flex,
                    "baseline": base,
                    "ms": f * 1e3,
                    "baseline_ms": b * 1e3,
                    "ratio": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--busy", action="store_true", help="one core kept spinning throughout")
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load = "one core busy" if args.busy else "quiet"
    print(f"B={B} H={H} T={args.t} D={D} float32, {torch.get_num_threads()} threads, {load}")
    spinner = Load() if args.busy else None
    try:
        rows = time_pairs(args.t, args.rounds)
    finally:
        if spinner is not None:
            spinner.stop()
    hit, cold = recognition_cost()
    print(
        f"recognising the softcap score_mod: {hit * 1e6:.1f} us per call once seen, "
        f"{cold * 1e3:.2f} ms the first time (torch.fx trace)"
    )
    print(
        f"recognising the bias score_mod and computing its table: {table_cost(args.t) * 1e6:.0f} "
        "us per call once seen"
    )
    extras: dict[str, float] = {}
    if args.memory:
        for name, make in (("softcap", _make_flex_train), ("bias", _make_flex_bias_train)):
            extra = extra_peak_memory(make, args.t)
            if extra is not None:
                extras[name] = extra / 2**20
                txt = args.t * args.t * H * 4
                print(
                    f"flex {name} forward+backward: {extra / 2**20:.0f} MiB extra peak "
                    f"({100 * extra / txt:.1f}% of one (H, T, T) float32 score matrix)"
                )
    if args.json:
        config = {
            "B": B,
            "H": H,
            "T": args.t,
            "D": D,
            "dtype": "float32",
            "threads": torch.get_num_threads(),
            "rounds": args.rounds,
            "load": load,
            "extra_mib": {k: round(v, 1) for k, v in extras.items()},
        }
        results.save(args.json, "front_ends", rows, config=config)


if __name__ == "__main__":
    main()
