"""Independent oracles for the KVX cache formats: numpy + ml_dtypes re-implementations of the pinned
formulas in docs/formats.md. Nothing here imports kvx_core.formats (the code under test).
"""
from __future__ import annotations

import sys

import ml_dtypes as md
import numpy as np

F32 = np.float32

# Hand-written E2M1 table: code -> value (bit 3 = sign).
E2M1_TABLE = {
    0x0: 0.0, 0x1: 0.5, 0x2: 1.0, 0x3: 1.5, 0x4: 2.0, 0x5: 3.0, 0x6: 4.0, 0x7: 6.0,
    0x8: -0.0, 0x9: -0.5, 0xA: -1.0, 0xB: -1.5, 0xC: -2.0, 0xD: -3.0, 0xE: -4.0, 0xF: -6.0,
}
E2M1_LUT = np.array([E2M1_TABLE[c] for c in range(16)], dtype=F32)


def e2m1_codes(y: np.ndarray) -> np.ndarray:
    """FP32 -> E2M1 codes via ml_dtypes (RNE), saturation made explicit by clipping to +-6."""
    y = np.clip(np.asarray(y, dtype=F32), F32(-6), F32(6))
    return y.astype(md.float4_e2m1fn).view(np.uint8) & np.uint8(0x0F)


def pack(codes: np.ndarray) -> np.ndarray:
    """Element 2i -> bits 3..0, element 2i+1 -> bits 7..4."""
    codes = codes.astype(np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack(packed: np.ndarray) -> np.ndarray:
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def _grouped(x: np.ndarray, gs: int) -> np.ndarray:
    return x.reshape(x.shape[:-1] + (x.shape[-1] // gs, gs))


def _gscale(g, heads: int) -> np.ndarray:
    g = np.asarray(1.0 if g is None else g, dtype=F32)
    return g.reshape(1, 1) if g.size == 1 else g.reshape(heads, 1)


# ----------------------------------------------------------------------------------------- NVFP4
def nvfp4_encode(x: np.ndarray, g=None) -> tuple[np.ndarray, np.ndarray]:
    """Pinned NVFP4: s = amax/(6g) (0 -> 1.0, clamp [2^-9, 448]) -> E4M3 RNE; codes = E2M1(x / (s8*g))."""
    x = np.asarray(x, dtype=F32)
    gg = _gscale(g, x.shape[-2])
    xg = _grouped(x, 16)
    finite = np.isfinite(xg).all(-1)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        amax = np.where(finite, np.abs(xg).max(-1), F32(0)).astype(F32)
        s = (amax / (F32(6) * gg).astype(F32)).astype(F32)
        s = np.where(s == 0, F32(1), s)
        s = np.clip(s, F32(2.0 ** -9), F32(448)).astype(F32)
        s8 = s.astype(md.float8_e4m3fn)
        big_s = (s8.astype(F32) * gg).astype(F32)
        y = (xg / big_s[..., None]).astype(F32)
    codes = np.where(finite[..., None], e2m1_codes(y), np.uint8(0)).astype(np.uint8)
    sbytes = np.where(finite, s8.view(np.uint8), np.uint8(0x7F)).astype(np.uint8)
    return pack(codes.reshape(x.shape)), sbytes


def nvfp4_decode(payload: np.ndarray, sbytes: np.ndarray, g=None) -> np.ndarray:
    gg = _gscale(g, payload.shape[-2])
    vals = _grouped(E2M1_LUT[unpack(payload)], 16)
    big_s = (sbytes.view(md.float8_e4m3fn).astype(F32) * gg).astype(F32)
    return (vals * big_s[..., None]).astype(F32).reshape(vals.shape[:-2] + (-1,))


def nvfp4_group_scale(sbytes: np.ndarray, g=None, heads: int | None = None) -> np.ndarray:
    gg = _gscale(g, heads if heads is not None else sbytes.shape[-2])
    return (sbytes.view(md.float8_e4m3fn).astype(F32) * gg).astype(F32)


# ----------------------------------------------------------------------------------------- MXFP4
def mx_exponent(amax: np.ndarray, rule: str) -> np.ndarray:
    """Exact scale exponent via frexp (float64, exact for every FP32 incl. subnormals), clamped to [-127, 127]."""
    amax = np.asarray(amax, dtype=F32)
    if rule == "rceil":
        d = (amax / F32(6)).astype(F32)
        m, e = np.frexp(d.astype(np.float64))  # d = m * 2**e, m in [0.5, 1)
        ex = np.where(m == 0.5, e - 1, e)  # ceil(log2(d))
        ex = np.where(d > 0, ex, -127)
    else:
        m, e = np.frexp(amax.astype(np.float64))
        ex = np.where(amax > 0, (e - 1) - 2, -127)  # floor(log2(amax)) - emax(E2M1)
    return np.clip(ex, -127, 127).astype(np.int32)


def mxfp4_encode(x: np.ndarray, gs: int, rule: str) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, dtype=F32)
    xg = _grouped(x, gs)
    finite = np.isfinite(xg).all(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        amax = np.where(finite, np.abs(xg).max(-1), F32(0)).astype(F32)
    ex = mx_exponent(amax, rule)
    sbytes = (ex + 127).astype(np.uint8)
    scale = sbytes.view(md.float8_e8m0fnu).astype(F32)  # ml_dtypes' E8M0 decode
    assert np.array_equal(scale.astype(np.float64), np.ldexp(1.0, ex))  # = 2**E exactly
    with np.errstate(invalid="ignore", over="ignore"):
        y = (xg / scale[..., None]).astype(F32)
    codes = np.where(finite[..., None], e2m1_codes(y), np.uint8(0)).astype(np.uint8)
    sbytes = np.where(finite, sbytes, np.uint8(0xFF)).astype(np.uint8)
    return pack(codes.reshape(x.shape)), sbytes


def mxfp4_decode(payload: np.ndarray, sbytes: np.ndarray, gs: int) -> np.ndarray:
    vals = _grouped(E2M1_LUT[unpack(payload)], gs)
    scale = sbytes.view(md.float8_e8m0fnu).astype(F32)
    with np.errstate(over="ignore"):  # 4 * 2**126 and up overflow FP32 (see mxfp4.py)
        return (vals * scale[..., None]).astype(F32).reshape(vals.shape[:-2] + (-1,))


# ------------------------------------------------------------------------------------ INT8 / INT4
def int_encode(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Returns (payload, scale bytes, fp16 scale, fp16 min)."""
    assert sys.byteorder == "little"
    x = np.asarray(x, dtype=F32)
    n = F32(2 ** bits - 1)
    finite = np.isfinite(x).all(-1)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        mn = x.min(-1) + F32(0)  # a zero extreme as +0
        mx = x.max(-1) + F32(0)
        s = ((mx - mn).astype(F32) / n).astype(F32)
        s_h = np.minimum(s, F32(65504)).astype(np.float16)
        m_h = np.clip(mn, F32(-65504), F32(65504)).astype(np.float16)
        s_h = np.where(finite, s_h, np.float16(np.nan))
        m_h = np.where(finite, m_h, np.float16(np.nan))
        ok = finite & (s_h > 0)
        q = np.rint(((x - m_h.astype(F32)[..., None]).astype(F32)
                     / np.where(ok, s_h, np.float16(1)).astype(F32)[..., None]).astype(F32))
    q = np.where(ok[..., None], np.clip(q, 0, n), 0).astype(np.uint8)
    payload = q if bits == 8 else pack(q)
    sbytes = np.stack([s_h, m_h], axis=-1).view(np.uint8).reshape(x.shape[:-1] + (4,))
    return payload, sbytes, s_h, m_h


def int_decode(payload: np.ndarray, sbytes: np.ndarray, bits: int) -> np.ndarray:
    q = payload if bits == 8 else unpack(payload)
    sm = sbytes.reshape(sbytes.shape[:-1] + (2, 2)).copy().view(np.float16)[..., 0].astype(F32)
    s, m = sm[..., 0], sm[..., 1]
    with np.errstate(invalid="ignore", over="ignore"):
        return ((q.astype(F32) * s[..., None]).astype(F32) + m[..., None]).astype(F32)


# ------------------------------------------------------------------------------------------ FP8
FP8 = {"fp8_e4m3": (md.float8_e4m3fn, 448.0), "fp8_e5m2": (md.float8_e5m2, 57344.0)}


def fp8_encode(x: np.ndarray, name: str, g=None) -> np.ndarray:
    """Bytes of fp8(clip(x/g, +-max)) via ml_dtypes; non-finite inputs -> 0x7F."""
    dt, mx = FP8[name]
    x = np.asarray(x, dtype=F32)
    gg = _gscale(g, x.shape[-2])
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.clip((x / gg).astype(F32), F32(-mx), F32(mx))
    b = y.astype(dt).view(np.uint8)
    return np.where(np.isfinite(x), b, np.uint8(0x7F)).astype(np.uint8)


def assert_same_float(a: np.ndarray, b: np.ndarray) -> None:
    """Bit-exact equality of float arrays, NaN == NaN."""
    a = np.asarray(a, dtype=F32)
    b = np.asarray(b, dtype=F32)
    assert a.shape == b.shape, (a.shape, b.shape)
    na, nb = np.isnan(a), np.isnan(b)
    assert np.array_equal(na, nb), f"NaN positions differ: {np.argwhere(na != nb)[:5]}"
    ok = np.where(na, True, a.view(np.uint32) == b.view(np.uint32))
    bad = np.argwhere(~ok)
    assert bad.size == 0, f"{len(bad)} mismatches, first at {bad[:3]}: {a[tuple(bad[0])]} vs {b[tuple(bad[0])]}"


def halfstep_e2m1(a: np.ndarray) -> np.ndarray:
    """Half the E2M1 grid spacing around |y| = a (a <= 6): 0.25 below 2, 0.5 in (2, 4], 1 in (4, 6]."""
    return np.where(a <= 2, 0.25, np.where(a <= 4, 0.5, 1.0))


def random_kv(rng: np.random.Generator, shape: tuple[int, ...], group: int = 16,
              log10_range: tuple[float, float] = (-3.0, 2.5)) -> np.ndarray:
    """Normal values whose magnitude varies per group of `group` (10**U(range)), plus a few outliers."""
    x = rng.standard_normal(shape).astype(F32)
    gshape = shape[:-1] + (shape[-1] // group, 1)
    mag = (10.0 ** rng.uniform(*log10_range, size=gshape)).astype(F32)
    x = (x.reshape(shape[:-1] + (shape[-1] // group, group)) * mag).reshape(shape).astype(F32)
    out = rng.random(shape) < 1e-3
    x[out] *= F32(20)
    return x
