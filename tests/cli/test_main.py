"""The attnkit command itself: what every subcommand shares."""

from __future__ import annotations

import subprocess
import sys

import pytest

from attnkit.cli import main


@pytest.mark.parametrize("command", ["demo", "bench", "explain"])
def test_help_is_plain_text(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert f"attnkit {command}" in text
    for markup in ("``", "**", ":func:", ":class:"):
        assert markup not in text


def test_the_command_imports_no_cuda_probe() -> None:
    # torch.utils.cpp_extension logs "No CUDA runtime is found" on import with a CUDA build of
    # torch and no GPU; `attnkit --help` must not import it (only `attnkit bench`, when it times).
    code = "import sys, attnkit.cli; print(sorted(m for m in sys.modules if 'cpp_extension' in m))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
