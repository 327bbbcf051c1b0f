"""The mask function (``build_mask``, ``TransformersMask``) against transformers' own masks: every
pattern, prefill, decoding and static caches, with and without padding; causal plus padding and
sliding windows reach attnkit structured, never as a (Tq, Tk) tensor."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

transformers = pytest.importorskip("transformers")

from transformers import masking_utils as mu  # noqa: E402

import attnkit  # noqa: E402
from attnkit.integrations import transformers as hf  # noqa: E402
from attnkit.integrations.transformers import _attention as attention_module  # noqa: E402

from .helpers import hf_dense, inputs, model, padded, run  # noqa: E402

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
    theirs = hf_dense(**kwargs)
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
    theirs = hf_dense(**kwargs, q_offset=1, mask_function=mu.causal_mask_function)
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

    monkeypatch.setattr(attention_module, "attention", spy)
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


def test_a_model_that_asks_for_a_tensor_gets_transformers_own() -> None:
    """Indexers slice the mask and read its dtype (DeepSeek V3.2 asks with
    allow_is_causal_skip=False): they get sdpa's bool tensor, not the structured mask."""
    padding = padded([8, 5], 8, "left")[1].bool()
    for fn, flag in [
        (mu.causal_mask_function, "allow_is_causal_skip"),
        (mu.sliding_window_causal_mask_function(3), "allow_is_causal_skip"),
        (mu.bidirectional_mask_function, "allow_is_bidirectional_skip"),
    ]:
        args = dict(batch_size=2, q_length=8, kv_length=8, mask_function=fn, attention_mask=padding)
        ours = hf.build_mask(**args, **{flag: False})
        assert isinstance(ours, Tensor), (fn, ours)
        assert torch.equal(ours, hf_dense(**args))
        assert torch.equal(ours[:, 0, :, :], hf_dense(**args)[:, 0])  # as the indexers read it
        assert isinstance(hf.build_mask(**args), hf.TransformersMask)  # not asked: structured


def test_transformers_own_flags_keep_the_structured_mask() -> None:
    """The bidirectional mask creators pass allow_is_causal_skip=False whatever the model wants,
    and packed sequences set the flag too: neither is a model asking for a tensor."""
    ours = hf.build_mask(
        batch_size=2,
        q_length=8,
        kv_length=8,
        mask_function=mu.bidirectional_mask_function,
        attention_mask=padded([8, 5], 8, "left")[1].bool(),
        allow_is_causal_skip=False,
    )
    assert isinstance(ours, hf.TransformersMask)
    assert ours.mask is not None
    ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    packed = mu.and_masks(
        mu.remap_positions_for_packed_sequence(mu.causal_mask_function, ids),
        mu.packed_sequence_mask_function(mu.find_packed_sequence_indices(ids)),
    )
    ours = hf.build_mask(
        batch_size=1, q_length=8, kv_length=8, mask_function=packed, allow_is_causal_skip=False
    )
    assert isinstance(ours, hf.TransformersMask), ours
    assert ours.packed


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("sizes", [(7, 7, 0, 0, 7), (3, 12, 4, 0, 7)], ids=str)
def test_the_last_queries_of_a_mask(pattern: str, sizes: tuple[int, ...]) -> None:
    """Gemma 4 keeps the last queries once its remaining layers reuse earlier layers' keys and
    values (``mask[:, :, -n:, :]``, also with n = Tq): the structured mask of those queries, the
    rows of transformers' mask, and attention over them as eager computes it. Indexing failed
    with ``'TransformersMask' object is not subscriptable``."""
    from transformers import AttentionInterface

    from .helpers import Layer

    q_len, kv_len, q_offset, kv_offset, seen = sizes
    kwargs = dict(
        batch_size=2,
        q_length=q_len,
        kv_length=kv_len,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=PATTERNS[pattern](),
        attention_mask=padded([seen, seen - 3], seen, "left")[1].bool(),
    )
    ours = hf.build_mask(**kwargs)
    theirs = hf_dense(**kwargs)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, kv_len, 8, generator=g, dtype=torch.float64) for _ in range(2))
    for n in (2, q_len):
        rows = ours[:, :, -n:, :]
        assert isinstance(rows, hf.TransformersMask), rows
        want = theirs[:, :, -n:, :]
        assert torch.equal(rows.dense().expand(want.shape), want), rows
        q = torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64)
        out, _ = AttentionInterface()["attnkit"](Layer(), q, k, v, rows, scaling=0.3)
        bias = torch.zeros(want.shape, dtype=q.dtype).masked_fill(~want, -torch.inf)
        weights = torch.softmax(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3 + bias, -1)
        expected = (weights.nan_to_num() @ v.repeat_interleave(2, 1)).transpose(1, 2)
        real = want.any(-1)[:, 0]  # a query that sees no key: eager averages, attnkit gives 0
        torch.testing.assert_close(out[real], expected[real], atol=1e-12, rtol=1e-10)
    other = ours[:, :, :2, :]  # not the last queries: the dense mask's rows
    assert torch.equal(other.expand(theirs[:, :, :2].shape), theirs[:, :, :2]), other


def test_a_model_reading_the_mask_gets_the_bool_tensor_it_stands_for() -> None:
    """LASR's convolution module reads the layer mask itself (its ``dtype``, then ``~mask``) to
    zero the frames that no query may see: it gets what sdpa's bool mask would give it, and the
    encoder's output at real frames equals eager's."""
    config_class = getattr(transformers, "LasrEncoderConfig", None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no LASR")
    mask = hf.build_mask(
        batch_size=2,
        q_length=5,
        kv_length=5,
        mask_function=mu.bidirectional_mask_function,
        attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
    )
    assert isinstance(mask, hf.TransformersMask)
    assert mask.dtype == torch.bool
    assert torch.equal(~mask, ~mask.dense())
    config = config_class(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
        num_mel_bins=16, subsampling_conv_channels=8, conv_kernel_size=5,
    )  # fmt: skip
    torch.manual_seed(0)
    encoder = transformers.AutoModel.from_config(config).eval()
    features = torch.randn(2, 40, 16, generator=torch.Generator().manual_seed(1))
    frames = torch.ones(2, 40, dtype=torch.long)
    frames[1, 28:] = 0
    outs = {}
    for impl in ("eager", "attnkit"):
        out = run(encoder, impl, input_features=features, attention_mask=frames)
        outs[impl] = out.last_hidden_state
    real = encoder._get_output_attention_mask(frames, outs["eager"].size(1)).bool()
    assert not real.all()  # the second row's padding reaches the encoder's frames
    torch.testing.assert_close(outs["attnkit"][real], outs["eager"][real], atol=1e-5, rtol=1e-4)
