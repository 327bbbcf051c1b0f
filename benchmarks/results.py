"""The JSON file every benchmark script writes with ``--json PATH``, and the machine it records.

One object per file::

    {
      "schema": 1,
      "benchmark": "backends",              # which script: the report picks its tables by this
      "command": "benchmarks/bench_backends.py --quick --json ...",
      "date": "2026-01-31T12:00:00+00:00",  # UTC, when the run finished
      "environment": {...},                  # environment() below
      "config": {...},                       # the fixed sizes of the run (B, H, D, dtype, ...)
      "rows": [{...}, ...]                   # one object per measurement; keys per benchmark
    }

``benchmarks/report.py`` turns a folder of these files into the tables and plots of the
documentation's benchmarks page.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

import attnkit

SCHEMA = 1


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# torch.cpu's checks of what the CPU computes in, and the names they are reported by.
_CPU_FEATURES = {
    "_is_avx2_supported": "AVX2",
    "_is_avx512_supported": "AVX-512",
    "_is_avx512_bf16_supported": "AVX512-BF16",
    "_is_amx_tile_supported": "AMX",
    "_is_amx_fp16_supported": "AMX-FP16",
}


def cpu_features() -> list[str]:
    """The vector and matrix units of this CPU that attnkit's and torch's kernels choose by
    (CPUs of one model name differ: "AMD EPYC" names AVX2-only and AVX-512 parts alike)."""
    return [name for check, name in _CPU_FEATURES.items() if getattr(torch.cpu, check, bool)()]


def environment(device: str | torch.device = "cpu") -> dict[str, Any]:
    """What produced a measurement: the machine, its threads and the software versions."""
    device = torch.device(device)
    env: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_features": cpu_features(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device.type,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "attnkit": attnkit.__version__,
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def save(
    path: str | os.PathLike[str],
    benchmark: str,
    rows: list[dict[str, Any]],
    *,
    config: dict[str, Any] | None = None,
    device: str | torch.device = "cpu",
) -> None:
    """Write one benchmark run to ``path`` in the format above."""
    result = {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "command": " ".join([Path(os.path.relpath(sys.argv[0])).as_posix(), *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(device),
        "config": config or {},
        "rows": rows,
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
