"""MultiHeadAttention: project, call :func:`attnkit.attention` once, project back.

The module is batch-first and takes attnkit's one mask convention (bool, True = may attend). It
covers self- and cross-attention, key/value inputs of other feature sizes (``kdim``, ``vdim``),
per-head sizes other than ``d_model / num_heads`` (``head_dim``, ``v_head_dim``), grouped-query
and multi-query attention (``num_kv_heads``), rotary embeddings, a KV cache for decoding, and
``torch.nn.MultiheadAttention``'s extra keys (``add_bias_kv``, ``add_zero_attn``).

The fast path is the default: without ``need_weights`` (and outside
:func:`~attnkit.capture_attention`) no ``(Tq, Tk)`` weights exist, self-attention projects
``q, k, v`` with one GEMM, and the heads are strided views of that GEMM's output, so nothing is
copied between the projections and the fused attention kernel.

Shape letters: ``B`` batch, ``Tq`` queries, ``Tk`` new keys, ``S`` keys attended (``Tk`` plus the
cached ones), ``D`` d_model, ``Dkv`` the feature sizes of key and value inputs (``kdim``,
``vdim``), ``H`` query heads, ``Hkv`` key/value heads, ``Dh``/``Dhv`` per-head query-key and
value sizes.
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._base.checks import (
    check_bool,
    check_input,
    check_int,
    check_probability,
    present,
    shape_str,
)
from .._base.hints import torch_keywords
from .._base.shapes import Bool, Float, shape_checked
from ..attention import Backend, Explanation, attend, check_backend, explain
from ..caches.kv_cache import KVCache
from ..caches.paged import PagedKVCache
from ..caches.streaming import StreamingKVCache
from ..caches.view import CacheView
from ..masks import Mask
from ..scores import DistanceBias, ScoreTerm
from ._packing import split_packed
from ._shards import SequenceShards
from .capture import is_capturing, record
from .positional import rows_by_offset

__all__ = ["MultiHeadAttention"]

#: the caches a module decodes with
AnyCache = KVCache | PagedKVCache | StreamingKVCache


def _drop_staged(cache: AnyCache) -> None:
    """Forget the tokens a failed call staged in ``cache``, and nothing it held before: each
    cache's ``rewind`` to what it holds drops an uncommitted stage (and a streaming cache's puts
    back the slot its step wrote over), so neither ``view()`` nor a later ``commit()`` sees
    them."""
    if isinstance(cache, PagedKVCache):
        cache.rewind(cache.lengths)
    elif isinstance(cache, StreamingKVCache):
        cache.rewind(cache.position)
    else:
        cache.rewind(cache.length)


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al., 2017), batch-first, on :func:`attnkit.attention`.

    Args:
        d_model: ``D``, the size of the queries and of the output.
        num_heads: ``H``, query heads.
        kdim, vdim: feature sizes of the key and value inputs (default ``D``), for cross-attention
            on a memory of another width.
        head_dim: ``Dh``, per-head size of queries and keys; default ``D / H`` (which must then be
            an integer).
        v_head_dim: ``Dhv``, per-head size of values; default ``Dh``. The output projection maps
            ``H * Dhv`` back to ``D``.
        num_kv_heads: ``Hkv``, key/value heads (default ``H``). ``H`` must be a multiple: each
            group of ``H / Hkv`` query heads shares one key/value head (grouped-query attention;
            ``Hkv = 1`` is multi-query attention). The key/value projections are ``Hkv`` heads wide.
        proj_bias: biases on the input and output projections (``forward``'s ``bias`` is the
            additive score bias, something else).
        dropout: dropout on the attention weights, in training only.
        add_bias_kv: a learned key and value (``bias_k`` ``(1, 1, Hkv*Dh)``, ``bias_v``
            ``(1, 1, Hkv*Dhv)``, in the projections' output space, as
            ``torch.nn.MultiheadAttention``'s): one extra token that every query sees, whatever
            ``mask``, ``bias``, ``causal`` or the cache say, and that ``rotary`` does not turn
            (it has no position).
        add_zero_attn: a key of zeros with a value of zeros that every query sees (torch's
            ``add_zero_attn``): a score of 0 in every row's softmax, so no row is ever empty and
            its weights on the other keys sum to less than 1. It is an attention sink of logit 0
            (:func:`attnkit.attention`'s ``sinks``).
        rotary: a module that rotates ``(B, heads, T, Dh)`` queries and keys for their positions,
            called as ``rotary(x, offset=n)``: :class:`~attnkit.RotaryEmbedding`. With a cache,
            ``n`` is the number of tokens already cached.
        backend: passed to :func:`attnkit.attention`: ``"auto"`` (the fastest that fits), the
            name of a registered backend (registered before the module is built: a misspelt name
            fails here, not at the first call) or an :class:`attnkit.Backend`.
        device, dtype: of the parameters.

    Parameters follow ``torch.nn.MultiheadAttention``'s names: ``in_proj_weight`` packs the query,
    key and value projections (``H*Dh + Hkv*Dh + Hkv*Dhv`` rows) when ``kdim == vdim == D``;
    otherwise they are ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``. ``in_proj_bias``
    is packed in both cases; ``out_proj`` is an ``nn.Linear``.

    ``forward(query, key=None, value=None, *, mask=None, bias=None, causal=False,
    need_weights=False, average_weights=True, cache=None)``:

    * ``query`` ``(B, Tq, D)``; ``key`` ``(B, Tk, kdim)`` defaults to ``query`` (self-attention);
      ``value`` ``(B, Tk, vdim)`` defaults to ``key``.
    * ``mask``: bool, broadcastable to ``(B, H, Tq, S)``, **True = may attend**, or a structured
      mask; e.g. :func:`attnkit.masks.key_padding` or :func:`attnkit.masks.padding_mask`
      ``(B, 1, 1, S)``. torch's ``attn_mask``/``key_padding_mask`` are the opposite (True = may
      NOT attend): ``mask, bias = attnkit.interop.torch.from_torch_masks(attn_mask,
      key_padding_mask, num_heads=H)`` converts them. ``bias``: float, added to the scaled
      scores, broadcastable likewise (:func:`~attnkit.alibi_bias`).
    * ``causal``: query ``i`` attends keys ``j <= i + S - Tq`` (bottom-right, as a cache needs).
    * ``cache``: a :class:`~attnkit.KVCache` (:meth:`make_cache`); the new keys and values are
      appended to it and the queries attend every cached key. They are held only once the call
      succeeded: a call that raises (a mask that does not fit, ``causal=1``...) leaves the cache
      as it was, so it can be retried.
    * Returns the output ``(B, Tq, D)``; with ``need_weights=True``, ``(output, weights)`` with the
      weights averaged over heads ``(B, Tq, S)``, or per head ``(B, H, Tq, S)`` with
      ``average_weights=False``. Weights are taken before dropout. With ``add_bias_kv`` and
      ``add_zero_attn`` the weights have a column more for each, after the keys: the learned
      token's, then the zero key's (torch's order), and each row sums to 1 over all of them.

    >>> mha = MultiHeadAttention(64, 8, num_kv_heads=2)       # grouped-query: 2 key/value heads
    >>> x = torch.randn(2, 10, 64)
    >>> mha(x, causal=True).shape
    torch.Size([2, 10, 64])
    >>> memory = torch.randn(2, 7, 64)                        # cross-attention, Tq != Tk
    >>> out, w = mha(x, memory, need_weights=True)
    >>> w.shape, bool(torch.allclose(w.sum(-1), torch.ones(2, 10)))
    (torch.Size([2, 10, 7]), True)
    """

    in_proj_weight: nn.Parameter | None
    q_proj_weight: nn.Parameter | None
    k_proj_weight: nn.Parameter | None
    v_proj_weight: nn.Parameter | None
    in_proj_bias: nn.Parameter | None
    bias_k: nn.Parameter | None
    bias_v: nn.Parameter | None
    #: This rank's place in a sequence split across processes, set by
    #: :func:`attnkit.distributed.sequence_parallel`; ``None`` in one process.
    sequence_shards: SequenceShards | None = None

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        num_kv_heads: int | None = None,
        proj_bias: bool = True,
        dropout: float = 0.0,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        rotary: nn.Module | None = None,
        backend: str | Backend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_model = check_int("d_model", d_model)
        self.num_heads = check_int("num_heads", num_heads)
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(
                    f"d_model ({d_model}) is not divisible by num_heads ({num_heads}); pass "
                    "head_dim= to choose the per-head size"
                )
            head_dim = d_model // num_heads
        self.head_dim = check_int("head_dim", head_dim)
        self.v_head_dim = (
            self.head_dim if v_head_dim is None else check_int("v_head_dim", v_head_dim)
        )
        self.num_kv_heads = (
            self.num_heads if num_kv_heads is None else check_int("num_kv_heads", num_kv_heads)
        )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) is not divisible by num_kv_heads ({num_kv_heads})"
            )
        self.kdim = self.d_model if kdim is None else check_int("kdim", kdim)
        self.vdim = self.d_model if vdim is None else check_int("vdim", vdim)
        proj_bias = check_bool("proj_bias", proj_bias)
        self.dropout = check_probability("dropout", dropout)
        add_bias_kv = check_bool("add_bias_kv", add_bias_kv)
        self.add_zero_attn = check_bool("add_zero_attn", add_zero_attn)
        if rotary is not None and not isinstance(rotary, nn.Module):
            raise TypeError(f"rotary must be an nn.Module or None, got {type(rotary).__name__}")
        rotary_dim = getattr(rotary, "head_dim", self.head_dim)
        if rotary_dim != self.head_dim:
            raise ValueError(
                f"rotary.head_dim ({rotary_dim}) must equal the head_dim of the queries and keys "
                f"({self.head_dim})"
            )
        self.rotary = rotary
        self.backend = check_backend(backend)

        def empty(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))

        self._sizes = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.v_head_dim,
        )
        nq, nk, nv = self._sizes
        if self.kdim == self.d_model and self.vdim == self.d_model:
            self.in_proj_weight = empty(nq + nk + nv, d_model)
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.register_parameter("in_proj_weight", None)
            self.q_proj_weight = empty(nq, d_model)
            self.k_proj_weight = empty(nk, self.kdim)
            self.v_proj_weight = empty(nv, self.vdim)
        if proj_bias:
            self.in_proj_bias = empty(nq + nk + nv)
        else:
            self.register_parameter("in_proj_bias", None)
        if add_bias_kv:
            self.bias_k = empty(1, 1, nk)
            self.bias_v = empty(1, 1, nv)
        else:
            self.register_parameter("bias_k", None)
            self.register_parameter("bias_v", None)
        self.out_proj = nn.Linear(
            self.num_heads * self.v_head_dim, d_model, bias=proj_bias, device=device, dtype=dtype
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections (each of q, k, v on its own fan), zero biases;
        Xavier-normal ``bias_k`` and ``bias_v``, as torch initialises them."""
        for w in self.in_weights():
            nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
        if self.bias_k is not None and self.bias_v is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)
        self.out_proj.reset_parameters()
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)

    def in_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """The query, key and value projection weights (views into ``in_proj_weight`` if packed)."""
        if self.in_proj_weight is not None:
            wq, wk, wv = self.in_proj_weight.split(self._sizes)
            return wq, wk, wv
        return (
            present(self.q_proj_weight, "q_proj_weight"),
            present(self.k_proj_weight, "k_proj_weight"),
            present(self.v_proj_weight, "v_proj_weight"),
        )

    def _in_biases(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        if self.in_proj_bias is None:
            return None, None, None
        bq, bk, bv = self.in_proj_bias.split(self._sizes)
        return bq, bk, bv

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(B, Tq, H*Dh)``, ``(B, Tk, Hkv*Dh)``, ``(B, Tk, Hkv*Dhv)`` in as few GEMMs as fit."""
        w, b = self.in_proj_weight, self.in_proj_bias
        if w is not None and key is query and value is query:
            # Self-attention: one GEMM, and q, k, v are column slices of its output (no copies).
            q, k, v = split_packed(F.linear(query, w, b), self._sizes)
            return q, k, v
        (wq, wk, wv), (bq, bk, bv) = self.in_weights(), self._in_biases()
        if w is not None and value is key:
            # Cross-attention on one memory: keys and values in one GEMM.
            nq = self._sizes[0]
            k, v = split_packed(
                F.linear(key, w[nq:], None if b is None else b[nq:]), self._sizes[1:]
            )
            return F.linear(query, wq, bq), k, v
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def _extra_tokens(
        self, q: Tensor, out: Tensor, weights: Tensor | None, lse: Tensor, dropout_p: float
    ) -> tuple[Tensor, Tensor | None]:
        """The call's output with the learned token (``add_bias_kv``) merged in, and its weights
        with the columns of the learned token and the zero key (``add_zero_attn``) appended.

        ``out`` ``(B, H, Tq, Dhv)``, ``weights`` ``(B, H, Tq, S)`` and ``lse`` ``(B, H, Tq)`` are
        the attention over the keys (and the zero key, as a sink). One more token is one more
        term of the softmax: with ``total = logaddexp(lse, s)`` for its score ``s``, the keys'
        share is ``exp(lse - total)`` and the token's ``exp(s - total)``. That is exact and
        differentiable, and unlike appending the token to k and v it copies no keys and leaves
        the mask, the causal alignment and the cache as they are.
        """
        f = lse.dtype  # float32 for float16/bfloat16 inputs
        total = lse
        columns = []
        if self.bias_k is not None and self.bias_v is not None:
            # (1, 1, Hkv*Dh) -> (H, Dh): query head h uses key/value head h // (H / Hkv).
            g = self.num_heads // self.num_kv_heads
            bk = self.bias_k.view(self.num_kv_heads, self.head_dim).repeat_interleave(g, 0)
            bv = self.bias_v.view(self.num_kv_heads, self.v_head_dim).repeat_interleave(g, 0)
            score = torch.einsum("bhtd,hd->bht", q.to(f), bk.to(f)) / math.sqrt(self.head_dim)
            total = torch.logaddexp(lse, score)  # (B, H, Tq)
            # A query that sees no key has lse = -inf: the keys' share is 0, not NaN.
            share = (lse - total).exp()
            token = (score - total).exp()
            columns.append(token)  # weights are taken before dropout
            if dropout_p:
                # The token's weight is dropped as torch drops it; attention() dropped the keys'.
                token = F.dropout(token, dropout_p)
            out = (share.unsqueeze(-1) * out.to(f) + token.unsqueeze(-1) * bv.to(f)[:, None, :]).to(
                out.dtype
            )
            if weights is not None:
                weights = weights * share.unsqueeze(-1).to(weights.dtype)
        if self.add_zero_attn:
            columns.append((-total).exp())  # the sink's share: exp(0 - total)
        if weights is not None:
            weights = torch.cat(
                [weights, *(c.unsqueeze(-1).to(weights.dtype) for c in columns)], -1
            )
        return out, weights

    def _rotated(self, x: Tensor, offset: int | Tensor) -> Tensor:
        """``rotary(x, offset=offset)``, which must keep ``x``'s shape and dtype (the attention
        call takes the result as this module's own, unchecked)."""
        out = self.rotary(x, offset=offset)  # type: ignore[misc]
        if not isinstance(out, Tensor) or out.shape != x.shape or out.dtype != x.dtype:
            got = f"{shape_str(out.shape)} {out.dtype}" if isinstance(out, Tensor) else type(out)
            raise ValueError(
                f"rotary must return a tensor of its input's shape and dtype, "
                f"{shape_str(x.shape)} {x.dtype}, got {got}"
            )
        return out

    def _rotated_shard(self, x: Tensor, shards: SequenceShards) -> Tensor:
        """``x`` rotated at the whole sequence's positions: each run of positions this rank holds
        from its own first position (a zigzag shard holds two runs)."""
        pieces = [
            self._rotated(x[..., lo : lo + n, :], start)
            for lo, start, n in shards.segments(x.size(-2))
        ]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2)

    def _check_sharded(self, bias: object, need_weights: bool, cache: object) -> None:
        """What a call on one rank's shard of a sequence cannot do, refused with the reason."""
        if isinstance(bias, Tensor):
            raise ValueError(
                f"bias: a dense bias {shape_str(bias.shape)} would need the whole sequence's rows "
                "of scores on every rank; give it as a score term at the whole sequence's "
                "positions (attnkit.scores.DistanceBias, attnkit.alibi_term)"
            )
        if need_weights or is_capturing(self):
            raise ValueError(
                "no attention weights from a sequence split across processes: they would be the "
                "whole sequence's (Tq, Tk) matrix on every rank"
            )
        if cache is not None:
            raise ValueError(
                "a KV cache decodes one sequence in one process; this module runs on a shard of "
                "the sequence (sequence_parallel): decode with a copy made before it"
            )

    def _check_paged(self, bias: object, need_weights: bool) -> None:
        """What a call on a :class:`~attnkit.PagedKVCache` cannot be, refused before the cache is
        written: each row has its own keys, read from its pages where they lie."""
        if getattr(self, "sequence_shards", None) is not None:
            raise ValueError(
                "a PagedKVCache decodes whole sequences in one process; this module runs on a "
                "shard of the sequence"
            )
        if need_weights or is_capturing(self):
            raise ValueError(
                "no attention weights from a PagedKVCache call: each row has its own keys, read "
                "from its pages where they lie"
            )
        if self.training and self.dropout:
            raise ValueError(
                "a PagedKVCache call is inference: call module.eval() (dropout is "
                f"{self.dropout} in training)"
            )
        if bias is not None and not isinstance(bias, DistanceBias):
            raise TypeError(
                "bias: a PagedKVCache call takes a bias by distance (DistanceBias, "
                f"attnkit.alibi_term), got {type(bias).__name__}"
            )

    @staticmethod
    def _offsets(cache: AnyCache | None, rows: int) -> list[int] | Tensor:
        """The position of each row's first new token: the tokens its cache took (those it let
        go included); a tensor of them for a paged cache, whose rows each sit at their own."""
        if cache is None:
            return [0] * rows
        if isinstance(cache, PagedKVCache):
            return cache.next_positions()  # (made between graphs under torch.compile)
        return [cache.position] * rows

    def _rotated_rows(self, x: Tensor, offsets: list[int] | Tensor) -> Tensor:
        """``x`` ``(B, heads, T, Dh)`` with row ``b`` rotated from position ``offsets[b]``."""
        if isinstance(offsets, Tensor):
            if getattr(self.rotary, "per_row_offsets", False):
                return self._rotated(x, offsets)
            offsets = [int(o) for o in offsets.tolist()]  # a rotary of ints only
        # (comparisons, not a set: a compiled step's offset is a symbolic size, which a set would
        # make a constant, and so a new graph at every step)
        if offsets and all(o == offsets[0] for o in offsets):
            return self._rotated(x, offsets[0])
        out = torch.empty_like(x)
        for offset, group in rows_by_offset(offsets):
            rows = torch.tensor(group, device=x.device)
            out[rows] = self._rotated(x[rows], offset)
        return out

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        params = self.out_proj.weight
        check_input("query", query, f"(B, Tq, d_model={self.d_model})", self.d_model, params)
        for name, t, dim, attr in (
            ("key", key, self.kdim, "kdim"),
            ("value", value, self.vdim, "vdim"),
        ):
            if t is query and dim == self.d_model:  # self-attention: checked just above
                continue
            if t is key and name == "value" and dim == self.kdim:  # one memory: checked as key
                continue
            shape = f"(B={query.size(0)}, Tk, {attr}={dim})"
            check_input(name, t, shape, dim, params)
            if t.size(0) != query.size(0):
                raise ValueError(f"{name} must have shape {shape}, got {shape_str(t.shape)}")
        if key.size(1) != value.size(1):
            raise ValueError(
                f"key and value must have the same length Tk, got key {shape_str(key.shape)} and "
                f"value {shape_str(value.shape)}"
            )

    def _stage(
        self,
        cache: AnyCache,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | Mask | None,
        bias: Tensor | ScoreTerm | None,
        causal: bool,
        sinks: Tensor | None,
        want_weights: bool,
    ) -> tuple[Tensor | CacheView, Tensor | None, Tensor | Mask | None]:
        """The new ``k`` and ``v`` staged in ``cache``, held only once :meth:`forward`'s call
        succeeded; the keys, values (None: in the keys' view) and mask the call attends."""
        if isinstance(cache, StreamingKVCache):
            # The held tokens and the new ones, with the mask of the sinks and the window.
            return cache.stage_call(q, k, v, mask=mask, bias=bias, need_weights=want_weights)
        # The cache checks what it must refuse before it writes, then stages the new keys past
        # what it holds, invisible until the commit: a call attention() refuses leaves the cache
        # as it was. The call reads the cache's keys where they lie.
        view = cache.stage_call(q, k, v, mask=mask, causal=causal, bias=bias, sinks=sinks)
        return view, None, mask

    def _attend(
        self,
        q: Tensor,
        k: Tensor | CacheView,
        v: Tensor | None,
        mask: Tensor | Mask | None,
        bias: Tensor | ScoreTerm | None,
        causal: bool,
        sinks: Tensor | None,
        dropout_p: float,
        want_weights: bool,
        shards: SequenceShards | None,
    ) -> tuple[Tensor, Tensor | None]:
        """The one attention call, on this rank's shard of the sequence or on the whole, with
        the extra tokens merged in: the output ``(B, H, Tq, Dhv)`` and the weights (None unless
        ``want_weights``). q, k, v and the settings are this module's, built from what it checked
        and when it was built: attend() checks only the caller's mask, bias and causal, once.
        ``k`` is the cache's view (and ``v`` None) for a call on a cache."""
        # The log-sum-exp merges the learned token in, and scales the weights to make room for
        # the extra tokens' columns.
        want_lse = self.bias_k is not None or (want_weights and self.add_zero_attn)
        got: Tensor | tuple[Tensor, ...]
        if shards is not None:
            if isinstance(k, CacheView) or v is None:
                raise ValueError("a module on a shard of the sequence attends no cache")
            got = shards.attention(
                q,
                k,
                v,
                mask=mask,
                bias=bias if isinstance(bias, ScoreTerm) else None,
                causal=causal,
                scale=None,
                sinks=sinks,
                dropout_p=dropout_p,
                return_lse=want_lse,
            )
        else:
            got = attend(
                q,
                k,
                v,
                mask=mask,
                bias=bias,
                causal=causal,
                sinks=sinks,
                dropout_p=dropout_p,
                return_weights=want_weights,
                return_lse=want_lse,
                backend=self.backend,
            )
        parts = [got] if isinstance(got, Tensor) else list(got)
        out, weights = parts[0], (parts[1] if want_weights else None)
        if want_lse:
            out, weights = self._extra_tokens(q, out, weights, parts[-1], dropout_p)
        return out, weights

    @overload
    def forward(
        self,
        query: Float[Tensor, "B Tq D"],
        key: Float[Tensor, "B Tk Dk"] | None = None,
        value: Float[Tensor, "B Tk Dv"] | None = None,
        *,
        mask: Bool[Tensor, "..."] | Mask | None = None,
        bias: Float[Tensor, "..."] | ScoreTerm | None = None,
        causal: bool = False,
        need_weights: Literal[False] = False,
        average_weights: bool = True,
        cache: AnyCache | None = None,
    ) -> Float[Tensor, "B Tq D"]: ...

    @overload
    def forward(
        self,
        query: Float[Tensor, "B Tq D"],
        key: Float[Tensor, "B Tk Dk"] | None = None,
        value: Float[Tensor, "B Tk Dv"] | None = None,
        *,
        mask: Bool[Tensor, "..."] | Mask | None = None,
        bias: Float[Tensor, "..."] | ScoreTerm | None = None,
        causal: bool = False,
        need_weights: Literal[True],
        average_weights: bool = True,
        cache: AnyCache | None = None,
    ) -> tuple[Float[Tensor, "B Tq D"], Float[Tensor, "B *h Tq S"]]: ...

    @torch_keywords
    @shape_checked
    def forward(
        self,
        query: Float[Tensor, "B Tq D"],
        key: Float[Tensor, "B Tk Dk"] | None = None,
        value: Float[Tensor, "B Tk Dv"] | None = None,
        *,
        mask: Bool[Tensor, "..."] | Mask | None = None,
        bias: Float[Tensor, "..."] | ScoreTerm | None = None,
        causal: bool = False,
        need_weights: bool = False,
        average_weights: bool = True,
        cache: AnyCache | None = None,
    ) -> Float[Tensor, "B Tq D"] | tuple[Float[Tensor, "B Tq D"], Float[Tensor, "B *h Tq S"]]:
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value)
        check_bool("need_weights", need_weights)
        check_bool("average_weights", average_weights)
        if cache is not None and not isinstance(cache, AnyCache):
            raise TypeError(
                "cache must be a KVCache, a PagedKVCache, a StreamingKVCache or None, got "
                f"{type(cache).__name__}"
            )

        q, k, v = self._project(query, key, value)
        # (B, T, heads*Dh) -> (B, heads, T, Dh): strided views; attention() takes them as they are.
        # (view, not unflatten: the same view without a Python frame; rows are contiguous)
        q = q.view(*q.shape[:-1], self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(*k.shape[:-1], self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(*v.shape[:-1], self.num_kv_heads, self.v_head_dim).transpose(1, 2)
        if isinstance(cache, PagedKVCache):
            self._check_paged(bias, need_weights)
        shards = self.sequence_shards
        if shards is not None:
            self._check_sharded(bias, need_weights, cache)
        if self.rotary is not None and shards is not None:
            q, k = self._rotated_shard(q, shards), self._rotated_shard(k, shards)
        elif self.rotary is not None:
            # Each row's new tokens sit after its own held ones: rows of one offset rotate together.
            offsets = self._offsets(cache, q.size(0))
            q, k = self._rotated_rows(q, offsets), self._rotated_rows(k, offsets)

        capturing = is_capturing(self)
        want_weights = need_weights or capturing
        dropout_p = self.dropout if self.training else 0.0
        # The zero key scores q . 0 = 0 and adds 0 to the output: exactly a sink of logit 0.
        sinks = q.new_zeros(self.num_heads) if self.add_zero_attn else None
        keys: Tensor | CacheView = k
        values: Tensor | None = v
        try:
            if cache is not None:
                keys, values, mask = self._stage(
                    cache, q, k, v, mask, bias, causal, sinks, want_weights
                )
            out, weights = self._attend(
                q, keys, values, mask, bias, causal, sinks, dropout_p, want_weights, shards
            )
            if capturing:
                record(self, present(weights, "weights"))
            # (B, H, Tq, Dhv) -> (B, Tq, H*Dhv): a free view when the kernel laid its output out
            # as (B, Tq, H, Dhv), which torch's fused CPU kernel does; a copy otherwise.
            result: Tensor = self.out_proj(out.transpose(1, 2).flatten(2))
            if cache is not None:
                cache.commit()  # (a streaming cache's chunk writes here: an interrupt may land)
        except BaseException:
            # A call that fails after its tokens were staged (in attention(), in out_proj, in a
            # hook, in the commit) leaves the cache as it was, as a call the cache refuses does.
            if cache is not None:
                _drop_staged(cache)
            raise
        if not need_weights:
            return result
        weights = present(weights, "weights")
        return result, (weights.mean(1) if average_weights else weights)

    def explain(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Tensor | Mask | None = None,
        bias: Tensor | ScoreTerm | None = None,
        causal: bool = False,
        need_weights: bool = False,
        cache: AnyCache | None = None,
    ) -> Explanation:
        """Which backend ``self(query, key, value, ...)`` would run its attention on, and why:
        :func:`attnkit.explain` for the call the module makes. Runs nothing (no projection, no
        cache write).

        >>> mha = MultiHeadAttention(64, 8)
        >>> x = torch.randn(2, 40, 64)
        >>> with torch.no_grad():  # small inference (longer calls and training: the native kernel)
        ...     print(mha.explain(x, causal=True))  # doctest: +ELLIPSIS
        attention call: q (2, 8, 40, 8), k (2, 8, 40, 8), v (2, 8, 40, 8) float32 on cpu, causal
        auto picks: sdpa
        ...
        """
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value)
        b, tq, tk = query.size(0), query.size(1), key.size(1)
        ref = self.out_proj.weight

        # Tensors of the call's shapes that hold nothing (stride 0); they need gradients when the
        # module's call would.
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, *self.parameters()))

        def shaped(heads: int, t: int, d: int) -> Tensor:
            # zeros, not empty: explain() reads whether q, k and v are finite when the call
            # needs gradients, and uninitialised memory may hold NaN.
            base = torch.zeros((), dtype=ref.dtype, device=ref.device, requires_grad=grad)
            return base.expand(b, heads, t, d)

        weights = need_weights or is_capturing(self)
        keys: Tensor | CacheView = shaped(self.num_kv_heads, tk, self.head_dim)
        values: Tensor | None = shaped(self.num_kv_heads, tk, self.v_head_dim)
        if isinstance(cache, StreamingKVCache):  # its held tokens and window, with its mask
            keys, values, mask = cache.stand_in(tk, mask=mask, bias=bias, need_weights=weights)
        elif cache is not None:  # the cache's keys where the call will read them, as stand-ins
            keys, values = cache.stand_in(tk), None
        return explain(
            shaped(self.num_heads, tq, self.head_dim),
            keys,
            values,
            mask=mask,
            bias=bias,
            causal=causal,
            sinks=(
                torch.zeros(self.num_heads, dtype=ref.dtype, device=ref.device)
                if self.add_zero_attn
                else None
            ),
            dropout_p=self.dropout if self.training else 0.0,
            return_weights=weights,
            return_lse=self.bias_k is not None or (weights and self.add_zero_attn),
            backend=self.backend,
        )

    def make_cache(
        self, batch_size: int, max_len: int, *, kv_dtype: torch.dtype | None = None
    ) -> KVCache:
        """An empty :class:`~attnkit.KVCache` for this module: ``Hkv`` heads of ``Dh``/``Dhv``, in
        the parameters' dtype and on their device, for ``batch_size`` sequences of up to
        ``max_len`` tokens; ``kv_dtype`` (``torch.int8``, ``torch.float8_e4m3fn``,
        ``torch.float8_e5m2``) stores them quantized, as :class:`~attnkit.KVCache` says."""
        w = self.in_weights()[1]
        return KVCache(
            batch_size,
            max_len,
            self.num_kv_heads,
            self.head_dim,
            self.v_head_dim,
            dtype=w.dtype,
            device=w.device,
            kv_dtype=kv_dtype,
        )

    def make_paged_cache(
        self,
        num_blocks: int,
        page_size: int,
        *,
        max_seqs: int,
        max_pages_per_seq: int | None = None,
        layout: Literal["flash", "vllm"] = "flash",
        kv_dtype: torch.dtype | None = None,
    ) -> PagedKVCache:
        """An empty :class:`~attnkit.PagedKVCache` for this module: a pool of ``num_blocks``
        pages of ``page_size`` tokens of ``Hkv`` heads of ``Dh``/``Dhv``, in the parameters' dtype
        and on their device, for ``max_seqs`` sequences (the batch rows of every call);
        ``kv_dtype`` stores them quantized, as :class:`~attnkit.PagedKVCache` says."""
        w = self.in_weights()[1]
        return PagedKVCache(
            num_blocks,
            page_size,
            self.num_kv_heads,
            self.head_dim,
            self.v_head_dim,
            max_seqs=max_seqs,
            max_pages_per_seq=max_pages_per_seq,
            layout=layout,
            dtype=w.dtype,
            device=w.device,
            kv_dtype=kv_dtype,
        )

    def extra_repr(self) -> str:
        parts = [f"d_model={self.d_model}", f"num_heads={self.num_heads}"]
        if self.num_kv_heads != self.num_heads:
            parts.append(f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim * self.num_heads != self.d_model:
            parts.append(f"head_dim={self.head_dim}")
        if self.v_head_dim != self.head_dim:
            parts.append(f"v_head_dim={self.v_head_dim}")
        if self.kdim != self.d_model or self.vdim != self.d_model:
            parts.append(f"kdim={self.kdim}, vdim={self.vdim}")
        if self.in_proj_bias is None:
            parts.append("proj_bias=False")
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        if self.bias_k is not None:
            parts.append("add_bias_kv=True")
        if self.add_zero_attn:
            parts.append("add_zero_attn=True")
        if self.backend != "auto":
            parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)
