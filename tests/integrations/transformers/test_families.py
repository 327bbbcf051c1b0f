"""Model families whose attention is unusual, through ``attn_implementation="attnkit"`` against
transformers' own ``eager`` and ``sdpa``: logits with left and right padding (float64 and float32),
greedy generation with the dynamic and the static cache, beam search, chunked prefill, a training
step's gradients, packed sequences and attention weights.

The families and what each stresses: GPT-OSS (attention sinks, sliding and full layers), Llama 4
text (chunked local attention, NoPE layers, attention temperature tuning), Gemma 3 (sliding and
global layers, a query pre-attention scalar; bidirectional as EmbeddingGemma), Cohere 2 (sliding
and global), Phi-3 (a sliding window everywhere), Qwen3 and Qwen3-MoE (q/k norms; Qwen3 with
sliding layers above ``max_window_layers``), SmolLM3 (NoPE layers), Falcon-H1 (Mamba and attention
in every layer), ModernBERT (an encoder with local and global layers), BERT and RoBERTa (encoder
padding masks), BART and T5 (encoder-decoders: cross-attention; T5's relative position bias),
Whisper (audio encoder-decoder), ViT and CLIP (no mask). A family missing from the installed
transformers is skipped with its name.

Every model is tiny (2 to 4 layers, hidden size 32) with weights drawn at a standard deviation of
0.2, so that attention moves the logits (transformers' 0.02 leaves some families' logits nearly
blind to it); each forward test checks that it does. Logits are compared at real tokens only (a
padded query's row is filled differently by each implementation and reaches no real token).
transformers' eager softmax runs in float32 for most of these families, so in float64 attnkit is
compared with sdpa (or with eager where eager keeps float64), and in float32 with eager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

transformers = pytest.importorskip("transformers")

from attnkit.integrations.transformers import _register as registration  # noqa: E402

from .helpers import V, padded, use  # noqa: E402

OURS = [
    "attnkit",
    "attnkit_chunked",
]  # "auto" (mostly torch's SDPA on the CPU) and attnkit's kernel


def _config(name: str, **kwargs: Any) -> Any:
    config_class = getattr(transformers, name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return config_class(**kwargs)


def _head(name: str) -> Any:
    head = getattr(transformers, name, None)
    if head is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return head


def _decoder(**overrides: Any) -> dict[str, Any]:
    return dict(
        vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    ) | overrides  # fmt: skip


def _encoder(**overrides: Any) -> dict[str, Any]:
    return dict(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64, pad_token_id=0,
    ) | overrides  # fmt: skip


def _seq2seq(**overrides: Any) -> dict[str, Any]:
    return dict(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    ) | overrides  # fmt: skip


def _experts_eager(m: Any) -> Any:
    """The experts as a loop of plain matmuls: the grouped GEMM takes no float64."""
    if hasattr(m, "set_experts_implementation"):
        m.set_experts_implementation("eager")
    return m


def _gpt_oss() -> Any:
    config = _config(
        "GptOssConfig", **_decoder(), head_dim=8, sliding_window=4, num_local_experts=2,
        num_experts_per_tok=1,
    )  # fmt: skip
    return _experts_eager(_head("GptOssForCausalLM")(config))


def _llama4() -> Any:
    # Layers 0 and 2 rotate (chunked attention over 4 keys), 1 and 3 are NoPE (global); a floor
    # scale of 2 makes the NoPE layers' temperature tuning scale queries from position 1 on.
    config = _config(
        "Llama4TextConfig", **_decoder(num_hidden_layers=4), head_dim=8, intermediate_size_mlp=32,
        num_local_experts=2, attention_chunk_size=4, no_rope_layer_interval=2, floor_scale=2,
        attn_scale=0.5, attn_temperature_tuning=True,
    )  # fmt: skip
    return _experts_eager(_head("Llama4ForCausalLM")(config))


def _gemma3(**overrides: Any) -> Any:
    config = _config(
        "Gemma3TextConfig", **_decoder(), head_dim=8, sliding_window=4, query_pre_attn_scalar=3,
        layer_types=["sliding_attention", "full_attention"], **overrides,
    )  # fmt: skip
    return config


def _whisper_features(rows: int) -> Tensor:
    return torch.randn(rows, 8, 20, generator=torch.Generator().manual_seed(7))


BUILD: dict[str, Callable[[], Any]] = {
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,
    "gemma3": lambda: _head("Gemma3ForCausalLM")(_gemma3()),
    # EmbeddingGemma: both ways, the sliding layers a window on either side.
    "gemma3_bidirectional": lambda: _head("Gemma3TextModel")(
        _gemma3(use_bidirectional_attention=True)
    ),
    "cohere2": lambda: _head("Cohere2ForCausalLM")(
        _config(
            "Cohere2Config",
            **_decoder(),
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        )
    ),
    "phi3": lambda: _head("Phi3ForCausalLM")(_config("Phi3Config", **_decoder(), sliding_window=4)),
    "qwen3": lambda: _head("Qwen3ForCausalLM")(
        _config(
            "Qwen3Config",
            **_decoder(),
            head_dim=8,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
        )
    ),
    "qwen3_moe": lambda: _experts_eager(
        _head("Qwen3MoeForCausalLM")(
            _config(
                "Qwen3MoeConfig",
                **_decoder(),
                head_dim=8,
                num_experts=2,
                num_experts_per_tok=1,
                moe_intermediate_size=16,
            )
        )
    ),
    "smollm3": lambda: _head("SmolLM3ForCausalLM")(  # NoPE in layers 1 and 3
        _config(
            "SmolLM3Config",
            **_decoder(num_hidden_layers=4),
            no_rope_layer_interval=2,
            use_sliding_window=True,
            sliding_window=4,
        )
    ),
    "falcon_h1": lambda: _head("FalconH1ForCausalLM")(
        _config(
            "FalconH1Config",
            **_decoder(),
            head_dim=8,
            mamba_d_ssm=32,
            mamba_n_heads=4,
            mamba_d_head=8,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_chunk_size=4,
            mamba_d_conv=2,
            mamba_expand=1,
        )
    ),
    "modernbert": lambda: _head("ModernBertForMaskedLM")(  # local (a window of 4), global, local
        _config(
            "ModernBertConfig",
            **_encoder(intermediate_size=32, num_hidden_layers=3),
            global_attn_every_n_layers=2,
            local_attention=4,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        )
    ),
    "bert": lambda: _head("BertForMaskedLM")(_config("BertConfig", **_encoder())),
    "roberta": lambda: _head("RobertaForMaskedLM")(_config("RobertaConfig", **_encoder())),
    "bart": lambda: _head("BartForConditionalGeneration")(
        _config("BartConfig", **_seq2seq(), max_position_embeddings=64, forced_eos_token_id=None)
    ),
    "t5": lambda: _head("T5ForConditionalGeneration")(
        _config(
            "T5Config",
            vocab_size=V,
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=2,
        )
    ),
    "whisper": lambda: _head("WhisperForConditionalGeneration")(
        _config(
            "WhisperConfig",
            **_seq2seq(),
            num_mel_bins=8,
            max_source_positions=10,
            max_target_positions=32,
        )
    ),
    "vit": lambda: _head("ViTModel")(
        _config(
            "ViTConfig",
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=37,
            image_size=8,
            patch_size=2,
            num_channels=3,
        )
    ),
    "clip": lambda: _head("CLIPModel")(
        _config(
            "CLIPConfig",
            text_config=dict(
                vocab_size=V,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=37,
                max_position_embeddings=16,
                eos_token_id=2,
                pad_token_id=0,
                bos_token_id=1,
            ),
            vision_config=dict(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=37,
                image_size=8,
                patch_size=2,
            ),
            projection_dim=16,
        )
    ),
}

NO_SDPA = {"gpt_oss"}  # sinks: transformers' sdpa refuses the model
EAGER_KEEPS_FLOAT64 = {"gpt_oss", "llama4", "bert", "roberta", "bart", "t5", "whisper"}
SEQ2SEQ = {"bart", "t5", "whisper"}
CAUSAL = ["gpt_oss", "llama4", "gemma3", "cohere2", "phi3", "qwen3", "qwen3_moe", "smollm3"]

_MODELS: dict[tuple[str, torch.dtype], Any] = {}


def model(name: str, dtype: torch.dtype = torch.float32) -> Any:
    """One eval-mode model per family and dtype, its weights drawn from seed 0 at std 0.2 (the
    embeddings and norms as transformers initialised them; GPT-OSS's sinks at std 1)."""
    if (name, dtype) not in _MODELS:
        torch.manual_seed(0)
        m = BUILD[name]()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if p.ndim >= 2 and "embed" not in n and "shared" not in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
                elif n.endswith("sinks"):
                    p.copy_(torch.randn(p.shape, generator=g))
        _MODELS[name, dtype] = m.to(dtype).eval()
    return _MODELS[name, dtype]


def batch(name: str, side: str, dtype: torch.dtype) -> tuple[dict[str, Any], Tensor]:
    """Inputs of 3 rows padded on ``side`` and the mask of the positions whose outputs count."""
    ids, mask = padded([10, 7, 4], 10, side)
    if name == "vit":
        pixels = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        return dict(pixel_values=pixels.to(dtype)), torch.ones(3, 17, dtype=torch.bool)
    if name == "clip":  # CLIP pools the text at its end-of-text token
        ends = mask.sum(1) - 1 if side == "right" else torch.full((3,), 9)
        ids[torch.arange(3), ends] = 2
        pixels = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels.to(dtype)), mask.bool()
    if name not in SEQ2SEQ:
        return dict(input_ids=ids, attention_mask=mask), mask.bool()
    dec, dec_mask = padded([6, 3, 5], 6, side)
    inputs = dict(decoder_input_ids=dec, decoder_attention_mask=dec_mask)
    if name == "whisper":
        return inputs | dict(input_features=_whisper_features(3).to(dtype)), dec_mask.bool()
    return inputs | dict(input_ids=ids, attention_mask=mask), dec_mask.bool()


def output(name: str, out: Any, real: Tensor) -> Tensor:
    """The outputs that count: logits (hidden states, embeddings) at real positions."""
    if name == "clip":
        return torch.cat([out.text_embeds, out.image_embeds])
    main = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return main[real]


def forward(m: Any, impl: str, inputs: dict[str, Any]) -> Any:
    with use(m, impl), torch.no_grad():
        return m(**inputs)


@contextlib.contextmanager
def attention_zeroed() -> Iterator[None]:
    """Every attention layer's output zero: how much the logits owe to attention."""
    forward = registration.attention_forward

    def zero(module: Any, q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Any:
        return v.new_zeros(q.size(0), q.size(2), q.size(1), v.size(-1)), None

    registration.attention_forward = zero
    try:
        yield
    finally:
        registration.attention_forward = forward


# Forward


FORWARD = [
    (name, side) for name in BUILD for side in ("left", "right") if (name, side) != ("vit", "right")
]


@pytest.mark.parametrize(("name", "side"), FORWARD)  # ViT has no padding: once
def test_forward_matches_eager_and_sdpa(name: str, side: str) -> None:
    # float64: exact but for the order of sums
    m = model(name, torch.float64)
    inputs, real = batch(name, side, torch.float64)
    refs = [] if name in NO_SDPA else ["sdpa"]
    refs += ["eager"] if name in EAGER_KEEPS_FLOAT64 else []
    theirs = {impl: output(name, forward(m, impl, inputs), real) for impl in refs}
    for impl in OURS:
        ours = output(name, forward(m, impl, inputs), real)
        for ref, want in theirs.items():
            scale = want.abs().max().item()
            torch.testing.assert_close(ours, want, atol=1e-11 * scale, rtol=0, msg=f"{impl}/{ref}")
    # float32 against eager
    m = model(name)
    inputs, real = batch(name, side, torch.float32)
    want = output(name, forward(m, "eager", inputs), real)
    scale = want.abs().max().item()
    for impl in OURS:
        ours = output(name, forward(m, impl, inputs), real)
        torch.testing.assert_close(ours, want, atol=1e-5 * scale, rtol=0, msg=impl)
    m.set_attn_implementation("attnkit")
    with attention_zeroed(), torch.no_grad():
        blind = output(name, m(**inputs), real)
    assert (blind - want).abs().max() > 0.05 * scale, "the logits barely depend on attention"


# Generation


def _generate(m: Any, impl: str, inputs: dict[str, Any], **kwargs: Any) -> Any:
    with use(m, impl):
        return m.generate(
            **inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False,
            return_dict_in_generate=True, output_logits=True, **kwargs,
        )  # fmt: skip


def _generation_inputs(name: str) -> dict[str, Any]:
    if name == "whisper":
        return dict(input_features=_whisper_features(2))
    ids, mask = padded([6, 3], 6, "left")
    return dict(input_ids=ids, attention_mask=mask)


def _assert_same_generation(ours: Any, theirs: Any, msg: str) -> None:
    assert torch.equal(ours.sequences, theirs.sequences), msg
    for a, b in zip(ours.logits, theirs.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4 * b.abs().max().item(), rtol=0, msg=msg)


GENERATE = [*CAUSAL, "falcon_h1", "bart", "t5", "whisper"]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", GENERATE)
def test_greedy_generation_matches_eager(name: str, cache: str) -> None:
    """12 greedy tokens from a left-padded batch: every step's logits and the tokens; past the
    sliding windows and chunks (4 keys), and through a static cache's unfilled slots."""
    m = model(name)
    inputs = _generation_inputs(name)
    want = _generate(m, "eager", inputs, cache_implementation=cache)
    for impl in OURS:
        got = _generate(m, impl, inputs, cache_implementation=cache)
        _assert_same_generation(got, want, f"{impl} {cache}")


@pytest.mark.parametrize("name", ["gpt_oss", "llama4", "gemma3"])
def test_chunked_prefill_and_prompt_lookup_match_eager(name: str) -> None:
    """Several queries at once against a filled cache: a prompt prefilled 4 tokens at a time
    (dynamic and static caches), and prompt-lookup decoding's draft tokens, checked together."""
    m = model(name)
    ids, mask = padded([9, 5], 9, "left")
    runs: list[tuple[dict[str, Any], dict[str, Any]]] = [
        (dict(input_ids=ids, attention_mask=mask), dict(prefill_chunk_size=4)),
        (
            dict(input_ids=ids, attention_mask=mask),
            dict(prefill_chunk_size=4, cache_implementation="static"),
        ),
        (dict(input_ids=ids[:1], attention_mask=mask[:1]), dict(prompt_lookup_num_tokens=3)),
    ]
    for inputs, kwargs in runs:
        want = _generate(m, "eager", inputs, **kwargs)
        got = _generate(m, "attnkit", inputs, **kwargs)
        _assert_same_generation(got, want, str(kwargs))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_beam_search_matches_eager(cache: str) -> None:
    """GPT-OSS (sinks, sliding layers): 3 beams reorder the cache at every step."""
    m = model("gpt_oss")
    inputs = _generation_inputs("gpt_oss")
    found = {}
    for impl in ["eager", *OURS]:
        with use(m, impl):
            found[impl] = m.generate(
                **inputs, max_new_tokens=12, min_new_tokens=12, num_beams=3, do_sample=False,
                cache_implementation=cache, return_dict_in_generate=True, output_scores=True,
            )  # fmt: skip
    want = found.pop("eager")
    for impl, got in found.items():
        assert torch.equal(got.sequences, want.sequences), impl
        torch.testing.assert_close(got.sequences_scores, want.sequences_scores, atol=1e-5, rtol=0)


# Training


@pytest.mark.parametrize("name", ["llama4", "modernbert"])
def test_training_gradients_match_sdpa(name: str) -> None:
    """A training step in float64 (train mode, no dropout): every parameter's gradient of a
    weighted sum of the real tokens' logits. Llama 4: chunks, NoPE and temperature tuning;
    ModernBERT: a window on either side, and padding in every layer."""
    m = model(name, torch.float64).train()
    try:
        inputs, real = batch(name, "left" if name == "llama4" else "right", torch.float64)
        weight = torch.randn(*real.shape, V, generator=torch.Generator().manual_seed(3))
        grads = {}
        for impl in ["sdpa", *OURS]:
            m.zero_grad(set_to_none=True)
            with use(m, impl):
                logits = m(**inputs).logits
            (logits * weight.double())[real].sum().backward()
            grads[impl] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    finally:
        m.zero_grad(set_to_none=True)
        m.eval()
    want = grads.pop("sdpa")
    scale = max(g.abs().max().item() for g in want.values())
    for impl, got in grads.items():
        assert got.keys() == want.keys(), impl
        for n, g in got.items():
            torch.testing.assert_close(g, want[n], atol=1e-11 * scale, rtol=0, msg=f"{impl} {n}")


# Packed sequences


def _packed() -> tuple[Tensor, Tensor, list[tuple[int, int]]]:
    """One row of three sequences (3, 9 and 2 tokens) and their positions."""
    ids = torch.randint(3, V, (1, 14), generator=torch.Generator().manual_seed(5))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1]])
    return ids, positions, [(0, 3), (3, 12), (12, 14)]


@pytest.mark.parametrize("name", ["llama4", "gemma3", "qwen3", "smollm3", "gpt_oss"])
def test_packed_sequences_match_sdpa_and_each_alone(name: str) -> None:
    """A packed row (positions restarting at 0, no mask, no cache) equals transformers' sdpa, which
    counts chunks and windows from each sequence's start, and gives each sequence the logits it
    has alone. Two exceptions, both transformers' own: Llama 4 tunes its NoPE layers' temperature
    by the token's index in the row, not its position, so a packed sequence is not as alone; and
    GPT-OSS builds its masks without the positions, so its eager (it has no sdpa) lets packed
    sequences see each other, where attnkit, like transformers' flash-attention path, keeps them
    apart."""
    m = model(name, torch.float64)
    ids, positions, spans = _packed()
    inputs = dict(input_ids=ids, position_ids=positions, use_cache=False)
    want = None
    if name not in NO_SDPA:
        want = forward(m, "sdpa", inputs).logits
    if name != "llama4":
        alone = [forward(m, "sdpa" if want is not None else "eager", dict(
            input_ids=ids[:, a:b], use_cache=False)) for a, b in spans]  # fmt: skip
        each = torch.cat([out.logits for out in alone], dim=1)
        want = each if want is None else want
        torch.testing.assert_close(want, each, atol=1e-10, rtol=0, msg="transformers")
    for impl in OURS:
        got = forward(m, impl, inputs).logits
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0, msg=impl)


# Attention weights


@pytest.mark.parametrize("name", ["gpt_oss", "llama4", "gemma3", "bart"])
def test_attention_weights_in_generation_match_eager(name: str) -> None:
    """``output_attentions`` through a static cache: the weights of every step (the prompt's at
    real queries), sinks' share left out as eager leaves it, unfilled slots zero."""
    m = model(name)
    ids, mask = padded([6, 3], 6, "left")
    found = {}
    for impl in ["eager", "attnkit"]:
        with use(m, impl):
            found[impl] = m.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                do_sample=False, cache_implementation="static", return_dict_in_generate=True,
                output_attentions=True,
            )  # fmt: skip
    want, got = found["eager"], found["attnkit"]
    assert torch.equal(got.sequences, want.sequences)
    kinds = ["decoder_attentions", "cross_attentions"] if name in SEQ2SEQ else ["attentions"]
    for kind in kinds:
        for step, (ours, theirs) in enumerate(
            zip(getattr(got, kind), getattr(want, kind), strict=True)
        ):
            for a, b in zip(ours, theirs, strict=True):
                real = mask.bool()[:, None, :, None] if step == 0 else torch.tensor(True)
                torch.testing.assert_close(
                    torch.where(real, a, 0), torch.where(real, b, 0), atol=1e-6, rtol=0, msg=kind
                )


@pytest.mark.parametrize("name", ["qwen3", "gpt_oss"])
def test_a_padding_hole_in_one_row_is_not_packing(name: str) -> None:
    """One row whose 2-d mask hides tokens in its middle: generate() numbers the real tokens on
    past the hole (the hidden ones get position 1), so the positions do not step by 1 there. With
    padding in the mask, every transformers path attends by the mask alone (flash-attention's
    too: it unpads and never reads the positions), so the tokens after the hole see those before
    it: the logits of a forward with those positions and 12 greedy tokens equal eager's."""
    ids = torch.randint(3, V, (1, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    real = mask.bool()
    m = model(name, torch.float64)
    inputs = dict(input_ids=ids, attention_mask=mask, position_ids=positions)
    want = forward(m, "sdpa" if name not in NO_SDPA else "eager", inputs).logits[real]
    for impl in OURS:
        got = forward(m, impl, inputs).logits[real]
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0, msg=impl)
    m = model(name)
    want_tokens = _generate(m, "eager", dict(input_ids=ids, attention_mask=mask))
    for impl in OURS:
        got_tokens = _generate(m, impl, dict(input_ids=ids, attention_mask=mask))
        _assert_same_generation(got_tokens, want_tokens, impl)


def test_a_padding_hole_is_one_sequence_under_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled with ``fullgraph=True`` (where whether the mask hides a token is data), a row
    with a hole and positions that restart stays one sequence, as in eager attnkit; without the
    hole, the same positions are two packed sequences in both."""
    from transformers import masking_utils as mu

    import attnkit
    from attnkit.integrations import transformers as hf
    from attnkit.integrations.transformers import _attention as attention_module

    # Outside a model's forward no output collector is active (a model's own compiles).
    monkeypatch.setattr(attention_module, "_model_collects_weights", lambda: False)

    class Layer(torch.nn.Module):
        is_causal = True

    def call(q: Tensor, k: Tensor, v: Tensor, pad: Tensor, positions: Tensor) -> Tensor:
        mask = hf.build_mask(
            batch_size=1, q_length=6, kv_length=6, mask_function=mu.causal_mask_function,
            attention_mask=pad,
        )  # fmt: skip
        out = attention_module.attention_forward(
            Layer(), q, k, v, mask, backend="auto", position_ids=positions
        )
        return out[0]

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    compiled = torch.compile(call, fullgraph=True, backend="eager")
    for hole, docs in ((True, [6]), (False, [3, 3])):
        pad = torch.tensor([[True, True, False, True, True, True]]) if hole else torch.ones(1, 6)
        pad = pad.bool()
        allowed = attnkit.masks.documents(docs) & attnkit.masks.key_padding(valid=pad)
        want = attnkit.attention(q, k, v, mask=allowed, causal=True, backend="reference")
        want = want.transpose(1, 2)
        real = pad[:, :, None, None]
        for got in (call(q, k, v, pad, positions), compiled(q, k, v, pad, positions)):
            torch.testing.assert_close(got * real, want * real, msg=f"hole={hole}")
