"""FlexAttention's BlockMask made from attnkit's block plan: for every mask kind it equals the one
torch's create_block_mask builds by evaluating the mask_mod (the block counts, the indices and the
full blocks), and it is made once per plan."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask

from attnkit import masks
from attnkit.backends.flex.block_mask import block_mask, plan_of
from attnkit.backends.flex.mask_mod import lower_mask

from .helpers import B, H, catalogue

BLOCK = 16
SIZES = [(64, 64), (32, 64), (64, 40)]
# The masks whose visibility depends on the batch row or the head: a plan describes all rows and
# heads at once (a block is FULL where it is for every row and head, EMPTY where it is for none).
PER_ROW = {
    "documents per row, causal",
    "key padding by lengths",
    "key padding on the left",
    "key padding by a tensor",
    "window | key padding",
    "dense per head",
    "dense ~ and a window",
    "dense keys",
    "key indices per row and key head",
    "block indices per query head | window",
}


def _blocks(num: Tensor, idx: Tensor, nk: int) -> Tensor:
    """``(..., nq, nk)`` bool: the blocks the tables list."""
    listed = torch.arange(nk) < num.unsqueeze(-1)  # (..., nq, nk) by position in the list
    out = torch.zeros(*idx.shape[:-1], nk, dtype=torch.bool)
    return out.scatter(-1, idx.long(), listed) | out


def _lowered(kind: str, tq: int, tk: int) -> tuple[masks.Mask, object, masks.Geometry]:
    made = catalogue(tq, tk)[kind]()
    mask = made if isinstance(made, masks.Mask) else masks.visibility(made, False)
    assert mask is not None
    geo = masks.Geometry((B,), H, tq, tk, torch.device("cpu"))
    return mask, lower_mask(mask, geo), geo


@pytest.mark.parametrize(("tq", "tk"), SIZES)
@pytest.mark.parametrize("kind", list(catalogue(64, 64)))
def test_the_block_mask_is_create_block_masks(kind: str, tq: int, tk: int) -> None:
    mask, mod, geo = _lowered(kind, tq, tk)
    ours = block_mask(mask, geo, mod, block=(BLOCK, BLOCK))  # type: ignore[arg-type]
    assert ours.mask_mod is mod
    assert ours.BLOCK_SIZE == (BLOCK, BLOCK)
    assert ours.seq_lengths == (tq, tk)
    if kind not in PER_ROW:
        want = create_block_mask(mod, None, None, tq, tk, device="cpu", BLOCK_SIZE=BLOCK)  # type: ignore[arg-type]
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            torch.testing.assert_close(getattr(ours, name), getattr(want, name), msg=name)
        return
    # per row and head: ours lists a block as FULL where torch's is full in every row and head,
    # and as listed at all where it is listed in some
    want = create_block_mask(mod, B, H, tq, tk, device="cpu", BLOCK_SIZE=BLOCK)  # type: ignore[arg-type]
    nk = want.kv_indices.size(-1)
    w_full = _blocks(want.full_kv_num_blocks, want.full_kv_indices, nk)
    w_any = w_full | _blocks(want.kv_num_blocks, want.kv_indices, nk)
    o_full = _blocks(ours.full_kv_num_blocks, ours.full_kv_indices, nk)[0, 0]
    o_any = o_full | _blocks(ours.kv_num_blocks, ours.kv_indices, nk)[0, 0]
    torch.testing.assert_close(o_full, w_full.all(0).all(0))
    torch.testing.assert_close(o_any, w_any.any(0).any(0))


def test_one_block_mask_per_plan() -> None:
    # Two calls like each other (causal() twice: one plan) share the tables; each has its own
    # mask_mod, which reads its own call's tensors.
    geo = masks.Geometry((B,), H, 64, 64, torch.device("cpu"))
    first_mod = lower_mask(masks.causal(), geo)
    second_mod = lower_mask(masks.causal(), geo)
    first = block_mask(masks.causal(), geo, first_mod, block=(BLOCK, BLOCK))
    second = block_mask(masks.causal(), geo, second_mod, block=(BLOCK, BLOCK))
    assert first.kv_indices is second.kv_indices
    assert first.q_indices is second.q_indices
    assert first.mask_mod is first_mod
    assert second.mask_mod is second_mod
    other = block_mask(masks.sliding_window(3), geo, first_mod, block=(BLOCK, BLOCK))
    assert other.kv_indices is not first.kv_indices


_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu")


def test_the_block_mask_reads_nothing_back_from_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # The plan is asked of the mask once (one read, kept for calls like it); the BlockMask is
    # written from the plan's visits, which are on the host already: no read of any tensor.
    reads: list[str] = []
    for t in (256, 4096):
        geo = masks.Geometry((1,), 2, t, t, torch.device("cpu"))
        mask = masks.sliding_window(200) & masks.key_padding([t - 7])
        plan_of(mask, geo, 1, (128, 128))  # the plan, as a call like it would have made it
        mod = lower_mask(mask, geo)
        for name in _READS:
            original = getattr(torch.Tensor, name)

            def read(self: Tensor, *a: object, _name: str = name, _f: object = original) -> object:
                reads.append(_name)
                return _f(self, *a)  # type: ignore[operator]

            monkeypatch.setattr(torch.Tensor, name, read)
        made = block_mask(mask, geo, mod)
        monkeypatch.undo()
        assert made.kv_num_blocks.shape == (1, 1, t // 128)
    assert reads == []
