"""A streaming cache (sinks and a window) decoding far past any window: memory and step time flat.

``StreamingKVCache(sink_tokens=4, window=1024)`` (B=1, H=32, Hkv=8, D=128, float32) decodes
``--tokens`` tokens one at a time (100,000 by default). The step time is measured with
``torch.utils.benchmark`` at checkpoints along the way (each a ``blocked_autorange`` of steps that
keep decoding), and the process's resident memory is read at each checkpoint: both must stay flat
once the window is full. Side by side at every checkpoint: one ``attnkit.attention`` call over a
plain tensor of the same ``S + W`` keys (the step's floor: what any cache of those tokens costs).

    python benchmarks/bench_streaming.py
    python benchmarks/bench_streaming.py --tokens 20000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import resource

import torch
from torch.utils import benchmark

from attnkit import StreamingKVCache, attention


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--checkpoints", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    b, h, hkv, d = 1, 32, 8, 128
    cache = StreamingKVCache(b, hkv, d, sink_tokens=args.sinks, window=args.window)
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, hkv, 1, d), torch.randn(b, hkv, 1, d)

    def step() -> None:
        cache.attention(q, k, v)

    keys = torch.randn(b, hkv, args.sinks + args.window, d)
    rows = []
    marks = [round(args.tokens * (i + 1) / args.checkpoints) for i in range(args.checkpoints)]
    plain = benchmark.Timer(
        "attention(q, keys, keys)", globals={"attention": attention, "q": q, "keys": keys}
    )
    with torch.inference_mode():
        for mark in marks:
            while cache.length < mark:
                step()
            timed = benchmark.Timer("step()", globals={"step": step}).blocked_autorange(
                min_run_time=1.0
            )
            floor = plain.blocked_autorange(min_run_time=1.0)
            rows.append(
                {
                    "tokens": cache.length,
                    "step_us": timed.median * 1e6,
                    "plain_call_us": floor.median * 1e6,
                    "over_plain_call": timed.median / floor.median,
                    "rss_mib": _rss_mib(),
                    "held": cache.held,
                }
            )
            print(
                f"after {cache.length:>7} tokens: step {timed.median * 1e6:7.1f} us, "
                f"{timed.median / floor.median:.2f}x one call over a plain tensor of the "
                f"{cache.held} held; RSS {rows[-1]['rss_mib']:.0f} MiB"
            )
    first, last = rows[0], rows[-1]
    print(
        f"last/first checkpoint: step time {last['step_us'] / first['step_us']:.2f}x, "
        f"RSS {last['rss_mib'] - first['rss_mib']:+.1f} MiB"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checkpoints": rows}, f, indent=1)


if __name__ == "__main__":
    main()
