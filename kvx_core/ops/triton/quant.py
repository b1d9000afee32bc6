"""`@triton.jit` encode/decode helpers that reproduce `kvx_core.formats` bit for bit.

Everything is integer bit manipulation or IEEE round-to-nearest FP32 arithmetic (`div_ieee`; kernels
using these launch with `enable_fp_fusion=False` so no mul+add becomes an FMA), so the GPU and the
CPU interpreter give the bytes the torch encoders give:
- `div_ieee`: correctly rounded FP32 division that keeps subnormal operands and quotients, whatever the
  Triton version (see its docstring).
- `f32_to_f8_bits`: software RNE of FP32 to E4M3/E5M2 (sign copied, as torch's float8 casts do),
  so the result never depends on which cvt instruction (or double rounding via fp16) a backend uses.
- `e2m1_code`: the same threshold ladder as `formats.codes.e2m1_encode` (RNE, saturating).
- `floor_log2` / `ceil_log2`: exact from the FP32 bits, subnormals included.
"""
from __future__ import annotations

import triton
import triton.language as tl

RINT_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (v + M) - M is RNE to an integer for |v| < 2**22


@triton.jit
def rint(v):
    """Round half to even (exact for |v| < 2**22; larger magnitudes stay large, callers clamp)."""
    return (v + RINT_MAGIC) - RINT_MAGIC


@triton.jit
def div_ieee(x, y, ASM: tl.constexpr):
    """x / y in FP32, correctly rounded, subnormal operands and quotients kept (IEEE 754, as torch divides).

    `tl.math.div_rn` is not that on every Triton: before 3.6 (3.5.1 checked) it lowers to libdevice's
    `__nv_fdiv_rn`, which Triton links with `nvvm-reflect-ftz` set, i.e. PTX `div.rn.ftz.f32` (a subnormal operand
    or quotient becomes 0); 3.6 emits `div.rn.f32` itself (triton-lang/triton#8557). The kernels run under whatever
    Triton the serving engine brings, so on CUDA (ASM) they state the PTX instruction; the CPU interpreter, which
    runs no inline asm, uses `div_rn` (numpy's IEEE division)."""
    if ASM:
        return tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.math.div_rn(x, y)


@triton.jit
def f32_to_f8_bits(y, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """Finite FP32 (|y| <= the target's max finite) -> FP8 bits (int32, low byte), RNE, sign copied."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    e = a >> 23
    m = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    e = tl.maximum(e, 1)
    # quantum = 2**(e_target - MBITS); target subnormal below 2**(1 - BIAS)
    shift = (23 - MBITS) + tl.maximum(128 - BIAS - e, 0)
    shift = tl.minimum(shift, 30)
    q = m >> shift
    rem = m & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    q += tl.where(e >= 128 - BIAS, (e - 128 + BIAS) << MBITS, 0)
    return q | sign


@triton.jit
def e2m1_code(y):
    """FP32 -> E2M1 code 0..15 (int32): RNE, saturating at +-6, sign bit copied, NaN -> 0."""
    a = tl.abs(y)
    mag = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) \
        + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    sign = (y.to(tl.int32, bitcast=True) >> 28) & 0x8
    return tl.where(y == y, mag | sign, 0)


@triton.jit
def floor_log2(v):
    """Exact floor(log2(v)) (int32) of positive finite FP32 values, subnormals included."""
    bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    e = bits >> 23
    mant = bits & 0x7FFFFF
    sub = (mant.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127 - 149
    return tl.where(e == 0, sub, e - 127)


@triton.jit
def ceil_log2(v):
    """Exact ceil(log2(v)) (int32) of positive finite FP32 values, subnormals included."""
    bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    e = bits >> 23
    mant = bits & 0x7FFFFF
    pow2 = tl.where(e == 0, (mant & (mant - 1)) == 0, mant == 0)
    fl = floor_log2(v)
    return tl.where(pow2, fl, fl + 1)


@triton.jit
def is_finite(x):
    """Elementwise |x| < inf (False for NaN and +-inf)."""
    return tl.abs(x) < float("inf")


@triton.jit
def e2m1_value(code):
    """E2M1 code (low 4 bits of an int) -> FP32 value, exact (-0.0 for code 8)."""
    c = code.to(tl.uint16)
    bits = ((c & 0x8) << 12) | ((c & 0x7) << 9)  # fp16 bits of value * 2**-14
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def f8_byte_f32(b, E5: tl.constexpr):
    """FP8 byte (E4M3 or E5M2) -> FP32, exact (NaN / inf bytes decode to NaN / inf)."""
    if E5:
        return (b.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return e4m3_f32(b)


@triton.jit
def e4m3_f32(b):
    """E4M3 byte -> FP32 from the bits (0x7F / 0xFF -> NaN; the CPU interpreter's fp8 cast reads 240). The sign is
    set as a bit: Triton's unary minus is `0 - x`, which would decode 0x80 as +0.0 where torch gives -0.0."""
    x = b.to(tl.int32)
    e = (x >> 3) & 0xF
    m = x & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    mag = tl.where((x & 0x7F) == 0x7F, float("nan"), mag)
    return (mag.to(tl.int32, bitcast=True) | ((x & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def f16_bytes_f32(SC, row, byte_off: tl.constexpr, mask):
    """Little-endian fp16 at bytes [byte_off, byte_off + 2) of each scale row -> FP32."""
    b0 = tl.load(SC + row + byte_off, mask=mask, other=0).to(tl.uint16)
    b1 = tl.load(SC + row + (byte_off + 1), mask=mask, other=0).to(tl.uint16)
    return (b0 | (b1 << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def to_f32(x):
    """bf16 / fp16 / fp32 -> FP32 exactly (bf16 widened through its bits: the CPU interpreter's own
    bf16 conversion is not exact)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def f32_to_bf16(x):
    """FP32 -> bf16 with round-to-nearest-even in software (NaN -> quiet NaN, sign kept), so the CPU
    interpreter (whose bf16 rounding is not RNE) and the GPU agree with torch."""
    bits = x.to(tl.uint32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    r = tl.where(x == x, r, (bits >> 16) | 0x40)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def cast_exact(x, DT: tl.constexpr):
    """x -> DT (bf16 / fp16 / fp32) as torch's `.to` does: one RNE rounding from the exact value."""
    if x.dtype == DT:
        return x
    elif DT == tl.bfloat16:
        return f32_to_bf16(to_f32(x))
    else:
        return to_f32(x).to(DT)
