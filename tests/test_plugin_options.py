"""vLLM plugin run options (issue 10, F12), tested without vLLM: `kvx_vllm.options` parses
`additional_config` and refuses, with a ValueError naming the fix, a non-object `additional_config`
(formerly AttributeError), a "kvx" key spelt another way (formerly silently ignored), and bad "kvx" options.
"""
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from .procs import run

PLUGIN = Path(__file__).resolve().parents[1] / "plugins" / "kvx_vllm"
if importlib.util.find_spec("kvx_vllm") is None:  # the main venv does not install the plugin
    sys.path.insert(0, str(PLUGIN))
options = importlib.import_module("kvx_vllm.options")


def _config(extra):
    return SimpleNamespace(additional_config=extra)


def test_options_and_dtypes_import_without_vllm():
    """Even where vLLM is installed, loading these modules must not import it (import vllm fails here)."""
    code = ("import sys; sys.modules['vllm'] = None; sys.path.insert(0, sys.argv[1]); "
            "import kvx_vllm.options as o, kvx_vllm.dtypes; from kvx_core import config; "
            "print(o.options_of(None) == o.KvxOptions(**{f: config.BY_NAME[f].default for f in o._KNOWN}))")
    out = run([sys.executable, "-c", code, str(PLUGIN)])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"  # every setting at the table's default


@pytest.mark.parametrize("extra, rotate, prefill", [
    (None, False, "split"), ({}, False, "split"), ({"other_platform_key": 1}, False, "split"),
    ({"kvx": {}}, False, "split"), ({"kvx": {"rotate": True}}, True, "split"),
    ({"kvx": {"rotate": False}}, False, "split"),
    ({"kvx": {"prefill": "cache"}}, False, "cache"), ({"kvx": {"prefill": "split", "rotate": True}}, True, "split"),
])
def test_valid_configs(extra, rotate, prefill):
    assert options.options_of(_config(extra)) == options.KvxOptions(rotate=rotate, prefill=prefill)


def test_lm_head_option():
    assert options.options_of(_config({"kvx": {"lm_head": "mxfp4"}})).lm_head == "mxfp4"
    assert options.options_of(_config({"kvx": {"lm_head": None}})).lm_head is None


def test_kv_calibration_option():
    path = "/m/c.safetensors"
    assert options.options_of(_config({"kvx": {"kv_calibration": path}})).kv_calibration == path
    assert options.options_of(_config({"kvx": {}})).kv_calibration is None


def test_config_without_additional_config_attribute():
    assert options.options_of(SimpleNamespace()) == options.KvxOptions()


@pytest.mark.parametrize("extra", ["kvx", 5, ["kvx"], ("kvx",), 0, "", [], 1.5, True])
def test_non_object_additional_config_is_refused(extra):
    with pytest.raises(ValueError, match="--additional-config must be a JSON object"):
        options.options_of(_config(extra))


@pytest.mark.parametrize("key", ["KVX", "Kvx", "kVx", " kvx", "kvx ", "KVX\n"])
def test_misspelt_kvx_key_is_refused(key):
    with pytest.raises(ValueError, match='did you mean "kvx"') as e:
        options.options_of(_config({key: {"rotate": True}}))
    assert repr(key) in str(e.value)


def test_misspelt_key_is_refused_even_beside_the_right_one():
    with pytest.raises(ValueError, match='did you mean "kvx"'):
        options.options_of(_config({"kvx": {}, "KVX": {"rotate": True}}))


@pytest.mark.parametrize("section", [None, "rotate", ["rotate"], 1, True])
def test_non_object_kvx_section_is_refused(section):
    with pytest.raises(ValueError, match='"kvx" must be an object'):
        options.options_of(_config({"kvx": section}))


@pytest.mark.parametrize("section, match", [
    ({"rotation": True}, "unknown .*'rotation'"), ({"Rotate": True}, "unknown .*'Rotate'"),
    ({1: True, "x": 2}, "unknown .*'x', 1;"),  # mixed key types are reported, not a TypeError from sorting
    ({"rotate": 1}, "kvx.rotate must be true or false"), ({"rotate": "true"}, "kvx.rotate must be true or false"),
    ({"rotate": None}, "kvx.rotate must be true or false"),
    ({"prefill": "flash"}, "kvx.prefill must be one of split, split_fused, cache"),
    ({"prefill": None}, "kvx.prefill must be"),
    ({"prefill": "Cache"}, "kvx.prefill must be one of"), ({"prefill": True}, "kvx.prefill must be"),
    ({"lm_head": "MXFP4"}, "kvx.lm_head must be one of mxfp4"), ({"lm_head": "nvfp4"}, "kvx.lm_head must be one of"),
    ({"lm_head": True}, "kvx.lm_head must be"),
    ({"kv_calibration": ""}, "kvx.kv_calibration must be a non-empty path"), ({"kv_calibration": 1}, "non-empty path"),
    ({"store": ""}, "kvx.store must be a non-empty path"), ({"kvtc": ["/a"]}, "kvx.kvtc must be a non-empty path"),
])
def test_bad_kvx_options_are_refused(section, match):
    with pytest.raises(ValueError, match=match):
        options.options_of(_config({"kvx": section}))


def test_format_names():
    from kvx_vllm.dtypes import KVX_CACHE_DTYPES, format_name

    assert [format_name(d, False) for d in KVX_CACHE_DTYPES] == ["nvfp4", "mxfp4", "int4", "int8", "k8v4"]
    assert format_name("kvx_nvfp4", True) == "nvfp4_rot"
    with pytest.raises(ValueError, match="no rotated variant"):
        format_name("kvx_int8", True)
    for bad in ("fp8", "KVX_NVFP4", None, ["kvx_nvfp4"]):
        with pytest.raises(ValueError, match="is not a KVX cache dtype"):
            format_name(bad, False)


def _run_config(kv_transfer_config, speculative_config=None, **parallel):
    return SimpleNamespace(
        additional_config=None, kv_transfer_config=kv_transfer_config, speculative_config=speculative_config,
        cache_config=SimpleNamespace(kv_cache_dtype_skip_layers=None, cache_dtype="kvx_nvfp4"),
        parallel_config=SimpleNamespace(**parallel), model_config=None)


@pytest.mark.parametrize("transfer", [{"kv_connector": "KvxConnector"},
                                      {"kv_connector": "Anything", "kv_connector_module_path": "kvx_vllm.connector"}])
def test_kvx_connector_is_accepted_with_kvx_dtypes(transfer):
    assert options.check_config(_run_config(SimpleNamespace(**transfer))) == "nvfp4"


@pytest.mark.parametrize("name", ["NixlConnector", "ExampleConnector", "LMCacheConnectorV1"])
def test_other_connectors_are_refused_with_kvx_dtypes(name):
    """vLLM's own connectors move raw pages and check dtypes by name or byte size; they are refused, naming ours."""
    with pytest.raises(ValueError, match="KvxConnector"):
        options.check_config(_run_config(SimpleNamespace(kv_connector=name, kv_connector_module_path=None)))


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_verified_speculators_are_accepted(method):
    """The n-gram speculator (no attention of its own) and EAGLE (its head attends through the KVX backend): their
    verification steps run as multi-row decodes (tests/vllm/test_vllm_spec_decode.py)."""
    spec = SimpleNamespace(method=method, num_speculative_tokens=3)
    assert options.check_config(_run_config(None, spec)) == "nvfp4"


@pytest.mark.parametrize("method", ["eagle3", "draft_model", "mtp", "suffix", None])
def test_other_speculators_are_refused_with_the_reason(method):
    """Drafters that run attention layers through the backend (or are not tested) are refused, naming the method
    and what is verified."""
    with pytest.raises(ValueError, match=f"speculative decoding with method {method!r}.*'ngram', 'eagle' only"):
        options.check_config(_run_config(None, SimpleNamespace(method=method, num_speculative_tokens=2)))


@pytest.mark.parametrize("parallel, flags", [
    ({"decode_context_parallel_size": 2}, "--decode-context-parallel-size 2"),
    ({"prefill_context_parallel_size": 4, "decode_context_parallel_size": 1}, "--prefill-context-parallel-size 4"),
    ({"decode_context_parallel_size": 2, "prefill_context_parallel_size": 2},
     "--decode-context-parallel-size 2 --prefill-context-parallel-size 2"),
])
def test_context_parallelism_is_refused_naming_the_setting(parallel, flags):
    """Decode / prefill context parallelism shards a sequence's KV along its tokens across ranks: refused at startup
    with the flags the run set and why (the real field names are checked on vLLM's ParallelConfig in
    tests/vllm/test_vllm_parallel.py)."""
    with pytest.raises(ValueError, match=re.escape(f"context parallelism ({flags}): each rank would hold")):
        options.check_config(_run_config(None, tensor_parallel_size=2, **parallel))


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                      {"data_parallel_size": 2, "data_parallel_rank": 1},
                                      {"decode_context_parallel_size": 1, "prefill_context_parallel_size": 1}])
def test_tensor_pipeline_and_data_parallelism_are_not_refused(parallel):
    """The backend serves each rank's own layers and heads: tensor parallelism (verified), pipeline and data
    parallelism (untested, compat_matrix.yaml) start."""
    assert options.check_config(_run_config(None, **parallel)) == "nvfp4"


def _env_clean(monkeypatch):
    from kvx_core import config

    for s in config.SETTINGS:
        monkeypatch.delenv(s.env, raising=False)


def test_options_come_from_the_environment_when_no_key_is_given(monkeypatch):
    """One spelling per setting: KVX_<NAME> stands in for the additional_config key (which wins over it)."""
    _env_clean(monkeypatch)
    monkeypatch.setenv("KVX_ROTATE", "1")
    monkeypatch.setenv("KVX_STORE", "/env/store")
    assert options.options_of(_config(None)) == options.KvxOptions(rotate=True, store="/env/store")
    assert options.options_of(_config({"kvx": {"rotate": False, "store": "/k"}})) == options.KvxOptions(store="/k")
    monkeypatch.setenv("KVX_PREFILL", "flash")
    with pytest.raises(ValueError, match="KVX_PREFILL must be one of split, split_fused, cache, got 'flash'"):
        options.options_of(_config(None))


def _with_connector(extra, additional=None, dtype="auto"):
    return SimpleNamespace(additional_config=additional, cache_config=SimpleNamespace(cache_dtype=dtype),
                           kv_transfer_config=SimpleNamespace(kv_connector="KvxConnector",
                                                              kv_connector_extra_config=extra))


def test_connector_settings_old_spelling_is_read_with_a_warning(monkeypatch):
    _env_clean(monkeypatch)
    with pytest.warns(DeprecationWarning, match="kvx_store is deprecated: use additional_config.kvx.store"):
        assert options.options_of(_with_connector({"kvx_store": "/s", "other": 1})).store == "/s"
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="store is given twice"):
        options.options_of(_with_connector({"kvx_store": "/old"}, {"kvx": {"store": "/new"}}))
    with pytest.raises(ValueError, match="'kvx_stor' are not read"):
        options.options_of(_with_connector({"kvx_stor": "/s"}))


def test_calibration_from_the_environment_is_refused_for_vllms_own_caches(monkeypatch):
    """A set setting that would do nothing is refused, naming where it was set."""
    _env_clean(monkeypatch)
    monkeypatch.setenv("KVX_KV_CALIBRATION", "/m/c.kvxcal")
    with pytest.raises(ValueError, match=r"kv_calibration \(env KVX_KV_CALIBRATION\) applies to kvx_"):
        options.options_of(_with_connector({}, dtype="fp8"))
    assert options.options_of(_with_connector({}, dtype="kvx_nvfp4")).kv_calibration == "/m/c.kvxcal"
