"""Dequantizing gather: the first `min(seq_len, max_seq_len)` tokens of each sequence, read through a
PACKED block table, decoded into dense ragged K/V `[T, H, D]` (sequences concatenated in order).

`gather_pools` checks everything (host syncs) and serves `gather_kv`; `ops.bound_gather.gather_bound` launches the
same kernel (`launch_gather`) over a bound layer with no host sync, for a prefill that dequantizes a cached prefix
once and attends over it with a dense 16-bit kernel (the attention kernels themselves never materialise this).
Grid `(cdiv(max_len, BT), B, 2 H)`. Decoding is the formats' FP32 arithmetic (no FMA contraction), so the output
equals `reference.gather_kv` bit for bit; Hadamard formats are decoded to FP32 in the kernel and rotated back
with the reference's own `ops.rotation.rotate`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import KvxError, Status
from ...formats import CacheFormat
from ..checks import (
    IO_DTYPES,
    check_block_ids,
    check_max_seq_len,
    check_no_alias,
    check_out_dtype,
    global_scale,
    require_type,
)
from ..kernel_format import FormatCode, kernel_format
from ..rotation import rotate
from .dequant import F_FP8, F_INT4, F_INT8, F_NVFP4, F_PLAIN, e8m0_f32
from .launch import as_bytes, as_format, check_device, check_pool, global_scale_arg, pool_geometry, scale_args
from .quant import cast_exact, e2m1_value, e4m3_f32, f8_byte_f32, f16_bytes_f32

INDEX_DTYPES = (torch.int32, torch.int64)
"""The block-table and length dtypes the gather kernel reads."""


@triton.jit
def _decode_rows(PD, s_pb, s_ph, s_pt, SC, s_sb, s_sh, s_st, G, O, s_ot, s_oh, phys, off, orow, ok, h,
                 F: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, GRP: tl.constexpr, NGP: tl.constexpr,
                 F8E5: tl.constexpr):
    h64 = h.to(tl.int64)
    prow = phys * s_pb + h64 * s_ph + off * s_pt
    srow = phys * s_sb + h64 * s_sh + off * s_st
    orow = orow * s_ot + h64 * s_oh
    ODT: tl.constexpr = O.dtype.element_ty
    if F == F_PLAIN or F == F_FP8 or F == F_INT8:
        d = tl.arange(0, DP)
        m2 = ok[:, None] & (d < D)[None, :]
        raw = tl.load(PD + prow[:, None] + d[None, :], mask=m2, other=0)
        if F == F_PLAIN:
            x = cast_exact(raw, ODT)
        elif F == F_FP8:
            x = cast_exact(f8_byte_f32(raw, F8E5) * tl.load(G + h), ODT)
        else:
            s = f16_bytes_f32(SC, srow, 0, ok)
            m = f16_bytes_f32(SC, srow, 2, ok)
            x = cast_exact(raw.to(tl.float32) * s[:, None] + m[:, None], ODT)
        tl.store(O + orow[:, None] + d[None, :], x, mask=m2)
    elif F == F_INT4:
        HP: tl.constexpr = DP // 2
        j = tl.arange(0, HP)
        m2 = ok[:, None] & (j < D // 2)[None, :]
        raw = tl.load(PD + prow[:, None] + j[None, :], mask=m2, other=0).to(tl.int32)
        s = f16_bytes_f32(SC, srow, 0, ok)[:, None]
        m = f16_bytes_f32(SC, srow, 2, ok)[:, None]
        xa = (raw & 0xF).to(tl.float32) * s + m
        xb = (raw >> 4).to(tl.float32) * s + m
        d = tl.arange(0, DP)  # each row stored whole (low / high nibbles interleaved in registers): coalesced
        tl.store(O + orow[:, None] + d[None, :], cast_exact(tl.interleave(xa, xb), ODT),
                 mask=ok[:, None] & (d < D)[None, :])
    else:  # FP4 groups
        GH: tl.constexpr = GRP // 2
        gi = tl.arange(0, NGP)
        ji = tl.arange(0, GH)
        gm = gi < D // GRP
        m3 = ok[:, None, None] & gm[None, :, None]
        raw = tl.load(PD + prow[:, None, None] + (gi[None, :, None] * GH + ji[None, None, :]), mask=m3, other=0)
        sb = tl.load(SC + srow[:, None] + gi[None, :], mask=ok[:, None] & gm[None, :], other=0)
        if F == F_NVFP4:
            big_s = e4m3_f32(sb) * tl.load(G + h)
        else:
            big_s = e8m0_f32(sb)
        xa = e2m1_value(raw.to(tl.int32)) * big_s[:, :, None]
        xb = e2m1_value(raw.to(tl.int32) >> 4) * big_s[:, :, None]
        eidx = gi[None, :, None] * GRP + tl.arange(0, GRP)[None, None, :]  # whole groups, as the int4 rows
        tl.store(O + orow[:, None, None] + eidx, cast_exact(tl.interleave(xa, xb), ODT), mask=m3)


@triton.jit
def _gather_kernel(
    BTAB, s_bt, SEQ, CU, max_len, H,
    KD, s_kdb, s_kdh, s_kdt, KS, s_ksb, s_ksh, s_kst, KG, KO, s_kot, s_koh,
    VD, s_vdb, s_vdh, s_vdt, VS, s_vsb, s_vsh, s_vst, VG, VO, s_vot, s_voh,
    D: tl.constexpr, DP: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
    KF: tl.constexpr, KGRP: tl.constexpr, KNGP: tl.constexpr, KE5: tl.constexpr,
    VF: tl.constexpr, VGRP: tl.constexpr, VNGP: tl.constexpr, VE5: tl.constexpr,
):
    b = tl.program_id(1)
    which = tl.program_id(2) // H
    h = tl.program_id(2) % H
    n = tl.minimum(tl.load(SEQ + b), max_len)
    pos = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = pos < n
    phys = tl.load(BTAB + b.to(tl.int64) * s_bt + pos // BS, mask=ok, other=0).to(tl.int64)
    off = (pos % BS).to(tl.int64)
    orow = tl.load(CU + b) + pos.to(tl.int64)
    if which == 0:
        _decode_rows(KD, s_kdb, s_kdh, s_kdt, KS, s_ksb, s_ksh, s_kst, KG, KO, s_kot, s_koh, phys, off, orow, ok, h,
                     KF, D, DP, KGRP, KNGP, KE5)
    else:
        _decode_rows(VD, s_vdb, s_vdh, s_vdt, VS, s_vsb, s_vsh, s_vst, VG, VO, s_vot, s_voh, phys, off, orow, ok, h,
                     VF, D, DP, VGRP, VNGP, VE5)


@torch.no_grad()
def gather_pools(k_data: torch.Tensor, k_scales: torch.Tensor | None, v_data: torch.Tensor,
                 v_scales: torch.Tensor | None, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 fmt: CacheFormat | str, k_gs=None, v_gs=None, *, max_seq_len: int | None = None,
                 out_dtype: torch.dtype | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 block_t: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ragged `(K, V) [sum(min(seq_lens, max_seq_len)), H_kv, D]` in the model's domain.

    `out_dtype` defaults to the pool dtype for unquantized caches and FP32 otherwise (as the reference).
    `block_table` is PACKED int32/int64 `[B, max_blocks]`; `seq_lens` int32/int64 `[B]`. Host syncs (the total,
    and the checks: block ids a sequence uses lie in the pools, global scales are finite and > 0).
    """
    fmt = as_format(fmt)
    nb, hkv, bs = pool_geometry(k_data, v_data)
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        require_type(t, torch.Tensor, name)
    check_device(k_data, v_data, block_table, seq_lens)
    if block_table.dim() != 2 or block_table.dtype not in INDEX_DTYPES or seq_lens.dtype not in INDEX_DTYPES \
            or seq_lens.dim() != 1 or seq_lens.numel() != block_table.shape[0]:
        raise KvxError(Status.INVALID_ARGUMENT, "block_table must be int32/int64 [B, max_blocks] and seq_lens "
                       f"int32/int64 [B], got {block_table.dtype} {tuple(block_table.shape)} and {seq_lens.dtype} "
                       f"{tuple(seq_lens.shape)}")
    block_table, seq_lens = block_table.contiguous(), seq_lens.contiguous()  # the kernel reads unit-stride rows
    kk, kv = kernel_format(fmt.k), kernel_format(fmt.v)
    d = k_data.shape[3] * (2 if kk.packed else 1)
    fmt.check_head_dim(d)
    check_pool("K", k_data, kk, d)
    check_pool("V", v_data, kv, d)
    ks, vs = scale_args("K", k_scales, k_data, kk, fmt.k, d), scale_args("V", v_scales, v_data, kv, fmt.v, d)
    kg = global_scale(fmt.k, k_gs, hkv, k_data.device, "K global scale")
    vg = global_scale(fmt.v, v_gs, hkv, k_data.device, "V global scale")
    lens = seq_lens.to(torch.int64)
    if max_seq_len is not None:
        lens = lens.clamp(max=check_max_seq_len(max_seq_len))
    if bool((lens < 0).any()):
        raise KvxError(Status.INVALID_ARGUMENT, "sequence lengths must be >= 0")
    if bool((lens > block_table.shape[1] * bs).any()):
        raise KvxError(Status.OUT_OF_RANGE,
                       f"a sequence is longer than its block table row ({block_table.shape[1]} blocks)")
    check_block_ids(block_table, lens, bs, nb)
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=lens.device)
    torch.cumsum(lens, 0, out=cu[1:])
    total = int(cu[-1])
    max_len = int(lens.max()) if lens.numel() else 0
    check_out_dtype(out_dtype)
    dt = out_dtype or (kk.storage if kk.code == kv.code == FormatCode.PLAIN else torch.float32)
    if out is not None:
        _check_out(out, total, hkv, d, out_dtype,
                   {"K": k_data, "V": v_data, "K scales": k_scales, "V scales": v_scales})
    direct = out is not None and not fmt.rotate and out[0].stride(2) == 1 and out[1].stride(2) == 1
    if direct:
        ko, vo = out
    else:
        dts = (out[0].dtype, out[1].dtype) if out is not None else (dt, dt)
        ko, vo = (torch.empty(total, hkv, d, dtype=torch.float32 if fmt.rotate else x, device=k_data.device)
                  for x in dts)
    if total:
        launch_gather(block_table, seq_lens, cu, max_len,
                      (k_data, ks, global_scale_arg(kg, kk, hkv, k_data.device), ko, kk),
                      (v_data, vs, global_scale_arg(vg, kv, hkv, v_data.device), vo, kv), d, bs, block_t)
    if fmt.rotate:
        ko, vo = (rotate(x, out_dtype=o.dtype if out is not None else dt)
                  for x, o in zip((ko, vo), out or (None, None), strict=True))
    if out is None or direct:
        return ko, vo
    out[0][:total].copy_(ko)
    out[1][:total].copy_(vo)
    return out


def _check_out(out, total: int, hkv: int, d: int, out_dtype: torch.dtype | None, pools: dict) -> None:
    """`out` is two float `[>= total, H_kv, D]` tensors on the pools' device (of `out_dtype` when given) that
    overlap neither each other nor a pool."""
    ok = isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
    if not ok or any(t.dim() != 3 or t.shape[0] < total or tuple(t.shape[1:]) != (hkv, d) or t.dtype not in IO_DTYPES
                     or (out_dtype is not None and t.dtype != out_dtype) or t.device != pools["K"].device for t in out):
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"out must be two {out_dtype or 'bf16/fp16/fp32'} [>= {total}, {hkv}, {d}] tensors on "
                       f"{pools['K'].device}")
    check_no_alias({"out K": out[0], "out V": out[1]}, pools)


def launch_gather(block_table: torch.Tensor, seq_lens: torch.Tensor, cu: torch.Tensor, max_len: int, k_side: tuple,
                  v_side: tuple, d: int, bs: int, block_t: int) -> None:
    """The gather kernel over checked arguments; a side is (data pool, `scale_args`, global-scale argument, output,
    its `KernelFormat`)."""
    (kd, ks, kg, ko, kk), (vd, vs, vg, vo, kv) = k_side, v_side

    def ngp(k) -> int:
        return triton.next_power_of_2(max(1, d // (k.group or 16)))

    _gather_kernel[(triton.cdiv(max_len, block_t), block_table.shape[0], 2 * kd.shape[1])](
        block_table, block_table.stride(0), seq_lens, cu, max_len, kd.shape[1],
        as_bytes(kd), kd.stride(0), kd.stride(1), kd.stride(2), *ks, kg, ko, ko.stride(0), ko.stride(1),
        as_bytes(vd), vd.stride(0), vd.stride(1), vd.stride(2), *vs, vg, vo, vo.stride(0), vo.stride(1),
        D=d, DP=triton.next_power_of_2(d), BT=block_t, BS=bs,
        KF=kk.code, KGRP=kk.group or 16, KNGP=ngp(kk), KE5=kk.e5m2,
        VF=kv.code, VGRP=kv.group or 16, VNGP=ngp(kv), VE5=kv.e5m2,
        num_warps=4, enable_fp_fusion=False,
    )
