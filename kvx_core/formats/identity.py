"""Unquantized cache formats (bf16 / fp16 / fp32): the payload is `x.to(dtype)`, no scale pool.

The cast is torch's IEEE cast (round-to-nearest-even; NaN/inf are kept, the NaN bit pattern being the
device's own). Unlike the quantized formats it does not saturate: a value beyond the storage dtype's
range (above 65504 for fp16, FP64 input beyond the FP32/BF16 range) is stored as +-inf, exactly what
the model's own cast to that dtype gives.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..enums import DType, QuantFormat
from ..errors import KvxError, Status
from .base import TensorFormat
from .kernel_facts import FormatCode, KernelFormat

_DTYPES = {"bf16": DType.BF16, "fp16": DType.F16, "fp32": DType.F32}


class IdentityFormat(TensorFormat):
    """The model dtype stored as is."""

    quant = QuantFormat.NONE
    scale_dtype = None
    group_size = 0
    scale_bytes_per_group = 0
    uses_global_scale = False

    def __init__(self, name: str = "bf16") -> None:
        if not isinstance(name, str) or name not in _DTYPES:
            raise KvxError(Status.UNSUPPORTED, f"identity format {name!r}: expected one of {sorted(_DTYPES)}")
        self.name = name
        self.data_dtype = _DTYPES[name]
        self.payload_bits = 32 if name == "fp32" else 16

    def kernel_facts(self) -> KernelFormat:
        return KernelFormat(FormatCode.PLAIN, 0, self.torch_data_dtype, False, False, False)

    def encode(self, x: Tensor, global_scale: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
        self._check_input(x)
        self._global_scale(global_scale, int(x.shape[-2]), x.device)
        payload = x.detach().to(self.torch_data_dtype, copy=True)  # never the caller's tensor itself
        scales = torch.empty(tuple(x.shape[:-1]) + (0,), dtype=torch.uint8, device=x.device)
        return payload, scales

    def decode(self, payload: Tensor, scales: Tensor, global_scale: Tensor | float | None = None,
               out_dtype: torch.dtype = torch.float32) -> Tensor:
        self._check_stored(payload, scales, out_dtype)
        self._global_scale(global_scale, int(payload.shape[-2]), payload.device)
        return payload.to(out_dtype, copy=True)  # never a view of the stored payload
