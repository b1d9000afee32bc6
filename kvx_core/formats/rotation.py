"""Orthonormal Hadamard rotation along head_dim, used by the `_rot` cache formats.

H = Sylvester Hadamard matrix of order D (a power of two) scaled by 1/sqrt(D): symmetric and
orthonormal, so H^-1 = H^T = H. Keys and queries are both multiplied by H (Q K^T is unchanged); values
are rotated at write time and the attention output is rotated back with the same H (P (V H) H = P V).
Rotation spreads outliers across the head so FP4/INT4 group scales fit the data better.
Numerics: FP32 (FP64 for FP64 input) matmul; not bit-exact across implementations (summation order).
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ..errors import KvxError, Status
from .base import is_power_of_two


@functools.lru_cache(maxsize=32)
def _sylvester(d: int) -> Tensor:
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h / math.sqrt(d)


def hadamard(d: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> Tensor:
    """The orthonormal Sylvester Hadamard matrix `[d, d]` (d a power of two; else KvxError UNSUPPORTED)."""
    if not is_power_of_two(d):
        raise KvxError(Status.UNSUPPORTED, f"Hadamard rotation needs head_dim to be a power of two, got {d!r}")
    return _sylvester(d).to(device=device, dtype=dtype, copy=True)


@functools.lru_cache(maxsize=64)
def _rotation_matrix(d: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """`hadamard(d)` kept per (dtype, device) for `rotate`, which only reads it: no host-to-device copy
    per call (so rotations on a GPU stream are also CUDA-graph capturable after the first call)."""
    return hadamard(d, dtype=dtype, device=device)


def rotate(x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """`x @ H` along the last dim (its own inverse: `rotate(rotate(x)) == x` up to rounding)."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise KvxError(Status.INVALID_ARGUMENT, "rotate expects a floating-point torch.Tensor")
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = _rotation_matrix(int(x.shape[-1]), work, x.device)
    return (x.to(work) @ h).to(out_dtype or x.dtype)


#: H is symmetric and orthonormal, so undoing a rotation is the same operation.
unrotate = rotate
