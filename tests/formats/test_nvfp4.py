"""NVFP4 vs an independent numpy/ml_dtypes oracle of the pinned formula, adversarial cases, error bounds.

Error bound (stated and checked below). With S = f32(e4m3(s) * g) the group's effective scale and
y = x / S, RNE onto the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} gives, per element,
    |x - x_hat| <= S * max(h(|y|), |y| - 6)   (+ FP32 rounding of x/S and of the decode product),
with h = 0.25 for |y| <= 2, 0.5 for |y| <= 4, 1 for |y| <= 6 (half the grid spacing), and |y| - 6
the saturation error. When s = amax/(6g) is a normal E4M3 number (2^-6 <= s <= 448), RNE gives
e4m3(s) >= s / (1 + 2^-4), so |y| <= 6 (1 + 2^-4) = 6.375, the saturation term is <= 0.375 and the
group's max error is <= S <= (1 + 2^-4) * amax / 6 (about 0.177 amax). Below 2^-6 the E4M3 scale is
subnormal (coarser) and below 2^-9 it is clamped to 2^-9 (underflow guard): the per-element bound
still holds. Above 448 (global scale too small) the scale saturates and the |y| - 6 term dominates.
"""
import ml_dtypes as md
import numpy as np
import pytest
import torch

from kvx_core.errors import KvxError, Status
from kvx_core.formats import NVFP4Format, global_scale_from_amax

from . import oracles as O

F32 = np.float32
FMT = NVFP4Format()


def run(x: np.ndarray, g=None, in_dtype=torch.float32):
    gt = None if g is None else torch.as_tensor(np.asarray(g, dtype=F32))
    p, s = FMT.encode(torch.from_numpy(np.ascontiguousarray(x)).to(in_dtype), gt)
    assert p.dtype == torch.uint8 and s.dtype == torch.uint8
    assert p.shape == x.shape[:-1] + (x.shape[-1] // 2,) and s.shape == x.shape[:-1] + (x.shape[-1] // 16,)
    return p.numpy(), s.numpy(), FMT.decode(p, s, gt).numpy()


def check_vs_oracle(x: np.ndarray, g=None):
    p, s, dec = run(x, g)
    op, os_ = O.nvfp4_encode(x, g)
    assert np.array_equal(s, os_), np.argwhere(s != os_)[:5]
    assert np.array_equal(p, op), np.argwhere(p != op)[:5]
    O.assert_same_float(dec, O.nvfp4_decode(op, os_, g))
    return p, s, dec


def test_random_million_values_bit_exact():
    x = O.random_kv(np.random.default_rng(10), (1024, 8, 128))
    check_vs_oracle(x)


def test_bf16_input_bit_exact():
    x = O.random_kv(np.random.default_rng(11), (256, 4, 128))
    xb = torch.from_numpy(x).to(torch.bfloat16)
    p, s = FMT.encode(xb)
    op, os_ = O.nvfp4_encode(xb.to(torch.float32).numpy())
    assert np.array_equal(p.numpy(), op) and np.array_equal(s.numpy(), os_)
    dec_bf16 = FMT.decode(p, s, out_dtype=torch.bfloat16)
    assert dec_bf16.dtype == torch.bfloat16
    assert torch.equal(dec_bf16, FMT.decode(p, s).to(torch.bfloat16))


def test_global_scale_per_tensor_and_per_head_bit_exact():
    rng = np.random.default_rng(12)
    x = O.random_kv(rng, (256, 8, 128), log10_range=(-2, 4))
    g = global_scale_from_amax(torch.tensor(float(np.abs(x).max()))).numpy()
    assert g.shape == () and g != 1
    check_vs_oracle(x, g)
    check_vs_oracle(x, F32(0.37))
    gh = global_scale_from_amax(torch.from_numpy(np.abs(x).max(axis=(0, 2)))).numpy()
    assert gh.shape == (8,)
    check_vs_oracle(x, gh)
    check_vs_oracle(x, (10.0 ** rng.uniform(-3, 1, 8)).astype(F32))


TIE_ROW = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0]
TIE_CODES = [0x7, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x8, 0xA, 0xA, 0xC, 0xC, 0xE, 0xE, 0xF]


@pytest.mark.parametrize("mult,g,scale_byte", [
    (1.0, 1.0, 0x38),            # s = 1
    (2.0 ** -5, 2.0 ** -3, 0x28),  # s = 2^-2
    (2.0 ** 6, 1.0, 0x68),       # s = 64
    (1.125, 1.0, 0x39),          # s = 1.125 (ties relative to a non power of two scale)
    (1.125 * 0.375, 0.375, 0x39),  # same with g = 0.375
])
def test_e2m1_ties_relative_to_scale_hand(mult, g, scale_byte):
    row = (np.array(TIE_ROW, dtype=np.float64) * mult).astype(F32)
    assert np.array_equal(row.astype(np.float64), np.array(TIE_ROW) * mult)  # exact in FP32
    p, s, dec = run(row.reshape(1, 16), F32(g))
    assert s.tolist() == [[scale_byte]]
    assert O.unpack(p).ravel().tolist() == TIE_CODES
    big_s = F32(np.array([scale_byte], np.uint8).view(md.float8_e4m3fn).astype(F32)[0] * F32(g))
    assert dec.ravel().tolist() == [float(F32(O.E2M1_TABLE[c]) * big_s) for c in TIE_CODES]


def test_scale_guards_and_rounding_hand():
    rows = {
        "zero": ([0.0] * 16, 0x38),                 # all-zero group -> s = 1.0 (ModelOpt)
        "neg_zero": ([-0.0] * 16, 0x38),
        "s_min": ([6 * 2.0 ** -9] + [0.0] * 15, 0x01),          # s = 2^-9 exactly
        "s_tie_to_zero": ([6 * 2.0 ** -10] + [0.0] * 15, 0x01),  # s = 2^-10 -> guard 2^-9 (RNE would give 0)
        "s_tiny": ([1e-30] * 16, 0x01),              # far below: guard
        "s_subnormal": ([1e-40, -1e-40] * 8, 0x01),
        "s_underflows_fp32": ([1e-45, -1e-45] * 8, 0x38),  # amax/6 == 0 in FP32 -> treated as zero group
        "s_max": ([6 * 448.0] + [1.0] * 15, 0x7E),   # s = 448
        "s_over": ([6 * 464.0] + [1.0] * 15, 0x7E),  # s = 464 -> saturate 448
        "s_huge": ([3.0e38, -3.0e38] * 8, 0x7E),
        "e4m3_tie_down": ([6 * 1.0625] + [0.0] * 15, 0x38),   # 1.0625: tie 1.0 / 1.125 -> even 1.0
        "e4m3_tie_up": ([6 * 1.1875] + [0.0] * 15, 0x3A),     # 1.1875: tie 1.125 / 1.25 -> even 1.25
    }
    x = np.array([r for r, _ in rows.values()], dtype=F32).reshape(1, len(rows), 16)
    p, s, dec = check_vs_oracle(x)
    assert s.ravel().tolist() == [b for _, b in rows.values()]
    names = list(rows)
    codes = O.unpack(p).reshape(len(rows), 16)
    assert codes[names.index("zero")].tolist() == [0] * 16
    assert codes[names.index("neg_zero")].tolist() == [8] * 16  # sign bit kept (decodes to -0.0)
    assert codes[names.index("s_huge")].tolist() == [0x7, 0xF] * 8  # saturated at +-6
    assert dec[0, names.index("s_huge")].tolist() == [6 * 448.0, -6 * 448.0] * 8
    assert dec[0, names.index("s_tiny")].tolist() == [0.0] * 16
    assert FMT.scale_overflow(torch.from_numpy(x)).reshape(-1).tolist() == [
        n in ("s_over", "s_huge") for n in names]


def _adversarial_rows(rng: np.random.Generator) -> np.ndarray:
    rows = [np.array(TIE_ROW, F32), np.array(TIE_ROW, F32) * F32(2.0 ** -7)]
    for k in range(-20, 21, 3):  # amax exactly a power of two
        r = rng.uniform(-1, 1, 16).astype(F32) * F32(2.0 ** k)
        r[rng.integers(16)] = F32(2.0 ** k) * rng.choice([-1, 1])
        rows.append(r)
    rows += [np.zeros(16, F32), np.full(16, -0.0, F32), np.array([0.0, -0.0] * 8, F32)]
    rows += [rng.uniform(-1, 1, 16).astype(F32) * F32(1e-40), np.full(16, 1e-45, F32)]  # subnormals
    rows += [rng.uniform(-1, 1, 16).astype(F32) * F32(1e30), np.full(16, 3.4e38, F32)]  # huge
    rows += [rng.uniform(-1, 1, 16).astype(F32) * F32(1e-7), rng.uniform(-1, 1, 16).astype(F32) * F32(1e5)]
    r = rng.uniform(-1, 1, 16).astype(F32)
    r[3] = F32(1e4)
    rows.append(r)  # one outlier crushing the rest of its group
    for s in (2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -6, 448.0, 449.0, 464.0, 1.0625, 1.1875):
        r = rng.uniform(-1, 1, 16).astype(F32) * F32(6 * s)
        r[0] = F32(6 * s)
        rows.append(r)
    while len(rows) % 8:
        rows.append(rng.standard_normal(16).astype(F32))
    return np.stack(rows).astype(F32)


@pytest.mark.parametrize("g", [None, "scalar", "per_head"])
def test_adversarial_bit_exact(g):
    rng = np.random.default_rng(13)
    x = _adversarial_rows(rng).reshape(-1, 2, 64)  # 4 groups per (token, head): neighbours differ wildly
    gv = {None: None, "scalar": F32(2.0 ** -4), "per_head": np.array([0.01, 3.0], F32)}[g]
    check_vs_oracle(x, gv)
    check_vs_oracle(x[:, ::-1].copy(), gv)


def test_nan_inf_poison_only_their_group():
    rng = np.random.default_rng(14)
    x = rng.standard_normal((4, 2, 64)).astype(F32)
    x[0, 0, 3] = np.nan
    x[1, 1, 40] = np.inf
    x[2, 0, 17] = -np.inf
    p, s, dec = check_vs_oracle(x)
    bad = [(0, 0, 0), (1, 1, 2), (2, 0, 1)]
    codes = O.unpack(p).reshape(4, 2, 4, 16)
    decg = dec.reshape(4, 2, 4, 16)
    for idx in np.ndindex(4, 2, 4):
        if idx in bad:
            assert s[idx] == 0x7F and (codes[idx] == 0).all() and np.isnan(decg[idx]).all()
        else:
            assert s[idx] != 0x7F and np.isfinite(decg[idx]).all()


def test_decode_arbitrary_bytes_matches_oracle():
    rng = np.random.default_rng(15)
    p = rng.integers(0, 256, (64, 4, 32), dtype=np.uint8)
    s = rng.integers(0, 256, (64, 4, 4), dtype=np.uint8)
    g = np.array([1.0, 0.5, 3.0, 1e-3], F32)
    got = FMT.decode(torch.from_numpy(p), torch.from_numpy(s), torch.from_numpy(g)).numpy()
    O.assert_same_float(got, O.nvfp4_decode(p, s, g))


@pytest.mark.parametrize("calibrated", [True, False])
def test_round_trip_error_bound(calibrated):
    rng = np.random.default_rng(16)
    x = O.random_kv(rng, (512, 4, 128), log10_range=(-8, 5))
    g = (np.abs(x).max(axis=(0, 2)) / F32(6 * 448)).astype(F32) if calibrated else None
    p, s, dec = check_vs_oracle(x, g)
    big_s = O.nvfp4_group_scale(s, g, heads=4).astype(np.float64)[..., None]
    xg = x.reshape(512, 4, 8, 16).astype(np.float64)
    err = np.abs(xg - dec.reshape(xg.shape).astype(np.float64))
    a = np.abs(xg) / big_s
    bound = big_s * np.maximum(O.halfstep_e2m1(np.minimum(a, 6)), a - 6)
    slack = 2.0 ** -22 * (np.abs(xg) + np.abs(dec.reshape(xg.shape))) + 1e-44
    assert (err <= bound + slack).all()
    # group-level: scales in the normal E4M3 range give max error <= S <= (1 + 2^-4) amax / 6
    amax = np.abs(xg).max(-1)
    gg = 1.0 if g is None else g.astype(np.float64)[:, None]
    s_raw = amax / (6 * gg)
    normal = (s_raw >= 2.0 ** -6) & (s_raw <= 448)
    assert normal.mean() > 0.2
    gmax = err.max(-1)
    assert (gmax[normal] <= big_s[..., 0][normal] * (1 + 1e-6)).all()
    assert (big_s[..., 0][normal] <= (1 + 2.0 ** -4) * amax[normal] / 6 * (1 + 1e-6)).all()
    if calibrated:
        assert not FMT.scale_overflow(torch.from_numpy(x), torch.from_numpy(g)).any()


def test_invalid_arguments():
    x = torch.randn(2, 3, 64)
    for bad in (0.0, -1.0, float("nan"), float("inf"), torch.ones(2), torch.ones(3, 1), torch.tensor([1, 2, 3])):
        with pytest.raises(KvxError) as e:
            FMT.encode(x, bad)
        assert e.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KvxError):
        FMT.encode(torch.randn(2, 3, 40))  # head_dim not a multiple of 16
    with pytest.raises(KvxError):
        FMT.encode(torch.randint(0, 3, (2, 3, 64)))  # not float
    p, s = FMT.encode(x)
    with pytest.raises(KvxError):
        FMT.decode(p, s[..., :2])
    with pytest.raises(KvxError):
        FMT.decode(p.to(torch.int32), s)
    assert FMT.payload_dim(128) == 64 and FMT.scale_dim(128) == 8 and FMT.bytes_per_token_head(128) == 72
