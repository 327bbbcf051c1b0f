"""FlexAttention's API on attnkit: ``flex_attention``, ``create_block_mask``, ``and_masks``, ...

The functions of ``torch.nn.attention.flex_attention``, with their arguments, layouts
``(B, H, T, D)`` and semantics, served by :func:`attnkit.attention`: any ``score_mod`` and
``mask_mod``, forward and backward, on any device, in O(T) memory (the chunked kernel applies
them tile by tile), so FlexAttention code trains on the CPU. On CUDA, where torch's compiled
FlexAttention runs, the ``flex`` backend hands the call to it.

>>> import torch
>>> from attnkit.flex import create_block_mask, flex_attention
>>> def causal(b, h, q_idx, kv_idx):
...     return q_idx >= kv_idx
>>> def relative(score, b, h, q_idx, kv_idx):
...     return score + 0.1 * (kv_idx - q_idx)
>>> q = torch.randn(2, 4, 64, 16, requires_grad=True)    # (B, H, T, D)
>>> block_mask = create_block_mask(causal, None, None, 64, 64)
>>> out = flex_attention(q, q, q, score_mod=relative, block_mask=block_mask)
>>> out.sum().backward()                                   # on the CPU, too
>>> out.shape, q.grad.shape
(torch.Size([2, 4, 64, 16]), torch.Size([2, 4, 64, 16]))

**Speed.** The chunked kernel calls a score_mod from Python once per tile (and again in the
backward). A score_mod that is exactly a softcap, ``c * tanh(score / c)`` with a constant
``c``, is recognised and the call runs as ``attention(softcap=c)``, in the native kernel (the
FlexAttention guide lists the forms recognised); ``attnkit.explain()`` says when.

**Elementwise.** FlexAttention calls a ``score_mod`` on one score at a time; attnkit calls it on
tiles of scores, the same thing exactly when it maps each score to one score, a function of that
score and its own ``b``, ``h``, ``q_idx``, ``kv_idx``. :func:`flex_attention` probes it on a
small tile once per call (a plain function once for its code) and refuses one that is not (a
sum, mean or maximum over the tile, ``score[..., :1]``, ``flip``, ``roll``, ``cumsum``, a
matmul) with a ``ValueError``. A result that broadcasts to the tile, a constant or a function of
the indices alone, is elementwise and taken. A ``mask_mod`` is probed the same way (once per
function, tile and device type): one that reduces over its index tensors (``q_idx.min()``,
``kv_idx.numel()``) is refused.

**Captured tensors.** A ``score_mod`` may read tensors (a learnable bias table, per-head
multipliers): gradients reach those that need them when attnkit can see them, in the function's
closure, its default arguments, the module globals it names or the attributes of its object (a
callable object or a bound method's ``self``). A score_mod that reaches a tensor needing
gradients any other way is refused with a ``ValueError`` rather than leaving it without gradient.

Shape legend: ``B`` batch, ``H`` query heads, ``Hkv`` key/value heads, ``T`` (``Q_LEN``,
``KV_LEN``) lengths, ``D`` size per head (the letters FlexAttention's documentation uses).
"""

from __future__ import annotations

import math
import threading
import typing
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._base.checks import broadcasts_to, check_int, one_or, shape_str
from ._score_mod import ScoreMod, check_elementwise, check_score_mod
from .attention import attention
from .masks import Geometry, Mask, from_fn

__all__ = [
    "AuxOutput",
    "AuxRequest",
    "BlockMask",
    "and_masks",
    "create_block_mask",
    "flex_attention",
    "noop_mask",
    "or_masks",
]

#: ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True = may attend)
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def noop_mask(batch: Tensor, head: Tensor, token_q: Tensor, token_kv: Tensor) -> Tensor:
    """The mask_mod under which every pair may attend."""
    return batch.new_ones((), dtype=torch.bool)


def _check_mods(what: str, mods: tuple[object, ...]) -> tuple[MaskMod, ...]:
    for i, m in enumerate(mods):
        if not callable(m):
            raise TypeError(f"{what}() takes mask_mod functions, argument {i} is {m!r}")
    return mods  # type: ignore[return-value]


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """The mask_mod that allows a pair where every one of ``mask_mods`` does (all of them: the
    noop mask when none is given).

    >>> both = and_masks(lambda b, h, q, kv: q >= kv, lambda b, h, q, kv: q - kv < 2)
    >>> create_block_mask(both, None, None, 4, 4).to_dense()[0, 0].int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [0, 1, 1, 0],
            [0, 0, 1, 1]], dtype=torch.int32)
    """
    mods = _check_mods("and_masks", mask_mods)

    def and_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = b.new_ones((), dtype=torch.bool)
        for m in mods:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    return and_mask


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """The mask_mod that allows a pair where any of ``mask_mods`` does (none: no pair).

    >>> prefix_lm = or_masks(lambda b, h, q, kv: q >= kv, lambda b, h, q, kv: kv < 2)
    >>> create_block_mask(prefix_lm, None, None, 4, 4).to_dense()[0, 0].int()
    tensor([[1, 1, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    mods = _check_mods("or_masks", mask_mods)

    def or_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = b.new_zeros((), dtype=torch.bool)
        for m in mods:
            out = out | m(b, h, q_idx, kv_idx)
        return out

    return or_mask


class _ModMask(Mask):
    """A mask_mod as an attnkit mask (:func:`attnkit.masks.from_fn`, raw indices), keeping the
    function as ``mask_mod`` for backends that hand it to FlexAttention."""

    def __init__(self, mask_mod: MaskMod, name: str) -> None:
        self.mask_mod = mask_mod
        self._name = name
        self._inner = from_fn(mask_mod)

    def describe(self) -> str:
        return f"mask_mod={self._name}"

    def tile(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        return self._inner.tile(geo, qs, qe, ks, ke)

    @property
    def positional(self) -> bool:
        return True


def _name(fn: object) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


class BlockMask:
    """What :func:`create_block_mask` returns: a ``mask_mod`` and the sizes it was made for.

    Unlike torch's ``BlockMask`` it computes nothing when made: attnkit's kernel asks the
    mask_mod about each block of a call once, to skip the blocks it hides, and again on the
    partial ones, so neither the ``(Q_LEN, KV_LEN)`` mask nor a block table is ever stored.
    ``shape`` is ``(B, H, Q_LEN, KV_LEN)`` with 1 for a ``B`` or ``H`` of None (the mask is the
    same for every batch row or head); :attr:`mask` is the same visibility as an
    :class:`attnkit.masks.Mask`, for ``attnkit.attention(mask=...)``.
    """

    def __init__(
        self,
        mask_mod: MaskMod,
        shape: tuple[int, int, int, int],
        device: torch.device | None,
        block_size: tuple[int, int],
    ) -> None:
        self.mask_mod = mask_mod
        self.shape = shape
        self.device = device
        self.BLOCK_SIZE = block_size
        self.mask: Mask = _ModMask(mask_mod, _name(mask_mod))

    @property
    def seq_lengths(self) -> tuple[int, int]:
        """``(Q_LEN, KV_LEN)``."""
        return self.shape[2], self.shape[3]

    def to_dense(self) -> Tensor:
        """The mask written out, bool ``(B, H, Q_LEN, KV_LEN)`` (this materialises it: for
        inspection)."""
        b, h, q_len, kv_len = self.shape
        geo = Geometry((b,), h, q_len, kv_len, self.device or torch.device("cpu"))
        return self.mask.tile(geo, 0, q_len, 0, kv_len).expand(b, h, q_len, kv_len)

    def __repr__(self) -> str:
        return f"BlockMask(mask_mod={_name(self.mask_mod)}, shape={shape_str(self.shape)})"


def create_block_mask(
    mask_mod: MaskMod,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    _compile: bool = False,
    **kwargs: Any,
) -> BlockMask:
    """A :class:`BlockMask` for ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend),
    torch's signature. ``B`` or ``H`` None: the same mask for every batch row or head; ``B``
    may be 0, for an empty batch, as in torch.

    ``mask_mod`` is called with int64 index tensors shaped ``(B, 1, 1, 1)``, ``(1, H, 1, 1)``,
    ``(1, 1, rows, 1)``, ``(1, 1, 1, keys)`` for one tile at a time (never for the whole
    matrix): write it with tensor operations, as FlexAttention requires. ``device``,
    ``BLOCK_SIZE`` (an int or a pair ``(queries, keys)``, each 1 or more), ``_compile`` and
    torch's other tuning arguments are accepted and change nothing: attnkit chooses its own
    blocks for each call.
    """
    if not callable(mask_mod):
        raise TypeError(f"create_block_mask() takes a mask_mod function, got {mask_mod!r}")
    b = 1 if B is None else check_int("B", B, minimum=0)
    h = 1 if H is None else check_int("H", H)
    q_len = check_int("Q_LEN", Q_LEN, minimum=0)
    kv_len = check_int("KV_LEN", KV_LEN, minimum=0)
    dev = None if device is None else torch.device(device)
    return BlockMask(mask_mod, (b, h, q_len, kv_len), dev, _block_size(BLOCK_SIZE))


def _block_size(size: object) -> tuple[int, int]:
    """``BLOCK_SIZE`` as ``(queries, keys)``: one int for both, or a pair, each 1 or more."""
    if isinstance(size, (tuple, list)):
        if len(size) != 2:
            raise ValueError(
                f"BLOCK_SIZE must be an int or a pair (queries, keys), got {tuple(size)!r}"
            )
        return check_int("BLOCK_SIZE[0]", size[0]), check_int("BLOCK_SIZE[1]", size[1])
    n = check_int("BLOCK_SIZE", size)
    return n, n


class AuxRequest(NamedTuple):
    """Which extra outputs :func:`flex_attention` returns (torch's ``AuxRequest``, a named tuple
    as torch's is; torch's own class works too). ``max_scores`` is not available in attnkit."""

    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """The extra outputs of :func:`flex_attention`: ``lse (B, H, Q_LEN)``, the natural-log
    log-sum-exp of each query's modified scores (``-inf`` for a query that sees no key); a
    named tuple, as torch's is, so ``out, (lse, _) = flex_attention(...)`` unpacks it."""

    lse: Tensor | None = None
    max_scores: Tensor | None = None


def _block_table(num: Tensor, idx: Tensor, rows: int, cols: int) -> Tensor:
    """The blocks a torch ``BlockMask`` lists, bool ``(B, H, rows, cols)``: in each row of
    blocks the first ``num`` entries of ``idx``. Read from the lists themselves, not from
    torch's ``to_dense()``, which drops the blocks past ``idx``'s last column (the lists may be
    shorter than the number of key blocks: only their first ``num`` entries are read)."""
    num, idx = num[..., :rows].long(), idx[..., :rows, :].long()
    taken = torch.arange(idx.size(-1), device=idx.device) < num.unsqueeze(-1)
    taken &= (idx >= 0) & (idx < cols)
    table = idx.new_zeros((*idx.shape[:-1], cols + 1), dtype=torch.bool)
    table.scatter_(-1, torch.where(taken, idx, cols), True)
    table = table[..., :cols]
    if table.size(-2) < rows:  # rows of blocks the lists do not reach list no block
        table = torch.nn.functional.pad(table, (0, 0, 0, rows - table.size(-2)))
    return table


def _torch_block_mask_fn(block_mask: Any) -> tuple[MaskMod, tuple[int, int, int, int]]:
    """A mask_mod equal to a torch ``BlockMask``'s visibility, and its ``(B, H, Q_LEN, KV_LEN)``:
    its mask_mod, and its block table (blocks it lists neither as partial nor as full are
    hidden), which a BlockMask built with ``from_kv_blocks`` needs."""
    inner: MaskMod = block_mask.mask_mod
    shape = tuple(int(s) for s in block_mask.shape)
    q_len, kv_len = (int(s) for s in block_mask.seq_lengths)
    bq, bk = (int(s) for s in block_mask.BLOCK_SIZE)
    rows, cols = max(-(-q_len // bq), 1), max(-(-kv_len // bk), 1)
    table = _block_table(block_mask.kv_num_blocks, block_mask.kv_indices, rows, cols)
    if block_mask.full_kv_num_blocks is not None:
        full = _block_table(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, rows, cols)
        table = table | full
    many_b, many_h = table.size(0) != 1, table.size(1) != 1  # 0: an empty batch
    name = _name(inner)

    def block_table_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        t = table.to(q_idx.device)
        listed: Tensor = t[b if many_b else 0, h if many_h else 0, q_idx // bq, kv_idx // bk]
        return listed & inner(b, h, q_idx, kv_idx)

    block_table_mask.__name__ = name
    return block_table_mask, (shape[0], shape[1], q_len, kv_len)


def _is_torch_block_mask(obj: object) -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask
    except ImportError:  # a torch without FlexAttention
        return False
    return isinstance(obj, TorchBlockMask)


#: the tile of ``(b, h, q_idx, kv_idx)`` on which a mask_mod is probed (at most the call's)
_PROBE = (2, 2, 8, 8)

# mask_mods that passed the probe, with the tiles and device types they passed on: a training
# loop that reuses its block mask reads the device once, on its first call
_PROBED: weakref.WeakKeyDictionary[Any, set[tuple[tuple[int, ...], str]]]
_PROBED = weakref.WeakKeyDictionary()
_PROBED_LOCK = threading.Lock()


def _probed(mask_mod: Any, key: tuple[tuple[int, ...], str], passed: bool = False) -> bool:
    """Whether ``mask_mod`` passed the probe on ``key`` already; ``passed``: it just did."""
    with _PROBED_LOCK:
        try:
            seen = _PROBED.setdefault(mask_mod, set()) if passed else _PROBED.get(mask_mod)
        except TypeError:  # an object without weak references is probed every time
            return False
        if passed and seen is not None:
            seen.add(key)
        return seen is not None and key in seen


def _check_mask_elementwise(mask_mod: MaskMod, sizes: tuple[int, ...], device: Any) -> None:
    """Refuse a mask_mod that is not elementwise with a ValueError. FlexAttention calls it on one
    pair at a time, attnkit on tiles, the same thing unless it reduces over its index tensors
    (``q_idx.min()``, ``kv_idx.numel()``): the probe calls it on a tile of the call's first
    indices and on that tile without its first, then its last, index of each size (where there
    are two or more), and the answers must agree where the tiles do. A function that returns no
    tensor is left to the mask's own check."""
    dims = tuple(min(n, p) for n, p in zip(sizes, _PROBE, strict=True))
    if math.prod(dims) <= 1 or torch.device(device).type == "meta":
        return
    if torch.compiler.is_compiling() or _probed(mask_mod, (dims, torch.device(device).type)):
        return

    def at(spans: list[tuple[int, int]]) -> Tensor | None:
        idx = [
            torch.arange(lo, hi, device=device).view([-1 if d == i else 1 for d in range(4)])
            for i, (lo, hi) in enumerate(spans)
        ]
        out = mask_mod(*idx)
        shape = tuple(hi - lo for lo, hi in spans)
        fits = isinstance(out, Tensor) and broadcasts_to(tuple(out.shape), shape)
        # one that does not fit the tile is left to the mask's own check, which says why
        return out.expand(shape) if fits else None

    full = at([(0, n) for n in dims])
    for first in (True, False):
        spans = [((1, n) if first else (0, n - 1)) if n > 1 else (0, n) for n in dims]
        part = at(spans)
        if full is None or part is None:
            return
        want = full[tuple(slice(lo, hi) for lo, hi in spans)]
        if not torch.equal(part, want):
            where = [int(i) for i in (part != want).nonzero()[0]]
            pair = tuple(w + lo for w, (lo, _) in zip(where, spans, strict=True))
            raise ValueError(
                f"mask_mod {_name(mask_mod)} is not elementwise: at (b, h, q_idx, kv_idx) = "
                f"{pair} it gives {bool(want[tuple(where)])} on the indices {shape_str(dims)} "
                f"and {bool(part[tuple(where)])} on fewer of them. FlexAttention calls a "
                "mask_mod on one pair at a time, attnkit on tiles of pairs: write it without "
                "reductions over its index tensors (min, max, sum, numel, ...)"
            )
    _probed(mask_mod, (dims, torch.device(device).type), passed=True)


def _mask_of(
    block_mask: object, b: int, h: int, q_len: int, kv_len: int, device: Any
) -> Mask | None:
    """The attnkit mask of a ``block_mask`` argument, checked against the call's sizes and
    probed for being elementwise on its device."""
    if block_mask is None:
        return None
    mask: Mask | None
    if isinstance(block_mask, BlockMask):
        shape = block_mask.shape
        mask = None if block_mask.mask_mod is noop_mask else block_mask.mask
        fn = block_mask.mask_mod
    elif _is_torch_block_mask(block_mask):
        read, shape = _torch_block_mask_fn(block_mask)
        mask = _ModMask(read, _name(block_mask.mask_mod))  # type: ignore[attr-defined]
        fn = block_mask.mask_mod  # type: ignore[attr-defined]  # the table is read by index
    else:
        raise TypeError(
            "block_mask must be a BlockMask from attnkit.flex.create_block_mask or "
            f"torch.nn.attention.flex_attention.create_block_mask, or None; got "
            f"{type(block_mask).__name__}"
        )
    mb, mh, mq, mk = shape
    if not one_or(mb, b) or not one_or(mh, h) or mq < q_len or mk < kv_len:
        raise ValueError(
            f"block_mask was made for (B, H, Q_LEN, KV_LEN) = {shape_str(shape)} but the call "
            f"has {shape_str((b, h, q_len, kv_len))}: B and H must match or be 1 (None), and "
            "the lengths must be at least the call's"
        )
    if mask is not None:
        _check_mask_elementwise(fn, (b, h, q_len, kv_len), device)
    return mask


def _check_4d(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a tensor (B, H, T, D), got {type(t).__name__}")
    if t.ndim != 4:
        raise ValueError(
            f"{name} must be 4-d (B, H, T, D) as FlexAttention takes it, got {t.ndim}-d "
            f"{shape_str(t.shape)}"
        )
    return t


def _check_kernel_options(options: object) -> None:
    """Refuse the ``kernel_options`` torch's flex_attention refuses: a ``BACKEND`` it does not
    name, and the outputs it decides itself from ``return_aux``. The others are tuning, which
    attnkit's kernels choose for themselves."""
    if options is None:
        return
    if not isinstance(options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {options!r}")
    for key in ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX"):
        if key in options:
            raise ValueError(
                f"kernel_options must not hold {key} (got {options[key]!r}): ask for the "
                "log-sum-exp or the maximum with return_aux=AuxRequest(...), as torch requires"
            )
    backends = _torch_backends()
    if backends and "BACKEND" in options and options["BACKEND"] not in backends:
        raise ValueError(
            f"kernel_options['BACKEND'] must be one of {backends}, got {options['BACKEND']!r}"
        )


def _torch_backends() -> tuple[str, ...]:
    """The ``kernel_options['BACKEND']`` values this torch's FlexAttention names (none: it
    names none, and any is taken)."""
    try:
        from torch.nn.attention import flex_attention as module
    except ImportError:  # a torch without FlexAttention
        return ()
    return tuple(typing.get_args(getattr(module, "_Backend", None)))


def _as_query_dtype(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """``key`` and ``value`` in ``query``'s dtype where theirs is another floating one (float8
    included), as torch's flex_attention takes them: it computes the scores in query's working
    precision and multiplies the weights by ``value`` in query's dtype."""

    def cast(t: Tensor) -> Tensor:
        same = t.dtype == query.dtype or not t.dtype.is_floating_point
        return t if same or not query.dtype.is_floating_point else t.to(query.dtype)

    return cast(key), cast(value)


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: ScoreMod | None = None,
    block_mask: BlockMask | Any | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict[str, Any] | None = None,
    *,
    return_aux: AuxRequest | Any | None = None,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, AuxOutput]:
    """FlexAttention's ``flex_attention``, torch's signature and semantics, on attnkit.

    Args:
        query: ``(B, H, Q_LEN, D)``.
        key: ``(B|1, Hkv, KV_LEN, D)``; a batch of 1 is shared by every query batch row.
            key and value of another floating dtype than query's (float8 included) are cast
            to query's, as torch computes in query's precision.
        value: ``(B|1, Hkv, KV_LEN, Dv)``.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to the scaled
            scores (float32 for float16/bfloat16 inputs) with broadcastable int64 index tensors
            ``(B, 1, 1, 1)``, ``(1, H, 1, 1)``, ``(1, 1, rows, 1)``, ``(1, 1, 1, keys)``: it
            must be elementwise, and may return its input, a view of it, its input written in
            place, a new tensor, or one that broadcasts to it (see the module docstring).
            Differentiable, captured tensors included.
        block_mask: a :class:`BlockMask` from :func:`create_block_mask`, a torch ``BlockMask``
            (its ``mask_mod``, sizes and block table are used), or None (every pair). Masked
            pairs stay masked whatever ``score_mod`` returns there.
        scale: multiplies ``q k^T``; default ``1 / sqrt(D)``.
        enable_gqa: must be True when ``Hkv < H`` (each ``H / Hkv`` query heads share a
            key/value head), as in torch.
        return_lse: also return the log-sum-exp ``(B, H, Q_LEN)`` (torch's older form).
        kernel_options: torch's kernel tuning; accepted, and changes nothing here (a
            ``BACKEND`` torch does not name, ``OUTPUT_LOGSUMEXP`` and ``OUTPUT_MAX`` are
            refused, as torch refuses them).
        return_aux: ``AuxRequest(lse=True)``: return ``(out, AuxOutput(lse=...))``.

    Returns:
        ``out (B, H, Q_LEN, Dv)`` in query's dtype; ``(out, lse)`` with ``return_lse``;
        ``(out, aux)`` with ``return_aux``. A query that sees no key gets output 0 (and lse
        ``-inf``), with zero gradients.
    """
    query, key, value = _check_4d("query", query), _check_4d("key", key), _check_4d("value", value)
    key, value = _as_query_dtype(query, key, value)
    b, h, q_len, _ = query.shape
    kb, hkv, kv_len, _ = key.shape
    if value.size(0) != kb:
        raise ValueError(
            f"key and value must share their batch size: key {shape_str(key.shape)}, value "
            f"{shape_str(value.shape)}"
        )
    if kb != b:
        if kb != 1:
            raise ValueError(
                f"key and value must have the batch size of query ({b}) or 1, got key "
                f"{shape_str(key.shape)}"
            )
        key, value = key.expand(b, *key.shape[1:]), value.expand(b, *value.shape[1:])
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {enable_gqa!r}")
    if hkv != h and not enable_gqa:
        raise ValueError(
            f"query has {h} heads and key/value {hkv}: pass enable_gqa=True for grouped-query "
            "attention (as torch's flex_attention requires)"
        )
    _check_kernel_options(kernel_options)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    if return_aux is not None:
        if return_lse:
            raise ValueError("pass return_aux=AuxRequest(lse=True) or return_lse=True, not both")
        if not hasattr(return_aux, "lse"):
            raise TypeError(f"return_aux must be an AuxRequest or None, got {return_aux!r}")
        if getattr(return_aux, "max_scores", False):
            raise ValueError(
                "return_aux=AuxRequest(max_scores=True) is not available in attnkit: its kernel "
                "keeps no per-row maximum of the modified scores"
            )
    mask = _mask_of(block_mask, b, h, q_len, kv_len, query.device)
    mod = check_score_mod(score_mod)
    if mod is not None:
        work = torch.promote_types(query.dtype, torch.float32)  # the dtype the mod sees
        check_elementwise(mod, Geometry((b,), h, q_len, kv_len, query.device, work))
    want_lse = return_lse or bool(getattr(return_aux, "lse", False))
    if scale is None:
        scale = 1.0 / math.sqrt(query.size(-1)) if query.size(-1) else 1.0
    if not want_lse:
        out = attention(query, key, value, mask=mask, scale=scale, score_mod=score_mod)
        return out if return_aux is None else (out, AuxOutput())
    out, lse = attention(
        query, key, value, mask=mask, scale=scale, score_mod=score_mod, return_lse=True
    )
    return (out, lse) if return_aux is None else (out, AuxOutput(lse=lse))
