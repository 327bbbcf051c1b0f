"""flash-attn's arguments checked (``attnkit.flash_attn._args``): each refusal names the argument
and quotes its value, in flash-attn's words for the layouts."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from attnkit import flash_attn as fa

ERRORS = [
    (lambda q: fa.flash_attn_func(q[0], q, q), ValueError,
     "q must be (batch, seqlen_q, nheads, headdim), got shape (3, 2, 8)"),
    (lambda q: fa.flash_attn_func(q, q, q, window_size=3), TypeError,
     "window_size must be a pair (left, right), got 3"),
    (lambda q: fa.flash_attn_func(q, q, q, window_size=(2.5, 0)), TypeError,
     "window_size left bound must be an int or None (-1 or None: no bound), got 2.5"),
    (lambda q: fa.flash_attn_func(q, q, q, window_size=(-4, 2)), ValueError,
     "window_size=(-4, 2) holds no key: the band runs from 4 to 2 keys from the diagonal"),
    (lambda q: fa.flash_attn_func(q, q, q, softcap=-1.0), ValueError,
     "softcap must be a finite number > 0, or 0.0 for none, got -1.0"),
    (lambda q: fa.flash_attn_func(q, q, q, alibi_slopes=torch.ones(3)), ValueError,
     "alibi_slopes must be (nheads,) = (2,) or (batch, nheads) = (1, 2), got (3)"),
    (lambda q: fa.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 2]),
                                         torch.tensor([0, 3]), 2, 3), ValueError,
     "cu_seqlens_q must start at 0, never decrease and end at the 3 packed tokens, got [0, 2]"),
    (lambda q: fa.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 3]),
                                         torch.tensor([0, 1, 3]), 3, 3), ValueError,
     "cu_seqlens_q describes 1 sequences and cu_seqlens_k 2"),
    (lambda q: fa.flash_attn_with_kvcache(q, q, q, q), TypeError,
     "k and v come together"),
    (lambda q: fa.flash_attn_with_kvcache(q, q, q, q, q), TypeError,
     "cache_seqlens is needed with k and v"),
    (lambda q: fa.flash_attn_with_kvcache(q, q, q, q, q, cache_seqlens=1), ValueError,
     "cache_seqlens [1] + 3 new tokens do not fit the cache's 3 positions"),
]  # fmt: skip


@pytest.mark.parametrize(("fn", "exc", "message"), ERRORS)
def test_errors_name_the_argument(fn: Any, exc: type[Exception], message: str | None) -> None:
    q = torch.randn(1, 3, 2, 8)
    with pytest.raises(exc, match=None if message is None else re.escape(message)):
        fn(q)
