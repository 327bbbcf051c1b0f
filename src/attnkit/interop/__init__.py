"""Weights in from speech toolkits: modules that compute what the toolkit's modules compute.

Each function takes a toolkit's module (read through its attribute names and shapes; the toolkit
itself is never imported), builds the attnkit module with the options that reproduce its math,
and copies the parameters, mapped where the two lay them out differently:

* :mod:`attnkit.interop.espnet`: ESPnet's ``RelPositionMultiHeadedAttention`` and
  ``LegacyRelPositionMultiHeadedAttention``, NeMo's ``RelPositionMultiHeadAttention`` (same
  parameter names), and ESPnet's Conformer ``EncoderLayer``;
* :mod:`attnkit.interop.speechbrain`: SpeechBrain's ``RelPosMHAXL``;
* :mod:`attnkit.interop.openspeech`: openspeech's Conformer ``RelativeMultiHeadAttention``;
* :mod:`attnkit.interop.torch`: ``torch.nn.MultiheadAttention`` and its masks, in and out.

The usual entry points are the class methods :meth:`attnkit.RelativeMultiHeadAttention.from_espnet`,
:meth:`~attnkit.RelativeMultiHeadAttention.from_speechbrain` and
:meth:`attnkit.ConformerLayer.from_espnet`. Masks are never translated: attnkit's are True = may
attend; each loader's docstring says how to turn the toolkit's into one.
"""

from . import espnet, openspeech, speechbrain, torch

__all__ = ["espnet", "openspeech", "speechbrain", "torch"]
