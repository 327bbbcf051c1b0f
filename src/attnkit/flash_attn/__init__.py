"""flash-attn's Python API, served by attnkit on any device.

The functions of ``flash_attn`` (flash-attn 2's ``flash_attn_interface``) with the same names,
argument order, defaults, ``(batch, seqlen, nheads, headdim)`` layouts and semantics, so code
written for flash-attn runs on the CPU, on Apple's GPUs and anywhere else torch runs::

    # before                                    # after
    from flash_attn import flash_attn_func      from attnkit.flash_attn import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True) out = flash_attn_func(q, k, v, causal=True)

or, for code you cannot edit (a Hub model's remote code, a library), once at start-up::

    import attnkit.flash_attn
    attnkit.flash_attn.install()    # "flash_attn" now imports this module, unless it is installed

Each function is one :func:`attnkit.attention` call: the ``(B, T, H, D)`` tensors go in as
``(B, H, T, D)`` views (``q.transpose(1, 2)``, no copy), ``causal`` and ``window_size`` become a
structured band mask, ``cu_seqlens`` become :func:`attnkit.masks.documents` (or, with different
query and key lengths per sequence, :func:`varlen_mask`), ``alibi_slopes`` ALiBi as a bias by
distance (:class:`~attnkit.scores.DistanceBias`, no ``(Tq, Tk)`` bias is written out, and the
native kernel reads it as it is). attnkit's backends then serve the call as any other, O(T)
memory included; :func:`attnkit.explain` tells which.

Conventions, as flash-attn's:

* queries are aligned **bottom-right** to the keys: query ``i`` sits at key position
  ``i + Tk - Tq`` (per sequence with ``cu_seqlens``, per batch row with a KV cache);
* ``causal``: query ``i`` may attend key ``j`` iff ``j <= i + Tk - Tq``::

      Tq=2, Tk=5        Tq=5, Tk=2
      1 1 1 1 0         0 0
      1 1 1 1 1         0 0
                        0 0
                        1 0
                        1 1

  A query with no visible key gets output 0 (and zero gradients);
* ``window_size=(left, right)``: query ``i`` may attend the keys
  ``i + Tk - Tq - left <= j <= i + Tk - Tq + right``, bounds inclusive; ``-1`` or None is no bound
  on that side. ``causal=True`` sets ``right = 0``. Other negative bounds are flash-attn 4's:
  a band that leaves out the diagonal (``(None, -11)``: only keys at least 11 before). A band
  with no key (``left + right < 0``) is a ``ValueError``;
* ``softmax_scale`` multiplies ``q k^T`` (default ``1 / sqrt(headdim)``); ``softcap > 0`` caps the
  scaled scores, ``softcap * tanh(s / softcap)``; ``alibi_slopes`` ``(nheads,)`` or
  ``(batch, nheads)`` then add ``-slope * |i + Tk - Tq - j|``; ``dropout_p`` drops attention
  weights and scales the kept ones by ``1 / (1 - p)`` (drawn from torch's generator:
  ``torch.manual_seed`` makes it repeatable);
* the log-sum-exp ``softmax_lse`` is the natural log of each row's softmax denominator over the
  scaled (capped, biased) scores, ``(batch, nheads, seqlen_q)``, or ``(nheads, total_q)`` with
  ``cu_seqlens``.

Where attnkit and flash-attn differ, on purpose:

* attnkit accepts what flash-attn refuses: any head size (the query/key size and the value size
  may differ), float32 and float64, any page size of a paged cache;
* a query with no visible key has ``softmax_lse = -inf`` (the log of an empty sum), where
  flash-attn 2 writes ``+inf``: with ``-inf`` the usual merge of partial attentions by their LSE
  gives such a part weight 0, as it must;
* ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)`` as flash-attn, and
  ``S_dmask`` is what flash-attn makes of it: an empty tensor when ``dropout_p == 0`` (so asking
  for the LSE costs no ``(Tq, Tk)`` tensor); with ``dropout_p > 0`` the softmax weights
  ``(batch, nheads, seqlen_q, seqlen_k)`` before dropout, correctly normalised (flash-attn's
  unnormalised, sign-encoded dropout pattern is not reproduced); the output, dropout included,
  is the one the same seed gives without ``return_attn_probs``. For the weights of any call use
  ``attnkit.attention(..., return_weights=True)``;
* the output is returned contiguous, as flash-attn's, and differentiable (the KV-cache function
  too, although flash-attn's has no backward);
* ``deterministic`` is accepted and changes nothing: attnkit's backward is deterministic;
  ``num_splits`` and ``max_seqlen_q``/``max_seqlen_k`` (launch sizes for flash-attn's kernels)
  are accepted and not needed.

Keyword-only additions: ``learnable_sink`` (flash-attn 4's name; ``s_aux`` in the flash-attn 3
builds that serve GPT-OSS) ``(nheads,)``: one logit per head that joins every row's softmax
denominator and attends to nothing (attnkit's ``sinks=``), included in ``softmax_lse``.

Shape letters: ``B`` batch, ``Tq``/``Tk`` query/key lengths, ``H`` query heads, ``Hkv`` key/value
heads (a divisor of ``H``: grouped-query attention), ``D`` head size (``Dv`` of the values).
"""

from __future__ import annotations

from ._api import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from ._kvcache import flash_attn_with_kvcache
from ._stand_in import install
from ._varlen import varlen_mask

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "install",
    "varlen_mask",
]
