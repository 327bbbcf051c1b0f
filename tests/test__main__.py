"""``python -m attnkit`` runs the ``attnkit`` command: the same usage, options and exit codes."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

# argparse wraps --help at the terminal's width: one width for every run compared.
ENV = {**os.environ, "COLUMNS": "100"}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=ENV, timeout=300
    )


def test_python_m_attnkit_prints_the_commands_help() -> None:
    got = run("-m", "attnkit", "--help")
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("usage: attnkit [-h] [--version] command ...")
    # The entry point the `attnkit` script calls, attnkit.cli:main.
    want = run("-c", "import sys; from attnkit.cli import main; sys.exit(main())", "--help")
    assert got.stdout == want.stdout
    script = pathlib.Path(sys.executable).with_name("attnkit")
    if script.is_file():  # the script pip installed beside this interpreter
        installed = subprocess.run(
            [str(script), "--help"], capture_output=True, text=True, env=ENV, timeout=300
        )
        assert got.stdout == installed.stdout


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["explain", "-t", "4", "--kv-len", "0"], 0, "auto picks: "),
        (["explain", "--heads", "0"], 2, "argument --heads: must be at least 1, got 0"),
    ],
)
def test_python_m_attnkit_runs_the_command_and_keeps_its_exit_code(
    args: list[str], code: int, words: str
) -> None:
    got = run("-m", "attnkit", *args)
    assert got.returncode == code, got.stderr
    assert words in got.stdout + got.stderr
