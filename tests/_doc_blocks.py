"""The fenced blocks of the documentation pages: what tests/test_docs.py runs, and what other tests take
from a page so that they test what the page shows (tests/test_extending.py builds docs/extending.md's
extension).  The conventions are described in tests/test_docs.py."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
PAGES = sorted(n for n in os.listdir(DOCS) if n.endswith(".md")) + ["README.md"]
EXAMPLE_LANGS = {"python", "py", "sh", "bash", "console", "shell"}
NOT_RUN = re.compile(r"^<!-- not run: (?P<reason>\S.*?) -->$")
FILE = re.compile(r"^<!-- file: (?P<name>[\w.-]+(?:/[\w.-]+)*) -->$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")


@dataclass
class Block:
    page: str
    line: int            # 1-based line of the opening fence
    lang: str
    body: str
    not_run: str | None  # the reason, when marked
    file: str | None = None  # the name to save it under, when it is a file the reader saves

    @property
    def example(self) -> bool:
        return self.lang in EXAMPLE_LANGS and self.file is None

    @property
    def python(self) -> bool:
        return self.lang in ("python", "py")


def page_path(page: str) -> str:
    return os.path.join(ROOT, page) if page == "README.md" else os.path.join(DOCS, page)


def blocks_of(page: str) -> list:
    with open(page_path(page), encoding="utf-8") as f:
        lines = f.read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        assert j < len(lines), f"{page}:{i + 1}: unclosed fence"
        mark = NOT_RUN.match(lines[i - 1].strip()) if i else None
        file = FILE.match(lines[i - 1].strip()) if i else None
        out.append(Block(page, i + 1, m.group("lang"), "\n".join(lines[i + 1:j]) + "\n",
                         mark.group("reason") if mark else None, file.group("name") if file else None))
        i = j + 1
    return out
