"""The flash_attn backend, tested without flash-attn: a stand-in module in ``sys.modules``
computes flash-attn's documented semantics (bottom-right bands, ``cu_seqlens``, softcap, grouped
heads, the log-sum-exp) on each sequence and records its calls, so what the backend hands the
package is checked against attnkit's float64 reference; where it serves on a GPU is asked of the
rules ``explain(device="cuda")`` reads."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import math
import sys
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks
from attnkit._base import devices
from attnkit._call import check_attention_args
from attnkit.backends import builtin_backends
from attnkit.backends import flash_package as fp
from attnkit.backends.base import CallInputs
from attnkit.caches.view import CacheView
from attnkit.testing import assert_close

H100 = devices.Target("cuda", "nvidia", (9, 0), present=False)
# the module, not the function attnkit exports under its name
attention_module = importlib.import_module("attnkit.attention")


def _sequence(q: Tensor, k: Tensor, v: Tensor, kw: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """flash-attn on one sequence: q (Tq, H, D), k and v (Tk, Hkv, D) -> out (Tq, H, D), lse
    (H, Tq). Query i sits at key i + Tk - Tq (bottom-right); window (left, right), -1 unbounded."""
    tq, tk, h = q.size(0), k.size(0), q.size(1)
    k, v = (t.repeat_interleave(h // t.size(1), dim=1) for t in (k, v))
    scale = kw["softmax_scale"] or 1 / math.sqrt(q.size(-1))
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if kw["softcap"]:
        s = kw["softcap"] * torch.tanh(s / kw["softcap"])
    left, right = (-1, 0) if kw["causal"] else kw["window_size"]
    d = torch.arange(tk)[None, :] - (torch.arange(tq)[:, None] + tk - tq)  # j - i'
    seen = torch.ones(tq, tk, dtype=torch.bool)
    if left >= 0:
        seen &= d >= -left
    if right >= 0:
        seen &= d <= right
    s = s.masked_fill(~seen, -math.inf)
    # a query that sees no key: output 0 and, as flash-attn writes it, a log-sum-exp of +inf
    empty = ~seen.any(-1)  # (Tq,)
    lse = torch.logsumexp(s, -1).masked_fill(empty, math.inf)
    weights = torch.softmax(s, -1).masked_fill(empty[:, None], 0.0)
    return torch.einsum("hqk,khd->qhd", weights, v), lse


def fake_flash_attn() -> ModuleType:
    module = ModuleType("flash_attn")
    calls: list[tuple[str, dict[str, Any]]] = []

    def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> Any:
        calls.append(("flash_attn_func", kw))
        parts = [_sequence(q[b], k[b], v[b], kw) for b in range(q.size(0))]
        out, lse = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        return (out, lse, None) if kw["return_attn_probs"] else out

    def flash_attn_varlen_func(
        q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, mq: int, mk: int, **kw: Any
    ) -> Any:
        calls.append(("flash_attn_varlen_func", {"cu_seqlens": cu_q.tolist(), "max": mq, **kw}))
        bounds = cu_q.tolist()
        parts = [_sequence(q[a:b], k[a:b], v[a:b], kw) for a, b in itertools.pairwise(bounds)]
        out = torch.cat([p[0] for p in parts])
        lse = torch.cat([p[1] for p in parts], dim=1)
        return (out, lse, None) if kw["return_attn_probs"] else out

    def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, **kw: Any) -> Any:
        calls.append(("flash_attn_with_kvcache", kw))
        table, ends, pad = kw["block_table"], kw["cache_seqlens"].tolist(), kw["cache_leftpad"]
        starts = [0] * len(ends) if pad is None else pad.tolist()
        outs, lses = [], []
        for n, (start, end) in enumerate(zip(starts, ends, strict=True)):
            if table is None:
                keys, values = k_cache[n, start:end], v_cache[n, start:end]
            else:  # (X, page, Hkv, D): the row's pages in order, their first `end` keys
                keys, values = (t[table[n].long()].flatten(0, 1)[:end] for t in (k_cache, v_cache))
            out, lse = _sequence(q[n], keys, values, {**kw, "softmax_scale": kw["softmax_scale"]})
            outs.append(out)
            lses.append(lse)
        out, lse = torch.stack(outs), torch.stack(lses)
        return (out, lse) if kw["return_softmax_lse"] else out

    module.flash_attn_with_kvcache = flash_attn_with_kvcache  # type: ignore[attr-defined]
    module.flash_attn_func = flash_attn_func  # type: ignore[attr-defined]
    module.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
    module.calls = calls  # type: ignore[attr-defined]
    return module


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = fake_flash_attn()
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return module


B, H, T, D = 2, 4, 32, 8


def checked(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:
    """The call attention() would describe for these arguments."""
    defaults: dict[str, Any] = {"mask": None, "bias": None, "causal": False, "scale": None}
    return check_attention_args(q, k, v, **{**defaults, **kwargs})


CASES = [
    ("no mask", {}, "flash_attn_func", None),
    ("causal", {"causal": True}, "flash_attn_func", None),
    ("sliding window", {"mask": masks.sliding_window(5)}, "flash_attn_func", None),
    ("window both sides", {"mask": masks.sliding_window(4, 2)}, "flash_attn_func", None),
    ("softcap, causal", {"causal": True, "softcap": 2.0}, "flash_attn_func", None),
    (
        "documents",
        {"mask": masks.documents([5, 11, 16])},
        "flash_attn_varlen_func",
        [0, 5, 16, 32, 37, 48, 64],
    ),
    (
        "documents, causal",
        {"mask": masks.documents([20, 12]), "causal": True},
        "flash_attn_varlen_func",
        [0, 20, 32, 52, 64],
    ),
    (
        "documents per row, a window",
        {"mask": masks.documents([[10, 22], [32]]) & masks.sliding_window(3)},
        "flash_attn_varlen_func",
        [0, 10, 32, 64],
    ),
    ("the log-sum-exp", {"causal": True, "return_lse": True}, "flash_attn_func", None),
]


@pytest.mark.parametrize(("name", "kwargs", "function", "cu"), CASES)
@pytest.mark.parametrize("hkv", [H, 2])
def test_the_package_computes_the_call(
    fake: ModuleType, name: str, kwargs: dict[str, Any], function: str, cu: Any, hkv: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, hkv, T, D, generator=gen, dtype=torch.float64) for _ in range(2))
    call = checked(q, k, v, **kwargs)
    got = fp.FlashAttnPackage().run(call, CallInputs(q, k, v))
    want = attnkit.attention(q, k, v, **kwargs, backend="reference")
    if isinstance(want, tuple):
        assert isinstance(got, tuple)
        assert_close(got[1], want[1])
        got, want = got[0], want[0]
    assert_close(got, want)
    (called, kw), *_ = fake.calls
    assert called == function
    if cu is not None:
        assert kw["cu_seqlens"] == cu
    assert kw["softcap"] == kwargs.get("softcap", 0.0)


def gpu_call(**kwargs: Any) -> Any:
    dtype = kwargs.pop("dtype", torch.bfloat16)
    q = torch.empty(B, H, 1024, 64, device="meta", dtype=dtype)
    call = checked(q, q, q, **kwargs)
    return dataclasses.replace(call, device=torch.device("cuda"))


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"mask": masks.documents([512, 512]), "causal": True}, None),
        ({"mask": masks.sliding_window(128), "softcap": 30.0, "dropout_p": 0.1}, None),
        (
            {"causal": True, "dtype": torch.float32},
            "flash-attn takes float16/bfloat16, not float32",
        ),
        ({"mask": masks.key_padding([1024, 512])}, "serves no mask but bands and packed documents"),
        (
            {"causal": True, "sinks": torch.zeros(H, device="meta", dtype=torch.bfloat16)},
            "no sinks",
        ),
        (
            {"bias": torch.zeros(H, 1024, 1024, device="meta", dtype=torch.bfloat16)},
            "adds nothing to the scores but a softcap",
        ),
        ({"mask": masks.causal(align="top_left")}, None),
        ({"causal": True, "return_weights": True}, "does not return attention weights"),
    ],
)
def test_what_it_serves_on_a_gpu(fake: ModuleType, kwargs: dict[str, Any], why: str | None) -> None:
    with devices.assuming(H100):
        reasons = fp.FlashAttnPackage().check(gpu_call(**kwargs))
    if why is None:
        assert reasons == []
    else:
        assert any(why in r for r in reasons), reasons


def test_not_on_the_cpu_nor_old_gpus(fake: ModuleType) -> None:
    q = torch.empty(B, H, 64, 64, dtype=torch.bfloat16)
    on_cpu = checked(q, q, q, causal=True)
    assert any("not cpu" in r for r in fp.FlashAttnPackage().check(on_cpu))
    with devices.assuming(dataclasses.replace(H100, capability=(7, 5))):
        assert any("from sm_80" in r for r in fp.FlashAttnPackage().check(gpu_call(causal=True)))


def test_never_a_dependency(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setattr(fp, "_importable", lambda: False)
    assert not fp.flash_attn_installed()
    assert "flash_attn" not in [b.name for b in builtin_backends()]
    with devices.assuming(H100):
        reasons = fp.FlashAttnPackage().check(gpu_call(causal=True))
    assert "the flash-attn package is not installed" in reasons
    # attnkit's own stand-in for flash-attn is not the package: no circle through it
    monkeypatch.setitem(sys.modules, "flash_attn", attnkit.flash_attn)
    assert not fp.flash_attn_installed()


def test_auto_takes_it_where_torch_is_not_the_fastest(
    fake: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = {b.name: b for b in builtin_backends()}
    assert list(registry)[:2] == ["sdpa", "flash_attn"]
    monkeypatch.setattr(attention_module, "_REGISTRY", registry)
    q = torch.empty(B, H, 1024, 64, device="meta", dtype=torch.bfloat16)

    def picks(**kwargs: Any) -> str | None:
        return attnkit.explain(q, q, q, **kwargs, device="cuda").chosen

    assert picks(causal=True) == "sdpa"  # torch's flash kernel
    assert picks(mask=masks.documents([256, 512, 256]), causal=True) == "flash_attn"
    assert picks(mask=masks.sliding_window(128)) == "flash_attn"
    assert picks(mask=masks.key_padding([1024, 512])) == "sdpa"
    assert picks(mask=masks.from_fn(lambda b, h, i, j: (i - j).abs() < 9)) == "flex"
    text = str(attnkit.explain(q, q, q, mask=masks.documents([256, 768]), device="cuda"))
    assert "flash_attn_varlen_func over 4 packed sequences" in text, text
    # a decode step on a cache, read where it lies
    cache = torch.empty(B, 2, 4096, 64, device="meta", dtype=torch.bfloat16)
    view = CacheView(cache, cache, [(0, 1000), (0, 4000)])
    step = torch.empty(B, H, 1, 64, device="meta", dtype=torch.bfloat16)
    text = str(attnkit.explain(step, view, causal=True, device="cuda"))
    assert "auto picks: flash_attn" in text, text
    assert "flash_attn_with_kvcache, window_size=(-1, 0), the cache read in place" in text, text


def _view(paged: bool, q_lens: Any = None) -> tuple[Tensor, CacheView]:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, 3, D, generator=gen, dtype=torch.float64)
    if paged:  # pages of 256 keys, rows through a block table
        pages = torch.randn(4, 2, 256, D, generator=gen, dtype=torch.float64)
        table = torch.tensor([[2, 0], [1, 3]])
        return q, CacheView(pages, pages * 2, [(0, 300), (0, 100)], table, q_lens=q_lens)
    cache = torch.randn(B, 2, 64, D, generator=gen, dtype=torch.float64)
    return q, CacheView(cache, cache * 2, [(0, 20), (5, 40)], q_lens=q_lens)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize(
    "kwargs", [{"causal": True}, {"mask": masks.sliding_window(7)}, {"softcap": 3.0}, {}]
)
def test_a_cache_read_where_it_lies(fake: ModuleType, paged: bool, kwargs: dict[str, Any]) -> None:
    q, view = _view(paged)
    call = checked(q, view, None, **kwargs, return_lse=True)
    got = fp.FlashAttnPackage().run(call, CallInputs(q, view.k, view.v))
    want = attnkit.attention(q, view, **kwargs, return_lse=True, backend="reference")
    assert isinstance(got, tuple)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    (called, kw), *_ = fake.calls
    assert called == "flash_attn_with_kvcache"
    assert (kw["block_table"] is not None) == paged


def test_a_cache_row_with_no_visible_key_has_lse_minus_inf(fake: ModuleType) -> None:
    # flash-attn writes +inf as the log-sum-exp of a query that sees no key (output 0): attnkit's
    # is -inf, which merge_attention reads as "no weight" (+inf would take all of it).
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, 3, D, generator=gen, dtype=torch.float64)
    cache = torch.randn(B, 2, 64, D, generator=gen, dtype=torch.float64)
    view = CacheView(cache, cache * 2, [(0, 20), (5, 6)])  # row 1: its first 2 queries see none
    call = checked(q, view, None, causal=True, return_lse=True)
    got = fp.FlashAttnPackage().run(call, CallInputs(q, view.k, view.v))
    want = attnkit.attention(q, view, causal=True, return_lse=True, backend="reference")
    assert isinstance(got, tuple)
    assert bool((want[1][1, :, :2] == -math.inf).all())
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])


def test_the_caches_it_declines(fake: ModuleType) -> None:
    def reasons(view: CacheView, **kwargs: Any) -> list[str]:
        q = torch.empty(B, H, 3, D, dtype=torch.bfloat16, device="meta")
        meta = CacheView(
            view.k.to("meta", torch.bfloat16),
            view.v.to("meta", torch.bfloat16),
            view.kv_range,
            view.block_table,
            q_lens=view.q_lens,
        )
        call = dataclasses.replace(checked(q, meta, None, **kwargs), device=torch.device("cuda"))
        with devices.assuming(H100):
            return fp.FlashAttnPackage().check(call)

    assert reasons(_view(paged=True)[1], causal=True) == []
    assert reasons(_view(paged=False)[1], causal=True) == []
    assert any("no padding queries" in r for r in reasons(_view(False, q_lens=[3, 1])[1]))
    small = CacheView(
        *(torch.zeros(8, 2, 16, D) for _ in range(2)),
        [(0, 20), (0, 9)],
        torch.tensor([[0, 1], [2, 3]]),
    )
    assert any("multiple of 256 keys, not 16" in r for r in reasons(small, causal=True))
