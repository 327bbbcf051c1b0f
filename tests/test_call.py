"""The validated call: ``AttentionCall``'s fields and properties, ``describe()``, the per-argument
checks of ``check_attention_args`` (each names its argument and quotes the values)."""

from __future__ import annotations

import math
import re
from dataclasses import fields, replace
from unittest import mock

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import PagedKVCache, _call, masks
from attnkit._call import AttentionCall, CheckedCall, check_attention_args
from attnkit.caches.view import CacheView
from attnkit.scores import RelativePositionTerm


def qkv(
    batch: tuple[int, ...] = (2,),
    h: int = 4,
    hkv: int = 2,
    tq: int = 3,
    tk: int = 5,
    dk: int = 8,
    dv: int = 6,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[Tensor, Tensor, Tensor]:
    def t(*shape: int) -> Tensor:
        return torch.randn(*shape, dtype=dtype, device=device)

    return t(*batch, h, tq, dk), t(*batch, hkv, tk, dk), t(*batch, hkv, tk, dv)


def call_of(q: object, k: object, v: object, **kw: object) -> AttentionCall:
    args: dict[str, object] = {"mask": None, "bias": None, "causal": False, "scale": None}
    args.update(kw)
    return check_attention_args(q, k, v, **args)  # type: ignore[arg-type]


def test_fields_and_properties_of_a_grouped_query_call() -> None:
    q, k, v = qkv(batch=(2, 3))
    c = call_of(q, k, v, causal=True, softcap=30, sinks=torch.zeros(4))
    assert (c.batch_shape, c.num_heads, c.num_kv_heads) == ((2, 3), 4, 2)
    assert (c.q_len, c.kv_len, c.qk_dim, c.v_dim) == (3, 5, 8, 6)
    assert (c.dtype, c.device) == (torch.float32, torch.device("cpu"))
    assert c.groups == 2
    assert c.scores_shape == (2, 3, 4, 3, 5)
    assert c.scale == 1 / math.sqrt(8)
    assert c.softcap == 30.0
    assert isinstance(c.softcap, float)
    assert c.sinks
    assert c.causal
    assert not c.requires_grad
    assert c.finite is None
    geo = c.geometry
    assert (geo.batch_shape, geo.heads, geo.q_len, geo.kv_len) == ((2, 3), 4, 3, 5)
    assert geo.batch == 6
    assert geo.shift == 2
    assert c.score_shape().dtype == torch.float32
    assert call_of(*qkv(dtype=torch.float64)).score_shape().dtype == torch.float64
    assert call_of(*qkv(dtype=torch.bfloat16)).score_shape().dtype == torch.float32


def test_a_described_call_holds_its_fields_as_the_dataclass_makes_them() -> None:
    """A described call is made without the dataclass's ``__init__`` (one ``object.__setattr__``
    a field, on every call): it must hold every field, defaults included, and nothing else, and
    equal the call ``AttentionCall(**fields)`` makes."""
    q, k, v = qkv()
    calls = [
        call_of(q, k, v),
        call_of(q, k, v, causal=True, softcap=30, sinks=torch.zeros(4), return_lse=True),
        call_of(q.requires_grad_(), k, v, mask=masks.sliding_window(2), check_finite=True),
    ]
    names = {f.name for f in fields(AttentionCall)}
    for call in calls:
        assert set(vars(call)) == names
        again = AttentionCall(**{n: getattr(call, n) for n in names})
        assert call == again
        assert hash(call) == hash(again)
        assert call.describe() == again.describe()
    assert calls[2].finite is True  # (a default, replaced for a call that needs gradients)
    assert calls[0].quantized is None  # defaults
    assert calls[0].cache is None


def test_a_cache_calls_dense_form_is_worked_out_once_and_copies_forget_it() -> None:
    """``dense_views`` keeps its answer on the call, None included (a decode step asks it
    several times), and a copy of the call with other fields works it out afresh."""
    cache = attnkit.KVCache(1, 8, 2, 4)
    cache.update(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
    q = torch.randn(1, 2, 1, 4)
    call = call_of(q, cache.view(), None)
    dense = call.dense_views
    assert dense is not None
    assert dense.cache is None
    assert call.dense_views is dense
    assert dense.kv_len == 5
    paged = _call.copy_call(call, cache=replace(call.cache, q_lens=(1,)))
    assert paged.dense_views is None
    assert paged.dense_views is None  # (the kept answer)
    assert _call.copy_call(paged, cache=call.cache).dense_views is not None


def test_the_mask_folds_causal_in_and_keeps_what_was_given() -> None:
    q, k, v = qkv()
    dense = torch.rand(2, 1, 3, 5) < 0.5
    c = call_of(q, k, v, mask=dense, causal=True)
    assert c.mask_shape == (2, 1, 3, 5)
    assert c.given_mask == (2, 1, 3, 5)
    assert c.mask_given == "(2, 1, 3, 5)"
    geo = c.geometry
    want = dense & masks.causal_mask(3, 5)
    assert c.mask is not None
    assert torch.equal(c.mask.tile(geo, 0, 3, 0, 5).expand(2, 4, 3, 5), want.expand(2, 4, 3, 5))
    window = masks.sliding_window(1)
    c = call_of(q, k, v, mask=window)
    assert c.mask is window
    assert c.given_mask is window
    assert c.mask_shape is None
    assert c.mask_given == repr(window)
    plain = call_of(q, k, v)
    assert plain.mask is None
    assert plain.mask_given is None


def test_describe_says_everything_that_decides_the_backend() -> None:
    q, k, v = qkv()
    assert call_of(q, k, v).describe() == (
        "q (2, 4, 3, 8), k (2, 2, 5, 8), v (2, 2, 5, 6) float32 on cpu"
    )
    bias = torch.zeros(3, 5, requires_grad=True)
    c = call_of(
        q,
        k,
        v,
        mask=masks.sliding_window(2),
        causal=True,
        bias=bias,
        softcap=5.0,
        sinks=torch.zeros(4),
        dropout_p=0.25,
        return_weights=True,
    )
    assert c.describe() == (
        "q (2, 4, 3, 8), k (2, 2, 5, 8), v (2, 2, 5, 6) float32 on cpu, "
        "mask sliding_window(left=2, right=0), causal, bias (3, 5) (requires grad), softcap=5.0, "
        "sinks, dropout_p=0.25, return_weights"
    )
    assert c.bias_shape == (3, 5)
    assert c.bias_requires_grad
    assert c.requires_grad


def test_a_score_term_is_described_and_its_gradients_counted() -> None:
    q, k, v = qkv(batch=(1,), h=2, hkv=2, tq=4, tk=4)
    qv = torch.randn(1, 2, 4, 8, requires_grad=True)
    term = RelativePositionTerm(qv, torch.randn(1, 7, 8), 1.0)
    c = call_of(q, k, v, bias=term)
    assert c.score_term is term
    assert c.bias_shape is None
    assert c.bias_requires_grad
    assert c.requires_grad
    assert c.describe().endswith(f", bias {term.describe()}")
    with torch.no_grad():
        assert not call_of(q, k, v, bias=term).requires_grad


def test_finiteness_is_checked_only_for_calls_that_need_gradients() -> None:
    q, k, v = qkv()
    k[0, 0, 0, 0] = float("nan")
    assert call_of(q, k, v, check_finite=True).finite is None
    q.requires_grad_()
    c = call_of(q, k, v, check_finite=True)
    assert c.finite is False
    assert c.describe().endswith(", non-finite values in q/k/v")
    assert call_of(q, k, v).finite is None  # not asked
    k[0, 0, 0, 0] = 0.0
    assert call_of(q, k, v, check_finite=True).finite is True


def test_meta_tensors_are_described_without_data() -> None:
    c = call_of(*qkv(device="meta"), causal=True, check_finite=True)
    assert c.device.type == "meta"
    assert c.describe().endswith("on meta, causal")


# (keyword arguments changed from a good call, exception type, the message's text)
Q, K, V = qkv()
BAD: list[tuple[dict[str, object], type[Exception], str]] = [
    ({"q": [1.0]}, TypeError, "q must be a torch.Tensor, got list"),
    ({"v": None}, TypeError, "v must be a torch.Tensor, got NoneType"),
    (
        {"q": torch.zeros(3, 8)},
        ValueError,
        "q must have shape (..., H, Tq, Dk) with 3 or more dims, got 2-d (3, 8)",
    ),
    (
        {"k": torch.zeros(2, 5, 8)},
        ValueError,
        "k must have as many dims as q (4), got 3-d (2, 5, 8) for q (2, 4, 3, 8)",
    ),
    (
        {"k": torch.zeros(1, 2, 5, 8), "v": torch.zeros(1, 2, 5, 6)},
        ValueError,
        "q, k and v must share their batch dims (...): got q (2, 4, 3, 8), k (1, 2, 5, 8), "
        "v (1, 2, 5, 6)",
    ),
    (
        {"v": torch.zeros(2, 2, 4, 6)},
        ValueError,
        "k and v must agree on (Hkv, Tk): got k (2, 2, 5, 8) and v (2, 2, 4, 6)",
    ),
    (
        {"k": torch.zeros(2, 2, 5, 7)},
        ValueError,
        "q and k must share the last dim Dk: got q (2, 4, 3, 8) (Dk=8) and k (2, 2, 5, 7) (Dk=7)",
    ),
    (
        {"k": torch.zeros(2, 3, 5, 8), "v": torch.zeros(2, 3, 5, 6)},
        ValueError,
        "the heads of q (H=4) must be a multiple of the heads of k and v (Hkv=3); "
        "got q (2, 4, 3, 8), k (2, 3, 5, 8)",
    ),
    (
        {"k": torch.zeros(2, 0, 5, 8), "v": torch.zeros(2, 0, 5, 6)},
        ValueError,
        "k and v must have at least one head (Hkv = k.shape[-3] >= 1); "
        "got q (2, 4, 3, 8), k (2, 0, 5, 8)",
    ),
    (
        {"q": Q.long(), "k": K.long(), "v": V.long()},
        TypeError,
        "q must be float16, bfloat16, float32 or float64, got int64",
    ),
    (
        {"v": V.double()},
        TypeError,
        "q, k and v must share a dtype, got q float32, k float32, v float64",
    ),
    (
        {"k": K.to("meta")},
        ValueError,
        "q, k and v must be on one device, got q on cpu, k on meta, v on cpu",
    ),
    (
        {"mask": torch.ones(3, 5)},
        TypeError,
        "mask must be a bool tensor",
    ),
    (
        {"mask": torch.ones(4, 5, dtype=torch.bool)},
        ValueError,
        "mask of shape (4, 5) does not broadcast to (..., H, Tq, Tk) = (2, 4, 3, 5)",
    ),
    (
        {"mask": "causal"},
        TypeError,
        "mask must be a bool tensor (True = may attend) or an attnkit.masks.Mask, got str",
    ),
    (
        {"mask": torch.ones(5, dtype=torch.bool, device="meta")},
        ValueError,
        "mask is on meta but q is on cpu",
    ),
    (
        {"mask": masks.causal() & torch.ones(5, dtype=torch.bool, device="meta")},
        ValueError,
        "mask holds a tensor on meta but q is on cpu",
    ),
    ({"causal": 1}, TypeError, "causal must be a bool, got 1"),
    (
        {"bias": [0.0]},
        TypeError,
        "bias must be a float tensor or an attnkit.scores.ScoreTerm, got list",
    ),
    (
        {"bias": torch.ones(3, 5, dtype=torch.bool)},
        TypeError,
        "bias must be a float tensor, got bool; a boolean mask belongs in mask=",
    ),
    (
        {"bias": torch.zeros(3, 5, dtype=torch.float64)},
        TypeError,
        "bias must have the dtype of q (float32), got float64; use bias.to(q.dtype)",
    ),
    (
        {"bias": torch.zeros(3, 4)},
        ValueError,
        "bias of shape (3, 4) does not broadcast to (..., H, Tq, Tk) = (2, 4, 3, 5)",
    ),
    ({"bias": torch.zeros(5, device="meta")}, ValueError, "bias is on meta but q is on cpu"),
    (
        {"bias": torch.tensor([0.0, 0.0, float("nan"), 0.0, 0.0])},
        ValueError,
        "bias holds NaN: a bias may hold -inf (that pair is then masked) but not NaN or +inf, "
        "which would make the softmax undefined",
    ),
    (
        {"bias": torch.tensor([0.0, float("inf"), 0.0, 0.0, 0.0])},
        ValueError,
        "bias holds +inf: a bias may hold -inf",
    ),
    ({"scale": "1"}, TypeError, "scale must be a float or None, got '1'"),
    ({"scale": True}, TypeError, "scale must be a float or None, got True"),
    (
        {"scale": float("inf")},
        ValueError,
        "scale must be finite and at most 3.4e+38 in magnitude (the largest float32, in which "
        "the scores are computed), got inf",
    ),
    ({"softcap": "5"}, TypeError, "softcap must be a number > 0 or None, got '5'"),
    ({"softcap": -1.0}, ValueError, "softcap must be a finite number > 0, got -1.0"),
    ({"sinks": [0.0] * 4}, TypeError, "sinks must be a float tensor (H,) or None, got list"),
    (
        {"sinks": torch.zeros(4, dtype=torch.int64)},
        TypeError,
        "sinks must be a float tensor (H,) or None, got int64",
    ),
    (
        {"sinks": torch.zeros(2)},
        ValueError,
        "sinks must have shape (H,) = (4,), one logit per query head, got (2)",
    ),
    (
        {"sinks": torch.zeros(4, dtype=torch.float64)},
        TypeError,
        "sinks must have the dtype of q (float32), got float64; use sinks.to(q.dtype)",
    ),
    ({"sinks": torch.zeros(4, device="meta")}, ValueError, "sinks is on meta but q is on cpu"),
    ({"return_weights": 0}, TypeError, "return_weights must be a bool, got 0"),
    ({"dropout_p": 1.0}, ValueError, "dropout_p must be in [0, 1), got 1.0"),
    ({"dropout_p": False}, TypeError, "dropout_p must be a float in [0, 1), got False"),
]


@pytest.mark.parametrize(("change", "exc", "message"), BAD, ids=lambda x: None)
def test_each_argument_is_checked_and_its_values_quoted(
    change: dict[str, object], exc: type[Exception], message: str
) -> None:
    args: dict[str, object] = {"q": Q, "k": K, "v": V}
    args.update(change)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match="^" + re.escape(message)):
        call_of(q, k, v, **args)


def test_the_good_call_of_the_table_passes() -> None:
    c = call_of(Q, K, V)
    assert c.dropout_p == 0.0
    assert not c.return_weights
    assert c.softcap is None
    assert not c.sinks
    assert call_of(Q, K, V, dropout_p=0).dropout_p == 0.0  # an int 0 is checked, and fine
    assert call_of(Q, K, V, scale=2).scale == 2.0
    assert call_of(Q, K, V, bias=torch.full((5,), -float("inf"))).bias_shape == (5,)


@pytest.mark.parametrize("backend", ["auto", "chunked"])
def test_scales_of_a_quantized_cache_view_that_need_gradients_get_them(backend: str) -> None:
    # A view's int8 scales that need gradients make the call one that needs gradients: the
    # native cache read (inference only) then serves nothing, and the scales' gradients are the
    # reference's (they were silently disconnected: "appears to not have been used in the
    # graph").
    import attnkit
    from attnkit import CacheView

    g = torch.Generator().manual_seed(61)
    k, v = (torch.randint(-20, 20, (4, 2, 3, 8), generator=g, dtype=torch.int8) for _ in "kv")
    q = torch.randn(2, 4, 1, 8, generator=g)  # (float32: what the native cache read takes)
    table, rows = torch.tensor([[0, 1], [2, 3]]), [(0, 5), (1, 6)]
    grads = []
    for chosen in (backend, "reference"):
        ks = (torch.rand(4, 2, 3, 1, generator=g.manual_seed(62)) * 0.05).requires_grad_()
        vs = (torch.rand(2, 1, 1, generator=g.manual_seed(63)) * 0.05).requires_grad_()
        view = CacheView(k, v, rows, table, k_scale=ks, v_scale=vs)
        out = attnkit.attention(q, view, None, backend=chosen)
        grads.append(torch.autograd.grad(out.sin().sum(), (ks, vs)))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# A cache step checked once: the call a PagedKVCache checks before its write, carried by its view


def _paged_step(**kw: object) -> tuple[Tensor, CacheView]:
    """A decode step's view of a PagedKVCache of 4 rows (16-token prompts, pages of 4): staged,
    its call checked (``causal=True`` and ``kw``), not committed."""
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(24, 4, 2, 8, max_seqs=4, dtype=torch.float64, layout="vllm")

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    cache.stage(rand(4, 2, 16, 8), rand(4, 2, 16, 8))
    cache.commit()
    q = rand(4, 4, 1, 8)
    with torch.no_grad():
        return q, cache.stage_call(q, rand(4, 2, 1, 8), rand(4, 2, 1, 8), causal=True, **kw)


def _recorded(q: Tensor, view: CacheView, **kw: object) -> tuple[AttentionCall, Tensor]:
    with torch.no_grad(), attnkit.record_dispatch() as calls:
        out = attnkit.attention(q, view, **kw)  # type: ignore[call-overload]
    assert len(calls) == 1
    return calls[0].call, out[0] if isinstance(out, tuple) else out


def _same_call(got: AttentionCall, want: AttentionCall) -> None:
    for f in fields(AttentionCall):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(a, masks.Mask) and isinstance(b, masks.Mask):
            assert repr(a) == repr(b), f.name
        elif f.name != "cache":
            assert a == b, f.name


def test_a_cache_step_is_checked_once_and_attention_dispatches_that_call() -> None:
    """The view a PagedKVCache step hands out carries the call its check described before the
    write; attention() on the view with the same arguments dispatches that call, field by field
    the call a fresh check of the view describes, on this very view, without checking it again."""
    q, view = _paged_step()
    assert isinstance(view.checked_call, CheckedCall)
    fresh = call_of(q, replace(view, checked_call=None), None, causal=True, return_lse=True)
    with mock.patch.object(_call, "_check_view", side_effect=AssertionError("checked again")):
        got, out = _recorded(q, view, causal=True, return_lse=True)
        got_plain, _ = _recorded(q, view, causal=True)
    _same_call(got, fresh)
    assert got.cache is view
    assert got_plain.return_lse is False
    keys, values = view.dense()
    want = attnkit.attention(q, keys, values, causal=True, backend="reference")
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("kw", "exc", "message"),
    [
        ({"softcap": -1.0}, ValueError, "softcap must be a finite number > 0, got -1.0"),
        ({"scale": math.nan}, ValueError, "scale must be finite"),
        ({"causal": 1}, TypeError, "causal must be a bool, got 1"),
        ({"sinks": torch.full((4,), math.nan, dtype=torch.float64)}, ValueError, "sinks holds NaN"),
        ({"return_lse": "yes"}, TypeError, "return_lse must be a bool, got 'yes'"),
        (
            {"mask": masks.key_padding([3, 4])},
            ValueError,
            "has 2 batch rows but the call has B = 4",
        ),
    ],
)
def test_a_call_on_a_checked_view_with_other_arguments_is_checked(
    kw: dict[str, object], exc: type[Exception], message: str
) -> None:
    """Only the arguments the cache checked are taken as checked: any other is checked (and
    refused) as attention() checks it, in the grad mode the view was checked in."""
    q, view = _paged_step()
    call = {"causal": True, **kw}
    with torch.no_grad(), pytest.raises(exc, match=re.escape(message)):
        call_of(q, view, None, **call)


def test_a_call_on_a_checked_view_with_other_valid_arguments_is_described_afresh() -> None:
    q, view = _paged_step()
    bare = replace(view, checked_call=None)
    for kw in ({"softcap": 5.0}, {"scale": 0.25}, {"causal": False, "mask": masks.causal()}):
        got, out = _recorded(q, view, **kw)
        _same_call(got, call_of(q, bare, None, **kw))
        assert torch.equal(out, _recorded(q, bare, **kw)[1])
    got, _ = _recorded(q.clone(), view, causal=True)  # other queries: described afresh
    assert got.cache is not view.checked_call.call.cache  # type: ignore[union-attr]


def test_a_step_checked_without_gradients_is_described_again_with_them() -> None:
    """The grad mode and q's requires_grad are part of what was checked: a call made with
    gradients on a view checked without them asks for them (and so is not read in place)."""
    q, view = _paged_step()
    q.requires_grad_(True)
    with attnkit.record_dispatch() as calls:
        out = attnkit.attention(q, view, causal=True)
    assert calls[0].call.requires_grad
    out.sum().backward()
    assert q.grad is not None
    assert q.grad.abs().sum() > 0


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_tensors_are_refused_with_the_way_to_attend_sequences_of_their_own_lengths() -> None:
    # attention(nt, nt, nt) on jagged nested tensors failed deep inside a backend's cost model
    # ("ValueError: ge: relation is indeterminate", from comparing a ragged length). Refused at
    # the check of q, naming the masks that do the same, and those masks on the padded tensors
    # give what torch's own attention gives on the nested ones.
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(11)
    lens = [3, 5]
    seqs = [[torch.randn(t, 2, 8, generator=g, dtype=torch.float64) for t in lens] for _ in "qkv"]
    nested = [torch.nested.nested_tensor(s, layout=torch.jagged).transpose(1, 2) for s in seqs]
    message = "q is a nested tensor: attention takes dense (..., H, T, D) tensors"
    with pytest.raises(TypeError, match=re.escape(message)) as caught:
        attnkit.attention(nested[0], nested[0], nested[0])
    assert "masks.key_padding(lengths)" in str(caught.value)
    assert "masks.documents(lengths)" in str(caught.value)
    strided = torch.nested.nested_tensor([s.transpose(0, 1) for s in seqs[0]])  # (no shape)
    with pytest.raises(TypeError, match=re.escape(message)):  # (the test suite's shape checks
        _call._check_qkv(strided, strided, strided)  # cannot read it: the check itself)
    view = CacheView(torch.zeros(2, 2, 6, 8), torch.zeros(2, 2, 6, 8), kv_range=[(0, 3), (0, 5)])
    with pytest.raises(TypeError, match=re.escape(message)):
        attnkit.attention(nested[0], view)
    want = F.scaled_dot_product_attention(*nested).transpose(1, 2).to_padded_tensor(0.0)
    padded = [n.transpose(1, 2).to_padded_tensor(0.0).transpose(1, 2) for n in nested]
    got = attnkit.attention(*padded, mask=masks.key_padding(lens))
    for b, t in enumerate(lens):
        torch.testing.assert_close(got[b, :, :t], want[b, :t].transpose(0, 1))
    packed = [torch.cat(list(s)).transpose(0, 1) for s in seqs]  # (H, 8, D): one row
    got = attnkit.attention(*packed, mask=masks.documents(lens))
    torch.testing.assert_close(got[:, :3], want[0, :3].transpose(0, 1))
    torch.testing.assert_close(got[:, 3:], want[1, :5].transpose(0, 1))
