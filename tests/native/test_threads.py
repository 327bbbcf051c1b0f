"""How the native kernel's forward and decode share a call between threads (``csrc/share.h``).

In a parallel region, or, for a while after a region's thread came late (always with
``ATTNKIT_SHARE=helpers``), with threads of torch's inter-op pool: the calling thread starts on
the work at once, they join when they get a core, and the call waits only for those that joined.
Each test runs in a child process (they set torch's thread counts, which a process sets once, and
a hang must fail the test rather than the suite): a call whose helper cannot start (the only
inter-op thread held by other work) returns, right, without it; the helper that starts after the
call returned changes nothing; a child made by ``fork()`` after calls that shared their work calls
the kernel and exits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attnkit import _native

pytestmark = pytest.mark.skipif(not _native.load(), reason=f"native kernel: {_native.status()[1]}")

# A decode call (one query, 20,000 keys: a call the kernel splits between threads) and a causal
# forward (300 queries), each with its float64 reference; and the largest difference of the
# kernel's output from it, taken in numpy (in a child made by fork(), torch's own parallel
# regions may wait forever for the parent's threads).
WORST = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import attnkit

    def cases() -> list:
        out = []
        for tq, tk, causal in ((1, 20000, False), (300, 2000, True)):
            g = torch.Generator().manual_seed(tq)
            q = torch.randn(2, 8, tq, 64, generator=g)
            k, v = (torch.randn(2, 2, tk, 64, generator=g) for _ in range(2))
            ref = attnkit.attention(
                q.double(), k.double(), v.double(), backend="reference", causal=causal
            )
            out.append((q, k, v, causal, ref.numpy()))
        return out

    def worst(cs: list) -> float:
        out = 0.0
        for q, k, v, causal, ref in cs:
            got = attnkit.attention(q, k, v, backend="chunked", causal=causal)
            out = max(out, float(abs(got.numpy().astype("float64") - ref).max()))
        return out

    def exit_code_of(pid: int) -> int:
        # The forked child's exit code; a child still running after a minute hung: killed,
        # and this process exits saying so.
        for _ in range(1200):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        sys.exit("the child hung")
    """
)


def run_child(tmp_path: Path, body: str, **env: str) -> str:
    script = tmp_path / "child.py"  # a file: TorchScript reads the source of what it compiles
    script.write_text(WORST + textwrap.dedent(body))
    child = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    return child.stdout


def test_a_call_does_not_wait_for_a_helper_that_cannot_start(tmp_path: Path) -> None:
    out = run_child(
        tmp_path,
        """
        torch.set_num_interop_threads(1)
        torch.set_num_threads(2)

        @torch.jit.script
        def hold(flag: torch.Tensor) -> int:
            n = 0
            while bool(flag[0] == 0):
                n += 1
            return n

        @torch.jit.script
        def start(flag: torch.Tensor) -> torch.jit.Future[int]:
            return torch.jit.fork(hold, flag)

        cs = cases()
        flag = torch.zeros(1, dtype=torch.int64)
        held = start(flag)  # the only inter-op thread spins until the flag is set
        errors = [worst(cs), worst(cs)]
        flag.fill_(1)
        held.wait()
        errors.append(worst(cs))  # the helpers queued above have run (and found nothing to do)
        print(max(errors))
        """,
        ATTNKIT_SHARE="helpers",  # as after a parallel region's thread came late
    )
    assert float(out.split()[-1]) < 1e-5


def test_a_forked_child_calls_the_kernel_after_its_parent_shared_calls(tmp_path: Path) -> None:
    out = run_child(
        tmp_path,
        """
        torch.set_num_threads(2)
        cs = cases()
        parent = worst(cs)
        pid = os.fork()
        if pid == 0:
            code = 4
            try:
                code = 0 if worst(cs) < 1e-5 else 3
            finally:
                os._exit(code)
        print(parent, exit_code_of(pid))
        """,
    )
    parent, child = out.split()[-2:]
    assert float(parent) < 1e-5
    assert child == "0"


def test_a_forked_child_trains_after_its_parent_ran_inference_calls(tmp_path: Path) -> None:
    # The parent's calls shared their work (forward, decode) but never checked inputs for NaN
    # and inf across threads nor ran a backward: the child's finiteness check (of inputs large
    # enough to share it) and its backward (of a call small enough that torch's own operations
    # run on one thread) must still run on the calling thread alone, not wait for the parent's.
    out = run_child(
        tmp_path,
        """
        import faulthandler
        torch.set_num_threads(2)
        cs = cases()
        worst(cs)
        big_q, big_k, big_v, _, big_ref = cs[1]
        big_q.requires_grad_()
        g = torch.Generator().manual_seed(1)
        small = [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
                 for s in ((2, 4, 64, 32), (2, 2, 64, 32), (2, 2, 64, 32))]
        ref = attnkit.attention(*small, backend="reference", causal=True)
        refs = [t.numpy() for t in torch.autograd.grad(ref.sum(), small)]
        inputs = [t.detach().float().requires_grad_() for t in small]
        ones = torch.ones(2, 4, 64, 32)
        pid = os.fork()
        if pid == 0:
            faulthandler.dump_traceback_later(50, exit=True)
            code = 4
            try:
                out = attnkit.attention(big_q, big_k, big_v, backend="chunked", causal=True)
                err = float(abs(out.detach().numpy().astype("float64") - big_ref).max())
                out = attnkit.attention(*inputs, backend="chunked", causal=True)
                grads = torch.autograd.grad(out, inputs, ones)
                for got, want in zip(grads, refs):
                    err = max(err, float(abs(got.numpy().astype("float64") - want).max()))
                code = 0 if err < 1e-4 else 3
            finally:
                os._exit(code)
        print(exit_code_of(pid))
        """,
    )
    assert out.split()[-1] == "0"


def test_a_misspelt_way_warns_when_the_kernel_loads_and_the_default_runs() -> None:
    code = (
        "import torch, attnkit; q = torch.randn(1, 1, 1, 8); "
        "print(float(attnkit.attention(q, q, q, backend='chunked').sum()))"
    )
    child = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "ATTNKIT_SHARE": "helper"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert "ATTNKIT_SHARE='helper', which is none of timed, region, helpers" in child.stderr
