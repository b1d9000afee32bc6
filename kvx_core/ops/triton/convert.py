"""Format conversion of bundled rows on import: decode the source rows and encode them in the destination format
straight into its pools, K and V in ONE launch, through the gather's decoder (`gather._decode_rows`) and the fused
write's encoder (`write._encode_rows`): the same `@triton.jit` code, so the bits are those of the torch reference
(`formats` decode, then `reference.write_kv`).

Grid `(cdiv(T, BT), H, 2)`: a program decodes BT tokens of one head of K (axis 2 = 0) or V (= 1) into an FP32
scratch row block, then (ENCODE) encodes that same block by slot mapping; the barrier between them orders the
program's own global stores before its loads (each program reads only what it wrote). Without ENCODE the kernel
only decodes (`decode_rows`): for conversions with a rotation or key transform in between, which run in torch on
the decoded rows as the reference's do, then go through the fused write.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ...errors import Status, require
from ...formats import CacheFormat
from ..checks import WriteArgs
from ..kernel_format import kernel_format
from .gather import _decode_rows
from .launch import as_bytes, check_device, global_scale_arg, interpreting, on_device, pool_geometry
from .write import _encode_rows, _side


@triton.jit(do_not_specialize=["T"])  # one compiled variant for every bundle length (`rows._rows_kernel`)
def _convert_kernel(
    SLOT, T, H,
    KR, s_kr, KRS, s_krs, KRG, VR, s_vr, VRS, s_vrs, VRG, KX, VX,
    KD, s_kdb, s_kdh, s_kdt, KS, s_ksb, s_ksh, s_kst, KG,
    VD, s_vdb, s_vdh, s_vdt, VS, s_vsb, s_vsh, s_vst, VG,
    D: tl.constexpr, DP: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
    SKF: tl.constexpr, SKGRP: tl.constexpr, SKNGP: tl.constexpr, SKE5: tl.constexpr,
    SVF: tl.constexpr, SVGRP: tl.constexpr, SVNGP: tl.constexpr, SVE5: tl.constexpr,
    KF: tl.constexpr, KGRP: tl.constexpr, KNGP: tl.constexpr, KE5: tl.constexpr, KRCEIL: tl.constexpr,
    VF: tl.constexpr, VGRP: tl.constexpr, VNGP: tl.constexpr, VE5: tl.constexpr, VRCEIL: tl.constexpr,
    ENCODE: tl.constexpr, ASM: tl.constexpr,
):
    t0 = tl.program_id(0) * BT
    h = tl.program_id(1)
    tt = (t0 + tl.arange(0, BT)).to(tl.int64)
    ok = tt < T
    zero = tt * 0
    # source rows are [T, H, X] (a token's rows s_* apart, a head's s_* / H): block = token, offset 0
    if tl.program_id(2) == 0:
        _decode_rows(KR, s_kr, s_kr // H, 0, KRS, s_krs, s_krs // H, 0, KRG, KX, H * D, D, tt, zero, tt, ok, h,
                     SKF, D, DP, SKGRP, SKNGP, SKE5)
        if ENCODE:
            tl.debug_barrier()
            _encode_rows(KX, H * D, D, SLOT, T, t0, h, KD, s_kdb, s_kdh, s_kdt, KS, s_ksb, s_ksh, s_kst, KG,
                         KF, D, DP, KGRP, KNGP, KE5, KRCEIL, BT, BS, ASM)
    else:
        _decode_rows(VR, s_vr, s_vr // H, 0, VRS, s_vrs, s_vrs // H, 0, VRG, VX, H * D, D, tt, zero, tt, ok, h,
                     SVF, D, DP, SVGRP, SVNGP, SVE5)
        if ENCODE:
            tl.debug_barrier()
            _encode_rows(VX, H * D, D, SLOT, T, t0, h, VD, s_vdb, s_vdh, s_vdt, VS, s_vsb, s_vsh, s_vst, VG,
                         VF, D, DP, VGRP, VNGP, VE5, VRCEIL, BT, BS, ASM)


def _source(tf, rows: dict[str, torch.Tensor], which: str, d: int, hkv: int) -> tuple[list, tuple]:
    """Kernel arguments and constexprs of one side's source rows (`{which}_data [T, H, P]` contiguous, its scales
    `[T, H, S]` and global scale when the format has them)."""
    kf = kernel_format(tf)
    data = as_bytes(rows[f"{which}_data"])
    scales = rows.get(f"{which}_scales")
    sc = (data, 0) if scales is None else (scales, scales.stride(0))
    args = [data, data.stride(0), *sc, global_scale_arg(rows.get(f"{which}_global"), kf, hkv, data.device)]
    grp = kf.group or 16
    return args, (kf.code, grp, triton.next_power_of_2(max(1, d // grp)), kf.e5m2)


def _launch(src: CacheFormat, rows: dict[str, torch.Tensor], d: int, hkv: int, out: tuple, encode: tuple | None,
            block_t: int | None) -> None:
    """The conversion kernel over `rows` into the FP32 `out` (K, V); `encode`: (slots, K pool arguments, V pool
    arguments, K constexprs, V constexprs, block size) of the destination, None to decode only."""
    t = int(rows["k_data"].shape[0])
    if t == 0:
        return
    kr, skc = _source(src.k, rows, "k", d, hkv)
    vr, svc = _source(src.v, rows, "v", d, hkv)
    unused = [out[0], 0, 0, 0, out[0], 0, 0, 0, out[0]]  # decode only: the encode branch is compiled out
    off = (0, 16, 1, False, False)
    slots, kargs, vargs, kc, vc, bs = encode or (out[0], unused, unused, off, off, 1)
    dp = triton.next_power_of_2(d)
    bt = block_t or max(1, min(64, 4096 // dp))
    with on_device(out[0].device):
        _convert_kernel[(triton.cdiv(t, bt), hkv, 2)](
            slots, t, hkv, *kr, *vr, out[0], out[1], *kargs, *vargs,
            D=d, DP=dp, BT=bt, BS=bs,
            SKF=skc[0], SKGRP=skc[1], SKNGP=skc[2], SKE5=skc[3], SVF=svc[0], SVGRP=svc[1], SVNGP=svc[2], SVE5=svc[3],
            KF=kc[0], KGRP=kc[1], KNGP=kc[2], KE5=kc[3], KRCEIL=kc[4],
            VF=vc[0], VGRP=vc[1], VNGP=vc[2], VE5=vc[3], VRCEIL=vc[4],
            ENCODE=encode is not None, ASM=not interpreting(), num_warps=4, enable_fp_fusion=False,
        )


@torch.no_grad()
def decode_rows(src: CacheFormat, rows: dict[str, torch.Tensor], head_dim: int, *,
                block_t: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 `[T, H, D]` K and V of bundled rows of format `src` (contiguous `[T, H, X]` tensors on one device; a
    rotated format's rows still rotated): `TensorFormat.decode` of each side, bit for bit, in one launch."""
    t, hkv = rows["k_data"].shape[:2]
    check_device(*(rows[n] for n in rows))
    out = tuple(torch.empty(t, hkv, head_dim, dtype=torch.float32, device=rows["k_data"].device) for _ in "kv")
    _launch(src, rows, head_dim, hkv, out, None, block_t)
    return out


def plan_convert(src: CacheFormat, rows: dict[str, torch.Tensor], args: WriteArgs, k_data: torch.Tensor,
                 k_scales: torch.Tensor | None, v_data: torch.Tensor, v_scales: torch.Tensor | None,
                 fmt: CacheFormat, *, scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
                 block_t: int | None = None) -> Callable[[], None]:
    """The store of bundled rows of format `src` (as for `decode_rows`) into the HND pools of `fmt` at `args.slots`
    (checked slots and global scales), as `reference.write_kv` of their decoded K/V stores them; neither format
    rotated, no key transform (the caller's rule). Every argument is checked here; the returned callable only
    launches (one launch for K and V). `scratch`: the FP32 `[T, H, D]` K and V the launch decodes into, which every
    layer of an import may share (their launches run in order on one stream: one allocation per bundle, not two
    per layer, issue 36); None: allocated by each launch."""
    require(not (src.rotate or fmt.rotate), Status.INVALID_ARGUMENT, "plan_convert: rotated formats convert "
                                                                     "through decode_rows and the fused write")
    _, hkv, bs = pool_geometry(k_data, v_data)
    d = int(k_data.shape[3]) * (2 if kernel_format(fmt.k).packed else 1)
    t = int(rows["k_data"].shape[0])
    check_device(args.slots, k_data, v_data, *rows.values())
    if scratch is not None:
        require(isinstance(scratch, tuple) and len(scratch) == 2
                and all(isinstance(x, torch.Tensor) and x.dtype == torch.float32 and tuple(x.shape) == (t, hkv, d)
                        and x.is_contiguous() and x.device == k_data.device for x in scratch),
                Status.INVALID_ARGUMENT, f"plan_convert: scratch must be two contiguous FP32 [{t}, {hkv}, {d}] "
                                         f"tensors on {k_data.device}")
    like = scratch[0] if scratch is not None else torch.empty(0, hkv, d, dtype=torch.float32, device=k_data.device)
    kargs, kc = _side("K", like, k_data, k_scales, args.k_gs, fmt.k, d, hkv)  # `like`: the scratch's strides
    vargs, vc = _side("V", like, v_data, v_scales, args.v_gs, fmt.v, d, hkv)
    encode = (args.slots, list(kargs[3:]), list(vargs[3:]), kc, vc, bs)

    def launch() -> None:  # without a shared scratch, the FP32 scratch lives for one layer's launch only
        out = scratch if scratch is not None else tuple(torch.empty(t, hkv, d, dtype=torch.float32,
                                                                    device=k_data.device) for _ in "kv")
        _launch(src, rows, d, hkv, out, encode, block_t)
    return launch
