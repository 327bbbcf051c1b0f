"""transformers' ``DeepseekV3Attention`` (tiny configs, random weights, no downloads) loaded into
MultiHeadLatentAttention: the same outputs in float64, in prefill and over 32 generated tokens
(attnkit's absorbed decode over its latent cache against transformers' eager attention over its
own cache)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks
from attnkit.interop import deepseek
from tests.interop.helpers import agrees

transformers = pytest.importorskip("transformers")

from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402

F64 = torch.float64
D, H = 48, 4
# transformers takes the RMS norms and the softmax in float32 even for float64 inputs (attnkit:
# in float64): the two agree to float32's rounding, 4e-8 here. A mistake in the formula (a rotary
# pair, a scale, a head's weights) is off by far more than this.
TOL = 1e-6


def config(**kw: Any) -> Any:
    settings: dict[str, Any] = dict(
        hidden_size=D,
        num_attention_heads=H,
        num_key_value_heads=H,
        q_lora_rank=20,
        kv_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=6,
        v_head_dim=10,
        num_hidden_layers=1,
        vocab_size=32,
        max_position_embeddings=64,
    )
    settings.update(kw)
    c = transformers.DeepseekV3Config(**settings)
    c._attn_implementation = "eager"
    return c


def module(c: Any, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    m = hf.DeepseekV3Attention(c, layer_idx=0).to(F64).eval()
    with torch.no_grad():  # norms' weights away from 1, biases away from 0
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m


def rope_table(c: Any, positions: Tensor, rotary: Any = None) -> tuple[Tensor, Tensor]:
    """transformers' ``position_embeddings`` (its rotary module's formula), with the angles in
    float64 where its module takes them in float32."""
    emb = hf.DeepseekV3RotaryEmbedding(c) if rotary is None else rotary
    freqs = positions[..., None].to(F64) * emb.inv_freq.to(F64)
    angle = torch.cat((freqs, freqs), dim=-1)
    return angle.cos() * emb.attention_scaling, angle.sin() * emb.attention_scaling


def additive(allowed: Tensor) -> Tensor:
    """attnkit's bool mask (True = may attend) as the float mask transformers' eager adds."""
    return torch.zeros(allowed.shape, dtype=F64).masked_fill(~allowed, torch.finfo(F64).min)


def randn(*shape: int, seed: int = 1) -> Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"q_lora_rank": None},
        {"rope_interleave": False},
        {"attention_bias": True},
    ],
    ids=["q_lora", "no_q_lora", "halves", "bias"],
)
def test_prefill_equals_transformers(kw: dict[str, Any]) -> None:
    c = config(**kw)
    theirs = module(c)
    ours = deepseek.latent_attention(theirs)
    t, lengths = 9, [9, 6]
    x = randn(2, t, D)
    keys = torch.arange(t)
    allowed = (keys[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :] & (
        keys[None, :] <= keys[:, None]
    )
    with torch.no_grad():
        want, _ = theirs(x, rope_table(c, keys[None]), additive(allowed))
        got = ours(x, mask=masks.key_padding(lengths), causal=True)
    agrees(got, want, TOL)


def test_yarn_frequencies_and_scale() -> None:
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    c = config(rope_parameters=rope)
    theirs, rotary = module(c), hf.DeepseekV3RotaryEmbedding(c)
    with pytest.raises(ValueError, match=r'rope_type="yarn".*rotary=deepseek\.rotary_embedding'):
        deepseek.latent_attention(theirs)
    ours = deepseek.latent_attention(theirs, rotary=deepseek.rotary_embedding(rotary))
    assert ours.scale == pytest.approx(theirs.scaling)
    assert ours.scale != 1 / (8 + 6) ** 0.5
    x = randn(1, 12, D)
    keys = torch.arange(12)
    with torch.no_grad():
        want, _ = theirs(
            x, rope_table(c, keys[None], rotary), additive(keys[None] <= keys[:, None])
        )
        got = ours(x, causal=True)
    agrees(got, want, TOL)


def test_32_generated_tokens_equal_transformers_with_its_cache() -> None:
    """A prompt of 5 tokens, then 32 steps, each fed transformers' previous output (normalised,
    as a model's next token embeds the choice made from its output): attnkit's absorbed decode
    over its latent cache against transformers' eager attention over its DynamicCache."""
    c = config()
    theirs = module(c)
    ours = deepseek.latent_attention(theirs)
    prompt, steps = 5, 32
    # (transformers' cache is its attention's fourth argument: named past_key_values, then cache)
    their_cache, our_cache = DynamicCache(config=c), ours.make_cache(2, prompt + steps)
    x = randn(2, prompt, D)
    keys = torch.arange(prompt)
    with torch.no_grad(), attnkit.record_dispatch() as calls:
        want, _ = theirs(
            x, rope_table(c, keys[None]), additive(keys[None] <= keys[:, None]), their_cache
        )
        got = ours(x, causal=True, cache=our_cache, form="expanded")
        agrees(got, want, TOL)
        last = want[:, -1:]
        for step in range(prompt, prompt + steps):
            x = last / last.square().mean(-1, keepdim=True).sqrt()
            last, _ = theirs(x, rope_table(c, torch.tensor([[step]])), None, their_cache)
            agrees(ours(x, causal=True, cache=our_cache), last, TOL)
    assert our_cache.length == their_cache.get_seq_length() == prompt + steps
    # every step after the prompt was one multi-query call over the latents: Dk = R + Dr, Hkv = 1
    decoded = [(d.call.num_kv_heads, d.call.qk_dim, d.call.v_dim) for d in calls[1:]]
    assert decoded == [(1, 24 + 6, 24)] * steps


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_each_form_equals_transformers_in_prefill_and_over_32_generated_tokens(form: str) -> None:
    """Each form, held for the whole run (a prompt whose batch row 1 has 2 padding tokens, then
    32 steps over the latent cache), against transformers' eager module over its own cache,
    given the same keys to attend: so the two forms also equal each other."""
    c = config()
    theirs = module(c, seed=3)
    ours = deepseek.latent_attention(theirs)
    prompt, steps = 6, 32
    their_cache, our_cache = DynamicCache(config=c), ours.make_cache(2, prompt + steps)
    valid = torch.ones(2, prompt + steps, dtype=torch.bool)
    valid[1, 4:prompt] = False  # row 1's prompt: 4 tokens, then 2 of padding
    x = randn(2, prompt, D, seed=4)
    keys = torch.arange(prompt)
    allowed = valid[:, None, None, :prompt] & (keys[None, :] <= keys[:, None])
    with torch.no_grad(), attnkit.record_dispatch() as calls:
        want, _ = theirs(x, rope_table(c, keys[None]), additive(allowed), their_cache)
        padding = masks.key_padding(valid=valid[:, :prompt])
        agrees(ours(x, mask=padding, causal=True, cache=our_cache, form=form), want, TOL)
        last = want[:, -1:]
        for step in range(prompt, prompt + steps):
            x = last / last.square().mean(-1, keepdim=True).sqrt()
            seen = valid[:, : step + 1]
            position = rope_table(c, torch.tensor([[step]]))
            last, _ = theirs(x, position, additive(seen[:, None, None]), their_cache)
            got = ours(x, mask=masks.key_padding(valid=seen), cache=our_cache, form=form)
            agrees(got, last, TOL)
    assert our_cache.length == prompt + steps
    # the form held: the absorbed one attends one latent head (Dk = R + Dr, Dv = R), the
    # expanded one H heads of Dn + Dr and Dv
    shapes = {(d.call.num_kv_heads, d.call.qk_dim, d.call.v_dim) for d in calls}
    assert shapes == ({(1, 24 + 6, 24)} if form == "absorbed" else {(H, 8 + 6, 10)})


def test_what_the_loader_refuses() -> None:
    with pytest.raises(TypeError, match=r"takes an nn\.Module, got int"):
        deepseek.latent_attention(3)  # type: ignore[arg-type]
    m = module(config())
    m.config = object()
    with pytest.raises(TypeError, match=r"needs config\.qk_nope_head_dim"):
        deepseek.latent_attention(m)
    with pytest.raises(ValueError, match=r"inv_freq must be 1-d \(Dh / 2,\), got \(2, 3\)"):
        deepseek.FrequencyRotary(torch.ones(2, 3))


def _their_v2(seed: int = 0) -> tuple[Any, Any]:
    """transformers' DeepseekV2Attention (tiny, float64, weights away from their init) and its
    config."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2

    c = transformers.DeepseekV2Config(
        hidden_size=D, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=20,
        kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10,
        num_hidden_layers=1, vocab_size=32, max_position_embeddings=64,
    )  # fmt: skip
    c._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = v2.DeepseekV2Attention(c, layer_idx=0).to(F64).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m, v2.DeepseekV2RotaryEmbedding(c)


def test_deepseek_v2_rotates_interleaved_pairs_and_loads_so() -> None:
    # V2's config has no rope_interleave, and its rotation (by complex numbers) always takes the
    # pairs (x0, x1), (x2, x3), ...: copied as halves, its rotary products were another model's.
    theirs, rotary = _their_v2()
    ours = deepseek.latent_attention(theirs)
    x, keys = randn(2, 9, D, seed=5), torch.arange(9)
    with torch.no_grad():
        freqs = rotary(x, keys[None].expand(2, -1))
        want, _ = theirs(x, additive(keys[None] <= keys[:, None]), position_embeddings=freqs)
        got = ours(x, causal=True)
    agrees(got, want, TOL)


def test_deepseek_v32_loads_without_its_indexer_only_when_told() -> None:
    """DeepSeek V3.2's attention attends the keys its indexer selects: refused, or loaded with
    ignore_indexer=True and given the indexer's selection as an index mask, equal to
    transformers' eager module (which always rotates interleaved pairs)."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32

    c = transformers.DeepseekV32Config(
        hidden_size=D, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=20,
        kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10,
        index_topk=3, index_n_heads=2, index_head_dim=12, num_hidden_layers=1, vocab_size=32,
        max_position_embeddings=64,
    )  # fmt: skip
    c._attn_implementation = "eager"
    torch.manual_seed(1)
    theirs = v32.DeepseekV32Attention(c, layer_idx=0).to(F64).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    with pytest.raises(ValueError, match=r"attends only the keys its indexer selects \(index_topk"):
        deepseek.latent_attention(theirs)
    ours = deepseek.latent_attention(theirs, ignore_indexer=True)
    x, keys = randn(2, 9, D, seed=6), torch.arange(9)
    picked: list[Tensor] = []
    theirs.indexer.register_forward_hook(lambda mod, args, out: picked.append(out))
    allowed = (keys[None] <= keys[:, None]).expand(2, 1, 9, 9)
    with torch.no_grad():
        want, _ = theirs(
            x, rope_table(c, keys[None], v32.DeepseekV32RotaryEmbedding(c)), additive(allowed),
            position_ids=keys[None],
        )  # fmt: skip
        selected = masks.key_indices(picked[0].unsqueeze(1))
        got = ours(x, mask=selected & masks.causal())
    agrees(got, want, TOL)
