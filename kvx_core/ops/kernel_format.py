"""`KernelFormat`: the per-format facts every KVX kernel needs, in one place.

A cache tensor format (`kvx_core.formats.TensorFormat`) maps to one `KernelFormat` (`kernel_format`): its
Triton format code (`FormatCode`, the `tl.constexpr` F_* values of `ops/triton/dequant.py` are built from it),
its CUDA decode code (`CudaCode`, the `enum` of `ops/cuda/paged_decode_mma.cu`; tests/kernels/test_cuda_decode.py
checks the two match), its storage, its scales, whether it packs two elements per byte, whether an FP8 payload
is E5M2, and the dtype of its tensor-core dots. Every launcher (Triton write / gather / decode / prefill, the
CUDA decode) and `ops.dispatch` reads these facts here and nowhere else. No triton import: the dispatch asks
`kernel_format` whether a cache has a kernel before it imports a kernel module.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..errors import KvxError, Status
from ..formats import FP8Format, IdentityFormat, IntFormat, MXFP4Format, NVFP4Format, TensorFormat


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


_CUDA = {FormatCode.NVFP4: CudaCode.NVFP4, FormatCode.MXFP4: CudaCode.MXFP4, FormatCode.INT4: CudaCode.INT4,
         FormatCode.INT8: CudaCode.INT8}


@dataclass(frozen=True)
class KernelFormat:
    """How one cache tensor (K or V) is stored, as the kernels see it. Two KernelFormats are equal when the
    kernels decode them alike (`rceil`, an encode rule, is left out of the comparison)."""

    code: FormatCode      # Triton format code
    group: int            # FP4 group size (16 / 32), else 0
    storage: torch.dtype  # payload torch dtype
    global_scale: bool    # uses the FP32 per-head global scale
    has_scales: bool      # has a scale pool
    packed: bool          # two elements per byte
    e5m2: bool = False    # FP8 payload is E5M2 (else E4M3)
    rceil: bool = field(default=True, compare=False)  # MXFP4 scale rule: RCEIL (else floor); encode only

    @property
    def affine(self) -> bool:
        """INT8 / INT4: x = code * scale + min, scale and min per token row."""
        return self.code in (FormatCode.INT8, FormatCode.INT4)

    @property
    def cuda_code(self) -> CudaCode | None:
        """The CUDA decode's code for this format (None: the CUDA kernel does not decode it)."""
        if self.code == FormatCode.FP8:
            return CudaCode.E5M2 if self.e5m2 else CudaCode.E4M3
        return _CUDA.get(self.code)

    def dot_dtype(self, q_dtype: torch.dtype) -> torch.dtype:
        """Operand dtype of the tensor-core dots for this format (payload values are exact in it)."""
        if self.code == FormatCode.PLAIN:
            return self.storage
        if self.code == FormatCode.MXFP4:
            return torch.bfloat16
        return torch.float16


def kernel_format(tf: TensorFormat) -> KernelFormat:
    """The kernel facts of a TensorFormat (KvxError UNSUPPORTED for formats without a kernel)."""
    if isinstance(tf, IdentityFormat):
        return KernelFormat(FormatCode.PLAIN, 0, tf.torch_data_dtype, False, False, False)
    if isinstance(tf, FP8Format):
        return KernelFormat(FormatCode.FP8, 0, tf.torch_data_dtype, True, False, False,
                            e5m2=tf.torch_data_dtype == torch.float8_e5m2)
    if isinstance(tf, IntFormat):
        return KernelFormat(FormatCode.INT8 if tf.bits == 8 else FormatCode.INT4, 0, torch.uint8, False, True,
                            tf.bits == 4)
    if isinstance(tf, NVFP4Format):
        return KernelFormat(FormatCode.NVFP4, 16, torch.uint8, True, True, True)
    if isinstance(tf, MXFP4Format):
        return KernelFormat(FormatCode.MXFP4, tf.group_size, torch.uint8, False, True, True,
                            rceil=tf.scale_rule == "rceil")
    raise KvxError(Status.UNSUPPORTED, f"no Triton kernel for cache tensor format {tf!r}")
