"""The fenced code blocks of README.md and docs/*.md, so that a test runs exactly what a page shows.

A shell or Python block is preceded by one marker line:

    <!-- doc-block: ID run-by tests/path.py -->        tests/path.py runs it: ``doc_block("ID")`` returns its text
    <!-- doc-block: illustrative: why it is not run -->

and every fence names its language (``text`` for diagrams and sample output), so no command hides in an untagged
block. A fence of any other language (``text``, ``json``, ...) needs a marker too when one of its lines starts
like a command (``COMMAND_STARTS``: ``kvmesh``, ``python``, ``make``, ``docker``, ``curl``, a ``$`` prompt, ...),
so no command hides in a ``text`` block either. tests/test_docs.py checks the markers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_LANGUAGES = {"bash", "sh", "shell", "console", "python", "py", "pycon"}
# A line of a block in another language that starts so (after indentation) is a command a reader may type.
COMMAND_STARTS = ("kvmesh ", "python ", "python3 ", "make ", "docker ", "docker-compose ", "curl ", "$ ",
                  "sudo ", "pip ", "bash ", "git ", "vllm ", ".venv/bin/")
_MARKER = re.compile(r"<!-- doc-block: (?:illustrative: (?P<why>.+?)|(?P<id>[a-z0-9-]+) run-by (?P<path>\S+)) -->")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    marker: str  # the preceding non-blank line

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"

    @property
    def shows_commands(self) -> bool:
        """A code block, or one of another language with a line that starts like a command."""
        return self.language in CODE_LANGUAGES or any(
            line.lstrip().startswith(COMMAND_STARTS) for line in self.text.splitlines())

    def parsed_marker(self) -> re.Match | None:
        return _MARKER.fullmatch(self.marker.strip())


def blocks(page: Path) -> list[Block]:
    found, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(```+)(.*)$", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence.group(2))), len(lines))
        marker = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        found.append(Block(page, i + 1, fence.group(3).strip(), "\n".join(lines[i + 1:end]) + "\n", marker))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]


def doc_block(block_id: str) -> str:
    """The text of the block marked ``block_id`` (exactly as the page shows it)."""
    hits = [b for b in all_blocks() if (m := b.parsed_marker()) and m.group("id") == block_id]
    assert len(hits) == 1, f"doc block {block_id!r}: found {len(hits)}"
    return hits[0].text


def marker_problems(found: list[Block]) -> list[str]:
    """What is wrong with the markers of ``found``: a block that shows commands (a code block, or a ``text`` one with
    a line starting like a command) with no marker, or one naming a runner that does not use it."""
    problems = []
    for b in found:
        if not b.shows_commands:
            continue
        m = b.parsed_marker()
        if not m:
            why = "" if b.language in CODE_LANGUAGES else " (a line of it starts like a command)"
            problems.append(f"{b.where}: no <!-- doc-block: ... --> marker before this {b.language} block{why}")
        elif m.group("id"):
            runner = ROOT / m.group("path")
            if not runner.is_file():
                problems.append(f"{b.where}: run-by {m.group('path')} does not exist")
            elif m.group("id") not in runner.read_text():
                problems.append(f"{b.where}: {m.group('path')} never names block {m.group('id')!r}")
    return problems
