"""The chunked backend: attnkit's kernel (:mod:`attnkit._kernel`) as an ``attention()`` backend.

Exact attention in O(T * block) memory, forward and backward, in plain PyTorch: structured masks
skip the blocks they hide (a causal call does about half the work, a sliding window a fixed amount
per query), score terms are computed tile by tile, and softcap and sinks have exact gradients. It
returns no weights (``reference`` does). Dropout costs no memory: both kernels regenerate the same
mask block by block from one seed per call (:mod:`attnkit._kernel.dropout`).

On CPUs, fully visible stretches of the block plan that at least 768 queries share (every pair of
the stretch may attend, and nothing is added to the scores) are computed by torch's fused CPU
attention kernel, the one behind its SDPA, and merged with the rest of each row by log-sum-exp:
a call without a mask is one fused call, and the inside of long documents or of a prefix-LM's
prefix runs at the fused kernel's speed. Its backward is given the call's final output and
log-sum-exp, so it computes exactly those keys' share of the gradients.

``attnkit.backends.Chunked(block_q=..., block_k=..., fused_rows=...)`` is the backend with other
block sizes: one ``(H, block_q, block_k)`` score block exists at a time, so smaller blocks use less
memory and cost more per-block overhead. ``fused_rows=None`` keeps every block in attnkit's own
kernel.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .._call import AttentionCall, finite
from .._checks import check_int, shape_str
from .._kernel import (
    FUSED_ROWS,
    Grads,
    Plan,
    Problem,
    backward,
    default_blocks,
    delta_of,
    draw_seed,
    finish,
    forward,
    fused_serves,
    make_plan,
    no_autocast,
    sink_grad,
    sizes,
    small_scores,
    split_runs,
)
from .._native import load as load_native
from .._native.kernel import NativeCall, fuses, native_call, why_not_native
from .._packing import joint_grads
from .._score_mod import ScoreMod, distance_bias_of, softcap_of
from .._score_mod import describe as describe_score_mod
from ..masks import Geometry, Mask
from ..scores import DistanceBias, ScoreTerm, softcap_form, term_error
from .base import Backend, CallInputs

__all__ = ["Chunked", "chunked_check", "fused_note", "kernel_attention", "native_serves"]


def _flatten_batch(t: Tensor, batch: tuple[int, ...], n: int) -> Tensor:
    """(...|1, X, Y, Z) broadcastable to (*batch, X, Y, Z) -> (B or 1, X, Y, Z)."""
    t = t.reshape((1,) * (len(batch) + 3 - t.ndim) + tuple(t.shape))
    lead = t.shape[: len(batch)]
    if all(s == 1 for s in lead):
        return t.reshape(1, *t.shape[len(batch) :])
    return t.expand(*batch, *t.shape[len(batch) :]).reshape(n, *t.shape[len(batch) :])


def _as_5d(t: Tensor, batch: tuple[int, ...], n: int, kv_heads: int) -> Tensor:
    """A bias broadcastable to ``(*batch, H, Tq, Tk)`` as ``(B|1, Hkv|1, G|1, Tq|1, Tk|1)``."""
    t = _flatten_batch(t, batch, n)
    return t.unsqueeze(2) if t.size(1) == 1 else t.unflatten(1, (kv_heads, -1))


def _unlayout_bias_grad(d5: Tensor, bias: Tensor, batch: tuple[int, ...]) -> Tensor:
    """(B|1, Hkv|1, G|1, Tq|1, Tk|1) gradient -> the bias's own (broadcast) shape and dtype."""
    d = d5.flatten(1, 2)
    lead = batch if d.size(0) != 1 else (1,) * len(batch)
    padded = (1,) * (len(batch) + 3 - bias.ndim) + tuple(bias.shape)
    d = d.reshape(*lead, *d.shape[1:]).sum_to_size(padded)
    return d.reshape(bias.shape).to(bias.dtype)


def _check_term(term: ScoreTerm, lse: Tensor) -> None:
    """Raise when a score term gave NaN or +inf at a visible pair (one host synchronisation).

    With finite q, k, v and term inputs (and a bias already checked), only the term can make a
    visible score NaN or +inf, and any such score makes its row's log-sum-exp NaN or +inf: one
    look at the ``(B, H, Tq)`` log-sum-exp replaces a pass over every tile. (Scores overflowing
    the work dtype, ``|q . k| * scale`` beyond 3e38 in float32, would read the same.)
    """
    if not lse.numel():
        return
    top = float(lse.max())  # NaN propagates through max; -inf rows (no visible key) are fine
    if math.isnan(top) or top == math.inf:
        raise term_error(term)


@dataclass(frozen=True)
class _Spec:
    """What the backward needs besides the saved tensors: the call, and its plan."""

    mask: Mask | None
    geo: Geometry
    plan: Plan
    scale: float
    softcap: float | None
    term: ScoreTerm | None
    careful: bool
    #: q, k, v and the term's inputs are finite: a non-finite log-sum-exp is the term's doing
    check_term: bool
    has_bias: bool
    has_sinks: bool
    n_term: int
    fused_rows: int | None
    native: NativeCall | None  # None: the eager kernel
    dropout: tuple[float, int] | None  # (p, seed), see attnkit._kernel.dropout
    score_mod: ScoreMod | None = None
    zero_offset: bool | None = None


def _layout(
    spec: _Spec, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, native: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """q, k, v and a dense bias in the kernel's layout (see :class:`Problem`); for the native
    kernel k and v stay ``(B, Hkv, Tk, D)``, views at the caller's strides where they can be."""
    batch = spec.geo.batch_shape
    n = spec.geo.batch
    hkv = k.size(-3)
    kv = (n, hkv) if native else (n * hkv,)
    return (
        q.reshape(n, hkv, q.size(-3) // hkv, q.size(-2), q.size(-1)),
        k.reshape(*kv, k.size(-2), k.size(-1)),
        v.reshape(*kv, v.size(-2), v.size(-1)),
        None if bias is None else _as_5d(bias, batch, n, hkv),
    )


def _problem(
    spec: _Spec,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    term_inputs: tuple[Tensor, ...],
    mod_inputs: tuple[Tensor, ...] = (),
) -> Problem:
    q5, k3, v3, bias5 = _layout(spec, q, k, v, bias)
    return Problem(
        q5=q5,
        k3=k3,
        v3=v3,
        scale=spec.scale,
        plan=spec.plan,
        geo=spec.geo,
        mask=spec.mask,
        bias5=bias5,
        softcap=spec.softcap,
        term=spec.term,
        term_inputs=term_inputs,
        careful=spec.careful,
        fused_rows=spec.fused_rows,
        dropout=spec.dropout,
        score_mod=spec.score_mod,
        mod_inputs=mod_inputs,
        zero_offset=spec.zero_offset,
    )


class _KernelAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        spec: _Spec,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        sinks: Tensor | None,
        *extra: Tensor,
    ) -> tuple[Tensor, Tensor]:
        hkv = k.size(-3)
        # extra: the score term's inputs, then the tensors the score_mod captures
        term_inputs, mod_inputs = extra[: spec.n_term], extra[spec.n_term :]
        with no_autocast(q.device):
            if spec.native is not None:
                q5, k4, v4, bias5 = _layout(spec, q, k, v, bias, native=True)
                out5, lse = spec.native.forward(q5, k4, v4, bias5, term_inputs)
            else:
                out5, lse = forward(_problem(spec, q, k, v, bias, term_inputs, mod_inputs))
            if spec.check_term and spec.term is not None:
                _check_term(spec.term, lse)
            sinks2 = None if sinks is None else sinks.view(hkv, -1)
            out5, lse = finish(out5, lse, sinks2)
        # (B, Hkv, G, Tq, Dv) laid out as (B, Tq, H, Dv): a view of q's shape, like torch's SDPA.
        out = out5.flatten(1, 2).reshape(*q.shape[:-1], v.size(-1)).to(q.dtype)
        optional = [t for t in (bias, sinks) if t is not None]
        # The backward's rowsum(dO * O) takes O before rounding (see kernel.delta_of).
        ctx.save_for_backward(q, k, v, out5, lse, *optional, *extra)
        ctx.spec = spec  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)
        # (B, Hkv, G, Tq) -> (..., H, Tq): the natural-log log-sum-exp, the sinks' share included.
        return out, lse.flatten(1, 2).reshape(q.shape[:-1]).clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dout: Tensor | None, dlse: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        spec: _Spec = ctx.spec  # type: ignore[attr-defined]
        q, k, v, out5, lse, *rest = ctx.saved_tensors  # type: ignore[attr-defined]
        bias = rest.pop(0) if spec.has_bias else None
        sinks = rest.pop(0) if spec.has_sinks else None
        term_inputs, mod_inputs = tuple(rest[: spec.n_term]), tuple(rest[spec.n_term :])
        needs = ctx.needs_input_grad  # type: ignore[attr-defined]
        with no_autocast(q.device):
            # dout is None when only the log-sum-exp is used.
            dout5 = out5.new_zeros(out5.shape) if dout is None else dout.reshape(out5.shape)
            delta = delta_of(out5, dout5)
            if dlse is not None:
                # d lse / d s = the softmax: the score gradient P * (dP - delta) gains P * dlse.
                delta = delta - dlse.reshape(lse.shape).to(delta.dtype)
            bias_grad = bias is not None and needs[4]
            if spec.native is not None:
                q5, k4, v4, bias5 = _layout(spec, q, k, v, bias, native=True)
                joint = joint_grads(q, k, v)
                dq, dk, dv, dbias5, dterm5 = spec.native.backward(
                    q5,
                    k4,
                    v4,
                    bias5,
                    dout5,
                    lse,
                    delta,
                    bias_grad,
                    term_inputs,
                    tuple(needs[6 : 6 + spec.n_term]),
                    None if joint is None else _layout(spec, *joint, None, native=True)[:3],
                )
                grads = Grads(dq, dk, dv, dbias5, dterm5)
            else:
                grads = backward(
                    _problem(spec, q, k, v, bias, term_inputs, mod_inputs),
                    out5,
                    lse,
                    delta,
                    dout5,
                    bias_grad=bias_grad,
                    term_grads=any(needs[6 : 6 + spec.n_term]),
                )
            dsinks = None
            if sinks is not None and needs[5]:
                groups = sinks.view(out5.size(1), -1)
                dsinks = sink_grad(lse, delta, groups).reshape(sinks.shape)
        dbias = None
        if grads.dbias5 is not None and bias is not None:
            dbias = _unlayout_bias_grad(grads.dbias5, bias, spec.geo.batch_shape)
        # An input no tile reached (no queries, every block skipped) gets zeros, not None.
        dterm = [
            (torch.zeros_like(t) if need else None) if g is None else g.to(t.dtype)
            for g, t, need in zip(
                [*grads.dterm, *grads.dmod], [*term_inputs, *mod_inputs], needs[6:], strict=True
            )
        ]
        return (
            None,
            grads.dq.reshape(q.shape).to(q.dtype),
            grads.dk.reshape(k.shape).to(k.dtype),
            grads.dv.reshape(v.shape).to(v.dtype),
            dbias,
            None if dsinks is None else dsinks.to(sinks.dtype),  # type: ignore[union-attr]
            *dterm,
        )


# Function.apply is untyped in torch; give it its type once.
_apply: Callable[..., tuple[Tensor, Tensor]] = _KernelAttention.apply


# The native kernel's default blocks (banded masks, others): its score buffer stays in L2. A
# band's visits are cut at the band's own edges (see attnkit._native.kernel), so its key blocks
# need not be narrow to skip what the band hides.
NATIVE_BLOCKS = {True: (128, 256), False: (128, 256)}


def plan_for(
    mask: Mask | None,
    geo: Geometry,
    groups: int,
    term: bool,
    block_q: int | None = None,
    block_k: int | None = None,
    native: bool = False,
) -> Plan:
    """The block plan of a whole call, with the default block sizes where none are given (those
    of the native kernel when ``native``)."""
    banded = mask is not None and mask.distances(geo)[1] < math.inf
    bq, bk = NATIVE_BLOCKS[banded] if native else default_blocks(banded, groups, geo.q_len, term)
    return make_plan(
        mask,
        geo,
        q_start=0,
        q_len=geo.q_len,
        k_start=0,
        kv_len=geo.kv_len,
        block_q=block_q or bq,
        block_k=block_k or bk,
    )


# The plans of recent calls (see Mask.plan_key): a training or serving loop calls with one mask
# and one geometry again and again, and making a long call's plan in Python costs a tenth of its
# attention or more. Each entry holds its mask, so a key made of a tensor's id names that tensor.
# At most 16 plans and 2^17 visits in all (a few dozen MiB of Python objects at most).
_PLANS: OrderedDict[Hashable, tuple[Mask | None, Plan, NativeCall | None, int]] = OrderedDict()
_PLANS_KEPT = 16
_PLANS_VISITS = 1 << 17
_PLANS_LOCK = threading.Lock()


def _planned(
    mask: Mask | None,
    geo: Geometry,
    groups: int,
    term: bool,
    block_q: int | None,
    block_k: int | None,
    native: bool,
) -> tuple[Plan, NativeCall | None]:
    """:func:`plan_for`'s plan and, when ``native``, the native kernel's visits of it (a
    :class:`NativeCall` whose per-call numbers :func:`native_call` fills in), from the cache when
    an earlier call had the same mask (by :attr:`Mask.plan_key`) and geometry."""
    mask_key = "no mask" if mask is None else mask.plan_key
    key = None if mask_key is None else (mask_key, geo, groups, term, block_q, block_k, native)
    if key is not None:
        with _PLANS_LOCK:
            hit = _PLANS.get(key)
            if hit is not None:
                _PLANS.move_to_end(key)
                return hit[1], hit[2]
    plan = plan_for(mask, geo, groups, term, block_q, block_k, native=native)
    visits = None
    if native:
        visits = native_call(
            mask, geo, plan, scale=1.0, softcap=None, dtype=geo.dtype, groups=groups
        )
    size = plan.visited
    if key is not None and size <= _PLANS_VISITS:
        with _PLANS_LOCK:
            _PLANS[key] = (mask, plan, visits, size)
            held = sum(entry[3] for entry in _PLANS.values())
            while len(_PLANS) > _PLANS_KEPT or held > _PLANS_VISITS:
                held -= _PLANS.popitem(last=False)[1][3]
    return plan, visits


def kernel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | None,
    bias: Tensor | ScoreTerm | None,
    scale: float,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    fused_rows: int | None = FUSED_ROWS,
    is_finite: bool | None = None,
    return_lse: bool = False,
    score_mod: ScoreMod | None = None,
    captured: tuple[Tensor, ...] = (),
    native: bool = True,
    dropout_p: float = 0.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Run the kernel on a validated call (what the ``chunked`` backend does). ``is_finite``:
    whether q, k and v hold only finite values, if the caller knows (None: find out, in the same
    host read as the sizes that tell whether the kernel may take offset 0 throughout, see
    :func:`attnkit._kernel.sizes`). ``return_lse``: also return the natural-log log-sum-exp
    ``(..., H, Tq)`` (differentiable). ``score_mod``: applied to each tile; ``captured``: the
    tensors it captures that need gradients (they receive theirs).

    ``native``: use the native kernel where it computes the same thing (see
    :func:`native_serves`; never with a ``score_mod``). ``dropout_p``: both kernels drop the same
    pairs for a seed drawn here (:mod:`attnkit._kernel.dropout`)."""
    batch = tuple(q.shape[:-3])
    h, tq, _ = q.shape[-3:]
    hkv, tk, _ = k.shape[-3:]
    geo = Geometry(batch, h, tq, tk, q.device)
    term = bias if isinstance(bias, ScoreTerm) else None
    dense = bias if isinstance(bias, Tensor) else None
    term_inputs = () if term is None else tuple(term.inputs())
    zero_offset = None  # asked by the kernel's forward
    term_finite: bool | None = None
    # The native kernel serves the call if its inputs are finite (it has no careful mode).
    native_ok = score_mod is None and native_serves(q.device, term, False, native, geo)
    if is_finite is None and native_ok:
        # The native kernel needs to know only that q, k, v (and the term's inputs) are finite:
        # one host read (see attnkit._call.finite).
        is_finite = term_finite = finite(q, k, v, *term_inputs)
        if not is_finite and term_inputs:
            is_finite, term_finite = finite(q, k, v), None
    if is_finite is None:
        is_finite = True
        if q.numel() and k.numel() and v.numel():
            work = torch.promote_types(q.dtype, torch.float32)
            q_norm, k_norm, v_max = sizes(q, k, v, work).tolist()
            is_finite = math.isfinite(q_norm + k_norm + v_max)
            plain = is_finite and softcap is None and bias is None and score_mod is None
            zero_offset = plain and small_scores(q_norm, k_norm, v_max, scale, tk, work)
    careful = not is_finite
    seed = draw_seed() if dropout_p else 0
    served = native_ok and not careful
    plan, layout = _planned(mask, geo, h // hkv, term is not None, block_q, block_k, served)
    fast = None
    if layout is not None:
        fast = native_call(
            mask,
            geo,
            plan,
            scale=scale,
            softcap=softcap,
            dtype=q.dtype,
            p_drop=dropout_p,
            seed=seed,
            term=term,
            groups=h // hkv,
            layout_of=layout,
        )
    spec = _Spec(
        mask=mask,
        geo=geo,
        plan=plan,
        scale=scale,
        softcap=softcap,
        term=term,
        careful=careful,
        check_term=term is not None
        and not careful
        and (finite(*term_inputs) if term_finite is None else term_finite),
        has_bias=dense is not None,
        has_sinks=sinks is not None,
        n_term=len(term_inputs),
        fused_rows=fused_rows,
        native=fast,
        dropout=(dropout_p, seed) if dropout_p else None,
        score_mod=score_mod,
        zero_offset=zero_offset,
    )
    out, lse = _apply(spec, q, k, v, dense, sinks, *term_inputs, *captured)
    return (out, lse) if return_lse else out


def native_serves(
    device: torch.device,
    term: ScoreTerm | None,
    careful: bool,
    native: bool,
    geo: Geometry | None = None,
) -> bool:
    """Whether the native kernel runs a call: on CPUs, with no score term or one it fuses (see
    :func:`attnkit._native.kernel.fuses`), on finite q, k and v (the eager kernel handles
    non-finite inputs), when it is built (see :mod:`attnkit._native`).
    """
    return (
        native
        and device.type == "cpu"
        and fuses(term, geo)
        and not careful
        and load_native() is not None
    )


def fused_note(call: AttentionCall, plan: Plan, fused_rows: int | None) -> str | None:
    """What of a call's plan goes to torch's fused CPU kernel, for explain() (None: nothing)."""
    added = call.bias_shape is not None or call.score_term is not None or call.score_mod is not None
    work = torch.promote_types(call.dtype, torch.float32)
    capped = call.softcap is not None and softcap_form(call.softcap, work) is not None
    serves = fused_serves(
        call.device,
        call.dtype,
        call.qk_dim,
        call.v_dim,
        softcap=1.0 if capped else None,
        added=added,
    )
    if fused_rows is None or not serves or call.finite is False or call.dropout_p:
        return None
    runs, _ = split_runs(plan, fused_rows)
    if not runs:
        return None
    pairs = sum((v.r1 - v.r0) * (v.ke - v.ks) for b in plan.blocks for v in b.visits)
    fused = sum((r.qe - r.qs) * (r.ke - r.ks) for r in runs)
    calls = f"{len(runs)} call{'s' if len(runs) > 1 else ''}"
    return (
        f"torch's fused CPU kernel: {100 * fused / max(pairs, 1):.0f}% of the pairs in {calls} "
        f"(fully visible stretches of {fused_rows}+ queries, finite inputs)"
    )


def as_softcap(call: AttentionCall) -> float | None:
    """The cap ``c`` when the call's score_mod is exactly ``c * tanh(score / c)`` (see
    ``attnkit._score_mod.softcap_of``) and nothing comes before it in the scores (no
    ``softcap``, no ``bias``): the call is then the same as one with ``softcap=c``."""
    if call.score_mod is None or call.softcap is not None:
        return None
    if call.bias_shape is not None or call.score_term is not None:
        return None
    return softcap_of(call.score_mod)


def as_distance_bias(call: AttentionCall) -> DistanceBias | None:
    """The call's score_mod as a bias by distance (see ``attnkit._score_mod.distance_bias_of``)
    when nothing else adds to the scores (no ``bias``, no score term); None otherwise."""
    if call.score_mod is None or call.bias_shape is not None or call.score_term is not None:
        return None
    work = torch.promote_types(call.dtype, torch.float32)
    return distance_bias_of(call.score_mod, call.geometry, work)


def chunked_check(call: AttentionCall) -> list[str]:
    """Why the kernel cannot serve a call (empty when it can)."""
    reasons = []
    if torch.compiler.is_compiling():
        reasons.append(
            "torch.compile/export is tracing: its block loop would unroll per block and its "
            "block plan is computed from data"
        )
    if call.return_weights:
        reasons.append(
            "does not return attention weights (return_weights=True: only reference does)"
        )
    return reasons


class Chunked(Backend):
    """The chunked backend with chosen block sizes (default: sizes that run well on CPUs).

    It applies a call's ``score_mod`` tile by tile, forward and backward (see
    :mod:`attnkit._kernel.softmax`).

    ``fused_rows``: fully visible stretches of the block plan shared by at least this many queries
    go to torch's fused CPU kernel (see :mod:`attnkit.backends.chunked`); ``None``: never.
    ``native=False``: always the eager kernel, never the native one (:mod:`attnkit._native`); the
    native kernel runs every block itself, so ``fused_rows`` matters only to the eager one.

    >>> import torch, attnkit
    >>> q = torch.randn(1, 2, 100, 8)
    >>> small = attnkit.backends.Chunked(block_q=16, block_k=32)
    >>> out = attnkit.attention(q, q, q, causal=True, backend=small)
    >>> torch.allclose(out, attnkit.attention(q, q, q, causal=True, backend="reference"), atol=1e-6)
    True
    """

    accepts_score_mod = True

    def __init__(
        self,
        *,
        block_q: int | None = None,
        block_k: int | None = None,
        fused_rows: int | None = FUSED_ROWS,
        native: bool = True,
    ) -> None:
        super().__init__("chunked")
        if not isinstance(native, bool):
            raise TypeError(f"native must be a bool, got {native!r}")
        self.native = native
        # Sizes past any sequence mean the same as the sequence: they saturate.
        self.block_q = None if block_q is None else check_int("block_q", block_q, saturate=True)
        self.block_k = None if block_k is None else check_int("block_k", block_k, saturate=True)
        self.fused_rows = (
            None if fused_rows is None else check_int("fused_rows", fused_rows, saturate=True)
        )

    def check(self, call: AttentionCall) -> list[str]:
        return chunked_check(call)

    def notes(self, call: AttentionCall) -> list[str]:
        """The block plan of a structured mask, which kernel runs it ("native kernel" or why
        not), and the share of torch's fused CPU kernel (what can be told without data: nothing
        on ``meta`` tensors)."""
        if call.device.type == "meta":
            return []
        rewrite = []
        cap = as_softcap(call)
        if cap is not None and call.score_mod is not None:
            rewrite = [
                f"{describe_score_mod(call.score_mod)} recognised as softcap={cap} "
                f"(c * tanh(score / c) exactly): runs as attention(softcap={cap})"
            ]
            call = replace(call, softcap=cap, score_mod=None)
        by_distance = None if cap is not None else as_distance_bias(call)
        if by_distance is not None and call.score_mod is not None:
            table = shape_str(by_distance.table.shape)
            rewrite = [
                f"{describe_score_mod(call.score_mod)} recognised as score + a bias by distance "
                f"(of b, h, q_idx - kv_idx): runs as a DistanceBias, a {table} table"
            ]
            call = replace(call, score_mod=None, score_term=by_distance)
        term = call.score_term is not None
        why = why_not_native(call, self.native)
        plan = plan_for(
            call.mask,
            call.geometry,
            call.groups,
            term,
            self.block_q,
            self.block_k,
            native=why is None,
        )
        notes = [*rewrite, *([] if call.mask is None else [f"block plan: {plan.describe()}"])]
        if why is None:
            return [*notes, "native kernel"]
        fused = fused_note(call, plan, self.fused_rows)
        return [*notes, why, *([fused] if fused else [])]

    def run(self, call: AttentionCall, inputs: CallInputs) -> Tensor | tuple[Tensor, Tensor]:
        # A score_mod that is exactly a softcap runs as softcap=: in the native kernel, with no
        # Python per tile. It captures no tensor needing gradients (softcap_of refuses those).
        cap = None if inputs.captured else as_softcap(call)
        # A score_mod that adds a bias by distance runs as a DistanceBias: in the native kernel,
        # its table's gradient reaching what the score_mod read through the table's autograd.
        by_distance = None if cap is not None else as_distance_bias(call)
        mod = None if cap is not None or by_distance is not None else call.score_mod
        added = inputs.bias if inputs.bias is not None else call.score_term
        return kernel_attention(
            inputs.q,
            inputs.k,
            inputs.v,
            mask=call.mask,
            bias=added if by_distance is None else by_distance,
            scale=call.scale,
            softcap=call.softcap if cap is None else cap,
            sinks=inputs.sinks,
            block_q=self.block_q,
            block_k=self.block_k,
            fused_rows=self.fused_rows,
            is_finite=call.finite,
            return_lse=call.return_lse,
            native=self.native,
            dropout_p=call.dropout_p,
            score_mod=mod,
            captured=() if mod is None else inputs.captured,
        )

    def __repr__(self) -> str:
        sizes = [f"{n}={v}" for n, v in (("block_q", self.block_q), ("block_k", self.block_k)) if v]
        if self.fused_rows != FUSED_ROWS:
            sizes.append(f"fused_rows={self.fused_rows}")
        if not self.native:
            sizes.append("native=False")
        return f"Chunked({', '.join(sizes)})"
