"""Forward + backward of attention() backends against torch SDPA: what a training step pays.

H=8, D=64, float32 (or ``--dtype bfloat16``), q/k/v as strided views of one packed (B, T, 3, H, D)
projection (what a multi-head module hands the core). Times are medians of interleaved
torch.utils.benchmark rounds; "ratio" divides by torch SDPA's time for the same shape and
causality.

    python benchmarks/bench_training.py            # ~3 minutes
    python benchmarks/bench_training.py --quick
    python benchmarks/bench_training.py --dtype bfloat16 --shapes 1x256 1x1024 1x4096
    python benchmarks/bench_training.py --json docs/benchmarks/data/training.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit
from attnkit.cli.measure import time_side_by_side

import results

H, D = 8, 64
SHAPES = [(4, 1024), (1, 4096)]  # (B, T)


def step(
    candidate: str, b: int, t: int, causal: bool, dtype: torch.dtype = torch.float32
) -> Callable[[], None]:
    torch.manual_seed(0)
    qkv = torch.randn(b, t, 3, H, D, dtype=dtype, requires_grad=True)
    grad = torch.randn(b, H, t, D, dtype=dtype)

    def run() -> None:
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        if candidate == "torch sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            out = attnkit.attention(q, k, v, causal=causal, backend=candidate)
        out.backward(grad)
        qkv.grad = None

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter rounds")
    parser.add_argument(
        "--shapes",
        nargs="*",
        metavar="BxT",
        help="(B, T) shapes to time, e.g. 4x1024 1x4096 (the default)",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(n) for n in s.lower().split("x")) for s in args.shapes]
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, H={H} D={D} {args.dtype}")
    print("\n| B, T | causal | candidate | ms | ratio to torch sdpa |")
    print("| --- | --- | --- | ---: | ---: |")
    for b, t in shapes:
        for causal in (False, True):
            fns = {c: step(c, b, t, causal, dtype) for c in ("torch sdpa", "auto", "chunked")}
            times = time_side_by_side(
                fns, rounds=2 if args.quick else 3, min_run_time=0.5 if args.quick else 2.0
            )
            for name, sec in times.items():
                ratio = sec / times["torch sdpa"]
                print(
                    f"| {b}, {t} | {causal} | {name} | {sec * 1e3:.1f} | {ratio:.2f} |", flush=True
                )
                rows.append(
                    {
                        "B": b,
                        "T": t,
                        "causal": causal,
                        "candidate": name,
                        "seconds": sec,
                        "ratio": ratio,
                    }
                )
    if args.json:
        config = {"H": H, "D": D, "dtype": args.dtype, "pass": "forward + backward"}
        results.save(args.json, "training", rows, config=config)


if __name__ == "__main__":
    main()
