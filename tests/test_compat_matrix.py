"""compat_matrix.yaml stays true: it parses, every status is one of the four, every `verified` or `api_checked`
(a vLLM release accepted after the plugin's load-time API checks) entry names evidence that exists in the repo, every
`unsupported`/`untested` entry gives a reason."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _entries(node, path=()):
    if isinstance(node, dict):
        if "status" in node:
            yield path, node
        for k, v in node.items():
            yield from _entries(v, path + (k,))


def test_matrix_entries_are_backed():
    matrix = yaml.safe_load((ROOT / "compat_matrix.yaml").read_text())
    entries = list(_entries(matrix))
    assert entries
    for path, e in entries:
        assert e["status"] in ("verified", "api_checked", "untested", "unsupported"), path
        if e["status"] in ("verified", "api_checked"):
            evidence = " ".join(e["by"] if isinstance(e["by"], list) else [e["by"]])
            files = re.findall(r"(?:tests|benchmarks)/[\w/.*-]+", evidence)
            assert files, (path, "verified needs a test or benchmark path")
            for f in files:
                assert list(ROOT.glob(f.rstrip(".,)"))), (path, f)
        else:
            assert e.get("reason"), (path, "needs a reason")
