"""Recognising transformers' mask functions (``_patterns``): its own causal, bidirectional and
sliding-window functions and its packed sequences are read as patterns; anything else, or a
function that reads otherwise on sample positions, falls back to transformers' dense mask."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

transformers = pytest.importorskip("transformers")

from transformers import masking_utils as mu  # noqa: E402

from attnkit.integrations import transformers as hf  # noqa: E402
from attnkit.integrations.transformers import _patterns as patterns  # noqa: E402

from .helpers import hf_dense, padded  # noqa: E402


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
    assert torch.equal(ours.dense(), hf_dense(**kwargs))


def test_a_misread_pattern_falls_back_to_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transformers whose window function means something else is caught by the probe."""

    def overlay(sliding_window: int) -> Callable[..., Tensor]:
        def inner_mask(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return k >= q - sliding_window  # one key more than transformers' window

        inner_mask.__qualname__ = "sliding_window_overlay.<locals>.inner_mask"
        return inner_mask

    fn = mu.and_masks(overlay(5), mu.causal_mask_function)
    monkeypatch.setattr(patterns, "_AGREED", {})
    ours = hf.build_mask(batch_size=1, q_length=8, kv_length=8, mask_function=fn)
    assert "does not read as attnkit expects" in repr(ours)
    theirs = hf_dense(batch_size=1, q_length=8, kv_length=8, mask_function=fn)
    assert torch.equal(ours.dense(), theirs)


@pytest.mark.parametrize(
    ("fn", "want"),
    [
        (lambda: mu.causal_mask_function, patterns.Pattern(causal=True)),
        (lambda: mu.bidirectional_mask_function, patterns.Pattern(causal=False)),
        (lambda: mu.sliding_window_causal_mask_function(3), patterns.Pattern(True, 3)),
        (lambda: mu.sliding_window_bidirectional_mask_function(2), patterns.Pattern(False, 2)),
        (lambda: mu.chunked_causal_mask_function(3, torch.tensor([0])), None),
        (lambda: mu.and_masks(mu.causal_mask_function, mu.causal_mask_function), None),
        (lambda: lambda b, h, q, k: k <= q, None),  # causal, but not transformers' own
    ],
    ids=["causal", "bidirectional", "window3", "bidirectional2", "chunked", "and", "lambda"],
)
def test_transformers_own_functions_are_recognised_and_nothing_else(
    fn: Callable[[], Callable[..., Tensor]], want: patterns.Pattern | None
) -> None:
    got = patterns.recognise(fn())
    assert got == want
    if got is not None:  # and the reading holds where patterns differ
        assert patterns.agrees(fn(), got)


def test_packed_sequences_unpack_into_their_pattern_and_document_ids() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    fn = mu.and_masks(
        mu.remap_positions_for_packed_sequence(mu.causal_mask_function, positions),
        mu.packed_sequence_mask_function(ids),
    )
    unpacked = patterns.unpack(fn)
    assert unpacked is not None
    inner, got_ids = unpacked
    assert inner is mu.causal_mask_function
    assert torch.equal(got_ids, ids)
    assert patterns.unpack(mu.causal_mask_function) is None


@pytest.mark.parametrize("kind", ["causal", "window", "misread-window", "window-made-traced"])
def test_a_compiled_fullgraph_call_may_be_the_first_to_check_a_pattern(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A compiled ``fullgraph=True`` training step can be a process's first forward: the probe
    on sample positions then runs while torch.compile traces, and its answer holds there (a
    window served as attnkit's mask, a misread one as transformers' dense mask)."""

    def overlay(sliding_window: int) -> Callable[..., Tensor]:
        def inner_mask(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return k >= q - sliding_window  # one key more than transformers' window

        inner_mask.__qualname__ = "sliding_window_overlay.<locals>.inner_mask"
        return inner_mask

    fn = {
        "causal": mu.causal_mask_function,
        "window": mu.sliding_window_causal_mask_function(3),
        "misread-window": mu.and_masks(overlay(3), mu.causal_mask_function),
        "window-made-traced": mu.sliding_window_causal_mask_function(3),
    }[kind]
    pad = padded([5, 8], 8, "left")[1]
    monkeypatch.setattr(patterns, "_AGREED", {})

    def dense(pad: Tensor) -> Tensor:
        # A model makes its window function in its forward: traced, its closure cannot be read.
        made = mu.sliding_window_causal_mask_function(3) if kind == "window-made-traced" else fn
        built = hf.build_mask(
            batch_size=2, q_length=8, kv_length=8, mask_function=made, attention_mask=pad
        )
        return built.dense() if isinstance(built, hf.TransformersMask) else built

    got = torch.compile(dense, fullgraph=True, backend="eager")(pad)
    want = hf_dense(batch_size=2, q_length=8, kv_length=8, mask_function=fn, attention_mask=pad)
    assert torch.equal(got, want)
    if kind == "misread-window":  # the sample told the windows apart, traced too
        window = mu.sliding_window_causal_mask_function(3)
        read = dict(batch_size=2, q_length=8, kv_length=8, attention_mask=pad)
        assert not torch.equal(got, hf_dense(**read, mask_function=window))
