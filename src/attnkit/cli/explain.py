"""``attnkit explain``: which backend ``auto`` picks for a call described on the command line.

The call is built from ``device="meta"`` tensors, so nothing is allocated and any size can be asked.
"""

from __future__ import annotations

import argparse

import torch

import attnkit

from .._checks import int_arg

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
MASKS = ("none", "padding", "full", "query")
BIASES = ("none", "heads", "full")


def add_arguments(p: argparse.ArgumentParser) -> None:
    shape = p.add_argument_group("shapes")
    shape.add_argument("-b", "--batch", type=int_arg, default=1, help="batch size B (default 1)")
    shape.add_argument("--heads", type=int_arg, default=8, help="query heads H (default 8)")
    shape.add_argument(
        "--kv-heads", type=int_arg, default=None, help="key/value heads Hkv (default: H)"
    )
    shape.add_argument(
        "-t", "--q-len", type=int_arg, default=1024, help="queries Tq (default 1024)"
    )
    shape.add_argument("--kv-len", type=int_arg, default=None, help="keys Tk (default: Tq)")
    shape.add_argument("-d", "--head-dim", type=int_arg, default=64, help="Dk (default 64)")
    shape.add_argument("--v-dim", type=int_arg, default=None, help="Dv (default: Dk)")
    opts = p.add_argument_group("options")
    opts.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    opts.add_argument(
        "--device",
        default="meta",
        help="device the call would run on (default meta: describe without allocating; try cuda)",
    )
    opts.add_argument(
        "--mask",
        choices=MASKS,
        default="none",
        help="none; padding (B,1,1,Tk); full (B,H,Tq,Tk); query (Tq,Tk), e.g. sliding window",
    )
    opts.add_argument("--causal", action="store_true", help="bottom-right causal masking")
    opts.add_argument(
        "--bias",
        choices=BIASES,
        default="none",
        help="none; heads (H,Tq,Tk), e.g. ALiBi or relative positions; full (B,H,Tq,Tk)",
    )
    opts.add_argument("--bias-grad", action="store_true", help="the bias requires grad")
    opts.add_argument("--dropout", type=float, default=0.0, metavar="P", help="dropout_p")
    opts.add_argument("--weights", action="store_true", help="return_weights=True")
    opts.add_argument(
        "--backend",
        default="auto",
        help=f"auto or one of {', '.join(attnkit.available_backends())}",
    )


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here (--device meta describes any call)")
    dtype = DTYPES[args.dtype]
    b, h, tq, dk = args.batch, args.heads, args.q_len, args.head_dim
    hkv = h if args.kv_heads is None else args.kv_heads
    tk = tq if args.kv_len is None else args.kv_len
    dv = dk if args.v_dim is None else args.v_dim

    def empty(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dt, device=device)

    mask_shapes = {"padding": (b, 1, 1, tk), "full": (b, h, tq, tk), "query": (tq, tk)}
    mask = None if args.mask == "none" else empty(*mask_shapes[args.mask], dt=torch.bool)
    bias = None
    if args.bias != "none":
        bias = empty(*((h, tq, tk) if args.bias == "heads" else (b, h, tq, tk)))
        bias.requires_grad_(args.bias_grad)
    report = attnkit.explain(
        empty(b, h, tq, dk),
        empty(b, hkv, tk, dk),
        empty(b, hkv, tk, dv),
        mask=mask,
        bias=bias,
        causal=args.causal,
        dropout_p=args.dropout,
        return_weights=args.weights,
        backend=args.backend,
    )
    print(report)
    return 0 if report.chosen is not None else 1
