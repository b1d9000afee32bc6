"""The configuration table (`kvx_core.config`, issue 37): typed parsing of outside values (environment strings,
an engine's JSON) with KvxError naming the variable, one spelling per setting with deprecated ones warned about or
refused when they disagree, precedence (engine key, environment, default), no KVX_* environment reads outside the
table, `kvx config`, and the committed guide page equal to the table's rendering."""
from __future__ import annotations

import ast
import json
import random
import warnings
from pathlib import Path

import pytest

from kvx_cli.main import main
from kvx_core import config, jsonsafe
from kvx_core.errors import KvxError, Status
from tests.fuzz import EXTREME_JSON, dumps_json, mutate_json, run_capped
from tests.sources import package_dirs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No KVX_* variable of the caller's shell leaks into a test; `once` starts empty and is left empty."""
    for s in config.SETTINGS:
        monkeypatch.delenv(s.env, raising=False)
    config.once.cache_clear()
    yield
    config.once.cache_clear()


def _refused(name, given=None, environ=None) -> KvxError:
    with pytest.raises(KvxError) as e:
        config.resolve(name, given, environ)
    assert e.value.status == Status.INVALID_ARGUMENT
    return e.value


def test_the_guide_page_is_the_tables_rendering():
    assert (ROOT / "docs" / "guide" / "configuration.md").read_text() == config.render_markdown()


def test_every_setting_is_in_the_guide_and_spelled_once():
    page = config.render_markdown()
    assert len({s.name for s in config.SETTINGS}) == len({s.env for s in config.SETTINGS}) == len(config.SETTINGS)
    for s in config.SETTINGS:
        assert f"| `{s.name}` | `{s.env}` |" in page
        assert s.env == "KVX_" + s.name.upper()
        assert all(k == f"additional_config.kvx.{s.name}" for k in s.keys)


def _environ_reads(path: Path) -> list[str]:
    """`os.environ[...]` / `.get(...)` / `os.getenv(...)` / `... in os.environ` whose key is a KVX_* string or not a
    string literal at all (a variable may hold a KVX_* name), as 'file:line'."""
    tree = ast.parse(path.read_text(), str(path))
    hits = []

    def is_environ(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ" or isinstance(node, ast.Name) and \
            node.id == "environ"

    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and (
                node.func.attr in ("get", "pop", "setdefault") and is_environ(node.func.value)
                or node.func.attr == "getenv"):
            key = node.args[0]
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            key = node.left
        if key is not None and not (isinstance(key, ast.Constant) and not str(key.value).startswith("KVX_")):
            hits.append(f"{path}:{node.lineno}")
    return hits


def test_no_kvx_environment_reads_outside_the_table():
    """Every KVX_* variable is read through `kvx_core.config` (its parsing, its errors, its docs)."""
    table = Path(config.__file__).resolve()
    stray = [hit for d in package_dirs(ROOT).values() for p in sorted(d.rglob("*.py")) if p.resolve() != table
             for hit in _environ_reads(p)]
    assert stray == []


def test_the_stray_read_check_finds_reads(tmp_path):
    """The oracle of the test above, on reads it must find and reads it must leave."""
    p = tmp_path / "probe.py"
    p.write_text('import os\nfrom os import environ\nV = "KVX_X"\na = os.environ.get("KVX_STORE")\n'
                 'b = os.environ[V]\nc = os.getenv("KVX_ROLE")\nd = "KVX_Y" in os.environ\ne = environ.get("KVX_Z")\n'
                 'f = os.environ.get("CUDA_HOME")\n')
    assert [h.rsplit(":", 1)[1] for h in _environ_reads(p)] == ["4", "5", "6", "7", "8"]


@pytest.mark.parametrize("text, expected", [("1", True), ("TRUE", True), ("yes", True), ("On", True), ("0", False),
                                            ("false", False), ("No", False), ("off", False)])
def test_booleans_from_the_environment(text, expected):
    assert config.resolve("rotate", environ={"KVX_ROTATE": text}) == (expected, "env KVX_ROTATE")


@pytest.mark.parametrize("text", ["2", "-1", "tru", "y", "enabled", " 1", "1.0", "٠"])
def test_other_boolean_words_are_refused(text):
    assert "KVX_ROTATE" in _refused("rotate", environ={"KVX_ROTATE": text}).message


@pytest.mark.parametrize("text, n", [("1", 1), ("512MiB", 512 << 20), ("2g", 2 << 30), (" 64 k ", 64 << 10),
                                     (str(1 << 60), 1 << 60)])
def test_byte_counts_from_the_environment(text, n):
    assert config.resolve("kv_cache_memory", environ={"KVX_KV_CACHE_MEMORY": text}).value == n


@pytest.mark.parametrize("text", ["0", "-1", "1.5GiB", "0x10", "1e9", "2TB", "GiB", "١٢", str((1 << 60) + 1),
                                  "9" * 30, "1_000"])
def test_byte_counts_are_never_truncated_or_guessed(text):
    assert "KVX_KV_CACHE_MEMORY" in _refused("kv_cache_memory", environ={"KVX_KV_CACHE_MEMORY": text}).message


@pytest.mark.parametrize("raw, want", [("256", 256), (16, 16), ("1", 1)])
def test_counts_from_the_environment_and_json(raw, want):
    src = {"environ": {"KVX_STORE_PREFIX_BLOCK": raw}} if isinstance(raw, str) else \
        {"given": {"additional_config.kvx.store_prefix_block": raw}}
    assert config.resolve("store_prefix_block", src.get("given"), src.get("environ", {})).value == want


@pytest.mark.parametrize("raw", ["0", "-1", "1.5", "16k", "\u0661\u0666", " ", "9" * 19, 0, -3, 1.5, True, "16", 2**61])
def test_counts_are_never_truncated_or_guessed(raw):
    """A JSON count is an integer (a string is refused there: JSON has numbers); the environment's digits only."""
    if isinstance(raw, str) and raw != "16":
        e = _refused("store_prefix_block", environ={"KVX_STORE_PREFIX_BLOCK": raw})
    else:
        e = _refused("store_prefix_block", {"additional_config.kvx.store_prefix_block": raw})
    assert "store_prefix_block" in e.message.lower() or "STORE_PREFIX_BLOCK" in e.message


def test_byte_counts_from_json_are_integers_or_strings_with_units():
    key = "additional_config.kvx.store_max_bytes"
    assert config.resolve("store_max_bytes", {key: 4096}, {}).value == 4096
    assert config.resolve("store_max_bytes", {key: "8GiB"}, {}).value == 8 << 30
    for bad in (0, -1, 1.5, True, 2**61, "1.5GiB"):
        _refused("store_max_bytes", {key: bad})


@pytest.mark.parametrize("name, text", [("role", "sender"), ("role", "Both"), ("decode_backend", "CUDA"),
                                        ("write_backend", "tpu"), ("prefill", "flash"), ("format", "nvfp5"),
                                        ("lm_head", "nvfp4")])
def test_choices_are_exact(name, text):
    env = config.BY_NAME[name].env
    e = _refused(name, environ={env: text})
    assert env in e.message and repr(text) in e.message


def test_empty_variable_is_unset_and_precedence_is_key_then_environment_then_default():
    assert config.resolve("store", environ={"KVX_STORE": ""}) == (None, "default")
    assert config.resolve("store", environ={"KVX_STORE": "/e"}) == ("/e", "env KVX_STORE")
    given = {"additional_config.kvx.store": "/k"}
    assert config.resolve("store", given, {"KVX_STORE": "/e"}) == ("/k", "additional_config.kvx.store")


def test_a_bad_environment_value_is_refused_even_where_a_key_overrides_it():
    """Nothing is silently dropped: a variable that would break the next run without the key is refused now."""
    _refused("rotate", {"additional_config.kvx.rotate": True}, {"KVX_ROTATE": "maybe"})


def test_deprecated_spelling_warns_with_the_new_one():
    with pytest.warns(DeprecationWarning, match=r"kv_connector_extra_config.kvx_store is deprecated: use "
                                                r"additional_config.kvx.store or KVX_STORE"):
        r = config.resolve("store", {"kv_connector_extra_config.kvx_store": "/old"})
    assert r == ("/old", "kv_connector_extra_config.kvx_store")
    with pytest.warns(DeprecationWarning):
        same = {"kv_connector_extra_config.kvx_kvtc": "/c", "additional_config.kvx.kvtc": "/c"}
        assert config.resolve("kvtc", same) == ("/c", "additional_config.kvx.kvtc")


def test_deprecated_and_new_spelling_that_disagree_are_refused():
    given = {"kv_connector_extra_config.kvx_store": "/old", "additional_config.kvx.store": "/new"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        e = _refused("store", given)
    assert "/old" in e.message and "/new" in e.message and "additional_config.kvx.store" in e.message


@pytest.mark.parametrize("additional, extra, words", [
    ([], {}, "must be a JSON object"), ({"KVX": {}}, {}, 'did you mean "kvx"'), ({"kvx": []}, {}, "must be an object"),
    ({"kvx": {"role": "both"}}, {}, "unknown --additional-config kvx option(s) 'role'"),
    ({"kvx": {"stor": "/a"}}, {}, "'stor'"), ({}, {"kvx_stor": "/a"}, "'kvx_stor' are not read"),
])
def test_vllm_json_that_would_be_ignored_is_refused(additional, extra, words):
    with pytest.raises(KvxError) as e:
        config.vllm_given(additional, extra)
    assert e.value.status == Status.INVALID_ARGUMENT and words in e.value.message


def test_once_reads_the_environment_once_per_process(monkeypatch):
    """The kernel choices ask on every call; the first answer holds for the process."""
    from kvx_core.ops import decode, write

    monkeypatch.setenv("KVX_DECODE_BACKEND", "triton")
    assert decode.requested_backend(None) == "triton"
    monkeypatch.setenv("KVX_DECODE_BACKEND", "cuda")
    assert decode.requested_backend(None) == "triton" and decode.requested_backend("auto") == "auto"
    monkeypatch.setenv("KVX_WRITE_BACKEND", "bogus")
    with pytest.raises(KvxError, match="KVX_WRITE_BACKEND"):
        write.choose_backend(None, None, None, None, None, None)


def test_kvx_config_prints_values_and_sources(monkeypatch, capsys):
    monkeypatch.setenv("KVX_ROLE", "consumer")
    assert main(["config", "--json", "--additional-config", '{"kvx": {"rotate": true}}']) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == set(config.BY_NAME)
    assert out["role"] == {"value": "consumer", "source": "env KVX_ROLE"}
    assert out["rotate"] == {"value": True, "source": "additional_config.kvx.rotate"}
    assert out["prefill"] == {"value": "split", "source": "default"}
    assert main(["config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(config.SETTINGS) and "env KVX_ROLE" in lines[[s.name for s in config.SETTINGS]
                                                                          .index("role")]
    assert main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == config.render_markdown()


@pytest.mark.parametrize("env, argv, words", [
    ({"KVX_KV_CACHE_MEMORY": "1.5GiB"}, [], "KVX_KV_CACHE_MEMORY"),
    ({}, ["--additional-config", '{"kvx": {"rotate": NaN}}'], "NaN"),
    ({}, ["--additional-config", "[" * 100 + "]" * 100], "nests deeper"),
    ({}, ["--additional-config", '{"kvx": {"prefill": 1}}'], "kvx.prefill"),
])
def test_kvx_config_refuses_bad_values_in_one_line(monkeypatch, capsys, env, argv, words):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["config", *argv]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.splitlines()) == 1 and words in cap.err


_VALID_ENV = {"KVX_FORMAT": "nvfp4_rot", "KVX_ROTATE": "true", "KVX_KV_CACHE_MEMORY": "512MiB", "KVX_ROLE": "both",
              "KVX_STORE": "/dev/shm/kvx", "KVX_DECODE_BACKEND": "auto"}
_VALID_VLLM = {"kvx": {"rotate": False, "prefill": "cache", "lm_head": "mxfp4", "kv_calibration": "/m/c.kvxcal",
                       "store": "/s", "kvtc": "/k"}}


def fuzz_target(rng: random.Random) -> None:
    """Forged environment strings and a forged vLLM --additional-config: only KvxError, or values of the types the
    table states."""
    environ = {k: v for k, v in _VALID_ENV.items() if rng.random() < 0.7}
    for _ in range(rng.choice([0, 0, 1, 2])):
        s = rng.choice(config.SETTINGS)
        v = rng.choice([*EXTREME_JSON, "".join(rng.choice("0123456789kKmMgGiIbB .-_xe") for _ in range(6))])
        environ[s.env] = v if isinstance(v, str) else json.dumps(v)
    if rng.random() < 0.5:  # one value swapped for an extreme one or another key's: past the structure checks
        kvx = dict(_VALID_VLLM["kvx"])
        kvx[rng.choice(list(kvx))] = rng.choice([*EXTREME_JSON, *kvx.values()])
        forged = {"kvx": kvx}
    else:
        forged = mutate_json(_VALID_VLLM, rng)
    additional = jsonsafe.loads(dumps_json(forged), "--additional-config")  # as `kvx config` reads it
    extra = rng.choice([{}, {"kvx_store": "/s"}, {"kvx_kvtc": rng.choice(EXTREME_JSON)}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        values = config.effective(config.vllm_given(additional, extra), environ)
    for name, r in values.items():
        kind = config.BY_NAME[name].kind
        positive = type(r.value) is int and 0 < r.value <= config.MAX_BYTES
        typed = {"bool": isinstance(r.value, bool), "bytes": positive, "count": positive}
        ok = typed.get(kind, isinstance(r.value, str) and r.value != "") or r.value is None and kind != "bool"
        assert ok, (name, r)


def test_fuzz_configuration_values():
    run_capped("tests.core.test_config:fuzz_target", cases=400)
