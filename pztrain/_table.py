"""Tables as text within a width, and as HTML: the layout of ``state.summary()``.

One column of a table may wrap: its long cells are broken after a ``/``, ``.``
or ``,`` (inside a word only when there is none) onto lines of their own, so
that the table fits ``width`` columns when its other columns leave room.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence

__all__ = ["html_table", "text_table", "wrap_cell"]

WIDTH = 100  # columns of a text table (a terminal, a notebook's text output)
_NUMERIC = {"count", "bytes", "arrays", "values", "per device"}
_BREAK = re.compile(r"(?<=[/.,])")  # break after a separator
_HTML_BREAK = re.compile(r"(?<=[/.,(])")  # and, in HTML, after a "(" too


def wrap_cell(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken after a ``/``,
    ``.`` or ``,`` where it can be (a part longer than ``width`` is cut).

    Example:
      >>> wrap_cell("decoder/block_0/attention/query.weights", 20)
      ['decoder/block_0/', 'attention/query.', 'weights']
      >>> wrap_cell("short", 20)
      ['short']
    """
    lines: list[str] = []
    line = ""
    for part in _BREAK.split(text):
        while len(part) > width:  # no separator for too long: cut
            if line:
                lines.append(line)
                line = ""
            lines.append(part[:width])
            part = part[width:]
        if len(line) + len(part) > width:
            lines.append(line)
            line = ""
        line += part
    return [*lines, line] if line or not lines else lines


def text_table(
    header: Sequence[str],
    cells: Sequence[Sequence[str]],
    wrap: str,
    width: int = WIDTH,
) -> str:
    """A text table with aligned columns, numbers to the right, at most
    ``width`` characters a line when the column named ``wrap`` may be narrowed
    to fit (to no less than its header or 16 characters)."""
    wrap_at = list(header).index(wrap)
    widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]
    others = sum(widths) - widths[wrap_at] + 2 * (len(header) - 1)
    room = max(width - others, len(header[wrap_at]), 16)
    widths[wrap_at] = min(widths[wrap_at], room)

    def line(cell: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if h in _NUMERIC else c.ljust(w)
            for c, w, h in zip(cell, widths, header, strict=True)
        ]
        return "  ".join(parts).rstrip()

    lines = [line(header), "  ".join("-" * w for w in widths)]
    for cell in cells:
        first, *more = _wrapped(cell[wrap_at], widths[wrap_at])
        lines.append(line([*cell[:wrap_at], first, *cell[wrap_at + 1 :]]))
        blank = [""] * len(header)
        lines += [line([*blank[:wrap_at], m, *blank[wrap_at + 1 :]]) for m in more]
    return "\n".join(lines)


def _wrapped(text: str, width: int) -> list[str]:
    """A cell's lines: the first as wide as the column, the others indented."""
    if len(text) <= width:
        return [text]
    first = wrap_cell(text, width)[0]
    return [first, *("  " + m for m in wrap_cell(text[len(first) :], width - 2))]


def html_table(
    header: Sequence[str], cells: Sequence[Sequence[str]], wrap: str | None = None
) -> str:
    """The same table in HTML. The column named ``wrap`` may break where the
    text table's does, after a ``/``, ``.`` or ``,``, and after a ``(``
    (inside a word only if it must): its cells wrap in a narrow page instead
    of being cut.

    Example:
      >>> table = html_table(["part", "contents"], [["opt", "Adam(A, B)"]], "contents")
      >>> table.count("overflow-wrap: anywhere"), "Adam(<wbr>A,<wbr> B)" in table
      (1, True)
    """
    wrap_at = list(header).index(wrap) if wrap is not None else None
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            _WRAP_TD + "<wbr>".join(map(html.escape, _HTML_BREAK.split(c))) + "</td>"
            if i == wrap_at
            else f"<td>{html.escape(c)}</td>"
            for i, c in enumerate(cell)
        )
        + "</tr>"
        for cell in cells
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# wraps at its <wbr>s, inside a word only if it must, never under 16 characters:
# "anywhere" (not "break-word") lets a table's layout narrow the column below its
# longest word (InjectStatefulHyperparamsState), so the table fits the page
_WRAP_TD = '<td style="white-space: normal; overflow-wrap: anywhere; min-width: 16ch">'
