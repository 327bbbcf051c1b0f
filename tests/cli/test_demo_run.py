"""The demo's run folder: the swap that replaces an earlier run, and Ctrl-C during it."""

from __future__ import annotations

import signal
from collections.abc import Iterator
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


@pytest.fixture
def sigint() -> Iterator[None]:
    """Restores the process's SIGINT handler after a test that sets one (a process started in the
    background by a shell without job control inherits SIGINT ignored)."""
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


def _swap(done: list[str]) -> None:
    with _demo_run._interrupts_deferred():
        # raise_signal: delivered to this thread (os.kill may hand it to one of torch's threads,
        # whose handler can run after the block on a busy machine)
        signal.raise_signal(signal.SIGINT)
        done.append("the block ran to its end")


def test_ctrl_c_during_the_swap_takes_effect_after_it(sigint: None) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        _swap(done)
    assert done == ["the block ran to its end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_stays_ignored_where_it_was(sigint: None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    done: list[str] = []
    _swap(done)
    assert done == ["the block ran to its end"]
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
