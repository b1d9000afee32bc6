"""Paged decode attention over quantized KV pools (split-KV / flash-decoding + a reduction kernel).

One program = (sequence b, KV head h, split s): it loads each K/V tile of its token range once for
all `QH = Hq / H_kv` query heads that share the KV head (GQA), dequantizes in registers (see
`dequant.py`), and runs the online softmax with the tile dots on tensor cores (M = QH padded to 16).
4-bit formats are never interleaved in registers: even head_dim elements (low nibbles) and odd ones
(high nibbles) are contracted separately against the even / odd query halves, and the V halves
accumulate into even / odd output columns. `merge.py` merges the splits (LSE-weighted), rotates the output
back for Hadamard formats, casts to the query dtype and writes the LSE. `launch_decode` (below) launches this
kernel; `kvx_core/ops/decode.py` checks the arguments, chooses the backend and the splits, and merges.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..kernel_format import KernelFormat, kernel_format
from .dequant import (
    F_FP8, F_INT4, F_INT8, F_MXFP4, F_NVFP4, TWO_POW_14, TWO_POW_24, dot_f32, e2m1_hi_f16_x4, e2m1_lo_f16_x4,
    e4m3_byte_f16, e8m0_f32_x2p14, hadamard_tile, lse_or_empty, u4_hi_f16_sub, u4_lo_f16_sub, u8_f16_sub,
)
from .launch import as_bytes, dot_type, fp8_type, interpreting, next_pow2
from .quant import f16_bytes_f32

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _load_q_part(Q, q_row, rmask, D: tl.constexpr, BM: tl.constexpr, PART: tl.constexpr, HALF: tl.constexpr,
                 ROTATE: tl.constexpr, DT: tl.constexpr, RSD: tl.constexpr):
    """Query tile as the K side needs it: full [BM, D] (HALF=False) or its even/odd half (PART 0/1)."""
    if ROTATE:
        offs_d = tl.arange(0, D)
        q = tl.load(Q + q_row[:, None] + offs_d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        if HALF:
            hm = hadamard_tile(D, D // 2, 1, 0, 2, PART)
        else:
            hm = hadamard_tile(D, D, 1, 0, 1, 0)
        qr = dot_f32(q, hm, tl.bfloat16) * RSD
        return qr.to(DT)
    else:
        if HALF:
            offs = tl.arange(0, D // 2) * 2 + PART
        else:
            offs = tl.arange(0, D)
        q = tl.load(Q + q_row[:, None] + offs[None, :], mask=rmask[:, None], other=0.0)
        return q.to(DT)


@triton.jit
def _decode_kernel(
    Q, s_qb, s_qh,
    KD, s_kdb, s_kdh, s_kdt,
    KS, s_ksb, s_ksh, s_kst,
    VD, s_vdb, s_vdh, s_vdt,
    VS, s_vsb, s_vsh, s_vst,
    KG, VG,
    BT, s_btb, SEQ,
    MO, s_mob, s_moh, s_mos,
    ML, s_mlb, s_mlh,
    sm_scale, softcap, window,
    BS: tl.constexpr, QH: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    KF: tl.constexpr, VF: tl.constexpr, KGRP: tl.constexpr, VGRP: tl.constexpr,
    KDT: tl.constexpr, VDT: tl.constexpr, KIEEE: tl.constexpr, VIEEE: tl.constexpr,
    KGS: tl.constexpr, VGS: tl.constexpr, K8: tl.constexpr, V8: tl.constexpr,
    ROTATE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, RSD: tl.constexpr, ASM: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    nsp = tl.num_programs(2)

    seq_len = tl.load(SEQ + b)
    tok_lo = 0
    if WINDOW:
        tok_lo = tl.maximum(seq_len - 1 - window, 0)
    n_tok = seq_len - tok_lo
    chunk = tl.cdiv(tl.cdiv(n_tok, nsp), BLOCK_N) * BLOCK_N
    lo = tok_lo + sp * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    KPACK: tl.constexpr = KF == F_INT4 or KF == F_MXFP4 or KF == F_NVFP4
    VPACK: tl.constexpr = VF == F_INT4 or VF == F_MXFP4 or VF == F_NVFP4
    KINT: tl.constexpr = KF == F_INT8 or KF == F_INT4
    VINT: tl.constexpr = VF == F_INT8 or VF == F_INT4
    HD: tl.constexpr = D // 2

    rows = tl.arange(0, BM)
    rmask = rows < QH
    hq = h * QH + rows
    q_row = b.to(tl.int64) * s_qb + hq.to(tl.int64) * s_qh

    # ---- query (rotated / split into even-odd halves as the K format needs) ----
    if KPACK:
        qa = _load_q_part(Q, q_row, rmask, D, BM, 0, True, ROTATE, KDT, RSD)
        qb = _load_q_part(Q, q_row, rmask, D, BM, 1, True, ROTATE, KDT, RSD)
    else:
        qa = _load_q_part(Q, q_row, rmask, D, BM, 0, False, ROTATE, KDT, RSD)
    if KINT:
        qsum = tl.sum(qa.to(tl.float32), axis=1)
        if KPACK:
            qsum += tl.sum(qb.to(tl.float32), axis=1)

    # per-head constant factors applied after the dots
    k_fac = sm_scale
    if KGS:
        k_fac = k_fac * tl.load(KG + h)
    if KF == F_NVFP4:
        k_fac = k_fac * TWO_POW_14
    v_fac = 1.0
    if VGS:
        v_fac = v_fac * tl.load(VG + h)
    if VF == F_NVFP4:
        v_fac = v_fac * TWO_POW_14
    if VINT:
        v_fac = v_fac * TWO_POW_24
    if SOFTCAP:
        k_fac = k_fac / softcap  # s = softcap * tanh(qk * sm_scale / softcap)

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    if VPACK:
        acc_a = tl.zeros([BM, HD], tl.float32)
        acc_b = tl.zeros([BM, HD], tl.float32)
    else:
        acc_a = tl.zeros([BM, D], tl.float32)
    if VINT:
        pm = tl.zeros([BM], tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_hd = tl.arange(0, HD)
    bt_row = BT + b.to(tl.int64) * s_btb
    h64 = h.to(tl.int64)

    for start in range(lo, hi, BLOCK_N):
        t = start + offs_n
        tmask = t < hi
        phys = tl.load(bt_row + t // BS, mask=tmask, other=0).to(tl.int64)
        off = (t % BS).to(tl.int64)

        # ------------------------------------------------------------ K tile -> scores
        krow = phys * s_kdb + h64 * s_kdh + off * s_kdt
        if KPACK:
            if KF == F_INT4:
                kb8 = tl.load(KD + krow[:, None] + offs_hd[None, :], mask=tmask[:, None], other=0)
                ka_t = u4_lo_f16_sub(kb8, ASM)
                kb_t = u4_hi_f16_sub(kb8, ASM)
            else:
                KG_N: tl.constexpr = D // KGRP
                KGB: tl.constexpr = KGRP // 2
                offs_g = tl.arange(0, KG_N)
                offs_gb = tl.arange(0, KGB)
                kb8 = tl.load(KD + krow[:, None, None] + (offs_g[None, :, None] * KGB + offs_gb[None, None, :]),
                              mask=tmask[:, None, None], other=0)
                ksrow = phys * s_ksb + h64 * s_ksh + off * s_kst
                ksb = tl.load(KS + ksrow[:, None] + offs_g[None, :], mask=tmask[:, None], other=0)
                if KF == F_NVFP4:
                    ks16 = e4m3_byte_f16(ksb)[:, :, None]
                    ka3 = e2m1_lo_f16_x4(kb8, ASM) * ks16
                    kb3 = e2m1_hi_f16_x4(kb8, ASM) * ks16
                else:
                    ks32 = e8m0_f32_x2p14(ksb)[:, :, None]
                    ka3 = e2m1_lo_f16_x4(kb8, ASM).to(tl.float32) * ks32
                    kb3 = e2m1_hi_f16_x4(kb8, ASM).to(tl.float32) * ks32
                ka_t = tl.reshape(ka3, [BLOCK_N, HD]).to(KDT)
                kb_t = tl.reshape(kb3, [BLOCK_N, HD]).to(KDT)
            s = tl.dot(qa, tl.trans(ka_t)) + tl.dot(qb, tl.trans(kb_t))
        else:
            kraw = tl.load(KD + krow[:, None] + offs_d[None, :], mask=tmask[:, None], other=0)
            if KF == F_INT8:
                k_t = u8_f16_sub(kraw, ASM)
            elif KF == F_FP8:
                k_t = kraw.to(K8, bitcast=True).to(KDT)
            else:
                k_t = kraw.to(KDT)
            if KIEEE:
                s = tl.dot(qa, tl.trans(k_t), input_precision="ieee")
            else:
                s = tl.dot(qa, tl.trans(k_t))
        if KINT:
            ksrow = phys * s_ksb + h64 * s_ksh + off * s_kst
            k_sc = f16_bytes_f32(KS, ksrow, 0, tmask) * TWO_POW_24  # codes enter the dot as fp16 c * 2**-24
            k_mn = f16_bytes_f32(KS, ksrow, 2, tmask)
            s = s * k_sc[None, :] + qsum[:, None] * k_mn[None, :]
        s = s * k_fac
        if SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf, no overflow NaN
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0))
        s = s * LOG2E
        s = tl.where(tmask[None, :], s, float("-inf"))

        # ------------------------------------------------------------ online softmax
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

        # ------------------------------------------------------------ V tile
        vrow = phys * s_vdb + h64 * s_vdh + off * s_vdt
        if VPACK:
            acc_a = acc_a * alpha[:, None]
            acc_b = acc_b * alpha[:, None]
            if VF == F_INT4:
                vb8 = tl.load(VD + vrow[:, None] + offs_hd[None, :], mask=tmask[:, None], other=0)
                va_t = u4_lo_f16_sub(vb8, ASM)
                vb_t = u4_hi_f16_sub(vb8, ASM)
            else:
                VG_N: tl.constexpr = D // VGRP
                VGB: tl.constexpr = VGRP // 2
                offs_vg = tl.arange(0, VG_N)
                offs_vgb = tl.arange(0, VGB)
                vb8 = tl.load(VD + vrow[:, None, None] + (offs_vg[None, :, None] * VGB + offs_vgb[None, None, :]),
                              mask=tmask[:, None, None], other=0)
                vsrow = phys * s_vsb + h64 * s_vsh + off * s_vst
                vsb = tl.load(VS + vsrow[:, None] + offs_vg[None, :], mask=tmask[:, None], other=0)
                if VF == F_NVFP4:
                    vs16 = e4m3_byte_f16(vsb)[:, :, None]
                    va3 = e2m1_lo_f16_x4(vb8, ASM) * vs16
                    vb3 = e2m1_hi_f16_x4(vb8, ASM) * vs16
                else:
                    vs32 = e8m0_f32_x2p14(vsb)[:, :, None]
                    va3 = e2m1_lo_f16_x4(vb8, ASM).to(tl.float32) * vs32
                    vb3 = e2m1_hi_f16_x4(vb8, ASM).to(tl.float32) * vs32
                va_t = tl.reshape(va3, [BLOCK_N, HD]).to(VDT)
                vb_t = tl.reshape(vb3, [BLOCK_N, HD]).to(VDT)
        else:
            acc_a = acc_a * alpha[:, None]
            vraw = tl.load(VD + vrow[:, None] + offs_d[None, :], mask=tmask[:, None], other=0)
            if VF == F_INT8:
                va_t = u8_f16_sub(vraw, ASM)
            elif VF == F_FP8:
                va_t = vraw.to(V8, bitcast=True).to(VDT)
            else:
                va_t = vraw.to(VDT)
        if VINT:
            vsrow = phys * s_vsb + h64 * s_vsh + off * s_vst
            v_sc = f16_bytes_f32(VS, vsrow, 0, tmask)
            v_mn = f16_bytes_f32(VS, vsrow, 2, tmask)
            v_smax = tl.max(v_sc, axis=0)
            v_smax = tl.where(v_smax > 0, v_smax, 1.0)
            w = (p * (v_sc / v_smax)[None, :]).to(VDT)
            pm = pm * alpha + tl.sum(p * v_mn[None, :], axis=1)
            acc_a += tl.dot(w, va_t.to(VDT)) * v_smax
            if VPACK:
                acc_b += tl.dot(w, vb_t.to(VDT)) * v_smax
        else:
            pv = p.to(VDT)
            if VPACK:
                acc_a += tl.dot(pv, va_t)
                acc_b += tl.dot(pv, vb_t)
            else:
                if VIEEE:
                    acc_a += tl.dot(p, va_t, input_precision="ieee")
                else:
                    acc_a += tl.dot(pv, va_t)

    # ---- store this split's normalised partial output and its log2-sum-exp ----
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    inv_l = 1.0 / l_safe
    lse2 = lse_or_empty(l_i, m_i + tl.log2(l_safe))
    mo_row = b.to(tl.int64) * s_mob + hq.to(tl.int64) * s_moh + sp * s_mos
    tl.store(ML + b.to(tl.int64) * s_mlb + hq.to(tl.int64) * s_mlh + sp, lse2, mask=rmask)
    if VINT:
        add = pm
    else:
        add = tl.zeros([BM], tl.float32)
    if VPACK:
        oa = (acc_a * v_fac + add[:, None]) * inv_l[:, None]
        ob = (acc_b * v_fac + add[:, None]) * inv_l[:, None]
        tl.store(MO + mo_row[:, None] + offs_hd[None, :] * 2, oa, mask=rmask[:, None])
        tl.store(MO + mo_row[:, None] + offs_hd[None, :] * 2 + 1, ob, mask=rmask[:, None])
    else:
        oa = (acc_a * v_fac + add[:, None]) * inv_l[:, None]
        tl.store(MO + mo_row[:, None] + offs_d[None, :], oa, mask=rmask[:, None])


def default_block_n(kk: KernelFormat, kv: KernelFormat, head_dim: int) -> int:
    """Key tile of the Triton decode for K / V kernel formats `kk` / `kv`."""
    if kk.storage == torch.float32 or kv.storage == torch.float32:
        return 16
    if kk.storage in (torch.bfloat16, torch.float16) or kv.storage in (torch.bfloat16, torch.float16):
        return 64 if head_dim <= 128 else 32
    if kk.packed and kv.packed:
        # H200, B=64 32k: 64 beat 128 by 9-10% on int4 and nvfp4 (benchmarks/results/decode_triton_splits_blockn_h200.jsonl)
        return 64
    # 8-bit payloads (H200 sweep winners: benchmarks/results/decode_triton_tile_sweep_h200.jsonl)
    return 128 if head_dim <= 128 else 64


def launch_decode(q, k_data, ks, v_data, vs, kg, vg, block_table, seq_lens, fmt, mid_o, mid_l, sm_scale,
                  softcap, window, block_n, num_warps, num_stages) -> None:
    """The Triton split-KV decode kernel on checked arguments: per-split partials into `mid_o [B, Hq, S, D]` /
    `mid_l [B, Hq, S]` (`ks` / `vs`: `launch.scale_args`; `kg` / `vg`: `launch.global_scale_arg`)."""
    bsz, hq, d = q.shape
    _, hkv, bs, _ = k_data.shape
    kk, kv = kernel_format(fmt.k), kernel_format(fmt.v)
    qh = hq // hkv
    bm = max(16, next_pow2(qh))
    num_splits = mid_o.shape[2]
    kdt, vdt = dot_type(kk, q.dtype), dot_type(kv, q.dtype)
    rsd = 1.0 / math.sqrt(d)
    if block_n is None:
        block_n = default_block_n(kk, kv, d)
    if num_warps is None:
        # H200 sweep (benchmarks/results/decode_triton_tile_sweep_h200.jsonl): 8 warps lost up to ~40% of throughput
        num_warps = 4
    if num_stages is None:
        num_stages = 2 if (kk.packed or kv.packed) else 3
    _decode_kernel[(bsz, hkv, num_splits)](
        q, q.stride(0), q.stride(1),
        as_bytes(k_data), k_data.stride(0), k_data.stride(1), k_data.stride(2),
        ks[0], ks[1], ks[2], ks[3],
        as_bytes(v_data), v_data.stride(0), v_data.stride(1), v_data.stride(2),
        vs[0], vs[1], vs[2], vs[3],
        kg, vg,
        block_table, block_table.stride(0), seq_lens,
        mid_o, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_l, mid_l.stride(0), mid_l.stride(1),
        sm_scale, float(softcap) if softcap else 1.0, int(window) if window is not None and window >= 0 else 0,
        BS=bs, QH=qh, BM=bm, D=d, BLOCK_N=block_n,
        KF=kk.code, VF=kv.code, KGRP=kk.group or 16, VGRP=kv.group or 16,
        KDT=kdt, VDT=vdt, KIEEE=kk.storage == torch.float32, VIEEE=kv.storage == torch.float32,
        KGS=kk.global_scale, VGS=kv.global_scale, K8=fp8_type(kk), V8=fp8_type(kv),
        ROTATE=fmt.rotate, SOFTCAP=bool(softcap), WINDOW=window is not None and window >= 0, RSD=rsd,
        ASM=not interpreting(), num_warps=num_warps, num_stages=num_stages,
    )
