"""attnkit.flex with a score_mod against the same call through attention()'s own arguments.

A softcap as a score_mod (``c * tanh(s / c)``) against ``attention(softcap=c)``, and an additive
relative bias as a score_mod (``s + table[q_idx - kv_idx]``) against ``attention(bias=...)`` with
that bias written out as a (T, T) tensor (``auto`` takes torch's SDPA for it; the chunked
kernel's figure is there too). B=1, H=8, D=64, float32 on the CPU, no mask; forward
(no grad) and forward+backward. Times are medians of interleaved torch.utils.benchmark rounds;
"ratio" is flex's time over attention()'s. ``--memory`` also measures the extra peak memory of
flex's forward+backward in a fresh process.

    python benchmarks/bench_flex.py              # T = 4096
    python benchmarks/bench_flex.py --t 1024 --memory
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import Tensor

import attnkit
from attnkit.cli.measure import extra_peak_memory, time_side_by_side
from attnkit.flex import flex_attention

B, H, D = 1, 8, 64
CAP = 20.0


def _inputs(t: int, grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, t, D, requires_grad=grad) for _ in range(3))
    table = torch.randn(2 * t) * 0.1
    return q, k, v, table


def calls(t: int, grad: bool) -> dict[str, Callable[[], object]]:
    """The four calls at length ``t``, forward only or forward+backward."""
    q, k, v, table = _inputs(t, grad)
    pos = torch.arange(t)
    dense = table[pos[:, None] - pos[None, :] + t]  # (T, T)

    def capped(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return CAP * torch.tanh(s / CAP)

    def relative(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return s + table[qi - kv + t]

    def run(fn: Callable[[], Tensor]) -> Callable[[], object]:
        def go() -> object:
            if not grad:
                with torch.no_grad():
                    return fn()
            out = fn()
            out.sum().backward()
            return out

        return go

    return {
        "softcap: attention(softcap=)": run(lambda: attnkit.attention(q, k, v, softcap=CAP)),
        "softcap: flex score_mod": run(lambda: flex_attention(q, k, v, capped)),  # type: ignore[arg-type,return-value]
        "bias: attention(bias=)": run(lambda: attnkit.attention(q, k, v, bias=dense)),
        "bias: chunked(bias=)": run(
            lambda: attnkit.attention(q, k, v, bias=dense, backend="chunked")
        ),
        "bias: flex score_mod": run(lambda: flex_attention(q, k, v, relative)),  # type: ignore[arg-type,return-value]
    }


def _make_flex_train(t: int) -> tuple[Callable[[], object], int]:
    fns = calls(t, grad=True)
    return fns["softcap: flex score_mod"], 4 * B * H * t * D * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory", action="store_true")
    args = parser.parse_args()
    print(f"B={B} H={H} T={args.t} D={D} float32, {torch.get_num_threads()} threads")
    for grad in (False, True):
        times = time_side_by_side(calls(args.t, grad), rounds=args.rounds, min_run_time=0.1)
        names = list(times)
        mode = "forward+backward" if grad else "forward"
        for base, flex in ((names[0], names[1]), (names[2], names[4]), (names[3], names[4])):
            ratio = times[flex] / times[base]
            print(
                f"{mode:<17} {base:<30} {times[base]:8.3f} s   {flex:<24} "
                f"{times[flex]:8.3f} s   ratio {ratio:.2f}"
            )
    if args.memory:
        extra = extra_peak_memory(_make_flex_train, args.t)
        if extra is not None:
            txt = args.t * args.t * H * 4
            print(
                f"flex softcap forward+backward: {extra / 2**20:.0f} MiB extra peak "
                f"({100 * extra / txt:.1f}% of one (H, T, T) float32 score matrix)"
            )


if __name__ == "__main__":
    main()
