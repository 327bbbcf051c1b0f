"""Index masks (``attnkit.masks.key_indices``, ``block_indices``): what they let through, drawn
against a brute-force reading of the indices; their tiles and block states against their dense
form; their checks' words; the reference backend with them against the formula over the selected
keys."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

import attnkit
from attnkit import masks
from attnkit.masks import EMPTY, Geometry


def _brute(indices: torch.Tensor, kv_len: int, block: int = 1) -> torch.Tensor:
    """``(B, Hi, Tq, Tk)`` bool, by a loop over the entries."""
    b, h, tq, _ = indices.shape
    out = torch.zeros(b, h, tq, kv_len, dtype=torch.bool)
    for i in range(b):
        for j in range(h):
            for t in range(tq):
                for x in indices[i, j, t].tolist():
                    if x >= 0:
                        out[i, j, t, x * block : min(kv_len, x * block + block)] = True
    return out


def _random(b: int, h: int, tq: int, k: int, hi: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, hi, (b, h, tq, k), generator=g)


def test_key_indices_let_through_the_listed_keys_once() -> None:
    idx = _random(2, 3, 7, 5, 11, seed=0)
    idx[0, 0, 0] = torch.tensor([4, 4, 4, -1, 4])  # repeated and none
    idx[1, 2, 3] = -1  # a row with none
    dense = masks.key_indices(idx).dense(7, 11, batch_size=2, num_heads=3)
    assert torch.equal(dense, _brute(idx, 11))
    assert dense[0, 0, 0].nonzero().flatten().tolist() == [4]
    assert not dense[1, 2, 3].any()


def test_block_indices_let_through_whole_blocks_cut_at_tk() -> None:
    idx = _random(1, 2, 6, 3, 4, seed=1)  # blocks of 3 over 10 keys: the last one holds key 9
    idx[0, 0, 0] = torch.tensor([3, 3, -1])
    dense = masks.block_indices(idx, block=3).dense(6, 10, num_heads=2)
    assert torch.equal(dense, _brute(idx, 10, block=3))
    assert dense[0, 0, 0].nonzero().flatten().tolist() == [9]


def test_heads_of_the_indices_map_to_groups_of_query_heads() -> None:
    # 2 selections for 4 query heads: heads 0, 1 read the first, heads 2, 3 the second.
    idx = _random(1, 2, 5, 2, 6, seed=2)
    dense = masks.key_indices(idx).dense(5, 6, num_heads=4)
    want = _brute(idx, 6).repeat_interleave(2, dim=1)
    assert torch.equal(dense.expand(1, 4, 5, 6), want)


def test_composition_with_causal_and_padding() -> None:
    idx = _random(2, 1, 6, 4, 9, seed=3)
    mask = masks.key_indices(idx) & masks.causal() & masks.key_padding([9, 5])
    want = _brute(idx, 9) & masks.causal_mask(6, 9) & masks.padding_mask([9, 5])
    assert torch.equal(mask.dense(6, 9, batch_size=2), want)
    union = masks.key_indices(idx) | masks.key_indices(idx.flip(0))
    assert torch.equal(union.dense(6, 9, batch_size=2), _brute(idx, 9) | _brute(idx.flip(0), 9))


def test_tiles_and_block_states_agree_with_the_dense_mask() -> None:
    idx = _random(2, 2, 13, 3, 17, seed=4)
    mask = masks.block_indices(idx, block=2)
    geo = Geometry((2,), 4, 13, 34, torch.device("cpu"))
    whole = mask.dense(13, 34, batch_size=2, num_heads=4)
    assert torch.equal(mask.tile(geo, 3, 9, 5, 30), whole[:, :, 3:9, 5:30])
    states = mask.block_states(geo, (0, 13, 4), (0, 34, 8))
    for i, qs in enumerate(range(0, 13, 4)):
        for j, ks in enumerate(range(0, 34, 8)):
            seen = bool(whole[:, :, qs : qs + 4, ks : ks + 8].any())
            assert (int(states[i, j]) != EMPTY) == seen, (i, j)


def test_describe_and_a_plan_key_that_follows_writes() -> None:
    idx = torch.zeros(1, 1, 4, 2, dtype=torch.long)
    mask = masks.key_indices(idx)
    assert repr(mask) == "key_indices(indices (1, 1, 4, 2))"
    assert repr(masks.block_indices(idx, block=64) & masks.causal()) == (
        "block_indices(indices (1, 1, 4, 2), block=64) & causal()"
    )
    key = mask.plan_key
    idx[0, 0, 0, 0] = 3
    assert mask.plan_key != key
    # the selection read for the call follows the write too
    assert mask.selected(4, torch.device("cpu"))[0, 0, 0].tolist() == [0, 3]


def test_checks_quote_the_values() -> None:
    q = torch.randn(2, 4, 5, 8)
    with pytest.raises(
        ValueError, match=r"entries from 5 to 5, and each must be -1 \(none\) .*\(0 to 4\)"
    ):
        attnkit.attention(q, q, q, mask=masks.key_indices(torch.full((1, 1, 5, 2), 5)))
    with pytest.raises(ValueError, match=r"gives 3 heads, which do not divide the call's H = 4"):
        attnkit.attention(q, q, q, mask=masks.key_indices(torch.zeros(1, 3, 5, 2, dtype=torch.int)))
    with pytest.raises(ValueError, match=r"selects keys for 6 queries but the call has Tq = 5"):
        attnkit.attention(q, q, q, mask=masks.key_indices(torch.zeros(1, 1, 6, 2, dtype=torch.int)))
    with pytest.raises(ValueError, match=r"has 3 batch rows but the call has B = 2"):
        attnkit.attention(q, q, q, mask=masks.key_indices(torch.zeros(3, 1, 5, 2, dtype=torch.int)))
    with pytest.raises(ValueError, match=r"a block of 2 keys of the call's Tk = 5 keys \(0 to 2\)"):
        attnkit.attention(q, q, q, mask=masks.block_indices(torch.full((1, 1, 5, 1), 3), block=2))
    with pytest.raises(ValueError, match=r"is key_indices\(indices.unsqueeze\(1\)\)"):
        masks.key_indices(torch.zeros(2, 5, 3, dtype=torch.long))
    with pytest.raises(TypeError, match=r"integer tensor \(B\|1, Hi, Tq, k\), got torch.float32"):
        masks.key_indices(torch.zeros(1, 1, 5, 3))
    with pytest.raises(TypeError, match=r"got a bool tensor"):
        masks.key_indices(torch.zeros(1, 1, 5, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"block must be >= 1, got 0"):
        masks.block_indices(torch.zeros(1, 1, 5, 3, dtype=torch.long), block=0)


def test_the_reference_attends_the_selected_keys_only() -> None:
    # The formula over each row's own keys, written out: the spec the kernels are tested against.
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    idx = _random(1, 1, 6, 3, 6, seed=6)
    idx[0, 0, 2] = -1  # a query with no key: output 0
    out = attnkit.attention(q, k, v, mask=masks.key_indices(idx), backend="reference")
    for h in range(2):
        for t in range(6):
            keys = sorted({x for x in idx[0, 0, t].tolist() if x >= 0})
            if not keys:
                assert not out[0, h, t].any()
                continue
            w = torch.softmax(q[0, h, t] @ k[0, h, keys].T / 2.0, -1)
            torch.testing.assert_close(out[0, h, t], w @ v[0, h, keys])


def _formula(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    causal: bool,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The float64 formula, written out without attnkit: query ``t`` of head ``h`` attends the
    distinct keys its selection names (-1 none; Hi heads of indices shared by groups of query
    heads), those after it dropped when ``causal`` (bottom-right); ``softcap * tanh(s /
    softcap)``; a sink logit per head in the denominator; a query with no key gives 0."""
    b, h, tq, _ = q.shape
    tk, hkv, hi = k.size(2), k.size(1), idx.size(1)
    out = torch.zeros(b, h, tq, v.size(-1), dtype=q.dtype)
    rows = []
    for n in range(b):
        for head in range(h):
            kv_head, sel = head // (h // hkv), head // (h // hi)
            for t in range(tq):
                keys = sorted({x for x in idx[n, sel, t].tolist() if x >= 0})
                if causal:
                    keys = [j for j in keys if j <= t + tk - tq]
                if not keys and sinks is None:
                    continue
                at = torch.tensor(keys, dtype=torch.long)
                s = (k[n, kv_head, at] @ q[n, head, t]) * scale
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                if sinks is not None:
                    s = torch.cat([s, sinks[head : head + 1]])
                w = torch.softmax(s, -1)[: len(keys)]
                rows.append((n, head, t, w @ v[n, kv_head, at]))
    for n, head, t, row in rows:
        out[n, head, t] = row
    return out


@pytest.mark.parametrize("kind", ["random", "sorted"])
@pytest.mark.parametrize("causal", [False, True], ids=["any", "causal"])
@pytest.mark.parametrize(
    ("hi", "modifier"),
    [(1, "softcap"), (2, "sinks"), (4, "none")],
    ids=["Hi=1-softcap", "Hi=Hkv-sinks", "Hi=H"],
)
def test_index_masks_equal_the_formula_forward_and_backward(
    kind: str, causal: bool, hi: int, modifier: str
) -> None:
    # GQA (4 query heads on 2 key/value heads), Tq < Tk, repeated and -1 entries, a row with
    # none: the reference's outputs and gradients of q, k, v (and the sinks) equal the formula's.
    g = torch.Generator().manual_seed(11)
    b, h, hkv, tq, tk, d = 2, 4, 2, 7, 12, 4
    q, k, v = (torch.randn(b, n, t, d, generator=g, dtype=torch.float64) for n, t in
               ((h, tq), (hkv, tk), (hkv, tk)))  # fmt: skip
    if kind == "sorted":
        idx = torch.rand(b, hi, tq, tk, generator=g).argsort(-1)[..., :5].sort(-1).values
    else:
        idx = _random(b, hi, tq, 5, tk, seed=12)
        idx[..., 1] = idx[..., 0]  # a repeat in every row
    idx[0, 0, 2] = -1  # a query (of every head reading selection 0) with no key at all
    sinks = torch.tensor([0.3, -1.0, 2.0, -0.5], dtype=torch.float64)
    softcap = 1.5 if modifier == "softcap" else None
    leaves = [t.requires_grad_() for t in (q, k, v)]
    if modifier == "sinks":
        leaves.append(sinks.requires_grad_())
    kw: dict[str, object] = {"scale": 0.6, "softcap": softcap}
    if modifier == "sinks":
        kw["sinks"] = sinks
    mask = masks.key_indices(idx) & masks.causal() if causal else masks.key_indices(idx)
    got = attnkit.attention(q, k, v, mask=mask, backend="reference", **kw)  # type: ignore[arg-type]
    want = _formula(q, k, v, idx, causal, 0.6, softcap, kw.get("sinks"))  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    assert not got[0, :, 2].any() if hi == 1 else not got[0, 0, 2].any()
    w = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((got * w).sum(), leaves)
    wants = torch.autograd.grad((want * w).sum(), leaves)
    for a, e in zip(grads, wants, strict=True):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("backend", ["reference", "chunked", "sdpa", "flex"])
def test_indices_made_under_inference_mode(backend: str) -> None:
    # A tensor made under torch.inference_mode has no version counter: the selection read for
    # the call is then made afresh each time instead of being kept by version.
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, 4, t, 8, generator=g) for t in (6, 40, 40))
    with torch.inference_mode():
        idx = _random(2, 2, 6, 5, 40, seed=22)
        mask = masks.key_indices(idx) & masks.causal()
        got = attnkit.attention(q, k, v, mask=mask, backend=backend)
    want = attnkit.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


def test_an_index_mask_crosses_into_the_operator_as_text_and_its_tensor() -> None:
    idx = _random(1, 1, 4, 2, 3, seed=23)
    tensors: list[torch.Tensor] = []
    text = masks.encode(masks.block_indices(idx, block=3) & masks.causal(), tensors)
    assert text is not None
    assert tensors[0] is idx
    back = masks.decode(text, tensors)
    assert back is not None
    assert back.describe() == ("block_indices(indices (1, 1, 4, 2), block=3) & causal()")
    assert torch.equal(
        back.dense(4, 9), (masks.block_indices(idx, block=3) & masks.causal()).dense(4, 9)
    )
    # a pytree node, so that torch.export takes it as an input
    leaves, spec = pytree.tree_flatten(masks.key_indices(idx))
    assert leaves == [idx]
    assert pytree.tree_unflatten(leaves, spec).describe() == "key_indices(indices (1, 1, 4, 2))"


@pytest.mark.parametrize("backend", ["chunked", "sdpa", "reference"])
def test_compiled_index_masks_equal_the_reference_and_refuse_entries_past_tk(
    backend: str,
) -> None:
    # The indices are an input of the compiled function (their values are data while torch
    # traces): fullgraph, gradients, new values without a new trace, and entries outside the
    # keys refused when the graph runs.
    g = torch.Generator().manual_seed(24)
    q, k, v = (torch.randn(2, 4, t, 8, generator=g) for t in (6, 40, 40))

    def call(q: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        mask = masks.key_indices(idx) & masks.causal()
        return attnkit.attention(q, k, v, mask=mask, backend=backend)

    compiled = torch.compile(call, fullgraph=True)
    for seed in (25, 26):
        idx = _random(2, 2, 6, 5, 40, seed=seed)
        leaf = q.clone().requires_grad_()
        got = compiled(leaf, idx)
        want = attnkit.attention(
            q.double().requires_grad_(), k.double(), v.double(),
            mask=masks.key_indices(idx) & masks.causal(), backend="reference",
        )  # fmt: skip
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
        got.sum().backward()
        assert leaf.grad is not None
        assert torch.isfinite(leaf.grad).all()
    idx[0, 0, 0, 0] = 40
    with pytest.raises(RuntimeError, match=r"each entry of key_indices must be -1 \(none\) or a"):
        compiled(q, idx)


def test_a_block_wider_than_the_keys_is_read_as_the_keys() -> None:
    # Block 0 of 2**26 keys is the call's Tk keys: read so, not written out 2**26 wide per entry
    # (64 GiB here).
    g = torch.Generator().manual_seed(27)
    q, k = torch.randn(1, 2, 64, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g)
    mask = masks.block_indices(torch.zeros(1, 1, 64, 2, dtype=torch.long), block=2**26)
    want = attnkit.attention(q.double(), k.double(), k.double(), causal=True, backend="reference")
    for backend in ("reference", "chunked", "sdpa"):
        got = attnkit.attention(q, k, k, mask=mask & masks.causal(), backend=backend)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "chunked", "sdpa"])
def test_indices_on_meta_are_refused_with_the_device_named(backend: str) -> None:
    # Indices on another device are moved to q's; meta ones hold no values to move (the call
    # failed in torch: Cannot copy out of meta tensor).
    q = torch.randn(1, 2, 3, 8)
    idx = torch.zeros(1, 1, 3, 2, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"\(1, 1, 3, 2\)\) is on meta, .* q is on cpu"):
        attnkit.attention(q, q, q, mask=masks.key_indices(idx), backend=backend)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.uint8])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_a_decode_step_with_indices_of_any_integer_dtype_and_strides(
    dtype: torch.dtype, kv_dtype: torch.dtype | None
) -> None:
    # Tq = 1 through a (quantized) cache's view, per key/value head, the indices transposed
    # (not contiguous) and of a narrow integer dtype: the float64 formula over the selected keys.
    g = torch.Generator().manual_seed(31)
    cache = attnkit.KVCache(2, 16, 2, 8, kv_dtype=kv_dtype)
    cache.update(*(torch.randn(2, 2, 11, 8, generator=g) for _ in range(2)))
    q = torch.randn(2, 4, 1, 8, generator=g)
    idx = torch.randint(0, 11, (2, 2, 3, 1), generator=g).transpose(2, 3).to(dtype)
    keys, values = (t.double() for t in cache.view().dense(torch.float64))
    got = attnkit.attention(q, cache.view(), None, mask=masks.key_indices(idx))
    chosen = _brute(idx.long(), 11).repeat_interleave(2, 1)  # (B, H, 1, Tk)
    scores = (q.double() @ keys.repeat_interleave(2, 1).mT / 8**0.5).masked_fill(~chosen, -1e300)
    want = scores.softmax(-1) @ values.repeat_interleave(2, 1)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_index_masks_joined_by_or_are_one_list_of_keys_and_gathered() -> None:
    # key_indices | key_indices: one index mask listing both (the call gathers it), equal to the
    # union of the two; rows and heads broadcast, dtypes promote.
    a = _random(1, 1, 40, 3, 200, seed=7)
    b = _random(2, 2, 40, 2, 200, seed=8).to(torch.int32)
    union = masks.key_indices(a) | masks.key_indices(b)
    assert isinstance(union, masks.KeyIndices)
    assert tuple(union.indices.shape) == (2, 2, 40, 5)
    want = _brute(a, 200) | _brute(b, 200)
    assert torch.equal(union.dense(40, 200, batch_size=2, num_heads=2), want)
    with_causal = (masks.key_indices(a) | masks.key_indices(b)) & masks.causal()
    q, k, v = (
        torch.randn(2, 2, n, 8, generator=torch.Generator().manual_seed(n)) for n in (40, 200, 200)
    )
    with attnkit.record_dispatch() as record:
        out = attnkit.attention(q, k, v, mask=with_causal, backend="chunked")
    assert record[0].kernel is not None
    assert "gathered" in record[0].kernel
    dense = want & masks.causal_mask(40, 200)
    ref = attnkit.attention(q.double(), k.double(), v.double(), mask=dense, backend="reference")
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # blocks of another size, or heads that do not broadcast, stay a union of two masks
    other = masks.key_indices(a) | masks.block_indices(a, block=2)
    assert not isinstance(other, masks.KeyIndices)
    assert torch.equal(other.dense(40, 400), _brute(a, 400) | _brute(a, 400, block=2))
    apart = masks.key_indices(_random(1, 2, 9, 1, 12, 0)) | masks.key_indices(
        _random(1, 3, 9, 1, 12, 1)
    )
    assert not isinstance(apart, masks.KeyIndices)
