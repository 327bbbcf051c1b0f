"""On a GPU: every kind of call attnkit sends to torch's compiled kernels, checked against the
float64 reference and timed in bfloat16 against torch's own kernels written by hand.

    python benchmarks/gpu_check.py --json docs/benchmarks/data/gpu.json   # one GPU, < 8 minutes
    python benchmarks/gpu_check.py --smoke                                # the whole script on the
                                                                          # CPU at tiny sizes

Part 1 (checks), each call kind at a small size in float32: attnkit's output (``backend="auto"``)
and its gradients (q, k, v and what the call adds: bias, tables, sinks, the relative encodings)
against the reference backend in float64 on the same inputs, at attnkit.testing's tolerances; and
the hand-written baseline's forward against the same reference, so that the timings compare the
same arithmetic. Part 2 (timings), bfloat16, forward and forward+backward: attnkit against
torch's FlexAttention written by hand for the same mask and modifier (``torch.compile``d, its
``BlockMask`` from ``create_block_mask``), and plain, causal and decode calls against torch's SDPA,
and index masks against SDPA with the selection as a dense bool mask (what ``auto`` ran before
``flex`` took them).
T runs from 1k to 64k for the calls SDPA serves; the other kinds are timed at 4k first, then at the
other lengths while ``--budget`` seconds last (each length compiles anew), so the script ends in
time on one H100. Every attnkit call is recorded (``attnkit.record_dispatch``): the backend that
served it, and how many ran attnkit's eager kernel, a Python loop of small kernels (target: 0).

It writes the benchmarks page's ``gpu`` rows (``T``, ``causal``, ``mode``, ``candidate``, ``ms``,
``ratio`` to the row's baseline) plus ``call``, ``baseline`` and ``served_by``; it exits non-zero
if a check fails or, on a GPU, if any call ran the eager kernel.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils import benchmark

import attnkit
from attnkit import masks
from attnkit.scores import DistanceBias, RelativePositionTerm
from attnkit.testing import assert_close

import results

try:  # torch's FlexAttention, for the baselines written by hand
    from torch.nn.attention import flex_attention as _flex_module
except ImportError:  # pragma: no cover - a torch without FlexAttention
    _flex_module = None  # type: ignore[assignment]


@dataclass
class Setup:
    """The run's device and sizes."""

    device: str
    batch: int
    heads: int
    dim: int
    check_t: int
    lengths: list[int]
    first_t: int
    min_run_time: float
    budget: float
    compiled: bool
    started: float = field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.started)


Inputs = dict[str, Any]
Call = Callable[[Inputs, str], Tensor]  # attnkit's call, on a backend
Hand = Callable[[Inputs, "Flex"], Tensor]  # the baseline written by hand


@dataclass(frozen=True)
class Kind:
    """One kind of call: how to make its inputs, attnkit's call, the baseline by hand."""

    name: str
    call: Call
    hand: Hand
    baseline: str = "flex"  # "flex" (torch's FlexAttention by hand) or "sdpa"
    causal: bool = False
    tq: Callable[[int], int] = lambda t: t
    heads_kv: int | None = None
    grads: bool = True  # decode steps are inference: forward only
    max_t: int = 1 << 16  # baselines that write out a (T, T) table stop earlier
    extra: Callable[[Setup, int, int, torch.dtype], Inputs] = lambda s, tq, tk, dt: {}


class Flex:
    """torch's FlexAttention as the baselines call it, compiled. The smoke run (on the CPU, where
    it has no backward and its eager form traces every new mask_mod for seconds) evaluates the
    same ``mask_mod`` and ``score_mod`` on the whole score matrix instead."""

    def __init__(self, setup: Setup) -> None:
        if _flex_module is None:
            raise SystemExit("this torch has no FlexAttention: nothing to compare with")
        self.setup = setup
        # as torch's documentation writes it (default dynamic shapes), which attnkit's flex
        # backend also compiles with on GPUs: both compile static kernels for the first length
        # of a kind and a kernel for every length from the second on
        self.attend = torch.compile(_flex_module.flex_attention)

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask_mod: Callable[..., Tensor] | None = None,
        score_mod: Callable[..., Tensor] | None = None,
        lse: bool = False,
    ) -> Any:
        if not self.setup.compiled:
            return _dense_flex(q, k, v, mask_mod, score_mod, lse)
        block = None
        if mask_mod is not None:
            block = _flex_module.create_block_mask(
                mask_mod, q.size(0), None, q.size(-2), k.size(-2), device=q.device
            )
        aux = _flex_module.AuxRequest(lse=True) if lse else None
        gqa = q.size(1) != k.size(1)
        return self.attend(
            q, k, v, score_mod=score_mod, block_mask=block, enable_gqa=gqa, return_aux=aux
        )


def _dense_flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_mod: Callable[..., Tensor] | None,
    score_mod: Callable[..., Tensor] | None,
    lse: bool,
) -> Any:
    """FlexAttention's arithmetic on the whole ``(B, H, Tq, Tk)`` score matrix: the smoke run's
    stand-in for the compiled kernel, with the same mods and FlexAttention's outputs (0 and
    ``lse = -inf`` for a query that sees no key)."""
    groups = q.size(1) // k.size(1)
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    b, h, tq, tk = q.size(0), q.size(1), q.size(2), k.size(2)
    idx = [
        torch.arange(n, device=q.device).view(*(-1 if i == d else 1 for i in range(4)))
        for d, n in enumerate((b, h, tq, tk))
    ]
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.size(-1))
    if score_mod is not None:
        scores = score_mod(scores, *idx)
    if mask_mod is not None:
        scores = scores.masked_fill(~mask_mod(*idx).expand_as(scores), -math.inf)
    total = torch.logsumexp(scores, -1, keepdim=True)
    seen = torch.isfinite(total)
    probs = torch.where(seen, torch.exp(scores - total.masked_fill(~seen, 0.0)), 0.0)
    out = (probs @ v.float()).to(q.dtype)
    if not lse:
        return out
    return out, SimpleNamespace(lse=total.squeeze(-1))


# --------------------------------------------------------------------------------------------------
# The kinds of calls: attnkit's call and the same arithmetic written by hand


def _offset(i: Inputs) -> int:
    return int(i["k"].size(-2) - i["q"].size(-2))  # bottom-right: query i sits at key i + offset


def _causal_mod(off: int) -> Callable[..., Tensor]:
    return lambda b, h, q, kv: kv <= q + off


def _lengths(s: Setup, tq: int, tk: int, dt: torch.dtype) -> Inputs:
    return {"lengths": torch.tensor([tk, max(1, tk // 3)] * (s.batch // 2), device=s.device)}


def _docs(s: Setup, tq: int, tk: int, dt: torch.dtype) -> Inputs:
    cuts = [tk // 4, tk // 2, tk - tk // 4 - tk // 2]
    ids = torch.cat([torch.full((n,), d, device=s.device) for d, n in enumerate(cuts)])
    return {"docs": cuts, "ids": ids}


def _bias(s: Setup, tq: int, tk: int, dt: torch.dtype) -> Inputs:
    return {"bias": torch.randn(s.heads, tq, tk, device=s.device, dtype=dt)}


def _table(s: Setup, tq: int, tk: int, dt: torch.dtype) -> Inputs:
    return {"table": torch.randn(s.heads, tq + tk - 1, device=s.device, dtype=dt)}


def _sinks(s: Setup, tq: int, tk: int, dt: torch.dtype) -> Inputs:
    return {"sinks": torch.randn(s.heads, device=s.device, dtype=dt)}


def _selection(s: Setup, tq: int, tk: int, n: int, block: int) -> Inputs:
    """An indexer's choice (``block`` 1: keys, else blocks of keys), ``(B, 1, Tq, n)``: each
    query's own key (block) and ``n - 1`` more of its causal past at random, repeats allowed;
    and the selection ANDed with causal as the dense bool mask SDPA reads."""
    gen = torch.Generator(device=s.device).manual_seed(tq + tk + block)
    own = (torch.arange(tq, device=s.device) + tk - tq) // block  # (Tq,)
    u = torch.rand(s.batch, 1, tq, n, generator=gen, device=s.device)
    idx = (u * (own + 1).view(-1, 1)).long()  # uniform in 0 .. own
    idx[..., 0] = own
    mask = masks.key_indices(idx) if block == 1 else masks.block_indices(idx, block=block)
    visible = (mask & masks.causal()).dense(tq, tk, batch_size=s.batch, device=s.device)
    return {"idx": idx, "visible": visible}


def _selected(block: int) -> tuple[Call, Hand]:
    def call(i: Inputs, backend: str) -> Tensor:
        idx = i["idx"]
        mask = masks.key_indices(idx) if block == 1 else masks.block_indices(idx, block=block)
        return attnkit.attention(
            i["q"], i["k"], i["v"], mask=mask & masks.causal(), backend=backend
        )

    def hand(i: Inputs, flex: Flex) -> Tensor:
        gqa = i["q"].size(1) != i["k"].size(1)
        return F.scaled_dot_product_attention(
            i["q"], i["k"], i["v"], attn_mask=i["visible"], enable_gqa=gqa
        )

    return call, hand


def _relative(s: Setup, tq: int, tk: int, dt: torch.dtype) -> Inputs:
    return {
        "qv": torch.randn(s.batch, s.heads, tq, s.dim, device=s.device, dtype=dt),
        "enc": torch.randn(s.heads, tq + tk - 1, s.dim, device=s.device, dtype=dt) / 8,
    }


def _relative_call(i: Inputs, backend: str) -> Tensor:
    scale = 1 / math.sqrt(i["q"].size(-1))
    term = RelativePositionTerm(i["qv"], i["enc"], scale)
    return attnkit.attention(i["q"], i["k"], i["v"], bias=term, causal=True, backend=backend)


def _relative_hand(i: Inputs, flex: Flex) -> Tensor:
    # scale * qv_i . enc[top - (i' - j)], top = Tk - 1: the (B, H, Tq, P) product written out
    scale = 1 / math.sqrt(i["q"].size(-1))
    pos = torch.einsum("bhqd,hpd->bhqp", i["qv"], i["enc"]) * scale
    top, off = i["k"].size(-2) - 1, _offset(i)

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return score + pos[b, h, q, top - (q + off - kv)]

    return flex(i["q"], i["k"], i["v"], _causal_mod(off), score_mod)  # type: ignore[no-any-return]


def _sinks_hand(i: Inputs, flex: Flex) -> Tensor:
    out, aux = flex(i["q"], i["k"], i["v"], _causal_mod(_offset(i)), lse=True)
    sink = i["sinks"].float()[None, :, None]
    return (out * torch.sigmoid(aux.lse - sink)[..., None]).to(out.dtype)  # type: ignore[no-any-return]


def _decode(paged: bool) -> tuple[Call, Hand]:
    """A decode step (Tq = 1) over a cache whose rows hold ``lengths`` keys, through attnkit's
    flash-attn API: contiguous, or in pages of 256 through a block table."""

    def call(i: Inputs, backend: str) -> Tensor:
        q, k, v = (t.transpose(1, 2) for t in (i["q"], i["k"], i["v"]))  # (B, T, H, D)
        if backend == "reference":  # the same keys, as a padded call
            mask = masks.key_padding(i["lengths"])
            return attnkit.attention(i["q"], i["k"], i["v"], mask=mask, backend=backend)
        table = None
        if paged:  # the same cache in pages (made once, outside the timings)
            if "pages" not in i:
                b, tk, hkv, d = k.shape
                page = min(256, tk)
                i["pages"] = tuple(t.reshape(b * tk // page, page, hkv, d) for t in (k, v))
                i["table"] = torch.arange(b * tk // page, device=q.device).reshape(b, -1)
            (k, v), table = i["pages"], i["table"]
        out = attnkit.flash_attn.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=i["lengths"].int(), block_table=table
        )
        return out.transpose(1, 2)  # type: ignore[no-any-return]

    def hand(i: Inputs, flex: Flex) -> Tensor:
        lengths = i["lengths"]
        return flex(i["q"], i["k"], i["v"], lambda b, h, q, kv: kv < lengths[b])  # type: ignore[no-any-return]

    return call, hand


def _masked(
    mask: Callable[[Inputs], Any], mod: Callable[[Inputs], Callable[..., Tensor]]
) -> tuple[Call, Hand]:
    def call(i: Inputs, backend: str) -> Tensor:
        return attnkit.attention(i["q"], i["k"], i["v"], mask=mask(i), backend=backend)

    def hand(i: Inputs, flex: Flex) -> Tensor:
        return flex(i["q"], i["k"], i["v"], mod(i))  # type: ignore[no-any-return]

    return call, hand


def _sdpa(causal: bool = False) -> tuple[Call, Hand]:
    def call(i: Inputs, backend: str) -> Tensor:
        return attnkit.attention(i["q"], i["k"], i["v"], causal=causal, backend=backend)

    def hand(i: Inputs, flex: Flex) -> Tensor:
        gqa = i["q"].size(1) != i["k"].size(1)
        return F.scaled_dot_product_attention(
            i["q"], i["k"], i["v"], is_causal=causal, enable_gqa=gqa
        )

    return call, hand


def _by_distance(table: Tensor, tk: int) -> Callable[..., Tensor]:
    return lambda s, b, h, q, kv: s + table[h, kv - q + tk - 1]


def _chunks(i: Inputs) -> Callable[..., Tensor]:
    return lambda b, h, q, kv: (q // 256) == (kv // 256)


def _prefix(i: Inputs) -> Callable[..., Tensor]:
    return lambda b, h, q, kv: (kv <= q) | (kv < 128)


def kinds() -> list[Kind]:
    """Every kind of call, the calls SDPA serves first."""
    window = 256
    causal = masks.causal
    out = [
        Kind("plain", *_sdpa(), baseline="sdpa"),
        Kind("causal", *_sdpa(causal=True), baseline="sdpa", causal=True),
        Kind("GQA 16/4, causal", *_sdpa(causal=True), baseline="sdpa", causal=True, heads_kv=4),
        Kind(
            "key padding",
            *_masked(
                lambda i: masks.key_padding(i["lengths"]),
                lambda i: lambda b, h, q, kv, n=i["lengths"]: kv < n[b],
            ),
            baseline="flex",
            extra=_lengths,
        ),
        Kind(
            "causal + key padding",
            *_masked(
                lambda i: causal() & masks.key_padding(i["lengths"]),
                lambda i: lambda b, h, q, kv, n=i["lengths"]: (kv <= q) & (kv < n[b]),
            ),
            causal=True,
            extra=_lengths,
        ),
        Kind(
            f"sliding window {window}",
            *_masked(
                lambda i: masks.sliding_window(window),
                lambda i: lambda b, h, q, kv: (kv <= q) & (q - kv <= window),
            ),
            causal=True,
        ),
        Kind(
            "documents, causal",
            *_masked(
                lambda i: causal() & masks.documents(i["docs"]),
                lambda i: lambda b, h, q, kv, d=i["ids"]: (kv <= q) & (d[q] == d[kv]),
            ),
            causal=True,
            extra=_docs,
        ),
        Kind("chunks of 256 (from_fn)", *_masked(lambda i: masks.from_fn(_chunks(i)), _chunks)),
        Kind("prefix-LM (from_fn)", *_masked(lambda i: masks.from_fn(_prefix(i)), _prefix)),
        Kind(
            "causal, Tq = Tk / 2 (bottom-right)",
            *_masked(lambda i: causal(), lambda i: _causal_mod(_offset(i))),
            causal=True,
            tq=lambda t: t // 2,
        ),
        Kind(
            "causal, Tq = Tk / 2 (top-left)",
            *_masked(lambda i: causal(align="top_left"), lambda i: _causal_mod(0)),
            causal=True,
            tq=lambda t: t // 2,
        ),
        Kind(
            "softcap 30, causal",
            lambda i, be: attnkit.attention(
                i["q"], i["k"], i["v"], causal=True, softcap=30.0, backend=be
            ),
            lambda i, flex: flex(
                i["q"],
                i["k"],
                i["v"],
                _causal_mod(0),
                lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0),
            ),
            causal=True,
        ),
        Kind(
            "bias by distance (ALiBi-like table), causal",
            lambda i, be: attnkit.attention(
                i["q"],
                i["k"],
                i["v"],
                causal=True,
                bias=DistanceBias(i["table"], first=-(i["k"].size(-2) - 1)),
                backend=be,
            ),
            lambda i, flex: flex(
                i["q"],
                i["k"],
                i["v"],
                _causal_mod(0),
                _by_distance(i["table"], i["k"].size(-2)),
            ),
            causal=True,
            extra=_table,
        ),
        Kind(
            "dense bias (H, Tq, Tk)",
            lambda i, be: attnkit.attention(i["q"], i["k"], i["v"], bias=i["bias"], backend=be),
            lambda i, flex: flex(
                i["q"], i["k"], i["v"], None, lambda s, b, h, q, kv, t=i["bias"]: s + t[h, q, kv]
            ),
            max_t=1 << 13,
            extra=_bias,
        ),
        Kind(
            "sinks, causal",
            lambda i, be: attnkit.attention(
                i["q"], i["k"], i["v"], causal=True, sinks=i["sinks"], backend=be
            ),
            _sinks_hand,
            causal=True,
            extra=_sinks,
        ),
        Kind(
            "relative position term, causal",
            _relative_call,
            _relative_hand,
            causal=True,
            max_t=1 << 12,
            extra=_relative,
        ),
        Kind(
            "key indices, 256 a query, causal",
            *_selected(1),
            baseline="sdpa",
            causal=True,
            max_t=1 << 14,  # the baseline's (Tq, Tk) bool mask
            extra=lambda s, tq, tk, dt: _selection(s, tq, tk, 256, 1),
        ),
        Kind(
            "block indices, 16 of 64 keys a query, causal",
            *_selected(64),
            baseline="sdpa",
            causal=True,
            max_t=1 << 14,
            extra=lambda s, tq, tk, dt: _selection(s, tq, tk, 16, 64),
        ),
        Kind(
            "decode step, cache",
            *_decode(paged=False),
            tq=lambda t: 1,
            heads_kv=4,
            grads=False,
            extra=_lengths,
        ),
        Kind(
            "decode step, paged cache",
            *_decode(paged=True),
            tq=lambda t: 1,
            heads_kv=4,
            grads=False,
            extra=_lengths,
        ),
    ]
    return out


# --------------------------------------------------------------------------------------------------
# Inputs, checks and timings


def make_inputs(setup: Setup, kind: Kind, t: int, dtype: torch.dtype, grad: bool) -> Inputs:
    gen = torch.Generator(device=setup.device).manual_seed(t)
    b, h, d = setup.batch, setup.heads, setup.dim
    hkv = kind.heads_kv or h
    tq = kind.tq(t)

    def randn(*shape: int) -> Tensor:
        x = torch.randn(*shape, generator=gen, device=setup.device, dtype=torch.float32)
        return x.to(dtype).requires_grad_(grad)

    i: Inputs = {"q": randn(b, h, tq, d), "k": randn(b, hkv, t, d), "v": randn(b, hkv, t, d)}
    for name, x in kind.extra(setup, tq, t, dtype).items():
        floating = isinstance(x, Tensor) and x.is_floating_point()
        i[name] = x.requires_grad_(grad) if grad and floating else x
    return i


def leaves(i: Inputs) -> list[str]:
    return [n for n, x in i.items() if isinstance(x, Tensor) and x.requires_grad]


def as_float64(i: Inputs) -> Inputs:
    out: Inputs = {}
    for n, x in i.items():
        if isinstance(x, Tensor) and x.is_floating_point():
            out[n] = x.detach().double().requires_grad_(x.requires_grad)
        else:
            out[n] = x
    return out


@dataclass
class Tally:
    failures: list[str] = field(default_factory=list)
    eager: list[str] = field(default_factory=list)
    served: dict[str, str] = field(default_factory=dict)


def recorded(kind: Kind, run: Callable[[], Tensor], tally: Tally, device: str) -> Tensor:
    """``run()``, each attnkit call in it recorded: who served it, and whether the eager kernel
    ran (on a GPU, the chunked backend runs nothing else)."""
    with attnkit.record_dispatch() as log:
        out = run()
    for d in log:
        tally.served[kind.name] = d.served_by
        eager = (d.kernel or "").startswith("the eager kernel") or (
            d.served_by == "chunked" and device != "cpu"
        )
        if eager:
            tally.eager.append(f"{kind.name}: {d.kernel or d.served_by}")
    return out


def check(setup: Setup, kind: Kind, flex: Flex, tally: Tally) -> None:
    i = make_inputs(setup, kind, setup.check_t, torch.float32, kind.grads)
    ref_in = as_float64(i)
    try:
        expected = kind.call(ref_in, "reference")
        got = recorded(kind, lambda: kind.call(i, "auto"), tally, setup.device)
        assert_close(got, expected)
        names = leaves(i)
        if names:
            cot = torch.randn_like(expected)
            want = torch.autograd.grad(expected, [ref_in[n] for n in names], cot)
            grads = torch.autograd.grad(got, [i[n] for n in names], cot.float())
            for n, g, w in zip(names, grads, want, strict=True):
                try:
                    assert_close(g, w)
                except AssertionError as err:
                    raise AssertionError(f"gradient of {n}: {err}") from None
        with torch.no_grad():
            baseline = kind.hand(_detached(i), flex)
        try:
            assert_close(baseline, expected.detach())
        except AssertionError as err:
            raise AssertionError(f"the baseline by hand: {err}") from err
        print(f"ok    {kind.name:<46} served by {tally.served.get(kind.name)}", flush=True)
    except AssertionError as err:
        tally.failures.append(kind.name)
        print(f"FAIL  {kind.name}: {str(err).splitlines()[0]}", flush=True)


def _detached(i: Inputs) -> Inputs:
    return {n: x.detach() if isinstance(x, Tensor) else x for n, x in i.items()}


def _time(fn: Callable[[], Tensor], backward: bool, setup: Setup) -> float:
    if backward:
        out = fn()
        g = torch.randn_like(out)

        def step() -> None:
            fn().backward(g)

        ctx = torch.enable_grad()
    else:

        def step() -> None:
            fn()

        ctx = torch.no_grad()
    with ctx:
        step()  # compile and warm up outside the measurement
        timer = benchmark.Timer("step()", globals={"step": step})
        if not setup.compiled:  # the smoke run: once is enough to run the code
            return float(timer.timeit(1).median)
        return float(timer.blocked_autorange(min_run_time=setup.min_run_time).median)


def timings(
    setup: Setup, todo: list[tuple[Kind, int]], flex: Flex, tally: Tally
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for kind, t in todo:
        if setup.left() <= 0:
            print(f"skip  {kind.name} T={t}: out of time (--budget {setup.budget:.0f} s)")
            continue
        for backward in (False, True):
            if backward and not kind.grads:
                continue
            i = make_inputs(setup, kind, t, torch.bfloat16, backward)
            mode = "fwd+bwd" if backward else "fwd"
            try:
                base = _time(lambda k=kind, i=i: k.hand(i, flex), backward, setup)
                mine = _time(
                    lambda k=kind, i=i: recorded(k, lambda: k.call(i, "auto"), tally, setup.device),
                    backward,
                    setup,
                )
            except (RuntimeError, torch.OutOfMemoryError) as err:  # a size the GPU cannot hold
                print(f"skip  {kind.name} T={t} {mode}: {str(err).splitlines()[0][:120]}")
                continue
            basename = "torch sdpa" if kind.baseline == "sdpa" else "flex by hand"
            common = {"T": t, "causal": kind.causal, "mode": mode, "call": kind.name}
            served = tally.served.get(kind.name, "?")
            rows.append({**common, "candidate": basename, "ms": base * 1e3, "ratio": 1.0})
            rows.append(
                {
                    **common,
                    "candidate": f"attnkit ({served})",
                    "ms": mine * 1e3,
                    "ratio": mine / base,
                    "baseline": basename,
                    "served_by": served,
                }
            )
            print(
                f"T={t:>6} {mode:<8} {kind.name:<46} {basename} {base * 1e3:8.3f} ms, "
                f"attnkit ({served}) {mine * 1e3:8.3f} ms ({mine / base:.2f}x)",
                flush=True,
            )
    return rows


def plan(setup: Setup, all_kinds: list[Kind]) -> list[tuple[Kind, int]]:
    """What to time, most telling first: every kind at ``first_t``, the calls SDPA serves at every
    length, then the other kinds at the other lengths (each compiles anew) while time lasts."""
    first = [(k, setup.first_t) for k in all_kinds if setup.first_t <= k.max_t]
    sdpa = [(k, t) for k in all_kinds if k.baseline == "sdpa" for t in setup.lengths]
    rest = [(k, t) for t in setup.lengths for k in all_kinds if k.baseline != "sdpa"]
    seen: set[tuple[str, int]] = set()
    out = []
    for k, t in [*first, *sdpa, *rest]:
        if (k.name, t) not in seen and t <= k.max_t:
            seen.add((k.name, t))
            out.append((k, t))
    return out


def setup_of(args: argparse.Namespace) -> Setup:
    if args.smoke:
        return Setup("cpu", 2, 4, 16, 32, [64], 64, 0.0, args.budget, compiled=False)
    lengths = [1 << n for n in range(10, 17)]  # 1k .. 64k
    return Setup("cuda", 2, 16, 64, 256, lengths, 4096, 0.2, args.budget, compiled=True)


def growing_cache(setup: Setup, tally: Tally) -> None:
    """Decode steps with a softcap (which ``flex`` serves) over a cache that grows by one key a
    step: torch compiles the lowered call a few times (a length, then every length), not once per
    length. On a GPU only (the CPU compiles flex_attention once per shape)."""
    if setup.device == "cpu":
        return
    from torch._dynamo.utils import counters

    b, h, d = setup.batch, setup.heads, setup.dim
    before = counters["stats"]["unique_graphs"]
    worst = 0.0
    for tk in range(1000, 1008):
        q = torch.randn(b, h, 1, d, device=setup.device, dtype=torch.bfloat16)
        k, v = (torch.randn(b, h, tk, d, device=setup.device, dtype=torch.bfloat16) for _ in "kv")
        out = attnkit.attention(q, k, v, causal=True, softcap=30.0)
        ref = attnkit.attention(q, k, v, causal=True, softcap=30.0, backend="reference")
        worst = max(worst, float((out.float() - ref.float()).abs().max()))
    graphs = counters["stats"]["unique_graphs"] - before
    print(
        f"decode over a growing cache, softcap: {graphs} compiles for 8 lengths, error {worst:.1e}"
    )
    if graphs > 3 or worst > 2e-2:
        tally.failures.append(f"growing cache: {graphs} compiles for 8 lengths, error {worst:.1e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows and the checks' results to this file")
    parser.add_argument("--smoke", action="store_true", help="the whole script, CPU, tiny sizes")
    parser.add_argument("--budget", type=float, default=390.0, help="seconds for the timings")
    parser.add_argument("--only", nargs="*", help="only the kinds whose names contain these")
    args = parser.parse_args(argv)
    setup = setup_of(args)
    if setup.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (--smoke runs the script on the CPU)")
        return 2
    # each mask_mod and score_mod is a graph of its own: let torch.compile keep them all
    torch._dynamo.config.recompile_limit = 512
    torch._dynamo.config.accumulated_recompile_limit = 4096
    where = torch.cuda.get_device_name() if setup.device == "cuda" else "CPU (smoke run)"
    print(f"torch {torch.__version__}, attnkit {attnkit.__version__}, {where}")
    chosen = [k for k in kinds() if not args.only or any(w in k.name for w in args.only)]
    flex, tally = Flex(setup), Tally()
    for kind in chosen:
        check(setup, kind, flex, tally)
    growing_cache(setup, tally)
    rows = timings(setup, plan(setup, chosen), flex, tally)
    print(
        f"\n{len(tally.failures)} failed checks"
        + (": " + ", ".join(tally.failures) if tally.failures else "")
    )
    print(
        f"{len(tally.eager)} calls ran attnkit's eager kernel"
        + ("".join(f"\n  {e}" for e in tally.eager))
    )
    if args.json:
        config = {
            "B": setup.batch,
            "H": setup.heads,
            "D": setup.dim,
            "dtype": "bfloat16",
            "failures": tally.failures,
            "eager_calls": tally.eager,
            "served_by": tally.served,
        }
        results.save(args.json, "gpu", rows, config=config, device=setup.device)
    eager_fails = setup.device != "cpu" and bool(tally.eager)
    return 1 if tally.failures or eager_fails else 0


if __name__ == "__main__":
    sys.exit(main())
