"""Structured masks: each equals its definition written out here, block plans are sound, bad
arguments are explained (the dense helpers are tested in ``tests/masks/test_dense.py``)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit.masks import Geometry

from .strategies import structured_masks

# --------------------------------------------------------------------------------------------------
# Structured masks


shapes = st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(0, 11), st.integers(0, 11))


@given(shape=shapes, data=st.data())
def test_structured_masks_equal_their_definition(
    shape: tuple[int, int, int, int], data: st.DataObject
) -> None:
    b, h, tq, tk = shape
    s = data.draw(structured_masks(b, h, tq, tk))
    got = s.mask.dense(tq, tk, batch_size=b, num_heads=h)
    assert got.dtype == torch.bool
    assert torch.equal(got.expand(b, h, tq, tk), s.dense), s.label


@given(
    tq=st.integers(0, 9),
    tk=st.integers(0, 9),
    left=st.integers(-6, 9),
    right=st.integers(-6, 9),
)
def test_sliding_window_with_negative_bounds(tq: int, tk: int, left: int, right: int) -> None:
    """A band that leaves out the diagonal (flash-attn 4's negative window bounds): the mask and
    its block plan agree with the definition."""
    if left + right < 0:
        with pytest.raises(ValueError, match="holds no key"):
            masks.sliding_window(left, right)
        return
    want = torch.tensor(
        [[-left <= j - (i + tk - tq) <= right for j in range(tk)] for i in range(tq)],
        dtype=torch.bool,
    ).reshape(tq, tk)
    m = masks.sliding_window(left, right)
    assert torch.equal(m.dense(tq, tk)[0, 0], want)
    if tq and tk:
        geo = Geometry((1,), 1, tq, tk, torch.device("cpu"))
        states = m.block_states(geo, (0, tq, 2), (0, tk, 3))
        for bi, qs in enumerate(range(0, tq, 2)):
            for bj, ks in enumerate(range(0, tk, 3)):
                block = want[qs : qs + 2, ks : ks + 3]
                state = int(states[bi, bj])
                assert state != masks.EMPTY or not block.any()
                assert state != masks.FULL or block.all()


@given(shape=shapes, block=st.tuples(st.integers(1, 5), st.integers(1, 5)), data=st.data())
def test_block_states_and_rows_are_sound(
    shape: tuple[int, int, int, int], block: tuple[int, int], data: st.DataObject
) -> None:
    # EMPTY blocks hold no visible pair, FULL blocks only visible ones, and the rows a block is
    # said to need include every row that sees one of its keys: the kernel skips the rest.
    b, h, tq, tk = shape
    s = data.draw(structured_masks(b, h, tq, tk))
    geo = Geometry((b,), h, tq, tk, torch.device("cpu"))
    bq, bk = block
    states = s.mask.block_states(geo, (0, tq, bq), (0, tk, bk))
    assert states.shape == (len(range(0, tq, bq)), len(range(0, tk, bk)))
    for i, qs in enumerate(range(0, tq, bq)):
        for j, ks in enumerate(range(0, tk, bk)):
            tile = s.dense[:, :, qs : qs + bq, ks : ks + bk]
            if states[i, j] == masks.EMPTY:
                assert not tile.any(), (s.label, i, j)
            if states[i, j] == masks.FULL:
                assert tile.all(), (s.label, i, j)
            r0, r1 = s.mask.visible_rows(geo, qs, min(qs + bq, tq), ks, min(ks + bk, tk))
            seen = tile.flatten(0, 1).any(0).any(-1).nonzero().flatten().tolist()
            assert all(r0 <= r < r1 for r in seen), (s.label, (r0, r1), seen)


def test_states_are_not_all_partial() -> None:
    # The property above holds trivially if every block is PARTIAL: the structure must show.
    geo = Geometry((1,), 1, 8, 8, torch.device("cpu"))
    grid = ((0, 8, 2), (0, 8, 2))
    # Causal: skipped above the diagonal, no mask work below it, a tile on it.
    assert masks.causal().block_states(geo, *grid).tolist() == [
        [1, 0, 0, 0],
        [2, 1, 0, 0],
        [2, 2, 1, 0],
        [2, 2, 2, 1],
    ]
    docs = masks.documents([4, 4]).block_states(geo, *grid)
    assert docs.tolist() == [[2, 2, 0, 0], [2, 2, 0, 0], [0, 0, 2, 2], [0, 0, 2, 2]]
    padded = masks.key_padding([3]).block_states(geo, *grid)
    assert padded[0].tolist() == [2, 1, 0, 0]


def test_composition_keeps_structure_and_takes_tensors_on_either_side() -> None:
    pad = masks.padding_mask([3, 2])  # (B, 1, 1, T)
    m = masks.causal() & masks.key_padding([3, 2]) & masks.sliding_window(1)
    assert repr(m) == "causal() & key_padding(lengths=[3, 2]) & sliding_window(left=1, right=0)"
    left, right = pad & masks.causal(), masks.causal() & pad
    want = masks.causal_mask(3) & pad
    for mixed in (left, right):
        assert torch.equal(mixed.dense(3, batch_size=2).expand(2, 1, 3, 3), want)
    either = masks.sliding_window(0) | masks.documents([1, 2])
    assert repr(either) == "sliding_window(left=0, right=0) | documents(lengths=[1, 2])"
    with pytest.raises(TypeError, match=r"the right operand is a float32 tensor"):
        masks.causal() & torch.ones(3)
    with pytest.raises(TypeError, match=r"the left operand is 3"):
        3 & masks.causal()  # type: ignore[operator]


def test_from_fn_sees_raw_indices_and_any_batch_or_head() -> None:
    calls = []

    def fn(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        calls.append((b.shape, h.shape, q.shape, kv.shape))
        return (kv == q) | (b == h)

    dense = masks.from_fn(fn).dense(2, 3, batch_size=2, num_heads=2)
    assert calls == [((2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 3))]
    assert dense[0, 0].all()  # b == h
    assert dense[1, 1].all()
    assert dense[0, 1].int().tolist() == [[1, 0, 0], [0, 1, 0]]  # raw q_idx, not bottom-right


STRUCTURED_BAD = [
    (
        lambda: masks.documents([2, 2]).dense(3),
        ValueError,
        "mask: documents(lengths=[2, 2]) covers 4 positions but the call has Tk = 3 keys",
    ),
    (
        lambda: masks.documents([[1, 2], [3, 0]]).dense(3, batch_size=3),
        ValueError,
        "documents(lengths=[[1, 2], [3, 0]]) describes 2 batch rows but the call has B = 3",
    ),
    (
        lambda: masks.documents([[1, 2], [3, 1]]),
        ValueError,
        "every batch row must cover the same Tk, got row totals [3, 4]",
    ),
    (lambda: masks.documents(), TypeError, "documents() takes lengths or ids=, exactly one"),
    (
        lambda: masks.documents(ids=torch.zeros(3)),
        TypeError,
        "ids must be an integer tensor (Tk,) or (B, Tk), got torch.float32",
    ),
    (
        lambda: masks.sliding_window(-1),
        ValueError,
        "sliding_window(left=-1, right=0) holds no key: the band runs from 1 to 0",
    ),
    (
        lambda: masks.sliding_window(2, right=-3),
        ValueError,
        "sliding_window(left=2, right=-3) holds no key: the band runs from -2 to -3",
    ),
    (lambda: masks.sliding_window(2.5), TypeError, "left must be an int, got 2.5"),
    (
        lambda: masks.causal(align="top"),
        ValueError,
        "align must be 'bottom_right' or 'top_left', got 'top'",
    ),
    (
        lambda: masks.key_padding([4, 2]).dense(2, 3, batch_size=2),
        ValueError,
        "mask: key_padding(lengths=[4, 2]) has a length 4 > Tk = 3",
    ),
    (
        lambda: masks.key_padding([1, 2, 3]).dense(2, 3, batch_size=2),
        ValueError,
        "key_padding(lengths=[1, 2, 3]) has 3 batch rows but the call has B = 2",
    ),
    (
        lambda: masks.key_padding(valid=torch.ones(2, 3)),
        TypeError,
        "valid must be a (B, Tk) bool tensor, True = real key; got float32 of shape (2, 3)",
    ),
    (lambda: masks.key_padding(3), TypeError, "lengths must be a sequence of ints, got int"),
    (
        lambda: masks.from_fn(lambda b, h, q, k: (k - q).float()).dense(2),
        TypeError,
        "mask: from_fn(<lambda>) must return a bool tensor (True = may attend), got torch.float32",
    ),
    (
        lambda: masks.from_fn(lambda b, h, q, k: torch.ones(5, dtype=torch.bool)).dense(2),
        ValueError,
        "from_fn(<lambda>) returned shape (5), which does not broadcast to (B, H, Tq, Tk) = "
        "(1, 1, 2, 2)",
    ),
    (lambda: masks.from_fn(3), TypeError, "from_fn() takes a function, got int"),
]


@pytest.mark.usefixtures("no_shape_checks")
@pytest.mark.parametrize(("call", "exc", "message"), STRUCTURED_BAD)
def test_bad_structured_masks(call, exc: type[Exception], message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(exc, match=re.escape(message)):
        call()


# ------------------------------------------------------------------------------------------------
# The mistakes people make, and what the errors say


def test_a_mask_cannot_be_negated_and_the_error_says_what_to_write() -> None:
    with pytest.raises(TypeError) as err:
        ~masks.causal()
    message = str(err.value)
    assert message.startswith("~causal(): attnkit masks cannot be negated")
    assert "_Causal" not in message
    assert "from_fn(" in message


def test_from_fn_with_python_and_or_says_to_use_tensor_operators() -> None:
    def prefix_lm(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> object:
        return (k <= q) or (k < 2)

    with pytest.raises(TypeError, match=r"from_fn\(prefix_lm\) used Python's and/or/not") as err:
        masks.from_fn(prefix_lm).dense(4)  # type: ignore[arg-type]
    assert "& (and), | (or) and ~ (not)" in str(err.value)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match="used Python's and/or/not"):
        attnkit.attention(q, q, q, mask=masks.from_fn(prefix_lm))  # type: ignore[arg-type]


def test_dense_of_a_batched_mask_names_batch_size() -> None:
    with pytest.raises(ValueError, match=r"has 2 batch rows, .* pass batch_size=2"):
        masks.key_padding([3, 2]).dense(4)
    with pytest.raises(ValueError, match=r"pass batch_size=2"):
        (masks.causal() & masks.key_padding([3, 2])).dense(4)
    assert masks.key_padding([3, 2]).dense(4, batch_size=2).shape == (2, 1, 4, 4)


def test_a_b_tk_padding_mask_gets_the_key_padding_hint() -> None:
    q = torch.randn(2, 4, 5, 8)
    valid = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    with pytest.raises(ValueError, match="does not broadcast") as err:
        attnkit.attention(q, q, q, mask=valid)
    assert "attnkit.masks.key_padding(valid=mask)" in str(err.value)
    assert "mask[:, None, None, :]" in str(err.value)
    # The hint's two spellings give the same result.
    a = attnkit.attention(q, q, q, mask=masks.key_padding(valid=valid))
    b = attnkit.attention(q, q, q, mask=valid[:, None, None, :])
    torch.testing.assert_close(a, b)


@pytest.mark.usefixtures("no_shape_checks")
def test_an_int64_attention_mask_is_led_to_key_padding_not_to_the_broadcast_error() -> None:
    q = torch.randn(2, 4, 5, 8)
    hf = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])  # Hugging Face: 1 = token
    with pytest.raises(TypeError, match="got int64") as err:
        attnkit.attention(q, q, q, mask=hf)
    assert "attnkit.masks.key_padding(valid=mask.bool())" in str(err.value)
    assert "convert it with mask.bool()" not in str(err.value)
    with pytest.raises(TypeError, match=r"convert it with mask.bool\(\)"):
        attnkit.attention(q, q, q, mask=torch.ones(5, 5, dtype=torch.long))


META_MASKS = {
    "key_padding(lengths)": lambda: masks.key_padding(torch.tensor([5, 3], device="meta")),
    "key_padding(valid)": lambda: masks.key_padding(
        valid=torch.ones(2, 5, dtype=torch.bool, device="meta")
    ),
    "documents(lengths)": lambda: masks.documents(torch.tensor([[2, 3], [1, 4]], device="meta")),
    "documents(ids)": lambda: masks.documents(ids=torch.zeros(5, dtype=torch.long, device="meta")),
    "causal & key_padding": lambda: (
        masks.causal() & masks.key_padding(torch.tensor([5, 3], device="meta"))
    ),
}


@pytest.mark.parametrize("name", list(META_MASKS))
def test_a_mask_on_meta_is_refused_by_name_in_a_call_with_values(name: str) -> None:
    q = torch.randn(2, 2, 5, 4)
    with pytest.raises(ValueError, match=r"^mask: .* is on the meta device, which holds no values"):
        attnkit.attention(q, q, q, mask=META_MASKS[name]())


@pytest.mark.parametrize("name", list(META_MASKS))
@pytest.mark.parametrize("backend", ["auto", "chunked", "reference"])
def test_a_call_on_meta_takes_a_mask_on_meta(name: str, backend: str) -> None:
    """Shape propagation (how a model is sized before it is materialised) reads no value: the
    output and the log-sum-exp have the shapes the same call on the CPU gives, with gradients."""
    q = torch.randn(2, 2, 5, 4, dtype=torch.float64)
    qm = q.to("meta").requires_grad_()
    cpu_mask = META_MASKS[name]()
    out, lse = attnkit.attention(qm, qm, qm, mask=cpu_mask, backend=backend, return_lse=True)
    out.sum().backward()
    assert qm.grad is not None
    assert qm.grad.shape == qm.shape
    want, want_lse = attnkit.attention(q, q, q, backend="reference", return_lse=True)
    assert (out.shape, out.dtype, lse.shape) == (want.shape, want.dtype, want_lse.shape)


@pytest.mark.parametrize("backend", ["auto", "chunked", "sdpa", "reference"])
def test_documents_of_ids_take_an_empty_batch(backend: str) -> None:
    # With no rows the native plan read the first row's starts and raised IndexError.
    mask = masks.documents(ids=torch.zeros(0, 5, dtype=torch.long))
    assert mask.document_starts() is None
    q = torch.randn(0, 2, 3, 4, requires_grad=True)
    k, v = (torch.randn(0, 2, 5, 4, requires_grad=True) for _ in range(2))
    out = attnkit.attention(q, k, v, mask=mask, causal=True, backend=backend)
    want = attnkit.attention(q, k, v, mask=mask, causal=True, backend="reference")
    assert out.shape == want.shape == (0, 2, 3, 4)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_from_tensor_is_the_tensors_mask_without_the_convention_check() -> None:
    from attnkit._base import hints

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64) for n in (5, 7, 7))
    allowed = torch.rand(2, 1, 5, 7, generator=g) > 0.4
    allowed[1] = False  # a batch element of padding alone: meant
    for backend in ("reference", "chunked", "sdpa"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the raw tensor: checked, and warned about
            want = attnkit.attention(q, k, v, mask=allowed, backend="reference")
        saved = set(hints._warned)
        hints._warned.clear()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                got = attnkit.attention(q, k, v, mask=masks.from_tensor(allowed), backend=backend)
        finally:
            hints._warned.clear()
            hints._warned.update(saved)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(
        TypeError, match=r"from_tensor\(\) takes a bool tensor .* got a float32 tensor"
    ):
        masks.from_tensor(allowed.float())


def test_from_tensor_on_flex_and_compiled_with_the_tensor_as_an_input() -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g) for _ in range(3))
    allowed = torch.rand(2, 1, 9, 9, generator=g) > 0.3
    allowed[..., 0] = True
    want = attnkit.attention(q.double(), k.double(), v.double(), mask=allowed, backend="reference")
    with torch.no_grad():
        got = attnkit.attention(q, k, v, mask=masks.from_tensor(allowed), backend="flex")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)

    def loss(q: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return (attnkit.attention(q, k, v, mask=masks.from_tensor(m)) * v[..., :9, :]).sum()

    compiled = torch.compile(loss, fullgraph=True)
    for m in (allowed, ~allowed | (torch.arange(9) == 0)):  # new values, the same graph
        q1, q2 = q.clone().requires_grad_(), q.clone().requires_grad_()
        got_loss, want_loss = compiled(q1, m), loss(q2, m)
        got_loss.backward()
        want_loss.backward()
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(q1.grad, q2.grad, rtol=1e-5, atol=1e-5)


def test_documents_from_ids_under_compile() -> None:
    """Document ids of any values (negative, out of order) give the same mask compiled as not,
    in one graph (ranking them with ``torch.unique`` broke it: its output shape is data)."""
    from torch._dynamo.utils import counters

    ids = torch.tensor([[5, 5, -3, -3, 9], [2, 7, 7, 2, 2]])

    def dense(ids: torch.Tensor) -> torch.Tensor:
        return masks.documents(ids=ids).dense(5, batch_size=2)

    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(dense, backend="aot_eager")(ids)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    want = (ids.unsqueeze(-1) == ids.unsqueeze(-2)).unsqueeze(1)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(dense(ids), want)
