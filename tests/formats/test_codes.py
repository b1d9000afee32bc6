"""Bit-level codecs: E2M1 codes, nibble packing order, E4M3 / E8M0 scale bytes, exact log2."""
import ml_dtypes as md
import numpy as np
import torch

from kvx_core.formats import codes as C

from .oracles import E2M1_TABLE, e2m1_codes, pack

F32 = np.float32


def test_e2m1_decode_matches_hand_table_and_ml_dtypes():
    all_codes = torch.arange(16, dtype=torch.uint8)
    got = C.e2m1_decode(all_codes).numpy()
    hand = np.array([E2M1_TABLE[c] for c in range(16)], dtype=F32)
    assert np.array_equal(got.view(np.uint32), hand.view(np.uint32))  # -0.0 for code 8 included
    ml = np.arange(16, dtype=np.uint8).view(md.float4_e2m1fn).astype(F32)
    assert np.array_equal(got.view(np.uint32), ml.view(np.uint32))


def test_e2m1_encode_exact_values_ties_and_saturation_hand():
    cases = [  # (value, code); a list, since 0.0 and -0.0 are equal dict keys
        (0.0, 0x0), (-0.0, 0x8),
    ]
    cases += list({
        0.5: 0x1, 1.0: 0x2, 1.5: 0x3, 2.0: 0x4, 3.0: 0x5, 4.0: 0x6, 6.0: 0x7,
        # ties -> even code
        0.25: 0x0, 0.75: 0x2, 1.25: 0x2, 1.75: 0x4, 2.5: 0x4, 3.5: 0x6, 5.0: 0x6,
        -0.25: 0x8, -0.75: 0xA, -1.25: 0xA, -1.75: 0xC, -2.5: 0xC, -3.5: 0xE, -5.0: 0xE,
        # just off the ties
        0.2500001: 0x1, 0.7499999: 0x1, 4.9999995: 0x6, 5.0000005: 0x7,
        # saturation and tiny values (sign kept on negative values that round to zero)
        6.5: 0x7, 7.0: 0x7, 1e30: 0x7, float("inf"): 0x7, -7.0: 0xF, float("-inf"): 0xF,
        1e-45: 0x0, -1e-45: 0x8, -0.1: 0x8,
    }.items())
    vals = torch.tensor([v for v, _ in cases], dtype=torch.float32)
    got = C.e2m1_encode(vals).tolist()
    assert got == [c for _, c in cases]
    assert C.e2m1_encode(torch.tensor([float("nan")])).tolist() == [0]


def test_e2m1_encode_matches_ml_dtypes_random():
    rng = np.random.default_rng(0)
    y = np.concatenate([
        rng.uniform(-8, 8, 200_000), rng.standard_normal(100_000) * 0.3,
        np.arange(-7, 7.01, 0.125),  # every tie and grid point
    ]).astype(F32)
    got = C.e2m1_encode(torch.from_numpy(y)).numpy()
    assert np.array_equal(got, e2m1_codes(y))


def test_pack_order_hand_made_bytes():
    codes = torch.tensor([0x1, 0x2, 0xF, 0x8, 0x7, 0x0, 0x3, 0xC], dtype=torch.uint8)
    packed = C.pack_nibbles(codes)
    assert packed.tolist() == [0x21, 0x8F, 0x07, 0xC3]
    assert C.unpack_nibbles(packed).tolist() == codes.tolist()
    assert np.array_equal(packed.numpy(), pack(codes.numpy()))
    # decode of hand-made bytes: 0x21 -> (0.5, 1.0), 0x8F -> (-6, -0), 0x07 -> (6, 0), 0xC3 -> (1.5, -2)
    vals = C.e2m1_decode(C.unpack_nibbles(torch.tensor([0x21, 0x8F, 0x07, 0xC3], dtype=torch.uint8)))
    assert vals.tolist() == [0.5, 1.0, -6.0, -0.0, 6.0, 0.0, 1.5, -2.0]


def test_e8m0_decode_all_bytes_vs_ml_dtypes():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = C.e8m0_from_byte(b).numpy()
    ml = np.arange(256, dtype=np.uint8).view(md.float8_e8m0fnu).astype(F32)
    assert np.isnan(got[255]) and np.isnan(ml[255])
    assert np.array_equal(got[:255].view(np.uint32), ml[:255].view(np.uint32))
    # hand values
    assert got[127] == 1.0 and got[128] == 2.0 and got[126] == 0.5 and got[254] == 2.0 ** 127
    assert got[0] == np.float32(2.0 ** -127) and got[1] == np.float32(2.0 ** -126)
    assert C.e8m0_to_byte(torch.tensor([-127, 0, 1, 127])).tolist() == [0, 127, 128, 254]


def test_e4m3_bytes_vs_ml_dtypes():
    rng = np.random.default_rng(1)
    v = np.concatenate([
        np.exp2(rng.uniform(-11, 9, 100_000)), [2.0 ** -9, 2.0 ** -10, 1.0625, 1.1875, 448.0, 464.0, 0.0],
    ]).astype(F32)
    v = np.minimum(v, F32(448))  # callers clamp first
    got = C.e4m3_to_byte(torch.from_numpy(v)).numpy()
    assert np.array_equal(got, v.astype(md.float8_e4m3fn).view(np.uint8))
    back = C.e4m3_from_byte(torch.arange(256, dtype=torch.int32).to(torch.uint8)).numpy()
    ml = np.arange(256, dtype=np.uint8).view(md.float8_e4m3fn).astype(F32)
    assert np.array_equal(np.isnan(back), np.isnan(ml))
    fin = ~np.isnan(ml)
    assert np.array_equal(back[fin].view(np.uint32), ml[fin].view(np.uint32))
    assert np.isnan(back[0x7F]) and back[0x7E] == 448.0 and back[0x38] == 1.0 and back[0x01] == 2.0 ** -9


def test_exact_floor_ceil_log2_including_subnormals():
    rng = np.random.default_rng(2)
    v = np.concatenate([
        np.exp2(rng.uniform(-149, 127.9, 50_000)), np.exp2(np.arange(-149, 128, dtype=np.float64)),
        [np.finfo(F32).max, np.finfo(F32).tiny, 1e-45, 3e-45, 1.0000001, 0.99999994],
    ]).astype(F32)
    v = v[v > 0]
    m, e = np.frexp(v.astype(np.float64))
    fl = torch.from_numpy(v)
    assert np.array_equal(C.floor_log2(fl).numpy(), e - 1)
    assert np.array_equal(C.ceil_log2(fl).numpy(), np.where(m == 0.5, e - 1, e))


def test_div_exact_is_ieee_division():
    """`div_exact` equals numpy's FP32 division (IEEE, round to nearest even) on values whose reciprocal product
    differs: x * (1/255) and x * (1/6) are not x / 255 and x / 6 for these."""
    x = torch.tensor([1.0, 3.0, 7.0, 1e-3, 6.0, 1.5, 255.0, 1e30, 3.4e38, 0.0, -0.0], dtype=torch.float32)
    for d in (255.0, 15.0, 6.0):
        want = x.numpy() / F32(d)
        assert np.array_equal(C.div_exact(x, d).numpy().view(np.uint32), want.view(np.uint32))
    rng = np.random.default_rng(0)
    y = rng.uniform(0, 1e4, 20000).astype(F32)
    recip = y * (F32(1) / F32(255))
    assert (recip != y / F32(255)).any()  # the property that makes the reciprocal form wrong
    assert np.array_equal(C.div_exact(torch.from_numpy(y), 255.0).numpy(), y / F32(255))


def test_encoders_divide_by_tensors_only(monkeypatch):
    """Every format's torch encoder (the oracle of the GPU kernels) divides by tensors, never by a Python number:
    PyTorch's CUDA division by a Python number multiplies by its reciprocal, which is not the pinned IEEE division
    (the GPU conversion tests saw int8 / mxfp4 scale bytes differ from the kernels' `div_rn` there)."""
    from kvx_core.formats import get_format, list_formats

    seen = []
    div = torch.Tensor.__truediv__

    def spy(self, other):
        if isinstance(other, (int, float)):
            seen.append(other)
        return div(self, other)

    monkeypatch.setattr(torch.Tensor, "__truediv__", spy)
    x = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(0)) * 4
    for name in list_formats():
        f = get_format(name)
        for tf in (f.k, f.v):
            g = torch.full((2,), 0.5) if tf.uses_global_scale else None
            seen.clear()
            tf.encode(x, g)
            assert not seen, (name, seen)
