"""Each example block of the API reference pastes alone into the Python REPL.

A reader copies one block of the reference (the copy button drops the ``>>> ``
and ``... `` prompts and the outputs: ``docs/conf.py``) and pastes it into the
REPL of the lowest supported Python, 3.11, which reads it line by line. Doctest
runs each ``>>>`` statement on its own; the REPL does not: a ``def``, ``for`` or
``with`` block directly followed by another statement is a ``SyntaxError`` there
(the block ends only at a blank line, written ``...`` in a docstring), and a
block that uses what an earlier block of the same docstring defined fails with
a ``NameError``.

So every block (a run of ``>>>`` lines up to a blank line) of every public
docstring, module docstrings included, is fed to ``code.InteractiveConsole``
line by line as the REPL would read it. The fast checks compile it as the REPL
does and read the names it uses; the slow one runs each block in a fresh
console, and a block fails on any exception but the one its example shows.
"""

from __future__ import annotations

import code
import contextlib
import doctest
import importlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from test_docstring_examples_paste import MODULES, examples, unbound_names

ROOT = Path(__file__).resolve().parents[1]


class Block(NamedTuple):
    """One example block: the lines a reader pastes and the doctest examples.

    Attributes:
        lines: each pasted line with the index of the example it belongs to:
            the copy button keeps the ``>>>`` and ``...`` lines without their
            prompts (a bare ``...`` is a blank line) and drops the outputs.
        examples: the block's examples as doctest reads them.
    """

    lines: list[tuple[int, str]]
    examples: list[doctest.Example]


def docstring_blocks(docstring: str) -> list[Block]:
    """The example blocks of a docstring.

    A block starts at a ``>>>`` line and ends at the first blank line, as the
    docstring renders it (one copy button a block).
    """
    blocks, current = [], None
    for line in docstring.splitlines() + [""]:
        if current is None and line.lstrip().startswith(">>>"):
            current = []
        if current is not None and not line.strip():
            blocks.append(_block(current))
            current = None
        elif current is not None:
            current.append(line.lstrip())
    return blocks


def _block(raw: list[str]) -> Block:
    lines, index = [], -1
    for line in raw:
        if line.startswith(">>>"):
            index += 1
        if line.startswith((">>>", "...")) and line[3:4] in ("", " "):
            lines.append((index, line[4:]))
    examples = doctest.DocTestParser().get_examples("\n".join(raw))
    return Block(lines, examples)


def blocks() -> dict[str, Block]:
    """Every example block of the public docstrings, by ``name[index]``."""
    found = {}
    for test in examples():
        for i, block in enumerate(docstring_blocks(test.docstring or "")):
            found[f"{test.name}[{i}]"] = block
    return found


class PasteConsole(code.InteractiveConsole):
    """A console that records the errors it would print instead of printing.

    ``run=False`` compiles each statement as the REPL does and runs none.
    """

    def __init__(self, run: bool):
        super().__init__({"__name__": "__console__", "__doc__": None})
        self.run, self.errors = run, []

    def runcode(self, code_object):
        if self.run:
            try:
                exec(code_object, self.locals)
            except SystemExit:
                raise
            except BaseException as error:  # the REPL prints it and goes on
                self.errors.append(f"{type(error).__name__}: {error}")

    def showsyntaxerror(self, filename=None, **kwargs):
        error = sys.exc_info()[1]
        self.errors.append(f"SyntaxError: {error.msg} (line {error.text!r})")

    def showtraceback(self):
        error = sys.exc_info()[1]
        self.errors.append(f"{type(error).__name__}: {error}")


def paste(block: Block, run: bool) -> list[str]:
    """Feed a block to a fresh console line by line, as pasted, then Enter.

    Returns the errors the REPL would print, but for an exception the block's
    example shows (its output starts with ``Traceback``).
    """
    console, unexpected = PasteConsole(run), []
    last = block.lines[-1][0]
    for index, line in [*block.lines, (last, "")]:
        before = len(console.errors)
        with contextlib.redirect_stdout(io.StringIO()):
            console.push(line)
        shows = block.examples[index].exc_msg is not None
        for error in console.errors[before:]:
            if not (shows and not error.startswith("SyntaxError")):
                unexpected.append(error)
    return unexpected


def _report(failed: dict[str, list[str]]) -> str:
    return "\n".join(
        f"  {name}: {'; '.join(errors)}" for name, errors in failed.items()
    )


def test_every_block_compiles_pasted_into_the_repl():
    failed = {}
    for name, block in blocks().items():
        errors = paste(block, run=False)
        if errors:
            failed[name] = errors
    assert not failed, (
        f"{len(failed)} docstring example blocks are a SyntaxError pasted into the "
        "Python REPL, which reads them line by line: end each def/for/with/if "
        "block with a '...' line (blank) before the next '>>>' statement:\n"
        + _report(failed)
    )


def test_every_block_imports_what_it_uses_by_itself():
    missing = {}
    for name, block in blocks().items():
        names = unbound_names("\n".join(line for _, line in block.lines))
        if names:
            missing[name] = names
    assert not missing, (
        "these docstring example blocks use names that only an earlier block "
        "of the same docstring (or nothing) binds, so they fail pasted alone "
        "(NameError): make each block import and build what it uses:\n"
        + "\n".join(f"  {name}: {', '.join(names)}" for name, names in missing.items())
    )


def test_module_docstrings_are_covered():
    names = {test.name for test in examples()}
    with_examples = [
        module
        for module in MODULES
        if ">>>" in (importlib.import_module(module).__doc__ or "")
    ]
    assert with_examples, "no module docstring has an example: the check is moot"
    assert set(with_examples) <= names


def test_the_paste_finds_a_block_without_its_blank_line_and_a_late_name():
    loop = ">>> for i in range(2):\n...     total = i\n>>> total\n1\n"
    [block] = docstring_blocks(f"Example:\n\n{loop}\nText.\n")
    assert block.lines == [
        (0, "for i in range(2):"),
        (0, "    total = i"),
        (1, "total"),
    ]
    assert paste(block, run=False)[0].startswith("SyntaxError")
    fixed = loop.replace(">>> total", "...\n>>> total")
    [block] = docstring_blocks(fixed)
    assert paste(block, run=False) == paste(block, run=True) == []
    first, second = docstring_blocks(">>> x = 1\n\nMore.\n\n>>> x + 1\n2\n")
    assert paste(second, run=True) == ["NameError: name 'x' is not defined"]
    shown = ">>> 1 / 0\nTraceback (most recent call last):\nZeroDivisionError: x\n"
    [block] = docstring_blocks(shown)
    assert paste(block, run=True) == []


def copied(text: str) -> list[str]:
    """The lines the site's copy button copies from a block (sphinx-copybutton's
    rule, with docs/conf.py's prompt: prompt lines without their prompt, blank
    lines, nothing else)."""
    conf = (ROOT / "docs" / "conf.py").read_text()
    prompt = re.search(r'^copybutton_prompt_text = r"(.*)"$', conf, re.M).group(1)
    lines = []
    for line in text.splitlines():
        match = re.match(f"^({prompt})(.*)", line)
        if match or not line.strip():
            lines.append(match.group(2) if match else "")
    return lines


def test_the_copy_button_copies_what_the_paste_feeds():
    text = ">>> for i in range(2):\n...     total = i\n...\n>>> total\n1"
    [block] = docstring_blocks(text)
    assert copied(text) == [line for _, line in block.lines]
    assert copied(text)[2] == ""


# The slow check: every block run in a fresh console, all in one fresh Python.
RUN_ALL = """
import json, sys
sys.path.insert(0, sys.argv[1])
import matplotlib
matplotlib.use("Agg")
sys.path.insert(0, sys.argv[1] + "/tests")
from test_repl_paste import blocks, paste
failed = {}
for name, block in blocks().items():
    errors = paste(block, run=True)
    if errors:
        failed[name] = errors
print(json.dumps(failed))
"""


@pytest.mark.slow
def test_every_block_runs_pasted_alone_into_the_repl(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", RUN_ALL, str(ROOT)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-5000:]
    failed = json.loads(run.stdout.strip().splitlines()[-1])
    assert not failed, (
        f"{len(failed)} docstring example blocks raise pasted alone into the "
        "Python REPL:\n" + _report(failed)
    )
