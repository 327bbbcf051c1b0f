"""``attnkit bench``: attnkit against torch and against attention written by hand, side by side.

Two groups of rows, float32 on the CPU, inference (no grad):

* **attention core** ``(B, H, T, D)``: ``attnkit.attention`` (auto) against torch's
  ``scaled_dot_product_attention`` and the naive ``softmax(q k^T / sqrt(d)) v`` that hand-written
  code uses (masking by ``masked_fill``);
* **multi-head module** ``(B, T, d_model)``: ``attnkit.MultiHeadAttention`` against
  ``torch.nn.MultiheadAttention(need_weights=False)`` with the same weights, and a hand-written
  module as tutorials write it (four ``nn.Linear`` and the naive core).

Time is the median of interleaved ``torch.utils.benchmark`` rounds; "ratio" divides by the torch row
of the same group; "extra MiB" is the peak memory a call adds beyond its inputs and output,
measured in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnkit

from .._base.checks import int_arg
from .measure import extra_peak_memory, time_side_by_side


@dataclass(frozen=True)
class Scenario:
    """One shape; ``kind`` is "core" (attention on (B, H, T, D)) or "module" (B, T, d_model)."""

    kind: str
    batch: int
    length: int
    heads: int
    dim: int  # head dim for "core", d_model for "module"
    causal: bool = False
    padding: bool = False

    @property
    def label(self) -> str:
        dims = (
            f"B={self.batch} H={self.heads} T={self.length} D={self.dim}"
            if self.kind == "core"
            else f"B={self.batch} T={self.length} d_model={self.dim} H={self.heads}"
        )
        extra = "".join([", causal" if self.causal else "", ", padding" if self.padding else ""])
        return f"{self.kind}: {dims}{extra}"


FULL = [
    Scenario("core", 1, 1024, 8, 64),
    Scenario("core", 1, 4096, 8, 64),
    Scenario("core", 1, 4096, 8, 64, causal=True),
    Scenario("core", 4, 1024, 8, 64, causal=True, padding=True),
    Scenario("module", 4, 1024, 8, 512),
    Scenario("module", 4, 1024, 8, 512, padding=True),
]
QUICK = [Scenario("core", 1, 1024, 8, 64), Scenario("module", 2, 256, 8, 256)]
CORE = ("torch sdpa", "attnkit", "naive")
MODULE = ("torch MultiheadAttention", "attnkit MultiHeadAttention", "naive module")


def _lengths(s: Scenario) -> Tensor:
    # Padding: every other sequence loses its last quarter.
    return torch.tensor([s.length if i % 2 == 0 else s.length * 3 // 4 for i in range(s.batch)])


def _naive_core(q: Tensor, k: Tensor, v: Tensor, blocked: Tensor | None) -> Tensor:
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    if blocked is not None:
        scores = scores.masked_fill(blocked, -1e9)
    return torch.softmax(scores, dim=-1) @ v


class _NaiveMHA(nn.Module):
    """Multi-head attention as tutorials write it: four Linear layers around the naive core."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, x: Tensor, blocked: Tensor | None) -> Tensor:
        b, t, d = x.shape

        def split(y: Tensor) -> Tensor:
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        out = _naive_core(split(self.q(x)), split(self.k(x)), split(self.v(x)), blocked)
        result: Tensor = self.o(out.transpose(1, 2).reshape(b, t, d))
        return result


def build(s: Scenario, candidate: str) -> tuple[Callable[[], Tensor], int]:
    """Inputs and a no-grad call; module-level so that a measuring child process can run it."""
    torch.manual_seed(0)
    keep = attnkit.masks.padding_mask(_lengths(s), s.length) if s.padding else None
    if s.causal:
        causal = attnkit.masks.causal_mask(s.length)
        keep = causal if keep is None else keep & causal
    blocked = None if keep is None else ~keep
    fn: Callable[[], Tensor]
    if s.kind == "core":
        q, k, v = (torch.randn(s.batch, s.heads, s.length, s.dim) for _ in range(3))
        pad = attnkit.masks.padding_mask(_lengths(s), s.length) if s.padding else None

        def torch_sdpa() -> Tensor:
            if s.causal and not s.padding:  # torch's own causal path, no mask
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

        fns: dict[str, Callable[[], Tensor]] = {
            "attnkit": lambda: attnkit.attention(q, k, v, mask=pad, causal=s.causal),
            "torch sdpa": torch_sdpa,
            "naive": lambda: _naive_core(q, k, v, blocked),
        }
        fn = fns[candidate]
        nbytes = q.numel() * 4
    else:
        x = torch.randn(s.batch, s.length, s.dim)
        ours = attnkit.MultiHeadAttention(s.dim, s.heads).eval()
        theirs = attnkit.interop.torch.to_torch(ours).eval()
        naive = _NaiveMHA(s.dim, s.heads).eval()
        with torch.no_grad():  # the same weights in all three
            for lin, w, b in zip(
                (naive.q, naive.k, naive.v),
                theirs.in_proj_weight.chunk(3),
                theirs.in_proj_bias.chunk(3),
                strict=True,
            ):
                lin.weight.copy_(w)
                lin.bias.copy_(b)
            naive.o.weight.copy_(theirs.out_proj.weight)
            naive.o.bias.copy_(theirs.out_proj.bias)
        pad = attnkit.masks.padding_mask(_lengths(s), s.length) if s.padding else None
        key_padding = None if pad is None else ~pad[:, 0, 0]  # torch: True = ignore
        fns = {
            "attnkit MultiHeadAttention": lambda: ours(x, mask=pad),
            "torch MultiheadAttention": lambda: theirs(
                x, x, x, key_padding_mask=key_padding, need_weights=False
            )[0],
            "naive module": lambda: naive(x, blocked),
        }
        fn = fns[candidate]
        nbytes = x.numel() * 4

    def call() -> Tensor:
        with torch.inference_mode():
            return fn()

    return call, nbytes


@dataclass
class Row:
    scenario: str
    candidate: str
    ms: float
    ratio: float
    extra_mib: float | None


def run_scenarios(
    scenarios: list[Scenario], *, rounds: int, min_run_time: float, memory: bool
) -> list[Row]:
    rows = []
    for s in scenarios:
        names = CORE if s.kind == "core" else MODULE
        if s.kind == "module" and not hasattr(attnkit, "MultiHeadAttention"):
            continue
        times = time_side_by_side(
            {n: build(s, n)[0] for n in names}, rounds=rounds, min_run_time=min_run_time
        )
        for n in names:
            mem = extra_peak_memory(build, s, n) if memory else None
            rows.append(
                Row(
                    s.label,
                    n,
                    times[n] * 1e3,
                    times[n] / times[names[0]],
                    None if mem is None else mem / 2**20,
                )
            )
    return rows


def format_table(rows: list[Row]) -> str:
    lines = [
        "| scenario | candidate | ms | ratio | extra MiB |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        mem = "" if r.extra_mib is None else f"{r.extra_mib:.1f}"
        lines.append(f"| {r.scenario} | {r.candidate} | {r.ms:.2f} | {r.ratio:.2f} | {mem} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="two small shapes, fewer rounds (~1 min)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    p.add_argument("--threads", type=int_arg, default=None, help="torch threads (default: torch's)")


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    rows = run_scenarios(
        QUICK if args.quick else FULL,
        rounds=2 if args.quick else 3,
        min_run_time=0.2 if args.quick else 1.0,
        memory=not args.no_memory,
    )
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, no grad\n")
        print(format_table(rows))
    return 0
