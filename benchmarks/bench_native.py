"""The native CPU kernel against torch SDPA (and attnkit's eager kernel), side by side in one run.

float32, B=1 H=8 D=64. Each row times the chunked backend on its native kernel ("native") and
torch's ``scaled_dot_product_attention`` ("sdpa"), with ``--eager`` also the same backend on its
eager kernel with every block in attnkit's own code ("eager", ``Chunked(native=False,
fused_rows=None)``), in interleaved rounds of ``torch.utils.benchmark``; the table gives each
one's median over the rounds, the worst round, and the ratio of medians to SDPA.

* plain, causal, softcap: T=4096; softcap (30) against SDPA without softcap (which has none).
* window: ``masks.sliding_window(512)`` at T=65536 against SDPA on the 128 independent 512-token
  chunks, made contiguous before the timer starts (the same visible work).

``--backward`` times forward + backward. ``--busy`` starts a process spinning on one core for the
whole run (and stops it at the end): the machine under load.

    python benchmarks/bench_native.py --threads 2
    python benchmarks/bench_native.py --threads 2 --backward --busy --cases causal window
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import attnkit
from attnkit import masks
from attnkit.backends import Chunked

H, D = 8, 64
CASES = ["plain", "causal", "softcap", "window"]


def _spin() -> None:
    while True:
        pass


def _qkv(t: int, grad: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, H, t, D, generator=g).requires_grad_(grad) for _ in range(3)]


def _step(fn: Callable[[], torch.Tensor], backward: bool) -> Callable[[], object]:
    if not backward:
        return fn

    def step() -> None:
        fn().sum().backward()

    return step


def build(case: str, backward: bool, eager_too: bool) -> dict[str, Callable[[], object]]:
    """The calls of one row: native, SDPA and (``eager_too``) eager."""
    native, eager = Chunked(), Chunked(native=False, fused_rows=None)
    if case == "window":
        t, w = 65536, 512
        q, k, v = _qkv(t, backward)
        mask = masks.sliding_window(w)
        # (1, H, T, D) -> (T / w, H, w, D): independent chunks, contiguous before the timer.
        chunks = [
            x.detach().view(1, H, t // w, w, D)[0].transpose(0, 1).contiguous() for x in (q, k, v)
        ]
        chunks = [c.requires_grad_(backward) for c in chunks]

        def ours(backend: Chunked) -> Callable[[], torch.Tensor]:
            return lambda: attnkit.attention(q, k, v, mask=mask, backend=backend)

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(*chunks)

    else:
        q, k, v = _qkv(4096, backward)
        kw: dict[str, object] = {"causal": case == "causal"}
        if case == "softcap":
            kw["softcap"] = 30.0

        def ours(backend: Chunked) -> Callable[[], torch.Tensor]:
            return lambda: attnkit.attention(q, k, v, backend=backend, **kw)  # type: ignore[arg-type]

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=case == "causal")

    fns = {"native": _step(ours(native), backward), "sdpa": _step(sdpa, backward)}
    if eager_too:
        fns["eager"] = _step(ours(eager), backward)
    return fns


def measure(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    for fn in fns.values():
        fn()  # warm-up (and the native kernel's build or load)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
            samples[name].append(timer.blocked_autorange(min_run_time=0.3).median)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=CASES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--busy", action="store_true", help="a second process spins on one core")
    parser.add_argument("--eager", action="store_true", help="also time the eager kernel")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _, why = attnkit._native.status()
    print(f"native kernel: {why}; threads {args.threads}; busy: {args.busy}")
    spinner = None
    if args.busy:
        spinner = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
        spinner.start()
    try:
        print(f"{'case':<10} {'what':<8} {'median ms':>10} {'worst ms':>9} {'/ sdpa':>7}")
        for case in args.cases:
            samples = measure(build(case, args.backward, args.eager), args.rounds)
            base = statistics.median(samples["sdpa"])
            for name, s in samples.items():
                med = statistics.median(s)
                print(
                    f"{case:<10} {name:<8} {med * 1e3:>10.1f} {max(s) * 1e3:>9.1f} "
                    f"{med / base:>7.2f}"
                )
    finally:
        if spinner is not None:
            spinner.terminate()
            spinner.join()


if __name__ == "__main__":
    main()
