"""`@triton.jit` helpers that decode each KVX cache format in registers (and the format codes as constexprs).

Decoding is split into an exactly-representable *payload value* that goes into the tensor-core dot
and a factor applied after the dot where the algebra allows it (per token, per head), so the hot
loop does a few integer ops per element and no int->float conversion instructions:
- E2M1 nibble -> fp16 bits `sign<<15 | code<<9` is exactly e2m1 * 2**-14 (the subnormal code too);
  the 2**14 goes into the per-head factor.
- uint8/uint4 code c -> fp16 bits `0x6400 | c` is exactly 1024 + c; subtracting 1024 is exact.
- NVFP4: (e2m1 * 2**-14) * fp16(E4M3 scale) is exact in fp16 (at most 6 significant bits, smallest
  product 2**-24 = the smallest fp16 subnormal); g * 2**14 is applied after the dot.
- MXFP4: e2m1 * 2**(b-127) is exact in bf16 (2 significant bits) for every realistic exponent.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..kernel_format import FormatCode

# Format codes as tl.constexpr values, from `kvx_core/ops/kernel_format.py` (meanings there).
F_PLAIN = tl.constexpr(int(FormatCode.PLAIN))
F_FP8 = tl.constexpr(int(FormatCode.FP8))
F_INT8 = tl.constexpr(int(FormatCode.INT8))
F_INT4 = tl.constexpr(int(FormatCode.INT4))
F_MXFP4 = tl.constexpr(int(FormatCode.MXFP4))
F_NVFP4 = tl.constexpr(int(FormatCode.NVFP4))

TWO_POW_14 = tl.constexpr(16384.0)


@triton.jit
def e2m1_lo_f16(b):
    """uint8 bytes -> fp16 e2m1(low nibble) * 2**-14 (exact)."""
    x = b.to(tl.uint16)
    bits = ((x & 0x8) << 12) | ((x & 0x7) << 9)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def e2m1_hi_f16(b):
    """uint8 bytes -> fp16 e2m1(high nibble) * 2**-14 (exact)."""
    x = b.to(tl.uint16)
    bits = ((x & 0x80) << 8) | ((x & 0x70) << 5)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def u8_code_f16(b):
    """uint8 code c (0..255) -> fp16 c, exact, via the 1024 + c bit trick (no I2F instruction)."""
    x = b.to(tl.uint16) | 0x6400
    return x.to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def u4_lo_f16(b):
    """Low nibble (0..15) -> fp16, exact."""
    x = (b.to(tl.uint16) & 0xF) | 0x6400
    return x.to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def u4_hi_f16(b):
    """High nibble (0..15) -> fp16, exact."""
    x = (b.to(tl.uint16) >> 4) | 0x6400
    return x.to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def e4m3_byte_f16(b):
    """E4M3 scale byte -> fp16 (exact; 0x7F/0xFF -> NaN)."""
    return b.to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def e8m0_f32_x2p14(b):
    """E8M0 byte -> fp32 2**(b-127) * 2**14 (undoes the fp16 E2M1 trick); 255 -> NaN.

    Exact for b <= 240 (scales up to 2**113); larger exponents are outside any KV cache's range.
    """
    x = b.to(tl.int32)
    bits = (x + 14) << 23
    v = bits.to(tl.float32, bitcast=True)
    return tl.where(x == 255, float("nan"), v)


@triton.jit
def e8m0_f32(b):
    """E8M0 byte -> fp32 2**(b-127) exactly (b=0: subnormal 2**-127; 255: NaN)."""
    x = b.to(tl.int32)
    bits = tl.where(x == 0, 0x00400000, x << 23)
    v = bits.to(tl.float32, bitcast=True)
    return tl.where(x == 255, float("nan"), v)


# ---- packed decoders: 4 payload bytes per PTX block, two fp16 results per 32-bit register --------
# `ASM` False selects the portable form (same bits; the CPU interpreter cannot run PTX). The byte
# permute [b0,b2,b1,b3] puts elements (0,1) into the two 16-bit lanes at bits 0/16 and (2,3) at 8/24,
# so each fp16x2 result costs two shifts and one lop3 ((x | y) & mask, immLut 0xA8).
E2M1_PTX_LO = tl.constexpr("""{
.reg .b32 t, x, y;
prmt.b32 t, $2, 0, 0x3120;
and.b32 t, t, 0x0F0F0F0F;
shl.b32 x, t, 9;
shl.b32 y, t, 12;
lop3.b32 $0, x, y, 0x8E008E00, 0xA8;
shl.b32 x, t, 1;
shl.b32 y, t, 4;
lop3.b32 $1, x, y, 0x8E008E00, 0xA8;
}""")
E2M1_PTX_HI = tl.constexpr("""{
.reg .b32 t, x, y;
prmt.b32 t, $2, 0, 0x3120;
and.b32 t, t, 0xF0F0F0F0;
shl.b32 x, t, 5;
shl.b32 y, t, 8;
lop3.b32 $0, x, y, 0x8E008E00, 0xA8;
shr.b32 x, t, 3;
lop3.b32 $1, x, t, 0x8E008E00, 0xA8;
}""")
U4_PTX_LO = tl.constexpr("""{
.reg .b32 t, x;
prmt.b32 t, $2, 0, 0x3120;
and.b32 $0, t, 0x000F000F;
shr.b32 x, t, 8;
and.b32 $1, x, 0x000F000F;
}""")
U4_PTX_HI = tl.constexpr("""{
.reg .b32 t, x;
prmt.b32 t, $2, 0, 0x3120;
shr.b32 x, t, 4;
and.b32 $0, x, 0x000F000F;
shr.b32 x, t, 12;
and.b32 $1, x, 0x000F000F;
}""")
U8_PTX = tl.constexpr("""prmt.b32 $0, $2, 0, 0x4140;
prmt.b32 $1, $2, 0, 0x4342;""")
TWO_POW_24 = tl.constexpr(16777216.0)
# E2M1 -> bf16 bits `sign<<15 | code<<6`, exactly e2m1 * 2**-126 (code 1 is the bf16 subnormal 2**-127). The same
# byte permute; the two lanes' magnitude (bits 6-8) and sign (bit 15) fields are masked separately (lop3 0xEC:
# (x & c) | y), since bf16's narrower mantissa makes the shifted neighbours overlap them.
E2M1_BF16_PTX_LO = tl.constexpr("""{
.reg .b32 t, x, y;
prmt.b32 t, $2, 0, 0x3120;
shl.b32 x, t, 6;
shl.b32 y, t, 12;
and.b32 y, y, 0x80008000;
lop3.b32 $0, x, y, 0x01C001C0, 0xEC;
shr.b32 x, t, 2;
shl.b32 y, t, 4;
and.b32 y, y, 0x80008000;
lop3.b32 $1, x, y, 0x01C001C0, 0xEC;
}""")
E2M1_BF16_PTX_HI = tl.constexpr("""{
.reg .b32 t, x, y;
prmt.b32 t, $2, 0, 0x3120;
shl.b32 x, t, 2;
shl.b32 y, t, 8;
and.b32 y, y, 0x80008000;
lop3.b32 $0, x, y, 0x01C001C0, 0xEC;
shr.b32 x, t, 6;
and.b32 y, t, 0x80008000;
lop3.b32 $1, x, y, 0x01C001C0, 0xEC;
}""")


@triton.jit
def _f16x4(b, asm: tl.constexpr):
    return tl.inline_asm_elementwise(asm, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _bf16x4(b, asm: tl.constexpr):
    return tl.inline_asm_elementwise(asm, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def e2m1_lo_f16_x4(b, ASM: tl.constexpr):
    """`e2m1_lo_f16` (e2m1 * 2**-14 of the low nibble), ~2 integer ops per element with ASM."""
    if ASM:
        return _f16x4(b, E2M1_PTX_LO)
    else:
        return e2m1_lo_f16(b)


@triton.jit
def e2m1_hi_f16_x4(b, ASM: tl.constexpr):
    """`e2m1_hi_f16` (e2m1 * 2**-14 of the high nibble), ~2 integer ops per element with ASM."""
    if ASM:
        return _f16x4(b, E2M1_PTX_HI)
    else:
        return e2m1_hi_f16(b)


@triton.jit
def e2m1_lo_bf16_x4(b, ASM: tl.constexpr):
    """uint8 bytes -> bf16 e2m1(low nibble) * 2**-126 (exact), ~2.25 integer ops per element with ASM."""
    if ASM:
        return _bf16x4(b, E2M1_BF16_PTX_LO)
    else:
        x = b.to(tl.uint16)
        return (((x & 0x8) << 12) | ((x & 0x7) << 6)).to(tl.bfloat16, bitcast=True)


@triton.jit
def e2m1_hi_bf16_x4(b, ASM: tl.constexpr):
    """uint8 bytes -> bf16 e2m1(high nibble) * 2**-126 (exact)."""
    if ASM:
        return _bf16x4(b, E2M1_BF16_PTX_HI)
    else:
        x = b.to(tl.uint16)
        return (((x & 0x80) << 8) | ((x & 0x70) << 2)).to(tl.bfloat16, bitcast=True)


@triton.jit
def e8m0_bf16_x2p126(b):
    """E8M0 byte b <= 128 -> bf16 2**(b-127) * 2**126 = 2**(b-1) (undoes the bf16 E2M1 trick; exact)."""
    return ((b.to(tl.uint16) + 126) << 7).to(tl.bfloat16, bitcast=True)


@triton.jit
def mul_bf16(a, b, ASM: tl.constexpr):
    """a * b for bf16 tensors in one `mul.rn.bf16x2` per two elements (subnormal operands kept); exact products here."""
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        fa = (a.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        fb = (b.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        return (fa * fb).to(tl.bfloat16)


@triton.jit
def u4_lo_f16_sub(b, ASM: tl.constexpr):
    """Low nibble n -> fp16 n * 2**-24 (the fp16 whose bits are n: exact subnormal; scale by 2**24 later)."""
    if ASM:
        return _f16x4(b, U4_PTX_LO)
    else:
        return (b & 0xF).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def u4_hi_f16_sub(b, ASM: tl.constexpr):
    """High nibble n -> fp16 n * 2**-24 (exact subnormal)."""
    if ASM:
        return _f16x4(b, U4_PTX_HI)
    else:
        return (b >> 4).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def u8_f16_sub(b, ASM: tl.constexpr):
    """uint8 code c -> fp16 c * 2**-24 (exact subnormal): one byte permute per two elements with ASM."""
    if ASM:
        return _f16x4(b, U8_PTX)
    else:
        return b.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def lse_or_empty(l, lse):
    """`lse` where the softmax denominator `l` is positive; -inf for an empty row (l == 0); NaN when the
    scores were NaN (l is NaN), as the reference attention gives."""
    return tl.where(l > 0, lse, tl.where(l == 0, float("-inf"), float("nan")))


@triton.jit
def join_sink(lse, sink):
    """(lse', w): the attention sink `sink` (natural log, `ops.attention`) joined into a finished row's natural-log
    `lse` as one more denominator term with no value: lse' = log(exp(lse) + exp(sink)), and w = exp(lse - lse')
    rescales the row's output. In the natural-log domain, as `ops.attention.apply_sinks` (times log2(e) a sink
    near FP32's max would overflow). An empty row (lse -inf) gives the sink and w = 0; NaN stays NaN."""
    total = tl.maximum(lse, sink) + tl.log(1.0 + tl.exp(-tl.abs(lse - sink)))
    return total, tl.exp(lse - total)
