"""attnkit's masks as FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` functions.

A mask is lowered by asking it what it is, through the mask protocol of :mod:`attnkit.masks`
(never by its class): a combination (``op``, ``parts``) joins the lowered parts with ``&`` or
``|``; a mask that carries a ``mask_mod`` (:func:`attnkit.masks.from_fn`, the masks of
:mod:`attnkit.flex`, a class of one's own that defines one) is that function; a dense tensor
(``tensor``) is read at ``[b, h, q_idx, kv_idx]`` through its own tile of the call; a band around
the diagonal (``band``: causal in both alignments, sliding windows) is the one band test,
:func:`attnkit.masks.band_visibility`, at the query's aligned position; a mask of the keys alone
(``keys_only``: key padding from lengths or a tensor, either side) is its key tile, read at
``[b, kv_idx]``; packed documents compare the document ids of the query's position and the key;
an index mask (:func:`~attnkit.masks.key_indices`, :func:`~attnkit.masks.block_indices`: the
public class :class:`attnkit.masks.KeyIndices`, whose ``indices`` are its answer to "what is it")
is its selection packed as a bitmap (:func:`selection_bitmap`), a bit a key (or a block of keys)
for each query and selection head, read at the query's row: ``Tq * Tk / 8`` bytes per batch row
and selection head, where the same selection written as a bool ``(Tq, Tk)`` mask takes 8 times
that (and ``block`` times less for blocks). Its ``BlockMask`` comes from the block plan, as for
every mask: the index mask's block states list the blocks some query selects a key of.

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

from ..._base.checks import shape_str
from ..._score_mod import captured_tensors
from ...masks import Geometry, KeyIndices, Mask, band_visibility, encode, first_entries

__all__ = [
    "MaskMod",
    "bitmap_bytes",
    "index_masks",
    "lower_mask",
    "mask_refusal",
    "selection_bitmap",
]

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
    """Why ``mask`` has no ``mask_mod`` here (None: it has one), or has one torch refuses: a
    ``mask_mod`` that captures a tensor needing gradients. Reads no tensor data."""
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
    own = _own_mask_mod(mask)
    needing = () if own is None else captured_tensors(own)
    if needing:
        shapes = ", ".join(shape_str(t.shape) for t in needing)
        return (
            f"the mask {mask.describe()}'s mask_mod reads a tensor that needs gradients "
            f"({shapes}), which torch's FlexAttention refuses in a mask_mod (even under no_grad): "
            "have it read a detached copy (t = table.detach(), made outside it) to lower it"
        )
    known = (
        own is not None
        or mask.tensor is not None
        or mask.band is not None
        or mask.keys_only
        or _document_kind(mask) is not None
        or isinstance(mask, KeyIndices)
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
    if isinstance(mask, KeyIndices):
        return _lower_indices(mask, geo)
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


# --------------------------------------------------------------------------------------------------
# Index masks: each row's selection as a bitmap


def selection_bitmap(indices: Tensor, slots: int, *, presorted: bool = False) -> Tensor:
    """int32 ``(..., ceil(slots / 32))``: bit ``s % 32`` of word ``s // 32`` is set where the row
    of ``indices`` ``(..., k)`` (entries ``-1`` or ``0 .. slots - 1``; ``presorted``: each row in
    order already) holds ``s``. ``-1`` and repeated entries set nothing: in a sorted row an entry
    counts where it differs from its left neighbour, so the scatter adds each bit at most once.
    No ``(..., slots)`` tensor is made, and the rows are packed a stretch of about 4M entries
    at a time, so the int64 work tensors stay a few tens of MiB whatever ``Tq * k`` is."""
    rows = indices.flatten(0, -2) if indices.ndim > 1 else indices.view(1, -1)
    out = torch.empty(rows.size(0), -(-slots // 32), dtype=torch.int32, device=rows.device)
    step = max(1, (1 << 22) // max(1, rows.size(1)))
    for r in range(0, rows.size(0), step):
        out[r : r + step] = _packed(rows[r : r + step], out.size(1), presorted)
    return out.view(*indices.shape[:-1], out.size(1))


def _packed(rows: Tensor, words: int, presorted: bool) -> Tensor:
    keys = rows.to(torch.int64)
    if not presorted:
        keys = keys.sort(-1).values
    first = first_entries(keys)
    word = torch.where(first, keys // 32, 0)
    bit = torch.where(first, torch.ones_like(keys) << (keys % 32), 0)
    out = torch.zeros(rows.size(0), words, dtype=torch.int64, device=rows.device)
    out.scatter_add_(-1, word, bit)
    # Each word holds 32 bits in an int64; written as int32 with the same bits, bit 31 becomes
    # the sign bit, which ``>>`` and ``& 1`` read back as they read the others.
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


def index_masks(mask: Mask | None) -> list[KeyIndices]:
    """The index masks among ``mask``'s parts (through every ``&`` and ``|``)."""
    if mask is None:
        return []
    if mask.op is not None:
        return [m for p in mask.parts for m in index_masks(p)]
    return [mask] if isinstance(mask, KeyIndices) else []


def bitmap_bytes(mask: KeyIndices, geo: Geometry) -> int:
    """Bytes of the bitmap :func:`lower_mask` makes of ``mask`` for the call ``geo``: per batch
    row of the indices, selection head and query, a bit a key (a block of keys for
    :func:`~attnkit.masks.block_indices`), in 32-bit words. Reads no tensor data."""
    rows, heads, q_len, _ = mask.indices.shape
    slots = -(-geo.kv_len // mask.block)
    return rows * heads * q_len * -(-slots // 32) * 4


def _lower_indices(mask: KeyIndices, geo: Geometry) -> MaskMod:
    """Query ``q_idx`` of head ``h`` in row ``b`` sees key ``kv_idx`` iff its selection (that of
    head ``h // (H / Hi)``) holds the key's slot, ``kv_idx // block``."""
    slots = -(-geo.kv_len // mask.block)
    if mask.block == 1:  # the sorted keys the block plan has read already
        words = selection_bitmap(mask.selected(geo.kv_len, geo.device), slots, presorted=True)
    else:
        words = selection_bitmap(mask.indices.to(geo.device), slots)  # (B|1, Hi, Tq, words)
    words = words.expand(geo.batch, *words.shape[1:])
    group, block = geo.heads // mask.heads, mask.block

    def selected(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        slot = kv_idx // block if block > 1 else kv_idx
        head = h // group if group > 1 else h
        return ((words[b, head, q_idx, slot // 32] >> (slot % 32)) & 1) != 0

    return selected
