"""Hypothesis profiles: ``ci`` (set ``CI=1``, as ``.ci/run`` does) draws the same examples on every
run, so a red build always names a change; the default explores new examples each run. And the
package's build, started as the session starts when its test is to run (it takes a minute or
more, in a process of its own), or first among a worker's tests when pytest-xdist runs them."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


# The modules whose build was started here (their STARTED lists, emptied by their test), and
# the folders the builds were made in.
_BUILDS: list[Any] = []


def _in_worker() -> bool:
    """Whether this process is one of pytest-xdist's workers (``make test`` runs several)."""
    return "PYTEST_XDIST_WORKER" in os.environ


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Across several workers the build cannot be started for the one that will run its test:
    # the test starts it, first, so that it runs beside the other workers' tests.
    if _in_worker():
        items.sort(key=lambda item: item.name != "test_wheel_and_sdist_build_install_and_work")


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly or _in_worker():
        return
    for item in session.items:
        if item.name == "test_wheel_and_sdist_build_install_and_work":
            module = item.module  # type: ignore[attr-defined]
            folder = Path(tempfile.mkdtemp(prefix="attnkit-build-"))
            module.STARTED.append(module.Build(folder))
            _BUILDS.append((module, folder))
            return


def pytest_sessionfinish(session: pytest.Session) -> None:
    for module, folder in _BUILDS:
        for left in module.STARTED:  # not taken: the session stopped before its test
            left.proc.kill()
            left.proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
