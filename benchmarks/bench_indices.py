"""Index-selected sparse attention: ``masks.key_indices(idx) & masks.causal()`` against the same
arithmetic done densely and against the same selection given as a dense boolean mask.

Each query attends ``k`` keys of its causal past, chosen at random (with repeats, which count
once; a query with fewer than ``k`` keys before it selects among those), as DeepSeek V3.2's
indexer hands them over; float32, ``H`` heads with a selection shared by all of them.

* gathered: ``attnkit.attention(q, k, v, mask=key_indices(idx) & causal())``, the chunked
  backend's gathered kernel (each query's ``k`` key and value rows read by position), on the
  native kernel.
* sparse products: the same through ``Chunked(native=False)``, torch's sparse products (SDDMM
  and SpMM); with ``--sparse``.
* dense k: torch's ``scaled_dot_product_attention`` of the queries against ``k`` keys, ``(Tq, k)``
  scores: the same multiply-adds, with every key reused by all queries.
* bool mask: torch's SDPA over all ``Tk`` keys with the selection as a dense ``(Tq, Tk)`` bool
  mask (what transformers' sdpa path runs); left out with ``--no-bool`` (it holds ``Tq * Tk``
  bytes, and SDPA a float copy of them).
* read floor: the time to read, once, the bytes the gathered forward reads (``k * H * (Dk + Dv)``
  floats per query), at the bandwidth of a sum over a 512 MiB tensor measured in the same run;
  for forward + backward three times that (the backward gathers the rows again and adds their
  gradients back).

Forward alone and forward + backward, medians of interleaved torch.utils.benchmark rounds; each
ratio is a time over another in the same run. ``--clock cpu`` times each call by the CPU time of
the process instead (all its threads), which a loaded machine's other processes disturb less than
the wall clock: with one thread, that thread's time.

    python benchmarks/bench_indices.py                                 # Tq = Tk = 32768, k = 2048
    python benchmarks/bench_indices.py --tq 4096 --k 512 --threads 1 --json indices.json
    python benchmarks/bench_indices.py --tq 16384 --k 1024 --threads 1 --clock cpu --no-bool
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks
from attnkit.backends import Chunked
from attnkit.cli.measure import time_side_by_side

import results


def selection(tq: int, tk: int, k: int, seed: int = 0) -> torch.Tensor:
    """``(1, 1, Tq, k)`` causal random key positions: query ``i`` picks among keys ``0..i'``."""
    g = torch.Generator().manual_seed(seed)
    at = torch.arange(tq).view(1, 1, tq, 1) + (tk - tq) + 1
    return (torch.rand(1, 1, tq, k, generator=g) * at).long()


def candidates(
    tq: int, tk: int, k: int, h: int, d: int, backward: bool, with_bool: bool, sparse: bool
) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).requires_grad_(backward)

    q, keys, values = randn(1, h, tq, d), randn(1, h, tk, d), randn(1, h, tk, d)
    k_few, v_few = randn(1, h, k, d), randn(1, h, k, d)
    idx = selection(tq, tk, k)
    mask = masks.key_indices(idx) & masks.causal()
    grad = torch.randn(1, h, tq, d, generator=g)

    def run(fn: Callable[[], torch.Tensor]) -> Callable[[], object]:
        if not backward:
            return lambda: fn().detach()
        return lambda: fn().backward(grad)

    fns = {
        "gathered": run(lambda: attnkit.attention(q, keys, values, mask=mask, backend="chunked")),
        "dense k": run(lambda: F.scaled_dot_product_attention(q, k_few, v_few)),
    }
    if sparse:
        eager = Chunked(native=False)
        fns["sparse products"] = run(
            lambda: attnkit.attention(q, keys, values, mask=mask, backend=eager)
        )
    if with_bool:
        dense = mask.dense(tq, tk)
        fns["bool mask"] = run(
            lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=dense)
        )
    return fns


def cpu_side_by_side(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median CPU seconds (the process's, all threads) per call of each callable, in ``rounds``
    interleaved rounds of one call each after a warm-up call."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            samples[name].append(time.process_time() - start)
    return {name: sorted(s)[len(s) // 2] for name, s in samples.items()}


def bandwidth() -> float:
    """Bytes per second of a sum over a 512 MiB float32 tensor (the median of 5)."""
    x = torch.ones(1 << 27)
    x.sum()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / sorted(times)[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tq", type=int, default=32768)
    parser.add_argument("--tk", type=int, help="keys (default: Tq)")
    parser.add_argument("--k", type=int, default=2048, help="keys selected per query")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, help="torch's threads (default: its own count)")
    parser.add_argument("--no-bool", action="store_true", help="leave out the dense bool mask")
    parser.add_argument("--sparse", action="store_true", help="also time torch's sparse products")
    parser.add_argument("--forward-only", action="store_true", help="leave out forward + backward")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall", help="wall clock or the CPU time"
    )
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tq, k, h, d = args.tq, args.k, args.heads, args.dim
    tk = args.tk or tq
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}; "
        f"Tq={tq} Tk={tk} k={k} H={h} D={d} float32, causal"
    )
    q = torch.empty(1, h, tq, d)
    kv = torch.empty(1, h, tk, d)
    print(attnkit.explain(q, kv, kv, mask=masks.key_indices(selection(tq, tk, k)) & masks.causal()))
    per_query = k * h * 2 * d * 4  # bytes each query reads: its k key and value rows, every head
    floor = tq * per_query / bandwidth()
    print(f"bytes gathered per query: {per_query / 2**20:.2f} MiB; read floor {floor:.3f} s")
    print("\n| pass | gathered s | dense k s | bool mask s | sparse products s | "
          "gathered / dense k | gathered / bool mask | sparse products / dense k | "
          "floor / gathered |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for backward in (False,) if args.forward_only else (False, True):
        fns = candidates(tq, tk, k, h, d, backward, not args.no_bool, args.sparse)
        if args.clock == "cpu":
            times = cpu_side_by_side(fns, args.rounds)
        else:
            times = time_side_by_side(fns, rounds=args.rounds, min_run_time=0.5)
        ours, dense = times["gathered"], times["dense k"]
        boolean = times.get("bool mask")
        sparse = times.get("sparse products")
        row = {
            "pass": "fwd+bwd" if backward else "forward",
            "gathered_seconds": ours,
            "dense_k_seconds": dense,
            "bool_mask_seconds": boolean,
            "over_dense_k": ours / dense,
            "over_bool_mask": None if boolean is None else ours / boolean,
            "sparse_products_seconds": sparse,
            "sparse_over_dense_k": None if sparse is None else sparse / dense,
            "read_floor_seconds": floor * (3 if backward else 1),
        }
        rows.append(row)
        print(
            f"| {row['pass']} | {ours:.3f} | {dense:.3f} | "
            f"{'' if boolean is None else f'{boolean:.3f}'} | "
            f"{'' if sparse is None else f'{sparse:.3f}'} | {ours / dense:.2f} | "
            f"{'' if boolean is None else f'{ours / boolean:.2f}'} | "
            f"{'' if sparse is None else f'{sparse / dense:.2f}'} | "
            f"{row['read_floor_seconds'] / ours:.2f} |",
            flush=True,
        )
    if args.json:
        config = {"Tq": tq, "Tk": tk, "k": k, "H": h, "D": d, "dtype": "float32"}
        config |= {"rounds": args.rounds, "bytes_per_query": per_query, "clock": args.clock}
        results.save(args.json, "indices", rows, config=config)


if __name__ == "__main__":
    main()
