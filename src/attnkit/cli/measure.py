"""Measuring helpers shared by ``attnkit bench`` and the scripts in ``benchmarks/``.

* :func:`time_side_by_side` times several callables with ``torch.utils.benchmark`` in interleaved
  rounds, so that a machine's slow minute hurts every candidate alike, and reports medians.
* :func:`extra_peak_memory` runs a callable in a fresh process and reports how far the process's
  peak resident memory rose above what it held before the call, minus the result itself. CPU
  tensors have no allocator statistics in torch; the kernel's high-water mark (``VmHWM``, reset
  through ``/proc/self/clear_refs``) is the honest measure of what a call needs. The child runs
  with glibc's mmap threshold fixed at 64 KiB, so every sizeable buffer is returned to the system
  when freed and the warm-up call cannot leave a cache behind that hides the measured call's
  allocations. Linux only.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing as mp
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch

from .._base.env import number


def time_side_by_side(
    fns: dict[str, Callable[[], object]], *, rounds: int = 3, min_run_time: float = 0.5
) -> dict[str, float]:
    """Median seconds per call of each callable, measured in ``rounds`` interleaved rounds."""
    # Imported here, not with the module: torch.utils.benchmark imports torch.utils.cpp_extension,
    # which on a CUDA build of torch without a GPU logs "No CUDA runtime is found" to stderr, and
    # every `attnkit` command (--help included) imports this module.
    from torch.utils import benchmark

    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: first-call costs (kernel selection, allocations)
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
            samples[name].append(timer.blocked_autorange(min_run_time=min_run_time).median)
    return {name: statistics.median(s) for name, s in samples.items()}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _measure_child(
    make: Callable[..., tuple[Callable[[], Any], int]], args: tuple[Any, ...], queue: Any
) -> None:
    threads = number("ATTNKIT_BENCH_THREADS", torch.get_num_threads(), minimum=1, integer=True)
    torch.set_num_threads(int(threads))
    fn, result_bytes = make(*args)
    fn()  # warm-up: libraries and per-thread buffers are not the call's own memory
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS high-water mark to the current RSS
    before = _status_kib("VmRSS")
    out = fn()
    peak = _status_kib("VmHWM")
    del out
    queue.put(max(0, (peak - before) * 1024 - result_bytes))


# Fixed thresholds (setting them disables glibc's dynamic adjustment): big blocks are mmapped and
# unmapped on free, and the heap is trimmed, so resident memory follows live memory.
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def extra_peak_memory(
    make: Callable[..., tuple[Callable[[], Any], int]], *args: Any, timeout: float = 1800
) -> int | None:
    """Bytes a call needs beyond its inputs and its result, measured in a fresh process.

    ``make(*args)`` runs in the child and returns ``(fn, result_bytes)``: it builds the inputs, and
    ``fn()`` makes the call. ``make`` must be importable (a module-level function). Returns None
    where the measurement is not possible (not Linux).
    """
    if not os.path.exists("/proc/self/clear_refs"):
        return None
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure_child, args=(make, args, queue))
    saved = {k: os.environ.get(k) for k in _MALLOC_ENV}
    os.environ.update(_MALLOC_ENV)  # a spawned child inherits the environment at start
    try:
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    proc.join(timeout)
    if proc.exitcode != 0:
        proc.kill()
        raise RuntimeError(f"memory measurement of {make.__name__}{args} failed ({proc.exitcode})")
    result: int = queue.get(timeout=10)
    return result
