"""The attnkit command itself: what every subcommand shares."""

from __future__ import annotations

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
