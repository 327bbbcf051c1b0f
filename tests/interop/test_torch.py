"""``attnkit.interop.torch``: modules to and from ``torch.nn.MultiheadAttention`` compute what
torch computes, and ``from_torch_masks`` masks what torch masks. (The property-based comparisons
over many configurations are in ``tests/modules/test_multihead.py``.)"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import attnkit
from attnkit import MultiHeadAttention
from attnkit.interop.torch import from_torch, from_torch_masks, to_torch
from attnkit.testing import assert_close


def randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def drawn(m: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return m


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"kdim": 5, "vdim": 7},  # separate projections
        {"proj_bias": False},
    ],
    ids=["packed", "kdim-vdim", "no-bias"],
)
@pytest.mark.parametrize("batch_first", [True, False])
def test_to_torch_computes_what_the_module_computes(
    config: dict[str, object], batch_first: bool
) -> None:
    ours = drawn(MultiHeadAttention(8, 2, dtype=torch.float64, **config), seed=1).eval()  # type: ignore[arg-type]
    assert isinstance(ours, MultiHeadAttention)
    theirs = to_torch(ours, batch_first=batch_first)
    assert theirs.batch_first is batch_first
    query = randn(3, 4, 8, seed=2)
    key, value = randn(3, 6, ours.kdim, seed=3), randn(3, 6, ours.vdim, seed=4)

    def t(x: Tensor) -> Tensor:
        return x if batch_first else x.transpose(0, 1)

    want, want_w = theirs(t(query), t(key), t(value), average_attn_weights=False)
    got, got_w = ours(query, key, value, need_weights=True, average_weights=False)
    assert_close(got, t(want))
    assert_close(got_w, want_w)
    # ... and back: the same parameters, the same function (a sequence-first module is refused
    # unless the caller says it will give the copy batch-first inputs)
    if not batch_first:
        with pytest.raises(ValueError, match="batch_first=False"):
            from_torch(theirs)
    back = from_torch(theirs, batch_first=True)
    assert back.state_dict().keys() == ours.state_dict().keys()
    for name, p in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], p), name
    assert_close(back(query, key, value), got)


def test_from_torch_keeps_the_training_mode_and_dropout() -> None:
    theirs = nn.MultiheadAttention(8, 2, dropout=0.25, batch_first=True, dtype=torch.float64)
    ours = from_torch(theirs.eval())
    assert ours.dropout == 0.25
    assert not ours.training
    assert from_torch(theirs.train()).training


def test_from_torch_masks_masks_what_torch_masks() -> None:
    # A per-head float attn_mask (B*H, Tq, Tk) with -inf entries and a bool key padding mask.
    theirs = drawn(nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64), seed=5)
    ours = from_torch(theirs.eval())
    x = randn(2, 5, 8, seed=6)
    attn_mask = randn(4, 5, 5, seed=7)
    attn_mask[1, :, 0] = -float("inf")
    padding = torch.tensor([[False] * 5, [False, False, False, True, True]])  # True = padding
    float_padding = torch.zeros(2, 5, dtype=torch.float64).masked_fill(padding, -float("inf"))
    mask, bias = from_torch_masks(attn_mask, float_padding, num_heads=2, dtype=torch.float64)
    assert mask is None
    assert bias is not None
    with torch.no_grad():
        want = theirs(
            x, x, x, attn_mask=attn_mask, key_padding_mask=float_padding, need_weights=False
        )[0]
        assert_close(ours(x, mask=None, bias=bias), want)
        mask, bias = from_torch_masks(attn_mask, padding, num_heads=2, dtype=torch.float64)
        assert mask is not None
        assert tuple(mask.shape) == (2, 1, 1, 5)
        assert_close(ours(x, mask=mask, bias=bias), want)
        # A bool attn_mask: True means "may not attend" in torch, "may attend" in attnkit.
        blocked = torch.rand(5, 5, generator=torch.Generator().manual_seed(8)) < 0.3
        blocked[:, 0] = False
        mask, bias = from_torch_masks(blocked, num_heads=2)
        assert bias is None
        assert mask is not None
        assert torch.equal(mask, ~blocked)
        want = theirs(x, x, x, attn_mask=blocked, need_weights=False)[0]
        assert_close(ours(x, mask=mask), want)


@pytest.mark.usefixtures("no_shape_checks")
def test_refusals_quote_the_values() -> None:
    with pytest.raises(
        TypeError, match=re.escape("to_torch() takes an attnkit.MultiHeadAttention, got Linear")
    ):
        to_torch(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=re.escape(
            "to_torch(): torch.nn.MultiheadAttention has no equivalent: num_kv_heads (1) != "
            "num_heads (2); head_dim (3) and v_head_dim (3) must both be d_model / num_heads "
            "(8 / 2 = 4)"
        ),
    ):
        to_torch(MultiHeadAttention(8, 2, num_kv_heads=1, head_dim=3))
    theirs = nn.MultiheadAttention(8, 2, batch_first=True)
    theirs.in_proj_weight = nn.Parameter(torch.zeros(20, 8))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "from_torch(): in_proj_weight has shape (20, 8), expected (24, 8) for embed_dim=8, "
            "num_heads=2"
        ),
    ):
        from_torch(theirs)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "from_torch() takes a torch.nn.MultiheadAttention, TransformerEncoderLayer, "
            "TransformerDecoderLayer or Transformer, got Linear"
        ),
    ):
        from_torch(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=re.escape(
            "a 3-d attn_mask must be (B*H, Tq, Tk) with H = num_heads (2), got (3, 4, 4)"
        ),
    ):
        from_torch_masks(torch.zeros(3, 4, 4), num_heads=2)
    with pytest.raises(
        ValueError, match=re.escape("key_padding_mask must be (B, Tk), got (2, 1, 4)")
    ):
        from_torch_masks(key_padding_mask=torch.zeros(2, 1, 4, dtype=torch.bool), num_heads=2)
    with pytest.raises(
        TypeError, match=re.escape("dtype must be a floating-point torch.dtype, got torch.int64")
    ):
        from_torch_masks(num_heads=2, dtype=torch.int64)


# --------------------------------------------------------------------------------------------------
# torch's own configurations of nn.MultiheadAttention: every constructor and forward input in
# torch.testing._internal.common_modules.module_db (bias, add_bias_kv, add_zero_attn, both layouts,
# with and without attn_mask and key_padding_mask), through from_torch and back through to_torch.

# torch's test helpers change process-wide settings when imported (torch.backends.
# disable_global_flags(), TorchScript call hooks), so the inputs are drawn in a child process and
# handed over in a file. expecttest, which those helpers import for a TestCase base class only, is
# stood in for when it is not installed: the inputs do not use it.
_MODULE_DB = r"""
import sys, types, unittest
try:
    import expecttest  # noqa: F401
except ImportError:
    sys.modules["expecttest"] = types.ModuleType("expecttest")
    sys.modules["expecttest"].TestCase = unittest.TestCase
import torch
from torch.testing._internal.common_modules import module_db

torch.manual_seed(0)
info = next(m for m in module_db if m.module_cls is torch.nn.MultiheadAttention)
samples = info.module_inputs_func(
    info, device="cpu", dtype=torch.float64, requires_grad=False, training=False
)
torch.save(
    [
        (s.constructor_input.args, s.constructor_input.kwargs, s.forward_input.args,
         s.forward_input.kwargs)
        for s in samples
    ],
    sys.argv[1],
)
"""


@pytest.fixture(scope="module")
def torch_module_inputs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Any, ...]]:
    path = tmp_path_factory.mktemp("module_db") / "inputs.pt"
    subprocess.run([sys.executable, "-c", _MODULE_DB, str(path)], check=True)
    inputs: list[tuple[Any, ...]] = torch.load(path)
    return inputs


def _describe(kwargs: dict[str, Any], forward: dict[str, Any]) -> str:
    flags = [f"{k}={v}" for k, v in kwargs.items()]
    flags += [f"{k}={'set' if v is not None else None}" for k, v in forward.items()]
    return ", ".join(flags)


def test_torch_module_db_configurations(
    torch_module_inputs: list[tuple[Any, ...]], subtests: pytest.Subtests
) -> None:
    # All 64 of them; 48 have add_bias_kv or add_zero_attn.
    assert len(torch_module_inputs) >= 64
    assert (
        sum(
            bool(kw.get("add_bias_kv") or kw.get("add_zero_attn"))
            for _, kw, _, _ in torch_module_inputs
        )
        >= 48
    )
    for n, (args, kwargs, inputs, forward) in enumerate(torch_module_inputs):
        with subtests.test(msg=f"{n}: {_describe(kwargs, forward)}"):
            _compare_with_torch(args, kwargs, inputs, forward, seed=n)


def _compare_with_torch(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    inputs: tuple[Tensor, ...],
    forward: dict[str, Any],
    *,
    seed: int,
) -> None:
    theirs = drawn(nn.MultiheadAttention(*args, **kwargs, dtype=torch.float64), seed=seed).eval()
    # torch's samples are unbatched (T, E); attnkit's module takes (B, T, E): a batch of one.
    ours = attnkit.interop.torch.from_torch(theirs, batch_first=True)  # type: ignore[arg-type]
    attn_mask, padding = forward.get("attn_mask"), forward.get("key_padding_mask")
    mask, bias = from_torch_masks(
        attn_mask,
        None if padding is None else padding[None],
        num_heads=theirs.num_heads,
        dtype=torch.float64,
    )

    def leaves() -> list[Tensor]:
        return [x.detach().clone().requires_grad_() for x in inputs]

    for average in (True, False):
        q, k, v = leaves()
        want, want_w = theirs(q, k, v, **forward, average_attn_weights=average)
        g = randn(*want.shape, seed=seed + 1)
        gw = randn(*want_w.shape, seed=seed + 2)
        ((want * g).sum() + (want_w * gw).sum()).backward()
        want_grads = {n: p.grad for n, p in theirs.named_parameters()} | {
            "query": q.grad,
            "key": k.grad,
            "value": v.grad,
        }
        theirs.zero_grad(set_to_none=True)

        q, k, v = leaves()
        got, got_w = ours(
            q[None],
            k[None],
            v[None],
            mask=mask,
            bias=bias,
            need_weights=True,
            average_weights=average,
        )
        assert_close(got[0], want)
        assert_close(got_w[0], want_w)
        ((got[0] * g).sum() + (got_w[0] * gw).sum()).backward()
        got_grads = {n: p.grad for n, p in ours.named_parameters()} | {
            "query": q.grad,
            "key": k.grad,
            "value": v.grad,
        }
        ours.zero_grad(set_to_none=True)
        assert got_grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            mine = got_grads[name]
            assert grad is not None, name
            assert mine is not None, name
            assert_close(mine, grad)

    with torch.no_grad():
        # torch's fast path (no weights: scaled_dot_product_attention) computes the same.
        want = theirs(*inputs, **forward, need_weights=False)[0]
        assert_close(ours(*(x[None] for x in inputs), mask=mask, bias=bias)[0], want)
        # ... and back: the same parameters under the same names, the same function.
        back = attnkit.interop.torch.to_torch(ours, batch_first=theirs.batch_first)
        assert (back.add_zero_attn, back.bias_k is None) == (
            theirs.add_zero_attn,
            theirs.bias_k is None,
        )
        assert back.state_dict().keys() == theirs.state_dict().keys()
        for name, p in theirs.state_dict().items():
            assert torch.equal(back.state_dict()[name], p), name
        assert_close(back(*inputs, **forward)[0], want)


@pytest.mark.parametrize(
    "activation",
    [torch.relu, nn.functional.silu, nn.SiLU(), nn.functional.gelu, nn.ReLU()],
    ids=["torch.relu", "F.silu", "nn.SiLU", "F.gelu", "nn.ReLU"],
)
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_layers_with_an_activation_given_as_a_callable(activation: Any, kind: str) -> None:
    # torch's layers keep whatever callable they are given; those attnkit's feed-forward computes
    # (relu, gelu, silu) load, with torch's outputs in float64.
    cls = nn.TransformerEncoderLayer if kind == "encoder" else nn.TransformerDecoderLayer
    theirs = cls(16, 4, 24, dropout=0.0, activation=activation, batch_first=True)
    theirs = drawn(theirs.to(torch.float64), seed=0).eval()
    ours = from_torch(theirs).eval()
    x, memory = randn(2, 5, 16, seed=1), randn(2, 7, 16, seed=2)
    if kind == "encoder":
        assert_close(ours(x), theirs(x))
    else:
        assert_close(ours(x, memory, causal=False), theirs(x, memory))


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_from_torch_computes_what_torch_computes(norm_first: bool) -> None:
    # torch's stacks end with a LayerNorm after post-norm layers too: the copy keeps both.
    theirs = nn.Transformer(16, 4, 2, 1, 24, dropout=0.0, norm_first=norm_first, batch_first=True)
    theirs = drawn(theirs.to(torch.float64), seed=0).eval()
    ours = from_torch(theirs).eval()
    assert isinstance(ours, attnkit.Transformer)
    src = randn(2, 7, 16, seed=1).requires_grad_()
    tgt = randn(2, 5, 16, seed=2)
    src_pad = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])  # torch: True = padding
    want = theirs(
        src,
        tgt,
        tgt_mask=nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64),
        src_key_padding_mask=src_pad,
        memory_key_padding_mask=src_pad,
    )
    pad, _ = from_torch_masks(key_padding_mask=src_pad, num_heads=4)
    got = ours(src, tgt, src_mask=pad, memory_mask=pad)
    assert_close(got, want)
    grad = randn(2, 5, 16, seed=3)
    (want_grad,) = torch.autograd.grad(want, src, grad)
    (got_grad,) = torch.autograd.grad(got, src, grad)
    assert_close(got_grad, want_grad)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
def test_transformer_from_torch_refuses_custom_stacks() -> None:
    custom = nn.Transformer(16, 4, custom_encoder=nn.Identity(), batch_first=True)
    with pytest.raises(TypeError, match=r"encoder is a Identity \(a custom_encoder\)"):
        from_torch(custom)
    with pytest.raises(ValueError, match="batch_first=False"):
        from_torch(nn.Transformer(16, 4, 1, 1, 24))
