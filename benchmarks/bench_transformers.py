"""A Llama-shaped transformers model run with eager, sdpa and attnkit attention: time and memory.

The model: transformers' ``LlamaForCausalLM`` from a config, 4 layers, hidden size 512, 8 query
heads and 2 key/value heads of 64 (grouped-query attention), MLP 1408, vocabulary 256, random
weights, float32, a forward under ``torch.inference_mode()`` of one sequence of T tokens.
"padding": its first T/4 tokens are left padding, as in the shorter rows of a batched prefill;
then transformers builds a mask, which eager and sdpa get as a dense ``(B, 1, T, T)`` tensor and
attnkit as key padding plus causal. Without padding sdpa gets no mask at all (torch's
``is_causal``).

* ``ms``: medians of interleaved torch.utils.benchmark rounds
  (:func:`attnkit.cli.measure.time_side_by_side`), per forward.
* ``extra MiB``: the peak resident memory one forward adds beyond the model, its inputs and the
  logits, measured in a fresh process (:func:`attnkit.cli.measure.extra_peak_memory`).

Then the memory check at T=16384 with padding: attnkit's extra peak must be at most half of
sdpa's (eager is not run there: its ``(B, H, T, T)`` float32 scores alone are 16 GiB).

    python benchmarks/bench_transformers.py                 # T=1024 and 8192, then T=16384
    python benchmarks/bench_transformers.py --t 1024 --check 0   # chosen lengths, no check
    python benchmarks/bench_transformers.py --json out.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from attnkit.cli.measure import extra_peak_memory, time_side_by_side
from attnkit.integrations.transformers import register

import results

B, LAYERS, HIDDEN, HEADS, KV_HEADS, MLP, VOCAB = 1, 4, 512, 8, 2, 1408, 256
IMPLEMENTATIONS = ["eager", "sdpa", "attnkit"]


def build(impl: str, t: int, padding: bool) -> tuple[Callable[[], Any], int]:
    """One forward of the model with attention ``impl`` on a fresh batch of length ``t``.

    Module-level, so that a child process can run it. Returns the call and its result's size.
    """
    register()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=t,
    )
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation(impl)
    ids = torch.randint(0, VOCAB, (B, t))
    mask = torch.ones(B, t, dtype=torch.long)
    if padding:
        mask[:, : t // 4] = 0

    def forward() -> torch.Tensor:
        with torch.inference_mode():
            logits: torch.Tensor = model(input_ids=ids, attention_mask=mask).logits
        return logits

    return forward, B * t * VOCAB * 4


def case(t: int, padding: bool, rounds: int, min_run_time: float) -> list[dict[str, Any]]:
    fns = {impl: build(impl, t, padding)[0] for impl in IMPLEMENTATIONS}
    times = time_side_by_side(fns, rounds=rounds, min_run_time=min_run_time)
    del fns
    rows = []
    for impl in IMPLEMENTATIONS:
        extra = extra_peak_memory(build, impl, t, padding)
        rows.append(
            {"T": t, "padding": padding, "impl": impl, "seconds": times[impl], "extra_bytes": extra}
        )
        mib = "" if extra is None else f"{extra / 2**20:.0f}"
        ratio = times[impl] / times["sdpa"]
        pad = "yes" if padding else "no"
        print(
            f"| {t} | {pad} | {impl} | {times[impl] * 1e3:.0f} | {ratio:.2f} | {mib} |", flush=True
        )
    return rows


def memory_check(t: int) -> list[dict[str, Any]]:
    rows = []
    for impl in ["sdpa", "attnkit"]:
        extra = extra_peak_memory(build, impl, t, True)
        rows.append({"T": t, "padding": True, "impl": impl, "extra_bytes": extra})
    sdpa, ours = (r["extra_bytes"] for r in rows)
    if sdpa is None or ours is None:
        print("extra peak memory cannot be measured on this system")
        return rows
    print(
        f"\nT={t}, padding: extra peak MiB sdpa {sdpa / 2**20:.0f}, attnkit {ours / 2**20:.0f} "
        f"({ours / sdpa:.2f}x sdpa)"
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t", type=int, action="append", help="table lengths (default 1024, 8192)")
    parser.add_argument("--check", type=int, default=16384, help="memory check length (0: none)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds at T <= 2048")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    lengths = args.t or [1024, 8192]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, B={B}\n")
    print("| T | padding | attention | ms | / sdpa | extra MiB |")
    print("| ---: | --- | --- | ---: | ---: | ---: |")
    rows = []
    for t in lengths:
        long = t > 2048  # one forward takes seconds: one timed call per round
        for padding in (False, True):
            rows += case(t, padding, 1 if long else args.rounds, 0.0 if long else 1.0)
    if args.check:
        rows += memory_check(args.check)
    if args.json:
        config = {"B": B, "layers": LAYERS, "hidden": HIDDEN, "H": HEADS, "Hkv": KV_HEADS}
        config |= {"dtype": "float32", "transformers": transformers.__version__}
        results.save(args.json, "transformers", rows, config=config)


if __name__ == "__main__":
    main()
