"""Modules across a process group: each rank runs a model on its shard of the sequence, and the
outputs, the inputs' gradients and the parameters' gradients (all-reduced) are the model's on the
whole sequence in one process (float64)."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import attnkit
from attnkit import masks
from attnkit.distributed import Layout, SequenceParallel, sequence_parallel

from .harness import run_ranks

TOL = {"atol": 1e-10, "rtol": 0.0}


def _summed_grads(module: nn.Module) -> dict[str, Tensor]:
    """Each parameter's gradient summed over the ranks (each rank holds its share)."""
    out = {}
    for name, p in module.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(g)
        out[name] = g
    return out


def _compare_step(
    whole: nn.Module,
    shard: nn.Module,
    lay: Layout,
    rank: int,
    x: Tensor,
    call: dict[str, object],
    shard_call: dict[str, object],
    *,
    shared: bool = False,
) -> float:
    """Forward and backward of ``whole`` on ``x`` and of ``shard`` on this rank's shard; asserts
    the output, the input's gradient and every parameter's gradient agree. Returns the largest
    difference of the outputs. ``shared``: the first rank alone runs ``whole`` and sends the
    results to the others (a long sequence, on ranks that share a few cores)."""
    whole.zero_grad()
    shard.zero_grad()
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(7), dtype=x.dtype)
    xw = x.clone().requires_grad_()
    if not shared or rank == 0:
        yw = whole(xw, **call)
        (yw * target).sum().backward()
    if shared:
        yw = yw.detach() if rank == 0 else torch.empty_like(x)
        xw.grad = xw.grad if rank == 0 else torch.empty_like(x)
        for p in whole.parameters():
            p.grad = p.grad if rank == 0 else torch.empty_like(p)
        for t in [yw, xw.grad, *(p.grad for p in whole.parameters()), *whole.buffers()]:
            dist.broadcast(t, 0)
    xs = lay.shard(x, rank, dim=1).requires_grad_()
    ys = shard(xs, **shard_call)
    (ys * lay.shard(target, rank, dim=1)).sum().backward()
    torch.testing.assert_close(ys, lay.shard(yw, rank, dim=1), **TOL)
    assert xs.grad is not None
    assert xw.grad is not None
    torch.testing.assert_close(xs.grad, lay.shard(xw.grad, rank, dim=1), **TOL)
    grads = _summed_grads(shard)
    for name, p in whole.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=name)
    return float((ys - lay.shard(yw, rank, dim=1)).detach().abs().max())


# --------------------------------------------------------------------------------------------------
# ConformerLayer


def conformer_long(rank: int, world: int) -> dict[str, float]:
    """8000 frames over the ranks, contiguous, a limited context and padding; a training step
    (BatchNorm's batch statistics across the ranks), then the running statistics and eval."""
    torch.manual_seed(0)
    whole = attnkit.ConformerLayer(32, 4, d_ff=64, kernel_size=31, dropout=0.0, context=(64, 64))
    whole = whole.double().train()
    shard = sequence_parallel(copy.deepcopy(whole))
    lay = Layout.contiguous(world)
    t = 8000
    x = torch.randn(2, t, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lengths = [t, t - 2100]  # the second recording ends inside rank 2's shard
    valid = masks.padding_mask(lengths).reshape(2, t)
    start = time.perf_counter()
    diff = _compare_step(
        whole,
        shard,
        lay,
        rank,
        x,
        {"mask": valid},
        {"mask": lay.shard(valid, rank, dim=1)},
        shared=True,
    )
    seconds = time.perf_counter() - start
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(
            getattr(shard.conv.norm, name), getattr(whole.conv.norm, name), **TOL, msg=name
        )
    # The whole sequence's lengths as a structured mask, in eval mode (running statistics).
    whole.eval()
    shard.eval()
    with torch.no_grad():
        yw = whole(x, mask=masks.key_padding(lengths)) if rank == 0 else torch.empty_like(x)
        dist.broadcast(yw, 0)
        ys = shard(lay.shard(x, rank, dim=1), mask=masks.key_padding(lengths))
    torch.testing.assert_close(ys, lay.shard(yw, rank, dim=1), **TOL)
    return {"diff": diff, "seconds": seconds}


def test_conformer_layer_on_8000_frames_over_4_ranks_equals_one_process() -> None:
    got = run_ranks(conformer_long, 4, timeout=180)
    assert max(g["diff"] for g in got) < 1e-10


def conformer_zigzag(rank: int, world: int) -> None:
    """Full attention on a zigzag layout: the convolution's halos come from both neighbours of
    each of a rank's two chunks; float32 within tolerance too."""
    torch.manual_seed(0)
    whole = attnkit.ConformerLayer(16, 2, d_ff=32, kernel_size=7, dropout=0.0).double().train()
    shard = sequence_parallel(copy.deepcopy(whole), layout="zigzag", strategy="ring")
    lay = Layout.zigzag(world)
    x = torch.randn(2, 24 * world, 16, generator=torch.Generator().manual_seed(1))
    _compare_step(whole, shard, lay, rank, x.double(), {}, {})
    whole, shard = whole.float(), shard.float()
    with torch.no_grad():
        yw, ys = whole(x), shard(lay.shard(x, rank, dim=1))
    torch.testing.assert_close(ys, lay.shard(yw, rank, dim=1), atol=2e-5, rtol=1e-5)


def test_conformer_layer_zigzag_over_3_ranks_equals_one_process() -> None:
    run_ranks(conformer_zigzag, 3)


# --------------------------------------------------------------------------------------------------
# MultiHeadAttention and RelativeMultiHeadAttention


def _mask_cases(
    t: int, rank: int, lay: Layout
) -> list[tuple[dict[str, object], dict[str, object]]]:
    """(the call in one process, this rank's call) for each kind of mask."""
    pad = masks.padding_mask([t, t - 5])  # (B, 1, 1, T): the shard travels with its keys
    lengths = masks.key_padding([t - 3, t - 7])  # the whole sequence's lengths
    window = masks.sliding_window(4, 2)
    return [
        ({"causal": True}, {"causal": True}),
        ({"mask": pad}, {"mask": lay.shard(pad, rank, dim=-1)}),
        ({"mask": lengths, "causal": True}, {"mask": lengths, "causal": True}),
        ({"mask": window}, {"mask": window}),
        ({"mask": window & pad}, {"mask": window & lay.shard(pad, rank, dim=-1)}),
    ]


def attention_modules(rank: int, world: int) -> int:
    t = 6 * world
    torch.manual_seed(0)
    rotary = attnkit.RotaryEmbedding(8)
    modules = [
        attnkit.MultiHeadAttention(16, 2, num_kv_heads=1, rotary=rotary),
        attnkit.RelativeMultiHeadAttention(16, 2),
    ]
    x = torch.randn(2, t, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    checked = 0
    for layout in ("contiguous", "zigzag"):
        lay = Layout.zigzag(world) if layout == "zigzag" else Layout.contiguous(world)
        for module in modules:
            whole = module.double()
            shard = sequence_parallel(copy.deepcopy(whole), layout=layout)
            for call, shard_call in _mask_cases(t, rank, lay):
                _compare_step(whole, shard, lay, rank, x, call, shard_call)
                checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 3])
def test_attention_modules_with_masks_equal_one_process(world: int) -> None:
    assert run_ranks(attention_modules, world) == [20] * world


def refusals(rank: int, world: int) -> list[str]:
    x = torch.randn(1, 4, 16)
    said = []
    layer = attnkit.ConformerLayer(8, 2, kernel_size=31, dropout=0.0).double()
    sequence_parallel(layer, layout="zigzag")
    with pytest.raises(ValueError, match="halo exchange") as err:
        layer(torch.randn(1, 20, 8, dtype=torch.float64))  # chunks of 10 frames, reach 15
    said.append(str(err.value))
    m = sequence_parallel(attnkit.MultiHeadAttention(16, 2))
    r = sequence_parallel(attnkit.RelativeMultiHeadAttention(16, 2, legacy="espnet"))
    for call in (
        lambda: m(x, need_weights=True),
        lambda: m(x, bias=torch.zeros(1, 2, 4, 4)),
        lambda: m(x, cache=attnkit.MultiHeadAttention(16, 2).make_cache(1, 8)),
        lambda: r(x),
    ):
        with pytest.raises(ValueError, match=r"process|bias|legacy") as err:
            call()
        said.append(str(err.value))
    return said


def test_what_a_shard_cannot_do_is_refused_on_every_rank() -> None:
    everyone = run_ranks(refusals, 2)
    for halo, *_ in everyone:  # a halo longer than a chunk: every rank says so, none waits
        assert "reads 15 frames on either side, more than one chunk of the layout holds" in halo
        assert "(10 frames: a shard of 20 in 2 chunks)" in halo
    said = everyone[0][1:]
    assert "no attention weights from a sequence split across processes" in said[0]
    assert "a dense bias (1, 2, 4, 4) would need the whole sequence's rows" in said[1]
    assert "a KV cache decodes one sequence in one process" in said[2]
    assert "legacy='espnet' reads absolute encodings of the whole sequence" in said[3]


def test_sequence_parallel_refuses_modules_that_would_see_only_a_shard() -> None:
    model = nn.Sequential(attnkit.MultiHeadAttention(8, 2), nn.Conv1d(8, 8, 3))
    with pytest.raises(ValueError, match=r"would see only this rank's shard: 1 \(Conv1d\)"):
        sequence_parallel(model)
    with pytest.raises(ValueError, match="holds no module that runs on a shard"):
        sequence_parallel(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="strategy must be one of 'auto', 'ring', 'ulysses'"):
        SequenceParallel(strategy="fast")
    # The Conformer's own Conv1d and BatchNorm run on shards: no complaint; state_dict unchanged.
    layer = attnkit.ConformerLayer(8, 2, kernel_size=3)
    keys = list(layer.state_dict())
    assert sequence_parallel(layer, layout="zigzag") is layer
    assert list(layer.state_dict()) == keys
    assert layer.conv.sequence_shards is layer.attn.sequence_shards is layer.sequence_shards
    assert copy.deepcopy(layer).conv.sequence_shards is layer.conv.sequence_shards


# --------------------------------------------------------------------------------------------------
# A transformers model


def llama_shards(rank: int, world: int) -> float:
    """A two-layer Llama, zigzag over the ranks, padding in the second row: the shard's hidden
    states and the parameters' gradients (all-reduced) are the model's in one process."""
    import transformers
    from transformers import AttentionInterface
    from transformers import masking_utils as mu

    from attnkit.integrations.transformers import register

    register("attnkit_sp", sequence_parallel=SequenceParallel(layout="zigzag"))
    config = transformers.LlamaConfig(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    whole = transformers.LlamaModel(config).double()
    whole.set_attn_implementation("sdpa")  # eager takes its softmax in float32
    shard = copy.deepcopy(whole)
    shard.set_attn_implementation("attnkit_sp")
    lay = Layout.zigzag(world)
    t = 8 * world
    ids = torch.randint(3, 99, (2, t), generator=torch.Generator().manual_seed(1))
    padding = torch.ones(2, t, dtype=torch.long)
    padding[1, t - 5 :] = 0  # right padding
    positions = torch.arange(t).expand(2, t)
    yw = whole(input_ids=ids, attention_mask=padding, use_cache=False).last_hidden_state
    ys = shard(
        input_ids=lay.shard(ids, rank, dim=1),
        attention_mask=lay.shard(padding, rank, dim=1),
        position_ids=lay.shard(positions, rank, dim=1),
        use_cache=False,
    ).last_hidden_state
    torch.testing.assert_close(ys, lay.shard(yw, rank, dim=1), **TOL)
    yw.square().sum().backward()
    ys.square().sum().backward()
    grads = _summed_grads(shard)
    for name, p in whole.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, **TOL, msg=name)
    AttentionInterface._global_mapping.pop("attnkit_sp", None)
    mu.AttentionMaskInterface._global_mapping.pop("attnkit_sp", None)
    return float((ys - lay.shard(yw, rank, dim=1)).detach().abs().max())


def test_a_transformers_llama_runs_on_shards_like_one_process() -> None:
    pytest.importorskip("transformers")
    run_ranks(llama_shards, 2)
