"""The block plan: it visits exactly the blocks that hold a visible pair, and no others."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from attnkit import masks
from attnkit._kernel import Plan, Run, make_plan, restrict, split_runs
from attnkit._kernel.plan import STRETCH_ROWS, query_stretch
from attnkit.masks import Geometry

from ..strategies import structured_masks


@given(
    shape=st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(0, 17), st.integers(0, 17)),
    block=st.tuples(st.integers(1, 6), st.integers(1, 6)),
    start=st.tuples(st.integers(0, 5), st.integers(0, 5)),
    data=st.data(),
)
def test_plan_visits_the_blocks_with_a_visible_pair(
    shape: tuple[int, int, int, int],
    block: tuple[int, int],
    start: tuple[int, int],
    data: st.DataObject,
) -> None:
    # The plan of a piece of a call (as ring attention asks: queries and keys starting at some
    # global position) against the dense mask: a block is visited iff it holds a visible pair
    # (with two exceptions, below),
    # marked full only if it holds no hidden one (partial is always safe), and its rows cover
    # every row that sees it.
    b, h, tq, tk = shape
    s = data.draw(structured_masks(b, h, tq, tk))
    geo = Geometry((b,), h, tq, tk, torch.device("cpu"))
    q0, k0 = min(start[0], tq), min(start[1], tk)
    plan = make_plan(
        s.mask,
        geo,
        q_start=q0,
        q_len=tq - q0,
        k_start=k0,
        kv_len=tk - k0,
        block_q=block[0],
        block_k=block[1],
    )
    dense = s.dense[:, :, q0:, k0:].flatten(0, 1).any(0)  # (rows, keys): visible for anyone
    hidden = ~s.dense[:, :, q0:, k0:].flatten(0, 1).all(0)
    seen = set()
    for qb in plan.blocks:
        for v in qb.visits:
            seen.add((qb.qs, v.ks))
            tile = dense[qb.qs : qb.qe, v.ks : v.ke]
            # Two cases may visit a block without a visible pair, with a mask tile (safe): an AND
            # of two partial blocks (each part sees pairs the other hides) and document ids out
            # of order (a block's range of ids can hold an id it lacks). Nothing else may.
            loose = "&" in s.label or "ids" in s.label
            assert tile.any() or (v.partial and loose), (s.label, qb.qs, v.ks)
            if not v.partial:
                assert not hidden[qb.qs : qb.qe, v.ks : v.ke].any(), (s.label, qb.qs, v.ks)
            rows = tile.any(-1).nonzero().flatten().tolist()
            assert all(v.r0 <= r < v.r1 for r in rows), (s.label, rows, v.r0, v.r1)
    for qs in range(0, tq - q0, block[0]):
        for ks in range(0, tk - k0, block[1]):
            if dense[qs : qs + block[0], ks : ks + block[1]].any():
                assert (qs, ks) in seen, (s.label, qs, ks)


def test_documents_plan_with_keys_that_do_not_fill_their_last_block() -> None:
    # Key ids padded out to whole blocks must not widen the range of ids a block holds: a query
    # block of document 0 never visits a key block that holds only document 1.
    from attnkit.masks import documents

    geo = Geometry((1,), 1, 2, 2, torch.device("cpu"))
    plan = make_plan(
        documents([1, 1]), geo, q_start=0, q_len=2, k_start=1, kv_len=1, block_q=1, block_k=2
    )
    assert [len(qb.visits) for qb in plan.blocks] == [0, 1]
    assert not plan.blocks[1].visits[0].partial


def pairs(qs: int, qe: int, ks: int, ke: int) -> set[tuple[int, int]]:
    return {(i, j) for i in range(qs, qe) for j in range(ks, ke)}


@given(
    shape=st.tuples(st.integers(1, 2), st.integers(0, 24), st.integers(0, 24)),
    block=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    min_rows=st.integers(1, 12),
    data=st.data(),
)
def test_runs_take_fully_visible_work_exactly_once(
    shape: tuple[int, int, int],
    block: tuple[int, int],
    min_rows: int,
    data: st.DataObject,
) -> None:
    # What the runs take plus what the blocks keep is what the plan visits, each pair once; a run
    # takes only pairs of FULL blocks, is at least min_rows tall, and every block it covers is
    # marked fused (their results are merged with the run's, not written over it).
    b, tq, tk = shape
    s = data.draw(structured_masks(b, 1, tq, tk))
    geo = Geometry((b,), 1, tq, tk, torch.device("cpu"))
    plan = make_plan(
        s.mask, geo, q_start=0, q_len=tq, k_start=0, kv_len=tk, block_q=block[0], block_k=block[1]
    )
    runs, blocks = split_runs(plan, min_rows)
    full: set[tuple[int, int]] = set()
    visited: set[tuple[int, int]] = set()
    for qb in plan.blocks:
        for v in qb.visits:
            p = pairs(qb.qs + v.r0, qb.qs + v.r1, v.ks, v.ke)
            visited |= p
            if not v.partial and (v.r0, v.r1) == (0, qb.qe - qb.qs):
                full |= p
    taken: set[tuple[int, int]] = set()
    for run in runs:
        assert run.qe - run.qs >= min_rows
        p = pairs(run.qs, run.qe, run.ks, run.ke)
        assert p <= full, (s.label, run)
        assert not p & taken, (s.label, run)
        taken |= p
    kept: set[tuple[int, int]] = set()
    for qb, left in zip(plan.blocks, blocks, strict=True):
        assert (left.qs, left.qe) == (qb.qs, qb.qe)
        assert left.fused == any(r.qs <= qb.qs and qb.qe <= r.qe for r in runs)
        assert set(left.visits) <= set(qb.visits)
        for v in left.visits:
            kept |= pairs(qb.qs + v.r0, qb.qs + v.r1, v.ks, v.ke)
    assert not taken & kept
    assert taken | kept == visited


def runs_of(mask: object, t: int, block: int, min_rows: int) -> tuple[Run, ...]:
    from attnkit import masks

    geo = Geometry((1,), 1, t, t, torch.device("cpu"))
    m = None if mask is None else getattr(masks, str(mask))()
    plan: Plan = make_plan(
        m, geo, q_start=0, q_len=t, k_start=0, kv_len=t, block_q=block, block_k=block
    )
    return split_runs(plan, min_rows)[0]


def test_runs_of_a_plain_call_and_a_causal_one() -> None:
    # No mask: every block the same stretch, one run over everything.
    assert runs_of(None, 64, 8, 16) == (Run(0, 64, 0, 64),)
    assert runs_of(None, 64, 8, 100) == ()  # too short for min_rows
    # Causal, blocks of 8: block i sees keys 0..8i fully. Blocks pair up until they hold 16
    # queries, over the keys both see fully (block 0 has none: its only block is the diagonal).
    assert runs_of("causal", 48, 8, 16) == (
        Run(8, 24, 0, 8),
        Run(24, 40, 0, 24),
    )


@given(
    shape=st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(0, 17), st.integers(1, 17)),
    block=st.tuples(st.integers(1, 6), st.integers(1, 6)),
    cut=st.tuples(st.integers(0, 4), st.integers(1, 4)),
    data=st.data(),
)
def test_a_restricted_plan_is_the_plan_of_its_keys(
    shape: tuple[int, int, int, int],
    block: tuple[int, int],
    cut: tuple[int, int],
    data: st.DataObject,
) -> None:
    # Ring attention's backward cuts its plans from the forward's: what make_plan says for keys
    # ks:ke of the call (cut on the block grid, ke possibly the last key).
    b, h, tq, tk = shape
    s = data.draw(structured_masks(b, h, tq, tk))
    geo = Geometry((b,), h, tq, tk, torch.device("cpu"))
    bq, bk = block
    ks = min(cut[0] * bk, (tk - 1) // bk * bk)
    ke = min(ks + cut[1] * bk, tk)

    def plan(k_start: int, kv_len: int) -> Plan:
        return make_plan(
            s.mask, geo, q_start=0, q_len=tq, k_start=k_start, kv_len=kv_len, block_q=bq, block_k=bk
        )

    assert restrict(plan(0, tk), ks, ke) == plan(ks, ke - ks), s.label


def test_query_ordering_takes_stretches_of_a_long_narrow_band_only() -> None:
    # Under a band finite on both sides, stretches of query blocks of about STRETCH_ROWS rows over
    # every batch row and head; in one stretch (0) when the call is that short, or its mask
    # reaches back or forth without end (each head then reuses all of its keys).
    def stretch(mask: masks.Mask | None, b: int, h: int, t: int, block_q: int = 128) -> int:
        return query_stretch(mask, Geometry((b,), h, t, t, torch.device("cpu")), block_q)

    window = masks.sliding_window(128, 128)
    assert stretch(window, 1, 4, 90_000) == STRETCH_ROWS // (128 * 4)
    assert stretch(window, 2, 8, 90_000) == max(1, STRETCH_ROWS // (128 * 16))
    assert stretch(window & masks.key_padding([90_000]), 1, 4, 90_000) > 0
    assert stretch(window, 1, 4, STRETCH_ROWS // 4) == 0  # one stretch holds every block
    for mask in (None, masks.causal(), masks.key_padding([90_000])):
        assert stretch(mask, 1, 4, 90_000) == 0
