"""attnkit.MultiHeadAttention against torch.nn.MultiheadAttention and against its own bare work.

Self-attention, B=4, T=1024, D=512, H=8, float32 on CPU, both modules holding the same weights.

* inference: eval mode under ``torch.inference_mode()``, no weights (torch's
  ``need_weights=False``; torch may take its native fast path there, and the script reports
  whether it did).
* bare work: what the module must do at the least, timed in the same run: the four projection
  GEMMs (q, k, v and output, each ``(B*T, D) x (D, D)``) plus the fused attention core
  (``scaled_dot_product_attention`` on contiguous ``(B, H, T, D/H)`` tensors), with nothing
  between them. "bare, packed" does q, k, v as one ``(B*T, D) x (D, 3D)`` GEMM instead.
* training step: train mode (dropout 0), forward and backward of the output against a fixed
  gradient, parameter gradients cleared between steps by ``set_to_none``.

Times are medians of interleaved torch.utils.benchmark rounds (attnkit.cli.measure), so a slow
minute on a shared machine hurts every candidate alike; the ratios are what to read.

    python benchmarks/bench_multihead.py            # about 2 minutes
    python benchmarks/bench_multihead.py --quick    # shorter rounds
    python benchmarks/bench_multihead.py --causal   # causal self-attention instead
    python benchmarks/bench_multihead.py --json docs/benchmarks/data/multihead.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import attnkit
from attnkit.cli.measure import time_side_by_side

import results

B, T, D, H = 4, 1024, 512, 8


def torch_takes_fast_path(m: nn.MultiheadAttention, x: torch.Tensor) -> bool:
    """Whether torch's module ran its native fused kernel for this call."""
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.inference_mode():
        m(x, x, x, need_weights=False)
    return any("_native_multi_head_attention" in e.key for e in prof.key_averages())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter timing rounds")
    parser.add_argument("--causal", action="store_true", help="causal self-attention")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--json", help="also write the results to this file as JSON")
    args = parser.parse_args()
    rounds, min_run = (2, 0.5) if args.quick else (args.rounds, 2.0)
    causal = args.causal

    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(D, H, batch_first=True)
    ours = attnkit.interop.torch.from_torch(theirs)
    x = torch.randn(B, T, D)
    torch_mask = nn.Transformer.generate_square_subsequent_mask(T) if causal else None

    def torch_forward() -> torch.Tensor:
        return theirs(x, x, x, need_weights=False, attn_mask=torch_mask, is_causal=causal)[0]

    def ours_forward() -> torch.Tensor:
        return ours(x, causal=causal)

    with torch.inference_mode():
        theirs.eval()
        ours.eval()
        diff = (torch_forward() - ours_forward()).abs().max().item()
    fast = torch_takes_fast_path(theirs, x)

    # The bare work, on inputs laid out as the kernels want them.
    wq, wk, wv = (w.detach() for w in theirs.in_proj_weight.chunk(3))
    bq, bk, bv = (b.detach() for b in theirs.in_proj_bias.chunk(3))
    w_in, b_in = theirs.in_proj_weight.detach(), theirs.in_proj_bias.detach()
    wo, bo = theirs.out_proj.weight.detach(), theirs.out_proj.bias.detach()
    x2 = x.view(B * T, D)
    q, k, v = (torch.randn(B, H, T, D // H) for _ in range(3))
    heads = torch.randn(B * T, D)

    def bare() -> torch.Tensor:
        F.linear(x2, wq, bq)
        F.linear(x2, wk, bk)
        F.linear(x2, wv, bv)
        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return F.linear(heads, wo, bo)

    def bare_packed() -> torch.Tensor:
        F.linear(x2, w_in, b_in)
        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return F.linear(heads, wo, bo)

    def inference(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            with torch.inference_mode():
                return fn()

        return call

    infer = time_side_by_side(
        {
            "torch": inference(torch_forward),
            "attnkit": inference(ours_forward),
            "bare": inference(bare),
            "bare, packed": inference(bare_packed),
        },
        rounds=rounds,
        min_run_time=min_run,
    )

    theirs.train()
    ours.train()
    xg = x.clone().requires_grad_()
    grad = torch.randn(B, T, D)

    def torch_step() -> None:
        theirs.zero_grad(set_to_none=True)
        xg.grad = None
        out = theirs(xg, xg, xg, need_weights=False, attn_mask=torch_mask, is_causal=causal)[0]
        out.backward(grad)

    def ours_step() -> None:
        ours.zero_grad(set_to_none=True)
        xg.grad = None
        ours(xg, causal=causal).backward(grad)

    train = time_side_by_side(
        {"torch": torch_step, "attnkit": ours_step}, rounds=rounds, min_run_time=min_run
    )

    what = "causal self-attention" if causal else "self-attention"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {what}, "
        f"B={B} T={T} D={D} H={H} float32"
    )
    print(f"torch's inference call took its native fast path: {fast}")
    print(f"max |attnkit - torch| on the inference output: {diff:.2e}")
    print(f"{'':<22} {'ms':>9} {'/ torch':>8} {'/ bare':>8} {'/ packed':>9}")
    for name, t in infer.items():
        print(
            f"{'inference: ' + name:<22} {t * 1e3:>9.1f} {t / infer['torch']:>8.3f} "
            f"{t / infer['bare']:>8.3f} {t / infer['bare, packed']:>9.3f}"
        )
    for name, t in train.items():
        print(f"{'training: ' + name:<22} {t * 1e3:>9.1f} {t / train['torch']:>8.3f}")
    if args.json:
        rows = [
            {"pass": "inference", "candidate": name, "seconds": t, "ratio": t / infer["torch"]}
            for name, t in infer.items()
        ] + [
            {"pass": "training step", "candidate": name, "seconds": t, "ratio": t / train["torch"]}
            for name, t in train.items()
        ]
        config = {
            "B": B,
            "T": T,
            "D": D,
            "H": H,
            "dtype": "float32",
            "causal": causal,
            "torch_fast_path": fast,
            "max_abs_diff": diff,
        }
        results.save(args.json, "multihead", rows, config=config)


if __name__ == "__main__":
    main()
