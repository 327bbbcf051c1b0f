"""Every transformers model family, built from a tiny config, run with
``attn_implementation="eager"`` and ``"attnkit"``: logits, greedy generation, one training step.

The families: transformers' causal LM, sequence-to-sequence LM and masked LM classes (its auto
mappings; the default), and with ``--heads other`` every other family of its base-model mapping
(what ``AutoModel`` builds: vision, audio and multimodal encoders, detectors, time series), each
as its image, audio, video or sequence classification head where it has one. Each is built from
its config class's defaults with the sizes shrunk (hidden size 32, 2 layers, 4 query and 2
key/value heads, tiny experts, indexers and windows, images of at most 64 x 64; every dropout and
SpecAugment mask 0; per-stage lists of a vision backbone kept), random weights (a projection
initialised to zero drawn too), no downloads. The shrinking knows the families' rules: per-layer
overrides (``per_layer_config``) are shrunk layer by layer, each kind of layer kept; a value a
config derives (a property) is left to it and ``OVERRIDES`` sets what it derives it from; aliases
are passed as the field they name; ``OVERRIDES`` holds what a config checks or needs beyond the
sizes (no grouped-query attention, one expert per token, an attention layer among Mamba layers,
shared keys and values as the model testers build them, multimodal rotary sections).
Both implementations get the same weights (seed, then the eager model's state dict, taken before
its training step moves any statistics) and the same inputs, made from the model's
``main_input_name`` and config: 2 rows of 12 token ids, the second padded by 3 (left for a
language model, right for an encoder; ordinary tokens under the padding), with images too where
the forward takes them; ``pixel_values`` at the config's image size and channels (frames for a
video model); ``input_features`` (mel frames) or ``input_values`` (samples); two images' patches
and their grid for a vision tower that takes them packed (Qwen2-VL's); decoder ids for an
encoder-decoder:

* ``logits``: the largest difference at real tokens, relative to the largest logit (a model
  without logits: every floating tensor of its output);
* ``generate``: 4 greedy tokens from the padded batch (causal and sequence-to-sequence LMs); with
  ``--static-cache`` the causal LMs' again with ``cache_implementation="static"``;
* ``train``: the loss and every parameter's gradient of one training step (a language model's
  labels = the inputs; another family's loss the mean square of what is compared), relative to
  the largest gradient.

A family is ``equal`` when all three agree (relative 1e-4 in float32, 2e-2 in ``--dtype
bfloat16`` or ``float16``, the same tokens: in a half type the tokens are reported, not judged),
``differ`` when one does not (a NaN included; the row then says how attnkit compares with sdpa,
which also gives a query that sees no key zeros where eager averages every value, and in a half
type how far attnkit's and eager's logits are from eager's in float32), ``fails`` when attnkit
raises where eager does not, ``refused`` when attnkit refuses it at load (a model with attention
code of its own), ``skipped`` when eager itself cannot run it from a tiny config (another input,
a package it needs, sizes the shrinking cannot keep; ``SKIP`` says which): the reason is printed.
A static cache that eager cannot use either is noted, not judged. ``--sdpa`` compares every
family with sdpa too, in the row and a second summary line. A family whose logits barely change
when every attention output is zeroed is noted, as it is compared on little else.

    python benchmarks/sweep_transformers.py                 # every LM family: table and summary
    python benchmarks/sweep_transformers.py llama doge      # the families named (model types)
    python benchmarks/sweep_transformers.py --heads other   # the families without an LM head
    python benchmarks/sweep_transformers.py --dtype bfloat16 --static-cache --sdpa
    python benchmarks/sweep_transformers.py --json out.json
    python benchmarks/sweep_transformers.py llama gpt2 --compile  # under torch.compile

With ``--compile`` a family is compared on its forward alone: the logits of the padded batch
(under ``torch.no_grad``) of the model compiled with ``torch.compile(model, backend=...)``
(``aot_eager`` by default; ``--compile-backend inductor`` generates code) against eager's
uncompiled logits. The row is ``equal`` or ``differ`` by the tolerance above, ``fails`` when the
compiled attnkit model raises where the compiled eager model does not, ``skipped`` when the
compiled eager model raises too (or eager cannot run uncompiled); it gives the graphs and graph
breaks of both compiled models (a break in attention code splits every layer's graph).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import io
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import Tensor

from attnkit.integrations.transformers import register

V, T, B, PAD = 99, 12, 2, 3  # vocabulary, tokens, rows; the second row's left padding
TOLERANCE = 1e-4  # relative to the largest logit / gradient, in float32
HALF_TOLERANCE = 2e-2  # in bfloat16 and float16
IMAGE = 64  # the largest image side; a config's smaller one is kept
WEAK = 1e-3  # an attention share of the logits below this is noted: the family is weakly tested

# Families eager cannot run from token ids alone: what they need.
SKIP: dict[str, str] = {
    "gemma4_assistant": "a draft model: its forward takes the target model's embeddings and "
    "shared key/value states",
    "gemma4_unified_assistant": "a draft model: its forward takes the target model's embeddings "
    "and shared key/value states",
    "gemma3n": "its vision tower needs the timm package",
    "voxtral_realtime": "a speech model: its forward needs input_features",
    "xlstm": "no attention layers; its mLSTM sizes round up to multiples of 64, which its "
    "state shapes at hidden size 32 do not follow",
}

# Attribute -> tiny value, set on every config (and sub-config) that has the attribute.
TINY: dict[str, Any] = {
    "vocab_size": V, "unpadded_vocab_size": V, "hidden_size": 32, "d_model": 32, "n_embd": 32,
    "embed_dim": 32, "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "encoder_layers": 2,
    "decoder_layers": 2, "num_decoder_layers": 2, "num_attention_heads": 4, "n_head": 4,
    "num_heads": 4, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "d_kv": 8, "attention_head_size": 8,
    "intermediate_size": 32, "ffn_dim": 32, "d_ff": 32, "n_inner": 32, "encoder_ffn_dim": 32,
    "decoder_ffn_dim": 32, "rotary_dim": 4, "max_position_embeddings": 64, "n_positions": 64,
    "n_ctx": 64,
    "max_target_positions": 64, "max_source_positions": 64, "sliding_window": 4,
    "sliding_window_size": 4, "attention_chunk_size": 4, "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16, "n_routed_experts": 4, "num_experts": 4,
    "num_local_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1,
    "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "qk_head_dim": 16,
    "index_topk": 4, "index_head_dim": 16, "index_n_heads": 2, "index_num_heads": 2,
    "keep_window_size": 4, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
    "swa_head_dim": 8,
    "mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_state": 16, "mamba_chunk_size": 16,
    "audio_hidden_size": 32, "vocab_size_per_layer_input": V, "hidden_size_per_layer_input": 8,
    "rel_extent": 8, "d_rel": 4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "decoder_start_token_id": 1, "mask_time_prob": 0.0, "mask_feature_prob": 0.0, "depth": 2,
    "out_hidden_size": 32, "text_hidden_size": 32,
}  # fmt: skip


# What a family's config checks beyond the sizes above.
OVERRIDES: dict[str, dict[str, Any]] = {
    "kolibri1_1": {"head_dim": 16},  # NVFP4-rounded keys: a multiple of 16
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # Per-layer sizes the config derives from its own arguments (the sliding layers' MLA sizes).
    "dots3_note_text": {
        "swa_num_attention_heads": 8, "swa_num_key_value_heads": 8, "swa_q_lora_rank": 16,
        "swa_kv_lora_rank": 32, "swa_head_dim": 24, "swa_qk_nope_head_dim": 16, "swa_v_head_dim": 8,
    },
    "neomme": {"head_dim": 16},  # a quarter of the full layers' head rotated: a multiple of 4
    # Layer kinds derived from other attributes (a property): an attention layer among them.
    "bamba": {"attn_layer_indices": [1]},
    "recurrent_gemma": {"num_hidden_layers": 3},  # recurrent, recurrent, attention
    # The last layers reuse the keys and values of the last earlier layer of their kind.
    "gemma3n_text": {
        "num_hidden_layers": 4, "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    # Gemma 4 as its model tester builds it: shared keys and values in the last two layers (of
    # both kinds), mixture-of-experts blocks, vision tokens (none here) attending both ways.
    "gemma4_text": {
        "num_hidden_layers": 4, "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "enable_moe_block": True,
        "num_experts": 4, "top_k_experts": 2, "use_bidirectional_attention": "vision",
    },
    "gemma4_unified_text": {
        "num_hidden_layers": 4, "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "use_bidirectional_attention": "vision",
    },
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    },
    "nemotron3_5_transcribe_word_timestamp": {"blank_token_id": V - 1},  # the last class
    "DbrxAttentionConfig": {"rope_theta": 10_000.0, "kv_n_heads": 2, "clip_qkv": 8.0},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},  # layer 1 attends
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # A shared transformer block, tied across the hybrid layers: two of them.
    "zamba": {
        "num_hidden_layers": 3, "layer_types": ["linear_attention", "hybrid", "hybrid"],
        "initializer_range": 0.2,  # its attention reaches the logits through many projections
    },
    "zamba2": {"num_hidden_layers": 3, "layer_types": ["linear_attention", "hybrid", "hybrid"]},
    "mamba2": {"expand": 1, "n_groups": 1},  # hidden_size * expand = heads * head_dim
    "esmc": {"num_key_value_heads": 4},  # no grouped-query attention
    "zaya": {"num_experts_per_tok": 1},  # its only routing
    "qwen4_exp_text": {
        "head_dim": 16, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25},
        "layer_types": ["linear_attention", "qwen_sparse_attention"], "linear_conv_kernel_dim": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 4,
        "linear_num_value_heads": 8, "hc_count": 2, "hc_lowrank": 8, "ple_layer_ids": [1],
        "ple_embed_dim": 16, "ple_conv_kernel_size": 2, "heads_per_ngram": 2,
        "ngram_vocab_size_base": 31, "make_ngram_vocab_size_divisible_by": 8,
        "split_ngram_parts": 4, "indexer_n_heads": 2, "indexer_kv_heads": 1,
        "indexer_head_dim": 8, "indexer_budget": 4, "indexer_compress_ratio": 2,
    },
    "dory": {  # an input, a looped and an output layer
        "num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    # BLT as its model tester builds it: no entropy patching in the forward, small hash tables,
    # the local models' view of the global model's width, and the sizes its cache reads from
    # the top config.
    "blt": {
        "patch_in_forward": False, "encoder_hash_byte_group_size": [2, 3],
        "encoder_hash_byte_group_vocab": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "hidden_size": 32,
    },
    "BltLocalEncoderConfig": {"hidden_size_global": 32},
    "BltLocalDecoderConfig": {"hidden_size_global": 32},
    "mobilebert": {  # its attention reaches the logits through many bottleneck projections
        "embedding_size": 16, "intra_bottleneck_size": 16, "initializer_range": 0.2,
    },
    "squeezebert": {"embedding_size": 32},  # no projection between embedding and blocks
    "reformer": {"is_decoder": True, "axial_pos_embds": False},
    "xmod": {"is_decoder": True, "default_language": "en_XX"},
    # Multimodal rotary sections (time, height, width) summing to the tiny heads' rotated half.
    **{
        name: {"rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0,
                                   "mrope_section": [2, 1, 1]}}
        for name in ("qwen2_vl_text", "qwen2_5_vl_text", "glm4v_text", "glm_image_text",
                     "glm_ocr_text", "paddleocr_vl_text")
    },
    "glm4v_moe_text": {"rope_parameters": {
        "rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5,
        "mrope_section": [1, 0, 1],
    }},
    # One row of ids per row of the batch; generation starts from a token it is told.
    "musicgen_decoder": {"num_codebooks": 1, "decoder_start_token_id": 1},
    "musicgen_melody_decoder": {"num_codebooks": 1, "decoder_start_token_id": 1},
}  # fmt: skip


def _shrunk(config_class: type, default: Any) -> dict[str, Any]:
    """Constructor arguments for a tiny version of ``default`` (its sub-configs too)."""
    if getattr(default, "is_heterogeneous", False):  # per-layer sizes: read their global values
        default.allow_global_per_layer_attribute_access = True
    kwargs = {k: v for k, v in TINY.items() if hasattr(default, k) and _takes(default, k)}
    if isinstance(getattr(default, "image_size", None), int) and default.image_size > IMAGE:
        kwargs["image_size"] = IMAGE
    if hasattr(default, "kv_lora_rank"):  # multi-head latent attention: one key head per query head
        kwargs["num_key_value_heads"] = TINY["num_attention_heads"]
    types = getattr(default, "layer_types", None)
    if isinstance(types, list) and types and all(isinstance(t, str) for t in types):
        kinds = list(dict.fromkeys(types))  # each kind of layer once, in the order they come
        kwargs["layer_types"] = (kinds * 2)[: max(len(kinds), TINY["num_hidden_layers"])]
        kwargs["num_hidden_layers"] = len(kwargs["layer_types"])
    if getattr(default, "is_encoder_decoder", False):
        kwargs.setdefault("decoder_start_token_id", TINY["decoder_start_token_id"])
    for name, value in vars(default).items():
        if isinstance(value, float) and any(d in name for d in ("dropout", "drop_prob", "pdrop")):
            kwargs[name] = 0.0
        if name == "layerdrop" or name.endswith("_layerdrop"):
            kwargs[name] = 0.0
    kwargs.update(OVERRIDES.get(getattr(config_class, "model_type", ""), {}))
    kwargs.update(OVERRIDES.get(config_class.__name__, {}))
    # An alias (attribute_map) is set after the config's __post_init__ has read the field it
    # names: pass the field itself.
    aliases = getattr(config_class, "attribute_map", {}) or {}
    kwargs = {aliases.get(k, k): v for k, v in kwargs.items()}
    # A value some configs derive (a property without a setter) is left to them; OVERRIDES sets
    # what they derive it from.
    derived = [k for k in kwargs if isinstance(getattr(config_class, k, None), property)]
    for name in derived:
        del kwargs[name]
    layers = _per_layer(default, kwargs)
    if layers is not None:
        kwargs["per_layer_config"] = layers
    for name in getattr(config_class, "sub_configs", {}) or {}:
        sub = getattr(default, name, None)
        if isinstance(sub, transformers.PreTrainedConfig):  # some configs read its model type
            kwargs[name] = {"model_type": sub.model_type, **_shrunk(type(sub), sub)}
    return kwargs


def _takes(default: Any, name: str) -> bool:
    """Whether ``default``'s ``name`` takes TINY's single value: not where it is a list (per-stage
    sizes of a vision backbone, say), which is left as it is, token ids excepted."""
    return name.endswith("token_id") or not isinstance(getattr(default, name), (list, tuple))


def _per_layer(default: Any, kwargs: dict[str, Any]) -> dict[int, dict[str, Any]] | None:
    """The per-layer overrides of a heterogeneous config, layer by layer for the tiny one: each
    tiny layer takes the overrides of the default's first layer of its type, with each size
    shrunk the way the global one was, kept larger (smaller) where the default's was larger
    (smaller), so the layers still differ."""
    spec = default.__dict__.get("_heterogeneity_spec")
    if spec is None or any(k.startswith("swa_") for k in kwargs):  # derived from swa_* arguments
        return None
    old_types = list(getattr(default, "layer_types", None) or [])
    new_types = list(kwargs.get("layer_types") or old_types)
    count = kwargs.get("num_hidden_layers", default.num_hidden_layers)
    layers: dict[int, dict[str, Any]] = {}
    for i in range(count):
        kind = new_types[i] if i < len(new_types) else None
        j = old_types.index(kind) if kind in old_types else i
        overrides = spec.per_layer_overrides.get(j)
        if overrides:
            layers[i] = {k: _shrunk_override(default, kwargs, k, v) for k, v in overrides.items()}
    return layers


def _shrunk_override(default: Any, kwargs: dict[str, Any], name: str, value: Any) -> Any:
    if name not in kwargs or not isinstance(value, int) or isinstance(value, bool):
        return value
    tiny, base = kwargs[name], getattr(default, name, None)
    if not isinstance(tiny, int) or not isinstance(base, int) or value == base:
        return tiny
    return 2 * tiny if value > base else max(1, tiny // 2)


def tiny_config(model_type: str) -> Any:
    """The tiny config of the class :func:`head_class` builds for a family (the family by its model
    type, as in transformers' auto mappings; the class's own config class, a text config for
    some)."""
    config_class = head_class(model_type).config_class
    default = config_class()
    return config_class(**_shrunk(config_class, default))


def families() -> dict[str, str]:
    """model type -> the class of its language-model head (causal, then seq2seq, then masked)."""
    from transformers.models.auto import modeling_auto as auto

    found: dict[str, str] = {}
    for mapping in (
        auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    ):
        found.update(mapping)
    return dict(sorted(found.items()))


def other_families() -> dict[str, str]:
    """model type -> the class to build for a family without a language-model head: its image,
    audio, video or sequence classification head where it has one, else its base model (what
    ``AutoModel`` builds): vision, audio and multimodal encoders, detectors, time series."""
    from transformers.models.auto import modeling_auto as auto

    found: dict[str, str] = {}
    for mapping in (
        auto.MODEL_MAPPING_NAMES,
        auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        auto.MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES,
        auto.MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES,
        auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    ):  # later mappings win
        for name, classes in mapping.items():
            found[name] = classes if isinstance(classes, str) else classes[0]
    lm = families()
    return {k: v for k, v in sorted(found.items()) if k not in lm}


def head_class(model_type: str) -> Any:
    """The class the sweep builds for ``model_type``: its language-model head, else the class
    :func:`other_families` names."""
    name = families().get(model_type) or other_families()[model_type]
    return getattr(transformers, name)


@dataclass(frozen=True)
class Options:
    """How a family is compared: the models' dtype, and whether generation also runs with a
    static cache (causal LMs) and attnkit is also compared with sdpa."""

    dtype: torch.dtype = torch.float32
    static: bool = False
    sdpa: bool = False
    compile: str | None = None  # a torch.compile backend: compare compiled forwards only

    @property
    def tolerance(self) -> float:
        """The largest relative difference that is equal: float32's, or a half type's."""
        return TOLERANCE if self.dtype == torch.float32 else HALF_TOLERANCE


def build(model_type: str, impl: str, dtype: torch.dtype = torch.float32) -> Any:
    """The family's model (:func:`head_class`) with attention ``impl``, weights from seed 0."""
    cls = head_class(model_type)
    torch.manual_seed(0)
    model = cls._from_config(tiny_config(model_type), attn_implementation=impl)
    with torch.no_grad():  # a projection initialised to zero would hide its layer's attention
        for p in model.parameters():
            if p.dim() >= 2 and p.is_floating_point() and not p.any():
                p.normal_(0.0, 0.02)
    return model.to(dtype).eval()


def _lm(model: Any) -> bool:
    return type(model).__name__ in families().values()


def batch(model: Any) -> dict[str, Tensor]:
    """2 rows of token ids, the second padded, and their 2-d mask (and decoder inputs).

    A language model's second row is left-padded, as for generation; another family's is
    right-padded, as an encoder's batch is, so that no query of it sees no key. The padding
    positions hold ordinary tokens, as transformers' model testers' inputs do: with the padding
    id, whose embedding is zero, a padding query's row stays zero through a model where the
    attention leaves a fully masked row at zero (attnkit, sdpa) but not in eager (an average of
    the values), and a model taking a square root of a row's mean square (Gemma 3n's AltUp) then
    gets NaN gradients from those rows under sdpa and attnkit alike."""
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, T, dtype=torch.long)
    if _lm(model):
        mask[1, :PAD] = 0
    else:
        mask[1, T - PAD :] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = ids[:, : T // 2]
    return inputs


def _find(config: Any, name: str) -> Any:
    """``config``'s attribute ``name``, else the first of its sub-configs' (depth first)."""
    value = getattr(config, name, None)
    if value is not None:
        return value
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, transformers.PreTrainedConfig):
            value = _find(sub, name)
            if value is not None:
                return value
    return None


def _pixels(config: Any, dtype: torch.dtype) -> Tensor:
    """Images at the config's size and channels (64 x 64 RGB where it has none); a video model's
    (one with ``num_frames``) as ``(B, frames, C, H, W)``."""
    size = _find(config, "image_size") or 64
    h, w = (size, size) if isinstance(size, int) else (int(size[0]), int(size[-1]))
    if isinstance(size, dict):
        h, w = int(size.get("height", 64)), int(size.get("width", 64))
    channels = _find(config, "num_channels") or 3
    frames = _find(config, "num_frames")
    shape = (B, channels, h, w) if not isinstance(frames, int) else (B, frames, channels, h, w)
    return torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)


def _audio(config: Any, name: str, dtype: torch.dtype) -> Tensor:
    """``input_features`` (mel frames) or ``input_values`` (samples) at the config's sizes."""
    g = torch.Generator().manual_seed(3)
    mels, frames = _find(config, "num_mel_bins"), _find(config, "max_source_positions")
    length = 2 * frames if isinstance(frames, int) else 64  # two frames per position (Whisper)
    if name == "input_values" and isinstance(_find(config, "max_length"), int) and mels:
        shape: tuple[int, ...] = (B, _find(config, "max_length"), mels)  # a spectrogram (AST)
    elif name == "input_values":
        shape = (B, 4000)  # samples: a dozen frames after the convolutions
    elif isinstance(mels, int) and isinstance(frames, int):  # Whisper's (B, mels, frames)
        shape = (B, mels, length)
    elif isinstance(mels, int):
        shape = (B, length, mels)
    elif isinstance(_find(config, "input_feat_per_channel"), int):
        per, channels = _find(config, "input_feat_per_channel"), _find(config, "input_channels")
        shape = (B, length, per * (channels or 1))
    else:
        shape = (B, length, _find(config, "feature_size") or 80)
    return torch.randn(shape, generator=g).to(dtype)


def _patches(config: Any, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Two images as a vision tower of packed patches takes them (Qwen2-VL's): every patch of
    both, flattened, ``(patches, channels * frames * size * size)``, and each image's
    ``(frames, rows, columns)`` of patches, whole multiples of the patches merged."""
    channels = _find(config, "in_channels") or _find(config, "num_channels") or 3
    frames = _find(config, "temporal_patch_size") or 1
    size = _find(config, "patch_size") or 14
    merge = _find(config, "spatial_merge_size") or 1
    grid = torch.tensor([[1, 2 * merge, 2 * merge], [1, merge, 2 * merge]])
    count = int(grid.prod(-1).sum())
    g = torch.Generator().manual_seed(4)
    patches = torch.randn(count, channels * frames * size * size, generator=g)
    return patches.to(dtype), grid


def inputs_to_try(model: Any, dtype: torch.dtype = torch.float32) -> list[dict[str, Tensor]]:
    """The inputs a family's model is run with, from its ``main_input_name`` and config, in the
    order tried: token ids with images too where the forward takes them (a dual encoder needs
    both; a model with image tokens of its own may then refuse, and gets the ids alone),
    images, audio features or samples."""
    name = getattr(model, "main_input_name", "input_ids")
    params = inspect.signature(model.forward).parameters
    grid = next((k for k in ("grid_thw", "image_grid_thw") if k in params), None)
    if grid is not None and "input_ids" not in params:  # a vision tower of packed patches
        first = next(iter(params))
        patches, sizes = _patches(model.config, dtype)
        return [{first: patches, grid: sizes}]
    if name == "input_ids":
        ids = batch(model)
        if "pixel_values" in params and not _lm(model):
            return [ids | {"pixel_values": _pixels(model.config, dtype)}, ids]
        return [ids]
    if name in ("pixel_values", "pixel_values_videos"):
        inputs = {name: _pixels(model.config, dtype)}
    elif name in ("input_features", "input_values"):
        inputs = {name: _audio(model.config, name, dtype)}
    else:
        raise ValueError(f"its main input is {name}")
    if model.config.is_encoder_decoder and "decoder_input_ids" in params:
        inputs["decoder_input_ids"] = batch(model)["input_ids"][:, : T // 2]
    return [inputs]


def _tensors(output: Any) -> list[Tensor]:
    """The floating tensors of a model's output, in order (nested outputs and tuples too)."""
    if isinstance(output, Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    return []


def _compared(model: Any, inputs: dict[str, Tensor], output: Any) -> Tensor:
    """What is compared of a forward: its logits (else every floating tensor of its output),
    at real tokens where a tensor is one row per token (a decoder's are all real)."""
    logits = getattr(output, "logits", None)
    parts = [logits] if isinstance(logits, Tensor) else _tensors(output)
    mask = inputs.get("attention_mask")
    real = []
    for t in parts:
        if mask is not None and t.shape[:2] == mask.shape:
            t = t[mask.bool()]
        real.append(t.float().flatten())
    return torch.cat(real) if real else torch.zeros(0)


def _relative(a: Tensor, b: Tensor) -> float:
    """The largest difference of ``a`` from ``b``, relative to ``b``'s largest value."""
    if a.shape != b.shape:
        return float("nan")
    scale = max(float(b.abs().max()), 1e-6) if b.numel() else 1.0
    return float((a - b).abs().max()) / scale if a.numel() else 0.0


def _loss(model: Any, inputs: dict[str, Tensor]) -> Tensor:
    """A language model's loss on its own tokens; another family's mean square of what is
    compared (every output that depends on the weights)."""
    if not _lm(model):
        return _compared(model, inputs, model(**inputs)).square().mean()
    labels = inputs.get("decoder_input_ids", inputs["input_ids"]).clone()
    if not model.config.is_encoder_decoder:
        labels = labels.masked_fill(inputs["attention_mask"] == 0, -100)
        # The first real token of the padded row is predicted from a padding query, whose row
        # each implementation fills its own way (eager: an average; attnkit: 0).
        labels[1, PAD] = -100
    if getattr(model.config, "num_codebooks", None) == 1:  # MusicGen: (B, T, codebooks)
        labels = labels.unsqueeze(-1)
    return model(**inputs, labels=labels).loss


def _train_step(model: Any, inputs: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    model.train()
    model.zero_grad()
    loss = _loss(model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    return loss.detach().float(), grads


def _generate(model: Any, inputs: dict[str, Tensor], static: bool = False) -> Tensor | None:
    """4 greedy tokens (with a static cache: causal LMs only); None where the model does not
    generate."""
    if not _lm(model) or not model.can_generate() or type(model).__name__.endswith("MaskedLM"):
        return None
    if static and not type(model).__name__.endswith("CausalLM"):
        return None
    extra = {"cache_implementation": "static"} if static else {}
    return model.generate(
        **inputs, max_new_tokens=4, do_sample=False, pad_token_id=0, num_return_sequences=1, **extra
    )  # MusicGen reads the count from its generation config, where it is unset


@dataclass
class Run:
    """What one implementation's run gave: what is compared of its forward, its greedy tokens (and
    with a static cache), its training step's loss and gradients."""

    logits: Tensor
    tokens: Tensor | None
    loss: Tensor
    grads: dict[str, Tensor]
    static: Tensor | BaseException | None = None  # tokens, or eager's error


def run(model: Any, inputs: dict[str, Tensor], static: bool = False) -> Run:
    """The model's forward, greedy tokens and training step on ``inputs``; with ``static``, the
    tokens with a static cache too (or the error it raised: a family whose cache layers the static
    cache does not have raises with eager too)."""
    with torch.no_grad():
        logits = _compared(model, inputs, model(**inputs))
    tokens = _generate(model, inputs)
    with_static: Tensor | BaseException | None = None
    if static:
        try:
            with_static = _generate(model, inputs, static=True)
        except Exception as e:  # a cache the family does not support: eager's error too
            with_static = e
    loss, grads = _train_step(model, inputs)
    return Run(logits, tokens, loss, grads, with_static)


def _same(ours: Tensor | BaseException | None, theirs: Tensor | BaseException | None) -> str:
    if not isinstance(theirs, Tensor) or not isinstance(ours, Tensor):
        return "-"
    return "same" if ours.shape == theirs.shape and torch.equal(ours, theirs) else "other"


def compare(ours: Run, theirs: Run, tolerance: float = TOLERANCE) -> tuple[str, str]:
    """(verdict, what was measured) of attnkit's run against eager's (or sdpa's). At a half
    type's tolerance the greedy tokens are reported but not judged: a token whose two best
    logits are within rounding of each other goes either way."""
    logits = _relative(ours.logits, theirs.logits)
    loss = abs(float(ours.loss - theirs.loss)) / max(abs(float(theirs.loss)), 1e-6)
    scale = max((float(g.abs().max()) for g in theirs.grads.values() if g.numel()), default=1.0)
    grads = max(
        (float((ours.grads[n] - g).abs().max()) / max(scale, 1e-6) for n, g in theirs.grads.items()
         if n in ours.grads and g.numel()),
        default=0.0,
    )  # fmt: skip
    missing = set(theirs.grads) ^ set(ours.grads)
    close = all(x <= tolerance for x in (logits, loss, grads))  # a NaN is not close
    tokens, static = _same(ours.tokens, theirs.tokens), _same(ours.static, theirs.static)
    judged = "other" not in (tokens, static) or tolerance > TOLERANCE
    ok = close and judged and not missing
    detail = f"logits {logits:.1e}, generate {tokens}, loss {loss:.1e}, grads {grads:.1e}"
    if isinstance(theirs.static, BaseException):
        detail += f", static cache - ({_reason(theirs.static)[:60]})"
    elif theirs.static is not None:
        detail += f", static cache {static}"
    return ("equal" if ok else "differ"), detail


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:160]}"


def _refused(e: BaseException) -> bool:
    return isinstance(e, ValueError) and "does not support attn_implementation" in str(e)


@dataclass
class Row:
    """One family's result: its verdict against eager, what was measured, and (asked for) its
    verdict against sdpa."""

    verdict: str
    detail: str
    sdpa: str | None = None


def _eager(model_type: str, options: Options) -> tuple[dict[str, Any], dict[str, Tensor], Run]:
    """Eager's initial state, the inputs it runs with (the first of
    :func:`inputs_to_try` that it takes) and its run; raises what eager raises."""
    eager = build(model_type, "eager", options.dtype)
    state = copy.deepcopy(eager.state_dict())  # before a training step moves any statistics
    tries = inputs_to_try(eager, options.dtype)
    for i, inputs in enumerate(tries):
        try:
            return state, inputs, run(eager, inputs, options.static)
        except Exception:
            if i == len(tries) - 1:
                raise
            eager.load_state_dict(state)
    raise AssertionError("no inputs")


def sweep_row(model_type: str, options: Options = Options()) -> Row:
    """One family, as :class:`Row`."""
    if options.compile:
        return compile_row(model_type, options)
    if model_type in SKIP:
        return Row("skipped", SKIP[model_type])
    try:
        state, inputs, theirs = _eager(model_type, options)
    except Exception as e:
        try:  # attnkit's refusal says more than eager's failure
            build(model_type, "attnkit")
        except Exception as refusal:
            if _refused(refusal):
                return Row("refused", _reason(refusal))
        return Row("skipped", "eager: " + _reason(e))
    try:
        torch.manual_seed(0)
        model = build(model_type, "attnkit", options.dtype)
    except Exception as e:
        return Row("refused", _reason(e)) if _refused(e) else Row("fails", "build: " + _reason(e))
    model.load_state_dict(copy.deepcopy(state))
    try:
        ours = run(model, inputs, options.static)
    except Exception as e:
        return Row("fails", _reason(e))
    if isinstance(ours.static, BaseException) and isinstance(theirs.static, Tensor):
        return Row("fails", "static cache: " + _reason(ours.static))
    verdict, detail = compare(ours, theirs, options.tolerance)
    row = Row(verdict, detail)
    if verdict == "differ" or options.sdpa:
        row.sdpa, against = _against_sdpa(model_type, state, inputs, ours, options)
        detail += against
    if options.dtype != torch.float32:
        detail += _against_float32(model_type, state, inputs, ours, theirs)
    model.load_state_dict(copy.deepcopy(state))
    share = _attention_share(model, inputs)
    if share == 0.0:
        detail += "; no attention reaches the logits"
    elif share < WEAK:
        detail += f"; attention's share of the logits only {share:.0e}"
    row.detail = detail
    return row


def _compiled_logits(
    model: Any, inputs: dict[str, Tensor], backend: str
) -> tuple[Tensor, int, int]:
    """What is compared of the forward of ``model`` compiled with ``backend``, with the graphs
    torch.compile made of it and the graph breaks it met."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # each family compiles afresh, within the recompile limit
    counters.clear()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        logits = _compared(model, inputs, compiled(**inputs))
    return logits, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def compile_row(model_type: str, options: Options) -> Row:
    """One family under ``torch.compile`` (backend ``options.compile``): the compiled attnkit
    model's logits against the uncompiled eager model's, as :class:`Row`, with the graphs and
    graph breaks of both compiled models."""
    backend = options.compile or "aot_eager"
    if model_type in SKIP:
        return Row("skipped", SKIP[model_type])
    try:
        eager = build(model_type, "eager", options.dtype)
        state = copy.deepcopy(eager.state_dict())
        for inputs in inputs_to_try(eager, options.dtype):
            try:
                with torch.no_grad():
                    truth = _compared(eager, inputs, eager(**inputs))
                break
            except Exception:
                eager.load_state_dict(state)
        else:
            raise RuntimeError("no inputs eager takes")
    except Exception as e:
        return Row("skipped", "eager: " + _reason(e))
    try:
        torch.manual_seed(0)
        model = build(model_type, "attnkit", options.dtype)
    except Exception as e:
        return Row("refused", _reason(e)) if _refused(e) else Row("fails", "build: " + _reason(e))
    model.load_state_dict(copy.deepcopy(state))
    try:
        theirs: tuple[Tensor, int, int] | BaseException = _compiled_logits(eager, inputs, backend)
    except Exception as e:
        theirs = e
    try:
        ours, graphs, breaks = _compiled_logits(model, inputs, backend)
    except Exception as e:
        if isinstance(theirs, BaseException):
            return Row("skipped", f"compiled eager: {_reason(theirs)}")
        return Row("fails", f"compiled ({backend}): {_reason(e)}")
    logits = _relative(ours, truth)
    verdict = "equal" if logits <= options.tolerance else "differ"
    detail = f"compiled ({backend}) logits {logits:.1e}, {graphs} graphs, {breaks} breaks"
    if isinstance(theirs, BaseException):
        detail += f" (compiled eager raises: {_reason(theirs)[:60]})"
    else:
        detail += f" (eager: {theirs[1]} graphs, {theirs[2]} breaks)"
    return Row(verdict, detail)


def sweep_one(model_type: str, options: Options = Options()) -> tuple[str, str]:
    """(verdict, detail) for one family."""
    row = sweep_row(model_type, options)
    return row.verdict, row.detail


def _against_sdpa(
    model_type: str, state: dict[str, Any], inputs: dict[str, Tensor], ours: Run, options: Options
) -> tuple[str, str]:
    """(verdict, detail) of attnkit against sdpa: where attnkit differs from eager, this says
    more, since a query that sees no key gets zeros from both (eager: the average of every
    value), which some models carry from padding into real tokens (BLT pools its bytes' states,
    padding included, into patches). ``no sdpa`` where the family does not support it."""
    try:
        torch.manual_seed(0)
        sdpa = build(model_type, "sdpa", options.dtype)
    except Exception as e:
        return "no sdpa", f"; sdpa: {_reason(e)[:80]}"
    sdpa.load_state_dict(copy.deepcopy(state))
    try:
        verdict, detail = compare(ours, run(sdpa, inputs, options.static), options.tolerance)
    except Exception as e:
        return "no sdpa", f"; sdpa: {_reason(e)[:80]}"
    return verdict, f"; against sdpa: {verdict}" + (f" ({detail})" if verdict != "equal" else "")


def _against_float32(
    model_type: str, state: dict[str, Any], inputs: dict[str, Tensor], ours: Run, theirs: Run
) -> str:
    """How far attnkit's and eager's half-precision logits are from eager's in float32 (the same
    weights, rounded): where attnkit differs from eager, whether it is the further one."""
    truth = build(model_type, "eager")
    truth.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v
                           for k, v in state.items()})  # fmt: skip
    wide = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    try:
        with torch.no_grad():
            logits = _compared(truth, wide, truth(**wide))
    except Exception as e:
        return f"; float32: {_reason(e)[:60]}"
    ours_off, eager_off = _relative(ours.logits, logits), _relative(theirs.logits, logits)
    return f"; logits from float32: attnkit {ours_off:.1e}, eager {eager_off:.1e}"


def _attention_share(model: Any, inputs: dict[str, Tensor]) -> float:
    """How much the logits change when every attention layer's output is zeroed: a family where
    this is tiny is compared on little more than its other layers."""
    from transformers import AttentionInterface

    mapping = AttentionInterface._global_mapping
    served = mapping["attnkit"]

    def zeroed(*args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        out, weights = served(*args, **kwargs)
        return torch.zeros_like(out), weights

    with torch.no_grad():
        logits = _compared(model, inputs, model(**inputs))
        mapping["attnkit"] = zeroed
        try:
            without = _compared(model, inputs, model(**inputs))
        finally:
            mapping["attnkit"] = served
    return _relative(without, logits)


ORDER = ["equal", "differ", "fails", "refused", "skipped"]


def _summary(rows: list[dict[str, Any]], key: str, order: list[str]) -> str:
    counts = Counter(r[key] for r in rows if r.get(key) is not None)
    return ", ".join(f"{k} {counts.get(k, 0)}" for k in order) + f" (of {sum(counts.values())})"


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="model types (default: every family)")
    parser.add_argument(
        "--heads",
        choices=["lm", "other", "all"],
        default="lm",
        help="families with a language-model head (default), the others, or both",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument(
        "--static-cache", action="store_true", help="causal LMs also generate with a static cache"
    )
    parser.add_argument("--sdpa", action="store_true", help="compare with sdpa too")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compare the forward under torch.compile with eager's uncompiled one",
    )
    parser.add_argument(
        "--compile-backend",
        default="aot_eager",
        help="the torch.compile backend with --compile (default aot_eager; inductor too)",
    )
    parser.add_argument("--json", help="also write the rows to this file")
    return parser.parse_args()


def main() -> None:
    args = _parse()
    backend = args.compile_backend if args.compile else None
    options = Options(getattr(torch, args.dtype), args.static_cache, args.sdpa, backend)
    register()
    transformers.logging.disable_default_handler()  # its warnings about the tiny configs
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # tiny models: a second thread costs more than it saves
    every = {"lm": list(families()), "other": list(other_families())}
    names = args.families or every.get(args.heads, every["lm"] + every["other"])
    compiled = f", torch.compile({args.compile_backend})" if args.compile else ""
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {args.dtype}"
          f"{compiled}\n")  # fmt: skip
    print("| family | result | seconds | detail |")
    print("| --- | --- | ---: | --- |")
    rows = []
    for name in names:
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            row = sweep_row(name, options)
        seconds = time.perf_counter() - start
        print(f"| {name} | {row.verdict} | {seconds:.1f} | {row.detail} |", flush=True)
        rows.append(
            {"family": name, "result": row.verdict, "sdpa": row.sdpa, "seconds": seconds,
             "detail": row.detail}
        )  # fmt: skip
    print("\n" + _summary(rows, "result", ORDER))
    if args.sdpa:
        print("against sdpa: " + _summary(rows, "sdpa", ["equal", "differ", "no sdpa"]))
    if args.json:
        import results

        config = {"T": T, "B": B, "dtype": args.dtype, "static_cache": args.static_cache,
                  "compile": backend}  # fmt: skip
        results.save(args.json, "transformers_sweep", rows, config=config)


if __name__ == "__main__":
    main()
