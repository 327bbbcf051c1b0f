"""The package's structure: imports run one way, privates stay private, the map is true, and every
module has its test file."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "attnkit"
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _resolve(name: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package(name).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _top_level_imports(name: str) -> set[str]:
    """attnkit modules ``name`` imports: at import time, inside its functions, or for type
    checkers only (under ``if TYPE_CHECKING:``, which is still a dependency a reader follows and
    the first step to a runtime cycle): ``from x import y`` counts ``x.y`` when that is a module,
    else ``x``."""
    return _imports_in(name, ast.parse(MODULES[name].read_text()))


def _imports_in(name: str, tree: ast.Module) -> set[str]:
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                continue
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(node.body)
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("attnkit"))
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(name, node)
                if not target.startswith("attnkit"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in MODULES else target)

    visit(tree.body)
    return {m for m in found if m in MODULES and m != name}


def test_imports_for_type_checkers_count() -> None:
    # A cycle closed by an import under TYPE_CHECKING is a cycle all the same: the two modules
    # cannot be read, or split, one without the other.
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from .problem import Problem\n"
        "def f() -> None:\n"
        "    from .plan import Run\n"
    )
    found = _imports_in("attnkit._kernel.fused", ast.parse(source))
    assert found == {"attnkit._kernel.problem", "attnkit._kernel.plan"}


def test_there_are_no_import_cycles() -> None:
    graph = {name: _top_level_imports(name) for name in MODULES}
    # A package imports its submodules; a submodule importing a sibling goes through the
    # package's __init__ only for names it re-exports, which is not a cycle of modules.
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + "."):  # a package importing its own submodules
                continue
            if node.startswith(nxt + "."):  # a submodule importing its package's names
                continue
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for name in MODULES:
        if name not in state:
            walk(name)


def test_no_backend_imports_another() -> None:
    # A backend speaks of itself only: it prices itself (check, cost, slower) and hands a call over
    # by another backend's registered name, which the dispatcher resolves at run time. The package
    # (the built-in backends, in auto's order) and the protocol (base) are not backends.
    # A backend of several modules is a package (backends/sdpa/): its modules import each other.
    package = "attnkit.backends"
    backends = {n for n in MODULES if n.startswith(package + ".") and n != f"{package}.base"}

    def backend(name: str) -> str:
        return ".".join(name.split(".")[:3])

    problems = [
        f"{name} imports {other}"
        for name in sorted(backends)
        for other in sorted(_top_level_imports(name) & backends)
        if backend(other) != backend(name)
    ]
    assert backends
    assert not problems, "\n".join(problems)


def _private_names_used(tree: ast.Module) -> set[str]:
    """``x._name`` attributes read on anything but ``self``/``cls``/a class of the module."""
    used = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "ctx"))
        ):
            used.add(node.attr)
    return used


def _names_defined(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


# Private attributes of torch and of the standard library that attnkit reads on purpose.
_FOREIGN = {
    "_C",  # torch._C, torch's own
    "_dynamo",
    "_ambiguous",  # placeholder, never read
    "_fields",
    "_asdict",
    "_replace",
    "_get_tracing_state",
    "_is_fx_tracing",
    "_functorch",
    "_are_functorch_transforms_active",  # torch._C's, asked in attnkit._base.transforms
    "_current_level",  # torch.autograd.forward_ad's dual level, asked in attnkit._base.transforms
    "_AutoDispatchBelowAutograd",  # torch._C's: an operator call without a graph (_native.ops)
    "_get_sdp_priority_order",  # torch._C's: SDPA's order of kernels (backends/sdpa/kernels.py)
    "_subclasses",
    "_inductor",
    "_export",
    "_guards",
    "_version",  # Tensor._version: the in-place counter autograd checks
    "_base",  # Tensor._base: the tensor a view was made from
    "_assert_async",  # torch's check of a tensor's value inside a compiled graph (masks.py)
    "_Environ",  # os.environ's class: _base/env.py reads its entries raw where it is CPython's
    # nn.Module's hooks, and torch.nn.modules.module's global ones: a projection that has any
    # must run as a module, not as its weight
    "_forward_hooks",
    "_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_scaled_dot_product_flash_attention_for_cpu",  # torch.ops.aten's fused CPU kernel
    "_scaled_dot_product_flash_attention_for_cpu_backward",
}


def test_no_module_uses_another_modules_private_names() -> None:
    problems = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and _resolve(name, node).startswith("attnkit"):
                for alias in node.names:
                    sub = f"{_resolve(name, node)}.{alias.name}"
                    if alias.name.startswith("_") and sub not in MODULES:
                        problems.append(f"{name} imports {alias.name} from {_resolve(name, node)}")
        foreign = _private_names_used(tree) - _names_defined(tree) - _FOREIGN
        problems += [f"{name} reads ._{n[1:]} defined elsewhere" for n in sorted(foreign)]
    assert not problems, "\n".join(problems)


def test_every_module_is_on_the_architecture_page() -> None:
    text = DOCS.read_text()
    missing = [
        name
        for name, path in MODULES.items()
        if not re.search(rf"`{re.escape(path.relative_to(SRC).as_posix())}`", text)
    ]
    assert not missing, f"docs/architecture.md does not place: {', '.join(missing)}"


TESTS = pathlib.Path(__file__).resolve().parent

# Modules without a test file of their own, each with the tests that cover it.
NO_MIRROR = {
    "__init__.py": "the public API: every test imports it; tests/suites/test_docs.py documents its "
    "names",
    "_kernel/__init__.py": "re-exports only: tests/kernel/test_plan.py, test_forward.py",
    "_native/__init__.py": "load() and status(): tests/native/test_build.py, test_kernel.py",
    "_base/__init__.py": "a docstring only: the modules' own tests in tests/base/",
    "_base/shapes.py": "its shape checks run in every test (conftest.py turns them on); "
    "tests/test_attention.py asserts one fires",
    "caches/__init__.py": "a docstring only: the tests in tests/caches/",
    "masks/__init__.py": "the masks themselves: tests/test_masks.py",
    "modules/__init__.py": "a docstring only: the tests in tests/modules/",
    "backends/__init__.py": "the built-in backends, in auto's order: tests/test_attention.py",
    "backends/sdpa/__init__.py": "re-exports only: the tests in tests/backends/sdpa/",
    "backends/flex/__init__.py": "re-exports only: the tests in tests/backends/flex/",
    "cli/__init__.py": "the command's entry point: tests/cli/test_main.py",
    "distributed/__init__.py": "re-exports only: tests/distributed/test_ring.py",
    "flash_attn/__init__.py": "re-exports only: the tests in tests/flash_attn/",
    "integrations/__init__.py": "re-exports only: the tests in tests/integrations/transformers/",
    "integrations/transformers/__init__.py": "re-exports only: the tests in "
    "tests/integrations/transformers/",
    "interop/__init__.py": "re-exports only: the tests in tests/interop/",
}


def _mirror(relative: pathlib.PurePosixPath) -> pathlib.PurePosixPath:
    """``X/_name.py`` or ``X/name.py`` -> ``X/test_name.py``, leading underscores dropped from the
    folders too (``_kernel/forward.py`` -> ``kernel/test_forward.py``)."""
    folders = [part.removeprefix("_") for part in relative.parent.parts]
    return pathlib.PurePosixPath(*folders, "test_" + relative.name.removeprefix("_"))


def _without_mirror(modules: list[pathlib.PurePosixPath], tests: pathlib.Path) -> list[str]:
    """The modules (paths under src/attnkit) with no test file of their own under ``tests``,
    less those listed in NO_MIRROR."""
    return [
        f"src/attnkit/{relative} -> tests/{_mirror(relative)}"
        for relative in modules
        if str(relative) not in NO_MIRROR and not (tests / _mirror(relative)).is_file()
    ]


def test_every_module_has_its_mirror_test_file() -> None:
    modules = [pathlib.PurePosixPath(p.relative_to(SRC).as_posix()) for p in MODULES.values()]
    missing = _without_mirror(modules, TESTS)
    assert not missing, "modules without their test file:\n" + "\n".join(missing)


def test_the_mirror_rule_names_a_module_without_a_test_file(tmp_path: pathlib.Path) -> None:
    # A leading underscore is dropped from the file and its folders, once: __main__.py is
    # tested in test__main__.py.
    modules = [
        pathlib.PurePosixPath(p)
        for p in ("__main__.py", "_kernel/forward.py", "distributed/_comm.py", "masks.py")
    ]
    for test_file in ("test__main__.py", "kernel/test_forward.py", "test_masks.py"):
        (tmp_path / test_file).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / test_file).touch()
    assert _without_mirror(modules, tmp_path) == [
        "src/attnkit/distributed/_comm.py -> tests/distributed/test_comm.py"
    ]
    (tmp_path / "test__main__.py").unlink()
    assert (
        _without_mirror(modules, tmp_path)[0] == "src/attnkit/__main__.py -> tests/test__main__.py"
    )


# The suites that cut across modules (fuzzing, the promises, precision, deployment, the docs, the
# package, ...) live in tests/suites/; every other test file is the mirror of a module, or of a
# package as one file (tests/X/test_pkg.py for src/attnkit/X/pkg/), or is listed here with what it
# tests.
SUITES = "suites"
NOT_A_MIRROR = {
    "test_architecture.py": "the package's structure: imports, privates, the map, the mirrors",
    "test_merge.py": "merge_attention, of attention.py",
    "cli/test_main.py": "cli/__init__.py: the command's entry point",
    "distributed/test_ddp.py": "distributed/backend.py under DistributedDataParallel",
    "interop/test_hyperparameters.py": "every loader of interop/: each number it copies",
    "integrations/transformers/test_families.py": "integrations/transformers/ in whole models of "
    "the families with unusual attention (sinks, chunks, NoPE, encoders, encoder-decoders)",
    "native/test_decode.py": "the native kernel's decode path (_native/csrc/decode.cpp)",
    "native/test_matrix_unit.py": "bfloat16 products: AMX, AVX512-BF16 (csrc/matrix_unit.h)",
    "native/test_softcap_bias.py": "the native kernel with softcap and something added to scores",
    "native/test_threads.py": "how the native kernel shares a call between threads (csrc/share.h)",
}


def _mirrored() -> set[pathlib.PurePosixPath]:
    """The test files that mirror a module or a package."""
    found = set()
    for path in MODULES.values():
        relative = pathlib.PurePosixPath(path.relative_to(SRC).as_posix())
        found.add(_mirror(relative))
        if relative.name == "__init__.py" and len(relative.parts) > 1:
            found.add(_mirror(relative.parent.with_suffix(".py")))
    return found


def test_every_test_file_outside_the_suites_mirrors_a_module() -> None:
    mirrored = _mirrored()
    stray = [
        f"tests/{relative}"
        for path in sorted(TESTS.rglob("test_*.py"))
        if (relative := pathlib.PurePosixPath(path.relative_to(TESTS).as_posix())).parts[0]
        != SUITES
        and str(relative) not in NOT_A_MIRROR
        and relative not in mirrored
    ]
    assert not stray, (
        "test files that mirror no module (a suite that cuts across modules goes in "
        "tests/suites/):\n" + "\n".join(stray)
    )


def test_the_test_files_listed_as_no_mirror_exist_and_are_none() -> None:
    # A stale entry (a test file moved, or a module added that it mirrors) would hide the next one.
    mirrored = _mirrored()
    for name in NOT_A_MIRROR:
        assert (TESTS / name).is_file(), f"NOT_A_MIRROR lists tests/{name}, which is not a file"
        assert pathlib.PurePosixPath(name) not in mirrored, f"tests/{name} mirrors a module"


def test_the_modules_without_a_mirror_exist_and_have_none() -> None:
    # A stale entry (a module renamed, or a test file added since) would hide the next one.
    for name in NO_MIRROR:
        relative = pathlib.PurePosixPath(name)
        assert (SRC / relative).is_file(), f"NO_MIRROR lists {name}, which is not a module"
        if relative.name != "__init__.py":
            assert not (TESTS / _mirror(relative)).is_file(), (
                f"{name} has tests/{_mirror(relative)}"
            )


# A function is long only in its signature and docstring: a body of more lines than this is
# several steps, which read better as functions named after them.
MAX_BODY_LINES = 80


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the end of the function."""
    body = node.body[1:] if ast.get_docstring(node, clean=False) is not None else node.body
    if not body:
        return 0
    return (body[-1].end_lineno or body[-1].lineno) - body[0].lineno + 1


def test_body_lines_count_from_after_the_docstring_to_the_end() -> None:
    source = (
        'def f(\n    x: int,\n) -> int:\n    """Doc.\n\n    More.\n    """\n'
        "    y = x\n\n    return y\n"
    )
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.FunctionDef)
    assert _body_lines(node) == 3
    (bare,) = ast.parse('def g():\n    """Only a docstring."""\n').body
    assert isinstance(bare, ast.FunctionDef)
    assert _body_lines(bare) == 0


def test_no_function_body_is_longer_than_80_lines() -> None:
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = _body_lines(node)
                if lines > MAX_BODY_LINES:
                    where = f"{path.relative_to(SRC).as_posix()}:{node.lineno}"
                    long.append(f"{where} {node.name}: a body of {lines} lines")
    assert not long, (
        f"functions whose body (after the docstring) is over {MAX_BODY_LINES} lines; name their "
        "steps:\n" + "\n".join(long)
    )


# The native kernel's C++ is split by concept (register tiles, pages, the step loop, the split-K
# merge, ...): a file over this many lines holds several, which read better as files named after
# them.
MAX_CPP_LINES = 700
CSRC = SRC / "_native" / "csrc"


def _long_cpp_files(folder: pathlib.Path) -> list[str]:
    """The C++ sources and headers in ``folder`` over MAX_CPP_LINES lines, with their counts."""
    sources = sorted([*folder.glob("*.cpp"), *folder.glob("*.h")])
    counts = {path.name: len(path.read_text().splitlines()) for path in sources}
    return [f"{name}: {n} lines" for name, n in counts.items() if n > MAX_CPP_LINES]


def test_the_cpp_rule_names_a_long_file(tmp_path: pathlib.Path) -> None:
    (tmp_path / "long.cpp").write_text("int x;\n" * (MAX_CPP_LINES + 1))
    (tmp_path / "long.h").write_text("int y;\n" * (MAX_CPP_LINES + 2))
    (tmp_path / "short.h").write_text("int z;\n" * MAX_CPP_LINES)
    (tmp_path / "notes.txt").write_text("words\n" * (MAX_CPP_LINES + 1))
    assert _long_cpp_files(tmp_path) == ["long.cpp: 701 lines", "long.h: 702 lines"]


def test_no_cpp_file_of_the_kernel_is_over_700_lines() -> None:
    assert any(CSRC.glob("*.cpp")), f"no C++ sources in {CSRC}"
    long = _long_cpp_files(CSRC)
    assert not long, (
        f"C++ files of the native kernel over {MAX_CPP_LINES} lines; split them by concept:\n"
        + "\n".join(long)
    )


# The kernel's two rooms: _kernel owns the plan and the choice of kernel, _native the build, the
# operators and their marshalling. _native reads the plan's types and nothing else of _kernel (not
# the package either, which holds the eager kernel).
NATIVE_READS_OF_KERNEL = {"attnkit._kernel.plan"}


def test_native_imports_only_the_plan_from_kernel() -> None:
    problems = [
        f"{name} imports {other}"
        for name in sorted(n for n in MODULES if n.startswith("attnkit._native"))
        for other in sorted(_top_level_imports(name))
        if other.startswith("attnkit._kernel") and other not in NATIVE_READS_OF_KERNEL
    ]
    assert not problems, "\n".join(problems)


# Who may call the kernel's entry points: the plan has one maker, and the kernel is run by the
# kernel's own modules and the backends. Modules and front ends call attention().
KERNEL_CALLS = {
    "BlockPlan": ("_kernel/planning.py",),
    "native_call": ("_kernel/", "_native/", "backends/"),
    "cache_attention": ("_kernel/", "backends/"),
}
# (ring attention's pairs of shards run through _kernel/rect.py, the kernel on a rectangle of a
# call: no caller outside the kernel and the backends is left)
KERNEL_CALLERS_KNOWN: set[tuple[str, str]] = set()


def _calls_of(tree: ast.Module, names: set[str]) -> set[str]:
    """Which of ``names`` ``tree`` calls, as ``name(...)`` or ``x.name(...)``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            called = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            if called in names:
                found.add(called)
    return found


def test_the_call_finder_sees_both_spellings() -> None:
    tree = ast.parse("a = native_call(p, g)\nb = cache.cache_attention(q)\nc = BlockPlan\n")
    assert _calls_of(tree, set(KERNEL_CALLS)) == {"native_call", "cache_attention"}


def test_only_the_kernel_and_the_backends_run_the_kernel() -> None:
    problems = []
    for path in MODULES.values():
        relative = path.relative_to(SRC).as_posix()
        for called in sorted(_calls_of(ast.parse(path.read_text()), set(KERNEL_CALLS))):
            allowed = relative.startswith(KERNEL_CALLS[called])
            if not allowed and (relative, called) not in KERNEL_CALLERS_KNOWN:
                problems.append(f"{relative} calls {called}")
    assert not problems, "\n".join(problems)


def test_the_known_kernel_callers_still_call_it() -> None:
    # A stale entry (a caller moved to attention()) would hide the next one.
    for relative, called in KERNEL_CALLERS_KNOWN:
        assert called in _calls_of(ast.parse((SRC / relative).read_text()), {called}), relative


# The top level holds the door (attention.py), the call, what a call adds to the scores, and the
# front ends that are one file; every other concept has its folder.
MAX_TOP_LEVEL_MODULES = 15


def test_the_top_level_stays_small() -> None:
    top = sorted(p.name for p in SRC.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} top-level modules: {', '.join(top)}"
