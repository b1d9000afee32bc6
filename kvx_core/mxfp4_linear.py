"""MXFP4 weights for a vocabulary projection (lm_head): quantize once after loading, multiply on every step.

A BF16 lm_head (gpt-oss: 201088 x 2880, 1.16 GB) is read whole at every decode step; in MXFP4 (E2M1 + one UE8M0
scale per 32 inputs, the OCP MX rule, 4.25 bits per weight) it is 3.76x smaller. The codec is KVX's own
`MXFP4Format(group_size=32)` (RCEIL scales), so the quantized weight is bit-identical to what the KV-cache formats'
oracles define, except for groups whose largest |w| exceeds 6 * 2**125 (~2.55e38, within 25% of the FP32 maximum):
there RCEIL's scale 2**126 would decode finite weights to inf (4 * 2**126 = 2**128), so those groups take OCP MX's
own scale 2**(floor(log2(amax)) - 2) = 2**125 and their largest elements saturate to +-6 * 2**125 (`MAX_EXPONENT`). This
module is the torch reference (any device): `mxfp4_linear` decodes the weight in row chunks (peak memory one chunk, not
the dense head) and multiplies in the input's dtype with FP32 accumulation where torch does. On CUDA, bf16 / fp16 inputs
go to the Triton kernel (`ops.triton.mxfp4_gemv`: the weight decoded in registers, 4.25 bits per weight read);
`backend="torch"` forces the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import KvxError, Status, require
from .formats.mxfp4 import MXFP4Format

GROUP = 32
"""Inputs per UE8M0 scale (OCP MX)."""

MAX_EXPONENT = 125
"""The largest scale exponent of a weight group: 6 * 2**125 is finite in FP32, 4 * 2**126 is not."""


class _FiniteMXFP4(MXFP4Format):
    """MXFP4 (RCEIL) whose scale exponents stop at `MAX_EXPONENT`, so that no finite weight decodes to inf."""

    def scale_exponent(self, amax: torch.Tensor) -> torch.Tensor:
        return super().scale_exponent(amax).clamp(max=MAX_EXPONENT)


CODEC = _FiniteMXFP4(group_size=GROUP)

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

    def __post_init__(self) -> None:
        """Shapes, dtypes, device and `max_scale` checked here: the kernels index the bytes by these shapes, and
        take the bf16 path from `max_scale` without looking at the scales."""
        p, s = self.payload, self.scales
        got = ", ".join(f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                        for t in (p, s))
        require(isinstance(p, torch.Tensor) and isinstance(s, torch.Tensor) and p.dtype == s.dtype == torch.uint8
                and p.dim() == 2 and p.shape[1] % (GROUP // 2) == 0
                and tuple(s.shape) == (p.shape[0], p.shape[1] * 2 // GROUP), Status.INVALID_ARGUMENT,
                f"Mxfp4Weight needs uint8 payload [out, in / 2] and scales [out, in / {GROUP}] (in a multiple of "
                f"{GROUP}), got {got}")
        require(p.device == s.device, Status.INVALID_ARGUMENT, f"payload on {p.device}, scales on {s.device}")
        require(self.max_scale is None or (type(self.max_scale) is int
                                           and self.max_scale == (int(s.max()) if s.numel() else 0)),
                Status.INVALID_ARGUMENT, f"max_scale {self.max_scale!r} is not the largest scale byte")

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
    x's dtype. The reference computes `x @ weight.dequantize(dtype=x.dtype).T` `chunk_rows` output rows at a time:
    the same products, but the BLAS picks its summation order by the chunk's shape, so two `chunk_rows` agree to
    within the bound of FP32 summation (2 * in_features * 2**-24 * sum |x * w| per output) plus one rounding to
    x's dtype, not bit for bit. The kernel (`backend` "auto" where `kernel_serves(x)`, or "triton") sums the same
    products in its own FP32 order."""
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
