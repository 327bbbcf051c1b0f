"""`attnkit bench`: rows for every candidate, and a memory measurement that sees what it should."""

from __future__ import annotations

import json

import pytest

from attnkit.cli import bench, main
from attnkit.cli.measure import extra_peak_memory

TINY = bench.Scenario("core", 1, 128, 2, 16, causal=True, padding=False)


@pytest.mark.parametrize(
    ("scenario", "names"),
    [(TINY, bench.CORE), (bench.Scenario("module", 2, 32, 4, 32, padding=True), bench.MODULE)],
)
def test_candidates_agree_with_each_other(scenario: bench.Scenario, names: tuple[str, ...]) -> None:
    # The rows must time the same computation: outputs agree before anything is timed.
    outs = {n: bench.build(scenario, n)[0]() for n in names}
    for n in names[1:]:
        assert (outs[n] - outs[names[0]]).abs().max() < 1e-5, n


def test_rows_and_table() -> None:
    rows = bench.run_scenarios([TINY], rounds=1, min_run_time=0.01, memory=False)
    assert [r.candidate for r in rows] == list(bench.CORE)
    assert rows[0].ratio == 1.0
    assert all(r.ms > 0 for r in rows)
    table = bench.format_table(rows)
    assert table.splitlines()[0] == "| scenario | candidate | ms | ratio | extra MiB |"
    assert "| core: B=1 H=2 T=128 D=16, causal | naive |" in table


def test_naive_needs_the_score_matrices_and_sdpa_does_not() -> None:
    s = bench.Scenario("core", 1, 1024, 8, 16)
    scores = 8 * 1024 * 1024 * 4  # one float32 (H, T, T) score tensor: 32 MiB
    naive = extra_peak_memory(bench.build, s, "naive")
    fused = extra_peak_memory(bench.build, s, "torch sdpa")
    assert naive is not None
    assert fused is not None
    assert naive >= scores
    assert fused < scores / 8


def test_json_output(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench, "QUICK", [TINY])
    assert main(["bench", "--quick", "--json", "--no-memory"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["candidate"] for r in rows} == set(bench.CORE)
    assert all(r["extra_mib"] is None for r in rows)
