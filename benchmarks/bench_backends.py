"""attention() backends against torch SDPA and a naive softmax(QK^T)V: time and extra peak memory.

B=1, H=8, D=64, float32, inference (no grad), T = 256 ... 16384. Times are medians of interleaved
torch.utils.benchmark rounds; "ratio" is time / torch SDPA's time at the same T and causality.
"extra MiB" is the peak resident memory a call adds beyond its inputs and output, measured in a
fresh process; "% TxT" relates it to one T x T float32 score matrix.

    python benchmarks/bench_backends.py                # every length (takes ~15 minutes)
    python benchmarks/bench_backends.py --quick        # T = 256, 1024, 4096, fewer rounds
    python benchmarks/bench_backends.py --json docs/benchmarks/data/backends.json

``--inference`` checks auto's choice instead: on the same shapes, under ``torch.inference_mode()``,
auto against the two backends it chooses between, attnkit's ``sdpa`` (torch's fused kernel) and
``chunked`` (the native kernel), side by side; "auto / best" is auto's time over the faster of the
two, and "picks" what auto chose and, from ``explain()``, why it avoided the other. ``--dtype
bfloat16`` does the same in bfloat16.

    python benchmarks/bench_backends.py --inference --json docs/benchmarks/data/auto.json
    python benchmarks/bench_backends.py --inference --dtype bfloat16
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit
from attnkit.cli.measure import extra_peak_memory, time_side_by_side

import results

B, H, D = 1, 8, 64
# (label, causal); the naive and reference paths hold two T x T float32 matrices per head.
CANDIDATES = [
    ("torch sdpa", False),
    ("naive", False),
    ("auto", False),
    ("sdpa", False),
    ("chunked", False),
    ("reference", False),
    ("torch sdpa", True),
    ("auto", True),
    ("chunked", True),
]
NAIVE_MAX_T = 8192  # beyond this the naive/reference score matrices need > 16 GiB


def build(
    label: str, causal: bool, t: int, dtype: torch.dtype = torch.float32
) -> tuple[Callable[[], torch.Tensor], int]:
    """Inputs and a no-grad call for one candidate; module-level so a child process can run it."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, t, D).to(dtype) for _ in range(3))
    scale = 1 / math.sqrt(D)

    def naive() -> torch.Tensor:
        s = q @ k.transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(~attnkit.masks.causal_mask(t), float("-inf"))
        return torch.softmax(s, -1) @ v

    def torch_sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def ours() -> torch.Tensor:
        return attnkit.attention(q, k, v, causal=causal, backend=label)

    fn = {"naive": naive, "torch sdpa": torch_sdpa}.get(label, ours)

    def call() -> torch.Tensor:
        with torch.inference_mode():
            return fn()

    return call, q.numel() * q.element_size()


def runnable(label: str, t: int) -> bool:
    return label not in ("naive", "reference") or t <= NAIVE_MAX_T


INFERENCE = ["auto", "sdpa", "chunked"]


def _auto_pick(t: int, causal: bool, dtype: torch.dtype) -> tuple[str, str]:
    """The backend auto picks for the shape, and explain()'s line on the one it avoided."""
    q = torch.zeros(B, H, t, D, dtype=dtype)
    with torch.inference_mode():
        report = attnkit.explain(q, q, q, causal=causal)
    other = "sdpa" if report.chosen == "chunked" else "chunked"
    why = report.costs.get(other, []) + report.slower.get(other, [])
    return str(report.chosen), "; ".join(why) or "comes later in the order"


def inference(
    lengths: list[int], rounds: int, min_run_time: float, dtype: torch.dtype
) -> list[dict[str, object]]:
    """auto against sdpa and chunked under inference_mode, each shape side by side."""
    print("\n| T | causal | auto ms | sdpa ms | chunked ms | auto / best | picks |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | --- |")
    rows: list[dict[str, object]] = []
    for t in lengths:
        for causal in (False, True):
            fns = {lab: build(lab, causal, t, dtype)[0] for lab in INFERENCE}
            times = time_side_by_side(fns, rounds=rounds, min_run_time=min_run_time)
            best = min(times["sdpa"], times["chunked"])
            chosen, why = _auto_pick(t, causal, dtype)
            print(
                f"| {t} | {'yes' if causal else 'no'} | {times['auto'] * 1e3:.2f} | "
                f"{times['sdpa'] * 1e3:.2f} | {times['chunked'] * 1e3:.2f} | "
                f"{times['auto'] / best:.2f} | {chosen} |",
                flush=True,
            )
            rows.append(
                {"T": t, "causal": causal, **{f"{lab}_s": times[lab] for lab in INFERENCE},
                 "auto_over_best": times["auto"] / best, "chosen": chosen, "avoided_why": why}
            )  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[256, 1024, 4096, 8192, 16384])
    parser.add_argument("--quick", action="store_true", help="T = 256, 1024, 4096; fewer rounds")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory measurements")
    parser.add_argument(
        "--inference", action="store_true", help="auto against sdpa and chunked (auto's choice)"
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="with --inference: the inputs' dtype",
    )
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    lengths = [256, 1024, 4096] if args.quick else args.lengths
    rounds = 2 if args.quick else 3
    if args.inference:
        dtype = getattr(torch, args.dtype)
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, B={B} H={H} D={D} "
            f"{args.dtype}"
        )
        rows = inference(lengths, rounds, 0.3 if args.quick else 1.0, dtype)
        if args.json:
            config = {"B": B, "H": H, "D": D, "dtype": args.dtype, "rounds": rounds}
            results.save(args.json, "auto_inference", rows, config=config | {"pass": "inference"})
        return

    rows = []
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, B={B} H={H} D={D} float32"
    )
    print("\n| T | candidate | ms | ratio to torch sdpa | extra MiB | % of one TxT f32 |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for t in lengths:
        for causal in (False, True):
            labels = [lab for lab, c in CANDIDATES if c == causal and runnable(lab, t)]
            fns = {lab: build(lab, causal, t)[0] for lab in labels}
            times = time_side_by_side(fns, rounds=rounds, min_run_time=0.3 if args.quick else 1.0)
            base = times["torch sdpa"]
            for lab in labels:
                mem = None if args.no_memory else extra_peak_memory(build, lab, causal, t)
                name = lab + (" causal" if causal else "")
                pct = "" if mem is None else f"{100 * mem / (4 * t * t):.1f}"
                mib = "" if mem is None else f"{mem / 2**20:.1f}"
                print(
                    f"| {t} | {name} | {times[lab] * 1e3:.2f} | {times[lab] / base:.2f} | {mib} "
                    f"| {pct} |",
                    flush=True,
                )
                rows.append(
                    {
                        "T": t,
                        "candidate": name,
                        "backend": lab,
                        "causal": causal,
                        "seconds": times[lab],
                        "ratio": times[lab] / base,
                        "extra_bytes": mem,
                    }
                )
    if args.json:
        config = {"B": B, "H": H, "D": D, "dtype": "float32", "pass": "inference", "rounds": rounds}
        results.save(args.json, "backends", rows, config=config)


if __name__ == "__main__":
    main()
