"""How far the native kernel and torch SDPA are from the arithmetic floor of their products.

For bench_native.py's cases (H=8, D=64, float32), side by side in one run:

* the pairs the native kernel's block plan computes (``visited``: rows x keys of every visit,
  over all heads) and the pairs a query sees (``visible``);
* the machine's GEMM rate at the native kernel's block shape (128 x 256 x 64, one thread, times
  the threads): ``torch.mm`` on the BLAS torch links;
* the floor: the time of the visited pairs' products alone at that rate (2 products of 2*D flops
  a pair forward; 7 forward + backward: the backward recomputes the scores and forms dP, dV, dQ
  and dK), beside the native call's and SDPA's measured medians (SDPA as bench_native.py calls
  it: the window and documents cases on contiguous chunks, softcap without softcap).

Everything a kernel does besides the products (the softmax's exp2, softcap's tanh, masks) comes
on top of the floor; so does the BLAS's own time beyond its best rate.

    python benchmarks/bench_floor.py --json docs/benchmarks/data/floor.json
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import bench_native
import torch
from torch.utils import benchmark

from attnkit._kernel.planning import block_plan
from attnkit._native.kernel import native_call
from attnkit.masks import Geometry

import results

CASES = ["plain", "softcap", "window", "documents"]


def gemm_rate(threads: int) -> float:
    """Flop/s of ``torch.mm`` at the native kernel's block shape on one thread, times ``threads``
    (the threads run independent products)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(128, 64), torch.randn(256, 64)
        timer = benchmark.Timer("torch.mm(a, b.t())", globals={"torch": torch, "a": a, "b": b})
        seconds = timer.blocked_autorange(min_run_time=1.0).median
    finally:
        torch.set_num_threads(before)
    return threads * 2 * 128 * 256 * 64 / seconds


def pairs(case: str) -> tuple[int, int]:
    """``(visited, visible)`` pairs of the case's native call, over all heads: a FULL visit's
    pairs are all visible, a partial one's are counted on its mask tile."""
    (q, k, _), kw = bench_native._case(case, False)
    mask = kw.get("mask")
    heads, tq, tk = q.size(1), q.size(2), k.size(2)
    geo = Geometry((1,), heads, tq, tk, q.device)
    plan = block_plan(mask, geo, native=True)
    call = native_call(plan, geo, scale=1.0, softcap=kw.get("softcap"), dtype=q.dtype)
    visited = visible = 0
    off, visits = call.off.tolist(), call.visits.tolist()
    for b in range(len(off) - 1):
        qs = b * call.block_q
        for ks, ke, r0, r1, partial, _ in visits[off[b] : off[b + 1]]:
            area = (ke - ks) * (r1 - r0)
            visited += area
            if partial and mask is not None:
                tile = mask.tile(geo, qs + r0, qs + r1, ks, ke)
                visible += int(tile.expand(*tile.shape[:-2], r1 - r0, ke - ks).sum())
            else:
                visible += area
    return visited * heads, visible * heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=CASES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rate = gemm_rate(args.threads)
    print(f"GEMM rate at 128 x 256 x 64: {rate / 1e9:.0f} GFLOP/s ({args.threads} threads)")
    print(
        f"{'case':<10} {'pass':<8} {'visited/visible':>15} {'floor ms':>9} {'native ms':>10} "
        f"{'sdpa ms':>8} {'native/floor':>12} {'sdpa/floor':>10} {'floor/sdpa':>10}"
    )
    rows: list[dict[str, Any]] = []
    for case in args.cases:
        visited, visible = pairs(case)
        for backward in (False, True):
            fns = bench_native.build(case, backward, eager_too=False)
            samples = bench_native.measure(fns, args.rounds, [False], None)
            native = statistics.median(samples["native", False])
            sdpa = statistics.median(samples["sdpa", False])
            products = 7 if backward else 2
            floor = visited * products * 2 * bench_native.D / rate
            row = {
                "case": case,
                "pass": "fwd+bwd" if backward else "forward",
                "visited_pairs": visited,
                "visible_pairs": visible,
                "gemm_flops_per_second": rate,
                "floor_seconds": floor,
                "native_seconds": native,
                "sdpa_seconds": sdpa,
                "native_over_floor": native / floor,
                "sdpa_over_floor": sdpa / floor,
                "floor_over_sdpa": floor / sdpa,
            }
            rows.append(row)
            print(
                f"{case:<10} {row['pass']:<8} {visited / visible:>15.3f} {floor * 1e3:>9.1f} "
                f"{native * 1e3:>10.1f} {sdpa * 1e3:>8.1f} {native / floor:>12.2f} "
                f"{sdpa / floor:>10.2f} {floor / sdpa:>10.2f}",
                flush=True,
            )
    if args.json:
        config = {"H": bench_native.H, "D": bench_native.D, "threads": args.threads}
        results.save(args.json, "floor", rows, config=config)


if __name__ == "__main__":
    main()
