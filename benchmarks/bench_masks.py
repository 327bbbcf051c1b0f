"""Structured masks, softcap and sinks against torch SDPA doing the same visible work.

float32, inference unless a row says forward + backward; times are medians of interleaved
torch.utils.benchmark rounds, "ratio" is time / the baseline's time in the same run; "extra MiB" is
the peak resident memory a call adds beyond its inputs and output, measured in a fresh process.

* window: B=1 H=8 T=65536 D=64, ``masks.sliding_window(512)``, against SDPA on the 128 independent
  512-token chunks (the same number of visible pairs).
* documents: 32 packed documents of random lengths, T=32768, ``masks.documents(lengths)``, against
  one SDPA call per document.
* prefix_lm: ``masks.from_fn`` (the first 1024 tokens see each other, the rest is causal) at
  T=16384, against SDPA with the same mask as a dense bool tensor (256 MiB).
* plain, softcap, sinks: the chunked backend at T=4096 against SDPA (a call without a mask is one
  call of torch's fused CPU kernel), and with softcap or sinks against plain chunked.
* kernel, softcap_vs_kernel: the same plain call with every block in attnkit's own kernel
  (``Chunked(fused_rows=None)``) against SDPA, and softcap (which always runs there) against it:
  the cost of the softcap itself.
* decode: one query against 4096 keys, attnkit.attention() against torch's SDPA: the dispatch cost.

    python benchmarks/bench_masks.py                      # every case (~20 minutes on 2 cores)
    python benchmarks/bench_masks.py --cases plain decode --json docs/benchmarks/data/masks.json
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks
from attnkit.backends import Chunked
from attnkit.cli.measure import extra_peak_memory, time_side_by_side

import results

H, D = 8, 64


def _qkv(t: int, b: int = 1, grad: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, H, t, D, generator=g).requires_grad_(grad) for _ in range(3)]


def _document_lengths(t: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(1)
    cuts = torch.randperm(t - 1, generator=g)[: n - 1].add(1).sort().values.tolist()
    bounds = [0, *cuts, t]
    return [bounds[i + 1] - bounds[i] for i in range(n)]


def _prefix_lm(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return (kv <= q) | (kv < 1024)


def build(case: str, who: str, backward: bool = False) -> tuple[Callable[[], object], int]:
    """The call ``who`` ("ours" or "baseline") makes for ``case``; module level for the child."""
    if case == "window":
        t, w = 65536, 512
        q, k, v = _qkv(t, grad=backward)
        if who == "ours":
            mask = masks.sliding_window(w)

            def fn() -> torch.Tensor:
                return attnkit.attention(q, k, v, mask=mask)

        else:

            def fn() -> torch.Tensor:
                chunks = [x.view(1, H, t // w, w, D).transpose(1, 2) for x in (q, k, v)]
                out = F.scaled_dot_product_attention(*chunks)
                return out.transpose(1, 2).reshape(1, H, t, D)

    elif case == "documents":
        t = 32768
        q, k, v = _qkv(t, grad=backward)
        lengths = _document_lengths(t, 32)
        if who == "ours":
            mask = masks.documents(lengths)

            def fn() -> torch.Tensor:
                return attnkit.attention(q, k, v, mask=mask)

        else:

            def fn() -> torch.Tensor:
                outs, start = [], 0
                for n in lengths:
                    part = [x[..., start : start + n, :] for x in (q, k, v)]
                    outs.append(F.scaled_dot_product_attention(*part))
                    start += n
                return torch.cat(outs, dim=-2)

    elif case == "prefix_lm":
        t = 16384
        q, k, v = _qkv(t, grad=backward)
        if who == "ours":
            mask = masks.from_fn(_prefix_lm)

            def fn() -> torch.Tensor:
                return attnkit.attention(q, k, v, mask=mask)

        else:
            i = torch.arange(t)
            dense = (i[None, :] <= i[:, None]) | (i[None, :] < 1024)

            def fn() -> torch.Tensor:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

    elif case in ("plain", "kernel", "softcap", "softcap_vs_kernel", "sinks"):
        t = 4096
        q, k, v = _qkv(t, grad=backward)
        kw: dict[str, object] = {}
        backend: object = "chunked"
        if who == "ours" and case.startswith("softcap"):
            kw["softcap"] = 30.0
        if who == "ours" and case == "sinks":
            kw["sinks"] = torch.zeros(H)
        if who == "ours" and case == "kernel":
            backend = Chunked(fused_rows=None)  # attnkit's own kernel for every block
        if who == "baseline" and case in ("plain", "kernel"):

            def fn() -> torch.Tensor:
                return F.scaled_dot_product_attention(q, k, v)

        else:

            def fn() -> torch.Tensor:
                return attnkit.attention(q, k, v, backend=backend, **kw)  # type: ignore[call-overload]

    elif case == "decode":
        q = torch.randn(1, H, 1, D)
        k, v = torch.randn(1, H, 4096, D), torch.randn(1, H, 4096, D)
        if who == "ours":

            def fn() -> torch.Tensor:
                return attnkit.attention(q, k, v)

        else:

            def fn() -> torch.Tensor:
                return F.scaled_dot_product_attention(q, k, v)

    else:
        raise ValueError(f"unknown case {case!r}")

    if backward:

        def step() -> object:
            out = fn()
            out.sum().backward()  # type: ignore[attr-defined]
            return None

        return step, 0

    def call() -> torch.Tensor:
        with torch.inference_mode():
            return fn()

    return call, 4 * H * D * {"window": 65536, "documents": 32768, "prefix_lm": 16384}.get(
        case, 4096
    )


PAIRS = {
    # case: (ours vs what), with the baseline each ratio is taken against
    "window": "torch SDPA on 128 chunks of 512",
    "documents": "torch SDPA, one call per document",
    "prefix_lm": "torch SDPA with the dense bool mask",
    "plain": "torch SDPA",
    "kernel": "torch SDPA",
    "softcap": "plain chunked",
    "softcap_vs_kernel": "plain chunked, own kernel only",
    "sinks": "plain chunked",
    "decode": "torch SDPA",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(PAIRS))
    parser.add_argument("--backward", action="store_true", help="also time forward + backward")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}, "
        "float32"
    )
    print("\n| case | pass | attnkit ms | baseline | baseline ms | ratio | attnkit extra MiB |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: |")
    rows = []
    for case in args.cases:
        for backward in (False, True) if args.backward and case != "decode" else (False,):
            base_case, base_who = case, "baseline"
            if case in ("softcap", "sinks"):
                base_case, base_who = "plain", "ours"
            if case == "softcap_vs_kernel":
                base_case, base_who = "kernel", "ours"
            fns = {
                "ours": build(case, "ours", backward)[0],
                "baseline": build(base_case, base_who, backward)[0],
            }
            times = time_side_by_side(fns, rounds=args.rounds, min_run_time=1.0)
            mem = None
            if not args.no_memory and not backward and case != "decode":
                mem = extra_peak_memory(build, case, "ours", False)
            ratio = times["ours"] / times["baseline"]
            mib = "" if mem is None else f"{mem / 2**20:.1f}"
            pass_ = "fwd+bwd" if backward else "forward"
            unit = 1e6 if case == "decode" else 1e3
            print(
                f"| {case} | {pass_} | {times['ours'] * unit:.1f} | {PAIRS[case]} | "
                f"{times['baseline'] * unit:.1f} | {ratio:.2f} | {mib} |"
                + (" (us)" if case == "decode" else ""),
                flush=True,
            )
            rows.append(
                {
                    "case": case,
                    "pass": pass_,
                    "seconds": times["ours"],
                    "baseline": PAIRS[case],
                    "baseline_seconds": times["baseline"],
                    "ratio": ratio,
                    "extra_bytes": mem,
                }
            )
    if args.json:
        config = {"H": H, "D": D, "dtype": "float32", "rounds": args.rounds}
        results.save(args.json, "masks", rows, config=config)


if __name__ == "__main__":
    main()
