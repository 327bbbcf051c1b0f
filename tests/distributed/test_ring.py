"""ring_attention on 2, 3 and 4 gloo ranks against attention() in one process on the whole sequence.

Spawning ranks costs seconds, so one run of 4 processes makes every check (:func:`all_checks`):
first as two groups of 2 ranks side by side (ranks 0-1 and 2-3, a subgroup whose ranks are not
the world's), then as a group of 3, then as the whole world of 4; the test functions below read
its report. Every case compares the output and the gradients of q, k, v and of the tensors every
rank holds whole (encodings, tables, sinks: each rank's share, summed over the ranks) with the
call in one process, in float64 to 1e-10.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import jaxtyping
import pytest
import torch
import torch.distributed as dist

import attnkit
from attnkit import masks
from attnkit.distributed import (
    Layout,
    RingBackend,
    balance_documents,
    ring_attention,
    ulysses_attention,
)
from attnkit.modules.positional import alibi_term
from attnkit.scores import DistanceBias, RelativePositionTerm
from attnkit.testing import assert_close

from .harness import run_ranks

B, H, HKV, DK, DV, DH = 2, 4, 2, 8, 6, 5  # grouped-query attention, Dv != Dk
T = 48  # divides into 2W chunks for W = 2, 3, 4
DOCS = [10, 20, 18]  # packed documents that cross shard boundaries


def whole_inputs(
    dtype: torch.dtype, seed: int = 0, kv_len: int = T, heads: int = H, q_len: int = T
) -> dict[str, torch.Tensor]:
    """The whole sequence's tensors, the same on every rank. Batch row 0 pads its last 3 keys,
    row 1 its first half less one, so under causality its first queries see no key at all."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    pad = torch.cat(
        [
            masks.padding_mask([kv_len - 3], max_len=kv_len),
            masks.padding_mask([kv_len // 2 - 1], max_len=kv_len, side="left"),
        ]
    )
    return {
        "q": randn(B, heads, q_len, DK),
        "k": randn(B, HKV, kv_len, DK),
        "v": randn(B, HKV, kv_len, DV),
        "dout": randn(B, heads, q_len, DV),
        "dlse": randn(B, heads, q_len),
        "qv": randn(B, heads, q_len, DH),
        "enc": randn(heads, q_len + kv_len - 1, DH),
        "table": randn(heads, q_len + kv_len - 1),
        "sinks": randn(heads),
        "slopes": attnkit.alibi_slopes(heads).to(dtype),
        "pad": pad,
    }


# Each case: attention()'s keyword arguments, built from the tensors given (the whole sequence's,
# or this rank's shards and the tensors every rank holds whole). "pad" is a dense key mask: a
# rank's shard travels with its keys.
Args = dict[str, Any]
CASES: dict[str, Callable[[dict[str, torch.Tensor]], Args]] = {
    "no mask": lambda x: {},
    "causal": lambda x: {"causal": True},
    "top-left causal": lambda x: {"mask": masks.causal(align="top_left")},
    "window left and right": lambda x: {"mask": masks.sliding_window(5, right=2)},
    "documents": lambda x: {"mask": masks.documents(DOCS)},
    "documents & causal": lambda x: {"mask": masks.documents(DOCS) & masks.causal()},
    "key_padding (whole lengths)": lambda x: {"mask": masks.key_padding([40, 13]), "causal": True},
    "from_fn": lambda x: {"mask": masks.from_fn(lambda b, h, i, j: (i + j + h) % 3 != 0)},
    "window | documents": lambda x: {"mask": masks.sliding_window(3) | masks.documents(DOCS)},
    "dense key mask & causal": lambda x: {"mask": x["pad"], "causal": True},
    "dense key mask & window": lambda x: {"mask": masks.sliding_window(6, right=2) & x["pad"]},
    "dense key mask | documents": lambda x: {"mask": x["pad"] | masks.documents(DOCS)},
    "position term, causal": lambda x: {
        "bias": RelativePositionTerm(x["qv"], x["enc"], DK**-0.5),
        "causal": True,
    },
    "position term, window": lambda x: {
        "bias": RelativePositionTerm(x["qv"], x["enc"], DK**-0.5),
        "mask": masks.sliding_window(7, right=3),
    },
    "distance bias, documents": lambda x: {
        "bias": DistanceBias(x["table"], -(T - 1)),
        "mask": masks.documents(DOCS),
    },
    "ALiBi, causal": lambda x: {"bias": alibi_term(x["slopes"], T, T), "causal": True},
    "softcap": lambda x: {"softcap": 2.0, "causal": True},
    "sinks": lambda x: {"sinks": x["sinks"], "mask": masks.sliding_window(6)},
    "return_lse": lambda x: {"return_lse": True, "causal": True, "mask": x["pad"]},
    "dropout": lambda x: {"dropout_p": 0.3, "causal": True},
    "dropout, position term": lambda x: {
        "dropout_p": 0.3,
        "bias": RelativePositionTerm(x["qv"], x["enc"], DK**-0.5),
    },
    "score_mod": lambda x: {
        "score_mod": lambda s, b, h, i, j: (
            s + 0.1 * torch.cos((i - j).to(s.dtype)) * x["slopes"][h]
        ),
        "causal": True,
    },
    "position term, softcap, sinks, documents & causal": lambda x: {
        "bias": RelativePositionTerm(x["qv"], x["enc"], DK**-0.5),
        "softcap": 3.0,
        "sinks": x["sinks"],
        "mask": masks.documents(DOCS) & masks.causal(),
    },
}
SHARDED = ("q", "k", "v", "dout", "qv")  # sharded along the sequence (dim -2)
WHOLE = ("enc", "table", "sinks", "slopes")  # every rank holds them whole


def layout_of(name: str | Layout, world: int) -> Layout:
    if isinstance(name, Layout):
        return name
    return Layout.contiguous(world) if name == "contiguous" else Layout.zigzag(world)


def compare(
    case: str,
    rank: int,
    world: int,
    layout: str | Layout,
    group: dist.ProcessGroup | None,
    dtype: torch.dtype = torch.float64,
    backend: attnkit.Backend | None = None,
    inputs: dict[str, torch.Tensor] | None = None,
    strategy: Callable[..., Any] = ring_attention,
    device: str = "cpu",
    make: Callable[[dict[str, torch.Tensor]], Args] | None = None,
    rank_seed: int = 7,
) -> tuple[str | None, dict[str, int], list[str]]:
    """Run one case on the ranks (``strategy``, or attention() with ``backend``) and in one
    process; assert they agree. Returns the kernel and the bytes this rank sent, as
    record_dispatch() saw them (the first record: the distributed call's).

    ``make``: the case's arguments, default ``CASES[case]``; ``rank_seed``: this rank's
    ``torch.manual_seed`` before its call (the process's call takes 7)."""
    lay = layout_of(layout, world)
    x = whole_inputs(dtype) if inputs is None else inputs
    x = {n: t.to(device) for n, t in x.items()}
    make = CASES[case] if make is None else make
    spec_backend = "chunked" if "dropout" in case else "reference"
    # The spec: the whole sequence in one process, in float64, on the same rounded inputs.
    whole = {n: t.double().clone().requires_grad_() for n, t in x.items() if n != "pad"}
    whole["pad"] = x["pad"]
    torch.manual_seed(7)
    want = attnkit.attention(
        whole["q"], whole["k"], whole["v"], **make(whole), backend=spec_backend
    )
    want_lse = None
    if isinstance(want, tuple):
        want, want_lse = want
    loss = (want * whole["dout"]).sum()
    if want_lse is not None:
        loss = loss + (want_lse * whole["dlse"]).sum()
    loss.backward()

    local = {n: lay.shard(x[n], rank).clone().requires_grad_() for n in SHARDED}
    local.update({n: x[n].clone().requires_grad_() for n in WHOLE})
    local["pad"] = lay.shard(x["pad"], rank, dim=-1)
    torch.manual_seed(rank_seed)
    with attnkit.record_dispatch() as record:
        if backend is None:
            got = strategy(
                local["q"], local["k"], local["v"], **make(local), layout=lay, group=group
            )
        else:
            got = attnkit.attention(
                local["q"], local["k"], local["v"], **make(local), backend=backend
            )
    got_lse = None
    if isinstance(got, tuple):
        got, got_lse = got
    loss = (got * lay.shard(x["dout"], rank)).sum()
    if got_lse is not None:
        loss = loss + (got_lse * lay.shard(x["dlse"], rank, dim=-1)).sum()
    loss.backward()

    what = f"{case}, layout={layout}, {dtype}, rank {rank} of {world}"
    pairs = [("output", got, lay.shard(want, rank))]
    if want_lse is not None:
        assert got_lse is not None
        pairs.append(("lse", got_lse, lay.shard(want_lse, rank, dim=-1)))
    for n in (*SHARDED[:3], "qv"):
        if whole[n].grad is not None:
            pairs.append((f"d{n}", local[n].grad, lay.shard(whole[n].grad, rank)))
    for n in WHOLE:
        if whole[n].grad is not None:
            share = local[n].grad
            total = torch.zeros_like(local[n]) if share is None else share.clone()
            dist.all_reduce(total, group=group)
            pairs.append((f"d{n} (summed over ranks)", total, whole[n].grad))
    for name, actual, expected in pairs:
        assert actual is not None, (what, name)
        if dtype == torch.float64:
            torch.testing.assert_close(
                actual, expected, atol=1e-10, rtol=1e-10, msg=lambda m, n=name: f"{what}, {n}: {m}"
            )
        else:
            assert actual.dtype == dtype or name == "lse", (what, name)
            assert_close(actual, expected)
    return record[0].kernel, dict(record[0].sent), [r.chosen for r in record]


def window_bytes(rank: int, world: int, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Bytes one forward and backward send, with shards of 2048 keys: a window of 256 keys, and
    packed documents that never cross a shard boundary."""
    shard = 2048
    q = torch.randn(1, 2, shard, 8)
    k, v = torch.randn(1, 1, shard, 8), torch.randn(1, 1, shard, 8)
    one_shard = k.numel() * k.element_size() + v.numel() * v.element_size()
    out: dict[str, Any] = {"one shard": one_shard}
    lengths = [500, 524] * (2 * world)  # every document inside one chunk of either layout
    for name, mask in (
        ("window 256", masks.sliding_window(256)),
        ("window 256 & causal", masks.sliding_window(256, right=100) & masks.causal()),
        ("documents in shards", masks.documents(lengths)),
        ("documents in shards & causal", masks.documents(lengths) & masks.causal()),
    ):
        for layout in ("contiguous", "zigzag"):
            local = [t.clone().requires_grad_() for t in (q, k, v)]
            with attnkit.record_dispatch() as record:
                got = ring_attention(*local, mask=mask, layout=layout, group=group)
            got.sum().backward()
            out[name, layout] = dict(record[0].sent)
    return out


def plans_made_by_the_backward(rank: int, world: int, group: dist.ProcessGroup | None) -> int:
    from attnkit._kernel import rect

    x = whole_inputs(torch.float64)
    lay = Layout.zigzag(world)
    local = [lay.shard(x[n], rank).requires_grad_() for n in ("q", "k", "v")]
    mask = masks.sliding_window(4, right=1) & lay.shard(x["pad"], rank, dim=-1)
    out = ring_attention(*local, mask=mask, layout=lay, group=group)
    made = []
    real = rect.block_plan

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return real(*args, **kwargs)

    rect.block_plan = counted  # type: ignore[assignment]
    try:
        out.backward(lay.shard(x["dout"], rank))
    finally:
        rect.block_plan = real  # type: ignore[assignment]
    return len(made)


def largest_saved_numel(rank: int, world: int, group: dist.ProcessGroup | None) -> int:
    """The largest tensor the autograd graph keeps for one causal zigzag call, in elements."""
    x = whole_inputs(torch.float64)
    local = [
        shard.clone().requires_grad_()
        for shard in (Layout.zigzag(world).shard(x[n], rank) for n in "qkv")
    ]
    sizes: list[int] = []

    def pack(saved: torch.Tensor) -> torch.Tensor:
        sizes.append(saved.numel())
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved):
        ring_attention(*local, causal=True, layout="zigzag", group=group)
    return max(sizes)


def error_message(call: Callable[[], object]) -> str:
    """The ``TypeError``/``ValueError`` a call raises, as ``'TypeName: message'``."""
    try:
        call()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("no error raised")


def bad_calls(rank: int, world: int, group: dist.ProcessGroup | None) -> dict[str, str]:
    """Calls that must fail on every rank, promptly: the messages each rank raised."""
    x = whole_inputs(torch.float64)
    q, k, v = (x[n].chunk(world, -2)[rank] for n in ("q", "k", "v"))
    uneven_q = x["q"][..., :-1, :].chunk(world, -2)[rank]  # T - 1 does not divide by W

    def ring(*args: Any, **kwargs: Any) -> object:
        return ring_attention(*args, group=group, **kwargs)

    errors = {
        "uneven": error_message(lambda: ring(uneven_q, uneven_q[:, :HKV], uneven_q[:, :HKV])),
        "one rank's bad mask": error_message(
            lambda: ring(q, k, v, mask=torch.ones(q.size(-2)) if rank == 1 else None)
        ),
        "causal differs": error_message(lambda: ring(q, k, v, causal=rank == 0)),
        "odd zigzag": error_message(
            lambda: ring(q[..., 1:, :], k[..., 1:, :], v[..., 1:, :], layout="zigzag")
        ),
        "query mask": error_message(
            lambda: ring(q, k, v, mask=torch.ones(q.size(-2), k.size(-2), dtype=torch.bool))
        ),
        "dense bias": error_message(
            lambda: ring(q, k, v, bias=torch.zeros(q.size(-2), k.size(-2), dtype=q.dtype))
        ),
        "documents of a shard": error_message(
            lambda: ring(q, k, v, mask=masks.documents([q.size(-2)]))
        ),
        "layout of another world": error_message(
            lambda: ring(q, k, v, layout=Layout.contiguous(world + 1))
        ),
        "openspeech term": error_message(
            lambda: ring(q, k, v, bias=RelativePositionTerm(x["qv"], x["enc"], 1.0, legacy=True))
        ),
        "qv of the whole sequence": error_message(
            lambda: ring(q, k, v, bias=RelativePositionTerm(x["qv"], x["enc"], 1.0))
        ),
    }
    # Nothing was left in flight: the ranks still work together after every rank raised.
    compare("causal", rank, world, "contiguous", group)
    return errors


def world_checks(rank: int, world: int, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Every check of one group of ``world`` ranks."""
    report: dict[str, Any] = {"kernels": {}, "sent": {}}
    for layout in ("contiguous", "zigzag"):
        for case in CASES:
            kernel, sent, _ = compare(case, rank, world, layout, group)
            report["kernels"][layout, case] = kernel
            report["sent"][layout, case] = sent
    # Packed documents on the layout that evens their work, through both strategies.
    balanced = balance_documents(DOCS, world, causal=True, chunks_per_rank=2)
    for strategy in (ring_attention, ulysses_attention):
        compare("documents & causal", rank, world, balanced, group, strategy=strategy)
    # float32, within attnkit.testing's tolerances of the float64 call.
    for case in ("dense key mask & causal", "position term, window", "sinks"):
        compare(case, rank, world, "zigzag", group, dtype=torch.float32)
    # The eager kernel on every pair (blocks that cut the shards unevenly, torch's fused kernel on
    # fully visible stretches), through attention() with the backend object.
    for layout in ("contiguous", "zigzag"):
        eager = RingBackend(layout=layout, group=group, native=False, block_q=4, block_k=3)
        for case in ("dense key mask & window", "causal", "position term, causal"):
            kernel, _, _ = compare(case, rank, world, layout, group, backend=eager)
            report["kernels"][layout, case, "eager"] = kernel
    # A NaN among the values of a key the mask hides, on one rank: every rank runs the eager
    # kernel's careful mode, as one process does.
    x = whole_inputs(torch.float64)
    x["v"][0, 0, -1, 0] = float("nan")  # batch row 0's last key is padding
    kernel, _, _ = compare("dense key mask & causal", rank, world, "contiguous", group, inputs=x)
    report["kernels"]["non-finite"] = kernel
    from .test_ulysses import ulysses_checks  # the all-to-all's checks share this run

    report["ulysses"] = ulysses_checks(rank, world, group)
    report["bytes"] = window_bytes(rank, world, group)
    report["backward plans"] = plans_made_by_the_backward(rank, world, group)
    ring = RingBackend(group=group)
    q = torch.zeros(1, H, T // world, DK)
    said = attnkit.explain(q, q, q, mask=masks.sliding_window(3), backend=ring)
    report["notes"] = ring.notes(said.call)
    report["saved"] = largest_saved_numel(rank, world, group)
    jaxtyping.config.update("jaxtyping_disable", True)  # attnkit's own checks, on every rank
    try:
        report["errors"] = bad_calls(rank, world, group)
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
    return report


def all_checks(rank: int, world: int) -> dict[int, dict[str, Any]]:
    """Two groups of 2 side by side, then 3 ranks, then all 4 (every rank creates every group)."""
    assert world == 4
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    three = dist.new_group([0, 1, 2])
    report = {2: world_checks(rank % 2, 2, pairs[rank // 2])}
    report[2]["long and seeded"] = long_and_seeded_checks(rank % 2, 2, pairs[rank // 2])
    if rank < 3:
        report[3] = world_checks(rank, 3, three)
    report[4] = world_checks(rank, 4, None)
    return report


def nccl_checks(rank: int, world: int) -> None:
    """A few cases of each strategy on GPUs (the eager kernel there), nccl between the ranks."""
    for layout in ("contiguous", "zigzag"):
        for case in (
            "dense key mask & window",
            "position term, softcap, sinks, documents & causal",
        ):
            for strategy in (ring_attention, ulysses_attention):
                compare(case, rank, world, layout, None, strategy=strategy, device=f"cuda:{rank}")
        compare("dropout", rank, world, layout, None, device=f"cuda:{rank}")


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="nccl runs one rank per GPU: needs 2 GPUs",
)
def test_ring_and_all_to_all_run_on_nccl() -> None:
    run_ranks(nccl_checks, 2, backend="nccl", timeout=600)


@functools.cache
def reports() -> list[dict[int, dict[str, Any]]]:
    # Ranks outside the group of 3 wait for it in the next collective: a generous timeout.
    return run_ranks(all_checks, 4, timeout=600, group_timeout=300)


def ranks_of(world: int) -> list[dict[str, Any]]:
    """The reports of one group of ``world`` ranks (for 2: both groups of 2)."""
    return [r[world] for r in reports() if world in r]


WORLDS = pytest.mark.parametrize("world", [2, 3, 4])


@WORLDS
def test_every_case_equals_one_process(world: int) -> None:
    # Each case asserted in each rank (output, lse, gradients of q, k, v, qv, and the summed
    # shares of encodings, tables, sinks, captured tensors); a failure there fails the run.
    got = ranks_of(world)
    assert len(got) == (4 if world == 2 else world)
    for report in got:
        assert len(report["kernels"]) == 2 * len(CASES) + 6 + 1


@WORLDS
def test_each_rank_runs_the_native_operator_where_one_process_would(world: int) -> None:
    for report in ranks_of(world):
        kernels = report["kernels"]
        for (layout, case), kernel in ((k, v) for k, v in kernels.items() if len(k) == 2):
            if "dropout" in case:
                assert kernel.startswith("the eager kernel (dropout across ranks"), case
            elif case == "score_mod":
                assert "does not fuse a score_mod" in kernel, case
            else:
                assert kernel == "native kernel", (layout, case, kernel)
        assert (
            kernels["contiguous", "causal", "eager"]
            == "the eager kernel (RingBackend(native=False))"
        )
        assert kernels["non-finite"] == "the eager kernel (non-finite values in q/k/v)"


@WORLDS
def test_ranks_send_only_the_keys_their_queries_meet(world: int) -> None:
    for report in ranks_of(world):
        sent = report["sent"]
        shard_kv = B * HKV * (T // world) * (DK + DV) * 8  # one shard's k and v, float64
        # Every rank's keys meet every other rank's queries: each sends its shard W - 1 times.
        assert sent["contiguous", "no mask"]["forward"] == (world - 1) * shard_kv
        bytes_ = report["bytes"]
        one = bytes_["one shard"]
        for layout in ("contiguous", "zigzag"):
            for window in ("window 256", "window 256 & causal"):
                assert bytes_[window, layout]["forward"] <= 1.1 * one, (window, layout)
            for docs in ("documents in shards", "documents in shards & causal"):
                assert bytes_[docs, layout] == {"forward": 0, "backward": 0}, (docs, layout)


def test_a_window_sends_a_shards_last_keys_to_one_neighbour() -> None:
    # Contiguous shards of 2048 keys, a window of 256: each rank but the last sends its last 256
    # keys, k and v, to the next rank. Zigzag shards hold two chunks of 1024: each chunk sends its
    # last 256 keys to the rank of the next chunk, but the sequence's last chunk (rank 0's) and
    # the one before the middle (rank W-1's, whose next chunk it holds itself).
    got = ranks_of(4)
    one = got[0]["bytes"]["one shard"]
    sent = [r["bytes"]["window 256", "contiguous"]["forward"] for r in got]
    assert sent == [one * 256 // 2048] * 3 + [0]
    sent = [r["bytes"]["window 256", "zigzag"]["forward"] for r in got]
    assert sent == [one * 256 // 2048, one * 512 // 2048, one * 512 // 2048, one * 256 // 2048]


@WORLDS
def test_explain_with_the_ring_backend_says_the_shard_plan(world: int) -> None:
    for report in ranks_of(world):
        chunk = T // world
        assert report["notes"] == [
            f"shard plan: {world} ranks, {world} chunks of {chunk} queries and {chunk} keys "
            "(contiguous)",
            f"shard plan: {world - 1} of {world * (world - 1)} pairs of ranks meet, in 1 step "
            f"(distance 1); keys sent per rank: {', '.join([str(chunk)] * (world - 1) + ['0'])}",
        ]


@WORLDS
def test_the_backward_reuses_the_forwards_plans(world: int) -> None:
    assert all(r["backward plans"] == 0 for r in ranks_of(world))


@WORLDS
def test_autograd_keeps_only_this_ranks_shard(world: int) -> None:
    local = B * H * (T // world) * DK  # one rank's q; the whole sequence's is W times larger
    assert all(r["saved"] <= local for r in ranks_of(world))


@WORLDS
def test_bad_arguments_raise_on_every_rank_instead_of_hanging(world: int) -> None:
    for r, report in enumerate(ranks_of(world)):
        r %= world
        e = report["errors"]
        assert e["uneven"].startswith("ValueError: ring_attention needs the same q shape")
        assert "does not divide evenly" in e["uneven"]
        assert e["causal differs"].startswith("ValueError: ring_attention needs the same mask")
        assert "rank 0: 'causal()'" in e["causal differs"]
        assert "must divide by 2, got Tq=" in e["odd zigzag"]
        assert "a dense mask" in e["query mask"]
        assert "depends on the query" in e["query mask"]
        assert "a dense bias" in e["dense bias"]
        assert (
            f"covers {T // world} positions but the call has Tk = {T} keys"
            in (e["documents of a shard"])
        )
        assert (
            f"the layout has {world + 1} ranks but the group has {world}"
            in (e["layout of another world"])
        )
        assert "openspeech's position term" in e["openspeech term"]
        assert "must be this rank's rows of the position queries" in e["qv of the whole sequence"]
        bad_mask = e["one rank's bad mask"]
        if r == 1:
            assert bad_mask.startswith("TypeError: mask must be a bool tensor, got float32")
        else:
            assert re.match(
                r"ValueError: ring_attention: rank 1 rejected its arguments, so none ran: "
                r"mask must be a bool tensor, got float32",
                bad_mask,
            )


def test_no_process_group_is_a_clear_error() -> None:
    assert not dist.is_initialized()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match=r"needs an initialised process group: call "):
        ring_attention(q, q, q)


def test_importing_attnkit_needs_no_process_group() -> None:
    assert attnkit.distributed.ring_attention is ring_attention
    assert not dist.is_initialized()


# --------------------------------------------------------------------------------------------------
# Shards longer than the stretch of keys the plan sends, and ranks seeded apart: checks of the
# groups of 2 ranks in the run above that report their failures (None: it agreed), read by the
# tests below.

LONG_T = 4 * 96  # on 2 ranks: contiguous shards of 192 keys, zigzag chunks of 96


@functools.cache
def long_valid() -> torch.Tensor:
    """key_padding(valid=...) of the whole sequence: (B, LONG_T), True = a real key."""
    return torch.rand(B, LONG_T, generator=torch.Generator().manual_seed(12)) < 0.8


def long_inputs() -> dict[str, torch.Tensor]:
    """:func:`whole_inputs` of LONG_T positions, ``pad`` a key mask that varies key by key."""
    x = whole_inputs(torch.float64, seed=3, kv_len=LONG_T, q_len=LONG_T)
    x["pad"] = torch.rand(B, 1, 1, LONG_T, generator=torch.Generator().manual_seed(13)) < 0.7
    return x


# Windows whose queries see a neighbour's last keys: a stretch that starts inside its shard (and
# inside a zigzag chunk: a left reach under 96 - 64 keys), with a key mask that differs there from
# the shard's first keys.
LONG_CASES: dict[str, Callable[[dict[str, torch.Tensor]], Args]] = {
    "window & key mask": lambda x: {"mask": masks.sliding_window(20, right=10) & x["pad"]},
    "causal window & key mask & key_padding(valid)": lambda x: {
        "mask": masks.sliding_window(25)
        & masks.causal()
        & x["pad"]
        & masks.key_padding(valid=long_valid()),
        "return_lse": True,
    },
    "window & key_padding(valid)": lambda x: {
        "mask": masks.sliding_window(20, right=10) & masks.key_padding(valid=long_valid())
    },
    "position term, window & key mask": lambda x: {
        "bias": RelativePositionTerm(x["qv"], x["enc"], DK**-0.5),
        "mask": masks.sliding_window(30, right=20) & x["pad"],
    },
}

# The cases of CASES that drop out.
DROPOUT = ("dropout", "dropout, position term")


def failure_of(check: Callable[..., object], *args: Any, **kwargs: Any) -> str | None:
    """None when ``check(*args, **kwargs)`` passes, else its assertion's message."""
    try:
        check(*args, **kwargs)
    except AssertionError as e:
        return str(e)[:2000]
    return None


def long_and_seeded_checks(
    rank: int, world: int, group: dist.ProcessGroup | None
) -> dict[tuple[str, ...], str | None]:
    report: dict[tuple[str, ...], str | None] = {}
    x = long_inputs()
    for layout in ("contiguous", "zigzag"):
        for case, make in LONG_CASES.items():
            report["long", layout, case, "ring_attention"] = failure_of(
                compare, case, rank, world, layout, group, inputs=x, make=make
            )
        eager = RingBackend(layout=layout, group=group, native=False, block_q=16, block_k=24)
        case = "window & key mask"
        report["long", layout, case, "eager"] = failure_of(
            compare,
            case,
            rank,
            world,
            layout,
            group,
            inputs=x,
            make=LONG_CASES[case],
            backend=eager,
        )
    # Each rank seeded its own way: the seed is rank 0's, the result one process's under it.
    from .test_ulysses import seeded_apart_checks

    seed = 7 + 1000 * rank
    for layout in ("contiguous", "zigzag"):
        for case in DROPOUT:
            report["seeded apart", layout, case] = failure_of(
                compare, case, rank, world, layout, group, rank_seed=seed
            )
    report.update(seeded_apart_checks(rank, world, group, seed))
    return report


def long_and_seeded() -> list[dict[tuple[str, ...], str | None]]:
    """The reports of :func:`long_and_seeded_checks`, of each rank of both groups of 2."""
    return [r["long and seeded"] for r in ranks_of(2)]


def test_the_plan_sends_stretches_that_start_inside_a_shard() -> None:
    # What the long cases rely on: a rank receives the last keys of a longer shard, a stretch
    # that starts inside it (the keys seen, rounded out to UNIT keys of a chunk).
    from attnkit.distributed.plan import UNIT, ShardPlan

    assert LONG_T // 4 > UNIT
    geo = masks.Geometry((B,), H, LONG_T, LONG_T, torch.device("cpu"))
    for layout, starts in ((Layout.contiguous(2), [128, 0]), (Layout.zigzag(2), [64, 0])):
        for mask in (masks.sliding_window(20, right=10), masks.sliding_window(30, right=20)):
            plan = ShardPlan(mask, geo, layout)
            sends = [st.send for r in range(2) for st in plan.steps(r)]
            assert [None if s is None else s[0] for s in sends] == starts, (layout, sends)


@pytest.mark.parametrize("case", list(LONG_CASES))
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shards_longer_than_a_sent_stretch_equal_one_process(layout: str, case: str) -> None:
    # Output, lse and gradients on each rank against attention() on the whole sequence: the keys,
    # values and key mask a neighbour sends are its shard's last ones, a stretch inside it.
    for r, report in enumerate(long_and_seeded()):
        assert report["long", layout, case, "ring_attention"] is None, f"rank {r % 2}"
        if ("long", layout, case, "eager") in report:
            assert report["long", layout, case, "eager"] is None, f"rank {r % 2}"


@pytest.mark.parametrize("case", DROPOUT)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_dropout_on_ranks_seeded_apart_equals_one_process_under_rank_0s_seed(
    layout: str, case: str
) -> None:
    for r, report in enumerate(long_and_seeded()):
        assert report["seeded apart", layout, case] is None, f"rank {r % 2}"
