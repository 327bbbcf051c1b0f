"""attnkit.checkpoint, the old name of attnkit.weights: each name warns and is the new one."""

from __future__ import annotations

import re

import pytest

import attnkit
from attnkit import weights


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("save_checkpoint", "save"),
        ("load_checkpoint", "load"),
        ("load_state_dict", "load_state_dict"),
    ],
)
def test_each_old_name_warns_and_is_the_new_function(old: str, new: str) -> None:
    message = (
        f"attnkit.checkpoint.{old} is deprecated and will be removed in the next release: use "
        f"attnkit.weights.{new}"
    )
    with pytest.warns(DeprecationWarning, match=re.escape(message)):
        got = getattr(attnkit.checkpoint, old)
    assert got is getattr(weights, new)


def test_from_import_warns_too() -> None:
    with pytest.warns(DeprecationWarning, match=r"attnkit\.checkpoint\.load_checkpoint"):
        from attnkit.checkpoint import load_checkpoint  # noqa: F401


def test_the_old_module_is_not_public() -> None:
    assert "checkpoint" not in attnkit.__all__
    assert "weights" in attnkit.__all__
    with pytest.raises(AttributeError, match="has no attribute 'save'"):
        attnkit.checkpoint.save  # noqa: B018
