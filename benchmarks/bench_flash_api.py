"""attnkit.flash_attn's front end against the attention() call it makes, side by side.

``flash_attn_func(q, k, v, causal=True)`` on ``(B, T, H, D)`` tensors against
``attnkit.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)``
with the output transposed back (a view: "attention()"), and the same with the output made
contiguous, as flash-attn returns it and ``flash_attn_func`` does ("attention() + copy"). The
inputs go in as views in both. float32 on the CPU, forward (no grad) and forward+backward, at a
tiny size (the front end's fixed cost, in microseconds) and at realistic ones.

Every round times each call once with torch.utils.benchmark (interleaved, so a slow minute of the
machine hurts all of them); "overhead" is flash_attn_func's time over the attention() call's in
the same round, minus 1: the median over the rounds and their range (every other round runs the
calls in reverse order). The tiny size gets five times the rounds, each shorter.

    python benchmarks/bench_flash_api.py                       # tiny, B=2 T=1024, B=1 T=4096
    python benchmarks/bench_flash_api.py --quick --threads 1   # tiny and T=1024 only
    python benchmarks/bench_flash_api.py --json docs/benchmarks/data/front_ends-flash.json
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils import benchmark

import attnkit
from attnkit.flash_attn import flash_attn_func

import results

H, D = 8, 64
SIZES = [("tiny", 1, 16, 2, 16), ("B=2 T=1024", 2, 1024, H, D), ("B=1 T=4096", 1, 4096, H, D)]


def calls(b: int, t: int, h: int, d: int, grad: bool) -> dict[str, Callable[[], object]]:
    """flash_attn_func and its attention() equivalents on (B, T, H, D) tensors."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, t, h, d, requires_grad=grad) for _ in range(3))

    def plain() -> Tensor:
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return attnkit.attention(qt, kt, vt, causal=True).transpose(1, 2)  # type: ignore[union-attr]

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
        "attention()": run(plain),
        "attention() + copy": run(lambda: plain().contiguous()),
        "flash_attn_func": run(lambda: flash_attn_func(q, k, v, causal=True)),  # type: ignore[arg-type,return-value]
    }


def time_rounds(
    fns: dict[str, Callable[[], object]], rounds: int, min_run_time: float
) -> dict[str, list[float]]:
    """Seconds per call of each callable in each of ``rounds`` interleaved rounds."""
    for fn in fns.values():  # warm-up: first-call costs (kernel selection, allocations)
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        # Every other round in reverse order: a trend in the machine's load favours neither.
        for name, fn in list(fns.items())[:: -1 if r % 2 else 1]:
            timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
            samples[name].append(timer.blocked_autorange(min_run_time=min_run_time).median)
    return samples


def overhead_text(base: list[float], other: list[float]) -> str:
    """``+x% [min..max]`` of the per-round ``other / base - 1``."""
    ratios = [100 * (o / b - 1) for b, o in zip(base, other, strict=True)]
    return f"{statistics.median(ratios):+5.1f}% [{min(ratios):+.1f}..{max(ratios):+.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="rounds at the realistic sizes")
    parser.add_argument("--quick", action="store_true", help="the tiny size and T=1024 only")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"causal, float32, {torch.get_num_threads()} threads")
    rows: list[dict[str, object]] = []
    for name, b, t, h, d in SIZES[:2] if args.quick else SIZES:
        for grad in (False, True):
            # The tiny size: many short rounds, its calls take microseconds.
            rounds, run_time = (5 * args.rounds, 0.05) if t < 100 else (args.rounds, 0.5)
            samples = time_rounds(calls(b, t, h, d, grad), rounds, min_run_time=run_time)
            base = samples["attention()"]
            mode = "forward+backward" if grad else "forward"
            cells = []
            for what in ("attention() + copy", "flash_attn_func"):
                diff = statistics.median(samples[what]) - statistics.median(base)
                cells.append(f"{what} {overhead_text(base, samples[what])} ({diff * 1e6:+.0f} us)")
                ratios = [o / a for a, o in zip(base, samples[what], strict=True)]
                rows.append(
                    {
                        "api": "flash_attn",
                        "pass": f"{name}, {mode}",
                        "call": what,
                        "baseline": "attention()",
                        "ms": statistics.median(samples[what]) * 1e3,
                        "baseline_ms": statistics.median(base) * 1e3,
                        "ratio": statistics.median(ratios),
                        "ratio_min": min(ratios),
                        "ratio_max": max(ratios),
                    }
                )
            print(
                f"{name:<11} {mode:<17} attention() {statistics.median(base) * 1e3:8.3f} ms   "
                + "   ".join(cells)
            )
    if args.json:
        config = {"H": H, "D": D, "dtype": "float32", "threads": torch.get_num_threads()}
        results.save(args.json, "front_ends", rows, config=config)


if __name__ == "__main__":
    main()
