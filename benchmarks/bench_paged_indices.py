"""A DeepSeek V3.2 decode step on a paged latent cache: ``key_indices`` over the pages against the
same selection over a contiguous copy of the keys and against the whole rows.

Every row holds ``--tk`` latents (one key/value head of ``R + Dr`` = 576 numbers, the values its
first 512, a view of the keys) in pages of ``--page`` tokens, shuffled through the pool as a
server's are; each of the ``--batch`` rows decodes one query of ``--heads`` heads that selects
``--k`` of its keys (random, causal), as the absorbed form's call is.

* paged: ``attnkit.attention(q, view, mask=key_indices(idx) & causal())`` on the cache's view:
  each query's selected rows gathered through the block table (``chunked``'s index path).
* contiguous: the same selection over the rows' keys as one contiguous ``(B, 1, Tk, 576)``
  tensor, served by the gathered kernel of index masks (the native one where it is built).
* whole rows: the step without a selection, every key of each row read in place from the pages
  by the native decode path (what the model would cost with no indexer).

Medians of interleaved torch.utils.benchmark rounds, each ratio a time over another in the same
run; the machine and its threads are printed.

    python benchmarks/bench_paged_indices.py                         # B 4, H 16, Tk 8192, k 2048
    python benchmarks/bench_paged_indices.py --tk 4096 --dtype float32 --json paged_indices.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch
from torch.utils import benchmark

import attnkit
from attnkit import masks

R, DR = 512, 64


def setup(args: argparse.Namespace) -> dict[str, object]:
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    b, tk, page = args.batch, args.tk, args.page
    per_row = -(-tk // page)
    cache = attnkit.PagedKVCache(
        num_blocks=b * per_row + 1, page_size=page, num_kv_heads=1, head_dim=R + DR,
        v_head_dim=R, max_seqs=b, layout="flash", dtype=dtype, values_in_keys=True,
    )  # fmt: skip
    latents = torch.randn(b, 1, tk, R + DR, dtype=dtype)
    cache.stage(latents, None)
    cache.commit()
    order = torch.randperm(b * per_row)  # pages scattered through the pool
    table = order.view(b, per_row).to(torch.int32)
    kp = cache.k_pages
    kp[order] = kp[: b * per_row].clone()
    cache.block_table[:, :per_row] = table
    view = cache.view()
    q = torch.randn(b, args.heads, 1, R + DR, dtype=dtype)
    idx = torch.randint(0, tk, (b, 1, 1, args.k))
    mask = masks.key_indices(idx) & masks.causal()
    keys = torch.stack([view.row(n, dtype)[0][0] for n in range(b)])  # (B, 1, Tk, R + Dr)
    return {"q": q, "view": view, "mask": mask, "keys": keys, "values": keys[..., :R]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--tk", type=int, default=8192)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    env = setup(args)
    stmts = {
        "paged": "attnkit.attention(q, view, mask=mask)",
        "contiguous": "attnkit.attention(q, keys, values, mask=mask)",
        "whole rows": "attnkit.attention(q, view, causal=True)",
    }
    with torch.no_grad():
        first = attnkit.attention(env["q"], env["view"], mask=env["mask"])  # type: ignore[call-overload]
        same = attnkit.attention(env["q"], env["keys"], env["values"], mask=env["mask"])  # type: ignore[call-overload]
        print("paged == contiguous to", float((first.float() - same.float()).abs().max()))
        with attnkit.record_dispatch() as seen:
            for stmt in stmts.values():
                eval(stmt, {"attnkit": attnkit, **env})
        for name, d in zip(stmts, seen, strict=True):
            print(f"{name}: {d.chosen}, {d.kernel}")
        times: dict[str, list[float]] = {n: [] for n in stmts}
        for _ in range(args.rounds):
            for name, stmt in stmts.items():
                t = benchmark.Timer(stmt, globals={"attnkit": attnkit, **env},
                                    num_threads=args.threads)  # fmt: skip
                times[name].append(t.blocked_autorange(min_run_time=0.5).median)
    medians = {n: statistics.median(v) for n, v in times.items()}
    print(
        f"{platform.processor() or platform.machine()}, {args.threads} threads, {args.dtype}, "
        f"B={args.batch} H={args.heads} Tk={args.tk} k={args.k} page={args.page}"
    )
    for name, m in medians.items():
        print(f"{name:12s} {m * 1e3:8.2f} ms   paged / this {medians['paged'] / m:6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "medians_s": medians, "rounds_s": times}, f, indent=1)


if __name__ == "__main__":
    main()
