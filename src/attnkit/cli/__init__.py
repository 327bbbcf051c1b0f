"""The ``attnkit`` command. Until the demo lands, ``attnkit demo`` runs a short example."""

from __future__ import annotations

import argparse
import sys

import torch

import attnkit


def _demo(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    q = torch.randn(1, 8, 1024, 64)
    kv = torch.randn(1, 2, 1024, 64)
    pad = attnkit.masks.padding_mask([1000], max_len=1024)
    out = attnkit.attention(q, kv, kv, mask=pad, causal=True)
    print(attnkit.explain(q, kv, kv, mask=pad, causal=True))
    print(f"output {tuple(out.shape)}, mean {out.mean():.4f}, finite: {bool(out.isfinite().all())}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnkit", description=attnkit.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a short example")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
