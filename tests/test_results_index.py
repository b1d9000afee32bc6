"""benchmarks/results/: every file has an index.yaml entry, and what the docs state about the results is the rendering
of the data (`benchmarks/render_results.py`): the results README of index.yaml, the marked tables of docs/results.md
of the JSON lines they cite. A stale number or a file left out of the index fails here."""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import render_results as rr  # noqa: E402

from kvx_core.errors import KvxError, Status  # noqa: E402
from tests.fuzz import DEEP, dumps_json, mutate_bytes, mutate_json, run_capped  # noqa: E402

RESULTS, DOC = rr.RESULTS, rr.DOC
INDEX_TEXT = (RESULTS / "index.yaml").read_text(encoding="utf-8")
INDEX_TREE = yaml.safe_load(INDEX_TEXT)
DEEP_YAML = 5000
"""Nesting depth of a forged YAML document: past the interpreter's recursion limit, and fast to parse."""


def _entry(file: str, **over) -> dict:
    return {"file": file, "what": "w", "command": "c", "gpu": "g", "commit": "x", "superseded_by": None, **over}


def _doc(*entries: dict) -> dict:
    return {"header": "# h\n", "sections": [{"title": "T", "entries": list(entries)}]}


def _refused(text: str | bytes, needle: str) -> None:
    with pytest.raises(KvxError) as e:
        rr.parse_index(text)
    assert e.value.status == Status.INVALID_ARGUMENT and needle in e.value.message, e.value.message


# ---- the committed files are the renderings --------------------------------------------------------------------------

def test_every_result_file_has_an_entry_and_every_entry_a_file():
    problems = rr.index_problems(rr.load_index(RESULTS), RESULTS)
    assert not problems, "benchmarks/results/index.yaml is out of date:\n  " + "\n  ".join(problems)


def test_results_readme_is_the_rendering_of_the_index():
    assert (RESULTS / "README.md").read_text(encoding="utf-8") == rr.render_readme(rr.load_index(RESULTS)), \
        "benchmarks/results/README.md differs from index.yaml: run python benchmarks/render_results.py"


def test_marked_tables_of_docs_results_are_the_rendering_of_their_data():
    text = DOC.read_text(encoding="utf-8")
    assert text == rr.render_doc(text, RESULTS), \
        "a marked table of docs/results.md differs from its data: run python benchmarks/render_results.py"


def test_every_table_renderer_has_its_marker_in_the_docs():
    text = DOC.read_text(encoding="utf-8")
    assert [name for name in rr.TABLES if f"<!-- results:{name} -->" not in text] == []


def test_cli_check_passes_on_the_repository():
    assert rr.main(["--check"]) == 0


def test_figures_are_listed_in_the_index():
    files = {e.file for e in rr.load_index(RESULTS).entries()}
    assert set(rr.FIGURES) <= files


def test_figures_render(tmp_path):
    pytest.importorskip("matplotlib")
    for name in ("decode_vs_flashinfer_h200.jsonl", "demo_default_cpu.jsonl", "tgi_formats_cpu.jsonl",
                 "tgi_formats_h100.jsonl", "vllm_kv_dtypes_h200.jsonl"):
        shutil.copy(RESULTS / name, tmp_path / name)
    for path in rr.render_figures(tmp_path):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the tables say what the JSON lines say (oracle: the fields read here, not through the renderer) ----------------

def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (RESULTS / name).read_text().splitlines() if line.strip()]


def _table_rows(name: str) -> list[list[str]]:
    lines = rr.TABLES[name](RESULTS).splitlines()[2:]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def test_transfer_table_cells_are_the_files_fields():
    rows = _rows("transfer_bundle_h100.jsonl")
    table = _table_rows("transfer_bundle_h100")
    assert len(table) == len(rows)
    for r, cells in zip(rows, table, strict=True):
        assert cells[0] == f"{r['src']} -> {r['dst']}" and cells[1] == r["path"]
        assert float(cells[3]) == pytest.approx(r["export_gbps"], abs=0.05)
        assert float(cells[4]) == pytest.approx(r["import_gbps"], abs=0.05)


def test_tgi_table_tokens_are_blocks_times_block_size():
    by_fmt = {r["format"]: r for r in _rows("tgi_formats_cpu.jsonl")}
    table = _table_rows("tgi_formats")
    assert {cells[0].strip("`") for cells in table} == set(by_fmt)
    for cells in table:
        r = by_fmt[cells[0].strip("`")]
        assert int(cells[1]) == r["blocks"] and int(cells[2].replace(",", "")) == r["blocks"] * r["block_size"]


def test_vllm_table_marks_the_skipped_runs():
    skipped = {r["kv_cache_dtype"] for r in _rows("vllm_kv_dtypes_h200.jsonl") if "skipped" in r}
    table = _table_rows("vllm_kv_dtypes_h200")
    assert skipped and {cells[0] for cells in table if "not run (1)" in cells} == skipped


def test_half_is_rounded_up_as_written_in_the_file():
    """0.0605 s is written 0.061 (the float's binary value is 0.06049...: plain formatting gives 0.060)."""
    assert rr._fixed(0.0605, 3) == "0.061" and rr._fixed(274.5, 0) == "275" and rr._fixed(11894.2, 0, commas=True) \
        == "11,894"


# ---- strict reading of index.yaml -----------------------------------------------------------------------------------

def test_a_valid_index_parses():
    index = rr.parse_index(yaml.safe_dump(_doc(_entry("a.jsonl"), _entry("b.jsonl", superseded_by="a.jsonl"))))
    assert [e.file for e in index.entries()] == ["a.jsonl", "b.jsonl"]
    assert "Superseded by `a.jsonl`." in rr.render_readme(index)


@pytest.mark.parametrize("doc, needle", [
    (_doc(_entry("a.jsonl", gpu=3)), "gpu must be a non-empty string"),
    (_doc(_entry("a.jsonl", what=True)), "what must be a non-empty string"),
    (_doc(_entry("a.jsonl", commit="")), "commit must be a non-empty string"),
    (_doc(_entry("a.jsonl", what="two\nlines")), "must be one line"),
    (_doc(_entry("a.jsonl", what="carriage\rreturn")), "must be one line"),
    (_doc(_entry("a.jsonl", extra=1)), "unknown keys ['extra']"),
    (_doc({k: v for k, v in _entry("a.jsonl").items() if k != "superseded_by"}), "missing keys ['superseded_by']"),
    (_doc(_entry("a.jsonl", superseded_by="gone.jsonl")), "names no other entry"),
    (_doc(_entry("a.jsonl", superseded_by="a.jsonl")), "names no other entry"),
    (_doc(_entry("a.jsonl"), _entry("a.jsonl")), "more than once"),
    (_doc(_entry("../a.jsonl")), "not a result file name"),
    (_doc(_entry("README.md")), "not a result file name"),
    ({"header": "# h", "sections": []}, "non-empty list"),
    ({"header": "# h", "sections": [{"title": "T", "entries": {}}]}, "non-empty list"),
    ({"header": 1.5, "sections": [{"title": "T", "entries": [_entry("a")]}]}, "header must be a non-empty string"),
    ([1, 2], "must be a mapping"),
])
def test_bad_index_is_refused(doc, needle):
    _refused(yaml.safe_dump(doc), needle)


def test_a_huge_forged_value_gives_a_short_message():
    with pytest.raises(KvxError) as e:
        rr.parse_index(yaml.safe_dump(_doc(_entry("a.jsonl", gpu=["x" * 100_000]))))
    assert len(e.value.message) < 300 and "..." in e.value.message


def test_a_key_given_twice_is_refused():
    """safe_load alone keeps the last of two equal keys: the first value would vanish without a word."""
    _refused("header: a\nheader: b\nsections: []\n", "given twice")


@pytest.mark.parametrize("text, needle", [
    ("header: [\n", "not valid YAML"),
    ("{1: a}\n", "is not a string"),
    ("header: !!python/object:os.system x\n", "not valid YAML"),
    (b"header: \xc3\x28\n", "not valid YAML"),
    ("x: " + "[" * DEEP_YAML + "]" * DEEP_YAML, "nests too deeply"),
])
def test_malformed_yaml_is_refused(text, needle):
    _refused(text, needle)


def test_index_over_the_cap_is_refused_before_reading(tmp_path, monkeypatch):
    (tmp_path / "index.yaml").write_text(INDEX_TEXT)
    monkeypatch.setattr(rr, "MAX_TEXT_BYTES", len(INDEX_TEXT.encode()) - 1)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail("read past the cap"))
    with pytest.raises(KvxError) as e:
        rr.load_index(tmp_path)
    assert e.value.status == Status.INVALID_ARGUMENT and "cap" in e.value.message


def test_index_problems_name_unlisted_and_missing_files(tmp_path):
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "new.log").write_text("x\n")
    (tmp_path / "README.md").write_text("")
    index = rr.parse_index(yaml.safe_dump(_doc(_entry("a.jsonl"), _entry("gone.jsonl"))))
    assert rr.index_problems(index, tmp_path) == ["new.log: in " + tmp_path.name + "/ but not in index.yaml",
                                                  "gone.jsonl: in index.yaml but not in " + tmp_path.name + "/"]


# ---- the command line: refusals write nothing ----------------------------------------------------------------------

@pytest.fixture
def copy(tmp_path, monkeypatch):
    """A copy of benchmarks/results and docs/results.md the command line works on."""
    results, doc = tmp_path / "results", tmp_path / "results.md"
    shutil.copytree(RESULTS, results)
    shutil.copy(DOC, doc)
    monkeypatch.setattr(rr, "RESULTS", results)
    monkeypatch.setattr(rr, "DOC", doc)
    return results, doc


def _snapshot(*paths: Path) -> dict:
    return {p: p.read_bytes() for p in paths}


def test_cli_check_names_a_stale_file_and_writes_nothing(copy, capsys):
    results, doc = copy
    (results / "README.md").write_text("stale\n")
    before = _snapshot(results / "README.md", doc)
    assert rr.main(["--check"]) == 1
    assert "README.md differs from its rendering" in capsys.readouterr().err
    assert _snapshot(results / "README.md", doc) == before
    assert rr.main([]) == 0 and rr.main(["--check"]) == 0


@pytest.mark.parametrize("damage", [
    lambda results, doc: (results / "new_run.jsonl").write_text("{}\n"),
    lambda results, doc: (results / "index.yaml").write_text("header: x\n"),
    lambda results, doc: doc.write_text(doc.read_text() + "\n<!-- results:nope -->\n|a|\n<!-- /results -->\n"),
    lambda results, doc: doc.write_text(doc.read_text() + "\n<!-- results:tgi_formats -->\n|a|\n"),
    lambda results, doc: (results / "transfer_bundle_h100.jsonl").write_text('{"bench": NaN}\n'),
    lambda results, doc: (results / "tgi_formats_h100.jsonl").write_bytes(b"\xff\n"),
])
def test_cli_refusal_exits_2_with_one_line_and_writes_nothing(copy, capsys, damage):
    results, doc = copy
    (results / "README.md").write_text("stale\n")  # would be rewritten if the run went on
    damage(results, doc)
    before = _snapshot(results / "README.md", doc)
    assert rr.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("render_results: [KVX_STATUS_INVALID_ARGUMENT]") and err.count("\n") == 1, err
    assert _snapshot(results / "README.md", doc) == before


def test_cli_figures_draws_nothing_when_the_index_is_refused(copy, capsys):
    pytest.importorskip("matplotlib")
    results, _ = copy
    for name in rr.FIGURES:
        (results / name).unlink()
    (results / "new_run.jsonl").write_text("{}\n")
    assert rr.main(["--figures"]) == 2
    assert "new_run.jsonl" in capsys.readouterr().err
    assert not [name for name in rr.FIGURES if (results / name).exists()]


def test_cli_figures_draws_the_figures_the_index_lists(copy):
    pytest.importorskip("matplotlib")
    results, _ = copy
    for name in rr.FIGURES:
        (results / name).unlink()
    assert rr.main(["--figures"]) == 0
    assert all((results / name).read_bytes()[:4] == b"\x89PNG" for name in rr.FIGURES)


def test_a_huge_number_is_refused(copy):
    """Found by the fuzzer: 1e308 in a field made the half-up rounding raise decimal.InvalidOperation."""
    results, _ = copy
    path = results / "transfer_bundle_h100.jsonl"
    rows = _rows("transfer_bundle_h100.jsonl")
    rows[0]["export_x_copy"] = 1e308
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(KvxError) as e:
        rr.table_transfer_bundle_h100(results)
    assert e.value.status == Status.OUT_OF_RANGE and "export_x_copy" in e.value.message


def test_a_fractional_batch_is_refused_not_truncated(copy):
    """`"batch": 1.5` must not become batch 1 (`int()` would truncate it)."""
    results, _ = copy
    path = results / "vllm_lm_head_mxfp4_h100.jsonl"
    rows = _rows("vllm_lm_head_mxfp4_h100.jsonl")
    rows[1]["batch"] = 1.5
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(KvxError, match="batch must be a non-negative integer"):
        rr.table_vllm_lm_head_mxfp4_h100(results)


def test_a_forged_boolean_batch_is_not_batch_1(copy):
    """`"batch": true` equals 1 in Python: the row must not be taken as the B=1 run."""
    results, _ = copy
    path = results / "vllm_kv_dtypes_h200.jsonl"
    rows = _rows("vllm_kv_dtypes_h200.jsonl")
    for r in rows:
        if r.get("batch") == 1 and r["kv_cache_dtype"] == "fp8":
            r["batch"] = True
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(KvxError, match="0 rows match"):
        rr.table_vllm_kv_dtypes_h200(results)


# ---- fuzz: forged index.yaml and forged JSON lines only ever raise KvxError -----------------------------------------

def fuzz_index_bytes(rng: random.Random) -> None:
    rr.parse_index(mutate_bytes(INDEX_TEXT.encode(), rng))


def fuzz_index_tree(rng: random.Random) -> None:
    tree = mutate_json(INDEX_TREE, rng)
    text = yaml.safe_dump(tree).replace(yaml.safe_dump(DEEP).split("\n")[0], "[" * DEEP_YAML + "]" * DEEP_YAML)
    rr.parse_index(text)


TABLE_FILES = {"vllm_kv_dtypes_h200": ["vllm_kv_dtypes_h200.jsonl"],
               "write_bandwidth_h100": ["write_bandwidth_h100.jsonl"],
               "transfer_bundle_h100": ["transfer_bundle_h100.jsonl"],
               "tgi_formats": ["tgi_formats_cpu.jsonl", "tgi_formats_h100.jsonl"],
               "decode_vs_flashinfer_h100": ["decode_vs_flashinfer_h100.jsonl",
                                             "decode_k8v4_cuda_vs_triton_h100.jsonl"],
               "kvtc_throughput_h100": ["kvtc_throughput_h100.jsonl"],
               "lm_head_accuracy_smollm2": ["lm_head_mxfp4_accuracy_smollm2_cpu.jsonl"],
               "lm_head_mxfp4_h100": ["lm_head_mxfp4_h100.jsonl"],
               "vllm_lm_head_mxfp4_h100": ["vllm_lm_head_mxfp4_h100.jsonl"],
               "kvtc_smollm2": ["kvtc_smollm2_cpu.jsonl"],
               "demo_global_scales_smollm2": ["demo_global_scales_smollm2_cpu.jsonl"]}


def test_fuzz_covers_every_table():
    assert set(TABLE_FILES) == set(rr.TABLES)


def fuzz_tables(rng: random.Random) -> None:
    """One table's files, one line mutated as a JSON tree (or the file's bytes damaged), rendered."""
    name = rng.choice(sorted(TABLE_FILES))
    with tempfile.TemporaryDirectory() as tmp:
        for fname in TABLE_FILES[name]:
            data = (RESULTS / fname).read_bytes()
            if rng.random() < 0.3:
                data = mutate_bytes(data, rng)
            else:
                lines = data.splitlines()
                i = rng.randrange(len(lines))
                lines[i] = dumps_json(mutate_json(json.loads(lines[i]), rng))
                data = b"\n".join(lines)
            Path(tmp, fname).write_bytes(data)
        rr.TABLES[name](Path(tmp))


def test_fuzz_index_bytes():
    run_capped("tests.test_results_index:fuzz_index_bytes", cases=150)


def test_fuzz_index_tree():
    run_capped("tests.test_results_index:fuzz_index_tree", cases=50)  # ~0.3 s a case: PyYAML in Python


def test_fuzz_tables():
    run_capped("tests.test_results_index:fuzz_tables", cases=600)
