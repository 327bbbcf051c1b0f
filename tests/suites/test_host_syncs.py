"""Host synchronisations of one call: decided per call, never per block.

Every ``.item()``, ``.tolist()``, ``bool(t)``, ``float(t)``, ``int(t)`` or ``.cpu()`` inside the
kernel's loops would stall a GPU once per block. These tests count them on the CPU (where the same
calls are made) during one ``attention()`` call, forward and backward separately: a long sequence
must make exactly as many as a short one.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit._kernel import make_plan

# What reads a tensor's numbers back to the host.
_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu")


@contextlib.contextmanager
def _counting() -> Iterator[collections.Counter[str]]:
    """Count the host reads on every tensor while the block runs."""
    counts: collections.Counter[str] = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counted(name: str) -> Callable[..., Any]:
        original = originals[name]

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return original(self, *args, **kwargs)

        return read

    try:
        for name in _READS:
            setattr(torch.Tensor, name, counted(name))
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _syncs(t: int, backend: str) -> tuple[dict[str, int], dict[str, int]]:
    """Host reads of one sliding-window call's forward, and of its backward."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, t, 16, generator=gen, requires_grad=True) for _ in range(3))
    mask = masks.sliding_window(256)
    with _counting() as forward:
        out = attnkit.attention(q, k, v, mask=mask, backend=backend)
    dout = torch.randn(out.shape, generator=gen)
    with _counting() as backward:
        out.backward(dout)
    assert q.grad is not None
    assert torch.isfinite(q.grad).all()
    return dict(forward), dict(backward)


@pytest.mark.parametrize("backend", ["auto", "chunked"])
def test_sliding_window_syncs_do_not_grow_with_length(backend: str) -> None:
    # A first call loads the native kernel, whose finiteness check then reads nothing back.
    _syncs(64, backend)
    short_fwd, short_bwd = _syncs(2048, backend)
    long_fwd, long_bwd = _syncs(16384, backend)
    assert long_fwd == short_fwd, "forward"
    assert long_bwd == short_bwd, "backward"


def _within_7(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return (j - i).abs() < 7


@pytest.mark.parametrize(
    "mask",
    [
        lambda t: masks.documents([t // 4, t // 2, t // 4]) & masks.causal(),
        lambda t: masks.sliding_window(256) & masks.from_fn(_within_7),
        lambda t: masks.key_padding([t - 100]),
    ],
    ids=["documents&causal", "window&from_fn", "key_padding"],
)
def test_plans_read_their_block_states_once(mask: Callable[[int], masks.Mask]) -> None:
    # A band's plan asks the mask one strip of blocks per query block; the strips are read back
    # together, wherever the mask computed them.
    def reads(t: int) -> dict[str, int]:
        geo = masks.Geometry((1,), 1, t, t, torch.device("cpu"))
        m = mask(t)
        with _counting() as counts:
            make_plan(m, geo, q_start=0, q_len=t, k_start=0, kv_len=t, block_q=512, block_k=128)
        return dict(counts)

    assert reads(2048) == reads(16384) == {"tolist": 1}


def test_counting_sees_host_reads() -> None:
    """The counter itself: each kind of read is seen (so the test above can fail)."""
    t = torch.ones(3)
    with _counting() as counts:
        t.sum().item()
        t.tolist()
        bool(t[0])
        float(t[0])
        int(t[0])
        t.cpu()
    assert counts == {name: 1 for name in _READS}
