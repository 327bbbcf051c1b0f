"""Modules across a process group: each rank runs a model on its shard of the sequence.

:func:`sequence_parallel` sets ``sequence_shards`` on every module of a model that can run on a
shard (:class:`attnkit.MultiHeadAttention`, :class:`attnkit.RelativeMultiHeadAttention`,
:class:`attnkit.ConformerLayer` and its convolution module) to a :class:`SequenceParallel`: the
group, the layout and the attention strategy. Per-token parts (projections, feed-forwards, layer
norms) need nothing. What mixes positions goes across the ranks:

* attention through :func:`~attnkit.distributed.parallel_attention` (ring or all-to-all), its
  mask and score term at the whole sequence's positions;
* rotary angles and relative distances from the whole sequence's positions;
* a convolution over time reads ``kernel_size // 2`` frames of its neighbours on either side (the
  halo), sent point to point by the ranks that hold them, and their gradients sent back;
* BatchNorm's batch statistics are sums over every rank, so that they are the whole batch's.

The output and the gradients are each rank's shard of the model's on the whole sequence; the
parameters' gradients are each rank's share (all-reduce them, as ``DistributedDataParallel``
does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from ..masks import Mask
from ..modules._shards import SequenceShards
from ..scores import ScoreTerm
from ._comm import agree, require_group
from .layout import LAYOUTS, Layout, layout_of
from .strategy import parallel_attention

__all__ = ["SequenceParallel", "sequence_parallel"]

STRATEGIES = ("auto", "ring", "ulysses")


# --------------------------------------------------------------------------------------------------
# Sums over the ranks


class _Sum(torch.autograd.Function):
    """``x`` summed over the ranks. Every rank's loss reads the sum, so the gradient of a rank's
    ``x`` is the sum of the ranks' gradients of the sum: the backward is the same all-reduce."""

    @staticmethod
    def forward(ctx: Any, group: ProcessGroup | None, x: Tensor) -> Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return None, grad


# --------------------------------------------------------------------------------------------------
# The halo: the frames a convolution reads beyond a segment's ends


# One message: rank ``src`` sends its frames ``lo:lo+reach``, which land at rank ``dst`` on the
# ``side`` (0 left, 1 right) of its segment ``segment``.
_Message = tuple[int, int, int, int, int]


def _messages(lay: Layout, length: int, reach: int) -> list[_Message]:
    """Every rank's halo messages, in one order that every rank computes alike (so that nccl,
    which matches messages by order, and gloo, by tag, agree)."""
    size = length // lay.per_rank
    if size < reach:
        raise ValueError(
            f"the convolution reads {reach} frames on either side, more than one chunk of the "
            f"layout holds ({size} frames: a shard of {length} in {lay.per_rank} chunks); use "
            "longer shards, fewer ranks or a layout of fewer chunks (contiguous)"
        )
    found: list[_Message] = []
    for dst in range(lay.world_size):
        for segment, (_, start, n) in enumerate(lay.segments(dst, length)):
            first, last = start // size, (start + n) // size - 1
            for side, chunk in ((0, first - 1), (1, last + 1)):
                if not 0 <= chunk < lay.count:
                    continue  # past the sequence's end: zeros, as a "same" padding's
                src = lay.owner(chunk)
                lo = lay.chunks[src].index(chunk) * size + (size - reach if side == 0 else 0)
                found.append((src, lo, dst, segment, side))
    return found


def _global(group: ProcessGroup | None, rank: int) -> int:
    # P2POp takes global ranks, which differ from a subgroup's own.
    return rank if group is None else dist.get_global_rank(group, rank)


def _post(group: ProcessGroup | None, ops: list[dist.P2POp]) -> None:
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


class _Halo(torch.autograd.Function):
    """``(S, 2, ..., reach)``: each of this rank's ``S`` segments' frames beyond its left and
    right ends. The backward sends each halo's gradient back to the rank that holds its frames."""

    @staticmethod
    def forward(
        ctx: Any,
        group: ProcessGroup | None,
        rank: int,
        messages: list[_Message],
        segments: int,
        reach: int,
        x: Tensor,
    ) -> Tensor:
        out = x.new_zeros(segments, 2, *x.shape[:-1], reach)
        ops, landed = [], []
        for tag, (src, lo, dst, segment, side) in enumerate(messages):
            if src == rank and dst == rank:
                out[segment, side] = x[..., lo : lo + reach]
            elif src == rank:
                frames = x[..., lo : lo + reach].contiguous()
                ops.append(dist.P2POp(dist.isend, frames, _global(group, dst), group, tag))
            elif dst == rank:
                buffer = x.new_empty(*x.shape[:-1], reach)
                ops.append(dist.P2POp(dist.irecv, buffer, _global(group, src), group, tag))
                landed.append((segment, side, buffer))
        _post(group, ops)
        for segment, side, buffer in landed:
            out[segment, side] = buffer
        ctx.args = (group, rank, messages, reach, x.shape)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        group, rank, messages, reach, shape = ctx.args
        dx = grad.new_zeros(shape)
        ops, landed = [], []
        for tag, (src, lo, dst, segment, side) in enumerate(messages):
            if src == rank and dst == rank:
                dx[..., lo : lo + reach] += grad[segment, side]
            elif dst == rank:
                back = grad[segment, side].contiguous()
                ops.append(dist.P2POp(dist.isend, back, _global(group, src), group, tag))
            elif src == rank:
                buffer = grad.new_empty(*shape[:-1], reach)
                ops.append(dist.P2POp(dist.irecv, buffer, _global(group, dst), group, tag))
                landed.append((lo, buffer))
        _post(group, ops)
        for lo, buffer in landed:
            dx[..., lo : lo + reach] += buffer
        return None, None, None, None, None, dx


# Function.apply is untyped in torch; give it its type once.
_halo: Callable[..., Tensor] = _Halo.apply
_sum: Callable[..., Tensor] = _Sum.apply


# --------------------------------------------------------------------------------------------------
# The split


class SequenceParallel:
    """A sequence split across the ranks of ``group``, as the modules that hold its shards see it.

    Args:
        group: the process group; default the whole world.
        layout: which positions each rank holds: ``"contiguous"``, ``"zigzag"`` or a
            :class:`~attnkit.distributed.Layout` (see :func:`~attnkit.distributed.ring_attention`).
        strategy: of the attention calls: ``"auto"`` (the one that sends the least, see
            :func:`~attnkit.distributed.explain`), ``"ring"`` or ``"ulysses"``.

    :func:`sequence_parallel` gives it to a model's modules; it also serves as the
    ``sequence_parallel=`` of :func:`attnkit.integrations.transformers.register`. Making one needs
    no process group; using it does.
    """

    def __init__(
        self,
        group: ProcessGroup | None = None,
        *,
        layout: str | Layout = "contiguous",
        strategy: str = "auto",
    ) -> None:
        if not isinstance(layout, Layout) and (
            not isinstance(layout, str) or layout not in LAYOUTS
        ):
            raise ValueError(
                f"layout must be one of {', '.join(map(repr, LAYOUTS))} or a Layout, got {layout!r}"
            )
        if strategy not in STRATEGIES:
            raise ValueError(
                f"strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}"
            )
        if group is not None and not isinstance(group, ProcessGroup):
            raise TypeError(
                f"group must be a torch.distributed ProcessGroup or None, got {group!r}"
            )
        self.group, self.layout, self.strategy = group, layout, strategy

    @property
    def world_size(self) -> int:
        """The number of ranks in the group."""
        require_group(self.group, "SequenceParallel")
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        require_group(self.group, "SequenceParallel")
        return dist.get_rank(self.group)

    def placement(self) -> Layout:
        """The layout on this group's ranks."""
        return layout_of(self.layout, self.world_size)

    def segments(self, length: int) -> list[tuple[int, int, int]]:
        """The runs of consecutive positions this rank holds, ``(local start, global start,
        length)``, for a shard of ``length`` positions."""
        lay = self.placement()
        if length % lay.per_rank:
            raise ValueError(
                f"a shard of {length} positions does not divide into the layout's "
                f"{lay.per_rank} chunks per rank; shard with attnkit.distributed.Layout.shard"
            )
        return lay.segments(self.rank, length)

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | Mask | None = None,
        bias: ScoreTerm | None = None,
        causal: bool = False,
        scale: float | None = None,
        sinks: Tensor | None = None,
        dropout_p: float = 0.0,
        return_lse: bool = False,
        softcap: float | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """:func:`~attnkit.distributed.parallel_attention` with this split's group, layout and
        strategy: this rank's shard of the whole sequence's call (masks and score terms describe
        the whole sequence; a bool key mask is this rank's shard)."""
        return parallel_attention(
            q, k, v, mask=mask, bias=bias, causal=causal, scale=scale, softcap=softcap, sinks=sinks,
            dropout_p=dropout_p, return_lse=return_lse, layout=self.layout,
            strategy=self.strategy, group=self.group,
        )  # fmt: skip

    def halo(self, x: Tensor, reach: int) -> list[Tensor]:
        """Each of this rank's segments of ``x`` (``(..., T)``, time last) with the ``reach``
        frames of the whole sequence before and after it, zeros past the sequence's ends:
        ``(..., n + 2 reach)`` per segment, differentiable. The ranks that hold the frames send
        them (and receive their gradients in the backward)."""
        lay, rank = self.placement(), self.rank
        length = x.size(-1)
        error = None
        messages: list[_Message] = []
        try:
            if length % lay.per_rank:
                raise ValueError(
                    f"a shard of {length} frames does not divide into the layout's "
                    f"{lay.per_rank} chunks per rank"
                )
            messages = _messages(lay, length, reach) if reach else []
        except ValueError as err:
            error = str(err)
        description = {"shape": tuple(x.shape), "dtype": str(x.dtype), "reach": reach}
        agree(self.group, "halo exchange", error, description, shape_fields=("shape",))
        if error is not None:
            raise ValueError(f"halo exchange: {error}")
        segments = lay.segments(rank, length)
        if not reach:
            return [x[..., lo : lo + n] for lo, _, n in segments]
        halos = _halo(self.group, rank, messages, len(segments), reach, x)
        return [
            torch.cat([halos[s, 0], x[..., lo : lo + n], halos[s, 1]], dim=-1)
            for s, (lo, _, n) in enumerate(segments)
        ]

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of ``x`` over the ranks; its gradient is the sum of the ranks' gradients."""
        require_group(self.group, "SequenceParallel")
        return _sum(self.group, x)

    def __deepcopy__(self, memo: dict[int, object]) -> SequenceParallel:
        # A process group is not copied: a copied model stays on the same ranks.
        return self

    def __repr__(self) -> str:
        layout = self.layout if isinstance(self.layout, str) else self.layout.chunks
        return f"SequenceParallel(layout={layout!r}, strategy={self.strategy!r})"


# --------------------------------------------------------------------------------------------------
# A model's modules on the split

# torch's modules that mix positions and know nothing of a split: refused unless a module that
# runs on shards holds them (a ConformerConvolution's Conv1d and BatchNorm1d).
_MIXERS: tuple[type[nn.Module], ...] = (
    nn.MultiheadAttention,
    nn.RNNBase,
    nn.Conv1d,
    nn.BatchNorm1d,
    nn.SyncBatchNorm,
)


def _shardable(module: nn.Module) -> bool:
    return "sequence_shards" in dir(type(module))


def sequence_parallel(
    module: nn.Module,
    group: ProcessGroup | SequenceParallel | None = None,
    *,
    layout: str | Layout = "contiguous",
    strategy: str = "auto",
) -> nn.Module:
    """Run ``module`` on one rank's shard of the sequence, across the ranks of ``group``.

    Sets ``sequence_shards`` on every submodule that can run on a shard
    (:class:`~attnkit.MultiHeadAttention`, :class:`~attnkit.RelativeMultiHeadAttention`,
    :class:`~attnkit.ConformerLayer`, :class:`~attnkit.ConformerConvolution`) and returns
    ``module``, changed in place: its parameters and ``state_dict`` are untouched. Each rank then
    calls it with its shard of the inputs (``layout.shard(x, rank, dim=1)``); the output is its
    shard of the model's output on the whole sequence, and so are the inputs' gradients.

    Args:
        module: the model.
        group: the process group (default the whole world), or a :class:`SequenceParallel`
            (then ``layout`` and ``strategy`` are its own).
        layout: which positions each rank holds (``"contiguous"``, ``"zigzag"``, a
            :class:`~attnkit.distributed.Layout`).
        strategy: the attention's: ``"auto"``, ``"ring"`` or ``"ulysses"``.

    Masks passed to the modules follow :func:`~attnkit.distributed.ring_attention`'s rule: a bool
    padding mask is this rank's shard, structured masks describe the whole sequence.

    Raises:
        ValueError: ``module`` holds no module that runs on shards, or holds torch modules that
            mix positions and would see only the shard (``nn.MultiheadAttention``, recurrent
            layers, ``nn.Conv1d``, BatchNorm outside a Conformer's convolution module).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    split = (
        group
        if isinstance(group, SequenceParallel)
        else SequenceParallel(group, layout=layout, strategy=strategy)
    )
    named = list(module.named_modules())
    held = [name for name, m in named if _shardable(m)]
    if not held:
        raise ValueError(
            f"{type(module).__name__} holds no module that runs on a shard of the sequence "
            "(MultiHeadAttention, RelativeMultiHeadAttention, ConformerLayer)"
        )
    whole = "" in held  # the module itself runs on shards: it covers what it holds
    covered = tuple(f"{name}." for name in held if name)
    alone = [
        f"{name} ({type(m).__name__})"
        for name, m in named
        if isinstance(m, _MIXERS) and not whole and not name.startswith(covered)
    ]
    if alone:
        raise ValueError(
            "these modules mix positions and would see only this rank's shard: "
            + ", ".join(alone)
            + "; use attnkit's modules, which run across the ranks"
        )
    shards: SequenceShards = split  # the protocol the modules read
    for _, m in named:
        if _shardable(m):
            m.sequence_shards = shards
    return module
