"""Tiny randomly initialised transformers models built from configs (no downloads), their padded
batches, and a way to run one with an attention implementation that checks attnkit really ran."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

transformers = pytest.importorskip("transformers")

from transformers import masking_utils as mu  # noqa: E402

from attnkit.integrations.transformers import _register as registration  # noqa: E402

V = 99  # vocabulary of every tiny model


def _decoder_kwargs() -> dict[str, Any]:
    return dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=32,  # GPT-OSS's grouped expert GEMMs want 16-byte strides
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _build(name: str) -> Any:
    t = transformers
    if name == "llama":
        config = t.LlamaConfig(**_decoder_kwargs())
        return t.LlamaForCausalLM(config)
    if name == "mistral":  # every layer a sliding window of 4 keys
        return t.MistralForCausalLM(t.MistralConfig(**_decoder_kwargs(), sliding_window=4))
    if name == "qwen2":  # hybrid: layer 0 full attention, layer 1 a window of 4
        config = t.Qwen2Config(
            **_decoder_kwargs(), use_sliding_window=True, sliding_window=4, max_window_layers=1
        )
        return t.Qwen2ForCausalLM(config)
    if name == "gemma2":  # a softcap small enough to matter at these logits
        config = t.Gemma2Config(
            **_decoder_kwargs(),
            head_dim=8,
            sliding_window=4,
            attn_logit_softcapping=0.5,
            query_pre_attn_scalar=8,
        )
        return t.Gemma2ForCausalLM(config)
    if name == "gpt_oss":
        config = t.GptOssConfig(
            **_decoder_kwargs(),
            head_dim=8,
            sliding_window=4,
            num_local_experts=2,
            num_experts_per_tok=1,
        )
        gpt_oss = t.GptOssForCausalLM(config)
        gpt_oss.set_experts_implementation("eager")  # the grouped expert GEMM takes no float64
        return gpt_oss
    if name == "gpt2":
        config = t.GPT2Config(
            vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
            eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        return t.GPT2LMHeadModel(config)
    if name == "bert":
        config = t.BertConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=37, max_position_embeddings=64,
        )  # fmt: skip
        return t.BertModel(config)
    if name == "t5":
        config = t.T5Config(
            vocab_size=V, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=2,
        )  # fmt: skip
        return t.T5ForConditionalGeneration(config)
    if name == "whisper":
        config = t.WhisperConfig(
            vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
            decoder_ffn_dim=37, num_mel_bins=8, max_source_positions=10,
            max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=1,
        )  # fmt: skip
        return t.WhisperForConditionalGeneration(config)
    raise AssertionError(name)


_MODELS: dict[tuple[str, torch.dtype], Any] = {}


def model(name: str, dtype: torch.dtype = torch.float32) -> Any:
    """One eval-mode model per name and dtype, shared by the tests (they only switch attention)."""
    if (name, dtype) not in _MODELS:
        torch.manual_seed(0)
        _MODELS[name, dtype] = _build(name).to(dtype).eval()
    return _MODELS[name, dtype]


def padded(lengths: list[int], total: int, side: str) -> tuple[Tensor, Tensor]:
    """Token ids and their 2-d attention mask (1 = real token), padding on ``side``."""
    g = torch.Generator().manual_seed(len(lengths) * 100 + total)
    ids = torch.randint(3, V, (len(lengths), total), generator=g)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, n in enumerate(lengths):
        if side == "left":
            mask[row, total - n :] = 1
        else:
            mask[row, :n] = 1
    return ids.masked_fill(mask == 0, 0), mask


def inputs(name: str, side: str, dtype: torch.dtype) -> tuple[dict[str, Any], Tensor]:
    """A batch for model ``name`` padded on ``side`` ("none": no padding), and the mask of the
    positions whose outputs count."""
    unpadded = side == "none"
    ids, mask = padded([10] * 3 if unpadded else [10, 7, 4], 10, "right" if unpadded else side)
    if name not in ("t5", "whisper"):
        return dict(input_ids=ids, attention_mask=mask), mask.bool()
    dec, dec_mask = padded([6] * 3 if unpadded else [6, 3, 5], 6, "right" if unpadded else side)
    if name == "t5":
        args = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    else:
        features = torch.randn(3, 8, 20, generator=torch.Generator().manual_seed(7)).to(dtype)
        args = dict(input_features=features, decoder_input_ids=dec)
    return dict(args, decoder_attention_mask=dec_mask), dec_mask.bool()


@contextlib.contextmanager
def use(m: Any, impl: str) -> Iterator[None]:
    """Run ``m`` with attention ``impl``; for attnkit's, check that its layers really call attnkit
    (a model that ignores the setting would compare transformers with itself and pass)."""
    m.set_attn_implementation(impl)
    if not impl.startswith("attnkit"):
        yield
        return
    calls = 0
    forward = registration.attention_forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return forward(*args, **kwargs)

    registration.attention_forward = counted
    try:
        yield
    finally:
        registration.attention_forward = forward
    assert calls, f"{type(m).__name__} never called attnkit with attn_implementation={impl!r}"


def run(m: Any, impl: str, **kwargs: Any) -> Any:
    with use(m, impl), torch.no_grad():
        return m(**kwargs)


def main_output(out: Any) -> Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def hf_dense(**kwargs: Any) -> Tensor:
    return mu.sdpa_mask(**kwargs, allow_is_causal_skip=False, allow_is_bidirectional_skip=False)


class Layer(torch.nn.Module):
    """An attention layer as transformers' attention functions see one: 4 query heads, 2 kv."""

    is_causal = True
    num_key_value_groups = 2


def qkv(tq: int = 5, tk: int = 5) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, tq, 8, generator=g)
    return q, torch.randn(2, 2, tk, 8, generator=g), torch.randn(2, 2, tk, 8, generator=g)


def sweep() -> Any:
    """``benchmarks/sweep_transformers.py``: each family, tiny, eager against attnkit."""
    import importlib.util
    import sys
    from pathlib import Path

    if "sweep_transformers" in sys.modules:
        return sys.modules["sweep_transformers"]
    path = Path(__file__).parents[3] / "benchmarks" / "sweep_transformers.py"
    spec = importlib.util.spec_from_file_location("sweep_transformers", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
