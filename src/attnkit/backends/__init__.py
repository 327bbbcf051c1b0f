"""The built-in backends of :func:`attnkit.attention`, and what a backend is.

* ``sdpa`` (:class:`SDPA`): torch's fused ``scaled_dot_product_attention``;
* ``flex`` (:class:`Flex`): calls lowered to torch's FlexAttention (every mask as a
  ``mask_mod``, what the call adds to the scores as a ``score_mod``), compiled on GPUs with
  gradients and on the CPU for inference (registered where torch has FlexAttention; ``auto``
  takes it on GPUs only);
* ``flash_attn`` (:class:`FlashAttnPackage`): the flash-attn package's kernels for packed
  documents and sliding windows on GPUs (registered where flash-attn is installed);
* ``chunked`` (:class:`Chunked`): attnkit's own blocked kernel (:mod:`attnkit._kernel`), O(T)
  memory, every mask, score term, softcap and sinks;
* ``reference`` (:class:`Reference`): the formula as it reads, materialised
  (:func:`attnkit.backends.reference.formula`); the spec the others are tested against, and the
  only one that returns the weights.

Pass a name (``backend="chunked"``) or an instance (``backend=Chunked(block_q=64)``) to
:func:`attnkit.attention`.
"""

import torch

from .base import Backend, BackendError, BackendFn, CallInputs, Dispatch, record_dispatch
from .chunked import Chunked
from .flash_package import FlashAttnPackage, flash_attn_installed
from .flex import Flex, flex_available
from .reference import Reference
from .sdpa import SDPA

__all__ = [
    "SDPA",
    "Backend",
    "BackendError",
    "BackendFn",
    "CallInputs",
    "Chunked",
    "Dispatch",
    "FlashAttnPackage",
    "Flex",
    "Reference",
    "builtin_backends",
    "record_dispatch",
]


def builtin_backends() -> tuple[Backend, ...]:
    """New instances of the built-in backends, in ``auto``'s order of preference: the fastest
    first, the materialising spec last; ``flash_attn`` where the flash-attn package is installed,
    ``flex`` where torch has FlexAttention."""
    flash = (FlashAttnPackage(),) if flash_attn_installed() else ()
    flex = (Flex(),) if flex_available() else ()
    return (SDPA(), *flash, *flex, Chunked(), Reference())


def missing_builtins() -> dict[str, str]:
    """The built-in backends this process does not register, each with what it needs (for the
    error of a call that names one)."""
    missing = {}
    if not flash_attn_installed():
        missing["flash_attn"] = (
            "registered where the flash-attn package is installed (pip install flash-attn, for "
            "NVIDIA and AMD GPUs); it is not installed here"
        )
    if not flex_available():
        missing["flex"] = (
            "registered where torch has FlexAttention (torch.nn.attention.flex_attention); this "
            f"torch ({torch.__version__}) has none"
        )
    return missing
