"""A griffe extension: attnkit's docstrings, written in reStructuredText habits, as Markdown.

attnkit's docstrings are read in three places: ``help()`` in a terminal, the doctests, and this
site. They keep the reStructuredText habits that read well in the first two (double-backtick
literals, ``:func:`name``` roles, ``::`` literal blocks, simple tables); this extension rewrites
each docstring as Markdown before mkdocstrings parses it, so the sources stay as they are:

* ````x```` becomes a code span;
* ``:func:`name```, ``:class:``, ``:meth:``, ``:mod:``, ``:attr:`` become cross-references to the
  API reference when ``name`` resolves (relative to the object, as Sphinx resolves it) to a public
  object, which the reference pages render; otherwise a code span (``contextvars``, private
  helpers). ``~`` keeps only the last component as the title, as in Sphinx;
* a paragraph ending in ``::`` and the indented block after it become a fenced text block;
* doctest blocks (``>>>``) become fenced ``pycon`` blocks, without what only the doctest runner
  reads: ``<BLANKLINE>`` becomes the blank line it stands for, and ``# doctest: +FLAG``
  comments go;
* simple tables (``====  ====`` rules) become Markdown tables.

Signatures show no private names: a parameter annotated with a private alias of the module
(``mask: _MaskArg``) shows the alias's value (``Bool[Tensor, ...] | Mask | None``).

Public means: a name in ``attnkit.__all__``, in the ``__all__`` of an exported subpackage (or a
public submodule of one), ``attnkit.testing``, and the public members of those classes. The test
``tests/suites/test_docs.py`` checks that the reference pages render every one of them, so a link
made here always has a target and ``mkdocs build --strict`` fails on any other.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import griffe

_log = logging.getLogger("mkdocs.plugins.attnkit.rst_docstrings")

# Modules documented besides those attnkit.__all__ reaches, with their members.
EXTRA_PUBLIC = ("attnkit.testing",)
# Modules whose docstring alone is on the reference pages (their members are reached elsewhere).
MODULE_DOCS = (
    "attnkit._kernel.plan",
    "attnkit._kernel.problem",
    "attnkit._kernel.forward",
    "attnkit._kernel.backward",
    "attnkit._kernel.fused",
    "attnkit._kernel.merge",
    "attnkit._kernel.sinks",
)

_INLINE = re.compile(r":(?P<role>[a-z]+):`(?P<tilde>~?)(?P<target>[^`]+)`|``(?P<literal>[^`]+?)``")
_RULE = re.compile(r"^\s*=+( +=+)+\s*$")
_ARG = re.compile(r"^\s*\*{0,2}\w+(, \*{0,2}\w+)*( \([^)]*\))?:(\s|$)")
_ITEM_HEAD = re.compile(r"^\s*\*?\*?[\w.]+( \([^)]*\))?:( |$)")
_DOCTEST_DIRECTIVE = re.compile(r"\s*# doctest:[^#]*$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


class RstDocstrings(griffe.Extension):
    """Rewrite the docstrings of a loaded package from reStructuredText habits to Markdown."""

    def on_package(
        self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: object
    ) -> None:
        if pkg.path != "attnkit":
            return
        self.collection = loader.modules_collection
        self.public = _public_paths(pkg, self.collection)
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = self.convert(obj.docstring.value, obj)
            if obj.is_function:
                _expand_private_aliases(obj)  # type: ignore[arg-type]

    # ---------------------------------------------------------------------------------------------

    def convert(self, text: str, obj: griffe.Object) -> str:
        lines = _close_arg_sections(text.splitlines())
        out: list[str] = []
        prose: list[str] = []

        def flush() -> None:
            if prose:
                out.extend(self._inline("\n".join(prose), obj).split("\n"))
                prose.clear()

        i = 0
        while i < len(lines):
            line = lines[i]
            stripped = line.strip()
            if stripped.startswith(">>>"):
                flush()
                j = i
                while j < len(lines) and lines[j].strip():
                    j += 1
                block = [_doctest_only_removed(ln) for ln in lines[i:j]]
                out.extend(_fence("pycon", block, _indent(line), blank_before=out))
                i = j
                continue
            if _RULE.match(line) and _is_table(lines, i):
                flush()
                j = _table_end(lines, i)
                table = _table(lines[i : j + 1])
                out.extend(" " * _indent(line) + self._inline(row, obj) for row in table)
                i = j + 1
                continue
            if stripped.endswith("::") and not stripped.startswith(">>>"):
                block_start = i + 1
                while block_start < len(lines) and not lines[block_start].strip():
                    block_start += 1
                if block_start < len(lines) and _indent(lines[block_start]) > _indent(line):
                    # The ``::`` paragraph, with one colon left (RST drops "::" alone).
                    head = line.rstrip()[:-1]
                    if head.strip() == ":":
                        head = ""
                    prose.append(head)
                    flush()
                    body_indent = _indent(lines[block_start])
                    j = block_start
                    while j < len(lines) and (
                        not lines[j].strip() or _indent(lines[j]) >= body_indent
                    ):
                        j += 1
                    while lines[j - 1].strip() == "":
                        j -= 1
                    fence_indent = max(
                        _indent(line) if not _ITEM_HEAD.match(line) else _indent(line) + 4,
                        body_indent - 4,
                    )
                    out.extend(_fence("text", lines[block_start:j], fence_indent, blank_before=out))
                    i = j
                    continue
            prose.append(line)
            i += 1
        flush()
        return "\n".join(out)

    def _inline(self, text: str, obj: griffe.Object) -> str:
        def repl(m: re.Match[str]) -> str:
            if m.group("literal") is not None:
                return _code(m.group("literal"))
            role, target = m.group("role"), m.group("target").strip()
            title = target.rsplit(".", 1)[-1] if m.group("tilde") else target
            if role in ("func", "meth") and not title.endswith(")"):
                title += "()"
            path = self.resolve(target.removesuffix("()"), obj, role)
            if path is None:
                _log.debug("%s: :%s:`%s` left as code", obj.path, role, target)
                return _code(title)
            return f"[{_code(title)}][{path}]"

        return _INLINE.sub(repl, text)

    def resolve(self, name: str, obj: griffe.Object, role: str) -> str | None:
        """The canonical path of the public object ``name`` means where ``obj`` says it."""
        scopes = []
        o: griffe.Object | None = obj
        while o is not None:
            scopes.append(o.path)
            o = o.parent  # type: ignore[assignment]
        candidates = [name] if name.split(".")[0] == "attnkit" else []
        candidates += [f"{scope}.{name}" for scope in scopes]
        for path in candidates:
            try:
                target = self.collection.get_member(path)
            except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
                continue
            target = _final(target)
            if target is None:
                continue
            if role in ("func", "class", "meth"):
                target = _final(_shadowed(target)) or target
            if target.path in self.public:
                return target.path
        return None


def _close_arg_sections(lines: list[str]) -> list[str]:
    """End an ``Args:`` section at a paragraph that is not an argument.

    The docstrings sometimes close their argument list with a sentence about the remaining
    arguments at the items' indentation; Google-style parsers read it as a malformed item, so it
    is moved out of the section (dedented, after a blank line).
    """
    out: list[str] = []
    header = item = None
    moving = 0
    for line in lines:
        stripped = line.strip()
        if moving:
            if stripped:
                out.append(line[moving:] if _indent(line) >= moving else line.lstrip())
                continue
            moving = 0
            header = item = None
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            header, item = _indent(line), None
        elif header is not None and stripped:
            if item is None:
                item = _indent(line)
            elif _indent(line) < item:
                header = item = None
            elif _indent(line) == item and not _ARG.match(line):
                out.append("")
                moving = item - header
                out.append(line[moving:])
                continue
        out.append(line)
    return out


def _doctest_only_removed(line: str) -> str:
    """A doctest line as a reader sees it: ``<BLANKLINE>`` is a blank line, and a ``# doctest:``
    directive is for the test runner."""
    if line.strip() == "<BLANKLINE>":
        return ""
    return _DOCTEST_DIRECTIVE.sub("", line)


def _expand_private_aliases(func: griffe.Function) -> None:
    """Annotations naming a private alias of the function's module show the alias's value."""
    for param in func.parameters:
        ann = param.annotation
        if not isinstance(ann, griffe.ExprName) or not ann.name.startswith("_"):
            continue
        target = func.module.members.get(ann.name)
        if target is None or target.is_alias or not target.is_attribute:
            continue
        value = target.value  # type: ignore[union-attr]
        if isinstance(value, griffe.Expr):
            param.annotation = value


def _code(text: str) -> str:
    ticks = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def _fence(lang: str, block: list[str], indent: int, *, blank_before: list[str]) -> list[str]:
    body = [ln for ln in block]
    strip = min((_indent(ln) for ln in body if ln.strip()), default=0)
    pad = " " * indent
    fenced = [f"{pad}```{lang}"] + [pad + ln[strip:] if ln.strip() else "" for ln in body]
    fenced += [f"{pad}```"]
    return ([""] if blank_before and blank_before[-1].strip() else []) + fenced


def _is_table(lines: list[str], i: int) -> bool:
    return any(_RULE.match(ln) for ln in lines[i + 1 : i + 4])


def _table_end(lines: list[str], start: int) -> int:
    """Index of the closing rule of the simple table opening at ``start``."""
    rules = 0
    for j in range(start, len(lines)):
        if _RULE.match(lines[j]):
            rules += 1
            if rules == 3:
                return j
    raise ValueError(f"unclosed table at line {start}")


def _table(lines: list[str]) -> list[str]:
    """A reStructuredText simple table (header, rules, rows) as Markdown rows.

    Columns start where the rule's runs of ``=`` start; a line whose first column is blank
    continues the row above, and so does one after a first cell that ends with a comma (the
    docstrings wrap long cells that way).
    """
    rule = lines[0]
    starts = [m.start() for m in re.finditer(r"=+", rule)]
    body = [ln for ln in lines if not _RULE.match(ln)]

    def cells(line: str) -> list[str]:
        line = line.rstrip()
        if all(s == 0 or s > len(line) or line[s - 1] == " " for s in starts):
            bounds = [*starts[1:], len(line)]
            return [line[a:b].strip() for a, b in zip(starts, bounds, strict=True)]
        # A cell wider than its rule: split at the runs of two spaces instead.
        parts = re.split(r"\s{2,}", line.strip(), maxsplit=len(starts) - 1)
        return parts + [""] * (len(starts) - len(parts))

    header, rows = cells(body[0]), []
    for line in body[1:]:
        if not line.strip():
            continue
        first_blank = len(line) - len(line.lstrip()) >= starts[1]
        if rows and (first_blank or rows[-1][0].endswith(",")):
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells(line), strict=True)]
        else:
            rows.append(cells(line))

    def row(cs: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cs) + " |"

    return (
        ["", row(header), "| " + " | ".join("---" for _ in starts) + " |"]
        + [row(r) for r in rows]
        + [""]
    )


def _final(obj: griffe.Object | griffe.Alias) -> griffe.Object | None:
    if not obj.is_alias:
        return obj  # type: ignore[return-value]
    try:
        return obj.final_target  # type: ignore[union-attr]
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _shadowed(obj: griffe.Object | griffe.Alias) -> griffe.Object | griffe.Alias:
    """The function or class a package exports under the name of one of its modules.

    ``from .attention import attention`` makes ``attnkit.attention`` the function at run time,
    while the sources (and griffe) see the module ``attnkit/attention.py`` under that name.
    """
    if obj.is_alias or not obj.is_module or obj.name not in obj.members:
        return obj
    if obj.members[obj.name].is_alias:  # ``import torch`` inside ``attnkit/interop/torch.py``
        return obj
    if not obj.members[obj.name].is_module:
        return obj.members[obj.name]
    return obj


def _walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    """``obj`` and every object defined inside it (aliases are someone else's)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)  # type: ignore[arg-type]


def _public_paths(pkg: griffe.Module, collection: griffe.ModulesCollection) -> set[str]:
    """Canonical paths of everything the API reference renders."""
    public: set[str] = set()

    def add(obj: griffe.Object | griffe.Alias | None) -> None:
        target = None if obj is None else _final(obj)
        if target is None or target.path in public or target.package.path != "attnkit":
            return
        if target.path != "attnkit":
            public.add(target.path)
        if target.is_module:
            names = target.exports
            if names is None:
                names = [n for n, m in target.members.items() if not m.is_alias]
            for n in names:
                if n in target.members and not n.startswith("__"):
                    add(_shadowed(target.members[n]))
        elif target.is_class:
            for n, member in target.members.items():
                if not n.startswith("_") and not member.is_alias:
                    add(member)

    add(pkg)
    for path in EXTRA_PUBLIC:
        add(collection.get_member(path))
    public.update(MODULE_DOCS)
    return public
