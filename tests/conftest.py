"""Hypothesis profiles: ``ci`` (set ``CI=1``, as ``.ci/run`` does) draws the same examples on every
run, so a red build always names a change; the default explores new examples each run."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
