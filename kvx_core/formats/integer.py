"""INT8 / INT4 cache formats: asymmetric quantization per (token, KV head) over the whole head_dim.

With N = 2**bits - 1 and FP32 arithmetic (x computed in FP32; finite FP64 inputs beyond the FP32 range
enter as +-FP32 max, so they saturate like any row whose range overflows FP16):
  mn, mx = min(x), max(x) over head_dim, each + 0.0 (a zero as +0: not the reduction order's sign)
  scale  = f16(clamp((mx - mn) / N, max=65504))        (RNE; saturates instead of overflowing to inf)
  min    = f16(clamp(mn, -65504, 65504))
  q      = clamp(round_half_even((x - f32(min)) / f32(scale)), 0, N)   (q = 0 when scale == 0)
  decode = f32(q) * f32(scale) + f32(min)               (two FP32 roundings, no FMA)
q is computed from the FP16-ROUNDED scale and min, so decode(encode(x)) uses exactly the numbers
the encoder used. Constant rows (max == min, or a range below the FP16 scale's resolution) store
scale 0, q = 0 and decode to f16(min).
Scale pool: 4 bytes per (token, KV head) = fp16 scale then fp16 min, each little-endian.
Payload: INT8 -> uint8 q; INT4 -> two unsigned codes per byte, element 2i in bits 3..0.
NaN/inf: a row containing a non-finite value stores scale = min = fp16 NaN (0x7E00) and q = 0, and
decodes to NaN for the whole row.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..enums import DType, QuantFormat, ScaleGranularity
from ..errors import KvxError, Status
from .base import GROUP_HEAD_DIM, TensorFormat, is_int
from .codes import div_exact, pack_nibbles, unpack_nibbles
from .kernel_facts import CudaCode, EncoderCode, FormatCode, KernelFormat

F16_MAX = 65504.0
F16_NAN_BITS = 0x7E00


def _f16_to_bytes(v: Tensor) -> Tensor:
    """fp16 tensor `[...]` -> uint8 `[..., 2]` little-endian."""
    bits = v.view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack((bits & 0xFF, bits >> 8), dim=-1).to(torch.uint8)


def _f16_from_bytes(b: Tensor) -> Tensor:
    """uint8 `[..., 2]` little-endian -> fp32 values of those fp16 bit patterns."""
    u = b[..., 0].to(torch.int32) | (b[..., 1].to(torch.int32) << 8)
    s16 = torch.where(u >= 0x8000, u - 0x10000, u).to(torch.int16)
    return s16.view(torch.float16).to(torch.float32)


class IntFormat(TensorFormat):
    """Asymmetric uint8/uint4 with an fp16 (scale, min) pair per (token, KV head)."""

    scale_dtype = DType.U8
    group_size = GROUP_HEAD_DIM
    scale_bytes_per_group = 4
    uses_global_scale = False
    scale_granularity = ScaleGranularity.PER_TOKEN_HEAD

    def __init__(self, bits: int = 8) -> None:
        if not is_int(bits) or bits not in (4, 8):
            raise KvxError(Status.UNSUPPORTED, f"integer KV format with {bits} bits: only 4 and 8 are defined")
        self.bits = bits
        self.payload_bits = bits
        self.levels = (1 << bits) - 1
        self.name = f"int{bits}"
        self.quant = QuantFormat.INT8 if bits == 8 else QuantFormat.INT4
        self.data_dtype = DType.U8 if bits == 8 else DType.INT4X2

    def kernel_facts(self) -> KernelFormat:
        if self.bits == 8:
            return KernelFormat(FormatCode.INT8, 0, torch.uint8, False, True, False, cuda_code=CudaCode.INT8,
                                encoder=EncoderCode.INT8)
        return KernelFormat(FormatCode.INT4, 0, torch.uint8, False, True, True, cuda_code=CudaCode.INT4,
                            encoder=EncoderCode.INT4)

    def encode(self, x: Tensor, global_scale: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
        xf = self._check_input(x)
        self._global_scale(global_scale, int(x.shape[-2]), x.device)
        finite = torch.isfinite(xf).all(dim=-1)
        # + 0.0: a zero extreme as +0 (which signed zero amin / amax return depends on the reduction order)
        mn = xf.amin(dim=-1) + 0.0
        mx = xf.amax(dim=-1) + 0.0
        scale_h = div_exact(mx - mn, self.levels).clamp(max=F16_MAX).to(torch.float16)
        min_h = mn.clamp(-F16_MAX, F16_MAX).to(torch.float16)
        nan_h = torch.full_like(scale_h, float("nan"))
        scale_h = torch.where(finite, scale_h, nan_h)
        min_h = torch.where(finite, min_h, nan_h)
        s = scale_h.to(torch.float32).unsqueeze(-1)
        m = min_h.to(torch.float32).unsqueeze(-1)
        usable = (finite & (scale_h > 0)).unsqueeze(-1)
        safe_s = torch.where(usable, s, torch.ones_like(s))
        q = torch.round((xf - m) / safe_s).clamp(0, self.levels)
        q = torch.where(usable, q, torch.zeros_like(q)).to(torch.uint8)
        payload = q if self.bits == 8 else pack_nibbles(q)
        scales = torch.cat((_f16_to_bytes(scale_h), _f16_to_bytes(min_h)), dim=-1)
        return payload, scales

    def decode(self, payload: Tensor, scales: Tensor, global_scale: Tensor | float | None = None,
               out_dtype: torch.dtype = torch.float32) -> Tensor:
        self._check_stored(payload, scales, out_dtype)
        self._global_scale(global_scale, int(payload.shape[-2]), payload.device)
        q = payload if self.bits == 8 else unpack_nibbles(payload)
        s = _f16_from_bytes(scales[..., 0:2]).unsqueeze(-1)
        m = _f16_from_bytes(scales[..., 2:4]).unsqueeze(-1)
        return (q.to(torch.float32) * s + m).to(out_dtype)
