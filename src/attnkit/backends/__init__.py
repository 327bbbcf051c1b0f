"""The built-in backends of :func:`attnkit.attention`, and what a backend is.

* ``sdpa`` (:class:`SDPA`): torch's fused ``scaled_dot_product_attention``;
* ``chunked`` (:class:`Chunked`): attnkit's own blocked kernel (:mod:`attnkit._kernel`), O(T)
  memory, every mask, score term, softcap and sinks;
* ``reference`` (:func:`reference`): the formula as it reads, materialised; the spec the others are
  tested against, and the only one that returns the weights.

Pass a name (``backend="chunked"``) or an instance (``backend=Chunked(block_q=64)``) to
:func:`attnkit.attention`.
"""

from .base import Backend, BackendError, BackendFn
from .chunked import Chunked
from .reference import reference
from .sdpa import SDPA

__all__ = ["SDPA", "Backend", "BackendError", "BackendFn", "Chunked", "reference"]
