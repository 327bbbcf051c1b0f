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

Quantized storage (``kv_dtype``): the sinks and the window are stored as ``torch.int8`` (a scale
per token and key/value head, in the slot beside its token: a token that leaves the ring takes its
scale with it, the one that takes its slot brings its own) or as ``torch.float8_e4m3fn`` /
``torch.float8_e5m2`` (a scale per row and key/value head, set by the first write after an empty
cache, the same for every token held), as :class:`~attnkit.KVCache` stores them. A step reads the
held tokens where they lie with their scales (:class:`~attnkit.caches.view.CacheView`); a chunk
reads them dequantized, in time order.

Shape letters: ``B`` batch, ``H`` query heads, ``Hkv`` key/value heads, ``T`` new tokens,
``S`` sink tokens, ``W`` window, ``Dk``/``Dv`` head sizes.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeGuard

import torch
from torch import Tensor

from .._base.checks import check_int
from .._base.quantized import dequantize
from .._base.shapes import Float, shape_checked
from ..attention import attention
from ..masks import Mask, causal, key_padding, sliding_window
from ._memory import cache_zeros
from ._quantize import (
    FLOAT8,
    check_dtype,
    check_kv_dtype,
    new_scales,
    pickled_state,
    quantize,
    unpickled_state,
)
from ._tokens import check_tokens, given, write
from .view import CacheView

__all__ = ["StreamingKVCache"]


class _New(NamedTuple):
    """New tokens as they are stored: keys and values ``(B, Hkv, T, D)`` in the cache's dtype,
    and their float32 scales for a quantized cache (int8 ``(B, Hkv, T, 1)``, float8 ``(B, Hkv,
    1, 1)``; None for a float cache)."""

    k: Tensor
    v: Tensor
    k_scale: Tensor | None
    v_scale: Tensor | None


class _Undo(NamedTuple):
    """What a chunk's commit, or a step's stage once the ring is full, wrote over: the position
    it started at, the slots it wrote ``(n,)`` and their tensors' old contents there (keys and
    values, an int8 cache's scales; float8 as bytes), so that :meth:`StreamingKVCache.rewind`
    can put them back; and the end of the positions written before it, which that makes the
    cache's again."""

    start: int
    slots: Tensor
    old: list[Tensor]
    written: int


def _both(pair: tuple[Tensor | None, Tensor | None]) -> TypeGuard[tuple[Tensor, Tensor]]:
    return pair[0] is not None and pair[1] is not None


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
        dtype, device: of the keys and values given and read, and of those stored unless
            ``kv_dtype`` says otherwise.
        kv_dtype: store the sinks and the window quantized, as :class:`~attnkit.KVCache` does:
            ``torch.int8`` (a float32 scale per token and key/value head, ``k_scale`` ``(B, Hkv,
            S + W, 1)``, moved with its token) or ``torch.float8_e4m3fn`` /
            ``torch.float8_e5m2`` (a float32 scale per row and key/value head, ``(B, Hkv, 1,
            1)``, set by the first write after an empty cache; later tokens beyond its range
            saturate). None (default): stored in ``dtype``.

    ``position`` counts every token appended (the next token's position, the offset a rotary
    embedding takes); ``length`` the tokens in memory, ``min(position, S + W)``.
    :class:`~attnkit.MultiHeadAttention` decodes with it as with a :class:`~attnkit.KVCache`
    (``module(x, cache=cache, causal=True)``).

    :meth:`attention` appends the new tokens and attends over what they may see, as one
    :func:`attnkit.attention` call; :meth:`update` returns the keys, values and mask for a call
    of your own. A step of one token reads the held tokens where they are, with no mask (a
    quantized cache through its :meth:`view`, with the scales), unless a module's call brings
    a mask or bias of its own (:meth:`stage_call`); a chunk of several tokens (a prompt) attends
    over the held tokens put in time order (dequantized), with the mask
    ``sliding_window(W - 1) | (causal() & key_padding([S] * B))``. Every check runs before
    anything is written, and a chunk's tokens (and scales) are written only by :meth:`commit`:
    a call that raises leaves every token a later query can see as it was.

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
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        b = check_int("batch_size", batch_size)
        h = check_int("num_kv_heads", num_kv_heads)
        dk = check_int("head_dim", head_dim)
        dv = dk if v_head_dim is None else check_int("v_head_dim", v_head_dim)
        self.sink_tokens = check_int("sink_tokens", sink_tokens, minimum=0)
        self.window = check_int("window", window)
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.dtype = check_dtype(dtype)  # given and read in
        stored = self.dtype if self.kv_dtype is None else self.kv_dtype
        slots = self.sink_tokens + self.window
        self.k_cache = cache_zeros((b, h, slots, dk), dtype=stored, device=device)
        self.v_cache = cache_zeros((b, h, slots, dv), dtype=stored, device=device)
        #: quantized keys' and values' float32 scales (None unless ``kv_dtype``)
        self.k_scale = None if self.kv_dtype is None else new_scales(self.k_cache)
        self.v_scale = None if self.kv_dtype is None else new_scales(self.v_cache)
        self.position = 0  # tokens appended so far: the next token's position
        self._staged: _New | None = None  # a chunk, written at commit
        self._staged_one = False  # one token, written in place at stage
        self._undo: _Undo | None = None  # what the last chunk's commit wrote over
        #: the end of the positions written to their slots (a rewind leaves them there): a
        #: query before ``_written - 1`` may attend a token that a later one wrote over
        self._written = 0

    @property
    def length(self) -> int:
        """The tokens in memory: ``min(position, S + W)``."""
        return min(self.position, self.sink_tokens + self.window)

    def _slot(self, position: int) -> int:
        s = self.sink_tokens
        return position if position < s else s + (position - s) % self.window

    def _runs(self, start: int, new: int) -> list[tuple[int, int, int]]:
        """Where the cache keeps ``new`` tokens from position ``start`` on: ``(first token,
        first slot, tokens)`` stretches, each contiguous in the tokens and in the slots (the
        sinks; the last ``W`` in the ring, split where it wraps)."""
        s, slots = self.sink_tokens, self.sink_tokens + self.window
        sinks = max(0, min(new, s - start))
        runs = [(0, start, sinks)] if sinks else []
        i = max(sinks, new - self.window)
        while i < new:
            slot = self._slot(start + i)
            n = min(new - i, slots - slot)
            runs.append((i, slot, n))
            i += n
        return runs

    def _given(self) -> tuple[Tensor, Tensor]:
        """The keys and values as they are given and read: the cache, or of a quantized one
        stand-ins in ``dtype`` without data (what the check of new tokens compares with)."""
        return given(self.k_cache, self.v_cache, None if self.kv_dtype is None else self.dtype)

    def _check(self, k: Tensor, v: Tensor) -> None:
        keys, values = self._given()
        check_tokens(k, v, keys, values, keys.size(0), "StreamingKVCache")
        if k.size(-2) == 0:
            raise ValueError("k and v bring no token (T = 0)")

    def _stored(self, k: Tensor, v: Tensor) -> _New:
        """Checked new tokens as the cache stores them: quantized with their scales (float8:
        the cache's scale, or one from these tokens for an empty cache), computed before
        anything is written."""
        if self.kv_dtype is None or self.k_scale is None or self.v_scale is None:
            return _New(k, v, None, None)
        first = self.position == 0
        kq, ks = quantize(k, self.kv_dtype, None if first else self.k_scale)
        vq, vs = quantize(v, self.kv_dtype, None if first else self.v_scale)
        return _New(kq, vq, ks, vs)

    def _put(self, new: _New, start: int) -> None:
        """The tokens of ``new`` the cache keeps, from position ``start`` on, into their slots
        (int8 scales into theirs; float8's per head from a first write)."""
        own = (self.k_scale, self.v_scale)
        scales = (new.k_scale, new.v_scale)
        rows = self.k_cache.size(0)
        for i, slot, n in self._runs(start, new.k.size(-2)):
            at = [slot] * rows
            write(self.k_cache, self.v_cache, new.k[:, :, i : i + n], new.v[:, :, i : i + n], at=at)
            if self.kv_dtype == torch.int8 and _both(own) and _both(scales):
                write(*own, scales[0][:, :, i : i + n], scales[1][:, :, i : i + n], at=at)
        if self.kv_dtype in FLOAT8 and start == 0 and _both(own) and _both(scales):
            own[0].copy_(scales[0])
            own[1].copy_(scales[1])
        end = start + new.k.size(-2)
        if end > self._written:  # (a comparison: a compiled step's position is a symbolic size)
            self._written = end

    def _stage(
        self, k: Tensor, v: Tensor, in_place: bool = True
    ) -> tuple[Tensor, Tensor, Mask] | None:
        """:meth:`stage` of checked tokens (:meth:`_check`), inside :meth:`_begin` and
        :meth:`_abandon`: a step's write in place (None: the held tokens are read where they
        lie) or a chunk's keys, values and mask (nothing written); ``in_place`` False: a step as
        a chunk of one token, its keys in time order."""
        new = self._stored(k, v)
        t, start = k.size(-2), self.position
        if t == 1 and in_place:
            # (the slot holds the window's oldest token once the ring is full: kept, so that a
            # dropped stage or a rewind by this step puts it back; kept before the write, so
            # that a write cut short, by an interrupt, is put back too)
            full = start >= self.sink_tokens + self.window
            undo = self._overwritten(start, 1) if full else None
            self._staged, self._staged_one, self._undo = None, True, undo
            self._put(new, start)
            return None
        held_k, held_v = self._held(self._time_order(start, t))
        if new.k_scale is not None and new.v_scale is not None:
            k = dequantize(new.k, new.k_scale, self.dtype)
            v = dequantize(new.v, new.v_scale, self.dtype)
        keys, values = torch.cat([held_k, k], dim=2), torch.cat([held_v, v], dim=2)
        self._staged, self._staged_one, self._undo = new, False, None
        return keys, values, self._mask(keys.size(2))

    def _begin(self) -> _Undo | None:
        """Before a checked stage: an earlier uncommitted stage is dropped (a step's slot gets
        back the token it held); returns the last chunk's copy for :meth:`rewind`, which
        :meth:`_abandon` keeps."""
        self._drop_staged()
        return self._undo

    def _abandon(self, undo: _Undo | None) -> None:
        """After a stage cut short (an interrupt lands between any two of its operations, or
        of what follows it in the same call): the stage dropped, a step's slot back as it was,
        and ``undo`` (:meth:`_begin`'s) kept for :meth:`rewind`."""
        self._drop_staged()
        self._undo = undo

    def _held(self, order: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values of the slots ``order``, in ``dtype`` (dequantized copies)."""
        k, v = self.k_cache.index_select(2, order), self.v_cache.index_select(2, order)
        ks, vs = self._scales()
        if ks is None or vs is None:
            return k, v
        return (
            dequantize(k, ks.index_select(2, order), self.dtype),
            dequantize(v, vs.index_select(2, order), self.dtype),
        )

    def _scales(self) -> tuple[Tensor | None, Tensor | None]:
        """A quantized cache's scales as a view takes them, ``(B, Hkv, S + W, 1)`` (a float8
        cache's expanded along the slots); None for a float cache."""
        if self.k_scale is None or self.v_scale is None:
            return None, None
        shape = (*self.k_cache.shape[:3], 1)
        return self.k_scale.expand(shape), self.v_scale.expand(shape)

    def view(self) -> CacheView:
        """The tokens held (and a staged step's), as :func:`attnkit.attention` reads them where
        they lie: each row's first ``length`` slots (the sinks and the ring, in slot order), with
        the scales of a quantized cache.

        The view reads the cache's buffers when a call runs, not a copy made now: once the ring
        is full each new token writes over a slot the view reads, as :meth:`rewind` and
        :meth:`reset` followed by new tokens do. Take a new view after them."""
        n = min(self.position + self._staged_one, self.sink_tokens + self.window)
        ks, vs = self._scales()
        rows = ((0, n),) * self.k_cache.size(0)
        return CacheView(self.k_cache, self.v_cache, rows, k_scale=ks, v_scale=vs, trusted=True)

    def _in_place(self) -> tuple[Tensor, Tensor]:
        """A float cache's held tokens after a staged step: views of the slots in use."""
        n = min(self.position + 1, self.sink_tokens + self.window)
        return self.k_cache.narrow(2, 0, n), self.v_cache.narrow(2, 0, n)

    @shape_checked
    def stage(
        self, k: Float[Tensor, "B Hkv T Dk"], v: Float[Tensor, "B Hkv T Dv"]
    ) -> tuple[Float[Tensor, "B Hkv S Dk"], Float[Tensor, "B Hkv S Dv"], Mask | None]:
        """The keys, values and mask the ``T`` new tokens' queries attend, without holding the
        tokens yet (:meth:`commit` does).

        One token: it is written in the slot of the token that just left the window (a token no
        query can see any more), and the keys and values are views of the held tokens, every one
        visible (mask None); of a quantized cache, dequantized copies in ``dtype``. Several:
        nothing is written; the keys and values are a copy of the sinks, the window's tokens in
        time order and the new tokens (of a quantized cache, all of them as stored, dequantized),
        with the mask that gives each query the sinks and its own window (``mask`` applies with
        bottom-right alignment, as everywhere in attnkit).

        An earlier stage not committed is dropped first (a step's slot gets back the token it
        held); a stage cut short (an interrupt) is dropped, and changes nothing.
        """
        self._check(k, v)
        undo = self._begin()
        try:
            got = self._stage(k, v)
            if got is not None:
                return got
            if self.kv_dtype is not None:
                keys, values = self.view().dense(self.dtype)
                return keys, values, None
            keys, values = self._in_place()
            return keys, values, None
        except BaseException:
            self._abandon(undo)
            raise

    def _time_order(self, start: int, new: int) -> Tensor:
        """The slots of the held tokens the new tokens' queries may see, in time order: the sinks,
        then the window tokens from ``start - W + 1`` on (older ones no new query sees)."""
        s, w = self.sink_tokens, self.window
        device = self.k_cache.device
        # Tensor arithmetic on the position, no Python list of its slots: under torch.compile the
        # position is a symbolic size, which a loop over its range would make a constant (a new
        # graph at every token). Before the ring wraps each held token is in its position's slot;
        # after, the sinks and the W - 1 latest slots, a fixed number rotated by the position.
        if start - w + 1 <= s:  # every held token in its own position's slot
            return torch.arange(start, device=device)
        rotated = torch.arange(start - w + 1 - s, start - s, device=device).remainder_(w).add_(s)
        return torch.cat([torch.arange(s, device=device), rotated])

    def _mask(self, kv_len: int) -> Mask:
        lengths = [min(self.sink_tokens, kv_len)] * self.k_cache.size(0)
        return sliding_window(self.window - 1) | (causal() & key_padding(lengths))

    def commit(self) -> None:
        """Hold the tokens of the last :meth:`stage`: a chunk's sinks go to their slots and its
        last ``W`` tokens into the ring, with their scales (nothing happens if nothing is
        staged)."""
        if self._staged_one:
            self.position += 1
        elif self._staged is not None:
            undo = self._overwritten(self.position, self._staged.k.size(-2))
            try:
                self._put(self._staged, self.position)
            except BaseException:  # (a write cut short, by an interrupt: the slots as they were)
                self._put_back(undo)
                raise
            self._undo = undo
            self.position += self._staged.k.size(-2)
        self._staged, self._staged_one = None, False

    def _stored_tensors(self) -> list[Tensor]:
        """The tensors a token's slot is in: keys and values (float8 as their bytes: torch's
        index_select has no float8 kernel) and an int8 cache's scales."""
        out = [
            t.view(torch.uint8) if t.dtype in FLOAT8 else t for t in (self.k_cache, self.v_cache)
        ]
        if self.kv_dtype == torch.int8 and self.k_scale is not None and self.v_scale is not None:
            out += [self.k_scale, self.v_scale]
        return out

    def _overwritten(self, start: int, new: int) -> _Undo:
        """The slots ``new`` tokens from position ``start`` on are written to, and what they
        hold before."""
        slots = [slot + j for _, slot, n in self._runs(start, new) for j in range(n)]
        at = torch.tensor(slots, dtype=torch.long, device=self.k_cache.device)
        old = [t.index_select(2, at) for t in self._stored_tensors()]
        return _Undo(start, at, old, self._written)

    def rewind(self, position: int) -> None:
        """Forget every token from ``position`` on, as if the calls that appended them had never
        run: what a stack of layers uses to undo a step when a later layer fails. A
        ``position`` past the tokens appended keeps them all.

        The ring has let older tokens go, so it can go back only where a query still finds
        every token it attends: by one token from the last one written (the window still holds
        the ``W - 1`` before it; once only, since that token wrote over the one before them),
        by the whole last chunk (its commit keeps a copy of the slots it wrote over, at most
        ``S + W`` tokens, until the next stage), or anywhere while no more than ``S + W``
        positions have been written (no slot written twice). Any other ``position`` is a
        ``ValueError``, and changes nothing. An uncommitted stage is dropped (a step's slot gets
        back the token it held), so ``rewind(position)`` undoes a call that failed after it
        staged. A forgotten token stays in its slot until the next stage writes over it
        (:attr:`length` and :meth:`view` count it until then)."""
        position = check_int("position", position, minimum=0, saturate=True)
        if position >= self.position:
            self._drop_staged()
            return
        undo = self._undo
        if undo is not None and position == undo.start:
            self._put_back(undo)
        elif not self._reachable(position):
            raise ValueError(
                f"this StreamingKVCache (position={self.position}, window={self.window}) cannot "
                f"rewind to position {position}: tokens a query there attends have left its "
                f"ring; it can go back to {self._reachable_text()}"
            )
        self.position = position
        self._staged, self._staged_one, self._undo = None, False, None

    def _put_back(self, undo: _Undo) -> None:
        """The slots ``undo`` names, as they were before the write it kept them from."""
        for t, old in zip(self._stored_tensors(), undo.old, strict=True):
            t.index_copy_(2, undo.slots, old)
        self._written = undo.written

    def _drop_staged(self) -> None:
        """Forget an uncommitted stage: a step's token leaves the slot it was written to, which
        gets back the token it held."""
        undo = self._undo
        if self._staged_one and undo is not None and undo.start == self.position:
            self._put_back(undo)
            self._undo = None
        self._staged, self._staged_one = None, False

    def _reachable(self, position: int) -> bool:
        """Whether every token a query at ``position`` attends is still in its slot."""
        if self._written <= self.sink_tokens + self.window:
            return True  # no slot written twice
        # (the last token written, a staged step's too, wrote over the oldest token of its
        # window, which a query one step earlier attends)
        return not self._staged_one and position >= self._written - 1

    def _reachable_text(self) -> str:
        """The positions :meth:`rewind` can go back to once the ring has wrapped, in words."""
        if self._staged_one:
            return f"position {self.position} (a staged step wrote over its window's oldest token)"
        choices = [self._written - 1]
        if self._undo is not None and self._undo.start < self._written - 1:
            choices.insert(0, self._undo.start)
        return " or ".join(f"position {p}" for p in choices)

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
        ``i`` sits at position ``position + i`` (a query per new token: ``q`` and ``k`` bring
        the same ``T``) and attends the sinks and its window. ``sinks``
        here are attention-sink logits ``(H,)`` (gpt-oss's), which take weight without a value;
        the cache's sink tokens are tokens. A call that raises (``scale``, ``softcap`` or
        ``sinks`` refused, or a KeyboardInterrupt wherever it lands: in the stage, the kernel's
        call or the commit) drops its stage: the cache is as it was, and :meth:`rewind` goes
        back where it could before."""
        self._drop_staged()  # (an earlier uncommitted stage: before the copy below is taken)
        undo = self._undo  # (the last chunk's copy, for rewind: kept if the call fails)
        keys, values, mask = self.stage_call(q, k, v)  # (all or nothing, as the rest below)
        try:
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
        except BaseException:  # (an interrupt included: in the kernel's call, in the commit)
            self._abandon(undo)  # (a step's slot gets back the token it held)
            raise
        return out, lse

    def stage_call(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask: object = None, **call: object
    ) -> tuple[Tensor | CacheView, Tensor | None, Mask | None]:
        """What a module attends for its new tokens: :meth:`stage`'s keys and values (of a
        quantized cache's step, its :meth:`view` and None, read in place), and the call's
        ``mask`` with the cache's (``None`` where neither has one).

        A step reads the held tokens in the ring's order, which a softmax alone does not mind;
        a call's own ``mask`` or ``bias`` (``call["bias"]``) is a function of the keys' order,
        and its weights (``call["need_weights"]``) are read in it, so with any of them a step
        reads the tokens in time order, as a chunk does (sinks, then the window), and the mask
        and bias apply there, bottom-right aligned."""
        # (a step reads the ring with no mask: a query past the new tokens would see all of it,
        # and a chunk's mask would put fewer queries at its last positions)
        shaped = isinstance(q, Tensor) and isinstance(k, Tensor) and q.ndim == k.ndim == 4
        if shaped and q.size(-2) != k.size(-2):
            raise ValueError(
                f"q brings {q.size(-2)} queries but k and v {k.size(-2)} new tokens: a "
                "StreamingKVCache call has a query per new token (query i at position "
                "position + i)"
            )
        ordered = mask is not None or call.get("bias") is not None or bool(call.get("need_weights"))
        self._check(k, v)
        undo = self._begin()
        try:
            got = self._stage(k, v, in_place=not ordered)
            if got is None:
                if self.kv_dtype is not None:
                    return self.view(), None, mask  # type: ignore[return-value]
                keys, values = self._in_place()
                return keys, values, mask  # type: ignore[return-value]
            keys, values, window = got
            if mask is None:
                return keys, values, window
            # (the method, not `&`: torch.compile traces the method, where `&` with a bool
            # tensor on the right breaks the graph)
            return keys, values, window.__and__(mask)
        except BaseException:
            self._abandon(undo)
            raise

    def stand_in(
        self, new_tokens: int, *, mask: object = None, **call: object
    ) -> tuple[Tensor | CacheView, Tensor | None, Mask | None]:
        """What :meth:`stage_call` would give a call of ``new_tokens`` tokens (with the same
        ``mask``, ``bias`` and ``need_weights``), without data and without writing: keys and
        values of the shapes it reads (one zero, expanded; a quantized step's view with unit
        scales) and the mask it attends with. What ``explain()`` describes."""
        new = check_int("new_tokens", new_tokens)
        ordered = mask is not None or call.get("bias") is not None or bool(call.get("need_weights"))
        b, h, _, dk = self.k_cache.shape
        zero = torch.zeros((), dtype=self.dtype, device=self.k_cache.device)
        if new == 1 and not ordered:  # a step: every held slot and the new token, in place
            n = min(self.position + 1, self.sink_tokens + self.window)
            keys = zero.expand(b, h, n, dk)
            values = zero.expand(b, h, n, self.v_cache.size(-1))
            if self.kv_dtype is None:
                return keys, values, None
            one = torch.ones((), device=zero.device).expand(b, h, n, 1)
            stored = self.k_cache.new_zeros(())
            pages = (stored.expand(b, h, n, dk), stored.expand(b, h, n, self.v_cache.size(-1)))
            view = CacheView(*pages, ((0, n),) * b, k_scale=one, v_scale=one)
            return view, None, None
        n = self._time_order(self.position, new).numel() + new
        keys, values = zero.expand(b, h, n, dk), zero.expand(b, h, n, self.v_cache.size(-1))
        window = self._mask(n)
        return keys, values, window if mask is None else window & mask

    def reset(self) -> None:
        """Forget every token (the memory stays allocated)."""
        self.position = 0
        self._staged, self._staged_one, self._undo = None, False, None
        self._written = 0

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> StreamingKVCache:
        """Move the keys and values to ``device`` and/or convert them to ``dtype``, in place;
        returns the cache. A quantized cache (``kv_dtype``) keeps its storage: ``dtype`` is then
        the one keys and values are given and read in."""
        if dtype is not None:
            check_dtype(dtype)  # before anything moves
        stored = dtype if self.kv_dtype is None else None
        self.k_cache = self.k_cache.to(device=device, dtype=stored)
        self.v_cache = self.v_cache.to(device=device, dtype=stored)
        self._undo = None  # (what a chunk wrote over, in the old dtype and place)
        if self.k_scale is not None and self.v_scale is not None:
            self.k_scale, self.v_scale = self.k_scale.to(device), self.v_scale.to(device)
        self.dtype = self.k_cache.dtype if self.kv_dtype is None else (dtype or self.dtype)
        return self

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle``, ``copy`` and ``torch.save`` store: float8 keys and values (a staged
        chunk's too) as their bytes, since torch cannot unpickle a float8 tensor."""
        return pickled_state(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(unpickled_state(state))

    def __repr__(self) -> str:
        b, h, _, dk = self.k_cache.shape
        return (
            f"StreamingKVCache(batch_size={b}, num_kv_heads={h}, head_dim={dk}, "
            f"v_head_dim={self.v_cache.size(-1)}, sink_tokens={self.sink_tokens}, "
            f"window={self.window}, position={self.position}, length={self.length}, "
            f"dtype={self.dtype}, "
            + ("" if self.kv_dtype is None else f"kv_dtype={self.kv_dtype}, ")
            + f"device={self.k_cache.device})"
        )
