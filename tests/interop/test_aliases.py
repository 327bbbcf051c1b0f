"""The converters' old spellings: each still converts, warns with a DeprecationWarning that names
the function in attnkit.interop, and gives what that function gives."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

import pytest
import torch
from torch import nn

from attnkit import (
    ConformerLayer,
    MultiHeadAttention,
    RelativeMultiHeadAttention,
    TransformerDecoderLayer,
    TransformerEncoderLayer,
)
from attnkit.interop import espnet, openspeech, speechbrain
from attnkit.interop import torch as interop_torch
from tests.interop.test_espnet import (
    RelPositionMultiHeadedAttention,
    espnet_encoder_layer,
    randomize,
)
from tests.interop.test_openspeech import OpenspeechDouble
from tests.interop.test_speechbrain import make as speechbrain_module


def _same_state(a: nn.Module, b: nn.Module) -> None:
    assert type(a) is type(b)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], rtol=0, atol=0)


def _old(new: str) -> pytest.WarningsChecker:
    return pytest.warns(DeprecationWarning, match="is deprecated.*" + re.escape(new))


TORCH_MHA = nn.MultiheadAttention(8, 2, batch_first=True)
TORCH_ENCODER = nn.TransformerEncoderLayer(8, 2, batch_first=True)
TORCH_DECODER = nn.TransformerDecoderLayer(8, 2, batch_first=True)

CASES: list[tuple[str, Callable[[], nn.Module], Callable[[], nn.Module], str]] = [
    (
        "MultiHeadAttention.from_torch",
        lambda: MultiHeadAttention.from_torch(TORCH_MHA),  # type: ignore[attr-defined]
        lambda: interop_torch.from_torch(TORCH_MHA),
        "attnkit.interop.torch.from_torch",
    ),
    (
        "TransformerEncoderLayer.from_torch",
        lambda: TransformerEncoderLayer.from_torch(TORCH_ENCODER),  # type: ignore[attr-defined]
        lambda: interop_torch.from_torch(TORCH_ENCODER),
        "attnkit.interop.torch.from_torch",
    ),
    (
        "TransformerDecoderLayer.from_torch",
        lambda: TransformerDecoderLayer.from_torch(TORCH_DECODER),  # type: ignore[attr-defined]
        lambda: interop_torch.from_torch(TORCH_DECODER),
        "attnkit.interop.torch.from_torch",
    ),
    (
        "RelativeMultiHeadAttention.from_espnet",
        lambda: RelativeMultiHeadAttention.from_espnet(  # type: ignore[attr-defined]
            ESPNET, max_len=64
        ),
        lambda: espnet.relative_attention(ESPNET, max_len=64),
        "attnkit.interop.espnet.relative_attention",
    ),
    (
        "ConformerLayer.from_espnet",
        lambda: ConformerLayer.from_espnet(espnet_encoder_layer()),  # type: ignore[attr-defined]
        lambda: espnet.conformer_layer(espnet_encoder_layer()),
        "attnkit.interop.espnet.conformer_layer",
    ),
    (
        "RelativeMultiHeadAttention.from_speechbrain",
        lambda: RelativeMultiHeadAttention.from_speechbrain(  # type: ignore[attr-defined]
            speechbrain_module(), encoding="signed"
        ),
        lambda: speechbrain.relative_attention(speechbrain_module(), encoding="signed"),
        "attnkit.interop.speechbrain.relative_attention",
    ),
    (
        "RelativeMultiHeadAttention.from_openspeech",
        lambda: RelativeMultiHeadAttention.from_openspeech(  # type: ignore[attr-defined]
            OPENSPEECH
        ),
        lambda: openspeech.relative_attention(OPENSPEECH),
        "attnkit.interop.openspeech.relative_attention",
    ),
    (
        "attnkit.interop.openspeech.from_openspeech",
        lambda: openspeech.from_openspeech(OPENSPEECH),  # type: ignore[attr-defined]
        lambda: openspeech.relative_attention(OPENSPEECH),
        "attnkit.interop.openspeech.relative_attention",
    ),
]
OPENSPEECH = OpenspeechDouble(8, 2, 0.0, wrapped=False)
ESPNET = randomize(RelPositionMultiHeadedAttention())


@pytest.mark.parametrize(("old", "call_old", "call_new", "new"), CASES, ids=[c[0] for c in CASES])
def test_an_old_spelling_warns_and_converts_as_the_new_one(
    old: str, call_old: Callable[[], nn.Module], call_new: Callable[[], nn.Module], new: str
) -> None:
    with _old(new) as record:
        got = call_old()
    (warning,) = record
    assert str(warning.message).startswith(f"attnkit.{old.removeprefix('attnkit.')} is deprecated")
    assert warning.filename == __file__  # it points at the caller's line
    _same_state(got, call_new())


def test_to_torch_as_a_method_warns_and_converts() -> None:
    ours = MultiHeadAttention(8, 2)
    with _old("attnkit.interop.torch.to_torch"):
        theirs = ours.to_torch(batch_first=False)  # type: ignore[attr-defined]
    assert theirs.batch_first is False
    _same_state(theirs, interop_torch.to_torch(ours, batch_first=False))


def test_the_modules_themselves_name_no_converter() -> None:
    # The class methods are attached by attnkit.interop, for one release; the classes' own
    # modules define none of them.
    for cls, names in (
        (MultiHeadAttention, ("from_torch", "to_torch")),
        (TransformerEncoderLayer, ("from_torch",)),
        (TransformerDecoderLayer, ("from_torch",)),
        (RelativeMultiHeadAttention, ("from_espnet", "from_speechbrain", "from_openspeech")),
        (ConformerLayer, ("from_espnet",)),
    ):
        text = inspect.getsource(inspect.getmodule(cls))  # type: ignore[arg-type]
        for name in names:
            assert f"def {name}(" not in text, (cls.__name__, name)
            assert getattr(cls, name).__doc__.startswith("Deprecated: attnkit.interop.")
