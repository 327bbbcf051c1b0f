"""Calls entering ``attention()`` as an outside reviewer would try them: lengths of every integer
kind, a batch of one, rows padded to nothing, views of caches kept after the cache changed, and
what ``explain()`` says of each, each number against the float64 reference.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks

F64 = torch.float64


def reference(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None) -> Tensor:
    """Softmax attention in float64 over the pairs ``keep`` allows (a query that sees no key
    gives 0)."""
    scores = (q.to(F64) @ k.to(F64).transpose(-1, -2)) / q.size(-1) ** 0.5
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v.to(F64)


def padding_keep(lengths: list[int], tk: int) -> Tensor:
    """``(B, 1, 1, Tk)``: key ``j`` of row ``b`` exists where ``j < lengths[b]``."""
    return (torch.arange(tk)[None, :] < torch.tensor(lengths)[:, None])[:, None, None]


def decoded_paged_cache() -> tuple[attnkit.PagedKVCache, attnkit.MultiHeadAttention]:
    """A paged cache of two sequences of 7 tokens each, in pages of 4, written by a module."""
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    cache = mha.make_paged_cache(num_blocks=16, page_size=4, max_seqs=2)
    with torch.no_grad():
        mha(torch.randn(2, 7, 32), causal=True, cache=cache)
    return cache, mha


# --------------------------------------------------------------------------------------------------
# A view kept after its cache changed


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("backend", ["reference", "chunked", "auto"])
def test_a_paged_view_kept_after_free_is_refused_by_name(backend: str, grad: bool) -> None:
    """After ``free(1)`` the block table's row 1 names no page (-1), while a view taken before
    still says the row holds 7 tokens: a call on that view refuses, naming the entry, on every
    path (the gather of the reference backend and of gradients included), and never reads page
    -1 (the pool's last page) as the row's keys."""
    cache, _ = decoded_paged_cache()
    view = cache.view()
    q = torch.randn(2, 4, 1, 8, requires_grad=grad)
    k0, v0 = view.row(1)
    fresh = attnkit.attention(q, view, backend=backend)
    want = reference(q[1:], k0.repeat_interleave(2, 1), v0.repeat_interleave(2, 1))
    torch.testing.assert_close(fresh[1:].to(F64), want, atol=1e-5, rtol=0)
    cache.free(1)
    native = backend != "reference" and not grad  # the native kernel checks the table itself
    error = RuntimeError if native else ValueError
    with pytest.raises(error, match=r"block_table\[1, 0\] = -1 is not a page"):
        attnkit.attention(q, view, backend=backend)


# --------------------------------------------------------------------------------------------------
# Padding lengths of every kind


B, H, TQ, TK, D = 2, 2, 3, 5, 8
LENGTHS = (
    [5, 2],
    (5, 2),
    torch.tensor([5, 2], dtype=torch.int32),
    torch.tensor([5, 2]),
    torch.tensor([5, 2], dtype=torch.int16),
)


@pytest.mark.parametrize(
    "lengths", LENGTHS, ids=lambda x: type(x).__name__ + str(getattr(x, "dtype", ""))
)
@pytest.mark.parametrize("backend", ["reference", "chunked", "sdpa", "flex", "auto"])
def test_key_padding_from_any_integer_lengths_with_tq_not_tk(lengths: object, backend: str) -> None:
    """A list, a tuple and int16/int32/int64 tensors of lengths give the same mask, on every
    backend, with fewer queries than keys; ``explain()`` names the backend that runs the call."""
    torch.manual_seed(1)
    q, k, v = torch.randn(B, H, TQ, D), torch.randn(B, H, TK, D), torch.randn(B, H, TK, D)
    mask = masks.key_padding(lengths)  # type: ignore[arg-type]
    with attnkit.record_dispatch() as calls:
        out = attnkit.attention(q, k, v, mask=mask, backend=backend)
    want = reference(q, k, v, padding_keep([5, 2], TK))
    torch.testing.assert_close(out.to(F64), want, atol=1e-5, rtol=0)
    said = str(attnkit.explain(q, k, v, mask=mask, backend=backend))
    assert f"'{calls[0].chosen}' (forced)" in said or f"auto picks: {calls[0].chosen}" in said


@pytest.mark.parametrize("backend", ["reference", "chunked", "sdpa", "auto"])
def test_rows_padded_to_nothing_give_zeros_and_zero_gradients(backend: str) -> None:
    """Every row of length 0, causal as well, Tq != Tk: outputs 0 and finite zero gradients."""
    q = torch.randn(B, H, TQ, D, requires_grad=True)
    k = torch.randn(B, H, TK, D, requires_grad=True)
    v = torch.randn(B, H, TK, D, requires_grad=True)
    lengths = torch.zeros(B, dtype=torch.int32)
    out = attnkit.attention(q, k, v, mask=masks.key_padding(lengths), causal=True, backend=backend)
    out.sum().backward()
    assert torch.equal(out, torch.zeros_like(out))
    for t in (q, k, v):
        assert t.grad is not None
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_a_batch_of_one_takes_a_list_or_a_1d_tensor_and_refuses_a_scalar_by_name() -> None:
    """A batch of one: ``[3]`` and ``tensor([3])`` mask keys 3 and on; a bare ``3`` and a 0-d
    tensor are refused with a TypeError naming ``lengths`` rather than read as a batch."""
    q, k, v = torch.randn(1, H, TQ, D), torch.randn(1, H, TK, D), torch.randn(1, H, TK, D)
    want = reference(q, k, v, padding_keep([3], TK))
    for lengths in ([3], torch.tensor([3])):
        out = attnkit.attention(q, k, v, mask=masks.key_padding(lengths))
        torch.testing.assert_close(out.to(F64), want, atol=1e-5, rtol=0)
    for bad in (3, torch.tensor(3)):
        with pytest.raises(TypeError, match="lengths"):
            masks.key_padding(bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# A contiguous cache's view against masks and later writes


def test_a_kv_cache_view_refuses_masks_that_contradict_it_and_survives_appends() -> None:
    """A view of 6 tokens: key padding longer than 6 and a bool mask over the cache's capacity
    are ValueErrors; key padding within it equals the reference; a view kept while more tokens
    are appended still reads the 6 it viewed."""
    torch.manual_seed(2)
    cache = attnkit.KVCache(batch_size=B, max_len=10, num_kv_heads=H, head_dim=D)
    k, v = torch.randn(B, H, 6, D), torch.randn(B, H, 6, D)
    cache.update(k, v)
    view = cache.view()
    q = torch.randn(B, H, 2, D)
    with pytest.raises(ValueError, match="length 7 > Tk = 6"):
        attnkit.attention(q, view, mask=masks.key_padding([7, 3]))
    with pytest.raises(ValueError, match="does not broadcast"):
        attnkit.attention(q, view, mask=torch.ones(2, 10, dtype=torch.bool))
    out = attnkit.attention(q, view, mask=masks.key_padding(torch.tensor([6, 3])))
    torch.testing.assert_close(
        out.to(F64), reference(q, k, v, padding_keep([6, 3], 6)), atol=1e-5, rtol=0
    )
    cache.update(torch.randn(B, H, 3, D), torch.randn(B, H, 3, D))
    torch.testing.assert_close(
        attnkit.attention(q, view).to(F64), reference(q, k, v), atol=1e-5, rtol=0
    )


# --------------------------------------------------------------------------------------------------
# Compiled steps, records and copies


def test_a_compiled_cross_attention_step_with_tensor_lengths_equals_eager() -> None:
    """``fullgraph=True, dynamic=True`` (aot_eager) of a cross-attention step (Tq 5, Tk 7) whose
    padding lengths are a tensor: loss and every gradient equal eager at lengths that change,
    all zero included, in one compile."""
    torch.manual_seed(3)
    mha = attnkit.MultiHeadAttention(16, 2, num_kv_heads=1)
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)

    def step(x: Tensor, memory: Tensor, lengths: Tensor) -> Tensor:
        out: Tensor = mha(x, memory, mask=masks.key_padding(lengths))
        return out.pow(2).sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for lengths in ([7, 3], [2, 6], [0, 0]):
        lens = torch.tensor(lengths, dtype=torch.int32)
        results = []
        for fn in (step, compiled):
            mha.zero_grad()
            loss = fn(x, memory, lens)
            loss.backward()
            results.append(
                (
                    loss.detach(),
                    [torch.clone(p.grad) for p in mha.parameters() if p.grad is not None],
                )
            )
        (eager_loss, eager_grads), (loss, grads) = results
        torch.testing.assert_close(loss, eager_loss, atol=1e-6, rtol=1e-6)
        for got, want in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_record_dispatch_records_a_compiled_call_as_explain_names_it() -> None:
    """A compiled call that the kernel serves (softcap and key padding) is recorded at every
    run, chosen and served by the backend ``explain()`` names."""
    torch.manual_seed(4)
    q, k, v = torch.randn(B, H, TQ, D), torch.randn(B, H, TK, D), torch.randn(B, H, TK, D)

    def call(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> Tensor:
        return attnkit.attention(q, k, v, mask=masks.key_padding(lengths), softcap=5.0)

    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    said = str(attnkit.explain(q, k, v, mask=masks.key_padding([5, 2]), softcap=5.0))
    for _ in range(2):
        with attnkit.record_dispatch() as calls:
            out = compiled(q, k, v, torch.tensor([5, 2]))
        assert [(c.chosen, c.served_by) for c in calls] == [("chunked", "chunked")]
        assert "auto picks: chunked" in said
        torch.testing.assert_close(out, call(q, k, v, torch.tensor([5, 2])), atol=1e-6, rtol=0)


class _Decoder(torch.nn.Module):
    """A module holding its attention and its paged cache."""

    def __init__(self, mha: attnkit.MultiHeadAttention, cache: attnkit.PagedKVCache) -> None:
        super().__init__()
        self.attn, self.cache = mha, cache

    def forward(self, x: Tensor) -> Tensor:
        """One step into the cache."""
        out: Tensor = self.attn(x, causal=True, cache=self.cache)
        return out


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_module_holding_a_paged_cache_copies_and_decodes_on_alike(how: str) -> None:
    """A copy (deepcopy, torch.save and load) of a module holding a paged cache decodes the next
    tokens as the original does, keeps the cache out of ``state_dict()``, and writes only its
    own cache."""
    cache, mha = decoded_paged_cache()
    model = _Decoder(mha, cache)
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    assert all(not name.startswith("cache") for name in model.state_dict())
    x = torch.randn(2, 2, 32)
    with torch.no_grad():
        for i in range(2):
            torch.testing.assert_close(
                twin(x[:, i : i + 1]), model(x[:, i : i + 1]), atol=0, rtol=0
            )
    assert model.cache.lengths == twin.cache.lengths == [9, 9]
    assert model.cache.k_pages.data_ptr() != twin.cache.k_pages.data_ptr()


def test_sinks_changed_in_place_after_stage_call_are_checked_again() -> None:
    """``stage_call`` checks the step's call (finite sinks) before it writes; the same sinks
    tensor set to NaN in place before the ``attention()`` call on that view is refused as NaN
    sinks are anywhere, not taken as checked (which gave NaN outputs)."""
    cache, _ = decoded_paged_cache()
    q, k = torch.randn(2, 4, 2, 8), torch.randn(2, 2, 2, 8)
    sinks = torch.zeros(4)
    view = cache.stage_call(q, k, k, causal=True, sinks=sinks)
    out = attnkit.attention(q, view, causal=True, sinks=sinks)
    want = attnkit.attention(q, view, causal=True, sinks=sinks.clone(), backend="reference")
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    sinks.fill_(float("nan"))
    with pytest.raises(ValueError, match="sinks holds NaN"):
        attnkit.attention(q, view, causal=True, sinks=sinks)


@pytest.mark.parametrize("which", ["encoder", "relative"])
def test_compiled_layers_with_tensor_lengths_equal_eager_down_to_a_batch_of_one(which: str) -> None:
    """``TransformerEncoderLayer`` and ``RelativeMultiHeadAttention`` in a compiled training step
    (aot_eager, ``fullgraph=True``) whose padding lengths are a tensor: loss and gradients equal
    eager for a batch of two (a row of length 0 among them) and for a batch of one."""
    torch.manual_seed(5)
    layer: torch.nn.Module
    if which == "encoder":
        layer = attnkit.TransformerEncoderLayer(16, 2, dropout=0.0)
    else:
        layer = attnkit.RelativeMultiHeadAttention(16, 2)

    def step(x: Tensor, lengths: Tensor) -> Tensor:
        out: Tensor = layer(x, mask=masks.key_padding(lengths))
        return out.pow(2).sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for x, lengths in ((torch.randn(2, 5, 16), [5, 0]), (torch.randn(1, 5, 16), [3])):
        results = []
        for fn in (step, compiled):
            layer.zero_grad()
            loss = fn(x, torch.tensor(lengths))
            loss.backward()
            grads = [torch.clone(p.grad) for p in layer.parameters() if p.grad is not None]
            results.append((loss.detach(), grads))
        (eager_loss, eager_grads), (loss, grads) = results
        torch.testing.assert_close(loss, eager_loss, atol=1e-6, rtol=1e-6)
        assert len(grads) == len(eager_grads) == len(list(layer.parameters()))
        for got, want in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
