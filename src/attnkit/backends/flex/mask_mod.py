"""attnkit's masks as FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` functions.

A mask is lowered by asking it what it is, through the mask protocol of :mod:`attnkit.masks`
(never by its class): a combination (``op``, ``parts``) joins the lowered parts with ``&`` or
``|``; a mask that carries a ``mask_mod`` (:func:`attnkit.masks.from_fn`, the masks of
:mod:`attnkit.flex`, a class of one's own that defines one) is that function; a dense tensor
(``tensor``) is read at ``[b, h, q_idx, kv_idx]`` through its own tile of the call; a band around
the diagonal (``band``: causal in both alignments, sliding windows) is the one band test,
:func:`attnkit.masks.band_visibility`, at the query's aligned position; a mask of the keys alone
(``keys_only``: key padding from lengths or a tensor, either side) is its key tile, read at
``[b, kv_idx]``; packed documents compare the document ids of the query's position and the key.

Every tensor a ``mask_mod`` reads is made here once per call, on the call's device, shaped for
the flattened batch (``B`` rows) and read by index, which is what FlexAttention compiles into its
kernel. Nothing here reads a tensor's values on the host.

Query ``i`` sits at key position ``i + Tk - Tq`` (bottom-right), as everywhere in attnkit;
``q_idx`` and ``kv_idx`` are FlexAttention's raw indices.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ...masks import Geometry, Mask, band_visibility, encode

__all__ = ["MaskMod", "lower_mask", "mask_refusal"]

#: ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True = may attend), FlexAttention's form
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _own_mask_mod(mask: Mask) -> MaskMod | None:
    fn = getattr(mask, "mask_mod", None)
    return fn if callable(fn) else None


def _document_kind(mask: Mask) -> tuple[str, list[Tensor]] | None:
    """``(kind, tensors)`` of packed documents as :func:`attnkit.masks.encode` writes them
    (``"documents"``: ids per key; ``"document_lengths"``: lengths per row), else None."""
    tensors: list[Tensor] = []
    text = encode(mask, tensors)
    for kind in ("documents", "document_lengths"):
        if text is not None and text.startswith(f'["{kind}"'):
            return kind, tensors
    return None


def mask_refusal(mask: Mask | None) -> str | None:
    """Why ``mask`` has no ``mask_mod`` here (None: it has one). Reads no tensor data."""
    if mask is None:
        return None
    if mask.op is not None:
        if mask.op not in ("and", "or"):
            return f"the mask {mask.describe()} joins its parts with {mask.op!r}, not & or |"
        for part in mask.parts:
            why = mask_refusal(part)
            if why is not None:
                return why
        return None
    known = (
        _own_mask_mod(mask) is not None
        or mask.tensor is not None
        or mask.band is not None
        or mask.keys_only
        or _document_kind(mask) is not None
    )
    if known:
        return None
    return (
        f"the mask {mask.describe()} is of a class of its own that FlexAttention cannot read: "
        "give it a mask_mod(b, h, q_idx, kv_idx) attribute (FlexAttention's form, raw indices) "
        "to lower it"
    )


def lower_mask(mask: Mask, geo: Geometry) -> MaskMod:
    """``mask`` for the call ``geo`` as a ``mask_mod`` over tensors on ``geo.device`` (a
    ``ValueError`` quoting :func:`mask_refusal` for a mask that has none)."""
    if mask.op in ("and", "or"):
        return _joined(mask.op == "and", tuple(lower_mask(p, geo) for p in mask.parts))
    own = _own_mask_mod(mask)
    if own is not None:
        return own
    if mask.tensor is not None:
        # the mask's own tile of the whole call: (B|1, H|1, Tq|1, Tk|1), a view of the tensor
        tile = mask.tile(geo, 0, geo.q_len, 0, geo.kv_len).to(geo.device)
        return _read_at(tile.expand(geo.batch, geo.heads, geo.q_len, geo.kv_len))
    band = mask.band
    if band is not None:
        lo, hi, align = band
        return _band(lo, hi, geo.shift if align == "bottom_right" else 0)
    if mask.keys_only:
        keys = mask.key_tile(geo, 0, geo.kv_len).to(geo.device)  # (B|1, Tk)
        return _keys(keys.expand(geo.batch, geo.kv_len))
    documents = _document_kind(mask)
    if documents is not None:
        return _documents(_document_ids(*documents, geo), geo.shift)
    raise ValueError(mask_refusal(mask))


def _joined(every: bool, mods: tuple[MaskMod, ...]) -> MaskMod:
    def joined(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            seen = mod(b, h, q_idx, kv_idx)
            out = out & seen if every else out | seen
        return out

    return joined


def _read_at(visible: Tensor) -> MaskMod:
    """A dense mask, ``(B, H, Tq, Tk)`` (broadcast dims as zero strides: no copy)."""

    def dense(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return visible[b, h, q_idx, kv_idx]

    return dense


def _band(lo: float, hi: float, offset: int) -> MaskMod:
    """``lo <= kv_idx - (q_idx + offset) <= hi``: the band test of every causal mask and window."""

    def band(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return band_visibility(q_idx + offset, kv_idx, lo, hi)

    return band


def _keys(valid: Tensor) -> MaskMod:
    """A mask of the keys alone: ``valid (B, Tk)``, True = a key every query of row ``b`` sees."""

    def keys(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return valid[b, kv_idx]

    return keys


def _document_ids(kind: str, tensors: list[Tensor], geo: Geometry) -> Tensor:
    """``(B, Tk)`` document ids per key on ``geo.device``."""
    if kind == "documents":
        ids = tensors[0].to(geo.device)  # (B|1, Tk)
    else:  # lengths per row (B|1, n): key j belongs to the first document ending past it
        ends = tensors[0].to(geo.device).cumsum(1)
        j = torch.arange(geo.kv_len, device=geo.device).expand(ends.size(0), -1).contiguous()
        ids = torch.searchsorted(ends, j, right=True)
    return ids.expand(geo.batch, geo.kv_len)


def _documents(ids: Tensor, shift: int) -> MaskMod:
    """Packed documents: the query's position (``q_idx + shift``) and the key carry one id. A
    query before every key (more queries than keys) sees none."""

    def documents(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        at = q_idx + shift
        return (ids[b, at.clamp(min=0)] == ids[b, kv_idx]) & (at >= 0)

    return documents
