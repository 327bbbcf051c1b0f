"""A decode step of multi-head latent attention (MLA): the absorbed form against the expanded one
and against the CPU's matrix-product throughput, side by side in one run.

DeepSeek V3's attention sizes: B=8 rows, H=16 query heads, a latent of R=512 and a rotary key of
Dr=64 per token, Dn=128, Dv=128; one new query a row against Tk=4096 cached tokens; bfloat16.

* absorbed: ``attnkit.attention`` of the absorbed form: q ``(B, H, 1, 576)`` against the latent
  cache ``(B, 1, Tk, 576)`` as multi-query keys, V the view of its first 512 columns.
* absorbed step: the same with what the form adds around the call: the query moved into the
  latent's space (``q_nope W_uk``) and ``W_uv`` applied to the output.
* per head: the absorbed call with the latent copied for each head (``Hkv = 16``): the same
  arithmetic, without the heads sharing one read of each latent row.
* expanded: the expanded form's decode, attention over a cache of the expanded keys and values
  ``(B, H, Tk, 192)`` and ``(B, H, Tk, 128)``.
* matmul: a 2048 x 2048 x 2048 bfloat16 ``torch.mm``: the throughput the CPU reaches on products.
* floor: ``x.sum()`` over a float32 tensor of the latent cache's bytes: the time to read them.

The table gives each candidate's median over interleaved rounds, its multiply-adds and bytes
read, its GFLOP/s, and the two ratios MLA decoding is judged by: the absorbed call's time over
the expanded one's, and its GFLOP/s over the matrix product's. ``auto``'s choice for the
absorbed call is printed with the kernel that served it.

    python benchmarks/bench_mla.py
    python benchmarks/bench_mla.py --rounds 5 --json mla.json
    python benchmarks/bench_mla.py --load busy   # another process spinning on one core

On CPUs with AVX512-BF16 where its dot products outrun float32 FMAs (AMD's), the absorbed call's
products run on them; ``ATTNKIT_BF16_DOTS=never`` times the float32 FMAs instead.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
from bench_native import Load, measure

import attnkit

import results

B, H, R, DR, DN, DV, T = 8, 16, 512, 64, 128, 128, 4096
N = 2048  # the matrix product's size
SCALE = (DN + DR) ** -0.5


def candidates() -> tuple[dict[str, Callable[[], object]], dict[str, tuple[float, float]]]:
    """The candidates, and each one's ``(multiply-adds, bytes read)``."""
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(bf)

    q_nope, q_rope = randn(B, H, 1, DN), randn(B, H, 1, DR)
    w_uk, w_uv = randn(H, DN, R) / DN**0.5, randn(H, DV, R) / R**0.5
    # (B, H, 1, R + DR): the query moved into the latent's space
    q = torch.cat((torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk), q_rope), -1)
    latent = randn(B, 1, T, R + DR)
    per_head = latent.expand(B, H, T, R + DR).contiguous()
    qe, ke, ve = randn(B, H, 1, DN + DR), randn(B, H, T, DN + DR), randn(B, H, T, DV)
    a, b = randn(N, N), randn(N, N)
    floor = torch.randn(B * T * (R + DR) * 2 // 4, generator=g)

    def absorbed() -> torch.Tensor:
        return attnkit.attention(q, latent, latent[..., :R], scale=SCALE)

    def absorbed_step() -> torch.Tensor:
        # what MultiHeadLatentAttention does around its call
        qa = torch.cat((torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk), q_rope), -1)
        out = attnkit.attention(qa, latent, latent[..., :R], scale=SCALE)
        return torch.einsum("bhtr,hvr->bhtv", out, w_uv)

    fns: dict[str, Callable[[], object]] = {
        "absorbed": absorbed,
        "absorbed step": absorbed_step,
        "per head": lambda: attnkit.attention(q, per_head, per_head[..., :R], scale=SCALE),
        "expanded": lambda: attnkit.attention(qe, ke, ve, scale=SCALE),
        "matmul": lambda: torch.mm(a, b),
        "floor": lambda: floor.sum(),
    }
    pairs = B * H * T  # (query, key) pairs of one step, over the heads
    absorbed_macs = pairs * (R + DR + R)
    up_macs = B * H * (DN * R + R * DV)
    costs = {
        "absorbed": (absorbed_macs, B * T * (R + DR) * 2),
        "absorbed step": (absorbed_macs + up_macs, B * T * (R + DR) * 2 + H * (DN + DV) * R * 2),
        "per head": (absorbed_macs, B * H * T * (R + DR) * 2),
        "expanded": (pairs * (DN + DR + DV), B * H * T * (DN + DR + DV) * 2),
        "matmul": (N**3, 3 * N * N * 2),
        "floor": (0, B * T * (R + DR) * 2),
    }
    return fns, {k: (float(m), float(by)) for k, (m, by) in costs.items()}


def auto_choice() -> str:
    """Which backend and kernel ``auto`` serves the absorbed call with, at the benchmark's shape."""
    q = torch.zeros(B, H, 1, R + DR, dtype=torch.bfloat16)
    latent = torch.zeros(B, 1, T, R + DR, dtype=torch.bfloat16)
    with attnkit.record_dispatch() as calls:
        attnkit.attention(q, latent, latent[..., :R], scale=SCALE)
    (call,) = calls
    return f"{call.served_by} ({call.kernel or 'its own kernel'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--load",
        choices=["quiet", "busy"],
        default="quiet",
        help="busy: another process keeps one core spinning for the whole run",
    )
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fns, costs = candidates()
    print(
        f"auto serves the absorbed call with: {auto_choice()} ({args.threads} threads, {args.load})"
    )
    spinner = Load() if args.load == "busy" else None
    try:
        with torch.inference_mode():
            samples = measure(fns, args.rounds, [False], None)
    finally:
        if spinner is not None:
            spinner.stop()
    seconds = {name: statistics.median(samples[name, False]) for name in fns}
    rate = {name: 2 * costs[name][0] / seconds[name] for name in fns}
    print(
        f"{'candidate':<14} {'ms':>8} {'worst ms':>9} {'GMAC':>7} {'MB read':>8} "
        f"{'MAC/byte':>8} {'GFLOP/s':>8}"
    )
    rows: list[dict[str, Any]] = []
    for name in fns:
        macs, read = costs[name]
        worst = max(samples[name, False])
        print(
            f"{name:<14} {seconds[name] * 1e3:>8.2f} {worst * 1e3:>9.2f} {macs / 1e9:>7.3f} "
            f"{read / 1e6:>8.1f} {macs / read:>8.1f} {rate[name] / 1e9:>8.0f}"
        )
        rows.append(
            {
                "candidate": name,
                "seconds": seconds[name],
                "worst_seconds": worst,
                "multiply_adds": macs,
                "bytes_read": read,
                "flops_per_second": rate[name],
            }
        )
    over_expanded = seconds["absorbed"] / seconds["expanded"]
    of_matmul = rate["absorbed"] / rate["matmul"]
    print(f"absorbed / expanded time: {over_expanded:.2f}x")
    print(f"absorbed / matmul GFLOP/s: {of_matmul:.2f}")
    print(f"per head / absorbed time: {seconds['per head'] / seconds['absorbed']:.2f}x")
    print(f"absorbed / floor time: {seconds['absorbed'] / seconds['floor']:.1f}x")
    if args.json:
        config = {
            "B": B,
            "H": H,
            "R": R,
            "Dr": DR,
            "Dn": DN,
            "Dv": DV,
            "Tk": T,
            "dtype": "bfloat16",
            "threads": args.threads,
            "load": args.load,
            "auto": auto_choice(),
            "absorbed_over_expanded": over_expanded,
            "absorbed_of_matmul": of_matmul,
        }
        results.save(args.json, "mla", rows, config=config)


if __name__ == "__main__":
    main()
