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
import weakref
from dataclasses import replace

import torch
from torch import Tensor

from .._base.checks import check_int, shape_str
from .._base.devices import readable
from .._base.transforms import transforms_active
from .._call import AttentionCall
from .._kernel import FUSED_ROWS, BlockPlan, Plan, fused_serves, split_runs
from .._kernel.cache import (
    IN_PLACE,
    IndexedCache,
    in_place_refusal,
    indexed_cache,
    indexed_cache_attention,
    read_cache,
)
from .._kernel.call import kernel_attention
from .._kernel.choice import decode_sized, decodes, why_not_native
from .._kernel.gathered import gathered_note
from .._kernel.operator import traceable, traced_attention
from .._kernel.planning import decode_plan, planned
from .._native import loaded as native_loaded
from .._native import status as native_status
from .._native.kernel import BF16_GROUP_DOTS, BF16_PRODUCTS, DECODE_QUERIES
from .._record import note_kernel
from .._score_mod import captured_tensors, distance_bias_of, softcap_of
from .._score_mod import describe as describe_score_mod
from ..caches.view import band_of, row_mask, row_term
from ..scores import DistanceBias, softcap_form
from .base import Backend, CallInputs, Output, dequantized, dequantized_cost

__all__ = [
    "Chunked",
    "chunked_check",
    "fused_note",
    "kernel_attention",
]


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
        # While tracing, the call becomes one node of attnkit's operator (see
        # attnkit._kernel.operator), which takes what text and tensors can say.
        if call.score_mod is not None:
            reasons.append(
                "a score_mod cannot be traced into attnkit's operator (torch.compile/export is "
                "tracing)"
            )
        else:
            why = traceable(call.mask, call.score_term)
            if why is not None:
                reasons.append(f"{why} (torch.compile/export is tracing)")
    elif call.device.type == "meta":
        # On the meta device the operator's fake kernel gives the outputs' shapes (see run).
        # The mask and a score_mod change none of them; what the scores add may hold tensors
        # that need gradients, which the operator must be given to give them theirs.
        meta = "on the meta device, where attnkit's operator gives the outputs' shapes"
        if call.score_mod is not None and captured_tensors(call.score_mod):
            reasons.append(
                "a score_mod that captures tensors needing gradients cannot be traced into "
                f"attnkit's operator ({meta})"
            )
        elif traceable(None, call.score_term) is not None:
            reasons.append(f"{traceable(None, call.score_term)} ({meta})")
    if call.return_weights:
        reasons.append(
            "does not return attention weights (return_weights=True: only reference does)"
        )
    if call.forward_ad:
        reasons.append(
            "computes no forward-mode derivative (torch.func.jvp, torch.autograd.forward_ad): "
            "reference does"
        )
    if (
        call.requires_grad
        and call.finite is None
        and not torch.compiler.is_compiling()
        and transforms_active()
    ):
        # (describe_call could not read the values: a call under torch.func.vmap)
        reasons.append(
            "reads whether q, k and v hold NaN or inf before a call that needs gradients, which "
            "torch.func.vmap cannot (vmap over grad: per-example gradients)"
        )
    return reasons


class Chunked(Backend):
    """The chunked backend with chosen block sizes (default: sizes that run well on CPUs).

    It applies a call's ``score_mod`` tile by tile, forward and backward (see
    :mod:`attnkit._kernel.problem`).

    ``fused_rows``: fully visible stretches of the block plan shared by at least this many queries
    go to torch's fused CPU kernel (see :mod:`attnkit.backends.chunked`); ``None``: never.
    ``native=False``: always the eager kernel, never the native one (:mod:`attnkit._native`); the
    native kernel runs every block itself, so ``fused_rows`` matters only to the eager one.
    ``register_tiles=False``, ``skewed_position=False``: the native kernel runs its float32
    products in the BLAS rather than its own AVX-512 register tiles, and Transformer-XL's
    position term per block's window of distances rather than along the diagonals (the same
    numbers to rounding; for side-by-side measurements). ``register_tiles=False`` also keeps a
    bfloat16 call's products in float32 where the CPU could run them as bfloat16 (on its matrix
    unit, AMX, or with AVX512-BF16), which rounds the probabilities to bfloat16 for ``p v`` as
    torch's bfloat16 kernels do.

    >>> import torch, attnkit
    >>> q = torch.randn(1, 2, 100, 8)
    >>> small = attnkit.backends.Chunked(block_q=16, block_k=32)
    >>> out = attnkit.attention(q, q, q, causal=True, backend=small)
    >>> torch.allclose(out, attnkit.attention(q, q, q, causal=True, backend="reference"), atol=1e-6)
    True
    """

    accepts_score_mod = True
    accepts_cache = True
    # int8/float8 keys and values: read in place on the native decode path, else dequantized
    # first (see kernel_attention)
    reads_quantized = True

    def __init__(
        self,
        *,
        block_q: int | None = None,
        block_k: int | None = None,
        fused_rows: int | None = FUSED_ROWS,
        native: bool = True,
        register_tiles: bool = True,
        skewed_position: bool = True,
    ) -> None:
        super().__init__("chunked")
        # the last cache call the native kernel was found to read in place
        self._read_in_place: weakref.ref[AttentionCall] | None = None
        for name, flag in (
            ("native", native),
            ("register_tiles", register_tiles),
            ("skewed_position", skewed_position),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        self.native = native
        self.register_tiles = register_tiles
        self.skewed_position = skewed_position
        # Sizes past any sequence mean the same as the sequence: they saturate.
        self.block_q = None if block_q is None else check_int("block_q", block_q, saturate=True)
        self.block_k = None if block_k is None else check_int("block_k", block_k, saturate=True)
        self.fused_rows = (
            None if fused_rows is None else check_int("fused_rows", fused_rows, saturate=True)
        )

    def check(self, call: AttentionCall) -> list[str]:
        reasons = chunked_check(call)
        if (
            not call.requires_grad
            and call.cache is None
            and transforms_active()
            and not torch.compiler.is_compiling()
            and not (self.native and decode_sized(call.q_len, self.block_q))
        ):
            # Only the native decode path takes care of NaN and inf itself; every other
            # inference call is read for them first (and the eager kernel writes with out=,
            # which vmap has no rule for).
            reasons.append(
                "reads whether q, k and v hold NaN or inf before an inference call of more than "
                f"{DECODE_QUERIES} queries (the native decode path's), which torch.func.vmap "
                "cannot: backend='reference' runs it"
            )
        return reasons

    def slower(self, call: AttentionCall) -> list[str]:
        """The eager kernel, where the native one would not serve the call (never builds it); on
        a cache whose keys it cannot read in place, the gather of its rows' keys."""
        if call.cache is not None:
            why = self.cache_refusal(call)
            if why is None or isinstance(indexed_cache(call, self.native), IndexedCache):
                return []
            if not self._views_of_rows(call):
                return [f"gathers each row's keys from the cache ({why})"]
            call = self._dense(call, call.q_len, call.kv_len, None)
        why = why_not_native(self._rewritten(call)[0], self.native)
        return [] if why is None else [f"runs {why}"]

    def cache_refusal(self, call: AttentionCall, build: bool = False) -> str | None:
        """None when the native kernel reads a call's cache (:attr:`AttentionCall.cache`) where it
        lies; else why the call runs as dense calls on the rows' keys (views of a contiguous
        cache whose rows share their keys, else gathered). ``build``: as a call about to run,
        load the kernel (questions never build it)."""
        if torch.compiler.is_compiling():  # (nothing kept while traced: no guard on it)
            return self._cache_refusal(call, build)
        last = self._read_in_place
        if last is not None and last() is call and native_loaded():
            return None  # (auto asked just now, and the kernel is loaded: a step asks twice)
        why = self._cache_refusal(call, build)
        self._read_in_place = weakref.ref(call) if why is None else None
        return why

    def _cache_refusal(self, call: AttentionCall, build: bool) -> str | None:
        if call.cache is None:
            return "the call is not on a cache"
        if not self.native:
            return "native=False"
        if call.return_weights or call.dropout_p or call.score_mod is not None:
            return "weights, dropout or a score_mod, which the cache read does not apply"
        if call.bias_shape is not None or not (
            call.score_term is None or isinstance(call.score_term, DistanceBias)
        ):
            return "a bias other than a bias by distance, which the cache read does not add"
        if band_of(call.mask) is None:
            return f"a mask that is not a band ({call.mask.describe() if call.mask else ''})"
        view = call.cache
        if not view.k.size(2):  # (the kernel finds key j on page j // page)
            return "pages of no keys (page size 0), which hold no key to read"
        strides = (view.k.stride(-1), view.v.stride(-1))
        # (a stand-in of one zero, expanded, is what explain() describes: no page to read)
        strided = [
            t.stride(-1) != 1 and t.size(-1) > 1 and any(t.stride()) for t in (view.k, view.v)
        ]
        if any(strided):
            return f"pages whose rows are not contiguous (strides {strides} along D)"
        if view.quantized and call.dtype == torch.float64:
            return (
                f"float64 queries on {str(view.k.dtype).removeprefix('torch.')} pages (read in "
                "place for float32, bfloat16 and float16 queries)"
            )
        return in_place_refusal(
            device=call.device,
            dtype=call.dtype,
            requires_grad=call.requires_grad,
            q_len=call.q_len,
            shared_rows=view.shared and view.contiguous,
            build=build,
        )

    @staticmethod
    def _views_of_rows(call: AttentionCall) -> bool:
        """Whether a cache call's dense form is views of the cache (no gather, no dequantized
        copy)."""
        view = call.cache
        return view is not None and view.shared and view.block_table is None and not view.quantized

    @staticmethod
    def _dense(call: AttentionCall, q_len: int, kv_len: int, row: int | None) -> AttentionCall:
        """A cache call's dense call on row ``row``'s keys (every row's when None)."""
        rows = call.batch_shape if row is None else (1,)
        term = row_term(call.score_term, row)
        mask = call.mask if row is None or call.cache is None else row_mask(
            call.mask, call.cache, row, q_len
        )  # fmt: skip
        return replace(
            call, cache=None, batch_shape=rows, q_len=q_len, kv_len=kv_len, score_term=term,
            mask=mask,
        )  # fmt: skip

    def _rewritten(self, call: AttentionCall) -> tuple[AttentionCall, list[str]]:
        """The call as :meth:`run` serves it: a score_mod that is exactly a softcap runs as
        ``softcap=``, one that adds a bias by distance as a ``DistanceBias``; and the words that
        say so, for :meth:`notes`."""
        if call.score_mod is None:  # nothing to recognise
            return call, []
        cap = as_softcap(call)
        if cap is not None and call.score_mod is not None:
            said = (
                f"{describe_score_mod(call.score_mod)} recognised as softcap={cap} "
                f"(c * tanh(score / c) exactly): runs as attention(softcap={cap})"
            )
            return replace(call, softcap=cap, score_mod=None), [said]
        by_distance = as_distance_bias(call) if readable(call.device) else None
        if by_distance is not None and call.score_mod is not None:
            table = shape_str(by_distance.table.shape)
            said = (
                f"{describe_score_mod(call.score_mod)} recognised as score + a bias by distance "
                f"(of b, h, q_idx - kv_idx): runs as a DistanceBias, a {table} table"
            )
            return replace(call, score_mod=None, score_term=by_distance), [said]
        return call, []

    def notes(self, call: AttentionCall) -> list[str]:
        """The block plan of a structured mask, which kernel runs it ("native kernel" or why
        not), and the share of torch's fused CPU kernel (what can be told without data: nothing
        on ``meta`` tensors)."""
        if not readable(call.device):  # meta, or a device explain(device=...) describes
            return []
        if call.cache is not None:
            why = self.cache_refusal(call)
            if why is None:
                return [f"reads the cache in place: {native_status()[1]}"]
            indexed = indexed_cache(call, self.native)
            if isinstance(indexed, IndexedCache):
                return [indexed.words]
            if not self._views_of_rows(call):
                why = why if indexed is None else f"{why}; {indexed}"
                return [f"each row's keys gathered from the cache, one call a row or all ({why})"]
            dense = self._dense(call, call.q_len, call.kv_len, None)
            return [f"the rows' keys as views of the cache ({why})", *self.notes(dense)]
        call, rewrite = self._rewritten(call)
        # an index mask: its keys gathered, or why they are scanned
        index = gathered_note(call, self.native)
        if index is not None and index[0]:
            return [*rewrite, index[1]]
        rewrite += [] if index is None else [index[1]]
        why = why_not_native(call, self.native)
        plan = self.block_plan(call)
        notes = [*rewrite, *([] if call.mask is None else [f"block plan: {plan.describe()}"])]
        if call.quantized is not None and self._reads_in_place(call):
            notes.append(f"reads {call.quantized.describe()} in place on the native decode path")
        if why is None:
            # "native kernel", and where it is not loaded yet where it comes from
            kernel = native_status()[1]
            # An inference call's inputs are read when it runs, except on the decode path, which
            # takes care of NaN and inf itself.
            if call.finite is None and not decodes(plan):
                kernel += "; the eager kernel where q, k or v hold NaN or inf"
            if (
                BF16_PRODUCTS
                and call.dtype == torch.bfloat16
                and self.register_tiles
                and not decodes(plan)
            ):
                kernel += f"; its bfloat16 products on {BF16_PRODUCTS}"
            elif self._group_dots(call, plan):
                kernel += (
                    "; the query heads that share a key/value head take their products on "
                    "AVX512-BF16's dot products, the weights rounded to bfloat16"
                )
            return [*notes, kernel]
        fused = fused_note(call, plan.grid, self.fused_rows)
        return [*notes, why, *([fused] if fused else [])]

    def _group_dots(self, call: AttentionCall, plan: BlockPlan) -> bool:
        """Whether the native decode path runs a bfloat16 call's rows sharing a key/value head
        (more than 8 of them) on AVX512-BF16's dot products (see BF16_GROUP_DOTS)."""
        rows = call.q_len * (call.num_heads // max(call.num_kv_heads, 1))
        return (
            BF16_GROUP_DOTS
            and decodes(plan)
            and self.register_tiles
            and call.dtype == torch.bfloat16
            and call.quantized is None
            and rows > 8
        )

    def _reads_in_place(self, call: AttentionCall) -> bool:
        """Whether the native decode path reads a call's int8/float8 keys and values in place
        (else they are dequantized first: see attnkit._kernel.choice.quantized_refusal)."""
        if call.requires_grad or call.dtype == torch.float64 or call.cache is not None:
            return False
        if not readable(call.device) or not decode_sized(call.q_len, self.block_q):
            return False
        return why_not_native(self._rewritten(call)[0], self.native) is None

    def cost(self, call: AttentionCall) -> list[str]:
        """int8/float8 keys and values dequantized first, where the native decode path does not
        read them in place."""
        if call.quantized is None or self._reads_in_place(call):
            return []
        return [f"{dequantized_cost(call)}: only the native decode path reads them in place"]

    def block_plan(self, call: AttentionCall) -> BlockPlan:
        """The :class:`~attnkit.BlockPlan` this backend would run ``call`` with: the native
        kernel's where it would serve the call (see :func:`attnkit.explain`), else the eager
        kernel's. Made once per mask and geometry and kept (see
        :attr:`attnkit.masks.Mask.plan_key`). Never builds the native kernel; needs a real
        device (a ``meta`` call has no mask data)."""
        if call.device.type == "meta":
            raise ValueError(
                "a block plan reads the mask, which a call on the meta device does not hold; "
                "describe the call on a real device (explain(q, k, v) with q, k, v on it)"
            )
        native = why_not_native(call, self.native) is None
        mask, keys = call.mask, self.block_k
        # An inference call on the decode path (see decode_plan).
        if native and decode_sized(call.q_len, self.block_q) and not call.requires_grad:
            mask, keys = decode_plan(mask, call.geometry, keys)
        return planned(
            mask,
            call.geometry,
            call.groups,
            call.score_term is not None,
            self.block_q,
            keys,
            native,
        )

    def run(self, call: AttentionCall, inputs: CallInputs) -> Output:
        meta = inputs.q.device.type == "meta"
        if call.quantized is not None and (
            meta or torch.compiler.is_compiling()
        ):  # the native decode path alone reads int8/float8 keys and values in place
            call, inputs = dequantized(call, inputs)
        if call.cache is not None:
            return self._run_cache(call, inputs)
        if torch.compiler.is_compiling() or meta:
            # A meta tensor holds no values for the kernel to read (the plan, whether q, k and v
            # are finite): the operator's fake kernel gives the outputs' shapes, and its autograd
            # the gradients'. The mask and a score_mod (one capturing no tensor that needs
            # gradients, see chunked_check) change no shape: one the operator cannot be given (a
            # from_fn mask, a mask class of one's own, any score_mod) is left out there.
            mask = call.mask
            if meta and traceable(mask, None) is not None:
                mask = None
            out, lse = traced_attention(
                inputs.q,
                inputs.k,
                inputs.v,
                mask=mask,
                bias=inputs.bias,
                term=call.score_term,
                sinks=inputs.sinks,
                scale=call.scale,
                softcap=call.softcap,
                dropout_p=call.dropout_p,
                block_q=self.block_q,
                block_k=self.block_k,
                fused_rows=self.fused_rows,
                native=self.native,
                register_tiles=self.register_tiles,
                skewed_position=self.skewed_position,
            )
            return (out, lse) if call.return_lse else out
        # A score_mod that is exactly a softcap runs as softcap=: in the native kernel, with no
        # Python per tile. It captures no tensor needing gradients (softcap_of refuses those).
        cap = None if inputs.captured else as_softcap(call)
        # A score_mod that adds a bias by distance runs as a DistanceBias: in the native kernel,
        # its table's gradient reaching what the score_mod read through the table's autograd.
        by_distance = None if cap is not None else as_distance_bias(call)
        mod = None if cap is not None or by_distance is not None else call.score_mod
        added = inputs.bias if inputs.bias is not None else call.score_term
        quantized = call.quantized
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
            register_tiles=self.register_tiles,
            skewed_position=self.skewed_position,
            score_mod=mod,
            captured=() if mod is None else inputs.captured,
            kv_scales=None if quantized is None else (quantized.k_scale, quantized.v_scale),
        )

    def _run_cache(self, call: AttentionCall, inputs: CallInputs) -> Output:
        """A call on a cache: its pages read in place by the native kernel, else dense calls on
        the rows' keys (views or gathered, see :meth:`cache_refusal`), each served as any call."""
        view = call.cache
        if view is None:
            raise ValueError("attnkit internal error: a cache call without its cache view")
        if self.cache_refusal(call, build=True) is None:
            band = band_of(call.mask)
            term = call.score_term
            note_kernel(IN_PLACE)
            out, lse = read_cache(
                inputs.q,
                view.k,
                view.v,
                kv_range=view.kv_range,
                block_table=view.block_table,
                q_lens=view.q_lens,
                band=None if band == (-math.inf, math.inf) else band,
                scale=call.scale,
                softcap=call.softcap,
                bias=term if isinstance(term, DistanceBias) else None,
                sinks=inputs.sinks,
                k_scale=view.k_scale,  # int8/float8 pages: dequantized in registers
                v_scale=view.v_scale,
            )
            return (out, lse) if call.return_lse else out
        indexed = indexed_cache(call, self.native, build=True)
        if isinstance(indexed, IndexedCache):
            if not torch.compiler.is_compiling():  # (a graph records it when it runs)
                note_kernel(indexed.words)
            out, lse = indexed_cache_attention(call, indexed, inputs.q, inputs.sinks)
            return (out, lse) if call.return_lse else out

        def dense(q: Tensor, k: Tensor, v: Tensor, row: int | None) -> Output:
            sub = self._dense(call, q.size(2), k.size(2), row)
            return self.run(sub, replace(inputs, q=q, k=k, v=v))

        return view.attend_rows(inputs.q, dense, weights=False, lse=call.return_lse)

    def __repr__(self) -> str:
        sizes = [f"{n}={v}" for n, v in (("block_q", self.block_q), ("block_k", self.block_k)) if v]
        if self.fused_rows != FUSED_ROWS:
            sizes.append(f"fused_rows={self.fused_rows}")
        if not self.native:
            sizes.append("native=False")
        for name in ("register_tiles", "skewed_position"):
            if not getattr(self, name):
                sizes.append(f"{name}=False")
        return f"Chunked({', '.join(sizes)})"
