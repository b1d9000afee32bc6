"""Every specification citation in the code resolves to a heading of the specification in `docs/`.

The code cites sections as `spec §6.1`, `§5.1 / §7.1`, `§4-§6` (and the C header as `spec section
6.2`); a section is resolved when a Markdown heading in `docs/*.md` starts with that exact label
(`## §6.1 Cache descriptor (kvx_cache_desc_t)`). Failures list each unresolved citation with its
file and line, so a moved or renumbered section cannot leave a dangling reference behind.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from tests.sources import package_dirs

#: Source trees whose citations must resolve besides the packages' (tests/sources.py), and the file types scanned.
SCANNED_DIRS = ("benchmarks",)
SCANNED_SUFFIXES = (".py", ".h", ".cu", ".cuh")
C_SUFFIXES = (".h", ".cu", ".cuh")
SKIPPED_PARTS = {"__pycache__", "build", "dist"}

SECTION = r"\d+(?:\.\d+)?"
#: `§6.1`, `§4` (a range `§4-§6` is two citations).
SIGN_CITATION = re.compile(rf"§({SECTION})")
#: C sources: `spec section 6.2`, `spec section 5.1, 6.3`, `specification, sections 3-8`,
#: `spec section 3, section 6`.
WORD_CITATION = re.compile(
    rf"\bspec(?:ification)?,?\s+sections?\s+({SECTION}(?:\s*[-,]\s*(?:sections?\s+)?{SECTION})*)", re.IGNORECASE)
#: A heading that carries a section label: `## §6.1 Title` (the label right after the hashes).
HEADING_LABEL = re.compile(rf"^#+\s+§({SECTION})(?=\s|$)")


def repo_root() -> Path:
    """The repository root: the nearest parent of this file holding pyproject.toml and docs/."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "pyproject.toml").is_file() and (parent / "docs").is_dir():
            return parent
    raise AssertionError(f"no repository root above {__file__}")


def _tree(top: Path) -> list[Path]:
    return [path for path in sorted(top.rglob("*"))
            if path.is_file() and path.suffix in SCANNED_SUFFIXES
            and not any(p.startswith(".") or p in SKIPPED_PARTS or p.endswith(".egg-info")
                        for p in path.relative_to(top).parts)]


def scanned_files(root: Path) -> list[Path]:
    return [f for top in (*(root / d for d in SCANNED_DIRS), *package_dirs(root).values()) for f in _tree(top)]


def citations(path: Path) -> list[tuple[int, str]]:
    """(line number, section label) of every citation in `path`."""
    out = []
    text = path.read_text(encoding="utf-8", errors="replace")
    for lineno, line in enumerate(text.splitlines(), 1):
        out += [(lineno, m) for m in SIGN_CITATION.findall(line)]
        if path.suffix in C_SUFFIXES:
            for group in WORD_CITATION.findall(line):
                out += [(lineno, m) for m in re.findall(SECTION, group)]
    return out


def heading_labels(root: Path) -> list[tuple[str, str]]:
    """(section label, `file:line`) of every labelled heading in docs/*.md (code blocks skipped)."""
    out = []
    for path in sorted((root / "docs").glob("*.md")):
        fenced = False
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            m = None if fenced else HEADING_LABEL.match(line)
            if m:
                out.append((m.group(1), f"docs/{path.name}:{lineno}"))
    return out


def test_docs_exist():
    root = repo_root()
    assert (root / "docs" / "README.md").is_file() and heading_labels(root), \
        "docs/ must hold the specification (README.md and section headings)"


def test_every_citation_resolves_to_a_docs_heading():
    root = repo_root()
    labels = {label for label, _ in heading_labels(root)}
    found = [(path, lineno, label) for path in scanned_files(root) for lineno, label in citations(path)]
    assert found, "no citations found: the scanner is broken"
    unresolved = [f"{path}:{lineno}: §{label}" for path, lineno, label in found if label not in labels]
    assert not unresolved, (
        f"{len(unresolved)} citation(s) name a section that no heading in docs/*.md carries "
        "(a heading must start with the label, e.g. '## §6.1 ...'):\n  " + "\n  ".join(unresolved))


def test_section_labels_are_unique():
    counts = Counter(label for label, _ in heading_labels(repo_root()))
    where = {}
    for label, loc in heading_labels(repo_root()):
        where.setdefault(label, []).append(loc)
    dupes = [f"§{label}: {', '.join(where[label])}" for label, n in sorted(counts.items()) if n > 1]
    assert not dupes, "section labels must name one place each:\n  " + "\n  ".join(dupes)


def test_subsections_have_their_section():
    """`§6.1` implies a `§6` heading, so a reader can always go one level up."""
    labels = {label for label, _ in heading_labels(repo_root())}
    orphans = sorted(f"§{label}" for label in labels if "." in label and label.split(".")[0] not in labels)
    assert not orphans, f"subsections without a parent section heading: {orphans}"
