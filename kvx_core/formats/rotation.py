"""Orthonormal Hadamard rotation along head_dim, used by the `_rot` cache formats.

H = Sylvester Hadamard matrix of order D (a power of two) scaled by 1/sqrt(D): symmetric and
orthonormal, so H^-1 = H^T = H. Keys and queries are both multiplied by H (Q K^T is unchanged); values
are rotated at write time and the attention output is rotated back with the same H (P (V H) H = P V).
Rotation spreads outliers across the head so FP4/INT4 group scales fit the data better.
Numerics: `rotate` is the fast Walsh-Hadamard butterfly in FP32 (FP64 for FP64 input): log2(D) stages of
elementwise adds/subtracts in a fixed order, then one multiply by 1/sqrt(D) rounded to the working dtype.
Every row is computed on its own, so a token's rotation is bit-identical whatever the batch it comes in (a matmul's
summation order changes with the number of rows) and on any device (IEEE adds, no reductions).
Saturation (finite stays finite, as the formats promise): finite inputs are first saturated to
±FP32_MAX/D, so the butterfly's D-fold sums stay finite, and finite results beyond the output dtype's range
saturate to its largest value; NaN and ±inf inputs pass through untouched and poison their row.
This module defines the math and runs it in torch, stage by stage; `kvx_core.ops.rotation.rotate` chooses which
implementation runs: on CUDA (FP16/BF16/FP32 input) the same butterfly as one fused Triton kernel
(`kvx_core.ops.triton.hadamard`, bit-identical to the torch ops), elsewhere this one.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ..errors import KvxError, Status
from .base import is_power_of_two


def _check_order(d: int) -> None:
    if not is_power_of_two(d):
        raise KvxError(Status.UNSUPPORTED, f"Hadamard rotation needs head_dim to be a power of two, got {d!r}")


@functools.lru_cache(maxsize=32)
def _sylvester(d: int) -> Tensor:
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h / math.sqrt(d)


def hadamard(d: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> Tensor:
    """The orthonormal Sylvester Hadamard matrix `[d, d]` (d a power of two; else KvxError UNSUPPORTED)."""
    _check_order(d)
    return _sylvester(d).to(device=device, dtype=dtype, copy=True)


def check_rotate_args(x: Tensor, out_dtype: torch.dtype | None, out: Tensor | None) -> torch.dtype:
    """Validate `rotate`'s arguments (shared by every implementation) and return the output dtype."""
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() == 0:
        raise KvxError(Status.INVALID_ARGUMENT, "rotate expects a floating-point torch.Tensor [..., D]")
    _check_order(int(x.shape[-1]))
    if out is not None:
        if not isinstance(out, Tensor) or not out.is_floating_point() or out.shape != x.shape \
                or out.device != x.device:
            raise KvxError(Status.INVALID_ARGUMENT,
                           f"rotate: out must be a float tensor {tuple(x.shape)} on {x.device}")
        return out.dtype
    return out_dtype or x.dtype


def rotate(x: Tensor, out_dtype: torch.dtype | None = None, out: Tensor | None = None) -> Tensor:
    """`x @ H` along the last dim (its own inverse: `rotate(rotate(x)) == x` up to rounding), row by row, into a new
    tensor of `out_dtype` (default: x's) or into `out` (x's shape, a float dtype; the result is then `out`).

    Butterfly stage h (h = 1, 2, 4, ...) maps each pair (a, b) = (y[i], y[i + h]) of a 2h-block to
    (a + b, a - b): the Sylvester recursion H_2h = [[H_h, H_h], [H_h, -H_h]] unrolled. No host sync and
    no host-to-device copy, so rotations on a GPU stream are CUDA-graph capturable.
    """
    out_dtype = check_rotate_args(x, out_dtype, out)
    d = int(x.shape[-1])
    if out is not None:
        return out.copy_(rotate(x, out_dtype))
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = _saturate_finite(x.to(work).reshape(-1, d), input_limit(d))
    h = 1
    while h < d:
        y = y.reshape(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    y = y.reshape(x.shape) * inv_sqrt(d, work)
    return _saturate_finite(y, output_limit(out_dtype)).to(out_dtype)


FP32_MAX = torch.finfo(torch.float32).max


def input_limit(d: int) -> float:
    """Finite inputs are saturated to ±this before the butterfly, so its D-fold sums stay finite in FP32."""
    return FP32_MAX / d


@functools.lru_cache(maxsize=64)
def inv_sqrt(d: int, work: torch.dtype = torch.float32) -> float:
    """1/sqrt(d) rounded to the working dtype: the one multiply every implementation applies after the butterfly."""
    return float(torch.tensor(1.0 / math.sqrt(d), dtype=work))


def output_limit(dtype: torch.dtype) -> float:
    """Finite results saturate to ±this: the output dtype's largest value (FP32's for wider outputs)."""
    return min(torch.finfo(dtype).max, FP32_MAX)


def _saturate_finite(y: Tensor, limit: float) -> Tensor:
    """Clamp finite values to ±limit; NaN and ±inf are kept (they mark their group invalid downstream)."""
    return torch.where(torch.isfinite(y), y.clamp(-limit, limit), y)


#: H is symmetric and orthonormal, so undoing a rotation is the same operation.
unrotate = rotate
