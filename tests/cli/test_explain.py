"""`attnkit explain`: the report for a call described by flags, and its exit codes."""

from __future__ import annotations

import pytest

from attnkit.cli import main


def test_explain_padding_causal_picks_chunked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "-t", "4096", "--mask", "padding", "--causal"]) == 0
    out = capsys.readouterr().out
    assert "mask (1, 1, 1, 4096), causal" in out
    assert "auto picks: chunked" in out
    assert "would materialise a (Tq, Tk) = (4096, 4096) causal mask" in out


def test_explain_options_reach_the_call(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "explain",
        "-b",
        "2",
        "--heads",
        "8",
        "--kv-heads",
        "2",
        "-t",
        "5",
        "--kv-len",
        "9",
        "-d",
        "16",
        "--v-dim",
        "8",
        "--dtype",
        "bfloat16",
        "--bias",
        "heads",
        "--bias-grad",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "q (2, 8, 5, 16), k (2, 2, 9, 16), v (2, 2, 9, 8) bfloat16 on meta" in out
    assert "bias (8, 5, 9) (requires grad)" in out
    assert "auto picks: chunked" in out  # torch's math kernel would keep the probabilities


def test_forced_backend_that_cannot_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--weights", "--backend", "chunked"]) == 1
    assert "backend 'chunked' cannot serve this call" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--heads", "6", "--kv-heads", "4"], "the heads of q (H=6) must be a multiple"),
        (["--dropout", "1.5"], "dropout_p must be in [0, 1), got 1.5"),
        (["--backend", "flash"], "unknown backend 'flash'"),
        (["--device", "cuda"], "no CUDA device here"),
    ],
)
def test_bad_values_exit_2_with_the_reason(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["explain", *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("attnkit explain: error: ")
    assert message in err


def test_help_lists_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--batch",
        "--heads",
        "--kv-heads",
        "--q-len",
        "--kv-len",
        "--head-dim",
        "--v-dim",
        "--dtype",
        "--device",
        "--mask",
        "--causal",
        "--bias",
        "--bias-grad",
        "--dropout",
        "--weights",
        "--backend",
    ):
        assert flag in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-t", "-5"], "argument -t/--q-len: must be at least 1, got -5"),
        (["--kv-heads", "0"], "argument --kv-heads: must be at least 1, got 0"),
        (["-d", "x"], "argument -d/--head-dim: invalid int value: 'x'"),
        (["--mask", "window"], "window:N, documents:N, key-padding:N (a structured mask)"),
    ],
)
def test_bad_sizes_and_masks_are_argparse_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["explain", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("mask", "described"),
    [
        ("window:512", "mask sliding_window(left=512, right=0)"),
        ("documents:4", "mask documents(lengths=[1024, 1024, 1024, 1024])"),
        ("key-padding:1000", "mask key_padding(lengths=[1000, 1000])"),
    ],
)
def test_structured_masks(mask: str, described: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "-b", "2", "-t", "4096", "--mask", mask]) == 0
    assert described in capsys.readouterr().out
