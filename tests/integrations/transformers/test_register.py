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

from .helpers import inputs, main_output, model, padded, run  # noqa: E402


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


def _tiny(config_class: str, **sizes: Any) -> Any:
    kw = dict(vocab_size=99, hidden_size=32, n_layer=2, n_head=4, num_hidden_layers=2,
              num_attention_heads=4, num_layers=2, num_heads=4)  # fmt: skip
    return getattr(transformers, config_class)(**{**kw, **sizes})


@pytest.mark.parametrize(
    ("model_class", "config"),
    [
        ("BloomForCausalLM", lambda: _tiny("BloomConfig")),
        ("GPTNeoForCausalLM", lambda: _tiny("GPTNeoConfig", attention_types=[[["global"], 2]])),
    ],
)
def test_models_with_attention_code_of_their_own_are_refused_at_load(
    model_class: str, config: Any
) -> None:
    """transformers refuses "sdpa" for them; with attnkit they crashed later, in their own code
    (BLOOM added attnkit's mask object to its scores; GPT-Neo had no layer class for the name)."""
    cls = getattr(transformers, model_class)
    message = (
        rf"^{model_class} does not support attn_implementation='attnkit': its attention layers "
        "compute attention in their own code"
    )
    with pytest.raises(ValueError, match=message):
        cls._from_config(config(), attn_implementation="attnkit")
    m = cls._from_config(config(), attn_implementation="eager")
    with pytest.raises(ValueError, match=message):
        m._check_and_adjust_attn_implementation("attnkit")  # what set_attn_implementation runs


def test_models_picking_their_attention_class_from_a_table_are_refused_at_load() -> None:
    """GIT's text layers take their class from ``GIT_SELF_ATTENTION_CLASSES[name]`` (eager only),
    while its vision layers call transformers' interface: loading it with attnkit raised
    ``KeyError: 'attnkit'`` from inside its constructor."""
    config = _tiny("GitConfig", intermediate_size=32, max_position_embeddings=64)
    message = (
        r"^GitForCausalLM does not support attn_implementation='attnkit': its attention layers "
        r"pick their class by the implementation's name from a table of their own "
        r"\(GIT_SELF_ATTENTION_CLASSES \['eager'\]\), which has none for attnkit"
    )
    with pytest.raises(ValueError, match=message):
        transformers.GitForCausalLM._from_config(config, attn_implementation="attnkit")


def test_a_model_transformers_runs_with_eager_only_gets_eager_masks() -> None:
    """DeepSeek V4 (no sdpa, flash or flex) widens its mask for its compressed keys when it is a
    tensor, in eager's float convention: it gets that mask, and attnkit computes the layer."""
    config = transformers.DeepseekV4Config(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, head_dim=8,
        num_key_value_heads=1, sliding_window=4,
    )  # fmt: skip
    torch.manual_seed(0)
    m = transformers.DeepseekV4ForCausalLM._from_config(config, attn_implementation="attnkit")
    ids, mask = padded([12, 9], 12, "left")
    seen: list[object] = []
    interface = mu.AttentionMaskInterface._global_mapping["attnkit"]

    def spy(**kwargs: Any) -> Any:
        seen.append(interface(**kwargs))
        return seen[-1]

    mu.AttentionMaskInterface._global_mapping["attnkit"] = spy
    try:
        ours = run(m.eval(), "attnkit", input_ids=ids, attention_mask=mask).logits
    finally:
        mu.AttentionMaskInterface._global_mapping["attnkit"] = interface
    assert seen
    assert all(isinstance(s, torch.Tensor) and s.is_floating_point() for s in seen)
    theirs = run(m, "eager", input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(ours[mask.bool()], theirs[mask.bool()], atol=1e-5, rtol=0)
