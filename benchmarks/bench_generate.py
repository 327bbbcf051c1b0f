"""Greedy generation with a Llama-shaped transformers model: attnkit against torch SDPA.

The model: transformers' ``LlamaForCausalLM`` from a config with random weights, 12 layers, hidden
size 768, 12 query heads and 4 key/value heads of 64 (grouped-query attention), MLP 2048,
vocabulary 16000: 100M parameters. The workload: a batch of 4 prompts of 2048 random tokens, then
``model.generate(..., max_new_tokens=256, min_new_tokens=256, do_sample=False)`` (greedy) with
transformers' default cache, a ``DynamicCache`` that grows by one token per step. One model per
dtype serves both implementations (``set_attn_implementation``), so they run the same weights.

What is measured, per dtype and implementation, in interleaved rounds (one call of each
implementation per round, timed by ``time.perf_counter``: ``torch.utils.benchmark``'s Timer would
run each call of tens of seconds twice more as its warm-up; medians over the rounds):

* ``prefill``: the prompt's forward alone, with a fresh cache and the last position's logits,
  as ``generate`` runs it first; prefill tokens/s = batch * prompt / time.
* ``generate``: the whole ``generate`` call; its decode time runs from the first new token (which
  the prefill gives) to the end, as a streamer passed to ``generate`` sees the tokens come, so
  prefill and decode are told apart within one call; decode tokens/s = batch * (new - 1) / decode
  time.
* the share of each in attention: every attention call is timed by a wrapper around the
  implementation's attention function (the mask functions and the rest of the layer not
  included), prefill calls (more than one query) and decode calls apart.
* agreement: the greedy tokens of attnkit and sdpa, the first step where a row differs, the
  largest logit difference before it, and at that step the margin between the two choices in
  each run (a near tie, when it is small).

    python benchmarks/bench_generate.py                    # float32 and bfloat16, full size
    python benchmarks/bench_generate.py --quick            # a small run of about a minute
    python benchmarks/bench_generate.py --dtype float32 --json docs/benchmarks/data/generate.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from attnkit.integrations.transformers import register

import results

LAYERS, HIDDEN, HEADS, KV_HEADS, MLP, VOCAB = 12, 768, 12, 4, 2048, 16000
IMPLEMENTATIONS = ["sdpa", "attnkit"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(dtype: torch.dtype, length: int) -> LlamaForCausalLM:
    """The model in ``dtype``, the same weights every time."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=length,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    return model


class AttentionClock:
    """Seconds spent in each implementation's attention function, prefill and decode calls apart."""

    def __init__(self) -> None:
        self.prefill = 0.0
        self.decode = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(module, query, *args, **kwargs)
            spent = time.perf_counter() - start
            if query.size(-2) > 1:
                self.prefill += spent
            else:
                self.decode += spent
            return out

        return timed

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Every implementation of ``IMPLEMENTATIONS`` timed, for the duration."""
        for impl in IMPLEMENTATIONS:
            ALL_ATTENTION_FUNCTIONS[impl] = self.wrap(ALL_ATTENTION_FUNCTIONS[impl])
        try:
            yield
        finally:
            for impl in IMPLEMENTATIONS:
                del ALL_ATTENTION_FUNCTIONS[impl]  # the instance's entry; the global one stays

    def take(self) -> tuple[float, float]:
        out = (self.prefill, self.decode)
        self.prefill = self.decode = 0.0
        return out


class TokenClock:
    """A ``generate`` streamer that notes when each step's tokens come (the prompt's first)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, tokens: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        self.times.append(time.perf_counter())

    def decode_seconds(self) -> float:
        """From the first new token to the end of the call."""
        return self.times[-1] - self.times[1]


def _timeit(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _agreement(
    tokens: dict[str, torch.Tensor], scores: dict[str, tuple[torch.Tensor, ...]]
) -> dict[str, Any]:
    """Where attnkit's greedy tokens first differ from sdpa's, and the raw logits around it (the
    logits before ``min_new_tokens`` sets the end token's to -inf)."""
    ours, theirs = tokens["attnkit"], tokens["sdpa"]
    differ = (ours != theirs).any(0).nonzero().flatten()
    step = int(differ[0]) if differ.numel() else None
    agreed = len(scores["sdpa"]) if step is None else step + 1  # same prefix through `step`
    gap = max(
        float((scores["attnkit"][i].float() - scores["sdpa"][i].float()).abs().max())
        for i in range(agreed)
    )
    out: dict[str, Any] = {"first_divergence": step, "max_logit_diff": gap, "margins": None}
    if step is not None:
        row = int((ours[:, step] != theirs[:, step]).nonzero()[0])
        a, b = int(ours[row, step]), int(theirs[row, step])
        # each run's preference between the two tokens at the step: small = a near tie
        out["margins"] = {
            impl: float(scores[impl][step][row, a] - scores[impl][step][row, b])
            for impl in IMPLEMENTATIONS
        }
        out["row"] = row
    return out


def run_dtype(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    dtype = DTYPES[name]
    model = build_model(dtype, args.prompt + args.new)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (args.batch, args.prompt), generator=g)
    mask = torch.ones_like(ids)
    clock = AttentionClock()

    def prefill(impl: str, tokens: int = args.prompt) -> Callable[[], object]:
        def fn() -> object:
            model.set_attn_implementation(impl)
            with torch.inference_mode():
                return model(
                    input_ids=ids[:, :tokens], attention_mask=mask[:, :tokens], use_cache=True,
                    logits_to_keep=1,
                )  # fmt: skip

        return fn

    outputs: dict[str, Any] = {}
    decode: dict[str, list[float]] = {impl: [] for impl in IMPLEMENTATIONS}

    def generate(impl: str) -> Callable[[], object]:
        def fn() -> object:
            model.set_attn_implementation(impl)
            tokens = TokenClock()
            with torch.inference_mode():
                outputs[impl] = model.generate(
                    streamer=tokens,
                    input_ids=ids, attention_mask=mask, max_new_tokens=args.new,
                    min_new_tokens=args.new, do_sample=False, output_logits=True,
                    return_dict_in_generate=True,
                )  # fmt: skip
            decode[impl].append(tokens.decode_seconds())
            return outputs[impl]

        return fn

    times: dict[tuple[str, str], list[float]] = {}
    attn: dict[tuple[str, str], list[float]] = {}
    with clock.installed():
        for impl in IMPLEMENTATIONS:  # warm-up: first-call costs (kernel loads, dispatch)
            prefill(impl, min(args.prompt, 64))()
        clock.take()
        for _ in range(args.rounds):
            for what, make in (("prefill", prefill), ("generate", generate)):
                for impl in IMPLEMENTATIONS:
                    times.setdefault((what, impl), []).append(_timeit(make(impl)))
                    pre, dec = clock.take()
                    attn.setdefault((what, impl), []).append(pre + dec)
                    attn.setdefault((what + " decode", impl), []).append(dec)
    check = _agreement(
        {impl: outputs[impl].sequences[:, args.prompt :] for impl in IMPLEMENTATIONS},
        {impl: outputs[impl].logits for impl in IMPLEMENTATIONS},
    )
    rows = []
    med = {key: statistics.median(v) for key, v in times.items()}
    attn_med = {key: statistics.median(v) for key, v in attn.items()}
    for impl in IMPLEMENTATIONS:
        pre, gen = med["prefill", impl], med["generate", impl]
        dec = statistics.median(decode[impl])
        rows.append(
            {
                "dtype": name,
                "impl": impl,
                "prefill_s": pre,
                "generate_s": gen,
                "decode_s": dec,
                "prefill_tok_s": args.batch * args.prompt / pre,
                "decode_tok_s": args.batch * (args.new - 1) / dec,
                "generate_tok_s": args.batch * args.new / gen,
                "prefill_attention_share": attn_med["prefill", impl] / pre,
                "decode_attention_share": attn_med["generate decode", impl] / dec,
                "generate_attention_share": attn_med["generate", impl] / gen,
                "rounds": args.rounds,
            }
        )
    rows[-1] |= {"agreement": check}
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    base = {r["dtype"]: r for r in rows if r["impl"] == "sdpa"}
    for r in rows:
        b = base[r["dtype"]]
        print(
            f"| {r['dtype']} | {r['impl']} | {r['prefill_tok_s']:.0f} | "
            f"{r['prefill_tok_s'] / b['prefill_tok_s']:.2f} | {r['decode_tok_s']:.1f} | "
            f"{r['decode_tok_s'] / b['decode_tok_s']:.2f} | {r['generate_tok_s']:.1f} | "
            f"{r['generate_tok_s'] / b['generate_tok_s']:.2f} | "
            f"{100 * r['prefill_attention_share']:.0f}% | "
            f"{100 * r['decode_attention_share']:.0f}% |",
            flush=True,
        )
        if "agreement" in r:
            a = r["agreement"]
            if a["first_divergence"] is None:
                print(
                    f"  {r['dtype']}: identical greedy tokens; largest logit difference "
                    f"{a['max_logit_diff']:.2e}"
                )
            else:
                print(
                    f"  {r['dtype']}: tokens first differ at step {a['first_divergence']} (row "
                    f"{a['row']}); largest logit difference until then {a['max_logit_diff']:.2e}; "
                    f"margin between the two tokens: {a['margins']}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--new", type=int, default=256, help="generated tokens")
    parser.add_argument("--dtype", choices=list(DTYPES), action="append", help="default: both")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument(
        "--quick", action="store_true", help="batch 2, prompt 256, 32 new tokens, float32, 1 round"
    )
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.prompt, args.new, args.rounds = 2, 256, 32, 1
        args.dtype = args.dtype or ["float32"]
    dtypes = args.dtype or list(DTYPES)
    register()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads; B={args.batch}, prompt {args.prompt}, "
        f"{args.new} new tokens, DynamicCache\n"
    )
    print(
        "| dtype | attention | prefill tok/s | / sdpa | decode tok/s | / sdpa | generate tok/s "
        "| / sdpa | prefill in attention | decode in attention |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows: list[dict[str, Any]] = []
    for name in dtypes:
        mine = run_dtype(name, args)
        _print(mine)
        rows += mine
    if args.json:
        config = {
            "B": args.batch, "prompt": args.prompt, "new": args.new, "layers": LAYERS,
            "hidden": HIDDEN, "H": HEADS, "Hkv": KV_HEADS, "D": HIDDEN // HEADS, "mlp": MLP,
            "vocab": VOCAB, "cache": "DynamicCache", "transformers": transformers.__version__,
        }  # fmt: skip
        results.save(args.json, "generate", rows, config=config)


if __name__ == "__main__":
    main()
