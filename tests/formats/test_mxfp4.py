"""MXFP4 (groups 16/32, RCEIL and FLOOR) vs an independent numpy/ml_dtypes oracle, edge cases, bounds.

Error bounds (S = 2**E the group's scale, y = x / S, h = half the E2M1 spacing at |y| as in NVFP4):
  RCEIL: S = 2**ceil(log2(amax/6)) >= amax/6, so |y| <= 6: no clipping, |x - x_hat| <= S * h(|y|) <= S,
         and S < 2 * amax / 6, so the group's max error is < amax / 3.
  FLOOR: S = 2**(floor(log2(amax)) - 2), amax / S in [4, 8): |y| may exceed 6 and saturates,
         |x - x_hat| <= S * max(h(|y|), |y| - 6) <= 2 S <= amax / 2.
  (Both when E is not clamped at -127; the clamped case still obeys the per-element bound.)
"""
import numpy as np
import pytest
import torch

from kvx_core.errors import KvxError, Status
from kvx_core.formats import MXFP4Format

from . import oracles as O

F32 = np.float32
VARIANTS = [(16, "rceil"), (32, "rceil"), (16, "floor"), (32, "floor")]


def check_vs_oracle(fmt: MXFP4Format, x: np.ndarray):
    p, s = fmt.encode(torch.from_numpy(np.ascontiguousarray(x)))
    assert p.dtype == torch.uint8 and s.dtype == torch.uint8
    assert s.shape == x.shape[:-1] + (x.shape[-1] // fmt.group_size,)
    dec = fmt.decode(p, s).numpy()
    p, s = p.numpy(), s.numpy()
    op, os_ = O.mxfp4_encode(x, fmt.group_size, fmt.scale_rule)
    assert np.array_equal(s, os_), np.argwhere(s != os_)[:5]
    assert np.array_equal(p, op), np.argwhere(p != op)[:5]
    O.assert_same_float(dec, O.mxfp4_decode(op, os_, fmt.group_size))
    return p, s, dec


@pytest.mark.parametrize("gs,rule", VARIANTS)
def test_random_million_values_bit_exact(gs, rule):
    x = O.random_kv(np.random.default_rng(20), (1024, 8, 128), group=gs, log10_range=(-6, 6))
    check_vs_oracle(MXFP4Format(gs, rule), x)


def _adversarial(rng: np.random.Generator, gs: int) -> np.ndarray:
    rows = []
    tie = np.array([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * (gs // 8), F32)
    tie[8:] *= -1
    rows += [tie, tie * F32(2.0 ** -9), tie * F32(2.0 ** 20)]
    for k in list(range(-130, 128, 11)) + [-149, -127, -126, 125, 127]:  # amax exactly 2**k (incl. subnormal)
        r = rng.uniform(-1, 1, gs).astype(F32) * F32(2.0 ** k)
        r[rng.integers(gs)] = F32(2.0 ** k)
        rows.append(r)
    for a in (6.0, 6.0000005, 5.9999995, 12.0, 7.0, 7.9999995, 8.0, 3.4e38, 1e-45, 1e-40, 6 * 2.0 ** -127):
        r = rng.uniform(-1, 1, gs).astype(F32) * F32(a)
        r[0] = F32(-a)
        rows.append(r)
    rows += [np.zeros(gs, F32), np.full(gs, -0.0, F32), np.full(gs, 1e-45, F32)]
    rows += [rng.uniform(-1, 1, gs).astype(F32) * F32(1e-7), rng.uniform(-1, 1, gs).astype(F32) * F32(1e7)]
    while len(rows) % 4:
        rows.append(rng.standard_normal(gs).astype(F32))
    return np.stack(rows).reshape(-1, 2, 2 * gs)


@pytest.mark.parametrize("gs,rule", VARIANTS)
def test_adversarial_bit_exact(gs, rule):
    rng = np.random.default_rng(21)
    fmt = MXFP4Format(gs, rule)
    x = _adversarial(rng, gs)
    check_vs_oracle(fmt, x)
    check_vs_oracle(fmt, -x)


def test_hand_values():
    fmt = MXFP4Format(16, "rceil")
    tie = np.array([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2, F32)
    p, s, dec = check_vs_oracle(fmt, tie.reshape(1, 1, 16))
    assert s.tolist() == [[[127]]]  # amax/6 = 1 -> 2**0
    assert O.unpack(p).ravel().tolist() == [7, 0, 2, 2, 4, 4, 6, 6] * 2
    # RCEIL: amax = 7 -> 2**ceil(log2(7/6)) = 2 (byte 128); FLOOR: 2**(2-2) = 1 (byte 127), 7 saturates to 6
    x = np.array([7.0] + [0.0] * 15, F32).reshape(1, 1, 16)
    _, s, dec = check_vs_oracle(fmt, x)
    assert s.ravel().tolist() == [128] and dec.ravel()[0] == 8.0  # 7/2 = 3.5 -> tie -> 4 (even) -> 8
    _, s, dec = check_vs_oracle(MXFP4Format(16, "floor"), x)
    assert s.ravel().tolist() == [127] and dec.ravel()[0] == 6.0
    # all-zero group -> byte 0, zero payload
    p, s, dec = check_vs_oracle(fmt, np.zeros((1, 1, 16), F32))
    assert s.ravel().tolist() == [0] and p.ravel().tolist() == [0] * 8 and (dec == 0).all()
    # 32-groups: one byte per 32 values
    f32 = MXFP4Format(32)
    assert f32.scale_dim(128) == 4 and f32.payload_dim(128) == 64 and f32.bytes_per_element(128) == 0.53125


@pytest.mark.parametrize("gs,rule", VARIANTS)
def test_nan_inf_poison_only_their_group(gs, rule):
    fmt = MXFP4Format(gs, rule)
    x = np.random.default_rng(22).standard_normal((3, 2, 128)).astype(F32)
    x[0, 1, 5] = np.nan
    x[2, 0, 127] = -np.inf
    p, s, dec = check_vs_oracle(fmt, x)
    n = 128 // gs
    decg = dec.reshape(3, 2, n, gs)
    codes = O.unpack(p).reshape(3, 2, n, gs)
    bad = {(0, 1, 0), (2, 0, n - 1)}
    for idx in np.ndindex(3, 2, n):
        if idx in bad:
            assert s[idx] == 0xFF and np.isnan(decg[idx]).all() and (codes[idx] == 0).all()
        else:
            assert s[idx] != 0xFF and np.isfinite(decg[idx]).all()


@pytest.mark.parametrize("gs,rule", VARIANTS)
def test_round_trip_error_bound(gs, rule):
    fmt = MXFP4Format(gs, rule)
    x = O.random_kv(np.random.default_rng(23), (256, 4, 128), group=gs, log10_range=(-30, 30))
    p, s, dec = check_vs_oracle(fmt, x)
    scale = np.ldexp(1.0, s.astype(np.int32) - 127)[..., None]
    xg = x.reshape(256, 4, 128 // gs, gs).astype(np.float64)
    err = np.abs(xg - dec.reshape(xg.shape))
    a = np.abs(xg) / scale
    amax = np.abs(xg).max(-1)
    if rule == "rceil":
        assert (a <= 6).all()
        assert (err <= scale * O.halfstep_e2m1(a) * (1 + 1e-7)).all()
        assert (err.max(-1) < amax / 3).all()
    else:
        assert (a < 8).all()
        assert (err <= scale * np.maximum(O.halfstep_e2m1(np.minimum(a, 6)), a - 6) * (1 + 1e-7)).all()
        assert (err.max(-1) <= amax / 2).all()


def test_decode_arbitrary_bytes_matches_oracle():
    rng = np.random.default_rng(24)
    for gs in (16, 32):
        p = rng.integers(0, 256, (32, 4, 64), dtype=np.uint8)
        s = rng.integers(0, 256, (32, 4, 128 // gs), dtype=np.uint8)
        got = MXFP4Format(gs).decode(torch.from_numpy(p), torch.from_numpy(s)).numpy()
        O.assert_same_float(got, O.mxfp4_decode(p, s, gs))


def test_invalid_arguments():
    with pytest.raises(KvxError) as e:
        MXFP4Format(8)
    assert e.value.status == Status.UNSUPPORTED
    with pytest.raises(KvxError):
        MXFP4Format(16, "nearest")
    fmt = MXFP4Format(32)
    with pytest.raises(KvxError) as e:
        fmt.encode(torch.randn(2, 2, 48))  # not a multiple of 32
    assert e.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KvxError):
        fmt.encode(torch.randn(2, 2, 64), torch.tensor(1.0))  # MXFP4 takes no global scale
