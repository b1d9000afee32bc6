"""INT8 / INT4 (asymmetric per token-head, fp16 scale and min) vs an independent numpy oracle.

Error bound. N = 2**bits - 1, s = (max-min)/N in FP32, s_h / m_h the stored fp16 scale / min
(q is computed from s_h and m_h). Without clipping, RNE gives |x - x_hat| <= s_h / 2. Clipping at
q = N can only come from rounding: (x - m_h)/s_h <= (N s + mn - m_h)/s_h, so the overshoot is at
most N |s - s_h| + |mn - m_h|; clipping at q = 0 only when m_h > mn, by at most m_h - mn. Hence
    |x - x_hat| <= s_h / 2 + N |s - s_h| + |mn - m_h|     (+ FP32 rounding slop)
where |s - s_h| <= 2^-11 s and |mn - m_h| <= 2^-11 |mn| for values in fp16's normal range.
"""
import numpy as np
import pytest
import torch

from kvx_core.errors import KvxError, Status
from kvx_core.formats import IntFormat

from . import oracles as O

F32 = np.float32


def check_vs_oracle(bits: int, x: np.ndarray):
    fmt = IntFormat(bits)
    p, s = fmt.encode(torch.from_numpy(np.ascontiguousarray(x)))
    assert p.dtype == torch.uint8 and s.dtype == torch.uint8 and s.shape == x.shape[:-1] + (4,)
    assert p.shape[-1] == x.shape[-1] * bits // 8
    dec = fmt.decode(p, s).numpy()
    p, s = p.numpy(), s.numpy()
    op, os_, s_h, m_h = O.int_encode(x, bits)
    assert np.array_equal(s, os_), np.argwhere(s != os_)[:5]
    assert np.array_equal(p, op), np.argwhere(p != op)[:5]
    O.assert_same_float(dec, O.int_decode(op, os_, bits))
    return p, s, dec, s_h, m_h


@pytest.mark.parametrize("bits", [8, 4])
def test_random_bit_exact(bits):
    rng = np.random.default_rng(30)
    x = O.random_kv(rng, (1024, 8, 128), group=128, log10_range=(-3, 3))
    x += (rng.standard_normal((1024, 8, 1)) * 10).astype(F32)  # offsets: asymmetric rows
    check_vs_oracle(bits, x.astype(F32))


@pytest.mark.parametrize("bits", [8, 4])
def test_adversarial_bit_exact(bits):
    rng = np.random.default_rng(31)
    d = 64
    rows = [
        np.zeros(d), np.full(d, 3.25), np.full(d, -1e-3), np.full(d, 1e6),  # constant rows
        np.linspace(-1, 1, d), np.linspace(0, 2 ** bits - 1, d),  # exact grid points / ties
        np.arange(d) * 0.5 + 0.25,  # RNE ties at scale 0.5 when N divides the range
        rng.uniform(1000, 1000.01, d),  # range below fp16 resolution of the min
        rng.uniform(-1, 1, d) * 1e-8,  # scale underflows fp16 -> 0
        rng.uniform(-1, 1, d) * 1e5, rng.uniform(-1, 1, d) * 3e38,  # scale / min beyond fp16: saturate
        rng.uniform(-1, 1, d) * 1e-40,  # subnormal inputs
        np.r_[np.full(d - 1, 1.0), [1.0000001]],
    ]
    x = np.stack(rows).astype(F32).reshape(-1, 1, d)
    check_vs_oracle(bits, x)
    check_vs_oracle(bits, -x)


def test_hand_values():
    # int8 row 0..255: min 0, scale 1 -> q = x exactly; bytes = fp16(1.0)=0x3C00, fp16(0)=0x0000
    x = np.arange(256, dtype=F32).reshape(1, 1, 256)
    p, s, dec, _, _ = check_vs_oracle(8, x)
    assert s.ravel().tolist() == [0x00, 0x3C, 0x00, 0x00]
    assert p.ravel().tolist() == list(range(256)) and np.array_equal(dec, x)
    # int4 row: [-1, 2] range 3 over 15 levels -> scale fp16(0.2), min -1; packing low nibble first
    x = np.array([-1.0, 2.0] + [0.5] * 14, F32).reshape(1, 1, 16)
    p, s, dec, s_h, m_h = check_vs_oracle(4, x)
    assert s_h.item() == np.float16(0.2) and m_h.item() == -1.0
    assert p.ravel()[0] == (15 << 4) | 0  # element 0 -> q 0 (low nibble), element 1 -> q 15 (high)
    assert s.ravel().tolist() == list(np.array([np.float16(0.2), np.float16(-1.0)]).view(np.uint8))
    # constant row: scale 0, q 0, decode = fp16(min)
    x = np.full((1, 1, 16), 0.1, F32)
    p, s, dec, s_h, _ = check_vs_oracle(4, x)
    assert s_h.item() == 0 and (p == 0).all() and (dec == F32(np.float16(0.1))).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_nan_inf_poison_only_their_row(bits):
    x = np.random.default_rng(32).standard_normal((3, 2, 32)).astype(F32)
    x[0, 1, 7] = np.nan
    x[2, 0, 0] = np.inf
    p, s, dec, _, _ = check_vs_oracle(bits, x)
    for t, h in np.ndindex(3, 2):
        if (t, h) in ((0, 1), (2, 0)):
            assert s[t, h].tolist() == [0x00, 0x7E, 0x00, 0x7E] and (p[t, h] == 0).all()
            assert np.isnan(dec[t, h]).all()
        else:
            assert np.isfinite(dec[t, h]).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_error_bound(bits):
    rng = np.random.default_rng(33)
    x = O.random_kv(rng, (512, 4, 128), group=128, log10_range=(-4, 4))
    x += (rng.standard_normal((512, 4, 1)) * 10 ** rng.uniform(-4, 4, (512, 4, 1))).astype(F32)
    x = x.astype(F32)
    _, _, dec, s_h, m_h = check_vs_oracle(bits, x)
    n = 2 ** bits - 1
    mn = x.min(-1).astype(np.float64)
    s = ((x.max(-1) - x.min(-1)) / F32(n)).astype(np.float64)
    sh, mh = s_h.astype(np.float64), m_h.astype(np.float64)
    bound = sh / 2 + n * np.abs(s - sh) + np.abs(mn - mh)
    err = np.abs(x.astype(np.float64) - dec).max(-1)
    slack = 2.0 ** -22 * (np.abs(x).max(-1) + np.abs(mh)) + 1e-30
    assert (err <= bound + slack).all()
    # and the rounding terms are what the docstring says, inside fp16's range (outside it they saturate)
    fits = (np.abs(mn) <= 65504) & (s <= 65504)
    assert 0.9 < fits.mean() < 1  # both regimes are exercised
    assert (np.abs(s - sh) <= 2.0 ** -11 * s + 2.0 ** -25)[fits].all()
    assert (np.abs(mn - mh) <= 2.0 ** -11 * np.abs(mn) + 2.0 ** -25)[fits].all()


def test_decode_arbitrary_bytes_matches_oracle():
    rng = np.random.default_rng(34)
    for bits in (8, 4):
        p = rng.integers(0, 256, (16, 4, 64 * bits // 8), dtype=np.uint8)
        s = rng.integers(0, 256, (16, 4, 4), dtype=np.uint8)
        got = IntFormat(bits).decode(torch.from_numpy(p), torch.from_numpy(s)).numpy()
        O.assert_same_float(got, O.int_decode(p, s, bits))


def test_geometry_and_errors():
    assert IntFormat(8).bytes_per_token_head(128) == 132 and IntFormat(4).bytes_per_token_head(128) == 68
    assert IntFormat(4).scale_dim(64) == 4 and IntFormat(4).payload_dim(64) == 32
    with pytest.raises(KvxError) as e:
        IntFormat(2)
    assert e.value.status == Status.UNSUPPORTED
    with pytest.raises(KvxError):
        IntFormat(4).encode(torch.randn(2, 2, 7))  # odd head_dim cannot be packed
    with pytest.raises(KvxError):
        IntFormat(8).encode(torch.randn(2, 2, 8), torch.tensor(1.0))  # no global scale
