"""`kvx demo` end to end (the README's main job) on a short text, and the KVX-backed transformers Cache.

Needs the demo dependencies (installed by scripts/setup_env.sh); marked `slow`.
"""
from __future__ import annotations

import json

import pytest
import torch

from kvx_core.cache import PagedKVCache

pytestmark = pytest.mark.slow

# Floors for a 1 x 256-token window of the default text: loose enough for noise on a short window,
# tight enough that a broken format (garbage K/V) or a cache that loses tokens fails.
TOP1_FLOOR = {"bf16": 1.0, "fp16": 0.97, "fp32": 0.97, "fp8_e4m3": 0.9, "fp8_e5m2": 0.85, "int8": 0.95, "k8v4": 0.8,
              "k8v4_rot": 0.8}
TOP1_FLOOR_FP4 = 0.6
PPL_DELTA_CEILING_PCT = {"int8": 2.0, "fp8_e4m3": 5.0, "k8v4": 10.0}
PPL_DELTA_CEILING_FP4_PCT = 60.0


@pytest.fixture(scope="module")
def loaded():
    from kvx_demo import load_model

    return load_model()


def test_kvx_cache_bf16_matches_roundtrip_cache_bit_for_bit(loaded):
    """Through KVX pools (write_kv -> gather_kv) a BF16 cache must equal a plain BF16 round trip."""
    from kvx_demo import load_windows, model_shape
    from kvx_demo.hf_cache import RoundTripCache, bf16_roundtrip
    from kvx_demo.kvx_cache import KvxCache

    s = model_shape(loaded.model)
    ids = load_windows(loaded.tokenizer, 1, 96)
    paged = PagedKVCache("bf16", num_layers=s["num_layers"], num_blocks=8, block_size=16,
                         num_kv_heads=s["num_kv_heads"], head_dim=s["head_dim"], page_buffer=True)
    with torch.inference_mode():
        outs = []
        for cache in (KvxCache(paged), RoundTripCache(s["num_layers"], bf16_roundtrip, bf16_roundtrip)):
            first = loaded.model(input_ids=ids[:, :64], past_key_values=cache, use_cache=True).logits
            second = loaded.model(input_ids=ids[:, 64:], past_key_values=cache, use_cache=True).logits
            outs.append(torch.cat([first, second], dim=1))
    assert torch.equal(outs[0], outs[1])


def test_kvx_cache_releases_blocks(loaded):
    from kvx_demo import model_shape
    from kvx_demo.kvx_cache import KvxCache

    s = model_shape(loaded.model)
    paged = PagedKVCache("nvfp4", num_layers=s["num_layers"], num_blocks=4, block_size=16,
                         num_kv_heads=s["num_kv_heads"], head_dim=s["head_dim"])
    cache = KvxCache(paged)
    with torch.inference_mode():
        loaded.model(input_ids=torch.arange(40)[None], past_key_values=cache, use_cache=True)
    assert paged.allocator.num_free == 1 and cache.get_seq_length() == 40
    cache.release()
    assert paged.allocator.num_free == 4


def test_demo_every_format_end_to_end(tmp_path, capsys):
    from kvx_cli.main import main

    out = tmp_path / "demo.jsonl"
    assert main(["demo", "--windows", "1", "--window-len", "256", "--formats", "all", "--no-progress",
                 "--json", str(out)]) == 0
    rows = {r["format"]: r for r in map(json.loads, out.read_text().splitlines())}
    from kvx_core.formats import list_formats

    assert set(rows) == set(list_formats())
    assert 5.0 < rows["bf16"]["perplexity"] < 40.0, rows["bf16"]
    table = capsys.readouterr().out
    for name, r in rows.items():
        assert name in table
        fp4 = any(tag in name for tag in ("int4", "mxfp4", "nvfp4"))
        floor = TOP1_FLOOR.get(name, TOP1_FLOOR_FP4 if fp4 else 0.9)
        assert r["top1_agreement"] >= floor, (name, r["top1_agreement"])
        ceiling = PPL_DELTA_CEILING_PCT.get(name, PPL_DELTA_CEILING_FP4_PCT if fp4 else 5.0)
        assert r["ppl_delta_pct"] <= ceiling, (name, r["ppl_delta_pct"])
    assert rows["nvfp4"]["capacity_vs_bf16"] == pytest.approx(2 / 0.5625)
    assert rows["int8"]["bytes_per_token"] == 30 * 3 * 2 * (64 + 4)


def test_demo_model_option_only_reads_the_checkpoint(loaded, capsys):
    """`--model DIR` loads DIR without writing it, also when DIR is KVX's own checkpoint (issue 10, F0)."""
    from kvx_cli.main import main

    def state():
        return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in loaded.source.iterdir()}

    before = state()
    assert main(["demo", "--model", str(loaded.source), "--windows", "1", "--window-len", "64", "--formats", "int8",
                 "--no-progress"]) == 0
    assert state() == before
    out = capsys.readouterr().out
    assert f"model {loaded.source.name}:" in out and "int8" in out


def test_demo_key_centering_end_to_end(tmp_path):
    """`--center-keys --smooth-keys` with scales: the quantized rows say what their caches stored and on which text
    the vectors were fitted; the baseline stays untransformed."""
    from kvx_cli.main import main

    cal = tmp_path / "cal.txt"
    cal.write_text("def f(x):\n    return x * 2  # a small calibration text\n" * 60, encoding="utf-8")
    out = tmp_path / "demo.jsonl"
    assert main(["demo", "--windows", "1", "--window-len", "128", "--formats", "nvfp4_rot,fp8_e4m3", "--center-keys",
                 "--smooth-keys", "0.25", "--calibrate", "--calibration-text", str(cal), "--no-progress",
                 "--json", str(out)]) == 0
    rows = {r["format"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["bf16"]["key_centering"] is False and rows["bf16"]["key_smoothing"] is None
    for name in ("nvfp4_rot", "fp8_e4m3"):
        r = rows[name]
        assert r["key_centering"] is True and r["key_smoothing"] == 0.25 and r["calibrated"] == "mse", r
        assert r["text"] == "pydoc_data.topics" and r["calibration_text"] == str(cal)
        assert 0.0 <= r["top1_agreement"] <= 1.0 and r["perplexity"] > 0


def test_demo_recipe_is_calibrate_kvs_recipe_and_is_not_mixed(capsys):
    """`kvx demo --recipe` applies `kvx calibrate-kv`'s defaults (kvx_cli/recipe.py: the one place they live) and says
    so above the table; beside --center-keys / --smooth-keys / --calibrate it is refused (exit 2, one line) before the
    model loads."""
    import argparse

    from kvx_cli import calibrate_kv_cmd, demo_cmd
    from kvx_cli.main import main

    a = argparse.Namespace(recipe=True, center_keys=False, smooth_keys=None, calibrate=None)
    demo_cmd._apply_recipe(a)
    assert (a.center_keys, a.smooth_keys, a.calibrate) == (True, calibrate_kv_cmd.DEFAULT_ALPHA, "mse")
    assert demo_cmd._calibration_line(a) == ("calibration (the measured recipe): key centering + key smoothing ALPHA "
                                             "0.25 + mse global scales")
    plain = argparse.Namespace(recipe=False, center_keys=False, smooth_keys=None, calibrate=None)
    assert demo_cmd._calibration_line(plain).startswith("calibration: none")
    for extra in (["--center-keys"], ["--smooth-keys", "0.5"], ["--calibrate", "amax"]):
        assert main(["demo", "--recipe", *extra, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert "--recipe sets --center-keys, --smooth-keys and --calibrate itself" in err and err.count("\n") == 1
