"""The ATTNKIT_* environment variables: every spelling of on and off, numbers in their range, and
any other value a warning (once) and the default, never an error. What is read at import runs
in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from attnkit._base import env as _env


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_env, "_warned", set())


@pytest.mark.parametrize(
    ("text", "value"),
    [
        *((t, True) for t in ("1", "on", "ON", "true", "True", "yes", " Yes\n")),
        *((t, False) for t in ("0", "off", "Off", "false", "FALSE", "no", " no ")),
    ],
)
@pytest.mark.parametrize("default", [True, False])
def test_every_spelling_of_on_and_off(
    monkeypatch: pytest.MonkeyPatch, text: str, value: bool, default: bool
) -> None:
    monkeypatch.setenv("ATTNKIT_TEST_SWITCH", text)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _env.switch("ATTNKIT_TEST_SWITCH", default) is value


@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_is_the_default(monkeypatch: pytest.MonkeyPatch, default: bool) -> None:
    monkeypatch.delenv("ATTNKIT_TEST_SWITCH", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _env.switch("ATTNKIT_TEST_SWITCH", default) is default
        monkeypatch.setenv("ATTNKIT_TEST_SWITCH", "  ")
        assert _env.switch("ATTNKIT_TEST_SWITCH", default) is default


@pytest.mark.parametrize("text", ["2", "enable", "o n", "nope", "-1"])
def test_any_other_switch_value_warns_once_and_takes_the_default(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv("ATTNKIT_TEST_SWITCH", text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [_env.switch("ATTNKIT_TEST_SWITCH", True) for _ in range(3)]
    assert got == [True] * 3
    assert [str(w.message) for w in caught] == [
        f"attnkit: ATTNKIT_TEST_SWITCH={text!r}, which is neither on (1, on, true, yes) nor off "
        "(0, off, false, no), in any case; taken as on, the default"
    ]


@pytest.mark.parametrize(
    ("text", "integer", "value"),
    [("2.5", False, 2.5), ("0", False, 0.0), ("inf", False, float("inf")), (" 8 ", True, 8)],
)
def test_numbers_in_their_range(
    monkeypatch: pytest.MonkeyPatch, text: str, integer: bool, value: float
) -> None:
    monkeypatch.setenv("ATTNKIT_TEST_NUMBER", text)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _env.number("ATTNKIT_TEST_NUMBER", 7, minimum=0, integer=integer) == value


@pytest.mark.parametrize(
    ("text", "integer", "kind"),
    [
        ("ten", False, "a number >= 0"),
        ("nan", False, "a number >= 0"),
        ("-3", False, "a number >= 0"),
        ("2.5", True, "a whole number >= 0"),
        ("-1", True, "a whole number >= 0"),
    ],
)
def test_any_other_number_warns_once_and_takes_the_default(
    monkeypatch: pytest.MonkeyPatch, text: str, integer: bool, kind: str
) -> None:
    monkeypatch.setenv("ATTNKIT_TEST_NUMBER", text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [_env.number("ATTNKIT_TEST_NUMBER", 7, minimum=0, integer=integer) for _ in range(2)]
    assert got == [7, 7]
    assert [str(w.message) for w in caught] == [
        f"attnkit: ATTNKIT_TEST_NUMBER={text!r}, which is not {kind}; taken as 7, the default"
    ]


def test_a_choice_in_any_case_or_a_warning_and_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    words = ("timed", "region", "helpers")
    for text, want in [(" Region ", "region"), ("HELPERS", "helpers"), ("", "timed")]:
        monkeypatch.setenv("ATTNKIT_TEST_CHOICE", text)
        assert _env.choice("ATTNKIT_TEST_CHOICE", words, "timed") == want
    monkeypatch.setenv("ATTNKIT_TEST_CHOICE", "helper")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [_env.choice("ATTNKIT_TEST_CHOICE", words, "timed") for _ in range(2)]
    assert got == ["timed", "timed"]
    assert [str(w.message) for w in caught] == [
        "attnkit: ATTNKIT_TEST_CHOICE='helper', which is none of timed, region, helpers; "
        "taken as timed, the default"
    ]


def test_the_build_timeout_is_such_a_number(monkeypatch: pytest.MonkeyPatch) -> None:
    """ATTNKIT_BUILD_TIMEOUT=nan used to be a timeout of 0 s, and "ten" 600 s, without a word."""
    from attnkit._native import build

    monkeypatch.setenv("ATTNKIT_BUILD_TIMEOUT", "nan")
    with pytest.warns(RuntimeWarning, match="ATTNKIT_BUILD_TIMEOUT='nan', which is not a number"):
        assert build._timeout() == 600.0
    monkeypatch.setenv("ATTNKIT_BUILD_TIMEOUT", "30")
    assert build._timeout() == 30.0


# What a fresh process reads at import: the shape checks' switch, with or without their libraries.
IMPORT = textwrap.dedent(
    """
    import json, sys, warnings
    for name in sys.argv[1:]:
        sys.modules[name] = None  # as if not installed: importing it raises ImportError
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch
        import attnkit
        from attnkit._base import shapes as _typing
        cache = attnkit.KVCache(1, 4, 1, 2)
        keys, _ = cache.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    print(json.dumps({
        "checks": _typing.SHAPE_CHECKS,
        "wrapped": hasattr(attnkit.KVCache.update, "__wrapped__"),
        "held": keys.shape[2],
        "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
    }))
    """
)


def _import(value: str | None, *hidden: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "ATTNKIT_SHAPE_CHECKS"}
    if value is not None:
        env["ATTNKIT_SHAPE_CHECKS"] = value
    done = subprocess.run(
        [sys.executable, "-c", IMPORT, *hidden],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.parametrize("hidden", [("beartype",), ("jaxtyping", "beartype")])
def test_shape_checks_without_their_libraries_warn(
    hidden: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ATTNKIT_SHAPE_CHECKS=1 without the test extras made ``import attnkit`` fail with "No
    module named 'beartype'"; the switch now reads off after one warning."""
    from attnkit._base import shapes

    monkeypatch.setenv("ATTNKIT_SHAPE_CHECKS", "1")
    for name in hidden:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.warns(RuntimeWarning) as caught:
        assert shapes._shape_checks() is False
    assert [str(w.message) for w in caught] == [
        "attnkit: ATTNKIT_SHAPE_CHECKS is on, but the shape checks need jaxtyping and beartype "
        '(pip install "attnkit[test]", or ".[test]" from a checkout) and '
        f"{' and '.join(hidden)} cannot be imported: attnkit "
        "runs without the checks"
    ]


def test_a_fresh_import_without_the_libraries_runs_unchecked() -> None:
    """The same at import, in a fresh process: it imports, warns once, and a cache still works."""
    report = _import("1", "jaxtyping", "beartype")
    assert (report["checks"], report["wrapped"], report["held"]) == (False, False, 1)
    assert len(report["warnings"]) == 1  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "checks", "warned"),
    [("1", True, False), ("Yes", True, False), ("off", False, False), (None, False, False),
     ("sometimes", False, True)],
)  # fmt: skip
def test_shape_checks_take_every_spelling(
    value: str | None, checks: bool, warned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ATTNKIT_SHAPE_CHECKS=off turned the checks on (anything but "" and "0" did)."""
    from attnkit._base import shapes

    if value is None:
        monkeypatch.delenv("ATTNKIT_SHAPE_CHECKS", raising=False)
    else:
        monkeypatch.setenv("ATTNKIT_SHAPE_CHECKS", value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert shapes._shape_checks() is checks
    expected = [
        f"attnkit: ATTNKIT_SHAPE_CHECKS={value!r}, which is neither on (1, on, true, yes) nor off "
        "(0, off, false, no), in any case; taken as off, the default"
    ]
    assert [str(w.message) for w in caught] == (expected if warned else [])


@pytest.mark.parametrize(("value", "checks"), [("yes", True), ("off", False)])
def test_the_switch_read_at_import_wraps_or_not(value: str, checks: bool) -> None:
    """What a fresh ``import attnkit`` makes of the switch: public functions wrapped or not."""
    report = _import(value)
    assert (report["checks"], report["wrapped"], report["held"]) == (checks, checks, 1)
    assert report["warnings"] == []


def test_a_switch_follows_every_change_between_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A switch read at every call (ATTNKIT_NATIVE) sees each change of its variable, set, unset,
    or spelt anew, as a fresh read of os.environ does; and an os.environ replaced by a plain
    mapping is read as it is."""
    name = "ATTNKIT_TEST_SWITCH"
    for text, want in [("on", True), ("off", False), (" ON ", True), ("no", False), (None, True)]:
        if text is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, text)
        assert [_env.switch(name, True) for _ in range(2)] == [want, want]
        assert _env.switch(name, False) is (want if text is not None else False)
    monkeypatch.setattr(os, "environ", {name: "off"})
    assert _env.switch(name, True) is False
    os.environ[name] = "1"
    assert _env.switch(name, False) is True


def test_a_switch_that_warns_warns_again_once_its_warnings_are_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A misspelt value is read anew each time (never kept as an answer), so that its warning is
    the long way's: once per variable and value."""
    monkeypatch.setenv("ATTNKIT_TEST_SWITCH", "maybe")
    for _ in range(2):
        monkeypatch.setattr(_env, "_warned", set())
        with pytest.warns(RuntimeWarning, match="ATTNKIT_TEST_SWITCH='maybe'"):
            assert _env.switch("ATTNKIT_TEST_SWITCH", True) is True
