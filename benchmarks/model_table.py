"""The vLLM guide's model coverage table, rendered from the `models:` rows of compat_matrix.yaml (the one place
where a model's status is written), so the table cannot say more than the matrix.

`python benchmarks/model_table.py` rewrites the table between `<!-- models:table -->` and `<!-- /models -->` in
docs/guide/vllm.md; `--check` only compares (exit 1 when the doc differs). A malformed row: exit 2, one line.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from kvx_core.errors import KvxError, Status

ROOT = Path(__file__).resolve().parent.parent
MATRIX = ROOT / "compat_matrix.yaml"
DOC = ROOT / "docs" / "guide" / "vllm.md"
OPEN, CLOSE = "<!-- models:table -->\n", "<!-- /models -->"
NEEDS = {"gqa": "GQA (query/KV heads)", "head_dim": "head_dim", "window": "sliding window", "sinks": "sinks",
         "softcap": "soft cap", "moe": "MoE", "mla": "MLA", "other": "other"}
"""The features a row's `needs` may name, in column order, with their column titles."""
ROW_KEYS = {"model", "geometry", "needs", "status", "by", "reason"}
STATUSES = ("verified", "untested", "unsupported")


def _bad(key: str, message: str) -> KvxError:
    return KvxError(Status.INVALID_ARGUMENT, f"compat_matrix.yaml models.{key}: {message}")


def _cell(value: object) -> str:
    """A table cell: one line, pipes escaped, absent shown as a dash."""
    return "—" if value is None else " ".join(str(value).split()).replace("|", "\\|")


def check_row(key: str, row: object) -> dict:
    """The row if it has what the table shows: a model name, known `needs` features, a status of the three, and
    its evidence (`by` when verified, `reason` otherwise)."""
    if not isinstance(row, dict):
        raise _bad(key, "must be a mapping")
    unknown = sorted(set(row) - ROW_KEYS)
    if unknown:
        raise _bad(key, f"unknown keys {unknown}")
    if not isinstance(row.get("model"), str) or not row["model"].strip():
        raise _bad(key, "model must be a non-empty string")
    if row.get("geometry") is not None and not isinstance(row["geometry"], str):
        raise _bad(key, "geometry must be a geometry name or null")
    needs = row.get("needs")
    if not isinstance(needs, dict) or not needs or set(needs) - set(NEEDS):
        raise _bad(key, f"needs must be a non-empty mapping of {sorted(NEEDS)}")
    status = row.get("status")
    if status not in STATUSES:
        raise _bad(key, f"status must be one of {list(STATUSES)}, got {status!r}")
    evidence = "by" if status == "verified" else "reason"
    if not isinstance(row.get(evidence), str) or not row[evidence].strip():
        raise _bad(key, f"a {status} row needs `{evidence}`")
    return row


def render(models: object) -> str:
    """The markdown table of the `models:` rows, in their order."""
    if not isinstance(models, dict) or not models:
        raise _bad("", "the models section must be a non-empty mapping")
    header = ["model", "geometry", *NEEDS.values(), "status"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, row in models.items():
        row = check_row(key, row)
        geometry = f"`{row['geometry']}`" if row.get("geometry") else None
        evidence = row["by"] if row["status"] == "verified" else row["reason"]
        cells = [row["model"], geometry, *(row["needs"].get(k) for k in NEEDS), f"**{row['status']}**: {evidence}"]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def render_doc(text: str, models: object) -> str:
    """`text` with the table between its markers replaced by the rendering of `models`."""
    start, end = text.find(OPEN), text.find(CLOSE)
    if start < 0 or end < start or text.count(OPEN) != 1 or text.count(CLOSE) != 1:
        raise KvxError(Status.INVALID_ARGUMENT, f"{DOC.name}: needs one {OPEN.strip()} ... {CLOSE} pair")
    return text[:start + len(OPEN)] + render(models) + text[end:]


def load_models() -> object:
    """The `models:` section of the matrix (a file of this repository, read with the safe loader)."""
    matrix = yaml.safe_load(MATRIX.read_text(encoding="utf-8"))
    return matrix.get("models") if isinstance(matrix, dict) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only: exit 1 when the doc's table differs")
    args = parser.parse_args(argv)
    try:
        text = DOC.read_text(encoding="utf-8")
        new = render_doc(text, load_models())
    except KvxError as e:
        print(f"model_table: {e.message}", file=sys.stderr)
        return 2
    if new == text:
        return 0
    if args.check:
        print(f"model_table: {DOC} differs from {MATRIX.name}: run python benchmarks/model_table.py", file=sys.stderr)
        return 1
    DOC.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
