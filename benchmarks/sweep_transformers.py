"""Every transformers model family with a language-model head, built from a tiny config, run with
``attn_implementation="eager"`` and ``"attnkit"``: logits, greedy generation, one training step.

The families: transformers' causal LM, sequence-to-sequence LM and masked LM classes (its auto
mappings). Each is built from its config class's defaults with the sizes shrunk (hidden size 32,
2 layers, 4 query and 2 key/value heads, tiny experts, indexers and windows; every dropout 0),
random weights (a projection initialised to zero drawn too), float32, no downloads. The shrinking
knows the families' rules: per-layer overrides (``per_layer_config``) are shrunk layer by layer,
each kind of layer kept; a value a config derives (a property) is left to it and ``OVERRIDES``
sets what it derives it from; aliases are passed as the field they name; ``OVERRIDES`` holds
what a config checks or needs beyond the sizes (no grouped-query attention, one expert per token,
an attention layer among Mamba layers, shared keys and values as the model testers build them).
Both implementations get the same weights (seed, then the eager model's state dict) and a batch
of 2 rows of 12 tokens, the second left-padded by 3 (ordinary tokens under the padding):

* ``logits``: the largest difference at real tokens, relative to the largest logit;
* ``generate``: 4 greedy tokens from the padded batch (causal and sequence-to-sequence LMs);
* ``train``: the loss and every parameter's gradient of one training step (labels = the inputs),
  relative to the largest gradient.

A family is ``equal`` when all three agree (relative 1e-4, the same tokens), ``differ`` when one
does not (a NaN included; the row then says how attnkit compares with sdpa, which also gives a
query that sees no key zeros where eager averages every value), ``fails`` when attnkit raises
where eager does not, ``refused`` when attnkit refuses it at load (a model with attention code of
its own), ``skipped`` when eager itself cannot run it from a tiny config (another input than token
ids, a package it needs, sizes the shrinking cannot keep; ``SKIP`` says which): the reason is
printed. A family whose logits barely
change when every attention output is zeroed is noted, as it is compared on little else.

    python benchmarks/sweep_transformers.py                 # every family: table and summary
    python benchmarks/sweep_transformers.py llama doge      # the families named (model types)
    python benchmarks/sweep_transformers.py --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
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
TOLERANCE = 1e-4  # relative to the largest logit / gradient
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
    "decoder_start_token_id": 1,
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
    # One row of ids per row of the batch; generation starts from a token it is told.
    "musicgen_decoder": {"num_codebooks": 1, "decoder_start_token_id": 1},
    "musicgen_melody_decoder": {"num_codebooks": 1, "decoder_start_token_id": 1},
}  # fmt: skip


def _shrunk(config_class: type, default: Any) -> dict[str, Any]:
    """Constructor arguments for a tiny version of ``default`` (its sub-configs too)."""
    if getattr(default, "is_heterogeneous", False):  # per-layer sizes: read their global values
        default.allow_global_per_layer_attribute_access = True
    kwargs = {k: v for k, v in TINY.items() if hasattr(default, k)}
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
    """The tiny config of a model family's language-model head (the family by its model type, as
    in transformers' auto mappings; the head's own config class, a text config for some)."""
    config_class = getattr(transformers, families()[model_type]).config_class
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


def build(model_type: str, impl: str) -> Any:
    """The family's language-model head with attention ``impl``, weights from seed 0."""
    cls = getattr(transformers, families()[model_type])
    torch.manual_seed(0)
    model = cls._from_config(tiny_config(model_type), attn_implementation=impl)
    with torch.no_grad():  # a projection initialised to zero would hide its layer's attention
        for p in model.parameters():
            if p.dim() >= 2 and p.is_floating_point() and not p.any():
                p.normal_(0.0, 0.02)
    return model.float().eval()


def batch(model: Any) -> dict[str, Tensor]:
    """2 rows of token ids, the second left-padded, and their 2-d mask (and decoder inputs).

    The padding positions hold ordinary tokens, as transformers' model testers' inputs do: with
    the padding id, whose embedding is zero, a padding query's row stays zero through a model
    where the attention leaves a fully masked row at zero (attnkit, sdpa) but not in eager (an
    average of the values), and a model taking a square root of a row's mean square (Gemma 3n's
    AltUp) then gets NaN gradients from those rows under sdpa and attnkit alike."""
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :PAD] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = ids[:, : T // 2]
    return inputs


def _real(model: Any, inputs: dict[str, Tensor], logits: Tensor) -> Tensor:
    """The logits at real tokens (the decoder's, for an encoder-decoder: all real)."""
    if model.config.is_encoder_decoder:
        return logits
    return logits[inputs["attention_mask"].bool()]


def _relative(a: Tensor, b: Tensor) -> float:
    """The largest difference of ``a`` from ``b``, relative to ``b``'s largest value."""
    scale = max(float(b.abs().max()), 1e-6) if b.numel() else 1.0
    return float((a - b).abs().max()) / scale if a.numel() else 0.0


def _train_step(model: Any, inputs: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    model.train()
    model.zero_grad()
    labels = inputs.get("decoder_input_ids", inputs["input_ids"]).clone()
    if not model.config.is_encoder_decoder:
        labels = labels.masked_fill(inputs["attention_mask"] == 0, -100)
        # The first real token of the padded row is predicted from a padding query, whose row
        # each implementation fills its own way (eager: an average; attnkit: 0).
        labels[1, PAD] = -100
    if getattr(model.config, "num_codebooks", None) == 1:  # MusicGen: (B, T, codebooks)
        labels = labels.unsqueeze(-1)
    loss = model(**inputs, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    return loss.detach(), grads


def _generate(model: Any, inputs: dict[str, Tensor]) -> Tensor | None:
    if not model.can_generate() or type(model).__name__.endswith("MaskedLM"):
        return None
    return model.generate(
        **inputs, max_new_tokens=4, do_sample=False, pad_token_id=0, num_return_sequences=1
    )  # MusicGen reads the count from its generation config, where it is unset


@dataclass
class Run:
    logits: Tensor
    tokens: Tensor | None
    loss: Tensor
    grads: dict[str, Tensor]


def run(model: Any) -> Run:
    inputs = batch(model)
    with torch.no_grad():
        logits = _real(model, inputs, model(**inputs).logits)
    tokens = _generate(model, inputs)
    loss, grads = _train_step(model, inputs)
    return Run(logits, tokens, loss, grads)


def compare(ours: Run, theirs: Run) -> tuple[str, str]:
    """(verdict, what was measured) of attnkit's run against eager's."""
    logits = _relative(ours.logits, theirs.logits)
    same_tokens = None
    if theirs.tokens is not None and ours.tokens is not None:
        same_tokens = bool(torch.equal(ours.tokens, theirs.tokens))
    loss = abs(float(ours.loss - theirs.loss)) / max(abs(float(theirs.loss)), 1e-6)
    scale = max((float(g.abs().max()) for g in theirs.grads.values()), default=1.0)
    grads = max(
        (float((ours.grads[n] - g).abs().max()) / max(scale, 1e-6) for n, g in theirs.grads.items()
         if n in ours.grads),
        default=0.0,
    )  # fmt: skip
    missing = set(theirs.grads) ^ set(ours.grads)
    close = all(x <= TOLERANCE for x in (logits, loss, grads))  # a NaN is not close
    ok = close and same_tokens is not False and not missing
    tokens = "-" if same_tokens is None else "same" if same_tokens else "other"
    detail = f"logits {logits:.1e}, generate {tokens}, loss {loss:.1e}, grads {grads:.1e}"
    return ("equal" if ok else "differ"), detail


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:160]}"


def sweep_one(model_type: str) -> tuple[str, str]:
    """(verdict, detail) for one family."""
    if model_type in SKIP:
        return "skipped", SKIP[model_type]
    try:
        eager = build(model_type, "eager")
        theirs = run(eager)
    except Exception as e:
        try:  # attnkit's refusal says more than eager's failure
            build(model_type, "attnkit")
        except ValueError as refusal:
            if "does not support attn_implementation" in str(refusal):
                return "refused", _reason(refusal)
        except Exception:
            pass
        return "skipped", "eager: " + _reason(e)
    try:
        torch.manual_seed(0)
        model = build(model_type, "attnkit")
    except ValueError as e:
        if "does not support attn_implementation" in str(e):
            return "refused", _reason(e)
        return "fails", "build: " + _reason(e)
    except Exception as e:
        return "fails", "build: " + _reason(e)
    model.load_state_dict(copy.deepcopy(eager.state_dict()))
    try:
        ours = run(model)
    except Exception as e:
        return "fails", _reason(e)
    verdict, detail = compare(ours, theirs)
    if verdict == "differ":
        detail += _against_sdpa(model_type, eager, ours)
    share = _attention_share(model)
    if share == 0.0:
        detail += "; no attention reaches the logits"
    elif share < WEAK:
        detail += f"; attention's share of the logits only {share:.0e}"
    return verdict, detail


def _against_sdpa(model_type: str, eager: Any, ours: Run) -> str:
    """Where attnkit differs from eager, how it compares with sdpa: a query that sees no key gets
    zeros from both (eager: the average of every value), which some models carry from padding
    into real tokens (BLT pools its bytes' states, padding included, into patches)."""
    try:
        torch.manual_seed(0)
        sdpa = build(model_type, "sdpa")
        sdpa.load_state_dict(copy.deepcopy(eager.state_dict()))
        verdict, detail = compare(ours, run(sdpa))
    except Exception as e:
        return f"; sdpa: {_reason(e)[:80]}"
    return f"; against sdpa: {verdict}" + (f" ({detail})" if verdict != "equal" else "")


def _attention_share(model: Any) -> float:
    """How much the logits change when every attention layer's output is zeroed: a family where
    this is tiny is compared on little more than its other layers."""
    from transformers import AttentionInterface

    mapping = AttentionInterface._global_mapping
    served = mapping["attnkit"]

    def zeroed(*args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        out, weights = served(*args, **kwargs)
        return torch.zeros_like(out), weights

    inputs = batch(model)
    with torch.no_grad():
        logits = _real(model, inputs, model(**inputs).logits)
        mapping["attnkit"] = zeroed
        try:
            without = _real(model, inputs, model(**inputs).logits)
        finally:
            mapping["attnkit"] = served
    return _relative(without, logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="model types (default: every family)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    register()
    transformers.logging.disable_default_handler()  # its warnings about the tiny configs
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # tiny models: a second thread costs more than it saves
    names = args.families or list(families())
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, float32\n")
    print("| family | result | seconds | detail |")
    print("| --- | --- | ---: | --- |")
    rows = []
    for name in names:
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            verdict, detail = sweep_one(name)
        seconds = time.perf_counter() - start
        print(f"| {name} | {verdict} | {seconds:.1f} | {detail} |", flush=True)
        rows.append({"family": name, "result": verdict, "seconds": seconds, "detail": detail})
    counts = Counter(r["result"] for r in rows)
    order = ["equal", "differ", "fails", "refused", "skipped"]
    print("\n" + ", ".join(f"{k} {counts.get(k, 0)}" for k in order) + f" (of {len(rows)})")
    if args.json:
        import results

        results.save(args.json, "transformers_sweep", rows, config={"T": T, "B": B})


if __name__ == "__main__":
    main()
