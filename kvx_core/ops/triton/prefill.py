"""Paged prefill / extend attention over the quantized pools (causal, GQA, softcap, sliding window, LSE).

Sequence b's new tokens are rows `qo_indptr[b]:qo_indptr[b+1]` of `q [T, Hq, D]` and its LAST
`q_len` cached tokens (already written); each attends to the cached prefix plus itself. One program =
BM rows of (token, query head) pairs of one sequence and one KV head (GQA packing: every K/V tile is
loaded once for all `Hq / H_kv` heads that share it), online softmax over BLOCK_N-token tiles with
both dots on tensor cores. K/V tiles are dequantized in registers exactly as decode.py does (payload
values exact in the dot dtype, per-head/per-token factors after the dot; 4-bit formats contract
even/odd head_dim halves separately). Hadamard formats: q is rotated and the output rotated back with
the torch matmul around the kernel. `window_left` follows FlashInfer, `paged_decode` and
`attention.paged_prefill(window=...)`: key j is attended iff `j >= pos - window_left`.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...errors import KvxError, Status
from ...formats import CacheFormat
from ..kernel_format import kernel_format
from .dequant import (
    F_FP8, F_INT4, F_INT8, F_MXFP4, F_NVFP4, TWO_POW_14, e2m1_hi_f16, e2m1_lo_f16, e4m3_byte_f16, e8m0_f32_x2p14,
    lse_or_empty, u4_hi_f16, u4_lo_f16, u8_code_f16,
)
from .launch import as_bytes, as_format, check_device, check_pool, dot_type, fp8_type, global_scale_arg, scale_args
from .quant import f16_bytes_f32

LOG2E = tl.constexpr(1.4426950408889634)
BLOCK_M = 128
"""Default rows of (token, query head) pairs per program; `prefill_plan` and the launch must agree."""


@triton.jit
def _fp4_tile(D_, row, S_, srow, tmask, F: tl.constexpr, GRP: tl.constexpr, D: tl.constexpr,
              BLOCK_N: tl.constexpr, DT: tl.constexpr):
    """[BLOCK_N, D/2] even (low nibble) and odd (high nibble) FP4 tiles, scaled by the group byte
    (NVFP4: e2m1 * 2**-14 * E4M3 in fp16, exact; MXFP4: e2m1 * 2**E in bf16, exact)."""
    NG: tl.constexpr = D // GRP
    GB: tl.constexpr = GRP // 2
    offs_g = tl.arange(0, NG)
    offs_gb = tl.arange(0, GB)
    b8 = tl.load(D_ + row[:, None, None] + (offs_g[None, :, None] * GB + offs_gb[None, None, :]),
                 mask=tmask[:, None, None], other=0)
    sb = tl.load(S_ + srow[:, None] + offs_g[None, :], mask=tmask[:, None], other=0)
    if F == F_NVFP4:
        s16 = e4m3_byte_f16(sb)[:, :, None]
        a3 = e2m1_lo_f16(b8) * s16
        b3 = e2m1_hi_f16(b8) * s16
    else:
        s32 = e8m0_f32_x2p14(sb)[:, :, None]
        a3 = e2m1_lo_f16(b8).to(tl.float32) * s32
        b3 = e2m1_hi_f16(b8).to(tl.float32) * s32
    return tl.reshape(a3, [BLOCK_N, D // 2]).to(DT), tl.reshape(b3, [BLOCK_N, D // 2]).to(DT)


@triton.jit
def _prefill_kernel(
    Q, s_qt, s_qh, O, s_ot, s_oh, LSE, s_lt, s_lh,
    KD, s_kdb, s_kdh, s_kdt, KS, s_ksb, s_ksh, s_kst,
    VD, s_vdb, s_vdh, s_vdt, VS, s_vsb, s_vsh, s_vst,
    KG, VG, BT, s_btb, SEQ, QO, TILE_SEQ, TILE_ROW,
    sm_scale, softcap, window_left,
    BS: tl.constexpr, QH: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    KF: tl.constexpr, VF: tl.constexpr, KGRP: tl.constexpr, VGRP: tl.constexpr,
    KDT: tl.constexpr, VDT: tl.constexpr, KIEEE: tl.constexpr, VIEEE: tl.constexpr,
    KGS: tl.constexpr, VGS: tl.constexpr, K8: tl.constexpr, V8: tl.constexpr,
    CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(TILE_SEQ + tile)
    row0 = tl.load(TILE_ROW + tile)
    q0 = tl.load(QO + b)
    q_len = tl.load(QO + b + 1) - q0
    seq_len = tl.load(SEQ + b)
    prefix = seq_len - q_len

    KPACK: tl.constexpr = KF == F_INT4 or KF == F_MXFP4 or KF == F_NVFP4
    VPACK: tl.constexpr = VF == F_INT4 or VF == F_MXFP4 or VF == F_NVFP4
    KINT: tl.constexpr = KF == F_INT8 or KF == F_INT4
    VINT: tl.constexpr = VF == F_INT8 or VF == F_INT4
    HD: tl.constexpr = D // 2

    r = row0 + tl.arange(0, BM)
    tok = r // QH
    rvalid = tok < q_len
    hq = h * QH + r % QH
    qpos = prefix + tok
    q_row = (q0 + tok).to(tl.int64) * s_qt + hq.to(tl.int64) * s_qh

    offs_d = tl.arange(0, D)
    offs_hd = tl.arange(0, HD)
    if KPACK:
        qa = tl.load(Q + q_row[:, None] + 2 * offs_hd[None, :], mask=rvalid[:, None], other=0.0).to(KDT)
        qb = tl.load(Q + q_row[:, None] + 2 * offs_hd[None, :] + 1, mask=rvalid[:, None], other=0.0).to(KDT)
    else:
        qa = tl.load(Q + q_row[:, None] + offs_d[None, :], mask=rvalid[:, None], other=0.0).to(KDT)
    if KINT:
        qsum = tl.sum(qa.to(tl.float32), axis=1)
        if KPACK:
            qsum += tl.sum(qb.to(tl.float32), axis=1)

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
    if SOFTCAP:
        k_fac = k_fac / softcap

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    if VPACK:
        acc_a = tl.zeros([BM, HD], tl.float32)
        acc_b = tl.zeros([BM, HD], tl.float32)
    else:
        acc_a = tl.zeros([BM, D], tl.float32)
    if VINT:
        pm = tl.zeros([BM], tl.float32)

    tok_last = tl.minimum(q_len - 1, (row0 + BM - 1) // QH)
    hi = seq_len
    full_end = seq_len  # keys below full_end are visible to every row of the program: no score mask
    if CAUSAL:
        hi = prefix + tok_last + 1
        full_end = prefix + row0 // QH + 1
    lo = 0
    if WINDOW:
        lo = tl.maximum(prefix + row0 // QH - window_left, 0)
        full_end = lo
    full_end = lo + (tl.maximum(full_end - lo, 0) // BLOCK_N) * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = BT + b.to(tl.int64) * s_btb
    h64 = h.to(tl.int64)

    for start in range(lo, hi, BLOCK_N):
        t = start + offs_n
        tmask = t < hi
        phys = tl.load(bt_row + t // BS, mask=tmask, other=0).to(tl.int64)
        off = (t % BS).to(tl.int64)
        krow = phys * s_kdb + h64 * s_kdh + off * s_kdt
        ksrow = phys * s_ksb + h64 * s_ksh + off * s_kst
        if KPACK:
            if KF == F_INT4:
                kb8 = tl.load(KD + krow[:, None] + offs_hd[None, :], mask=tmask[:, None], other=0)
                ka_t = u4_lo_f16(kb8).to(KDT)
                kb_t = u4_hi_f16(kb8).to(KDT)
            else:
                ka_t, kb_t = _fp4_tile(KD, krow, KS, ksrow, tmask, KF, KGRP, D, BLOCK_N, KDT)
            s = tl.dot(qa, tl.trans(ka_t)) + tl.dot(qb, tl.trans(kb_t))
        else:
            kraw = tl.load(KD + krow[:, None] + offs_d[None, :], mask=tmask[:, None], other=0)
            if KF == F_INT8:
                k_t = u8_code_f16(kraw).to(KDT)
            elif KF == F_FP8:
                k_t = kraw.to(K8, bitcast=True).to(KDT)
            else:
                k_t = kraw.to(KDT)
            if KIEEE:
                s = tl.dot(qa, tl.trans(k_t), input_precision="ieee")
            else:
                s = tl.dot(qa, tl.trans(k_t))
        if KINT:
            s = s * f16_bytes_f32(KS, ksrow, 0, tmask)[None, :] + qsum[:, None] * f16_bytes_f32(KS, ksrow, 2, tmask)[None, :]
        s = s * k_fac
        if SOFTCAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0))
        s = s * LOG2E
        if start >= full_end:  # tiles on the causal diagonal, past the end or in the window edge
            allowed = tmask[None, :] & rvalid[:, None]
            if CAUSAL:
                allowed = allowed & (t[None, :] <= qpos[:, None])
            if WINDOW:
                allowed = allowed & (t[None, :] >= qpos[:, None] - window_left)
            s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

        vrow = phys * s_vdb + h64 * s_vdh + off * s_vdt
        vsrow = phys * s_vsb + h64 * s_vsh + off * s_vst
        acc_a = acc_a * alpha[:, None]
        if VPACK:
            acc_b = acc_b * alpha[:, None]
            if VF == F_INT4:
                vb8 = tl.load(VD + vrow[:, None] + offs_hd[None, :], mask=tmask[:, None], other=0)
                va_t = u4_lo_f16(vb8)
                vb_t = u4_hi_f16(vb8)
            else:
                va_t, vb_t = _fp4_tile(VD, vrow, VS, vsrow, tmask, VF, VGRP, D, BLOCK_N, VDT)
        else:
            vraw = tl.load(VD + vrow[:, None] + offs_d[None, :], mask=tmask[:, None], other=0)
            if VF == F_INT8:
                va_t = u8_code_f16(vraw)
            elif VF == F_FP8:
                va_t = vraw.to(V8, bitcast=True).to(VDT)
            else:
                va_t = vraw.to(VDT)
        if VINT:
            v_sc = f16_bytes_f32(VS, vsrow, 0, tmask)
            v_mn = f16_bytes_f32(VS, vsrow, 2, tmask)
            v_smax = tl.max(v_sc, axis=0)
            v_smax = tl.where(v_smax > 0, v_smax, 1.0)
            w = (p * (v_sc / v_smax)[None, :]).to(VDT)
            pm = pm * alpha + tl.sum(p * v_mn[None, :], axis=1)
            acc_a += tl.dot(w, va_t.to(VDT)) * v_smax
            if VPACK:
                acc_b += tl.dot(w, vb_t.to(VDT)) * v_smax
        elif VPACK:
            acc_a += tl.dot(p.to(VDT), va_t)
            acc_b += tl.dot(p.to(VDT), vb_t)
        elif VIEEE:
            acc_a += tl.dot(p, va_t, input_precision="ieee")
        else:
            acc_a += tl.dot(p.to(VDT), va_t)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    inv_l = 1.0 / l_safe
    add = tl.zeros([BM], tl.float32)
    if VINT:
        add = pm
    o_row = (q0 + tok).to(tl.int64) * s_ot + hq.to(tl.int64) * s_oh
    if VPACK:
        oa = (acc_a * v_fac + add[:, None]) * inv_l[:, None]
        ob = (acc_b * v_fac + add[:, None]) * inv_l[:, None]
        tl.store(O + o_row[:, None] + 2 * offs_hd[None, :], oa.to(O.dtype.element_ty), mask=rvalid[:, None])
        tl.store(O + o_row[:, None] + 2 * offs_hd[None, :] + 1, ob.to(O.dtype.element_ty), mask=rvalid[:, None])
    else:
        oa = (acc_a * v_fac + add[:, None]) * inv_l[:, None]
        tl.store(O + o_row[:, None] + offs_d[None, :], oa.to(O.dtype.element_ty), mask=rvalid[:, None])
    lse = lse_or_empty(l_i, (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(LSE + (q0 + tok).to(tl.int64) * s_lt + hq.to(tl.int64) * s_lh, lse, mask=rvalid)


def _default_block_n(kk, kv) -> int:
    """Key tile (H200 sweep, benchmarks/results/prefill_tile_sweep_h200.jsonl, at BLOCK_M=128 / 8 warps): 128 for
    bf16 / fp16 / FP8 / FP4 caches; 64 for INT8 / INT4 (their per-key affine epilogue on a [BM, 128] score
    tile spills: 128 keys is 15-25% slower); 16 for fp32 caches (IEEE fp32 dots)."""
    if kk.storage == torch.float32 or kv.storage == torch.float32:
        return 16
    return 64 if kk.affine or kv.affine else 128


def prefill_plan(qo_indptr: torch.Tensor, qh: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """Work list (one host sync, like FlashInfer's plan): per program its sequence and first packed row."""
    ip = qo_indptr.to("cpu", torch.int64)
    rows = (ip[1:] - ip[:-1]) * qh
    n = (rows + block_m - 1) // block_m
    seq = torch.repeat_interleave(torch.arange(n.numel()), n)
    first = torch.cumsum(n, 0) - n
    row = (torch.arange(int(n.sum())) - first[seq]) * block_m
    dev = qo_indptr.device
    return seq.to(dev, torch.int32), row.to(dev, torch.int32)


def paged_prefill(q: torch.Tensor, qo_indptr: torch.Tensor, k_data, k_scales, v_data, v_scales, k_gs, v_gs,
                  block_table: torch.Tensor, seq_lens: torch.Tensor, fmt: CacheFormat | str, *, causal: bool = True,
                  sm_scale: float | None = None, softcap: float | None = None, window_left: int | None = None,
                  plan: tuple[torch.Tensor, torch.Tensor] | None = None, out=None, lse=None,
                  block_m: int = BLOCK_M, block_n: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None):
    """Prefill/extend attention -> (`out [T, Hq, D]` q.dtype, `lse [T, Hq]` fp32 natural log).

    `qo_indptr` int32 `[B+1]`; `seq_lens` int32 `[B]` = cached lengths INCLUDING the new tokens.
    `plan` = `prefill_plan(qo_indptr, Hq // H_kv, block_m)` may be computed once and reused.
    """
    fmt = as_format(fmt)
    check_device(q, qo_indptr, k_data, v_data, block_table, seq_lens)
    if q.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float16) or q.stride(2) != 1:
        raise KvxError(Status.INVALID_ARGUMENT, f"q must be bf16/fp16 [T, Hq, D] with a contiguous last dim, got {q.dtype} {tuple(q.shape)}")
    t, hq, d = q.shape
    kk, kv = kernel_format(fmt.k), kernel_format(fmt.v)
    fmt.check_head_dim(d)
    if d & (d - 1) or d < 32:
        raise KvxError(Status.UNSUPPORTED, f"paged_prefill supports power-of-two head_dim >= 32, got {d}")
    check_pool("K", k_data, kk, d)
    check_pool("V", v_data, kv, d)
    nb, hkv, bs, _ = k_data.shape
    bsz = seq_lens.numel()
    if hq % hkv or tuple(v_data.shape[:3]) != (nb, hkv, bs):
        raise KvxError(Status.INVALID_ARGUMENT, f"Hq={hq} must be a multiple of H_kv={hkv}; K/V pools must match")
    if qo_indptr.numel() != bsz + 1 or block_table.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] != bsz or block_table.stride(1) != 1 or seq_lens.dtype != torch.int32:
        raise KvxError(Status.INVALID_ARGUMENT, "need qo_indptr [B+1], int32 block_table [B, max_blocks], int32 seq_lens [B]")
    qh = hq // hkv
    if plan is None:
        plan = prefill_plan(qo_indptr, qh, block_m)
    ks = scale_args("K", k_scales, k_data, kk, fmt.k, d)
    vs = scale_args("V", v_scales, v_data, kv, fmt.v, d)
    if block_n is None:
        block_n = _default_block_n(kk, kv)
    if num_warps is None:
        num_warps = 8 if block_m >= 128 else 4
    if num_stages is None:
        num_stages = 2
    qq = fmt.rotate_q(q)
    o = torch.empty_like(q) if out is None or fmt.rotate else out
    if lse is None:
        lse = torch.empty(t, hq, dtype=torch.float32, device=q.device)
    if plan[0].numel():
        _prefill_kernel[(plan[0].numel(), hkv)](
            qq, qq.stride(0), qq.stride(1), o, o.stride(0), o.stride(1), lse, lse.stride(0), lse.stride(1),
            as_bytes(k_data), k_data.stride(0), k_data.stride(1), k_data.stride(2), *ks,
            as_bytes(v_data), v_data.stride(0), v_data.stride(1), v_data.stride(2), *vs,
            global_scale_arg(k_gs, kk, hkv, q.device), global_scale_arg(v_gs, kv, hkv, q.device),
            block_table, block_table.stride(0), seq_lens, qo_indptr, plan[0], plan[1],
            1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale), float(softcap) if softcap else 1.0,
            int(window_left) if window_left is not None and window_left >= 0 else 0,
            BS=bs, QH=qh, BM=block_m, D=d, BLOCK_N=block_n,
            KF=kk.code, VF=kv.code, KGRP=kk.group or 16, VGRP=kv.group or 16,
            KDT=dot_type(kk, q.dtype), VDT=dot_type(kv, q.dtype),
            KIEEE=kk.storage == torch.float32, VIEEE=kv.storage == torch.float32,
            KGS=kk.global_scale, VGS=kv.global_scale, K8=fp8_type(kk), V8=fp8_type(kv),
            CAUSAL=causal, SOFTCAP=bool(softcap), WINDOW=window_left is not None and window_left >= 0,
            num_warps=num_warps, num_stages=num_stages,
        )
    if fmt.rotate:
        o = fmt.unrotate_output(o)
        if out is not None:
            out.copy_(o)
            o = out
    return o, lse
