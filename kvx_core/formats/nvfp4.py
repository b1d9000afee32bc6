"""NVFP4 cache format: E2M1 payload + one E4M3 scale byte per 16 values + an FP32 global scale g.

Per group of 16 (FP32 arithmetic, ModelOpt's NVFP4 semantics; g per tensor or per KV head; finite FP64
inputs beyond the FP32 range enter as +-FP32 max and saturate as described under Overflow):
  amax = max|x|
  s    = f32(amax / f32(6 * g))
  s    = 1.0                         if s == 0         (all-zero group, or amax/(6g) underflowing
                                                        FP32 -> byte 0x38, as ModelOpt)
  s    = clamp(s, 2**-9, 448)                          (E4M3 guards, see below)
  byte = e4m3_rne(s)                                   (stored in the scale pool)
  S    = f32(f32(byte) * g)                            (the effective per-group scale)
  code = e2m1_rne_saturating(f32(x / S))               (payload nibble)
  decode: e2m1(code) * S                               (S computed exactly as above)
Underflow guard: a non-zero group whose s is below the smallest E4M3 subnormal (2**-9) gets
s = 2**-9 instead of rounding to a zero scale (which would divide by zero); its values then quantize
against 2**-9 * g (mostly to +-0). This is ModelOpt's `clamp_(min=2**-9)`.
Overflow: s > 448 only happens when g is too small for the data (g should be amax/(6*448), see
`global_scale_from_amax`); like ModelOpt's static path and ONNX exporter the scale saturates to 448
(byte 0x7E) and the group's elements saturate at +-6*448*g. `scale_overflow(x, g)` reports it.
NaN/inf: a group containing a non-finite value gets scale byte 0x7F (E4M3 NaN) and codes 0; it
decodes to NaN for the whole group. g itself must be finite and > 0 (KvxError otherwise).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..enums import DType, QuantFormat, ScaleGranularity
from ..errors import KvxError, Status
from .base import TensorFormat
from .codes import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    E4M3_NAN_BYTE,
    e4m3_from_byte,
    e4m3_to_byte,
    fp4_decode_groups,
    fp4_encode_groups,
)
from .kernel_facts import CudaCode, EncoderCode, FormatCode, KernelFormat


def global_scale_from_amax(amax: Tensor) -> Tensor:
    """Calibrated NVFP4 global scale `amax / (6 * 448)` (1.0 where amax is 0), FP32, any shape ([] or [H])."""
    if not isinstance(amax, Tensor) or not amax.is_floating_point():
        raise KvxError(Status.INVALID_ARGUMENT, f"amax must be a float tensor, got {type(amax).__name__}")
    amax = amax.to(torch.float32)
    g = amax / (E2M1_MAX * E4M3_MAX)
    return torch.where(g > 0, g, torch.ones_like(g))


class NVFP4Format(TensorFormat):
    """FP4 E2M1 + E4M3 scale per 16 values + FP32 global scale (two-level scaling)."""

    name = "nvfp4"
    quant = QuantFormat.NVFP4
    data_dtype = DType.FP4_E2M1X2
    scale_dtype = DType.F8_E4M3
    payload_bits = 4
    group_size = 16
    scale_bytes_per_group = 1
    uses_global_scale = True
    scale_granularity = ScaleGranularity.PER_GROUP

    def kernel_facts(self) -> KernelFormat:
        return KernelFormat(FormatCode.NVFP4, 16, torch.uint8, True, True, True, cuda_code=CudaCode.NVFP4,
                            encoder=EncoderCode.NVFP4)

    def _grouped(self, xf: Tensor) -> Tensor:
        d = int(xf.shape[-1])
        return xf.reshape(*xf.shape[:-1], d // self.group_size, self.group_size)

    def _raw_scale(self, xg: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """(s before the E4M3 guards, finite mask) per group; g is `[H or 1, 1]`."""
        finite = torch.isfinite(xg).all(dim=-1)
        amax = torch.where(finite, xg.abs().amax(dim=-1), torch.zeros(finite.shape, device=xg.device))
        return amax / (6.0 * g), finite

    def scale_overflow(self, x: Tensor, global_scale: Tensor | float | None = None) -> Tensor:
        """Bool `[..., H, D/16]`: groups whose scale saturated at 448 (global scale too small)."""
        xf = self._check_input(x)
        g = self._global_scale(global_scale, int(x.shape[-2]), x.device)
        s, finite = self._raw_scale(self._grouped(xf), g)
        return finite & (s > E4M3_MAX)

    def encode(self, x: Tensor, global_scale: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
        xf = self._check_input(x)
        g = self._global_scale(global_scale, int(x.shape[-2]), x.device)
        xg = self._grouped(xf)
        s, finite = self._raw_scale(xg, g)
        s = torch.where(s == 0, torch.ones_like(s), s).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX)
        byte = e4m3_to_byte(s)
        payload = fp4_encode_groups(xg, (e4m3_from_byte(byte) * g).unsqueeze(-1), finite)
        return payload, torch.where(finite, byte, torch.full_like(byte, E4M3_NAN_BYTE))

    def decode(self, payload: Tensor, scales: Tensor, global_scale: Tensor | float | None = None,
               out_dtype: torch.dtype = torch.float32) -> Tensor:
        self._check_stored(payload, scales, out_dtype)
        g = self._global_scale(global_scale, int(payload.shape[-2]), payload.device)
        return fp4_decode_groups(payload, self.group_size, e4m3_from_byte(scales) * g).to(out_dtype)
