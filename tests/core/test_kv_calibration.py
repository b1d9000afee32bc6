"""The KV-cache calibration file (`kvx_core.kv_calibration`): round trip with and without key centering, every
refusal (shape, dtype, NaN, <= 0, version, geometry, model, damaged bytes, overwrite), version 1 files (no
centering) still read, the fitting rules against `calibration`'s own functions, and that a cache the file is
applied to reads back exactly what `set_key_smoothing` + `set_key_center` + `set_global_scales` give."""
from __future__ import annotations

import json

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.calibration import (
    SampleObserver,
    amax_from_checkpoint,
    global_scale_for_amax,
    key_center,
    key_smoothing,
    stored_values,
)
from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format
from kvx_core.kv_calibration import (
    META_KEY,
    KvCalibration,
    LayerValues,
    from_checkpoint_amax,
    from_samples,
    load_kv_calibration,
)
from kvx_core.tensor_file import content_hash, read_tensor_file, write_tensor_file

L, H, D, NB, BS = 3, 2, 32, 4, 8


def _obs(seed: int = 0, tokens: int = 64) -> SampleObserver:
    g = torch.Generator().manual_seed(seed)
    obs = SampleObserver(L)
    for layer in range(L):
        k = torch.randn(tokens, H, D, generator=g) * torch.logspace(-1, 1.2, D) + torch.linspace(-3, 5, D)  # outlier
        # channels, and offsets (what centering removes)
        obs.observe(layer, k, torch.randn(tokens, H, D, generator=g))
    return obs


@pytest.fixture(scope="module")
def cal() -> KvCalibration:
    return from_samples(_obs(), ["nvfp4", "k8v4_rot"], rule="mse", alpha=0.5, model={"architecture": "x"})


@pytest.fixture(scope="module")
def centered() -> KvCalibration:
    return from_samples(_obs(), ["nvfp4", "k8v4_rot"], rule="mse", alpha=0.5, model={"architecture": "x"}, center=True)


@pytest.mark.parametrize("which", ["cal", "centered"])
def test_round_trip(request, which, tmp_path):
    cal = request.getfixturevalue(which)
    p = str(tmp_path / "c.safetensors")
    ident = cal.save(p)
    back = load_kv_calibration(p)
    assert back.identity == ident and back.params() == cal.params()
    assert back.params()["formats"] == ["k8v4_rot", "nvfp4"] and back.rule == "mse" and back.alpha == 0.5
    got, want = back.tensors(), cal.tensors()
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert (back.center is not None) == (which == "centered") == ("layer.2.k_center" in got)
    # a calibration without centering is written as before centering existed (version 1, no "center"), so older
    # KVX reads it; a centered one is version 2, which older KVX refuses by its version
    assert (back.params()["version"], back.params().get("center")) == ((2, True) if which == "centered" else (1, None))
    with pytest.raises(KvxError, match="never overwrites"):
        cal.save(p)
    cal.save(p, overwrite=True)  # explicit
    assert [f.name for f in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary file left


@pytest.mark.parametrize("which", ["cal", "centered"])
def test_fitted_values_are_calibrations_own(request, which):
    """Centers are the keys' means; smoothing is fitted on the centered keys; scales on (K - c) / s (rotated for
    _rot): what the cache stores."""
    cal, obs = request.getfixturevalue(which), _obs()
    centers = [key_center(obs.values(layer)[0]) for layer in range(L)] if which == "centered" else None
    assert cal.center is None if centers is None else all(torch.equal(a, b)
                                                          for a, b in zip(cal.center, centers, strict=True))
    for layer in range(L):
        keys = obs.values(layer)[0] - (0 if centers is None else centers[layer])
        assert torch.equal(cal.smoothing[layer], key_smoothing(keys, 0.5))
    for name in ("nvfp4", "k8v4_rot"):
        fmt = get_format(name)
        want = stored_values(obs, list(cal.smoothing), fmt.rotate, centers).global_scales(fmt, "mse")
        for got, ref in zip(cal.scales[name], want, strict=True):
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    if centers is not None:  # the centering changed what the scales were fitted on
        assert not torch.equal(cal.scales["nvfp4"][0][0], request.getfixturevalue("cal").scales["nvfp4"][0][0])


def test_checkpoint_rule():
    sd = {f"model.layers.{i}.self_attn.{s}_scale": torch.tensor(0.5 + i) for i in range(L) for s in "kv"}
    amax = amax_from_checkpoint(sd, L)
    c = from_checkpoint_amax(amax, ["nvfp4", "fp8_e4m3"], num_kv_heads=H, head_dim=D, model={})
    assert c.rule == "checkpoint" and c.smoothing is None
    assert torch.equal(c.scales["nvfp4"][2][0], global_scale_for_amax(get_format("nvfp4").k, amax[2, 0]))
    with pytest.raises(KvxError, match="unrotated"):
        from_checkpoint_amax(amax, ["nvfp4_rot"], num_kv_heads=H, head_dim=D, model={})
    with pytest.raises(KvxError, match="take no global scale"):
        from_checkpoint_amax(amax, ["int4"], num_kv_heads=H, head_dim=D, model={})


def _rewrite(cal: KvCalibration, path, *, tensors=None, params=None, identity=None) -> str:
    """A file with `cal`'s contents edited, and a valid identity hash over the edit unless `identity` is given."""
    t = dict(cal.tensors()) if tensors is None else tensors
    p = cal.params() if params is None else params
    write_tensor_file(str(path), t, {META_KEY: json.dumps(p), "identity": identity or content_hash(p, t)})
    return str(path)


@pytest.mark.parametrize("which, edit, match", [
    ("cal", lambda t: t.update({"layer.1.k_smoothing": torch.ones(H, D + 1)}), "shape"),
    ("cal", lambda t: t.update({"layer.1.k_smoothing": torch.ones(H, D, dtype=torch.float16)}), "FP32"),
    ("cal", lambda t: t.update({"layer.0.k_smoothing": torch.full((H, D), float("nan"))}), "finite"),
    ("cal", lambda t: t.update({"layer.2.nvfp4.v_global": torch.zeros(H)}), "> 0"),
    ("cal", lambda t: t.update({"layer.2.nvfp4.v_global": -torch.ones(1)}), "> 0"),
    ("cal", lambda t: t.update({"layer.2.nvfp4.v_global": torch.ones(H + 1)}), "shape"),
    ("cal", lambda t: t.pop("layer.0.nvfp4.k_global"), "missing"),
    ("cal", lambda t: t.update({"layer.9.k_smoothing": torch.ones(H, D)}), "unexpected"),
    ("cal", lambda t: t.update({"layer.0.k_center": torch.zeros(H, D)}), "unexpected"),  # centers in a version 1 file
    ("centered", lambda t: t.update({"layer.1.k_center": torch.zeros(H + 1, D)}), "shape"),
    ("centered", lambda t: t.update({"layer.1.k_center": torch.zeros(H, D, dtype=torch.float64)}), "FP32"),
    ("centered", lambda t: t.update({"layer.0.k_center": torch.full((H, D), float("inf"))}), "k_center must be finite"),
    ("centered", lambda t: t.update({"layer.2.k_center": torch.full((H, D), float("nan"))}), "k_center must be finite"),
    ("centered", lambda t: t.pop("layer.1.k_center"), "missing"),
    ("centered", lambda t: t.update({"layer.3.k_center": torch.zeros(H, D)}), "unexpected"),
])
def test_bad_tensors_are_refused(request, tmp_path, which, edit, match):
    cal = request.getfixturevalue(which)
    t = dict(cal.tensors())
    edit(t)
    with pytest.raises(KvxError, match=match) as e:
        load_kv_calibration(_rewrite(cal, tmp_path / "bad.safetensors", tensors=t))
    assert e.value.status == Status.INVALID_ARGUMENT


def test_centers_edited_or_dropped_are_refused(centered, tmp_path):
    """Negative centers are values like any other; a center edited, a centered file relabelled as version 1 or as
    center false are refused (the identity hash covers the centers and the version)."""
    t = dict(centered.tensors())
    t["layer.0.k_center"] = -torch.ones(H, D)
    loaded = load_kv_calibration(_rewrite(centered, tmp_path / "neg.kvx", tensors=t))
    assert torch.equal(loaded.center[0], t["layer.0.k_center"])
    with pytest.raises(KvxError, match="identity"):  # edited, hash of the original
        load_kv_calibration(_rewrite(centered, tmp_path / "edit.kvx", tensors=t, identity=centered.identity))
    v1 = {k: v for k, v in centered.params().items() if k != "center"} | {"version": 1}
    with pytest.raises(KvxError, match="unexpected"):  # an old reader's view of a centered file: refused too
        load_kv_calibration(_rewrite(centered, tmp_path / "v1.kvx", params=v1))
    no_tensors = {k: v for k, v in centered.tensors().items() if not k.endswith("k_center")}
    with pytest.raises(KvxError, match="identity"):  # centers stripped, relabelled version 1, the file's hash kept
        load_kv_calibration(_rewrite(centered, tmp_path / "v1id.kvx", params=v1, tensors=no_tensors,
                                     identity=centered.identity))
    off = {**centered.params(), "center": False}
    with pytest.raises(KvxError, match="unexpected"):
        load_kv_calibration(_rewrite(centered, tmp_path / "off.kvx", params=off))
    with pytest.raises(KvxError, match="identity"):  # centers dropped, version 2 center false: not a file KVX writes
        load_kv_calibration(_rewrite(centered, tmp_path / "drop.kvx", params=off, tensors=no_tensors))
    with pytest.raises(KvxError, match="center 'yes'"):
        load_kv_calibration(_rewrite(centered, tmp_path / "yes.kvx", params={**centered.params(), "center": "yes"}))
    with pytest.raises(KvxError, match="malformed"):  # version 2 must say whether it centers
        load_kv_calibration(_rewrite(centered, tmp_path / "nokey.kvx", params={**v1, "version": 2}))


def test_version_1_file_reads_as_uncentered(cal, tmp_path):
    """A file as KVX wrote it before centering (these metadata keys, these tensors) reads as no centering."""
    before = {"version", "num_layers", "num_kv_heads", "head_dim", "model", "alpha", "rule", "formats"}
    assert set(cal.params()) == before and cal.params()["version"] == 1
    back = load_kv_calibration(_rewrite(cal, tmp_path / "old.kvx"))
    assert back.center is None and back.identity == cal.identity
    assert all(lv.k_center is None for lv in back.for_format(get_format("nvfp4")))


def test_bad_metadata_and_damage_are_refused(cal, tmp_path):
    newer = {**cal.params(), "version": 3}
    with pytest.raises(KvxError, match="version 3") as e:
        load_kv_calibration(_rewrite(cal, tmp_path / "v.safetensors", params=newer))
    assert e.value.status == Status.INCOMPATIBLE
    for params, match in (({**cal.params(), "num_kv_heads": H + 1}, "shape"),
                          ({**cal.params(), "rule": "best"}, "rule"),
                          ({**cal.params(), "formats": ["int4"]}, "take no global scale"),
                          ({k: v for k, v in cal.params().items() if k != "alpha"}, "malformed")):
        with pytest.raises(KvxError, match=match):
            load_kv_calibration(_rewrite(cal, tmp_path / f"m{len(match)}.safetensors", params=params))
    with pytest.raises(KvxError, match="identity"):
        load_kv_calibration(_rewrite(cal, tmp_path / "id.safetensors", identity="0" * 64))
    p = tmp_path / "ok.safetensors"
    cal.save(str(p))
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0x10  # a tensor byte
    (tmp_path / "flip.safetensors").write_bytes(bytes(raw))
    with pytest.raises(KvxError, match="identity"):
        load_kv_calibration(str(tmp_path / "flip.safetensors"))
    (tmp_path / "cut.safetensors").write_bytes(bytes(raw[:len(raw) // 2]))
    with pytest.raises(KvxError, match="not a readable safetensors"):
        load_kv_calibration(str(tmp_path / "cut.safetensors"))
    write_tensor_file(str(tmp_path / "other.safetensors"), {"w": torch.ones(2)}, {})
    with pytest.raises(KvxError, match="not a KVX KV-cache calibration"):
        load_kv_calibration(str(tmp_path / "other.safetensors"))
    with pytest.raises(KvxError, match="no such file"):
        load_kv_calibration(str(tmp_path / "absent.safetensors"))
    assert read_tensor_file(str(p))[0]["identity"] == cal.identity


def test_model_and_geometry_checks(cal):
    cal.check_geometry(L, H, D, "f")
    with pytest.raises(KvxError, match="2 KV heads") as e:
        cal.check_geometry(L, H + 1, D, "f")
    assert e.value.status == Status.INCOMPATIBLE
    cal.check_model({"architecture": "x"}, "f")
    for other in ({"architecture": "y"}, None):
        with pytest.raises(KvxError, match="f ") as e:
            cal.check_model(other, "f")
        assert e.value.status == Status.INCOMPATIBLE


def test_format_without_scales_is_refused(cal, centered):
    with pytest.raises(KvxError, match="recalibrate") as e:
        cal.for_format(get_format("fp8_e4m3"))
    assert e.value.status == Status.INCOMPATIBLE
    assert [v[2:] for v in cal.for_format(get_format("int4"))] == [(None, None)] * L  # smoothing only
    with pytest.raises(KvxError, match="not quantized"):
        cal.for_format(get_format("bf16"))
    values = centered.for_format(get_format("nvfp4"))
    assert all(isinstance(lv, LayerValues) and lv.k_center is centered.center[i]
               and lv.k_smoothing is centered.smoothing[i] and lv.k_global is centered.scales["nvfp4"][i][0]
               for i, lv in enumerate(values))
    center_only = KvCalibration(L, H, D, {}, None, None, None, {}, centered.center)
    with pytest.raises(KvxError, match="not quantized: the calibration's k_center"):
        center_only.for_format(get_format("fp16"))


def _cache(fmt: str) -> PagedKVCache:
    return PagedKVCache(fmt, num_layers=L, num_blocks=NB, block_size=BS, num_kv_heads=H, head_dim=D,
                        per_head_global_scale=True)


@pytest.mark.parametrize("which", ["cal", "centered"])
@pytest.mark.parametrize("fmt", ["nvfp4", "k8v4_rot", "int4"])
def test_applied_cache_reads_what_the_setters_give(request, which, fmt):
    """Oracle: a cache given the file reads back bit for bit what a cache given the same vectors by hand reads."""
    cal = request.getfixturevalue(which)
    via_file, by_hand = _cache(fmt), _cache(fmt)
    cal.apply(via_file)
    for layer, (s, c, k, v) in enumerate(cal.for_format(get_format(fmt))):
        by_hand.set_key_smoothing(layer, s)
        by_hand.set_key_center(layer, c)
        if k is not None:
            by_hand.set_global_scales(layer, k, v)
        assert torch.equal(via_file.layers[layer].k_smoothing, cal.smoothing[layer])
        got = via_file.layers[layer].k_center
        assert got is None if cal.center is None else torch.equal(got, cal.center[layer])
    g = torch.Generator().manual_seed(3)
    slots = torch.arange(NB * BS)
    table, lens = torch.arange(NB, dtype=torch.int32).view(1, NB), torch.tensor([NB * BS], dtype=torch.int32)
    for layer in range(L):
        k = (torch.randn(NB * BS, H, D, generator=g) * torch.logspace(-1, 1.2, D)).bfloat16()
        v = torch.randn(NB * BS, H, D, generator=g).bfloat16()
        reads = []
        for c in (via_file, by_hand):
            c.write(layer, k, v, slots)
            reads.append(c.gather(layer, table, lens, out_dtype=torch.float32))
        assert torch.equal(reads[0][0], reads[1][0]) and torch.equal(reads[0][1], reads[1][1])


def test_apply_refuses_without_changing_anything(cal):
    c = PagedKVCache("nvfp4", num_layers=L, num_blocks=NB, block_size=BS, num_kv_heads=H, head_dim=D)  # per tensor
    with pytest.raises(KvxError, match="per_head_global_scale"):
        cal.apply(c)
    assert all(p.k_smoothing is None and bool((p.k_global == 1).all()) for p in c.layers)
    other = PagedKVCache("nvfp4", num_layers=L + 1, num_blocks=NB, block_size=BS, num_kv_heads=H, head_dim=D)
    with pytest.raises(KvxError, match="layers"):
        cal.apply(other)


def test_construction_refuses_nothing_and_halves():
    with pytest.raises(KvxError, match="none of them"):
        KvCalibration(L, H, D, {}, None, None, None, {})
    with pytest.raises(KvxError, match="together"):
        KvCalibration(L, H, D, {}, 0.5, None, None, {})
    with pytest.raises(KvxError, match="layers"):
        KvCalibration(L, H, D, {}, 0.5, None, (torch.ones(H, D),), {})
    with pytest.raises(KvxError, match="k_center for 1 layers"):
        KvCalibration(L, H, D, {}, None, None, None, {}, (torch.zeros(H, D),))
    with pytest.raises(KvxError, match="layer 1 k_center must be finite"):
        KvCalibration(L, H, D, {}, None, None, None, {}, (torch.zeros(H, D), torch.full((H, D), float("nan")),
                                                            torch.zeros(H, D)))


def test_write_without_hard_links(cal, tmp_path, monkeypatch):
    """A file system without hard links: the new file is renamed into place; an existing one is still refused."""
    import os

    def no_links(*_a):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(os, "link", no_links)
    p = str(tmp_path / "c.kvx")
    cal.save(p)
    assert load_kv_calibration(p).identity == cal.identity
    with pytest.raises(KvxError, match="never overwrites"):
        cal.save(p)
    assert [f.name for f in tmp_path.iterdir()] == ["c.kvx"]


def test_head_range_takes_the_rows_of_those_heads(centered):
    """A tensor-parallel rank's values: rows start..stop-1 of every per-head vector of the whole file (an oracle
    indexing the file's own tensors), a per-tensor [1] scale as it is; a range outside the file's heads is
    OUT_OF_RANGE and leaves the calibration as it was."""
    fmt = get_format("nvfp4")
    whole = [tuple(None if t is None else t.clone() for t in lv) for lv in centered.for_format(fmt)]
    for start, stop in [(0, 1), (1, 2), (0, 2)]:
        part = centered.for_format(fmt, heads=(start, stop))
        for i, lv in enumerate(part):
            assert all(t.shape[0] == stop - start for t in lv)
            assert torch.equal(lv.k_smoothing, centered.smoothing[i][start:stop])
            assert torch.equal(lv.k_center, centered.center[i][start:stop])
            assert torch.equal(lv.k_global, centered.scales["nvfp4"][i][0][start:stop])
            assert torch.equal(lv.v_global, centered.scales["nvfp4"][i][1][start:stop])
    tensor_wide = (torch.full((1,), 0.5), torch.full((1,), 0.25))
    per_tensor = KvCalibration(L, H, D, {}, None, "amax", None, {"nvfp4": (tensor_wide,) * L})
    assert all(torch.equal(lv.k_global, tensor_wide[0]) and torch.equal(lv.v_global, tensor_wide[1])
               for lv in per_tensor.for_format(fmt, heads=(1, 2)))
    for bad in [(0, 0), (1, 3), (-1, 1), (2, 3), (0.0, 1), (True, 2)]:
        with pytest.raises(KvxError, match="KV heads") as e:
            centered.for_format(fmt, heads=bad)
        assert e.value.status == Status.OUT_OF_RANGE
    assert all(all(a is b is None or torch.equal(a, b) for a, b in zip(lv, w, strict=True))
               for lv, w in zip(centered.for_format(fmt), whole, strict=True))
