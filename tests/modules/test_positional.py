"""Sinusoidal encoding, rotary embeddings and ALiBi against their papers' formulas."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit import RotaryEmbedding, SinusoidalPositionalEncoding, alibi_bias, alibi_slopes
from attnkit.modules.positional import alibi_term
from attnkit.scores import DistanceBias
from attnkit.testing import assert_close


@pytest.mark.parametrize("d_model", [1, 4, 7, 16])
def test_sinusoidal_is_the_papers_formula(d_model: int) -> None:
    pe = SinusoidalPositionalEncoding(d_model)
    want = torch.zeros(6, d_model, dtype=torch.float64)
    for pos in range(6):
        for col in range(d_model):
            i = col // 2
            angle = pos / 10000 ** (2 * i / d_model)
            want[pos, col] = math.sin(angle) if col % 2 == 0 else math.cos(angle)
    x = torch.randn(2, 6, d_model, dtype=torch.float64)
    assert_close(pe(x), x + want)
    assert_close(pe.encoding(6, dtype=torch.float32), want, dtype=torch.float32)


def test_sinusoidal_offset_and_dropout() -> None:
    pe = SinusoidalPositionalEncoding(8)
    full = pe.encoding(10, dtype=torch.float64)
    assert_close(pe.encoding(3, offset=7, dtype=torch.float64), full[7:])
    x = torch.zeros(1, 2, 8, dtype=torch.float64)
    assert_close(pe(x, offset=4)[0], full[4:6])
    drop = SinusoidalPositionalEncoding(8, dropout=0.5)
    assert (drop(torch.zeros(1, 50, 8)) == 0).any()
    assert torch.equal(drop.eval()(x), pe(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sinusoidal_far_positions_keep_their_own_angles(dtype: torch.dtype) -> None:
    # float32 holds integers exactly only up to 2^24: angles computed in it gave positions 2^24
    # and 2^24 + 1 one encoding, 0.89 away from the second one's.
    d_model, first = 6, 2**24
    pe = SinusoidalPositionalEncoding(d_model)
    want = torch.zeros(3, d_model, dtype=torch.float64)
    for row, pos in enumerate(range(first, first + 3)):
        for col in range(d_model):
            angle = pos / 10000 ** (2 * (col // 2) / d_model)
            want[row, col] = math.sin(angle) if col % 2 == 0 else math.cos(angle)
    # An angle of 1.7e7 rad is itself known to 1.7e7 * 2^-52 = 4e-9 only, in any float64 formula.
    conditioning = max(1.0, first * 2**-52 / 1e-10) if dtype == torch.float64 else 1.0
    x = torch.zeros(1, 3, d_model, dtype=dtype)
    assert_close(pe(x, offset=first)[0], want, conditioning=conditioning)
    assert_close(pe.encoding(3, offset=first, dtype=dtype), want, conditioning=conditioning)
    # The last position float64 tells apart is still served.
    last = pe.encoding(1, offset=2**53 - 1, dtype=torch.float64)
    assert last.isfinite().all()


@pytest.mark.usefixtures("no_shape_checks")
def test_sinusoidal_positions_beyond_float64_are_refused() -> None:
    pe = SinusoidalPositionalEncoding(4)
    with pytest.raises(
        ValueError,
        match=r"offset \(1152921504606846976\) \+ length \(3\) must be at most 2\^53",
    ):
        pe(torch.zeros(1, 3, 4), offset=2**60)
    with pytest.raises(ValueError, match=r"offset must be at most 2\*\*63 - 1 .*, got 2361183"):
        pe(torch.zeros(1, 3, 4), offset=2**71)
    with pytest.raises(ValueError, match=r"offset \(9007199254740991\) \+ length \(2\) must be"):
        pe.encoding(2, offset=2**53 - 1)
    with pytest.raises(ValueError, match=r"offset must be >= 0, got -1"):
        pe(torch.zeros(1, 3, 4), offset=-1)
    with pytest.raises(TypeError, match=r"offset must be an int, got 2.0"):
        pe(torch.zeros(1, 3, 4), offset=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"length must be >= 0, got -2"):
        pe.encoding(-2)


def rope_complex(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE as complex numbers: the pair (x[i], x[i + D/2]) is z_i, rotated by pos * theta_i."""
    half = x.size(-1) // 2
    theta = base ** (-torch.arange(half, dtype=torch.float64) / half)
    z = torch.complex(x[..., :half], x[..., half:])
    z = z * torch.polar(torch.ones_like(theta), positions[:, None].double() * theta)
    return torch.cat([z.real, z.imag], dim=-1)


@given(d=st.sampled_from([2, 4, 8, 12]), t=st.integers(1, 9), offset=st.integers(0, 50))
def test_rotary_is_a_rotation_by_position(d: int, t: int, offset: int) -> None:
    rope = RotaryEmbedding(d)
    x = torch.randn(2, 3, t, d, dtype=torch.float64)
    got = rope(x, offset=offset)
    assert_close(got, rope_complex(x, torch.arange(offset, offset + t)))
    assert_close(got.norm(dim=-1), x.norm(dim=-1))  # rotations keep lengths


@given(m=st.integers(0, 100), n=st.integers(0, 100), shift=st.integers(0, 1000))
def test_rotary_scores_depend_on_distance_only(m: int, n: int, shift: int) -> None:
    rope = RotaryEmbedding(16, base=500.0)
    gen = torch.Generator().manual_seed(m * 1000 + n)
    q = torch.randn(1, 16, dtype=torch.float64, generator=gen)
    k = torch.randn(1, 16, dtype=torch.float64, generator=gen)
    a = rope(q, offset=m) @ rope(k, offset=n).T
    b = rope(q, offset=m + shift) @ rope(k, offset=n + shift).T
    torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_rotary_angles_survive_half_precision() -> None:
    rope = RotaryEmbedding(8).half()  # no buffer to round: the angles are computed in float32
    x = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    got = rope(x.half(), offset=3000)
    assert_close(
        got, rope_complex(x.half().double(), torch.arange(3000, 3004)), dtype=torch.float16
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rotary_takes_one_offset_per_row_as_a_tensor(dtype: torch.dtype) -> None:
    from attnkit.interop.deepseek import FrequencyRotary

    x = torch.randn(3, 2, 4, 8, dtype=torch.float64)
    offsets = [7, 0, 4000]
    for rope in (RotaryEmbedding(8), FrequencyRotary(torch.rand(4) + 0.01, scaling=1.3)):
        want = torch.stack(
            [rope(x[b : b + 1].to(dtype), offset=o)[0] for b, o in enumerate(offsets)]
        )
        for given_as in (torch.tensor(offsets), torch.tensor(offsets, dtype=torch.int32)):
            assert torch.equal(rope(x.to(dtype), offset=given_as), want)
        assert torch.equal(rope(x.to(dtype), offset=torch.tensor(5)), rope(x.to(dtype), offset=5))
        if isinstance(rope, RotaryEmbedding) and dtype == torch.float64:  # the formula itself
            for b, o in enumerate(offsets):
                assert_close(want[b], rope_complex(x[b], torch.arange(o, o + 4)))
        with pytest.raises(ValueError, match=r"one int per row of x's first dim, shape \(3,\)"):
            rope(x, offset=torch.tensor([1, 2]))
        with pytest.raises(TypeError, match=r"integer tensor, got torch\.float32"):
            rope(x, offset=torch.tensor([1.0, 2.0, 3.0]))


def test_alibi_slopes_follow_the_paper() -> None:
    assert_close(alibi_slopes(8), torch.tensor([2.0**-i for i in range(1, 9)]))
    # Not a power of two: the 4-head slopes, then every other slope of 8 heads.
    want = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    assert_close(alibi_slopes(6), torch.tensor(want))


def test_alibi_bias_is_bottom_right_and_serves_a_cache() -> None:
    full = alibi_bias(4, 5, dtype=torch.float64)
    slopes = alibi_slopes(4).double()
    for h in range(4):
        for i in range(5):
            for j in range(5):
                assert full[h, i, j] == -slopes[h] * abs(i - j)
    assert_close(alibi_bias(4, 2, 5, dtype=torch.float64), full[:, 3:])  # 2 new after 3 cached


@pytest.mark.parametrize(("q_len", "kv_len"), [(5, 5), (2, 7), (7, 2), (1, 1), (0, 3)])
def test_alibi_term_is_alibi_as_a_bias_by_distance(q_len: int, kv_len: int) -> None:
    # Its table read at each pair's distance is the paper's bias, per batch row of slopes and
    # with each row's queries shifted left of the bottom-right position.
    slopes = torch.tensor([[0.5, 0.25], [0.125, 1.0], [2.0, 0.0625]], dtype=torch.float64)
    shifts = torch.tensor([0, 3, 1])
    term = alibi_term(slopes, q_len, kv_len, shifts=shifts)
    assert isinstance(term, DistanceBias)
    i = torch.arange(q_len)[:, None] + kv_len - q_len
    j = torch.arange(kv_len)[None, :]
    got = term.tile(term.inputs(), i, j)  # (B, H, Tq, Tk)
    for b in range(3):
        want = -slopes[b][:, None, None] * (j - (i - shifts[b])).abs()
        assert torch.equal(got[b], want)
    plain = alibi_term(slopes[0], q_len, kv_len)
    assert torch.equal(plain.tile(plain.inputs(), i, j), -slopes[0][:, None, None] * (j - i).abs())


def test_alibi_bias_reads_alibi_term() -> None:
    term = alibi_term(alibi_slopes(3), 4, 6)
    i, j = torch.arange(4)[:, None] + 2, torch.arange(6)[None, :]
    assert torch.equal(alibi_bias(3, 4, 6), term.tile(term.inputs(), i, j))


def test_the_alibi_term_the_messages_name_is_public() -> None:
    # A paged cache, a module with a cache and attention() refuse a dense bias by naming
    # attnkit.alibi_term: it must be there, and serve the call they refused.
    cache = attnkit.PagedKVCache(4, 4, 2, 8, max_seqs=1, dtype=torch.float64)
    q, k = (
        torch.randn(1, 2, 3, 8, dtype=torch.float64),
        torch.randn(1, 2, 3, 8, dtype=torch.float64),
    )
    with pytest.raises(TypeError, match=r"attnkit\.alibi_term"):
        cache.attention(q, k, k, bias=alibi_bias(2, 3, 3, dtype=torch.float64), causal=True)
    term = attnkit.alibi_term(alibi_slopes(2).double(), 3, 3)
    out, _ = cache.attention(q, k, k, bias=term, causal=True)
    want = attnkit.attention(q, k, k, bias=alibi_bias(2, 3, 3, dtype=torch.float64), causal=True)
    assert_close(out, want)


def test_alibi_in_attention_and_multihead() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 6, 8, dtype=torch.float64) for _ in range(3))
    bias = alibi_bias(4, 6, dtype=torch.float64)
    _, w = attnkit.attention(q, k, v, bias=bias, causal=True, return_weights=True)
    scores = q @ k.mT / math.sqrt(8) + bias
    scores = scores.masked_fill(~attnkit.masks.causal_mask(6), -math.inf)
    assert_close(w, torch.softmax(scores, -1))
    m = attnkit.MultiHeadAttention(16, 4, dtype=torch.float64)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    assert m(x, bias=bias, causal=True).isfinite().all()


@pytest.mark.usefixtures("no_shape_checks")
def test_errors() -> None:
    with pytest.raises(ValueError, match="head_dim must be even for rotary embeddings, got 5"):
        RotaryEmbedding(5)
    with pytest.raises(
        ValueError, match=r"x must have shape \(\.\.\., T, head_dim=8\), got \(2, 3, 6\)"
    ):
        RotaryEmbedding(8)(torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match="offset must be >= 0, got -1"):
        RotaryEmbedding(8)(torch.randn(2, 3, 8), offset=-1)
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, d_model=8\), got \(2, 3, 4\)"):
        SinusoidalPositionalEncoding(8)(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match=r"base must be a number > 1, got 0\.5"):
        SinusoidalPositionalEncoding(8, base=0.5)
    with pytest.raises(ValueError, match="num_heads must be >= 1, got 0"):
        alibi_slopes(0)


# --------------------------------------------------------------------------------------------------
# relative_encoding


@pytest.mark.parametrize("dim", [1, 6, 7])
def test_relative_encoding_is_the_formula_in_both_layouts(dim: int) -> None:
    distances = torch.tensor([5, 1, 0, -1, -5, 4000])
    halves = attnkit.relative_encoding(distances, dim, dtype=torch.float64)
    interleaved = attnkit.relative_encoding(
        distances, dim, layout="interleaved", dtype=torch.float64
    )
    half = (dim + 1) // 2
    for row, d in enumerate(distances.tolist()):
        sines = [math.sin(d * 10000 ** (-2 * k / dim)) for k in range(half)]
        cosines = [math.cos(d * 10000 ** (-2 * k / dim)) for k in range(dim - half)]
        assert_close(halves[row], torch.tensor(sines + cosines, dtype=torch.float64))
        mixed = [v for pair in zip(sines, cosines, strict=False) for v in pair]
        mixed += sines[len(cosines) :]  # an odd dim ends on a sine
        assert_close(interleaved[row], torch.tensor(mixed, dtype=torch.float64))
    # The layouts are one column permutation apart: sines from the even columns, then cosines.
    perm = torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])
    assert torch.equal(interleaved[:, perm], halves)


@pytest.mark.usefixtures("no_shape_checks")
def test_relative_encoding_dtype_and_bad_arguments() -> None:
    d = torch.tensor([3, -3])
    assert attnkit.relative_encoding(d, 4).dtype == torch.float32
    # Computed in float64 then rounded: the same as rounding the float64 table.
    assert torch.equal(
        attnkit.relative_encoding(d, 4, dtype=torch.float16),
        attnkit.relative_encoding(d, 4, dtype=torch.float64).half(),
    )
    with pytest.raises(ValueError, match="layout must be 'halves' or 'interleaved', got 'pairs'"):
        attnkit.relative_encoding(d, 4, layout="pairs")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dim must be >= 1, got 0"):
        attnkit.relative_encoding(d, 0)
    with pytest.raises(TypeError, match="distances must be an integer tensor"):
        attnkit.relative_encoding(torch.tensor([1.5]), 4)
    with pytest.raises(ValueError, match=r"distances must be 1-d \(P,\), got shape \(1, 2\)"):
        attnkit.relative_encoding(d[None], 4)


# --------------------------------------------------------------------------------------------------
# The position embeddings of relative attention


@pytest.mark.parametrize("encoding", ["signed", "symmetric"])
@pytest.mark.parametrize("encoding_dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("top", "bottom"), [(40, -40), (3, -50), (50, -3), (7, 2), (-2, -9)])
def test_relative_position_embedding_projects_the_encodings_of_the_distances(
    encoding: str, encoding_dtype: torch.dtype, top: int, bottom: int
) -> None:
    # W_r r(d) for d = top .. bottom, mirrored or not (tables of 32 or more distances of each sign
    # are projected mirrored), in every mode; with r(|d|) for the symmetric encoding.
    torch.manual_seed(0)
    pos = attnkit.RelativePositionEmbedding(
        9,
        encoding=encoding,  # type: ignore[arg-type]
        encoding_dtype=encoding_dtype,
        dtype=torch.float64,
    )
    distances = torch.arange(top, bottom - 1, -1)
    if encoding == "symmetric":
        distances = distances.abs()
    r = attnkit.relative_encoding(distances, 9, dtype=torch.float64)
    tolerance = 1e-4 if encoding_dtype == torch.float32 else 1e-12  # the toolkits' float32 angles
    got = pos(top, bottom)
    assert got.shape == (top - bottom + 1, 9)
    assert torch.allclose(got, r @ pos.weight.T, atol=tolerance)


def test_relative_position_embedding_legacy_tables_have_a_row_per_frame() -> None:
    from attnkit.modules import _relpos

    torch.manual_seed(0)
    openspeech = attnkit.RelativePositionEmbedding(6, legacy="openspeech")
    want = _relpos.openspeech_sinusoid(5, 6) @ openspeech.weight.T
    assert_close(openspeech(4, -4), want, dtype=torch.float32)
    espnet = attnkit.RelativePositionEmbedding(6, legacy="espnet", legacy_max_len=10)
    want = _relpos.espnet_legacy_sinusoid(5, 6, 10) @ espnet.weight.T
    assert_close(espnet(4, -4), want, dtype=torch.float32)
    assert repr(espnet) == "RelativePositionEmbedding(6, legacy='espnet', legacy_max_len=10)"


def test_relative_position_embedding_reuses_a_projection_of_the_same_weight_only() -> None:
    # Without gradients the last table is kept with a copy of the weight, and reused while the
    # weight holds the same bits: a weight written in place (load_state_dict, an optimizer step,
    # a user's copy_) is what the next call projects, in inference mode too. With gradients every
    # call projects, so that they reach the weight.
    pos = attnkit.RelativePositionEmbedding(8)
    with torch.inference_mode():
        before = pos(40, -40)
        assert pos(40, -40) is before
        assert pos(40, -39) is not before
    with torch.no_grad():
        pos.weight.mul_(2)
    with torch.inference_mode():
        assert_close(pos(40, -40), 2 * before, dtype=torch.float32)
    pos.load_state_dict({"weight": torch.zeros(8, 8)})
    with torch.no_grad():
        zeros = pos(40, -40)
        assert not zeros.any()
        pos.weight[3, 4] = -0.0  # equal to 0.0, but not the same bits
        assert pos(40, -40) is not zeros
    table = pos(40, -40)
    assert table.requires_grad
    assert table is not pos(40, -40)
    table.sum().backward()
    assert pos.weight.grad is not None


@pytest.mark.usefixtures("no_shape_checks")
def test_relative_position_embedding_bad_arguments_quote_values() -> None:
    with pytest.raises(ValueError, match="encoding must be 'signed' or 'symmetric', got 'odd'"):
        attnkit.RelativePositionEmbedding(8, encoding="odd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="legacy_max_len applies to legacy='espnet' only, got "):
        attnkit.RelativePositionEmbedding(8, legacy_max_len=10)
    with pytest.raises(ValueError, match=r"top \(-3\) must be >= bottom \(2\)"):
        attnkit.RelativePositionEmbedding(8)(-3, 2)
