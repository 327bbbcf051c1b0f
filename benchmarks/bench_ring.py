"""Ring attention over W processes against one process: time and per-rank peak memory.

Run it with torchrun; every rank runs this script:

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_ring.py              # T=32768, CPU
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_ring.py --length 4096 --backward
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        benchmarks/bench_ring.py --device cuda --length 131072           # a cluster: nccl

With ``--cases``, it runs every kind of call across the ranks instead, with shards of
``--shard`` keys (2048 by default): causal, a window of 256, packed documents inside the shards
and across them (on their balanced layout), Transformer-XL's position term and ALiBi, through
both strategies (``ring``, ``ulysses``) and the one :func:`attnkit.distributed.explain` picks.
For each: the largest difference from :func:`attnkit.attention` on the whole sequence in one
process in the same dtype (output and q/k/v gradients, ``--dtype``, float32 by default, gathered
on rank 0), the bytes each rank sent
(``Dispatch.sent``: forward, backward) next to one shard's k and v, and the slowest rank's time:

    torchrun --standalone --nproc-per-node 4 benchmarks/bench_ring.py --cases --backward

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
from attnkit import masks
from attnkit.distributed import (
    Layout,
    balance_documents,
    explain,
    ring_attention,
    shard_zigzag,
    ulysses_attention,
)
from attnkit.modules.positional import alibi_term
from attnkit.scores import RelativePositionTerm

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


@dataclass
class CaseRow:
    case: str
    strategy: str
    error: float  # largest difference from one process: output and q, k, v gradients
    sent_forward: list[int]  # bytes per rank
    sent_backward: list[int]
    one_shard: int  # one shard's k and v, bytes
    seconds: float  # the slowest rank's


def _cases(
    t: int, h: int, world: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> dict[str, dict[str, object]]:
    """Each case: attention()'s keyword arguments for the whole sequence of ``t`` tokens (a
    position term's ``qv`` is cut to each rank's rows later), and its layout."""
    g = torch.Generator().manual_seed(1)
    inside = [t // (2 * world) // 2, t // (2 * world) - t // (2 * world) // 2] * (2 * world)
    crossing = [t // 3, t // 2, t - t // 3 - t // 2]
    qv = torch.randn(1, h, t, 16, generator=g, dtype=dtype).to(device)
    enc = torch.randn(h, 2 * t - 1, 16, generator=g, dtype=dtype).to(device)
    return {
        "causal": {"kwargs": {"causal": True}, "layout": "zigzag"},
        "window 256": {"kwargs": {"mask": masks.sliding_window(256)}, "layout": "contiguous"},
        "documents inside shards": {
            "kwargs": {"mask": masks.documents(inside)},
            "layout": "zigzag",
        },
        "documents across shards & causal": {
            "kwargs": {"mask": masks.documents(crossing) & masks.causal()},
            "layout": balance_documents(crossing, world, causal=True),
        },
        "position term, window 512": {
            "kwargs": {
                "bias": RelativePositionTerm(qv, enc, 0.125),
                "mask": masks.sliding_window(512, right=64),
            },
            "layout": "contiguous",
        },
        "ALiBi, causal": {
            "kwargs": {
                "bias": alibi_term(attnkit.alibi_slopes(h).to(device, dtype), t, t),
                "causal": True,
            },
            "layout": "zigzag",
        },
    }


def _local(kwargs: dict[str, object], lay: Layout, rank: int) -> dict[str, object]:
    out = dict(kwargs)
    term = out.get("bias")
    if isinstance(term, RelativePositionTerm):
        out["bias"] = RelativePositionTerm(lay.shard(term.qv, rank), term.enc, term.scale)
    return out


def _gather(parts: list[torch.Tensor], lay: Layout) -> list[torch.Tensor]:
    """Every rank's shard of each tensor, as the whole sequence (on every rank)."""
    out = []
    for part in parts:
        shards = [torch.empty_like(part) for _ in range(lay.world_size)]
        dist.all_gather(shards, part.contiguous())
        out.append(lay.unshard(shards))
    return out


def _strategy_row(
    fn: Callable[..., torch.Tensor],
    lay: Layout,
    whole: list[torch.Tensor],
    kwargs: dict[str, object],
    expected: list[torch.Tensor] | None,
    args: argparse.Namespace,
    device: torch.device,
) -> tuple[float, list[int], list[int], float]:
    """One strategy on one case: (error on rank 0, forward and backward bytes per rank, the
    slowest rank's seconds)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = [lay.shard(x, rank).clone().requires_grad_() for x in whole[:3]]
    call_kwargs = _local(kwargs, lay, rank)
    dout = lay.shard(whole[3], rank)

    def run() -> tuple[torch.Tensor, list[attnkit.Dispatch]]:
        for x in local:
            x.grad = None
        with attnkit.record_dispatch() as record:
            out = fn(*local, **call_kwargs, layout=lay)
            if args.backward:
                out.backward(dout)
        return out, record

    out, record = run()  # the checked call: its error and its bytes
    parts = [out.detach(), *(x.grad for x in local if x.grad is not None)]
    gathered = _gather(parts if args.backward else parts[:1], lay)
    error = 0.0
    if expected is not None:
        pairs = zip(gathered, expected[: len(gathered)], strict=True)
        error = max(float((a - b).abs().max()) for a, b in pairs)
    sent = [record[0].sent.get("forward", 0), record[0].sent.get("backward", 0)]
    mine = torch.tensor(sent, dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    dist.barrier()
    seconds, _ = measure(run, device, args.repeat)
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return error, [int(e[0]) for e in everyone], [int(e[1]) for e in everyone], float(slowest)


def run_cases(args: argparse.Namespace, device: torch.device, threads: int) -> None:
    """``--cases``: each kind of call through each strategy against one process (see above)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t, h, d = args.shard * world, args.heads, args.dim
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    whole = [torch.randn(1, h, t, d, device=device, dtype=dtype) for _ in range(4)]  # q, k, v, dout
    one_shard = 2 * (t // world) * h * d * whole[0].element_size()
    strategies = {"ring": ring_attention, "ulysses": ulysses_attention}
    rows: list[CaseRow] = []
    if rank == 0:
        passes = "forward+backward" if args.backward else "forward"
        print(
            f"torch {torch.__version__}, {world} ranks x {threads} threads, T={t} (shards of "
            f"{args.shard}) H={h} D={d} {args.dtype}, {passes}"
        )
        print(
            f"{'case':<34} {'strategy':<9} {'error':>8} {'s':>7}  sent per rank, MiB "
            f"(forward; backward); one shard's k and v: {one_shard / MIB:.2f} MiB"
        )
    for case, spec in _cases(t, h, world, device, dtype).items():
        kwargs: dict[str, object] = spec["kwargs"]  # type: ignore[assignment]
        lay = spec["layout"]
        if not isinstance(lay, Layout):
            lay = Layout.zigzag(world) if lay == "zigzag" else Layout.contiguous(world)
        expected = None
        if rank == 0:  # the spec: the whole sequence in one process
            leaves = [x.clone().requires_grad_() for x in whole[:3]]
            want = attnkit.attention(*leaves, **kwargs)  # type: ignore[arg-type]
            want.backward(whole[3])
            expected = [want.detach(), *(x.grad for x in leaves if x.grad is not None)]
        shards = [lay.shard(x, rank) for x in whole[:3]]
        local_kwargs = _local(kwargs, lay, rank)
        chosen = explain(*shards, **local_kwargs, layout=lay, world_size=world).chosen  # type: ignore[arg-type]
        for name, fn in strategies.items():
            error, fwd, bwd, seconds = _strategy_row(fn, lay, whole, kwargs, expected, args, device)
            label = f"{name}{' *' if name == chosen else ''}"
            rows.append(CaseRow(case, label, error, fwd, bwd, one_shard, seconds))
            if rank == 0:
                sent = ", ".join(f"{b / MIB:.2f}" for b in fwd)
                back = ", ".join(f"{b / MIB:.2f}" for b in bwd)
                print(f"{case:<34} {label:<9} {error:>8.1e} {seconds:>7.2f}  {sent}; {back}")
    if rank == 0:
        print("* the strategy attnkit.distributed.explain picks (fewest bytes per rank)")
        if args.json:
            config = {
                "world_size": world,
                "threads": threads,
                "T": t,
                "shard": args.shard,
                "H": h,
                "D": d,
                "dtype": args.dtype,
                "backward": args.backward,
                "device": device.type,
                "repeat": args.repeat,
            }
            rows_json = [asdict(r) for r in rows]
            results.save(args.json, "ring_cases", rows_json, config=config, device=device)


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
    parser.add_argument(
        "--cases", action="store_true", help="every kind of call, both strategies (see above)"
    )
    parser.add_argument("--shard", type=int, default=2048, help="keys per rank with --cases")
    parser.add_argument(
        "--dtype", choices=["float32", "float64"], default="float32", help="with --cases"
    )
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
    if args.cases:
        run_cases(args, device, threads)
        dist.destroy_process_group()
        return

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
