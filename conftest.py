"""Test configuration: runtime shape checks and hypothesis profiles.

``ATTNKIT_SHAPE_CHECKS=1`` must be set before attnkit is first imported: then every public signature
annotated with jaxtyping (``Float[Tensor, "*batch H Tq Dk"]``) is checked with beartype on each call
during the tests (see ``attnkit._base.shapes.shape_checked``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

os.environ["ATTNKIT_SHAPE_CHECKS"] = "1"
import attnkit

if not attnkit._base.shapes.SHAPE_CHECKS:
    raise RuntimeError("attnkit was imported before conftest.py could turn on its shape checks")

from tests.helpers import attnkit_checks_only  # imports attnkit: after the switch above

settings.register_profile(
    "default",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# At most two threads a test; when pytest-xdist runs the tests in several processes (`make test`
# does), each takes its share of the cores, so that the processes do not fight over them.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(torch.get_num_threads() // _workers, 2)))


@pytest.fixture
def no_shape_checks() -> Iterator[None]:
    """Turn off the jaxtyping checks, so that a test sees attnkit's own argument validation."""
    with attnkit_checks_only():
        yield
