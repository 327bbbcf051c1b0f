"""MkDocs hooks: what the site build does besides rendering Markdown.

* Executed code blocks (markdown-exec) import ``pictures`` from this folder, so it goes on
  ``sys.path``.
* The benchmarks page: ``benchmarks/report.py`` turns the JSON files in ``docs/benchmarks/data/``
  into Markdown tables and PNG plots. Each ``<!-- benchmarks: NAME -->`` line of
  ``docs/benchmarks.md`` is replaced by that section, and the plots are added to the site as
  generated files, so nothing generated is committed and a new JSON file shows on the next build.
* After the build, every relative link of every page must lead to a file of the site, so the site
  works opened from disk (``site_links.py``).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PAGE = "benchmarks.md"
DATA = ROOT / "docs" / "benchmarks" / "data"
MARKER = re.compile(r"^<!-- benchmarks: (\w+) -->$", re.MULTILINE)

_report: Any = None


def on_config(config: Any) -> Any:
    # Here rather than at import: MkDocs restores sys.path after loading a hook module.
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return config


def _load_report() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "attnkit_bench_report", ROOT / "benchmarks" / "report.py"
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {ROOT / 'benchmarks' / 'report.py'}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def on_files(files: Files, *, config: Any) -> Files:
    global _report
    report = _load_report()
    _report = report.build(DATA)
    for name, png in _report.images.items():
        files.append(File.generated(config, f"{report.PLOTS}/{name}", content=png))
    return files


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri != PAGE:
        return markdown

    def section(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in _report.sections:
            raise ValueError(f"{PAGE}: no benchmark section {name!r}")
        return _report.sections[name]

    return MARKER.sub(section, markdown)


def on_post_build(*, config: Any) -> None:
    from site_links import broken_links

    broken = broken_links(Path(config["site_dir"]))
    if broken:
        shown = "\n  ".join(broken[:20])
        raise PluginError(
            f"{len(broken)} links of the built site lead to no file when it is opened from disk "
            f"(a folder, or nothing):\n  {shown}"
        )
