"""KVCache: the keys and values of the tokens decoded so far, preallocated for a maximum length.

Incremental decoding runs the model on the new tokens only; each self-attention layer appends
their keys and values to its cache and attends over everything cached. Because
:func:`attnkit.attention`'s ``causal=True`` is bottom-right aligned, the same call serves a prompt
(``Tq = Tk``), one new token (``Tq = 1``, which sees every cached key) and a chunk of new tokens
after a cached prefix.

Under grouped-query attention the cache holds the ``Hkv`` key/value heads, not the ``H`` query
heads: that is the memory GQA saves.

Shape letters: ``B`` batch, ``Hkv`` key/value heads, ``L`` maximum length, ``T`` new tokens,
``Dk``/``Dv`` key and value head sizes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._base.checks import check_bool, check_int
from .._base.shapes import Float, shape_checked
from ._evict import check_indices, compact_rows
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
from ._tokens import check_tokens, check_values, given, values_of_keys, write
from .view import CacheView

__all__ = ["KVCache", "check_values_in_keys"]


def check_values_in_keys(values_in_keys: object, dk: int, dv: int) -> bool:
    """``values_in_keys`` of a cache of keys ``Dk = dk`` and values ``Dv = dv``: a bool, and
    where it is True, values that fit in the keys (``Dv <= Dk``)."""
    if check_bool("values_in_keys", values_in_keys) and dv > dk:
        raise ValueError(
            f"values_in_keys=True reads the values as the keys' first v_head_dim columns: "
            f"v_head_dim ({dv}) must be at most head_dim ({dk})"
        )
    return bool(values_in_keys)


class KVCache:
    """Keys ``(B, Hkv, L, Dk)`` and values ``(B, Hkv, L, Dv)``, filled from position 0 on.

    Args:
        batch_size: ``B``.
        max_len: ``L``, the most tokens the cache can hold; going past it is a ``ValueError``.
        num_kv_heads: ``Hkv``.
        head_dim: ``Dk``.
        v_head_dim: ``Dv``, default ``Dk``.
        dtype, device: of the keys and values given and read (the projections' dtype and
            device), and of those stored unless ``kv_dtype`` says otherwise.
        kv_dtype: store keys and values quantized: ``torch.int8`` (symmetric, a float32 scale
            per token and key/value head, ``k_scale`` ``(B, Hkv, L, 1)``) or
            ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (a float32 scale per row and
            key/value head, ``(B, Hkv, 1, 1)``, set by the first write after an empty cache;
            later tokens beyond its range saturate). Writes quantize; attention reads the cache
            where it lies with its scales (the native decode kernel dequantizes in registers).
            None (default): stored in ``dtype``.
        values_in_keys: the values are the keys' first ``Dv`` columns (``Dv <= Dk``), stored
            once: ``v_cache`` is the view ``k_cache[..., :Dv]``. This is multi-head latent
            attention's cache (one head, ``Hkv = 1``, of ``[c, k_rope]`` a token, whose values
            are the latent ``c``: :meth:`MultiHeadLatentAttention.make_kv_cache()
            <attnkit.MultiHeadLatentAttention.make_kv_cache>`). Writes take the keys only
            (``v=None``), or values equal to the keys' first ``Dv`` columns (anything else is
            refused, since it could not be stored); an attention call reads the values where the
            keys lie, each row once for every query head. With ``kv_dtype`` the values are
            read with the keys' scales (``v_scale`` is ``k_scale``): the keys' first ``Dv``
            columns, dequantized.

    :meth:`MultiHeadAttention.make_cache() <attnkit.MultiHeadAttention.make_cache>` builds one with
    the module's sizes. :meth:`to` moves the keys and values. The cache is for inference:
    :meth:`update` refuses tensors that carry a gradient, since the stored keys would keep the
    graph of every step alive.

    A cache is not an ``nn.Module``: it is state that changes at every step, not part of a model
    or its ``state_dict()``. torch.compile takes a Module's integer attributes for constants and
    would compile a decode step again for every token (and stop at its recompile limit); a
    compiled step reads this cache's ``length`` as a symbolic size instead, one graph for every
    length.

    A module that can still fail after writing its keys uses :meth:`stage` and :meth:`commit`
    instead of :meth:`update`, so that a call that raises leaves the cache as it was.

    >>> cache = KVCache(batch_size=2, max_len=16, num_kv_heads=2, head_dim=8)
    >>> k, v = cache.update(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))  # a 5-token prompt
    >>> k.shape, cache.length
    (torch.Size([2, 2, 5, 8]), 5)
    >>> k, v = cache.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))  # one more token
    >>> k.shape, cache.length
    (torch.Size([2, 2, 6, 8]), 6)
    """

    k_cache: Tensor
    v_cache: Tensor

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        kv_dtype: torch.dtype | None = None,
        values_in_keys: bool = False,
    ) -> None:
        b = check_int("batch_size", batch_size)
        self.max_len = check_int("max_len", max_len)
        h = check_int("num_kv_heads", num_kv_heads)
        dk = check_int("head_dim", head_dim)
        dv = dk if v_head_dim is None else check_int("v_head_dim", v_head_dim)
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.dtype = check_dtype(dtype)  # given and read in
        #: whether ``v_cache`` is the view ``k_cache[..., :Dv]`` (a latent cache)
        self.values_in_keys = check_values_in_keys(values_in_keys, dk, dv)
        stored = self.dtype if self.kv_dtype is None else self.kv_dtype
        self.k_cache = cache_zeros((b, h, self.max_len, dk), dtype=stored, device=device)
        self.v_cache = (
            self.k_cache[..., :dv]
            if self.values_in_keys
            else cache_zeros((b, h, self.max_len, dv), dtype=stored, device=device)
        )
        #: quantized keys' and values' float32 scales (None unless ``kv_dtype``)
        self.k_scale = None if self.kv_dtype is None else new_scales(self.k_cache)
        self.v_scale = None if self.kv_dtype is None else new_scales(self.v_cache)
        if self.values_in_keys:  # values read from the keys' columns read with the keys' scales
            self.v_scale = self.k_scale
        self.length = 0  # tokens held; a Python int, so decoding never reads a tensor back
        #: the next token's position: the tokens appended, those :meth:`keep` let go included
        #: (the offset a module rotates new tokens by)
        self.position = 0
        self._staged = 0  # tokens written by stage() after `length` and not yet committed

    @shape_checked
    def update(
        self, k: Float[Tensor, "B Hkv T Dk"], v: Float[Tensor, "B Hkv T Dv"] | None
    ) -> tuple[Float[Tensor, "B Hkv S Dk"], Float[Tensor, "B Hkv S Dv"]]:
        """Append ``T`` new tokens; return the keys and values of all ``S = length`` tokens held.

        The results are views of the cache (no copy), valid until the next :meth:`update`,
        :meth:`stage` or :meth:`reset`. Equivalent to :meth:`stage` then :meth:`commit`.
        ``v`` None: a ``values_in_keys`` cache's values, the keys' first ``Dv`` columns.
        """
        keys, values = self.stage(k, v)
        self.commit()
        return keys, values

    @shape_checked
    def stage(
        self, k: Float[Tensor, "B Hkv T Dk"], v: Float[Tensor, "B Hkv T Dv"] | None
    ) -> tuple[Float[Tensor, "B Hkv S Dk"], Float[Tensor, "B Hkv S Dv"]]:
        """Write ``T`` new tokens after the ``length`` held, without holding them yet.

        Returns views of the ``S = length + T`` keys and values, as :meth:`update` does, but
        ``length`` stays where it was until :meth:`commit`. A caller that can still fail after
        writing (the attention call, the layers above) commits only once everything succeeded:
        tokens staged and never committed sit past ``length``, where nothing reads them, and the
        next :meth:`stage` or :meth:`update` writes over them. Every check runs before anything
        is written, so a call that raises leaves the cache as it was. A quantized cache
        (``kv_dtype``) returns its keys and values dequantized, a copy in ``dtype``.
        """
        end = self._stage(k, v)
        if self.kv_dtype is not None:
            return self.view().dense(self.dtype)
        return self.k_cache.narrow(2, 0, end), self.v_cache.narrow(2, 0, end)

    def _stage(self, k: Tensor, v: Tensor | None) -> int:
        """:meth:`stage`'s checks, then its write; the end of the tokens held and staged."""
        keys, values = self._given()
        compare = False
        if self.values_in_keys:
            v, compare = values_of_keys(k, v, values.size(-1))  # type: ignore[assignment]
        cached = keys.size(0)
        if isinstance(k, Tensor) and k.ndim == 4 and k.size(0) != cached:
            # The caller's batch, not "k and v", which a module's user never passed.
            if k.size(0) == 0:  # (no cache holds an empty batch: batch_size is at least 1)
                raise ValueError(
                    f"this KVCache holds a batch of {cached} sequences (batch_size={cached}) but "
                    "the call brings an empty batch (B = 0): it has no tokens to cache; make the "
                    "call without the cache"
                )
            raise ValueError(
                f"this KVCache holds a batch of {cached} sequences (batch_size={cached}) but the "
                f"call brings a batch of {k.size(0)} (the keys and values k, v): make a cache "
                f"with batch_size={k.size(0)} for this batch (make_cache(batch_size=...))"
            )
        k, v = check_tokens(k, v, keys, values, cached, "KVCache")
        if compare:
            check_values(k, v, values.size(-1), "this KVCache")
        start = self.length
        end = start + k.size(-2)
        if end > self.max_len:
            raise ValueError(
                f"KV cache overflow: {k.size(-2)} new tokens after the {start} cached exceed "
                f"max_len ({self.max_len}); make a larger cache or reset() it"
            )
        self._write(k, v, start)
        self._staged = end - start
        return end

    def _given(self) -> tuple[Tensor, Tensor]:
        """The keys and values as they are given and read: the cache, or of a quantized one
        stand-ins in ``dtype`` without data (what the checks of new tokens compare with)."""
        return given(self.k_cache, self.v_cache, None if self.kv_dtype is None else self.dtype)

    def _write(self, k: Tensor, v: Tensor, start: int) -> None:
        """Checked new tokens into every row from position ``start`` on; quantized (all of it
        computed before anything is written) for a ``kv_dtype`` cache, their scales beside."""
        at = [start] * self.k_cache.size(0)
        if self.kv_dtype is None or self.k_scale is None or self.v_scale is None:
            # (the values written with the keys where they are a view of them, never on their own)
            write(self.k_cache, None if self.values_in_keys else self.v_cache, k, v, at=at)
            return
        # float8: a scale per row and head, from the first tokens of an empty cache
        kq, ks = quantize(k, self.kv_dtype, None if start == 0 else self.k_scale)
        if self.values_in_keys:  # values and their scales the keys' own
            vq = vs = None
            v_cache = v_scale = None
        else:
            vq, vs = quantize(v, self.kv_dtype, None if start == 0 else self.v_scale)
            v_cache, v_scale = self.v_cache, self.v_scale
        write(self.k_cache, v_cache, kq, vq, at=at)
        if self.kv_dtype == torch.int8:
            write(self.k_scale, v_scale, ks, vs, at=at)
            return
        self.k_scale.copy_(ks)
        if v_scale is not None and vs is not None:
            v_scale.copy_(vs)

    def _scales(self) -> tuple[Tensor | None, Tensor | None]:
        """A quantized cache's scales as a view takes them, ``(B, Hkv, L, 1)`` (a float8
        cache's expanded along ``L``); None for a float cache."""
        if self.k_scale is None or self.v_scale is None:
            return None, None
        shape = (*self.k_cache.shape[:3], 1)
        return self.k_scale.expand(shape), self.v_scale.expand(shape)

    def view(self) -> CacheView:
        """The keys and values held and staged, as :func:`attnkit.attention` reads them where
        they lie: row ``b``'s first ``length`` (and staged) positions of the cache.

        The view reads the cache's buffers when a call runs, not a copy made now: tokens
        appended later leave what it reads as it was, while :meth:`keep` moves tokens into its
        positions and :meth:`rewind` or :meth:`reset` followed by new tokens write over them,
        which it then reads. Take a new view after those."""
        end = self.length + self._staged
        rows = ((0, end),) * self.k_cache.size(0)
        ks, vs = self._scales()
        return CacheView(self.k_cache, self.v_cache, rows, k_scale=ks, v_scale=vs, trusted=True)

    def stand_in(self, new_tokens: int) -> CacheView:
        """The view a call of ``new_tokens`` tokens will read once they are staged, without data
        (one zero, expanded): what ``explain()`` describes."""
        b, h, _, dk = self.k_cache.shape
        zero = self.k_cache.new_zeros(())
        end = self.length + new_tokens
        one = None
        if self.kv_dtype is not None:
            one = torch.ones((), device=zero.device).expand(b, h, end, 1)
        return CacheView(
            zero.expand(b, h, end, dk),
            zero.expand(b, h, end, self.v_cache.size(-1)),
            ((0, end),) * b,
            k_scale=one,
            v_scale=one,
        )

    def stage_call(self, q: Tensor, k: Tensor, v: Tensor | None, **call: object) -> CacheView:
        """:meth:`stage` ``k`` and ``v`` for the attention call of ``q`` and return the
        :meth:`view` that call reads: what a module does before its one
        :func:`attnkit.attention` call. The staged tokens lie past ``length``, where nothing reads
        them until :meth:`commit`, so a call that then fails leaves the cache as it was."""
        self._stage(k, v)
        return self.view()

    def commit(self) -> None:
        """Hold the tokens of the last :meth:`stage` (nothing happens if none are staged)."""
        self.length = self.length + self._staged
        self.position = self.position + self._staged
        self._staged = 0

    def rewind(self, length: int) -> None:
        """Forget every token from position ``length`` on, as if the calls that appended them had
        never run: what a multi-step call (a layer, a stack of layers) uses to undo its earlier
        steps when a later one fails. A ``length`` past the tokens held keeps them all."""
        length = check_int("length", length, minimum=0, saturate=True)
        self.position -= self.length - min(self.length, length)
        self.length = min(self.length, length)
        self._staged = 0

    def keep(self, indices: Tensor) -> None:
        """Keep only the tokens ``indices`` ``(B, Hkv, K)`` of each batch row and key/value head
        (positions from 0 to ``length - 1``, none twice in a row, in any order): they move to
        the first ``K`` positions, in time order, and ``length`` becomes ``K``. H2O and SnapKV
        evict this way (the inference guide builds both from :func:`attnkit.attention_stats`).

        ``K`` is the same for every row and head. Tokens staged and not committed are dropped.
        Everything is checked before anything moves: a refused call leaves the cache as it was.
        A call interrupted once the tokens began to move (a KeyboardInterrupt) moves them all and
        sets ``length`` before the interrupt goes on: the cache is as after the call, never
        its keys moved and its values not. Attention over the cache is then attention over
        exactly the kept tokens, and the next tokens are appended after them. Keys move as they
        are stored: a key rotated at its position (RoPE) keeps that rotation, and ``position``
        (the offset a module rotates new tokens by) still counts every token of the sequence,
        while ``length`` counts the kept ones.

        >>> cache = KVCache(batch_size=1, max_len=8, num_kv_heads=2, head_dim=1)
        >>> k = torch.arange(5.0).expand(1, 2, 5).unsqueeze(-1)  # tokens 0..4, their own value
        >>> _ = cache.update(k, k)
        >>> cache.keep(torch.tensor([[[4, 0, 2], [1, 3, 4]]]))  # per head, in any order
        >>> cache.length, cache.k_cache[0, :, :3, 0].tolist()
        (3, [[0.0, 2.0, 4.0], [1.0, 3.0, 4.0]])
        """
        b, h = self.k_cache.shape[:2]
        what = f"indices for this KVCache (B={b}, Hkv={h})"
        index = check_indices(indices, (b, h), self.length, what)
        # (float8 moved as its bytes: torch's gather has no float8 kernel; values that are a
        # view of the keys move with them, and would be moved twice on their own)
        stored = (self.k_cache,) if self.values_in_keys else (self.k_cache, self.v_cache)
        moved = [t.view(torch.uint8) if t.dtype in FLOAT8 else t for t in stored]
        if self.kv_dtype == torch.int8 and self.k_scale is not None and self.v_scale is not None:
            # a scale a token moves with it (once, where the values' are the keys')
            moved += [self.k_scale] if self.values_in_keys else [self.k_scale, self.v_scale]

        def held() -> None:
            self.length = index.size(-1)
            self._staged = 0

        compact_rows(moved, index, held)  # (an interrupt once it writes: it completes first)

    def reset(self) -> None:
        """Forget every token (the memory stays allocated)."""
        self.length = 0
        self.position = 0
        self._staged = 0

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> KVCache:
        """Move the keys and values to ``device`` and/or convert them to ``dtype``, in place;
        returns the cache. The tokens held stay held. A quantized cache (``kv_dtype``) keeps its
        storage: ``dtype`` is then the one keys and values are given and read in."""
        if dtype is not None:
            check_dtype(dtype)  # before anything moves
        stored = dtype if self.kv_dtype is None else None
        self.k_cache = self.k_cache.to(device=device, dtype=stored)
        if self.values_in_keys:  # still a view of the keys, not a copy beside them
            self.v_cache = self.k_cache[..., : self.v_cache.size(-1)]
        else:
            self.v_cache = self.v_cache.to(device=device, dtype=stored)
        if self.k_scale is not None and self.v_scale is not None:
            self.k_scale, self.v_scale = self.k_scale.to(device), self.v_scale.to(device)
            if self.values_in_keys:
                self.v_scale = self.k_scale
        self.dtype = self.k_cache.dtype if self.kv_dtype is None else (dtype or self.dtype)
        return self

    def __getstate__(self) -> dict[str, Any]:
        """What ``pickle``, ``copy`` and ``torch.save`` store: float8 keys and values as their
        bytes (torch cannot unpickle a float8 tensor), and of a ``values_in_keys`` cache the
        values' width instead of their view, which pickle would store as a copy beside the keys
        (later tokens' values would then be written where nothing reads them)."""
        state = pickled_state(self.__dict__)
        if self.values_in_keys:
            state["v_cache"] = self.v_cache.size(-1)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(unpickled_state(state))
        if self.values_in_keys:  # the values a view of the keys' first columns again
            self.v_cache = self.k_cache[..., : state["v_cache"]]

    def __repr__(self) -> str:
        b, h, _, dk = self.k_cache.shape
        return (
            f"KVCache(batch_size={b}, max_len={self.max_len}, num_kv_heads={h}, head_dim={dk}, "
            f"v_head_dim={self.v_cache.size(-1)}, length={self.length}, "
            f"dtype={self.dtype}, "
            + ("" if self.kv_dtype is None else f"kv_dtype={self.kv_dtype}, ")
            + ("values_in_keys=True, " if self.values_in_keys else "")
            + f"device={self.k_cache.device})"
        )
