"""What the non-finite policy costs: attnkit with its checks against attnkit without them.

The policy's per-call work on torch's SDPA is one look at the output (three small reductions:
NaN/inf, or a row of zeros no mask explains, send the call to attnkit's kernel), and for calls that
need gradients a sum over q, k and v. This script times the same calls with those checks switched
off (by replacing them in this process only), side by side:

* MultiHeadAttention(512, 8), B=4 T=1024, inference;
* MultiHeadAttention(512, 8), B=4 T=1024, a training step (forward + backward);
* one decode call: attention() with one query against 4096 keys, B=1 H=8 D=64.

    python benchmarks/bench_policy.py [--json docs/benchmarks/data/policy.json]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import platform
from collections.abc import Callable, Iterator

import torch

import attnkit
from attnkit.backends import sdpa as sdpa_module
from attnkit.cli.measure import time_side_by_side

import results

# The module (attnkit.attention is also the name of the function).
attention_module = importlib.import_module("attnkit.attention")


@contextlib.contextmanager
def checks_off() -> Iterator[None]:
    """attnkit with the policy's checks replaced by "everything is fine"."""
    saved = sdpa_module._trustworthy, attention_module.finite
    sdpa_module._trustworthy = lambda *a, **k: True  # type: ignore[assignment]
    attention_module.finite = lambda *a: True  # type: ignore[assignment]
    try:
        yield
    finally:
        sdpa_module._trustworthy, attention_module.finite = saved


def toggled(fn: Callable[[], object], off: bool) -> Callable[[], object]:
    def call() -> object:
        with checks_off() if off else contextlib.nullcontext():
            return fn()

    return call


def cases() -> dict[str, Callable[[], object]]:
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(512, 8).eval()
    x = torch.randn(4, 1024, 512)
    train = attnkit.MultiHeadAttention(512, 8).train()
    xt = torch.randn(4, 1024, 512)
    q = torch.randn(1, 8, 1, 64)
    k, v = torch.randn(1, 8, 4096, 64), torch.randn(1, 8, 4096, 64)

    def infer() -> object:
        with torch.inference_mode():
            return mha(x)

    def step() -> object:
        train(xt).sum().backward()
        return None

    def decode() -> object:
        with torch.inference_mode():
            return attnkit.attention(q, k, v)

    return {"MultiHeadAttention inference": infer, "MultiHeadAttention training": step,
            "decode call": decode}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    print("\n| call | with checks | without | difference | ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    rows = []
    for name, fn in cases().items():
        fns = {"on": toggled(fn, False), "off": toggled(fn, True)}
        times = time_side_by_side(fns, rounds=args.rounds, min_run_time=1.0)
        diff = times["on"] - times["off"]
        unit, scale = ("us", 1e6) if name == "decode call" else ("ms", 1e3)
        print(
            f"| {name} | {times['on'] * scale:.1f} {unit} | {times['off'] * scale:.1f} {unit} | "
            f"{diff * scale:+.1f} {unit} | {times['on'] / times['off']:.3f} |",
            flush=True,
        )
        rows.append({"call": name, "with": times["on"], "without": times["off"]})
    if args.json:
        results.save(args.json, "policy", rows, config={"threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
