"""Weights in and out of other toolkits: attnkit modules that compute what the toolkit's modules
compute.

Each function takes a toolkit's module (read through its attribute names and shapes; the speech
toolkits themselves are never imported), builds the attnkit module with the options that
reproduce its math, and copies the parameters, mapped where the two lay them out differently:

* :func:`attnkit.interop.torch.from_torch`: ``torch.nn.MultiheadAttention``,
  ``TransformerEncoderLayer`` and ``TransformerDecoderLayer``;
  :func:`~attnkit.interop.torch.to_torch` the other way;
  :func:`~attnkit.interop.torch.from_torch_masks`: torch's masks;
* :func:`attnkit.interop.espnet.relative_attention`: ESPnet's ``RelPositionMultiHeadedAttention``
  and ``LegacyRelPositionMultiHeadedAttention``, NeMo's ``RelPositionMultiHeadAttention`` (same
  parameter names); :func:`attnkit.interop.espnet.conformer_layer`: ESPnet's Conformer
  ``EncoderLayer``;
* :func:`attnkit.interop.speechbrain.relative_attention`: SpeechBrain's ``RelPosMHAXL``;
* :func:`attnkit.interop.openspeech.relative_attention`: openspeech's Conformer
  ``RelativeMultiHeadAttention``;
* :func:`attnkit.interop.deepseek.latent_attention`: transformers' ``DeepseekV3Attention``
  (multi-head latent attention), as :class:`~attnkit.MultiHeadLatentAttention`.

These functions are the one way in: the modules they build know nothing of the toolkits. Masks
are never translated: attnkit's are True = may attend; each loader's docstring says how to turn
the toolkit's into one (torch's: :func:`attnkit.interop.torch.from_torch_masks`).

>>> import torch
>>> from attnkit.interop.torch import from_torch
>>> from_torch(torch.nn.MultiheadAttention(16, 4, batch_first=True))
MultiHeadAttention(
  d_model=16, num_heads=4
  (out_proj): Linear(in_features=16, out_features=16, bias=True)
)
"""

from . import deepseek, espnet, openspeech, speechbrain, torch

__all__ = ["deepseek", "espnet", "openspeech", "speechbrain", "torch"]
