"""FP8 (E4M3 / E5M2) vs torch's float8 casts and ml_dtypes with explicit saturation; identity formats.

Error bound: y = x / g; RNE to FP8 with m mantissa bits (3 for E4M3, 2 for E5M2) gives
|y - fp8(y)| <= max(2^-(m+1) |y|, half the smallest subnormal) for |y| <= MAX (2^-10 for E4M3,
2^-17 for E5M2), plus |y| - MAX when saturated; the decoded error is g times that.
"""
import numpy as np
import pytest
import torch

from kvx_core.errors import KvxError, Status
from kvx_core.formats import FP8Format, IdentityFormat

from . import oracles as O

F32 = np.float32
SPEC = {  # name: (torch dtype, max finite, mantissa bits, half the smallest subnormal)
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0, 3, 2.0 ** -10),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0, 2, 2.0 ** -17),
}


def _data(rng):
    x = O.random_kv(rng, (512, 8, 128), log10_range=(-8, 6))
    specials = np.array([0.0, -0.0, 448, 449, 464, 465, 480, 57344, 61439, 61440, 1e6, 3e38, 2.0 ** -9,
                         2.0 ** -10, 2.0 ** -16, 2.0 ** -17, 1e-45, 0.0625 + 2.0 ** -8], F32)
    x[0, 0, : specials.size] = specials
    x[0, 1, : specials.size] = -specials
    return x


@pytest.mark.parametrize("name", list(SPEC))
@pytest.mark.parametrize("g", [None, "scalar", "per_head"])
def test_fp8_vs_torch_cast_and_ml_dtypes(name, g):
    rng = np.random.default_rng(40)
    x = _data(rng)
    gv = {None: None, "scalar": F32(0.0123), "per_head": (10.0 ** rng.uniform(-2, 2, 8)).astype(F32)}[g]
    fmt = FP8Format(name)
    gt = None if gv is None else torch.from_numpy(np.asarray(gv))
    p, s = fmt.encode(torch.from_numpy(x), gt)
    tdt, mx, _, _ = SPEC[name]
    assert p.dtype == tdt and s.shape == x.shape[:-1] + (0,) and s.dtype == torch.uint8
    # oracle 1: torch's own cast with the saturation made explicit
    gg = torch.ones(1, 1) if gv is None else torch.from_numpy(np.asarray(gv, F32)).reshape(-1, 1)
    ref = (torch.from_numpy(x) / gg).clamp(-mx, mx).to(tdt)
    assert torch.equal(p.view(torch.uint8), ref.view(torch.uint8))
    # oracle 2: ml_dtypes
    assert np.array_equal(p.view(torch.uint8).numpy(), O.fp8_encode(x, name, gv))
    dec = fmt.decode(p, s, gt)
    assert torch.equal(dec, p.to(torch.float32) * gg)


@pytest.mark.parametrize("name", list(SPEC))
def test_fp8_saturation_nan_inf_hand(name):
    fmt = FP8Format(name)
    tdt, mx, _, _ = SPEC[name]
    x = torch.tensor([[[1e9, -1e9, float("inf"), float("-inf"), float("nan"), 1.0]]])
    p, s = fmt.encode(x)
    b = p.view(torch.uint8).ravel().tolist()
    assert b[2:5] == [0x7F, 0x7F, 0x7F]  # non-finite -> NaN byte
    dec = fmt.decode(p, s).ravel()
    assert dec[:2].tolist() == [mx, -mx] and torch.isnan(dec[2:5]).all() and dec[5] == 1.0
    # a finite value that overflows only after dividing by a small scale also saturates
    p, _ = fmt.encode(torch.tensor([[[1.0, -1.0]]]), torch.tensor(1e-30))
    assert p.to(torch.float32).ravel().tolist() == [mx, -mx]


@pytest.mark.parametrize("name", list(SPEC))
def test_fp8_round_trip_error_bound(name):
    x = _data(np.random.default_rng(41))
    _, mx, m, sub = SPEC[name]
    g = F32(0.05)
    fmt = FP8Format(name)
    p, s = fmt.encode(torch.from_numpy(x), torch.tensor(g))
    dec = fmt.decode(p, s, torch.tensor(g)).numpy().astype(np.float64)
    y = np.abs(x.astype(np.float64)) / np.float64(g)
    bound = g * (np.maximum(2.0 ** -(m + 1) * np.minimum(y, mx), sub) + np.maximum(y - mx, 0))
    err = np.abs(x - dec)
    assert (err <= bound * (1 + 1e-6) + 1e-40).all()


@pytest.mark.parametrize("name,tdt", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
def test_identity_formats(name, tdt):
    fmt = IdentityFormat(name)
    x = torch.randn(4, 2, 64, dtype=torch.float32)
    x[0, 0, 0] = float("nan")
    p, s = fmt.encode(x)
    assert p.dtype == tdt and s.shape == (4, 2, 0) and torch.equal(p.view(torch.uint8), x.to(tdt).view(torch.uint8))
    assert torch.equal(fmt.decode(p, s, out_dtype=tdt).view(torch.uint8), p.view(torch.uint8))
    assert fmt.bytes_per_element(64) == (4.0 if name == "fp32" else 2.0)
    with pytest.raises(KvxError) as e:
        fmt.encode(x, torch.tensor(1.0))
    assert e.value.status == Status.INVALID_ARGUMENT


def test_fp8_scale_validation():
    fmt = FP8Format("fp8_e4m3")
    for bad in (0.0, -2.0, float("nan"), torch.ones(3)):
        with pytest.raises(KvxError):
            fmt.encode(torch.randn(2, 2, 8), bad)
    assert fmt.bytes_per_element(128) == 1.0
    with pytest.raises(KvxError) as e:
        FP8Format("fp8_e3m4")
    assert e.value.status == Status.UNSUPPORTED
