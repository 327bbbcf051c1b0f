"""A Conformer layer over a long recording split across W processes, checked against one process.

Run it with torchrun; every rank runs this script:

    torchrun --standalone --nproc-per-node 4 benchmarks/bench_sequence_parallel.py
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_sequence_parallel.py \\
        --frames 64000 --layout zigzag --context -1     # full attention, the zigzag layout
    torchrun --standalone --nproc-per-node 8 benchmarks/bench_sequence_parallel.py \\
        --device cuda --frames 256000                   # one GPU per rank: nccl

Every rank builds the same :class:`attnkit.ConformerLayer` (same seed) and the same recording,
makes the layer sequence-parallel (:func:`attnkit.distributed.sequence_parallel`) and runs a
training step on its shard of the frames: the relative attention runs across the ranks, the
depthwise convolution exchanges its halo with the neighbouring ranks, BatchNorm's statistics are
summed over the ranks. Rank 0 then runs the layer on the whole recording in one process and
prints the largest difference of the outputs, of the recording's gradients and of the
parameters' gradients (all-reduced), and both times (a training step's forward and backward,
the slowest rank's; the one-process time with rank 0's threads while the others wait).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import time

import torch
import torch.distributed as dist

import attnkit
from attnkit.distributed import Layout, sequence_parallel


def _step(layer: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, mask: object) -> tuple:
    """One forward and backward; the output, the input's gradient and the seconds it took."""
    layer.zero_grad()
    x = x.clone().requires_grad_()
    start = time.perf_counter()
    y = layer(x, mask=mask)
    (y * target).sum().backward()
    seconds = time.perf_counter() - start
    return y.detach(), x.grad, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=32000, help="frames of the recording")
    parser.add_argument("--d-model", type=int, default=144)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kernel-size", type=int, default=31)
    parser.add_argument(
        "--context", type=int, default=64, help="frames each side a frame attends; -1: all"
    )
    parser.add_argument("--layout", choices=("contiguous", "zigzag"), default="contiguous")
    parser.add_argument("--strategy", choices=("auto", "ring", "ulysses"), default="auto")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    context = None if args.context < 0 else (args.context, args.context)
    whole = attnkit.ConformerLayer(
        args.d_model, args.heads, kernel_size=args.kernel_size, dropout=0.0, context=context
    ).to(device, dtype)
    shard = sequence_parallel(copy.deepcopy(whole), layout=args.layout, strategy=args.strategy)
    lay = Layout.zigzag(world) if args.layout == "zigzag" else Layout.contiguous(world)

    g = torch.Generator().manual_seed(1)
    t = args.frames
    x = torch.randn(1, t, args.d_model, generator=g, dtype=dtype).to(device)
    target = torch.randn(1, t, args.d_model, generator=g, dtype=dtype).to(device)
    # The recording ends before the last frames: padding, True = real frame.
    valid = (torch.arange(t, device=device) < t - t // 7).unsqueeze(0)

    dist.barrier()
    ys, dxs, seconds = _step(
        shard,
        lay.shard(x, rank, dim=1),
        lay.shard(target, rank, dim=1),
        lay.shard(valid, rank, dim=1),
    )
    slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    grads = []
    for p in shard.parameters():
        gsum = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(gsum)
        grads.append(gsum)
    gathered = [torch.empty_like(ys) for _ in range(world)]
    dist.all_gather(gathered, ys)
    dgathered = [torch.empty_like(dxs) for _ in range(world)]
    dist.all_gather(dgathered, dxs)

    if rank == 0:
        yw, dxw, one = _step(whole, x, target, valid)
        out_diff = (lay.unshard(gathered, dim=1) - yw).abs().max().item()
        dx_diff = (lay.unshard(dgathered, dim=1) - dxw).abs().max().item()
        p_diff = max(
            (gs - p.grad).abs().max().item()
            for gs, p in zip(grads, whole.parameters(), strict=True)
        )
        print(
            f"ConformerLayer d_model={args.d_model} heads={args.heads} kernel={args.kernel_size} "
            f"context={context} {args.dtype} {t} frames, {world} ranks, {args.layout}"
        )
        print(f"largest difference: output {out_diff:.3g}, input gradient {dx_diff:.3g},")
        print(f"  parameter gradients (all-reduced) {p_diff:.3g}")
        print(f"training step: {world} ranks {slowest.item():.3f} s, one process {one:.3f} s")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
