"""A KV-cache calibration file is untrusted input (the vLLM plugin and the TGI backend load it from the model
directory by themselves, and anyone can recompute its identity hash): forged sizes are refused before anything is
allocated, forged values before they are used, and a fuzzer of forged files (metadata JSON, tensors, safetensors
header and raw bytes, the identity recomputed as a forger would) gets nothing but KvxError under a memory cap."""
from __future__ import annotations

import functools
import json
import os
import random
import struct
import tempfile

import pytest
import torch

from kvx_core import kv_calibration
from kvx_core.calibration import SampleObserver
from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format
from kvx_core.kv_calibration import META_KEY, KvCalibration, from_samples, load_kv_calibration
from kvx_core.tensor_file import content_hash, write_tensor_file
from tests.fuzz import DEEP, dumps_json, mutate_bytes, mutate_json, run_capped

L, H, D = 2, 2, 16


@functools.lru_cache(maxsize=1)
def _valid() -> KvCalibration:
    """A small calibration with every part: centering, smoothing and the scales of two formats."""
    g = torch.Generator().manual_seed(0)
    obs = SampleObserver(L)
    for layer in range(L):
        obs.observe(layer, torch.randn(32, H, D, generator=g) + 1.0, torch.randn(32, H, D, generator=g))
    return from_samples(obs, ["nvfp4", "k8v4"], rule="amax", alpha=0.5, model={"architecture": "x"}, center=True)


def _forge(path: str, params: object, tensors: dict[str, torch.Tensor]) -> str:
    """A file of `params` (any JSON tree, forged values included) and `tensors`, with the identity a forger
    recomputes over them."""
    text = dumps_json(params).decode()
    try:
        ident = content_hash(params, tensors)
    except (TypeError, ValueError, RuntimeError):  # what content_hash cannot hash (a 0-d tensor): any will do
        ident = "0" * 64
    write_tensor_file(path, tensors, {META_KEY: text, "identity": ident}, overwrite=True)
    return path


def _refused(path: str, status: Status = Status.INVALID_ARGUMENT) -> KvxError:
    before = open(path, "rb").read()
    with pytest.raises(KvxError) as e:
        load_kv_calibration(path)
    assert e.value.status == status and path in e.value.message
    assert open(path, "rb").read() == before  # reading never changes the file
    return e.value


def huge_num_layers(rng: random.Random) -> None:
    """Capped target: num_layers far beyond the tensors present (the finding: 10**30 built 10**30 names)."""
    cal = _valid()
    n = rng.choice([10**30, 2**63, 2**31, len(cal.tensors()) + 1])
    with tempfile.TemporaryDirectory() as d:
        load_kv_calibration(_forge(os.path.join(d, "c.kvx"), {**cal.params(), "num_layers": n}, cal.tensors()))


def test_huge_num_layers_is_refused_before_allocating(tmp_path):
    run_capped("tests.core.test_kv_calibration_untrusted:huge_num_layers", cases=8)  # never a MemoryError
    cal = _valid()
    for n in (10**30, len(cal.tensors()) + 1):
        e = _refused(_forge(str(tmp_path / "c.kvx"), {**cal.params(), "num_layers": n}, cal.tensors()))
        assert f"num_layers {n}" in e.message and "tensors" in e.message


def test_file_over_the_cap_is_refused_before_reading(tmp_path, monkeypatch):
    path = str(tmp_path / "c.kvx")
    _valid().save(path)
    monkeypatch.setattr(kv_calibration, "MAX_FILE_BYTES", os.path.getsize(path) - 1)
    assert "more than the" in _refused(path).message
    monkeypatch.setattr(kv_calibration, "MAX_FILE_BYTES", os.path.getsize(path))
    assert load_kv_calibration(path).identity == _valid().identity


def test_non_regular_files_are_refused(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # a reader that opened it would block forever
    for path in ("/dev/zero", str(tmp_path / "fifo"), str(tmp_path)):
        with pytest.raises(KvxError, match="no such file") as e:
            load_kv_calibration(path)
        assert e.value.status == Status.INVALID_ARGUMENT


@pytest.mark.parametrize("edit, match", [
    ({"version": True}, "version True: expected an integer"),  # True == 1, but no version number
    ({"version": 2.0}, "version 2.0: expected an integer"),
    ({"num_layers": 2.0}, "num_layers 2.0"),
    ({"num_layers": True}, "num_layers True"),
    ({"num_layers": 0}, "num_layers 0"),
    ({"num_kv_heads": 2.0}, "num_kv_heads must be an int"),
    ({"head_dim": -16}, "head_dim must be an int"),
    ({"alpha": True}, "alpha must be in"),
    ({"alpha": 1.5}, "alpha must be in"),
    ({"formats": ["nvfp4", "nvfp4", "k8v4"]}, "distinct"),
    ({"formats": "nvfp4"}, "formats 'nvfp4'"),
    ({"center": 1}, "center 1: expected true or false"),
    ({"model": DEEP}, "nests deeper"),
    ({"alpha": float("nan")}, "not valid JSON"),  # NaN is not JSON
    ({"rule": float("inf")}, "not valid JSON"),
    ({"rule": "x" * 100_000}, "rule must be one of"),
])
def test_forged_metadata_is_refused(tmp_path, edit, match):
    cal = _valid()
    e = _refused(_forge(str(tmp_path / "c.kvx"), {**cal.params(), **edit}, cal.tensors()))
    assert match in e.message and len(e.message) < 1000  # one line a user reads, not the forged value


@pytest.mark.parametrize("name, tensor, match", [
    ("layer.0.nvfp4.k_global", torch.tensor([float("inf")]), "finite"),
    ("layer.1.k8v4.v_global", torch.tensor([-0.0]), "> 0"),
    ("layer.1.k_smoothing", torch.zeros(H, D), "> 0"),
    ("layer.0.k_center", torch.zeros(H * D), "shape"),
    ("layer.0.k_center", torch.zeros(H, D, dtype=torch.int32), "FP32"),
    ("layer.0.nvfp4.v_global", torch.ones(H, 1), "shape"),
])
def test_forged_tensors_are_refused(tmp_path, name, tensor, match):
    cal = _valid()
    e = _refused(_forge(str(tmp_path / "c.kvx"), cal.params(), {**cal.tensors(), name: tensor}))
    assert match in e.message


def test_save_replaces_only_regular_files(tmp_path):
    """`save(overwrite=True)` onto a directory raised IsADirectoryError after the work; a FIFO would be replaced:
    both refused before anything is written, and a dangling link counts as an existing name."""
    cal = _valid()
    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "fifo")
    for name in ("d", "fifo"):
        with pytest.raises(KvxError, match="not a regular file") as e:
            cal.save(str(tmp_path / name), overwrite=True)
        assert e.value.status == Status.INVALID_ARGUMENT
    os.symlink(tmp_path / "nowhere", tmp_path / "link")
    with pytest.raises(KvxError, match="never overwrites"):
        cal.save(str(tmp_path / "link"))
    assert (tmp_path / "d").is_dir() and not any((tmp_path / "d").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "fifo", "link"]  # no temporary file left


# ------------------------------------------------------------------ fuzz
def _safetensors_parts(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _forged_tensor(rng: random.Random) -> torch.Tensor:
    shape = rng.choice([(H, D), (1,), (H,), (0,), (H, D + 1), (D, H), (3, H, D), ()])
    t = torch.randn(shape) * rng.choice([1.0, 1e-30, 1e30])
    t = t.to(rng.choice([torch.float32, torch.float32, torch.float16, torch.float64, torch.int32, torch.bool]))
    if t.is_floating_point() and t.numel() and rng.random() < 0.5:
        t.view(-1)[rng.randrange(t.numel())] = rng.choice([float("nan"), float("inf"), 0.0, -1.0])
    return t


def fuzz_file(rng: random.Random) -> None:
    """One forged calibration file made from a valid one (or the valid one), read by `load_kv_calibration`, and a
    head range of what loaded served (`_serve_a_head_range`)."""
    cal = _valid()
    params, tensors = cal.params(), dict(cal.tensors())
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.kvx")
        op = rng.randrange(5)
        if op == 4:  # the valid file: its head ranges are served
            cal.save(path)
        elif op == 0:  # the metadata JSON, identity recomputed
            _forge(path, mutate_json(params, rng), tensors)
        elif op == 1:  # tensors replaced, dropped or added, identity recomputed
            for _ in range(rng.randint(1, 3)):
                name = rng.choice([*tensors, f"layer.{rng.choice([0, L, 10**6])}.nvfp4.k_global"])
                if rng.random() < 0.3:
                    tensors.pop(name, None)
                else:
                    tensors[name] = _forged_tensor(rng)
            _forge(path, params, tensors)
        else:  # the safetensors header (declared dtypes, shapes, offsets) or the raw bytes
            cal.save(path)
            data = open(path, "rb").read()
            if op == 2:
                header, body = _safetensors_parts(data)
                head = dumps_json(mutate_json(header, rng))
                data = struct.pack("<Q", len(head)) + head + body
            else:
                data = mutate_bytes(data, rng)
            with open(path, "wb") as f:
                f.write(data)
        _serve_a_head_range(load_kv_calibration(path), rng)


def _serve_a_head_range(cal: KvCalibration, rng: random.Random) -> None:
    """What a tensor-parallel rank does with a file that loaded: take the values of a head range (sometimes outside
    the file's heads: KvxError) for a format; every per-head vector it gets has exactly that range's rows."""
    h = cal.num_kv_heads
    start = rng.choice([0, rng.randrange(h), h, -1])
    stop = rng.choice([start + 1, h, h + 1, start])
    fmt = get_format(rng.choice([*cal.scales, "int4"]))
    for lv in cal.for_format(fmt, heads=(start, stop)):
        assert all(t is None or t.shape[0] == stop - start or tuple(t.shape) == (1,) for t in lv), lv


def test_fuzz_calibration_file():
    run_capped("tests.core.test_kv_calibration_untrusted:fuzz_file", cases=400)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_checkpoint_scales_must_be_finite_and_non_negative(bad):
    """A negative k_scale became the default scale 1.0 without a word; NaN / inf are refused as well."""
    from kvx_core.calibration import amax_from_checkpoint

    sd = {f"model.layers.{i}.self_attn.{s}_scale": torch.tensor(0.5) for i in range(L) for s in "kv"}
    sd["model.layers.1.self_attn.v_scale"] = torch.tensor([0.5, bad])
    with pytest.raises(KvxError, match="v_scale' must be finite and >= 0") as e:
        amax_from_checkpoint(sd, L)
    assert e.value.status == Status.INVALID_ARGUMENT


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), -0.5])
def test_one_checkpoint_scale_must_be_finite_and_non_negative(bad):
    """The TGI backend maps a layer's checkpoint scale through `amax_from_kv_scale` alone: the same rule holds."""
    from kvx_core.calibration import amax_from_kv_scale

    with pytest.raises(KvxError, match="must be finite and >= 0") as e:
        amax_from_kv_scale(torch.tensor([bad]))
    assert e.value.status == Status.INVALID_ARGUMENT
    assert amax_from_kv_scale(torch.tensor([0.5])).tolist() == [224.0]


def fuzz_sample(rng: random.Random) -> None:
    """One forged `sample` metadata (outside the identity, so a forger needs no hash at all) on a valid file."""
    cal = _valid()
    sample = {"tokens": 2048, "windows": 2, "window_len": 1024, "text": "pydoc_data.topics"}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.kvxcal")
        meta = {META_KEY: json.dumps(cal.params()), "identity": cal.identity,
                kv_calibration.SAMPLE_KEY: dumps_json(mutate_json(sample, rng)).decode()}
        write_tensor_file(path, cal.tensors(), meta)
        back = load_kv_calibration(path)
        assert back.identity == cal.identity
        for key, value in back.sample.items():  # what is accepted has the documented types
            assert type(value) is kv_calibration.SAMPLE_FIELDS[key]


def test_fuzz_sample_metadata():
    run_capped("tests.core.test_kv_calibration_untrusted:fuzz_sample", cases=300)
