"""The built site's internal links, checked: every ``href`` to a page of the site
lands on a file that exists and, with a ``#fragment``, on an element of that id.

``python docs/_ext/pztrain_links.py docs/_build/html`` prints each broken link
(page: href, and why) and exits 1 if there is one. ``tests/test_docs_build.py``
runs it over the site it builds. Links to other sites are not checked.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Page(HTMLParser):
    """A page's ids (and ``<a name=>``) and the hrefs of its links."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("id", "name") if tag == "a" else ("id",):
            if attrs.get(key):
                self.ids.add(attrs[key])
        if tag == "a" and attrs.get("href"):
            self.hrefs.append(attrs["href"])


def broken_links(html: Path) -> list[str]:
    """``"<page>: <href> (why)"`` for each internal link of the site in ``html``
    that lands on no file, or on no element of its ``#fragment``."""
    html = Path(html).resolve()
    pages = {}
    for path in sorted(html.rglob("*.html")):
        page = _Page()
        page.feed(path.read_text(errors="replace"))
        pages[path] = page
    broken = []
    for path, page in pages.items():
        where = path.relative_to(html)
        for href in page.hrefs:
            url = urlsplit(href)
            if url.scheme or url.netloc:
                continue  # another site, mailto:, javascript:
            target = (path.parent / unquote(url.path)).resolve() if url.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{where}: {href} (no such file)")
            elif url.fragment and target in pages:
                if unquote(url.fragment) not in pages[target].ids:
                    broken.append(f"{where}: {href} (no such anchor)")
    return broken


if __name__ == "__main__":
    found = broken_links(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/_build/html"))
    print("\n".join(found) or "no broken internal links")
    sys.exit(1 if found else 0)
