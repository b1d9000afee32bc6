"""`kvx_tgi.calibration` without TGI (its server tests are tests/tgi/test_tgi_calibration.py): which file a run
serves (environment, beside the weights, none), the layer index from TGI's prefix, and the refusals (missing file,
another model or geometry, a format the file has no scales for, a layer beyond the file's)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("kvx_tgi") is None:  # the main venv does not install the TGI plugin (kvx_tgi.calibration
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "kvx_tgi"))  # needs no TGI)

from kvx_core.errors import KvxError  # noqa: E402
from kvx_core.formats import get_format  # noqa: E402
from kvx_core.kv_calibration import FILENAME, KvCalibration, fingerprint_dict  # noqa: E402
from kvx_core.transfer import checkpoint_fingerprint  # noqa: E402
from kvx_tgi import calibration, config  # noqa: E402

L, H, D = 2, 2, 16


def _checkpoint(d: Path, heads: int = H) -> Path:
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": L,
                                               "num_attention_heads": 4, "num_key_value_heads": heads,
                                               "hidden_size": 4 * D}))
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    return d


def _save(d: Path, model: dict, formats=("nvfp4",), center: bool = False) -> KvCalibration:
    scales = {f: tuple((torch.full((H,), 0.01), torch.full((1,), 0.02)) for _ in range(L)) for f in formats}
    centers = tuple(torch.linspace(-1, 1, H * D).view(H, D) + i for i in range(L)) if center else None
    cal = KvCalibration(L, H, D, model, 0.5, "mse", tuple(torch.full((H, D), 2.0) for _ in range(L)), scales, centers)
    cal.save(str(d / FILENAME))
    return cal


def _weights(d: Path):
    return SimpleNamespace(routing={"model.embed_tokens.weight": str(d / "model.safetensors")})


@pytest.fixture(autouse=True)
def run(monkeypatch):
    monkeypatch.setattr(calibration, "_loaded", {})
    monkeypatch.delenv(calibration.ENV, raising=False)
    monkeypatch.setattr(config, "_current", config.RunConfig(get_format("nvfp4"), "flashdecoding", 256, None))


@pytest.mark.parametrize("center", [False, True])
def test_file_beside_the_weights(tmp_path, center):
    d = _checkpoint(tmp_path / "m")
    assert calibration.layer_values(_weights(d), "model.layers.1.self_attn") is None and not calibration.active()
    cal = _save(d, fingerprint_dict(checkpoint_fingerprint(str(d))), center=center)
    s, c, k, v = calibration.layer_values(_weights(d), "model.layers.1.self_attn")
    assert calibration.active()
    assert torch.equal(s, cal.smoothing[1]) and torch.equal(k, cal.scales["nvfp4"][1][0]) and v.shape == (1,)
    assert c is None if not center else torch.equal(c, cal.center[1])
    with pytest.raises(KvxError, match="no layer index"):
        calibration.layer_values(_weights(d), "model.norm")
    with pytest.raises(KvxError, match="not layer 2"):
        calibration.layer_values(_weights(d), "model.layers.2.self_attn")


def test_environment_file(tmp_path, monkeypatch):
    d, other = _checkpoint(tmp_path / "m"), tmp_path / "elsewhere"
    other.mkdir()
    _save(other, {})
    monkeypatch.setenv(calibration.ENV, str(other / FILENAME))
    assert calibration.layer_values(_weights(d), "model.layers.0.self_attn") is not None
    monkeypatch.setenv(calibration.ENV, str(other / "missing"))
    with pytest.raises(KvxError, match="no such file"):
        calibration.layer_values(_weights(d), "model.layers.0.self_attn")


@pytest.mark.parametrize("case, match", [("model", "another model"), ("heads", "the model has 2 x 3"),
                                         ("format", "not for nvfp4")])
def test_refusals(tmp_path, case, match):
    d = _checkpoint(tmp_path / "m", heads=3 if case == "heads" else H)
    fp = fingerprint_dict(checkpoint_fingerprint(str(d)))
    _save(d, {**fp, "tokenizer_sha256": "0" * 64} if case == "model" else {} if case == "heads" else fp,
          formats=("fp8_e4m3",) if case == "format" else ("nvfp4",))
    with pytest.raises(KvxError, match=match):
        calibration.layer_values(_weights(d), "model.layers.0.self_attn")
    assert not calibration.active()
