"""The README and the guides run as written: every ```bash / ```python block without a kvx-doc marker is executed
(`tests/docblocks.py` says how blocks are marked), so a renamed command, option or function fails CI instead of
rotting in the docs.

The blocks of one file run in order in one fresh temporary directory (a later block may use a file an earlier one
wrote, as a reader following the page would), each in its own process: python blocks with this interpreter, bash
blocks with `bash -euo pipefail`; `kvx` on PATH is this interpreter's `python -m kvx_cli.main` (the checkout's, or
the installed wheel's in the wheel stage).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docblocks import Block, blocks, doc_files, repo_root

ROOT = repo_root()
BLOCK_TIMEOUT_S = 120
README_MAX_LINES = 130  # one screen, the formats table and the links


def _kvx_on_path(bin_dir: Path) -> None:
    """A `kvx` command for the blocks, bound to this interpreter."""
    kvx = bin_dir / "kvx"
    kvx.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kvx_cli.main "$@"\n')
    kvx.chmod(0o755)


def _run(block: Block, n: int, cwd: Path, env: dict[str, str]) -> None:
    suffix, argv = {"python": (".py", [sys.executable]), "bash": (".sh", ["bash", "-euo", "pipefail"])}[block.lang]
    script = cwd / f"doc_block_{n}{suffix}"
    script.write_text(block.code)
    try:
        r = subprocess.run([*argv, script.name], check=False, cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where(ROOT)}: still running after {BLOCK_TIMEOUT_S} s:\n{block.code}")
    assert r.returncode == 0, (f"{block.where(ROOT)} exited {r.returncode}:\n{block.code}\n--- stdout\n"
                               f"{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")


RUN_HERE = [d for d in doc_files(ROOT) if any(b.runs_here for b in blocks(d))]
"""The docs with blocks to run (the others' blocks are all marked or not code: the marker test reads them)."""


@pytest.mark.parametrize("doc", RUN_HERE, ids=lambda p: str(p.relative_to(ROOT)))
def test_blocks_run_as_written(doc: Path, tmp_path: Path):
    runnable = [b for b in blocks(doc) if b.runs_here]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _kvx_on_path(bin_dir)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    for n, block in enumerate(runnable):
        _run(block, n, work, env)


def test_every_marker_names_a_reason_and_covering_tests_exist():
    """Blocks not run here say why; a block covered elsewhere names a file that exists (and, for a test, mentions
    the doc it runs)."""
    for doc in doc_files(ROOT):
        for b in blocks(doc):  # a malformed or stray marker raises here
            if b.mark and b.mark[0] == "covered-by":
                path, _, test = b.mark[1].partition("::")
                assert (ROOT / path).is_file(), f"{b.where(ROOT)}: covered by {b.mark[1]}, which does not exist"
                assert not test or f"def {test}(" in (ROOT / path).read_text(encoding="utf-8"), \
                    f"{b.where(ROOT)}: covered by {b.mark[1]}, which does not exist"


def test_the_guides_exist_and_hold_runnable_blocks():
    """The extraction finds the docs' code (a broken fence pattern would otherwise pass every doc vacuously)."""
    docs = doc_files(ROOT)
    assert {p.name for p in docs} >= {"README.md", "vllm.md", "tgi.md", "trtllm.md", "handoff.md", "kvtc.md",
                                      "calibration.md", "kernels.md", "troubleshooting.md"}
    assert sum(b.runs_here for d in docs for b in blocks(d)) >= 8


@pytest.mark.parametrize("text, error", [
    ("<!-- kvx-doc: skip -->\n```bash\nx\n```\n", "a reason"),
    ("<!-- kvx-doc: later: soon -->\n```bash\nx\n```\n", "KIND one of"),
    ("<!-- kvx-doc: gpu: needs CUDA -->\n\n```bash\nx\n```\n", "right above a code fence"),
    ("```bash\nx\n", "unclosed code fence"),
])
def test_a_malformed_marker_or_fence_is_an_error(tmp_path, text, error):
    """A marker the extraction cannot tie to a block, without a reason, or a fence left open fails the doc tests
    instead of silently dropping blocks from them."""
    doc = tmp_path / "doc.md"
    doc.write_text(text)
    with pytest.raises(ValueError, match=error):
        blocks(doc)


def test_blocks_are_extracted_with_their_markers(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("text\n```bash\necho 1\n```\n<!-- kvx-doc: gpu: needs CUDA -->\n```python\nimport x\n```\n"
                   "- item:\n\n  ```bash\n  echo 2\n  ```\n```yaml\na: 1\n```\n")
    got = [(b.line, b.lang, b.code, b.mark, b.runs_here) for b in blocks(doc)]
    assert got == [(2, "bash", "echo 1\n", None, True), (6, "python", "import x\n", ("gpu", "needs CUDA"), False),
                   (11, "bash", "echo 2\n", None, True), (14, "yaml", "a: 1\n", None, False)]


def test_readme_opens_with_the_two_commands_and_stays_one_screen():
    """The README's first block is the two commands that set up and run the demo and the tests on a fresh
    machine; the README stays short (the detail lives in docs/guide and docs/results.md)."""
    readme = ROOT / "README.md"
    first = blocks(readme)[0]
    commands = [line.split("#")[0].strip() for line in first.code.splitlines() if line.strip()]
    assert first.lang == "bash" and commands == ["bash scripts/run_demo.sh", "bash scripts/run_tests.sh"], first
    assert (ROOT / "scripts/run_demo.sh").is_file() and (ROOT / "scripts/run_tests.sh").is_file()
    assert len(readme.read_text(encoding="utf-8").splitlines()) <= README_MAX_LINES
