"""The flex backend on the CPU: what the first compile of each kind of call costs, and a lowered
inference call against attnkit's own kernel, side by side in one run.

* first compile: the first ``attention(..., backend="flex")`` of each kind (a mask, or a mask with
  what the call adds to the scores), B=1, H=4, T=256, Dh=64, float32, in a fresh inductor cache
  (``--warm`` keeps the cache of earlier runs: what a second process pays), then the same call
  again;
* one call: a sliding window (left=256) at T=2048, B=1, H=8, Dh=64, float32, inference, through
  ``backend="flex"`` (torch's compiled FlexAttention, its BlockMask from attnkit's plan),
  ``backend="chunked"``, and torch's compiled FlexAttention written by hand for the same window
  (its BlockMask made once, outside the timing), timed with torch.utils.benchmark.

    python benchmarks/bench_flex_cpu.py
    python benchmarks/bench_flex_cpu.py --json flex_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

if "--warm" not in sys.argv:  # before torch reads it
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnkit-flex-bench-")

import torch
import torch.utils.benchmark as benchmark

import attnkit
from attnkit import masks
from attnkit.modules.positional import alibi_term


def _kinds(t: int, h: int) -> dict[str, dict[str, object]]:
    return {
        "causal": {"causal": True},
        "sliding window": {"mask": masks.sliding_window(64)},
        "documents & causal": {"mask": masks.documents([t // 2, t // 4, t // 4]) & masks.causal()},
        "key padding": {"mask": masks.key_padding([t - 10])},
        "softcap + ALiBi, causal": {
            "causal": True,
            "softcap": 30.0,
            "bias": alibi_term(attnkit.alibi_slopes(h), t, t),
        },
    }


def first_compiles() -> list[dict[str, object]]:
    h, t, d = 4, 256, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, t, d, generator=g) for _ in range(3))
    rows = []
    for name, kw in _kinds(t, h).items():
        times = []
        for _ in range(2):
            start = time.perf_counter()
            attnkit.attention(q, k, v, backend="flex", **kw)  # type: ignore[call-overload]
            times.append(time.perf_counter() - start)
        print(f"{name:<26} first call {times[0]:7.2f} s   second {times[1] * 1e3:8.2f} ms")
        rows.append({"kind": name, "first_seconds": times[0], "second_seconds": times[1]})
    return rows


def _by_hand(t: int) -> tuple[object, object]:
    """torch's compiled flex_attention and a BlockMask for the window, written by hand."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def window(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= 256)

    block_mask = create_block_mask(window, None, None, t, t, device="cpu")
    return torch.compile(flex_attention, dynamic=False), block_mask


def one_call(threads: int) -> dict[str, float]:
    h, t, d = 8, 2048, 64
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, t, d, generator=g) for _ in range(3))
    mask = masks.sliding_window(256)
    attnkit.attention(q, k, v, mask=mask, backend="flex")  # compiled here, not in the timing
    flex, block_mask = _by_hand(t)
    flex(q, k, v, block_mask=block_mask)  # type: ignore[operator]
    statements = {
        "flex": "attention(q, k, v, mask=mask, backend='flex')",
        "chunked": "attention(q, k, v, mask=mask, backend='chunked')",
        "torch flex by hand": "flex(q, k, v, block_mask=block_mask)",
    }
    names = {"attention": attnkit.attention, "flex": flex, "block_mask": block_mask}
    seconds = {}
    for name, statement in statements.items():
        timer = benchmark.Timer(
            statement,
            globals={**names, "q": q, "k": k, "v": v, "mask": mask},
            num_threads=threads,
            label="sliding_window(256), T=2048, H=8, Dh=64, float32, inference",
            sub_label=name,
        )
        m = timer.blocked_autorange(min_run_time=2.0)
        print(m)
        seconds[name] = m.median
    print(f"flex / chunked: {seconds['flex'] / seconds['chunked']:.2f}")
    print(f"flex / torch flex by hand: {seconds['flex'] / seconds['torch flex by hand']:.2f}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--warm", action="store_true", help="keep the inductor cache")
    parser.add_argument("--json", help="also write the results to this file as JSON")
    parser.add_argument("--no-compiles", action="store_true", help="time the one call only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with torch.no_grad():
        compiles = [] if args.no_compiles else first_compiles()
        call = one_call(args.threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"first_compiles": compiles, "sliding_window_T2048": call}, f, indent=1)


if __name__ == "__main__":
    main()
