"""Eviction: a cache compacted to chosen tokens, per batch row and key/value head.

H2O keeps the keys that received the most attention so far, SnapKV the keys a prompt's last
queries attend most: either way each key/value head keeps ``K`` of its ``L`` tokens, its own
ones. :func:`check_indices` checks the tokens chosen (every check before anything is written,
so a refused call changes nothing) and sorts them, so that the kept tokens stay in time order;
:func:`compact_rows` (a :class:`~attnkit.KVCache`'s rows) and :func:`compact_pages` (a
:class:`~attnkit.PagedKVCache` sequence's pages, through its block table) gather them and write
them to the first ``K`` positions. The keys move as they are stored: a key rotated at its
position (RoPE) keeps that rotation.

Shape letters: ``B`` batch rows, ``Hkv`` key/value heads, ``L`` tokens held, ``K`` tokens kept,
``X`` pages of a pool, ``D`` a head size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .._base.checks import dtype_str, shape_str

__all__ = ["check_indices", "compact_pages", "compact_rows", "run_through"]


def check_indices(
    indices: object,
    lead: tuple[int, ...],
    length: int,
    what: str,
    device: torch.device | None = None,
) -> Tensor:
    """``indices`` ``(*lead, K)``: an integer tensor of tokens ``0 .. length - 1``, none twice in
    a row (``what`` names the argument and the cache's shape, for the messages), that can be
    moved to the cache's ``device`` (where given; not meta for a real cache). Returns them
    sorted along ``K``, as int64 on their device."""
    if (
        not isinstance(indices, Tensor)
        or indices.is_floating_point()
        or indices.is_complex()
        or indices.dtype == torch.bool
    ):
        got = dtype_str(indices.dtype) if isinstance(indices, Tensor) else type(indices).__name__
        raise TypeError(f"{what} must be an integer tensor, got {got}")
    if indices.ndim != len(lead) + 1 or tuple(indices.shape[:-1]) != lead:
        raise ValueError(
            f"{what} must have shape ({', '.join(map(str, lead))}, K) (the same K tokens kept "
            f"in every row and head), got {shape_str(indices.shape)}"
        )
    if indices.size(-1) > length:
        raise ValueError(
            f"{what} keeps {indices.size(-1)} tokens of a row of {length}: at most {length}"
        )
    if device is not None:  # (before a caller drops a stage: a refused keep changes nothing)
        _check_device(indices, device)
    index = indices.long().sort(-1).values
    if index.numel() and index.device.type != "meta":
        bad = (index < 0) | (index >= length)
        if bool(bad.any()):
            at = tuple(bad.nonzero()[0].tolist())
            raise ValueError(
                f"{what}: the tokens kept must be from 0 to {length - 1} (the tokens held), got "
                f"{int(index[at])} in row {at[:-1]}"
            )
        twice = index[..., 1:] == index[..., :-1]
        if bool(twice.any()):
            at = tuple(twice.nonzero()[0].tolist())
            raise ValueError(
                f"{what}: row {at[:-1]} keeps token {int(index[at])} twice (each token is kept "
                "once)"
            )
    return index


def _check_device(index: Tensor, device: torch.device) -> None:
    """Indices elsewhere are moved to the cache's device; meta ones hold no values to move (the
    cache on meta reads none)."""
    if index.device.type == "meta" and device.type != "meta":
        raise ValueError(
            f"the tokens kept are on meta, which holds no values, but the cache is on {device}: "
            f"give the indices on {device}"
        )


def run_through(steps: Sequence[Callable[[], object]]) -> None:
    """Run ``steps`` in order, all of them: once the first has begun, an interrupt (a
    KeyboardInterrupt lands between any two operations) or another error in one does not stop
    the rest, which run before it propagates. Each step can run again (a copy from tensors read
    beforehand, bookkeeping that sets values), so that a move cut short never leaves the keys
    moved and the values not, or the tokens moved and the lengths not."""
    done = 0
    try:
        for step in steps:
            step()
            done += 1
    except BaseException:
        for step in steps[done:]:
            step()
        raise


def compact_rows(tensors: Sequence[Tensor], index: Tensor, then: Callable[[], None]) -> None:
    """Each of ``tensors`` ``(B, Hkv, L, *)`` (keys, values: any trailing sizes) gets, at its
    first ``K`` positions, its tokens ``index`` ``(B, Hkv, K)`` (sorted, checked); then
    ``then()`` (the cache's lengths), run through as :func:`run_through` says once the first
    write began (everything is read before)."""
    k = index.size(-1)
    _check_device(index, tensors[0].device)
    steps: list[Callable[[], object]] = []
    for t in tensors:
        where = index.to(t.device).reshape(*index.shape, *([1] * (t.ndim - 3)))
        kept = t.gather(2, where.expand(*index.shape, *t.shape[3:]))  # (B, Hkv, K, *): a copy
        steps.append(functools.partial(Tensor.copy_, t[:, :, :k], kept))
    run_through([*steps, then])


def compact_pages(
    tensors: Sequence[Tensor],
    pages: Sequence[int],
    index: Tensor,
    page_size: int,
    then: Callable[[], None],
) -> None:
    """Each of ``tensors`` ``(X, Hkv, page_size, *)`` (a pool's pages, head-major views) gets,
    at a sequence's first ``K`` positions, its tokens ``index`` ``(Hkv, K)`` (sorted, checked);
    token ``t`` of the sequence lies at row ``t % page_size`` of page ``pages[t // page_size]``.
    Then ``then()`` (the sequence's length and pages), run through as :func:`run_through` says
    once the first write began (everything is read before).
    """
    heads, k = index.shape
    device = tensors[0].device
    _check_device(index, device)
    if not k:
        then()
        return
    table = torch.tensor(list(pages), dtype=torch.int64, device=device)
    index = index.to(device)
    head = torch.arange(heads, device=device)[:, None]  # (Hkv, 1)
    src = (table[index // page_size], head, index % page_size)  # each (Hkv, K)
    to = torch.arange(k, device=device)[None, :]  # (1, K): the first K positions
    dst = (table[to // page_size], head, to % page_size)
    kept = [t[src] for t in tensors]  # (Hkv, K, *): copies, read before anything is written
    steps = [
        functools.partial(Tensor.index_put_, t, dst, x) for t, x in zip(tensors, kept, strict=True)
    ]
    run_through([*steps, then])
