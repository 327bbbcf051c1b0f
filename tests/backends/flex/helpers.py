"""What the flex backend's tests share: a catalogue of every mask kind, seeded inputs, the float64
reference, and a lowered call run through FlexAttention's unfused form (the compiled form costs
seconds per kind on the CPU: only tests/backends/flex/test_backend.py compiles)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

import attnkit
from attnkit import flex, masks
from attnkit._call import AttentionCall
from attnkit.backends.flex import lower_call, run_lowered

B, H, HKV, D = 2, 4, 2, 8


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def qkv(tq: int, tk: int, *, seed: int = 0, hkv: int = HKV) -> tuple[Tensor, Tensor, Tensor]:
    return (
        randn(B, H, tq, D, seed=seed),
        randn(B, hkv, tk, D, seed=seed + 1),
        randn(B, hkv, tk, D, seed=seed + 2),
    )


def reference(q: Tensor, k: Tensor, v: Tensor, **kw: object) -> object:
    kw = {
        n: t.double() if isinstance(t, Tensor) and t.is_floating_point() else t
        for n, t in kw.items()
    }
    return attnkit.attention(q.double(), k.double(), v.double(), backend="reference", **kw)  # type: ignore[call-overload]


def call_of(q: Tensor, k: Tensor, v: Tensor, **kw: object) -> AttentionCall:
    return attnkit.explain(q, k, v, **kw).call  # type: ignore[arg-type]


def unfused(q: Tensor, k: Tensor, v: Tensor, **kw: object) -> tuple[Tensor, Tensor]:
    """The call lowered and run through ``flex_attention``'s unfused form: ``(out, lse)``."""
    bias = kw.get("bias")
    call = call_of(q, k, v, **kw)
    dense = bias if isinstance(bias, Tensor) else None
    lowered = lower_call(call, q, k, v, dense)
    out, lse = run_lowered(lowered, lse=True, compiled=False)
    assert lse is not None
    return out.reshape(q.shape[:-1] + out.shape[-1:]), lse.reshape(q.shape[:-1])


def _prefix_lm(prefix: int) -> masks.Mask:
    def prefix_keys(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx < prefix

    return masks.causal() | masks.from_fn(prefix_keys)


def _not_diagonal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return ~(q_idx == kv_idx) & (kv_idx <= q_idx + 40)


def _flex_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return kv_idx <= q_idx


def selection(rows: int, heads: int, tq: int, slots: int, k: int, *, seed: int) -> Tensor:
    """``(rows, heads, tq, k)`` entries of ``-1 .. slots - 1``: random, with repeats (each row's
    second entry is its first), a row with none (query 1), and ``-1`` here and there."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, slots, (rows, heads, tq, k), generator=g)
    if k > 1:
        idx[..., 1] = idx[..., 0]
    if tq > 1:
        idx[:, :, 1] = -1
    return idx


def catalogue(tq: int, tk: int) -> dict[str, Callable[[], masks.Mask | Tensor]]:
    """Every mask kind for a call of ``tq`` queries and ``tk`` keys, by name (made when called:
    some hold tensors)."""
    third = tk // 3
    ids = torch.arange(tk) * 7 % 3  # documents whose positions are not contiguous runs
    valid = torch.rand(B, tk, generator=torch.Generator().manual_seed(5)) > 0.3
    dense = torch.rand(H, tq, tk, generator=torch.Generator().manual_seed(6)) > 0.4
    return {
        "causal": lambda: masks.causal(),
        "causal top-left": lambda: masks.causal(align="top_left"),
        "window": lambda: masks.sliding_window(5),
        "window both sides": lambda: masks.sliding_window(3, right=4),
        "window off the diagonal": lambda: masks.sliding_window(4, right=-1),
        "documents by lengths": lambda: masks.documents([third, 0, tk - 2 * third, third]),
        "documents by ids": lambda: masks.documents(ids=ids),
        "documents per row, causal": lambda: (
            masks.documents([[third, tk - third], [tk - 5, 5]]) & masks.causal()
        ),
        "key padding by lengths": lambda: masks.key_padding([tk - 3, 0]),
        "key padding on the left": lambda: masks.key_padding(torch.tensor([2, tk]), side="left"),
        "key padding by a tensor": lambda: masks.key_padding(valid=valid),
        "chunks": lambda: masks.documents(ids=torch.arange(tk) // 8) & masks.causal(),
        "prefix-LM": lambda: _prefix_lm(6),
        "from_fn with ~": lambda: masks.from_fn(_not_diagonal),
        "attnkit.flex mask_mod": lambda: (
            flex.create_block_mask(_flex_causal, None, None, tq, tk).mask
        ),
        "window | key padding": lambda: masks.sliding_window(2) | masks.key_padding([4, 9]),
        "dense per head": lambda: dense,
        "dense ~ and a window": lambda: masks.sliding_window(6, right=6) & ~dense[0],
        "dense keys": lambda: valid[:, None, None, :],
        "key indices": lambda: masks.key_indices(selection(1, 1, tq, tk, 6, seed=7)),
        "key indices sorted, & causal": lambda: (
            masks.key_indices(selection(1, 1, tq, tk, 9, seed=8).sort(-1).values) & masks.causal()
        ),
        "key indices per row and key head": lambda: masks.key_indices(
            selection(B, HKV, tq, tk, 5, seed=9)
        ),
        "block indices": lambda: masks.block_indices(
            selection(1, 1, tq, -(-tk // 4), 2, seed=10), block=4
        ),
        "block indices per query head | window": lambda: (
            masks.block_indices(selection(1, H, tq, -(-tk // 3), 2, seed=11), block=3)
            | masks.sliding_window(2)
        ),
    }


def dense_of(mask: masks.Mask | Tensor, tq: int, tk: int) -> Tensor:
    """``(B, H, Tq, Tk)`` bool: the mask written out by attnkit."""
    m = mask if isinstance(mask, masks.Mask) else masks.visibility(mask, False)
    assert m is not None
    return m.dense(tq, tk, batch_size=B, num_heads=H).expand(B, H, tq, tk)
