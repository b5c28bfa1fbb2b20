"""Every python block in the docs can be pasted into a Python prompt as it is: the
interactive interpreter ends a compound statement (``for``, ``with``) only at a blank line, so
a statement right after an indented block is a SyntaxError there though a script accepts it.
Checked by compiling each block line by line as the prompt does (nothing is run)."""

from __future__ import annotations

import codeop
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
BLOCKS = [(page.name, i, match.group(1))
          for page in sorted(DOCS.glob("*.md"))
          for i, match in enumerate(PYTHON_BLOCK.finditer(page.read_text()))]  # fmt: skip


def paste_error(block: str) -> str | None:
    """The first line the prompt would refuse, or None: lines are fed one by one, a
    statement is compiled once complete, and a blank line ends an open compound statement."""
    buffer: list[str] = []
    for number, line in enumerate([*block.splitlines(), ""], 1):
        buffer.append(line)
        source = "\n".join(buffer)
        try:
            code = codeop.compile_command(source, "<prompt>", "single")
        except SyntaxError as err:
            return f"line {number}: {line!r} ({err.msg})"
        if code is not None or not source.strip():
            buffer = []
    return None


def test_the_check_sees_a_statement_right_after_a_loop():
    assert paste_error("for i in range(2):\n    pass\nprint(i)\n") is not None
    assert paste_error("for i in range(2):\n    pass\n\nprint(i)\n") is None
    assert paste_error("x = f(1,\n      2)\ny = 3\n") is None


@pytest.mark.parametrize(("page", "index", "block"), BLOCKS,
                         ids=[f"{page}-{i}" for page, i, _ in BLOCKS])  # fmt: skip
def test_docs_blocks_paste_into_a_python_prompt(page, index, block):
    assert paste_error(block) is None
