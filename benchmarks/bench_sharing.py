"""How the native kernel shares a call between threads, quiet and with one core kept busy.

Decode calls (B=1, H=8 heads of 64, one query, float32) against caches of 1,000, 4,000 and 16,000
tokens, with one thread and with two, under each way a call can share its work
(``$ATTNKIT_SHARE``, read once per process, so each runs in a process of its own):

* ``timed`` (the default): a parallel region, timed; after a region whose calling thread waited
  long at its end (a thread came late), the next second's calls take ``helpers``' way;
* ``region``: always a parallel region (OpenMP), which ends when every thread it woke has passed
  its end;
* ``helpers``: the calling thread starts at once and threads of torch's inter-op pool join as they
  get a core; the call waits only for those that joined.

Each round runs every way in a fresh order, quiet and with a process spinning on one core (a
machine shared with another job); the table gives each one's median over the rounds of its mean
time per call, and the two-thread time over the one-thread time of the same way and load.

    python benchmarks/bench_sharing.py
    python benchmarks/bench_sharing.py --rounds 7 --json docs/benchmarks/data/sharing.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import textwrap

from bench_native import Load

import results

WAYS = ("timed", "region", "helpers")
LENGTHS = (1000, 4000, 16000)
THREADS = (1, 2)
B, H, D = 1, 8, 64

# One process's measurements: the mean seconds per call of each (length, threads).
CHILD = textwrap.dedent(
    f"""
    import json, time
    import torch
    import attnkit

    out = {{}}
    for t in {LENGTHS}:
        g = torch.Generator().manual_seed(t)
        q = torch.randn({B}, {H}, 1, {D}, generator=g)
        k, v = (torch.randn({B}, {H}, t, {D}, generator=g) for _ in range(2))
        for threads in {THREADS}:
            torch.set_num_threads(threads)
            for _ in range(10):
                attnkit.attention(q, k, v, backend="chunked")
            n = max(20, 200_000 // t)
            start = time.perf_counter()
            for _ in range(n):
                attnkit.attention(q, k, v, backend="chunked")
            out[f"{{t}} {{threads}}"] = (time.perf_counter() - start) / n
    print(json.dumps(out))
    """
)


def run_way(way: str) -> dict[str, float]:
    env = {**os.environ, "ATTNKIT_SHARE": way}
    child = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(child.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()

    run_way("timed")  # the native kernel's build or load, once
    spinner = Load()
    samples: dict[tuple[str, bool], list[dict[str, float]]] = {
        (w, b): [] for w in WAYS for b in (False, True)
    }
    try:
        for _ in range(args.rounds):
            for busy in (False, True):
                spinner.set(busy)
                for way in random.sample(WAYS, len(WAYS)):
                    samples[way, busy].append(run_way(way))
    finally:
        spinner.stop()

    rows = []
    print(f"{'way':8} {'load':6} {'T':>6} {'1 thread ms':>12} {'2 threads ms':>13} {'2 / 1':>7}")
    for busy in (False, True):
        for t in LENGTHS:
            for way in WAYS:
                ms = {
                    n: statistics.median(s[f"{t} {n}"] for s in samples[way, busy]) * 1e3
                    for n in THREADS
                }
                load = "busy" if busy else "quiet"
                print(
                    f"{way:8} {load:6} {t:>6} {ms[1]:>12.3f} {ms[2]:>13.3f} {ms[2] / ms[1]:>7.2f}"
                )
                rows.append(
                    {
                        "way": way,
                        "load": load,
                        "T": t,
                        "one_thread": ms[1] / 1e3,
                        "two_threads": ms[2] / 1e3,
                        "ratio": ms[2] / ms[1],
                    }
                )
    if args.json:
        config = {"B": B, "H": H, "D": D, "dtype": "float32", "rounds": args.rounds}
        results.save(args.json, "sharing", rows, config=config)


if __name__ == "__main__":
    main()
