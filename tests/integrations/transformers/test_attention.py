"""The attention function in whole models against transformers' eager and sdpa: logits, generation,
gradients, attention weights, dropout, packed sequences, and the calls it refuses.

Logits are compared at real tokens only: a padded query has no key to attend, and each
implementation fills that row its own way (eager: a uniform average; sdpa and attnkit: zeros),
which reaches no real token."""

from __future__ import annotations

import itertools
import warnings
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
from attnkit.integrations.transformers import _attention as attention_module  # noqa: E402

from .helpers import Layer, V, hf_dense, inputs, main_output, model, padded, qkv, run, use  # noqa: E402

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

    monkeypatch.setattr(attention_module, "attention", spy)
    batch, _ = inputs("gpt2", "left", torch.float32)
    run(model("gpt2"), "attnkit", **batch)
    assert asked == [False, False]


# Dropout


def test_dropout_only_in_training() -> None:
    layer = Layer()
    q, k, v = qkv()
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

    monkeypatch.setattr(attention_module, "attention", spy)
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
    layer = Layer().eval()
    f = AttentionInterface()["attnkit"]
    for tq, tk, causal in [(3, 7, True), (1, 7, True), (6, 4, True), (3, 7, False)]:
        q, k, v = qkv(tq, tk)
        layer.is_causal = causal
        ours = f(layer, q, k, v, None, scaling=0.3)[0]
        theirs = sdpa_attention_forward(layer, q, k, v, None, scaling=0.3)[0]
        torch.testing.assert_close(ours, theirs, msg=f"Tq={tq} Tk={tk} causal={causal}")


def test_custom_masks_bool_and_float() -> None:
    layer = Layer().eval()
    q, k, v = qkv(4, 6)
    f = AttentionInterface()["attnkit"]
    allowed = torch.rand(2, 1, 4, 6, generator=torch.Generator().manual_seed(2)) > 0.3
    allowed[..., 0] = True
    additive = torch.zeros(2, 1, 4, 6).masked_fill(~allowed, torch.finfo(torch.float32).min)
    for mask in (allowed, additive):
        ours = f(layer, q, k, v, mask, scaling=0.3)[0]
        theirs = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.3)[0]
        torch.testing.assert_close(ours, theirs)


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
    real = attention_module.attention

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_module, "attention", spy)
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
        assert torch.equal(built.dense(), hf_dense(**kwargs))
    m = model("llama")
    batch = transformers.DataCollatorWithFlattening()(_examples([3, 5, 4]))
    run(m, "attnkit", **batch)
    assert seen
    assert all("documents(" in repr(kw["mask"]) and kw["causal"] for kw in seen)


def test_cu_seq_lens_without_a_mask_follow_flash_attention() -> None:
    """The attention function alone, handed cu_seq_lens as transformers' flash path is: the
    sequences are independent, causal within each (a window too, as ``sliding_window`` says)."""
    layer = Layer().eval()
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


def test_packed_training_compiles() -> None:
    """Under torch.compile, where packed sequences start is data: position_ids that reset
    become a documents mask in the graph. A compiled packed batch's logits equal eager attnkit's
    (which reads the boundaries) and the padded batch's, at two packings."""
    m = model("llama")
    with use(m, "attnkit"), torch.no_grad():
        # (aot_eager: what is tested is the tracing, one graph with the documents as data)
        compiled = torch.compile(
            lambda **batch: m(**batch).logits, fullgraph=True, backend="aot_eager"
        )
        for lengths in ([3, 5, 4], [6, 2, 4]):
            batch = transformers.DataCollatorWithFlattening()(_examples(lengths))
            batch.pop("labels", None)
            want = m(**batch).logits
            torch.testing.assert_close(compiled(**batch), want)
            starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
            for i, (a, b) in enumerate(itertools.pairwise(starts)):
                alone = m(input_ids=batch["input_ids"][:, a:b]).logits
                torch.testing.assert_close(want[:, a:b], alone, msg=f"sequence {i}")


def test_unservable_masks_are_errors() -> None:
    layer = Layer().eval()
    q, k, v = qkv()
    f = AttentionInterface()["attnkit"]
    with pytest.raises(TypeError, match=r"^Layer: attention_mask must be a 4-d bool or float"):
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


# A dozen families of the sweep (benchmarks/sweep_transformers.py), each for a reason: the common
# shapes, softcap and sinks, and those that need more than a structured mask: indexers that slice
# the mask (DeepSeek V3.2, GLM-MoE-DSA, AXK2, HY-V4, Kolibri 1.1), a mask edited with the model's
# own terms (Doge), a mask widened for compressed keys (DeepSeek V4), per-query sinks (Inkling 2),
# models with attention code of their own (refused at load).
SWEEP = {
    "llama": "equal", "qwen2": "equal", "gemma3_text": "equal", "gpt_oss": "equal",
    "bert": "equal", "t5": "equal", "deepseek_v32": "equal", "glm_moe_dsa": "equal",
    "axk2": "equal", "hy_v4": "equal", "kolibri1_1": "equal", "doge": "equal",
    "deepseek_v4": "equal", "inkling2_text": "equal", "bloom": "refused", "gpt_neo": "refused",
    "encoder-decoder": "equal",  # a BERT decoder's cross-attention mask, sized from its cache
    # Per-layer head sizes; the last layers reuse earlier keys and values and slice the mask.
    "gemma4_text": "equal", "gemma3n_text": "equal",
    "bamba": "equal", "jamba": "equal",  # Mamba hybrids: attention in some layers only
    "qwen4_exp_text": "equal", "dots3_note_text": "equal",
    "git": "refused",  # its text layers pick their class from an eager-only table
}  # fmt: skip


@pytest.mark.parametrize("family", SWEEP)
def test_sweep_families_match_eager(family: str) -> None:
    from .helpers import sweep

    verdict, detail = sweep().sweep_one(family)
    assert verdict == SWEEP[family], f"{family}: {verdict} ({detail})"


# The sweep's other settings, and families without a language-model head (``--heads other``): a
# static cache and bfloat16 on a causal LM, a dual encoder (token ids and images), an audio
# encoder on a spectrogram, a vision tower taking two images' patches packed in one sequence
# (Qwen2.5-VL's, attending within each image), and LASR, whose convolution module reads the layer
# mask itself.
SWEEP_SETTINGS = {
    "llama, static cache": ("llama", {"static": True}),
    "gemma2, bfloat16, static cache": ("gemma2", {"dtype": torch.bfloat16, "static": True}),
    "clip": ("clip", {"sdpa": True}),
    "audio-spectrogram-transformer": ("audio-spectrogram-transformer", {}),
    "qwen2_5_vl_vision": ("qwen2_5_vl_vision", {"sdpa": True}),
    "lasr_encoder": ("lasr_encoder", {"sdpa": True}),
}


@pytest.mark.parametrize("case", SWEEP_SETTINGS)
def test_sweep_settings_and_other_families_match_eager(case: str) -> None:
    from .helpers import sweep

    family, options = SWEEP_SETTINGS[case]
    row = sweep().sweep_row(family, sweep().Options(**options))
    assert row.verdict == "equal", f"{case}: {row.verdict} ({row.detail})"
    assert row.sdpa == ("equal" if options.get("sdpa") else None), row.detail
    if options.get("static"):
        assert "static cache same" in row.detail, row.detail


def _eager_with_sinks(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, sinks: Tensor) -> Tensor:
    """Inkling 2's eager attention: one more logit per query (``sinks``, (B, H, Tq, 1)) in each
    row's softmax, with a zero value."""
    k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~allowed, -torch.inf)
    weights = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    return (weights @ v).transpose(1, 2)


@pytest.mark.parametrize("backend", ["attnkit", "attnkit_chunked"])
def test_per_query_sinks(backend: str) -> None:
    layer = Layer().eval()
    q, k, v = (t.double().requires_grad_() for t in qkv(5, 7))
    sinks = torch.randn(2, 4, 5, 1, dtype=torch.float64, requires_grad=True)
    mask = hf.build_mask(batch_size=2, q_length=5, kv_length=7, q_offset=2)
    weights_too = backend == "attnkit"  # only the reference backend returns weights
    out, weights = AttentionInterface()[backend](
        layer, q, k, v, mask, scaling=0.3, sinks=sinks, output_attentions=weights_too
    )
    allowed = hf_dense(batch_size=2, q_length=5, kv_length=7, q_offset=2)
    want = _eager_with_sinks(q, k, v, allowed, sinks)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    if weights_too:  # eager's weights: the sinks' share taken, their column dropped
        assert weights is not None
        values = v.detach().repeat_interleave(2, dim=1)
        got_out = (weights.detach() @ values).transpose(1, 2)
        torch.testing.assert_close(got_out, want.detach(), atol=1e-12, rtol=1e-10)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    wants = torch.autograd.grad(want.square().sum(), (q, k, v, sinks))
    for got, expected in zip(grads, wants, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match=r"per-query sinks must have shape \(B\|1, H, Tq, 1\) = "):
        AttentionInterface()[backend](layer, q, k, v, mask, sinks=sinks[..., 0])


def test_indexer_selection_is_applied() -> None:
    """DeepSeek V3.2's indexer hands attention functions other than eager and sdpa its top-k keys
    (``indices``) instead of folding them into the mask: attending every key would be another
    model."""
    layer = Layer().eval()
    q, k, v = (t.double() for t in qkv(5, 5))
    indices = torch.tensor([[0, 0], [0, 1], [2, 1], [3, 0], [4, 2]]).expand(2, 5, 2)
    allowed = hf_dense(batch_size=2, q_length=5, kv_length=5)
    selected = torch.zeros(2, 5, 5, dtype=torch.bool).scatter(-1, indices, True).unsqueeze(1)
    want = sdpa_attention_forward(layer, q, k, v, allowed & selected, scaling=0.3)[0]
    for mask in [hf.build_mask(batch_size=2, q_length=5, kv_length=5), allowed]:
        with attnkit.record_dispatch() as calls:
            out = AttentionInterface()["attnkit"](
                layer, q, k, v, mask, scaling=0.3, indices=indices
            )[0]
        torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
        # handed over as an index mask, not as a (B, 1, Tq, Tk) selection
        mask_seen = calls[0].call.mask
        assert mask_seen is not None
        assert "key_indices(indices (2, 1, 5, 2))" in mask_seen.describe()
    with pytest.raises(ValueError, match=r"block-sparse selection \(block_indices\)"):
        AttentionInterface()["attnkit"](layer, q, k, v, allowed, block_indices=indices)


def test_deepseek_v32_compiles_with_fullgraph() -> None:
    """DeepSeek V3.2 asks for transformers' bool tensor (its indexer slices it) and hands over
    ``indices``: their AND, and the index mask made from the indices (data while torch traces),
    trace with ``fullgraph=True``; the compiled logits equal sdpa's."""
    from .helpers import sweep

    config = sweep().tiny_config("deepseek_v32")
    config.index_topk, config.num_hidden_layers, config.mlp_layer_types = 4, 1, ["dense"]
    torch.manual_seed(0)
    m = transformers.DeepseekV32ForCausalLM(config).eval()
    ids = torch.randint(3, V, (2, 16), generator=torch.Generator().manual_seed(3))
    want = run(m, "sdpa", input_ids=ids).logits
    with use(m, "attnkit"), torch.no_grad():
        # (aot_eager: what is tested is the tracing, one graph)
        compiled = torch.compile(
            lambda ids: m(input_ids=ids).logits, fullgraph=True, backend="aot_eager"
        )
        torch.testing.assert_close(compiled(ids), want, atol=1e-5, rtol=1e-5)


def test_deepseek_v32_reads_its_indexer_selection_by_position() -> None:
    """DeepSeek V3.2 (a tiny one from its config): the indexer's top-4 keys of 32 reach attnkit as
    ``indices`` and run as ``masks.key_indices``, each query's keys gathered; logits equal sdpa's
    and eager's (which fold the selection into a dense mask; eager takes its softmax in float32),
    and greedy tokens and gradients equal sdpa's."""
    from .helpers import sweep

    config = sweep().tiny_config("deepseek_v32")
    config.index_topk = 4
    config.mlp_layer_types = ["dense"] * config.num_hidden_layers  # float64 throughout
    torch.manual_seed(0)
    m = transformers.DeepseekV32ForCausalLM(config).double().eval()
    ids = torch.randint(3, V, (2, 32), generator=torch.Generator().manual_seed(1))
    with attnkit.record_dispatch() as calls:
        got = run(m, "attnkit", input_ids=ids).logits
    kernels = {str(c.kernel).partition(" selected")[0] for c in calls}
    assert kernels == {"gathered: each query's 4"}, kernels
    torch.testing.assert_close(got, run(m, "sdpa", input_ids=ids).logits, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(got, run(m, "eager", input_ids=ids).logits, atol=1e-6, rtol=0)
    tokens, grads = {}, {}
    for impl in ["sdpa", "attnkit"]:
        with use(m, impl), torch.no_grad():
            tokens[impl] = m.generate(ids[:, :20], max_new_tokens=6, do_sample=False)
        m.zero_grad()
        with use(m, impl):
            m(input_ids=ids, labels=ids).loss.backward()
        grads[impl] = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
    assert torch.equal(tokens["attnkit"], tokens["sdpa"])
    torch.testing.assert_close(grads["attnkit"], grads["sdpa"], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_deepseek_v3_and_v32_tiny_models_equal_eager(family: str) -> None:
    """DeepSeek V3 (latent attention, expanded by transformers) and V3.2 (its indexer's top-4
    keys too), tiny from their configs, float64: logits through attnkit equal eager's (whose
    softmax runs in float32) and sdpa's, and 8 greedy tokens equal eager's."""
    from .helpers import sweep

    config = sweep().tiny_config(family)
    if family == "deepseek_v32":
        config.index_topk = 4
        config.mlp_layer_types = ["dense"] * config.num_hidden_layers
        cls = transformers.DeepseekV32ForCausalLM
    else:
        config.first_k_dense_replace = config.num_hidden_layers  # dense layers: float64 throughout
        cls = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    m = cls(config).double().eval()
    ids = torch.randint(3, V, (2, 24), generator=torch.Generator().manual_seed(2))
    with attnkit.record_dispatch() as calls:
        got = run(m, "attnkit", input_ids=ids).logits
    assert len(calls) == config.num_hidden_layers
    if family == "deepseek_v32":
        assert all(str(c.kernel).startswith("gathered") for c in calls), calls
    torch.testing.assert_close(got, run(m, "eager", input_ids=ids).logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(got, run(m, "sdpa", input_ids=ids).logits, atol=1e-12, rtol=1e-10)
    tokens = {}
    for impl in ["eager", "attnkit"]:
        with use(m, impl), torch.no_grad():
            tokens[impl] = m.generate(ids[:, :16], max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens["attnkit"], tokens["eager"])


def test_gemma4_assistant_matches_eager() -> None:
    """Gemma 4's assistant (the draft model of assisted generation) reads the target's keys and
    values and flips its sliding-window mask along the keys: ``'TransformersMask' object has no
    attribute 'flip'``. Its logits against eager's, the target's keys left-padded."""
    config = transformers.Gemma4AssistantConfig(
        text_config=dict(
            model_type="gemma4_text", vocab_size=V, hidden_size=32, intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            layer_types=["sliding_attention", "full_attention"], sliding_window=4,
            hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_kv_shared_layers=2,
            per_layer_config={1: {"head_dim": 16}},
        ),
        backbone_hidden_size=32,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(2, 3, 64, generator=g, dtype=torch.float64)
    shapes = {"full_attention": (2, 2, 9, 16), "sliding_attention": (2, 2, 4, 8)}
    states = {
        kind: tuple(torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2))
        for kind, shape in shapes.items()
    }
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    logits = {}
    for impl in ("eager", "attnkit"):
        torch.manual_seed(0)
        m = transformers.Gemma4AssistantForCausalLM._from_config(config, attn_implementation=impl)
        with torch.no_grad():
            out = m.double().eval()(
                inputs_embeds=embeds, shared_kv_states=states, attention_mask=mask
            )
        logits[impl] = out.logits
    # eager takes its softmax in float32 whatever the inputs: float32 rounding, not float64's
    torch.testing.assert_close(logits["attnkit"], logits["eager"], atol=1e-6, rtol=1e-5)


def test_export_takes_a_dynamic_length_from_two() -> None:
    """torch.export of a layer's call with a dynamic length ``Dim(min=2)``, as sdpa's exports:
    the packing read from ``position_ids`` in the graph must not narrow it (steps of length
    ``T - 1`` made it start at 3). The exported call equals the eager one at T = 2 and 7."""
    layer = Layer()

    class Call(torch.nn.Module):
        def forward(self, q: Tensor, k: Tensor, v: Tensor, pad: Tensor) -> Tensor:
            t = q.size(-2)
            mask = hf.build_mask(batch_size=2, q_length=t, kv_length=t, attention_mask=pad)
            positions = torch.arange(t).unsqueeze(0)
            out = attention_module.attention_forward(
                layer, q, k, v, mask, backend="auto", position_ids=positions
            )
            return out[0]

    t = torch.export.Dim("T", min=2, max=16)
    shapes = {"q": {2: t}, "k": {2: t}, "v": {2: t}, "pad": {1: t}}
    exported = torch.export.export(Call(), (*qkv(7, 7), padded([7, 4], 7, "left")[1].bool()),
                                   dynamic_shapes=shapes).module()  # fmt: skip
    for n in (2, 7):
        args = (*qkv(n, n), padded([n, 1], n, "left")[1].bool())
        real = args[-1][:, :, None, None]  # (B, T, 1, 1): real queries
        want = Call()(*args)
        torch.testing.assert_close(exported(*args) * real, want * real)


def test_compiled_packing_positions_and_a_dense_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled with ``fullgraph=True``, the packing read from ``position_ids`` is ANDed with a
    dense mask too (transformers' own, for a pattern attnkit does not know), as eager attnkit
    does: the call equals the eager one. (A 2-d mask without padding: one that hides a token
    turns the packing off.)"""
    # Outside a model's forward no output collector is active (a model's own compiles).
    monkeypatch.setattr(attention_module, "_model_collects_weights", lambda: False)
    layer = Layer()
    pad = torch.ones(1, 6, dtype=torch.bool)
    chunked = mu.chunked_causal_mask_function(4, torch.tensor([0]))

    def call(q: Tensor, k: Tensor, v: Tensor, pad: Tensor, positions: Tensor) -> Tensor:
        mask = hf.build_mask(
            batch_size=1, q_length=6, kv_length=6, mask_function=chunked, attention_mask=pad
        )
        out = attention_module.attention_forward(
            layer, q, k, v, mask, backend="auto", position_ids=positions
        )
        return out[0]

    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])  # two packed sequences of 3
    args = (*(t[:1] for t in qkv(6, 6)), pad, positions)
    got = torch.compile(call, fullgraph=True, backend="eager")(*args)
    real = pad[:, :, None, None]
    torch.testing.assert_close(got * real, call(*args) * real)


def test_a_batch_element_of_padding_alone_gives_no_warning_about_torchs_convention() -> None:
    # transformers' masks are True = may attend: a batch element that sees no key (a row of
    # padding alone, left padding under chunked prefill) is meant, and matches sdpa.
    from attnkit._base import hints

    layer = Layer().eval()
    q, k, v = qkv(4, 6)
    f = AttentionInterface()["attnkit"]
    allowed = torch.ones(2, 1, 4, 6, dtype=torch.bool)
    allowed[1] = False
    saved = set(hints._warned)
    hints._warned.clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ours = f(layer, q, k, v, allowed, scaling=0.3)[0]
    finally:
        hints._warned.clear()
        hints._warned.update(saved)
    theirs = sdpa_attention_forward(layer, q, k, v, allowed, scaling=0.3)[0]
    torch.testing.assert_close(ours[0], theirs[0])
    assert torch.equal(ours[1], torch.zeros_like(ours[1]))


def test_a_compiled_model_traces_attnkit_without_graph_breaks() -> None:
    """Compiled with torch.compile's defaults (graph breaks allowed), a model's attention traces
    in one graph: without packed sequences its ``position_ids`` are one row (0..T-1), which
    attnkit turns into a documents mask while torch.compile traces, and ranking those ids with
    ``torch.unique`` (an output shape that depends on data) broke the graph at every layer. The
    compiled logits equal eager's uncompiled ones at the real tokens."""
    from torch._dynamo.utils import counters

    m = model("llama")
    batch, real = inputs("llama", "left", torch.float32)
    want = run(m, "eager", **batch).logits
    torch._dynamo.reset()
    counters.clear()
    with use(m, "attnkit"), torch.no_grad():
        got = torch.compile(m, backend="aot_eager")(**batch).logits
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
