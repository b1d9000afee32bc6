"""KVTC's GPU codec: quantize + pack (and unpack + dequantize) every coded range of a sequence in one launch.

Grid `(cdiv(rows, BM), sections)`; a program codes `BM` token rows of one range (`kvtc.layout.Section`, read from
the section table) straight into / out of the body buffer: IntX codes `round((y - min) / step)` (round half to even,
clamped; a constant component has step 0 and codes 0), FP8 the E4M3 RNE bits of `y / scale` (saturating at +-448),
both divisions IEEE with subnormals kept (`quant.div_ieee`), packed LSB-first; the first row block also writes the
range header and the fp16 min / step. Decoding is `min + code * step` (two roundings: launched without FMA
contraction) and `e4m3 * scale`. Both equal the torch reference (`kvtc.quant.pack_range` / `unpack_range`) bit for
bit, on the GPU and in the CPU interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import Status, require
from .launch import interpreting, next_pow2
from .quant import div_ieee, e4m3_f32, f16_bytes_f32, f32_to_f8_bits, rint

BM = 64
HEADER_BYTES = tl.constexpr(40)


@triton.jit
def _section(T, r):
    tb = T + r * 8
    return (tl.load(tb), tl.load(tb + 1).to(tl.int32), tl.load(tb + 2).to(tl.int32), tl.load(tb + 3) != 0,
            tl.load(tb + 4), tl.load(tb + 5), tl.load(tb + 6), tl.load(tb + 7))


@triton.jit
def _store_f16_bytes(OUT, at, v, mask):
    h = v.to(tl.float16).to(tl.uint16, bitcast=True)
    tl.store(OUT + at, (h & 0xFF).to(tl.uint8), mask=mask)
    tl.store(OUT + at + 1, (h >> 8).to(tl.uint8), mask=mask)


@triton.jit
def _pack_kernel(Y, ldy, MN, ST, SC, T, HDR, OUT, rows, BM: tl.constexpr, JB: tl.constexpr, CB: tl.constexpr,
                 ASM: tl.constexpr):
    pm = tl.program_id(0)
    r = tl.program_id(1)
    col, n, bits, fp8, hdr_at, meta_at, data_at, rb = _section(T, r)
    per = 8 // bits
    levels = ((1 << bits) - 1).to(tl.float32)
    m = pm * BM + tl.arange(0, BM)
    m_ok = m < rows
    j = tl.arange(0, JB)
    acc = tl.zeros((BM, JB), dtype=tl.int32)
    for t in tl.static_range(4):
        e = j * per + t
        c_ok = (e < n) & (t < per)
        ok = m_ok[:, None] & c_ok[None, :]
        y = tl.load(Y + m.to(tl.int64)[:, None] * ldy + (col + e)[None, :], mask=ok, other=0.0)
        if fp8:
            q = tl.minimum(tl.maximum(div_ieee(y, tl.load(SC + col + e, mask=c_ok, other=1.0)[None, :], ASM), -448.0),
                          448.0)
            code = f32_to_f8_bits(q, 3, 7) & 0xFF
        else:
            mn = tl.load(MN + col + e, mask=c_ok, other=0.0)[None, :]
            s = tl.load(ST + col + e, mask=c_ok, other=0.0)[None, :]
            v = rint(div_ieee(y - mn, tl.where(s > 0, s, 1.0), ASM))
            code = tl.where(s > 0, tl.minimum(tl.maximum(v, 0.0), levels), 0.0).to(tl.int32)
        acc = acc | (tl.where(ok, code, 0) << (t * bits))
    st_ok = m_ok[:, None] & (j < rb)[None, :]
    tl.store(OUT + data_at + m.to(tl.int64)[:, None] * rb + j[None, :], acc.to(tl.uint8), mask=st_ok)
    if pm == 0:
        k = tl.arange(0, 64)
        h = tl.load(HDR + r * HEADER_BYTES + k, mask=k < HEADER_BYTES)
        tl.store(OUT + hdr_at + k, h, mask=k < HEADER_BYTES)
        if not fp8:
            c = tl.arange(0, CB)
            in_range = c < n
            _store_f16_bytes(OUT, meta_at + 2 * c, tl.load(MN + col + c, mask=in_range, other=0.0), in_range)
            _store_f16_bytes(OUT, meta_at + 2 * n + 2 * c, tl.load(ST + col + c, mask=in_range, other=0.0), in_range)


@triton.jit
def _unpack_kernel(BODY, SC, T, Y, ldy, rows, BM: tl.constexpr, JB: tl.constexpr):
    pm = tl.program_id(0)
    r = tl.program_id(1)
    col, n, bits, fp8, hdr_at, meta_at, data_at, rb = _section(T, r)
    per = 8 // bits
    mask_bits = (1 << bits) - 1
    m = pm * BM + tl.arange(0, BM)
    m_ok = m < rows
    j = tl.arange(0, JB)
    b = tl.load(BODY + data_at + m.to(tl.int64)[:, None] * rb + j[None, :],
                mask=m_ok[:, None] & (j < rb)[None, :], other=0).to(tl.int32)
    for t in tl.static_range(4):
        e = j * per + t
        c_ok = (e < n) & (t < per)
        code = (b >> (t * bits)) & mask_bits
        if fp8:
            v = e4m3_f32(code) * tl.load(SC + col + e, mask=c_ok, other=1.0)[None, :]
        else:
            mn = f16_bytes_f32(BODY, meta_at + 2 * e, 0, c_ok)[None, :]
            s = f16_bytes_f32(BODY, meta_at + 2 * n + 2 * e, 0, c_ok)[None, :]
            v = mn + code.to(tl.float32) * s
        tl.store(Y + m.to(tl.int64)[:, None] * ldy + (col + e)[None, :], v, mask=m_ok[:, None] & c_ok[None, :])


def pack_sections(y: torch.Tensor, mn: torch.Tensor, step: torch.Tensor, scale: torch.Tensor, table: torch.Tensor,
                  headers: torch.Tensor, body: torch.Tensor, widest: tuple[int, int]) -> None:
    """Code every section of `table` (`BodyLayout.table`) from `y [rows, columns]` into `body` (see the module doc);
    `mn` / `step` fp16 per column, `scale` fp32 per column, `headers` the sections' 40-byte headers, `widest` the
    largest (row bytes, components) of a section."""
    rows = y.shape[0]
    if table.shape[0] == 0:
        return
    require(y.is_contiguous() and headers.numel() == 40 * table.shape[0], Status.INVALID_ARGUMENT,
            "KVTC pack: contiguous projections and one 40-byte header per section")
    jb, cb = (next_pow2(max(w, 1)) for w in widest)
    grid = (max(triton.cdiv(rows, BM), 1), table.shape[0])
    _pack_kernel[grid](y, y.stride(0), mn.float().contiguous(), step.float().contiguous(), scale.contiguous(),
                       table.contiguous(), headers, body, rows, BM=BM, JB=jb, CB=cb, ASM=not interpreting(),
                       num_warps=4, enable_fp_fusion=False)


def unpack_sections(body: torch.Tensor, scale: torch.Tensor, table: torch.Tensor, y: torch.Tensor,
                    widest: tuple[int, int]) -> None:
    """Decode every section of `table` from `body` into the columns of `y [rows, columns]` (float32, contiguous)."""
    rows = y.shape[0]
    if table.shape[0] == 0 or rows == 0:
        return
    require(y.is_contiguous() and y.dtype == torch.float32, Status.INVALID_ARGUMENT,
            "KVTC unpack: contiguous float32 output")
    jb = next_pow2(max(widest[0], 1))
    grid = (triton.cdiv(rows, BM), table.shape[0])
    _unpack_kernel[grid](body, scale.contiguous(), table.contiguous(), y, y.stride(0), rows, BM=BM, JB=jb,
                         num_warps=4, enable_fp_fusion=False)
