"""Split merge of the split-KV decode: the per-split partial outputs and log2-sum-exps that the decode
kernels (Triton `decode.py`, CUDA `ops/cuda`) write into `mid_o [B, Hq, S, D]` / `mid_l [B, Hq, S]` are merged
(LSE-weighted) into the output, cast to its dtype, and its natural-log LSE. Attention sinks (`ops.attention`) join
here, once per row after the splits: each split is a piece of the row's softmax without them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dequant import join_sink, lse_or_empty

MERGE_COLS = 32
"""Output columns per merge program: B=1 decode spreads its merge over D/32 x Hq
programs (the whole-row merge took ~10 us of a 36 us B=1 32k NVFP4 decode on an H200)."""


# The split count and the strides that follow it are not specialized on (nor is the tile of splits sized by it), so one
# compiled kernel serves every split count: a split prefill's count changes from step to step with the step's shape,
# and each new value compiled a kernel while serving (vLLM's JIT monitor logged it in the H200 runs of 2026-11-28).
@triton.jit(do_not_specialize=["num_splits", "s_mlb", "s_mlh"])
def _merge_kernel(
    MO, s_mob, s_moh, s_mos,
    ML, s_mlb, s_mlh,
    O, s_ob, s_oh,
    LSE, s_lb, s_lh,
    SINKS,
    num_splits,
    DB: tl.constexpr, SB: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Merge the splits of one (sequence, query head): o = sum_s w_s o_s / sum_s w_s, w_s = 2**lse2_s; with
    HAS_SINKS, the head's sink `SINKS[hq]` joins as one more term exp(sink) of the denominator (`join_sink`).

    Program (b, hq, j) owns output columns [j*DB, (j+1)*DB); splits are read SB at a time as one [SB, DB] tile (one
    memory latency per SB splits, not per split), so small batches still spread the reduction over many SMs.
    """
    b = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1).to(tl.int64)
    d0 = tl.program_id(2) * DB
    offs_s = tl.arange(0, SB)
    offs_d = d0 + tl.arange(0, DB)
    m = float("-inf")
    l = 0.0
    acc = tl.zeros([DB], tl.float32)
    for s0 in range(0, num_splits, SB):
        sp = s0 + offs_s
        smask = sp < num_splits
        lse2 = tl.load(ML + b * s_mlb + hq * s_mlh + sp, mask=smask, other=float("-inf"))
        o = tl.load(MO + b * s_mob + hq * s_moh + sp[:, None] * s_mos + offs_d[None, :], mask=smask[:, None],
                    other=0.0)
        m_new = tl.maximum(m, tl.max(lse2, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse2 - m_safe)
        l = l * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        m = m_new
    l_safe = tl.where(l > 0, l, 1.0)
    out = acc / l_safe
    lse = lse_or_empty(l, (m + tl.log2(l_safe)) * 0.6931471805599453)
    if HAS_SINKS:
        lse, w = join_sink(lse, tl.load(SINKS + hq))
        out = out * w
    tl.store(O + b * s_ob + hq * s_oh + offs_d, out.to(O.dtype.element_ty))
    if d0 == 0:
        tl.store(LSE + b * s_lb + hq * s_lh, lse)


def merge_splits(mid_o: torch.Tensor, mid_l: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> None:
    """Merge `mid_o [B, Hq, S, D]` (fp32, per-split normalised outputs) and `mid_l [B, Hq, S]` (fp32 log2-sum-exps)
    into `out [B, Hq, D]` (its dtype, last dim contiguous) and `lse [B, Hq]` (fp32, natural log), joining the
    attention sinks `sinks` (checked by the caller: FP32 contiguous [Hq] on the device, `ops.attention.sink_values`;
    None: none, the kernel without that step)."""
    bsz, hq, num_splits, d = mid_o.shape
    db = min(d, MERGE_COLS)
    _merge_kernel[(bsz, hq, d // db)](
        mid_o, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_l, mid_l.stride(0), mid_l.stride(1),
        out, out.stride(0), out.stride(1),
        lse, lse.stride(0), lse.stride(1),
        lse if sinks is None else sinks,  # unread without sinks
        num_splits,
        DB=db, SB=64 if db < d else 32, HAS_SINKS=sinks is not None,
        num_warps=4,
    )
