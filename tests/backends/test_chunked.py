"""The chunked backend: memory it keeps, blocks it skips, and its default block sizes."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import _kernel as kernel
from attnkit import attention, masks
from attnkit._kernel import fused, problem
from attnkit.backends import Chunked
from attnkit.testing import assert_close


def saved_numels(backend: str, t: int) -> list[int]:
    q, k, v = (torch.randn(1, 2, t, 8, requires_grad=True) for _ in range(3))
    sizes: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        attention(q, k, v, causal=True, backend=backend)
    return sizes


def test_backward_saves_no_score_sized_tensor() -> None:
    t = 256
    assert max(saved_numels("chunked", t)) < t * t // 8
    assert max(saved_numels("reference", t)) >= t * t  # the check can fail: reference does save


def count_blocks(monkeypatch: pytest.MonkeyPatch, **kwargs: object) -> int:
    """Score blocks the kernel computes for a 64 x 64 call with 8 x 8 blocks."""
    computed = []
    original = problem.Problem.scores

    def counting(self, *args, **kw):  # type: ignore[no-untyped-def]
        computed.append(1)
        return original(self, *args, **kw)

    monkeypatch.setattr(problem.Problem, "scores", counting)
    q = torch.randn(1, 2, 64, 8)
    # The eager kernel's blocks are counted; the native kernel walks the same plan.
    small = Chunked(block_q=8, block_k=8, native=False)
    attention(q, q, q, backend=small, **kwargs)  # type: ignore[arg-type]
    return sum(computed)


def test_causal_skips_blocks_above_the_diagonal(monkeypatch: pytest.MonkeyPatch) -> None:
    assert count_blocks(monkeypatch) == 64  # 8 x 8 blocks
    assert count_blocks(monkeypatch, causal=True) == 36  # the 8 * 9 / 2 on or below the diagonal


def test_fully_masked_blocks_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    pad = masks.padding_mask([20], max_len=64)  # keys 20..63 are padding: 3 of 8 key blocks remain
    assert count_blocks(monkeypatch, mask=pad) == 8 * 3
    packed = masks.block_diagonal_mask([32, 32])  # two packed sequences: the off-diagonal quarter
    assert count_blocks(monkeypatch, mask=packed) == 32
    # The same masks as structured masks skip the same blocks, and a window only its band.
    assert count_blocks(monkeypatch, mask=masks.key_padding([20])) == 8 * 3
    assert count_blocks(monkeypatch, mask=masks.documents([32, 32])) == 32
    assert count_blocks(monkeypatch, mask=masks.documents([32, 32]) & masks.causal()) == 20
    assert count_blocks(monkeypatch, mask=masks.sliding_window(8)) == 8 + 7  # diagonal + below


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_default_blocks_equal_reference(causal: bool, kv_heads: int, native: bool) -> None:
    # 600 queries and 700 keys span several default blocks (512 x 256; causal 256 x 128, or 256 x
    # 256 with grouped heads), with ragged ends.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 600, 16, dtype=torch.float64, generator=g)
    k = torch.randn(1, kv_heads, 700, 16, dtype=torch.float64, generator=g)
    v = torch.randn(1, kv_heads, 700, 8, dtype=torch.float64, generator=g)
    mask = masks.padding_mask([650], max_len=700)
    got = attention(q, k, v, mask=mask, causal=causal, backend=Chunked(native=native))
    assert_close(got, attention(q, k, v, mask=mask, causal=causal, backend="reference"))


def test_causal_query_blocks_are_shorter_below_4096() -> None:
    # Short causal calls need shorter query blocks to have blocks to skip; key blocks stay 128.
    blocks = kernel.default_blocks
    assert [blocks(True, 1, t) for t in (1, 600, 4095, 4096, 8192)] == [(256, 128)] * 3 + [
        (512, 128)
    ] * 2
    assert blocks(False, 1, 1024) == (512, 256)
    assert blocks(True, 2, 1024) == (256, 256)


@pytest.mark.parametrize("native", [True, False])
def test_scores_rising_late_take_the_safe_path(native: bool) -> None:
    # Each key block's scores are 40 higher than the previous one's: the lazy offset from the first
    # block would overflow exp() by the last block, so the kernel must notice and redo the block.
    q = torch.ones(1, 1, 4, 1)
    k = torch.arange(64, dtype=torch.float32).div(8).floor().mul(40).view(1, 1, 64, 1)
    v = torch.randn(1, 1, 64, 3)
    got = attention(q, k, v, scale=1.0, backend=Chunked(block_q=4, block_k=8, native=native))
    want = attention(q.double(), k.double(), v.double(), scale=1.0, backend="reference")
    assert got.isfinite().all()
    assert_close(got, want)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("level", [-100.0, -30.0, -10.0, 0.0, 10.0, 20.0, 30.0, 100.0])
@pytest.mark.parametrize("extra", [None, "bias", "softcap"])
def test_score_levels_either_side_of_the_zero_offset(
    level: float, extra: str | None, native: bool
) -> None:
    # Rows whose scores sit near `level` (natural units): within +-22 the kernel takes offset 0
    # after the first key block (forward) and folds exp(-lse) into dO and delta (backward); beyond
    # that it subtracts per-row offsets. Both must equal the float64 reference, values and grads.
    gen = torch.Generator().manual_seed(int(level) + 100)
    q = torch.randn(1, 2, 40, 8, generator=gen)
    k = torch.randn(1, 2, 50, 8, generator=gen)
    v = torch.randn(1, 2, 50, 8, generator=gen)
    bias = torch.full((40, 50), level) if extra == "bias" else None
    kwargs = {"scale": 1 / 3, "softcap": 80.0} if extra == "softcap" else {"scale": 1 / 3}
    cot = torch.randn(1, 2, 40, 8, generator=gen)

    def grads(dtype: torch.dtype, backend: object) -> list[torch.Tensor]:
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        qq, kk, vv = leaves
        if extra != "bias":  # move every score by `level`: a constant extra feature
            qq = torch.cat([qq, qq.new_ones(1, 2, 40, 1)], -1)
            kk = torch.cat([kk, kk.new_full((1, 2, 50, 1), level * 3.0)], -1)
        b = None if bias is None else bias.to(dtype)
        out = attention(qq, kk, vv, bias=b, mask=masks.causal(), backend=backend, **kwargs)
        return [out, *torch.autograd.grad(out, leaves, cot.to(dtype))]

    got = grads(torch.float32, Chunked(block_q=16, block_k=16, native=native))
    want = grads(torch.float64, "reference")
    for g, w in zip(got, want, strict=True):
        assert g.isfinite().all()
        assert_close(g, w)


class FusedCalls:
    """Stand-ins for torch's fused CPU kernel that count calls (or refuse them)."""

    def __init__(self, allowed: bool = True) -> None:
        assert fused._FUSED is not None
        self.real = fused._FUSED
        self.allowed = allowed
        self.forward = self.backward = 0

    def ops(self) -> tuple[object, object]:
        def fwd(*args: object, **kw: object) -> object:
            assert self.allowed, "the fused kernel was given work it cannot compute"
            self.forward += 1
            return self.real[0](*args, **kw)

        def bwd(*args: object, **kw: object) -> object:
            assert self.allowed, "the fused kernel was given work it cannot compute"
            self.backward += 1
            return self.real[1](*args, **kw)

        return fwd, bwd


def fused_calls(monkeypatch: pytest.MonkeyPatch, allowed: bool = True) -> FusedCalls:
    calls = FusedCalls(allowed)
    monkeypatch.setattr(fused, "_FUSED", calls.ops())
    return calls


FUSED_CASES = {
    "plain": (None, False),
    "causal": (masks.causal(), False),
    "documents": (masks.documents([13, 0, 27]), False),
    "padding": (masks.key_padding([40, 25]), False),
    "prefix LM": (masks.from_fn(lambda b, h, q, kv: (kv <= q) | (kv < 12)), False),
    "window": (masks.sliding_window(20), False),
    "sinks": (masks.causal(), True),
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_stretches_equal_reference(
    monkeypatch: pytest.MonkeyPatch, case: str, dtype: torch.dtype
) -> None:
    # Fully visible stretches of 8+ queries go to torch's fused kernel and are merged with the
    # partial blocks of the same rows; the backward gives it the call's final output and
    # log-sum-exp. Grouped heads, Tq != Tk for the masks that allow it, values and gradients
    # against float64.
    mask, with_sinks = FUSED_CASES[case]
    tk = 40 if case in ("documents", "prefix LM", "causal", "sinks") else 46
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 40, 8, generator=g)
    k, v = torch.randn(2, 2, tk, 8, generator=g), torch.randn(2, 2, tk, 8, generator=g)
    sinks = torch.randn(4, generator=g) if with_sinks else None
    cot = torch.randn(2, 4, 40, 8, generator=g)
    calls = fused_calls(monkeypatch)

    def run(dt: torch.dtype, backend: object) -> list[torch.Tensor]:
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        extra = [] if sinks is None else [sinks.to(dt).requires_grad_()]
        kw = {} if sinks is None else {"sinks": extra[0]}
        out = attention(*leaves, mask=mask, backend=backend, **kw)  # type: ignore[arg-type]
        return [out, *torch.autograd.grad(out, leaves + extra, cot.to(dt))]

    got = run(dtype, Chunked(block_q=4, block_k=4, fused_rows=8, native=False))
    assert calls.forward > 0  # the path under test was taken
    assert calls.backward > 0
    want = run(torch.float64, "reference")
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


def test_fused_kernel_gets_only_what_it_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    # softcap, a bias, a score term, Dv != Dk, half precision, non-finite inputs and a last
    # dimension that is not contiguous (which the fused kernel would misread) stay in attnkit's
    # kernel, and still equal the reference.
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g) for _ in range(3))
    small = Chunked(block_q=4, block_k=4, fused_rows=8, native=False)
    strided = torch.randn(1, 2, 8, 32, generator=g).transpose(-1, -2)
    nan_v = v.clone()
    nan_v[..., 30:, :] = float("nan")  # hidden by the padding mask below
    calls: list[tuple[tuple[torch.Tensor, ...], dict[str, object]]] = [
        ((q, k, v), {"softcap": 5.0}),
        ((q, k, v), {"bias": torch.randn(32, 32, generator=g)}),
        ((q, k, v[..., :6]), {}),
        ((q.half(), k.half(), v.half()), {}),
        ((q, k, nan_v), {"mask": masks.key_padding([30])}),
        ((strided, k, v), {}),
        ((q, strided, v), {}),
    ]
    fused_calls(monkeypatch, allowed=False)
    for args, kw in calls:
        leaves = [t.detach().requires_grad_() for t in args]
        got = attention(*leaves, backend=small, **kw)  # type: ignore[arg-type]
        got.sum().backward()
        kw64 = {n: x.double() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
        want = attention(*(t.double() for t in args), backend="reference", **kw64)  # type: ignore[arg-type]
        assert_close(got, want)
    # The control: the same call without any of those takes the fused path, which would fail here.
    with pytest.raises(AssertionError, match="cannot compute"):
        attention(q, k, v, backend=small)


def test_explain_tells_what_the_fused_kernel_computes() -> None:
    q = torch.randn(1, 2, 64, 8)
    plain = str(
        attnkit.explain(q, q, q, backend=Chunked(block_q=8, block_k=8, fused_rows=16, native=False))
    )
    assert "torch's fused CPU kernel: 100% of the pairs in 1 call" in plain
    capped = attnkit.explain(
        q, q, q, softcap=5.0, backend=Chunked(block_q=8, fused_rows=16, native=False)
    )
    assert "fused CPU kernel" not in str(capped)
    off = attnkit.explain(q, q, q, backend=Chunked(block_q=8, block_k=8, fused_rows=None))
    assert "fused CPU kernel" not in str(off)


@pytest.mark.parametrize("cotangent", ["sum", "transposed"])
def test_fused_backward_takes_any_output_gradient_layout(
    monkeypatch: pytest.MonkeyPatch, cotangent: str
) -> None:
    # The fused backward gets the output gradient in whatever layout autograd hands it:
    # out.sum().backward() gives one with every stride 0, a transposed cotangent one whose last
    # dimension is not contiguous.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 32, 8, generator=g, dtype=torch.float64) for _ in range(3))
    cot = torch.randn(1, 2, 8, 32, generator=g, dtype=torch.float64).transpose(-1, -2)
    calls = fused_calls(monkeypatch)

    def grads(backend: object) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, mask=masks.causal(), backend=backend)  # type: ignore[call-overload]
        if cotangent == "sum":
            out.sum().backward()
        else:
            out.backward(cot)
        return [t.grad for t in leaves]  # type: ignore[misc]

    got = grads(Chunked(block_q=4, block_k=4, fused_rows=8, native=False))
    assert calls.backward > 0
    for a, b in zip(got, grads("reference"), strict=True):
        assert_close(a, b)


def _lazy_case(mask_kind: str, extra: str | None) -> dict[str, object]:
    """A call for the kernel's lazy offsets: |q| |k| scale is far beyond 2^32 in base 2 (a large
    feature of q meets a zero one of k, and the reverse), so offset 0 is not known to hold for the
    call, while most scores are small. Some rows see no key in the first key block the plan gives
    them; with ``extra="bias"`` some rows' scores are all about -120 (e^-120 underflows float32)."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 2, 40, 8, generator=gen)
    k = torch.randn(2, 2, 40, 8, generator=gen)
    q[..., 6:], k[..., 6:] = 0.0, 0.0
    q[..., 7], k[..., 6] = 30.0, 30.0
    v = torch.randn(2, 2, 40, 8, generator=gen)
    bias = torch.randn(40, 40, generator=gen) if extra == "bias" else None
    mask: masks.Mask
    if mask_kind == "documents":  # a document starts mid-block: its rows see nothing before it
        mask = masks.documents([24, 16])
        if bias is not None:
            bias[24:] -= 120.0
    elif mask_kind == "padding":  # batch row 1 has no real key: its rows see nothing at all
        mask = masks.key_padding([40, 0])
    else:  # a window, and a -inf bias that hides the first keys of some rows
        mask = masks.sliding_window(20)
        if bias is None:
            bias = torch.zeros(40, 40)
        else:
            bias[36:] -= 120.0
        bias[20:28, :16] = float("-inf")
    return {
        "q": q,
        "k": k,
        "v": v,
        "mask": mask,
        "bias": bias,
        "softcap": 30.0 if extra == "softcap" else None,
    }


@pytest.mark.parametrize("extra", [None, "bias", "softcap"])
@pytest.mark.parametrize("mask_kind", ["documents", "padding", "window"])
def test_lazy_offsets_of_rows_that_see_no_key_at_first(mask_kind: str, extra: str | None) -> None:
    # Such a row keeps offset -inf (or takes 0 once every row of the block is reached), so the
    # check at the end must send its block to the textbook path whenever that was not exact.
    x = _lazy_case(mask_kind, extra)
    cot = torch.randn(2, 2, 40, 8, generator=torch.Generator().manual_seed(8))

    def grads(dtype: torch.dtype, backend: object) -> list[torch.Tensor]:
        leaves = [x[n].to(dtype).requires_grad_() for n in ("q", "k", "v")]  # type: ignore[union-attr]
        bias = x["bias"]
        out = attention(
            *leaves,
            mask=x["mask"],
            bias=None if bias is None else bias.to(dtype),  # type: ignore[union-attr]
            softcap=x["softcap"],
            backend=backend,
        )  # type: ignore[call-overload]
        return [out, *torch.autograd.grad(out, leaves, cot.to(dtype))]

    got = grads(torch.float32, Chunked(block_q=16, block_k=16, fused_rows=None, native=False))
    want = grads(torch.float64, "reference")
    for g, w in zip(got, want, strict=True):
        assert g.isfinite().all()
        assert_close(g, w)


def test_each_block_is_computed_once_when_the_offsets_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    # Offset 0 for the whole call (small scores), and lazy offsets that need no redo (large
    # scores rising nowhere): every visited block once, as the plan says.
    computed = []
    original = problem.Problem.scores

    def counting(self, *args, **kw):  # type: ignore[no-untyped-def]
        computed.append(1)
        return original(self, *args, **kw)

    monkeypatch.setattr(problem.Problem, "scores", counting)
    gen = torch.Generator().manual_seed(0)
    for size in (1.0, 4.0):
        q, k, v = (torch.randn(1, 2, 64, 8, generator=gen) * size for _ in range(3))
        computed.clear()
        attention(q, k, v, mask=masks.causal(), backend=Chunked(block_q=8, block_k=8, native=False))
        assert sum(computed) == 36, size


# --------------------------------------------------------------------------------------------------
# The meta device: the outputs' shapes without values


def _meta_twin(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().to("meta").requires_grad_(t.requires_grad) for t in tensors]


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"causal": True},
        {"mask": masks.sliding_window(3) & masks.causal(), "softcap": 5.0, "dropout_p": 0.1},
        {"mask": masks.from_fn(lambda b, h, i, j: (i + j) % 3 != 0)},  # no operator spelling
        {"score_mod": lambda s, b, h, i, j: s * 0.5 + (i - j)},
        {"bias": "dense", "sinks": True},
    ],
    ids=["plain", "causal", "window-softcap-dropout", "from_fn", "score_mod", "bias-sinks"],
)
def test_meta_tensors_run_as_the_same_call_on_the_cpu(kw: dict[str, object]) -> None:
    """A call on the meta device that chunked serves gives what the same call gives on the CPU,
    but for the values: out and lse of the same shapes, dtypes and layouts, and gradients of the
    same shapes for q, k, v, the bias and the sinks. (The kernel itself reads the values: the
    plan, whether q, k and v are finite; on meta it is the operator's fake kernel that answers.)"""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 6, 8, generator=g).transpose(1, 2).contiguous().transpose(1, 2)
    k, v = (torch.randn(2, 2, 7, 8, generator=g) for _ in range(2))
    extra: dict[str, object] = dict(kw)
    tensors = [q, k, v]
    if extra.pop("bias", None):
        tensors.append(torch.randn(4, 6, 7, generator=g))
    if extra.pop("sinks", None):
        tensors.append(torch.randn(4, generator=g))
    for t in tensors:
        t.requires_grad_()
    results = []
    for device_tensors in (tensors, _meta_twin(*tensors)):
        cq, ck, cv, *rest = device_tensors
        named = dict(zip(("bias", "sinks"), rest, strict=False)) if "bias" in kw else {}
        out, lse = attention(
            cq,
            ck,
            cv,
            **extra,
            **named,
            return_lse=True,
            backend="chunked",  # type: ignore[arg-type]
        )
        (out.sum() + lse.sum()).backward()
        results.append((out, lse, [t.grad for t in device_tensors]))
    (out, lse, grads), (m_out, m_lse, m_grads) = results
    assert m_out.is_meta
    assert m_lse.is_meta
    for real, meta in ((out, m_out), (lse, m_lse), *zip(grads, m_grads, strict=True)):
        assert real is not None
        assert meta is not None
        assert (meta.shape, meta.dtype, meta.stride()) == (real.shape, real.dtype, real.stride())


def test_auto_serves_a_meta_call_that_asks_for_the_lse() -> None:
    """explain() says chunked serves a meta call with return_lse; the call then runs (it used to
    read the inputs' sizes from the meta tensors: "Cannot copy out of meta tensor")."""
    q = torch.empty(2, 4, 8, 16, device="meta")
    assert "auto picks: chunked" in str(attnkit.explain(q, q, q, return_lse=True))
    out, lse = attention(q, q, q, return_lse=True)
    assert (out.shape, lse.shape, lse.dtype) == ((2, 4, 8, 16), (2, 4, 8), torch.float32)


def test_a_module_built_on_the_meta_device_runs_there() -> None:
    """MultiHeadAttention(add_bias_kv=True) attends its extra key through the log-sum-exp
    (return_lse=True): built under torch.device("meta"), its forward and backward run there and
    give what the same module gives on the CPU, in shape."""
    torch.manual_seed(0)
    real = attnkit.MultiHeadAttention(16, 4, add_bias_kv=True)
    with torch.device("meta"):
        meta = attnkit.MultiHeadAttention(16, 4, add_bias_kv=True)
        x = torch.randn(2, 5, 16, requires_grad=True)
    out = meta(x, causal=True)
    out.sum().backward()
    want = real(torch.randn(2, 5, 16), causal=True)
    assert out.is_meta
    assert out.shape == want.shape
    assert x.grad is not None
    assert meta.bias_k.grad is not None
    assert meta.bias_k.grad.shape == meta.bias_k.shape


def test_pages_with_strided_rows_are_gathered_not_read_in_place() -> None:
    # A CacheView takes pages at any strides; the native read takes rows of contiguous Dk and
    # raised 'rows must be contiguous' for pages that are every other column of a wider tensor.
    from attnkit import CacheView

    g = torch.Generator().manual_seed(0)
    pages = torch.randn(3, 2, 16, 16, generator=g)[..., ::2]  # (3, 2, 16, 8), stride 2 along D
    for ranges in ([(0, 9), (0, 5), (2, 12)], [(0, 9)] * 3):
        view = CacheView(pages, pages, ranges)
        q = torch.randn(3, 4, 4, 8, generator=g)
        said = attnkit.explain(q, view, causal=True, backend="chunked")
        assert "rows are not contiguous" in str(said), ranges
        want = attnkit.attention(q, view, causal=True, backend="reference")
        assert_close(attnkit.attention(q, view, causal=True, backend="chunked"), want)
