"""The native kernel's compiler flags (``attnkit._native._flags``): readable without importing
attnkit (setup.py executes the file), each instruction set's flags turn on what at::vec compiles
for, and torch's headers passed as system headers keep their warnings to themselves."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from attnkit._native import _flags, build

FLAGS_FILE = Path(_flags.__file__)
CXX = build.compiler()
needs_compiler = pytest.mark.skipif(CXX is None, reason="no C++ compiler on PATH")


def test_the_file_imports_nothing_and_runs_alone() -> None:
    # setup.py executes it in an empty namespace, where torch may be importable but attnkit is
    # not: an import here would break the wheel's build.
    tree = ast.parse(FLAGS_FILE.read_text())
    imports = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")
    ]
    assert imports == []
    namespace: dict[str, object] = {}
    exec(FLAGS_FILE.read_text(), namespace)
    for name in ("CAPABILITY_FLAGS", "CFLAGS", "LDFLAGS", "WARNINGS"):
        assert namespace[name] == getattr(_flags, name), name


def test_each_instruction_set_names_itself_to_at_vec() -> None:
    # at::vec chooses its implementation by CPU_CAPABILITY_<name>; torch's capability names are
    # the keys (attnkit._native.build.capability() returns one of them).
    assert set(_flags.CAPABILITY_FLAGS) == {"AVX512", "AVX2", "DEFAULT"}
    for cap, flags in _flags.CAPABILITY_FLAGS.items():
        defines = sorted(f for f in flags if f.startswith("-D"))
        want = [] if cap == "DEFAULT" else [f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}"]
        assert defines == want, cap


def test_openmp_is_on_for_compiling_and_linking() -> None:
    # at::parallel_for is inline OpenMP: without -fopenmp the kernel's one parallel region per
    # call runs serially, without a word.
    assert "-fopenmp" in _flags.CFLAGS
    assert "-fopenmp" in _flags.LDFLAGS
    assert set(_flags.WARNINGS) <= set(_flags.CFLAGS)


def _macros(flags: list[str]) -> set[str]:
    assert CXX is not None
    out = subprocess.run(
        [CXX, "-x", "c++", "-dM", "-E", *flags, "/dev/null"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}


@needs_compiler
@pytest.mark.skipif(build.capability() == "DEFAULT", reason="not an x86-64 CPU with AVX2")
def test_each_instruction_sets_flags_turn_on_its_instructions() -> None:
    wanted = {
        "AVX512": {
            "__AVX512F__",
            "__AVX512BW__",
            "__AVX512VL__",
            "__AVX512DQ__",
            "__FMA__",
            "__F16C__",
        },
        "AVX2": {"__AVX2__", "__FMA__", "__F16C__"},
    }
    for cap, macros in wanted.items():
        got = _macros([*_flags.CFLAGS, *_flags.CAPABILITY_FLAGS[cap]])
        assert macros <= got, f"{cap}: {sorted(macros - got)} missing"
        assert "_OPENMP" in got
        assert f"CPU_CAPABILITY_{cap}" in got
    # The library for every other CPU uses nothing beyond x86-64's baseline.
    assert "__AVX2__" not in _macros([*_flags.CFLAGS, *_flags.CAPABILITY_FLAGS["DEFAULT"]])


def test_system_includes_name_every_folder() -> None:
    assert _flags.system_includes(["/a", "/b c"]) == ["-isystem", "/a", "-isystem", "/b c"]
    assert _flags.system_includes([]) == []


@needs_compiler
def test_a_folder_given_as_a_system_include_too_keeps_its_warnings(tmp_path: Path) -> None:
    # setuptools passes torch's folders as -I; the wheel's build adds them with system_includes.
    headers = tmp_path / "headers"
    headers.mkdir()
    (headers / "noisy.h").write_text(
        "#pragma unroll\ninline int noisy(int x) { int unused = x; return 0; }\n"
    )
    source = tmp_path / "kernel.cpp"
    source.write_text('#include "noisy.h"\nint kernel(int x) { return noisy(x); }\n')
    assert CXX is not None

    def warnings(flags: list[str]) -> list[str]:
        got = subprocess.run(
            [CXX, *_flags.WARNINGS, "-fsyntax-only", *flags, str(source)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert got.returncode == 0, got.stderr
        return [line for line in got.stderr.splitlines() if "warning:" in line]

    plain = ["-I", str(headers)]
    assert len(warnings(plain)) == 2, "the header's two warnings, seen as an -I folder"
    assert warnings([*plain, *_flags.system_includes([str(headers)])]) == []
