"""Render the vLLM versions table of docs/guide/vllm.md (between its `vllm-versions` markers) from the plugin's
version data (`kvx_vllm.compat.versions_table`); tests/test_vllm_versions.py checks that the doc is current.

Usage (from the repository root): PYTHONPATH=.:plugins/kvx_vllm python scripts/render_vllm_versions.py
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "guide" / "vllm.md"
BLOCK = re.compile(r"(<!-- vllm-versions:begin[^>]*-->\n)(.*?)(<!-- vllm-versions:end -->)", re.S)


def render(text: str, table: str) -> str:
    """`text` with the table between the markers replaced by `table`."""
    if len(BLOCK.findall(text)) != 1:
        raise SystemExit(f"render_vllm_versions: {DOC} needs exactly one vllm-versions block")
    return BLOCK.sub(lambda m: m.group(1) + table + m.group(3), text)


def main() -> int:
    from kvx_vllm.compat import versions_table

    DOC.write_text(render(DOC.read_text(), versions_table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
