"""``ConformerLayer``: the Conformer block (Gulati et al., 2020), padding-proof.

One block is two half-step feed-forwards around relative self-attention and a convolution module,
each a pre-norm residual, then a final LayerNorm::

    x = x + 1/2 · dropout(ff1(norm(x)))
    x = x + dropout(attn(norm(x)))          # RelativeMultiHeadAttention (Transformer-XL positions)
    x = x + dropout(conv(norm(x)))          # ConformerConvolution
    x = x + 1/2 · dropout(ff2(norm(x)))
    y = norm(x)

The convolution module is a pointwise projection to ``2 D`` channels and a GLU, a depthwise
convolution over time (``kernel_size``, odd, "same" padding), BatchNorm, Swish and a second
pointwise projection.

**Padding never reaches a real frame.** With a padding mask, a padded frame is read as zeros on
entry, it is a key no query may attend, and it is zeroed again right before the depthwise
convolution: the GLU writes ``pointwise1``'s bias into every frame, so a padded frame is not zero
there, and a plain convolution would hand it to the last ``(kernel_size - 1) / 2`` real frames of
each padded sequence. BatchNorm's batch statistics (in training) are taken over real frames only.
So the real frames' outputs do not depend on what the padded frames hold (NaN included), and in
eval mode a sequence gives the same outputs alone and padded next to a longer one (in training
BatchNorm's statistics come from every real frame of the batch, as BatchNorm's do). The outputs
at padded frames are not meaningful.

Shape letters: ``B`` batch, ``T`` frames, ``D`` d_model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import masks
from .._base.checks import (
    check_bool,
    check_input,
    check_int,
    check_positive,
    check_probability,
    shape_str,
)
from .._base.hints import torch_keywords, warn_torch_convention
from .._base.shapes import Bool, Float, shape_checked
from ..masks import Mask
from ._shards import SequenceShards
from .feedforward import PositionwiseFeedForward
from .relative import RelativeMultiHeadAttention

__all__ = ["ConformerConvolution", "ConformerLayer"]

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
}


def _check_activation(activation: object) -> str:
    if activation not in _ACTIVATIONS:
        known = ", ".join(repr(a) for a in _ACTIVATIONS)
        raise ValueError(f"activation must be one of {known}, got {activation!r}")
    return str(activation)


def _masked_batch_norm(
    x: Tensor, valid: Tensor, bn: nn.BatchNorm1d, total: Callable[[Tensor], Tensor] | None = None
) -> Tensor:
    """``bn(x)`` with batch statistics over the frames where ``valid`` (``(B, 1, T)``) is True.

    ``x`` is ``(B, C, T)``. The running statistics are updated as ``nn.BatchNorm1d`` updates them
    (momentum, or the cumulative average when it is None; the unbiased variance). ``total``: the
    sum over the ranks that hold the other frames of the batch (a sequence split across
    processes), so that the statistics are the whole batch's; the sums go through it in two
    passes, the mean's and then the centred squares', as in one process.
    """

    def whole(t: Tensor) -> Tensor:
        return t if total is None else total(t)

    n = int(whole(valid.sum()))  # a host sync, as BatchNorm's own check of the batch size
    if n < 2:
        raise ValueError(
            f"BatchNorm in training needs more than one real frame per channel, got {n}"
        )
    mean = whole(x.masked_fill(~valid, 0.0).sum((0, 2))) / n  # (C,)
    centred = (x - mean[:, None]).masked_fill(~valid, 0.0)
    var = whole(centred.square().sum((0, 2))) / n  # (C,) biased, as the normalisation uses
    if bn.training and bn.running_mean is not None and bn.running_var is not None:
        tracked = bn.num_batches_tracked
        if tracked is not None:
            tracked.add_(1)
        momentum = bn.momentum
        if momentum is None:
            momentum = 1.0 / float(tracked) if tracked is not None else 0.0
        with torch.no_grad():
            bn.running_mean.lerp_(mean.detach().to(bn.running_mean.dtype), momentum)
            unbiased = var.detach() * (n / (n - 1))  # Python floats: exact to the dtype
            bn.running_var.lerp_(unbiased.to(bn.running_var.dtype), momentum)
    out = (x - mean[:, None]) * torch.rsqrt(var[:, None] + bn.eps)
    if bn.weight is not None and bn.bias is not None:
        out = out * bn.weight[:, None] + bn.bias[:, None]
    return out


class ConformerConvolution(nn.Module):
    """The Conformer's convolution module: ``(B, T, D) -> (B, T, D)``.

    ``pointwise1`` (``D -> 2 D``) and a GLU (the first ``D`` channels times the sigmoid of the
    last ``D``), ``depthwise`` (one ``kernel_size`` filter per channel over time, zero "same"
    padding), ``norm`` (BatchNorm), the activation, ``pointwise2`` (``D -> D``).

    Args:
        d_model: ``D``.
        kernel_size: of the depthwise convolution, odd (31 in the paper).
        activation: ``"silu"`` (Swish, the paper's), ``"relu"`` or ``"gelu"``.
        bias: biases of the three convolutions.
        norm_eps, norm_momentum: of the BatchNorm.
        device, dtype: of the parameters.

    ``forward(x, valid=None)``: ``valid`` ``(B, T)`` bool, True at real frames; padded frames are
    zeroed before the depthwise convolution and left out of BatchNorm's batch statistics.

    On one rank's shard of a sequence split across processes (``sequence_shards``, set by
    :func:`attnkit.distributed.sequence_parallel`), the depthwise convolution reads the
    ``(kernel_size - 1) / 2`` frames beyond each end of the shard from the ranks that hold them,
    and BatchNorm's batch statistics in training are sums over every rank: the output is the
    shard of the module's on the whole sequence.
    """

    #: This rank's place in a sequence split across processes; ``None`` in one process.
    sequence_shards: SequenceShards | None = None

    def __init__(
        self,
        d_model: int,
        kernel_size: int = 31,
        *,
        activation: str = "silu",
        bias: bool = True,
        norm_eps: float = 1e-5,
        norm_momentum: float = 0.1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_model = check_int("d_model", d_model)
        self.kernel_size = check_int("kernel_size", kernel_size)
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (same padding), got {kernel_size}")
        self.activation = _check_activation(activation)
        bias = check_bool("bias", bias)
        self.pointwise1 = nn.Linear(d_model, 2 * d_model, bias=bias, device=device, dtype=dtype)
        self.depthwise = nn.Conv1d(
            d_model,
            d_model,
            kernel_size,
            padding=(kernel_size - 1) // 2,
            groups=d_model,
            bias=bias,
            device=device,
            dtype=dtype,
        )
        self.norm = nn.BatchNorm1d(
            d_model,
            eps=check_positive("norm_eps", norm_eps),
            momentum=check_probability("norm_momentum", norm_momentum),
            device=device,
            dtype=dtype,
        )
        self.pointwise2 = nn.Linear(d_model, d_model, bias=bias, device=device, dtype=dtype)

    def forward(self, x: Tensor, valid: Tensor | None = None) -> Tensor:
        h = F.glu(self.pointwise1(x), dim=-1).transpose(1, 2)  # (B, D, T)
        keep = None if valid is None else valid.unsqueeze(1)  # (B, 1, T)
        if keep is not None:
            h = h.masked_fill(~keep, 0.0)  # padded frames hold pointwise1's bias after the GLU
        shards = self.sequence_shards
        if h.size(-1) == 0:
            pass  # no frames, none to convolve: Conv1d refuses an input shorter than its kernel
        elif shards is None:
            h = self.depthwise(h)  # (B, D, T)
        else:
            h = self._depthwise_shard(h, shards)
        batch_statistics = self.norm.training or self.norm.running_mean is None
        if shards is not None and batch_statistics:
            keep = torch.ones_like(h[:, :1], dtype=torch.bool) if keep is None else keep
            h = _masked_batch_norm(h, keep, self.norm, shards.all_reduce)
        elif keep is not None and batch_statistics:
            h = _masked_batch_norm(h, keep, self.norm)
        else:
            h = self.norm(h)
        h = _ACTIVATIONS[self.activation](h).transpose(1, 2)  # (B, T, D)
        out: Tensor = self.pointwise2(h)
        return out

    def _depthwise_shard(self, h: Tensor, shards: SequenceShards) -> Tensor:
        """The depthwise convolution of this rank's ``(B, D, T)`` frames: each run of positions
        it holds, with the frames its kernel reaches beyond the run's ends (the halo) from the
        ranks that hold them, zeros past the sequence's ends as the "same" padding."""
        conv = self.depthwise
        reach = (self.kernel_size - 1) // 2
        runs = [
            F.conv1d(run, conv.weight, conv.bias, groups=conv.groups)
            for run in shards.halo(h, reach)
        ]
        return runs[0] if len(runs) == 1 else torch.cat(runs, dim=-1)

    def extra_repr(self) -> str:
        return f"{self.d_model}, kernel_size={self.kernel_size}, activation={self.activation!r}"


class ConformerLayer(nn.Module):
    """One Conformer block: ``(B, T, D) -> (B, T, D)``, with padding kept out of real frames.

    Args:
        d_model: ``D``.
        num_heads: heads of the relative self-attention attnkit builds (not with ``attention=``).
        d_ff: hidden units of each feed-forward; default ``4 * D``.
        kernel_size: of the depthwise convolution, odd (31 in the paper).
        dropout: on each sublayer's output and the feed-forwards' hidden units, in training only.
        attn_dropout: on the attention weights, in training only. Above 0 the attention takes its
            materialised path (``O(T^2)`` memory) in training, so it defaults to 0.
        activation: of the feed-forwards and the convolution module: ``"silu"`` (Swish, the
            paper's), ``"relu"`` or ``"gelu"``.
        bias: biases of the projections, feed-forwards and convolutions.
        layer_norm_eps: the LayerNorms' epsilon (ESPnet's are 1e-12).
        attention: a self-attention module built elsewhere, called as ``attention(x, mask=m)``
            with ``m`` a :class:`~attnkit.masks.Mask` (key padding, and the context window), e.g.
            a :class:`~attnkit.RelativeMultiHeadAttention` with ``encoding=`` or ``legacy=``.
        context: ``(left, right)``: each frame attends only the ``left`` frames before it and the
            ``right`` after it (limited context, for streaming and for long recordings: time then
            grows linearly with ``T`` and attention memory does not). ``None`` (default): every
            frame.
        device, dtype: of the parameters.

    Submodules: ``ff1_norm``, ``ff1``, ``attn_norm``, ``attn``, ``conv_norm``, ``conv``
    (:class:`ConformerConvolution`), ``ff2_norm``, ``ff2``, ``final_norm``.

    ``forward(x, *, mask=None)``: ``mask`` says which frames are real: a bool ``(B, T)`` or
    :func:`attnkit.masks.padding_mask`'s ``(B, 1, 1, T)`` (True = real frame), or
    :func:`attnkit.masks.key_padding`.

    >>> import torch, attnkit
    >>> layer = ConformerLayer(32, 4, kernel_size=7).eval()
    >>> x = torch.randn(2, 9, 32)
    >>> pad = attnkit.masks.padding_mask([9, 5])               # (B, 1, 1, T), True = real frame
    >>> y = layer(x, mask=pad)
    >>> torch.allclose(y[1, :5], layer(x[1:, :5])[0], atol=1e-5)   # alone = padded in a batch
    True

    On one rank's shard of a sequence split across processes
    (:func:`attnkit.distributed.sequence_parallel` sets ``sequence_shards`` on the layer and its
    attention and convolution modules), a bool ``mask`` is this rank's shard of the padding mask
    and :func:`attnkit.masks.key_padding` gives the whole sequence's lengths.
    """

    #: This rank's place in a sequence split across processes; ``None`` in one process.
    sequence_shards: SequenceShards | None = None

    def __init__(
        self,
        d_model: int,
        num_heads: int | None = None,
        d_ff: int | None = None,
        *,
        kernel_size: int = 31,
        dropout: float = 0.1,
        attn_dropout: float = 0.0,
        activation: str = "silu",
        bias: bool = True,
        layer_norm_eps: float = 1e-5,
        attention: nn.Module | None = None,
        context: tuple[int, int] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_model = check_int("d_model", d_model)
        d_ff = 4 * d_model if d_ff is None else d_ff
        self.dropout_p = check_probability("dropout", dropout)
        check_probability("attn_dropout", attn_dropout)
        activation = _check_activation(activation)
        bias = check_bool("bias", bias)
        eps = check_positive("layer_norm_eps", layer_norm_eps)
        if attention is None:
            if num_heads is None:
                raise ValueError("pass num_heads, or a ready-made attention= module")
            attention = RelativeMultiHeadAttention(
                d_model, num_heads, dropout=attn_dropout, proj_bias=bias, device=device, dtype=dtype
            )
        elif num_heads is not None or attn_dropout:
            raise ValueError(
                "num_heads and attn_dropout configure the attention attnkit builds; with "
                "attention= given, configure that module instead"
            )
        if not isinstance(attention, nn.Module):
            raise TypeError(f"attention must be an nn.Module, got {type(attention).__name__}")
        self.context = None
        if context is not None:
            if not isinstance(context, tuple) or len(context) != 2:
                raise TypeError(f"context must be a (left, right) tuple of ints, got {context!r}")
            self.context = (
                check_int("context[0]", context[0], minimum=0, saturate=True),
                check_int("context[1]", context[1], minimum=0, saturate=True),
            )

        def norm() -> nn.LayerNorm:
            return nn.LayerNorm(d_model, eps=eps, device=device, dtype=dtype)

        def ffn() -> PositionwiseFeedForward:
            return PositionwiseFeedForward(
                d_model,
                d_ff,
                activation=activation,
                dropout=dropout,
                bias=bias,
                device=device,
                dtype=dtype,
            )

        self.ff1_norm, self.ff1 = norm(), ffn()
        self.attn_norm, self.attn = norm(), attention
        self.conv_norm = norm()
        self.conv = ConformerConvolution(
            d_model, kernel_size, activation=activation, bias=bias, device=device, dtype=dtype
        )
        self.ff2_norm, self.ff2 = norm(), ffn()
        self.final_norm = norm()
        self.dropout = nn.Dropout(dropout)

    @torch_keywords
    @shape_checked
    def forward(
        self, x: Float[Tensor, "B T D"], *, mask: Bool[Tensor, "..."] | Mask | None = None
    ) -> Float[Tensor, "B T D"]:
        check_input("x", x, f"(B, T, {self.d_model})", self.d_model, self.final_norm.weight)
        valid = self._valid_frames(mask, x)
        key_mask: Tensor | Mask | None = None
        if valid is not None:
            x = x.masked_fill(~valid.unsqueeze(-1), 0.0)  # whatever padding holds, NaN included
            # Across processes the padding is this rank's keys' own: a key mask that travels
            # with them (a structured mask would be read at the whole sequence's positions).
            sharded = self.sequence_shards is not None
            key_mask = valid[:, None, None, :] if sharded else masks.key_padding(valid=valid)
        if self.context is not None:
            window = masks.sliding_window(*self.context)
            key_mask = window if key_mask is None else key_mask & window
        x = x + 0.5 * self.dropout(self.ff1(self.ff1_norm(x)))
        x = x + self.dropout(self.attn(self.attn_norm(x), mask=key_mask))
        x = x + self.dropout(self.conv(self.conv_norm(x), valid))
        x = x + 0.5 * self.dropout(self.ff2(self.ff2_norm(x)))
        out: Tensor = self.final_norm(x)
        return out

    def _valid_frames(self, mask: object, x: Tensor) -> Tensor | None:
        """The padding mask as ``(B, T)`` bool, True at real frames (this rank's, across
        processes)."""
        if mask is None:
            return None
        b, t = x.shape[:2]
        if isinstance(mask, Mask) and mask.keys_only and mask.tensor is None:
            shards = self.sequence_shards
            if shards is None:
                geo = masks.Geometry((b,), 1, t, t, x.device)
                mask.check(geo, "mask")
                return mask.key_tile(geo, 0, t).expand(b, t)
            # The whole sequence's mask, read at the positions this rank holds.
            whole = t * shards.world_size
            geo = masks.Geometry((b,), 1, whole, whole, x.device)
            mask.check(geo, "mask")
            runs = [mask.key_tile(geo, g, g + n) for _, g, n in shards.segments(t)]
            return torch.cat(runs, dim=-1).expand(b, t)
        if isinstance(mask, Mask):
            raise TypeError(
                f"mask must say which frames are real (a padding mask or masks.key_padding), got "
                f"{mask!r}; a window over the frames is the layer's context=(left, right)"
            )
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError(
                f"mask must be a bool tensor (True = real frame), got "
                f"{mask.dtype if isinstance(mask, Tensor) else type(mask).__name__}"
            )
        if tuple(mask.shape) in ((b, 1, 1, t), (b, t)):
            valid = mask.reshape(b, t)
            warn_torch_convention(valid[:, None, None, :])  # a torch key_padding_mask?
            return valid
        raise ValueError(
            f"mask must be a padding mask (B, T) or (B, 1, 1, T) = ({b}, {t}) or "
            f"({b}, 1, 1, {t}), True = real frame, got {shape_str(mask.shape)}: the convolution "
            "needs to know which frames are padding, so a per-query mask does not fit"
        )
