"""The converters' old spellings, kept for one release: class methods of the modules they build,
attached here so that those modules name no other toolkit (the loaders import the modules, never
the other way round). Each call warns with a ``DeprecationWarning`` naming the function in
:mod:`attnkit.interop` that replaces it.

=====================================================  ===========================================
old spelling                                           use
=====================================================  ===========================================
``MultiHeadAttention.from_torch(m)``                   :func:`attnkit.interop.torch.from_torch`
``module.to_torch()``                                  :func:`attnkit.interop.torch.to_torch`
``TransformerEncoderLayer.from_torch(m)``              :func:`attnkit.interop.torch.from_torch`
``TransformerDecoderLayer.from_torch(m)``              :func:`attnkit.interop.torch.from_torch`
``RelativeMultiHeadAttention.from_espnet(m)``          :func:`attnkit.interop.espnet.relative_attention`
``RelativeMultiHeadAttention.from_speechbrain(m)``     :func:`attnkit.interop.speechbrain.relative_attention`
``RelativeMultiHeadAttention.from_openspeech(m)``      :func:`attnkit.interop.openspeech.relative_attention`
``attnkit.interop.openspeech.from_openspeech(m)``      :func:`attnkit.interop.openspeech.relative_attention`
``ConformerLayer.from_espnet(layer)``                  :func:`attnkit.interop.espnet.conformer_layer`
=====================================================  ===========================================
"""  # noqa: E501

from __future__ import annotations

from .._deprecated import alias, alias_method
from ..conformer import ConformerLayer
from ..layers import TransformerDecoderLayer, TransformerEncoderLayer
from ..multihead import MultiHeadAttention
from ..relative import RelativeMultiHeadAttention
from . import espnet, openspeech, speechbrain, torch

__all__: list[str] = []

_FROM_TORCH = "attnkit.interop.torch.from_torch"
for _cls in (MultiHeadAttention, TransformerEncoderLayer, TransformerDecoderLayer):
    alias_method(_cls, "from_torch", torch.from_torch, _FROM_TORCH)
alias_method(
    MultiHeadAttention, "to_torch", torch.to_torch, "attnkit.interop.torch.to_torch", kind="method"
)
alias_method(
    RelativeMultiHeadAttention,
    "from_espnet",
    espnet.relative_attention,
    "attnkit.interop.espnet.relative_attention",
)
alias_method(
    RelativeMultiHeadAttention,
    "from_speechbrain",
    speechbrain.relative_attention,
    "attnkit.interop.speechbrain.relative_attention",
)
alias_method(
    RelativeMultiHeadAttention,
    "from_openspeech",
    openspeech.relative_attention,
    "attnkit.interop.openspeech.relative_attention",
)
alias_method(
    ConformerLayer, "from_espnet", espnet.conformer_layer, "attnkit.interop.espnet.conformer_layer"
)
setattr(  # noqa: B010 (a module attribute mypy would refuse as an assignment)
    openspeech,
    "from_openspeech",
    alias(
        openspeech.relative_attention,
        "attnkit.interop.openspeech.from_openspeech",
        "attnkit.interop.openspeech.relative_attention",
    ),
)
