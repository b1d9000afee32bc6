"""MXFP4 weight x BF16 / FP16 activations for small M (the lm_head of a decode step): `out = x @ W.T`.

A program owns `BN` output features (weight rows) and `BM` activation rows and walks the inputs `BK` at a time (the
remainder, a multiple of 32, one group at a time): the
weight tile is decoded in registers by the KV decode's own FP4 tile (`tiles.fp4_tile`: E2M1 nibble -> fp16 bits,
times the group's UE8M0 scale, exact in bf16), split into even (low nibble) and odd (high nibble) inputs, and meets
the matching even / odd activation columns in two tensor-core dots with FP32 accumulation. With bf16 activations
and scale bytes <= 128 (known from quantization) the tile skips FP32: E2M1 bits placed as bf16 e2m1 * 2**-126 and
multiplied by 2**(scale - 1) in bf16x2 (`_bf16_tile`, ~2.75 instead of ~4.5 instructions per weight). The weight is read
once per `BM` rows of x, so for M <= BM the kernel reads 4.25 bits per weight and little else. The products are exact;
only the FP32 summation order differs from the torch reference (`kvx_core.mxfp4_linear`, which multiplies the
decoded weight in x's dtype).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import Status, require
from .dequant import F_MXFP4, e2m1_hi_bf16_x4, e2m1_lo_bf16_x4, e8m0_bf16_x2p126, mul_bf16
from .launch import interpreting
from .tiles import fp4_tile

GROUP = 32
FAST_MAX_SCALE = 128
"""Scale bytes up to this (2**1) let bf16 hold the factor 2**(scale - 1) of the decode without FP32."""
DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _bf16_tile(P, row, S, srow, nmask, BK: tl.constexpr, BN: tl.constexpr, ASM: tl.constexpr):
    """The FP4 tile as bf16 without FP32: E2M1 bits as e2m1 * 2**-126, times 2**(scale - 1) in bf16x2 (exact for
    scale bytes <= 128, i.e. |w| <= 12)."""
    NG: tl.constexpr = BK // 32
    b8 = tl.load(P + row[:, None, None] + (tl.arange(0, NG)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]),
                 mask=nmask[:, None, None], other=0)
    f = tl.broadcast_to(e8m0_bf16_x2p126(tl.load(S + srow[:, None] + tl.arange(0, NG)[None, :], mask=nmask[:, None],
                                                 other=0))[:, :, None], (BN, NG, 16))
    a = mul_bf16(e2m1_lo_bf16_x4(b8, ASM), f, ASM)
    b = mul_bf16(e2m1_hi_bf16_x4(b8, ASM), f, ASM)
    return tl.reshape(a, [BN, BK // 2]), tl.reshape(b, [BN, BK // 2])


@triton.jit
def _chunk(acc, X, x_row, mmask, P, row, S, srow, nmask, k0, BK: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr,
           ASM: tl.constexpr, FAST: tl.constexpr):
    """acc += W[rows, k0:k0+BK] . x[:, k0:k0+BK] as even and odd input halves."""
    kh = tl.arange(0, BK // 2)
    if FAST:
        a, b = _bf16_tile(P + k0 // 2, row, S + k0 // 32, srow, nmask, BK, BN, ASM)
    else:
        a, b = fp4_tile(P + k0 // 2, row, S + k0 // 32, srow, nmask, F_MXFP4, 32, BK, BN, DT, ASM)
    xe = tl.load(X + x_row[None, :] + (k0 + 2 * kh)[:, None], mask=mmask[None, :], other=0.0)
    xo = tl.load(X + x_row[None, :] + (k0 + 2 * kh + 1)[:, None], mask=mmask[None, :], other=0.0)
    acc = tl.dot(a, xe, acc)
    return tl.dot(b, xo, acc)


@triton.jit
def _mxfp4_linear_kernel(X, s_xm, P, S, O, s_om, M, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr, FAST: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = n < N
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    mmask = m < M
    row = n.to(tl.int64) * (K // 2)
    srow = n.to(tl.int64) * (K // 32)
    x_row = m.to(tl.int64) * s_xm
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    K_MAIN: tl.constexpr = K - K % BK
    for k0 in range(0, K_MAIN, BK):
        acc = _chunk(acc, X, x_row, mmask, P, row, S, srow, nmask, k0, BK, BN, DT, ASM, FAST)
    for k0 in range(K_MAIN, K, 32):  # the inputs past the last whole chunk, one group at a time
        acc = _chunk(acc, X, x_row, mmask, P, row, S, srow, nmask, k0, 32, BN, DT, ASM, FAST)
    tl.store(O + m.to(tl.int64)[None, :] * s_om + n[:, None], acc.to(O.dtype.element_ty),
             mask=nmask[:, None] & mmask[None, :])


def config(m: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) for `m` activation rows: the fastest of `bench_lm_head.py --sweep` on an
    H100 at 201088 x 2880 (`benchmarks/results/lm_head_mxfp4_h100.jsonl`)."""
    if m <= 16:
        return 16, 128, 64, 4, 3
    if m <= 32:
        return 32, 128, 64, 4, 3
    return 64, 256, 64, 4, 3


def mxfp4_linear_triton(x: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor,
                        tiles: tuple[int, int, int, int, int] | None = None, *, max_scale: int | None = None
                        ) -> torch.Tensor:
    """`x [M, K]` (bf16 / fp16, unit stride in K) times the MXFP4 weight `payload [N, K/2]`, `scales [N, K/32]`
    (uint8, contiguous) -> `[M, N]` in x's dtype. `max_scale`: the largest scale byte when the caller knows it
    (`Mxfp4Weight.max_scale`); <= 128 (|w| <= 12, every real lm_head) with bf16 x selects the decode without FP32.
    `tiles`: (BM, BN, BK, num_warps, num_stages) instead of `config(M)` (the benchmark's sweep)."""
    require(x.dim() == 2 and x.dtype in DTYPES and x.stride(1) == 1, Status.INVALID_ARGUMENT,
            f"MXFP4 linear kernel: x must be [M, K] bf16 / fp16 with unit stride in K, got {tuple(x.shape)} {x.dtype}")
    n, k = payload.shape[0], x.shape[1]
    require(payload.dtype == scales.dtype == torch.uint8 and payload.is_contiguous() and scales.is_contiguous()
            and tuple(payload.shape) == (n, k // 2) and tuple(scales.shape) == (n, k // GROUP) and k % GROUP == 0,
            Status.INVALID_ARGUMENT, "MXFP4 linear kernel: payload [N, K/2] and scales [N, K/32] contiguous uint8")
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or n == 0:
        return out
    bm, bn, bk, warps, stages = tiles or config(x.shape[0])
    grid = (triton.cdiv(n, bn), triton.cdiv(x.shape[0], bm))
    _mxfp4_linear_kernel[grid](x, x.stride(0), payload, scales, out, out.stride(0), x.shape[0], n, K=k, BM=bm, BN=bn,
                               BK=bk, DT=DTYPES[x.dtype], ASM=not interpreting(),
                               FAST=x.dtype == torch.bfloat16 and max_scale is not None and max_scale <= FAST_MAX_SCALE,
                               num_warps=warps,
                               num_stages=stages)
    return out
