"""`kvx calibrate-kv` on a tiny local Llama: from text (smoothing + MSE scales equal to the library's fit of the same
observed K/V; with --center-keys the centers are the observed keys' means), from the checkpoint's own k_scale /
v_scale (auto picks them, unless the keys are to be smoothed or centered), next to the model by default, never
overwriting without --force, and one-line refusals (exit 2) before any model loads."""
from __future__ import annotations

import shutil

import pytest
import torch

from kvx_cli.main import main
from kvx_core.kv_calibration import FILENAME, from_samples, load_kv_calibration

from .tiny_llama import text_fixture, tiny_llama_fixture

TEXT = "The lighthouse keeper counted the ships that passed in the night, one by one. " * 8


tiny = tiny_llama_fixture()
text = text_fixture(TEXT)


def test_text_source_writes_next_to_the_model(tiny, text, tmp_path, capsys):
    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    args = ["calibrate-kv", "--model", str(model), "--text", str(text), "--tokens", "128", "--smooth-keys", "0.5",
            "--no-center-keys", "--formats", "nvfp4,k8v4_rot"]
    assert main(args) == 0, capsys.readouterr().err
    cal = load_kv_calibration(str(model / FILENAME))
    assert (cal.num_layers, cal.num_kv_heads, cal.head_dim, cal.alpha, cal.rule) == (2, 2, 16, 0.5, "mse")
    assert sorted(cal.scales) == ["k8v4_rot", "nvfp4"] and cal.model["num_kv_heads"] == 2

    # the same fit from the demo's observation path, in process: equal to the file bit for bit
    from kvx_cli.demo_cmd import observe_kv
    from kvx_demo import load_model, load_windows, model_shape

    lm = load_model(model)
    obs = observe_kv(lm.model, load_windows(lm.tokenizer, 1, 128, TEXT), model_shape(lm.model), 16)
    ref = from_samples(obs, ["nvfp4", "k8v4_rot"], rule="mse", alpha=0.5, model=cal.model)
    assert ref.identity == cal.identity

    before = (model / FILENAME).read_bytes()
    assert main(args) == 2 and "--force" in capsys.readouterr().err  # never overwritten
    assert (model / FILENAME).read_bytes() == before
    assert main(args + ["--rule", "amax", "--force"]) == 0
    assert load_kv_calibration(str(model / FILENAME)).rule == "amax"
    assert sorted(p.name for p in model.iterdir() if p.name.startswith(".kvx-")) == []  # no temporary file left


def test_center_keys(tiny, text, tmp_path, capsys):
    """The file's centers are `key_center` of the keys the demo's observation path sees, smoothing is fitted on the
    centered keys and the scales on (K - c) / s: the library's `from_samples(center=True)`, bit for bit."""
    from kvx_cli.demo_cmd import observe_kv
    from kvx_core.calibration import key_center
    from kvx_demo import load_model, load_windows, model_shape

    out = tmp_path / "c.kvx"
    assert main(["calibrate-kv", "--model", str(tiny), "--text", str(text), "--tokens", "128", "--center-keys",
                 "--smooth-keys", "0.5", "--formats", "nvfp4", "--out", str(out)]) == 0, capsys.readouterr().err
    assert "key centering" in capsys.readouterr().out
    cal = load_kv_calibration(str(out))
    assert cal.center is not None and cal.params()["version"] == 2 and cal.alpha == 0.5
    lm = load_model(tiny)
    obs = observe_kv(lm.model, load_windows(lm.tokenizer, 1, 128, TEXT), model_shape(lm.model), 16)
    for i in range(2):
        assert torch.equal(cal.center[i], key_center(obs.values(i)[0]))
        assert float(cal.center[i].abs().max()) > 0  # a real offset, not zeros
    ref = from_samples(obs, ["nvfp4"], rule="mse", alpha=0.5, model=cal.model, center=True)
    assert ref.identity == cal.identity
    # centering alone (no smoothing): centers, no smoothing vectors
    assert main(["calibrate-kv", "--model", str(tiny), "--text", str(text), "--tokens", "128", "--center-keys",
                 "--no-smooth-keys", "--formats", "nvfp4", "--out", str(out), "--force"]) == 0
    only = load_kv_calibration(str(out))
    assert only.smoothing is None and torch.equal(only.center[1], cal.center[1])


def test_checkpoint_source(tiny, tmp_path, capsys):
    from safetensors.torch import save_file

    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    save_file({f"model.layers.{i}.self_attn.{s}_scale": torch.tensor([0.25 * (i + 1)]) for i in range(2) for s in "kv"},
              str(model / "kv_scales.safetensors"))
    out = tmp_path / "c.safetensors"
    plain = ["--no-smooth-keys", "--no-center-keys"]  # auto takes the checkpoint's scales only without transforms
    assert main(["calibrate-kv", "--model", str(model), *plain, "--out", str(out)]) == 0, capsys.readouterr().err
    cal = load_kv_calibration(str(out))
    assert cal.rule == "checkpoint" and cal.smoothing is None and "nvfp4_rot" not in cal.scales
    assert torch.allclose(cal.scales["fp8_e4m3"][1][0], torch.tensor([0.5]))  # amax 0.5 * 448 -> / 448
    assert torch.allclose(cal.scales["nvfp4"][0][1], torch.tensor([0.25 * 448 / (6 * 448)]))
    # auto + --text would leave the text unused: refused; --source text uses it
    assert main(["calibrate-kv", "--model", str(model), *plain, "--out", str(tmp_path / "x"), "--rule", "amax"]) == 2
    assert "--source text" in capsys.readouterr().err
    assert main(["calibrate-kv", "--model", str(model), "--source", "checkpoint", "--smooth-keys"]) == 2
    assert "unsmoothed" in capsys.readouterr().err
    assert main(["calibrate-kv", "--model", str(model), "--source", "checkpoint", "--center-keys",
                 "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "--center-keys" in err and "uncentered" in err and err.count("\n") == 1, err
    assert not (tmp_path / "y").exists()
    # auto with the default recipe calibrates on text although the checkpoint has scales (they describe untransformed
    # keys); --source checkpoint turns the recipe's transforms off
    assert main(["calibrate-kv", "--model", str(model), "--formats", "nvfp4", "--tokens", "64",
                 "--out", str(tmp_path / "z.kvxcal")]) == 0, capsys.readouterr().err
    z = load_kv_calibration(str(tmp_path / "z.kvxcal"))
    assert z.rule == "mse" and z.center is not None and z.alpha == 0.25
    assert main(["calibrate-kv", "--model", str(model), "--source", "checkpoint", "--formats", "nvfp4",
                 "--out", str(tmp_path / "w.kvxcal")]) == 0, capsys.readouterr().err
    w = load_kv_calibration(str(tmp_path / "w.kvxcal"))
    assert (w.rule, w.center, w.smoothing) == ("checkpoint", None, None)


@pytest.mark.parametrize("extra, message", [
    (["--source", "checkpoint"], "no k_scale"),
    (["--formats", "int4"], "take no global scale"),
    (["--formats", "nvfp4,nvfp4"], "each once"),
    (["--source", "text", "--window-len", "4096"], "context"),
    (["--smooth-keys", "1.5"], "ALPHA"),
    (["--text", "/nonexistent.txt"], "cannot read"),
])
def test_refusals_are_one_line(tiny, tmp_path, capsys, extra, message):
    out = tmp_path / "c.safetensors"
    assert main(["calibrate-kv", "--model", str(tiny), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_missing_model_dir_is_refused(tmp_path, capsys):
    assert main(["calibrate-kv", "--model", str(tmp_path / "none")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_a_weight_file_name_beside_the_model_is_refused(tiny, capsys):
    """vLLM and TGI would load it as a weight shard."""
    assert main(["calibrate-kv", "--model", str(tiny), "--out", str(tiny / "kv.safetensors")]) == 2
    assert "as weights" in capsys.readouterr().err and not (tiny / "kv.safetensors").exists()


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if the command loads a model or builds the demo checkpoint: refusals come first."""
    import kvx_demo

    def loaded(*_a, **_k):
        raise AssertionError("the model was loaded (or the demo checkpoint built) before the refusal")

    monkeypatch.setattr(kvx_demo, "load_model", loaded)
    monkeypatch.setattr(kvx_demo, "ensure_local_checkpoint", loaded)


def _refused_before_loading(args: list[str], capsys, message: str) -> None:
    assert main(["calibrate-kv", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_out_paths_are_checked_before_the_model_loads(tiny, tmp_path, capsys, no_model_load):
    """--out a directory with --force (was IsADirectoryError after calibrating), a FIFO, a missing folder, an
    existing name (a dangling link too) without --force: one line, exit 2, nothing loaded, nothing changed."""
    import os

    folder = tmp_path / "a_dir"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    base = ["--model", str(tiny), "--formats", "nvfp4", "--window-len", "64"]
    for out, force, message in ((folder, True, "not a regular file"), (tmp_path / "fifo", True, "not a regular file"),
                                (tmp_path / "no" / "c.kvx", False, "not a directory this user can write in"),
                                (tmp_path / "dangling", False, "exists; pass --force")):
        _refused_before_loading([*base, "--out", str(out), *(["--force"] if force else [])], capsys, message)
    assert [p.name for p in folder.iterdir()] == ["keep.txt"] and (folder / "keep.txt").read_text() == "mine"
    assert os.readlink(tmp_path / "dangling") == str(tmp_path / "nowhere")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "dangling", "fifo"]
    # the default model (the demo checkpoint) is not built before --out is refused either
    _refused_before_loading(["--out", str(folder), "--force"], capsys, "not a regular file")


def test_text_is_capped_and_must_be_a_regular_file(tiny, tmp_path, capsys, monkeypatch, no_model_load):
    """--text /dev/zero read until memory ran out; a FIFO would block; a file over MAX_TEXT_BYTES is refused."""
    import os

    from kvx_cli import demo_cmd

    os.mkfifo(tmp_path / "fifo")
    out = tmp_path / "c.kvx"
    for path in ("/dev/zero", str(tmp_path / "fifo"), str(tmp_path)):
        _refused_before_loading(["--model", str(tiny), "--text", path, "--out", str(out)], capsys,
                                "is not a regular file")
    big = tmp_path / "big.txt"
    big.write_text("x" * 101)
    monkeypatch.setattr(demo_cmd, "MAX_TEXT_BYTES", 100)
    _refused_before_loading(["--model", str(tiny), "--text", str(big), "--out", str(out)], capsys,
                            "larger than the 100 bytes")
    assert not out.exists()


def test_text_reads_like_read_text(tmp_path, monkeypatch):
    """The capped read gives what `Path.read_text` gave (universal newlines), up to MAX_TEXT_BYTES exactly."""
    from kvx_cli import demo_cmd

    p = tmp_path / "t.txt"
    p.write_bytes("a\r\nb\rc\n\u00e9".encode())
    monkeypatch.setattr(demo_cmd, "MAX_TEXT_BYTES", p.stat().st_size)
    assert demo_cmd._read_text(p) == p.read_text(encoding="utf-8") == "a\nb\nc\n\u00e9"


def test_defaults_are_the_measured_recipe_over_every_window(tiny, text, tmp_path, capsys):
    """No transform flag: centering + smoothing ALPHA 0.25 + MSE scales (the measured recipe, docs/results.md), fitted
    on all --tokens (two windows here, not silently the first), said in the output and recorded in the file; the
    file is mode 0644 under umask 022 and `inspect` prints it on one screen."""
    import os

    from kvx_cli.demo_cmd import observe_kv
    from kvx_core.calibration import SampleObserver
    from kvx_demo import load_model, load_windows, model_shape

    out = tmp_path / "r.kvxcal"
    old = os.umask(0o022)
    try:
        assert main(["calibrate-kv", "--model", str(tiny), "--text", str(text), "--tokens", "256", "--window-len",
                     "128", "--formats", "nvfp4", "--out", str(out)]) == 0, capsys.readouterr().err
    finally:
        os.umask(old)
    printed = capsys.readouterr()
    assert "256 tokens of text, 2 x 128" in printed.out and "key centering, key smoothing alpha 0.25" in printed.out
    assert "calibrate-kv:" not in printed.err  # no progress off a terminal without --progress
    assert os.stat(out).st_mode & 0o777 == 0o644
    cal = load_kv_calibration(str(out))
    assert (cal.alpha, cal.rule, cal.center is not None) == (0.25, "mse", True)
    assert cal.sample == {"tokens": 256, "windows": 2, "window_len": 128, "text": str(text)}
    lm = load_model(tiny)
    ids = load_windows(lm.tokenizer, 2, 128, TEXT)
    obs = SampleObserver(2, max_tokens=256)
    for w in range(2):
        observe_kv(lm.model, ids[w:w + 1], model_shape(lm.model), 16, obs)
    keys = obs.values(0)[0]
    assert keys.shape[0] == 256
    assert torch.equal(cal.center[0], keys.double().mean(0).float())  # the mean over both windows
    assert from_samples(obs, ["nvfp4"], rule="mse", alpha=0.25, model=cal.model, center=True).identity == cal.identity

    assert main(["calibrate-kv", "inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    for line in ("key centering  yes", "key smoothing  ALPHA 0.25", "scale rule     mse",
                 f"sample         256 tokens (2 x 128) of {text}", "geometry       2 layers x 2 KV heads x head_dim 16",
                 "scales nvfp4", "LlamaForCausalLM"):
        assert line in shown, shown


def test_progress_on_request(tiny, text, tmp_path, capsys):
    assert main(["calibrate-kv", "--model", str(tiny), "--text", str(text), "--tokens", "64", "--formats", "nvfp4",
                 "--out", str(tmp_path / "p.kvxcal"), "--progress"]) == 0
    err = capsys.readouterr().err
    assert "calibrate-kv: observing K/V, window: 1/1" in err and "fitting scales, format x layer: 1/2" in err
    assert "left" in err


@pytest.mark.parametrize("args, message", [
    (["--tokens", "300", "--window-len", "128"], "not a multiple of --window-len"),
    (["--smooth-keys", "0.5", "--no-smooth-keys"], "contradict"),
    (["--tokens", "1"], "out of range"),
    (["--tokens", "2.5"], "not an integer"),
    (["stray.kvxcal"], "invalid choice"),
])
def test_sample_and_transform_refusals_come_before_the_model_loads(tiny, tmp_path, capsys, no_model_load, args,
                                                                    message):
    _refused_before_loading(["--model", str(tiny), "--out", str(tmp_path / "c.kvxcal"), *args], capsys, message)
    assert not (tmp_path / "c.kvxcal").exists()


def test_inspect_refusals(tmp_path, capsys):
    _refused_before_loading(["inspect"], capsys, "inspect needs FILE")
    _refused_before_loading(["inspect", str(tmp_path / "none.kvxcal")], capsys, "no such file")
    _refused_before_loading(["inspect", str(tmp_path / "none.kvxcal"), "--tokens", "64", "--force"], capsys,
                            "--tokens, --force apply to calibrating")
    (tmp_path / "x.kvxcal").write_bytes(b"\x00" * 16)
    _refused_before_loading(["inspect", str(tmp_path / "x.kvxcal")], capsys, "x.kvxcal")


def test_a_soft_capped_model_is_not_centered_by_default(tiny, text, tmp_path, capsys):
    """Engines refuse centered keys for a model with an attention logit soft cap: the default leaves centering out,
    and --center-keys is refused in one line (nothing written)."""
    import json

    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "attn_logit_softcapping": 50.0}))
    out = tmp_path / "s.kvxcal"
    assert main(["calibrate-kv", "--model", str(model), "--text", str(text), "--tokens", "64", "--formats", "nvfp4",
                 "--center-keys", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "soft cap" in err and "--no-center-keys" in err and err.count("\n") == 1 and not out.exists()
    assert main(["calibrate-kv", "--model", str(model), "--text", str(text), "--tokens", "64", "--formats", "nvfp4",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    cal = load_kv_calibration(str(out))
    assert cal.center is None and cal.alpha == 0.25
