"""What the non-finite policy costs: attnkit with its checks against attnkit without them.

The policy's per-call work on torch's SDPA is one look at the output (a matrix-vector product that
shows NaN/inf and rows of zeros; a suspicious output goes to an exact test and, if it fails, to
attnkit's kernel), and for calls that need gradients a sum over q, k and v. This script measures it
two ways:

* the calls with the checks and with them switched off (replaced in this process only), timed in
  many short rounds whose order alternates (on, off, off, on, ...); the ratio is the median of the
  rounds' ratios, which follows the machine's slow drifts less than two long runs would;
* the checks alone, timed on the very tensors those calls produce and read.

The calls:

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
import statistics
from collections.abc import Callable, Iterator

import torch
from torch.utils import benchmark

import attnkit
from attnkit._base.finite import finite
from attnkit.backends.sdpa import screen

import results

# The module (attnkit.attention is also the name of the function).
attention_module = importlib.import_module("attnkit.attention")


@contextlib.contextmanager
def checks_off() -> Iterator[None]:
    """attnkit with the policy's checks replaced by "everything is fine"."""
    saved = screen.trustworthy, attention_module.finite
    screen.trustworthy = lambda *a, **k: True  # type: ignore[assignment]
    attention_module.finite = lambda *a: True  # type: ignore[assignment]
    try:
        yield
    finally:
        screen.trustworthy, attention_module.finite = saved


def toggled(fn: Callable[[], object], off: bool) -> Callable[[], object]:
    def call() -> object:
        with checks_off() if off else contextlib.nullcontext():
            return fn()

    return call


def _median_time(fn: Callable[[], object], min_run_time: float) -> float:
    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def paired(
    on: Callable[[], object], off: Callable[[], object], rounds: int, min_run_time: float
) -> tuple[float, float, float]:
    """Median seconds of ``on`` and ``off`` and the median of the rounds' ratios on / off."""
    on(), off()  # warm-up
    ons, offs, ratios = [], [], []
    for i in range(rounds):
        if i % 2:
            b, a = _median_time(off, min_run_time), _median_time(on, min_run_time)
        else:
            a, b = _median_time(on, min_run_time), _median_time(off, min_run_time)
        ons.append(a)
        offs.append(b)
        ratios.append(a / b)
    return statistics.median(ons), statistics.median(offs), statistics.median(ratios)


def cases() -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """Per case: the call, and the policy's own work on the tensors that call produces/reads."""
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(512, 8).eval()
    x = torch.randn(4, 1024, 512)
    train = attnkit.MultiHeadAttention(512, 8).train()
    xt = torch.randn(4, 1024, 512)
    q = torch.randn(1, 8, 1, 64)
    k, v = torch.randn(1, 8, 4096, 64), torch.randn(1, 8, 4096, 64)
    # The output torch's SDPA gives the module: (B, H, T, D) over a (B, T, H, D) buffer.
    heads = torch.randn(4, 1024, 8, 64).transpose(1, 2)
    with torch.inference_mode():
        decoded = torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def infer() -> object:
        with torch.inference_mode():
            return mha(x)

    def step() -> object:
        train(xt).sum().backward()
        return None

    def decode() -> object:
        with torch.inference_mode():
            return attnkit.attention(q, k, v)

    # The checks alone, as the backend calls them: main() times the inference ones inside
    # inference_mode, as the calls run (entering it is the caller's cost, not the check's).
    def check_infer() -> object:
        return screen.trustworthy(heads, None)

    def check_step() -> object:
        return finite(heads, heads, heads)

    def check_decode() -> object:
        return screen.trustworthy(decoded, None)

    return {
        "MultiHeadAttention inference": (infer, check_infer),
        "MultiHeadAttention training": (step, check_step),
        "decode call": (decode, check_decode),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="alternating rounds per call")
    parser.add_argument("--json")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    print("\n| call | with checks | without | ratio (median of rounds) | the checks alone |")
    print("| --- | ---: | ---: | ---: | ---: |")
    rows = []
    for name, (fn, check) in cases().items():
        decode = name == "decode call"
        on, off, ratio = paired(
            toggled(fn, False), toggled(fn, True), args.rounds, 0.1 if decode else 0.5
        )
        with torch.inference_mode() if "training" not in name else contextlib.nullcontext():
            alone = _median_time(check, 0.5)
        unit, scale = ("us", 1e6) if decode else ("ms", 1e3)
        print(
            f"| {name} | {on * scale:.1f} {unit} | {off * scale:.1f} {unit} | {ratio:.3f} | "
            f"{alone * 1e6:.1f} us |",
            flush=True,
        )
        rows.append(
            {"call": name, "with": on, "without": off, "ratio": ratio, "check_alone": alone}
        )
    if args.json:
        config = {"threads": torch.get_num_threads(), "rounds": args.rounds}
        results.save(args.json, "policy", rows, config=config)


if __name__ == "__main__":
    main()
