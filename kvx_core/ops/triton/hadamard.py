"""Fused Walsh-Hadamard rotation: one launch for what `formats.rotation.rotate` does in log2(D) torch ops.

The kernel runs the same fixed-order butterfly on FP32 registers (stage h maps each pair (y[i], y[i+h]) of
a 2h-block to (a + b, a - b), then one multiply by the FP32 value of 1/sqrt(D)), with the same saturation of
finite inputs and results (`formats.rotation`), so its output is bit-identical to the torch butterfly
and, like it, independent of how many rows come in one call. On a GPU the torch version costs ~3
launches per stage; this one costs one (the `_rot` decode and write paths rotate q and K/V every step).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...formats.rotation import input_limit, inv_sqrt, output_limit
from .launch import interpreting

ROWS = 16
"""Rows per program: [16, D] FP32 tiles stay in registers for D <= 256."""


@triton.jit
def _saturate_finite(y, limit):
    finite = tl.abs(y) < float("inf")  # False for NaN and +-inf, which pass through
    return tl.where(finite, tl.minimum(tl.maximum(y, -limit), limit), y)


@triton.jit
def _hadamard_kernel(x_ptr, y_ptr, n_rows, x_heads, x_stride, x_head_stride, y_stride, inv_sqrt_d, in_limit,
                     out_limit, D: tl.constexpr, LOG2_D: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    mask = (rows < n_rows)[:, None]
    # input row r is (r // x_heads, r % x_heads) of a [N, x_heads, D] view: strided K/V token rows without a copy
    x_off = (rows // x_heads).to(tl.int64) * x_stride + (rows % x_heads).to(tl.int64) * x_head_stride
    y = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = _saturate_finite(y, in_limit)
    for s in tl.static_range(LOG2_D):
        # h = 2**s: [R, D/2h, 2, h] -> pairs on the last axis -> (a + b, a - b) -> back to [R, D]
        t = tl.permute(tl.reshape(y, (ROWS, D >> (s + 1), 2, 1 << s)), (0, 1, 3, 2))
        a, b = tl.split(t)
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, D))
    y = _saturate_finite(y * inv_sqrt_d, out_limit)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * y_stride + cols[None, :], y, mask=mask)


def hadamard_rows(x: torch.Tensor, out_dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate each row of `x [..., D]` (D a power of two, FP16/BF16/FP32) into `out` (same shape, `out_dtype`,
    rows addressable as `[-1, D]` with a contiguous last dim) or a new `out_dtype` tensor.

    On a GPU the kernel rounds to `out_dtype` itself (RNE, as torch's cast) and stores into the output: one launch.
    Triton's CPU interpreter does not round BF16 stores to nearest-even, so there the kernel stores FP32 and torch
    casts (same bits as on the GPU)."""
    d = int(x.shape[-1])
    x3 = _heads_view(x)
    n = x3.shape[0] * x3.shape[1]
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    direct = not interpreting() or out_dtype == torch.float32
    y2 = _rows_view(out) if direct else None
    dst = y2 if y2 is not None else torch.empty((n, d), dtype=torch.float32 if not direct else out_dtype,
                                                device=x.device)
    if n:
        _hadamard_kernel[(triton.cdiv(n, ROWS),)](x3, dst, n, x3.shape[1], x3.stride(0), x3.stride(1),
                                                  dst.stride(0), inv_sqrt(d), input_limit(d), output_limit(out_dtype),
                                                  D=d, LOG2_D=d.bit_length() - 1, ROWS=ROWS)
    if dst is not y2:
        out.copy_(dst.reshape(out.shape))
    return out


def _heads_view(x: torch.Tensor) -> torch.Tensor:
    """`x [..., D]` as `[N, H, D]` rows with a contiguous last dim: a view where the leading dims merge (e.g. vLLM's
    K/V, strided token rows of its QKV projection), else a contiguous copy."""
    x3 = x.reshape(1, 1, -1) if x.dim() == 1 else x.unsqueeze(1) if x.dim() == 2 else None
    if x3 is None:
        shape = (math.prod(x.shape[:-2]), *x.shape[-2:])
        try:
            x3 = x.view(shape)
        except RuntimeError:
            x3 = x.reshape(shape)
    return x3 if x3.stride(-1) == 1 or x3.shape[-1] <= 1 else x3.contiguous()


def _rows_view(t: torch.Tensor) -> torch.Tensor | None:
    """`t` as `[-1, D]` rows with a contiguous last dim sharing its memory, or None."""
    try:
        v = t.view(-1, t.shape[-1])
    except RuntimeError:
        return None
    return v if v.stride(-1) == 1 or v.shape[-1] <= 1 else None
