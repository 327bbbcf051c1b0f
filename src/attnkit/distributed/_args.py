"""The arguments of a call across ranks: what each rank checks against its shard and what against
the whole sequence, the mask split into what every rank evaluates and the key masks that stay
with their keys, and what the ranks compare before anything moves."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from .._base.checks import shape_str
from .._call import AttentionCall, check_attention_args
from .._score_mod import describe as describe_score_mod
from ..masks import PARTIAL, Geometry, Mask, visibility
from ..scores import DistanceBias, RelativePositionTerm, ScoreTerm

__all__ = [
    "Travel",
    "describe",
    "leaves",
    "rebuild",
    "split_mask",
    "term_reasons",
    "validated",
    "whole_geometry",
]


class Travel(Mask):
    """Where a dense key mask stands in the call's mask until a pair binds it to the block of
    keys it computes with: known to its rank only, so to the shard plan every block is PARTIAL."""

    def __init__(self, index: int, shape: tuple[int, ...]) -> None:
        self.index, self.shape = index, shape

    def describe(self) -> str:
        return f"key mask shard {shape_str(self.shape)}"

    def tile(self, geo: Geometry, qs: int, qe: int, ks: int, ke: int) -> Tensor:
        raise RuntimeError("attnkit internal error: a traveling key mask asked before binding")

    def block_states(
        self, geo: Geometry, q: tuple[int, int, int], k: tuple[int, int, int]
    ) -> Tensor:
        nq, nk = len(range(*q)), len(range(*k))
        return torch.full((nq, nk), PARTIAL, dtype=torch.uint8)

    @property
    def keys_only(self) -> bool:
        return True


def leaves(mask: Mask) -> list[Mask]:
    if mask.op is None:
        return [mask]
    return [leaf for part in mask.parts for leaf in leaves(part)]


def rebuild(mask: Mask, leaf: Callable[[Mask], Mask]) -> Mask:
    """``mask`` with each of its leaves replaced by ``leaf(it)``, ``&`` and ``|`` kept."""
    if mask.op is None:
        return leaf(mask)
    parts = [rebuild(p, leaf) for p in mask.parts]
    return functools.reduce(operator.and_ if mask.op == "and" else operator.or_, parts)


def split_mask(
    mask: Mask | Tensor | None, kv_len: int
) -> tuple[Mask | None, list[Tensor], list[str]]:
    """The call's mask as every rank evaluates it (dense key masks that are this rank's shard
    replaced by stand-ins), the dense key masks that travel with their keys (as ``(X, H|1, 1,
    Tk)``), and the reasons the mask cannot run across ranks."""
    mask = visibility(mask, False)
    if mask is None:
        return None, [], []
    travel: list[Tensor] = []
    reasons: list[str] = []

    def leaf(m: Mask) -> Mask:
        t = m.tensor
        if t is None:
            return m
        if t.ndim >= 2 and t.size(-2) != 1:
            reasons.append(
                f"a dense mask {shape_str(t.shape)} depends on the query: give a key mask "
                "(..., 1, Tk) sharded like the keys, or the mask as a structured one that "
                "describes the whole sequence (attnkit.masks)"
            )
            return m
        if t.size(-1) == 1 or t.ndim == 0:
            return m  # the same for every key: every rank evaluates it as it is
        if t.size(-1) != kv_len:
            reasons.append(
                f"a dense key mask {shape_str(t.shape)} is this rank's shard of the keys: its "
                f"last dimension must be the shard's Tk = {kv_len}"
            )
            return m
        t4 = t.reshape((1,) * max(0, 4 - t.ndim) + tuple(t.shape))
        travel.append(t4.reshape(-1, *t4.shape[-3:]))
        return Travel(len(travel) - 1, tuple(t.shape))

    return rebuild(mask, leaf), travel, reasons


_OPENSPEECH = (
    "openspeech's position term reads absolute encodings of the whole sequence in one "
    "process; give the Transformer-XL form (RelativePositionTerm(qv, enc, scale))"
)


def _check_rank_term(bias: object, q: object) -> None:
    """A position term refused for what ranks make of it, before the call's own check of the
    term (which knows nothing of ranks) could word it otherwise."""
    if not isinstance(bias, RelativePositionTerm) or not isinstance(q, Tensor) or q.dim() < 3:
        return
    if bias.legacy:
        raise ValueError(_OPENSPEECH)
    want = (math.prod(q.shape[:-3]), q.size(-3), q.size(-2))
    if tuple(bias.qv.shape[:3]) != want:
        raise ValueError(
            f"bias: the position term's qv {shape_str(bias.qv.shape)} must be this rank's "
            f"rows of the position queries, (B, H, Tq, Dh) with (B, H, Tq) = {shape_str(want)}"
        )


def term_reasons(term: ScoreTerm | None, geo: Geometry, batch: int) -> list[str]:
    """Why a score term cannot run across ranks, for a call of ``geo`` (the whole sequence)
    whose ranks hold ``batch`` rows and ``Tq`` queries each (empty when it can)."""
    if isinstance(term, RelativePositionTerm):
        return [_OPENSPEECH] if term.legacy else []
    if isinstance(term, DistanceBias):
        try:
            term.check(geo)
        except ValueError as err:
            return [f"{err} (distances of the whole sequence)"]
    return []


def describe(
    call: AttentionCall,
    structure: Mask | None,
    travel: list[Tensor],
    sinks: Tensor | None = None,
) -> dict[str, object]:
    """What must agree between the ranks: shapes, masks, flags, and the sinks' values (``(H,)``,
    held whole by every rank: a rank with other sinks would weigh its rows differently)."""
    term = call.score_term
    sink_values: object = call.sinks
    if sinks is not None and sinks.device.type != "meta":
        sink_values = sinks.detach().tolist()
    return {
        "q shape": (*call.batch_shape, call.num_heads, call.q_len, call.qk_dim),
        "k shape": (*call.batch_shape, call.num_kv_heads, call.kv_len, call.qk_dim),
        "v shape": (*call.batch_shape, call.num_kv_heads, call.kv_len, call.v_dim),
        "dtype": str(call.dtype).removeprefix("torch."),
        "device type": call.device.type,
        "mask": None if structure is None else repr(structure),
        "key mask shape": [tuple(t.shape) for t in travel] or None,
        "scale": call.scale,
        "softcap": call.softcap,
        "sinks": sink_values,
        "dropout_p": call.dropout_p,
        "return_lse": call.return_lse,
        "score term": None
        if term is None
        else (term.describe(), [tuple(t.shape) for t in term.inputs()]),
        "score_mod": None if call.score_mod is None else describe_score_mod(call.score_mod),
    }


def _flat_parts(mask: object) -> list[Mask]:
    return leaves(mask) if isinstance(mask, Mask) else []


def validated(
    q: object,
    k: object,
    v: object,
    *,
    mask: object,
    bias: object,
    causal: object,
    scale: object,
    softcap: object,
    sinks: object,
    dropout_p: object,
    return_lse: object,
    score_mod: object,
    world: int,
) -> AttentionCall:
    """The call as this rank sees it: its tensors and dense key mask checked against its shard,
    its structured masks and score term against the whole sequence."""
    dense = [p.tensor for p in _flat_parts(mask) if p.tensor is not None]
    if isinstance(mask, Tensor):
        dense = [mask]
    local = None
    for t in dense:
        local = t if local is None else local & t
    _check_rank_term(bias, q)
    call = check_attention_args(
        q, k, v, mask=local, bias=bias, causal=False, scale=scale, softcap=softcap, sinks=sinks,
        dropout_p=dropout_p, return_lse=return_lse, score_mod=score_mod,
    )  # fmt: skip
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    whole = whole_geometry(call, world)
    for part in _flat_parts(mask):
        if part.tensor is None:
            part.check(whole, "mask")
    reasons = term_reasons(call.score_term, whole, 0)
    if reasons:
        raise ValueError("; ".join(reasons))
    given = mask if isinstance(mask, Mask) else None
    return replace(
        call,
        mask=visibility(mask, causal),  # type: ignore[arg-type]
        given_mask=given if given is not None else call.given_mask,
        causal=causal,
    )


def whole_geometry(call: AttentionCall, world: int) -> Geometry:
    """The whole sequence's call, of which ``call`` is one of ``world`` ranks' shards."""
    return Geometry(
        call.batch_shape,
        call.num_heads,
        call.q_len * world,
        call.kv_len * world,
        call.device,
        torch.promote_types(call.dtype, torch.float32),
    )
