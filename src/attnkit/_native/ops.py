"""The native kernel's operators in Python: their fake kernels.

``attention.cpp``'s successors (``csrc/ops.cpp``) define the operators and their CPU kernels:

* ``torch.ops.attnkit.native_forward(q, k, v, offsets, visits, bias, key_ok, tiles, qv, enc,
  k_scale, v_scale, *, block_q, block_k, scale, ...) -> (out, lse)``: q in the work dtype
  (float32, float64), or bfloat16 with bfloat16 keys and values, out then in bfloat16 and lse in
  float32; on the decode path, int8 or float8 keys and values with their float32 scales
  ``(N, Hkv, Tk)`` (``k_scale``, ``v_scale``: key j is ``k[..., j, :] * k_scale[..., j]``), read
  as they are (no backward: a call that needs gradients dequantizes them first);
* ``torch.ops.attnkit.native_backward(dout, lse, delta, <the same>, *, ..., bias_grad, qv_grad,
  enc_grad) -> (dq, dk, dv, dbias, dqv, denc)`` (an empty tensor where a gradient is not asked);
* ``torch.ops.attnkit.native_backward_into(dout, lse, delta, dq!, dk!, dv!, ...)``, the same
  writing dq, dk and dv into given tensors;
* ``torch.ops.attnkit.native_cache_forward(q, k, v, block_table, kv_range, q_range, bias, key_ok,
  k_scale, v_scale, *, scale, ...) -> (out, lse)``: queries against a KV cache read in place,
  each batch row's keys a stretch of it, contiguous or in pages through a block table; int8 or
  float8 pages with their float32 scales ``(X, Hkv, page)``; forward only;
* ``torch.ops.attnkit.gathered_forward(q, k, v, keys, key_ok, *, scale, softcap, band, span)
  -> (out, lse)`` and ``gathered_backward(dout, q, k, v, keys, lse, delta, key_ok, *, scale,
  softcap, band) -> (dq, dk, dv)`` (``csrc/gathered.cpp``): index-selected attention, each
  query's selected key and value rows read by position; q ``(B, H, Tq, Dk)`` float32, k and v
  ``(B, Hkv, Tk, D)`` float32, bfloat16 or float16, ``keys`` ``(B|1, Hs, Tq, W)`` int64 sorted
  rows (-1 = none, a repeat counts once), ``key_ok`` ``(B|1, Tk)`` bool, ``band`` ``(lo, hi,
  offset)`` triples; outputs in float32 (see :mod:`attnkit._kernel.gathered`);
* ``torch.ops.attnkit.native_stats(lse, q, k, v, offsets, visits, ..., *, block_q, ...) ->
  (key_mass, key_max, entropy)``: the attention statistics of a call (see
  :mod:`attnkit._kernel.stats`) from its rows' natural-log log-sum-exp ``lse``
  ``(N, Hkv, G, Tq)``: the weights' column sums and maxima ``(N, Hkv, G, Tk)`` and the rows'
  entropies ``(N, Hkv, G, Tq)``, float32 or float64 as q and k (v is not read: any tensor of
  k's ``(N, Hkv, Tk)``, of width 0); no autograd;
* ``torch.ops.attnkit.all_finite(tensors) -> bool``.

Here, once the library is loaded (:func:`register`): each operator's fake kernel, which gives its
outputs' shapes, dtypes and strides without running it (what torch.compile, torch.export and
fake tensors need).

The operators have no autograd formula of their own: they are the kernel's marshalled calls, run
by the kernel's two phases (:mod:`attnkit._kernel.phases`: ``native_forward`` in the forward,
``native_backward`` in the backward), and a graph is recorded only by the kernel's autograd
entries above them (the eager autograd function and attnkit's operator,
``torch.ops.attnkit.attention``, whose backward is an operator of its own), which call them with
no graph to record.

The layouts are the kernel's: q ``(N, Hkv, G, Tq, Dk)``, k and v ``(N, Hkv, Tk, D)``; see
:mod:`attnkit._native.kernel` for the plan and mask arguments. Outputs are laid out as the
inputs are (token-major when q is a view of ``(B, T, H, D)`` memory), which the fake kernels
reproduce.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import torch
from torch import Tensor

from .._base.transforms import transforms_active

__all__ = ["like_kv", "like_q", "no_graph", "register"]

_registered: list[bool] = []
# Held while one thread registers (threads loading the kernel at once wait for it: registering
# an operator's kernel twice overrides the first and warns).
_REGISTERING = threading.Lock()


def _new_lock_in_child() -> None:
    """After ``fork()``: a lock of its own for the child (a thread of the parent may have held
    it at the fork, and none of the child's would release it)."""
    global _REGISTERING
    _REGISTERING = threading.Lock()


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_new_lock_in_child)


def like_q(q: Tensor, d: int) -> Tensor:
    """An empty ``(N, Hkv, G, Tq, d)`` tensor laid out as the kernel lays out its outputs for
    ``q``: ``(N, Tq, Hkv, G, d)`` memory when q's rows are token-major, else contiguous."""
    token_major = q.size(3) > 1 and q.stride(3) >= q.size(1) * q.size(2) * q.size(4)
    if not token_major:
        return q.new_empty((*q.shape[:4], d))
    return q.new_empty((q.size(0), q.size(3), q.size(1), q.size(2), d)).permute(0, 2, 3, 1, 4)


def like_kv(k: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An empty tensor of ``k``'s ``(N, X, T, D)`` shape (and ``dtype``, default k's) laid out as
    the kernel lays out k's and v's gradients: token-major when k is, else contiguous."""
    dtype = dtype or k.dtype
    token_major = k.size(2) > 1 and k.stride(2) >= k.size(1) * k.size(3)
    if not token_major:
        return k.new_empty(k.shape, dtype=dtype)
    return k.new_empty((k.size(0), k.size(2), k.size(1), k.size(3)), dtype=dtype).permute(
        0, 2, 1, 3
    )


def _fake_forward(
    q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    # (bfloat16 queries: the output in bfloat16, the log-sum-exp in float32)
    lse_dtype = torch.promote_types(q.dtype, torch.float32)
    return like_q(q, v.size(3)), q.new_empty(q.shape[:4], dtype=lse_dtype)


def _fake_cache_forward(
    q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    return like_q(q, v.size(3)), q.new_empty(q.shape[:4])


def _fake_stats(
    lse: Tensor, q: Tensor, k: Tensor, *args: Any, **kwargs: Any
) -> tuple[Tensor, Tensor, Tensor]:
    cols = (*q.shape[:3], k.size(2))
    return q.new_empty(cols), q.new_empty(cols), q.new_empty(q.shape[:4])


def _grads_like(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    qv: Tensor | None,
    enc: Tensor | None,
    bias_grad: bool,
    qv_grad: bool,
    enc_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The fake (dbias, dqv, denc): empty where not asked, as the kernel returns them."""
    position = qv is not None and enc is not None
    # (each its own tensor: outputs do not alias each other)
    dbias = bias.new_empty(bias.shape) if bias_grad and bias is not None else q.new_empty((0,))
    dqv = like_kv(qv) if position and qv_grad and qv is not None else q.new_empty((0,))
    denc = torch.empty_like(enc) if position and enc_grad and enc is not None else q.new_empty((0,))
    return dbias, dqv, denc


def _fake_backward(
    dout: Tensor,
    lse: Tensor,
    delta: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    offsets: Tensor,
    visits: Tensor,
    bias: Tensor | None = None,
    key_ok: Tensor | None = None,
    tiles: Tensor | None = None,
    qv: Tensor | None = None,
    enc: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    *,
    bias_grad: bool = False,
    qv_grad: bool = False,
    enc_grad: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, ...]:
    rest = _grads_like(q, k, v, bias, qv, enc, bias_grad, qv_grad, enc_grad)
    # (bfloat16 keys and values get their gradients in q's dtype)
    return (like_q(q, q.size(4)), like_kv(k, q.dtype), like_kv(v, q.dtype), *rest)


def _fake_backward_into(
    dout: Tensor,
    lse: Tensor,
    delta: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    offsets: Tensor,
    visits: Tensor,
    bias: Tensor | None = None,
    key_ok: Tensor | None = None,
    tiles: Tensor | None = None,
    qv: Tensor | None = None,
    enc: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    *,
    bias_grad: bool = False,
    qv_grad: bool = False,
    enc_grad: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, ...]:
    return _grads_like(q, k, v, bias, qv, enc, bias_grad, qv_grad, enc_grad)


def _fake_gathered_forward(
    q: Tensor, k: Tensor, v: Tensor, keys: Tensor, *args: Any, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    return q.new_empty((*q.shape[:3], v.size(3))), q.new_empty(q.shape[:3])


def _fake_gathered_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any
) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape)


def no_graph(tensors: tuple[Tensor | None, ...]) -> contextlib.AbstractContextManager[object]:
    """Run an operator call straight on its kernel when it records no graph: no tensor of
    ``tensors`` (the call's inputs) requires grad, or grad mode is off.

    The autograd layer (torch's fallback, for operators without a formula of their own) would
    find the same and hand the call on below autograd, as this does, after its own look at every
    input and output, which a small decode step would pay on every call. While torch.compile
    traces, or under torch.func transforms, the call goes through every layer as usual."""
    if (
        transforms_active()
        or torch.compiler.is_compiling()
        or (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))
    ):
        return contextlib.nullcontext()
    below: contextlib.AbstractContextManager[object] = torch._C._AutoDispatchBelowAutograd()
    return below


def _one_by_one(op_name: str) -> Any:
    """A ``torch.vmap`` rule for the operator ``op_name`` that calls it once per example and
    stacks the results along dimension 0. The kernels take whole calls, and vmap over them is
    what a per-example evaluation runs (a few queries a call, on the decode path): torch's own
    fallback does the same, but warns, on every call, of a missing batching rule."""
    op = getattr(torch.ops.attnkit, op_name).default

    def rule(info: Any, in_dims: tuple[int | None, ...], *args: Any, **kwargs: Any) -> Any:
        def example(i: int) -> list[Any]:
            taken = []
            for a, d in zip(args, in_dims, strict=True):
                if d is None or not isinstance(a, Tensor):
                    taken.append(a)
                elif info.batch_size:
                    taken.append(a.select(d, i))
                else:  # no example at all: zeros of one example's shape, for the results' shapes
                    taken.append(a.new_zeros(a.shape[:d] + a.shape[d + 1 :]))
            return taken

        results = [op(*example(i), **kwargs) for i in range(max(info.batch_size, 1))]
        single = isinstance(results[0], Tensor)
        rows = [(r,) for r in results] if single else results  # per example, its outputs
        outs = tuple(
            torch.stack(list(each)) if info.batch_size else each[0].new_empty((0, *each[0].shape))
            for each in zip(*rows, strict=True)
        )
        return (outs[0], 0) if single else (outs, (0,) * len(outs))

    return rule


def register() -> None:
    """Register the fake kernels and the vmap rules (once, after the library loaded; threads
    that ask at once wait for the first)."""
    if _registered:
        return
    with _REGISTERING:
        if _registered:
            return
        for name in ("native_forward", "native_cache_forward", "gathered_forward", "native_stats"):
            torch.library.register_vmap(f"attnkit::{name}", _one_by_one(name))
        torch.library.register_fake("attnkit::native_forward")(_fake_forward)
        torch.library.register_fake("attnkit::native_backward")(_fake_backward)
        torch.library.register_fake("attnkit::native_backward_into")(_fake_backward_into)
        torch.library.register_fake("attnkit::native_cache_forward")(_fake_cache_forward)
        torch.library.register_fake("attnkit::gathered_forward")(_fake_gathered_forward)
        torch.library.register_fake("attnkit::gathered_backward")(_fake_gathered_backward)
        torch.library.register_fake("attnkit::native_stats")(_fake_stats)
        _registered.append(True)
