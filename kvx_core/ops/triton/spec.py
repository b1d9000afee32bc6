"""Map a `kvx_core.formats` TensorFormat to the constexpr knobs of the Triton kernels."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from ...errors import KvxError, Status
from ...formats import FP8Format, IdentityFormat, IntFormat, MXFP4Format, NVFP4Format, TensorFormat
# Format codes: the ints behind dequant.py's tl.constexpr F_* values.
F_PLAIN, F_FP8, F_INT8, F_INT4, F_MXFP4, F_NVFP4 = 0, 1, 2, 3, 4, 5

_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@dataclass(frozen=True)
class KernelFormat:
    """Constexpr description of one cache tensor's storage for the kernels."""

    code: int            # F_* code
    group: int           # FP4 group size (16/32), else 0
    storage: torch.dtype  # payload torch dtype
    global_scale: bool    # uses the FP32 per-head global scale
    has_scales: bool      # has a scale pool
    packed: bool          # two elements per byte

    def dot_dtype(self, q_dtype: torch.dtype):
        """Operand dtype of the tensor-core dots for this format (payload values are exact in it)."""
        if self.code == F_PLAIN:
            return _TL[self.storage]
        if self.code == F_MXFP4:
            return tl.bfloat16
        return tl.float16


def kernel_format(tf: TensorFormat) -> KernelFormat:
    """The kernel knobs of a TensorFormat (KvxError UNSUPPORTED for formats without a kernel)."""
    if isinstance(tf, IdentityFormat):
        return KernelFormat(F_PLAIN, 0, tf.torch_data_dtype, False, False, False)
    if isinstance(tf, FP8Format):
        return KernelFormat(F_FP8, 0, tf.torch_data_dtype, True, False, False)
    if isinstance(tf, IntFormat):
        return KernelFormat(F_INT8 if tf.bits == 8 else F_INT4, 0, torch.uint8, False, True, tf.bits == 4)
    if isinstance(tf, NVFP4Format):
        return KernelFormat(F_NVFP4, 16, torch.uint8, True, True, True)
    if isinstance(tf, MXFP4Format):
        return KernelFormat(F_MXFP4, tf.group_size, torch.uint8, False, True, True)
    raise KvxError(Status.UNSUPPORTED, f"no Triton kernel for cache tensor format {tf!r}")
