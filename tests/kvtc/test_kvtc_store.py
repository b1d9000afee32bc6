"""KVTC as a bundle codec: `encode_bundle` / `decode_bundle` and `BundleStore(root, kvtc=...)` entries. The caches a
KVTC entry reloads into hold exactly what writing the buffer's decompressed K/V gives (any destination format), the
raw sink / recent tokens come back bit for bit, and entries without their calibration, of another calibration or
damaged are refused with the cache untouched."""
from __future__ import annotations

import io
from dataclasses import asdict

import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.errors import KvxError, Status
from kvx_core.kvtc import calibrate, decompress
from kvx_core.transfer import ModelFingerprint
from kvx_core.transfer.handoff import export_bundle
from kvx_core.transfer.kvtc_bundle import decode_bundle, encode_bundle
from kvx_core.transfer.rows import read_rows
from kvx_core.transfer.store import BundleStore

LAYERS, H, D, T = 2, 2, 32, 40
MODEL = ModelFingerprint("LlamaForCausalLM", LAYERS, H, D, {}, "c" * 64, "t" * 64)
IDS = list(range(7, 7 + T))
SINKS, RECENT = 4, 8


def _kv(n, seed):
    """Per layer (K, V) `[n, H, D]` of rank-6 structure plus noise (what PCA coding is for)."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(2 * LAYERS, 6, H * D, generator=torch.Generator().manual_seed(99))
    return [tuple((torch.randn(n, 6, generator=g) @ basis[2 * i + j] + 0.05 * torch.randn(n, H * D, generator=g))
                  .view(n, H, D).bfloat16() for j in range(2)) for i in range(LAYERS)]


def _cal(seed=0):
    return calibrate([_kv(200, seed + s) for s in range(3)], layers_per_group=2, ratio=4, range_size=8,
                     sink_tokens=SINKS, recent_tokens=RECENT, model=asdict(MODEL))


@pytest.fixture(scope="module")
def cal():
    return _cal()


def _cache(fmt, kv=None):
    c = PagedKVCache(fmt, num_layers=LAYERS, num_blocks=6, block_size=16, num_kv_heads=H, head_dim=D)
    if kv is not None:
        for layer, (k, v) in enumerate(kv):
            c.write(layer, k, v, torch.arange(T))
    return c


def _descs(c):
    return [c.descriptor(i) for i in range(LAYERS)]


def _rows(c, slots):
    return [read_rows(c.descriptor(i), slots) for i in range(LAYERS)]


def _same(a, b):
    return all(torch.equal(x[n].view(torch.uint8), y[n].view(torch.uint8))
               for x, y in zip(a, b, strict=True) for n in x)


@pytest.mark.parametrize("dst_fmt", ["bf16", "nvfp4", "int8"])
def test_kvtc_store_round_trip_equals_writing_the_decompressed_kv(cal, tmp_path, dst_fmt):
    src = _cache("bf16", _kv(T, 7))
    slots = torch.arange(T)
    plain = io.BytesIO()
    export_bundle(plain, _descs(src), slots, model=MODEL, token_ids=IDS)
    store = BundleStore(tmp_path / "kv", kvtc=cal)
    path = store.put(_descs(src), slots, model=MODEL, token_ids=IDS)
    coded = path.read_bytes()
    assert coded[:4] == b"KVTC" and len(coded) < len(plain.getvalue())
    header = store.header(MODEL, IDS)
    assert header["tokens"]["count"] == T and header["codec"] == {"name": "kvtc", "calibration": cal.identity}
    back = torch.arange(T) + 30
    dst = _cache(dst_fmt)
    assert BundleStore(tmp_path / "kv", kvtc=cal).get(_descs(dst), back, model=MODEL, token_ids=IDS)
    _, kv, ids = decompress(coded, cal, model=asdict(MODEL))
    assert ids == IDS
    oracle = _cache(dst_fmt)
    for layer, (k, v) in enumerate(kv):
        oracle.write(layer, k, v, back)
    assert _same(_rows(dst, back), _rows(oracle, back))
    if dst_fmt == "bf16":  # sinks and the recent window are stored raw
        raw = torch.cat([torch.arange(SINKS), torch.arange(T - RECENT, T)])
        assert _same(_rows(dst, back[raw]), _rows(src, raw))


def test_plain_entries_stay_readable_and_bundles_convert_both_ways(cal, tmp_path):
    src = _cache("nvfp4", _kv(T, 3))
    slots = torch.arange(T)
    BundleStore(tmp_path / "kv").put(_descs(src), slots, model=MODEL, token_ids=IDS)
    dst = _cache("nvfp4")
    assert BundleStore(tmp_path / "kv", kvtc=cal).get(_descs(dst), slots, model=MODEL, token_ids=IDS)
    assert _same(_rows(dst, slots), _rows(src, slots))  # a plain bundle entry, read by a KVTC store
    plain = io.BytesIO()
    export_bundle(plain, _descs(src), slots, model=MODEL, token_ids=IDS)
    plain.seek(0)
    buf = encode_bundle(plain, cal)
    out = io.BytesIO()
    header = decode_bundle(buf, cal, out)
    assert header["cache"]["format"] == "bf16" and header["tokens"]["ids"] == IDS and header["model"] == asdict(MODEL)


def test_kvtc_entries_are_refused_without_their_calibration_or_damaged(cal, tmp_path):
    src = _cache("bf16", _kv(T, 5))
    path = BundleStore(tmp_path / "kv", kvtc=cal).put(_descs(src), torch.arange(T), model=MODEL, token_ids=IDS)
    dst = _cache("int4", _kv(T, 6))
    before = [t.clone() for p in dst.layers for t in (p.k_data, p.v_data, p.k_scales)]
    cases = [(BundleStore(tmp_path / "kv"), Status.UNSUPPORTED, "KVTC-coded"),
             (BundleStore(tmp_path / "kv", kvtc=_cal(seed=50)), Status.INCOMPATIBLE, "calibration")]
    for store, status, words in cases:
        for call in (lambda: store.get(_descs(dst), torch.arange(T), model=MODEL, token_ids=IDS),
                     lambda: store.header(MODEL, IDS)):
            with pytest.raises(KvxError, match=words) as e:
                call()
            assert e.value.status == status
    other = ModelFingerprint("LlamaForCausalLM", LAYERS, H, D, {}, "d" * 64, "t" * 64)
    with pytest.raises(KvxError, match="another model"):
        BundleStore(tmp_path / "kv2", kvtc=cal).put(_descs(src), torch.arange(T), model=other, token_ids=IDS)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(KvxError, match="checksum"):
        BundleStore(tmp_path / "kv", kvtc=cal).get(_descs(dst), torch.arange(T), model=MODEL, token_ids=IDS)
    after = [t for p in dst.layers for t in (p.k_data, p.v_data, p.k_scales)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert not list((tmp_path / "kv2").glob("*.kvx"))
