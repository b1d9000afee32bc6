"""KVTC buffers and calibration files from outside are untrusted even with a valid checksum / identity hash (a forger
recomputes them, `forge.py`): every declared size is checked against the bytes present and a cap before anything is
allocated, every field's range and meaning before use, and anything else is refused with KvxError. Plus the fuzz
tests of both readers under the memory cap of `tests/fuzz.py`."""
from __future__ import annotations

import dataclasses
import io
import math
import struct
import zlib

import pytest
import torch

from kvx_core.errors import KvxError, Status
from kvx_core.kvtc import calibrate, calibration as calib_mod, compress, decompress, load_calibration, read_header
from kvx_core.kvtc.codec import HEADER, MAX_BODY_BYTES, read_file
from kvx_core.kvtc.layout import body_layout

from ..fuzz import DEEP, run_capped
from .forge import (
    MODEL,
    buffers,
    cal_parts,
    calibration,
    fields,
    forge,
    raw_body,
    seal,
    small_kv,
    with_raw_body,
    write_cal,
)


def _refused(fn, status=Status.INVALID_ARGUMENT, words: str | None = None) -> KvxError:
    with pytest.raises(KvxError) as e:
        fn()
    assert e.value.status == status, e.value
    if words:
        assert words in e.value.message, e.value.message
    return e.value


# ------------------------------------------------------------------ buffers
def bomb_target(rng) -> None:
    """Run under the fuzz harness's memory cap: a buffer whose DEFLATE body inflates to 1 GiB although its header
    (checksum recomputed) declares the real body size must be refused without inflating it."""
    import os

    with open(os.environ["KVX_TEST_BOMB"], "rb") as f:
        buf = f.read()
    try:
        decompress(buf, calibration())
    except KvxError as e:
        assert e.status == Status.INVALID_ARGUMENT and "inflates to more" in e.message, e
        raise
    raise AssertionError("a DEFLATE bomb was decompressed")


def test_a_deflate_bomb_is_refused_without_inflating_it(tmp_path):
    buf = buffers()[1]  # DEFLATE, token ids
    z = zlib.compressobj(1)
    zeros = bytes(1 << 26)
    bomb = b"".join(z.compress(zeros) for _ in range(16)) + z.flush()  # 1 GiB of zeros in ~5 MB
    f = fields(buf)
    path = tmp_path / "bomb.kvtc"
    path.write_bytes(seal({**f, "body_bytes": len(bomb)}, bomb))  # raw_body_bytes: the real (small) body's
    run_capped("tests.kvtc.test_kvtc_untrusted:bomb_target", cases=1, env={"KVX_TEST_BOMB": str(path)})


def test_a_deflate_body_must_be_one_stream_of_the_declared_size():
    buf = buffers()[1]
    raw = raw_body(buf)
    f = fields(buf)
    cases = {"one byte more": zlib.compress(raw + b"\0"), "one byte less": zlib.compress(raw[:-1]),
             "bytes after the stream": zlib.compress(raw) + b"tail", "cut stream": zlib.compress(raw)[:-6],
             "not DEFLATE": b"\x00" * 64}
    for stored in cases.values():
        forged = seal({**f, "body_bytes": len(stored)}, stored)
        _refused(lambda: decompress(forged, calibration()), words="DEFLATE")
    assert decompress(seal({**f, "body_bytes": len(z := zlib.compress(raw, 9))}, z), calibration()).token_ids


@pytest.mark.parametrize("change,words", [
    ({"token_start": 2**64 - 1}, "2^53"),
    ({"token_start": 2**53 - 10}, "2^53"),
    ({"token_count": 2**64 - 1}, "2^53"),
    ({"num_layers": 0}, "geometry"),
    ({"layers_per_group": 0}, "geometry"),
    ({"layers_per_group": 3, "num_layers": 4}, "geometry"),
    ({"num_kv_heads": 0}, "geometry"),
    ({"raw_head": 2**32 - 1}, "raw tokens"),
    ({"raw_tail": 41}, "raw tokens"),
    ({"body_bytes": MAX_BODY_BYTES + 1, "raw_body_bytes": MAX_BODY_BYTES + 1}, "more than"),
    ({"raw_body_bytes": 2**64 - 1}, "more than"),
    ({"raw_body_bytes": 7}, "disagree"),
    ({"raw_body_bytes": 10, "flags": 1}, "too small"),
])
def test_header_fields_out_of_range_are_refused_with_the_checksum_recomputed(change, words):
    buf = buffers()[0]  # plain, 40 tokens: 4 sinks, 8 recent
    forged = forge(buf, **change)
    _refused(lambda: read_header(forged), words=words)
    _refused(lambda: read_file(io.BytesIO(forged)), words=words)
    _refused(lambda: decompress(forged, calibration()), words=words)


@pytest.mark.parametrize("change,words", [
    ({"raw_head": 0, "raw_tail": 12}, "sinks and recent window"),  # the same raw bytes, not the calibration's split
    ({"token_start": 2}, "sinks and recent window"),  # 2 sinks left, not 4
    ({"token_count": 39}, "geometry and calibration make"),  # the body is one coded row too long
    ({"token_count": 2**40}, "more than"),  # decodes to more K/V bytes than the cap
    ({"num_kv_heads": 4}, "disagrees with its calibration"),
])
def test_header_fields_must_agree_with_the_calibration(change, words):
    forged = forge(buffers()[0], **change)  # plain, 40 tokens from position 0: 4 sinks, 8 recent
    read_header(forged)  # each field in range on its own
    _refused(lambda: decompress(forged, calibration()), words=words)


def test_a_decoded_body_that_is_not_finite_is_refused():
    """IntX metadata, FP8 codes and raw tokens that decode to NaN / inf (what compress never writes)."""
    base = calibration()
    g = base.groups[0]  # K's first range coded as FP8, so both kinds are present
    k = dataclasses.replace(g["k"], ranges=((*g["k"].ranges[0][:2], "fp8"), *g["k"].ranges[1:]))
    cal = dataclasses.replace(base, groups=({"k": k, "v": g["v"]},))
    buf = compress(small_kv(40, 11), cal)
    f = fields(buf)
    raw = bytearray(raw_body(buf))
    raw_tokens = (f["raw_head"] + f["raw_tail"]) * 2 * f["num_layers"] * f["num_kv_heads"] * f["head_dim"] * 2
    layout = body_layout(cal, f["token_count"] - f["raw_head"] - f["raw_tail"], raw_tokens)
    kinds = {s.kind.name for s in layout.sections}
    assert {"fp8"} & kinds and {"int2", "int4", "int8"} & kinds, kinds  # the calibration keeps both kinds
    intx = next(s for s in layout.sections if s.kind.is_int)
    fp8 = next(s for s in layout.sections if not s.kind.is_int)
    forgeries = {
        "IntX min NaN": (intx.meta_at, struct.pack("<e", math.nan)),
        "IntX step inf": (intx.meta_at + 2 * intx.n, struct.pack("<e", math.inf)),
        "FP8 NaN code": (fp8.data_at, b"\x7f"),
        "raw bf16 NaN": (0, b"\xc0\x7f"),
        "raw bf16 inf": (2, b"\x80\x7f"),
    }
    for at, data in forgeries.values():
        bad = bytearray(raw)
        bad[at:at + len(data)] = data
        forged = with_raw_body(buf, bytes(bad))
        _refused(lambda: decompress(forged, cal), words="non-finite")
    assert decompress(with_raw_body(buf, bytes(raw)), cal).header.token_count == 40  # the same, unforged


def test_compress_refuses_positions_past_2_53():
    kv = small_kv(8, 1)
    _refused(lambda: compress(kv, calibration(), token_start=2**53 - 4), words="2^53")
    _refused(lambda: compress(kv, calibration(), token_start=-1))


def test_read_file_checks_the_declared_size_before_reading_the_body(tmp_path):
    buf = buffers()[1]
    hdr, whole = read_file(io.BytesIO(buf))
    assert whole == buf and hdr == read_header(buf)
    assert read_file(io.BytesIO(buf), keep=False) == (hdr, None)
    for name, data in {"truncated": buf[:-1], "padded": buf + b"\0", "header only": buf[:HEADER.size]}.items():
        p = tmp_path / name
        p.write_bytes(data)
        with open(p, "rb") as f:
            _refused(lambda: read_file(f), words="header says")
            assert f.tell() == HEADER.size  # nothing past the header read (the size disagrees with the file's)
        _refused(lambda: read_file(io.BytesIO(data)))
    big = forge(buf, body_bytes=MAX_BODY_BYTES, flags=1)  # declares 64 GiB, holds a few hundred bytes
    _refused(lambda: read_file(io.BytesIO(big)))


# ------------------------------------------------------------------ calibration files
def _params_forged(tmp_path, **changes):
    params, tensors = cal_parts()
    return write_cal(tmp_path / "forged.safetensors", {**params, **changes}, tensors)


@pytest.mark.parametrize("changes,status", [
    ({"layers_per_group": 0}, Status.INVALID_ARGUMENT),
    ({"layers_per_group": 3}, Status.INVALID_ARGUMENT),
    ({"layers_per_group": 2.0}, Status.INVALID_ARGUMENT),
    ({"num_layers": True}, Status.INVALID_ARGUMENT),
    ({"num_layers": 2**40}, Status.INVALID_ARGUMENT),
    ({"head_dim": 2.5}, Status.INVALID_ARGUMENT),
    ({"sink_tokens": -1}, Status.INVALID_ARGUMENT),
    ({"recent_tokens": -5}, Status.INVALID_ARGUMENT),
    ({"recent_tokens": 2**64}, Status.INVALID_ARGUMENT),
    ({"ratio": math.inf}, Status.INVALID_ARGUMENT),
    ({"ratio": math.nan}, Status.INVALID_ARGUMENT),
    ({"ratio": 0.5}, Status.INVALID_ARGUMENT),
    ({"ratio": "3"}, Status.INVALID_ARGUMENT),
    ({"ratio": 10**400}, Status.INVALID_ARGUMENT),
    ({"range_size": 6}, Status.INVALID_ARGUMENT),
    ({"rope_theta": -1.0}, Status.INVALID_ARGUMENT),
    ({"model": {"name": "x"}}, Status.INVALID_ARGUMENT),
    ({"model": {**MODEL, "num_layers": 3}}, Status.INVALID_ARGUMENT),
    ({"model": None}, Status.INVALID_ARGUMENT),
    ({"version": True}, Status.INCOMPATIBLE),
    ({"version": 2}, Status.INCOMPATIBLE),
    ({"extra": 1}, Status.INVALID_ARGUMENT),
    ({"ranges": []}, Status.INVALID_ARGUMENT),
    ({"ranges": DEEP}, Status.INVALID_ARGUMENT),
    ({"ranges": [{"k": [[0, 4, "drop"]], "v": []}]}, Status.INVALID_ARGUMENT),
    ({"ranges": [{"k": [[0, 4, "int4"], [0, 4, "int4"]], "v": []}]}, Status.INVALID_ARGUMENT),
    ({"ranges": [{"k": [[0, 5, "int4"]], "v": []}]}, Status.INVALID_ARGUMENT),
    ({"ranges": [{"k": [[32, 36, "int4"]], "v": []}]}, Status.INVALID_ARGUMENT),
    ({"ranges": [{"k": [[4.0, 8, "int4"]], "v": []}]}, Status.INVALID_ARGUMENT),
    ({"ranges": [{"k": [[0, 4, "int3"]], "v": []}]}, Status.INVALID_ARGUMENT),
    ({"ranges": [{"k": [[0, 4]], "v": []}]}, Status.INVALID_ARGUMENT),
    ({"ranges": [{"k": []}]}, Status.INVALID_ARGUMENT),
])
def test_calibration_parameters_are_checked_with_the_identity_recomputed(tmp_path, changes, status):
    path = _params_forged(tmp_path, **changes)
    before = path.read_bytes()
    _refused(lambda: load_calibration(str(path)), status)
    assert path.read_bytes() == before


def test_calibration_metadata_that_is_not_a_json_object_is_refused(tmp_path):
    from safetensors.torch import save_file

    _, tensors = cal_parts()
    for text in ("[1, 2]", "{", '{"version": NaN}', "[" * 10000 + "]" * 10000):
        p = tmp_path / "meta.safetensors"
        p.unlink(missing_ok=True)
        save_file(tensors, str(p), metadata={"kvx_kvtc": text, "identity": "0"})
        _refused(lambda: load_calibration(str(p)))


def _tensor_forged(tmp_path, name, value):
    params, tensors = cal_parts()
    tensors = dict(tensors)
    if value is None:
        del tensors[name]
    else:
        tensors[name] = value
    return write_cal(tmp_path / "forged.safetensors", params, tensors)


@pytest.mark.parametrize("name,make,words", [
    ("g0.k.mean", lambda t: torch.full_like(t, math.nan), "non-finite"),
    ("g0.v.basis", lambda t: t.index_fill(0, torch.tensor([3]), math.inf), "non-finite"),
    ("g0.k.basis", lambda t: t * 2, "unit length"),
    ("g0.k.variance", lambda t: -t - 1, "negative variances"),
    ("g0.v.fp8_scale", lambda t: torch.zeros_like(t), "FP8 scales"),
    ("g0.k.basis", lambda t: t[:, :-1].contiguous(), "metadata implies"),
    ("g0.k.mean", lambda t: t.double(), "metadata implies"),
    ("g0.k.fp8_scale", lambda t: None, "missing"),
    ("g1.k.mean", lambda t: torch.zeros(32), "metadata implies none"),
])
def test_calibration_tensors_are_checked_with_the_identity_recomputed(tmp_path, name, make, words):
    _, tensors = cal_parts()
    path = _tensor_forged(tmp_path, name, make(tensors.get(name, torch.zeros(1))))
    _refused(lambda: load_calibration(str(path)), words=words)


def test_calibration_files_past_the_cap_are_refused_before_reading(tmp_path, monkeypatch):
    path = tmp_path / "cal.safetensors"
    calibration().save(str(path))
    assert load_calibration(str(path)).identity == calibration().identity
    monkeypatch.setattr(calib_mod, "MAX_CALIBRATION_BYTES", path.stat().st_size - 1)
    _refused(lambda: load_calibration(str(path)), words="more than")


@pytest.mark.parametrize("kwargs", [
    {"sink_tokens": -1}, {"recent_tokens": -5}, {"ratio": math.inf}, {"ratio": math.nan}, {"ratio": 0.9},
    {"range_size": 6}, {"range_size": 4.0}, {"layers_per_group": 0}, {"sink_tokens": 2**60},
    {"rope_theta": math.nan}, {"model": {"name": "x"}},
])
def test_calibrate_refuses_settings_a_calibration_file_cannot_hold(kwargs):
    """calibrate never writes what load_calibration refuses: its settings are checked by the same code."""
    _refused(lambda: calibrate([small_kv(40, 1)], **{"layers_per_group": 2, "range_size": 4, **kwargs}))


# ------------------------------------------------------------------ fuzz (tests/fuzz.py, under a memory cap)
def test_fuzz_kvtc_buffers():
    """`read_header`, `read_file` and `decompress` of forged buffers: raw damage, extreme header fields and
    damaged bodies with every size and the checksum recomputed (accepted ones must decode to finite K/V)."""
    run_capped("tests.kvtc.forge:fuzz_buffer", cases=3000)


def test_fuzz_kvtc_calibration_files():
    """`load_calibration` of forged files: mutated parameters JSON and damaged tensors with the identity
    recomputed, damaged bytes and safetensors headers (an accepted calibration must code and decode finitely)."""
    run_capped("tests.kvtc.forge:fuzz_calibration", cases=1500)
