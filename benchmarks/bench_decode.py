"""Decoding against a long KV cache: attnkit, torch SDPA and the memory floor, side by side.

B=8, H=32 query heads, Hkv=8 key/value heads, D=128, one query per row against a cache of 4096
tokens (256 MiB of keys and values in float32, 128 MiB in bfloat16 or float16), in each dtype of
``--dtype`` (float32 by default). Every candidate runs in interleaved rounds of
``torch.utils.benchmark``; the table gives each one's median over the rounds, its worst round,
and its ratios to the memory floor, to torch SDPA (or the contiguous cache) and to the same
candidate in float32, measured in the same run.

* floor: ``x.sum()`` over a float32 tensor of the keys' and values' bytes in that dtype: the time
  to read them once at the read bandwidth torch's own reduction reaches on the CPU it runs on.
* decode: ``attnkit.attention`` with the chunked backend (the native kernel's decode path) and
  with ``auto``, against ``F.scaled_dot_product_attention(..., enable_gqa=True)``; the cache laid
  out ``(B, Hkv, T, D)``.
* kvcache: ``attnkit.flash_attn.flash_attn_with_kvcache`` on a ``(B, T, Hkv, D)`` cache, and on
  the same keys in pages of 16 and of 256 tokens (flash-attn's ``(blocks, page, Hkv, D)``, pages
  shuffled) through a block table; ``gathered`` is the pages gathered into one tensor and
  attended (what a paged call cost before the kernel read pages in place).
* modules: a decode step of attnkit's module caches, one new token a row after ``T - 1`` held:
  ``KVCache.stage`` then ``attnkit.attention`` on its views, against ``PagedKVCache.attention``
  on the same tokens in pages of 16 and of 256, in flash-attn's layout and in vLLM's (``vllm``),
  filled a page a row at a time, so that each row's pages interleave with the others'.

* steps: a small model's decode loop, where the costs around the kernel count: 64 steps of one
  new token each against a cache growing from 1,000 tokens (B=1, H=8, Hkv=2, D=64, causal), so
  every step is a call of a new length. ``attnkit.attention`` with ``auto`` and with the chunked
  backend against ``F.scaled_dot_product_attention`` on the same views; ``module`` is a
  ``MultiHeadAttention`` (d_model 512) decoding with a ``KVCache``, against ``torch module``: the
  same projections, cache writes and SDPA written out by hand.

``--load busy`` keeps a process spinning on one core for the whole run; ``--load both`` alternates
quiet and busy rounds and adds each candidate's busy median over its quiet median.

    python benchmarks/bench_decode.py
    python benchmarks/bench_decode.py --dtype float32 bfloat16 float16
    python benchmarks/bench_decode.py --load both --rounds 7 --json docs/benchmarks/data/decode.json
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from bench_native import Load, measure

import attnkit
from attnkit import flash_attn as fa

import results

B, H, HKV, D, T = 8, 32, 8, 128, 4096
CASES = ["decode", "kvcache", "modules", "steps"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def _decode(dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    k, v = torch.randn(B, HKV, T, D, generator=g), torch.randn(B, HKV, T, D, generator=g)
    k, v = k.to(dtype), v.to(dtype)
    # the bytes of k and v, read once (as float32 elements)
    floor = torch.randn(2 * B * HKV * T * D * dtype.itemsize // 4, generator=g)
    return {
        "floor": lambda: floor.sum(),
        "chunked": lambda: attnkit.attention(q, k, v, backend="chunked"),
        "auto": lambda: attnkit.attention(q, k, v),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }


def _pages(
    cache: torch.Tensor, page: int, order: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T, Hkv, D)`` as shuffled pages ``(blocks, page, Hkv, D)`` and a block table."""
    blocks = cache.reshape(B * T // page, page, HKV, D)
    pages = torch.empty_like(blocks)
    pages[order] = blocks
    return pages, order.view(B, T // page).int()


def _kvcache(dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, 1, H, D, generator=g).to(dtype)
    k_cache, v_cache = (
        torch.randn(B, T, HKV, D, generator=g).to(dtype),
        torch.randn(B, T, HKV, D, generator=g).to(dtype),
    )
    seqlens = torch.full((B,), T, dtype=torch.int32)
    fns: dict[str, Callable[[], object]] = {
        "contiguous": lambda: fa.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, causal=True
        )
    }
    for page in (16, 256):
        order = torch.randperm(B * T // page, generator=g)
        kp, table = _pages(k_cache, page, order)
        vp, _ = _pages(v_cache, page, order)

        def paged(kp: torch.Tensor = kp, vp: torch.Tensor = vp, t: torch.Tensor = table) -> object:
            return fa.flash_attn_with_kvcache(
                q, kp, vp, cache_seqlens=seqlens, block_table=t, causal=True
            )

        fns[f"paged {page}"] = paged
        if page == 256:

            def gathered(
                kp: torch.Tensor = kp, vp: torch.Tensor = vp, t: torch.Tensor = table
            ) -> object:
                keys = kp[t.long()].flatten(1, 2).transpose(1, 2)
                values = vp[t.long()].flatten(1, 2).transpose(1, 2)
                return attnkit.attention(q.transpose(1, 2), keys, values, causal=True)

            fns["gathered 256"] = gathered
    return fns


def _modules(dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    k, v = torch.randn(B, HKV, T, D, generator=g), torch.randn(B, HKV, T, D, generator=g)
    k, v = k.to(dtype), v.to(dtype)
    contiguous = attnkit.KVCache(B, T, HKV, D, dtype=dtype)
    contiguous.update(k[:, :, :-1], v[:, :, :-1])
    new_k, new_v = k[:, :, -1:], v[:, :, -1:]

    def kvcache() -> object:
        # stage() without commit(): every round writes the same position, as one step does.
        keys, values = contiguous.stage(new_k, new_v)
        return attnkit.attention(q, keys, values, causal=True)

    fns: dict[str, Callable[[], object]] = {"kvcache": kvcache}
    for page, layout in ((16, "flash"), (256, "flash"), (16, "vllm"), (256, "vllm")):
        cache = attnkit.PagedKVCache(
            B * T // page, page, HKV, D, max_seqs=B, layout=layout, dtype=dtype
        )
        for start in range(0, T - 1, page):
            n = min(page, T - 1 - start)
            cache.stage(k[:, :, start : start + n], v[:, :, start : start + n])
            cache.commit()

        def paged(cache: attnkit.PagedKVCache = cache) -> object:
            return cache.attention(q, new_k, new_v, causal=True)

        fns[f"paged {page}" + (" vllm" if layout == "vllm" else "")] = paged
    return fns


STEPS, START = 64, 1000


def _steps(dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(3)
    h, hkv, d = 8, 2, 64
    q = torch.randn(1, h, 1, d, generator=g).to(dtype)
    k, v = (torch.randn(1, hkv, START + STEPS, d, generator=g).to(dtype) for _ in range(2))

    def loop(step: Callable[[torch.Tensor, torch.Tensor], object]) -> Callable[[], object]:
        def run() -> object:
            for t in range(START + 1, START + STEPS + 1):
                step(k[:, :, :t], v[:, :, :t])
            return None

        return run

    module = attnkit.MultiHeadAttention(h * d, h, num_kv_heads=hkv, dtype=dtype).eval()
    cache = module.make_cache(batch_size=1, max_len=START + STEPS)
    prompt = torch.randn(1, START, h * d, generator=g).to(dtype)
    tokens = torch.randn(STEPS, 1, 1, h * d, generator=g).to(dtype)
    module(prompt, cache=cache, causal=True)
    w = module.in_proj_weight.detach()
    b = module.in_proj_bias.detach() if module.in_proj_bias is not None else None
    keys, values = cache.k_cache.clone(), cache.v_cache.clone()
    sizes = [h * d, hkv * d, hkv * d]

    def attnkit_module() -> object:
        cache.rewind(START)
        for x in tokens:
            module(x, cache=cache, causal=True)
        return None

    def torch_module() -> object:
        for i, x in enumerate(tokens):
            qs, ks, vs = F.linear(x, w, b).split(sizes, dim=-1)
            t = START + i
            keys[:, :, t : t + 1] = ks.view(1, 1, hkv, d).transpose(1, 2)
            values[:, :, t : t + 1] = vs.view(1, 1, hkv, d).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                qs.view(1, 1, h, d).transpose(1, 2),
                keys[:, :, : t + 1],
                values[:, :, : t + 1],
                enable_gqa=True,
            )
            module.out_proj(out.transpose(1, 2).flatten(2))
        return None

    return {
        "auto": loop(lambda k, v: attnkit.attention(q, k, v, causal=True)),
        "chunked": loop(lambda k, v: attnkit.attention(q, k, v, causal=True, backend="chunked")),
        "sdpa": loop(lambda k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
        "module": attnkit_module,
        "torch module": torch_module,
    }


def _candidates(case: str, names: list[str]) -> dict[str, Callable[[], object]]:
    """Every candidate of ``case`` in every dtype, named ``"<candidate> <dtype>"``."""
    make = {"decode": _decode, "kvcache": _kvcache, "modules": _modules, "steps": _steps}[case]
    fns: dict[str, Callable[[], object]] = {}
    for name in names:
        for cand, fn in make(DTYPES[name]).items():
            fns[f"{cand} {SHORT[name]}"] = fn
    return fns


def _row(
    case: str,
    name: str,
    busy: bool,
    samples: dict[tuple[str, bool], list[float]],
    dtypes: list[str],
) -> dict[str, Any]:
    """One candidate's row: its median and worst round, and its ratios to the floor (decode), to
    the case's base in its dtype and to itself in float32 (when measured)."""
    cand, short = name.rsplit(" ", 1)
    s = samples[name, busy]
    med = statistics.median(s)
    bases = {"decode": "sdpa", "kvcache": "contiguous", "modules": "kvcache", "steps": "sdpa"}
    base = ("torch module" if cand == "module" else bases[case]) + f" {short}"
    row: dict[str, Any] = {
        "case": case,
        "candidate": cand,
        "dtype": next(d for d in DTYPES if SHORT[d] == short),
        "load": "busy" if busy else "quiet",
        "seconds": med,
        "worst_seconds": max(s),
        "rounds": len(s),
        "baseline": base,
        "ratio": med / statistics.median(samples[base, busy]),
    }
    if case == "decode":
        row["over_floor"] = med / statistics.median(samples[f"floor {short}", busy])
    if short != "f32" and (f"{cand} f32", busy) in samples:
        row["over_float32"] = med / statistics.median(samples[f"{cand} f32", busy])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=CASES)
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--load", choices=["quiet", "busy", "both"], default="quiet")
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    loads = {"quiet": [False], "busy": [True], "both": [False, True]}[args.load]
    torch.set_num_threads(args.threads)
    before = os.getloadavg()[0]
    _, why = attnkit._native.status()
    print(
        f"native kernel: {why}; threads {args.threads}; load: {args.load}; loadavg {before:.2f}; "
        f"B={B} H={H} Hkv={HKV} D={D} T={T} {' '.join(args.dtype)}"
    )
    spinner = Load() if args.load != "quiet" else None
    rows: list[dict[str, Any]] = []
    head = f"{'case':<8} {'candidate':<18} {'load':<6} {'median ms':>10} {'worst ms':>9}"
    print(
        head
        + f" {'/ floor':>8} {'/ base':>7} {'/ f32':>6}"
        + (f" {'busy/quiet':>10}" if args.load == "both" else "")
    )
    try:
        with torch.inference_mode():
            for case in args.cases:
                fns = _candidates(case, args.dtype)
                samples = measure(fns, args.rounds, loads, spinner)
                for name in fns:
                    for busy in loads:
                        row = _row(case, name, busy, samples, args.dtype)
                        floor = f"{row['over_floor']:.2f}" if "over_floor" in row else ""
                        f32 = f"{row['over_float32']:.2f}" if "over_float32" in row else ""
                        line = (
                            f"{case:<8} {name:<18} {row['load']:<6} "
                            f"{row['seconds'] * 1e3:>10.1f} {row['worst_seconds'] * 1e3:>9.1f} "
                            f"{floor:>8} {row['ratio']:>7.2f} {f32:>6}"
                        )
                        if busy and args.load == "both":
                            quiet = statistics.median(samples[name, False])
                            row["busy_ratio"] = row["seconds"] / quiet
                            line += f" {row['busy_ratio']:>10.2f}"
                        print(line, flush=True)
                        rows.append(row)
    finally:
        if spinner is not None:
            spinner.stop()
    after = os.getloadavg()[0]
    print(f"loadavg {after:.2f} at the end")
    if args.json:
        config = {
            "B": B,
            "H": H,
            "Hkv": HKV,
            "D": D,
            "T": T,
            "dtype": args.dtype[0] if len(args.dtype) == 1 else args.dtype,
            "threads": args.threads,
            "rounds": args.rounds,
            "load": args.load,
            "loadavg": [round(before, 2), round(after, 2)],
        }
        results.save(args.json, "decode", rows, config=config)


if __name__ == "__main__":
    main()
