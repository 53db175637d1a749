"""Turns a guide's ```python blocks into MyST-NB code cells, executed at build time.

Usage (from the repository's root)::

    python docs/_tools/to_mystnb.py docs/guides/fit.md [more.md ...]

For each page it

* adds the front matter that makes myst-nb execute the page as a notebook
  (``file_format: mystnb`` and a ``python3`` kernel), unless the page has it;
* turns each top-level ```python fence into a ```{code-cell} ipython3 fence
  (fences nested in a ````markdown example stay as they are; ``text``,
  ``console`` and ``bash`` fences stay shown, not run);
* takes the test scaffolding out of the reader's code: a top-level ``assert``,
  or a ``for`` loop whose body holds only asserts, is removed from its cell and
  printed as an entry of ``CHECKS`` in ``tests/docs_checks.py`` (paste it
  there): the test runs the check right after the cell that holds the entry's
  anchor, a line of that cell's code. A cell left with nothing is dropped (its
  checks anchor to the cell before it).

It rewrites the page in place and prints what it moved, then the lines of test
scaffolding it could not move, for an author: a ``try``/``except``/``else: raise
AssertionError`` that shows an error reads better as a cell tagged
``raises-exception`` holding only the failing call (the page shows the error; a
check reads it as ``sys.last_value``); ``np.testing`` calls; an import only the
asserts used (``re``, say); prose that says "the assert below". A check runs
after its whole cell: if the cell later rebinds a name the assert read, print
the value in the cell instead. A value an assert checked reads better as the
cell's last expression, so the page shows it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from markdown_it import MarkdownIt

# What the reader should not see in a cell: a check (moved to tests by hand when
# it is not a top-level assert).
_SCAFFOLDING = ("assert ", "np.testing.", "AssertionError", "pytest")

FRONT_MATTER = """---
file_format: mystnb
kernelspec:
  name: python3
  display_name: Python 3
---

"""


def _checks_out(code: str) -> tuple[str, list[str]]:
    """The cell's code without its top-level asserts, and the asserts' source."""
    tree = ast.parse(code)
    lines = code.splitlines()
    drop, checks = set(), []
    for node in tree.body:
        only_asserts = isinstance(node, ast.For) and all(
            isinstance(n, ast.Assert) for n in node.body
        )
        if isinstance(node, ast.Assert) or only_asserts:
            span = range(node.lineno - 1, node.end_lineno)
            checks.append("\n".join(lines[i] for i in span))
            drop.update(span)
    kept = [line for i, line in enumerate(lines) if i not in drop]
    while kept and not kept[-1].strip():
        kept.pop()
    return "\n".join(kept) + "\n" if kept else "", checks


def _anchor(code: str, page_code: str) -> str:
    """A line of ``code`` found once in the page: the longest such line."""
    candidates = sorted(
        (line.strip() for line in code.splitlines() if line.strip()),
        key=len,
        reverse=True,
    )
    for line in candidates:
        if page_code.count(line) == 1:
            return line
    return candidates[0]


def convert(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The page as MyST-NB text, and its (anchor, check) pairs."""
    lines = text.splitlines(keepends=True)
    fences = [
        tok
        for tok in MarkdownIt("commonmark").parse(text)
        if tok.type == "fence" and tok.info.strip().split(" ")[0] == "python"
    ]
    page_code = "".join(tok.content for tok in fences)
    checks: list[tuple[str, str]] = []
    for tok in reversed(fences):  # from the end: line numbers stay valid
        start, end = tok.map
        code, moved = _checks_out(tok.content)
        fence = tok.markup
        cell = [f"{fence}{{code-cell}} ipython3\n", code, f"{fence}\n"] if code else []
        lines[start:end] = cell
        checks[:0] = [(tok.content, check) for check in moved]
    pairs, previous = [], None
    kept_cells = [(tok.content, _checks_out(tok.content)[0]) for tok in fences]
    for original, code in kept_cells:  # each check: after its own cell, or before
        anchor_cell = code or previous
        for source, check in checks:
            if source == original:
                if anchor_cell is None:
                    raise ValueError(f"a check before any code cell: {check!r}")
                pairs.append((_anchor(anchor_cell, page_code), check))
        previous = anchor_cell
    out = "".join(lines)
    if not out.startswith("---\n"):
        out = FRONT_MATTER + out
    return out, pairs


def main(paths: list[str]) -> None:
    for name in paths:
        path = Path(name)
        text, pairs = convert(path.read_text())
        path.write_text(text)
        print(
            f"# {path}: {len(pairs)} checks moved; add to tests/docs_checks.py CHECKS:"
        )
        print(f'"{path.name}": [')
        for anchor, check in pairs:
            print(f"    ({anchor!r}, {check!r}),")
        print("],")
        left = [
            f"{path}:{i}: {line.strip()}"
            for i, line in enumerate(text.splitlines(), 1)
            if any(word in line for word in _SCAFFOLDING)
        ]
        if left:
            print(f"# {path}: test scaffolding left in its cells, for an author:")
            print("\n".join(f"#   {line}" for line in left))


if __name__ == "__main__":
    main(sys.argv[1:])
