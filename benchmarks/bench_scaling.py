"""The cost model of attention across ranks against measured calls, and its curves.

Measured, under torchrun (every rank runs this script; gloo on CPUs):

    torchrun --standalone --nproc-per-node 4 benchmarks/bench_scaling.py

First the figures the model needs, measured with every rank busy at once: the link (each rank
sends a block to the next and receives one from the one before, as a ring step does, for blocks
of 4 KiB to 8 MiB; latency and bandwidth fitted by least squares) and each rank's attention
throughput (forward and backward of one shard against itself, no mask). Then each case (causal
on the zigzag layout, a window of 256, documents inside the shards, documents across them with
causal) through the ring and the all-to-all, forward and backward: the slowest rank's measured
time next to the modelled one, and the bytes each rank sent (``Dispatch.sent``) next to the
model's.

Modelled only, no processes (``--curves``): time and bytes per rank of each strategy from 2 to
1,024 ranks on the model's GPU nodes (NVLink within 8, InfiniBand between), every rank holding
``--shard`` tokens (the whole sequence grows with the ranks):

    python benchmarks/bench_scaling.py --curves --json docs/benchmarks/data/scaling_model.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import benchmark

import attnkit
from attnkit import masks
from attnkit.distributed import (
    GPU_NODES,
    Hardware,
    Link,
    cost,
    ring_attention,
    ulysses_attention,
)

import results

MIB = 2**20


def _exchange(nbytes: int, rounds: int) -> float:
    """Seconds per ring step: every rank sends ``nbytes`` to the next and receives from the one
    before, all at once."""
    rank, world = dist.get_rank(), dist.get_world_size()
    send = torch.zeros(nbytes // 4)
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, (rank + 1) % world),
        dist.P2POp(dist.irecv, recv, (rank - 1) % world),
    ]
    for r in dist.batch_isend_irecv(ops):  # the connection, once
        r.wait()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        for r in dist.batch_isend_irecv(ops):
            r.wait()
    return (time.perf_counter() - start) / rounds


def measure_link() -> tuple[Link, list[tuple[int, float]]]:
    """Latency and bandwidth fitted to ring steps of 4 KiB to 8 MiB (the slowest rank's)."""
    points = []
    for nbytes in [4096 * 4**i for i in range(7)]:
        seconds = torch.tensor([_exchange(nbytes, 20 if nbytes < MIB else 5)], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        points.append((nbytes, float(seconds)))
    x = torch.tensor([[1.0, b] for b, _ in points], dtype=torch.float64)
    y = torch.tensor([s for _, s in points], dtype=torch.float64)
    latency, per_byte = torch.linalg.lstsq(x, y[:, None]).solution[:, 0].tolist()
    return Link("gloo, measured", 1.0 / per_byte, max(latency, 0.0)), points


def measure_flops(h: int, t: int, d: int, repeat: int) -> float:
    """FLOP/s of one rank's attention (forward and backward, no mask), every rank at once."""
    q, k, v = (torch.randn(1, h, t, d, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, h, t, d)

    def run() -> None:
        attnkit.attention(q, k, v).backward(dout)

    run()
    dist.barrier()
    seconds = benchmark.Timer("run()", globals={"run": run}).timeit(repeat).mean
    slowest = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    flop = (2 * (d + d) + 2 * (3 * d + 2 * d)) * h * t * t
    return flop / float(slowest)


def measure_overhead(repeat: int) -> float:
    """Seconds of a ring call with nothing to compute or send (forward and backward): what a
    call costs whatever its size, on the slowest rank."""
    world = dist.get_world_size()
    q, k, v = (torch.randn(1, 1, 64, 8, requires_grad=True) for _ in range(3))
    mask = masks.documents([32] * (2 * world))  # inside every shard: nothing travels

    def run() -> None:
        ring_attention(q, k, v, mask=mask).sum().backward()

    run()
    dist.barrier()
    seconds = benchmark.Timer("run()", globals={"run": run}).timeit(repeat * 5).mean
    slowest = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest) / 2  # per pass


def cases(t: int, world: int) -> dict[str, tuple[dict[str, Any], str]]:
    shard = t // world
    inside = [shard // 4, shard // 2 - shard // 4] * (2 * world)
    crossing = [t // 3, t // 2, t - t // 3 - t // 2]
    return {
        "causal": ({"causal": True}, "zigzag"),
        "window 256": ({"mask": masks.sliding_window(256)}, "contiguous"),
        "documents inside shards": ({"mask": masks.documents(inside)}, "zigzag"),
        "documents across shards & causal": (
            {"mask": masks.documents(crossing) & masks.causal()},
            "contiguous",
        ),
    }


def _time_call(fn: Callable[[], None], repeat: int) -> float:
    dist.barrier()
    seconds = benchmark.Timer("fn()", globals={"fn": fn}).timeit(repeat).mean
    slowest = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def _sent(record: list[attnkit.Dispatch]) -> list[int]:
    mine = torch.tensor(
        [sum(r.sent.get(p, 0) for r in record) for p in ("forward", "backward")],
        dtype=torch.float64,
    )
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [int(e[0] + e[1]) for e in everyone]


def run_measured(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    h, d, shard = args.heads, args.dim, args.shard
    t = shard * world
    link, points = measure_link()
    flops = measure_flops(h, shard, d, args.repeat)
    overhead = measure_overhead(args.repeat)
    hw = Hardware("gloo, measured", flops, link, link, world, overhead)
    if rank == 0:
        print(
            f"torch {torch.__version__}, {world} ranks x {args.threads} threads, T={t} (shards of "
            f"{shard}) H={h} D={d} float32, forward+backward"
        )
        print(
            f"measured: link {link.bandwidth / 1e9:.2f} GB/s, {link.latency * 1e6:.0f} us a "
            f"message; attention {flops / 1e9:.1f} GFLOP/s per rank; {overhead * 1e3:.1f} ms a "
            "pass on the host"
        )
        print(f"{'case':<34} {'strategy':<8} {'measured s':>10} {'model s':>8} {'ratio':>6}  bytes")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(rank)
    q, k, v, dout = (torch.randn(1, h, shard, d, generator=g) for _ in range(4))
    rows = []
    strategies = {"ring": ring_attention, "ulysses": ulysses_attention}
    for case, (kwargs, layout) in cases(t, world).items():
        shapes = torch.empty(1, h, shard, d, device="meta")
        model = cost(
            shapes, shapes, shapes, **kwargs, layout=layout, world_size=world, hardware=hw,
            backward=True,
        )  # fmt: skip
        for name, fn in strategies.items():
            if model[name] is None:
                continue
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]

            def call(
                fn: Any = fn,
                leaves: list[torch.Tensor] = leaves,
                kwargs: dict[str, Any] = kwargs,
                layout: str = layout,
            ) -> None:
                for x in leaves:
                    x.grad = None
                fn(*leaves, **kwargs, layout=layout).backward(dout)

            with attnkit.record_dispatch() as record:
                call()
            sent = _sent(record)
            seconds = _time_call(call, args.repeat)
            c = model[name]
            if c is None:  # the all-to-all needs heads that divide among the ranks
                continue
            modelled = [f + b for f, b in zip(c.sent, c.sent_backward, strict=True)]
            row = {
                "world_size": world,
                "case": case,
                "strategy": name,
                "measured_s": seconds,
                "model_s": c.seconds,
                "model_compute_s": c.compute,
                "model_links_s": c.communication,
                "ratio": c.seconds / seconds,
                "sent": sent,
                "model_sent": modelled,
            }
            rows.append(row)
            if rank == 0:
                same = "= model" if sent == modelled else f"model {modelled}"
                print(
                    f"{case:<34} {name:<8} {seconds:>10.3f} {c.seconds:>8.3f} "
                    f"{c.seconds / seconds:>6.2f}  {max(sent) / MIB:.2f} MiB most ({same})",
                    flush=True,
                )
    if rank == 0 and args.json:
        config = {
            "world_size": world,
            "threads": args.threads,
            "T": t,
            "shard": shard,
            "H": h,
            "D": d,
            "dtype": "float32",
            "backward": True,
            "device": "cpu",
            "repeat": args.repeat,
            "link_bandwidth": link.bandwidth,
            "link_latency": link.latency,
            "link_points": points,
            "flops": flops,
            "overhead": overhead,
        }
        results.save(args.json, "scaling", rows, config=config)
    dist.destroy_process_group()


def run_curves(args: argparse.Namespace) -> None:
    """The model alone, 2 to 1,024 ranks on GPU_NODES (weak scaling: a fixed shard per rank)."""
    h, hkv, d, shard = args.heads, args.kv_heads, args.dim, args.shard
    dtype = torch.bfloat16
    q = torch.empty(1, h, shard, d, dtype=dtype, device="meta")
    kv = torch.empty(1, hkv, shard, d, dtype=dtype, device="meta")
    rows = []
    worlds = [2**i for i in range(1, 11) if 2**i <= args.most]
    for world in worlds:
        t = shard * world
        doc = args.document
        specs = {
            "causal": ({"causal": True}, "zigzag"),
            f"window {args.window}": ({"mask": masks.sliding_window(args.window)}, "contiguous"),
            f"documents of {doc}": (
                {"mask": masks.documents([doc] * (t // doc) + [t % doc] * (t % doc > 0))},
                "contiguous",
            ),
        }
        for case, (kwargs, layout) in specs.items():
            start = time.perf_counter()
            model = cost(
                q, kv, kv, **kwargs, layout=layout, world_size=world, hardware=GPU_NODES,
                backward=True,
            )  # fmt: skip
            for name, c in model.items():
                if c is None:
                    continue
                rows.append(
                    {
                        "world_size": world,
                        "case": case,
                        "strategy": name,
                        "seconds": c.seconds,
                        "compute_s": c.compute,
                        "links_s": c.communication,
                        "exposed_s": c.exposed,
                        "sent_mib": c.most_sent / MIB,
                        "steps": c.steps,
                    }
                )
                print(
                    f"{world:>5} {case:<22} {name:<8} {c.seconds * 1e3:>9.2f} ms "
                    f"(compute {c.compute * 1e3:.2f} ms) {c.most_sent / MIB:>9.1f} MiB "
                    f"[{time.perf_counter() - start:.1f} s to model]",
                    flush=True,
                )
    if args.json:
        config = {
            "shard": shard,
            "H": h,
            "Hkv": hkv,
            "D": d,
            "dtype": "bfloat16",
            "backward": True,
            "hardware": dataclasses.asdict(GPU_NODES),
            "window": args.window,
            "document": args.document,
            "modelled": True,
        }
        results.save(args.json, "scaling_model", rows, config=config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curves", action="store_true", help="the model alone, 2 to 1,024 ranks")
    parser.add_argument("--shard", type=int, help="tokens per rank (1024 measured, 8192 curves)")
    parser.add_argument(
        "--heads", type=int, help="query heads (8 measured, 6 on 3 ranks; 32 curves)"
    )
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads (curves)")
    parser.add_argument("--dim", type=int, help="head size (64 measured, 128 curves)")
    parser.add_argument("--window", type=int, default=4096, help="the curves' window")
    parser.add_argument("--document", type=int, default=65536, help="the curves' documents")
    parser.add_argument("--most", type=int, default=1024, help="the curves' most ranks")
    parser.add_argument("--repeat", type=int, default=3, help="calls per measurement")
    parser.add_argument("--threads", type=int, default=1, help="threads per rank")
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    if args.curves:
        args.shard, args.heads, args.dim = args.shard or 8192, args.heads or 32, args.dim or 128
        run_curves(args)
    else:
        if "RANK" not in os.environ:
            raise SystemExit("run it with torchrun (see the docstring), or with --curves")
        # 8 heads, or 6 where 8 do not divide among the ranks (the all-to-all needs them to).
        heads = 8 if 8 % int(os.environ["WORLD_SIZE"]) == 0 else 6
        args.shard, args.heads, args.dim = args.shard or 1024, args.heads or heads, args.dim or 64
        run_measured(args)


if __name__ == "__main__":
    main()
