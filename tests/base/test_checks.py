"""The shared argument checks: what each accepts, and the words and types of what it raises."""

from __future__ import annotations

import re

import pytest
import torch

from attnkit._base import checks

# (call, exception type, the message's text)
BAD = [
    (lambda: checks.check_int("block_q", 2.0), TypeError, "block_q must be an int, got 2.0"),
    (lambda: checks.check_int("block_q", True), TypeError, "block_q must be an int, got True"),
    (lambda: checks.check_int("block_q", 0), ValueError, "block_q must be >= 1, got 0"),
    (lambda: checks.check_int("n", -1, minimum=0), ValueError, "n must be >= 0, got -1"),
    (
        lambda: checks.check_lengths("lens", 3),
        TypeError,
        "lens must be a sequence of ints, got int",
    ),
    (
        lambda: checks.check_lengths("lens", "12"),
        TypeError,
        "lens must be a sequence of ints, got str",
    ),
    (lambda: checks.check_lengths("lens", [1, -1]), ValueError, "lens[1] must be >= 0, got -1"),
    (lambda: checks.check_lengths("lens", [1, 2.5]), TypeError, "lens[1] must be an int, got 2.5"),
    (lambda: checks.check_bool("causal", 1), TypeError, "causal must be a bool, got 1"),
    (lambda: checks.check_bool("causal", None), TypeError, "causal must be a bool, got None"),
    (lambda: checks.check_positive("eps", "1"), TypeError, "eps must be a number > 0, got '1'"),
    (lambda: checks.check_positive("eps", False), TypeError, "eps must be a number > 0, got False"),
    (lambda: checks.check_positive("eps", 0), ValueError, "eps must be a finite number > 0, got 0"),
    (
        lambda: checks.check_positive("eps", float("inf")),
        ValueError,
        "eps must be a finite number > 0, got inf",
    ),
    (
        lambda: checks.check_probability("dropout", "0.1"),
        TypeError,
        "dropout must be a float in [0, 1), got '0.1'",
    ),
    (
        lambda: checks.check_probability("dropout", 1.0),
        ValueError,
        "dropout must be in [0, 1), got 1.0",
    ),
    (
        lambda: checks.check_probability("dropout", -0.1),
        ValueError,
        "dropout must be in [0, 1), got -0.1",
    ),
    (
        lambda: checks.present(None, "the plan"),
        RuntimeError,
        "attnkit internal error: the plan is None here; please report it",
    ),
    (lambda: checks.require_tensor("q", [1.0]), TypeError, "q must be a torch.Tensor, got list"),
    (
        lambda: checks.check_float_tensor("x", torch.zeros(2, dtype=torch.int64)),
        TypeError,
        "x must be a float tensor, got int64",
    ),
    (lambda: checks.check_float_tensor("x", 3.0), TypeError, "x must be a torch.Tensor, got float"),
    (
        lambda: checks.check_input("query", torch.zeros(2, 5), "(B, Tq, d_model=8)", 8, None),
        ValueError,
        "query must have shape (B, Tq, d_model=8), got (2, 5)",
    ),
    (
        lambda: checks.check_input("query", torch.zeros(2, 5, 4), "(B, Tq, d_model=8)", 8, None),
        ValueError,
        "query must have shape (B, Tq, d_model=8), got (2, 5, 4)",
    ),
    (
        lambda: checks.check_input(
            "query",
            torch.zeros(2, 5, 8),
            "(B, Tq, d_model=8)",
            8,
            torch.zeros(1, dtype=torch.float64),
        ),
        TypeError,
        "query is float32 but the module's parameters are float64: convert one of them "
        "(module.to(dtype)), or run under torch.autocast",
    ),
    (
        lambda: checks.check_like_parameters("x", torch.zeros(1, device="meta"), torch.zeros(1)),
        ValueError,
        "x is on meta but the module's parameters are on cpu",
    ),
    (
        lambda: checks.check_broadcastable("bias", torch.zeros(3, 4), (2, 5, 4), "(B, T, K)"),
        ValueError,
        "bias of shape (3, 4) does not broadcast to (B, T, K) = (2, 5, 4)",
    ),
    (
        lambda: checks.check_broadcastable("bias", torch.zeros(1, 1, 1, 4), (5, 4), "(T, K)"),
        ValueError,
        "bias of shape (1, 1, 1, 4) does not broadcast to (T, K) = (5, 4)",
    ),
]


@pytest.mark.parametrize(("call", "exc", "message"), BAD)
def test_bad_values_raise_with_the_argument_and_the_value(
    call, exc: type[Exception], message: str
) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        call()


def test_good_values_pass_through() -> None:
    assert checks.check_int("n", 3) == 3
    assert checks.check_int("n", 0, minimum=0) == 0
    assert checks.check_lengths("lens", (0, 2, 5)) == [0, 2, 5]
    assert checks.check_lengths("lens", []) == []
    assert checks.check_bool("flag", False) is False
    assert checks.check_positive("eps", 1) == 1.0
    assert isinstance(checks.check_positive("eps", 1), float)
    assert checks.check_probability("p", 0) == 0.0
    assert checks.check_probability("p", 0.999) == 0.999
    assert checks.present(0, "zero") == 0  # only None is missing
    t = torch.zeros(2, 3, 8, dtype=torch.float64)
    assert checks.require_tensor("t", t) is t
    assert checks.check_float_tensor("t", t) is t
    assert checks.check_input("x", t, "(B, T, 8)", 8, torch.zeros(1, dtype=torch.float64)) is t
    assert checks.check_input("x", t, "(B, T, D)", None, None) is t
    checks.check_broadcastable("bias", torch.zeros(5, 1), (2, 3, 5, 4), "(B, H, T, K)")
    checks.check_broadcastable("bias", torch.zeros(()), (5, 4), "(T, K)")


def test_under_autocast_a_dtype_other_than_the_parameters_is_fine() -> None:
    x, params = torch.zeros(1, 2, 4, dtype=torch.bfloat16), torch.zeros(1)
    with pytest.raises(TypeError, match=r"run under torch\.autocast"):
        checks.check_like_parameters("x", x, params)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        checks.check_like_parameters("x", x, params)


def test_strings_of_shapes_dims_and_dtypes() -> None:
    assert checks.shape_str(torch.Size([2, 8, 128, 64])) == "(2, 8, 128, 64)"
    assert checks.shape_str(()) == "()"
    assert checks.shape_str((5,)) == "(5)"
    assert checks.dim_str(7) == "7"
    assert checks.dtype_str(torch.bfloat16) == "bfloat16"
    assert checks.dtype_str(torch.float64) == "float64"


def test_numpy_integers_are_ints() -> None:
    """Lengths read from a numpy array (``key_padding([np.int64(3), 6])``) were refused as "not
    an int"; numpy's floats and bools still are."""
    np = pytest.importorskip("numpy")
    assert checks.check_lengths("lens", [np.int64(3), np.int32(0), 6]) == [3, 0, 6]
    got = checks.check_int("block_q", np.uint8(7))
    assert got == 7
    assert type(got) is int
    with pytest.raises(TypeError, match=re.escape("lens[0] must be an int, got np.float64(2.0)")):
        checks.check_lengths("lens", [np.float64(2.0)])
    with pytest.raises(TypeError, match="block_q must be an int"):
        checks.check_int("block_q", np.bool_(True))
    from attnkit import attention, masks

    q = torch.randn(2, 2, 5, 4, dtype=torch.float64)
    got_out = attention(q, q, q, mask=masks.key_padding(list(np.array([3, 5]))))
    want = attention(q, q, q, mask=masks.key_padding([3, 5]), backend="reference")
    torch.testing.assert_close(got_out, want)


def test_numpy_floats_are_floats() -> None:
    """A scale, softcap or dropout rate computed in numpy (``np.float32(0.125)``) was refused as
    "must be a float"; the argument checks of attention() and of the flash-attn functions take
    it as the Python float of its value. numpy's bools still are refused. (With the runtime type
    checks on, the hints, ``float``, refuse it first, as they say.)"""
    np = pytest.importorskip("numpy")
    from attnkit._call import _check_scale, _check_softcap
    from attnkit.flash_attn._args import scale_of, softcap_of

    for got, want in [
        (checks.check_probability("dropout_p", np.float32(0.25)), 0.25),
        (checks.check_positive("eps", np.float16(0.5)), 0.5),
        (_check_scale(np.float32(0.5), 8, torch.float32), 0.5),
        (_check_softcap(np.float64(30.0)), 30.0),
        (scale_of(np.float32(0.25), torch.bfloat16), 0.25),
        (softcap_of(np.float32(2.5)), 2.5),
    ]:
        assert got == want
        assert type(got) is float
    with pytest.raises(TypeError, match="dropout_p must be a float"):
        checks.check_probability("dropout_p", np.bool_(False))
    with pytest.raises(ValueError, match="scale must be finite"):
        _check_scale(np.float32("nan"), 8, torch.float32)


@pytest.mark.parametrize(
    ("shape", "target"),
    [
        ((), (2, 3, 1)),
        ((3, 1), (2, 3, 1)),
        ((1, 1, 1), (2, 3, 1)),
        ((2, 3, 1), (2, 3, 1)),
        ((2, 3, 2), (2, 3, 1)),
        ((1, 2, 3, 1), (2, 3, 1)),
        ((4, 1), (2, 3, 1)),
        ((0, 1), (2, 0, 1)),
        ((2, 1), (2, 0, 1)),
        ((3,), (3,)),
    ],
)
def test_broadcasts_to_follows_torchs_rule(shape: tuple[int, ...], target: tuple[int, ...]) -> None:
    try:
        torchs = torch.broadcast_shapes(shape, target) == torch.Size(target)
    except RuntimeError:
        torchs = False
    assert checks.broadcasts_to(shape, target) is torchs


def test_broadcasts_to_while_tracing_with_symbolic_sizes() -> None:
    @torch.compile(fullgraph=True, dynamic=True)
    def fits(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x + 1 if checks.broadcasts_to(scale.shape, (*x.shape[:-1], 1)) else x - 1

    x = torch.zeros(2, 3, 5, 4)
    assert fits(torch.ones(3, 5, 1), x).eq(1).all()
    assert fits(torch.ones(2, 3, 5, 1), x).eq(1).all()
    assert fits(torch.ones(2, 3, 5, 2), x).eq(-1).all()
