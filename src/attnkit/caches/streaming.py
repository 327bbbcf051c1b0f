"""StreamingKVCache: the first ``S`` tokens and the last ``W``, in constant memory, for decoding
past any length (StreamingLLM's attention sinks and window, Xiao et al., 2023).

A query at position ``t`` attends the ``S`` sink tokens (positions ``0 .. S - 1``) and the ``W``
latest tokens up to itself (``t - W + 1 .. t``); every other token is gone. The cache holds
``S + W`` tokens at most, whatever the length of the conversation, and a decoding step reads them
in place: the window is a ring (the new token takes the slot of the one that just left it), and
one new query attends every held token, in whatever order the ring holds them (softmax does not
care about the order of its keys).

Positions and rotary embeddings: the cache stores keys as they are given. A model that rotates
its keys before caching them (RoPE at each token's own position, ``offset = cache.position``, as
:class:`~attnkit.MultiHeadAttention` does) gets exactly the attention a full cache would give
over the same tokens: the output equals attention with the mask ``sinks | window`` over the whole
sequence. Positions then keep growing past the lengths the model was trained on. StreamingLLM's
other choice, positions counted inside the cache, needs keys stored before their rotation and
rotated again at each step: that is a different cache, not this one.

Shape letters: ``B`` batch, ``H`` query heads, ``Hkv`` key/value heads, ``T`` new tokens,
``S`` sink tokens, ``W`` window, ``Dk``/``Dv`` head sizes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._base.checks import check_float_tensor, check_int
from .._base.shapes import Float, shape_checked
from ..attention import attention
from ..masks import Mask, causal, key_padding, sliding_window

__all__ = ["StreamingKVCache"]


class StreamingKVCache:
    """Keys ``(B, Hkv, S + W, Dk)`` and values ``(B, Hkv, S + W, Dv)``: ``S`` sinks and a ring of
    the last ``W`` tokens.

    Args:
        batch_size: ``B``.
        num_kv_heads: ``Hkv``.
        head_dim: ``Dk``; ``v_head_dim``: ``Dv``, default ``Dk``.
        sink_tokens: ``S``, the first tokens, kept for ever (StreamingLLM keeps 4); 0 for a
            window alone.
        window: ``W`` >= 1, the latest tokens each query attends, itself included.
        dtype, device: of the stored keys and values.

    ``position`` counts every token appended (the next token's position, the offset a rotary
    embedding takes); ``length`` the tokens in memory, ``min(position, S + W)``.
    :class:`~attnkit.MultiHeadAttention` decodes with it as with a :class:`~attnkit.KVCache`
    (``module(x, cache=cache, causal=True)``).

    :meth:`attention` appends the new tokens and attends over what they may see, as one
    :func:`attnkit.attention` call; :meth:`update` returns the keys, values and mask for a call
    of your own. A step of one token reads the held tokens where they are, with no mask; a
    chunk of several tokens (a prompt) attends over the held tokens put in time order, with the
    mask ``sliding_window(W - 1) | (causal() & key_padding([S] * B))``. Every check runs before
    anything is written, and a chunk's tokens are written only by :meth:`commit`: a call that
    raises leaves every token a later query can see as it was.

    >>> cache = StreamingKVCache(1, 1, 8, sink_tokens=2, window=4)
    >>> for _ in range(100):
    ...     out, _ = cache.attention(*(torch.randn(1, 1, 1, 8) for _ in range(3)))
    >>> cache.position, cache.length, tuple(cache.k_cache.shape)
    (100, 6, (1, 1, 6, 8))
    """

    k_cache: Tensor
    v_cache: Tensor

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        *,
        sink_tokens: int,
        window: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        b = check_int("batch_size", batch_size)
        h = check_int("num_kv_heads", num_kv_heads)
        dk = check_int("head_dim", head_dim)
        dv = dk if v_head_dim is None else check_int("v_head_dim", v_head_dim)
        self.sink_tokens = check_int("sink_tokens", sink_tokens, minimum=0)
        self.window = check_int("window", window)
        slots = self.sink_tokens + self.window
        self.k_cache = torch.zeros(b, h, slots, dk, dtype=dtype, device=device)
        self.v_cache = torch.zeros(b, h, slots, dv, dtype=dtype, device=device)
        self.position = 0  # tokens appended so far: the next token's position
        self._staged: tuple[Tensor, Tensor] | None = None  # a chunk, written at commit
        self._staged_one = False  # one token, written in place at stage

    @property
    def length(self) -> int:
        """The tokens in memory: ``min(position, S + W)``."""
        return min(self.position, self.sink_tokens + self.window)

    def _slot(self, position: int) -> int:
        s = self.sink_tokens
        return position if position < s else s + (position - s) % self.window

    def _check(self, k: Tensor, v: Tensor) -> None:
        check_float_tensor("k", k)
        check_float_tensor("v", v)
        keys, values = self.k_cache, self.v_cache
        b, h = keys.size(0), keys.size(1)
        t = k.size(-2) if k.ndim == 4 else "T"
        want_k, want_v = (b, h, t, keys.size(3)), (b, h, t, values.size(3))
        if k.shape != want_k or v.shape != want_v:
            raise ValueError(
                f"k and v must have shapes (B, Hkv, T, Dk) = {want_k} and (B, Hkv, T, Dv) = "
                f"{want_v} for this cache, got k {tuple(k.shape)} and v {tuple(v.shape)}"
            )
        if k.dtype != keys.dtype or v.dtype != values.dtype:
            raise TypeError(
                f"k and v must have the cache's dtype ({keys.dtype}), got k {k.dtype} and "
                f"v {v.dtype}"
            )
        if k.device != keys.device or v.device != keys.device:
            raise ValueError(
                f"k and v must be on the cache's device ({keys.device}), got k on {k.device} and "
                f"v on {v.device}"
            )
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise ValueError(
                "StreamingKVCache got keys that require grad: the cache is for inference, run "
                "decoding under torch.no_grad() or torch.inference_mode()"
            )
        if k.size(-2) == 0:
            raise ValueError("k and v bring no token (T = 0)")

    @shape_checked
    def stage(
        self, k: Float[Tensor, "B Hkv T Dk"], v: Float[Tensor, "B Hkv T Dv"]
    ) -> tuple[Float[Tensor, "B Hkv S Dk"], Float[Tensor, "B Hkv S Dv"], Mask | None]:
        """The keys, values and mask the ``T`` new tokens' queries attend, without holding the
        tokens yet (:meth:`commit` does).

        One token: it is written in the slot of the token that just left the window (a token no
        query can see any more), and the keys and values are views of the held tokens, every one
        visible (mask None). Several: nothing is written; the keys and values are a copy of the
        sinks, the window's tokens in time order and the new tokens, with the mask that gives each
        query the sinks and its own window (``mask`` applies with bottom-right alignment, as
        everywhere in attnkit).
        """
        self._check(k, v)
        t, start = k.size(-2), self.position
        self._staged, self._staged_one = None, False
        if t == 1:
            slot = self._slot(start)
            self.k_cache.narrow(2, slot, 1).copy_(k)
            self.v_cache.narrow(2, slot, 1).copy_(v)
            self._staged_one = True
            n = min(start + 1, self.sink_tokens + self.window)
            return self.k_cache.narrow(2, 0, n), self.v_cache.narrow(2, 0, n), None
        order = self._time_order(start, t)
        keys = torch.cat([self.k_cache.index_select(2, order), k], dim=2)
        values = torch.cat([self.v_cache.index_select(2, order), v], dim=2)
        self._staged = (k, v)
        return keys, values, self._mask(keys.size(2))

    def _time_order(self, start: int, new: int) -> Tensor:
        """The slots of the held tokens the new tokens' queries may see, in time order: the sinks,
        then the window tokens from ``start - W + 1`` on (older ones no new query sees)."""
        s = self.sink_tokens
        sinks = list(range(min(start, s)))
        first = max(s, start - self.window + 1)
        window = [self._slot(p) for p in range(first, start)]
        return torch.tensor(sinks + window, dtype=torch.long, device=self.k_cache.device)

    def _mask(self, kv_len: int) -> Mask:
        lengths = [min(self.sink_tokens, kv_len)] * self.k_cache.size(0)
        return sliding_window(self.window - 1) | (causal() & key_padding(lengths))

    def commit(self) -> None:
        """Hold the tokens of the last :meth:`stage`: a chunk's sinks go to their slots and its
        last ``W`` tokens into the ring (nothing happens if nothing is staged)."""
        if self._staged_one:
            self.position += 1
        elif self._staged is not None:
            k, v = self._staged
            t, start = k.size(-2), self.position
            keep = [
                i
                for i in range(t)
                if start + i < self.sink_tokens or start + i >= start + t - self.window
            ]
            rows = torch.tensor(keep, dtype=torch.long, device=k.device)
            slots = [self._slot(start + i) for i in keep]
            at = torch.tensor(slots, dtype=torch.long, device=k.device)
            self.k_cache.index_copy_(2, at, k.index_select(2, rows))
            self.v_cache.index_copy_(2, at, v.index_select(2, rows))
            self.position += t
        self._staged, self._staged_one = None, False

    @shape_checked
    def update(
        self, k: Float[Tensor, "B Hkv T Dk"], v: Float[Tensor, "B Hkv T Dv"]
    ) -> tuple[Float[Tensor, "B Hkv S Dk"], Float[Tensor, "B Hkv S Dv"], Mask | None]:
        """:meth:`stage` then :meth:`commit`: the keys, values and mask to attend with."""
        out = self.stage(k, v)
        self.commit()
        return out

    def attention(
        self,
        q: Float[Tensor, "B H T Dk"],
        k: Float[Tensor, "B Hkv T Dk"],
        v: Float[Tensor, "B Hkv T Dv"],
        *,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> tuple[Float[Tensor, "B H T Dv"], Float[Tensor, "B H T"]]:
        """Append the new tokens and attend: ``(out (B, H, T, Dv), lse (B, H, T))``, one
        :func:`attnkit.attention` call (``explain()`` and ``record_dispatch()`` see it). Query
        ``i`` sits at position ``position + i`` and attends the sinks and its window. ``sinks``
        here are attention-sink logits ``(H,)`` (gpt-oss's), which take weight without a value;
        the cache's sink tokens are tokens."""
        keys, values, mask = self.stage(k, v)
        out, lse = attention(
            q,
            keys,
            values,
            mask=mask,
            scale=scale,
            softcap=softcap,
            sinks=sinks,
            return_lse=True,
        )
        self.commit()
        return out, lse

    def stage_call(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask: object = None, **call: object
    ) -> tuple[Tensor, Tensor, Mask | None]:
        """What a module attends for its new tokens: :meth:`stage`'s keys and values, and the
        call's ``mask`` with the cache's (``None`` where neither has one)."""
        keys, values, window = self.stage(k, v)
        if window is None:
            return keys, values, mask  # type: ignore[return-value]
        if mask is None:
            return keys, values, window
        return keys, values, window & mask

    def reset(self) -> None:
        """Forget every token (the memory stays allocated)."""
        self.position = 0
        self._staged, self._staged_one = None, False

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> StreamingKVCache:
        """Move the keys and values to ``device`` and/or convert them to ``dtype``, in place;
        returns the cache."""
        self.k_cache = self.k_cache.to(device=device, dtype=dtype)
        self.v_cache = self.v_cache.to(device=device, dtype=dtype)
        return self

    def __repr__(self) -> str:
        b, h, _, dk = self.k_cache.shape
        return (
            f"StreamingKVCache(batch_size={b}, num_kv_heads={h}, head_dim={dk}, "
            f"v_head_dim={self.v_cache.size(-1)}, sink_tokens={self.sink_tokens}, "
            f"window={self.window}, position={self.position}, length={self.length}, "
            f"dtype={self.k_cache.dtype}, device={self.k_cache.device})"
        )
