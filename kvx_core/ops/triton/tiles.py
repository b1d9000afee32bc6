"""`@triton.jit` steps shared by the Triton attention kernels (decode.py, prefill.py): the per-head factors and
the query row sums, the K/V tile dequantization, the scores of a K tile, the online-softmax step, the P.V
accumulation and the final normalisation. A new cache format is one branch in `kv_tile` (and, if it has
per-token or per-head factors, in `scores` / `v_weights` / `head_factors`).

Tiles hold *payload values* that are exact in the dot dtype; per-token and per-head factors are applied after
the dots (see dequant.py). Packed 4-bit formats give two [BLOCK_N, D/2] tiles, the even (low nibble) and odd
(high nibble) head_dim halves, contracted separately; the other formats one [BLOCK_N, D] tile.
Two exact encodings of INT4 / INT8 codes c, chosen by the kernel with `SUB` (each kernel keeps the one it was
tuned with, so its instructions are those it had before these steps were shared):
- SUB=True (decode): the fp16 whose bits are c, i.e. c * 2**-24, one byte permute per two elements with ASM;
  `scores` and `head_factors` undo the 2**-24;
- SUB=False (prefill): c itself, via the (1024 + c) - 1024 fp16 trick.
`ASM` selects the inline-PTX 4-byte decoders (the CPU interpreter and the prefill kernel use the portable forms;
same bits).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .dequant import (
    F_FP8,
    F_INT4,
    F_INT8,
    F_MXFP4,
    F_NVFP4,
    TWO_POW_14,
    TWO_POW_24,
    e2m1_hi_f16_x4,
    e2m1_lo_f16_x4,
    e4m3_byte_f16,
    e8m0_f32_x2p14,
    lse_or_empty,
    u4_hi_f16,
    u4_hi_f16_sub,
    u4_lo_f16,
    u4_lo_f16_sub,
    u8_code_f16,
    u8_f16_sub,
)
from .quant import f16_bytes_f32

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def load_q(Q, q_row, rmask, F: tl.constexpr, D: tl.constexpr, DT: tl.constexpr, QS, h, HAS_QS: tl.constexpr):
    """The query rows `q_row` as K format F's dots take them, in dtype DT: (even, odd) head_dim halves for packed K
    (low / high nibbles are contracted separately), else (the whole row, the same). HAS_QS: times KV head h's key
    smoothing `QS [Hkv, D]` (FP32) first (`ops.smoothing`)."""
    if F == F_INT4 or F == F_MXFP4 or F == F_NVFP4:
        offs = tl.arange(0, D // 2) * 2
        qa = tl.load(Q + q_row[:, None] + offs[None, :], mask=rmask[:, None], other=0.0)
        qb = tl.load(Q + q_row[:, None] + offs[None, :] + 1, mask=rmask[:, None], other=0.0)
        if HAS_QS:
            qa = qa.to(tl.float32) * tl.load(QS + h * D + offs)[None, :]
            qb = qb.to(tl.float32) * tl.load(QS + h * D + offs + 1)[None, :]
        qa = qa.to(DT)
        qb = qb.to(DT)
    else:
        offs = tl.arange(0, D)
        qa = tl.load(Q + q_row[:, None] + offs[None, :], mask=rmask[:, None], other=0.0)
        if HAS_QS:
            qa = qa.to(tl.float32) * tl.load(QS + h * D + offs)[None, :]
        qa = qa.to(DT)
        qb = qa  # unused: one tile
    return qa, qb


@triton.jit
def head_factors(sm_scale, softcap, KG, VG, h, KF: tl.constexpr, VF: tl.constexpr, KGS: tl.constexpr,
                 VGS: tl.constexpr, SOFTCAP: tl.constexpr, SUB: tl.constexpr):
    """(k_fac, v_fac): the per-head factors applied to the scores and to the output after the dots (softmax
    scale, FP32 global scales, 2**14 of the NVFP4 payload trick, 2**24 of SUB-encoded INT V codes; k_fac is
    divided by the soft cap: s = softcap * tanh(qk * sm_scale / softcap))."""
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
    if SUB:
        if VF == F_INT8 or VF == F_INT4:
            v_fac = v_fac * TWO_POW_24
    if SOFTCAP:
        k_fac = k_fac / softcap
    return k_fac, v_fac


@triton.jit
def q_sums(qa, qb, F: tl.constexpr, BM: tl.constexpr):
    """Row sums of the query tiles (qa, qb: the halves for packed K) for INT4 / INT8 keys (their per-token
    min multiplies them); zeros for the other formats (unused)."""
    if F == F_INT8 or F == F_INT4:
        qsum = tl.sum(qa.to(tl.float32), axis=1)
        if F == F_INT4:
            qsum += tl.sum(qb.to(tl.float32), axis=1)
    else:
        qsum = tl.zeros([BM], tl.float32)
    return qsum


@triton.jit
def acc_init(F: tl.constexpr, BM: tl.constexpr, D: tl.constexpr):
    """Online-softmax state for V format F: (m_i, l_i, acc_a, acc_b, pm), acc_a / acc_b the even / odd output
    columns for packed V (else acc_a the whole row and acc_b unused), pm the per-token-min share (INT V)."""
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    if F == F_INT4 or F == F_MXFP4 or F == F_NVFP4:
        acc_a = tl.zeros([BM, D // 2], tl.float32)
        acc_b = tl.zeros([BM, D // 2], tl.float32)
    else:
        acc_a = tl.zeros([BM, D], tl.float32)
        acc_b = acc_a
    pm = tl.zeros([BM], tl.float32)
    return m_i, l_i, acc_a, acc_b, pm


@triton.jit
def tile_slots(BT, s_btb, b, start, hi, BLOCK_N: tl.constexpr, BS: tl.constexpr):
    """Tokens `start .. start + BLOCK_N` of sequence b (those < hi valid), through its block-table row:
    (t, tmask, physical block (int64), offset in the block (int64))."""
    t = start + tl.arange(0, BLOCK_N)
    tmask = t < hi
    phys = tl.load(BT + b.to(tl.int64) * s_btb + t // BS, mask=tmask, other=0).to(tl.int64)
    off = (t % BS).to(tl.int64)
    return t, tmask, phys, off


@triton.jit
def fp4_tile(P, row, S, srow, tmask, F: tl.constexpr, GRP: tl.constexpr, D: tl.constexpr,
             BLOCK_N: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_N, D/2] even (low nibble) and odd (high nibble) FP4 tiles, scaled by the group byte
    (NVFP4: e2m1 * 2**-14 * E4M3 in fp16, exact; MXFP4: e2m1 * 2**E in bf16, exact)."""
    NG: tl.constexpr = D // GRP
    GB: tl.constexpr = GRP // 2
    offs_g = tl.arange(0, NG)
    offs_gb = tl.arange(0, GB)
    b8 = tl.load(P + row[:, None, None] + (offs_g[None, :, None] * GB + offs_gb[None, None, :]),
                 mask=tmask[:, None, None], other=0)
    sb = tl.load(S + srow[:, None] + offs_g[None, :], mask=tmask[:, None], other=0)
    if F == F_NVFP4:
        s16 = e4m3_byte_f16(sb)[:, :, None]
        a3 = e2m1_lo_f16_x4(b8, ASM) * s16
        b3 = e2m1_hi_f16_x4(b8, ASM) * s16
    else:
        s32 = e8m0_f32_x2p14(sb)[:, :, None]
        a3 = e2m1_lo_f16_x4(b8, ASM).to(tl.float32) * s32
        b3 = e2m1_hi_f16_x4(b8, ASM).to(tl.float32) * s32
    return tl.reshape(a3, [BLOCK_N, D // 2]).to(DT), tl.reshape(b3, [BLOCK_N, D // 2]).to(DT)


@triton.jit
def kv_tile(P, row, S, srow, tmask, F: tl.constexpr, GRP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
            DT: tl.constexpr, F8: tl.constexpr, SUB: tl.constexpr, ASM: tl.constexpr):
    """One K or V tile of the token rows `row` (payload pool `P`, scale rows `srow` of pool `S`), as dot operands
    of dtype DT: (even half, odd half) for packed formats, (tile, tile) for the others. F8: the FP8 bitcast type."""
    if F == F_INT4 or F == F_MXFP4 or F == F_NVFP4:
        if F == F_INT4:
            b8 = tl.load(P + row[:, None] + tl.arange(0, D // 2)[None, :], mask=tmask[:, None], other=0)
            if SUB:
                a = u4_lo_f16_sub(b8, ASM)
                b = u4_hi_f16_sub(b8, ASM)
            else:
                a = u4_lo_f16(b8).to(DT)
                b = u4_hi_f16(b8).to(DT)
        else:
            a, b = fp4_tile(P, row, S, srow, tmask, F, GRP, D, BLOCK_N, DT, ASM)
    else:
        raw = tl.load(P + row[:, None] + tl.arange(0, D)[None, :], mask=tmask[:, None], other=0)
        if F == F_INT8:
            if SUB:
                a = u8_f16_sub(raw, ASM)
            else:
                a = u8_code_f16(raw).to(DT)
        elif F == F_FP8:
            a = raw.to(F8, bitcast=True).to(DT)
        else:
            a = raw.to(DT)
        b = a
    return a, b


@triton.jit
def scores(qa, qb, ka, kb, S, srow, tmask, qsum, k_fac, softcap, F: tl.constexpr, IEEE: tl.constexpr,
           SOFTCAP: tl.constexpr, SUB: tl.constexpr):
    """log2-domain scores [BM, BLOCK_N] of query tiles (qa, qb) against a `kv_tile` K tile (ka, kb):
    dot(s), INT4 / INT8 per-token scale and min (`qsum`: the row sums of q), the per-head factor `k_fac`
    (softmax scale, global scale, format constants), soft cap, then * log2(e)."""
    if F == F_INT4 or F == F_MXFP4 or F == F_NVFP4:
        s = tl.dot(qa, tl.trans(ka)) + tl.dot(qb, tl.trans(kb))
    elif IEEE:
        s = tl.dot(qa, tl.trans(ka), input_precision="ieee")
    else:
        s = tl.dot(qa, tl.trans(ka))
    if F == F_INT8 or F == F_INT4:
        k_sc = f16_bytes_f32(S, srow, 0, tmask)
        if SUB:
            k_sc = k_sc * TWO_POW_24  # codes entered the dot as fp16 c * 2**-24
        k_mn = f16_bytes_f32(S, srow, 2, tmask)
        s = s * k_sc[None, :] + qsum[:, None] * k_mn[None, :]
    s = s * k_fac
    if SOFTCAP:
        # s = softcap * tanh(x), tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf, no overflow NaN
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0))
    return s * LOG2E


@triton.jit
def softmax_step(s, m_i, l_i):
    """Online softmax over one tile of log2-domain scores `s` (-inf = masked): (p, alpha, m_i, l_i) with p the
    tile's weights under the new running max and alpha the factor that rescales earlier sums and outputs."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@triton.jit
def v_weights(p, S, srow, tmask, F: tl.constexpr, DT: tl.constexpr):
    """(w, v_smax, pmn): the weights that multiply a `kv_tile` V tile in the dot, in dtype DT. INT4 / INT8 fold
    the per-token scale into them (normalised by the tile's largest scale `v_smax`, applied after the dot) and
    return `pmn = sum_t p_t min_t` (the per-token min's share); the other formats return p, 1 and 0."""
    if F == F_INT8 or F == F_INT4:
        v_sc = f16_bytes_f32(S, srow, 0, tmask)
        v_mn = f16_bytes_f32(S, srow, 2, tmask)
        v_smax = tl.max(v_sc, axis=0)
        v_smax = tl.where(v_smax > 0, v_smax, 1.0)
        w = (p * (v_sc / v_smax)[None, :]).to(DT)
        pmn = tl.sum(p * v_mn[None, :], axis=1)
    else:
        w = p.to(DT)
        v_smax = 1.0
        pmn = 0.0
    return w, v_smax, pmn


@triton.jit
def pv(acc, p, w, v_smax, vt, F: tl.constexpr, IEEE: tl.constexpr, DT: tl.constexpr):
    """acc + P.V for one V tile (or one half of a packed one) `vt`, with `v_weights`' (w, v_smax)."""
    if F == F_INT8 or F == F_INT4:
        acc += tl.dot(w, vt.to(DT)) * v_smax
    elif IEEE:
        acc += tl.dot(p, vt, input_precision="ieee")
    else:
        acc += tl.dot(w, vt)
    return acc


@triton.jit
def pv_step(acc_a, acc_b, pm, p, alpha, P, row, S, srow, tmask, F: tl.constexpr, GRP: tl.constexpr,
            D: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr, F8: tl.constexpr, IEEE: tl.constexpr,
            SUB: tl.constexpr, ASM: tl.constexpr):
    """Rescale the state by `alpha` and add the V tile of rows `row` weighted by `p`: (acc_a, acc_b, pm)
    (acc_b and pm come back unchanged where V format F does not use them)."""
    PACK: tl.constexpr = F == F_INT4 or F == F_MXFP4 or F == F_NVFP4
    acc_a = acc_a * alpha[:, None]
    if PACK:
        acc_b = acc_b * alpha[:, None]
    va, vb = kv_tile(P, row, S, srow, tmask, F, GRP, D, BLOCK_N, DT, F8, SUB, ASM)
    w, v_smax, pmn = v_weights(p, S, srow, tmask, F, DT)
    if F == F_INT8 or F == F_INT4:
        pm = pm * alpha + pmn
    acc_a = pv(acc_a, p, w, v_smax, va, F, IEEE, DT)
    if PACK:
        acc_b = pv(acc_b, p, w, v_smax, vb, F, IEEE, DT)
    return acc_a, acc_b, pm


@triton.jit
def finish(acc_a, acc_b, pm, inv_l, v_fac, F: tl.constexpr):
    """(out_a, out_b): the normalised output (even / odd columns for packed V, else out_a the row); `inv_l` is
    1 / the softmax denominator, with empty rows (l = 0) read as 1 (their output is 0)."""
    oa = (acc_a * v_fac + pm[:, None]) * inv_l[:, None]
    if F == F_INT4 or F == F_MXFP4 or F == F_NVFP4:
        ob = (acc_b * v_fac + pm[:, None]) * inv_l[:, None]
    else:
        ob = oa
    return oa, ob


@triton.jit
def store_rows(O, o_row, acc_a, acc_b, pm, m_i, l_i, v_fac, o_fac, rmask, F: tl.constexpr, D: tl.constexpr):
    """Store the normalised output rows `o_row` times `o_fac` (1.0, or per row the weight `dequant.join_sink` gives
    the keys when a sink joins the denominator; cast to O's dtype; even / odd columns for packed V) and return
    their log2-sum-exp without a sink (-inf for an empty row, NaN for NaN scores)."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    oa, ob = finish(acc_a, acc_b, pm, o_fac / l_safe, v_fac, F)
    if F == F_INT4 or F == F_MXFP4 or F == F_NVFP4:
        offs_hd = tl.arange(0, D // 2)
        tl.store(O + o_row[:, None] + 2 * offs_hd[None, :], oa.to(O.dtype.element_ty), mask=rmask[:, None])
        tl.store(O + o_row[:, None] + 2 * offs_hd[None, :] + 1, ob.to(O.dtype.element_ty), mask=rmask[:, None])
    else:
        offs_d = tl.arange(0, D)
        tl.store(O + o_row[:, None] + offs_d[None, :], oa.to(O.dtype.element_ty), mask=rmask[:, None])
    return lse_or_empty(l_i, m_i + tl.log2(l_safe))


@triton.jit
def qk_tile(qa, qb, qsum, k_fac, softcap, KD, s_kdb, s_kdh, s_kdt, KS, s_ksb, s_ksh, s_kst, phys, h64, off, tmask,
            F: tl.constexpr, GRP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr,
            F8: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr, SUB: tl.constexpr, ASM: tl.constexpr):
    """Scores of the query rows against the K tile at slots (`phys` block, `off` token) of KV head `h64`."""
    krow = phys * s_kdb + h64 * s_kdh + off * s_kdt
    ksrow = phys * s_ksb + h64 * s_ksh + off * s_kst
    ka, kb = kv_tile(KD, krow, KS, ksrow, tmask, F, GRP, D, BLOCK_N, DT, F8, SUB, ASM)
    return scores(qa, qb, ka, kb, KS, ksrow, tmask, qsum, k_fac, softcap, F, IEEE, SOFTCAP, SUB)


@triton.jit
def pv_tile(acc_a, acc_b, pm, p, alpha, VD, s_vdb, s_vdh, s_vdt, VS, s_vsb, s_vsh, s_vst, phys, h64, off, tmask,
            F: tl.constexpr, GRP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr,
            F8: tl.constexpr, IEEE: tl.constexpr, SUB: tl.constexpr, ASM: tl.constexpr):
    """`pv_step` on the V tile at slots (`phys` block, `off` token) of KV head `h64`."""
    vrow = phys * s_vdb + h64 * s_vdh + off * s_vdt
    vsrow = phys * s_vsb + h64 * s_vsh + off * s_vst
    return pv_step(acc_a, acc_b, pm, p, alpha, VD, vrow, VS, vsrow, tmask, F, GRP, D, BLOCK_N, DT, F8, IEEE, SUB, ASM)
