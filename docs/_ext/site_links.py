"""Links of a built site that do not lead to a file when the site is opened from disk.

Opened as ``file://.../site/index.html``, a browser follows a link to a folder (``guide/``) to a
directory listing, not to the page, and a link to a missing file (or an absolute one, ``/assets/``,
which leads to the root of the file system) to an error. The site hook runs :func:`broken_links`
after every build, so ``mkdocs build`` fails on any of them, in every page the error page
(``404.html``) included.
"""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("href", "src") and value:
                self.urls.append(value)


def broken_links(site: Path) -> list[str]:
    """``page: link`` for each relative link in the HTML pages under ``site`` that does not name
    a file there (a folder, or nothing)."""
    broken = []
    for page in sorted(site.rglob("*.html")):
        parser = _Links()
        parser.feed(page.read_text(encoding="utf-8"))
        for url in parser.urls:
            parts = urlsplit(url)
            if parts.scheme or parts.netloc or not parts.path:
                continue  # another site, data: and mailto: links, or an anchor on this page
            target = (page.parent / unquote(parts.path)).resolve()
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: {url}")
    return broken
