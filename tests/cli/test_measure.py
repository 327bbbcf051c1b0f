"""The measuring helpers: interleaved timing reports a median per candidate, and the peak-memory
measurement sees a call's temporary buffers but not its result."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from attnkit.cli.measure import extra_peak_memory, time_side_by_side

MIB = 1024 * 1024


def test_time_side_by_side_warms_up_and_times_each_candidate() -> None:
    calls = {"sleep": 0, "noop": 0}

    def sleep() -> None:
        calls["sleep"] += 1
        time.sleep(0.002)

    def noop() -> None:
        calls["noop"] += 1

    medians = time_side_by_side({"sleep": sleep, "noop": noop}, rounds=2, min_run_time=0.01)
    assert list(medians) == ["sleep", "noop"]
    assert medians["sleep"] >= 0.002  # a sleep lasts at least as long as asked
    assert medians["noop"] > 0
    assert calls["sleep"] >= 3  # the warm-up, then at least one call per round
    assert calls["noop"] >= 3


def temporary_and_result(
    temporary_mib: int, result_mib: int
) -> tuple[Callable[[], torch.Tensor], int]:
    """A call that writes a ``temporary_mib`` buffer, frees it, and returns ``result_mib``."""

    def fn() -> torch.Tensor:
        tmp = torch.ones(temporary_mib * MIB // 4)
        out = torch.ones(result_mib * MIB // 4)
        del tmp
        return out

    return fn, result_mib * MIB


def test_extra_peak_memory_counts_temporaries_not_the_result() -> None:
    extra = extra_peak_memory(temporary_and_result, 32, 16)
    if extra is None:
        pytest.skip("peak-memory measurement needs Linux's /proc")
    assert 28 * MIB <= extra <= 44 * MIB  # the 32 MiB temporary, not the 16 MiB result
