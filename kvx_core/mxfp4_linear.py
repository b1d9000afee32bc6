"""MXFP4 weights for a vocabulary projection (lm_head): quantize once after loading, multiply on every step.

A BF16 lm_head (gpt-oss: 201088 x 2880, 1.16 GB) is read whole at every decode step; in MXFP4 (E2M1 + one UE8M0
scale per 32 inputs, the OCP MX rule, 4.25 bits per weight) it is 3.76x smaller. The codec is KVX's own
`MXFP4Format(group_size=32)`, so the quantized weight is bit-identical to what the KV-cache formats' oracles
define. This module is the torch reference (any device): `mxfp4_linear` decodes the weight in row chunks (peak
memory one chunk, not the dense head) and multiplies in the input's dtype with FP32 accumulation where torch does.
On CUDA, bf16 / fp16 inputs go to the Triton kernel (`ops.triton.mxfp4_gemv`: the weight decoded in registers, 4.25
bits per weight read); `backend="torch"` forces the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import KvxError, Status, require
from .formats.mxfp4 import MXFP4Format

GROUP = 32
"""Inputs per UE8M0 scale (OCP MX)."""

CODEC = MXFP4Format(group_size=GROUP)

DEFAULT_CHUNK_ROWS = 8192
"""Output rows decoded at a time by `mxfp4_linear`, and encoded at a time by `quantize_mxfp4` (8192 x 2880 fp32 =
94 MB)."""


@dataclass(frozen=True)
class Mxfp4Weight:
    """A quantized `[out_features, in_features]` weight: `payload [out, in / 2]` uint8 (two E2M1 codes per byte,
    element 2i in the low nibble) and `scales [out, in / 32]` uint8 (UE8M0)."""

    payload: torch.Tensor
    scales: torch.Tensor
    max_scale: int | None = None  # the largest scale byte, when known (lets the kernel decode without FP32)

    def to(self, device) -> Mxfp4Weight:
        return Mxfp4Weight(self.payload.to(device), self.scales.to(device), self.max_scale)

    @property
    def out_features(self) -> int:
        return int(self.payload.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.payload.shape[1]) * 2

    @property
    def nbytes(self) -> int:
        return self.payload.numel() + self.scales.numel()

    def dequantize(self, rows: slice = slice(None), dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight rows `rows` as `dtype` (exact: every MXFP4 value is representable in bf16 and fp32)."""
        return CODEC.decode(self.payload[rows], self.scales[rows], out_dtype=dtype)


def quantize_mxfp4(weight: torch.Tensor) -> Mxfp4Weight:
    """MXFP4 of a `[out_features, in_features]` float weight (in_features a multiple of 32). Refuses non-finite
    weights (MXFP4 would store a NaN scale for their whole group) instead of carrying them silently."""
    require(isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.is_floating_point(),
            Status.INVALID_ARGUMENT, "quantize_mxfp4 expects a 2-D float weight [out_features, in_features], got "
            + (f"{tuple(weight.shape)} {weight.dtype}" if isinstance(weight, torch.Tensor) else type(weight).__name__))
    require(weight.shape[1] % GROUP == 0, Status.INVALID_ARGUMENT,
            f"MXFP4 weights need in_features divisible by {GROUP}, got {weight.shape[1]}")
    require(bool(torch.isfinite(weight).all()), Status.INVALID_ARGUMENT,
            "the weight holds NaN or inf values: MXFP4 cannot represent them (a whole group's scale would be NaN)")
    payload = torch.empty(weight.shape[0], weight.shape[1] // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(weight.shape[0], weight.shape[1] // GROUP, dtype=torch.uint8, device=weight.device)
    for lo in range(0, weight.shape[0], DEFAULT_CHUNK_ROWS):  # rows are independent: the peak is one chunk's
        payload[lo:lo + DEFAULT_CHUNK_ROWS], scales[lo:lo + DEFAULT_CHUNK_ROWS] = CODEC.encode(
            weight[lo:lo + DEFAULT_CHUNK_ROWS])
    return Mxfp4Weight(payload, scales, int(scales.max()) if scales.numel() else 0)


def kernel_serves(x: torch.Tensor) -> bool:
    """Whether `mxfp4_linear` runs the Triton kernel for x (CUDA, bf16 / fp16) rather than the torch reference."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def mxfp4_linear(x: torch.Tensor, weight: Mxfp4Weight, *, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                 backend: str = "auto") -> torch.Tensor:
    """`x @ W.T` for `x [..., in_features]` with `W` the decoded MXFP4 weight: the output `[..., out_features]` in
    x's dtype. The reference equals `x @ weight.dequantize(dtype=x.dtype).T` for any `chunk_rows` (rows are
    independent); the kernel (`backend` "auto" where `kernel_serves(x)`, or "triton") has the same exact products
    summed in another FP32 order."""
    if not isinstance(weight, Mxfp4Weight):
        raise KvxError(Status.INVALID_ARGUMENT, f"mxfp4_linear expects an Mxfp4Weight, got {type(weight).__name__}")
    require(isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 1
            and x.shape[-1] == weight.in_features, Status.INVALID_ARGUMENT,
            f"mxfp4_linear: x must be a float tensor [..., {weight.in_features}], got "
            + (f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__))
    require(isinstance(chunk_rows, int) and chunk_rows > 0, Status.INVALID_ARGUMENT,
            f"chunk_rows must be a positive int, got {chunk_rows!r}")
    require(x.device == weight.payload.device, Status.INVALID_ARGUMENT,
            f"x is on {x.device}, the weight on {weight.payload.device}")
    require(backend in ("auto", "torch", "triton"), Status.INVALID_ARGUMENT,
            f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "triton" or (backend == "auto" and kernel_serves(x)):
        from .ops.triton.mxfp4_gemv import mxfp4_linear_triton
        x2 = x.reshape(-1, weight.in_features)
        out2 = mxfp4_linear_triton(x2 if x2.stride(-1) == 1 else x2.contiguous(), weight.payload, weight.scales,
                                   max_scale=weight.max_scale)
        return out2.view(*x.shape[:-1], weight.out_features)
    out = torch.empty(*x.shape[:-1], weight.out_features, dtype=x.dtype, device=x.device)
    for lo in range(0, weight.out_features, chunk_rows):
        rows = slice(lo, min(lo + chunk_rows, weight.out_features))
        out[..., rows] = torch.matmul(x, weight.dequantize(rows, x.dtype).T)
    return out
