"""A small attnkit Transformer trains under DistributedDataParallel with its sequence split across 2
gloo ranks (ring attention through the registered backend), step for step like one process
training on the whole sequence.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import attnkit
from attnkit import BackendError, masks
from attnkit.distributed import register_ring_backend, shard_zigzag

from .harness import run_ranks

B, T, D, HEADS, KV_HEADS, FEATURES = 2, 24, 16, 4, 2, 3


class TinyTransformer(nn.Module):
    """Features -> two pre-norm encoder layers (causal, grouped-query) -> one number per token.

    Positions are a learned table read at the *global* positions the caller passes, so a rank's
    shard knows where it lies in the sequence.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, D)
        self.positions = nn.Embedding(T, D)
        self.layers = nn.ModuleList(
            attnkit.TransformerEncoderLayer(
                D,
                attention=attnkit.MultiHeadAttention(D, HEADS, num_kv_heads=KV_HEADS),
                dropout=0.0,
                norm_first=True,
            )
            for _ in range(2)
        )
        self.head = nn.Linear(D, 1)

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
        h = self.embed(x) + self.positions(positions)
        for layer in self.layers:
            h = layer(h, mask=mask, causal=True)
        out: Tensor = self.head(h)
        return out


def use_backend(model: nn.Module, backend: str) -> None:
    for m in model.modules():
        if isinstance(m, attnkit.MultiHeadAttention):
            m.backend = backend


def ddp_training(rank: int, world: int) -> list[float]:
    """Two SGD steps on 2 ranks (zigzag shards) and in one process; asserts they agree."""
    torch.manual_seed(0)
    whole = TinyTransformer().double()
    use_backend(whole, "reference")
    ring = copy.deepcopy(whole)
    register_ring_backend("ring", layout="zigzag")
    use_backend(ring, "ring")
    ddp = DistributedDataParallel(ring)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, FEATURES, generator=g, dtype=torch.float64)
    target = torch.randn(B, T, 1, generator=g, dtype=torch.float64)
    mask = masks.padding_mask([T, T - 7])  # the second sequence's last 7 keys are padding
    positions = torch.arange(T)
    local = [shard_zigzag(t, rank, world, dim=-2) for t in (x, target)]
    local_positions = shard_zigzag(positions, rank, world, dim=-1)
    local_mask = shard_zigzag(mask, rank, world, dim=-1)

    opt_whole = torch.optim.SGD(whole.parameters(), lr=0.05)
    opt_ring = torch.optim.SGD(ddp.parameters(), lr=0.05)
    losses = []
    for _ in range(2):
        opt_whole.zero_grad()
        loss_whole = (whole(x, positions, mask) - target).square().mean()
        loss_whole.backward()
        opt_whole.step()

        opt_ring.zero_grad()
        # Each rank's loss is the mean over its tokens; DDP averages the gradients over the
        # ranks, which with equal shards is the gradient of the whole sequence's mean.
        loss_ring = (ddp(local[0], local_positions, local_mask) - local[1]).square().mean()
        loss_ring.backward()
        opt_ring.step()

        mean_loss = loss_ring.detach().clone()
        dist.all_reduce(mean_loss)
        torch.testing.assert_close(mean_loss / world, loss_whole.detach(), atol=1e-10, rtol=0)
        losses.append(float(loss_whole.detach()))
    for (name, p_ring), p_whole in zip(ring.named_parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p_ring, p_whole, atol=1e-10, rtol=0, msg=name)
    attnkit.unregister_backend("ring")
    return losses


def test_transformer_trains_two_steps_under_ddp_like_one_process() -> None:
    losses = run_ranks(ddp_training, 2)
    assert losses[0] == losses[1]
    assert losses[0][1] < losses[0][0]  # it did train: the second step's loss is lower


def test_ring_backend_says_what_it_cannot_serve() -> None:
    register_ring_backend("ring-test")
    try:
        q = torch.empty(1, 4, 8, 16, device="meta")
        bias = torch.empty(1, 4, 8, 8, device="meta")
        query_mask = torch.empty(8, 8, dtype=torch.bool, device="meta")
        with pytest.raises(
            BackendError, match=r"ring-test +cannot: a dense bias \(1, 4, 8, 8\) would need"
        ):
            attnkit.attention(q, q, q, bias=bias, backend="ring-test")
        assert attnkit.explain(q, q, q).chosen != "ring-test"  # auto never picks it
        with pytest.raises(BackendError) as e:
            attnkit.attention(q, q, q, mask=query_mask, return_weights=True, backend="ring-test")
        for reason in ("no weights", "a dense mask (8, 8) depends on the query"):
            assert reason in str(e.value)
    finally:
        attnkit.unregister_backend("ring-test")
    with pytest.raises(
        ValueError, match=r"layout must be one of 'contiguous', 'zigzag' or a Layout, got 'z'"
    ):
        register_ring_backend("ring-test", layout="z")
