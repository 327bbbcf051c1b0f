"""Run a function on several gloo ranks, each a fresh process, and collect what each returns.

The children turn on attnkit's shape checks (``ATTNKIT_SHAPE_CHECKS=1``) before they import
attnkit, as conftest.py does for the test process. A rank's exception fails the test with that
rank's traceback; a run that outlives its timeout is killed, so a hang cannot outlive the test.
This module must not import attnkit itself (the switch has to come first in a child).
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest

# A collective or receive that waits longer than this raises in the child instead of hanging.
PROCESS_GROUP_TIMEOUT_S = 30


def _child(
    module: str,
    name: str,
    rank: int,
    world_size: int,
    store: str,
    results: Any,
    wait: float,
    backend: str,
) -> None:
    try:
        os.environ["ATTNKIT_SHAPE_CHECKS"] = "1"
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # W ranks share this machine's cores
        fn = getattr(importlib.import_module(module), name)
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank, before the group exists
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=wait),
        )
        try:
            results.put((rank, True, fn(rank, world_size)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[[int, int], Any],
    world_size: int,
    *,
    timeout: float = 90,
    group_timeout: float = PROCESS_GROUP_TIMEOUT_S,
    backend: str = "gloo",
) -> list[Any]:
    """``[fn(0, W), ..., fn(W-1, W)]``, each called in its own process inside a process group
    (gloo; nccl with one GPU per rank).

    ``fn`` must be a module-level function; what it returns must pickle. ``group_timeout``: how
    long a collective or receive may wait before it raises in the child.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")  # a FileStore: no port to find, none to collide
        procs = [
            ctx.Process(
                target=_child,
                args=(
                    fn.__module__,
                    fn.__qualname__,
                    rank,
                    world_size,
                    store,
                    results,
                    group_timeout,
                    backend,
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(got) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"ranks {sorted(set(range(world_size)) - set(got))} hung")
                try:
                    rank, ok, payload = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead and not set(dead) <= set(got):
                        pytest.fail(f"rank(s) {dead} died without a word (exit codes)")
                    continue
                got[rank] = (ok, payload)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    failures = [f"rank {r}:\n{payload}" for r, (ok, payload) in sorted(got.items()) if not ok]
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    return [got[r][1] for r in range(world_size)]
