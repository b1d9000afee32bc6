"""FP8 cache formats (E4M3 `float8_e4m3fn`, E5M2) with a per-tensor or per-KV-head FP32 scale (vLLM semantics).

Encode: `q = fp8(clamp(x / g, -MAX, MAX))` with round-to-nearest-even, so finite values (including
ones that overflow after the division, and finite FP64 inputs beyond the FP32 range, which enter as
+-FP32 max) saturate to +-448 (E4M3) / +-57344 (E5M2) instead of becoming NaN/inf.
Decode: `fp32(q) * g`. There is no scale pool (the scale lives in the cache descriptor).
NaN/inf: a non-finite input element encodes to the NaN byte 0x7F (a NaN in both E4M3 and E5M2) and
decodes to NaN; FP8 has no groups, so the "group" poisoned by a non-finite value is the element.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..enums import DType, QuantFormat
from ..errors import KvxError, Status
from .base import TensorFormat
from .kernel_facts import CudaCode, EncoderCode, FormatCode, KernelFormat

FP8_NAN_BYTE = 0x7F

_SPECS = {
    "fp8_e4m3": (DType.F8_E4M3, QuantFormat.FP8_E4M3, torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (DType.F8_E5M2, QuantFormat.FP8_E5M2, torch.float8_e5m2, 57344.0),
}


class FP8Format(TensorFormat):
    """x / scale saturated to the largest finite FP8 value, per-tensor or per-head FP32 scale."""

    scale_dtype = None
    payload_bits = 8
    group_size = 0
    scale_bytes_per_group = 0
    uses_global_scale = True

    def __init__(self, name: str = "fp8_e4m3") -> None:
        if not isinstance(name, str) or name not in _SPECS:
            raise KvxError(Status.UNSUPPORTED, f"FP8 format {name!r}: expected one of {sorted(_SPECS)}")
        self.name = name
        self.data_dtype, self.quant, self._torch, self.max_finite = _SPECS[name]

    def kernel_facts(self) -> KernelFormat:
        e5m2 = self._torch == torch.float8_e5m2
        return KernelFormat(FormatCode.FP8, 0, self._torch, True, False, False, e5m2=e5m2,
                            cuda_code=CudaCode.E5M2 if e5m2 else CudaCode.E4M3,
                            encoder=EncoderCode.E5M2 if e5m2 else EncoderCode.E4M3)

    def encode(self, x: Tensor, global_scale: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
        xf = self._check_input(x)
        g = self._global_scale(global_scale, int(x.shape[-2]), x.device)
        y = (xf / g).clamp(-self.max_finite, self.max_finite)
        q = y.to(self._torch).view(torch.uint8)
        q = torch.where(torch.isfinite(xf), q, torch.full_like(q, FP8_NAN_BYTE))
        scales = torch.empty(tuple(x.shape[:-1]) + (0,), dtype=torch.uint8, device=x.device)
        return q.view(self._torch), scales

    def decode(self, payload: Tensor, scales: Tensor, global_scale: Tensor | float | None = None,
               out_dtype: torch.dtype = torch.float32) -> Tensor:
        self._check_stored(payload, scales, out_dtype)
        g = self._global_scale(global_scale, int(payload.shape[-2]), payload.device)
        return (payload.to(torch.float32) * g).to(out_dtype)
