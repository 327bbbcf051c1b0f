"""capture_attention(): every attnkit attention module's weights, and no cost outside."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

import attnkit
from attnkit import AttentionMaps, MultiHeadAttention, Transformer, capture_attention, masks
from attnkit.testing import assert_close


def small_transformer() -> Transformer:
    torch.manual_seed(0)
    return Transformer(
        16, 4, num_encoder_layers=2, num_decoder_layers=1, num_kv_heads=2, dtype=torch.float64
    ).eval()


def test_records_every_attention_module_with_its_name() -> None:
    model = small_transformer()
    src = torch.randn(2, 6, 16, dtype=torch.float64)
    tgt = torch.randn(2, 3, 16, dtype=torch.float64)
    pad = masks.padding_mask([6, 4])
    with capture_attention(model) as maps:
        out = model(src, tgt, src_mask=pad, memory_mask=pad)
    assert sorted(maps) == [
        "decoder_layers.0.cross_attn",
        "decoder_layers.0.self_attn",
        "encoder_layers.0.self_attn",
        "encoder_layers.1.self_attn",
    ]
    assert all(len(v) == 1 for v in maps.values())
    assert maps["encoder_layers.1.self_attn"][0].shape == (2, 4, 6, 6)  # per head, H not Hkv
    assert maps["decoder_layers.0.cross_attn"][0].shape == (2, 4, 3, 6)
    # The maps are the weights the module computes when asked, and the model's output is unchanged.
    assert_close(out, model(src, tgt, src_mask=pad, memory_mask=pad))
    memory = model.encode(src, mask=pad)
    self_out = model.decoder_layers[0].self_attn(tgt, causal=True)
    x = model.decoder_layers[0].norm1(tgt + self_out)  # post-norm: the cross-attention's input
    _, want = model.decoder_layers[0].cross_attn(
        x, memory, mask=pad, need_weights=True, average_weights=False
    )
    assert_close(maps["decoder_layers.0.cross_attn"][0], want)
    # Causal self-attention: nothing above the diagonal; padding: nothing on padded keys.
    w = maps["decoder_layers.0.self_attn"][0]
    assert torch.all(w.triu(1) == 0)
    assert torch.all(maps["encoder_layers.0.self_attn"][0][1, ..., 4:] == 0)


def test_no_weights_outside_the_context(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[bool] = []
    real = attnkit.modules.multihead.attend

    def spy(*args: object, **kwargs: object) -> object:
        asked.append(bool(kwargs.get("return_weights", False)))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attnkit.modules.multihead, "attend", spy)
    model = small_transformer()
    other = MultiHeadAttention(16, 4, dtype=torch.float64)
    src = torch.randn(1, 5, 16, dtype=torch.float64)
    with capture_attention(model) as maps:
        model(src, src)
        other(src)  # not inside the captured model: no weights
    assert asked == [True] * 4 + [False]
    asked.clear()
    model(src, src)  # after the context: the fast path again, nothing recorded
    assert asked == [False] * 4
    assert all(len(v) == 1 for v in maps.values())


def test_nested_and_repeated_captures() -> None:
    mha = MultiHeadAttention(8, 2)
    model = nn.Sequential(nn.Linear(8, 8), mha)
    x = torch.randn(1, 3, 8)
    with capture_attention(model) as outer:
        model(x)
        with capture_attention(mha) as inner:
            model(x)
        model(x)
    assert len(outer["1"]) == 3
    assert list(inner) == [""]  # the captured module itself is named "" by named_modules()
    assert len(inner[""]) == 1
    assert torch.equal(inner[""][0], outer["1"][1])


def test_decoding_step_by_step_records_each_step() -> None:
    model = small_transformer()
    src = torch.randn(1, 4, 16, dtype=torch.float64)
    tgt = torch.randn(1, 3, 16, dtype=torch.float64)
    with torch.no_grad(), capture_attention(model) as maps:
        memory = model.encode(src)
        cache = model.make_cache(1, 3)
        for i in range(3):
            model.decode(tgt[:, i : i + 1], memory, cache=cache)
    shapes = [tuple(w.shape) for w in maps["decoder_layers.0.self_attn"]]
    assert shapes == [(1, 4, 1, 1), (1, 4, 1, 2), (1, 4, 1, 3)]


def test_need_weights_and_capture_share_one_computation() -> None:
    mha = MultiHeadAttention(8, 2, dtype=torch.float64)
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    with capture_attention(mha) as maps:
        _, avg = mha(x, need_weights=True)
    assert_close(avg, maps[""][0].mean(1))


def test_capture_takes_a_module() -> None:
    with (
        pytest.raises(TypeError, match=r"capture_attention\(\) takes an nn.Module, got str"),
        capture_attention("model"),  # type: ignore[arg-type]
    ):
        pass


# --------------------------------------------------------------------------------------------------
# A capture belongs to the thread (or asyncio task) that opened it


def spy_on_weights(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """(thread name, whether weights were asked) for every attention call of the modules."""
    asked: list[tuple[str, bool]] = []
    real = attnkit.modules.multihead.attend

    def spy(*args: object, **kwargs: object) -> object:
        asked.append((threading.current_thread().name, bool(kwargs.get("return_weights"))))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attnkit.modules.multihead, "attend", spy)
    return asked


def test_other_threads_are_not_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = spy_on_weights(monkeypatch)
    model = small_transformer()
    src = torch.randn(1, 5, 16, dtype=torch.float64)
    opened, other_done = threading.Event(), threading.Event()
    maps: dict[str, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def in_thread(name: str, body: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                body()
            except BaseException as err:  # reported by the main thread below
                errors.append(err)
                opened.set()
                other_done.set()

        return threading.Thread(target=run, name=name)

    def capturing() -> None:
        with capture_attention(model) as m:
            opened.set()
            assert other_done.wait(60)  # the other thread's call happens inside this capture
            model(src, src)
        maps.update(m)

    def other() -> None:
        assert opened.wait(60)
        model(src, src)  # the same modules, while the capture is open in the first thread
        other_done.set()

    threads = [in_thread("capturing", capturing), in_thread("other", other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(maps) == [
        "decoder_layers.0.cross_attn",
        "decoder_layers.0.self_attn",
        "encoder_layers.0.self_attn",
        "encoder_layers.1.self_attn",
    ]
    assert all(len(v) == 1 for v in maps.values())  # the capturing thread's call only
    assert sorted(asked) == [("capturing", True)] * 4 + [("other", False)] * 4  # fast path


def test_other_asyncio_tasks_are_not_recorded() -> None:
    mha = MultiHeadAttention(8, 2, dtype=torch.float64)
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    y = torch.randn(1, 4, 8, dtype=torch.float64)

    async def main() -> AttentionMaps:
        opened, other_done = asyncio.Event(), asyncio.Event()

        async def capturing() -> AttentionMaps:
            with capture_attention(mha) as maps:
                opened.set()
                await other_done.wait()
                mha(x)
            return maps

        async def other() -> None:
            await opened.wait()
            mha(y)  # the capture of the other task is open
            other_done.set()

        maps, _ = await asyncio.gather(capturing(), other())
        return maps

    maps = asyncio.run(main())
    assert [tuple(w.shape) for w in maps[""]] == [(1, 2, 3, 3)]  # x's call, not y's
    assert_close(maps[""][0], mha(x, need_weights=True, average_weights=False)[1])


def test_compiled_calls_are_recorded_in_the_capturing_thread_only() -> None:
    torch._dynamo.reset()  # a fresh recompile budget: each capture state is its own graph
    try:
        mha = MultiHeadAttention(8, 2, dtype=torch.float64).eval()
        # Dynamo alone ("eager"): what decides is what it traces and guards, not the codegen.
        compiled = torch.compile(mha, fullgraph=True, backend="eager")
        x = torch.randn(1, 3, 8, dtype=torch.float64)
        with torch.no_grad():
            assert_close(compiled(x), mha(x))
            with capture_attention(mha) as maps:
                compiled(x)
                other = threading.Thread(target=compiled, args=(x,))
                other.start()
                other.join()
            compiled(x)
        assert len(maps[""]) == 1
        assert_close(maps[""][0], mha(x, need_weights=True, average_weights=False)[1])
    finally:
        torch._dynamo.reset()
