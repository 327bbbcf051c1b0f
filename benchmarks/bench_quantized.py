"""Decoding against an int8 or float8 KV cache read in place, side by side with a bfloat16 one.

B=8, H=32 query heads, Hkv=8 key/value heads, D=128, one query per row (float32; bfloat16 for the
bfloat16 cache, which takes queries of its dtype) against a cache of 4096 tokens laid out
``(B, Hkv, T, D)``: 128 MiB of keys and values in bfloat16, 64 MiB in int8 or float8 (plus a
float32 scale per token and key/value head for int8, per head for float8). Every candidate runs
in interleaved rounds of ``torch.utils.benchmark`` and the table gives each one's median over the
rounds, its ratio to the bfloat16 cache and to its own memory floor, measured in the same run.

* floor: ``x.sum()`` over a float32 tensor of a cache's bytes (keys, values and scales): the time
  to read them once at the read bandwidth torch's own reduction reaches on this CPU.
* decode: ``attnkit.attention(q, k, v, k_scale=, v_scale=)`` with the ``chunked`` backend (the
  native kernel's decode path, which reads the quantized cache in place); ``bf16`` is the same
  call on the bfloat16 cache.
* cache steps: one decode step of a cache (``stage_call`` of the new token, then
  ``attention(q, view, causal=True)``, as ``MultiHeadAttention`` makes it), for a
  ``KVCache(..., kv_dtype=...)`` and a ``PagedKVCache(page_size=16, kv_dtype=...)`` holding the
  same tokens (rows on pages in order; ``paged`` flash-attn's token-major pages, ``paged-vllm``
  vLLM's head-major ones), int8, float8 e4m3 and bfloat16: the paged step against the
  contiguous one, and each format against bfloat16. ``--steps`` times these steps alone (at
  ``--batch`` rows), ``--cpu`` by the process's processor time rather than the wall clock.
* accuracy: each quantized output against the float64 formula over the dequantized cache (the
  kernel's own error) and against the float64 formula over the unquantized cache (the format's
  error), as relative errors (norm of the difference over the norm of the exact output).

    python benchmarks/bench_quantized.py
    python benchmarks/bench_quantized.py --rounds 7 --json docs/benchmarks/data/quantized.json
    python benchmarks/bench_quantized.py --steps --threads 2
    python benchmarks/bench_quantized.py --steps --batch 1 --tokens 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils import benchmark

import attnkit

B, H, HKV, D, T = 8, 32, 8, 128, 4096
FORMATS = {
    "int8": torch.int8,
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """int8: symmetric, a scale per token and key/value head; float8: a scale per head."""
    if dtype == torch.int8:
        scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127.0
        return (x / scale).round().clamp(-127, 127).to(torch.int8), scale
    scale = x.abs().amax((-2, -1), keepdim=True).clamp_min(1e-12) / torch.finfo(dtype).max
    return (x / scale).to(dtype), scale


def measure(
    fns: dict[str, Callable[[], object]], rounds: int, cpu: bool = False
) -> dict[str, float]:
    """Each candidate's median seconds per call over interleaved rounds (``cpu``: the process's
    processor seconds per call, which other processes on a busy machine do not add to)."""
    for fn in fns.values():
        fn()  # warm-up (and the native kernel's build or load)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if cpu:
                timer = benchmark.Timer("fn()", globals={"fn": fn}, timer=time.process_time)
            else:
                threads = torch.get_num_threads()
                timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=threads)
            samples[name].append(timer.blocked_autorange(min_run_time=0.3).median)
    return {name: statistics.median(s) for name, s in samples.items()}


def cache_steps(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rounds: int, cpu: bool = False
) -> dict[str, float]:
    """Seconds per decode step of a KVCache and a PagedKVCache (page 16), int8, float8 e4m3
    and bfloat16."""
    b, t = k.size(0), k.size(2)
    one_k, one_v = k[:, :, :1].contiguous(), v[:, :, :1].contiguous()
    fns: dict[str, Callable[[], object]] = {}
    for name, kv_dtype, dtype in (
        ("int8", torch.int8, torch.float32),
        ("e4m3", torch.float8_e4m3fn, torch.float32),
        ("bf16", None, torch.bfloat16),
    ):
        flat = attnkit.KVCache(b, t + 1, HKV, D, dtype=dtype, kv_dtype=kv_dtype)
        flat.update(k.to(dtype), v.to(dtype))
        pages = -(-(t + 1) // 16)
        paged = {}
        for layout in ("flash", "vllm"):
            paged[layout] = attnkit.PagedKVCache(
                b * pages, 16, HKV, D, max_seqs=b, dtype=dtype, kv_dtype=kv_dtype, layout=layout
            )
            paged[layout].stage(k.to(dtype), v.to(dtype))
            paged[layout].commit()
        qc, kc, vc = q.to(dtype), one_k.to(dtype), one_v.to(dtype)

        def step(cache: attnkit.KVCache | attnkit.PagedKVCache, qc=qc, kc=kc, vc=vc) -> object:
            # staged, never committed: the next step writes over it, the length stays t + 1
            return attnkit.attention(qc, cache.stage_call(qc, kc, vc, causal=True), causal=True)

        fns[f"KVCache {name}"] = lambda c=flat, s=step: s(c)
        fns[f"paged {name}"] = lambda c=paged["flash"], s=step: s(c)
        fns[f"paged-vllm {name}"] = lambda c=paged["vllm"], s=step: s(c)
    return measure(fns, rounds, cpu)


def print_steps(steps: dict[str, float]) -> None:
    print(f"{'cache step':>16} {'ms':>8} {'/ KVCache':>9} {'/ bf16':>7}")
    for name, sec in steps.items():
        kind, fmt = name.split()
        flat, same = steps[f"KVCache {fmt}"], steps[f"{kind} bf16"]
        print(f"{name:>16} {sec * 1e3:>8.2f} {sec / flat:>9.2f} {sec / same:>7.2f}")


def relative(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.double() - exact).norm() / exact.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tokens", type=int, default=T)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--steps", action="store_true", help="time the cache steps alone")
    parser.add_argument("--batch", type=int, default=B, help="rows of the cache steps")
    parser.add_argument("--cpu", action="store_true", help="time by processor time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    t = args.tokens
    if args.steps:
        shape = (args.batch, HKV, t, D)
        q = torch.randn(args.batch, H, 1, D, generator=g)
        k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        with torch.inference_mode():
            steps = cache_steps(q, k, v, args.rounds, args.cpu)
        clock = "processor" if args.cpu else "wall"
        print(f"B={args.batch} H={H} Hkv={HKV} D={D} T={t}, {args.threads} threads, {clock} time")
        print_steps(steps)
        return
    q = torch.randn(B, H, 1, D, generator=g)
    k = torch.randn(B, HKV, t, D, generator=g)
    v = torch.randn(B, HKV, t, D, generator=g)
    backend = attnkit.backends.Chunked()
    caches = {"bf16": (k.bfloat16(), v.bfloat16(), None, None)}
    for name, dtype in FORMATS.items():
        (kq, ks), (vq, vs) = quantize(k, dtype), quantize(v, dtype)
        caches[name] = (kq, vq, ks, vs)

    def call(name: str) -> Callable[[], object]:
        kc, vc, ks, vs = caches[name]
        qc = q.to(kc.dtype) if ks is None else q  # bfloat16 keys take bfloat16 queries
        return lambda: attnkit.attention(qc, kc, vc, k_scale=ks, v_scale=vs, backend=backend)

    def nbytes(name: str) -> int:
        return sum(x.numel() * x.element_size() for x in caches[name] if x is not None)

    floors = {name: torch.randn(nbytes(name) // 4, generator=g) for name in caches}
    fns: dict[str, Callable[[], object]] = {}
    for name in caches:
        fns[f"floor {name}"] = floors[name].sum
        fns[f"decode {name}"] = call(name)
    with torch.inference_mode():
        with attnkit.record_dispatch() as calls:
            for name in FORMATS:
                call(name)()
        kernels = {c.kernel for c in calls}
        times = measure(fns, args.rounds)
        exact = attnkit.attention(q.double(), k.double(), v.double(), backend="reference")
        accuracy = {}
        for name in FORMATS:
            kq, vq, ks, vs = caches[name]
            kd, vd = ((x.float() * s).double() for x, s in ((kq, ks), (vq, vs)))  # type: ignore[union-attr]
            over = attnkit.attention(q.double(), kd, vd, backend="reference")
            out = call(name)()
            accuracy[name] = (relative(out, over), relative(out, exact))  # type: ignore[arg-type]
    print(f"B={B} H={H} Hkv={HKV} D={D} T={t}, {args.threads} threads; kernels: {kernels}")
    print(f"{'cache':>6} {'MiB':>6} {'ms':>8} {'floor ms':>9} {'/ floor':>8} {'/ bf16':>7} "
          f"{'err/deq':>9} {'err/exact':>10}")  # fmt: skip
    rows = {}
    for name in caches:
        ms, floor = times[f"decode {name}"] * 1e3, times[f"floor {name}"] * 1e3
        ratio = times[f"decode {name}"] / times["decode bf16"]
        deq, ex = accuracy.get(name, (float("nan"), float("nan")))
        rows[name] = {"ms": ms, "floor_ms": floor, "over_floor": ms / floor, "over_bf16": ratio,
                      "error_vs_dequantized": deq, "error_vs_exact": ex}  # fmt: skip
        print(f"{name:>6} {nbytes(name) / 2**20:>6.1f} {ms:>8.2f} {floor:>9.2f} {ms / floor:>8.2f} "
              f"{ratio:>7.2f} {deq:>9.1e} {ex:>10.1e}")  # fmt: skip
    with torch.inference_mode():
        steps = cache_steps(q, k, v, args.rounds)
    print()
    print_steps(steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"B": B, "H": H, "Hkv": HKV, "D": D, "T": t, "rows": rows,
                 "cache_steps_ms": {n: s * 1e3 for n, s in steps.items()}},
                f,
                indent=1,
            )  # fmt: skip


if __name__ == "__main__":
    main()
