"""``benchmarks/gpu_check.py``, the script a GPU runs unattended, kept from rotting: its
``--smoke`` mode runs every part of it on the CPU at tiny sizes (each kind of call against the
float64 reference, the baselines written by hand, the timings, the JSON the benchmarks page
draws)."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def gpu_check() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCHMARKS))  # the script imports its neighbour results.py
    try:
        yield importlib.import_module("gpu_check")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_the_smoke_run_checks_and_times_every_kind_of_call(
    gpu_check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--smoke", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    names = [kind.name for kind in gpu_check.kinds()]
    for name in names:
        assert f"ok    {name}" in printed, printed
    assert "0 failed checks" in printed
    data = json.loads(out.read_text())
    assert data["benchmark"] == "gpu"
    assert data["config"]["failures"] == []
    rows = data["rows"]
    # every kind timed, each row in the form the benchmarks page's gpu section reads
    assert {r["call"] for r in rows} == set(names)
    for row in rows:
        assert {"T", "causal", "mode", "candidate", "ms", "ratio"} <= set(row)
    assert {r["mode"] for r in rows} == {"fwd", "fwd+bwd"}
    mine = [r for r in rows if r["candidate"].startswith("attnkit")]
    assert all(r["ratio"] > 0 for r in mine)


def test_a_wrong_baseline_fails_its_check(
    gpu_check: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    # the check compares the baseline written by hand with the reference too: a mask_mod that
    # is not the call's mask is caught, so the timings compare the same arithmetic
    kind = next(k for k in gpu_check.kinds() if k.name.startswith("sliding window"))
    wrong = gpu_check.Kind(kind.name, kind.call, lambda i, flex: flex(i["q"], i["k"], i["v"]))
    setup = gpu_check.setup_of(gpu_check.argparse.Namespace(smoke=True, budget=1.0))
    tally = gpu_check.Tally()
    gpu_check.check(setup, wrong, gpu_check.Flex(setup), tally)
    assert tally.failures == [kind.name]
    assert "the baseline by hand" in capsys.readouterr().out
