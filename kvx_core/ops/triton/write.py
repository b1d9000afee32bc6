"""Fused KV write: quantize new K/V tokens `[T, H, D]` in any KVX format and scatter payload and scale
bytes into the paged pools by slot mapping, K and V in ONE launch.

Grid `(cdiv(T, BT), H, 2)`: a program encodes BT tokens of one head of K (axis 2 = 0) or V (= 1).
Bit-identical to `kvx_core.formats` encode (same FP32 operations, IEEE division keeping subnormals (`div_ieee`), no
FMA contraction, software FP8 rounding; see quant.py). Hadamard formats rotate with the reference's own
`ops.rotation.rotate` before the kernel, so the kernel sees exactly the reference's rotated input.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...formats import CacheFormat
from ..checks import WriteArgs, check_write_args
from ..kernel_format import kernel_format
from ..rotation import rotate_kv
from .dequant import F_FP8, F_INT4, F_INT8, F_NVFP4, F_PLAIN, e8m0_f32
from .launch import (
    as_bytes,
    as_format,
    check_device,
    check_pool,
    global_scale_arg,
    interpreting,
    pool_geometry,
    scale_args,
)
from .quant import (
    cast_exact,
    ceil_log2,
    div_ieee,
    e2m1_code,
    e4m3_f32,
    f32_to_f8_bits,
    floor_log2,
    is_finite,
    rint,
    to_f32,
)

F16_MAX = tl.constexpr(65504.0)
F16_NAN_BITS = tl.constexpr(0x7E00)


@triton.jit
def _int_params(mn, mx, fin, LEVELS: tl.constexpr, ASM: tl.constexpr):
    """Row min/max -> (fp16 scale bits, fp16 min bits, f32 scale, f32 min, usable) as formats.integer."""
    mn = mn + 0.0  # a zero extreme as +0 (formats.integer)
    mx = mx + 0.0
    sc_h = tl.minimum(div_ieee(mx - mn, LEVELS, ASM), F16_MAX).to(tl.float16)
    mn_h = tl.minimum(tl.maximum(mn, -F16_MAX), F16_MAX).to(tl.float16)
    sc_bits = tl.where(fin, sc_h.to(tl.uint16, bitcast=True).to(tl.int32), F16_NAN_BITS)
    mn_bits = tl.where(fin, mn_h.to(tl.uint16, bitcast=True).to(tl.int32), F16_NAN_BITS)
    s = sc_h.to(tl.float32)
    usable = fin & (s > 0)
    return sc_bits, mn_bits, tl.where(usable, s, 1.0), mn_h.to(tl.float32), usable


@triton.jit
def _int_code(x, m, s, usable, LEVELS: tl.constexpr, ASM: tl.constexpr):
    q = rint(div_ieee(x - m[:, None], s[:, None], ASM))
    q = tl.minimum(tl.maximum(q, 0.0), LEVELS)
    return tl.where(usable[:, None], q, 0.0).to(tl.int32)


@triton.jit
def _store_f16_bytes(SC, srow, bits, byte_off: tl.constexpr, mask):
    tl.store(SC + srow + byte_off, (bits & 0xFF).to(tl.uint8), mask=mask)
    tl.store(SC + srow + (byte_off + 1), (bits >> 8).to(tl.uint8), mask=mask)


@triton.jit
def _encode_rows(X, s_xt, s_xh, SLOT, T, t0, h, PD, s_pb, s_ph, s_pt, SC, s_sb, s_sh, s_st, G,
                 F: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, GRP: tl.constexpr, NGP: tl.constexpr,
                 F8E5: tl.constexpr, RCEIL: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, ASM: tl.constexpr):
    offs_t = t0 + tl.arange(0, BT)
    slot = tl.load(SLOT + offs_t, mask=offs_t < T, other=-1).to(tl.int64)
    ok = (offs_t < T) & (slot >= 0)
    blk = tl.where(ok, slot // BS, 0)
    off = tl.where(ok, slot % BS, 0)
    h64 = h.to(tl.int64)
    xrow = offs_t.to(tl.int64) * s_xt + h64 * s_xh
    prow = blk * s_pb + h64 * s_ph + off * s_pt
    srow = blk * s_sb + h64 * s_sh + off * s_st
    if F == F_PLAIN or F == F_FP8 or F == F_INT8:
        d = tl.arange(0, DP)
        m2 = ok[:, None] & (d < D)[None, :]
        x = tl.load(X + xrow[:, None] + d[None, :], mask=m2, other=0)
        dst = PD + prow[:, None] + d[None, :]
        if F == F_PLAIN:
            tl.store(dst, cast_exact(x, PD.dtype.element_ty), mask=m2)
        elif F == F_FP8:
            xf = to_f32(x)
            fmax = 57344.0 if F8E5 else 448.0
            y = tl.minimum(tl.maximum(div_ieee(xf, tl.load(G + h), ASM), -fmax), fmax)
            if F8E5:
                b = f32_to_f8_bits(y, 2, 15)
            else:
                b = f32_to_f8_bits(y, 3, 7)
            tl.store(dst, tl.where(is_finite(xf), b, 0x7F).to(tl.uint8), mask=m2)
        else:
            xf = to_f32(x)
            dm = (d < D)[None, :]
            fin = tl.max(tl.where(dm & ~is_finite(xf), 1, 0), axis=1) == 0
            mn = tl.min(tl.where(dm, xf, float("inf")), axis=1)
            mx = tl.max(tl.where(dm, xf, float("-inf")), axis=1)
            sc_bits, mn_bits, s, m, usable = _int_params(mn, mx, fin, 255.0, ASM)
            tl.store(dst, _int_code(xf, m, s, usable, 255.0, ASM).to(tl.uint8), mask=m2)
            _store_f16_bytes(SC, srow, sc_bits, 0, ok)
            _store_f16_bytes(SC, srow, mn_bits, 2, ok)
    elif F == F_INT4:
        HP: tl.constexpr = DP // 2
        d = tl.arange(0, DP)
        m2 = ok[:, None] & (d < D)[None, :]
        xa, xb = tl.split(tl.reshape(to_f32(tl.load(X + xrow[:, None] + d[None, :], mask=m2, other=0)), [BT, HP, 2]))
        j = tl.arange(0, HP)
        jm = (j < D // 2)[None, :]
        fin = tl.max(tl.where(jm & ~(is_finite(xa) & is_finite(xb)), 1, 0), axis=1) == 0
        mn = tl.minimum(tl.min(tl.where(jm, xa, float("inf")), axis=1), tl.min(tl.where(jm, xb, float("inf")), axis=1))
        mx = tl.maximum(tl.max(tl.where(jm, xa, float("-inf")), axis=1),
                        tl.max(tl.where(jm, xb, float("-inf")), axis=1))
        sc_bits, mn_bits, s, m, usable = _int_params(mn, mx, fin, 15.0, ASM)
        qa = _int_code(xa, m, s, usable, 15.0, ASM)
        qb = _int_code(xb, m, s, usable, 15.0, ASM)
        tl.store(PD + prow[:, None] + j[None, :], (qa | (qb << 4)).to(tl.uint8), mask=ok[:, None] & jm)
        _store_f16_bytes(SC, srow, sc_bits, 0, ok)
        _store_f16_bytes(SC, srow, mn_bits, 2, ok)
    else:  # F_NVFP4 / F_MXFP4: groups of GRP along D, even/odd elements -> low/high nibbles
        GH: tl.constexpr = GRP // 2
        gi = tl.arange(0, NGP)
        ji = tl.arange(0, GH)
        gm = gi < D // GRP
        m3 = ok[:, None, None] & gm[None, :, None]
        eidx = gi[None, :, None] * GRP + tl.arange(0, GRP)[None, None, :]
        x = to_f32(tl.load(X + xrow[:, None, None] + eidx, mask=m3, other=0))
        xa, xb = tl.split(tl.reshape(x, [BT, NGP, GH, 2]))  # one contiguous row load, even/odd split in registers
        fin = tl.max(tl.where(is_finite(xa) & is_finite(xb), 0, 1), axis=2) == 0
        amax = tl.maximum(tl.max(tl.abs(xa), axis=2), tl.max(tl.abs(xb), axis=2))
        amax = tl.where(fin, amax, 0.0)
        if F == F_NVFP4:
            g = tl.load(G + h)
            s = div_ieee(amax, 6.0 * g, ASM)
            s = tl.where(s == 0, 1.0, s)
            s = tl.minimum(tl.maximum(s, 0.001953125), 448.0)
            sbyte = f32_to_f8_bits(s, 3, 7)
            big_s = e4m3_f32(sbyte) * g
            sbyte = tl.where(fin, sbyte, 0x7F)
            ya = div_ieee(xa, big_s[:, :, None], ASM)
            yb = div_ieee(xb, big_s[:, :, None], ASM)
        else:
            if RCEIL:
                dd = div_ieee(amax, 6.0, ASM)
                e = tl.where(dd > 0, ceil_log2(tl.where(dd > 0, dd, 1.0)), -127)
            else:
                e = floor_log2(tl.where(amax > 0, amax, 1.0)) - 2
            e = tl.where(amax > 0, e, -127)
            e = tl.minimum(tl.maximum(e, -127), 127)
            sbyte = tl.where(fin, e + 127, 0xFF)
            inv_s = e8m0_f32(127 - e)[:, :, None]  # 2**-e: x * 2**-e rounds exactly as x / 2**e (same value)
            ya = xa * inv_s
            yb = xb * inv_s
        ca = e2m1_code(ya)
        cb = e2m1_code(yb)
        byte = tl.where(fin[:, :, None], ca | (cb << 4), 0)
        tl.store(PD + prow[:, None, None] + (gi[None, :, None] * GH + ji[None, None, :]), byte.to(tl.uint8), mask=m3)
        tl.store(SC + srow[:, None] + gi[None, :], sbyte.to(tl.uint8), mask=ok[:, None] & gm[None, :])


@triton.jit
def _write_kernel(
    SLOT, T,
    KX, s_kxt, s_kxh, KD, s_kdb, s_kdh, s_kdt, KS, s_ksb, s_ksh, s_kst, KG,
    VX, s_vxt, s_vxh, VD, s_vdb, s_vdh, s_vdt, VS, s_vsb, s_vsh, s_vst, VG,
    D: tl.constexpr, DP: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
    KF: tl.constexpr, KGRP: tl.constexpr, KNGP: tl.constexpr, KE5: tl.constexpr, KRCEIL: tl.constexpr,
    VF: tl.constexpr, VGRP: tl.constexpr, VNGP: tl.constexpr, VE5: tl.constexpr, VRCEIL: tl.constexpr,
    ASM: tl.constexpr,
):
    t0 = tl.program_id(0) * BT
    h = tl.program_id(1)
    if tl.program_id(2) == 0:
        _encode_rows(KX, s_kxt, s_kxh, SLOT, T, t0, h, KD, s_kdb, s_kdh, s_kdt, KS, s_ksb, s_ksh, s_kst, KG,
                     KF, D, DP, KGRP, KNGP, KE5, KRCEIL, BT, BS, ASM)
    else:
        _encode_rows(VX, s_vxt, s_vxh, SLOT, T, t0, h, VD, s_vdb, s_vdh, s_vdt, VS, s_vsb, s_vsh, s_vst, VG,
                     VF, D, DP, VGRP, VNGP, VE5, VRCEIL, BT, BS, ASM)


def _side(name, x, data, scales, gs, tf, d, hkv):
    """Kernel arguments and constexprs of one of K/V (`x` checked by `check_write_args`; here its pools)."""
    kf = kernel_format(tf)
    check_pool(name, data, kf, d)
    x = x if x.stride(2) == 1 else x.contiguous()
    sc = scale_args(name, scales, data, kf, tf, d)
    grp = kf.group or 16
    ngp = triton.next_power_of_2(max(1, d // grp))
    consts = (kf.code, grp, ngp, kf.e5m2, kf.rceil)
    args = (x, x.stride(0), x.stride(1), as_bytes(data), data.stride(0), data.stride(1), data.stride(2), *sc,
            global_scale_arg(gs, kf, hkv, x.device))
    return args, consts


@torch.no_grad()
def write_pools(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             k_data: torch.Tensor, k_scales: torch.Tensor | None, v_data: torch.Tensor, v_scales: torch.Tensor | None,
             fmt: CacheFormat | str, k_gs=None, v_gs=None, *, check: bool = True, block_t: int | None = None) -> None:
    """Quantize `key`/`value [T, H_kv, D]` (bf16/fp16/fp32) in `fmt` and scatter them into the HND pools
    at `slot_mapping [T]` (int32/int64; negative = skip), one launch for K and V.

    Everything (both sides, pools, slots, global scales) is checked before the launch, so a rejected call
    stores nothing. `check` adds the value checks (host syncs), as the reference does: valid slots in range
    and unique, global scales finite and > 0; hot paths that validated them upstream pass False.
    """
    fmt = as_format(fmt)
    nb, hkv, bs = pool_geometry(k_data, v_data)
    args = check_write_args(fmt, key, value, slot_mapping, num_slots=nb * bs, num_kv_heads=hkv, k_gs=k_gs, v_gs=v_gs,
                            check=check)
    launch_write(key, value, args, k_data, k_scales, v_data, v_scales, fmt, block_t=block_t)


def launch_write(key: torch.Tensor, value: torch.Tensor, args: WriteArgs, k_data: torch.Tensor,
                 k_scales: torch.Tensor | None, v_data: torch.Tensor, v_scales: torch.Tensor | None,
                 fmt: CacheFormat, *, block_t: int | None = None) -> None:
    """The fused write of arguments `check_write_args` accepted for these pools (`write_pools`, and `ops.dispatch`
    after its descriptor-level check); the pools themselves are checked here, still before the launch."""
    _, hkv, bs = pool_geometry(k_data, v_data)
    check_device(key, value, args.slots, k_data, v_data)
    d = int(key.shape[2])
    if fmt.rotate:  # the reference's own rotation: bit-identical inputs
        key, value = rotate_kv(key, value)
    kargs, kc = _side("K", key, k_data, k_scales, args.k_gs, fmt.k, d, hkv)
    vargs, vc = _side("V", value, v_data, v_scales, args.v_gs, fmt.v, d, hkv)
    t = int(key.shape[0])
    if t == 0:
        return
    dp = triton.next_power_of_2(d)
    bt = block_t or max(1, min(64, 4096 // dp))
    _write_kernel[(triton.cdiv(t, bt), hkv, 2)](
        args.slots, t, *kargs, *vargs,
        D=d, DP=dp, BT=bt, BS=bs,
        KF=kc[0], KGRP=kc[1], KNGP=kc[2], KE5=kc[3], KRCEIL=kc[4],
        VF=vc[0], VGRP=vc[1], VNGP=vc[2], VE5=vc[3], VRCEIL=vc[4], ASM=not interpreting(),
        num_warps=4, enable_fp_fusion=False,
    )
