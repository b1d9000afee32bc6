"""The fenced code blocks of the user's docs (README.md, docs/guide/*.md), as the doc tests run them.

A ```bash or ```python block is run by `tests/test_docs.py` unless an HTML comment on the line right above its fence
says otherwise, always with a reason:

    <!-- kvx-doc: gpu: REASON -->          needs a CUDA GPU (or an engine that only runs on one)
    <!-- kvx-doc: covered-by: PATH -->     run elsewhere: PATH is the test (or CI script) that runs what it shows
    <!-- kvx-doc: skip: REASON -->         not run at all (e.g. a placeholder path, a 15-minute job)

Other languages (yaml, text) are shown, never run. Shared by the vLLM quick-start test, which runs the README's
vLLM block in real vLLM.
"""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

RUNNABLE = ("bash", "python")
MARK_KINDS = ("gpu", "covered-by", "skip")

_FENCE = re.compile(r"^\s*(`{3,})\s*(\S*)")
_MARK = re.compile(r"^<!--\s*kvx-doc:\s*(.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts, its language, its text and its marker (kind, reason) if any."""

    path: Path
    line: int
    lang: str
    code: str
    mark: tuple[str, str] | None

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line}"

    @property
    def runs_here(self) -> bool:
        """Run by tests/test_docs.py: a bash or python block without a marker."""
        return self.lang in RUNNABLE and self.mark is None


def repo_root() -> Path:
    """The repository root (the checkout, or the wheel stage's copy of it): the parent holding README.md."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "README.md").is_file() and (parent / "pyproject.toml").is_file():
            return parent
    raise AssertionError(f"no repository root above {__file__}")


def doc_files(root: Path) -> list[Path]:
    """The docs whose blocks must run: the README and the guides."""
    return [root / "README.md", *sorted((root / "docs" / "guide").glob("*.md"))]


def _mark(text: str, where: str) -> tuple[str, str]:
    kind, sep, reason = text.partition(":")
    kind, reason = kind.strip(), reason.strip()
    if kind not in MARK_KINDS or not sep or not reason:
        raise ValueError(f"{where}: a kvx-doc marker is `<!-- kvx-doc: KIND: REASON -->` with KIND one of "
                         f"{', '.join(MARK_KINDS)} and a reason, got {text!r}")
    return kind, reason


def blocks(path: Path) -> list[Block]:
    """Every fenced block of `path` in order; ValueError for an unclosed fence or a marker that is malformed or
    not right above a fence."""
    out: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _MARK.match(lines[i].strip())
        if m:
            where = f"{path}:{i + 1}"
            if i + 1 >= len(lines) or not _FENCE.match(lines[i + 1]):
                raise ValueError(f"{where}: a kvx-doc marker must be on the line right above a code fence")
            mark, i = _mark(m.group(1), where), i + 1
        else:
            mark = None
        fence = _FENCE.match(lines[i])
        if fence:
            start, ticks = i, fence.group(1)
            i += 1
            while i < len(lines) and lines[i].strip() != ticks:
                i += 1
            if i >= len(lines):
                raise ValueError(f"{path}:{start + 1}: unclosed code fence")
            out.append(Block(path, start + 1, fence.group(2),
                             textwrap.dedent("\n".join(lines[start + 1:i])) + "\n", mark))
        i += 1
    return out
