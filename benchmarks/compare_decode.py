"""bench_decode.py's candidates in two checkouts of attnkit, side by side: new over old.

Each checkout runs in a worker process of its own (``PYTHONPATH`` at its ``src``), holding the
candidates of ``bench_decode.py`` built once; the driver asks the two workers in turn for one
``torch.utils.benchmark`` measurement of each candidate, round after round, so both see the same
load. The table gives each candidate's median over the rounds in each checkout and new / old.

    git worktree add /tmp/old <commit before>
    python benchmarks/compare_decode.py --old /tmp/old/src --new src --cases kvcache modules
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, sys
import torch
from torch.utils import benchmark
sys.path.insert(0, sys.argv[1])
import bench_decode
torch.set_num_threads(int(sys.argv[2]))
fns = {}
with torch.inference_mode():  # as bench_decode.py builds and runs them
    for case in json.loads(sys.argv[3]):
        made = bench_decode._candidates(case, ["float32"])
        fns.update({f"{case}: {n}": f for n, f in made.items()})
    print(json.dumps(sorted(fns)), flush=True)
    for line in sys.stdin:
        fn = fns[line.strip()]
        fn()
        t = benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.5)
        print(t.median, flush=True)
"""


def _worker(src: str, bench: str, threads: int, cases: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": src}
    args = [sys.executable, "-c", WORKER, bench, str(threads), json.dumps(cases)]
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def _ask(proc: subprocess.Popen[str], name: str) -> float:
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write(name + "\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="the old checkout's src folder")
    parser.add_argument("--new", required=True, help="the new checkout's src folder")
    parser.add_argument("--cases", nargs="+", default=["kvcache", "modules", "steps"])
    parser.add_argument("--only", nargs="*", help="candidates whose name holds one of these")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    bench = os.path.dirname(os.path.abspath(__file__))
    workers = {
        t: _worker(getattr(args, t), bench, args.threads, args.cases) for t in ("old", "new")
    }
    names = []
    for proc in workers.values():
        assert proc.stdout is not None
        names = json.loads(proc.stdout.readline())
    if args.only:
        names = [n for n in names if any(o in n for o in args.only)]
    samples: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for name in names:
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for tree in order:
                samples.setdefault((tree, name), []).append(_ask(workers[tree], name))
    for proc in workers.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    print(f"loadavg {os.getloadavg()[0]:.2f}; {args.rounds} rounds; threads {args.threads}")
    print(f"{'candidate':<34} {'old ms':>9} {'new ms':>9} {'new/old':>8}")
    rows = []
    for name in names:
        old = statistics.median(samples["old", name])
        new = statistics.median(samples["new", name])
        rows.append({"candidate": name, "old_s": old, "new_s": new, "ratio": new / old})
        print(f"{name:<34} {old * 1e3:>9.2f} {new * 1e3:>9.2f} {new / old:>8.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
