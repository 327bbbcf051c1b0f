"""A training call's forward and backward on the ``chunked`` backend in two checkouts of attnkit,
side by side: new over old.

Each checkout runs in a worker process of its own (``PYTHONPATH`` at its ``src``) holding the
candidates built once: ``attention(q, k, v, causal=True)`` and its backward, B=1 H=8 D=64 in
float32, at each ``--lengths`` on the native kernel and (``--eager``) the eager one
(``Chunked(native=False)``). The driver asks the two workers in turn for one
``torch.utils.benchmark`` measurement of each candidate, round after round, so both see the same
load; the table gives each candidate's median over the rounds in each checkout and new / old,
and the same of the fastest round (steadier on a loaded machine). ``--clock cpu`` times the
process's CPU time rather than the wall clock's (with ``--threads 1``: the work itself, not the
waits for a core that a loaded machine adds).

    mkdir /tmp/old && git archive <commit before> src | tar -x -C /tmp/old
    python benchmarks/compare_training.py --old /tmp/old/src --new src --lengths 128 1024 --eager
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
import attnkit
from attnkit.backends import Chunked
torch.set_num_threads(int(sys.argv[1]))
fns = {}
for t in json.loads(sys.argv[2]):
    for kind in json.loads(sys.argv[3]):
        backend = Chunked(native=kind == "native")
        g = torch.Generator().manual_seed(t)
        q, k, v = (torch.randn(1, 8, t, 64, generator=g).requires_grad_() for _ in range(3))
        dout = torch.randn(1, 8, t, 64, generator=g)
        def step(q=q, k=k, v=v, dout=dout, backend=backend):
            out = attnkit.attention(q, k, v, causal=True, backend=backend)
            torch.autograd.grad(out, (q, k, v), dout)
        fns[f"T={t} {kind}"] = step
print(json.dumps(list(fns)), flush=True)
for line in sys.stdin:
    fn = fns[line.strip()]
    fn()
    clock = time.process_time if sys.argv[5] == "cpu" else time.perf_counter
    timer = benchmark.Timer("fn()", globals={"fn": fn}, timer=clock)
    t = timer.blocked_autorange(min_run_time=float(sys.argv[4]))
    print(t.median, flush=True)
"""


def _worker(
    src: str, threads: int, lengths: list[int], kinds: list[str], run_time: float, clock: str
) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": src}
    args = [sys.executable, "-c", WORKER, str(threads), json.dumps(lengths), json.dumps(kinds)]
    args += [str(run_time), clock]
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def _ask(proc: subprocess.Popen[str], name: str) -> float:
    if proc.stdin is None or proc.stdout is None:
        raise RuntimeError("the worker has no pipes")
    proc.stdin.write(name + "\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="the old checkout's src folder")
    parser.add_argument("--new", required=True, help="the new checkout's src folder")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--eager", action="store_true", help="also time the eager kernel")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--run-time", type=float, default=0.5, help="seconds per measurement")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the process's CPU time (with --threads 1, steadier on a loaded machine)",
    )
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    kinds = ["native", "eager"] if args.eager else ["native"]
    workers = {
        t: _worker(getattr(args, t), args.threads, args.lengths, kinds, args.run_time, args.clock)
        for t in ("old", "new")
    }
    names: list[str] = []
    for proc in workers.values():
        if proc.stdout is None:
            raise RuntimeError("the worker has no pipes")
        names = json.loads(proc.stdout.readline())
    samples: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for name in names:
            for tree in ("old", "new") if r % 2 == 0 else ("new", "old"):
                samples.setdefault((name, tree), []).append(_ask(workers[tree], name))
    for proc in workers.values():
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait()
    rows = []
    print(f"{'candidate':<16} {'old ms':>9} {'new ms':>9} {'new/old':>8} {'fastest':>8}")
    for name in names:
        old = statistics.median(samples[name, "old"]) * 1e3
        new = statistics.median(samples[name, "new"]) * 1e3
        fastest = min(samples[name, "new"]) / min(samples[name, "old"])
        rows.append(
            {
                "candidate": name,
                "old_ms": old,
                "new_ms": new,
                "ratio": new / old,
                "fastest": fastest,
            }
        )
        print(f"{name:<16} {old:>9.3f} {new:>9.3f} {new / old:>8.3f} {fastest:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
