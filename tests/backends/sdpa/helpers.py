"""What the sdpa backend's tests share: seeded inputs, the float64 reference, a checked call."""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import attention
from attnkit._call import AttentionCall, check_attention_args


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def reference(q: Tensor, k: Tensor, v: Tensor, **kw: object) -> Tensor:
    out = attention(q.double(), k.double(), v.double(), backend="reference", **kw)  # type: ignore[arg-type]
    assert isinstance(out, Tensor)
    return out


def call_of(q: Tensor, k: Tensor, v: Tensor, **kw: object) -> AttentionCall:
    args: dict[str, object] = {"mask": None, "bias": None, "causal": False, "scale": None}
    args.update(kw)
    return check_attention_args(q, k, v, **args)  # type: ignore[arg-type]
