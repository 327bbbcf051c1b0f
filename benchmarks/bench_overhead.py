"""The cost of a small call: attnkit's Python around the kernel, next to torch's SDPA.

One thread (``torch.set_num_threads(1)``), float32, B=1, H=8, D=64: calls small enough that the
time is mostly what runs in Python before and after the kernel (the checks, the choice of backend,
the plan, the marshalling of the operator's arguments).

* ``sdpa``: ``F.scaled_dot_product_attention(q, k, v)``, one query against 128 keys: the floor.
* ``auto``: ``attnkit.attention(q, k, v)`` on the same tensors (served by torch's SDPA).
* ``window softcap``: with ``mask=masks.sliding_window(64), softcap=30.0`` (the native kernel).
* ``lse``: ``return_lse=True`` (the native kernel).
* ``prefill``: ``causal=True``, 256 queries against 256 keys.
* ``module decode``: a ``MultiHeadAttention`` (d_model 512, Hkv=2) decoding one token against a
  ``KVCache`` of 128 tokens (the cache rewound after each step).

Each candidate is timed with ``torch.utils.benchmark`` (``blocked_autorange``). ``--against SRC``
times a second source tree of attnkit (``PYTHONPATH=SRC``) as well, in separate processes that
alternate with this tree's for ``--rounds`` rounds; the table gives each side's median over the
rounds, the ratio new / old, and each side's ratio to torch's SDPA measured in the same process.

    python benchmarks/bench_overhead.py
    python benchmarks/bench_overhead.py --against /path/to/other/src --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.benchmark as benchmark

B, H, D, TK, T_PREFILL = 1, 8, 64, 128, 256
CASES = ["sdpa", "auto", "window softcap", "lse", "prefill", "module decode"]


def _candidates() -> dict[str, Callable[[], object]]:
    import attnkit
    from attnkit import masks

    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, H, TK, D, generator=g), torch.randn(B, H, TK, D, generator=g)
    qp, kp, vp = (torch.randn(B, H, T_PREFILL, D, generator=g) for _ in range(3))
    window = masks.sliding_window(64)

    module = attnkit.MultiHeadAttention(H * D, H, num_kv_heads=2).eval()
    cache = module.make_cache(batch_size=1, max_len=TK + 1)
    x = torch.randn(1, 1, H * D, generator=g)
    with torch.no_grad():
        module(torch.randn(1, TK, H * D, generator=g), cache=cache, causal=True)

    def module_decode() -> object:
        with torch.no_grad():
            out = module(x, cache=cache, causal=True)
        cache.rewind(TK)
        return out

    return {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "auto": lambda: attnkit.attention(q, k, v),
        "window softcap": lambda: attnkit.attention(q, k, v, mask=window, softcap=30.0),
        "lse": lambda: attnkit.attention(q, k, v, return_lse=True),
        "prefill": lambda: attnkit.attention(qp, kp, vp, causal=True),
        "module decode": module_decode,
    }


def measure(min_run_time: float) -> dict[str, float]:
    """Microseconds per call of each candidate (the median of torch's blocked runs)."""
    torch.set_num_threads(1)
    fns = _candidates()
    times = {}
    for name in CASES:
        fn = fns[name]
        for _ in range(20):  # warm up: caches, the native kernel's first load
            fn()
        timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=1)
        times[name] = timer.blocked_autorange(min_run_time=min_run_time).median * 1e6
    return times


def _child(src: str | None, min_run_time: float) -> dict[str, float]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    cmd = [sys.executable, __file__, "--child", "--min-run-time", str(min_run_time)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(new: list[dict[str, float]], old: list[dict[str, float]] | None) -> str:
    def med(runs: list[dict[str, float]], name: str) -> float:
        return statistics.median(r[name] for r in runs)

    def to_sdpa(runs: list[dict[str, float]], name: str) -> float:
        return statistics.median(r[name] / r["sdpa"] for r in runs)

    lines = []
    if old is None:
        lines.append(f"{'call':<16}{'us':>10}{'x sdpa':>9}")
        for name in CASES:
            lines.append(f"{name:<16}{med(new, name):>10.1f}{to_sdpa(new, name):>9.2f}")
        return "\n".join(lines)
    lines.append(
        f"{'call':<16}{'old us':>10}{'new us':>10}{'new/old':>9}{'old x sdpa':>12}"
        f"{'new x sdpa':>12}"
    )
    for name in CASES:
        o, n = med(old, name), med(new, name)
        ratio = statistics.median(a[name] / b[name] for a, b in zip(new, old, strict=True))
        lines.append(
            f"{name:<16}{o:>10.1f}{n:>10.1f}{ratio:>9.2f}"
            f"{to_sdpa(old, name):>12.2f}{to_sdpa(new, name):>12.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="another attnkit source tree to time alongside")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-run-time", type=float, default=1.0)
    parser.add_argument("--json", help="write every round's figures here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.min_run_time)))
        return
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "src")
    new: list[dict[str, float]] = []
    old: list[dict[str, float]] | None = [] if args.against else None
    for _ in range(args.rounds):
        new.append(_child(os.path.normpath(here), args.min_run_time))
        if old is not None:
            old.append(_child(args.against, args.min_run_time))
        print(f"round {len(new)} done", file=sys.stderr)
    print(_table(new, old))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"new": new, "old": old, "cases": CASES}, f, indent=1)


if __name__ == "__main__":
    main()
