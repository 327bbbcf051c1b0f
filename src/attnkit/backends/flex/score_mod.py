"""What a call adds to its scores, as one FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)``.

In the order of :func:`attnkit.backends.reference.formula`, on the scaled scores: the softcap,
then what the call adds (a dense ``bias``, or a score term), then the call's own ``score_mod``.
What is added is one tensor made once per call and read by index in the kernel:

* a dense ``bias`` broadcastable to ``(..., H, Tq, Tk)``: read at ``[b, h, q_idx, kv_idx]``
  (broadcast dims as zero strides: never copied);
* a :class:`~attnkit.scores.DistanceBias` (ALiBi, T5's and Swin's learned tables): its table
  ``(B, H, L)``, read at the pair's distance;
* Transformer-XL's :class:`~attnkit.scores.RelativePositionTerm`: the products ``q . r`` of each
  query with the encodings of the distances the mask leaves visible, ``(B, H, Tq, W)`` (``W`` the
  window's width under a sliding window: O(T W), not O(T^2)), read at the pair's distance;
* any other score term: its dense form ``(B|1, H|1, Tq, Tk)``.

Gradients reach the added tensor as FlexAttention's captured buffers, and through it what it was
made from (the table, ``q + v`` and the encodings). The tensor sits in the returned function's
own closure, where :func:`attnkit._score_mod.captured_tensors` finds it too: attnkit's own
kernel runs a lowered ``score_mod`` with the same gradients.

A pair the added term makes ``-inf`` is masked, as in the formula; the call's ``score_mod`` sees
0 there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..._call import AttentionCall
from ..._score_mod import ScoreMod
from ...masks import Geometry
from ...scores import DistanceBias, RelativePositionTerm, ScoreTerm, cap_scores

__all__ = ["Added", "added_term", "lower_scores", "relative_width"]


@dataclass(frozen=True)
class Added:
    """One tensor added to the scores and how a pair reads it: ``"pair"`` at ``[b, h, q_idx,
    kv_idx]``; ``"distance"`` at ``[b, h, kv_idx - q_idx + offset]``; ``"relative"`` at ``[b, h,
    q_idx, kv_idx - q_idx + offset]`` where that lies in ``[0, W)``, else 0."""

    values: Tensor
    read: str
    offset: int = 0
    what: str = ""


def relative_width(term: RelativePositionTerm, geo: Geometry, reach: tuple[float, float]) -> int:
    """How many distances the relative term's products hold per query: the encodings' rows that
    the visible distances ``reach`` (bounds on ``j - i'``) can read."""
    first, last = _relative_rows(term, geo, reach)
    return max(0, last - first)


def _relative_rows(
    term: RelativePositionTerm, geo: Geometry, reach: tuple[float, float]
) -> tuple[int, int]:
    # enc's row for the pair (i', j) is top - (i' - j) = top + (j - i')
    top, rows = term.top(geo), term.enc.size(1)
    lo = -(geo.kv_len - 1) if reach[0] == -math.inf else int(max(reach[0], -(geo.kv_len - 1)))
    hi = geo.q_len - 1 if reach[1] == math.inf else int(min(reach[1], geo.q_len - 1))
    return max(0, top + lo), min(rows, top + hi + 1)


def added_term(
    term: ScoreTerm, geo: Geometry, reach: tuple[float, float], work: torch.dtype
) -> Added:
    """``term`` for the call ``geo`` as one tensor a score_mod reads; ``reach``: bounds on the
    visible distances ``j - i'`` (the mask's :meth:`~attnkit.masks.Mask.distances`)."""
    geo = Geometry(geo.batch_shape, geo.heads, geo.q_len, geo.kv_len, geo.device, work)
    n, heads = geo.batch, geo.heads
    if type(term) is DistanceBias:
        term.check(geo)
        table = term.table.to(geo.device, work)
        table = table.reshape((1,) * (3 - table.ndim) + tuple(table.shape))
        values = table.expand(n, heads, table.size(-1))
        # distance kv - (q + shift) is entry distance - first
        return Added(values, "distance", -geo.shift - term.first, term.describe())
    if type(term) is RelativePositionTerm and not term.legacy:
        first, last = _relative_rows(term, geo, reach)
        qv = term.qv.reshape(n, heads, geo.q_len, -1).to(work)
        enc = term.enc[:, first : max(first, last)].to(geo.device, work)
        product = (qv @ enc.transpose(-1, -2).unsqueeze(0)) * term.scale  # (B, H, Tq, W)
        # row of the pair: top + kv - (q + shift), from the first one made
        return Added(product, "relative", term.top(geo) - geo.shift - first, term.describe())
    dense = term.dense(term.inputs(), geo)  # (B|1, H|1, Tq, Tk)
    return Added(dense.expand(n, heads, geo.q_len, geo.kv_len), "pair", 0, term.describe())


def added_bias(bias: Tensor, geo: Geometry, work: torch.dtype) -> Added:
    """A dense ``bias`` broadcastable to ``(..., H, Tq, Tk)``, its batch dims flattened."""
    nb = len(geo.batch_shape)
    t = bias.to(work).reshape((1,) * max(0, nb + 3 - bias.ndim) + tuple(bias.shape))
    lead = t.shape[:nb]
    if all(s == 1 for s in lead):
        t = t.reshape(1, *t.shape[nb:])
    else:
        t = t.expand(*geo.batch_shape, *t.shape[nb:]).reshape(geo.batch, *t.shape[nb:])
    values = t.expand(geo.batch, geo.heads, geo.q_len, geo.kv_len)
    if geo.kv_len > 1 and values.stride(-1) == 0 and values.stride(-2) == 0:
        # One value for all of a head's scores: inductor's FlexAttention fails to build such a
        # captured tensor (strides 0 in both of the scores' dims), so the keys' dim holds it
        # Tk times.
        values = t.expand(*t.shape[:-1], geo.kv_len).contiguous().expand_as(values)
    return Added(values, "pair", 0, "bias")


def lower_scores(
    call: AttentionCall, bias: Tensor | None, work: torch.dtype
) -> tuple[ScoreMod | None, Added | None]:
    """The call's softcap, bias or score term and ``score_mod`` as one score_mod (None: the
    scores stay as they are), and what it adds."""
    geo = call.geometry
    added = None
    if bias is not None:
        added = added_bias(bias, geo, work)
    elif call.score_term is not None:
        reach = (-math.inf, math.inf) if call.mask is None else call.mask.distances(geo)
        added = added_term(call.score_term, geo, reach, work)
    if call.softcap is None and added is None:
        return call.score_mod, None
    return _composed(call.softcap, added, call.score_mod), added


def _composed(softcap: float | None, added: Added | None, user: ScoreMod | None) -> ScoreMod:
    values = None if added is None else added.values
    read = "" if added is None else added.read
    offset = 0 if added is None else added.offset

    def lowered(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        s = score if softcap is None else cap_scores(score, softcap)
        if values is None:
            return s if user is None else user(s, b, h, q_idx, kv_idx)
        if read == "pair":
            term = values[b, h, q_idx, kv_idx]
        elif read == "distance":
            term = values[b, h, kv_idx - q_idx + offset]
        elif values.size(-1) == 0:  # the table holds none of the visible distances
            term = torch.zeros_like(s)
        else:
            at = kv_idx - q_idx + offset
            inside = (at >= 0) & (at < values.size(-1))
            at = at.clamp(0, max(values.size(-1) - 1, 0))
            term = torch.where(inside, values[b, h, q_idx, at], 0.0)
        if user is None:
            return s + term
        # the formula's order: a pair the term masks is 0 under the score_mod, then masked
        hidden = term == -math.inf
        s = user(torch.where(hidden, 0.0, s + term), b, h, q_idx, kv_idx)
        return torch.where(hidden, -math.inf, s)

    return lowered
