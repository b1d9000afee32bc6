"""Which Hadamard rotation runs: the fused Triton kernel (`ops.triton.hadamard`) on CUDA FP16/BF16/FP32 tensors
when triton is installed, else the torch butterfly of `formats.rotation` (the math; bit-identical results).
Formats define the rotation; every op path (reference, kernels, calibration) rotates through this function."""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..formats import rotation


@functools.lru_cache(maxsize=1)
def _fused_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def rotate(x: Tensor, out_dtype: torch.dtype | None = None, out: Tensor | None = None) -> Tensor:
    """`formats.rotation.rotate` (same arguments, checks and results), fused into one launch where it can be."""
    out_dtype = rotation.check_rotate_args(x, out_dtype, out)
    if x.is_cuda and x.dtype != torch.float64 and out_dtype != torch.float64 and _fused_available():
        from .triton.hadamard import hadamard_rows  # lazy: kvx_core imports with torch alone

        return hadamard_rows(x, out_dtype, out)
    return rotation.rotate(x, out_dtype, out)
