"""attnkit.flex against torch's own FlexAttention as the oracle, on the cases peers' suites use.

torch's unfused eager ``flex_attention`` is the oracle for the score_mod / mask_mod grid
(float64 output and log-sum-exp), with GQA, ``scale``, lengths that are not multiples of the
block size, and degenerate shapes; one call against torch's compiled FlexAttention (inference
on the CPU); torch BlockMasks built by hand with ``from_kv_blocks``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from attnkit import flex

tf = pytest.importorskip("torch.nn.attention.flex_attention")

DOCS = torch.tensor([0] * 40 + [1] * 90 + [2] * 127)  # 257 positions in three documents
BIAS = torch.randn(2, 4, 257, 257, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Causal."""
    return q_idx >= kv_idx


def window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Sliding window of 16 on either side."""
    return (q_idx - kv_idx).abs() <= 16


def prefix(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """The first 20 keys."""
    return kv_idx < 20


def document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Same document, read from a captured tensor."""
    return DOCS[q_idx] == DOCS[kv_idx]


def relative(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Relative position bias."""
    return s + 0.01 * (q_idx - kv_idx)


def alibi(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """ALiBi with a slope per head."""
    return s - (h + 1) * 0.05 * (q_idx - kv_idx).abs()


def softcap(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """tanh softcap at 5."""
    return 5.0 * torch.tanh(s / 5.0)


def bias(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """A captured bias tensor read at (b, h, q_idx, kv_idx)."""
    return s + BIAS[b, h, q_idx, kv_idx]


def where_causal(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Causal through the score_mod."""
    return torch.where(q_idx >= kv_idx, s, -float("inf"))


def _qkv(b: int, h: int, hkv: int, q_len: int, kv_len: int, d: int = 8) -> list[Tensor]:
    g = torch.Generator().manual_seed(q_len * 1000 + kv_len)
    shapes = [(b, h, q_len, d), (b, hkv, kv_len, d), (b, hkv, kv_len, d)]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def _eager(*args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile()"
        return tf.flex_attention(*args, **kwargs)


def _ours(*args: Any, **kwargs: Any) -> Any:
    return flex.flex_attention(*args, **kwargs)


def _same(got: Tensor, want: Tensor, tol: float = 1e-10) -> None:
    assert got.shape == want.shape
    assert torch.equal(got.isfinite(), want.isfinite())
    fin = want.isfinite()
    assert torch.allclose(got[fin], want[fin], rtol=tol, atol=tol)


MASKS = [
    causal,
    window,
    prefix,
    document,
    tf.and_masks(causal, window),
    tf.or_masks(causal, prefix),
]
MODS = [None, relative, alibi, softcap, bias, where_causal]


@pytest.mark.parametrize("mask_mod", MASKS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("score_mod", MODS, ids=lambda m: getattr(m, "__name__", "none"))
def test_grid_against_torch_eager(score_mod: Any, mask_mod: Callable[..., Tensor]) -> None:
    """Output and log-sum-exp, float64, with attnkit's and torch's block masks, B=None and H=4,
    Q_LEN != KV_LEN, lengths that are not multiples of BLOCK_SIZE (64, 128)."""
    q, k, v = _qkv(2, 4, 4, 100, 257)
    ours = flex.create_block_mask(mask_mod, None, 4, 100, 257, BLOCK_SIZE=(64, 128))
    theirs = tf.create_block_mask(mask_mod, None, 4, 100, 257, device="cpu", BLOCK_SIZE=(64, 128))
    want, want_lse = _eager(q, k, v, score_mod=score_mod, block_mask=theirs, return_lse=True)
    for block_mask in (ours, theirs):
        got, lse = _ours(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True)
        _same(got, want)
        _same(lse, want_lse)


@pytest.mark.parametrize(
    ("b", "h", "hkv", "q_len", "kv_len", "scale"),
    [
        (2, 4, 2, 100, 100, None),
        (2, 4, 1, 257, 100, 0.3),
        (1, 2, 2, 1, 50, 0.0),
        (2, 2, 2, 1, 1, 2.0),
    ],
)
def test_gqa_scale_and_short_shapes_against_torch_eager(
    b: int, h: int, hkv: int, q_len: int, kv_len: int, scale: float | None
) -> None:
    """GQA with enable_gqa=True, scale= (0 included), one query or one key."""
    q, k, v = _qkv(b, h, hkv, q_len, kv_len)
    theirs = tf.create_block_mask(document, b, None, q_len, kv_len, device="cpu")
    ours = flex.create_block_mask(document, b, None, q_len, kv_len)
    kw: dict[str, Any] = {"score_mod": bias, "scale": scale, "enable_gqa": True}
    want, want_lse = _eager(q, k, v, block_mask=theirs, return_lse=True, **kw)
    got, lse = _ours(q, k, v, block_mask=ours, return_lse=True, **kw)
    _same(got, want)
    _same(lse, want_lse)


def test_float32_and_bfloat16_against_torch_eager() -> None:
    """Lower precisions against torch's own at its precision (same inputs)."""
    q, k, v = _qkv(2, 2, 2, 100, 257, d=16)
    block_mask = tf.create_block_mask(document, None, None, 100, 257, device="cpu")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        args = [t.to(dtype) for t in (q, k, v)]
        want = _eager(*args, score_mod=softcap, block_mask=block_mask)
        got = _ours(*args, score_mod=softcap, block_mask=block_mask)
        assert got.dtype == dtype
        _same(got.double(), want.double(), tol)


def _from_kv_blocks(columns: int) -> Any:
    """A torch BlockMask listing blocks by hand (BLOCK_SIZE 100, lengths 250, causal
    mask_mod): query block 0 lists key block 0 as partial and key block 2 as full, query block 1
    key block 1, query block 2 key block 2 as partial and key block 0 as full; ``columns``
    entries in each row's lists."""
    num = torch.tensor([[[1, 1, 1]]], dtype=torch.int32)
    idx = torch.zeros(1, 1, 3, columns, dtype=torch.int32)
    idx[0, 0, :, 0] = torch.tensor([0, 1, 2])
    full_num = torch.tensor([[[1, 0, 1]]], dtype=torch.int32)
    full_idx = torch.zeros(1, 1, 3, columns, dtype=torch.int32)
    full_idx[0, 0, 0, 0] = 2
    return tf.BlockMask.from_kv_blocks(
        num, idx, full_num, full_idx, BLOCK_SIZE=100, mask_mod=causal, seq_lengths=(250, 250)
    )


def test_torch_block_mask_with_short_index_lists() -> None:
    """kv_indices with fewer columns than key blocks (torch's kernels read only the first
    kv_num_blocks entries of a row): attnkit failed with an IndexError, reading torch's
    to_dense(), which drops the blocks past the last column. Visible: the listed blocks where
    the mask_mod allows, as with the full lists."""
    q, k, v = _qkv(1, 1, 1, 250, 250)
    qi, ki = torch.arange(250)[:, None], torch.arange(250)[None]
    listed = ((qi // 100 - ki // 100).abs() % 2 == 0) & (qi >= ki)  # block 1 sees only block 1
    scores = (q @ k.transpose(-1, -2) / 8**0.5).masked_fill(~listed, -float("inf"))
    want = torch.softmax(scores, -1) @ v
    _same(_ours(q, k, v, block_mask=_from_kv_blocks(3)), want)
    _same(_ours(q, k, v, block_mask=_from_kv_blocks(2)), want)


def test_one_call_against_compiled_torch() -> None:
    """torch's compiled FlexAttention (inference on the CPU), a torch BlockMask with B and H
    given and BLOCK_SIZE (64, 128), relative position bias, GQA, lengths 100 and 257."""
    q, k, v = (t.float() for t in _qkv(2, 4, 2, 100, 257, d=16))
    mask_mod = flex.and_masks(document, flex.or_masks(causal, prefix))
    block_mask = tf.create_block_mask(mask_mod, 2, 4, 100, 257, device="cpu", BLOCK_SIZE=(64, 128))
    kw: dict[str, Any] = {"score_mod": relative, "enable_gqa": True}
    with torch.no_grad():  # compiled on the CPU: inference, without the log-sum-exp
        compiled: Any = torch.compile(tf.flex_attention)
        want = compiled(q, k, v, block_mask=block_mask, **kw)
    _same(_ours(q, k, v, block_mask=block_mask, **kw), want, 1e-5)


def test_empty_batch_matches_torch_eager() -> None:
    """B=0: an empty output, as torch's."""
    q, k, v = _qkv(0, 2, 2, 100, 100)
    block_mask = flex.create_block_mask(causal, None, None, 100, 100)
    got = _ours(q, k, v, score_mod=relative, block_mask=block_mask)
    theirs = tf.create_block_mask(causal, None, None, 100, 100, device="cpu")
    _same(got, _eager(q, k, v, score_mod=relative, block_mask=theirs))


def test_block_mask_for_an_empty_batch() -> None:
    """create_block_mask(B=0), which torch takes, was refused ("B must be >= 1"): an empty
    batch runs as torch's, and a mask of no rows is refused for a call that has some."""
    q, k, v = _qkv(0, 2, 2, 37, 37)
    ours = flex.create_block_mask(causal, 0, None, 37, 37)
    theirs = tf.create_block_mask(causal, 0, None, 37, 37, device="cpu")
    assert ours.shape == tuple(theirs.shape)
    want = _eager(q, k, v, block_mask=theirs)
    _same(_ours(q, k, v, block_mask=ours), want)
    _same(_ours(q, k, v, block_mask=theirs), want)  # torch's mask of no rows read an index 0
    with pytest.raises(ValueError, match="block_mask was made for"):
        _ours(*_qkv(2, 2, 2, 37, 37), block_mask=ours)
