"""The README as a front door, the API reference's coverage, and the docstring translation.

``make docs`` (part of ``make test``) builds the site strictly, which runs the tutorial and every
executed example; these tests check what a build cannot see: that the README stays short, that
every public name has a place on the reference pages, and that the reStructuredText habits of the
docstrings become the Markdown the site renders.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
import types
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

import attnkit

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"
README_LIMIT = 12_000


def test_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text) <= README_LIMIT, (
        f"README.md has {len(text)} characters (at most {README_LIMIT})"
    )
    assert "pip install" in text
    assert "make demo" in text
    assert "make test" in text
    assert ">>> " in text  # its example runs as a doctest (pyproject's testpaths)


def test_readme_links_to_pages_that_exist() -> None:
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert links
    for link in links:
        assert (ROOT / link).is_file(), link


def _directives() -> set[str]:
    """Every ``::: path`` on the reference pages."""
    found = set()
    for page in REFERENCE.glob("*.md"):
        found.update(re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.MULTILINE))
    return found


def _public_names() -> list[tuple[str, object]]:
    """(path, object) for every public name: attnkit.__all__, the __all__ of the subpackages it
    exports (and of their public submodules), attnkit.testing, and attnkit.integrations' modules
    when the package has them."""
    names: list[tuple[str, object]] = []

    def visit(prefix: str, module: types.ModuleType) -> None:
        for name in getattr(module, "__all__", []):
            if name.startswith("__"):
                continue
            obj = getattr(module, name)
            names.append((f"{prefix}.{name}", obj))
            if isinstance(obj, types.ModuleType):
                visit(f"{prefix}.{name}", obj)

    visit("attnkit", attnkit)
    names.append(("attnkit.testing", importlib.import_module("attnkit.testing")))
    if importlib.util.find_spec("attnkit.integrations") is not None:
        folder = Path(importlib.import_module("attnkit.integrations").__file__ or "").parent
        modules = [*folder.glob("[!_]*.py"), *(p.parent for p in folder.glob("[!_]*/__init__.py"))]
        for path in sorted(modules):  # modules and packages (integrations/transformers/)
            name = f"attnkit.integrations.{path.stem}"
            names.append((name, types.ModuleType(name)))
    return names


def test_every_public_name_is_on_the_reference_pages() -> None:
    rendered = _directives()
    missing = []
    for path, obj in _public_names():
        if isinstance(obj, types.ModuleType):
            if path not in rendered:
                missing.append(path)
            continue
        module, _, name = path.rpartition(".")
        canonical = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
        # A module's page renders its __all__, except a name that is also one of the package's
        # submodules (attnkit.attention): the documentation tools read the sources, where that
        # name is the submodule, so the object needs its own directive.
        parent = importlib.import_module(module)
        shadowed = (
            hasattr(parent, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None
        )
        on_module_page = module in rendered and module != "attnkit" and not shadowed
        if not (on_module_page or {path, canonical} & rendered):
            missing.append(path)
    assert not missing, f"not on any docs/reference page: {', '.join(missing)}"


def test_reference_pages_are_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in REFERENCE.glob("*.md"):
        assert f"reference/{page.name}" in nav, page.name


# ------------------------------------------------------------------------------------------------
# The griffe extension that turns the docstrings' reStructuredText habits into Markdown


@pytest.fixture(scope="module")
def rst() -> types.ModuleType:
    pytest.importorskip("griffe")
    spec = importlib.util.spec_from_file_location(
        "rst_docstrings", ROOT / "docs" / "_ext" / "rst_docstrings.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def converter(rst: types.ModuleType) -> tuple[object, object]:
    import griffe

    loader = griffe.GriffeLoader(extensions=griffe.load_extensions(rst.RstDocstrings()))
    package = loader.load("attnkit")
    extension = next(e for e in loader.extensions._extensions if isinstance(e, rst.RstDocstrings))
    return extension, package


def test_docstrings_keep_no_rst_markup(converter: tuple[object, object]) -> None:
    _, package = converter
    masks = package["masks"]
    text = masks.docstring.value
    assert not re.search(r"(?<!`)``[^`\n]+``(?!`)", text)
    assert ":func:" not in text
    assert "[`causal()`][attnkit.masks.causal]" in text
    assert "```pycon\n>>> import torch" in text


def test_literal_blocks_and_tables_become_markdown(rst: types.ModuleType) -> None:
    ext = rst.RstDocstrings()
    ext.collection, ext.public = {}, set()
    text = (
        "Drawn::\n\n    1 0\n    1 1\n\nAfter.\n\n"
        "=====  =========\n"
        "name   meaning\n"
        "=====  =========\n"
        "``a``,  the first,\n"
        "b      and more\n"
        "c      plain\n"
        "       continued\n"
        "=====  =========\n"
    )

    class Obj:
        path = "x"
        parent = None

    out = ext.convert(text, Obj())
    assert "Drawn:\n\n```text\n1 0\n1 1\n```" in out
    assert "| name | meaning |" in out
    assert "| `a`, b | the first, and more |" in out
    assert "| c | plain continued |" in out


def test_args_entry_naming_two_arguments_and_a_closing_sentence(rst: types.ModuleType) -> None:
    lines = [
        "Args:",
        "    d_model, num_heads: as for the layers.",
        "    Every other keyword argument goes to the layers,",
        "    each of them.",
        "",
        "Returns:",
    ]
    out = rst._close_arg_sections(lines)
    assert out == [
        "Args:",
        "    d_model, num_heads: as for the layers.",
        "",
        "Every other keyword argument goes to the layers,",
        "each of them.",
        "",
        "Returns:",
    ]


def test_doctest_markup_is_not_shown(rst: types.ModuleType) -> None:
    ext = rst.RstDocstrings()
    ext.collection, ext.public = {}, set()

    class Obj:
        path = "x"
        parent = None

    text = ">>> print('a\\n\\nb')  # doctest: +ELLIPSIS\na\n<BLANKLINE>\nb\n"
    out = ext.convert(text, Obj())
    assert out == "```pycon\n>>> print('a\\n\\nb')\na\n\nb\n```"


def test_signatures_show_no_private_alias(converter: tuple[object, object]) -> None:
    _, package = converter
    fn = package["attention"]["attention"]  # type: ignore[index]
    shown = " ".join(str(p.annotation) for p in fn.parameters)
    assert "_MaskArg" not in shown
    assert "_BiasArg" not in shown
    assert "Mask | None" in shown


def test_site_links_that_fail_from_disk_are_found(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "site_links", ROOT / "docs" / "_ext" / "site_links.py"
    )
    assert spec is not None
    assert spec.loader is not None
    site_links = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site_links)
    (tmp_path / "guide").mkdir()
    (tmp_path / "guide" / "masks.html").write_text('<a href="../index.html#top">home</a>')
    (tmp_path / "index.html").write_text(
        '<a href="guide/masks.html">ok</a> <a href="guide/">folder</a> <a href="#x">here</a>'
        '<img src="data:image/png;base64,AA"> <a href="https://example.org/">web</a>'
        '<script src="missing.js"></script>'
    )
    # The error page too: an absolute link leads to the root of the file system from disk.
    (tmp_path / "404.html").write_text(
        '<link href="/assets/main.css"><a href="index.html">home</a>'
    )
    assert site_links.broken_links(tmp_path) == [
        "404.html: /assets/main.css",
        "index.html: guide/",
        "index.html: missing.js",
    ]


# ------------------------------------------------------------------------------------------------
# The built site, opened from disk


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as ``make docs`` builds it (strictly), in a folder of its own; or the one it just
    built, where ``ATTNKIT_BUILT_SITE`` names its folder (``make test`` builds it before the
    tests)."""
    given = os.environ.get("ATTNKIT_BUILT_SITE")
    if given:
        built_site = ROOT / given
        assert (built_site / "index.html").is_file(), f"ATTNKIT_BUILT_SITE={given}: no site there"
        return built_site
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert built.returncode == 0, built.stderr
    return out


class _Urls(HTMLParser):
    """Every href and src of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [v for k, v in attrs if k in ("href", "src") and v]


def test_the_error_page_works_from_disk(site: Path) -> None:
    # MkDocs gives error pages absolute links (/assets/...), which from disk lead to the root of
    # the file system: the page showed unstyled, without its scripts and with a dead navigation.
    page = _Urls()
    page.feed((site / "404.html").read_text(encoding="utf-8"))
    local = [u for u in page.urls if not urlsplit(u).scheme and not urlsplit(u).netloc]
    assert any(u.endswith(".css") for u in local)
    assert any(u.endswith(".js") for u in local)
    unresolved = [
        u for u in local if urlsplit(u).path and not (site / unquote(urlsplit(u).path)).is_file()
    ]
    assert not unresolved, f"404.html links that lead to no file from disk: {unresolved}"


# Lines a code block of the README (GitHub's column) and of the home page hold without scrolling.
CODE_LINE_LIMIT = 88


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_front_door_code_lines_fit_without_a_sideways_scroll(page: str) -> None:
    long = []
    fenced = False
    for number, line in enumerate((ROOT / page).read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced and len(line) > CODE_LINE_LIMIT:
            long.append(f"{page}:{number} ({len(line)} characters)")
    assert not long, f"code lines longer than {CODE_LINE_LIMIT} characters: {', '.join(long)}"


def test_every_code_fence_of_the_pages_opens_and_closes_on_a_line_of_its_own() -> None:
    # A closing fence with text after it ("``` The loaded module ...") is no closing fence:
    # Markdown runs the code block on through the next fence, headings and all, and the page's
    # anchors below it vanish.
    pages = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
    broken = []
    for page in pages:
        inside = False
        for number, line in enumerate(page.read_text().splitlines(), start=1):
            fence = re.match(r"\s*(`{3,})(.*)$", line)
            if fence is None:
                continue
            rest = fence.group(2).strip()
            if inside and rest:  # (a line of the block, which goes on)
                broken.append(f"{page.relative_to(ROOT)}:{number}: {line.strip()[:60]}")
                continue
            inside = not inside
    assert not broken, broken
