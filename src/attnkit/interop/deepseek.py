"""transformers' DeepSeek V3 attention (``DeepseekV3Attention``), loaded into attnkit's
:class:`~attnkit.MultiHeadLatentAttention`.

The module and its ``config`` are read through their attribute names (transformers is not
imported). The parameters map one to one, with one permutation:

=====================================================  ==========================================
transformers ``DeepseekV3Attention``                   attnkit ``MultiHeadLatentAttention``
=====================================================  ==========================================
``q_proj`` (no ``q_lora_rank``)                        ``q_proj``
``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``          ``q_a_proj``, ``q_a_norm``, ``q_b_proj``
``kv_a_proj_with_mqa``                                 ``kv_a_proj``
``kv_a_layernorm``                                     ``kv_a_norm``
``kv_b_proj``, ``o_proj``                              ``kv_b_proj``, ``out_proj``
``scaling`` (YaRN's ``mscale`` folded in)              ``scale``
``config.rope_interleave``                             the rotary rows of ``q_proj``/``q_b_proj``
                                                       and ``kv_a_proj``: ``0, 2, 4, ...`` then
                                                       ``1, 3, 5, ...``
=====================================================  ==========================================

**The rotary layout.** With ``rope_interleave`` (DeepSeek's checkpoints) transformers rotates the
pairs ``(x0, x1), (x2, x3), ...`` of the rotary part and writes the result as the rotated evens
then the rotated odds: exactly what attnkit's "rotate half" :class:`~attnkit.RotaryEmbedding`
gives for the input ``(x0, x2, x4, ..., x1, x3, ...)``. The loader permutes the rows of the
projections that make the rotary parts, so the loaded module computes the same products with
attnkit's rotary. Without ``rope_interleave`` the rows are copied as they are.
``DeepseekV2Attention`` (by complex numbers, leaving the pairs in place: the products of the
queries and keys are those of the same permutation) and ``DeepseekV32Attention`` always rotate
interleaved pairs (their configs have no ``rope_interleave``), and are loaded so.

**The frequencies.** A ``"default"`` rope is :class:`~attnkit.RotaryEmbedding` with
``rope_theta``. Other rope types (DeepSeek V3's YaRN) keep their frequencies and scaling in the
model's rotary module, not in the attention: pass
``rotary=deepseek.rotary_embedding(model.model.rotary_emb)``.

What the loaded module computes in higher precision: transformers takes the RMS norms and the
softmax in float32 even for float64 inputs, and its rotary angles in float32; attnkit computes
them in the parameters' dtype (float64 angles for float64 inputs).

The mask: transformers' eager attention adds a float mask (0 where a pair may attend, a large
negative number where not). attnkit's is bool, True = may attend: ``causal=True`` for its causal
mask, :func:`attnkit.masks.key_padding` for padding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .._base.checks import check_float_tensor
from .._base.shapes import Float, shape_checked
from ..modules.latent import MultiHeadLatentAttention
from ..modules.positional import RotaryEmbedding, rotary_positions
from . import _copy

__all__ = ["FrequencyRotary", "latent_attention", "rotary_embedding"]

#: transformers' latent attention classes that rotate DeepSeek's interleaved pairs whatever their
#: config says (theirs has no ``rope_interleave``): V2's rotation by complex numbers, V3.2's.
_ALWAYS_INTERLEAVED = ("DeepseekV2Attention", "DeepseekV32Attention")


class FrequencyRotary(nn.Module):
    """A rotary embedding of given frequencies and scaling, in the "rotate half" layout:
    :class:`~attnkit.RotaryEmbedding`'s rotation with a model's own ``inv_freq`` (YaRN's,
    for one) and its cos and sin multiplied by ``scaling`` (YaRN's ``attention_factor``).

    ``forward(x, offset=0)`` rotates ``x`` ``(..., T, Dh)`` as positions ``offset, ...``
    (``offset`` an int, or a tensor of one per row: see
    :func:`~attnkit.modules.positional.rotary_positions`). The angles are computed in float64
    for float64 inputs, float32 otherwise.
    """

    inv_freq: Tensor

    def __init__(self, inv_freq: Tensor, scaling: float = 1.0) -> None:
        super().__init__()
        check_float_tensor("inv_freq", inv_freq)
        if inv_freq.ndim != 1:
            raise ValueError(f"inv_freq must be 1-d (Dh / 2,), got {tuple(inv_freq.shape)}")
        self.head_dim = 2 * inv_freq.numel()
        self.scaling = float(scaling)
        freq = inv_freq.detach().to(torch.float64)
        # The frequencies on the host: the buffer is not in state_dict() (transformers' is not),
        # so a module materialised by to_empty() (off the meta device, or built under
        # torch.device("meta")) gets them from here, where load_state_dict() has none to give.
        self._frequencies = None if freq.device.type == "meta" else freq.to("cpu", copy=True)
        self.register_buffer("inv_freq", freq, persistent=False)

    #: ``forward`` takes a tensor of one offset per row (see RotaryEmbedding's).
    per_row_offsets = True

    @shape_checked
    def forward(
        self, x: Float[Tensor, "*batch T Dh"], *, offset: int | Tensor = 0
    ) -> Float[Tensor, "*batch T Dh"]:
        check_float_tensor("x", x)
        if x.ndim < 2 or x.size(-1) != self.head_dim:
            raise ValueError(
                f"x must have shape (..., T, head_dim={self.head_dim}), got {tuple(x.shape)}"
            )
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        pos = rotary_positions(offset, x, work)  # (..., T, 1)
        angle = pos * self.inv_freq.to(device=x.device, dtype=work)
        angle = torch.cat((angle, angle), dim=-1)
        cos = (angle.cos() * self.scaling).to(x.dtype)
        sin = (angle.sin() * self.scaling).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def _apply(self, fn: Any, recurse: bool = True) -> FrequencyRotary:
        # The frequencies are constants, moved and never converted: ``module.to(torch.bfloat16)``
        # would round them to 8 bits, which turns the angles at position 4,000 by whole
        # radians. to_empty() leaves a buffer's memory as it finds it (none on meta), so they
        # are put back from the host's copy, kept as the buffer last held them.
        freq = self.inv_freq
        if freq.device.type != "meta":
            self._frequencies = freq.detach().to("cpu", torch.float64, copy=True)
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        if self._frequencies is not None:
            self.reset_parameters()
        elif self.inv_freq.dtype != torch.float64:  # (frequencies given on meta: no values)
            self.inv_freq = freq.to(device=self.inv_freq.device)
        return self

    def reset_parameters(self) -> None:
        """Put the frequencies back into ``inv_freq`` (float64, where it lies) from the host's
        copy: what a module built on the meta device runs after ``to_empty()``, which moving
        it does already."""
        if self._frequencies is not None and self.inv_freq.device.type != "meta":
            # (a copy: the buffer is the module's to change, the host's copy stays as made)
            self.inv_freq = self._frequencies.to(self.inv_freq.device, copy=True)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, scaling={self.scaling:g}"


def rotary_embedding(module: nn.Module) -> FrequencyRotary:
    """A :class:`FrequencyRotary` with the frequencies and scaling of transformers' DeepSeek
    rotary module (``model.model.rotary_emb``: its ``inv_freq`` and ``attention_scaling``)."""
    who = "deepseek.rotary_embedding()"
    inv_freq = _copy.tensor(module, "inv_freq", who)
    scaling = getattr(module, "attention_scaling", 1.0)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        raise TypeError(f"{who} needs attention_scaling to be a number, got {scaling!r}")
    return FrequencyRotary(inv_freq, float(scaling))


def _setting(config: Any, name: str, who: str) -> Any:
    if not hasattr(config, name):
        raise TypeError(f"{who} needs config.{name}, which {type(config).__name__} does not have")
    return getattr(config, name)


def _rotary(config: Any, dr: int, rotary: nn.Module | None, who: str) -> nn.Module:
    """The loaded module's rotary embedding: ``rotary`` if given, else the default rope's."""
    if rotary is not None:
        return rotary
    params = getattr(config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise ValueError(
            f'{who}: config.rope_parameters has rope_type="{kind}", whose frequencies the '
            "attention module does not hold: pass rotary=deepseek.rotary_embedding("
            "model.model.rotary_emb)"
        )
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return RotaryEmbedding(dr, base=float(theta))


def _permuted(w: Tensor, rope_at: int, dr: int, period: int) -> Tensor:
    """``w`` with the ``dr`` rotary rows at ``rope_at`` of each ``period`` rows taken evens then
    odds (DeepSeek's interleaved pairs as attnkit's halves)."""
    order = _copy.halves_from_interleaved(dr).to(w.device)
    blocks = w.reshape(-1, period, *w.shape[1:]).clone()
    blocks[:, rope_at : rope_at + dr] = blocks[:, rope_at + order]
    return blocks.reshape(w.shape)


def _interleaved(module: nn.Module, config: Any, who: str) -> bool:
    """Whether ``module`` rotates interleaved pairs (else halves) of its rotary parts."""
    name = type(module).__name__
    if name in _ALWAYS_INTERLEAVED:
        return True
    given = getattr(config, "rope_interleave", None)
    if given is None:
        raise ValueError(
            f"{who}: the config of {name} has no rope_interleave, so whether it rotates "
            "DeepSeek's interleaved pairs (True) or halves (False) of the rotary part is "
            "unknown; set config.rope_interleave"
        )
    return bool(given)


def _check_indexer(module: nn.Module, ignore: bool, who: str) -> None:
    """Refuse a module with a sparse-attention indexer (DeepSeek V3.2's) unless told to load
    its latent attention alone: attending every key instead would be another model."""
    indexer = getattr(module, "indexer", None)
    if indexer is None or ignore:
        return
    topk = getattr(indexer, "index_topk", "?")
    raise ValueError(
        f"{who}: {type(module).__name__} attends only the keys its indexer selects "
        f"(index_topk = {topk}), which MultiHeadLatentAttention does not compute; pass "
        "ignore_indexer=True to load the latent attention alone, and give it the indexer's "
        "selection as mask=attnkit.masks.key_indices(indices)"
    )


def latent_attention(
    module: nn.Module, *, rotary: nn.Module | None = None, ignore_indexer: bool = False
) -> MultiHeadLatentAttention:
    """attnkit's copy of transformers' ``DeepseekV3Attention`` (see the module docstring), in
    the dtype and on the device of its parameters. ``DeepseekV2Attention`` loads the same way.

    ``rotary``: the rotary embedding, for a rope type other than ``"default"``
    (:func:`rotary_embedding`).

    ``ignore_indexer``: load the latent attention of a module that also has a sparse-attention
    indexer (DeepSeek V3.2's ``DeepseekV32Attention``) without it; the loaded module then
    attends every key its mask allows, so give it the indexer's selection
    (``mask=attnkit.masks.key_indices(indices) & attnkit.masks.causal()``). Without it such a
    module is refused.
    """
    who = "deepseek.latent_attention()"
    if not isinstance(module, nn.Module):
        raise TypeError(f"{who} takes an nn.Module, got {type(module).__name__}")
    _check_indexer(module, ignore_indexer, who)
    config = _setting(module, "config", who)
    h = _copy.integer(module, "num_heads", who)
    dn = int(_setting(config, "qk_nope_head_dim", who))
    dr = int(_setting(config, "qk_rope_head_dim", who))
    r = int(_setting(config, "kv_lora_rank", who))
    q_rank = _setting(config, "q_lora_rank", who)
    kv_a = _copy.part(module, "kv_a_proj_with_mqa", nn.Linear, who)
    scale = getattr(module, "scaling", None)
    w = kv_a.weight
    out = MultiHeadLatentAttention(
        int(_setting(config, "hidden_size", who)),
        h,
        kv_lora_rank=r,
        q_lora_rank=None if q_rank is None else int(q_rank),
        qk_nope_head_dim=dn,
        qk_rope_head_dim=dr,
        v_head_dim=int(_setting(config, "v_head_dim", who)),
        proj_bias=kv_a.bias is not None,
        scale=None if scale is None else float(scale),
        dropout=float(getattr(config, "attention_dropout", 0.0)),
        rotary=_rotary(config, dr, rotary, who),
        device=w.device,
        dtype=w.dtype,
    )
    interleaved = _interleaved(module, config, who)

    def rope_rows(t: Tensor, rope_at: int, period: int) -> Tensor:
        return _permuted(t, rope_at, dr, period) if interleaved else t

    _copy_queries(out, module, rope_rows, who)
    weight = rope_rows(kv_a.weight, r, r + dr)
    _copy.copy(out.kv_a_proj.weight, weight, "kv_a_proj_with_mqa.weight", who)
    if kv_a.bias is not None and out.kv_a_proj.bias is not None:
        _copy.copy(out.kv_a_proj.bias, rope_rows(kv_a.bias, r, r + dr), "kv_a_proj bias", who)
    _copy_norm(out.kv_a_norm, module, "kv_a_layernorm", who)
    _copy.copy_linear(
        out.kv_b_proj, _copy.part(module, "kv_b_proj", nn.Linear, who), "kv_b_proj", who
    )
    _copy.copy_linear(out.out_proj, _copy.part(module, "o_proj", nn.Linear, who), "o_proj", who)
    return out


def _copy_queries(
    out: MultiHeadLatentAttention, module: nn.Module, rope_rows: Any, who: str
) -> None:
    """The query projections: ``q_proj``, or ``q_a_proj``, its norm and ``q_b_proj``, the
    rotary rows of each head permuted as ``rope_rows`` says."""
    dn, period = out.qk_nope_head_dim, out.qk_nope_head_dim + out.qk_rope_head_dim
    if out.q_proj is not None:
        q = _copy.part(module, "q_proj", nn.Linear, who)
        _copy.copy(out.q_proj.weight, rope_rows(q.weight, dn, period), "q_proj.weight", who)
        return
    q_a = _copy.part(module, "q_a_proj", nn.Linear, who)
    q_b = _copy.part(module, "q_b_proj", nn.Linear, who)
    down, norm, up = out.q_a_proj, out.q_a_norm, out.q_b_proj
    if down is None or norm is None or up is None:
        raise RuntimeError("attnkit internal error: q_lora_rank without its projections")
    _copy.copy_linear(down, q_a, "q_a_proj", who)
    _copy_norm(norm, module, "q_a_layernorm", who)
    _copy.copy(up.weight, rope_rows(q_b.weight, dn, period), "q_b_proj.weight", who)


def _copy_norm(dst: nn.RMSNorm, module: nn.Module, name: str, who: str) -> None:
    """transformers' RMS norm ``module.<name>``: its weight and epsilon (``variance_epsilon``)."""
    src = _copy.part(module, name, nn.Module, who)
    if dst.weight is None:
        raise RuntimeError(f"attnkit internal error: {name} has no weight here")
    _copy.copy(dst.weight, _copy.tensor(src, "weight", who), f"{name}.weight", who)
    eps = getattr(src, "variance_epsilon", getattr(src, "eps", None))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise TypeError(f"{who} needs {name}.variance_epsilon to be a number > 0, got {eps!r}")
    dst.eps = float(eps)
