"""Paged prefill / extend attention over the quantized pools (causal, GQA, softcap, sliding window, LSE).

Sequence b's new tokens are rows `qo_indptr[b]:qo_indptr[b+1]` of `q [T, Hq, D]` and its LAST
`q_len` cached tokens (already written); each attends to the cached prefix plus itself. One program =
BM rows of (token, query head) pairs of one sequence and one KV head (GQA packing: every K/V tile is
loaded once for all `Hq / H_kv` heads that share it), online softmax over BLOCK_N-token tiles with
both dots on tensor cores. The tile steps (K/V dequantization in registers, scores, online softmax, P.V) are
`tiles.py`'s, shared with decode.py (payload values exact in the dot dtype, per-head/per-token factors after
the dot; 4-bit formats contract even/odd head_dim halves separately); here INT codes enter the dots as their
integer values (`SUB` off) and the 4-bit decoders are the portable forms (`ASM` off). Hadamard formats: the
kernel works in the rotated domain; q is rotated before it and its FP32 output back after it by
`ops.rotation.rotate`, as in decode. Attention sinks (`ops.attention`) join each row's denominator in its final
normalisation (`dequant.join_sink`). `plan_prefill` builds the work list once per step; `PrefillPlan.run`
launches one layer. `window_left` follows FlashInfer, `paged_decode` and
`attention.paged_prefill(window=...)`: key j is attended iff `j >= pos - window_left`. `queries_after`
(non-causal only) places the queries right after the cached tokens instead of at their end (`attention.paged_prefill`).
Split-KV (flash-decoding, as decode.py): when the programs are few against the SMs and the keys many (a few
queries over a long cached prefix), `plan_prefill` gives each program a third grid axis of S splits of its key
range (whole BLOCK_N tiles, so the causal / window masks see the tiles the unsplit kernel sees); each split stores
its rows' normalised FP32 output and log2-sum-exp (-inf: no key seen) into the plan's workspace, every query token a
"sequence" of `merge.merge_splits`, which then writes the output and LSE and joins the sinks once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...errors import KvxError, Status, require
from ...formats import CacheFormat
from ..checks import check_max_seq_len
from ..kernel_format import kernel_format
from ..rotation import rotate
from .dequant import join_sink, lse_or_empty
from .launch import (
    as_bytes,
    check_device,
    check_layer,
    check_plan,
    dot_type,
    fp8_type,
    global_scale_arg,
    pool_geometry,
    sm_count,
)
from .merge import merge_splits
from .tiles import acc_init, head_factors, load_q, pv_tile, q_sums, qk_tile, softmax_step, store_rows, tile_slots

BLOCK_M = 128
"""Default rows of (token, query head) pairs per program."""
MIN_SPLIT_TILES = 8
"""Key tiles (BLOCK_N each) a split covers at least: fewer, and the split's fixed costs (q load, workspace row,
merge) outweigh its keys (the Triton decode's 1024-token floor at its 128-key tiles)."""
MAX_SPLITS = 256
"""Most key splits per program: the workspace is T x Hq x S x D fp32."""


# Not specialized on: the split LSEs' strides, which follow the split count (`merge.py`), and the block table's row
# stride, which follows the engine's table width: a kernel compiled before serving (`ops.warmup`) serves every step.
@triton.jit(do_not_specialize=["s_btb", "s_mlt", "s_mlh"])
def _prefill_kernel(
    Q, s_qt, s_qh, O, s_ot, s_oh, LSE, s_lt, s_lh,
    KD, s_kdb, s_kdh, s_kdt, KS, s_ksb, s_ksh, s_kst,
    VD, s_vdb, s_vdh, s_vdt, VS, s_vsb, s_vsh, s_vst,
    KG, VG, BT, s_btb, SEQ, QO, TILE_SEQ, TILE_ROW, SINKS,
    MO, s_mot, s_moh, s_mos, ML, s_mlt, s_mlh,
    sm_scale, softcap, window_left,
    BS: tl.constexpr, QH: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    KF: tl.constexpr, VF: tl.constexpr, KGRP: tl.constexpr, VGRP: tl.constexpr,
    KDT: tl.constexpr, VDT: tl.constexpr, KIEEE: tl.constexpr, VIEEE: tl.constexpr,
    KGS: tl.constexpr, VGS: tl.constexpr, K8: tl.constexpr, V8: tl.constexpr,
    CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    AFTER: tl.constexpr, SPLIT: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    b = tl.load(TILE_SEQ + tile)
    row0 = tl.load(TILE_ROW + tile)
    q0 = tl.load(QO + b)
    q_len = tl.load(QO + b + 1) - q0
    seq_len = tl.load(SEQ + b)
    prefix = seq_len - q_len
    if AFTER:  # the queries follow the cached tokens (non-causal: every cached key precedes them)
        prefix = seq_len

    r = row0 + tl.arange(0, BM)
    tok = r // QH
    rvalid = tok < q_len
    hq = h * QH + r % QH
    qpos = prefix + tok
    q_row = (q0 + tok).to(tl.int64) * s_qt + hq.to(tl.int64) * s_qh

    qa, qb = load_q(Q, q_row, rvalid, KF, D, KDT, Q, h, False)  # queries arrive smoothed (ops.smoothing)
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
    if SPLIT:  # split sp's keys: whole BLOCK_N tiles of [lo, hi), so every tile starts where the unsplit one does
        chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), tl.num_programs(2)), BLOCK_N) * BLOCK_N
        lo = lo + sp * chunk
        hi = tl.minimum(hi, lo + chunk)
    h64 = h.to(tl.int64)

    for start in range(lo, hi, BLOCK_N):
        t, tmask, phys, off = tile_slots(BT, s_btb, b, start, hi, BLOCK_N, BS)
        s = qk_tile(qa, qb, qsum, k_fac, softcap, KD, s_kdb, s_kdh, s_kdt, KS, s_ksb, s_ksh, s_kst, phys, h64, off,
                    tmask, KF, KGRP, D, BLOCK_N, KDT, K8, KIEEE, SOFTCAP, False, False)
        if start >= full_end:  # tiles on the causal diagonal, past the end or in the window edge
            allowed = tmask[None, :] & rvalid[:, None]
            if CAUSAL:
                allowed = allowed & (t[None, :] <= qpos[:, None])
            if WINDOW:
                allowed = allowed & (t[None, :] >= qpos[:, None] - window_left)
            s = tl.where(allowed, s, float("-inf"))

        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        acc_a, acc_b, pm = pv_tile(acc_a, acc_b, pm, p, alpha, VD, s_vdb, s_vdh, s_vdt, VS, s_vsb, s_vsh, s_vst, phys,
                                   h64, off, tmask, VF, VGRP, D, BLOCK_N, VDT, V8, VIEEE, False, False)

    if SPLIT:  # this split's normalised rows and log2-sum-exp (-inf: no key) for merge.py, which joins the sinks
        mo_row = (q0 + tok).to(tl.int64) * s_mot + hq.to(tl.int64) * s_moh + sp * s_mos
        lse2 = store_rows(MO, mo_row, acc_a, acc_b, pm, m_i, l_i, v_fac, 1.0, rvalid, VF, D)
        tl.store(ML + (q0 + tok).to(tl.int64) * s_mlt + hq.to(tl.int64) * s_mlh + sp, lse2, mask=rvalid)
    else:
        o_row = (q0 + tok).to(tl.int64) * s_ot + hq.to(tl.int64) * s_oh
        if HAS_SINKS:  # the row's sink joins its denominator: the LSE and the keys' weight w
            lse2 = m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))
            lse, w = join_sink(lse_or_empty(l_i, lse2 * 0.6931471805599453),
                               tl.load(SINKS + hq, mask=rvalid, other=0.0))
            store_rows(O, o_row, acc_a, acc_b, pm, m_i, l_i, v_fac, w, rvalid, VF, D)
        else:
            lse = store_rows(O, o_row, acc_a, acc_b, pm, m_i, l_i, v_fac, 1.0, rvalid, VF, D) * 0.6931471805599453
        tl.store(LSE + (q0 + tok).to(tl.int64) * s_lt + hq.to(tl.int64) * s_lh, lse, mask=rvalid)


def _default_block_n(kk, kv) -> int:
    """Key tile (H200 sweep, benchmarks/results/prefill_tile_sweep_h200.jsonl, at BLOCK_M=128 / 8 warps): 128 for
    bf16 / fp16 / FP8 / FP4 caches; 64 for INT8 / INT4 (their per-key affine epilogue on a [BM, 128] score
    tile spills: 128 keys is 15-25% slower); 16 for fp32 caches (IEEE fp32 dots)."""
    if kk.storage == torch.float32 or kv.storage == torch.float32:
        return 16
    return 64 if kk.affine or kv.affine else 128


def work_list(qo_indptr: torch.Tensor, qh: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """Per program its sequence and first packed row (int32, on the host: one sync when `qo_indptr` is not)."""
    ip = qo_indptr.to("cpu", torch.int64)
    rows = (ip[1:] - ip[:-1]) * qh
    n = (rows + block_m - 1) // block_m
    seq = torch.repeat_interleave(torch.arange(n.numel()), n)
    first = torch.cumsum(n, 0) - n
    row = (torch.arange(int(n.sum())) - first[seq]) * block_m
    return seq.to(torch.int32), row.to(torch.int32)


def prefill_num_splits(programs: int, max_seq_len: int | None, block_n: int, sms: int) -> int:
    """Key splits per program (flash-decoding): when the programs (tiles x KV heads) fill less than half of the
    `sms` SMs and the longest sequence holds enough keys, enough splits for ~2 programs per SM, each of at least
    `MIN_SPLIT_TILES` key tiles; else 1 (the unsplit kernel). A few queries over a long cached prefix (vLLM's
    recompute after a prefix-cache hit: 16 tokens x 8 KV heads = 8 programs over 32k keys on 132 SMs) split 32
    ways; a long prompt (4096 tokens: 128 x 8 programs) does not split. Without `max_seq_len`: 1."""
    if max_seq_len is None or programs == 0 or 2 * programs > sms:
        return 1
    by_len = max_seq_len // (MIN_SPLIT_TILES * block_n)
    return max(1, min(math.ceil(2 * sms / programs), by_len, MAX_SPLITS))


@dataclass(frozen=True)
class PrefillPlan:
    """One step's prefill work (FlashInfer's plan/run split): the program list over `qo_indptr`, the tiles and
    the options, for `num_tokens` queries of `num_qo_heads` x `head_dim` over pools of `num_kv_heads` x
    `block_size`. Built once per step (`plan_prefill`) and `run` once per layer."""

    fmt: CacheFormat
    num_tokens: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    q_dtype: torch.dtype
    causal: bool
    sm_scale: float
    softcap: float | None
    window_left: int | None
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    qo_indptr: torch.Tensor  # int32 [B + 1] on the device
    tile_seq: torch.Tensor  # int32 [programs]: each program's sequence
    tile_row: torch.Tensor  # int32 [programs]: its first packed (token, query head) row
    rotated_out: torch.Tensor | None  # fp32 [T, Hq, D]: the output before its rotation back (rotated formats)
    sinks: torch.Tensor | None = None  # FP32 [Hq] contiguous attention sinks (`ops.attention.sink_values`)
    queries_after: bool = False  # the queries follow the cached tokens (`attention.paged_prefill`)
    num_splits: int = 1  # key splits per program (`prefill_num_splits`); 1: no workspace, no merge
    mid_o: torch.Tensor | None = None  # fp32 [T, Hq, S, D] per-split normalised outputs (S > 1)
    mid_l: torch.Tensor | None = None  # fp32 [T, Hq, S] per-split log2-sum-exps (S > 1)

    def run(self, q: torch.Tensor, k_data, k_scales, v_data, v_scales, k_gs, v_gs, block_table: torch.Tensor,
            seq_lens: torch.Tensor, out=None, lse=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill one layer -> (`out [T, Hq, D]`, `lse [T, Hq]` fp32 natural log), in place when given."""
        fmt = self.fmt
        t, hq, d, hkv, bs = self.num_tokens, self.num_qo_heads, self.head_dim, self.num_kv_heads, self.block_size
        ks, vs, out, lse = check_layer(self, q, t, self.qo_indptr.numel() - 1, k_data, k_scales, v_data, v_scales,
                                       block_table, seq_lens, out, lse)
        kk, kv = kernel_format(fmt.k), kernel_format(fmt.v)
        qq = rotate(q) if fmt.rotate else q  # the fused kernel on CUDA (ops.rotation), as the write rotates
        o = out if self.rotated_out is None else self.rotated_out
        if self.tile_seq.numel():
            w = self.window_left
            mo, ml = (o, lse) if self.mid_o is None else (self.mid_o, self.mid_l)  # unread unsplit
            _prefill_kernel[(self.tile_seq.numel(), hkv, self.num_splits)](
                qq, qq.stride(0), qq.stride(1), o, o.stride(0), o.stride(1), lse, lse.stride(0), lse.stride(1),
                as_bytes(k_data), k_data.stride(0), k_data.stride(1), k_data.stride(2), *ks,
                as_bytes(v_data), v_data.stride(0), v_data.stride(1), v_data.stride(2), *vs,
                global_scale_arg(k_gs, kk, hkv, q.device), global_scale_arg(v_gs, kv, hkv, q.device),
                block_table, block_table.stride(0), seq_lens, self.qo_indptr, self.tile_seq, self.tile_row,
                lse if self.sinks is None else self.sinks,  # unread without sinks
                mo, mo.stride(0), mo.stride(1), mo.stride(-2), ml, ml.stride(0), ml.stride(1),
                self.sm_scale, float(self.softcap) if self.softcap else 1.0,
                int(w) if w is not None and w >= 0 else 0,
                BS=bs, QH=hq // hkv, BM=self.block_m, D=d, BLOCK_N=self.block_n,
                KF=kk.code, VF=kv.code, KGRP=kk.group or 16, VGRP=kv.group or 16,
                KDT=dot_type(kk, q.dtype), VDT=dot_type(kv, q.dtype),
                KIEEE=kk.storage == torch.float32, VIEEE=kv.storage == torch.float32,
                KGS=kk.global_scale, VGS=kv.global_scale, K8=fp8_type(kk), V8=fp8_type(kv),
                CAUSAL=self.causal, SOFTCAP=bool(self.softcap), WINDOW=w is not None and w >= 0,
                HAS_SINKS=self.sinks is not None, AFTER=self.queries_after, SPLIT=self.mid_o is not None,
                num_warps=self.num_warps, num_stages=self.num_stages,
            )
            if self.mid_o is not None:
                merge_splits(self.mid_o, self.mid_l, o, lse, self.sinks)
        if self.rotated_out is not None:  # one rotation back into the output dtype
            rotate(o, out=out)
        return out, lse


def plan_prefill(fmt: CacheFormat | str, qo_indptr: torch.Tensor, *, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, q_dtype: torch.dtype, device, causal: bool = True,
                 sm_scale: float | None = None, softcap: float | None = None, window_left: int | None = None,
                 block_m: int = BLOCK_M, block_n: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, queries_after: bool = False, max_seq_len: int | None = None,
                 num_splits: int | None = None) -> PrefillPlan:
    """Plan a prefill step from `qo_indptr` (int32/int64 `[B+1]`; pass it on the host to avoid a device sync).

    `max_seq_len`: a host hint of the step's longest sequence (cached tokens with the new ones; vLLM's
    `CommonAttentionMetadata.max_seq_len`), no sync: with few programs against the SMs it splits each program's
    keys (`prefill_num_splits`; SMs: the CUDA device's, the interpreter's stand-in of 4 elsewhere,
    `launch.sm_count`). The hint only sizes the splits: each program splits its own key range, so a wrong hint
    costs speed, never correctness. `num_splits` forces the splits (tests, benchmarks). With S > 1 the plan holds
    the split workspace (`mid_o` / `mid_l`, T x Hq x S x (D + 1) fp32, reused by every layer of the step; engines
    do not capture prefill steps in CUDA graphs, so it is allocated per plan) and `run` merges the splits
    (`merge.merge_splits`, which joins the sinks)."""
    fmt, kk, kv = check_plan("paged_prefill", fmt, q_dtype, (torch.bfloat16, torch.float16), num_qo_heads,
                             num_kv_heads, head_dim)
    device = torch.device(device)
    d = head_dim
    if not isinstance(qo_indptr, torch.Tensor) or qo_indptr.dim() != 1 or qo_indptr.numel() < 1 \
            or qo_indptr.dtype not in (torch.int32, torch.int64):
        raise KvxError(Status.INVALID_ARGUMENT, "qo_indptr must be an int32/int64 [B+1] tensor")
    host = qo_indptr.to("cpu")
    num_tokens = int(host[-1])
    seq, row = work_list(host, num_qo_heads // num_kv_heads, block_m)
    block_n = _default_block_n(kk, kv) if block_n is None else block_n
    if num_splits is None:
        hint = None if max_seq_len is None else check_max_seq_len(max_seq_len)
        if hint is not None and window_left is not None and window_left >= 0:  # a program's keys: window + its rows
            hint = min(hint, window_left + 1 + -(-block_m // (num_qo_heads // num_kv_heads)))
        num_splits = prefill_num_splits(seq.numel() * num_kv_heads, hint, block_n, sm_count(device))
    require(not isinstance(num_splits, bool) and isinstance(num_splits, int) and 1 <= num_splits <= MAX_SPLITS,
            Status.INVALID_ARGUMENT, f"paged_prefill: num_splits must be an int in [1, {MAX_SPLITS}], got "
            f"{num_splits!r}")
    mid_o = mid_l = None
    if num_splits > 1:
        mid_o = torch.empty(num_tokens, num_qo_heads, num_splits, d, dtype=torch.float32, device=device)
        mid_l = torch.empty(num_tokens, num_qo_heads, num_splits, dtype=torch.float32, device=device)
    rotated = torch.empty(num_tokens, num_qo_heads, d, dtype=torch.float32, device=device) if fmt.rotate else None
    return PrefillPlan(fmt, num_tokens, num_qo_heads, num_kv_heads, d, block_size, q_dtype, causal,
                       1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale), softcap, window_left, block_m,
                       block_n, (8 if block_m >= 128 else 4) if num_warps is None else num_warps,
                       2 if num_stages is None else num_stages,
                       qo_indptr.to(device=device, dtype=torch.int32), seq.to(device), row.to(device), rotated,
                       queries_after=queries_after, num_splits=num_splits, mid_o=mid_o, mid_l=mid_l)


def prefill_pools(q: torch.Tensor, qo_indptr: torch.Tensor, k_data, k_scales, v_data, v_scales, k_gs, v_gs,
                  block_table: torch.Tensor, seq_lens: torch.Tensor, fmt: CacheFormat | str, *, causal: bool = True,
                  sm_scale: float | None = None, softcap: float | None = None, window_left: int | None = None,
                  out=None, lse=None, block_m: int = BLOCK_M, block_n: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None, max_seq_len: int | None = None,
                  num_splits: int | None = None):
    """Prefill/extend attention -> (`out [T, Hq, D]` q.dtype, `lse [T, Hq]` fp32 natural log): `plan_prefill`
    then `PrefillPlan.run`.

    `qo_indptr` int32 `[B+1]`; `seq_lens` int32 `[B]` = cached lengths INCLUDING the new tokens.
    """
    check_device(q, qo_indptr, k_data, v_data, block_table, seq_lens)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise KvxError(Status.INVALID_ARGUMENT, f"q must be [T, Hq, D], got {tuple(getattr(q, 'shape', ()))}")
    pool_geometry(k_data, v_data)
    if qo_indptr.numel() != seq_lens.numel() + 1:
        raise KvxError(Status.INVALID_ARGUMENT, "need qo_indptr [B+1] for seq_lens [B]")
    plan = plan_prefill(fmt, qo_indptr, num_qo_heads=q.shape[1], num_kv_heads=k_data.shape[1], head_dim=q.shape[2],
                        block_size=k_data.shape[2], q_dtype=q.dtype, device=q.device, causal=causal,
                        sm_scale=sm_scale, softcap=softcap, window_left=window_left, block_m=block_m,
                        block_n=block_n, num_warps=num_warps, num_stages=num_stages, max_seq_len=max_seq_len,
                        num_splits=num_splits)
    return plan.run(q, k_data, k_scales, v_data, v_scales, k_gs, v_gs, block_table, seq_lens, out=out, lse=lse)
