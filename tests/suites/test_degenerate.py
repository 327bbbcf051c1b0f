"""Degenerate sizes (a 0 or a 1 in any of B, H, Hkv, Tq, Tk, Dk, Dv) through every backend, forward
and backward, against the float64 reference, in a child process.

An empty batch once killed the process with SIGFPE in the native kernel's backward: in-process,
such a crash would end the test run without a report. In a child it is one failing test that
names the case running when the child died. The child is this file run as a script
(``python tests/suites/test_degenerate.py``): it runs every case and prints one JSON line when a
case starts and one with its result.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

import attnkit
from attnkit import MultiHeadAttention, attention, masks
from attnkit.backends import Chunked
from attnkit.testing import assert_close

BASE = {"B": 2, "H": 4, "Hkv": 2, "Tq": 5, "Tk": 7, "Dk": 8, "Dv": 6}
MASKS = ("none", "causal", "key_padding", "sliding_window")


def sizes() -> list[dict[str, int]]:
    """The small base sizes, and each letter of them at 0 and at 1 (H stays a multiple of Hkv:
    with H = 1, Hkv = 1; with Hkv = 0, H = 0)."""
    out = [dict(BASE)]
    for letter in BASE:
        for value in (0, 1):
            s = dict(BASE, **{letter: value})
            if s["H"] == 1:
                s["Hkv"] = 1
            if s["Hkv"] == 0:
                s["H"] = 0
            if s not in out:
                out.append(s)
    return out


def mask_of(name: str, s: dict[str, int]) -> masks.Mask | None:
    if name == "causal":
        return masks.causal()
    if name == "key_padding":  # the first row sees 3 keys (or fewer), the second all
        return masks.key_padding([min(3, s["Tk"]), s["Tk"]][: s["B"]])
    if name == "sliding_window":
        return masks.sliding_window(2, 1)
    return None


def backends() -> dict[str, str | Chunked]:
    """Every registered backend by name (chunked runs the native kernel where it can), and the
    chunked backend's eager kernel."""
    # (flex serves the CPU without gradients only; tests/backends/flex/ checks that it refuses
    # empty sizes)
    out: dict[str, str | Chunked] = {
        name: name for name in attnkit.available_backends() if name != "flex"
    }
    out["chunked(native=False)"] = Chunked(native=False)
    return out


def _ours(err: BaseException) -> bool:
    """An attnkit refusal: a ValueError or TypeError raised in attnkit's own code."""
    frames = traceback.extract_tb(err.__traceback__)
    return isinstance(err, ValueError | TypeError) and "attnkit" in frames[-1].filename


def _run(backend: object, leaves: list[Tensor], cot: Tensor, mask: object) -> list[Tensor]:
    out = attention(*leaves, mask=mask, backend=backend)  # type: ignore[arg-type]
    grads = torch.autograd.grad(out, leaves, cot, allow_unused=True, materialize_grads=True)
    return [out, *grads]


def _cases() -> Iterator[dict[str, Any]]:
    """Every (sizes, mask, dtype, backend) case, each run and compared: the result lines."""
    for s in sizes():
        g = torch.Generator().manual_seed(0)
        shapes = [
            (s["B"], s["H"], s["Tq"], s["Dk"]),
            (s["B"], s["Hkv"], s["Tk"], s["Dk"]),
            (s["B"], s["Hkv"], s["Tk"], s["Dv"]),
        ]
        data = [torch.randn(*shape, generator=g, dtype=torch.float64) for shape in shapes]
        cot = torch.randn(s["B"], s["H"], s["Tq"], s["Dv"], generator=g, dtype=torch.float64)
        for mask_name in MASKS:
            refused = None
            try:
                mask = mask_of(mask_name, s)
                want = _run("reference", [t.clone().requires_grad_() for t in data], cot, mask)
            except (ValueError, TypeError) as err:
                if not _ours(err):
                    raise
                want, refused = [], f"{type(err).__name__}: {err}"
            for dtype in (torch.float64, torch.float32):
                for name, backend in backends().items():
                    case = {"sizes": s, "mask": mask_name, "dtype": str(dtype), "backend": name}
                    yield {"start": case}
                    yield {"case": case, **_one(backend, data, cot, mask, dtype, want, refused)}


def _one(
    backend: object,
    data: list[Tensor],
    cot: Tensor,
    mask: object,
    dtype: torch.dtype,
    want: list[Tensor],
    refused: str | None,
) -> dict[str, str]:
    leaves = [t.to(dtype).requires_grad_() for t in data]
    try:
        got = _run(backend, leaves, cot.to(dtype), mask)
    except Exception as err:
        if not _ours(err):
            return {"status": "error", "why": traceback.format_exc()}
        return {"status": "refused", "why": f"{type(err).__name__}: {err}"}
    if refused is not None:
        return {"status": "error", "why": f"served what the reference refused: {refused}"}
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        if a.shape != b.shape:
            return {"status": "wrong", "why": f"{what}: {tuple(a.shape)} != {tuple(b.shape)}"}
        try:
            assert_close(a, b.to(dtype), dtype=dtype)
        except AssertionError as err:
            return {"status": "wrong", "why": f"{what}: {err}"}
    return {"status": "ok", "why": ""}


def _training_steps() -> Iterator[dict[str, Any]]:
    """A MultiHeadAttention training step on an empty batch, through every backend: it runs,
    its gradients are zeros, and the step leaves the weights as they were."""
    for name, backend in backends().items():
        case = {"module": "MultiHeadAttention", "batch": 0, "backend": name}
        yield {"start": case}
        torch.manual_seed(0)
        mha = MultiHeadAttention(16, 4, num_kv_heads=2, backend=backend)
        opt = torch.optim.SGD(mha.parameters(), lr=0.1)
        before = [p.detach().clone() for p in mha.parameters()]
        x = torch.randn(0, 5, 16, requires_grad=True)
        try:
            out = mha(x, causal=True)
            out.sum().backward()
            opt.step()
        except Exception:
            yield {"case": case, "status": "error", "why": traceback.format_exc()}
            continue
        grads = [p.grad for p in mha.parameters()]
        fine = (
            out.shape == (0, 5, 16)
            and x.grad is not None
            and x.grad.shape == x.shape
            and all(g is None or bool(g.isfinite().all() and not g.any()) for g in grads)
            and all(torch.equal(a, p) for a, p in zip(before, mha.parameters(), strict=True))
        )
        why = "" if fine else "gradients not zero, or the step moved the weights"
        yield {"case": case, "status": "ok" if fine else "wrong", "why": why}


def main() -> None:
    # Printed as each case starts and ends (not collected first): a crash leaves its case named.
    for line in itertools.chain(_cases(), _training_steps(), [{"done": True}]):
        print(json.dumps(line), flush=True)


# --------------------------------------------------------------------------------------------------
# The test, in the parent process

Known = tuple[str, str, Callable[[dict[str, Any]], bool], str]

# Known bugs, each (backend, what, its cases, the error it gives): while one lasts its cases must
# still fail that way, so that the entry goes when the bug does.
KNOWN: list[Known] = []


def _known(case: dict[str, Any]) -> Known | None:
    for entry in KNOWN:
        if case["backend"] == entry[0] and entry[2](case):
            return entry
    return None


def test_the_sizes_cover_every_letter_at_0_and_1() -> None:
    for letter in BASE:
        for value in (0, 1):
            assert any(s[letter] == value for s in sizes()), (letter, value)
    assert all(s["Hkv"] == 0 or s["H"] % s["Hkv"] == 0 for s in sizes())
    assert {"reference", "sdpa", "chunked", "chunked(native=False)"} <= set(backends())


def test_degenerate_sizes_run_and_match_the_reference() -> None:
    child = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, timeout=600, check=False
    )
    lines = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    started = [line["start"] for line in lines if "start" in line]
    results = [line for line in lines if "status" in line]
    where = f"the last case started: {started[-1]}" if started else "before any case"
    for signal in ("Floating point exception", "Segmentation"):
        assert signal not in child.stderr, f"{signal} in {where}\n{child.stderr[-3000:]}"
    assert child.returncode == 0, (
        f"the child exited with {child.returncode} in {where}\n{child.stderr[-3000:]}"
    )
    assert lines[-1:] == [{"done": True}], f"the child stopped in {where}"
    assert len(results) == len(started)
    bad, fixed = [], []
    for line in results:
        known = _known(line["case"])
        if line["status"] == "refused":  # an attnkit error: the backend does not serve the call
            continue
        if known is None:
            if line["status"] != "ok":
                bad.append(f"{line['case']}: {line['status']}: {line['why']}")
        elif line["status"] == "ok":
            fixed.append(f"{line['case']}: passes now ({known[1]}): remove it from KNOWN")
        elif known[3] not in line["why"]:
            bad.append(f"{line['case']}: {line['status']}: {line['why']}")
    assert not bad, "\n".join(bad[:10])
    assert not fixed, "\n".join(fixed[:10])
    # The test must be able to fail: every backend served (and was compared on) each letter at 0
    # and at 1 (but those a known bug breaks), and the training step; not only refused them.
    served = [line["case"] for line in results if line["status"] == "ok"]
    for backend in backends():
        mine = [c for c in served if c["backend"] == backend and "sizes" in c]
        for letter in ("B", "H", "Tq", "Tk", "Dk", "Dv"):
            for value in (0, 1):
                if _known({"backend": backend, "sizes": dict(BASE, **{letter: value})}):
                    continue
                assert any(c["sizes"][letter] == value for c in mine), (backend, letter, value)
        step = {"module": "MultiHeadAttention", "batch": 0, "backend": backend}
        assert step in served or _known(step), step


if __name__ == "__main__":
    main()
