"""int8 and float8 keys and values with their scales (``attention(..., k_scale=, v_scale=)``):
the checks of the arguments, with their messages; every backend equal to the float64 formula over
the dequantized values, gradients of q and the scales included; and what explain() says of them.
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import attention, explain, masks
from attnkit._base.quantized import QUANTIZED, check_kv_scales, dequantize, stand_in


def _quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (B, Hkv, Tk, D)`` with a scale per token and key/value head."""
    top = 127.0 if dtype == torch.int8 else torch.finfo(dtype).max
    scale = (x.abs().amax(-1, keepdim=True) / top).clamp_min(1e-30).float()
    y = x / scale
    return (y.round() if dtype == torch.int8 else y).to(dtype), scale


def _call(
    dtype: torch.dtype, tq: int, h: int = 4, hkv: int = 2, tk: int = 50, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, h, tq, 16, generator=g)
    (kq, ks), (vq, vs) = (_quantize(torch.randn(2, hkv, tk, 16, generator=g), dtype) for _ in "kv")
    return q, kq, vq, ks, vs


def _formula(q: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor, ks: torch.Tensor,
             vs: torch.Tensor, **kw: object) -> torch.Tensor:  # fmt: skip
    """The float64 formula over the keys and values the call uses (in q's dtype)."""
    k, v = (dequantize(x, s, q.dtype).double() for x, s in ((kq, ks), (vq, vs)))
    return attention(q.double(), k, v, backend="reference", **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# The arguments


def test_quantized_keys_need_their_scale_and_the_message_quotes_the_dtype() -> None:
    q, kq, vq, ks, vs = _call(torch.float8_e5m2, 1)
    with pytest.raises(TypeError, match=r"k of float8_e5m2 needs k_scale= .*\(2, 2, 50, 1\)"):
        attention(q, kq, vq, v_scale=vs)
    with pytest.raises(TypeError, match=r"v of float8_e5m2 needs v_scale="):
        attention(q, kq, vq, k_scale=ks)


def test_scales_are_float_tensors_broadcastable_to_one_per_token_and_head() -> None:
    q, kq, vq, ks, vs = _call(torch.int8, 1)
    with pytest.raises(ValueError, match=r"k_scale must be broadcastable to .* \(2, 2, 50, 1\).*"
                       r"got \(2, 2, 50\)"):  # fmt: skip
        attention(q, kq, vq, k_scale=ks[..., 0], v_scale=vs)
    with pytest.raises(TypeError, match="v_scale must be float16, bfloat16, float32 or float64, "
                       "got int32"):  # fmt: skip
        attention(q, kq, vq, k_scale=ks, v_scale=vs.int())
    with pytest.raises(TypeError, match="k_scale must be a float tensor, got float"):
        check_kv_scales(q, kq, vq, 0.5, vs)
    # One scale per head, or for the whole cache, broadcast
    for k_scale in (ks.amax((0, 2), keepdim=True)[0], ks.max().reshape(())):
        check_kv_scales(q, kq, vq, k_scale, vs)
    # A scale that only broadcasts to a larger shape (more dims, a width of 2) is refused
    for bad in (ks[None], ks.expand(2, 2, 50, 2), ks[:, :1, :1].expand(2, 1, 1, 2)):
        with pytest.raises(ValueError, match=r"k_scale must be broadcastable"):
            check_kv_scales(q, kq, vq, bad, vs)


def test_q_must_be_float_and_k_and_v_share_their_dtype() -> None:
    q, kq, vq, ks, vs = _call(torch.int8, 1)
    with pytest.raises(TypeError, match=r"q must be float16, bfloat16, float32 or float64 .* got "
                       r"q of int8"):  # fmt: skip
        check_kv_scales(q.to(torch.int8), kq, vq, ks, vs)
    with pytest.raises(TypeError, match="quantized k and v must share a dtype, got k int8 and v "
                       "float8_e4m3fn"):  # fmt: skip
        attention(q, kq, vq.to(torch.float8_e4m3fn), k_scale=ks, v_scale=vs)


def test_scales_with_float_keys_are_refused() -> None:
    q, kq, vq, ks, vs = _call(torch.int8, 1)
    with pytest.raises(TypeError, match=r"k_scale and v_scale are for int8/float8 k and v .* got "
                       r"k of float32"):  # fmt: skip
        attention(q, kq.float(), vq.float(), k_scale=ks, v_scale=vs)


def test_scales_with_a_cache_view_are_refused_by_what_carries_them() -> None:
    q, _, _, ks, vs = _call(torch.int8, 1)
    cache = attnkit.KVCache(2, 60, 2, 16, kv_dtype=torch.int8)
    cache.update(torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16))
    with pytest.raises(TypeError, match=r"a CacheView carries its pages' scales"):
        attention(q, cache.view(), k_scale=ks, v_scale=vs)


def test_other_arguments_are_checked_on_the_dequantized_shapes() -> None:
    q, kq, vq, ks, vs = _call(torch.int8, 1, h=4, hkv=3)
    with pytest.raises(ValueError, match=r"q \(H=4\) must be a multiple of the heads of k and v"):
        attention(q, kq, vq, k_scale=ks, v_scale=vs)


def test_stand_ins_hold_no_memory() -> None:
    x = torch.zeros(2, 3, 1000, 64, dtype=torch.int8)
    s = stand_in(x, torch.float32)
    assert s.shape == x.shape
    assert s.dtype == torch.float32
    assert s.untyped_storage().nbytes() == 4
    assert not s.any()


# --------------------------------------------------------------------------------------------------
# Every backend: the formula over the dequantized values


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("backend", ["auto", "chunked", "reference", "sdpa", "flex"])
@pytest.mark.parametrize("tq", [1, 20])
def test_every_backend_equals_the_formula_over_the_dequantized_values(
    dtype: torch.dtype, backend: str, tq: int
) -> None:
    q, kq, vq, ks, vs = _call(dtype, tq)
    kw: dict[str, object] = {"mask": masks.sliding_window(30), "sinks": torch.zeros(4)}
    if backend in ("sdpa", "flex"):
        kw = {"causal": True}  # (sdpa takes no sinks; flex on the CPU, a plain mask)
    out = attention(q, kq, vq, k_scale=ks, v_scale=vs, backend=backend, **kw)  # type: ignore[arg-type]
    if "sinks" in kw:
        kw["sinks"] = torch.zeros(4, dtype=torch.float64)
    ref = _formula(q, kq, vq, ks, vs, **kw)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("tq", [1, 20])
def test_gradients_reach_q_and_the_scales(tq: int) -> None:
    q, kq, vq, ks, vs = _call(torch.int8, tq)
    leaves = [t.double().requires_grad_() for t in (q, ks, vs)]
    out = attention(leaves[0], kq, vq, k_scale=leaves[1], v_scale=leaves[2], causal=True)
    grads = torch.autograd.grad(out.sum(), leaves)
    ref_leaves = [t.double().requires_grad_() for t in (q, ks, vs)]
    ref = _formula(ref_leaves[0], kq, vq, ref_leaves[1], ref_leaves[2], causal=True)
    ref_grads = torch.autograd.grad(ref.sum(), ref_leaves)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("backend", ["auto", "chunked", "reference"])
@pytest.mark.parametrize("tq", [1, 20])
def test_nan_and_inf_at_masked_keys_touch_no_output_or_gradient(
    dtype: torch.dtype, backend: str, tq: int
) -> None:
    # A call that needs gradients reads whether its inputs are finite to pick a kernel that
    # follows the non-finite policy: it must read the scales and values, not the stand-ins.
    q, kq, vq, ks, vs = _call(dtype, tq)
    mask = masks.key_padding(torch.tensor([50, 30]))  # row 1's keys 30.. are padding
    bad_ks, bad_vs, bad_kq = ks.clone(), vs.clone(), kq.clone()
    bad_ks[1, 0, 35] = float("nan")
    bad_vs[1, 1, 40] = float("inf")
    if dtype != torch.int8:
        bad_kq[1, 1, 45, 3] = float("nan")

    def run(kq: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, ks, vs)]
        out = attention(leaves[0], kq, vq, k_scale=leaves[1], v_scale=leaves[2], mask=mask,
                        backend=backend)  # fmt: skip
        return [out, *torch.autograd.grad(out.square().sum(), leaves)]

    got, want = run(bad_kq, bad_ks, bad_vs), run(kq, ks, vs)
    hidden = torch.zeros_like(ks, dtype=torch.bool)
    hidden[1, :, 30:] = True  # the padding's scales: a gradient of 0 whatever they hold
    got[2], got[3] = got[2].masked_fill(hidden, 0.0), got[3].masked_fill(hidden, 0.0)
    want[2], want[3] = want[2].masked_fill(hidden, 0.0), want[3].masked_fill(hidden, 0.0)
    # float32 on two kernels, rounding apart: a scale's gradient sums products of either sign,
    # so its error is float32's relative to the largest of them, not to the sum
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * max(1.0, w.abs().max().item()))
    with pytest.raises(attnkit.BackendError, match="hold NaN/inf and gradients are needed"):
        attention(q.requires_grad_(), bad_kq, vq, k_scale=bad_ks, v_scale=bad_vs, mask=mask,
                  backend="sdpa")  # fmt: skip


def test_a_compiled_call_takes_gradients_of_the_scales_in_one_graph() -> None:
    # The checks' stand-ins for k and v need gradients where the scales do: made as a leaf with
    # requires_grad=True, torch.compile(fullgraph=True) refused to trace the call.
    q, kq, vq, ks, vs = _call(torch.int8, 3)
    leaves = [t.double().requires_grad_() for t in (q, ks, vs)]

    def step(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
        return attention(q, kq, vq, k_scale=ks, v_scale=vs, causal=True)

    out = torch.compile(step, fullgraph=True, backend="eager")(*leaves)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    ref_leaves = [t.double().requires_grad_() for t in (q, ks, vs)]
    ref = _formula(ref_leaves[0], kq, vq, ref_leaves[1], ref_leaves[2], causal=True)
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_leaves)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


def test_the_error_of_int8_on_random_data_is_about_a_hundredth() -> None:
    # Against the unquantized keys and values: the quantization's own error, not the kernel's.
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 1, 64, generator=g)
    k, v = (torch.randn(1, 2, 500, 64, generator=g) for _ in "kv")
    (kq, ks), (vq, vs) = _quantize(k, torch.int8), _quantize(v, torch.int8)
    out = attention(q, kq, vq, k_scale=ks, v_scale=vs)
    exact = attention(q.double(), k.double(), v.double())
    err = float((out.double() - exact).norm() / exact.norm())
    assert 1e-4 < err < 3e-2


# --------------------------------------------------------------------------------------------------
# What explain() and record_dispatch() say


def test_a_decode_reads_them_in_place_and_auto_picks_the_backend_that_does() -> None:
    q, kq, vq, ks, vs = _call(torch.int8, 1)
    said = str(explain(q, kq, vq, k_scale=ks, v_scale=vs))
    assert "auto picks: chunked" in said
    assert "reads int8 k and v, scales (2, 2, 50, 1) and (2, 2, 50, 1) in place" in said
    assert "sdpa       avoided: would dequantize int8 k and v" in said
    with torch.inference_mode(), attnkit.record_dispatch() as calls:
        attention(q, kq, vq, k_scale=ks, v_scale=vs)
    assert calls[-1].kernel == "native kernel (int8 k and v read in place)"


def test_a_prefill_dequantizes_first_and_says_so() -> None:
    q, kq, vq, ks, vs = _call(torch.float8_e4m3fn, 20)
    said = str(explain(q, kq, vq, k_scale=ks, v_scale=vs, backend="chunked"))
    assert "would dequantize float8_e4m3fn k and v" in said
    assert "only the native decode path reads them in place" in said
    with attnkit.record_dispatch() as calls:
        attention(q, kq, vq, k_scale=ks, v_scale=vs, backend="chunked")
    assert "on float8_e4m3fn k and v dequantized first: 20 queries" in str(calls[-1].kernel)
