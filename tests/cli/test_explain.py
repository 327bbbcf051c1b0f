"""`attnkit explain`: the report for a call described by flags, and its exit codes."""

from __future__ import annotations

import re

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
        (["--device", "gpu0"], "--device 'gpu0': not a device (cpu, cuda, cuda:1, meta...)"),
        (["-b", "99999999999", "-t", "99999999999"], "more than torch holds (9223372036854775807)"),
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
        (["-t", "-5"], "argument -t/--q-len: must be at least 0, got -5"),
        (["--heads", "0"], "argument --heads: must be at least 1, got 0"),
        (["--kv-heads", "0"], "argument --kv-heads: must be at least 1, got 0"),
        (["-d", "x"], "argument -d/--head-dim: invalid int value: 'x'"),
        (["--mask", "window"], "window:N, documents:N, key-padding:N (a structured mask)"),
        (["--mask", "documents:0"], "invalid mask 'documents:0': N must be at least 1, got 0"),
        (["--mask", "window:-1"], "invalid mask 'window:-1': N must be at least 0, got -1"),
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


@pytest.mark.parametrize(
    ("args", "call"),
    [
        # No keys: every query sees nothing (output 0), a call attention() serves.
        (["-t", "4", "--kv-len", "0", "--causal", "--mask", "padding"], "k (1, 8, 0, 64)"),
        (["-t", "0"], "q (1, 8, 0, 64), k (1, 8, 0, 64)"),
        (["-b", "0", "-t", "4"], "q (0, 8, 4, 64)"),
        (["-t", "4", "-d", "0", "--v-dim", "0"], "q (1, 8, 4, 0), k (1, 8, 4, 0), v (1, 8, 4, 0)"),
        (["-t", "4", "--mask", "window:0"], "mask sliding_window(left=0, right=0)"),
        (["-t", "4", "--mask", "key-padding:0"], "mask key_padding(lengths=[0])"),
    ],
)
def test_sizes_of_zero_are_calls_too(
    args: list[str], call: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["explain", *args]) == 0
    out = capsys.readouterr().out
    assert call in out
    assert "auto picks: " in out


def test_meta_says_what_it_leaves_out(capsys: pytest.CaptureFixture[str]) -> None:
    # chunked's notes need a real device; on meta the report says which are missing and how to
    # get them, and --device cpu gives them.
    window = ["explain", "-t", "4096", "--mask", "window:512"]
    assert main(window) == 0
    out = capsys.readouterr().out
    assert "auto picks: chunked" in out
    assert "block plan: " not in out
    assert out.rstrip().endswith(
        "left out on meta, a device without data: the chunked backend's block plan and whether "
        "its native kernel would run (--device cpu tells them)"
    )
    assert main([*window, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "block plan: " in out
    assert "left out" not in out
    # Without a mask there is no block plan to leave out.
    assert main(["explain", "-t", "64", "--bias", "heads", "--bias-grad"]) == 0
    assert (
        capsys.readouterr()
        .out.rstrip()
        .endswith(
            "left out on meta, a device without data: whether the chunked backend's native kernel "
            "would run (--device cpu tells it)"
        )
    )
    # Nothing is left out when another backend is chosen.
    assert main(["explain", "-t", "64"]) == 0
    out = capsys.readouterr().out
    assert "auto picks: sdpa" in out
    assert "left out" not in out


@pytest.mark.parametrize("mask", ["full", "padding", "query"])
def test_a_dense_mask_on_a_real_device_hides_no_key(
    mask: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The command knows a dense mask's shape, not its content: the block plan on a real device
    # counts every block, never what uninitialised memory happened to hold.
    args = ["explain", "-t", "512", "--mask", mask, "--bias", "heads", "--bias-grad"]
    assert main([*args, "--device", "cpu"]) == 0
    plan = re.search(
        r"block plan: (\d+) x (\d+) blocks .*: (\d+) computed, (\d+) with a mask",
        capsys.readouterr().out,
    )
    assert plan is not None
    assert int(plan[1]) * int(plan[2]) == int(plan[3])
    assert plan[4] == "0"


def test_any_size_is_described_without_allocating(capsys: pytest.CaptureFixture[str]) -> None:
    # q, k and v of 2 * 10^13 bytes each: nothing of that size is allocated, on a real device too.
    args = ["explain", "-b", "100000", "-t", "100000", "--mask", "window:512", "--device", "cpu"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "q (100000, 8, 100000, 64)" in out
    assert "block plan: " in out
