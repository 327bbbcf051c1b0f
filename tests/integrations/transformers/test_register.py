"""``register()``: the names transformers would read as its own are refused, the backend is
checked, a missing or old transformers is one ImportError, and a model loaded by name runs
attnkit."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AttentionInterface  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

import attnkit  # noqa: E402
from attnkit.integrations import transformers as hf  # noqa: E402

from .helpers import inputs, main_output, model, run  # noqa: E402


@pytest.mark.parametrize("name", ["eager", "my_sdpa", "flash_attnkit", "org/kernel", "paged|x"])
def test_register_refuses_names_transformers_reads_otherwise(name: str) -> None:
    with pytest.raises(ValueError, match=f"name {name!r} would be read by transformers"):
        hf.register(name)


def test_register_checks_the_backend() -> None:
    with pytest.raises(ValueError, match="unknown backend 'fast'; choose 'auto' or one of: sdpa"):
        hf.register("x", backend="fast")
    with pytest.raises(TypeError, match="backend must be a name or a Backend, got int"):
        hf.register("x", backend=3)  # type: ignore[arg-type]


def test_register_with_a_backend_object() -> None:
    hf.register("attnkit_object", backend=attnkit.backends.Chunked(block_q=4, block_k=4))
    try:
        m = model("llama")
        batch, real = inputs("llama", "left", torch.float32)
        ours = main_output(run(m, "attnkit_object", **batch))[real]
        torch.testing.assert_close(ours, main_output(run(m, "eager", **batch))[real])
    finally:
        AttentionInterface._global_mapping.pop("attnkit_object", None)
        mu.AttentionMaskInterface._global_mapping.pop("attnkit_object", None)


def test_missing_or_old_transformers_is_one_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda _: "5.19.2")
    with pytest.raises(
        ImportError, match=r"needs transformers>=5\.20, found 5\.19\.2: install the hf extra"
    ):
        hf.register()
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(
        ImportError,
        match=r'not installed: install the hf extra: pip install "attnkit\[hf\]" '
        r'\(or "\.\[hf\]" from a checkout\)',
    ):
        hf.register()


def test_from_pretrained_by_name(tmp_path: Any) -> None:
    m = model("llama")
    m.save_pretrained(tmp_path)
    auto = transformers.AutoModelForCausalLM
    loaded = auto.from_pretrained(tmp_path, attn_implementation="attnkit")
    assert loaded.config._attn_implementation == "attnkit"
    batch, real = inputs("llama", "left", torch.float32)
    with torch.no_grad():
        got = loaded.eval()(**batch).logits[real]
    torch.testing.assert_close(got, main_output(run(m, "eager", **batch))[real], atol=1e-4, rtol=0)
