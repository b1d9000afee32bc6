"""Bit-level codecs shared by the formats: E2M1 codes, nibble packing, E4M3 and E8M0 scale bytes.

E2M1 (pinned): codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 = sign; round-to-nearest-even,
saturating at +-6. The sign bit is copied from the input's sign bit, so -0.0 and negative values
that round to zero encode as 0x8 ("-0"), as `ml_dtypes.float4_e2m1fn` and the hardware cvt do
(ModelOpt's `_cast_fp4` uses `x < 0` and gives 0x0 for an exact -0.0 input; both decode to zero).
Packing: element 2i in bits 3..0, element 2i+1 in bits 7..4 of byte i.
"""
from __future__ import annotations

import torch
from torch import Tensor

#: E2M1 value of each 4-bit code (code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0 ** -9
E4M3_NAN_BYTE = 0x7F
E8M0_BIAS = 127
E8M0_NAN_BYTE = 0xFF

# Decision thresholds between consecutive E2M1 magnitudes, and whether a tie goes up (to the even
# code above) or down (to the even code below).
_E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def div_exact(x: Tensor, d: float) -> Tensor:
    """`x / d` rounded as IEEE division on every device. PyTorch's CUDA kernels divide a tensor by a Python number as
    a multiplication by its reciprocal (not correctly rounded: `(mx - mn) / 255` or `amax / 6` can differ in the
    last bit from the pinned formulas and the kernels' `div_ieee`), so the divisor is a tensor on `x`'s device."""
    return x / torch.full((), d, dtype=x.dtype, device=x.device)


def e2m1_encode(y: Tensor) -> Tensor:
    """FP32 values -> uint8 E2M1 codes (RNE, saturating, sign bit copied; NaN -> 0, callers mask it)."""
    y = y.to(torch.float32)
    a = y.abs()
    mag = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for bound, tie_up in _E2M1_BOUNDS:
        mag += (a >= bound) if tie_up else (a > bound)
    sign = torch.signbit(y).to(torch.uint8) << 3
    code = mag | sign
    return torch.where(torch.isnan(y), torch.zeros_like(code), code)


def e2m1_decode(codes: Tensor) -> Tensor:
    """uint8 E2M1 codes (low 4 bits) -> FP32 values."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return lut[(codes & 0x0F).long()]


def pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 codes `[..., 2n]` (values 0..15) -> bytes `[..., n]`: element 2i low nibble, 2i+1 high nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Bytes `[..., n]` -> uint8 codes `[..., 2n]` (inverse of `pack_nibbles`)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def fp4_encode_groups(xg: Tensor, group_scale: Tensor, finite: Tensor) -> Tensor:
    """Groups `xg [..., G, g]` divided by their scale `[..., G, 1]` -> packed E2M1 payload `[..., G*g/2]`;
    the codes of non-finite groups are stored as 0 (their scale byte carries the NaN)."""
    codes = e2m1_encode(xg / group_scale)
    codes = torch.where(finite.unsqueeze(-1), codes, torch.zeros_like(codes))
    return pack_nibbles(codes.flatten(-2))


def fp4_decode_groups(payload: Tensor, group_size: int, group_scale: Tensor) -> Tensor:
    """Packed E2M1 payload `[..., D/2]` times its per-group scale `[..., D/group_size]` -> FP32 `[..., D]`."""
    vals = e2m1_decode(unpack_nibbles(payload))
    vals = vals.unflatten(-1, (-1, group_size)) * group_scale.unsqueeze(-1)
    return vals.flatten(-2)


def e4m3_to_byte(v: Tensor) -> Tensor:
    """FP32 -> E4M3 (`float8_e4m3fn`) bytes, round-to-nearest-even. Callers clamp to [-448, 448] first."""
    return v.to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_from_byte(b: Tensor) -> Tensor:
    """E4M3 bytes -> FP32 (0x7F / 0xFF decode to NaN)."""
    return b.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def e8m0_from_byte(b: Tensor) -> Tensor:
    """UE8M0 bytes -> FP32 exactly: 2**(b-127) for b in 0..254 (b=0 is the FP32 subnormal 2**-127), NaN for 255."""
    b32 = b.to(torch.int32)
    bits = torch.where(b32 == 0, torch.full_like(b32, 0x00400000), b32 << 23)
    val = bits.view(torch.float32)
    return torch.where(b32 == E8M0_NAN_BYTE, torch.full_like(val, float("nan")), val)


def e8m0_to_byte(e: Tensor) -> Tensor:
    """Integer exponents e in [-127, 127] -> UE8M0 bytes (e + 127)."""
    return (e + E8M0_BIAS).to(torch.uint8)


def floor_log2(v: Tensor) -> Tensor:
    """Exact floor(log2(v)) of positive finite FP32 values (subnormals included) as int32."""
    bits = v.to(torch.float32).view(torch.int32) & 0x7FFFFFFF
    exp = bits >> 23
    mant = bits & 0x007FFFFF
    # Subnormal: value = mant * 2**-149, floor(log2) = (bit length of mant) - 1 - 149.
    mant_f = mant.to(torch.float32)  # exact: mant < 2**23
    sub_exp = (mant_f.view(torch.int32) >> 23) - 127 - 149
    return torch.where(exp == 0, sub_exp, exp - 127)


def ceil_log2(v: Tensor) -> Tensor:
    """Exact ceil(log2(v)) of positive finite FP32 values (subnormals included) as int32."""
    fl = floor_log2(v)
    bits = v.to(torch.float32).view(torch.int32) & 0x7FFFFFFF
    exp = bits >> 23
    mant = bits & 0x007FFFFF
    # v is an exact power of two iff (normal and mantissa == 0) or (subnormal and one mantissa bit set).
    pow2 = torch.where(exp == 0, (mant & (mant - 1)) == 0, mant == 0)
    return torch.where(pow2, fl, fl + 1)
