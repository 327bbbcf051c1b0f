"""``install()``: ``import flash_attn`` finds attnkit's functions where flash-attn is not installed,
and never shadows an installed flash-attn."""

from __future__ import annotations

import sys

import pytest

from attnkit import flash_attn as fa
from attnkit.flash_attn import _stand_in as stand_in


def test_install_aliases_only_without_flash_attn(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    real_find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "flash_attn" else real_find(name, *a),
    )
    try:
        assert "now import attnkit.flash_attn" in fa.install()
        from flash_attn import flash_attn_func  # type: ignore[import-not-found]
        from flash_attn.flash_attn_interface import (  # type: ignore[import-not-found]
            flash_attn_varlen_func,
        )

        assert flash_attn_func is fa.flash_attn_func
        assert flash_attn_varlen_func is fa.flash_attn_varlen_func
        assert fa.install() == "flash_attn already stands for attnkit.flash_attn"
    finally:
        stand_in._uninstall()
    assert "flash_attn" not in sys.modules
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert "nothing was aliased" in fa.install()
    assert "flash_attn" not in sys.modules
