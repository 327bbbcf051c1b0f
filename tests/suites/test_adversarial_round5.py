"""Index masks, latent attention and quantized caches given what an outside reviewer would try:
each answer compared with the float64 formula written out here, never with shapes alone."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import attnkit
from attnkit import masks

F64 = torch.float64


def selection(indices: Tensor, kv_len: int, heads: int, block: int = 1) -> Tensor:
    """``(B|1, H, Tq, Tk)`` bool: True where a query's entries (``-1``: none) name the key, entry
    ``x`` naming keys ``x * block`` to ``x * block + block - 1``; selection head ``h // (H /
    Hi)`` for query head ``h``."""
    rows, hi, q_len, _ = indices.shape
    allowed = torch.zeros(rows, hi, q_len, kv_len, dtype=torch.bool)
    for b in range(rows):
        for h in range(hi):
            for i in range(q_len):
                for x in indices[b, h, i].tolist():
                    if x >= 0:
                        allowed[b, h, i, x * block : min(x * block + block, kv_len)] = True
    return allowed.repeat_interleave(heads // hi, dim=1)


def formula(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
    """Attention in float64 with ``allowed`` (True = may attend), grouped heads repeated; a query
    with no key gives 0."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))).masked_fill(~allowed, -math.inf)
    w = torch.softmax(s, -1).nan_to_num(0.0)
    return w @ v


@pytest.mark.parametrize("backend", ["reference", "chunked", "flex", "auto"])
def test_indices_joined_by_or_are_read_again_after_an_in_place_change(backend: str) -> None:
    # `key_indices(a) | key_indices(b)` is one index mask listing both selections; it was made
    # as a copy of a and b (torch.cat) when the mask was built, so a selection changed in place
    # afterwards (a decode loop refilling its index buffer) was never read: every later call
    # attended the first selection, silently. A single index mask reads its tensor anew.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 8, generator=g) for n in (5, 12, 12))
    k, v = k[:, :2], v[:, :2]
    a = torch.randint(-1, 12, (2, 2, 5, 3), generator=g)
    b = torch.randint(-1, 12, (1, 1, 5, 2), generator=g).to(torch.int32)
    c = torch.randint(-1, 3, (1, 2, 5, 1), generator=g)
    both = masks.key_indices(a) | masks.key_indices(b)
    assert isinstance(both, masks.KeyIndices)  # one selection, as the docs say
    mask = both | masks.block_indices(c, block=4)  # (another block size: not joined)
    for step in range(3):
        got = attnkit.attention(q, k, v, mask=mask, backend=backend)
        allowed = selection(a, 12, 4) | selection(b, 12, 4)
        want = formula(q, k, v, allowed | selection(c, 12, 4, block=4))
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        # the buffers refilled in place, as a decode loop's indexer writes its picks
        a.copy_(torch.randint(-1, 12, a.shape, generator=g))
        b[..., step % 2] = -1
        c.fill_(step)


def test_a_joined_selection_pickled_or_copied_reads_its_own_tensors() -> None:
    import copy
    import pickle

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (3, 9, 9))
    a = torch.tensor([[[[0], [4], [8]]]])
    b = torch.tensor([[[[1], [1], [-1]]]])
    mask = masks.key_indices(a) | masks.key_indices(b)
    for other in (copy.deepcopy(mask), pickle.loads(pickle.dumps(mask))):
        a.fill_(2)  # the original's tensors change; the copy's do not
        got = attnkit.attention(q, k, v, mask=other, backend="chunked")
        allowed = selection(torch.tensor([[[[0], [4], [8]]]]), 9, 2) | selection(b, 9, 2)
        torch.testing.assert_close(got.double(), formula(q, k, v, allowed), atol=1e-5, rtol=1e-5)
        got = attnkit.attention(q, k, v, mask=mask, backend="chunked")
        allowed = selection(a, 9, 2) | selection(b, 9, 2)
        torch.testing.assert_close(got.double(), formula(q, k, v, allowed), atol=1e-5, rtol=1e-5)
        a.copy_(torch.tensor([[[[0], [4], [8]]]]))


def test_a_joined_selection_given_to_a_compiled_call_is_read_as_it_holds_now() -> None:
    # The mask object as an input of a compiled call: each run reads the selections' tensors.
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    a = torch.randint(-1, 6, (1, 1, 6, 2), generator=g)
    b = torch.randint(-1, 6, (1, 2, 6, 1), generator=g)
    mask = masks.key_indices(a) | masks.key_indices(b)
    run = torch.compile(
        lambda q, k, v, m: attnkit.attention(q, k, v, mask=m), fullgraph=True, backend="aot_eager"
    )
    for _ in range(2):
        want = formula(q, k, v, selection(a, 6, 2) | selection(b, 6, 2))
        torch.testing.assert_close(run(q, k, v, mask).double(), want, atol=1e-5, rtol=1e-5)
        a.copy_(torch.randint(-1, 6, a.shape, generator=g))
