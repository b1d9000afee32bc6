"""Launcher of the CUDA paged decode (`paged_decode_mma.cu`): which calls it serves, and the launch.

It serves NVFP4 (f16/bf16 queries), MXFP4 16/32 (bf16 queries), INT4, INT8 and FP8 E4M3/E5M2 (f16/bf16)
caches whose K and V use the same format, and k8v4 (FP8 E4M3 keys, NVFP4 values) (rotated variants too), head_dim
64/128/256, 1..16 query heads per KV head, block sizes that are multiples of 16, dense token rows aligned for word
loads; 4 warps/CTA. Anything else goes to the Triton kernel (`supports` says why). The kernel writes per-split partial
outputs and, in the same library call, merges them (the merge of `ops/triton/merge.py`, which serves the Triton decode,
with attention sinks).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ...errors import KvxError, Status
from ...formats import CacheFormat
from ..kernel_format import MIXED, FormatCode, KernelFormat, kernel_format
from . import checked_library, cuda_error_name, launch_on_stream

WARPS = 4  # warps per CTA of the CUDA kernel (its tiles are 16 tokens per warp)


class DecodeParams(ctypes.Structure):
    """ctypes mirror of `kvx::DecodeParams` (checked against the library's sizeof at load), in its three groups:
    the layer's cache (`LayerArgs`, filled once per bound layer), the step (`step_params`, once per plan and
    tables) and the call (query, output: `launch_args`)."""

    _fields_ = [
        ("kd", ctypes.c_void_p), ("kd_sb", ctypes.c_int64), ("kd_sh", ctypes.c_int64), ("kd_st", ctypes.c_int64),
        ("ks", ctypes.c_void_p), ("ks_sb", ctypes.c_int64), ("ks_sh", ctypes.c_int64), ("ks_st", ctypes.c_int64),
        ("vd", ctypes.c_void_p), ("vd_sb", ctypes.c_int64), ("vd_sh", ctypes.c_int64), ("vd_st", ctypes.c_int64),
        ("vs", ctypes.c_void_p), ("vs_sb", ctypes.c_int64), ("vs_sh", ctypes.c_int64), ("vs_st", ctypes.c_int64),
        ("kg", ctypes.c_void_p), ("vg", ctypes.c_void_p), ("qs", ctypes.c_void_p),
        ("bt", ctypes.c_void_p), ("bt_sb", ctypes.c_int64), ("seq", ctypes.c_void_p),
        ("mo", ctypes.c_void_p), ("mo_sb", ctypes.c_int64), ("mo_sh", ctypes.c_int64), ("mo_ss", ctypes.c_int64),
        ("ml", ctypes.c_void_p), ("ml_sb", ctypes.c_int64), ("ml_sh", ctypes.c_int64), ("sinks", ctypes.c_void_p),
        ("sm_scale", ctypes.c_float), ("softcap", ctypes.c_float), ("window", ctypes.c_int32),
        ("qh", ctypes.c_int32), ("bs", ctypes.c_int32), ("num_splits", ctypes.c_int32), ("rotate_out", ctypes.c_int32),
        ("rows_per_seq", ctypes.c_int32), ("q_rot", ctypes.c_void_p),
        ("q", ctypes.c_void_p), ("q_sb", ctypes.c_int64), ("q_sh", ctypes.c_int64),
        ("o", ctypes.c_void_p), ("o_sb", ctypes.c_int64), ("o_sh", ctypes.c_int64),
        ("lse", ctypes.c_void_p), ("lse_sb", ctypes.c_int64), ("lse_sh", ctypes.c_int64),
        ("o_dtype", ctypes.c_int32),
    ]


_STEP_BYTES = (DecodeParams.bt.offset, DecodeParams.q.offset)  # the step group, copied into a call's params
OUT_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # what the merge writes


def kernel_library(device) -> ctypes.CDLL:
    """The kernel library for a CUDA device (`library`), with `kvx_paged_decode`'s signature set and the
    DecodeParams mirror checked against the C struct's size and field offsets (INTERNAL_ERROR if they differ)."""
    return checked_library(device, "kvx_paged_decode", [ctypes.c_void_p] + [ctypes.c_int] * 8 + [ctypes.c_void_p],
                           "kvx_decode_params_size", DecodeParams, "paged_decode_mma.cu", "kvx_decode_params_layout")


def _served(fmt: CacheFormat) -> tuple[KernelFormat, KernelFormat] | None:
    """The kernel formats (K, V) when the CUDA kernel decodes the pair (`KernelFormat.cuda_code`: one format for
    both, or a `MIXED` pair), else None."""
    try:
        kk, kv = kernel_format(fmt.k), kernel_format(fmt.v)
    except KvxError:
        return None
    if kk.cuda_code is None or kv.cuda_code is None:
        return None
    return (kk, kv) if kk == kv or (kk.cuda_code, kv.cuda_code) in MIXED else None


def _aligned(t: torch.Tensor, width: int) -> bool:
    return t.data_ptr() % width == 0 and all(t.stride(i) % width == 0 for i in range(3))


def plan_reason(fmt: CacheFormat, q_dtype: torch.dtype, device: torch.device, batch: int, num_qo_heads: int,
                num_kv_heads: int, head_dim: int, block_size: int) -> str | None:
    """None when the CUDA kernel can serve a step of this geometry (the pools are checked by `pool_reason` at
    launch), else the reason it cannot."""
    if _served(fmt) is not None:
        if device.type != "cuda":
            return "not a CUDA tensor"
        if torch.cuda.get_device_capability(device) < (8, 9):
            return "needs compute capability >= 8.9"
    return geometry_reason(fmt, q_dtype, batch, num_qo_heads, num_kv_heads, head_dim, block_size)


def geometry_reason(fmt: CacheFormat, q_dtype: torch.dtype, batch: int, num_qo_heads: int, num_kv_heads: int,
                    head_dim: int, block_size: int) -> str | None:
    """`plan_reason` without the device: the formats, query dtypes and geometries the kernel serves (the CPU suite's
    host build of the kernel, tests/kernels/host_decode.cpp, serves what this accepts)."""
    served = _served(fmt)
    if served is None:
        return f"format {fmt.name}: the CUDA decode serves nvfp4 / mxfp4 / int4 / int8 / fp8 / k8v4"
    mx = any(kf.code == FormatCode.MXFP4 for kf in served)
    if q_dtype not in (torch.float16, torch.bfloat16) or (mx and q_dtype != torch.bfloat16):
        return f"{q_dtype} queries (MXFP4 needs bf16, the others f16 or bf16)"
    if head_dim not in (64, 128, 256):
        return f"head_dim {head_dim} (64/128/256)"
    if num_qo_heads // num_kv_heads > 16:
        return f"{num_qo_heads // num_kv_heads} query heads per KV head (<= 16)"
    if block_size % 16:
        return f"block size {block_size} (a multiple of 16)"
    if batch > 65535 or num_kv_heads > 65535:
        return "grid too large"
    return None


PAGE_STRIDE_LIMIT = 2**31
"""The kernel multiplies a block id by a page stride in 32 x 32 -> 64 bits (one instruction per pool and tile)."""


def pool_reason(q: torch.Tensor, fmt: CacheFormat, k_data, k_scales, v_data, v_scales) -> str | None:
    """None when the kernel can address these tensors (dense, word-aligned rows), else the reason it cannot."""
    d = q.shape[2]
    # a thread loads a quarter K row and an eighth V row per token, and the scale bytes of those
    kk, kv = _served(fmt)
    for name, kf, data, scales, part in (("K", kk, k_data, k_scales, 4), ("V", kv, v_data, v_scales, 8)):
        row = d // 2 if kf.packed else d  # payload bytes per token row
        if not _aligned(data, min(16, row // part)):
            return f"{name} payload rows not aligned for word loads"
        if data.stride(2) != row:
            return f"{name} rows of a page are not dense (token stride {data.stride(2)} != {row} bytes)"
        for what, t in [("payload", data)] + ([("scale", scales)] if kf.has_scales else []):
            if t.stride(0) >= PAGE_STRIDE_LIMIT:
                return f"{name} {what} page stride {t.stride(0)} reaches 2**31 bytes"
        if kf.has_scales:
            width = 4 if kf.affine else max(1, (d // part) // kf.group)  # INT: fp16 scale | min words
            if not _aligned(scales, width):
                return f"{name} scale rows not aligned"
            srow = 4 if kf.affine else d // kf.group
            if scales.stride(2) != srow:
                return f"{name} scale rows of a page are not dense (token stride {scales.stride(2)} != {srow} bytes)"
    if q.stride(2) != 1:
        return "query last dim not contiguous"
    return None


def supports(q: torch.Tensor, fmt: CacheFormat, k_data, k_scales, v_data, v_scales) -> str | None:
    """None when the CUDA kernel serves this call, else the reason it does not."""
    bsz, hq, d = q.shape
    _, hkv, bs, _ = k_data.shape
    return plan_reason(fmt, q.dtype, q.device, bsz, hq, hkv, d, bs) \
        or pool_reason(q, fmt, k_data, k_scales, v_data, v_scales)


@dataclass(frozen=True, eq=False)
class LayerArgs:
    """One layer's cache as the CUDA decode takes it, derived once (`layer_args`; a bound layer keeps it): the
    layer group of the parameters, the format codes and the library's entry point."""

    params: DecodeParams
    codes: tuple[int, int, int, int]  # K format, V format, FP4 group, head_dim
    num_kv_heads: int
    device: torch.device
    entry: object  # the library's kvx_paged_decode


def layer_args(fmt: CacheFormat, k_data, k_scales, v_data, v_scales, kg, vg,
               q_smoothing: torch.Tensor | None = None) -> LayerArgs:
    """The layer group for `supports`-approved pools: `kg` / `vg` FP32 `[H_kv]` global scales (read for the sides
    whose format has one), `q_smoothing` contiguous FP32 `[H_kv, D]` the kernel multiplies the queries by as it loads
    them (key smoothing; not for rotated formats)."""
    kk, kv = _served(fmt)
    p = DecodeParams()
    for pre, data, sc in (("k", k_data, k_scales), ("v", v_data, v_scales)):
        setattr(p, pre + "d", data.data_ptr())
        setattr(p, pre + "s", sc.data_ptr())
        for suf, i in (("b", 0), ("h", 1), ("t", 2)):
            setattr(p, f"{pre}d_s{suf}", data.stride(i))
            setattr(p, f"{pre}s_s{suf}", sc.stride(i))
    p.kg = kg.data_ptr() if kg is not None and kk.global_scale else None
    p.vg = vg.data_ptr() if vg is not None and kv.global_scale else None
    p.qs = q_smoothing.data_ptr() if q_smoothing is not None else None
    # group: the FP4 group size (the kernel reads it for NVFP4 / MXFP4 only)
    codes = (int(kk.cuda_code), int(kv.cuda_code), kk.group or kv.group or 16,
             int(k_data.shape[3]) * (2 if kk.packed else 1))
    return LayerArgs(p, codes, int(k_data.shape[1]), k_data.device, kernel_library(k_data.device).kvx_paged_decode)


def step_params(block_table: torch.Tensor, seq_lens: torch.Tensor, mid_o: torch.Tensor, mid_l: torch.Tensor,
                sm_scale: float, softcap: float | None, window: int | None, qh: int, block_size: int,
                sinks: torch.Tensor | None = None, rotate_out: bool = False, rows_per_seq: int = 1,
                q_rot: torch.Tensor | None = None) -> DecodeParams:
    """The step group: int32 `block_table [B / rows_per_seq, max_blocks]` / `seq_lens [B]` (the keys each of the B
    query rows attends; row r reads block-table row `r // rows_per_seq`: speculative decoding's 1 + k tokens of a
    sequence), the split workspace `mid_o [B, Hq, S, D]` / `mid_l [B, Hq, S]`, the options, `sinks` (contiguous FP32
    `[Hq]` natural-log logits, or None), whether the merge rotates the output back and `q_rot`, contiguous scratch of
    at least B * Hq * D query-dtype elements the library rotates the queries into first (`_rot` formats: then the
    queries come unrotated and the output leaves unrotated, one library call)."""
    p = DecodeParams()
    p.bt, p.bt_sb, p.seq = block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr()
    p.mo, p.mo_sb, p.mo_sh, p.mo_ss = mid_o.data_ptr(), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2)
    p.ml, p.ml_sb, p.ml_sh = mid_l.data_ptr(), mid_l.stride(0), mid_l.stride(1)
    p.sinks = sinks.data_ptr() if sinks is not None else None
    p.sm_scale, p.softcap = sm_scale, float(softcap) if softcap else 0.0
    p.window = min(int(window), 2**31 - 1) if window is not None and window >= 0 else -1  # int32 field: saturate
    p.qh, p.bs, p.num_splits, p.rotate_out = qh, block_size, mid_o.shape[2], int(rotate_out)
    p.rows_per_seq = rows_per_seq
    p.q_rot = q_rot.data_ptr() if q_rot is not None else None
    return p


def launch_args(layer: LayerArgs, step: DecodeParams, q: torch.Tensor, out: torch.Tensor | None = None,
                lse: torch.Tensor | None = None) -> None:
    """Decode `q [B, Hq, D]` (contiguous last dim; rotated formats: in the rotated domain) over `layer` with `step`'s
    tables and workspace: the per-split partials, then (with `out [B, Hq, D]` fp32/fp16/bf16 and `lse [B, Hq]` fp32,
    last dims contiguous) their merge, in one library call."""
    p = DecodeParams.from_buffer_copy(layer.params)
    ctypes.memmove(ctypes.addressof(p) + _STEP_BYTES[0], ctypes.addressof(step) + _STEP_BYTES[0],
                   _STEP_BYTES[1] - _STEP_BYTES[0])
    p.q, p.q_sb, p.q_sh = q.data_ptr(), q.stride(0), q.stride(1)
    if out is not None:
        p.o, p.o_sb, p.o_sh, p.o_dtype = out.data_ptr(), out.stride(0), out.stride(1), OUT_DTYPES[out.dtype]
        p.lse, p.lse_sb, p.lse_sh = lse.data_ptr(), lse.stride(0), lse.stride(1)
    kf, vf, group, d = layer.codes
    err = launch_on_stream(layer.entry, layer.device.index, ctypes.byref(p), kf, vf, int(q.dtype == torch.bfloat16),
                           d, group, WARPS, q.shape[0], layer.num_kv_heads)
    if err != 0:
        raise KvxError(Status.INTERNAL_ERROR, f"KVX CUDA decode launch failed: {cuda_error_name(err)}")


def launch(q, k_data, k_scales, v_data, v_scales, kg, vg, block_table, seq_lens, fmt: CacheFormat,
           mid_o: torch.Tensor, mid_l: torch.Tensor, sm_scale: float, softcap: float | None,
           window: int | None, q_smoothing: torch.Tensor | None = None, out: torch.Tensor | None = None,
           lse: torch.Tensor | None = None, sinks: torch.Tensor | None = None, rotate_out: bool = False,
           rows_per_seq: int = 1, q_rot: torch.Tensor | None = None) -> None:
    """`launch_args` on arguments derived for this call: write the per-split partials of `supports`-approved inputs
    into `mid_o [B, Hq, S, D]` / `mid_l [B, Hq, S]` and, with `out` and `lse`, merge them (with `sinks`; rotated back
    with `rotate_out`; `rows_per_seq`, `q_rot`: see `step_params`)."""
    layer = layer_args(fmt, k_data, k_scales, v_data, v_scales, kg, vg, q_smoothing)
    step = step_params(block_table, seq_lens, mid_o, mid_l, sm_scale, softcap, window, q.shape[1] // k_data.shape[1],
                       int(k_data.shape[2]), sinks, rotate_out, rows_per_seq, q_rot)
    launch_args(layer, step, q, out, lse)


def merge(mid_o: torch.Tensor, mid_l: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
          sinks: torch.Tensor | None = None, rotate_out: bool = False) -> None:
    """The library's split merge alone: `mid_o [B, Hq, S, D]` / `mid_l [B, Hq, S]` (fp32, as the decode kernels write
    them; D a multiple of 32) into `out [B, Hq, D]` (fp32 / fp16 / bf16) and `lse [B, Hq]` (fp32), last dims
    contiguous; what `launch` runs after the decode (the Triton merge's math, with attention sinks; `rotate_out`: then
    `ops.rotation.rotate` of the FP32 result into `out`'s dtype, D 64 / 128 / 256)."""
    bsz, hq, _, d = mid_o.shape
    p = DecodeParams()
    p.mo, p.mo_sb, p.mo_sh, p.mo_ss = mid_o.data_ptr(), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2)
    p.ml, p.ml_sb, p.ml_sh = mid_l.data_ptr(), mid_l.stride(0), mid_l.stride(1)
    p.sinks = sinks.data_ptr() if sinks is not None else None
    p.num_splits, p.rotate_out = mid_o.shape[2], int(rotate_out)
    p.o, p.o_sb, p.o_sh, p.o_dtype = out.data_ptr(), out.stride(0), out.stride(1), OUT_DTYPES[out.dtype]
    p.lse, p.lse_sb, p.lse_sh = lse.data_ptr(), lse.stride(0), lse.stride(1)
    lib = checked_library(mid_o.device, "kvx_merge_splits", [ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_void_p],
                          "kvx_decode_params_size", DecodeParams, "paged_decode_mma.cu", "kvx_decode_params_layout")
    err = launch_on_stream(lib.kvx_merge_splits, mid_o.device.index, ctypes.byref(p), d, bsz, hq)
    if err != 0:
        raise KvxError(Status.INTERNAL_ERROR, f"KVX CUDA merge launch failed: {cuda_error_name(err)}")
