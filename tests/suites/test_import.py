"""``import attnkit``: on a machine without numpy it imports, and writes nothing to stderr."""

from __future__ import annotations

import subprocess
import sys

# numpy is optional. torch's own import, without it, warns "Failed to initialize NumPy" (the README
# says so); attnkit's import must add nothing: no numpy import, no tensor.numpy() or
# torch.from_numpy() at import time, no warning. Everything written to stderr while attnkit and
# its command's modules are imported, by Python or by C++, is caught and printed to stdout.
CHILD = r"""
import contextlib, io, os, sys, tempfile, warnings

sys.modules["numpy"] = None  # `import numpy` raises ImportError, as where it is not installed
import torch  # what torch itself writes without numpy is torch's

warnings.simplefilter("always")  # a warning torch gave once already is shown again
with tempfile.TemporaryFile(mode="w+") as caught:
    saved = os.dup(2)
    os.dup2(caught.fileno(), 2)
    try:
        with contextlib.redirect_stderr(io.StringIO()) as python:
            import attnkit
            import attnkit.cli
    finally:
        os.dup2(saved, 2)
    caught.seek(0)
    print(repr(python.getvalue() + caught.read()))
"""


def test_import_without_numpy_writes_nothing_to_stderr() -> None:
    got = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "''"
