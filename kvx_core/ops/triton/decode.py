"""Paged decode attention over quantized KV pools (split-KV / flash-decoding + a reduction kernel).

One program = (query row b, KV head h, split s): it loads each K/V tile of its token range once for
all `QH = Hq / H_kv` query heads that share the KV head (GQA), dequantizes in registers (see
`dequant.py`), and runs the online softmax with the tile dots on tensor cores (M = QH padded to 16).
4-bit formats are never interleaved in registers: even head_dim elements (low nibbles) and odd ones
(high nibbles) are contracted separately against the even / odd query halves, and the V halves
accumulate into even / odd output columns. The tile steps are `tiles.py`'s, shared with prefill.py (here
with INT codes as fp16 subnormals, `SUB`, and the inline-PTX decoders, `ASM`). `merge.py` merges the splits
(LSE-weighted), casts to the output dtype and writes the LSE. Hadamard formats: the kernel works in the rotated
domain; `kvx_core/ops/decode.py` rotates q before and the merged output back after (`ops.rotation.rotate`).
A query row is one query token: `RPS` (rows_per_seq) consecutive rows share a block-table row (speculative
decoding's 1 + k tokens of a sequence), each attending the keys its own length in SEQ gives (`ops/decode.py`).
`launch_decode` (below) launches this kernel; `kvx_core/ops/decode.py` plans (backend, splits) and merges.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_format import KernelFormat, kernel_format
from .launch import as_bytes, dot_type, fp8_type, interpreting, next_pow2
from .tiles import acc_init, head_factors, load_q, pv_tile, q_sums, qk_tile, softmax_step, store_rows, tile_slots


@triton.jit
def _decode_kernel(
    Q, s_qb, s_qh,
    KD, s_kdb, s_kdh, s_kdt,
    KS, s_ksb, s_ksh, s_kst,
    VD, s_vdb, s_vdh, s_vdt,
    VS, s_vsb, s_vsh, s_vst,
    KG, VG,
    BT, s_btb, SEQ, RPS,
    MO, s_mob, s_moh, s_mos,
    ML, s_mlb, s_mlh,
    sm_scale, softcap, window,
    BS: tl.constexpr, QH: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    KF: tl.constexpr, VF: tl.constexpr, KGRP: tl.constexpr, VGRP: tl.constexpr,
    KDT: tl.constexpr, VDT: tl.constexpr, KIEEE: tl.constexpr, VIEEE: tl.constexpr,
    KGS: tl.constexpr, VGS: tl.constexpr, K8: tl.constexpr, V8: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, ASM: tl.constexpr, QS, HAS_QS: tl.constexpr,
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

    rows = tl.arange(0, BM)
    rmask = rows < QH
    hq = h * QH + rows
    q_row = b.to(tl.int64) * s_qb + hq.to(tl.int64) * s_qh
    qa, qb = load_q(Q, q_row, rmask, KF, D, KDT, QS, h, HAS_QS)
    qsum = q_sums(qa, qb, KF, BM)
    k_fac, v_fac = head_factors(sm_scale, softcap, KG, VG, h, KF, VF, KGS, VGS, SOFTCAP, True)
    m_i, l_i, acc_a, acc_b, pm = acc_init(VF, BM, D)

    h64 = h.to(tl.int64)

    for start in range(lo, hi, BLOCK_N):
        t, tmask, phys, off = tile_slots(BT, s_btb, b // RPS, start, hi, BLOCK_N, BS)

        s = qk_tile(qa, qb, qsum, k_fac, softcap, KD, s_kdb, s_kdh, s_kdt, KS, s_ksb, s_ksh, s_kst, phys, h64, off,
                    tmask, KF, KGRP, D, BLOCK_N, KDT, K8, KIEEE, SOFTCAP, True, ASM)
        p, alpha, m_i, l_i = softmax_step(tl.where(tmask[None, :], s, float("-inf")), m_i, l_i)
        acc_a, acc_b, pm = pv_tile(acc_a, acc_b, pm, p, alpha, VD, s_vdb, s_vdh, s_vdt, VS, s_vsb, s_vsh, s_vst, phys,
                                   h64, off, tmask, VF, VGRP, D, BLOCK_N, VDT, V8, VIEEE, True, ASM)

    # ---- store this split's normalised partial output and its log2-sum-exp ----
    mo_row = b.to(tl.int64) * s_mob + hq.to(tl.int64) * s_moh + sp * s_mos
    lse2 = store_rows(MO, mo_row, acc_a, acc_b, pm, m_i, l_i, v_fac, 1.0, rmask, VF, D)  # sinks: merge.py
    tl.store(ML + b.to(tl.int64) * s_mlb + hq.to(tl.int64) * s_mlh + sp, lse2, mask=rmask)


def default_block_n(kk: KernelFormat, kv: KernelFormat, head_dim: int) -> int:
    """Key tile of the Triton decode for K / V kernel formats `kk` / `kv`."""
    if kk.storage == torch.float32 or kv.storage == torch.float32:
        return 16
    if kk.storage in (torch.bfloat16, torch.float16) or kv.storage in (torch.bfloat16, torch.float16):
        return 64 if head_dim <= 128 else 32
    if kk.packed and kv.packed:
        # H200, B=64 32k: 64 beat 128 by 9-10% on int4 and nvfp4
        # (benchmarks/results/decode_triton_splits_blockn_h200.jsonl)
        return 64
    # 8-bit payloads (H200 sweep winners: benchmarks/results/decode_triton_tile_sweep_h200.jsonl)
    return 128 if head_dim <= 128 else 64


def launch_decode(q, k_data, ks, v_data, vs, kg, vg, block_table, seq_lens, fmt, mid_o, mid_l, sm_scale,
                  softcap, window, block_n, num_warps, num_stages, q_smoothing=None, rows_per_seq: int = 1) -> None:
    """The Triton split-KV decode kernel on checked arguments: per-split partials into `mid_o [B, Hq, S, D]` /
    `mid_l [B, Hq, S]` (`ks` / `vs`: `launch.scale_args`; `kg` / `vg`: `launch.global_scale_arg`; `q_smoothing`:
    contiguous FP32 `[Hkv, D]` the queries are multiplied by as they load). `seq_lens [B]`: the keys each query row
    attends; row r reads `block_table` row `r // rows_per_seq`."""
    bsz, hq, d = q.shape
    _, hkv, bs, _ = k_data.shape
    kk, kv = kernel_format(fmt.k), kernel_format(fmt.v)
    qh = hq // hkv
    bm = max(16, next_pow2(qh))
    num_splits = mid_o.shape[2]
    kdt, vdt = dot_type(kk, q.dtype), dot_type(kv, q.dtype)
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
        block_table, block_table.stride(0), seq_lens, rows_per_seq,
        mid_o, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_l, mid_l.stride(0), mid_l.stride(1),
        sm_scale, float(softcap) if softcap else 1.0, int(window) if window is not None and window >= 0 else 0,
        BS=bs, QH=qh, BM=bm, D=d, BLOCK_N=block_n,
        KF=kk.code, VF=kv.code, KGRP=kk.group or 16, VGRP=kv.group or 16,
        KDT=kdt, VDT=vdt, KIEEE=kk.storage == torch.float32, VIEEE=kv.storage == torch.float32,
        KGS=kk.global_scale, VGS=kv.global_scale, K8=fp8_type(kk), V8=fp8_type(kv),
        SOFTCAP=bool(softcap), WINDOW=window is not None and window >= 0, ASM=not interpreting(),
        QS=q_smoothing if q_smoothing is not None else q, HAS_QS=q_smoothing is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
