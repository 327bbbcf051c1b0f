"""flash-attn's ``flash_attn_with_kvcache``: decoding with a preallocated or paged cache.

One call, in named steps: every argument is checked (:func:`_checked_rows`, and what
:func:`attnkit.attention` will check, on a stand-in of the cache's view without data) before the
new tokens are written, so a refused call leaves the cache as it was; then the new keys and queries
are rotated, written into the cache, and the queries attend each row's own keys in one
:func:`attnkit.attention` call on the cache's :class:`~attnkit.caches.view.CacheView`, where they
lie (``explain()`` shows it, ``record_dispatch()`` records it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .._base.checks import check_bool, dtype_str, shape_str
from .._call import AttentionCall, check_attention_args
from ..caches._quantize import FLOAT8, quantize_fp8
from ..caches._tokens import Spelling, check_tokens, write
from ..caches.view import CacheView
from ..masks import Mask
from ..scores import ScoreTerm
from ._alibi import alibi
from ._api import attend
from ._args import (
    band,
    band_mask,
    descaled_q,
    descales,
    four_d,
    host_ints,
    scale_of,
    sinks_of,
    softcap_of,
)
from ._paging import check_block_table, page_table, pages_used
from ._rotary import check_rotary, rotate

__all__ = ["flash_attn_with_kvcache"]

_Window = tuple[int | None, int | None]


# What each per-row argument's values decide, for the refusal of one on the meta device.
_DECIDES = {
    "cache_seqlens": "say how many keys each row holds and where the new ones are written",
    "cache_leftpad": "say where each row's keys start",
    "cache_batch_idx": "say which cache row each batch row reads and writes",
}


def _per_row(name: str, value: object, rows: int, default: int) -> list[int]:
    """An int, or a ``(rows,)`` integer tensor, as one int per row (one host read)."""
    if value is None:
        return [default] * rows
    if type(value) is int:
        return [value] * rows
    if (
        not isinstance(value, Tensor)
        or value.is_floating_point()
        or value.is_complex()
        or value.dtype == torch.bool
        or value.shape != (rows,)
    ):
        got = (
            f"{dtype_str(value.dtype)} of shape {shape_str(value.shape)}"
            if isinstance(value, Tensor)
            else repr(value)
        )
        raise ValueError(f"{name} must be an int or an integer tensor ({rows},), got {got}")
    return host_ints(name, value, _DECIDES[name])


def _check_cache(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """The cache's shapes against each other and against q's heads and head size."""
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache {shape_str(k_cache.shape)} and v_cache {shape_str(v_cache.shape)} must agree "
            "on all but the head size"
        )
    heads, kv_heads = q.size(2), k_cache.size(2)
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"q's nheads ({heads}) must be a multiple of the cache's nheads_k ({kv_heads}); got "
            f"q {shape_str(q.shape)}, k_cache {shape_str(k_cache.shape)}"
        )
    if q.size(3) != k_cache.size(3):
        raise ValueError(
            f"q's headdim ({q.size(3)}) must be k_cache's ({k_cache.size(3)}); got q "
            f"{shape_str(q.shape)}, k_cache {shape_str(k_cache.shape)}"
        )


def _attention_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention() takes a tensor of ``dtype`` in: under torch.autocast it casts
    float16, bfloat16 and float32 to autocast's dtype, and float64 stays (torch's SDPA rule)."""
    kind = device.type
    if (
        dtype in (torch.float16, torch.bfloat16, torch.float32)
        and torch.amp.is_autocast_available(kind)
        and torch.is_autocast_enabled(kind)
    ):
        return torch.get_autocast_dtype(kind)
    return dtype


def _stand_in(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A tensor of ``shape`` with ``t``'s device and the dtype attention() takes it in, and no
    data: one zero, expanded."""
    return torch.zeros((), dtype=_attention_dtype(t.dtype, t.device), device=t.device).expand(shape)


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    block_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    learnable_sink: Tensor | None = None,
    s_aux: Tensor | None = None,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """flash-attn's ``flash_attn_with_kvcache``: decoding with a preallocated (or paged) cache.

    With ``k`` and ``v`` the new keys and values are first written into ``k_cache``/``v_cache``
    **in place**, at positions ``cache_seqlens[b]``, ``cache_seqlens[b] + 1``, ... of row ``b``;
    the queries then attend the row's keys ``cache_leftpad[b] <= j < cache_seqlens[b] +
    seqlen_new``, aligned bottom-right to them.

    Args:
        q: ``(B, Tq, H, D)``.
        k_cache, v_cache: ``(B_cache, capacity, Hkv, D|Dv)``, or with ``block_table`` pages
            ``(blocks, page, Hkv, D|Dv)`` (any page size).
        k, v: ``(B, seqlen_new, Hkv, D|Dv)`` new keys and values, or None. Batch rows whose
            new tokens would go to one slot (a cache row named twice by ``cache_batch_idx``, a
            page two rows' block tables name where both write) are a ``ValueError``: flash-attn
            leaves the slot to whichever write lands last.
        rotary_cos, rotary_sin: ``(seqlen_ro, rotary_dim / 2)``: rotate the first ``rotary_dim``
            dims of ``k`` at its positions ``cache_seqlens[b] + t`` (the rows of the tables are
            indices into the cache row, ``cache_leftpad`` included, as flash-attn's kernel reads
            them), and of ``q`` at the same positions when ``causal`` or windowed (else all at
            ``cache_seqlens[b]``), pairs as ``rotary_interleaved`` says
            (True: dims ``(0, 1), (2, 3), ...``; False: ``(0, rotary_dim / 2), ...``, GPT-NeoX).
            Needs ``k`` and ``v``, as in flash-attn.
        cache_seqlens: an int or ``(B,)``: the tokens each row holds before this call (None: the
            whole capacity, and no ``k``/``v``).
        cache_batch_idx: ``(B,)``: the cache rows of the batch rows (default ``0..B-1``); not
            with ``block_table``, whose rows say that already (as in flash-attn).
        cache_leftpad: ``(B,)``: each row's keys start there (default 0).
        block_table: ``(B, max_blocks)``: the pages of each row, in order.
        num_splits: accepted, not needed.
        return_softmax_lse: also return ``softmax_lse`` ``(B, H, Tq)``.
        q_descale, k_descale, v_descale: flash-attn 3's float8 descale factors, ``(B, Hkv)``
            float tensors (None: 1), for a ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``
            cache: batch row ``b``'s keys are ``k_cache.float() * k_descale[b, h]`` (the values
            likewise), read in place (the native decode kernel dequantizes in registers). New
            ``k`` and ``v`` of the cache's dtype are written as they are; float ones are
            quantized first, ``k / k_descale`` rounded to the format (saturating). ``q`` may be
            float8 too, read as ``q.float() * q_descale`` in bfloat16 (flash-attn 3's output
            dtype for float8 inputs); a float ``q`` is multiplied by ``q_descale``. The pages a
            row reads take its factors (rows sharing a page with factors of their own each read
            it with theirs, folded into ``q`` and the output).
        others: as :func:`~attnkit.flash_attn.flash_attn_func`.

    Returns:
        ``out`` ``(B, Tq, H, Dv)``, or ``(out, softmax_lse)``.

    >>> import torch
    >>> k_cache, v_cache = torch.zeros(2, 16, 2, 8), torch.zeros(2, 16, 2, 8)
    >>> q, k, v = torch.randn(2, 1, 4, 8), torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
    >>> out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([3, 5]),
    ...                               causal=True)
    >>> out.shape, bool(k_cache[1, 5].eq(k[1, 0]).all())   # k was written at position 5 of row 1
    (torch.Size([2, 1, 4, 8]), True)
    """
    # Every check comes before the new tokens are written: a refused call leaves the cache as it
    # was, so the caller can fix the call and repeat it.
    q = four_d("q", q, "(batch, seqlen_q, nheads, headdim)")
    layout = (
        "(num_blocks, page_block_size, nheads_k, headdim)"
        if block_table is not None
        else ("(batch_cache, seqlen_cache, nheads_k, headdim)")
    )
    k_cache = four_d("k_cache", k_cache, layout)
    v_cache = four_d("v_cache", v_cache, layout)
    batch, q_len, heads = q.shape[:3]
    lo, hi = band(window_size, causal)
    want_lse = check_bool("return_softmax_lse", return_softmax_lse)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int (0: flash-attn's choice), got {num_splits!r}")
    check_bool("rotary_interleaved", rotary_interleaved)
    _check_cache(q, k_cache, v_cache)
    factors = descales(q, k_cache, v_cache, q_descale, k_descale, v_descale)
    given = q.dtype
    q = descaled_q(q, factors[0])
    cap = softcap_of(softcap)
    scale = scale_of(softmax_scale, q.dtype)
    sinks = sinks_of(learnable_sink, s_aux, q, heads)
    rows, k, v = _checked_rows(
        k_cache,
        v_cache,
        k,
        v,
        batch,
        cache_seqlens,
        cache_batch_idx,
        cache_leftpad,
        block_table,
        given,
    )
    if rotary_cos is not None or rotary_sin is not None:
        # flash-attn's rule: causal or windowed queries sit at their own positions.
        positional = causal or not (lo == -math.inf and hi == math.inf)
        q, k = _rotated(q, k, rows, rotary_cos, rotary_sin, rotary_interleaved, positional)
    view, fold = _view(k_cache, v_cache, rows, factors[1:])
    if fold is not None:  # rows sharing a page with factors of their own: k_descale into q
        q = descaled_q(q, fold[0])
    mask = band_mask(lo, hi, q_len, view.width)
    bias = None
    if alibi_slopes is not None:  # each row's call from its own alignment
        bias = alibi(alibi_slopes, heads, batch, q.dtype, q_len, view.width)
    _check_as_attention(q, view, mask, bias, scale, cap, sinks)

    if k is not None and v is not None and rows.new:
        _check_apart(rows, view.block_table, k_cache.size(1))
        new_k, new_v = _stored(k, v, k_cache.dtype, factors[1:])
        write(view.k, view.v, new_k, new_v, at=rows.seen, block_table=view.block_table)
    out, lse, _ = attend(
        q.transpose(1, 2),
        view,
        None,
        mask=mask,
        bias=bias,
        dropout_p=0.0,
        softmax_scale=scale,
        softcap=cap,
        sinks=sinks,
        want_lse=want_lse,
        want_probs=False,
    )
    if fold is not None:  # and v_descale into the output: sum_j w_j (d v_j) = d sum_j w_j v_j
        out = descaled_q(out, fold[1])
    return (out, lse) if want_lse and lse is not None else out


@dataclass(frozen=True)
class _Rows:
    """What the call does with each batch row ``b`` of the cache: ``seen[b]`` tokens held before
    the call, ``new`` written after them, so ``lengths[b]`` tokens attended from ``start[b]``
    (``cache_leftpad``) on; ``cache_rows``: the cache row of each batch row (None: row ``b``);
    ``table``: with a paged cache, its block table (int64, entries past a row's pages 0), and
    ``page`` its page size."""

    seen: list[int]
    start: list[int]
    new: int
    cache_rows: list[int] | None
    table: Tensor | None
    page: int

    @property
    def lengths(self) -> list[int]:
        return [s + self.new for s in self.seen]


def _checked_rows(
    k_cache: Tensor,
    v_cache: Tensor,
    k: object,
    v: object,
    batch: int,
    cache_seqlens: object,
    cache_batch_idx: object,
    cache_leftpad: object,
    block_table: object,
    q_dtype: torch.dtype,
) -> tuple[_Rows, Tensor | None, Tensor | None]:
    """The rows the call reads and writes, every index checked against the cache, and the new
    keys and values (checked; float ones into a float8 cache in ``q_dtype``) or None."""
    table = None
    if block_table is not None:
        if cache_batch_idx is not None:  # the table's rows already say which pages a row reads
            raise ValueError(
                "cache_batch_idx is for a cache of rows, not with block_table: order the block "
                "table's rows instead (flash-attn refuses it too: 'Paged KVcache does not support "
                f"cache_batch_idx'), got cache_batch_idx={cache_batch_idx!r}"
            )
        table = check_block_table(block_table, batch)
        capacity = table.size(1) * k_cache.size(1)
    else:
        capacity = k_cache.size(1)
        if cache_batch_idx is None and k_cache.size(0) != batch:
            raise ValueError(
                f"k_cache holds {k_cache.size(0)} rows for a batch of {batch}: pass "
                "cache_batch_idx to say which rows"
            )
    if (k is None) != (v is None):
        raise TypeError("k and v come together: give both new keys and values, or neither")
    if k is not None and cache_seqlens is None:
        raise TypeError("cache_seqlens is needed with k and v: it says where they are written")
    seen = _per_row("cache_seqlens", cache_seqlens, batch, capacity)
    start = _per_row("cache_leftpad", cache_leftpad, batch, 0)
    cache_rows = None
    if cache_batch_idx is not None:
        cache_rows = _per_row("cache_batch_idx", cache_batch_idx, batch, 0)
        if cache_rows and (min(cache_rows) < 0 or max(cache_rows) >= k_cache.size(0)):
            raise ValueError(
                f"cache_batch_idx must index the {k_cache.size(0)} cache rows, got {cache_rows}"
            )
    k, v = _checked_new(k, v, k_cache, v_cache, batch, q_dtype)
    new = 0 if k is None else k.size(1)
    lengths = [s + new for s in seen]
    if max(lengths, default=0) > capacity or min(seen, default=0) < 0:
        raise ValueError(
            f"cache_seqlens {seen} + {new} new tokens do not fit the cache's {capacity} positions"
        )
    if any(not 0 <= a <= n for a, n in zip(start, seen, strict=True)):
        raise ValueError(f"cache_leftpad {start} must lie in 0..cache_seqlens {seen}")
    if table is not None:
        used = pages_used(lengths, k_cache.size(1))
        what = f"k_cache {shape_str(k_cache.shape)}"
        table = page_table(table, used, k_cache.size(0), what, k_cache.device)
    rows = _Rows(seen, start, new, cache_rows, table, k_cache.size(1))
    return rows, k, v


#: flash-attn's names and layout in the messages of the caches' one check of new tokens
_SPELLING = Spelling(
    k_shape="(batch, seqlen_new, nheads_k, headdim)",
    v_shape="(batch, seqlen_new, nheads_k, headdim_v)",
    token_major=True,
    dtype_of="k_cache's dtype",
    device_of="k_cache's device",
    who="flash_attn_with_kvcache",
)


def _checked_new(
    k: object, v: object, k_cache: Tensor, v_cache: Tensor, batch: int, q_dtype: torch.dtype
) -> tuple[Tensor | None, Tensor | None]:
    """The new keys and values (None: none), through the check every cache makes of new tokens
    (:func:`~attnkit.caches._tokens.check_tokens`), in flash-attn's words: of the cache's heads,
    sizes, dtype and device, needing no gradient. Float keys into a float8 cache (quantized with
    the descale factors before they are written) come in q's dtype."""
    if k is None or v is None:
        return None, None
    k_pages, v_pages = k_cache.permute(0, 2, 1, 3), v_cache.permute(0, 2, 1, 3)
    spelling = _SPELLING
    if k_cache.dtype in FLOAT8 and not (isinstance(k, Tensor) and k.dtype in FLOAT8):
        zero = torch.zeros((), dtype=q_dtype, device=k_cache.device)
        k_pages, v_pages = zero.expand(k_pages.shape), zero.expand(v_pages.shape)
        spelling = replace(_SPELLING, dtype_of="k_cache's float8 dtype or q's")
    what = f"k_cache {shape_str(k_cache.shape)}, v_cache {shape_str(v_cache.shape)}"
    return check_tokens(k, v, k_pages, v_pages, batch, what, spelling)


def _rotated(
    q: Tensor,
    k: Tensor | None,
    rows: _Rows,
    rotary_cos: object,
    rotary_sin: object,
    interleaved: bool,
    positional: bool,
) -> tuple[Tensor, Tensor]:
    """``q`` and the new keys rotated at their positions in each row: the keys at their indices
    in the cache row (``cache_seqlens[b] + t``; flash-attn counts them from the row's start, not
    from its ``cache_leftpad``), the queries at theirs when ``positional`` (causal or windowed),
    else all at the row's first new position."""
    if rotary_cos is None or rotary_sin is None or k is None:
        raise TypeError(
            "rotary_cos and rotary_sin come together, and with k and v (the new tokens they "
            "rotate), as in flash-attn"
        )
    batch, q_len = q.shape[:2]
    base = rows.seen
    reach = max((b + max(rows.new, q_len if positional else 1) for b in base), default=0)
    cos, sin = check_rotary(rotary_cos, rotary_sin, q.size(3), max(reach, *rows.lengths, 0))
    at = torch.tensor(base, device=q.device)
    k_pos = at[:, None] + torch.arange(rows.new, device=q.device)
    q_pos = at[:, None] + (torch.arange(q_len, device=q.device) if positional else 0)
    q_pos = q_pos.expand(batch, q_len)
    return rotate(q, cos, sin, q_pos, interleaved), rotate(k, cos, sin, k_pos, interleaved)


def _view(
    k_cache: Tensor, v_cache: Tensor, rows: _Rows, descales: tuple[Tensor | None, Tensor | None]
) -> tuple[CacheView, tuple[Tensor, Tensor] | None]:
    """The cache as the call reads it: row ``b``'s keys ``cache_leftpad[b] <= j < lengths[b]``
    of its pages (the block table, checked), of its cache row (``cache_batch_idx``: a page of the
    whole capacity a row), or of row ``b``; a float8 cache with each page's scale, the descale
    factors of the row that reads it. Where rows that read one page have factors of their own,
    the page has no one scale: the view's scales are then 1 and the factors ``(k_descale,
    v_descale)`` come back, for the call to fold into q (the scores ``q . (d k)`` are ``(d q) .
    k``) and into the output (else None)."""
    table = rows.table
    if table is None and rows.cache_rows is not None:
        table = torch.tensor(rows.cache_rows, dtype=torch.int64, device=k_cache.device)[:, None]
    kd, vd = descales
    fold = None
    if kd is not None and vd is not None and table is not None:
        one = _one_factor(kd, k_cache, rows, table) and _one_factor(vd, k_cache, rows, table)
        if not one:
            fold, descales = (kd, vd), (torch.ones_like(kd), torch.ones_like(vd))
    scales = [None if d is None else _page_scales(d, k_cache, rows, table) for d in descales]
    return CacheView(
        k_cache.permute(0, 2, 1, 3),
        v_cache.permute(0, 2, 1, 3),
        tuple(zip(rows.start, rows.lengths, strict=True)),
        table,
        None,
        scales[0],
        scales[1],
        trusted=True,
    ), fold


def _check_apart(rows: _Rows, table: Tensor | None, page: int) -> None:
    """Refuse batch rows whose new tokens go to one slot of the cache (a cache row named twice
    by ``cache_batch_idx``, a page in two rows' block tables at the positions they write): the
    last write would win, and the other row attend a key that is not its own."""
    if table is None or table.size(0) < 2 or table.device.type == "meta":
        return  # (without a table row b writes its own row b; a meta table names no page)
    at = torch.tensor(rows.seen, device=table.device)[:, None] + torch.arange(
        rows.new, device=table.device
    )  # (B, new): the positions each row writes
    slots = table.long().gather(1, at // page) * page + at % page
    flat = slots.flatten()
    ordered, order = flat.sort()
    twice = (ordered[1:] == ordered[:-1]).nonzero()
    if twice.numel():
        i = int(twice[0, 0])
        first, second = sorted(int(order[j]) // rows.new for j in (i, i + 1))
        slot = int(ordered[i])
        where = (
            f"page {slot // page}, position {slot % page}"
            if rows.table is not None
            else f"cache row {slot // page}, position {slot % page}"
        )
        raise ValueError(
            f"batch rows {first} and {second} write their new keys to one slot of the cache "
            f"({where}): the last write would win and the other row attend a key not its own; "
            "give each row's new tokens slots of their own (cache_batch_idx, block_table, "
            "cache_seqlens)"
        )


def _one_factor(d: Tensor, k_cache: Tensor, rows: _Rows, table: Tensor) -> bool:
    """Whether every page rows read is read with one factor ``d (B, Hkv)`` a head (rows that
    share a page, prefix sharing or one ``cache_batch_idx`` row, may give their own)."""
    page = k_cache.size(1)
    scales = _page_scales(d, k_cache, rows, table)[:, :, 0, 0]  # (X, Hkv): the last row's
    used = torch.tensor([-(-n // page) for n in rows.lengths], device=table.device)
    read = torch.arange(table.size(1), device=table.device) < used[:, None]  # (B, P)
    given = d[:, None, :].expand(-1, table.size(1), -1)[read]  # (pages read, Hkv)
    return bool((scales[table.long()[read]] == given).all())


def _page_scales(d: Tensor, k_cache: Tensor, rows: _Rows, table: Tensor | None) -> Tensor:
    """Row ``b``'s descale factors ``d (B, Hkv)`` on the pages it reads: ``(X, Hkv, page, 1)``,
    each page's one scale a head expanded along the page (1 on pages no row reads)."""
    pages, page, hkv = k_cache.size(0), k_cache.size(1), k_cache.size(2)
    scales = torch.ones(pages, hkv, device=k_cache.device)
    if table is None:
        scales[: d.size(0)] = d
    else:
        used = torch.tensor([-(-n // page) for n in rows.lengths], device=table.device)
        read = torch.arange(table.size(1), device=table.device) < used[:, None]  # (B, P)
        where = table.long()[read]
        scales[where] = d[:, None, :].expand(-1, table.size(1), -1)[read]
    return scales[:, :, None, None].expand(pages, hkv, page, 1)


def _stored(
    k: Tensor, v: Tensor, dtype: torch.dtype, descales: tuple[Tensor | None, Tensor | None]
) -> tuple[Tensor, Tensor]:
    """New ``k``, ``v`` ``(B, T, Hkv, D)`` as ``(B, Hkv, T, D)`` in the cache's dtype: float ones
    into a float8 cache quantized with the descale factors (computed before any write)."""
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    kd, vd = descales
    if dtype not in FLOAT8 or kd is None or vd is None:
        return kt, vt
    if kt.dtype not in FLOAT8:
        kt = quantize_fp8(kt, dtype, scale=kd[:, :, None, None])[0]
    if vt.dtype not in FLOAT8:
        vt = quantize_fp8(vt, dtype, scale=vd[:, :, None, None])[0]
    return kt, vt


def _check_as_attention(
    q: Tensor,
    view: CacheView,
    mask: Mask | None,
    bias: ScoreTerm | None,
    scale: float | None,
    cap: float | None,
    sinks: Tensor | None,
) -> AttentionCall:
    """What attention() checks of the call it will get (dtypes, devices, the mask's and the score
    term's fit), asked of a stand-in of the cache's view without data, before anything is
    written: the call."""
    batch, q_len, heads, head_dim = q.shape
    kv_heads, kv_len = view.num_kv_heads, view.kv_len
    k = _stand_in(view.k, (batch, kv_heads, kv_len, view.k.size(3)))
    v = _stand_in(view.v, (batch, kv_heads, kv_len, view.v.size(3)))
    one = None if not view.quantized else _stand_in(q.float(), (batch, kv_heads, kv_len, 1))
    return check_attention_args(
        _stand_in(q, (batch, heads, q_len, head_dim)),
        CacheView(k, v, view.kv_range, k_scale=one, v_scale=one, trusted=True),
        None,
        mask=mask,
        bias=bias,
        causal=False,
        scale=scale,
        softcap=cap,
        sinks=None if sinks is None else _stand_in(sinks, tuple(sinks.shape)),
    )
