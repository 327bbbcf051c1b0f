"""attnkit as transformers' attention implementation, against transformers' eager and sdpa.

Tiny randomly initialised models built from configs (no downloads). Logits are compared at real
tokens only: a padded query has no key to attend, and each implementation fills that row its own
way (eager: a uniform average; sdpa and attnkit: zeros), which reaches no real token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

transformers = pytest.importorskip("transformers")

from transformers import AttentionInterface  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import attnkit  # noqa: E402
from attnkit.integrations import transformers as hf  # noqa: E402

V = 99  # vocabulary of every tiny model


@pytest.fixture(scope="module", autouse=True)
def registered() -> Iterator[None]:
    # The models are tiny: a second thread costs more in synchronisation than it saves.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    hf.register()
    hf.register("attnkit_chunked", backend="chunked")
    yield
    for name in ("attnkit", "attnkit_chunked"):
        AttentionInterface._global_mapping.pop(name, None)
        mu.AttentionMaskInterface._global_mapping.pop(name, None)
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------
# Tiny models


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
    forward = hf._attention_forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return forward(*args, **kwargs)

    hf._attention_forward = counted
    try:
        yield
    finally:
        hf._attention_forward = forward
    assert calls, f"{type(m).__name__} never called attnkit with attn_implementation={impl!r}"


def run(m: Any, impl: str, **kwargs: Any) -> Any:
    with use(m, impl), torch.no_grad():
        return m(**kwargs)


def main_output(out: Any) -> Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


# --------------------------------------------------------------------------------------------------
# The mask function against transformers' own masks


def _hf_dense(**kwargs: Any) -> Tensor:
    return mu.sdpa_mask(**kwargs, allow_is_causal_skip=False, allow_is_bidirectional_skip=False)


PATTERNS = {
    "causal": lambda: mu.causal_mask_function,
    "sliding3": lambda: mu.sliding_window_causal_mask_function(3),
    "bidirectional": lambda: mu.bidirectional_mask_function,
    "window2": lambda: mu.sliding_window_bidirectional_mask_function(2),
}
# (Tq, Tk, q_offset, kv_offset, 2-d mask length): prefill, decoding with a dynamic cache, a static
# cache of 12 slots (empty, partly filled, one query), a full sliding-window cache, cross-attention.
SIZES = [
    (7, 7, 0, 0, 7),
    (3, 9, 6, 0, 9),
    (1, 9, 8, 0, 9),
    (5, 12, 0, 0, 5),
    (3, 12, 4, 0, 7),
    (1, 12, 9, 0, 10),
    (1, 4, 9, 7, 10),
    (4, 6, 0, 0, 6),
]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("sizes", SIZES, ids=str)
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_mask_matches_transformers(pattern: str, sizes: tuple[int, ...], padding: str) -> None:
    q_len, kv_len, q_offset, kv_offset, seen = sizes
    attention_mask = None
    if padding != "none":
        attention_mask = padded([seen, max(1, seen - 3)], seen, padding)[1].bool()
    kwargs = dict(
        batch_size=2,
        q_length=q_len,
        kv_length=kv_len,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=PATTERNS[pattern](),
        attention_mask=attention_mask,
    )
    theirs = _hf_dense(**kwargs)
    ours = hf.build_mask(**kwargs, allow_is_causal_skip=True, dtype=torch.float32)
    assert torch.equal(ours.dense().expand(theirs.shape), theirs), ours
    if pattern in ("causal", "bidirectional"):  # never a (Tq, Tk) tensor
        assert not isinstance(ours.mask, Tensor) or ours.mask.shape[-2] == 1, ours


def test_static_cache_step_as_a_tensor_offset() -> None:
    kwargs = dict(batch_size=1, q_length=2, kv_length=6, kv_offset=0)
    ours = hf.build_mask(**kwargs, q_offset=torch.tensor(1), attention_mask=None)
    assert repr(ours) == (
        "TransformersMask(1 x 2 queries x 6 keys: causal; 3 keys used, 3 never visible left out)"
    )
    theirs = _hf_dense(**kwargs, q_offset=1, mask_function=mu.causal_mask_function)
    assert torch.equal(ours.dense(), theirs)


def test_unknown_patterns_get_transformers_dense_mask() -> None:
    left = torch.tensor([2, 0])
    kwargs = dict(
        batch_size=2,
        q_length=6,
        kv_length=6,
        mask_function=mu.chunked_causal_mask_function(3, left),
        attention_mask=padded([4, 6], 6, "left")[1].bool(),
    )
    ours = hf.build_mask(**kwargs)
    assert "dense (B, 1, Tq, Tk) = (2, 1, 6, 6): mask function and_masks" in repr(ours)
    assert torch.equal(ours.dense(), _hf_dense(**kwargs))


def test_a_misread_pattern_falls_back_to_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transformers whose window function means something else is caught by the probe."""

    def overlay(sliding_window: int) -> Callable[..., Tensor]:
        def inner_mask(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return k >= q - sliding_window  # one key more than transformers' window

        inner_mask.__qualname__ = "sliding_window_overlay.<locals>.inner_mask"
        return inner_mask

    fn = mu.and_masks(overlay(5), mu.causal_mask_function)
    monkeypatch.setattr(hf, "_AGREED", {})
    ours = hf.build_mask(batch_size=1, q_length=8, kv_length=8, mask_function=fn)
    assert "does not read as attnkit expects" in repr(ours)
    theirs = _hf_dense(batch_size=1, q_length=8, kv_length=8, mask_function=fn)
    assert torch.equal(ours.dense(), theirs)


def test_causal_padding_reaches_attention_as_key_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Causal plus padding never becomes a (Tq, Tk) tensor, so auto avoids the O(T^2) paths."""
    seen: list[tuple[object, bool, list[str]]] = []

    def spy(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:
        mask = kwargs["mask"]
        args = {n: kwargs[n] for n in ("mask", "bias", "causal", "scale")}
        explained = attnkit.explain(q, k, v, **args)
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else "structured"
        seen.append((shape, kwargs["causal"], explained.costs[explained.chosen]))
        return attnkit.attention(q, k, v, **kwargs)

    monkeypatch.setattr(hf, "attention", spy)
    m = model("llama")
    batch, _ = inputs("llama", "left", torch.float32)
    run(m, "attnkit", **batch)
    assert len(seen) == 2  # one call per layer
    for shape, causal, costs in seen:
        assert shape in [(3, 1, 1, 10), "structured"]
        assert causal
        assert costs == []  # the backend auto chose materialises nothing


def test_sliding_window_reaches_attention_structured() -> None:
    ours = hf.build_mask(
        batch_size=2,
        q_length=8,
        kv_length=8,
        mask_function=mu.sliding_window_causal_mask_function(3),
        attention_mask=padded([8, 5], 8, "left")[1].bool(),
    )
    assert isinstance(ours.mask, attnkit.masks.Mask), ours


# --------------------------------------------------------------------------------------------------
# Models against eager and sdpa

DECODERS = [
    "llama",
    "mistral",
    "qwen2",
    "gemma2",
    "gpt_oss",
    "gpt2",
]
ALL = [*DECODERS, "bert", "t5", "whisper"]
NO_SDPA = {"gemma2", "gpt_oss"}  # transformers' sdpa cannot run softcap or sinks


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("side", ["left", "right"])
def test_float32_matches_eager_and_sdpa(name: str, side: str) -> None:
    m = model(name)
    batch, real = inputs(name, side, torch.float32)
    ours = main_output(run(m, "attnkit", **batch))[real]
    for impl in ["eager"] if name in NO_SDPA else ["eager", "sdpa"]:
        theirs = main_output(run(m, impl, **batch))[real]
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0, msg=f"{name} vs {impl}")


# These models' eager takes the softmax in float32 whatever the model's dtype: in float64 it is
# float32-accurate, and the finfo(float64).min it adds to masked scores becomes -inf there, so a
# query with no visible key (left padding; right padding inside a sliding window) gets a NaN row,
# whose NaN values reach real tokens in later layers through 0 * NaN.
SOFTMAX_IN_FLOAT32 = {"llama", "mistral", "qwen2", "gemma2"}


def references(name: str) -> list[str]:
    return ["eager"] if name in NO_SDPA else ["sdpa", "eager"]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("side", ["left", "right", "none"])
def test_float64_matches_eager_and_sdpa(name: str, side: str) -> None:
    m = model(name, torch.float64)
    batch, real = inputs(name, side, torch.float64)
    ours = main_output(run(m, "attnkit", **batch))
    assert not ours.isnan().any()  # padded rows too: a query with no key gives 0
    compared = []
    for impl in references(name):
        theirs = main_output(run(m, impl, **batch))[real]
        if impl == "eager" and name in SOFTMAX_IN_FLOAT32:
            if theirs.isnan().any():
                assert side != "none"
                continue
            torch.testing.assert_close(ours[real], theirs, atol=1e-6, rtol=0)
        else:
            torch.testing.assert_close(ours[real], theirs, atol=1e-12, rtol=1e-10, msg=impl)
        compared.append(impl)
    assert compared or (name == "gemma2" and side != "none")  # gemma2: padded in float32 only


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_chunked_backend_matches_eager(name: str) -> None:
    m = model(name, torch.float64)
    batch, real = inputs(name, "left", torch.float64)
    ours = main_output(run(m, "attnkit_chunked", **batch))[real]
    torch.testing.assert_close(ours, main_output(run(m, "sdpa", **batch))[real])


GENERATE = [
    ("llama", "dynamic"),
    ("llama", "static"),
    ("mistral", "dynamic"),  # 6 prompt + 6 new tokens: the window of 4 slides
    ("mistral", "static"),
    ("qwen2", "static"),
    ("gemma2", "dynamic"),
    ("gpt_oss", "static"),
    ("gpt2", "dynamic"),
    ("t5", "dynamic"),
    ("whisper", "static"),
]


@pytest.mark.parametrize(("name", "cache"), GENERATE)
def test_generate_matches_eager_and_sdpa(name: str, cache: str) -> None:
    m = model(name)
    ids, mask = padded([6, 3], 6, "left")
    kwargs: dict[str, Any] = dict(input_ids=ids, attention_mask=mask)
    if name == "whisper":
        kwargs = dict(input_features=inputs(name, "left", torch.float32)[0]["input_features"][:2])
    generated = {}
    for impl in ["attnkit", *references(name)]:
        with use(m, impl):
            generated[impl] = m.generate(
                **kwargs,
                max_new_tokens=6,
                do_sample=False,
                cache_implementation=cache,
                return_dict_in_generate=True,
                output_logits=True,
            )
    ours = generated.pop("attnkit")
    for impl, theirs in generated.items():
        assert torch.equal(ours.sequences, theirs.sequences), impl
        for a, b in zip(ours.logits, theirs.logits, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0, msg=impl)


@pytest.mark.parametrize(
    ("name", "side"),
    [
        ("llama", "left"),
        ("mistral", "left"),
        ("t5", "left"),
        ("gpt2", "left"),
        ("gemma2", "none"),
        ("gpt_oss", "left"),  # the sinks' gradient too
    ],
)
def test_gradients_match(name: str, side: str) -> None:
    m = model(name, torch.float64)
    batch, real = inputs(name, side, torch.float64)
    weight = torch.randn(*real.shape, V, generator=torch.Generator().manual_seed(3), dtype=m.dtype)
    refs = references(name)
    if side == "left" and name in SOFTMAX_IN_FLOAT32:
        refs.remove("eager")
    grads = {}
    for impl in ["attnkit", *refs]:
        m.zero_grad(set_to_none=True)
        with use(m, impl):
            logits = m(**batch).logits
        (logits * weight)[real].sum().backward()
        grads[impl] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    for impl in refs:
        tol = (1e-4, 1e-5) if impl == "eager" and name in SOFTMAX_IN_FLOAT32 else (1e-10, 1e-8)
        assert grads["attnkit"].keys() == grads[impl].keys()
        for n, g in grads["attnkit"].items():
            torch.testing.assert_close(g, grads[impl][n], atol=tol[0], rtol=tol[1], msg=n + impl)


# --------------------------------------------------------------------------------------------------
# Attention weights


@pytest.mark.parametrize("name", ["llama", "gpt2", "whisper"])
def test_output_attentions(name: str) -> None:
    """Weights without falling back to eager: GPT-2 and Whisper do not pass output_attentions on."""
    m = model(name)
    batch, real = inputs(name, "left", torch.float32)
    ours = run(m, "attnkit", **batch, output_attentions=True)
    theirs = run(m, "eager", **batch, output_attentions=True)
    fields = ["attentions"] if name != "whisper" else ["encoder_attentions", "decoder_attentions"]
    fields += ["cross_attentions"] if name == "whisper" else []
    for field in fields:
        assert len(getattr(ours, field)) == 2, field
        for a, b in zip(getattr(ours, field), getattr(theirs, field), strict=True):
            rows = real[:, None, :, None] if a.size(-2) == real.size(-1) else True
            torch.testing.assert_close(a * rows, b * rows, atol=1e-6, rtol=0)


def test_output_attentions_with_a_static_cache() -> None:
    m = model("llama")
    ids, mask = padded([6, 3], 6, "left")
    out = {}
    for impl in ("eager", "attnkit"):
        with use(m, impl):
            out[impl] = m.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=2,
                do_sample=False,
                cache_implementation="static",
                return_dict_in_generate=True,
                output_attentions=True,
            ).attentions
    for step_ours, step_theirs in zip(out["attnkit"], out["eager"], strict=True):
        for a, b in zip(step_ours, step_theirs, strict=True):
            assert a.shape == b.shape  # the whole static cache, empty slots weighing 0
            torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=0)  # the unpadded row


def test_capture_attention_records_every_layer() -> None:
    m = model("t5")
    batch, _ = inputs("t5", "right", torch.float32)
    with use(m, "attnkit"), attnkit.capture_attention(m) as maps, torch.no_grad():
        m(**batch)
    theirs = run(m, "eager", **batch, output_attentions=True)
    assert sorted(maps) == sorted(
        [f"encoder.block.{i}.layer.0.SelfAttention" for i in range(2)]
        + [f"decoder.block.{i}.layer.0.SelfAttention" for i in range(2)]
        + [f"decoder.block.{i}.layer.1.EncDecAttention" for i in range(2)]
    )
    for i in range(2):
        got = maps[f"encoder.block.{i}.layer.0.SelfAttention"]
        assert len(got) == 1
        real = batch["attention_mask"].bool()[:, None, :, None]
        torch.testing.assert_close(got[0] * real, theirs.encoder_attentions[i] * real)


def test_no_weights_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[bool] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs.get("return_weights", False))
        return attnkit.attention(*args, **kwargs)

    monkeypatch.setattr(hf, "attention", spy)
    batch, _ = inputs("gpt2", "left", torch.float32)
    run(model("gpt2"), "attnkit", **batch)
    assert asked == [False, False]


# --------------------------------------------------------------------------------------------------
# Dropout


class _Layer(torch.nn.Module):
    """An attention layer as transformers' attention functions see one: 4 query heads, 2 kv."""

    is_causal = True
    num_key_value_groups = 2


def _qkv(tq: int = 5, tk: int = 5) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, tq, 8, generator=g)
    return q, torch.randn(2, 2, tk, 8, generator=g), torch.randn(2, 2, tk, 8, generator=g)


def test_dropout_only_in_training() -> None:
    layer = _Layer()
    q, k, v = _qkv()
    f = AttentionInterface()["attnkit"]
    layer.eval()
    plain = f(layer, q, k, v, None, dropout=0.0)[0]
    torch.testing.assert_close(f(layer, q, k, v, None, dropout=0.5)[0], plain)
    layer.train()
    torch.manual_seed(0)
    assert not torch.allclose(f(layer, q, k, v, None, dropout=0.5)[0], plain)


def test_training_dropout_in_a_model(monkeypatch: pytest.MonkeyPatch) -> None:
    rates: list[float] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        rates.append(kwargs["dropout_p"])
        return attnkit.attention(*args, **kwargs)

    monkeypatch.setattr(hf, "attention", spy)
    m = model("bert")
    batch, _ = inputs("bert", "right", torch.float32)
    for layer in m.encoder.layer:
        monkeypatch.setattr(layer.attention.self.dropout, "p", 0.5)
    try:
        m.train()
        with use(m, "attnkit"):
            m(**batch)
    finally:
        m.eval()
    run(m, "attnkit", **batch)
    assert rates == [0.5, 0.5, 0.0, 0.0]  # two layers in training, then two in eval


# --------------------------------------------------------------------------------------------------
# Negative controls: the comparisons above catch a dropped mask and the top-left case


def test_control_an_attention_function_alone_drops_padding() -> None:
    """Without the mask function transformers passes mask=None: padding is attended to."""
    AttentionInterface.register("attnkit_alone", AttentionInterface()["attnkit"])
    try:
        m = model("gpt2")
        batch, real = inputs("gpt2", "left", torch.float32)
        alone = main_output(run(m, "attnkit_alone", **batch))[real]
        eager = main_output(run(m, "eager", **batch))[real]
        assert (alone - eager).abs().max() > 1e-2
    finally:
        AttentionInterface._global_mapping.pop("attnkit_alone")


def _bottom_right_when_none(
    module: Any, q: Tensor, k: Tensor, v: Tensor, mask: Any, **kw: Any
) -> Any:
    """A wrong attention function: reads mask=None as attnkit's bottom-right causal."""
    if mask is None and q.size(-2) > 1:
        out = attnkit.attention(q, k, v, causal=True, scale=kw.get("scaling"))
        return out.transpose(1, 2), None
    return AttentionInterface()["attnkit"](module, q, k, v, mask, **kw)


@pytest.mark.parametrize(
    ("attention_fn", "matches"),
    [("attnkit", True), ("bottom_right", False)],
)
def test_control_top_left_when_transformers_skips_the_mask(
    attention_fn: str, matches: bool
) -> None:
    """transformers' sdpa mask function returns None for an empty static cache's prefill
    (Tk = cache size > Tq) and means top-left causal there; attnkit's causal is bottom-right."""
    fn = AttentionInterface()["attnkit"] if attention_fn == "attnkit" else _bottom_right_when_none
    AttentionInterface.register("attnkit_hf_masks", fn)
    mu.AttentionMaskInterface.register("attnkit_hf_masks", mu.sdpa_mask)
    try:
        m = model("llama", torch.float64)
        ids = padded([6, 6], 6, "left")[0]
        logits = {}
        for impl in ("sdpa", "attnkit_hf_masks"):
            with use(m, impl):
                logits[impl] = m.generate(
                    input_ids=ids,
                    max_new_tokens=4,  # a static cache of 10 slots
                    do_sample=False,
                    cache_implementation="static",
                    return_dict_in_generate=True,
                    output_logits=True,
                ).logits[0]  # the prefill's
        same = torch.allclose(logits["attnkit_hf_masks"], logits["sdpa"], atol=1e-10, rtol=0)
        assert same is matches
    finally:
        AttentionInterface._global_mapping.pop("attnkit_hf_masks")
        mu.AttentionMaskInterface._global_mapping.pop("attnkit_hf_masks")


def test_mask_none_follows_sdpa() -> None:
    """mask=None: top-left causal for a causal module with Tq > 1, as transformers' sdpa."""
    layer = _Layer().eval()
    f = AttentionInterface()["attnkit"]
    for tq, tk, causal in [(3, 7, True), (1, 7, True), (6, 4, True), (3, 7, False)]:
        q, k, v = _qkv(tq, tk)
        layer.is_causal = causal
        ours = f(layer, q, k, v, None, scaling=0.3)[0]
        theirs = sdpa_attention_forward(layer, q, k, v, None, scaling=0.3)[0]
        torch.testing.assert_close(ours, theirs, msg=f"Tq={tq} Tk={tk} causal={causal}")


def test_custom_masks_bool_and_float() -> None:
    layer = _Layer().eval()
    q, k, v = _qkv(4, 6)
    f = AttentionInterface()["attnkit"]
    allowed = torch.rand(2, 1, 4, 6, generator=torch.Generator().manual_seed(2)) > 0.3
    allowed[..., 0] = True
    additive = torch.zeros(2, 1, 4, 6).masked_fill(~allowed, torch.finfo(torch.float32).min)
    for mask in (allowed, additive):
        ours = f(layer, q, k, v, mask, scaling=0.3)[0]
        theirs = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.3)[0]
        torch.testing.assert_close(ours, theirs)


# --------------------------------------------------------------------------------------------------
# Packed sequences without padding (DataCollatorWithFlattening)

PACKED = [[9, 4, 7], [5, 11, 2]]  # token counts of each training example, two batches


def _examples(lengths: list[int]) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(sum(lengths))
    return [{"input_ids": torch.randint(3, V, (n,), generator=g).tolist()} for n in lengths]


def _loss_and_grads(m: Any, impl: str, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
    m.zero_grad(set_to_none=True)
    with use(m, impl):
        loss = m(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_packed_training_equals_padded(name: str, flash_kwargs: bool) -> None:
    """DataCollatorWithFlattening's batches (no padding) give the loss and the gradients of the
    same examples padded, on the CPU: each example attends only to itself."""
    m = model(name, torch.float64)
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    for lengths in PACKED:
        examples = _examples(lengths)
        packed = collate(examples)
        ids, mask = padded(lengths, max(lengths), "right")
        for row, ex in enumerate(examples):
            ids[row, : lengths[row]] = torch.tensor(ex["input_ids"])
        labels = ids.masked_fill(mask == 0, -100)
        padded_batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
        loss, grads = _loss_and_grads(m, "attnkit", packed)
        want, want_grads = _loss_and_grads(m, "sdpa", padded_batch)
        # transformers computes the loss (and rotary angles) in float32 even for a float64 model.
        torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-6)
        assert grads.keys() == want_grads.keys()
        for n, g in grads.items():
            torch.testing.assert_close(g, want_grads[n], atol=1e-6, rtol=1e-5, msg=n)


def test_packed_position_ids_become_documents(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' packed-sequence mask reaches attention as documents & causal, never dense;
    it equals transformers' own dense mask."""
    seen: list[Any] = []
    real = hf.attention

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "attention", spy)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    ids = mu.find_packed_sequence_indices(positions)
    for base in (mu.causal_mask_function, mu.sliding_window_causal_mask_function(2)):
        fn = mu.and_masks(
            mu.remap_positions_for_packed_sequence(base, positions),
            mu.packed_sequence_mask_function(ids),
        )
        kwargs = dict(batch_size=1, q_length=9, kv_length=9, mask_function=fn)
        built = hf.build_mask(**kwargs)
        assert "packed sequences" in repr(built)
        assert isinstance(built.mask, attnkit.masks.Mask)
        assert torch.equal(built.dense(), _hf_dense(**kwargs))
    m = model("llama")
    batch = transformers.DataCollatorWithFlattening()(_examples([3, 5, 4]))
    run(m, "attnkit", **batch)
    assert seen
    assert all("documents(" in repr(kw["mask"]) and kw["causal"] for kw in seen)


def test_cu_seq_lens_without_a_mask_follow_flash_attention() -> None:
    """The attention function alone, handed cu_seq_lens as transformers' flash path is: the
    sequences are independent, causal within each (a window too, as ``sliding_window`` says)."""
    layer = _Layer().eval()
    f = AttentionInterface()["attnkit"]
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 4, 10, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 10, 8, generator=g, dtype=torch.float64) for _ in range(2))
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    for window in (None, 2):
        extra = {} if window is None else {"sliding_window": window}
        out = f(layer, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                max_length_q=5, max_length_k=5, **extra)[0]  # fmt: skip
        for a, b in zip(cu.tolist(), cu.tolist()[1:], strict=False):
            n = b - a
            allowed = mu.sdpa_mask(
                batch_size=1, q_length=n, kv_length=n,
                mask_function=mu.causal_mask_function if window is None
                else mu.sliding_window_causal_mask_function(window),
                allow_is_causal_skip=False,
            )  # fmt: skip
            part = (t[:, :, a:b] for t in (q, k, v))
            want = sdpa_attention_forward(layer, *part, allowed, scaling=0.3)[0]
            torch.testing.assert_close(out[:, a:b], want)


# --------------------------------------------------------------------------------------------------
# What it cannot serve, and registration


def test_unservable_masks_are_errors() -> None:
    layer = _Layer().eval()
    q, k, v = _qkv()
    f = AttentionInterface()["attnkit"]
    with pytest.raises(TypeError, match="_Layer: attention_mask must be a 4-d bool or float"):
        f(layer, q, k, v, {"full_attention": None})
    with pytest.raises(ValueError, match=r"must be 4-d .* got torch.bool of shape \(2, 5\)"):
        f(layer, q, k, v, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="need both cu_seq_lens_q and cu_seq_lens_k, got only"):
        f(layer, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 5]))
    cu = torch.tensor([0, 2, 5])
    with pytest.raises(ValueError, match=r"come in one batch row, got q \(2, 4, 5, 8\)"):
        f(layer, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    wrong = hf.build_mask(batch_size=2, q_length=5, kv_length=9, q_offset=4)
    with pytest.raises(ValueError, match=r"does not fit q \(2, 4, 5, 8\) and k \(2, 2, 5, 8\)"):
        f(layer, q, k, v, wrong)


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
    monkeypatch.setattr(hf.importlib.metadata, "version", lambda _: "5.19.2")
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
