"""Index masks inside ``torch.compile``: the compiled call on the gathered kernel against the same
compiled call on the kernel that scans the keys (what attnkit's operator ran for index masks
before it asked the gathered kernel), and against the eager call.

``masks.key_indices(idx) & masks.causal()``, each query attending ``k`` keys of its causal past
chosen at random (see ``bench_indices.py``), float32, one selection shared by the ``H`` heads.

* compiled, gathered: ``torch.compile(fullgraph=True)`` of an ``attnkit.attention`` call; the
  graph holds attnkit's operator, which runs the gathered kernel (O(Tq * k)).
* compiled, scanning: the same compiled function, its operator made to plan and run the
  scanning kernel (O(Tq * Tk) over the blocks the selection touches), as it did before.
* eager, gathered: the same call without torch.compile.

Forward alone (with ``--backward``, also forward + backward), medians of interleaved
torch.utils.benchmark rounds; each ratio is a time over another in the same run.

    python benchmarks/bench_indices_compiled.py                      # Tq = Tk = 8192, k = 512
    python benchmarks/bench_indices_compiled.py --tq 4096 --k 256 --json compiled.json
"""

from __future__ import annotations

import argparse
import contextlib
import platform
from collections.abc import Callable, Iterator
from typing import Any

import torch
from bench_indices import selection

import attnkit
from attnkit import masks
from attnkit._kernel import operator
from attnkit.cli.measure import time_side_by_side

import results


@contextlib.contextmanager
def scanning() -> Iterator[None]:
    """attnkit's operator as it ran index masks before: never on the gathered kernel."""
    kept = operator._gathered
    operator._gathered = lambda *args: None  # type: ignore[assignment]
    try:
        yield
    finally:
        operator._gathered = kept


def candidates(
    tq: int, tk: int, k: int, h: int, d: int, backward: bool
) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(1)
    q, keys, values = (
        torch.randn(1, h, t, d, generator=g).requires_grad_(backward) for t in (tq, tk, tk)
    )
    idx = selection(tq, tk, k)
    grad = torch.randn(1, h, tq, d, generator=g)

    def call(q: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        mask = masks.key_indices(idx) & masks.causal()
        return attnkit.attention(q, keys, values, mask=mask, backend="chunked")

    compiled: Callable[..., Any] = torch.compile(call, fullgraph=True)

    def run(fn: Callable[..., torch.Tensor]) -> Callable[[], object]:
        if not backward:
            return lambda: fn(q, idx).detach()
        return lambda: fn(q, idx).backward(grad)

    def before() -> object:
        with scanning():
            return run(compiled)()

    return {"compiled, gathered": run(compiled), "compiled, scanning": before, "eager": run(call)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tq", type=int, default=8192)
    parser.add_argument("--tk", type=int, help="keys (default: Tq)")
    parser.add_argument("--k", type=int, default=512, help="keys selected per query")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, help="torch's threads (default: its own count)")
    parser.add_argument("--backward", action="store_true", help="also time forward + backward")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tq, k, h, d = args.tq, args.k, args.heads, args.dim
    tk = args.tk or tq
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}; "
        f"Tq={tq} Tk={tk} k={k} H={h} D={d} float32, causal, torch.compile(fullgraph=True)"
    )
    print("\n| pass | compiled, gathered s | compiled, scanning s | eager s | "
          "scanning / gathered | compiled / eager |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for backward in (False, True) if args.backward else (False,):
        fns = candidates(tq, tk, k, h, d, backward)
        with attnkit.record_dispatch() as calls:
            for fn in fns.values():
                fn()
        kernels = [c.kernel for c in calls]
        times = time_side_by_side(fns, rounds=args.rounds, min_run_time=0.5)
        ours, old, eager = (times[n] for n in ("compiled, gathered", "compiled, scanning", "eager"))
        row = {
            "pass": "fwd+bwd" if backward else "forward",
            "compiled_gathered_seconds": ours,
            "compiled_scanning_seconds": old,
            "eager_seconds": eager,
            "scanning_over_gathered": old / ours,
            "compiled_over_eager": ours / eager,
            "kernels": kernels,
        }
        rows.append(row)
        print(
            f"| {row['pass']} | {ours:.4f} | {old:.4f} | {eager:.4f} | {old / ours:.1f} | "
            f"{ours / eager:.2f} |",
            flush=True,
        )
    for name, kernel in zip(fns, rows[-1]["kernels"], strict=True):
        print(f"{name}: {kernel}")
    if args.json:
        config = {"Tq": tq, "Tk": tk, "k": k, "H": h, "D": d, "dtype": "float32"}
        config |= {"rounds": args.rounds, "compiled": "fullgraph"}
        results.save(args.json, "indices_compiled", rows, config=config)


if __name__ == "__main__":
    main()
