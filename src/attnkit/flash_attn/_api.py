"""flash-attn's attention functions over ``(B, T, H, D)`` tensors and packed sequences, each one
:func:`attnkit.attention` call (see the package's conventions); packed sequences on a paged cache
are a call on its :class:`~attnkit.caches.view.CacheView`, its pages read where they lie."""

from __future__ import annotations

import torch
from torch import Tensor

from .._base.checks import check_bool, check_probability, shape_str
from ..attention import attention
from ..caches._quantize import FLOAT8
from ..caches.view import CacheView
from ..masks import Mask
from ..scores import ScoreTerm
from ._alibi import alibi, varlen_alibi
from ._args import (
    band,
    band_mask,
    descaled_q,
    descales,
    four_d,
    lengths_of,
    scale_of,
    sinks_of,
    softcap_of,
    three_d,
)
from ._paging import checked_pages, gather_pages
from ._varlen import sequences_mask

__all__ = [
    "attend",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]

_Window = tuple[int | None, int | None]
_Result = Tensor | tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]
#: the layouts of q, k and v that refusals name
_DENSE = (
    "(batch, seqlen_q, nheads, headdim)",
    "(batch, seqlen_k, nheads_k, headdim)",
    "(batch, seqlen_k, nheads_k, headdim_v)",
)
_PACKED = (
    "(total_q, nheads, headdim)",
    "(total_k, nheads_k, headdim)",
    "(total_k, nheads_k, headdim_v)",
)
_PAGED = (
    "(total_q, nheads, headdim)",
    "(num_blocks, page_block_size, nheads_k, headdim)",
    "(num_blocks, page_block_size, nheads_k, headdim_v)",
)


def attend(
    q: Tensor,
    k: Tensor | CacheView,
    v: Tensor | None,
    *,
    mask: Mask | None,
    bias: ScoreTerm | None,
    dropout_p: float,
    softmax_scale: float | None,
    softcap: float | None,
    sinks: Tensor | None,
    want_lse: bool,
    want_probs: bool,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One :func:`attnkit.attention` call on ``(B, H, T, D)`` views (``k`` a cache's view and
    ``v`` None: the call on a cache): the output ``(B, Tq, H, Dv)``, the LSE ``(B, H, Tq)`` if
    wanted, the weights if wanted (``softmax_scale`` and ``softcap`` already checked: softcap None
    for none).

    With dropout, the weights come from a second call without it: asking for the weights must
    not change the output, and a backend that returns weights may draw its dropout otherwise than
    the one that serves the call without them (flash-attn's output is the same with or without
    ``return_attn_probs``, for one seed). Without dropout one call gives both. ``k_scale`` and
    ``v_scale``: float8 keys' and values' scales, as :func:`attnkit.attention` takes them."""
    together = want_probs and dropout_p == 0
    result = attention(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        scale=softmax_scale,
        softcap=softcap,
        sinks=sinks,
        dropout_p=dropout_p,
        k_scale=k_scale,
        v_scale=v_scale,
        return_weights=together,
        return_lse=want_lse,
    )
    parts: tuple[Tensor, ...] = result if isinstance(result, tuple) else (result,)
    out, lse = parts[0], parts[-1] if want_lse else None
    probs = parts[1] if together else None
    if want_probs and not together:
        _, probs = attention(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            scale=softmax_scale,
            softcap=softcap,
            sinks=sinks,
            k_scale=k_scale,
            v_scale=v_scale,
            return_weights=True,
        )
    return out.transpose(1, 2).contiguous(), lse, probs


def _finish(out: Tensor, lse: Tensor | None, probs: Tensor | None, asked: bool) -> _Result:
    """flash-attn's return value: ``out``, or ``(out, softmax_lse, S_dmask)`` when asked."""
    if not asked or lse is None:
        return out
    if probs is None:  # flash-attn's S_dmask without dropout: nothing
        probs = out.new_empty((0,))
    return out, lse, probs


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Tensor | None = None,
    s_aux: Tensor | None = None,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
) -> _Result:
    """flash-attn's ``flash_attn_func``: attention over ``(B, T, H, D)`` tensors.

    Args:
        q: ``(B, Tq, H, D)``.
        k: ``(B, Tk, Hkv, D)``.
        v: ``(B, Tk, Hkv, Dv)``.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic:
            as in flash-attn (see the module's conventions).
        return_attn_probs: also return ``softmax_lse`` ``(B, H, Tq)`` and ``S_dmask``.
        learnable_sink, s_aux: ``(H,)`` attention-sink logits (flash-attn 4's and 3's names).
        q_descale, k_descale, v_descale: flash-attn 3's float8 descale factors, float ``(B,
            Hkv)``, for ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` inputs (default 1):
            batch row ``b``'s keys are ``k.float() * k_descale[b, h]``, read in place (the
            native kernel dequantizes in registers), and likewise the values. A float8 ``q`` is
            read as ``q.float() * q_descale`` in bfloat16, flash-attn 3's output dtype for float8
            inputs; a float ``q`` is multiplied by ``q_descale``.

    Returns:
        ``out`` ``(B, Tq, H, Dv)``, or ``(out, softmax_lse, S_dmask)``.

    >>> import torch
    >>> q, k, v = torch.randn(2, 5, 8, 16), torch.randn(2, 7, 2, 16), torch.randn(2, 7, 2, 16)
    >>> out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    >>> out.shape, lse.shape
    (torch.Size([2, 5, 8, 16]), torch.Size([2, 8, 5]))
    """
    q = four_d("q", q, "(batch, seqlen_q, nheads, headdim)")
    k = four_d("k", k, "(batch, seqlen_k, nheads_k, headdim)")
    v = four_d("v", v, "(batch, seqlen_k, nheads_k, headdim_v)")
    _check_layout(q, k, v, _DENSE)
    lo, hi = band(window_size, causal)
    check_bool("deterministic", deterministic)
    asked = check_bool("return_attn_probs", return_attn_probs)
    p = check_probability("dropout_p", dropout_p)
    cap = softcap_of(softcap)
    scale = scale_of(softmax_scale, q.dtype)
    batch, q_len, heads = q.shape[:3]
    kv_len = k.size(1)
    q, k_scale, v_scale = _float8(q, k, v, q_descale, k_descale, v_descale)
    bias = None
    if alibi_slopes is not None:
        bias = alibi(alibi_slopes, heads, batch, q.dtype, q_len, kv_len)
    out, lse, probs = attend(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        mask=band_mask(lo, hi, q_len, kv_len),
        bias=bias,
        dropout_p=p,
        softmax_scale=scale,
        softcap=cap,
        sinks=sinks_of(learnable_sink, s_aux, q, heads),
        want_lse=asked,
        want_probs=asked and p > 0,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return _finish(out, lse, probs, asked)


def _check_layout(q: Tensor, k: Tensor, v: Tensor, names: tuple[str, str, str]) -> None:
    """``q``, ``k`` and ``v`` against each other in flash-attn's layout, their shapes as given
    (``names``: each one's dims, heads and head size last): the same batch dims, ``k`` and ``v``
    the same but for the head size, the heads of ``q`` a multiple of theirs, and one head size
    for ``q`` and ``k`` (attention() would find the same faults in its own ``(B, H, T, D)``
    layout, and name the shapes transposed)."""
    got = f"got q {shape_str(q.shape)}, k {shape_str(k.shape)}, v {shape_str(v.shape)}"
    spelled = f"q {names[0]}, k {names[1]}, v {names[2]}"
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree on all but the head size ({spelled}); {got}")
    if q.ndim == 4 and q.size(0) != k.size(0):
        raise ValueError(f"q, k and v must share their batch ({spelled}); {got}")
    if k.size(-2) == 0 or q.size(-2) % k.size(-2):
        raise ValueError(
            f"q's nheads ({q.size(-2)}) must be a multiple of the key/value heads (k's and v's "
            f"nheads_k, {k.size(-2)}) ({spelled}); {got}"
        )
    if q.size(-1) != k.size(-1):
        raise ValueError(
            f"q's headdim ({q.size(-1)}) must be k's ({k.size(-1)}) ({spelled}); {got}"
        )


def _float8(
    q: Tensor, k: Tensor, v: Tensor, q_descale: object, k_descale: object, v_descale: object
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``q`` descaled (float8 queries in bfloat16) and the keys' and values' scales as
    :func:`attnkit.attention` takes them, ``(B, Hkv, 1, 1)``, from flash-attn 3's descale
    factors ``(B, Hkv)``; float inputs without factors come back as they are."""
    plain = q_descale is None and k_descale is None and v_descale is None
    if plain and not {q.dtype, k.dtype, v.dtype} & {*FLOAT8, torch.int8}:
        return q, None, None  # (the common call: nothing to check or scale)
    if (q_descale is not None or q.dtype in FLOAT8) and q.size(2) % max(k.size(2), 1):
        raise ValueError(
            f"the query heads ({q.size(2)}) must be a multiple of the key/value heads ({k.size(2)})"
        )
    qd, kd, vd = descales(q, k, v, q_descale, k_descale, v_descale, names=("k", "v"))
    k_scale = kd[:, :, None, None] if kd is not None else None
    v_scale = vd[:, :, None, None] if vd is not None else None
    return descaled_q(q, qd), k_scale, v_scale


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Tensor | None = None,
    s_aux: Tensor | None = None,
) -> _Result:
    """flash-attn's ``flash_attn_qkvpacked_func``: ``qkv`` ``(B, T, 3, H, D)``, split into views;
    otherwise :func:`flash_attn_func`."""
    if not isinstance(qkv, Tensor) or qkv.ndim != 5 or qkv.size(2) != 3:
        got = shape_str(qkv.shape) if isinstance(qkv, Tensor) else type(qkv).__name__
        raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got {got}")
    q, k, v = qkv.unbind(2)
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=learnable_sink,
        s_aux=s_aux,
    )


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Tensor | None = None,
    s_aux: Tensor | None = None,
) -> _Result:
    """flash-attn's ``flash_attn_kvpacked_func``: ``kv`` ``(B, Tk, 2, Hkv, D)``, split into
    views; otherwise :func:`flash_attn_func`."""
    if not isinstance(kv, Tensor) or kv.ndim != 5 or kv.size(2) != 2:
        got = shape_str(kv.shape) if isinstance(kv, Tensor) else type(kv).__name__
        raise ValueError(f"kv must be (batch, seqlen_k, 2, nheads_k, headdim), got {got}")
    k, v = kv.unbind(2)
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=learnable_sink,
        s_aux=s_aux,
    )


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | Tensor | None = None,
    max_seqlen_k: int | Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Tensor | None = None,
    *,
    learnable_sink: Tensor | None = None,
    s_aux: Tensor | None = None,
) -> _Result:
    """flash-attn's ``flash_attn_varlen_func``: packed sequences without padding.

    Args:
        q: ``(total_q, H, D)``, the sequences' queries one after the other.
        k: ``(total_k, Hkv, D)``; with ``block_table``, a paged cache ``(blocks, page, Hkv, D)``.
        v: ``(total_k, Hkv, Dv)``, or paged like ``k``.
        cu_seqlens_q: ``(batch + 1,)`` integers: sequence ``s`` has the queries
            ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]``.
        cu_seqlens_k: ``(batch + 1,)``, the same for the keys (a sequence may have more keys than
            queries: its queries are aligned bottom-right to its keys).
        max_seqlen_q, max_seqlen_k: accepted, not needed.
        block_table: ``(batch, max_blocks)``: sequence ``s``'s keys are the first
            ``cu_seqlens_k[s + 1] - cu_seqlens_k[s]`` tokens of its pages.
        others: as :func:`flash_attn_func`; ``alibi_slopes`` may be ``(batch, H)``, one row per
            sequence.

    Returns:
        ``out`` ``(total_q, H, Dv)``, or ``(out, softmax_lse, S_dmask)`` with ``softmax_lse``
        ``(H, total_q)`` and ``S_dmask`` ``(H, total_q, total_k)`` (zero across sequences) when
        ``dropout_p > 0``.

    >>> import torch
    >>> q = torch.randn(5, 4, 16)                  # two sequences of 2 and 3 tokens
    >>> cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    >>> flash_attn_varlen_func(q, q, q, cu, cu, 3, 3, causal=True).shape
    torch.Size([5, 4, 16])
    """
    q = three_d("q", q, "(total_q, nheads, headdim)")
    q_lengths = lengths_of("cu_seqlens_q", cu_seqlens_q, q.size(0))
    rows = len(q_lengths)
    table = None
    if block_table is not None:
        k, v, table, k_lengths = checked_pages(k, v, cu_seqlens_k, block_table, rows)
        _check_layout(q, k, v, _PAGED)
    else:
        k = three_d("k", k, "(total_k, nheads_k, headdim)")
        v = three_d("v", v, "(total_k, nheads_k, headdim_v)")
        _check_layout(q, k, v, _PACKED)
        k_lengths = lengths_of("cu_seqlens_k", cu_seqlens_k, k.size(0))
    if len(k_lengths) != rows:
        raise ValueError(
            f"cu_seqlens_q describes {rows} sequences and cu_seqlens_k {len(k_lengths)}: they "
            "must describe the same sequences"
        )
    lo, hi = band(window_size, causal)
    check_bool("deterministic", deterministic)
    asked = check_bool("return_attn_probs", return_attn_probs)
    p = check_probability("dropout_p", dropout_p)
    cap = softcap_of(softcap)
    scale = scale_of(softmax_scale, q.dtype)
    sinks = sinks_of(learnable_sink, s_aux, q, q.size(1))
    sizes, args = (q_lengths, k_lengths), (scale, cap, alibi_slopes, sinks)
    if table is None:
        return _finish(*_packed(q, k, v, sizes, (lo, hi), p, args, asked, asked and p > 0), asked)
    paged_lse, paged_out = _paged(q, k, v, table, sizes, (lo, hi), p, *args)
    probs = None
    # With dropout, the weights come from the packed keys, gathered; the output is the paged
    # call's.
    if asked and p > 0:
        k, v = gather_pages(k, table, k_lengths), gather_pages(v, table, k_lengths)
        probs = _packed(q, k, v, sizes, (lo, hi), 0.0, args, False, True)[2]
    return _finish(paged_out, paged_lse, probs, asked)


def _packed(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sizes: tuple[list[int], list[int]],
    window: tuple[float, float],
    dropout_p: float,
    args: tuple[float | None, float | None, object, Tensor | None],
    want_lse: bool,
    want_probs: bool,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """:func:`flash_attn_varlen_func` on packed keys ``(total_k, Hkv, D)``: one
    :func:`attnkit.attention` call over ``(1, H, total, D)`` views (``sizes``: the sequences'
    query and key lengths; ``args``: the checked scale, softcap, ALiBi slopes and sinks);
    ``(out (total_q, H, Dv), lse (H, total_q), weights (H, total_q, total_k))``, as wanted."""
    (q_lengths, k_lengths), (scale, cap, alibi_slopes, sinks) = sizes, args
    bias = None
    if alibi_slopes is not None:
        bias = varlen_alibi(alibi_slopes, q.size(1), q_lengths, k_lengths, q.dtype)
    out, lse, probs = attend(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        mask=sequences_mask(q_lengths, k_lengths, *window, q.device),
        bias=bias,
        dropout_p=dropout_p,
        softmax_scale=scale,
        softcap=cap,
        sinks=sinks,
        want_lse=want_lse,
        want_probs=want_probs,
    )
    return out[0], None if lse is None else lse[0], None if probs is None else probs[0]


def _paged(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    table: Tensor,
    sizes: tuple[list[int], list[int]],
    window: tuple[float, float],
    dropout_p: float,
    scale: float | None,
    cap: float | None,
    alibi_slopes: object,
    sinks: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """:func:`flash_attn_varlen_func` on a paged cache: one :func:`attnkit.attention` call on its
    view, sequence ``s``'s queries (padded to the longest, its first ``q_lengths[s]`` real)
    against its pages (``sizes``: the sequences' query and key lengths); ``(lse (H, total_q),
    out (total_q, H, Dv))``."""
    q_lengths, k_lengths = sizes
    rows, heads = len(q_lengths), q.size(1)
    q_len, kv_len = max(q_lengths, default=0), max(k_lengths, default=0)
    # (total_q, H, D) -> (N, q_len, H, D): each sequence's queries in a row of its own
    # (int indices from the host lengths: no read of a mask, which the meta device cannot give)
    seq = torch.repeat_interleave(torch.arange(rows), torch.tensor(q_lengths, dtype=torch.long))
    pos = torch.cat([torch.arange(n) for n in q_lengths]) if rows else seq
    seq, pos = seq.to(q.device), pos.to(q.device)
    padded = q.new_zeros(rows, q_len, heads, q.size(2))
    padded[seq, pos] = q
    view = CacheView(
        k.permute(0, 2, 1, 3),
        v.permute(0, 2, 1, 3),
        tuple((0, n) for n in k_lengths),
        table,
        tuple(q_lengths),
        trusted=True,
    )
    bias = None
    if alibi_slopes is not None:  # from each sequence's own alignment
        bias = alibi(alibi_slopes, heads, rows, q.dtype, q_len, kv_len)
    out, lse, _ = attend(
        padded.transpose(1, 2),
        view,
        None,
        mask=band_mask(*window, q_len, kv_len),
        bias=bias,
        dropout_p=dropout_p,
        softmax_scale=scale,
        softcap=cap,
        sinks=sinks,
        want_lse=True,
        want_probs=False,
    )
    # (N, q_len, H, Dv) -> (total_q, H, Dv); (N, H, q_len) -> (H, total_q)
    if lse is None:
        raise ValueError("attnkit internal error: the paged call gave no log-sum-exp")
    return lse[seq, :, pos].transpose(0, 1), out[seq, pos]


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int | Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Tensor | None = None,
    s_aux: Tensor | None = None,
) -> _Result:
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: ``qkv`` ``(total, 3, H, D)``, split
    into views; otherwise :func:`flash_attn_varlen_func`."""
    if not isinstance(qkv, Tensor) or qkv.ndim != 4 or qkv.size(1) != 3:
        got = shape_str(qkv.shape) if isinstance(qkv, Tensor) else type(qkv).__name__
        raise ValueError(f"qkv must be (total, 3, nheads, headdim), got {got}")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=learnable_sink,
        s_aux=s_aux,
    )


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | Tensor | None = None,
    max_seqlen_k: int | Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: _Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: Tensor | None = None,
    s_aux: Tensor | None = None,
) -> _Result:
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: ``kv`` ``(total_k, 2, Hkv, D)``, split
    into views; otherwise :func:`flash_attn_varlen_func`."""
    if not isinstance(kv, Tensor) or kv.ndim != 4 or kv.size(1) != 2:
        got = shape_str(kv.shape) if isinstance(kv, Tensor) else type(kv).__name__
        raise ValueError(f"kv must be (total_k, 2, nheads_k, headdim), got {got}")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=learnable_sink,
        s_aux=s_aux,
    )
