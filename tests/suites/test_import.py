"""``import attnkit``: on a machine without numpy it imports, and writes nothing to stderr; the
names it holds are the current spellings only."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest

import attnkit

# numpy is optional. torch's own import, without it, warns "Failed to initialize NumPy" (the README
# says so); attnkit's import must add nothing: no numpy import, no tensor.numpy() or
# torch.from_numpy() at import time, no warning. Everything written to stderr while attnkit and
# its command's modules are imported, by Python or by C++, is caught and printed to stdout.
CHILD = r"""
import contextlib, io, os, sys, tempfile, warnings

sys.modules["numpy"] = None  # `import numpy` raises ImportError, as where it is not installed
import torch  # what torch itself writes without numpy is torch's

warnings.simplefilter("always")  # a warning torch gave once already is shown again
with tempfile.TemporaryFile(mode="w+") as caught:
    saved = os.dup(2)
    os.dup2(caught.fileno(), 2)
    try:
        with contextlib.redirect_stderr(io.StringIO()) as python:
            import attnkit
            import attnkit.cli
    finally:
        os.dup2(saved, 2)
    caught.seek(0)
    print(repr(python.getvalue() + caught.read()))
"""


def test_import_without_numpy_writes_nothing_to_stderr() -> None:
    got = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "''"


# Spellings from before 0.1.0, each removed before that release (none was ever released):
# (where, name) for attributes, and dotted names for modules.
GONE_ATTRIBUTES = [
    (attnkit, "from_torch_masks"),  # attnkit.interop.torch.from_torch_masks
    (attnkit, "checkpoint"),  # attnkit.weights
    (attnkit.MultiHeadAttention, "from_torch"),  # attnkit.interop.torch.from_torch
    (attnkit.MultiHeadAttention, "to_torch"),  # attnkit.interop.torch.to_torch
    (attnkit.TransformerEncoderLayer, "from_torch"),
    (attnkit.TransformerDecoderLayer, "from_torch"),
    (attnkit.RelativeMultiHeadAttention, "from_espnet"),  # interop.espnet.relative_attention
    (attnkit.RelativeMultiHeadAttention, "from_speechbrain"),
    (attnkit.RelativeMultiHeadAttention, "from_openspeech"),
    (attnkit.ConformerLayer, "from_espnet"),  # interop.espnet.conformer_layer
    (attnkit.interop.openspeech, "from_openspeech"),  # interop.openspeech.relative_attention
]
GONE_MODULES = [
    "attnkit.checkpoint",
    "attnkit.backends.torch_flex",  # attnkit.backends.flex
    "attnkit.multihead",  # attnkit.modules.multihead
    "attnkit.kv_cache",  # attnkit.caches.kv_cache
    "attnkit.paged_kv_cache",  # attnkit.caches.paged
    "attnkit._deprecated",
    "attnkit.interop._aliases",
]


@pytest.mark.parametrize(
    ("owner", "name"),
    GONE_ATTRIBUTES,
    ids=[f"{getattr(o, '__name__', o)}.{n}" for o, n in GONE_ATTRIBUTES],
)
def test_an_old_spelling_is_a_plain_attribute_error(owner: object, name: str) -> None:
    with pytest.raises(AttributeError):
        getattr(owner, name)


def test_a_module_has_no_old_method() -> None:
    with pytest.raises(AttributeError, match="object has no attribute 'to_torch'"):
        attnkit.MultiHeadAttention(8, 2).to_torch  # noqa: B018


@pytest.mark.parametrize("name", GONE_MODULES)
def test_an_old_module_is_a_plain_import_error(name: str) -> None:
    with pytest.raises(ModuleNotFoundError, match=f"No module named '{name}'"):
        importlib.import_module(name)


def test_an_old_name_in_a_from_import_is_a_plain_import_error() -> None:
    with pytest.raises(ImportError, match="cannot import name 'from_torch_masks' from 'attnkit'"):
        from attnkit import from_torch_masks  # type: ignore[attr-defined]  # noqa: F401


def test_backends_reference_is_the_module_not_a_function() -> None:
    # It was the reference formula under the package's name, shadowing the submodule; the backend
    # is attention(..., backend="reference") and the formula attnkit.backends.reference.formula.
    assert isinstance(attnkit.backends.reference, types.ModuleType)
    assert not callable(attnkit.backends.reference)
