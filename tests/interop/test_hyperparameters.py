"""Every hyperparameter a loader copies, given a value no default has, so that a missing copy
fails: LayerNorm and BatchNorm eps, BatchNorm momentum and running statistics, dropout rates.

The stand-ins are those of the loaders' own tests; here each copied number is set apart from the
toolkit's default, from attnkit's default and from every other copied number (a swap fails too).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

import attnkit
from attnkit import MultiHeadAttention
from tests.interop.helpers import agrees
from tests.interop.test_espnet import (
    E,
    espnet_encoder_layer,
    espnet_layer,
    espnet_mask,
    randn,
    randomize,
)
from tests.interop.test_espnet import RelPositionMultiHeadedAttention as EspnetAttention
from tests.interop.test_speechbrain import make as speechbrain_attention

NORMS = ("norm_ff_macaron", "norm_mha", "norm_conv", "norm_ff", "norm_final")


def odd_espnet_layer() -> nn.Module:
    """ESPnet's Conformer layer with a distinct eps per LayerNorm, a BatchNorm with eps 0.1 and
    momentum 0.3 (defaults 1e-5 and 0.1), and distinct dropout rates."""
    layer = espnet_encoder_layer(seed=3)
    for i, name in enumerate(NORMS):
        getattr(layer, name).eps = 0.05 * (i + 1)  # 0.05 ... 0.25
    layer.conv_module.norm.eps = 0.1
    layer.conv_module.norm.momentum = 0.3
    layer.conv_module.norm.num_batches_tracked.fill_(7)
    layer.dropout.p = 0.11
    layer.feed_forward_macaron.dropout.p = 0.12
    layer.feed_forward.dropout.p = 0.13
    layer.self_attn.dropout.p = 0.14
    return layer


def test_conformer_layer_copies_every_eps() -> None:
    theirs = odd_espnet_layer()
    ours = attnkit.interop.espnet.conformer_layer(theirs)
    x = randn(2, 9, E, seed=4)
    with torch.no_grad():
        agrees(ours(x), espnet_layer(theirs, x, espnet_mask([9, 9], 9)))


def test_conformer_layer_copies_the_batchnorm_statistics_and_momentum() -> None:
    theirs = odd_espnet_layer()
    ours = attnkit.interop.espnet.conformer_layer(theirs).train()
    assert int(ours.conv.norm.num_batches_tracked) == 7
    seen: list[Tensor] = []
    ours.conv.norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    ours(randn(2, 9, E, seed=5))
    # One training step moves the running statistics by the momentum: their BatchNorm, given
    # what ours was given, must land on the same statistics.
    bn = copy.deepcopy(theirs.conv_module.norm).train()
    bn(seen[0])
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ours.conv.norm, name), getattr(bn, name))


def test_conformer_layer_copies_every_dropout_rate() -> None:
    ours = attnkit.interop.espnet.conformer_layer(odd_espnet_layer())
    rates = {
        "dropout": ours.dropout.p,
        "ff1": ours.ff1.dropout.p,
        "ff2": ours.ff2.dropout.p,
        "attention": ours.attn.dropout,
    }
    assert rates == {"dropout": 0.11, "ff1": 0.12, "ff2": 0.13, "attention": 0.14}


def test_relative_attention_loaders_copy_the_dropout_rate() -> None:
    espnet = randomize(EspnetAttention())
    espnet.dropout.p = 0.35
    assert attnkit.interop.espnet.relative_attention(espnet).dropout == 0.35
    speechbrain = speechbrain_attention()
    speechbrain.dropout_att.p = 0.45
    assert attnkit.interop.speechbrain.relative_attention(speechbrain).dropout == 0.45


def test_torch_loaders_copy_the_dropout_rate_both_ways() -> None:
    theirs = nn.MultiheadAttention(8, 2, dropout=0.37, batch_first=True)
    ours = attnkit.interop.torch.from_torch(theirs)
    assert ours.dropout == 0.37
    ours = MultiHeadAttention(8, 2, dropout=0.29)
    assert attnkit.interop.torch.to_torch(ours).dropout == 0.29
