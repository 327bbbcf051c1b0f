"""Registering attnkit with transformers: the mask function and the attention function under one
name, for transformers 5.20 or later."""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import re
import sys
from typing import Any

from torch import Tensor, nn

from ...attention import Backend, available_backends
from ...modules._shards import SequenceShards
from ._attention import attention_forward
from ._masks import TransformersMask, build_mask, serve_eager_masks

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

# The names register() gave attnkit in this process: models asking for one are checked at load.
_NAMES: set[str] = set()


_OWN_CODE: dict[type, bool] = {}


def _own_attention_code(model_class: type) -> bool:
    """Whether the module of ``model_class`` defines attention layers that never call transformers'
    attention interface (transformers' own reading, for ``set_attn_implementation``: an
    ``*Attention*(nn.Module)`` class and no ``ALL_ATTENTION_FUNCTIONS.get_interface(``). False when
    the source cannot be read (a model defined in a notebook): then nothing is known."""
    if model_class not in _OWN_CODE:
        module = sys.modules.get(model_class.__module__)
        try:
            code = inspect.getsource(module) if module is not None else ""
        except (OSError, TypeError):
            code = ""
        defines = re.search(r"^class \w*Attention\w*\(nn\.Module\):", code, re.MULTILINE)
        own = bool(defines) and "ALL_ATTENTION_FUNCTIONS.get_interface(" not in code
        _OWN_CODE[model_class] = own
    return _OWN_CODE[model_class]


def _attention_class_tables(model_class: type) -> dict[str, list[str]]:
    """The tables of ``model_class``'s module that map an implementation's name to an attention
    layer class (``GIT_SELF_ATTENTION_CLASSES = {"eager": GitSelfAttention}``), each with its
    names: a layer built from one looks the name up there, so it has no class for attnkit's."""
    module = sys.modules.get(model_class.__module__)
    found: dict[str, list[str]] = {}
    for key, value in vars(module).items() if module is not None else ():
        if key.endswith("ATTENTION_CLASSES") and isinstance(value, dict):
            found[key] = sorted(str(k) for k in value)
    return found


def check_model(model: nn.Module, name: str) -> None:
    """Refuse, at load, a model attnkit cannot serve; note one that needs eager's masks.

    transformers refuses ``"sdpa"`` for a model whose class does not declare ``_supports_sdpa``;
    a model with attention code of its own (BLOOM, BigBird, MPT, XGLM, GPT-Neo, ...) would never
    call attnkit, and the mask object attnkit's mask function builds would reach code that adds
    it to its scores. A model that transformers runs with eager attention only gets eager's float
    mask, the one its code was written for (DeepSeek V4 widens it for its compressed keys).
    """
    cls = type(model)
    if _own_attention_code(cls) and not getattr(cls, "_supports_sdpa", False):
        raise ValueError(
            f"{cls.__name__} does not support attn_implementation={name!r}: its attention layers "
            "compute attention in their own code instead of calling transformers' "
            "AttentionInterface, so attnkit would never be called. Load it with "
            'attn_implementation="eager"'
        )
    tables = {k: v for k, v in _attention_class_tables(cls).items() if name not in v}
    if tables:
        listed = ", ".join(f"{k} {v}" for k, v in tables.items())
        raise ValueError(
            f"{cls.__name__} does not support attn_implementation={name!r}: its attention layers "
            f"pick their class by the implementation's name from a table of their own ({listed}), "
            'which has none for attnkit. Load it with attn_implementation="eager"'
        )
    served = ("_supports_sdpa", "_supports_flash_attn", "_supports_flex_attn")
    config = getattr(model, "config", None)
    if config is not None and not any(getattr(cls, flag, False) for flag in served):
        serve_eager_masks(type(config))


def _install_load_check() -> None:
    """Run :func:`check_model` wherever transformers checks a model's attention implementation
    (at construction, ``from_pretrained`` and ``set_attn_implementation``), as it runs its own
    checks for ``"sdpa"``. transformers offers no hook for a registered implementation, so its
    ``PreTrainedModel.get_correct_attn_implementation`` is wrapped, once per process."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.get_correct_attn_implementation
    if getattr(original, "_attnkit_checks", False):
        return

    @functools.wraps(original)
    def get_correct_attn_implementation(
        self: Any, requested_attention: str | None, is_init_check: bool = False
    ) -> str:
        chosen: str = original(self, requested_attention, is_init_check)
        if chosen in _NAMES:
            check_model(self, chosen)
        return chosen

    get_correct_attn_implementation._attnkit_checks = True  # type: ignore[attr-defined]
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation


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
    _NAMES.add(name)
    _install_load_check()
