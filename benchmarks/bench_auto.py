"""Where ``auto``'s CPU inference thresholds come from: torch SDPA against the chunked backend (the
native kernel), side by side, at the sizes around each threshold.

One thread by default, B=1 H=8 D=64 for prefill (``Tq = Tk``, with and without a causal mask),
and decode steps (one query) against caches of 0.5 to 256 MiB of keys and values (with
``--short-decode`` also 2 KiB to 1 MiB, with ``--long-decode`` 8 to 64 MiB without grouped
heads), in each dtype
of ``--dtype``. Each row gives both backends' medians over interleaved rounds of
``torch.utils.benchmark`` and their ratio (chunked / sdpa: below 1, the native kernel is the
faster). ``auto`` sends a call to the native kernel from the sizes where the ratio stays below 1
(``attnkit.backends.sdpa.thresholds``, each beside the measurement that set it).

    python benchmarks/bench_auto.py --dtype float32 bfloat16 float16 --json auto.json
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import attnkit
from attnkit.cli.measure import time_side_by_side

import results

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PREFILL = [(64, False), (96, False), (128, False), (128, True), (256, False), (256, True)]
PREFILL_LONG = [(1024, True), (4096, True)]
# (B, H, Hkv, Tk, D) of a decode step
DECODE = [
    (1, 8, 8, 128, 64),
    (1, 8, 8, 512, 64),
    (1, 8, 2, 4096, 64),
    (1, 32, 8, 1024, 128),
    (1, 8, 8, 4096, 64),
    (8, 32, 8, 4096, 128),
]
# Long caches without grouped heads (--long-decode): from where they outgrow the last-level cache.
DECODE_LONG = [
    (1, 8, 8, 2048, 64),
    (1, 8, 8, 8192, 64),
    (1, 8, 8, 16384, 64),
    (1, 32, 32, 256, 128),
    (1, 32, 32, 512, 128),
    (1, 8, 8, 4096, 128),
    (1, 32, 32, 2048, 128),
]
# Short caches (--short-decode), where a call's fixed cost weighs: torch reads a key/value head
# once per query head of its group, so each group size comes in steps of the bytes that makes.
DECODE_SHORT = [
    (1, 16, 16, 16, 64),
    (1, 16, 16, 64, 64),
    (1, 16, 16, 256, 64),
    (1, 32, 8, 4, 128),
    (1, 32, 8, 16, 128),
    (1, 32, 8, 64, 128),
    (1, 8, 1, 16, 128),
    (1, 8, 1, 64, 128),
    (1, 8, 1, 256, 128),
]


def _prefill(t: int, causal: bool, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(1, 8, t, 64, generator=g).to(dtype) for _ in range(3))
    return {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "chunked": lambda: attnkit.attention(q, k, v, causal=causal, backend="chunked"),
    }


def _decode(shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    b, h, hkv, tk, d = shape
    g = torch.Generator().manual_seed(tk)
    q = torch.randn(b, h, 1, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hkv, tk, d, generator=g).to(dtype) for _ in range(2))
    return {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=hkv != h),
        "chunked": lambda: attnkit.attention(q, k, v, backend="chunked"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--long", action="store_true", help="also causal prefill at T=1024, 4096")
    parser.add_argument(
        "--short-decode",
        action="store_true",
        help="also decode steps against caches of 2 KiB to 1 MiB (the bytes torch reads, over "
        "the query heads, in brackets)",
    )
    parser.add_argument(
        "--long-decode",
        action="store_true",
        help="also decode steps without grouped heads against caches of 8 to 64 MiB",
    )
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    before = os.getloadavg()[0]
    print(f"native kernel: {attnkit._native.status()[1]}; threads {args.threads}")
    print(f"{'dtype':<9} {'case':<8} {'size':<22} {'sdpa ms':>9} {'chunked ms':>11} {'ratio':>6}")
    rows: list[dict[str, Any]] = []
    cases: list[tuple[str, Any]] = [("prefill", c) for c in PREFILL]
    if args.long:
        cases += [("prefill", c) for c in PREFILL_LONG]
    cases += [("decode", s) for s in DECODE]
    if args.short_decode:
        cases += [("decode", s) for s in DECODE_SHORT]
    if args.long_decode:
        cases += [("decode", s) for s in DECODE_LONG]
    with torch.inference_mode():
        for name in args.dtype:
            dtype = DTYPES[name]
            for case, size in cases:
                if case == "prefill":
                    fns = _prefill(*size, dtype)
                    label = f"T={size[0]}{' causal' if size[1] else ''}"
                else:
                    fns = _decode(size, dtype)
                    b, h, hkv, tk, d = size
                    mib = b * hkv * tk * 2 * d * dtype.itemsize / 2**20
                    label = f"{','.join(map(str, size))} {mib:g} MiB"
                    if size in DECODE_SHORT:
                        label += f" ({mib * h / hkv:g})"
                t = time_side_by_side(fns, rounds=args.rounds, min_run_time=0.2)
                ratio = t["chunked"] / t["sdpa"]
                print(
                    f"{name:<9} {case:<8} {label:<22} {t['sdpa'] * 1e3:>9.3f} "
                    f"{t['chunked'] * 1e3:>11.3f} {ratio:>6.2f}",
                    flush=True,
                )
                rows.append(
                    {"dtype": name, "case": case, "size": label, "sdpa_seconds": t["sdpa"],
                     "chunked_seconds": t["chunked"], "ratio": ratio}
                )  # fmt: skip
    if args.json:
        config = {
            "threads": args.threads,
            "rounds": args.rounds,
            "loadavg": [round(before, 2), round(os.getloadavg()[0], 2)],
        }
        results.save(args.json, "auto", rows, config=config)


if __name__ == "__main__":
    main()
