"""The native CPU kernel against torch SDPA (and attnkit's eager kernel), side by side in one run.

B=1 H=8 D=64, in each dtype of ``--dtype`` (float32 by default; bfloat16 and float16 inputs are
rounded from the same float32 numbers). Each row times the chunked backend on its native kernel
("native") and torch's ``scaled_dot_product_attention`` ("sdpa"), with ``--eager`` also the same
backend on its eager kernel with every block in attnkit's own code ("eager",
``Chunked(native=False, fused_rows=None)``), in interleaved rounds of ``torch.utils.benchmark``;
the table gives each one's median over the rounds, the worst round, the ratio of medians to SDPA
in the same dtype, and for other dtypes the ratio to the same candidate in float32.

* plain, causal, softcap: T=4096; softcap (30) against SDPA without softcap (which has none).
* window: ``masks.sliding_window(512)`` at T=65536 against SDPA on the 128 independent 512-token
  chunks, made contiguous before the timer starts (the same visible work).
* documents: ``masks.documents`` of 32 documents of 1024 tokens at T=32768 against SDPA on the 32
  documents as one ``(32, H, 1024, D)`` batch, made contiguous before the timer starts;
  documents_unequal: 32 documents of random lengths against one SDPA call per document, each on
  its own contiguous tensors.

``--backward`` times forward + backward. ``--load busy`` (or ``--busy``) keeps a second process
spinning on one core for the whole run: the machine under load. ``--load both`` runs quiet and
busy rounds alternately (the spinning process is paused in the quiet ones) and adds, per
candidate, its busy median and its worst busy round over its quiet median. ``--memory`` adds the
native call's extra peak memory (beyond its inputs, output and gradients, in a fresh process).

    python benchmarks/bench_native.py --threads 2
    python benchmarks/bench_native.py --cases causal --dtype float32 bfloat16 --backward
    python benchmarks/bench_native.py --backward --load both --rounds 10 --cases causal window
    python benchmarks/bench_native.py --cases documents --memory --json native.json
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import attnkit
from attnkit import masks
from attnkit.backends import Chunked
from attnkit.cli.measure import extra_peak_memory

import results

H, D = 8, 64
CASES = ["plain", "causal", "softcap", "window", "documents", "documents_unequal"]


def _spin() -> None:
    while True:
        pass


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def _qkv(t: int, grad: bool, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, H, t, D, generator=g).to(dtype).requires_grad_(grad) for _ in range(3)]


def _document_lengths(t: int, n: int) -> list[int]:
    """``n`` random lengths summing to ``t`` (the same as bench_masks.py's)."""
    g = torch.Generator().manual_seed(1)
    cuts = torch.randperm(t - 1, generator=g)[: n - 1].add(1).sort().values.tolist()
    bounds = [0, *cuts, t]
    return [bounds[i + 1] - bounds[i] for i in range(n)]


def _chunks(x: torch.Tensor, w: int, grad: bool) -> torch.Tensor:
    """(1, H, T, D) -> (T / w, H, w, D), contiguous: independent chunks of ``w`` tokens."""
    t = x.size(-2)
    return x.detach().view(1, H, t // w, w, D)[0].transpose(0, 1).contiguous().requires_grad_(grad)


Output = torch.Tensor | list[torch.Tensor]


def _step(fn: Callable[[], Output], backward: bool) -> Callable[[], object]:
    if not backward:
        return fn

    def step() -> None:
        out = fn()
        outs = out if isinstance(out, list) else [out]
        torch.stack([o.sum() for o in outs]).sum().backward()

    return step


def _case(
    case: str, grad: bool, dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The inputs and the keyword arguments of ``case``'s attnkit call."""
    if case == "window":
        return _qkv(65536, grad, dtype), {"mask": masks.sliding_window(512)}
    if case == "documents":
        return _qkv(32768, grad, dtype), {"mask": masks.documents([1024] * 32)}
    if case == "documents_unequal":
        return _qkv(32768, grad, dtype), {"mask": masks.documents(_document_lengths(32768, 32))}
    kw: dict[str, Any] = {"causal": case == "causal"}
    if case == "softcap":
        kw["softcap"] = 30.0
    return _qkv(4096, grad, dtype), kw


def build(
    case: str, backward: bool, eager_too: bool, dtype: torch.dtype = torch.float32
) -> dict[str, Callable[[], object]]:
    """The calls of one row: native, SDPA and (``eager_too``) eager."""
    native, eager = Chunked(), Chunked(native=False, fused_rows=None)
    (q, k, v), kw = _case(case, backward, dtype)

    def ours(backend: Chunked) -> Callable[[], torch.Tensor]:
        return lambda: attnkit.attention(q, k, v, backend=backend, **kw)

    sdpa: Callable[[], Output]
    if case in ("window", "documents"):
        chunks = [_chunks(x, 512 if case == "window" else 1024, backward) for x in (q, k, v)]

        def sdpa() -> Output:
            return F.scaled_dot_product_attention(*chunks)

    elif case == "documents_unequal":
        per_doc, start = [], 0
        for n in _document_lengths(32768, 32):
            per_doc.append(
                [
                    x.detach()[..., start : start + n, :].contiguous().requires_grad_(backward)
                    for x in (q, k, v)
                ]
            )
            start += n

        def sdpa() -> Output:
            return [F.scaled_dot_product_attention(*d) for d in per_doc]

    else:

        def sdpa() -> Output:
            return F.scaled_dot_product_attention(q, k, v, is_causal=case == "causal")

    fns = {"native": _step(ours(native), backward), "sdpa": _step(sdpa, backward)}
    if eager_too:
        fns["eager"] = _step(ours(eager), backward)
    return fns


def native_memory(case: str, backward: bool) -> tuple[Callable[[], object], int]:
    """The native call of ``case`` for :func:`extra_peak_memory`: ``(fn, result bytes)``."""
    (q, k, v), kw = _case(case, backward)
    size = q.numel() * q.element_size()
    if not backward:

        def forward() -> torch.Tensor:
            with torch.inference_mode():
                return attnkit.attention(q, k, v, backend="chunked", **kw)

        return forward, size
    cot = torch.randn_like(q)

    def step() -> tuple[torch.Tensor, ...]:
        out = attnkit.attention(q, k, v, backend="chunked", **kw)
        return torch.autograd.grad(out, (q, k, v), cot)

    # The result: the three gradients, and the output the step holds until they are computed.
    return step, 4 * size


class Load:
    """A process spinning on one core, paused (SIGSTOP) while the machine should be quiet."""

    def __init__(self) -> None:
        self.proc = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
        self.proc.start()
        self.busy = True

    def set(self, busy: bool) -> None:
        if busy != self.busy and self.proc.pid is not None:
            os.kill(self.proc.pid, signal.SIGCONT if busy else signal.SIGSTOP)
            self.busy = busy

    def stop(self) -> None:
        self.set(True)  # a stopped process would not see the SIGTERM until continued
        self.proc.terminate()
        self.proc.join()


def measure(
    fns: dict[str, Callable[[], object]], rounds: int, loads: list[bool], spinner: Load | None
) -> dict[tuple[str, bool], list[float]]:
    """Seconds per call of each candidate under each load (True: busy), in interleaved rounds."""
    for fn in fns.values():
        fn()  # warm-up (and the native kernel's build or load)
    samples: dict[tuple[str, bool], list[float]] = {(n, b): [] for n in fns for b in loads}
    for _ in range(rounds):
        for busy in loads:
            if spinner is not None:
                spinner.set(busy)
            for name, fn in fns.items():
                timer = benchmark.Timer(
                    "fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
                )
                samples[name, busy].append(timer.blocked_autorange(min_run_time=0.3).median)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=CASES[:4])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["float32"])
    parser.add_argument("--load", choices=["quiet", "busy", "both"], default="quiet")
    parser.add_argument("--busy", action="store_true", help="the same as --load busy")
    parser.add_argument("--eager", action="store_true", help="also time the eager kernel")
    parser.add_argument("--memory", action="store_true", help="the native call's extra memory")
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    load = "busy" if args.busy else args.load
    loads = {"quiet": [False], "busy": [True], "both": [False, True]}[load]
    torch.set_num_threads(args.threads)
    os.environ["ATTNKIT_BENCH_THREADS"] = str(args.threads)  # for extra_peak_memory's child
    _, why = attnkit._native.status()
    before = os.getloadavg()[0]
    print(f"native kernel: {why}; threads {args.threads}; load: {load}; loadavg {before:.2f}")
    spinner = Load() if load != "quiet" else None
    rows: list[dict[str, Any]] = []
    pass_ = "fwd+bwd" if args.backward else "forward"
    try:
        head = (
            f"{'case':<18} {'what':<12} {'load':<6} {'median ms':>10} {'worst ms':>9} {'/ sdpa':>7}"
        )
        print(head + (f" {'busy/quiet':>10} {'worst/quiet':>11}" if load == "both" else ""))
        for case in args.cases:
            fns = {
                f"{name} {SHORT[d]}": fn
                for d in args.dtype
                for name, fn in build(case, args.backward, args.eager, DTYPES[d]).items()
            }
            samples = measure(fns, args.rounds, loads, spinner)
            mem = None
            if args.memory:
                if spinner is not None:
                    spinner.set(False)
                mem = extra_peak_memory(native_memory, case, args.backward)
            for name in fns:
                for busy in loads:
                    s = samples[name, busy]
                    med, worst = statistics.median(s), max(s)
                    cand, short = name.rsplit(" ", 1)
                    row: dict[str, Any] = {
                        "case": case,
                        "pass": pass_,
                        "candidate": cand,
                        "dtype": next(d for d in args.dtype if SHORT[d] == short),
                        "load": "busy" if busy else "quiet",
                        "seconds": med,
                        "worst_seconds": worst,
                        "rounds": len(s),
                        "ratio": med / statistics.median(samples[f"sdpa {short}", busy]),
                    }
                    line = (
                        f"{case:<18} {name:<12} {row['load']:<6} {med * 1e3:>10.1f} "
                        f"{worst * 1e3:>9.1f} {row['ratio']:>7.2f}"
                    )
                    if short != "f32" and (f"{cand} f32", busy) in samples:
                        row["over_float32"] = med / statistics.median(samples[f"{cand} f32", busy])
                        line += f"  / f32 {row['over_float32']:.2f}"
                    if busy and load == "both":
                        quiet = statistics.median(samples[name, False])
                        row["busy_ratio"], row["worst_ratio"] = med / quiet, worst / quiet
                        line += f" {med / quiet:>10.2f} {worst / quiet:>11.2f}"
                    if cand == "native" and mem is not None and busy == loads[0]:
                        row["extra_bytes"] = mem
                        line += f"  extra {mem / 2**20:.1f} MiB"
                    print(line, flush=True)
                    rows.append(row)
    finally:
        if spinner is not None:
            spinner.stop()
    after = os.getloadavg()[0]
    print(f"loadavg {after:.2f} at the end")
    if args.json:
        config = {
            "H": H,
            "D": D,
            "dtype": args.dtype[0] if len(args.dtype) == 1 else args.dtype,
            "threads": args.threads,
            "rounds": args.rounds,
            "load": load,
            "loadavg": [round(before, 2), round(after, 2)],
        }
        results.save(args.json, "native", rows, config=config)


if __name__ == "__main__":
    main()
