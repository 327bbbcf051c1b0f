"""MultiHeadLatentAttention: DeepSeek's multi-head latent attention (MLA), in its two forms.

Each token's keys and values come from one shared latent ``c`` of ``R = kv_lora_rank`` numbers
(RMS-normalised) and one small rotary key ``k_rope`` of ``Dr = qk_rope_head_dim`` numbers shared by
every head (DeepSeek-V2, 2024, section 2.1). Head ``h`` sees::

    k_h = [W_uk[h] c, k_rope]       (Dn + Dr numbers: the "nope" part and the rotary part)
    v_h =  W_uv[h] c                (Dv numbers)
    q_h = [q_nope_h, q_rope_h]

where ``W_uk`` and ``W_uv`` are the two halves of ``kv_b_proj``. The same attention has two forms:

* **expanded** (prefill): ``k_h`` and ``v_h`` are computed for every key and head, and one
  :func:`attnkit.attention` call runs ``H`` heads with ``Dk = Dn + Dr`` and ``Dv``;
* **absorbed** (decoding): ``q_nope_h . W_uk[h] c = (W_uk[h]^T q_nope_h) . c``, so each query
  is moved into the latent's space instead of every key out of it, and the weighted sum of the
  ``v_h`` is ``W_uv[h]`` applied once to the weighted sum of the latents. Every head then reads
  the same ``R + Dr`` numbers per token: one multi-query call (``Hkv = 1``) with
  ``Dk = R + Dr`` and ``Dv = R``, whose values are the first ``R`` columns of its keys (a view of
  the cache, never a copy). A decode step reads ``R + Dr`` numbers per cached token instead of
  ``H (Dn + Dr + Dv)``.

The cache holds the latent form only, ``[c, k_rope]`` per token: 576 numbers a token for DeepSeek
V3's sizes, against 40,960 for its expanded keys and values. Three caches hold it:
:class:`LatentCache` (:meth:`MultiHeadLatentAttention.make_cache`), and a
:class:`~attnkit.KVCache` or a :class:`~attnkit.PagedKVCache` of one key/value head whose values
are its keys' first ``R`` columns (``values_in_keys=True``:
:meth:`MultiHeadLatentAttention.make_kv_cache`,
:meth:`MultiHeadLatentAttention.make_paged_cache`). On the last two a decode
step is one :func:`attnkit.attention` call on the cache's view, which the native kernel reads
where it lies (a paged cache's rows each at their own length), each latent row once for all
heads.

Shape letters: ``B`` batch, ``Tq`` new tokens, ``S`` keys attended (the cached ones and the new),
``L`` a cache's capacity, ``D`` d_model, ``H`` heads, ``R`` kv_lora_rank, ``Dn``
qk_nope_head_dim, ``Dr`` qk_rope_head_dim, ``Dv`` v_head_dim.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from .._base.checks import (
    check_bool,
    check_float_tensor,
    check_input,
    check_int,
    check_positive,
    check_probability,
    present,
    shape_str,
)
from .._base.shapes import Bool, Float, shape_checked
from ..attention import Backend, Explanation, attention, check_backend, explain
from ..caches.kv_cache import KVCache
from ..caches.paged import Layout, PagedKVCache
from ..caches.view import CacheView
from ..masks import Mask
from .positional import RotaryEmbedding, rows_by_offset

__all__ = ["DECODE_TOKENS", "LatentCache", "MultiHeadLatentAttention"]

#: ``form="auto"`` takes the absorbed form for a call with a cache and at most this many new
#: tokens. The absorbed form does ``2R + Dr`` multiply-adds per query, key and head against the
#: expanded form's ``Dn + Dr + Dv`` plus ``R (Dn + Dv)`` per key and head to expand the cache, so it
#: wins on arithmetic up to about ``R (Dn + Dv) / (2R - Dn - Dv)`` queries (170 at DeepSeek V3's
#: sizes); what makes it fast is that every head reads the one latent, which a kernel's decode
#: path does for a few queries at a time (attnkit's native kernel: up to 16).
DECODE_TOKENS = 16

_Form = Literal["auto", "expanded", "absorbed"]


def _latent_dtype(dtype: object) -> torch.dtype | None:
    """A :class:`LatentCache`'s dtype: None (torch's default) or float16, bfloat16, float32 or
    float64, the latents' own. In any other the latents held would be truncated (an integer
    dtype, bool) or rounded with no scale (float8), and the module's refused."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize > 1:
        return dtype
    got = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else repr(dtype)
    raise TypeError(
        "dtype must be torch.float16, torch.bfloat16, torch.float32 or torch.float64 (the dtype "
        f"the latents are given and read in), got {got}; a quantized latent cache is "
        "MultiHeadLatentAttention.make_kv_cache(..., kv_dtype=...)"
    )


class LatentCache:
    """The latents ``[c, k_rope]`` of the tokens decoded so far: ``(B, 1, L, R + Dr)``, one head.

    The keys of the absorbed form are the latents as they are, and its values their first ``R``
    columns: :meth:`stage` returns the ``(B, 1, S, R + Dr)`` keys, and :meth:`values` views
    their values, so the cache stores each token's ``R + Dr`` numbers once. Like
    :class:`~attnkit.KVCache` it is preallocated, for inference only, and holds what a call
    wrote only once :meth:`commit` says the call succeeded.

    >>> cache = LatentCache(batch_size=2, max_len=16, kv_lora_rank=8, rope_dim=4)
    >>> keys = cache.stage(torch.randn(2, 1, 5, 12))     # a 5-token prompt
    >>> cache.commit()
    >>> keys.shape, cache.values(keys).shape, cache.length
    (torch.Size([2, 1, 5, 12]), torch.Size([2, 1, 5, 8]), 5)
    """

    latent: Tensor

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        kv_lora_rank: int,
        rope_dim: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        b = check_int("batch_size", batch_size)
        self.max_len = check_int("max_len", max_len)
        self.kv_lora_rank = check_int("kv_lora_rank", kv_lora_rank)
        rope = check_int("rope_dim", rope_dim)
        width = self.kv_lora_rank + rope
        dtype = _latent_dtype(dtype)
        self.latent = torch.zeros(b, 1, self.max_len, width, dtype=dtype, device=device)
        self.length = 0  # tokens held; a Python int, so decoding never reads a tensor back
        self._staged = 0  # tokens written by stage() after `length` and not yet committed

    @shape_checked
    def stage(self, latent: Float[Tensor, "B 1 T W"]) -> Float[Tensor, "B 1 S W"]:
        """Write ``T`` new tokens' latents after the ``length`` held, without holding them yet;
        return a view of the ``S = length + T`` held and new. Every check runs before anything is
        written, so a call that raises leaves the cache as it was."""
        check_float_tensor("latent", latent)
        store = self.latent
        if latent.ndim == 4 and latent.size(0) != store.size(0):
            raise ValueError(
                f"this LatentCache holds a batch of {store.size(0)} sequences (batch_size="
                f"{store.size(0)}) but the call brings a batch of {latent.size(0)}: make a cache "
                f"with batch_size={latent.size(0)} for this batch (make_cache(batch_size=...))"
            )
        want = (store.size(0), 1, latent.size(-2) if latent.ndim == 4 else "T", store.size(3))
        if latent.ndim != 4 or tuple(latent.shape) != want:
            raise ValueError(
                f"latent must have shape (B, 1, T, kv_lora_rank + rope_dim) = {want} for this "
                f"cache, got {shape_str(latent.shape)}"
            )
        if latent.dtype != store.dtype or latent.device != store.device:
            kind, hint = latent.device.type, ""
            if (
                torch.amp.is_autocast_available(kind)  # (torch refuses to be asked about "meta")
                and torch.is_autocast_enabled(kind)
                and latent.dtype == torch.get_autocast_dtype(kind)
            ):
                # the module's float32 projections give latents in the autocast dtype
                hint = (
                    f": under torch.autocast the projections give {latent.dtype} latents; make "
                    f"the cache in it (cache.to(dtype={latent.dtype}))"
                )
            raise TypeError(
                f"latent must have the cache's dtype and device ({store.dtype} on {store.device}), "
                f"got {latent.dtype} on {latent.device}{hint}"
            )
        if torch.is_grad_enabled() and latent.requires_grad:
            raise ValueError(
                "LatentCache got latents that require grad: the cache is for inference, run "
                "decoding under torch.no_grad() or torch.inference_mode()"
            )
        start, new = self.length, latent.size(-2)
        if start + new > self.max_len:
            raise ValueError(
                f"latent cache overflow: {new} new tokens after the {start} cached exceed "
                f"max_len ({self.max_len}); make a larger cache or reset() it"
            )
        store.narrow(2, start, new).copy_(latent)
        self._staged = new
        return store.narrow(2, 0, start + new)

    def values(self, keys: Float[Tensor, "B 1 S W"]) -> Float[Tensor, "B 1 S R"]:
        """The absorbed form's values: the first ``R`` columns of ``keys``, a view."""
        return keys[..., : self.kv_lora_rank]

    def commit(self) -> None:
        """Hold the tokens of the last :meth:`stage` (nothing happens if none are staged)."""
        self.length += self._staged
        self._staged = 0

    def rewind(self, length: int) -> None:
        """Forget every token from position ``length`` on."""
        self.length = min(self.length, check_int("length", length, minimum=0))
        self._staged = 0

    def reset(self) -> None:
        """Forget every token (the memory stays allocated)."""
        self.length = 0
        self._staged = 0

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> LatentCache:
        """Move the latents to ``device`` and/or convert them to ``dtype``, in place; returns the
        cache. The tokens held stay held. ``dtype`` is a float dtype the latents are given and
        read in: float16, bfloat16, float32 or float64."""
        if dtype is not None:
            _latent_dtype(dtype)  # (before anything moves)
        self.latent = self.latent.to(device=device, dtype=dtype)
        return self

    def __repr__(self) -> str:
        b, _, _, width = self.latent.shape
        return (
            f"LatentCache(batch_size={b}, max_len={self.max_len}, "
            f"kv_lora_rank={self.kv_lora_rank}, rope_dim={width - self.kv_lora_rank}, "
            f"length={self.length}, dtype={self.latent.dtype}, device={self.latent.device})"
        )


#: the caches the module decodes with: the latents' own, or a KV cache holding them as one head
#: whose values are its keys' first ``R`` columns (``values_in_keys=True``)
_Cache = LatentCache | KVCache | PagedKVCache


def _drop_staged(cache: _Cache) -> None:
    """Forget the latents a failed call staged in ``cache``, and nothing it held before (each
    cache's ``rewind`` to what it holds drops an uncommitted stage)."""
    if isinstance(cache, PagedKVCache):
        cache.rewind(cache.lengths)
    else:
        cache.rewind(cache.length)


def _latent_cache_refusal(cache: object, r: int, dr: int) -> str | None:
    """Why ``cache`` cannot hold this module's latents (``R = r``, ``Dr = dr``), None if it can:
    a KV cache of one head of ``R + Dr`` numbers whose values are their first ``R``."""
    if isinstance(cache, KVCache):
        keys, values = cache.k_cache, cache.v_cache
        heads, dk, dv = keys.size(1), keys.size(-1), values.size(-1)
    elif isinstance(cache, PagedKVCache):
        keys, values = cache.token_major()
        heads, dk, dv = keys.size(2), keys.size(-1), values.size(-1)
    else:
        return None
    if not cache.values_in_keys or (heads, dk, dv) != (1, r + dr, r):
        return (
            f"a {type(cache).__name__} holds this module's latents as num_kv_heads=1, head_dim = "
            f"kv_lora_rank + qk_rope_head_dim = {r} + {dr}, v_head_dim = kv_lora_rank = {r} and "
            f"values_in_keys=True (make_kv_cache(), make_paged_cache()), got num_kv_heads="
            f"{heads}, head_dim={dk}, v_head_dim={dv}, values_in_keys={cache.values_in_keys}"
        )
    return None


def _offsets(cache: _Cache | None, rows: int) -> list[int] | Tensor:
    """The position of each row's first new token: where its rotary parts are rotated from (the
    tokens a cache took, those :meth:`KVCache.keep` let go included); a tensor of them for a
    paged cache, whose rows each sit at their own."""
    if isinstance(cache, PagedKVCache):
        return cache.next_positions()  # (made between graphs under torch.compile)
    if isinstance(cache, KVCache):
        return [cache.position] * rows
    return [0 if cache is None else cache.length] * rows


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), batch-first, on :func:`attnkit.attention`.

    Args:
        d_model: ``D``, the size of the input and of the output.
        num_heads: ``H``.
        kv_lora_rank: ``R``, the size of the shared latent ``c`` the keys and values come from.
        q_lora_rank: the queries' own low-rank step (``D -> q_lora_rank``, RMS-normalised, then
            up to the heads), as DeepSeek V2 and V3 have it; None (default) projects the queries
            from ``D`` directly (DeepSeek-V2-Lite).
        qk_nope_head_dim: ``Dn``, the per-head query/key size without position.
        qk_rope_head_dim: ``Dr``, the rotary part of each query and of the one shared rotary key.
        v_head_dim: ``Dv``, the per-head value size.
        proj_bias: biases on the down-projections ``q_a_proj`` and ``kv_a_proj`` and on
            ``out_proj`` (DeepSeek's ``attention_bias``). ``q_proj`` and the up-projections have
            none, as in DeepSeek's models; ``kv_b_proj``'s lack of one is what lets the absorbed
            form fold it into the query and the output.
        norm_eps: the RMS norms' epsilon.
        scale: multiplies ``q . k``; default ``1 / sqrt(Dn + Dr)`` in both forms (YaRN models
            scale it further).
        dropout: dropout on the attention weights, in training only.
        rotary: rotates the ``Dr`` rotary parts for their positions, called as
            ``rotary(x, offset=n)`` on ``(..., T, Dr)``; default
            :class:`~attnkit.RotaryEmbedding` ``(Dr)`` (the "rotate half" layout; a model trained
            with DeepSeek's interleaved pairs loads by permuting its weights, as
            :func:`attnkit.interop.deepseek.latent_attention` does).
        backend: passed to :func:`attnkit.attention`.
        device, dtype: of the parameters.

    ``forward(x, *, mask=None, causal=False, cache=None, form="auto")``:

    * ``x`` ``(B, Tq, D)``; returns ``(B, Tq, D)``.
    * ``mask``: bool, broadcastable to ``(B, H, Tq, S)``, **True = may attend**, or a structured
      mask (:func:`attnkit.masks.key_padding`, ...), as :class:`~attnkit.MultiHeadAttention`
      takes it; ``causal``: query ``i`` attends keys ``j <= i + S - Tq`` (bottom-right).
    * ``cache``: a :class:`LatentCache` (:meth:`make_cache`), or a :class:`~attnkit.KVCache`
      (:meth:`make_kv_cache`) or :class:`~attnkit.PagedKVCache` (:meth:`make_paged_cache`)
      holding the latents as one head whose values are its keys' first ``R`` columns: the new
      tokens' latents are appended and the queries attend every cached token; held once the
      call succeeded. The rotary parts are rotated at each row's position in the cache (a
      paged cache's rows each at their own; :meth:`PagedKVCache.schedule
      <attnkit.PagedKVCache.schedule>` says how many of a row's ``Tq`` are new). A paged
      cache takes the masks that are bands (``causal``, ``sliding_window``).
    * ``form``: ``"expanded"``, ``"absorbed"`` or ``"auto"``: absorbed for a call with a cache
      and at most :data:`DECODE_TOKENS` new tokens (a decode step), expanded otherwise (a
      prefill). The two compute the same attention.

    >>> mla = MultiHeadLatentAttention(64, 4, kv_lora_rank=32, qk_nope_head_dim=16,
    ...                                qk_rope_head_dim=8, v_head_dim=16)
    >>> x = torch.randn(2, 21, 64)
    >>> cache = mla.make_cache(batch_size=2, max_len=32)
    >>> with torch.no_grad():
    ...     prompt = mla(x[:, :20], causal=True, cache=cache)   # 20 tokens: expanded
    ...     step = mla(x[:, 20:], causal=True, cache=cache)     # 1 token: absorbed
    ...     whole = mla(x, causal=True)
    >>> bool(torch.allclose(step, whole[:, 20:], atol=1e-5)), cache.length
    (True, 21)
    """

    q_proj: nn.Linear | None
    q_a_proj: nn.Linear | None
    q_a_norm: nn.RMSNorm | None
    q_b_proj: nn.Linear | None

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        kv_lora_rank: int = 512,
        q_lora_rank: int | None = None,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        proj_bias: bool = False,
        norm_eps: float = 1e-6,
        scale: float | None = None,
        dropout: float = 0.0,
        rotary: nn.Module | None = None,
        backend: str | Backend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_model = check_int("d_model", d_model)
        self.num_heads = h = check_int("num_heads", num_heads)
        self.kv_lora_rank = r = check_int("kv_lora_rank", kv_lora_rank)
        self.q_lora_rank = None if q_lora_rank is None else check_int("q_lora_rank", q_lora_rank)
        self.qk_nope_head_dim = dn = check_int("qk_nope_head_dim", qk_nope_head_dim)
        self.qk_rope_head_dim = dr = check_int("qk_rope_head_dim", qk_rope_head_dim)
        self.v_head_dim = dv = check_int("v_head_dim", v_head_dim)
        bias = check_bool("proj_bias", proj_bias)
        eps = check_positive("norm_eps", norm_eps)
        self.scale = 1 / math.sqrt(dn + dr) if scale is None else check_positive("scale", scale)
        self.dropout = check_probability("dropout", dropout)
        if rotary is None:
            if dr % 2:
                raise ValueError(
                    f"qk_rope_head_dim ({dr}) must be even for the default rotary embedding, "
                    "which rotates pairs of its numbers; give rotary= for another"
                )
            rotary = RotaryEmbedding(dr)
        if not isinstance(rotary, nn.Module):
            raise TypeError(f"rotary must be an nn.Module or None, got {type(rotary).__name__}")
        rotary_dim = getattr(rotary, "head_dim", dr)
        if rotary_dim != dr:
            raise ValueError(f"rotary.head_dim ({rotary_dim}) must equal qk_rope_head_dim ({dr})")
        self.rotary = rotary
        self.backend = check_backend(backend)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        q_width = h * (dn + dr)
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, q_width, bias=False, **kw)
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(d_model, self.q_lora_rank, bias=bias, **kw)
            self.q_a_norm = nn.RMSNorm(self.q_lora_rank, eps=eps, **kw)
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_width, bias=False, **kw)
        self.kv_a_proj = nn.Linear(d_model, r + dr, bias=bias, **kw)
        self.kv_a_norm = nn.RMSNorm(r, eps=eps, **kw)
        self.kv_b_proj = nn.Linear(r, h * (dn + dv), bias=False, **kw)
        self.out_proj = nn.Linear(h * dv, d_model, bias=bias, **kw)

    def _rotated(self, x: Tensor, offsets: list[int] | Tensor) -> Tensor:
        """``x`` ``(B, heads, T, Dr)`` with row ``b`` rotated from position ``offsets[b]``: in
        one call from a tensor of them (a paged cache's rows each sit at their own), else rows
        of one offset together."""
        if isinstance(offsets, Tensor):
            if getattr(self.rotary, "per_row_offsets", False):
                by_row: Tensor = self.rotary(x, offset=offsets)
                return by_row
            offsets = [int(o) for o in offsets.tolist()]  # a rotary of ints only
        # (comparisons, not a set: a compiled step's offset is a symbolic size)
        first = offsets[0] if offsets else 0  # (a batch of no rows has no offsets)
        if all(o == first for o in offsets):
            rotated: Tensor = self.rotary(x, offset=first)
            return rotated
        out = torch.empty_like(x)
        for offset, group in rows_by_offset(offsets):
            rows = torch.tensor(group, device=x.device)
            out[rows] = self.rotary(x[rows], offset=offset)
        return out

    def _queries(self, x: Tensor, offsets: list[int] | Tensor) -> tuple[Tensor, Tensor]:
        """``(B, H, Tq, Dn)`` and the rotated ``(B, H, Tq, Dr)``."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:  # the queries' low-rank step
            down = present(self.q_a_proj, "q_a_proj")
            q = present(self.q_b_proj, "q_b_proj")(present(self.q_a_norm, "q_a_norm")(down(x)))
        b, t, _ = x.shape
        # (sizes spelled out, not -1: a call of no tokens or no rows has no size to infer)
        width = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = q.view(b, t, self.num_heads, width).transpose(1, 2)
        q_nope, q_rope = q.split((self.qk_nope_head_dim, self.qk_rope_head_dim), dim=-1)
        return q_nope, self._rotated(q_rope, offsets)

    def _latent(self, x: Tensor, offsets: list[int] | Tensor) -> Tensor:
        """The new tokens' ``[c, k_rope]`` ``(B, 1, Tq, R + Dr)``: c normalised, k_rope rotated."""
        c, k_rope = (
            self.kv_a_proj(x).unsqueeze(1).split((self.kv_lora_rank, self.qk_rope_head_dim), dim=-1)
        )
        return torch.cat((self.kv_a_norm(c), self._rotated(k_rope, offsets)), dim=-1)

    def _up(self) -> tuple[Tensor, Tensor]:
        """``W_uk`` ``(H, Dn, R)`` and ``W_uv`` ``(H, Dv, R)``: views of ``kv_b_proj.weight``."""
        w = self.kv_b_proj.weight.view(self.num_heads, -1, self.kv_lora_rank)
        w_uk, w_uv = w.split((self.qk_nope_head_dim, self.v_head_dim), dim=1)
        return w_uk, w_uv

    def _expanded(
        self, q_nope: Tensor, q_rope: Tensor, latent: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q ``(B, H, Tq, Dn + Dr)``, k ``(B, H, S, Dn + Dr)`` and v ``(B, H, S, Dv)``, every
        head's keys and values computed from the latents."""
        b, _, s, _ = latent.shape
        c, k_rope = latent.split((self.kv_lora_rank, self.qk_rope_head_dim), dim=-1)
        width = self.qk_nope_head_dim + self.v_head_dim
        kv = self.kv_b_proj(c.squeeze(1)).view(b, s, self.num_heads, width).transpose(1, 2)
        k_nope, v = kv.split((self.qk_nope_head_dim, self.v_head_dim), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, self.num_heads, -1, -1)), dim=-1)
        return torch.cat((q_nope, q_rope), dim=-1), k, v

    def _absorbed_query(self, q_nope: Tensor, q_rope: Tensor) -> Tensor:
        """``[W_uk[h]^T q_nope_h, q_rope_h]`` ``(B, H, Tq, R + Dr)``: the query in the latent's
        space, where its product with ``[c, k_rope]`` is the expanded form's ``q . k``."""
        w_uk, _ = self._up()
        # einsum multiplies head by head, (H, B*Tq, Dn) x (H, Dn, R): a broadcast matmul would
        # copy W_uk for every batch row
        return torch.cat((torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk), q_rope), dim=-1)

    def _form(self, form: object, tq: int, cache: _Cache | None) -> str:
        if form not in ("auto", "expanded", "absorbed"):
            raise ValueError(f'form must be "auto", "expanded" or "absorbed", got {form!r}')
        if form != "auto":
            return str(form)
        return "absorbed" if cache is not None and tq <= DECODE_TOKENS else "expanded"

    def _check(self, x: Tensor, cache: _Cache | None) -> None:
        check_input("x", x, f"(B, Tq, d_model={self.d_model})", self.d_model, self.kv_b_proj.weight)
        if cache is None:
            return
        if not isinstance(cache, LatentCache | KVCache | PagedKVCache):
            raise TypeError(
                "cache must be a LatentCache, a KVCache or a PagedKVCache holding the latents, or "
                f"None, got {type(cache).__name__}"
            )
        refusal = _latent_cache_refusal(cache, self.kv_lora_rank, self.qk_rope_head_dim)
        if refusal is not None:
            raise ValueError(refusal)
        if not isinstance(cache, LatentCache):
            return
        width = self.kv_lora_rank + self.qk_rope_head_dim
        if cache.kv_lora_rank != self.kv_lora_rank or cache.latent.size(-1) != width:
            raise ValueError(
                f"this module's latents are kv_lora_rank={self.kv_lora_rank} + "
                f"qk_rope_head_dim={self.qk_rope_head_dim} wide, the cache holds {cache!r}"
            )

    def _attend(
        self,
        q_nope: Tensor,
        q_rope: Tensor,
        keys: Tensor | CacheView,
        absorbed: bool,
        mask: Tensor | Mask | None,
        causal: bool,
        dropout_p: float,
    ) -> Tensor:
        """The one attention call ``(B, H, Tq, Dv)`` on the latents ``keys``: ``(B, 1, S, R +
        Dr)`` tensors, or a cache's view of them where they lie."""
        kw: dict[str, Any] = {
            "mask": mask,
            "causal": causal,
            "scale": self.scale,
            "dropout_p": dropout_p,
            "backend": self.backend,
        }
        if absorbed:
            q = self._absorbed_query(q_nope, q_rope)
            # V: the first R columns of the latents, a view of K (of the cache's memory); a view
            # of a cache carries it already.
            values = None if isinstance(keys, CacheView) else keys[..., : self.kv_lora_rank]
            out = attention(q, keys, values, **kw)  # (B, H, Tq, R)
            # (B, H, Tq, Dv): W_uv applied once, to the weighted sum of the latents
            return torch.einsum("bhtr,hvr->bhtv", out, self._up()[1])
        q = torch.cat((q_nope, q_rope), dim=-1)
        if isinstance(keys, Tensor):
            _, k, v = self._expanded(q_nope, q_rope, keys)
            return attention(q, k, v, **kw)  # type: ignore[no-any-return]
        # (a quantized cache's latents dequantized in the queries' dtype, not its float32 default)
        if keys.shared:  # every row the same keys: expanded from their latents as they are
            _, k, v = self._expanded(q_nope, q_rope, keys.dense(q.dtype)[0])
            return attention(q, k, v, **kw)  # type: ignore[no-any-return]
        # Rows of their own lengths (a paged cache): each row's latents expanded at its keys'
        # positions, attended as a view of the same rows and queries.
        latents = q.new_zeros(keys.rows, 1, keys.kv_len, keys.k.size(-1))
        for n, (start, end) in enumerate(keys.kv_range):
            latents[n, :, start:end] = keys.row(n, q.dtype)[0][0]
        _, k, v = self._expanded(q_nope, q_rope, latents)
        view = CacheView(k, v, keys.kv_range, None, keys.q_lens, trusted=True)
        return attention(q, view, None, **kw)  # type: ignore[no-any-return]

    def _stage(
        self,
        cache: _Cache,
        q_nope: Tensor,
        latent: Tensor,
        mask: Tensor | Mask | None,
        causal: bool,
    ) -> Tensor | CacheView:
        """The new tokens' latents written into ``cache`` past what it holds (held only once the
        call succeeded); what the call reads: the held and new latents, or a KV cache's view of
        them. A paged cache checks the call first, on a query of the latents' width."""
        if isinstance(cache, LatentCache):
            return cache.stage(latent)
        b, h, t, _ = q_nope.shape
        stand_in = q_nope.new_zeros(()).expand(b, h, t, latent.size(-1))
        return cache.stage_call(stand_in, latent, None, mask=mask, causal=causal, scale=self.scale)

    @shape_checked
    def forward(
        self,
        x: Float[Tensor, "B Tq D"],
        *,
        mask: Bool[Tensor, "..."] | Mask | None = None,
        causal: bool = False,
        cache: LatentCache | KVCache | PagedKVCache | None = None,
        form: _Form = "auto",
    ) -> Float[Tensor, "B Tq D"]:
        self._check(x, cache)
        absorbed = self._form(form, x.size(1), cache) == "absorbed"
        offsets = _offsets(cache, x.size(0))
        q_nope, q_rope = self._queries(x, offsets)
        latent = self._latent(x, offsets)
        keys: Tensor | CacheView = latent
        try:
            if cache is not None:
                # Written past the cache's length, held only once the call succeeded.
                keys = self._stage(cache, q_nope, latent, mask, causal)
            dropout_p = self.dropout if self.training else 0.0
            out = self._attend(q_nope, q_rope, keys, absorbed, mask, causal, dropout_p)
            result: Tensor = self.out_proj(out.transpose(1, 2).flatten(2))
        except BaseException:
            # A call that fails after its latents were staged (in attention(), in out_proj, in
            # a hook) leaves the cache as it was, as a call the cache refuses does.
            if cache is not None:
                _drop_staged(cache)
            raise
        if cache is not None:
            cache.commit()
        return result

    def explain(
        self,
        x: Tensor,
        *,
        mask: Tensor | Mask | None = None,
        causal: bool = False,
        cache: LatentCache | KVCache | PagedKVCache | None = None,
        form: _Form = "auto",
    ) -> Explanation:
        """Which backend ``self(x, ...)`` would run its attention call on, and why:
        :func:`attnkit.explain` for the call of the form the module would take. Runs nothing.

        >>> mla = MultiHeadLatentAttention(64, 4, kv_lora_rank=32, qk_nope_head_dim=16,
        ...                                qk_rope_head_dim=8, v_head_dim=16)
        >>> cache = mla.make_cache(batch_size=2, max_len=100)
        >>> print(mla.explain(torch.randn(2, 1, 64), cache=cache))  # doctest: +ELLIPSIS
        attention call: q (2, 4, 1, 40), k (2, 1, 1, 40), v (2, 1, 1, 32) float32 on cpu
        ...

        On a :class:`~attnkit.KVCache` or :class:`~attnkit.PagedKVCache` (:meth:`make_kv_cache`,
        :meth:`make_paged_cache`) a decode step's call reads the cache where it lies, and the
        explanation names that read.
        """
        self._check(x, cache)
        absorbed = self._form(form, x.size(1), cache) == "absorbed"
        b, tq = x.size(0), x.size(1)
        s = tq + (0 if cache is None else cache.length)
        ref = self.kv_b_proj.weight
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, *self.parameters()))

        def shaped(heads: int, t: int, d: int) -> Tensor:
            base = torch.zeros((), dtype=ref.dtype, device=ref.device, requires_grad=grad)
            return base.expand(b, heads, t, d)

        h, r, dr = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        dk = r + dr if absorbed else self.qk_nope_head_dim + dr
        dv = r if absorbed else self.v_head_dim
        keys: Tensor | CacheView = shaped(1 if absorbed else h, s, dk)
        values: Tensor | None = shaped(1 if absorbed else h, s, dv)
        if isinstance(cache, KVCache | PagedKVCache):
            view = cache.stand_in(tq)
            if absorbed:  # the cache's latents where the call reads them
                keys, values = view, None
            elif not view.shared:
                # rows of their own lengths: each row's keys expanded, read as a view of the rows
                # (as _attend calls it), not a dense call over the longest row's keys
                k, v = shaped(h, view.kv_len, dk), shaped(h, view.kv_len, dv)
                keys = CacheView(k, v, view.kv_range, None, view.q_lens, trusted=True)
                values = None
        return explain(
            shaped(h, tq, dk),
            keys,
            values,
            mask=mask,
            causal=causal,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self.backend,
        )

    def make_cache(self, batch_size: int, max_len: int) -> LatentCache:
        """An empty :class:`LatentCache` for this module, in the parameters' dtype and on their
        device, for ``batch_size`` sequences of up to ``max_len`` tokens."""
        w = self.kv_b_proj.weight
        return LatentCache(
            batch_size,
            max_len,
            self.kv_lora_rank,
            self.qk_rope_head_dim,
            dtype=w.dtype,
            device=w.device,
        )

    def make_kv_cache(
        self, batch_size: int, max_len: int, *, kv_dtype: torch.dtype | None = None
    ) -> KVCache:
        """An empty :class:`~attnkit.KVCache` holding this module's latents: one key/value head
        of ``R + Dr`` numbers a token, whose values are their first ``R`` (``values_in_keys=True``,
        stored once), in the parameters' dtype and on their device, for ``batch_size`` sequences
        of up to ``max_len`` tokens; ``kv_dtype`` (``torch.int8``, ``torch.float8_e4m3fn``,
        ``torch.float8_e5m2``) stores them quantized, the values read with the keys' scales. A
        decode step reads it where it lies, each latent row once for every head."""
        w = self.kv_b_proj.weight
        r = self.kv_lora_rank
        return KVCache(
            batch_size,
            max_len,
            1,
            r + self.qk_rope_head_dim,
            r,
            dtype=w.dtype,
            device=w.device,
            kv_dtype=kv_dtype,
            values_in_keys=True,
        )

    def make_paged_cache(
        self,
        num_blocks: int,
        page_size: int,
        *,
        max_seqs: int,
        max_pages_per_seq: int | None = None,
        layout: Layout = "flash",
        kv_dtype: torch.dtype | None = None,
    ) -> PagedKVCache:
        """An empty :class:`~attnkit.PagedKVCache` holding this module's latents: a pool of
        ``num_blocks`` pages of ``page_size`` tokens of one key/value head of ``R + Dr`` numbers,
        whose values are their first ``R`` (``values_in_keys=True``, stored once), in the
        parameters' dtype and on their device, for ``max_seqs`` sequences (the batch rows of
        every call); ``kv_dtype`` stores them quantized, as :meth:`make_kv_cache` says. Each
        row's rotary parts follow its own position in the cache."""
        w = self.kv_b_proj.weight
        r = self.kv_lora_rank
        return PagedKVCache(
            num_blocks,
            page_size,
            1,
            r + self.qk_rope_head_dim,
            r,
            max_seqs=max_seqs,
            max_pages_per_seq=max_pages_per_seq,
            layout=layout,
            dtype=w.dtype,
            device=w.device,
            kv_dtype=kv_dtype,
            values_in_keys=True,
        )

    def extra_repr(self) -> str:
        parts = [
            f"d_model={self.d_model}",
            f"num_heads={self.num_heads}",
            f"kv_lora_rank={self.kv_lora_rank}",
        ]
        if self.q_lora_rank is not None:
            parts.append(f"q_lora_rank={self.q_lora_rank}")
        parts.append(
            f"qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim={self.qk_rope_head_dim}, "
            f"v_head_dim={self.v_head_dim}"
        )
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        if self.backend != "auto":
            parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)
