"""Decode steps over a cache's memory on 4 KiB pages and on transparent huge pages, side by side.

attnkit's caches (``KVCache``, ``PagedKVCache``, ``StreamingKVCache``) advise their memory to
transparent huge pages before they first touch it (``ATTNKIT_HUGE_PAGES=0`` turns that off). This
script makes each cache tensor twice, with the advice and without it (``cache_zeros``, as the
caches make them), fills both with the same numbers, and times ``attnkit.attention`` over each in
interleaved rounds of ``torch.utils.benchmark``:

* bf16: a grouped-query decode step, B=8, H=32, Hkv=8, D=128, 4096 cached tokens, bfloat16.
* int8: the same over an int8 cache with a float32 scale per token (float32 queries).
* MLA absorbed: latent attention's absorbed decode, B=8, H=16 heads reading one latent of 512 +
  64 per token (V its first 512 columns), bfloat16.
* MLA expanded: the same step in the expanded form, H=16 heads of keys 192 and values 128.

The table gives each case's median time on each kind of page and their ratio, and the two ratios
the quantized and latent caches are judged by (int8 / bf16, absorbed / expanded), on each.

    python benchmarks/bench_cache_memory.py
    python benchmarks/bench_cache_memory.py --rounds 5 --json cache_memory.json
    python benchmarks/bench_cache_memory.py --load busy   # another process spinning on one core

Huge pages need Linux with ``madvise`` or ``always`` in
``/sys/kernel/mm/transparent_hugepage/enabled``; elsewhere both columns time the same memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
from bench_native import Load, measure

import attnkit
from attnkit.caches._memory import cache_zeros

import results

B, T = 8, 4096
BF = torch.bfloat16


def in_cache(x: torch.Tensor, huge: bool) -> torch.Tensor:
    """x copied into memory made as attnkit's caches make theirs, advised to huge pages or not."""
    before = os.environ.get("ATTNKIT_HUGE_PAGES")
    os.environ["ATTNKIT_HUGE_PAGES"] = "1" if huge else "0"
    try:
        out = cache_zeros(tuple(x.shape), dtype=x.dtype, device="cpu")
    finally:
        if before is None:
            del os.environ["ATTNKIT_HUGE_PAGES"]
        else:
            os.environ["ATTNKIT_HUGE_PAGES"] = before
    return out.copy_(x)


def cases() -> dict[str, Callable[[bool], Callable[[], object]]]:
    """Each case: a function of ``huge`` that makes its tensors and returns the timed call."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = BF) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    k, v, q = randn(B, 8, T, 128), randn(B, 8, T, 128), randn(B, 32, 1, 128)
    k8 = torch.randint(-127, 128, (B, 8, T, 128), dtype=torch.int8, generator=g)
    v8 = torch.randint(-127, 128, (B, 8, T, 128), dtype=torch.int8, generator=g)
    scale = torch.rand(B, 8, T, 1, generator=g) / 100
    q32 = q.float()
    latent, qa = randn(B, 1, T, 576), randn(B, 16, 1, 576)
    ke, ve, qe = randn(B, 16, T, 192), randn(B, 16, T, 128), randn(B, 16, 1, 192)

    def bf16(huge: bool) -> Callable[[], object]:
        kc, vc = in_cache(k, huge), in_cache(v, huge)
        return lambda: attnkit.attention(q, kc, vc)

    def int8(huge: bool) -> Callable[[], object]:
        kc, vc = in_cache(k8, huge), in_cache(v8, huge)
        return lambda: attnkit.attention(q32, kc, vc, k_scale=scale, v_scale=scale)

    def absorbed(huge: bool) -> Callable[[], object]:
        lc = in_cache(latent, huge)
        return lambda: attnkit.attention(qa, lc, lc[..., :512], scale=192**-0.5)

    def expanded(huge: bool) -> Callable[[], object]:
        kc, vc = in_cache(ke, huge), in_cache(ve, huge)
        return lambda: attnkit.attention(qe, kc, vc, scale=192**-0.5)

    return {"bf16": bf16, "int8": int8, "MLA absorbed": absorbed, "MLA expanded": expanded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load", choices=["quiet", "busy"], default="quiet")
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    made = cases()
    fns = {f"{name}|{kind}": make(kind == "huge") for name, make in made.items()
           for kind in ("plain", "huge")}  # fmt: skip
    spinner = Load() if args.load == "busy" else None
    try:
        with torch.inference_mode():
            samples = measure(fns, args.rounds, [False], None)
    finally:
        if spinner is not None:
            spinner.stop()
    ms = {name: statistics.median(samples[name, False]) * 1e3 for name in fns}
    print(f"{args.threads} threads, {args.load}; B={B}, Tk={T}")
    print(f"{'case':<14} {'4 KiB pages ms':>15} {'huge pages ms':>14} {'huge / 4 KiB':>13}")
    rows: list[dict[str, Any]] = []
    for name in made:
        plain, huge = ms[f"{name}|plain"], ms[f"{name}|huge"]
        print(f"{name:<14} {plain:>15.2f} {huge:>14.2f} {huge / plain:>13.2f}")
        rows.append({"case": name, "plain_seconds": plain / 1e3, "huge_seconds": huge / 1e3})
    ratios = {
        f"{a} / {b}, {kind}": ms[f"{a}|{kind}"] / ms[f"{b}|{kind}"]
        for a, b in (("int8", "bf16"), ("MLA absorbed", "MLA expanded"))
        for kind in ("plain", "huge")
    }
    for label, value in ratios.items():
        print(f"{label}: {value:.2f}x")
    if args.json:
        config = {"B": B, "Tk": T, "threads": args.threads, "load": args.load, "ratios": ratios}
        results.save(args.json, "cache_memory", rows, config=config)


if __name__ == "__main__":
    main()
