"""The native kernel's cut of a grid plan: its visits cover every visible pair once, its FULL
visits hold only visible pairs, and a partial visit's mask is in the cheapest exact form."""

from __future__ import annotations

import pytest
import torch

from attnkit import masks
from attnkit._kernel import make_plan
from attnkit._kernel.native_plan import native_visits
from attnkit.masks import Geometry, Mask

T = 70
MASKS: dict[str, Mask] = {
    "causal": masks.causal(),
    "window": masks.sliding_window(9, 3),
    "documents": masks.documents([20, 35, 15]),
    "documents & causal": masks.documents([20, 35, 15]) & masks.causal(),
    "padding & causal": masks.key_padding([70, 41]) & masks.causal(),
    "function": masks.from_fn(lambda b, h, i, j: (i + j) % 3 != 0),
}
FORMS = {
    "causal": "band",
    "window": "band",
    "documents": "none",
    "documents & causal": "band",
    "padding & causal": "band and key flags",
    "function": "tiles",
}


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("rect", [(0, T, 0, T), (16, 30, 8, 50)])
def test_the_visits_cover_each_visible_pair_once(name: str, rect: tuple[int, ...]) -> None:
    mask = MASKS[name]
    geo = Geometry((2,), 2, T, T, torch.device("cpu"))
    q0, nq, k0, nk = rect
    grid = make_plan(mask, geo, q_start=q0, q_len=nq, k_start=k0, kv_len=nk, block_q=8, block_k=16)
    cut = native_visits(mask, geo, grid, (q0, nq, k0, nk))
    dense = mask.dense(T, T, batch_size=2, num_heads=2)[..., q0 : q0 + nq, k0 : k0 + nk]
    some, every = dense.flatten(0, 1).any(0), dense.flatten(0, 1).all(0)
    visited = torch.zeros(nq, nk, dtype=torch.int64)
    for b, qb in enumerate(grid.blocks):
        for ks, ke, r0, r1, partial, _ in cut.rows[cut.offsets[b] : cut.offsets[b + 1]]:
            visited[qb.qs + r0 : qb.qs + r1, ks:ke] += 1
            if not partial:  # no mask work: every pair of the visit is visible
                assert every[qb.qs + r0 : qb.qs + r1, ks:ke].all()
    assert not (some & (visited == 0)).any()  # every visible pair is visited
    assert visited.max() <= 1  # and once
    assert cut.shift == geo.shift + q0 - k0
    form = [
        *(["band"] if cut.band is not None else []),
        *(["key flags"] if cut.key_ok is not None else []),
        *(["tiles"] if cut.tiles is not None else []),
    ]
    assert (" and ".join(form) or "none") == FORMS[name]


def test_a_band_is_cut_at_its_edges_not_at_key_blocks() -> None:
    # A window of 9 keys in blocks of 64: a row sees at most 13 keys, and the visits hold few
    # more pairs than the band (a grid visit would hold 64 keys per row).
    mask = masks.sliding_window(9, 3)
    geo = Geometry((1,), 1, 256, 256, torch.device("cpu"))
    grid = make_plan(mask, geo, q_start=0, q_len=256, k_start=0, kv_len=256, block_q=64, block_k=64)
    cut = native_visits(mask, geo, grid, (0, 256, 0, 256))
    pairs = sum((r1 - r0) * (ke - ks) for ks, ke, r0, r1, _, _ in cut.rows)
    visible = int(mask.dense(256, 256).sum())
    assert visible <= pairs < 4 * visible
    grid_pairs = sum((v.r1 - v.r0) * (v.ke - v.ks) for qb in grid.blocks for v in qb.visits)
    assert pairs < 0.7 * grid_pairs
