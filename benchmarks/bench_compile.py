"""torch.compile against eager: a sliding-window call's time and extra memory, forward and
forward + backward, at T = 8192 .. 65536.

``attention(q, k, v, mask=masks.sliding_window(256))``, B=1 H=4 D=64, float32. Compiled with
``torch.compile(fullgraph=True)``, the call is one node of attnkit's operator
(``torch.ops.attnkit.attention``), which runs the same kernel in the same O(T) memory as eager;
"ratio" is compiled / eager in the same run. "extra MiB" is the peak resident memory a call adds
beyond its inputs and output, measured in a fresh process (its warm-up call compiles).

With ``--training``: a training step instead, ``MultiHeadAttention(512, 8)`` at B=4 T=1024 with
``causal() & key_padding(lengths)``, the lengths a tensor as a data loader hands them, forward and
backward, eager against ``torch.compile(fullgraph=True)``, beside torch's
``nn.MultiheadAttention`` with the same mask (its causal ``attn_mask`` and ``key_padding_mask``)
eager and compiled: all four in one interleaved run.

    python benchmarks/bench_compile.py
    python benchmarks/bench_compile.py --lengths 8192 32768 --json docs/benchmarks/data/compile.json
    python benchmarks/bench_compile.py --training --json docs/benchmarks/data/compile_training.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import attnkit
from attnkit import masks
from attnkit.cli.measure import extra_peak_memory, time_side_by_side

import results

B, H, D, WINDOW = 1, 4, 64, 256


def _qkv(t: int, grad: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return [torch.randn(B, H, t, D, generator=g).requires_grad_(grad) for _ in range(3)]


def _call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return attnkit.attention(q, k, v, mask=masks.sliding_window(WINDOW))


def build(t: int, compiled: bool, backward: bool) -> tuple[Callable[[], object], int]:
    """The measured call and its result's bytes (module level: the memory child imports it)."""
    torch._dynamo.reset()
    q, k, v = _qkv(t, backward)
    fn = torch.compile(_call, fullgraph=True) if compiled else _call
    if not backward:

        def forward() -> object:
            with torch.no_grad():
                return fn(q, k, v)

        return forward, q.numel() * 4

    def step() -> object:
        out = fn(q, k, v)
        out.sum().backward()
        for x in (q, k, v):
            x.grad = None
        return None

    return step, 0


def training_steps() -> dict[str, Callable[[], object]]:
    """The four training steps of ``--training``, each forward, backward and gradients cleared."""
    b, t, d, h = 4, 1024, 512, 8
    torch.manual_seed(0)
    x = torch.randn(b, t, d)
    lengths = torch.tensor([1024, 900, 700, 1000])
    ours = attnkit.MultiHeadAttention(d, h)
    theirs = torch.nn.MultiheadAttention(d, h, batch_first=True)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)  # torch's convention: True = masked

    def loss_ours(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return ours(x, mask=masks.causal() & masks.key_padding(lengths)).square().mean()

    def loss_theirs(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        pad = torch.arange(t) >= lengths[:, None]
        out = theirs(x, x, x, attn_mask=future, key_padding_mask=pad, need_weights=False)[0]
        return out.square().mean()

    def step(loss: Callable[..., torch.Tensor], module: torch.nn.Module) -> Callable[[], object]:
        def run() -> object:
            loss(x, lengths).backward()
            for p in module.parameters():
                p.grad = None
            return None

        return run

    return {
        "attnkit eager": step(loss_ours, ours),
        "attnkit compiled": step(torch.compile(loss_ours, fullgraph=True), ours),
        "torch eager": step(loss_theirs, theirs),
        "torch compiled": step(torch.compile(loss_theirs, fullgraph=True), theirs),
    }


def training(rounds: int, json_path: str | None) -> None:
    times = time_side_by_side(training_steps(), rounds=rounds)
    for name, sec in times.items():
        print(f"{name:<18} {1e3 * sec:>9.1f} ms")
    rows = [
        {"module": who, "eager_s": times[f"{who} eager"], "compiled_s": times[f"{who} compiled"],
         "time_ratio": times[f"{who} compiled"] / times[f"{who} eager"]}
        for who in ("attnkit", "torch")
    ]  # fmt: skip
    for row in rows:
        print(f"{row['module']}: compiled / eager = {row['time_ratio']:.2f}")
    if json_path:
        config = {"B": 4, "T": 1024, "d_model": 512, "H": 8, "mask": "causal & key_padding"}
        results.save(json_path, "compile_training", rows, config=config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="times only")
    parser.add_argument("--json", help="write the rows to this file (see results.py)")
    parser.add_argument("--training", action="store_true", help="a training step (see above)")
    args = parser.parse_args()
    if args.training:
        training(args.rounds, args.json)
        return
    rows = []
    print(f"{'T':>6} {'pass':<18} {'eager ms':>9} {'compiled ms':>12} {'ratio':>6} "
          f"{'eager MiB':>10} {'compiled MiB':>13} {'ratio':>6}")  # fmt: skip
    for t in args.lengths:
        for backward in (False, True):
            fns = {c: build(t, c, backward)[0] for c in (False, True)}
            times = time_side_by_side(
                {"eager": fns[False], "compiled": fns[True]}, rounds=args.rounds
            )
            mem = {c: None if args.no_memory else extra_peak_memory(build, t, c, backward)
                   for c in (False, True)}  # fmt: skip
            name = "forward+backward" if backward else "forward"
            row = {
                "T": t,
                "pass": name,
                "eager_s": times["eager"],
                "compiled_s": times["compiled"],
                "time_ratio": times["compiled"] / times["eager"],
                "eager_bytes": mem[False],
                "compiled_bytes": mem[True],
            }
            rows.append(row)
            mib = {c: "-" if m is None else f"{m / 2**20:.0f}" for c, m in mem.items()}
            mem_ratio = (
                f"{mem[True] / max(mem[False], 1):.2f}"
                if mem[True] is not None and mem[False] is not None
                else "-"
            )
            print(f"{t:>6} {name:<18} {1e3 * times['eager']:>9.1f} "
                  f"{1e3 * times['compiled']:>12.1f} {row['time_ratio']:>6.2f} {mib[False]:>10} "
                  f"{mib[True]:>13} {mem_ratio:>6}", flush=True)  # fmt: skip
    if args.json:
        config = {"B": B, "H": H, "D": D, "window": WINDOW, "dtype": "float32"}
        results.save(args.json, "compile", rows, config=config)


if __name__ == "__main__":
    main()
