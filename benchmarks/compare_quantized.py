"""bench_quantized.py's decode at its shape in two checkouts of attnkit, side by side: new over old.

Each checkout runs in a worker process of its own (``PYTHONPATH`` at its ``src``) holding the same
inputs (bench_quantized.py's, built from one seed): the int8 and bfloat16 caches' decode and their
memory floors (``x.sum()`` over a float32 tensor of the cache's bytes). The driver asks the two
workers in turn, the order swapped every round, for one ``torch.utils.benchmark`` measurement of
each candidate, so both see the same load; the table gives each one's median over the rounds in
each checkout, new / old, and the decode over the floor and over the bfloat16 decode measured in
the same worker.

    git archive <commit before> src | tar -x -C /tmp/old
    python benchmarks/compare_quantized.py --old /tmp/old/src --new src --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, sys, time
import torch
from torch.utils import benchmark
sys.path.insert(0, sys.argv[1])
import attnkit
import bench_quantized as bq
torch.set_num_threads(int(sys.argv[2]))
t = int(sys.argv[3])
g = torch.Generator().manual_seed(0)
q = torch.randn(bq.B, bq.H, 1, bq.D, generator=g)
k = torch.randn(bq.B, bq.HKV, t, bq.D, generator=g)
v = torch.randn(bq.B, bq.HKV, t, int(sys.argv[4]), generator=g)
backend = attnkit.backends.Chunked()
(kq, ks), (vq, vs) = bq.quantize(k, torch.int8), bq.quantize(v, torch.int8)
kb, vb, qb = k.bfloat16(), v.bfloat16(), q.bfloat16()
int8_bytes = sum(x.numel() * x.element_size() for x in (kq, vq, ks, vs))
bf16_bytes = 2 * (kb.numel() + vb.numel())
floors = {"int8": torch.randn(int8_bytes // 4), "bf16": torch.randn(bf16_bytes // 4)}
fns = {
    "decode int8": lambda: attnkit.attention(q, kq, vq, k_scale=ks, v_scale=vs, backend=backend),
    "decode bf16": lambda: attnkit.attention(qb, kb, vb, backend=backend),
    "floor int8": floors["int8"].sum,
    "floor bf16": floors["bf16"].sum,
}
with torch.inference_mode():
    out = fns["decode int8"]()
    over = attnkit.attention(q.double(), (kq.float() * ks).double(), (vq.float() * vs).double(),
                             backend="reference")
    err = float((out.double() - over).norm() / over.norm())
    print(json.dumps({"names": sorted(fns), "error": err}), flush=True)
    for line in sys.stdin:
        fn = fns[line.strip()]
        fn()
        if sys.argv[5] == "cpu":  # this thread's processor time: none while another process runs
            best = float("inf")
            for _ in range(5):
                start, calls = time.thread_time(), 0
                while time.thread_time() - start < 0.06:
                    fn()
                    calls += 1
                best = min(best, (time.thread_time() - start) / calls)
            print(best, flush=True)
            continue
        timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        print(timer.blocked_autorange(min_run_time=0.3).median, flush=True)
"""


def _worker(
    src: str, bench: str, threads: int, tokens: int, dv: int, clock: str
) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": src}
    args = [sys.executable, "-c", WORKER, bench, str(threads), str(tokens), str(dv), clock]
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def _ask(proc: subprocess.Popen[str], name: str) -> float:
    if proc.stdin is None or proc.stdout is None:
        raise RuntimeError("the worker's pipes are closed")
    proc.stdin.write(name + "\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="the old checkout's src folder")
    parser.add_argument("--new", required=True, help="the new checkout's src folder")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dv", type=int, default=128, help="the values' width (keys: 128)")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="one thread, timed by its processor time (the best of 5 spans of 60 ms) rather than "
        "by the wall clock: on a machine shared with other processes",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    bench = os.path.dirname(os.path.abspath(__file__))
    trees = ("old", "new")
    if args.cpu_time:
        args.threads = 1
    clock = "cpu" if args.cpu_time else "wall"
    workers = {
        t: _worker(getattr(args, t), bench, args.threads, args.tokens, args.dv, clock)
        for t in trees
    }
    errors = {}
    names: list[str] = []
    for tree, proc in workers.items():
        if proc.stdout is None:
            raise RuntimeError("the worker's pipes are closed")
        first = json.loads(proc.stdout.readline())
        names, errors[tree] = first["names"], first["error"]
    samples: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for name in names:
            for tree in trees if r % 2 == 0 else trees[::-1]:
                samples.setdefault((tree, name), []).append(_ask(workers[tree], name))
    for proc in workers.values():
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait()
    med = {key: statistics.median(s) for key, s in samples.items()}
    print(f"loadavg {os.getloadavg()[0]:.2f}; {args.rounds} rounds; threads {args.threads}")
    print(f"{'candidate':<12} {'old ms':>8} {'new ms':>8} {'new/old':>8}")
    for name in names:
        old, new = med["old", name], med["new", name]
        print(f"{name:<12} {old * 1e3:>8.2f} {new * 1e3:>8.2f} {new / old:>8.3f}")
    rows = {}
    for tree in trees:
        int8, bf16, floor = (
            med[tree, "decode int8"],
            med[tree, "decode bf16"],
            med[tree, "floor int8"],
        )
        rows[tree] = {"int8_over_bf16": int8 / bf16, "int8_over_floor": int8 / floor,
                      "error_vs_dequantized": errors[tree]}  # fmt: skip
        print(f"{tree}: int8 / bf16 {int8 / bf16:.3f}, int8 / its floor {int8 / floor:.2f}, "
              f"error against the dequantized cache {errors[tree]:.1e}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"ms": {f"{t} {n}": s * 1e3 for (t, n), s in med.items()}, **rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
