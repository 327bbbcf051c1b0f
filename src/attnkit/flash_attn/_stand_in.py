"""Standing in for flash-attn: ``import flash_attn`` finds :mod:`attnkit.flash_attn` where
flash-attn is not installed."""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["install"]

# The package whose functions stand in for flash-attn's.
_PACKAGE = __name__.rpartition(".")[0]


def install() -> str:
    """Let ``import flash_attn`` find this module when flash-attn is not installed.

    Registers ``sys.modules["flash_attn"]`` and ``sys.modules["flash_attn.flash_attn_interface"]``
    as aliases of :mod:`attnkit.flash_attn`, so code that does ``from flash_attn import
    flash_attn_func`` runs unchanged. A real flash-attn install is never shadowed: if one can be
    imported, nothing is registered. Returns what it did, in one line.

    Only the attention functions are there: ``flash_attn.bert_padding``, ``flash_attn.layers``,
    ``flash_attn.ops`` and ``flash_attn.modules`` are not.
    """
    this = sys.modules[_PACKAGE]
    if sys.modules.get("flash_attn") is this:
        return "flash_attn already stands for attnkit.flash_attn"
    if "flash_attn" in sys.modules or importlib.util.find_spec("flash_attn") is not None:
        found = sys.modules.get("flash_attn")
        where = getattr(found, "__file__", None) or getattr(
            importlib.util.find_spec("flash_attn"), "origin", None
        )
        return f"flash_attn is installed ({where}); nothing was aliased"
    sys.modules["flash_attn"] = this
    sys.modules["flash_attn.flash_attn_interface"] = this
    return (
        "flash_attn and flash_attn.flash_attn_interface now import attnkit.flash_attn "
        "(flash-attn is not installed)"
    )


def _uninstall() -> None:
    """Remove the aliases :func:`install` registered (for tests)."""
    this = sys.modules[_PACKAGE]
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        if sys.modules.get(name) is this:
            del sys.modules[name]
