"""The demo's run folder: the swap that replaces an earlier run, and Ctrl-C during it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from attnkit.cli import _demo_run


def listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_failed_swap_puts_the_earlier_run_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for name in _demo_run.RESULT_FILES:  # an earlier run's folder
        (out / name).write_text(f"earlier {name}")
    before = listing(out)
    staging = tmp_path / ".out.new-test"
    staging.mkdir()
    (staging / "config.json").write_text("{}")
    real_rename = _demo_run.os.rename

    def rename(src: object, dst: object) -> None:
        if Path(str(src)) == staging:
            raise OSError(5, "Input/output error", str(src))
        real_rename(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(_demo_run.os, "rename", rename)
    with pytest.raises(OSError, match="Input/output error"):
        _demo_run.swap_in(staging, out, out)
    assert listing(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.new-test", "out"]


def test_ctrl_c_during_the_swap_takes_effect_after_it() -> None:
    done = []

    def swap() -> None:
        with _demo_run._interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("the block ran to its end")

    with pytest.raises(KeyboardInterrupt):
        swap()
    assert done == ["the block ran to its end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
