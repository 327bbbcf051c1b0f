"""What one selected (query, key) pair costs the gathered kernel, forward and backward, against
what it costs dense attention over ``k`` keys: CPU nanoseconds per pair and head, on one thread.

Two shapes of the same arithmetic per pair:

* long: ``key_indices(idx) & causal()`` over ``Tq = Tk`` (bench_indices.py's call), where each
  query's rows come from all over k and v;
* in cache: the same number of queries, each selecting ``k_small`` distinct keys of only
  ``Tk_small`` keys, so that every row of k, v, dk and dv stays in the core's own cache and no
  pair waits on memory.

If the backward's cost per pair is about the same in both, its time is the work done per pair
(the instructions), not the gathering. ``--target`` times dense attention's forward + backward
time, less the long call's gathered forward, over the long call's pairs, is what its backward may
cost per pair for the call to take at most ``--target`` times dense attention's time.

    python benchmarks/bench_indices_pairs.py --tq 16384 --k 1024
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks

import results


def cpu_seconds(fn: Callable[[], object], rounds: int) -> float:
    """Median CPU seconds of the process per call, after a warm-up call."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return sorted(times)[len(times) // 2]


def pairs_of(idx: torch.Tensor, tq: int, tk: int, heads: int) -> int:
    """The distinct visible (query, key) pairs of a causal selection, times the heads."""
    keys = idx.sort(-1).values
    first = torch.ones_like(keys, dtype=torch.bool)
    first[..., 1:] = keys[..., 1:] != keys[..., :-1]
    at = torch.arange(tq).view(1, 1, tq, 1) + (tk - tq)
    return int(((keys >= 0) & (keys <= at) & first).sum()) * heads


def gathered_times(
    tq: int, tk: int, idx: torch.Tensor, causal: bool, h: int, d: int, rounds: int
) -> tuple[float, float]:
    """Forward and backward CPU seconds of the gathered kernel on ``idx``."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, n, d, generator=g).requires_grad_() for n in (tq, tk, tk))
    mask = masks.key_indices(idx) & masks.causal() if causal else masks.key_indices(idx)
    grad = torch.randn(1, h, tq, d, generator=g)
    forward = cpu_seconds(
        lambda: attnkit.attention(q, k, v, mask=mask, backend="chunked").detach(), rounds
    )
    both = cpu_seconds(
        lambda: attnkit.attention(q, k, v, mask=mask, backend="chunked").backward(grad), rounds
    )
    return forward, both - forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tq", type=int, default=16384)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--tk-small", type=int, default=128, help="keys of the in-cache shape")
    parser.add_argument("--k-small", type=int, default=16, help="keys each query selects there")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--target", type=float, default=3.0)
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tq, k, h, d = args.tq, args.k, args.heads, args.dim
    g = torch.Generator().manual_seed(0)
    at = torch.arange(tq).view(1, 1, tq, 1) + 1
    long_idx = (torch.rand(1, 1, tq, k, generator=g) * at).long()
    small_idx = torch.rand(1, 1, tq, args.tk_small, generator=g).argsort(-1)[..., : args.k_small]
    q = torch.randn(1, h, tq, d, generator=g).requires_grad_()
    few = [torch.randn(1, h, k, d, generator=g).requires_grad_() for _ in range(2)]
    grad = torch.randn(1, h, tq, d, generator=g)
    dense_f = cpu_seconds(lambda: F.scaled_dot_product_attention(q, *few).detach(), args.rounds)
    dense_fb = cpu_seconds(
        lambda: F.scaled_dot_product_attention(q, *few).backward(grad), args.rounds
    )
    dense_pairs = tq * k * h
    print(f"torch {torch.__version__}, 1 thread; Tq={tq} H={h} D={d} float32; CPU ns per pair-head")
    print(f"dense over k={k}: forward {dense_f / dense_pairs * 1e9:.2f}, "
          f"forward+backward {dense_fb / dense_pairs * 1e9:.2f}")  # fmt: skip
    print("\n| shape | pairs x heads (M) | forward ns | backward ns | fwd+bwd ns / dense k's |")
    print("| --- | ---: | ---: | ---: | ---: |")
    rows = []
    cases = [
        (f"long: Tk={tq}, k={k}, causal", tq, long_idx, True),
        (f"in cache: Tk={args.tk_small}, k={args.k_small}", args.tk_small, small_idx, False),
    ]
    for name, tk, idx, causal in cases:
        pairs = pairs_of(idx, tq, tk, h) if causal else tq * idx.shape[-1] * h
        fwd, bwd = gathered_times(tq, tk, idx, causal, h, d, args.rounds)
        f_ns, b_ns = fwd / pairs * 1e9, bwd / pairs * 1e9
        over = (f_ns + b_ns) / (dense_fb / dense_pairs * 1e9)
        rows.append({"shape": name, "pairs": pairs, "forward_ns": f_ns, "backward_ns": b_ns,
                     "over_dense_k": over})  # fmt: skip
        print(f"| {name} | {pairs / 1e6:.1f} | {f_ns:.2f} | {b_ns:.2f} | {over:.2f} |", flush=True)
    long = rows[0]
    seconds = (long["forward_ns"] + long["backward_ns"]) * long["pairs"] / 1e9
    budget = (args.target * dense_fb - long["forward_ns"] * long["pairs"] / 1e9) / long["pairs"]
    budget *= 1e9
    print(f"\nlong call: forward + backward {seconds:.2f} s = {seconds / dense_fb:.2f}x dense k's "
          f"{dense_fb:.2f} s; its backward may cost {budget:.2f} ns per pair-head for "
          f"{args.target:g}x")  # fmt: skip
    if args.json:
        config = {"Tq": tq, "k": k, "H": h, "D": d, "rounds": args.rounds, "threads": 1}
        config |= {"Tk_small": args.tk_small, "k_small": args.k_small}
        config |= {"dense_forward_ns": dense_f / dense_pairs * 1e9}
        config |= {"dense_fwd_bwd_ns": dense_fb / dense_pairs * 1e9, "budget_ns": budget}
        config |= {"long_over_dense_k": seconds / dense_fb}
        results.save(args.json, "indices_pairs", rows, config=config)


if __name__ == "__main__":
    main()
