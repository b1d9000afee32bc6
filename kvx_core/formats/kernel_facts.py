"""The kernel codes and the `KernelFormat` facts that each `TensorFormat` declares (`TensorFormat.kernel_facts`).

They live here, next to the formats, so that a format states its own kernel facts without importing the kernels
(`kvx_core.ops.kernel_format` re-exports all of this and adds the `kernel_format` lookup). The enums mirror the
kernel sources: `FormatCode` the Triton F_* constexprs, `CudaCode` the format enum of `ops/cuda/paged_decode_mma.cu`,
`EncoderCode` the encoder enum of `ops/cuda/paged_write.cu` (tests/kernels/test_kernel_facts.py checks both `.cu`
enums name for name). `MIXED` lists the K / V pairs of different formats both CUDA kernels are instantiated for.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class FormatCode(enum.IntEnum):
    """Format codes of the Triton kernels (`ops/triton/dequant.py` F_* constexprs)."""

    PLAIN = 0   # bf16 / fp16 / fp32 stored as is
    FP8 = 1     # float8 e4m3 / e5m2, x = fp8 * g
    INT8 = 2    # uint8 code, x = c * scale + min (fp16 scale, fp16 min in 4 scale bytes)
    INT4 = 3    # two uint4 codes per byte, same scales
    MXFP4 = 4   # E2M1 pairs + E8M0 byte per group (16 or 32)
    NVFP4 = 5   # E2M1 pairs + E4M3 byte per 16, x = e2m1 * s * g


class CudaCode(enum.IntEnum):
    """Format codes of the CUDA decode: `enum : int { F_NVFP4 = 0, ... }` in `ops/cuda/paged_decode_mma.cu`."""

    NVFP4 = 0
    MXFP4 = 1
    INT4 = 2
    E4M3 = 3
    E5M2 = 4
    INT8 = 5


class EncoderCode(enum.IntEnum):
    """Encoders of the CUDA write: `enum : int { E_NVFP4 = 0, ... }` in `ops/cuda/paged_write.cu` (the first six
    are the CUDA decode's codes; the MXFP4 variants by group and scale rule follow)."""

    NVFP4 = 0
    MXFP4 = 1
    INT4 = 2
    E4M3 = 3
    E5M2 = 4
    INT8 = 5
    MXFP4_32 = 6
    MXFP4_FLOOR = 7
    MXFP4_32_FLOOR = 8


#: (K, V) CUDA codes of different formats that the CUDA decode and write are instantiated for (k8v4).
MIXED: frozenset[tuple[CudaCode, CudaCode]] = frozenset({(CudaCode.E4M3, CudaCode.NVFP4)})

#: (K, V) encoders the CUDA write rotates rows for, in the kernel (`paged_write.cu` `by_format<true>`): the `_rot`
#: formats' (FP4 / INT4, and k8v4).
ROTATING_ENCODERS: frozenset[tuple[EncoderCode, EncoderCode]] = frozenset(
    {(e, e) for e in (EncoderCode.NVFP4, EncoderCode.MXFP4, EncoderCode.MXFP4_32, EncoderCode.INT4)}
    | {(EncoderCode.E4M3, EncoderCode.NVFP4)})


@dataclass(frozen=True)
class KernelFormat:
    """How one cache tensor (K or V) is stored, as the kernels see it. Two KernelFormats are equal when the
    kernels decode them alike (`rceil` and `encoder`, encode rules, are left out of the comparison)."""

    code: FormatCode      # Triton format code
    group: int            # FP4 group size (16 / 32), else 0
    storage: torch.dtype  # payload torch dtype
    global_scale: bool    # uses the FP32 per-head global scale
    has_scales: bool      # has a scale pool
    packed: bool          # two elements per byte
    e5m2: bool = False    # FP8 payload is E5M2 (else E4M3)
    cuda_code: CudaCode | None = None  # the CUDA decode's code (None: the CUDA decode does not read it)
    rceil: bool = field(default=True, compare=False)  # MXFP4 scale rule: RCEIL (else floor); encode only
    encoder: EncoderCode | None = field(default=None, compare=False)  # the CUDA write's encoder (None: none)

    @property
    def affine(self) -> bool:
        """INT8 / INT4: x = code * scale + min, scale and min per token row."""
        return self.code in (FormatCode.INT8, FormatCode.INT4)

    def dot_dtype(self, q_dtype: torch.dtype) -> torch.dtype:
        """Operand dtype of the tensor-core dots for this format (payload values are exact in it)."""
        if self.code == FormatCode.PLAIN:
            return self.storage
        if self.code == FormatCode.MXFP4:
            return torch.bfloat16
        return torch.float16
