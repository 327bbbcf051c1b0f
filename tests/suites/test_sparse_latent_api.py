"""Index masks and multi-head latent attention used the way their users use them: every entry
point, every backend, the index tensors people actually pass (other integer dtypes, views,
broadcast batches), the sizes at the edges, gradients, torch.compile, torch.export and ONNX,
autocast, and the latent module in low precision, compiled, and over every cache.

Every result is compared with a float64 formula written here (the allowed pairs built from the
indices by a scatter of this file's own), with attnkit's reference backend, or with the other
form of the same module: never with a shape alone.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks
from attnkit.modules.latent import MultiHeadLatentAttention
from attnkit.testing import assert_close

F64 = torch.float64
# flex on the CPU compiles FlexAttention once per shape and mask kind (seconds each): it runs
# the calls of one shape, the layouts and the blocks; the others check its refusals only.
EAGER = ("auto", "chunked", "reference", "sdpa")
BACKENDS = (*EAGER, "flex")
# B, H, Tq = Tk, D, k: k / Tk below a quarter, so the chunked backend gathers
B, H, T, D, K = 2, 4, 40, 8, 3


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=gen(seed), dtype=F64).to(dtype)


def qkv(seed: int, dtype: torch.dtype = torch.float32, tq: int = T, tk: int = T) -> list[Tensor]:
    return [
        randn(B, H, tq, D, seed=seed, dtype=dtype),
        randn(B, H, tk, D, seed=seed + 1, dtype=dtype),
        randn(B, H, tk, D, seed=seed + 2, dtype=dtype),
    ]


def picks(*shape: int, high: int, seed: int, low: int = -1) -> Tensor:
    """Random entries in ``low .. high - 1`` (``-1``: none), repeats included."""
    return torch.randint(low, high, shape, generator=gen(seed))


def allowed(indices: Tensor, kv_len: int, block: int = 1) -> Tensor:
    """``(B|1, Hi, Tq, Tk)`` bool: the keys ``indices`` selects, each entry ``x`` standing for
    keys ``x * block`` to ``x * block + block - 1`` (those below ``kv_len``); ``-1`` none."""
    idx = indices.long()
    keys = (idx.unsqueeze(-1) * block + torch.arange(block)).flatten(-2)
    keys = keys.where((idx >= 0).repeat_interleave(block, -1) & (keys < kv_len), kv_len)
    out = torch.zeros(*idx.shape[:-1], kv_len + 1, dtype=torch.bool)
    return out.scatter(-1, keys, True)[..., :kv_len]


def formula(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float | None = None) -> Tensor:
    """Attention in float64; ``visible`` broadcasts to ``(B, Hi, Tq, Tk)`` with ``Hi`` dividing
    ``H`` (query head ``h`` reads selection ``h // (H / Hi)``). A query that sees nothing: 0."""
    h, hkv = q.size(1), k.size(1)
    k64, v64 = (t.double().repeat_interleave(h // hkv, 1) for t in (k, v))
    vis = visible.repeat_interleave(h // visible.size(1), 1)
    s = q.double() @ k64.mT * (1 / math.sqrt(q.size(-1)) if scale is None else scale)
    return torch.softmax(s.masked_fill(~vis, -math.inf), -1).nan_to_num(0.0) @ v64


def causal_pairs(tq: int, tk: int) -> Tensor:
    """``(Tq, Tk)``: query ``i`` sees keys ``j <= i + Tk - Tq`` (aligned to the end)."""
    return torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + tk - tq


def causal_picks(rows: int, heads: int, tq: int, k: int, seed: int) -> Tensor:
    """Entries each query may see under ``causal()`` (Tq = Tk), ``-1`` and repeats included."""
    raw = picks(rows, heads, tq, k, high=1 << 20, seed=seed)
    return raw.where(raw < 0, raw % (torch.arange(tq).view(1, 1, tq, 1) + 1))


# --------------------------------------------------------------------------------------------------
# The index tensors people pass


LAYOUTS: dict[str, Callable[[Tensor], Tensor]] = {
    "int64": lambda i: i,
    "int32": lambda i: i.int(),
    "int16": lambda i: i.short(),
    "uint8": lambda i: i.clamp(min=0).to(torch.uint8),  # (no -1 in an unsigned dtype)
    "transposed": lambda i: i.mT.contiguous().mT,
    "batch_expanded": lambda i: i[:1].expand(B, -1, -1, -1),  # stride 0 along B
    "head_expanded": lambda i: i[:, :1].expand(-1, H, -1, -1),  # stride 0 along Hi
    "one_key_everywhere": lambda i: torch.tensor(7).expand(B, 1, T, K),  # every stride 0
}


@pytest.mark.parametrize(
    ("layout", "backend"),
    [(lay, b) for lay in LAYOUTS for b in EAGER]
    + [(lay, "flex") for lay in ("int32", "transposed", "batch_expanded", "head_expanded")],
)
def test_index_layouts_and_dtypes_on_every_backend_are_the_formula(
    layout: str, backend: str
) -> None:
    q, k, v = qkv(1)
    idx = LAYOUTS[layout](picks(B, 1, T, K, high=T, seed=2))
    mask = masks.key_indices(idx) & masks.causal()
    got = attnkit.attention(q, k, v, mask=mask, backend=backend)
    want = formula(q, k, v, allowed(idx, T) & causal_pairs(T, T))
    assert_close(got, want, dtype=torch.float32)


@pytest.mark.parametrize("backend", EAGER)
def test_a_batch_of_one_selection_broadcasts_over_the_batch(backend: str) -> None:
    q, k, v = qkv(3)
    idx = picks(1, 2, T, K, high=T, seed=4)  # Hi = 2 of H = 4: one selection per pair of heads
    got = attnkit.attention(q, k, v, mask=masks.key_indices(idx), backend=backend)
    assert_close(got, formula(q, k, v, allowed(idx, T)), dtype=torch.float32)


@pytest.mark.parametrize(
    ("block", "backend"),
    # 40 keys: blocks that do not divide Tk, and one past all of them
    [(n, b) for n in (3, 7, 64) for b in EAGER] + [(7, "flex"), (64, "flex")],
)
def test_block_indices_of_blocks_that_do_not_divide_the_keys(block: int, backend: str) -> None:
    q, k, v = qkv(5)
    blocks = -(-T // block)
    idx = picks(B, 1, T, 2, high=blocks, seed=6)
    mask = masks.block_indices(idx, block=block) & masks.causal()
    got = attnkit.attention(q, k, v, mask=mask, backend=backend)
    want = formula(q, k, v, allowed(idx, T, block) & causal_pairs(T, T))
    assert_close(got, want, dtype=torch.float32)


def test_indices_that_are_not_an_integer_tensor_are_refused_naming_what_came() -> None:
    idx = picks(1, 1, 3, 2, high=3, seed=7)
    for given, name in (
        (idx.tolist(), "list"),
        (idx.numpy(), "ndarray"),
        (idx.float(), "torch.float32"),
    ):
        with pytest.raises(
            TypeError, match=rf"takes an integer tensor \(B\|1, Hi, Tq, k\), got {name}"
        ):
            masks.key_indices(given)  # type: ignore[arg-type]
    # a list made a tensor is the same selection
    q, k, v = qkv(8, tq=3, tk=3)
    a = attnkit.attention(q, k, v, mask=masks.key_indices(torch.tensor(idx.tolist())))
    b = attnkit.attention(q, k, v, mask=masks.key_indices(torch.from_numpy(np.asarray(idx))))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"block must be >= 1, got 0"):
        masks.block_indices(idx, block=0)
    with pytest.raises(TypeError, match=r"block must be an int, got 2.0"):
        masks.block_indices(idx, block=2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
def test_entries_outside_the_keys_and_heads_that_do_not_divide_are_refused(backend: str) -> None:
    q, k, v = qkv(9)
    idx = picks(B, 1, T, K, high=T, seed=10)
    run = lambda i: attnkit.attention(q, k, v, mask=masks.key_indices(i), backend=backend)  # noqa: E731
    with pytest.raises(ValueError, match=r"entries from \d+ to \d+, .* Tk = 40 keys \(0 to 39\)"):
        run(idx + T)
    with pytest.raises(ValueError, match=r"entries from -2 to .* must be -1 \(none\)"):
        run(idx.clamp(min=0) - 2)
    with pytest.raises(ValueError, match=r"gives 3 heads, which do not divide the call's H = 4"):
        run(idx.expand(-1, 3, -1, -1))
    with pytest.raises(ValueError, match=r"selects keys for 39 queries but the call has Tq = 40"):
        run(idx[:, :, 1:])
    with pytest.raises(ValueError, match=r"has 3 batch rows but the call has B = 2"):
        run(torch.cat([idx, idx[:1]]))


def test_indices_on_meta_are_checked_and_shaped_and_meta_indices_need_a_meta_call() -> None:
    q, k, v = (t.to("meta") for t in qkv(11))
    idx = picks(B, 1, T, K, high=T, seed=12)
    for i in (idx, idx.to("meta")):
        assert attnkit.attention(q, k, v, mask=masks.key_indices(i)).shape == (B, H, T, D)
    with pytest.raises(ValueError, match=r"is on meta, which holds no values, but the call's q"):
        attnkit.attention(*qkv(11), mask=masks.key_indices(idx.to("meta")))


def test_dense_of_a_selection_of_several_batch_rows_says_to_pass_batch_size() -> None:
    idx = picks(2, 1, 3, 1, high=2, seed=13)
    mask = masks.block_indices(idx, block=2) & masks.causal()
    with pytest.raises(ValueError, match=r"has 2 batch rows, .* pass batch_size=2"):
        mask.dense(3, 4)
    want = allowed(idx, 4, 2) & causal_pairs(3, 4)
    assert torch.equal(mask.dense(3, 4, batch_size=2), want)


# --------------------------------------------------------------------------------------------------
# Sizes at the edges


EDGES: dict[str, tuple[int, int, int, int]] = {  # B, Tq, Tk, k
    "no_entries": (B, 5, 40, 0),
    "no_queries": (B, 0, 40, 3),
    "no_keys": (B, 5, 0, 3),  # every entry -1
    "no_rows": (0, 5, 40, 3),
}


@pytest.mark.parametrize(
    ("edge", "backend"),
    # (flex refuses the empty sizes; k = 0 alone would compile it for a shape of its own)
    [(e, b) for e in EDGES for b in BACKENDS if (e, b) != ("no_entries", "flex")],
)
def test_edge_sizes_give_the_formula(edge: str, backend: str) -> None:
    b, tq, tk, n = EDGES[edge]
    q = randn(b, H, tq, D, seed=14)
    k, v = randn(b, H, tk, D, seed=15), randn(b, H, tk, D, seed=16)
    idx = picks(b, 1, tq, n, high=max(tk, 0), seed=17) if tk else torch.full((b, 1, tq, n), -1)
    if backend == "flex" and not b * tq * tk:
        with pytest.raises(attnkit.BackendError, match=r"FlexAttention needs a batch row, a he"):
            attnkit.attention(q, k, v, mask=masks.key_indices(idx), backend=backend)
        return
    got = attnkit.attention(q, k, v, mask=masks.key_indices(idx), backend=backend)
    assert_close(got, formula(q, k, v, allowed(idx, tk)), dtype=torch.float32)


@pytest.mark.parametrize("backend", EAGER)
def test_a_selection_of_none_gives_zero_rows(backend: str) -> None:
    q, k, v = qkv(18)
    idx = picks(B, 1, T, K, high=T, seed=19)
    idx[0, 0, :7] = -1  # queries that select nothing
    got = attnkit.attention(q, k, v, mask=masks.key_indices(idx), backend=backend)
    assert torch.equal(got[0, :, :7], torch.zeros_like(got[0, :, :7]))
    assert_close(got, formula(q, k, v, allowed(idx, T)), dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# Composition


def test_compositions_are_the_formula_and_explain_says_how_each_runs() -> None:
    q, k, v = qkv(20)
    a, b = picks(B, 1, T, K, high=T, seed=21), picks(B, 1, T, K, high=T, seed=22)
    sel_a, sel_b, near = allowed(a, T), allowed(b, T), causal_pairs(T, T)
    cases = {
        "gathered": (masks.key_indices(a) & masks.key_indices(b), sel_a & sel_b),
        "gathered ": (masks.key_indices(a) | masks.key_indices(b), sel_a | sel_b),
        "scanned, not gathered": (masks.key_indices(a) | masks.causal(), sel_a | near),
        " gathered": (
            masks.key_indices(a) & masks.key_padding(torch.tensor([40, 25])),
            sel_a & (torch.arange(T) < torch.tensor([40, 25])[:, None]).view(B, 1, 1, T),
        ),
    }
    for says, (mask, visible) in cases.items():
        assert_close(attnkit.attention(q, k, v, mask=mask), formula(q, k, v, visible))
        assert says.strip() in str(attnkit.explain(q, k, v, mask=mask))
    with pytest.raises(TypeError, match=r"~key_indices\(indices \(2, 1, 40, 3\)\): attnkit masks"):
        ~masks.key_indices(a)


@pytest.mark.parametrize("backend", EAGER)
def test_indices_changed_in_place_between_calls_are_read_again(backend: str) -> None:
    # (the selected keys and the call's plan are kept per tensor version)
    q, k, v = qkv(56)
    idx = picks(B, 1, T, K, high=T, seed=57)
    mask = masks.key_indices(idx) & masks.causal()
    attnkit.attention(q, k, v, mask=mask, backend=backend)
    idx.copy_(picks(B, 1, T, K, high=T, seed=58))
    got = attnkit.attention(q, k, v, mask=mask, backend=backend)
    assert_close(got, formula(q, k, v, allowed(idx, T) & causal_pairs(T, T)), dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# Gradients


@pytest.mark.parametrize("backend", ["auto", "chunked", "reference", "sdpa"])
def test_gradcheck_through_each_backend(backend: str) -> None:
    # Tk = 24, k = 2: the chunked backend gathers (torch's sparse products in float64); H = 4
    # query heads over Hkv = 2, each query head its own selection (Hi = 4 > Hkv)
    q = randn(1, 4, 6, 3, seed=23, dtype=F64).requires_grad_()
    k, v = (randn(1, 2, 24, 3, seed=n, dtype=F64).requires_grad_() for n in (24, 25))
    idx = picks(1, 4, 6, 2, high=24, seed=27)
    mask = masks.key_indices(idx) & masks.causal()
    softcap = None if backend == "sdpa" else 3.0  # (torch's kernel has none)
    fn = lambda *t: attnkit.attention(*t, mask=mask, backend=backend, softcap=softcap)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


def test_flex_on_the_cpu_says_it_computes_no_gradients() -> None:
    q, k, v = (t.requires_grad_() for t in qkv(28))
    mask = masks.key_indices(picks(B, 1, T, K, high=T, seed=29))
    with pytest.raises(attnkit.BackendError, match=r"flex .*cannot: .* computes no gradients"):
        attnkit.attention(q, k, v, mask=mask, backend="flex")


# --------------------------------------------------------------------------------------------------
# torch.compile, torch.export, ONNX, autocast


@pytest.mark.parametrize(
    ("backend", "dynamic"),
    [
        ("auto", None),
        ("sdpa", None),
        *((b, True) for b in ("auto", "chunked", "reference", "sdpa")),
    ],
)
def test_compiled_with_the_indices_as_an_input_runs_new_indices_without_recompiling(
    backend: str, dynamic: bool | None
) -> None:
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def step(q: Tensor, k: Tensor, v: Tensor, idx: Tensor) -> Tensor:
        mask = masks.key_indices(idx) & masks.causal()
        return attnkit.attention(q, k, v, mask=mask, backend=backend)  # type: ignore[no-any-return]

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend=counter)
    q, k, v = qkv(30)
    for seed in (31, 32, 33):
        idx = causal_picks(B, 1, T, K, seed)
        want = formula(q, k, v, allowed(idx, T) & causal_pairs(T, T))
        assert_close(compiled(q, k, v, idx), want, dtype=torch.float32)
    assert counter.frame_count == 1


def test_a_mask_object_as_a_compiled_input_takes_new_masks_without_recompiling() -> None:
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def step(q: Tensor, k: Tensor, v: Tensor, mask: masks.Mask) -> Tensor:
        return attnkit.attention(q, k, v, mask=mask)  # type: ignore[no-any-return]

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    q, k, v = qkv(59)
    for seed in (60, 61):
        idx = picks(B, 1, T, K, high=T, seed=seed)
        got = compiled(q, k, v, masks.key_indices(idx) & masks.causal())
        assert_close(got, formula(q, k, v, allowed(idx, T) & causal_pairs(T, T)))
    assert counter.frame_count == 1


def test_export_with_dynamic_lengths_runs_other_lengths_and_indices() -> None:
    class Sparse(torch.nn.Module):
        def forward(self, q: Tensor, k: Tensor, v: Tensor, idx: Tensor) -> Tensor:
            mask = masks.block_indices(idx, block=4) & masks.causal()
            return attnkit.attention(q, k, v, mask=mask)  # type: ignore[no-any-return]

    length = torch.export.Dim("T", min=8, max=128)
    seq = {2: length}
    q, k, v = qkv(34)
    program = torch.export.export(
        Sparse(), (q, k, v, picks(B, 1, T, 2, high=10, seed=35)), dynamic_shapes=[seq] * 4
    )
    for t in (T, 23):
        q, k, v = qkv(36, tq=t, tk=t)
        idx = picks(B, 1, t, 2, high=-(-t // 4), seed=37)
        want = formula(q, k, v, allowed(idx, t, 4) & causal_pairs(t, t))
        assert_close(program.module()(q, k, v, idx), want, dtype=torch.float32)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_onnx_of_sparse_calls_runs_in_onnxruntime_at_other_lengths(tmp_path: Path) -> None:
    # One program, two calls: chunked's operator, which the exporter writes as its dense form, and
    # sdpa's call as torch's attention. Dynamic lengths, and queries that select no key they may
    # see (their output is 0, where ONNX's attention alone would give the mean of the values).
    pytest.importorskip("onnxscript", reason="ONNX export needs the test extra onnxscript")
    ort = pytest.importorskip("onnxruntime", reason="the test extra onnxruntime runs the model")

    class Sparse(torch.nn.Module):
        def forward(self, q: Tensor, k: Tensor, v: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
            mask = masks.key_indices(idx) & masks.causal()
            a = attnkit.attention(q, k, v, mask=mask, backend="chunked")
            b = attnkit.attention(q, k, v, mask=mask, backend="sdpa")
            return a, b  # type: ignore[return-value]

    length = torch.export.Dim("T", min=8, max=128)
    program = torch.export.export(
        Sparse(), (*qkv(38), picks(B, 1, T, K, high=T, seed=39)), dynamic_shapes=[{2: length}] * 4
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onnx_program = torch.onnx.export(program, dynamo=True, verbose=False)
    assert onnx_program is not None
    onnx_program.save(str(tmp_path / "sparse.onnx"))
    session = ort.InferenceSession(
        str(tmp_path / "sparse.onnx"), providers=["CPUExecutionProvider"]
    )
    names = [i.name for i in session.get_inputs()]
    for t in (T, 17):
        q, k, v = qkv(40, tq=t, tk=t)
        idx = picks(B, 1, t, K, high=t, seed=41)
        visible = allowed(idx, t) & causal_pairs(t, t)
        assert not visible.any(-1).all()  # some queries see no key
        feeds = dict(zip(names, (x.numpy() for x in (q, k, v, idx)), strict=True))
        for got in session.run(None, feeds):
            assert_close(torch.from_numpy(got), formula(q, k, v, visible), dtype=torch.float32)


@pytest.mark.parametrize("backend", ["auto", "chunked", "sdpa"])
def test_autocast_bfloat16_on_the_cpu(backend: str) -> None:
    q, k, v = qkv(42)
    idx = picks(B, 2, T, K, high=T, seed=43)
    mask = masks.key_indices(idx) & masks.causal()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attnkit.attention(q, k, v, mask=mask, backend=backend)
    assert got.dtype == torch.bfloat16
    want = formula(*(t.bfloat16() for t in (q, k, v)), allowed(idx, T) & causal_pairs(T, T))
    assert_close(got, want, dtype=torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# MultiHeadAttention with an index mask


def test_multihead_attention_with_an_index_mask_decodes_over_each_cache() -> None:
    torch.manual_seed(44)
    m = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2).double().eval()
    x = randn(2, 12, 32, seed=45, dtype=F64)
    idx = causal_picks(2, 2, 12, 3, seed=46)  # one selection per key/value head
    with torch.no_grad():
        whole = m(x, mask=masks.key_indices(idx) & masks.causal())
        dense = (allowed(idx, 12) & causal_pairs(12, 12)).repeat_interleave(2, 1)
        assert_close(whole, m(x, mask=dense))
        caches = (
            attnkit.KVCache(2, 16, 2, 8, dtype=F64),
            attnkit.PagedKVCache(16, 4, 2, 8, max_seqs=2, dtype=F64),
        )
        for cache in caches:
            steps = [
                m(x[:, a:e], mask=masks.key_indices(idx[:, :, a:e]) & masks.causal(), cache=cache)
                for a, e in ((0, 6), *((t, t + 1) for t in range(6, 12)))
            ]
            assert_close(torch.cat(steps, 1), whole)


# --------------------------------------------------------------------------------------------------
# MultiHeadLatentAttention


SIZES: dict[str, Any] = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


def mla(q_lora_rank: int | None = 12, dtype: torch.dtype = F64) -> MultiHeadLatentAttention:
    torch.manual_seed(47)
    return MultiHeadLatentAttention(32, 4, q_lora_rank=q_lora_rank, **SIZES, dtype=dtype).eval()


def latent_caches(m: MultiHeadLatentAttention) -> dict[str, Any]:
    return {
        "latent": m.make_cache(2, 32),
        "kv": m.make_kv_cache(2, 32),
        "paged": m.make_paged_cache(16, 4, max_seqs=2),
    }


def test_an_odd_rotary_size_is_refused_naming_qk_rope_head_dim() -> None:
    with pytest.raises(ValueError, match=r"qk_rope_head_dim \(3\) must be even .* give rotary="):
        MultiHeadLatentAttention(32, 4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=3)


@pytest.mark.parametrize("heads", [1, 2, 4])
@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_both_forms_with_an_index_mask_of_each_head_count_agree(
    q_lora_rank: int | None, heads: int
) -> None:
    # The absorbed form is one key/value head for H = 4 query heads: Hi = 2 or 4 selections
    # still apply per query head, as in the expanded form.
    m = mla(q_lora_rank)
    x = randn(2, 30, 32, seed=48, dtype=F64)
    idx = causal_picks(2, heads, 30, 3, seed=49)
    mask = masks.key_indices(idx) & masks.causal()
    with torch.no_grad():
        expanded = m(x, mask=mask, form="expanded")
        assert_close(m(x, mask=mask, form="absorbed"), expanded)
        # against the module's own dense mask: the selection is not ignored
        dense = (allowed(idx, 30) & causal_pairs(30, 30)).repeat_interleave(4 // heads, 1)
        assert_close(m(x, mask=dense, form="expanded"), expanded)


@pytest.mark.parametrize("cache", ["latent", "kv", "paged"])
def test_16_decoded_tokens_over_each_cache_equal_the_expanded_form(cache: str) -> None:
    m = mla()
    x = randn(2, 20, 32, seed=50, dtype=F64)
    store = latent_caches(m)[cache]
    with torch.no_grad():
        whole = m(x, causal=True, form="expanded")
        steps = [m(x[:, :4], causal=True, cache=store)]
        steps += [m(x[:, t : t + 1], causal=True, cache=store) for t in range(4, 20)]
    assert_close(torch.cat(steps, 1), whole)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_module_in_low_precision_decodes_near_float64(dtype: torch.dtype) -> None:
    m64 = mla()
    m = copy.deepcopy(m64).to(dtype)
    assert m.make_cache(1, 1).latent.dtype == dtype
    x = randn(2, 12, 32, seed=51, dtype=F64)
    with torch.no_grad():
        want = m64(x, causal=True)
        for store in latent_caches(m).values():
            steps = [m(x[:, :5].to(dtype), causal=True, cache=store)]
            steps += [m(x[:, t : t + 1].to(dtype), causal=True, cache=store) for t in range(5, 12)]
            got = torch.cat(steps, 1)
            assert got.dtype == dtype
            assert_close(got, want, dtype=dtype, conditioning=4.0)


def test_a_quantized_latent_cache_decodes_near_the_float_one() -> None:
    m = mla(dtype=torch.float32)
    x = randn(2, 12, 32, seed=52)
    store = m.make_kv_cache(2, 16, kv_dtype=torch.int8)
    with torch.no_grad():
        want = m(x, causal=True).double()
        steps = [m(x[:, :5], causal=True, cache=store)]
        steps += [m(x[:, t : t + 1], causal=True, cache=store) for t in range(5, 12)]
    err = (torch.cat(steps, 1).double() - want).abs().max().item()
    assert 0 < err < 2e-2  # quantized (not the float cache), and close


def test_state_dict_round_trip_and_to_dtype() -> None:
    m = mla()
    fresh = MultiHeadLatentAttention(32, 4, q_lora_rank=12, **SIZES, dtype=F64)
    fresh.load_state_dict(m.state_dict())
    x = randn(2, 9, 32, seed=53, dtype=F64)
    with torch.no_grad():
        assert torch.equal(fresh(x, causal=True), m(x, causal=True))
        half = copy.deepcopy(m).to(torch.bfloat16)
        assert all(p.dtype == torch.bfloat16 for p in half.parameters())
        assert_close(half(x.bfloat16(), causal=True), m(x, causal=True), dtype=torch.bfloat16)


@pytest.mark.parametrize("cache", ["latent", "kv"])
def test_a_compiled_decode_step_over_a_cache_compiles_once(cache: str) -> None:
    from torch._dynamo.testing import CompileCounter

    m = mla(dtype=torch.float32)
    x = randn(2, 12, 32, seed=54)
    store = latent_caches(m)[cache]
    counter = CompileCounter()
    step = torch.compile(
        lambda t: m(t, causal=True, cache=store), fullgraph=True, dynamic=True, backend=counter
    )
    with torch.no_grad():
        whole = m(x, causal=True)
        steps = [m(x[:, :4], causal=True, cache=store)]
        steps += [step(x[:, t : t + 1]) for t in range(4, 12)]
    assert_close(torch.cat(steps, 1), whole.double(), dtype=torch.float32)
    assert counter.frame_count == 1


def test_the_module_on_no_rows_and_no_tokens() -> None:
    m = mla()
    x = randn(2, 6, 32, seed=55, dtype=F64)
    with torch.no_grad():
        assert m(x[:0], causal=True).shape == (0, 6, 32)
        for store in latent_caches(m).values():
            assert m(x[:, :0], causal=True, cache=store).shape == (2, 0, 32)
            assert_close(m(x, causal=True, cache=store), m(x, causal=True))


def test_a_cache_of_another_batch_size_is_refused_naming_both_sizes() -> None:
    m = mla()
    x = randn(2, 5, 32, seed=62, dtype=F64)
    for store in (m.make_cache(3, 8), m.make_kv_cache(3, 8)):
        with (
            torch.no_grad(),
            pytest.raises(ValueError, match=r"a batch of 3 .* batch of 2\b.*: make a cache"),
        ):
            m(x, causal=True, cache=store)
        assert store.length == 0


def test_a_loaded_rotary_keeps_its_frequencies_through_to_bfloat16() -> None:
    # module.to(dtype) reaches the rotary's frequencies (deepseek.rotary_embedding's, YaRN's):
    # rounded to bfloat16 they would turn the angles at position 4,000 by whole radians
    from attnkit.interop import deepseek

    inv_freq = 10000.0 ** -(torch.arange(0, 8, 2, dtype=F64) / 8) / 4.0
    rotary = deepseek.FrequencyRotary(inv_freq, scaling=1.1)
    m = MultiHeadLatentAttention(32, 4, **{**SIZES, "qk_rope_head_dim": 8}, rotary=rotary)
    x = randn(2, 4, 3, 8, seed=63, dtype=F64)
    want = m.double().rotary(x, offset=4000)
    m.to(torch.bfloat16)
    assert_close(m.rotary(x.bfloat16(), offset=4000), want, dtype=torch.bfloat16)
    assert rotary.inv_freq.dtype == F64


# --------------------------------------------------------------------------------------------------
# transformers' DeepSeek V3 and V3.2 through attn_implementation="attnkit"


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_deepseek_left_padded_generation_equals_eager_in_float32(family: str) -> None:
    # (in float64 transformers' eager gives NaN past a left-padded row's first layer)
    transformers = pytest.importorskip("transformers")
    from transformers import AttentionInterface
    from transformers import masking_utils as mu

    from attnkit.integrations import transformers as hf

    from ..integrations.transformers.helpers import run, sweep, use

    config = sweep().tiny_config(family)
    if family == "deepseek_v32":
        config.index_topk = 4  # of up to 20 keys: the selection matters
        cls = transformers.DeepseekV32ForCausalLM
    else:
        config.first_k_dense_replace = config.num_hidden_layers
        cls = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(64)
    m = cls(config).eval()
    ids = torch.randint(3, 90, (2, 12), generator=gen(65))
    pad = torch.ones(2, 12, dtype=torch.long)
    pad[1, :5] = 0
    hf.register()
    try:
        logits = {
            i: run(m, i, input_ids=ids, attention_mask=pad).logits for i in ("eager", "attnkit")
        }
        real = pad.bool()
        assert_close(logits["attnkit"][real], logits["eager"][real].double(), dtype=torch.float32)
        tokens = {}
        for impl in ("eager", "attnkit"):
            with use(m, impl), torch.no_grad():
                tokens[impl] = m.generate(
                    ids, attention_mask=pad, max_new_tokens=8, do_sample=False, pad_token_id=0
                )
        assert torch.equal(tokens["attnkit"], tokens["eager"])
    finally:
        AttentionInterface._global_mapping.pop("attnkit", None)
        mu.AttentionMaskInterface._global_mapping.pop("attnkit", None)
