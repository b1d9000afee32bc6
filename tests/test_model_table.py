"""The model coverage table (issue 33): the `models:` rows of compat_matrix.yaml are its one source, the vLLM guide's
table is their rendering (`benchmarks/model_table.py`), every `verified` row points at a recorded result or a test
that exists, and the families the issue names are all there, DeepSeek's MLA refused with the plugin's message."""
from __future__ import annotations

import copy
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import model_table as mt  # noqa: E402
from model_geometries import MODELS  # noqa: E402

from kvx_core.errors import KvxError, Status  # noqa: E402
from tests.sources import package_dirs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROWS = yaml.safe_load((ROOT / "compat_matrix.yaml").read_text(encoding="utf-8"))["models"]
INDEXED = {e["file"] for s in yaml.safe_load((ROOT / "benchmarks/results/index.yaml").read_text())["sections"]
           for e in s["entries"]}
"""The result files index.yaml records (read here with yaml, not through the renderer)."""


def test_the_guide_table_is_the_rendering_of_the_matrix():
    text = mt.DOC.read_text(encoding="utf-8")
    assert text == mt.render_doc(text, ROWS), "docs/guide/vllm.md's model table differs: run benchmarks/model_table.py"
    assert mt.main(["--check"]) == 0


def test_the_readme_links_the_table():
    assert "docs/guide/vllm.md#which-models-this-serves" in (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("key", ROWS)
def test_rows_name_existing_geometries_and_evidence(key):
    row = mt.check_row(key, ROWS[key])
    assert row["geometry"] is None or row["geometry"] in MODELS, (key, row["geometry"])
    if row["status"] != "verified":
        return
    named = re.findall(r"benchmarks/results/([\w.-]+?)(?=[\s,;)]|$)", row["by"])
    tests = re.findall(r"tests/[\w/.-]+\.py", row["by"])
    assert named or tests, (key, "a verified row names a result file or a test")
    for f in named:
        assert (ROOT / "benchmarks/results" / f).is_file() and f in INDEXED, (key, f)
    for t in tests:
        assert (ROOT / t).is_file(), (key, t)
    if re.search(r"\bH[12]00\b", row["by"]):
        assert named, (key, "a GPU claim names the recorded result that shows it")


def test_the_issue_families_are_covered():
    """gpt-oss 20b and 120b, Gemma 3 (head_dim 128 and 256), Qwen3, Llama 3, Mistral, DeepSeek (refused)."""
    geometries = {r["geometry"] for r in ROWS.values()}
    assert {"gpt-oss-20b-4l", "gpt-oss-120b-4l", "gemma3-27b-6l", "gemma3-12b-6l", "qwen3-8b-8l",
            "llama3-8b-8l"} <= geometries
    models = " ".join(r["model"] for r in ROWS.values())
    assert "Mistral 7B v0.1" in models and "Gemma 2" in models
    mistral = next(r for r in ROWS.values() if r["model"] == "Mistral 7B v0.1")
    assert "4096" in mistral["needs"]["window"]
    assert next(r for r in ROWS.values() if r["model"].startswith("Gemma 2"))["needs"]["softcap"]
    assert all("softcap" not in r["needs"] for r in ROWS.values() if r["model"].startswith("Gemma 3"))


def test_mla_row_quotes_the_plugins_refusal():
    row = next(r for r in ROWS.values() if "mla" in r["needs"])
    assert row["status"] == "unsupported" and "DeepSeek" in row["model"]
    quote = re.search(r"'([^']+)'", row["reason"]).group(1)
    assert quote in (package_dirs(ROOT)["kvx_vllm"] / "options.py").read_text(encoding="utf-8")


@pytest.mark.parametrize("key", [k for k, r in ROWS.items() if r["status"] == "unsupported"])
def test_unsupported_rows_cite_the_refusing_source(key):
    sources = re.findall(r"kvx_vllm/(\w+\.py)", ROWS[key]["reason"])
    plugin = package_dirs(ROOT)["kvx_vllm"]  # the checkout's, or the installed one in the wheel stage
    assert sources and all((plugin / s).is_file() for s in sources), key


# ---- malformed rows are refused, naming the row ----------------------------------------------------------------------

def _row(**over) -> dict:
    return {"model": "M", "geometry": None, "needs": {"gqa": "8/1"}, "status": "untested", "reason": "r", **over}


@pytest.mark.parametrize("row, needle", [
    ("not a mapping", "must be a mapping"),
    (_row(extra=1), "unknown keys ['extra']"),
    (_row(model=""), "model must be"),
    (_row(geometry=3), "geometry must be"),
    (_row(needs={}), "needs must be"),
    (_row(needs={"alibi": True}), "needs must be"),
    (_row(status="works"), "status must be one of"),
    (_row(status="verified"), "needs `by`"),
    (_row(reason=" "), "needs `reason`"),
])
def test_a_malformed_row_is_refused(row, needle):
    with pytest.raises(KvxError) as e:
        mt.render({"bad_row": row})
    assert e.value.status == Status.INVALID_ARGUMENT
    assert "models.bad_row" in e.value.message and needle in e.value.message, e.value.message


def test_cli_refuses_a_bad_matrix_and_leaves_the_doc_untouched(tmp_path, monkeypatch, capsys):
    doc, matrix = tmp_path / "vllm.md", tmp_path / "compat_matrix.yaml"
    doc.write_text(f"intro\n{mt.OPEN}old table\n{mt.CLOSE}\n", encoding="utf-8")
    bad = copy.deepcopy(ROWS)
    bad[next(iter(bad))]["status"] = "probably"
    matrix.write_text(yaml.safe_dump({"models": bad}), encoding="utf-8")
    monkeypatch.setattr(mt, "DOC", doc)
    monkeypatch.setattr(mt, "MATRIX", matrix)
    before = doc.read_bytes()
    assert mt.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "status must be one of" in err[0]
    assert doc.read_bytes() == before


def test_cli_writes_then_checks(tmp_path, monkeypatch):
    doc, matrix = tmp_path / "vllm.md", tmp_path / "compat_matrix.yaml"
    doc.write_text(f"intro\n{mt.OPEN}old table\n{mt.CLOSE}\nrest\n", encoding="utf-8")
    matrix.write_text(yaml.safe_dump({"models": {"one": _row()}}), encoding="utf-8")
    monkeypatch.setattr(mt, "DOC", doc)
    monkeypatch.setattr(mt, "MATRIX", matrix)
    assert mt.main(["--check"]) == 1
    assert mt.main([]) == 0 and mt.main(["--check"]) == 0
    text = doc.read_text(encoding="utf-8")
    assert text.startswith("intro\n") and text.endswith(f"{mt.CLOSE}\nrest\n")
    assert "| M | — | 8/1 |" in text and "**untested**: r |" in text


@pytest.mark.parametrize("text", ["no markers", f"{mt.OPEN}a{mt.CLOSE}{mt.OPEN}b{mt.CLOSE}", f"{mt.CLOSE}{mt.OPEN}"])
def test_markers_must_be_one_ordered_pair(text):
    with pytest.raises(KvxError) as e:
        mt.render_doc(text, ROWS)
    assert e.value.status == Status.INVALID_ARGUMENT
