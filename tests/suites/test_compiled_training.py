"""Compiled training steps with the masks data loaders hand over: padding lengths and document
lengths as tensors, masks built inside the step or passed in, equal to eager over three optimizer
steps, across two sequence lengths without a recompilation per length."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks

MaskMaker = Callable[[Tensor, int], masks.Mask]

MASKS: dict[str, MaskMaker] = {
    "causal & key_padding(tensor)": lambda lengths, t: masks.causal() & masks.key_padding(lengths),
    "sliding_window & key_padding": lambda lengths, t: (
        masks.sliding_window(5) & masks.key_padding(lengths)
    ),
    "documents(list)": lambda lengths, t: masks.documents([t // 3, t - t // 3]),
    "documents(tensor)": lambda lengths, t: masks.documents(torch.stack([lengths, t - lengths], 1)),
    "documents(ids)": lambda lengths, t: (
        masks.documents(ids=(torch.arange(t) >= t // 2).long()) & masks.causal()
    ),
}


def _module(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "MultiHeadAttention":
        return attnkit.MultiHeadAttention(32, 4, num_kv_heads=2)
    return attnkit.RelativeMultiHeadAttention(32, 4)


def _train(
    module: torch.nn.Module,
    make: MaskMaker,
    *,
    compiled: bool,
    mask_as_input: bool,
    backend: str = "inductor",
) -> tuple[list[float], list[Tensor]]:
    """Three SGD steps at lengths 40, 48, 40 (the lengths tensors the steps' masks take)."""
    model = copy.deepcopy(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def loss_inside(x: Tensor, lengths: Tensor) -> Tensor:
        return model(x, mask=make(lengths, x.size(1))).square().mean()

    def loss_given(x: Tensor, mask: masks.Mask) -> Tensor:
        return model(x, mask=mask).square().mean()

    fn: Callable[[Tensor, object], Tensor] = loss_given if mask_as_input else loss_inside  # type: ignore[assignment]
    step = torch.compile(fn, fullgraph=True, dynamic=True, backend=backend) if compiled else fn
    gen = torch.Generator().manual_seed(1)
    losses = []
    for t in (40, 48, 40):
        x = torch.randn(2, t, 32, generator=gen)
        lengths = torch.tensor([t, t - 9])
        opt.zero_grad()
        loss = step(x, make(lengths, t) if mask_as_input else lengths)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


# Every mask built inside a MultiHeadAttention step; the README's and a document mask passed in;
# relative attention (its position term is a score term) with both kinds of data-made mask.
CASES = [
    *[("MultiHeadAttention", name, False) for name in MASKS],
    ("MultiHeadAttention", "causal & key_padding(tensor)", True),
    ("MultiHeadAttention", "documents(tensor)", True),
    ("RelativeMultiHeadAttention", "causal & key_padding(tensor)", False),
    ("RelativeMultiHeadAttention", "documents(ids)", True),
]
# Inductor for the README's mask, made inside and passed in, and for relative attention; the other
# masks differ in what dynamo traces (their tensors reach attnkit's operator the same way), which
# aot_eager's graphs show at a fraction of inductor's compile time.
INDUCTOR = {
    ("MultiHeadAttention", "causal & key_padding(tensor)", False),
    ("MultiHeadAttention", "causal & key_padding(tensor)", True),
    ("RelativeMultiHeadAttention", "causal & key_padding(tensor)", False),
}


@pytest.mark.parametrize(("kind", "name", "mask_as_input"), CASES)
def test_a_compiled_training_step_equals_eager(kind: str, name: str, mask_as_input: bool) -> None:
    torch._dynamo.reset()
    module = _module(kind)
    eager, eager_params = _train(module, MASKS[name], compiled=False, mask_as_input=False)
    # A list of lengths is constants in the graph: a new list, a new graph. Lengths in tensors
    # (and masks passed in) take one graph for both sequence lengths.
    once = not mask_as_input and name != "documents(list)"
    with torch._dynamo.config.patch(error_on_recompile=once):
        backend = "inductor" if (kind, name, mask_as_input) in INDUCTOR else "aot_eager"
        got, got_params = _train(
            module, MASKS[name], compiled=True, mask_as_input=mask_as_input, backend=backend
        )
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_params, eager_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_compiled_step_with_an_empty_batch_has_gradients() -> None:
    q = torch.randn(0, 4, 7, 8, requires_grad=True)
    k = torch.randn(0, 2, 7, 8, requires_grad=True)
    v = torch.randn(0, 2, 7, 6, requires_grad=True)

    def loss(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> Tensor:
        mask = masks.causal() & masks.key_padding(lengths)
        return attnkit.attention(q, k, v, mask=mask).sum()

    torch.compile(loss, fullgraph=True)(q, k, v, torch.zeros(0, dtype=torch.long)).backward()
    for t in (q, k, v):
        assert t.grad is not None
        assert t.grad.shape == t.shape


def test_negative_lengths_are_refused_when_the_compiled_call_runs() -> None:
    q = torch.randn(2, 4, 8, 8)

    def out(q: Tensor, lengths: Tensor) -> Tensor:
        return attnkit.attention(q, q, q, mask=masks.key_padding(lengths))

    step = torch.compile(out, fullgraph=True)
    torch.testing.assert_close(
        step(q, torch.tensor([8, 3])),
        attnkit.attention(q, q, q, mask=masks.key_padding([8, 3]), backend="reference"),
    )
    with pytest.raises((ValueError, RuntimeError), match=r"negative length -1|lie in \[0, Tk\]"):
        step(q, torch.tensor([8, -1]))


def test_a_compiled_transformers_training_step_equals_eager() -> None:
    """A tiny Llama with ``attn_implementation="attnkit"``: a left-padded batch (the padding
    mask a tensor, as a tokenizer gives it), three steps at two lengths, one graph; equal to
    attnkit eager and, at the real tokens' predictions, to transformers' eager attention."""
    transformers = pytest.importorskip("transformers")
    from attnkit.integrations.transformers import register

    register()
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config)

    def train(implementation: str, compiled: bool) -> list[float]:
        model = copy.deepcopy(base)
        model.set_attn_implementation(implementation)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)

        def loss(ids: Tensor, padding: Tensor) -> Tensor:
            # Predictions made at padded positions are not scored (labels shift by one).
            unscored = (padding == 0) | (padding.roll(1, 1) == 0)
            return model(
                input_ids=ids, attention_mask=padding, labels=ids.masked_fill(unscored, -100)
            ).loss

        step = torch.compile(loss, fullgraph=True, dynamic=True) if compiled else loss
        gen = torch.Generator().manual_seed(1)
        losses = []
        for t in (12, 16, 12):
            ids = torch.randint(0, 64, (2, t), generator=gen)
            padding = torch.ones(2, t, dtype=torch.long)
            padding[1, :3] = 0
            opt.zero_grad()
            value = step(ids, padding)
            value.backward()
            opt.step()
            losses.append(value.item())
        return losses

    torch._dynamo.reset()
    eager, ours = train("eager", False), train("attnkit", False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = train("attnkit", True)
    torch.testing.assert_close(compiled, ours, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)


def test_default_compile_takes_one_more_graph_not_one_per_length() -> None:
    """Without ``dynamic=True`` torch compiles the first length as it is and the second as a
    symbol: a third length, and a fourth, reuse that graph (the lengths tensors included)."""
    torch._dynamo.reset()
    model = attnkit.MultiHeadAttention(32, 4)
    compiles = 0

    def counting(gm: torch.fx.GraphModule, example: object) -> object:
        nonlocal compiles
        compiles += 1
        return gm.forward

    def loss(x: Tensor, lengths: Tensor) -> Tensor:
        return model(x, mask=masks.causal() & masks.key_padding(lengths)).square().mean()

    step = torch.compile(loss, backend=counting, fullgraph=True)
    for t in (40, 48, 56, 64):
        x = torch.randn(2, t, 32)
        lengths = torch.tensor([t, t - 9])
        torch.testing.assert_close(step(x, lengths), loss(x, lengths))
    assert compiles == 2
