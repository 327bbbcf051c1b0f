"""Two parts of one row's keys, combined by their log-sum-exp.

The forward merges a fully visible stretch's part (from torch's fused kernel) into the rest of its
rows this way; ring attention merges each shard pair's part into the running result.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["merge"]


def merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one part's (output, log-sum-exp) into a running pair, in place (``block_out`` too).

    Two parts of one row's keys combine exactly: ``lse = logaddexp(lse_a, lse_b)`` and each output
    weighs ``exp(lse_part - lse)``.
    """
    new = torch.logaddexp(lse, block_lse)
    # A row that has seen no key on either side stays at -inf; subtracting 0 then keeps both
    # weights at exp(-inf) = 0 instead of exp(-inf + inf) = nan.
    safe = new.masked_fill(new == float("-inf"), 0.0)
    out.mul_((lse - safe).exp_().unsqueeze(-1))
    out.add_(block_out.mul_((block_lse - safe).exp_().unsqueeze(-1)))
    lse.copy_(new)
