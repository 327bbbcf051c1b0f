"""An hour of audio on a CPU: relative attention and a Conformer layer with limited context.

One hour of 40 ms frames is T = 90,000. The module is RelativeMultiHeadAttention(256, 4) with
``masks.sliding_window(128, 128)`` (128 frames of context on each side, as a limited-context
Conformer uses), and a whole ConformerLayer(256, 4, context=(128, 128)). Inference, float32, batch
1. Times are medians of torch.utils.benchmark runs, every length in the same interleaved rounds;
"extra MiB" is the peak resident memory a call adds beyond its input and output, measured in a
fresh process. Linear cost means the time grows
10x from T = 9,000 to T = 90,000 and the extra memory stays flat but for the O(T) activations.

    python benchmarks/bench_long_audio.py                 # T = 9,000 and 90,000 (~10 minutes)
    python benchmarks/bench_long_audio.py --json docs/benchmarks/data/long_audio.json
    python benchmarks/bench_long_audio.py --modules relative --no-memory
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable

import torch

import attnkit
from attnkit.cli.measure import extra_peak_memory, time_side_by_side

import results

D, H, CONTEXT = 256, 4, 128


def build(what: str, t: int) -> tuple[Callable[[], object], int]:
    """The call of ``what`` ("relative" or "conformer") on ``t`` frames; module level for the
    memory measurement's child process."""
    torch.manual_seed(0)
    x = torch.randn(1, t, D)
    if what == "relative":
        m: torch.nn.Module = attnkit.RelativeMultiHeadAttention(D, H).eval()
        window = attnkit.masks.sliding_window(CONTEXT, CONTEXT)

        def call() -> object:
            with torch.inference_mode():
                return m(x, mask=window)

    else:
        m = attnkit.ConformerLayer(D, H, kernel_size=31, context=(CONTEXT, CONTEXT)).eval()

        def call() -> object:
            with torch.inference_mode():
                return m(x)

    return call, x.numel() * x.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[9000, 90000])
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--modules", nargs="*", choices=["relative", "conformer"], default=["relative", "conformer"]
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--json")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}, "
        f"float32, d_model={D}, heads={H}, context={CONTEXT} frames each side"
    )
    print("\n| module | T (frames) | audio | seconds | growth from the first T | extra MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for what in args.modules:
        # Every length of a module in the same interleaved rounds: the growth is a ratio of two
        # times, and a machine whose load changes between them would skew it.
        calls = {t: build(what, t)[0] for t in args.lengths}
        times = time_side_by_side(
            {str(t): call for t, call in calls.items()}, rounds=args.rounds, min_run_time=2.0
        )
        del calls
        first = None
        for t in args.lengths:
            seconds = times[str(t)]
            first = first or (t, seconds)
            mem = None if args.no_memory else extra_peak_memory(build, what, t)
            mib = "" if mem is None else f"{mem / 2**20:.0f}"
            growth = seconds / first[1]
            minutes = t * 0.04 / 60
            print(
                f"| {what} | {t} | {minutes:.0f} min | {seconds:.2f} | {growth:.1f}x "
                f"(T x{t / first[0]:.0f}) | {mib} |",
                flush=True,
            )
            rows.append({"module": what, "T": t, "seconds": seconds, "extra_bytes": mem})
    if args.json:
        results.save(
            args.json,
            "long_audio",
            rows,
            config={"D": D, "H": H, "context": CONTEXT, "dtype": "float32", "B": 1},
        )


if __name__ == "__main__":
    main()
