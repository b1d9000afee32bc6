"""Paged prefill / extend attention over the quantized pools (causal, GQA, softcap, sliding window, LSE).

Sequence b's new tokens are rows `qo_indptr[b]:qo_indptr[b+1]` of `q [T, Hq, D]` and its LAST
`q_len` cached tokens (already written); each attends to the cached prefix plus itself. One program =
BM rows of (token, query head) pairs of one sequence and one KV head (GQA packing: every K/V tile is
loaded once for all `Hq / H_kv` heads that share it), online softmax over BLOCK_N-token tiles with
both dots on tensor cores. The tile steps (K/V dequantization in registers, scores, online softmax, P.V) are
`tiles.py`'s, shared with decode.py (payload values exact in the dot dtype, per-head/per-token factors after
the dot; 4-bit formats contract even/odd head_dim halves separately); here INT codes enter the dots as their
integer values (`SUB` off) and the 4-bit decoders are the portable forms (`ASM` off). Hadamard formats: q is rotated and the output rotated back with
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
from .dequant import F_INT4, F_MXFP4, F_NVFP4, lse_or_empty
from .launch import as_bytes, as_format, check_device, check_pool, dot_type, fp8_type, global_scale_arg, scale_args
from .tiles import acc_init, finish, head_factors, kv_tile, pv_step, q_sums, scores, softmax_step, tile_slots

BLOCK_M = 128
"""Default rows of (token, query head) pairs per program; `prefill_plan` and the launch must agree."""


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
        qb = qa  # unused: one tile
    qsum = q_sums(qa, qb, KF, BM)
    k_fac, v_fac = head_factors(sm_scale, softcap, KG, VG, h, KF, VF, KGS, VGS, SOFTCAP, False)
    m_i, l_i, acc_a, acc_b, pm = acc_init(VF, BM, D)

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
    h64 = h.to(tl.int64)

    for start in range(lo, hi, BLOCK_N):
        t, tmask, phys, off = tile_slots(BT, s_btb, b, start, hi, BLOCK_N, BS)
        krow = phys * s_kdb + h64 * s_kdh + off * s_kdt
        ksrow = phys * s_ksb + h64 * s_ksh + off * s_kst
        ka_t, kb_t = kv_tile(KD, krow, KS, ksrow, tmask, KF, KGRP, D, BLOCK_N, KDT, K8, False, False)
        s = scores(qa, qb, ka_t, kb_t, KS, ksrow, tmask, qsum, k_fac, softcap, KF, KIEEE, SOFTCAP, False)
        if start >= full_end:  # tiles on the causal diagonal, past the end or in the window edge
            allowed = tmask[None, :] & rvalid[:, None]
            if CAUSAL:
                allowed = allowed & (t[None, :] <= qpos[:, None])
            if WINDOW:
                allowed = allowed & (t[None, :] >= qpos[:, None] - window_left)
            s = tl.where(allowed, s, float("-inf"))

        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        vrow = phys * s_vdb + h64 * s_vdh + off * s_vdt
        vsrow = phys * s_vsb + h64 * s_vsh + off * s_vst
        acc_a, acc_b, pm = pv_step(acc_a, acc_b, pm, p, alpha, VD, vrow, VS, vsrow, tmask, VF, VGRP, D, BLOCK_N, VDT,
                                   V8, VIEEE, False, False)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    inv_l = 1.0 / l_safe
    o_row = (q0 + tok).to(tl.int64) * s_ot + hq.to(tl.int64) * s_oh
    oa, ob = finish(acc_a, acc_b, pm, inv_l, v_fac, VF)
    if VPACK:
        tl.store(O + o_row[:, None] + 2 * offs_hd[None, :], oa.to(O.dtype.element_ty), mask=rvalid[:, None])
        tl.store(O + o_row[:, None] + 2 * offs_hd[None, :] + 1, ob.to(O.dtype.element_ty), mask=rvalid[:, None])
    else:
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
