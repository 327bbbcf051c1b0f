"""PositionwiseFeedForward: the two-layer network applied to every position on its own.

``relu`` and ``gelu`` give the paper's ``W2 · act(W1 x + b1) + b2`` (Vaswani et al., 2017, section
3.3), ``silu`` the same with Swish, ``x · sigmoid(x)`` (the Conformer's); ``swiglu`` gives
``W2 · (silu(W x) ⊙ V x)`` (Shazeer, 2020, "GLU Variants Improve Transformer"), with ``W`` and
``V`` packed into one ``linear1`` of ``2 * d_ff`` outputs so that the input is read by a single
GEMM.

Shape letters: ``B`` batch, ``T`` positions, ``D`` d_model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._base.checks import (
    check_bool,
    check_float_tensor,
    check_int,
    check_like_parameters,
    check_probability,
    shape_str,
)
from .._base.shapes import Float, shape_checked

__all__ = ["PositionwiseFeedForward"]

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "silu": F.silu,
}
_GATED = ("swiglu",)


class PositionwiseFeedForward(nn.Module):
    """``(B, T, D) -> (B, T, D)`` through a hidden layer of ``d_ff`` units.

    Args:
        d_model: ``D``.
        d_ff: hidden units (the paper: ``4 * D``; SwiGLU models often use ``8/3 * D`` to keep the
            parameter count).
        activation: ``"relu"``, ``"gelu"`` (exact, erf-based), ``"silu"`` (Swish) or
            ``"swiglu"``.
        dropout: on the hidden activations, in training only (where torch's Transformer layers
            put it).
        bias: biases on both linear layers.
        device, dtype: of the parameters.

    >>> ffn = PositionwiseFeedForward(16, 64, activation="swiglu")
    >>> ffn(torch.randn(2, 5, 16)).shape
    torch.Size([2, 5, 16])
    >>> ffn.linear1.weight.shape        # gate and value projections packed: 2 * d_ff rows
    torch.Size([128, 16])
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: str = "relu",
        dropout: float = 0.0,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_model = check_int("d_model", d_model)
        self.d_ff = check_int("d_ff", d_ff)
        if activation not in _ACTIVATIONS and activation not in _GATED:
            known = ", ".join(repr(a) for a in (*_ACTIVATIONS, *_GATED))
            raise ValueError(f"activation must be one of {known}, got {activation!r}")
        self.activation = activation
        hidden = 2 * d_ff if activation in _GATED else d_ff
        bias = check_bool("bias", bias)
        self.linear1 = nn.Linear(d_model, hidden, bias=bias, device=device, dtype=dtype)
        self.dropout = nn.Dropout(check_probability("dropout", dropout))
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias, device=device, dtype=dtype)

    @shape_checked
    def forward(self, x: Float[Tensor, "*batch D"]) -> Float[Tensor, "*batch D"]:
        check_float_tensor("x", x)
        if x.ndim == 0 or x.size(-1) != self.d_model:
            raise ValueError(
                f"x must have shape (..., d_model={self.d_model}), got {shape_str(x.shape)}"
            )
        check_like_parameters("x", x, self.linear1.weight)
        h = self.linear1(x)
        if self.activation == "swiglu":
            gate, value = h.chunk(2, dim=-1)
            h = F.silu(gate) * value
        else:
            h = _ACTIVATIONS[self.activation](h)
        out: Tensor = self.linear2(self.dropout(h))
        return out

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}, activation={self.activation!r}"
