"""MXFP4 cache format: E2M1 payload + one UE8M0 scale byte (bias 127) per group of 16 or 32 values.

Per group (FP32 arithmetic, amax = max|x|; finite FP64 inputs beyond the FP32 range enter as +-FP32 max,
so they encode as the largest scale, never as the NaN byte):
  RCEIL (default; FlashInfer / triton_kernels / cuDNN):  E = ceil(log2(f32(amax / 6)))
  FLOOR (OCP MX v1.0):                                   E = floor(log2(amax)) - 2
  E is exact (computed from the FP32 bits, subnormals included) and clamped to [-127, 127];
  scale byte = E + 127; S = 2**E (byte 0 is 2**-127, an FP32 subnormal).
  elements: e2m1_rne_saturating(x / S); decode: e2m1 * S (exact in FP32).
RCEIL never clips (|x / S| <= 6); FLOOR may (|x / S| < 8, saturated to 6).
All-zero group: amax = 0 -> E clamps to -127 -> byte 0x00, codes 0 (0x8 for negative zeros).
Decoding overflows FP32 to +-inf where e2m1 * 2**E >= 2**128 (e.g. value 4 at E = 126, which RCEIL
gives for |x| >= 3.5 * 2**126 ~ 2.98e38, within 13% of the FP32 max), as in any MXFP4 -> FP32 decoder.
NaN/inf: a group containing a non-finite value gets scale byte 0xFF (the UE8M0 NaN) and codes 0;
it decodes to NaN for the whole group.
Note: triton_kernels' RCEIL bit trick maps a subnormal amax/6 to byte 1 where KVX gives the exact
ceil (byte 0 or 1), and its E2M1 cast breaks ties upward; KVX pins RNE (ties to even) as the
hardware cvt.rn.satfinite.e2m1x2 does.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..enums import DType, QuantFormat, ScaleGranularity
from ..errors import KvxError, Status
from .base import TensorFormat, is_int
from .codes import (
    E8M0_NAN_BYTE,
    ceil_log2,
    div_exact,
    e8m0_from_byte,
    e8m0_to_byte,
    floor_log2,
    fp4_decode_groups,
    fp4_encode_groups,
)
from .kernel_facts import CudaCode, EncoderCode, FormatCode, KernelFormat

SCALE_RULES = ("rceil", "floor")
#: The CUDA write's encoder of each (group size, scale rule).
_ENCODERS = {(16, "rceil"): EncoderCode.MXFP4, (32, "rceil"): EncoderCode.MXFP4_32,
             (16, "floor"): EncoderCode.MXFP4_FLOOR, (32, "floor"): EncoderCode.MXFP4_32_FLOOR}


class MXFP4Format(TensorFormat):
    """FP4 E2M1 + power-of-two UE8M0 scale per `group_size` (16: KV default, 32: OCP MX)."""

    quant = QuantFormat.MXFP4
    data_dtype = DType.FP4_E2M1X2
    scale_dtype = DType.UE8M0
    payload_bits = 4
    scale_bytes_per_group = 1
    uses_global_scale = False
    scale_granularity = ScaleGranularity.PER_GROUP

    def __init__(self, group_size: int = 16, scale_rule: str = "rceil") -> None:
        if not is_int(group_size) or group_size not in (16, 32):
            raise KvxError(Status.UNSUPPORTED, f"MXFP4 group size {group_size}: only 16 and 32 are defined")
        if not isinstance(scale_rule, str) or scale_rule not in SCALE_RULES:
            raise KvxError(Status.UNSUPPORTED, f"MXFP4 scale rule {scale_rule!r}: expected one of {SCALE_RULES}")
        self.group_size = group_size
        self.scale_rule = scale_rule
        self.name = f"mxfp4_{group_size}" + ("" if scale_rule == "rceil" else "_floor")

    def kernel_facts(self) -> KernelFormat:
        return KernelFormat(FormatCode.MXFP4, self.group_size, torch.uint8, False, True, True,
                            cuda_code=CudaCode.MXFP4, rceil=self.scale_rule == "rceil",
                            encoder=_ENCODERS[(self.group_size, self.scale_rule)])

    def scale_exponent(self, amax: Tensor) -> Tensor:
        """Unbiased scale exponent E in [-127, 127] (int32) of each group's FP32 amax (finite, >= 0)."""
        if not isinstance(amax, Tensor) or not amax.is_floating_point():
            raise KvxError(Status.INVALID_ARGUMENT, f"amax must be a float tensor, got {type(amax).__name__}")
        pos = amax > 0
        safe = torch.where(pos, amax, torch.ones_like(amax))
        if self.scale_rule == "rceil":
            d = div_exact(safe, 6.0)
            d_pos = d > 0  # amax/6 may underflow to 0 for the smallest subnormals
            e = ceil_log2(torch.where(d_pos, d, torch.ones_like(d)))
            e = torch.where(d_pos, e, torch.full_like(e, -127))
        else:
            e = floor_log2(safe) - 2
        e = torch.where(pos, e, torch.full_like(e, -127))
        return e.clamp(-127, 127)

    def encode(self, x: Tensor, global_scale: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
        xf = self._check_input(x)
        self._global_scale(global_scale, int(x.shape[-2]), x.device)
        d = int(x.shape[-1])
        xg = xf.reshape(*xf.shape[:-1], d // self.group_size, self.group_size)
        finite = torch.isfinite(xg).all(dim=-1)
        amax = torch.where(finite, xg.abs().amax(dim=-1), torch.zeros(finite.shape, device=x.device))
        byte = e8m0_to_byte(self.scale_exponent(amax))
        payload = fp4_encode_groups(xg, e8m0_from_byte(byte).unsqueeze(-1), finite)
        return payload, torch.where(finite, byte, torch.full_like(byte, E8M0_NAN_BYTE))

    def decode(self, payload: Tensor, scales: Tensor, global_scale: Tensor | float | None = None,
               out_dtype: torch.dtype = torch.float32) -> Tensor:
        self._check_stored(payload, scales, out_dtype)
        self._global_scale(global_scale, int(payload.shape[-2]), payload.device)
        return fp4_decode_groups(payload, self.group_size, e8m0_from_byte(scales)).to(out_dtype)
