"""attnkit.backends.flex, the old name of attnkit.backends.torch_flex: each name warns and is the
new one."""

from __future__ import annotations

import importlib
import re

import pytest

from attnkit.backends import torch_flex


@pytest.mark.parametrize("name", ["Flex", "flex_available"])
def test_each_old_name_warns_and_is_the_new_one(name: str) -> None:
    old = importlib.import_module("attnkit.backends.flex")
    message = (
        f"attnkit.backends.flex.{name} is deprecated and will be removed in the next release: "
        f"use attnkit.backends.torch_flex.{name}"
    )
    with pytest.warns(DeprecationWarning, match=re.escape(message)):
        got = getattr(old, name)
    assert got is getattr(torch_flex, name)


def test_the_registry_name_stays_flex() -> None:
    assert torch_flex.Flex().name == "flex"
