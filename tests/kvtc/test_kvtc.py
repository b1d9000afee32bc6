"""KVTC: range quantizers against hand-made vectors and torch casts, the bit allocation against brute force, the
calibration file, and the codec's round trip, raw tokens and refusals (another calibration or model, damage,
truncation, versions, non-finite input)."""
from __future__ import annotations

import hashlib
import itertools
import math
import struct

import pytest
import torch

from kvx_core.errors import KvxError, Status
from kvx_core.kvtc import calibrate, calibration as calib_mod, compress, decompress, load_calibration, read_header
from kvx_core.kvtc.codec import HEADER, VERSION
from kvx_core.kvtc.quant import KINDS, RangeKind, dequantize_range, quantize_range, range_bytes

L, H, D = 4, 2, 16
MODEL = {"architecture": "LlamaForCausalLM", "num_layers": L, "num_kv_heads": H, "head_dim": D, "rope": {},
         "config_sha256": "c" * 64, "tokenizer_sha256": "t" * 64}  # a ModelFingerprint as a dict


def _kv(n: int, seed: int, bases, noise=0.05):
    """K/V of L layers with rank-8 structure per layer (fixed `bases`) plus noise, bf16."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for bk, bv in bases:
        k = torch.randn(n, 8, generator=g) @ bk + noise * torch.randn(n, H * D, generator=g)
        v = torch.randn(n, 8, generator=g) @ bv + noise * torch.randn(n, H * D, generator=g)
        out.append((k.view(n, H, D).bfloat16(), v.view(n, H, D).bfloat16()))
    return out


@pytest.fixture(scope="module")
def bases():
    g = torch.Generator().manual_seed(123)
    return [(torch.randn(8, H * D, generator=g), torch.randn(8, H * D, generator=g)) for _ in range(L)]


@pytest.fixture(scope="module")
def cal(bases):
    return calibrate([_kv(300, s, bases) for s in range(3)], layers_per_group=2, ratio=6, range_size=8,
                     sink_tokens=4, recent_tokens=16, model=MODEL)


def _rel(a, b):
    return float(sum(((x.float() - y.float()) ** 2).sum()
                     for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))
                 / sum((x.float() ** 2).sum() for p in a for x in p))


# ------------------------------------------------------------------ quantizers
def test_int_codes_pack_lsb_first_with_fp16_min_and_step_per_component():
    y = torch.tensor([[0.0, 1.0, 5.0, 3.0], [3.0, 1.0, 5.0, 0.0]])  # columns: 0..3, constant 1, constant 5, 3..0
    meta, q = quantize_range(y, RangeKind.parse("int2"), torch.ones(4))
    assert q.shape == (2, range_bytes(RangeKind.parse("int2"), 4)) == (2, 1)
    mn, step = meta.view(torch.float16).view(2, 4).tolist()
    assert mn == [0.0, 1.0, 5.0, 0.0] and step == [1.0, 0.0, 0.0, 1.0]  # constant columns: step 0, codes 0
    assert int(q[0, 0]) == 0b11_00_00_00 and int(q[1, 0]) == 0b00_00_00_11  # element i at bits 2i
    assert torch.equal(dequantize_range(meta, q, RangeKind.parse("int2"), 4, torch.ones(4)), y)
    _, q4 = quantize_range(torch.tensor([[0.0, 15.0, 7.0, 8.0], [15.0, 0.0, 0.0, 0.0]]), RangeKind.parse("int4"),
                           torch.ones(4))
    assert q4[0].tolist() == [0xF0, 0xFF] and q4[1].tolist() == [0x0F, 0x00]  # each column its own min..max


def test_fp8_ranges_are_the_torch_cast_of_the_scaled_values():
    y = torch.tensor([[1.0, -300.0, 1e-3, 900.0]])
    scale = torch.tensor([0.5, 1.0, 1.0, 1.0])
    meta, q = quantize_range(y, RangeKind.parse("fp8"), scale)
    want = torch.tensor([[2.0, -300.0, 1e-3, 448.0]]).to(torch.float8_e4m3fn)  # 900 saturates to 448
    assert meta.numel() == 0 and torch.equal(q, want.view(torch.uint8))
    assert torch.equal(dequantize_range(meta, q, RangeKind.parse("fp8"), 4, scale), want.float() * scale)


def test_int_ranges_refuse_values_beyond_fp16():
    with pytest.raises(KvxError) as e:
        quantize_range(torch.tensor([[0.0, 1e6, 0.0, 0.0]]), RangeKind.parse("int4"), torch.ones(4))
    assert e.value.status == Status.OUT_OF_RANGE


# ------------------------------------------------------------------ calibration
def _brute_force(segments, budget):
    """The least summed error over every kind per range (`segments`: (y, scale) ranges) within `budget`."""
    best = math.inf
    for combo in itertools.product(KINDS, repeat=len(segments)):
        if sum(range_bytes(k, seg.shape[1]) for k, (seg, _) in zip(combo, segments, strict=True)) > budget:
            continue
        e = 0.0
        for k, (seg, sc) in zip(combo, segments, strict=True):
            rec = (dequantize_range(*quantize_range(seg, k, sc), k, seg.shape[1], sc) if k.bits
                   else torch.zeros_like(seg))
            e += float(((rec - seg).double() ** 2).sum())
        best = min(best, e)
    return best


def _error(y, scale, ranges):
    e = float((y.double() ** 2).sum())
    for a, b, name in ranges:
        k = RangeKind.parse(name)
        seg = y[:, a:b]
        rec = dequantize_range(*quantize_range(seg, k, scale[a:b]), k, b - a, scale[a:b])
        e += float(((rec - seg).double() ** 2).sum()) - float((seg.double() ** 2).sum())
    return e


def test_allocation_is_the_best_within_the_budget():
    """Dynamic programming == brute force over every kind per range, on measured errors (one projection, and K
    and V sharing a budget)."""
    g = torch.Generator().manual_seed(5)
    y = torch.randn(64, 12, generator=g) * torch.tensor([9.0] * 4 + [3.0] * 4 + [0.5] * 4)
    y2 = torch.randn(64, 8, generator=g) * torch.tensor([4.0] * 4 + [0.2] * 4)
    scale, scale2 = y.abs().amax(0) / 448, y2.abs().amax(0) / 448
    segs = [(y[:, a:a + 4], scale[a:a + 4]) for a in (0, 4, 8)]
    segs2 = [(y2[:, a:a + 4], scale2[a:a + 4]) for a in (0, 4)]
    for budget in (3, 7, 12):
        (got,) = calib_mod._allocate([(y, scale)], 4, budget)
        assert _error(y, scale, got) == pytest.approx(_brute_force(segs, budget), rel=1e-9), budget
        got_k, got_v = calib_mod._allocate([(y, scale), (y2, scale2)], 4, budget)
        joint = _error(y, scale, got_k) + _error(y2, scale2, got_v)
        assert joint == pytest.approx(_brute_force(segs + segs2, budget), rel=1e-9), budget


def test_calibration_basis_and_budget(cal):
    for gc in cal.groups:
        for s in ("k", "v"):
            c = gc[s]
            f = cal.features
            assert c.basis.shape == (f, f) and torch.allclose(c.basis.T @ c.basis, torch.eye(f), atol=1e-4)
            assert bool((c.variance[:-1] >= c.variance[1:]).all())
            assert c.bytes_per_token() <= int(f * 2 / cal.ratio)


def test_calibration_file_round_trip_and_damage(cal, tmp_path):
    p = str(tmp_path / "cal.safetensors")
    ident = cal.save(p)
    back = load_calibration(p)
    assert back.identity == ident == cal.identity and back.params() == cal.params()
    from safetensors import safe_open  # a standard safetensors file
    with safe_open(p, framework="pt") as f:
        assert "g0.k.basis" in f.keys() and f.metadata()["identity"] == ident
    with pytest.raises(KvxError, match="never overwrites"):
        cal.save(p)
    raw = bytearray(open(p, "rb").read())
    raw[-5] ^= 0x01  # a tensor byte
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(raw))
    with pytest.raises(KvxError, match="identity"):
        load_calibration(str(bad))
    (tmp_path / "junk").write_bytes(b"not safetensors")
    with pytest.raises(KvxError):
        load_calibration(str(tmp_path / "junk"))


# ------------------------------------------------------------------ codec
def test_round_trip_keeps_raw_tokens_exact_and_codes_the_rest(cal, bases):
    kv = _kv(100, 9, bases)
    buf = compress(kv, cal, model={"name": "shim"}, token_start=2)
    hdr, out, _ = decompress(buf, cal, model={"name": "shim"})
    assert (hdr.token_start, hdr.token_count, hdr.raw_head, hdr.raw_tail) == (2, 100, 2, 16)  # sinks: positions < 4
    for (k, v), (k2, v2) in zip(kv, out, strict=True):
        for a, b in ((k, k2), (v, v2)):
            assert torch.equal(a[:2], b[:2]) and torch.equal(a[-16:], b[-16:])
    middle = [(k[2:-16], v[2:-16]) for k, v in kv]
    assert _rel(middle, [(k[2:-16], v[2:-16]) for k, v in out]) < 5e-3  # rank-8 data, noise 0.05
    assert len(buf) < 100 * L * 2 * H * D * 2 / 2.5
    d = compress(kv, cal, model={"name": "shim"}, token_start=2, deflate=True)
    assert len(d) < len(buf) and read_header(d).flags == 1
    _, out2, _ = decompress(d, cal)
    assert all(torch.equal(a, b) for p, q in zip(out, out2, strict=True) for a, b in zip(p, q, strict=True))


def test_all_raw_and_empty_sequences(cal, bases):
    for n in (0, 3, 20):
        kv = _kv(n, 1, bases)
        hdr, out, _ = decompress(compress(kv, cal), cal)
        assert hdr.token_count == n
        if n <= 20:  # every token is a sink or recent
            assert all(torch.equal(a, b) for p, q in zip(kv, out, strict=True) for a, b in zip(p, q, strict=True))


def test_foreign_damaged_and_truncated_buffers_are_refused(cal, bases):
    kv = _kv(60, 2, bases)
    buf = compress(kv, cal, model={"name": "shim"})
    other = calibrate([_kv(300, 7, bases)], layers_per_group=2, ratio=6, range_size=8, sink_tokens=4,
                      recent_tokens=16)
    cases = {
        "another calibration": (lambda: decompress(buf, other), Status.INCOMPATIBLE),
        "another model": (lambda: decompress(buf, cal, model={"name": "other"}), Status.INCOMPATIBLE),
        "truncated": (lambda: decompress(buf[:-7], cal), Status.INVALID_ARGUMENT),
        "damaged": (lambda: decompress(buf[:200] + bytes([buf[200] ^ 1]) + buf[201:], cal), Status.INVALID_ARGUMENT),
        "bad magic": (lambda: decompress(b"XXXX" + buf[4:], cal), Status.INVALID_ARGUMENT),
        "newer version": (lambda: decompress(buf[:4] + struct.pack("<H", VERSION + 1) + buf[6:], cal),
                          Status.INCOMPATIBLE),
        "version 1 with a version 2 checksum": (lambda: decompress(buf[:4] + struct.pack("<H", 1) + buf[6:], cal),
                                                Status.INVALID_ARGUMENT),
        "not bytes": (lambda: decompress("text", cal), Status.INVALID_ARGUMENT),
    }
    for name, (fn, status) in cases.items():
        with pytest.raises(KvxError) as e:
            fn()
        assert e.value.status == status, name
    assert HEADER.size + 16 < len(buf)


def test_version_2_checksum_is_xxh3_128_and_version_1_buffers_still_read(cal, bases):
    xxhash = pytest.importorskip("xxhash")
    kv = _kv(60, 3, bases)
    buf = compress(kv, cal)
    assert struct.unpack_from("<H", buf, 4)[0] == VERSION == 2
    assert buf[-16:] == xxhash.xxh3_128(buf[:-16]).digest()
    v1 = buf[:4] + struct.pack("<H", 1) + buf[6:-16]
    v1 += hashlib.blake2b(v1, digest_size=16).digest()
    old, new = decompress(v1, cal), decompress(buf, cal)
    assert all(torch.equal(a, b) for p, q in zip(old.kv, new.kv, strict=True) for a, b in zip(p, q, strict=True))


def test_bad_input_is_refused(cal, bases):
    kv = _kv(30, 3, bases)
    bad = [(k.clone(), v) for k, v in kv]
    bad[1][0][5, 0, 0] = float("nan")
    for fn in (lambda: compress(bad, cal), lambda: compress(kv[:3], cal),
               lambda: compress([(k[:, :1], v[:, :1]) for k, v in kv], cal),
               lambda: compress(kv, cal, token_start=-1)):
        with pytest.raises(KvxError) as e:
            fn()
        assert e.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KvxError, match="divide"):
        calibrate([kv], layers_per_group=3)


def test_rope_removal_matches_transformers_and_round_trips():
    """`rope.rotate` == transformers' Llama RoPE (apply_rotary_pos_emb) on the same positions; inverse undoes it."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from kvx_core.kvtc.rope import rope_theta_of, rotate

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    k = torch.randn(1, 2, 37, 16, generator=torch.Generator().manual_seed(0))  # [B, H, T, D]
    pos = torch.arange(5, 42)[None]
    cos, sin = LlamaRotaryEmbedding(cfg)(k, pos)
    want, _ = apply_rotary_pos_emb(k, k, cos, sin)
    got = rotate(k[0].transpose(0, 1), pos[0], rope_theta_of(cfg))
    torch.testing.assert_close(got, want[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotate(got, pos[0], 10000.0, inverse=True), k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    cfg.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert rope_theta_of(cfg) is None  # scaled RoPE: coded without removal


def test_rope_removal_codes_rotated_keys_better(bases):
    """Keys that are low-rank before RoPE (as a model's are) code far better with the rotation removed."""
    from kvx_core.kvtc.rope import rotate

    def roped(n, seed, start=0):
        return [(rotate(k.float(), torch.arange(start, start + n), 10000.0).bfloat16(), v)
                for k, v in _kv(n, seed, bases)]

    err = {}
    for theta in (None, 10000.0):
        c = calibrate([roped(300, s) for s in range(3)], layers_per_group=2, ratio=6, range_size=8,
                      sink_tokens=4, recent_tokens=16, rope_theta=theta)
        kv = roped(80, 11, start=100)
        hdr, out, _ = decompress(compress(kv, c, token_start=100), c)
        assert all(torch.equal(a[-16:], b[-16:])
                   for p, q in zip(kv, out, strict=True) for a, b in zip(p, q, strict=True))
        err[theta] = _rel([(k[:-16], k[:-16]) for k, _ in kv], [(k[:-16], k[:-16]) for k, _ in out])
    assert err[10000.0] < 5e-3 < err[None]
