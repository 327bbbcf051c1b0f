"""Registering attnkit with transformers: the mask function and the attention function under one
name, for transformers 5.20 or later."""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any

from torch import Tensor, nn

from ..._shards import SequenceShards
from ...attention import Backend, available_backends
from ._attention import attention_forward
from ._masks import TransformersMask, build_mask

__all__ = ["MIN_TRANSFORMERS", "register"]

# The oldest transformers where all of this holds. Mask functions take (q_length, q_offset) from 5.4
# on (a cache_position tensor before); T5 calls the attention interface from 5.15, and its encoder
# and decoder follow set_attn_implementation() from 5.20 (before, they silently kept their own).
MIN_TRANSFORMERS = (5, 20)
_INSTALL = 'install the hf extra: pip install "attnkit[hf]" (or ".[hf]" from a checkout)'


def _require_transformers() -> None:
    """Import transformers, or raise one ImportError that says how to get a version that works."""
    need = ".".join(map(str, MIN_TRANSFORMERS))
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"attnkit.integrations.transformers needs transformers>={need}, which is not "
            f"installed: {_INSTALL}"
        ) from e
    found = importlib.metadata.version("transformers")
    parsed = re.match(r"(\d+)\.(\d+)", found)
    if parsed is None or tuple(map(int, parsed.groups())) < MIN_TRANSFORMERS:
        raise ImportError(
            f"attnkit.integrations.transformers needs transformers>={need}, found {found}: "
            f"{_INSTALL}"
        )


_TRANSFORMERS_NAMES = ("sdpa", "flash", "flex", "/", "|")


def register(
    name: str = "attnkit",
    *,
    backend: str | Backend = "auto",
    sequence_parallel: SequenceShards | None = None,
) -> None:
    """Make attnkit the attention implementation ``name`` of transformers models.

    Afterwards ``from_pretrained(..., attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` run every attention layer of a model through
    :func:`attnkit.attention` with ``backend``. Registering again under a name replaces what it
    stood for (another backend, say). The registration lasts for the process.

    Args:
        name: the implementation's name in transformers. transformers gives names containing
            ``sdpa``, ``flash``, ``flex``, ``/`` (a Hub kernel) or ``|``, and ``eager``, a meaning
            of their own, so those are refused.
        backend: passed to every :func:`attnkit.attention` call: ``"auto"`` (the fastest backend
            that serves each call) or a backend name or object.
        sequence_parallel: an :class:`attnkit.distributed.SequenceParallel`: every layer then
            runs on this rank's shard of a sequence split across its group's ranks (the model
            called with the shard's ``input_ids``, its part of the 2-d ``attention_mask``, and
            ``position_ids`` holding the shard's positions in the whole sequence, for rotary
            embeddings; without a cache). ``backend`` is then unused.

    Raises:
        ImportError: transformers is missing or older than 5.20 (the hf extra:
            ``pip install "attnkit[hf]"``, or ``".[hf]"`` from a checkout).
        ValueError, TypeError: for a name transformers would misread, or an unknown backend.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    if name == "eager" or any(part in name for part in _TRANSFORMERS_NAMES):
        raise ValueError(
            f"name {name!r} would be read by transformers as one of its own implementations or "
            "as a Hub kernel (names with 'sdpa', 'flash', 'flex', '/' or '|', and 'eager'); "
            "choose another, such as 'attnkit'"
        )
    if isinstance(backend, str):
        if backend != "auto" and backend not in available_backends():
            raise ValueError(
                f"unknown backend {backend!r}; choose 'auto' or one of: "
                + ", ".join(available_backends())
            )
    elif not isinstance(backend, Backend):
        raise TypeError(f"backend must be a name or a Backend, got {type(backend).__name__}")
    if sequence_parallel is not None and not callable(getattr(sequence_parallel, "halo", None)):
        raise TypeError(
            "sequence_parallel must be an attnkit.distributed.SequenceParallel, got "
            f"{type(sequence_parallel).__name__}"
        )
    _require_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def attnkit_attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: TransformersMask | Tensor | None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        return attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            backend=backend,
            sequence_shards=sequence_parallel,
            **kwargs,
        )

    AttentionInterface.register(name, attnkit_attention)
    AttentionMaskInterface.register(name, build_mask)
