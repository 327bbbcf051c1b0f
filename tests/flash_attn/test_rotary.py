"""flash-attn's rotary embedding in the KV-cache call (``attnkit.flash_attn._rotary``)."""

from __future__ import annotations

import re

import pytest
import torch

from attnkit import flash_attn as fa

from .helpers import kv_call


def test_rotary_tables_wider_than_the_head_are_named() -> None:
    call = kv_call(paged=False)
    call["rotary_cos"] = call["rotary_sin"] = torch.ones(16, 5, dtype=torch.float64)
    message = (
        "rotary_cos has 5 columns (rotary_dim / 2) and so rotates 10 dims, more than the headdim "
        "of 8: it may have at most 4 columns, got shape (16, 5)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        fa.flash_attn_with_kvcache(**call)
    call["rotary_cos"] = call["rotary_sin"] = torch.ones(16, 4, dtype=torch.float64)
    fa.flash_attn_with_kvcache(**call)  # rotary_dim = headdim: the whole head turns
