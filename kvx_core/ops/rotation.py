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


def _v_follows_k(key: Tensor, value: Tensor) -> bool:
    """V's heads directly follow K's in one buffer with K's strides (vLLM's split of its QKV projection), so
    `[T, 2H, D]` over K's memory addresses both."""
    return (key.dim() == 3 and value.shape == key.shape and value.dtype == key.dtype and value.device == key.device
            and value.stride() == key.stride() and key.stride(2) == 1
            and value.data_ptr() - key.data_ptr() == key.shape[1] * key.stride(1) * key.element_size()
            and value.untyped_storage().data_ptr() == key.untyped_storage().data_ptr())


def rotate_kv(key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """`(rotate(key), rotate(value))` of `[T, H, D]` K/V, in one launch of the fused kernel when V follows K in one
    buffer (`_v_follows_k`): the rows are rotated independently, so the results are the same bits."""
    if key.is_cuda and _fused_available() and _v_follows_k(key, value):
        t, h, d = key.shape
        both = rotate(torch.as_strided(key, (t, 2 * h, d), key.stride()))
        return both[:, :h], both[:, h:]
    return rotate(key), rotate(value)
