"""Ring attention over W processes against one process: time and per-rank peak memory.

Run it with torchrun; every rank runs this script:

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_ring.py              # T=32768, CPU
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_ring.py --length 4096 --backward
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        benchmarks/bench_ring.py --device cuda --length 131072           # a cluster: nccl

B=1, H=8, D=64 by default. Rows:

* ``ring <layout>``: :func:`attnkit.distributed.ring_attention`, each rank holding T/W of the
  sequence; the time is the slowest rank's, the memory each rank's own.
* ``one process <backend>``: :func:`attnkit.attention` on the whole sequence in one process on
  rank 0, with all W ranks' threads (CPU) or rank 0's GPU, while the other ranks wait.

"inputs MiB" is what q, k, v (and the output's gradient with ``--backward``) take in one process;
"extra MiB" is how far its peak memory rose above that during the call, the output and the
gradients of q, k, v included: on CPU
the kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs), with glibc's mmap
threshold fixed at 64 KiB so freed buffers leave resident memory at once; on GPU
``torch.cuda.max_memory_allocated``. Times are torch.utils.benchmark means over ``--repeat``
calls after a small warm-up; compare them as ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.utils import benchmark

import attnkit
from attnkit.distributed import ring_attention, shard_zigzag

import results

MIB = 2**20


@dataclass
class Row:
    candidate: str
    causal: bool
    seconds: float
    inputs_mib: float
    extra_mib: list[float]  # per rank (one entry for the single process)
    ratio: float | None = None  # to the first single-process row of the same causality


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _fix_malloc() -> None:
    """Make resident memory follow live memory: big blocks are mmapped and unmapped on free."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD


def measure(fn: Callable[[], object], device: torch.device, repeat: int) -> tuple[float, float]:
    """(seconds per call, peak bytes above the memory held before the calls)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current resident size
        before = _status_kib("VmRSS") * 1024
    seconds = benchmark.Timer("fn()", globals={"fn": fn}).timeit(repeat).mean
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = _status_kib("VmHWM") * 1024
    return seconds, max(0, peak - before)


def make_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    backward: bool,
) -> Callable[[], object]:
    if not backward:

        def forward() -> object:
            with torch.no_grad():
                return attend(q, k, v)

        return forward
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)  # the gradient arriving from the layers above

    def forward_backward() -> object:
        for t in (q, k, v):
            t.grad = None
        attend(q, k, v).backward(dout)
        return None

    return forward_backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768, help="the whole sequence's T")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--repeat", type=int, default=1, help="calls per measurement")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--threads", type=int, help="threads per rank on CPU (default: cores / ranks)"
    )
    parser.add_argument(
        "--baselines",
        nargs="*",
        default=["chunked", "auto"],
        help="attnkit.attention backends to run in one process on the whole sequence",
    )
    parser.add_argument("--json", help="rank 0 also writes the results to this file as JSON")
    args = parser.parse_args()

    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
        _fix_malloc()
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)

    t, b, h, d = args.length, args.batch, args.heads, args.dim
    if t % (2 * world):
        raise SystemExit(f"--length {t} must divide into 2 * {world} zigzag chunks")
    torch.manual_seed(0)  # every rank draws the same whole sequence, then keeps its shard
    whole = [torch.randn(b, h, t, d, device=device) for _ in range(3)]
    shards = {
        "contiguous": [x.chunk(world, -2)[rank].contiguous() for x in whole],
        "zigzag": [shard_zigzag(x, rank, world) for x in whole],
    }
    one_process_inputs = sum(x.numel() * x.element_size() for x in whole)
    if rank != 0:
        del whole  # only rank 0 runs the single-process baseline

    def ring(layout: str, causal: bool) -> Callable[..., torch.Tensor]:
        return lambda q, k, v: ring_attention(q, k, v, causal=causal, layout=layout)

    # Warm-up at a small length: thread pools, gloo connections, allocator.
    small = [x[..., : 4 * world, :].contiguous() for x in shards["contiguous"]]
    make_call(*small, ring("contiguous", True), args.backward)()

    if rank == 0:
        print(
            f"torch {torch.__version__}, {world} ranks x {threads} threads on {device.type}, "
            f"T={t} B={b} H={h} D={d} float32, {'forward+backward' if args.backward else 'forward'}"
        )
        print(f"{'candidate':<28} {'s':>9} {'ratio':>7} {'inputs MiB':>11}  extra MiB per rank")
    rows: list[Row] = []
    inputs_factor = 4 / 3 if args.backward else 1  # with the output's gradient, as big as q
    for causal in (False, True):
        layouts = ["contiguous", "zigzag"] if causal else ["contiguous"]
        for layout in layouts:
            dist.barrier()
            fn = make_call(*shards[layout], ring(layout, causal), args.backward)
            seconds, extra = measure(fn, device, args.repeat)
            del fn
            slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            extras = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
            dist.all_gather(extras, torch.tensor([extra / MIB], dtype=torch.float64, device=device))
            local_inputs = sum(x.numel() * x.element_size() for x in shards[layout])
            rows.append(
                Row(
                    f"ring {layout}" + (" causal" if causal else ""),
                    causal,
                    float(slowest),
                    inputs_factor * local_inputs / MIB,
                    [round(float(e), 1) for e in extras],
                )
            )
        dist.barrier()
        if rank == 0:
            torch.set_num_threads(threads * world if device.type == "cpu" else threads)
            for backend in args.baselines:

                def attend(
                    q: torch.Tensor,
                    k: torch.Tensor,
                    v: torch.Tensor,
                    backend: str = backend,
                    causal: bool = causal,
                ) -> torch.Tensor:
                    return attnkit.attention(q, k, v, causal=causal, backend=backend)

                name = backend
                if backend == "auto":
                    name = f"auto: {attnkit.explain(*whole, causal=causal).chosen}"
                fn = make_call(*whole, attend, args.backward)
                seconds, extra = measure(fn, device, args.repeat)
                del fn
                rows.append(
                    Row(
                        f"one process {name}" + (" causal" if causal else ""),
                        causal,
                        seconds,
                        inputs_factor * one_process_inputs / MIB,
                        [round(extra / MIB, 1)],
                    )
                )
            torch.set_num_threads(threads)
        dist.barrier()

    if rank == 0:
        # Ratios against the first single-process row of the same causality.
        base = {c: next((r.seconds for r in rows if r.causal == c and "one" in r.candidate), 0.0)
                for c in (False, True)}  # fmt: skip
        for row in rows:
            row.ratio = row.seconds / base[row.causal] if base[row.causal] else None
            ratio = "-" if row.ratio is None else f"{row.ratio:.2f}"
            extras = ", ".join(f"{e:.1f}" for e in row.extra_mib)
            print(
                f"{row.candidate:<28} {row.seconds:>9.2f} {ratio:>7} {row.inputs_mib:>11.1f}  "
                f"{extras}",
                flush=True,
            )
        if args.json:
            config = {
                "world_size": world,
                "threads": threads,
                "T": t,
                "B": b,
                "H": h,
                "D": d,
                "dtype": "float32",
                "backward": args.backward,
                "device": device.type,
                "repeat": args.repeat,
            }
            results.save(args.json, "ring", [asdict(r) for r in rows], config=config, device=device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
