"""A KV calibration file (`kvx_core.kv_calibration`) in TGI's real model server: found beside the weights, each
layer's cache takes its key smoothing, key centering (when the file has it) and per-head global scales (replacing
the checkpoint's k_scale / v_scale), and every layer's cache reads back exactly the format's encode -> decode of
`(K - c) / s`, times `s`, plus `c` (`checks.cache_mismatches`);
a file for another format or model is refused when the model loads."""
from __future__ import annotations

import os

import pytest
import torch

from kvx_core.errors import KvxError
from kvx_core.kv_calibration import FILENAME, KvCalibration, fingerprint_dict
from kvx_core.transfer import checkpoint_fingerprint

from .checks import StoreSpy, cache_mismatches
from .test_tgi_server import PROMPTS, serving

L, H, D = 2, 2, 64  # tests/tgi/conftest.py's tiny Llama


def _calibrated_dir(src: str, dst, *, formats=("nvfp4",), model: dict | None = None, center: bool = False):
    """`src`'s files as links plus a calibration with strong smoothing (s in [0.25, 4]), per-head scales and,
    with `center`, centering vectors in [-2, 2] (large against the tiny model's keys, so a reader that forgot to
    add c back would be far off)."""
    dst.mkdir()
    for name in os.listdir(src):
        (dst / name).symlink_to(os.path.join(src, name))
    g = torch.Generator().manual_seed(7)
    smoothing = tuple(torch.rand(H, D, generator=g) * 3.75 + 0.25 for _ in range(L))
    scales = {f: tuple((torch.rand(H, generator=g) * 0.01 + 0.001, torch.rand(H, generator=g) * 0.01 + 0.001)
                       for _ in range(L)) for f in formats}
    centers = tuple(torch.rand(H, D, generator=g) * 4 - 2 for _ in range(L)) if center else None
    fp = fingerprint_dict(checkpoint_fingerprint(src)) if model is None else model
    cal = KvCalibration(L, H, D, fp, 0.5, "mse", smoothing, scales, centers)
    cal.save(str(dst / FILENAME))
    return str(dst), cal


@pytest.fixture
def fresh(monkeypatch):
    from kvx_tgi import calibration

    monkeypatch.setattr(calibration, "_loaded", {})
    monkeypatch.delenv(calibration.ENV, raising=False)


@pytest.mark.parametrize("center", [False, True])
def test_file_beside_the_weights_is_served(fresh, tiny_scaled_dir, tmp_path, monkeypatch, center):
    from transformers import AutoTokenizer

    model_dir, cal = _calibrated_dir(tiny_scaled_dir, tmp_path / "m", center=center)
    spy = StoreSpy()
    with serving(model_dir, "nvfp4", tmp_path, spy, monkeypatch) as (srv, router):
        req, seq = router.request(PROMPTS[2], max_new_tokens=3, prompt_len=32)
        router.run_to_end(router.prefill([req]))
        for i, cache in enumerate(srv.model.kv_cache):
            pools = cache.cache.layers[0]
            assert torch.equal(pools.k_smoothing.cpu(), cal.smoothing[i])
            assert torch.equal(pools.k_global.cpu(), cal.scales["nvfp4"][i][0])  # not the checkpoint's 0.05
            assert torch.equal(pools.v_global.cpu(), cal.scales["nvfp4"][i][1])
            assert cache.desc.quant.k_smoothing is pools.k_smoothing
            if center:
                assert torch.equal(pools.k_center.cpu(), cal.center[i])
            assert cache.desc.quant.k_center is pools.k_center and (pools.k_center is None) == (not center)
        prompt = len(AutoTokenizer.from_pretrained(model_dir)(PROMPTS[2], add_special_tokens=False).input_ids)
        assert cache_mismatches(srv.model.kv_cache, spy, seq.blocks, prompt) == []


@pytest.mark.parametrize("formats, model, match", [(("fp8_e4m3",), None, "not for nvfp4"),
                                                   (("nvfp4",), {"architecture": "other"}, "another model")])
def test_file_that_cannot_be_served_is_refused(fresh, tiny_scaled_dir, tmp_path, monkeypatch, formats, model, match):
    model_dir, _ = _calibrated_dir(tiny_scaled_dir, tmp_path / "m", formats=formats, model=model)
    with pytest.raises(KvxError, match=match):
        with serving(model_dir, "nvfp4", tmp_path):
            pass
