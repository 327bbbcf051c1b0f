"""On a CUDA machine: check every backend against the float64 reference, then time them in bf16.

    python benchmarks/gpu_check.py              # checks + timings, a table on stdout
    python benchmarks/gpu_check.py --json docs/benchmarks/data/gpu.json

Part 1 runs each backend on CUDA over a grid of cases (plain, causal with Tq == Tk and Tq < Tk,
padding and random masks with fully masked rows, bias, GQA, float32/bfloat16/float16) and compares
outputs, and for float32 the q/k/v/bias gradients, with the reference computed in float64 on the
same inputs, at attnkit.testing's tolerances. Part 2 times forward and forward+backward in bfloat16
against torch's own scaled_dot_product_attention. It exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import attnkit
from attnkit import masks
from attnkit.testing import assert_close

import results

DEV = "cuda"


def cases() -> list[tuple[str, dict[str, object]]]:
    """(name, case) pairs; a case holds shapes and options, tensors are made per dtype."""
    out: list[tuple[str, dict[str, object]]] = []
    for tq, tk in [(256, 256), (100, 300), (300, 100), (1, 512)]:
        for causal in (False, True):
            out.append((f"Tq={tq} Tk={tk} causal={causal}", {"tq": tq, "tk": tk, "causal": causal}))
    out.append(("padding + causal", {"tq": 200, "tk": 200, "causal": True, "pad": True}))
    out.append(("random mask, empty rows", {"tq": 64, "tk": 96, "mask": True}))
    out.append(("bias", {"tq": 128, "tk": 160, "bias": True}))
    out.append(
        ("bias + mask + causal", {"tq": 128, "tk": 160, "bias": True, "mask": True, "causal": True})
    )
    out.append(("GQA 8/2", {"tq": 128, "tk": 128, "h": 8, "hkv": 2, "causal": True}))
    out.append(("MQA 8/1, Dv != Dk", {"tq": 64, "tk": 192, "h": 8, "hkv": 1, "dv": 32}))
    return out


def make(case: dict[str, object], dtype: torch.dtype, grad: bool) -> dict[str, object]:
    g = torch.Generator(device=DEV).manual_seed(0)
    b, h, hkv = 2, int(case.get("h", 4)), int(case.get("hkv", 4))  # type: ignore[call-overload]
    tq, tk, dk = int(case["tq"]), int(case["tk"]), 64  # type: ignore[call-overload]
    dv = int(case.get("dv", dk))  # type: ignore[call-overload]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=DEV).to(dtype).requires_grad_(grad)

    kw: dict[str, object] = {
        "q": randn(b, h, tq, dk),
        "k": randn(b, hkv, tk, dk),
        "v": randn(b, hkv, tk, dv),
        "causal": bool(case.get("causal")),
    }
    if case.get("pad"):
        kw["mask"] = masks.padding_mask(torch.tensor([tk, tk // 2], device=DEV), tk)
    if case.get("mask"):
        m = torch.rand(b, 1, tq, tk, generator=g, device=DEV) < 0.5
        m[:, :, 0] = False  # a query with nothing to attend
        kw["mask"] = m
    if case.get("bias"):
        kw["bias"] = randn(h, tq, tk)
    return kw


def check(backends: list[str]) -> list[str]:
    failures = []
    for name, case in cases():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            grad = dtype == torch.float32
            kw = make(case, dtype, grad)
            ref_kw = {
                k: (
                    v.detach().double().requires_grad_(grad)
                    if isinstance(v, torch.Tensor) and v.is_floating_point()
                    else v
                )
                for k, v in kw.items()
            }
            expected = attnkit.attention(**ref_kw, backend="reference")  # type: ignore[arg-type]
            leaves = [n for n in ("q", "k", "v", "bias") if n in kw]
            if grad:
                cot = torch.randn_like(expected)
                want = torch.autograd.grad(expected, [ref_kw[n] for n in leaves], cot)
            for backend in backends:
                label = f"{backend:<9} {str(dtype)[6:]:<8} {name}"
                try:
                    got = attnkit.attention(**kw, backend=backend)  # type: ignore[arg-type]
                    assert_close(got, expected)
                    if grad:
                        grads = torch.autograd.grad(got, [kw[n] for n in leaves], cot.float())
                        for n, gg, ww in zip(leaves, grads, want, strict=True):
                            try:
                                assert_close(gg, ww)
                            except AssertionError as err:
                                raise AssertionError(f"gradient of {n}: {err}") from None
                    print(f"ok    {label}")
                except attnkit.BackendError:
                    print(f"skip  {label} (backend cannot serve this call)")
                except AssertionError as err:
                    failures.append(label)
                    print(f"FAIL  {label}: {str(err).splitlines()[0]}")
    return failures


def candidates(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> dict[str, Callable[[], torch.Tensor]]:
    return {
        "torch sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "auto": lambda: attnkit.attention(q, k, v, causal=causal),
        "chunked": lambda: attnkit.attention(q, k, v, causal=causal, backend="chunked"),
    }


def timings(lengths: list[int]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    b, h, d = 4, 16, 64
    print(f"\nbf16, B={b} H={h} D={d}; ms per call (ratio to torch SDPA)")
    for t in lengths:
        for causal in (False, True):
            q, k, v = (
                torch.randn(b, h, t, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)
            )
            cands = candidates(q, k, v, causal)
            for mode in ("fwd", "fwd+bwd"):
                base = None
                for name, fn in cands.items():
                    stmt = "fn()" if mode == "fwd" else "fn().sum().backward()"
                    ctx = torch.no_grad() if mode == "fwd" else torch.enable_grad()
                    with ctx:
                        m = benchmark.Timer(stmt, globals={"fn": fn}).blocked_autorange(
                            min_run_time=0.5
                        )
                    base = base or m.median
                    rows.append(
                        {
                            "T": t,
                            "causal": causal,
                            "mode": mode,
                            "candidate": name,
                            "ms": m.median * 1e3,
                            "ratio": m.median / base,
                        }
                    )
                    print(
                        f"T={t:>6} causal={causal!s:<5} {mode:<8} {name:<11} "
                        f"{m.median * 1e3:9.3f} ms  ({m.median / base:.2f}x)",
                        flush=True,
                    )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description="attnkit on CUDA: correctness and bf16 timings")
    parser.add_argument("--lengths", type=int, nargs="*", default=[1024, 4096, 16384])
    parser.add_argument("--json", help="write the timings and failures to this file")
    parser.add_argument("--device", default="cuda", help="'cpu' for a dry run of the script")
    args = parser.parse_args()
    global DEV
    DEV = args.device
    if DEV == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    print(f"torch {torch.__version__}, {name}")
    failures = check([b for b in attnkit.available_backends() if b != "reference"])
    rows = timings(args.lengths)
    if args.json:
        config = {"B": 4, "H": 16, "D": 64, "dtype": "bfloat16", "failures": failures}
        results.save(args.json, "gpu", rows, config=config, device=DEV)
    print(f"\n{len(failures)} failed checks" + (": " + ", ".join(failures) if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
