"""A call in the native operators' terms: a block plan and the call's numbers as the arguments of
``torch.ops.attnkit.native_forward`` and its backward, and the calls themselves.

The plan is :mod:`attnkit._kernel`'s (:class:`~attnkit._kernel.plan.BlockPlan`, cut for this
kernel by :mod:`attnkit._kernel.native_plan`); which kernel serves a call is decided there too
(:mod:`attnkit._kernel.choice`). Here: what the operators compute themselves (:func:`fuses`), the
dtypes they read as they are, the CPU's bfloat16 products, and :class:`NativeCall`, which marshals
a call's tensors and settings into an operator call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._base.env import choice
from .._base.quantized import QUANTIZED
from .._kernel.plan import BlockPlan
from ..masks import Geometry
from ..scores import DistanceBias, RelativePositionTerm, ScoreTerm, softcap_form
from . import load, ready
from .ops import no_graph

__all__ = [
    "BF16_DOT",
    "BF16_GROUP_DOTS",
    "BF16_PRODUCTS",
    "DECODE_QUERIES",
    "MATRIX_UNIT",
    "REDUCED",
    "NativeCall",
    "cpu_has",
    "fuses",
    "native_call",
    "scale_rows",
]

#: The dtypes of keys and values that the native kernel reads as they are, computing in float32.
REDUCED = (torch.bfloat16, torch.float16)

#: A call of at most this many queries, all in one query block, runs on the native kernel's decode
#: path (``csrc/decode.cpp``, its ``kDecodeQueries``): split across threads by keys, each key/value
#: head's keys and values read once for all its query heads, NaN and inf in q, k and v handled
#: without reading them beforehand.
DECODE_QUERIES = 16


def cpu_has(check: str) -> bool:
    """torch.cpu's ``check`` (``"_is_amx_tile_supported"``...; absent: no), where torch runs its
    AVX-512 kernels: the native kernel's bfloat16 products are in that build alone (see
    csrc/matrix_unit.h), and so are torch's own on the matrix unit."""
    try:
        avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    except (AttributeError, RuntimeError):
        avx512 = False
    return avx512 and bool(getattr(torch.cpu, check, lambda: False)())


# Whether this CPU has a matrix unit for bfloat16 (AMX tiles), read once: the kernel runs a
# bfloat16 call's products there (see csrc/matrix_unit.h).
MATRIX_UNIT = cpu_has("_is_amx_tile_supported")
# Whether it has AVX512-BF16 (every CPU with AMX has): without the matrix unit the kernel runs
# those products as AVX512-BF16's dot products (AMD's Zen 4 on, Intel's Cooper Lake).
BF16_DOT = cpu_has("_is_avx512_bf16_supported")


def _amd() -> bool:
    """Whether the CPU is AMD's (Linux's /proc/cpuinfo; elsewhere, or unreadable: no)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip() == "AuthenticAMD"
    except OSError:
        pass
    return False


def _bf16_dots_outrun_fma() -> bool:
    # As csrc/matrix_unit.h's bf16_dots_outrun_fma decides: $ATTNKIT_BF16_DOTS, else the vendor.
    if not BF16_DOT:
        return False
    word = choice("ATTNKIT_BF16_DOTS", ("auto", "always", "never"), "auto")
    return word == "always" if word != "auto" else _amd()


#: Whether the decode path runs a step of more than 8 query rows per key/value head (grouped
#: heads, latent attention's absorbed form) of bfloat16 queries, keys and values on AVX512-BF16's
#: dot products, the weights rounded to bfloat16 for ``p v`` (csrc/decode_group.h): where those
#: outrun float32 FMAs (AMD's cores; ``ATTNKIT_BF16_DOTS=always|never`` fixes it).
BF16_GROUP_DOTS = _bf16_dots_outrun_fma()

#: Where the native kernel runs a bfloat16 call's products (products of bfloat16 summed in
#: float32), in words; None: in float32, on bfloat16 converted to float32.
BF16_PRODUCTS = (
    "the CPU's matrix unit (AMX)"
    if MATRIX_UNIT
    else "AVX512-BF16's dot products"
    if BF16_DOT
    else None
)


def fuses(term: ScoreTerm | None, geo: Geometry | None = None) -> bool:
    """Whether the native kernel computes a score term itself: Transformer-XL's position term
    (:class:`~attnkit.scores.RelativePositionTerm`, not openspeech's variant) with ``qv`` of shape
    ``(B, H, Tq, Dh)`` for the call's ``geo``, whose product ``qv @ enc^T`` the kernel takes per
    block over the block's distances and reads with the shift as index arithmetic; or a bias by
    distance (:class:`~attnkit.scores.DistanceBias`), read as a bias whose rows are stretches of
    its table."""
    if term is None or isinstance(term, DistanceBias):
        return True
    if not isinstance(term, RelativePositionTerm) or term.legacy:
        return False
    qv, enc = term.qv, term.enc
    if qv.dim() != 4 or enc.dim() != 3 or qv.size(-1) != enc.size(-1):
        return False
    return geo is None or (tuple(qv.shape[:3]) == (geo.batch, geo.heads, geo.q_len))


@dataclass(frozen=True)
class NativeCall:
    """One call's plan and mask in the native kernel's terms (built once, used by the forward
    and the backward): the arguments of ``torch.ops.attnkit.native_forward`` besides the
    call's tensors."""

    plan: BlockPlan
    scale: float
    softcap: float  # 0: none
    p_drop: float
    seed: int
    #: the position term's (scale, distance of enc's first row, whole_width), or None
    position: tuple[float, int, int] | None = None
    #: a bias by distance's layout in its table (see DistanceBias.layout), or [] for none
    layout: tuple[int, ...] = ()
    #: how the kernel runs its products (the same numbers to rounding): float32 products in its
    #: own register tiles rather than the BLAS, and the position term along the diagonals of
    #: the scores rather than per block's window of distances (both where the build has AVX-512).
    #: register_tiles also lets a bfloat16 call run its products as bfloat16 (BF16_PRODUCTS:
    #: the CPU's matrix unit, AMX, or AVX512-BF16), with the probabilities rounded to bfloat16 for
    #: ``p v``; False keeps them float32.
    register_tiles: bool = True
    skewed_position: bool = True

    # The plan's parts, as the operators take them.
    @property
    def off(self) -> Tensor:
        return self.plan.offsets

    @property
    def visits(self) -> Tensor:
        return self.plan.visits

    @property
    def block_q(self) -> int:
        return self.plan.block_q

    @property
    def block_k(self) -> int:
        return self.plan.block_k

    @property
    def band(self) -> list[float]:
        return [] if self.plan.band is None else [float(x) for x in self.plan.band]

    @property
    def shift(self) -> int:
        return self.plan.shift

    @property
    def key_ok(self) -> Tensor | None:
        return self.plan.key_ok

    @property
    def tiles(self) -> Tensor | None:
        return self.plan.tiles

    def settings(self) -> dict[str, object]:
        """The operators' keyword arguments for this call."""
        rel_scale, top, whole = self.position if self.position is not None else (0.0, 0, 0)
        plan = self.plan  # (read once: the properties above are its fields)
        return {
            "block_q": plan.block_q,
            "block_k": plan.block_k,
            "scale": self.scale,
            "softcap": self.softcap,
            "bias_layout": list(self.layout),
            "band": [] if plan.band is None else [float(x) for x in plan.band],
            "shift": plan.shift,
            "stretch": plan.stretch,
            "dropout_p": self.p_drop,
            "seed": self.seed,
            "rel_scale": rel_scale,
            "rel_top": top,
            "whole_width": whole,
            "register_tiles": self.register_tiles,
            "skewed_position": self.skewed_position,
        }

    def reads_as_is(self, dtype: torch.dtype, backward: bool = False) -> bool:
        """Whether the kernel takes keys and values of ``dtype`` as they are: in the forward
        bfloat16 and float16, half the bytes of float32, converted to float32 in registers (the
        decode path) or block by block (the blocked forward), or multiplied as they are where
        the CPU has bfloat16 products (BF16_PRODUCTS); in the backward bfloat16, for those (the
        kernel otherwise converts them). Their gradients come in float32."""
        return dtype in REDUCED and (not backward or dtype == torch.bfloat16)

    def tensors(
        self,
        q5: Tensor,
        k4: Tensor,
        v4: Tensor,
        bias5: Tensor | None,
        term_inputs: tuple[Tensor, ...],
        backward: bool = False,
        reduced_out: bool = False,
    ) -> tuple[Tensor | None, ...]:
        """The operators' positional tensors, with contiguous rows: ``(q, k, v, offsets, visits,
        bias, key_ok, tiles, qv, enc)``, all in the work dtype but bfloat16/float16 keys and
        values that the forward reads as they are (see :meth:`reads_as_is`), and with
        ``reduced_out`` bfloat16 queries with such keys and values: the forward then gives its
        output in bfloat16 (no float32 copy of the queries or the output)."""
        work = torch.promote_types(q5.dtype, torch.float32)
        kv = k4.dtype if self.reads_as_is(k4.dtype, backward) and v4.dtype == k4.dtype else work
        if k4.dtype in QUANTIZED and not backward:  # read as they are, with their scales
            kv = k4.dtype
        reduced = reduced_out and not backward and q5.dtype == kv == torch.bfloat16
        qv = enc = None
        if self.position is not None:
            qv, enc = _rows(term_inputs[0], work), _rows(term_inputs[1], work)
        bias = None if bias5 is None else bias5.to(work)
        if self.layout:  # a bias by distance: its table
            bias = term_inputs[0].to(work).contiguous()
        plan = self.plan
        return (
            _rows(q5, torch.bfloat16 if reduced else work),
            _rows(k4, kv),
            _rows(v4, kv),
            plan.offsets,
            plan.visits,
            bias,
            plan.key_ok,
            plan.tiles,
            qv,
            enc,
        )

    def forward(
        self,
        q5: Tensor,
        k4: Tensor,
        v4: Tensor,
        bias5: Tensor | None,
        term_inputs: tuple[Tensor, ...] = (),
        reduced_out: bool = False,
        scales: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(out5, lse)`` in the work dtype, as :func:`attnkit._kernel.forward` returns them
        (``term_inputs``: the position term's ``(qv, enc)``, or a bias by distance's table);
        with ``reduced_out``, out5 in bfloat16 when q, k and v are (see :meth:`tensors`).
        ``scales``: int8/float8 k4 and v4's ``(k_scale, v_scale)``, float32 ``(N, Hkv, Tk)``
        (see :func:`scale_rows`), which the decode path reads with them."""
        if not (ready() or load()):  # (loaded already by the call's choice of kernel)
            raise RuntimeError("attnkit internal error: native call without the native kernel")
        args = self.tensors(q5, k4, v4, bias5, term_inputs, reduced_out=reduced_out)
        if scales is not None:
            args = (*args, *scales)
        with no_graph(args):
            out, lse = torch.ops.attnkit.native_forward(*args, **self.settings())
        return out, lse

    def stats(
        self,
        q5: Tensor,
        k4: Tensor,
        bias5: Tensor | None,
        lse: Tensor,
        term_inputs: tuple[Tensor, ...] = (),
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(key_mass, key_max, entropy)`` of the call, ``(N, Hkv, G, Tk)``, ``(N, Hkv, G, Tk)``
        and ``(N, Hkv, G, Tq)`` in the work dtype, from its rows' natural-log log-sum-exp ``lse``
        ``(N, Hkv, G, Tq)`` (see :mod:`attnkit._kernel.stats`): one pass over the plan, keys in
        the work dtype (bfloat16 and float16 ones converted first)."""
        if not (ready() or load()):  # (loaded already by the call's choice of kernel)
            raise RuntimeError("attnkit internal error: native call without the native kernel")
        work = torch.promote_types(q5.dtype, torch.float32)
        k4 = k4.to(work)
        args = self.tensors(q5, k4, k4[..., :0], bias5, term_inputs)
        lse = lse.to(work).contiguous()
        with no_graph(args):
            mass, top, entropy = torch.ops.attnkit.native_stats(lse, *args, **self.settings())
        return mass, top, entropy

    def backward(
        self,
        q5: Tensor,
        k4: Tensor,
        v4: Tensor,
        bias5: Tensor | None,
        dout5: Tensor,
        lse: Tensor,
        delta: Tensor,
        bias_grad: bool,
        term_inputs: tuple[Tensor, ...] = (),
        term_grads: tuple[bool, ...] = (),
        grads_out: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, list[Tensor | None]]:
        """``(dq5, dk4, dv4, dbias5, dterm)`` in the work dtype (``dbias5`` in ``bias5``'s shape;
        ``dterm``: the gradients of ``term_inputs`` that ``term_grads`` asks for, else None).
        ``grads_out``: tensors of q5's, k4's and v4's shapes to write dq5, dk4 and dv4 into (used
        when the inputs are in the work dtype with contiguous rows)."""
        if not (ready() or load()):  # (loaded already by the call's choice of kernel)
            raise RuntimeError("attnkit internal error: native call without the native kernel")
        work = torch.promote_types(q5.dtype, torch.float32)
        qv_grad, enc_grad = term_grads if self.position is not None else (False, False)
        table_grad = bool(self.layout) and term_grads[0]
        args = self.tensors(q5, k4, v4, bias5, term_inputs, backward=True)
        own = grads_out is not None and all(
            a is b for a, b in zip(args[:3], (q5, k4, v4), strict=True)
        )
        head = (_rows(dout5, work), lse.to(work).contiguous(), delta.to(work).contiguous())
        flags = {
            "bias_grad": table_grad or (bias_grad and bias5 is not None),
            "qv_grad": qv_grad,
            "enc_grad": enc_grad,
        }
        if own and grads_out is not None:
            dq, dk, dv = grads_out
            dbias, dqv, denc = torch.ops.attnkit.native_backward_into(
                *head, dq, dk, dv, *args, **self.settings(), **flags
            )
        else:
            dq, dk, dv, dbias, dqv, denc = torch.ops.attnkit.native_backward(
                *head, *args, **self.settings(), **flags
            )
        # dbias is already in bias5's shape (a bias by distance's: in its table's)
        asked = flags["bias_grad"]
        dterm: list[Tensor | None] = []
        if self.position is not None:
            dterm = [dqv if qv_grad else None, denc if enc_grad else None]
        elif self.layout:
            dterm, dbias = [dbias if table_grad else None], None
        return dq, dk, dv, (dbias if asked and not self.layout else None), dterm


def scale_rows(scale: Tensor, k: Tensor, n: int) -> Tensor:
    """A scale broadcastable to ``(*batch, Hkv, Tk, 1)`` of quantized keys or values ``k``
    ``(*batch, Hkv, Tk, D)`` as the operators read it: float32 ``(N, Hkv, Tk)`` (``N`` the batch
    flattened), strides 0 where it is broadcast (no copy of a scale per head)."""
    ks = k.shape
    if scale.dtype == torch.float32 and len(ks) == 4 and scale.shape == (*ks[:-1], 1):
        return scale.select(-1, 0)  # (a scale per row already: the same view, made directly)
    rows = scale.to(torch.float32).expand(*k.shape[:-1], 1)[..., 0]
    return rows.reshape(n, k.size(-3), k.size(-2))


def _rows(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype`` with contiguous rows (its last dimension), at any other strides: the
    kernel reads rows at their stride, so a ``(B, T, H, D)`` view needs no copy."""
    if t.dtype != dtype:
        t = t.to(dtype)
    shape, stride = t.shape, t.stride()
    unit = stride[-1] == 1 or shape[-1] <= 1
    apart = len(shape) < 2 or shape[-2] <= 1 or stride[-2] >= max(shape[-1], 1)
    if unit and apart:
        return t
    # (an empty tensor is contiguous to torch at any strides: k[..., :0] of keys expanded along
    # Tk keeps their stride 0, which .contiguous() would return as it is)
    return t.contiguous() if t.numel() else t.new_empty(t.shape)


def native_call(
    plan: BlockPlan,
    geo: Geometry,
    *,
    scale: float,
    softcap: float | None,
    dtype: torch.dtype,
    p_drop: float = 0.0,
    seed: int = 0,
    term: ScoreTerm | None = None,
    groups: int = 1,
    register_tiles: bool = True,
    skewed_position: bool = True,
) -> NativeCall:
    """A whole call in the native kernel's terms: its ``plan`` (cut for this kernel, see
    :func:`attnkit._kernel.planning.block_plan`) and its numbers (``geo``: the geometry the plan
    covers, where a score term is read; ``dtype``: the inputs', which decides how a softcap is
    computed, see :func:`attnkit.scores.softcap_form`; ``groups``: query heads per key/value
    head; ``register_tiles``, ``skewed_position``: see :class:`NativeCall`)."""
    work = torch.promote_types(dtype, torch.float32)
    form = None if softcap is None else softcap_form(softcap, work)
    return NativeCall(
        plan=plan,
        scale=float(scale),
        softcap=0.0 if form is None else float(form.cap),
        p_drop=float(p_drop),
        seed=seed,
        position=_position(term, geo),
        layout=tuple(term.layout(geo, groups)) if isinstance(term, DistanceBias) else (),
        register_tiles=register_tiles,
        skewed_position=skewed_position,
    )


def _position(term: ScoreTerm | None, geo: Geometry) -> tuple[float, int, int] | None:
    if term is None or isinstance(term, DistanceBias):
        return None
    if not isinstance(term, RelativePositionTerm) or term.legacy:
        raise RuntimeError(f"attnkit internal error: the native kernel cannot fuse {term!r}")
    return float(term.scale), int(term.top(geo)), term.whole_width
