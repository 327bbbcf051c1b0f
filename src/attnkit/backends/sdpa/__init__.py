"""The sdpa backend: torch's fused ``scaled_dot_product_attention``, with attnkit's conventions
and policy.

* ``backend.py``: the adapter, :class:`SDPA`: attnkit's conventions on torch's kernel, what it
  cannot serve (:func:`sdpa_check`) and what it would write out (:func:`sdpa_cost`);
* ``documents.py``: packed documents, one fused call each;
* ``terms.py``: a score term beside torch's kernel, block by block;
* ``caches.py``: a contiguous KV cache read where it lies, on GPUs;
* ``kernels.py``: which of torch's kernels serves a call on a GPU (flash, cuDNN,
  memory-efficient, math);
* ``screen.py``: the non-finite screen of torch's output, and when a call is handed over;
* ``costs.py``: the cost model, where torch's kernels are slower than attnkit's on CPUs
  (:func:`sdpa_slower`), from the thresholds of ``thresholds.py``, each beside its measurement.
"""

from .backend import SDPA, sdpa_check, sdpa_cost
from .costs import sdpa_slower

__all__ = ["SDPA", "sdpa_check", "sdpa_cost", "sdpa_slower"]
