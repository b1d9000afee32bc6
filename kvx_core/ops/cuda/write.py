"""Launcher of the CUDA fused write (`paged_write.cu`): which calls it serves, and the launch.

It serves FP8 E4M3/E5M2, INT8, INT4, NVFP4 and MXFP4 (16 / 32, RCEIL or floor) caches whose K and V share a format,
and k8v4 (E4M3 keys, NVFP4 values), and their `_rot` variants (the kernel rotates each row in registers: the bits of
`ops.rotation.rotate`, which the Triton write runs before its kernel);
head_dim 32 / 64 / 128 / 256; fp32 / fp16 / bf16 K/V whose rows are 16-byte aligned; pools whose rows are aligned
for word stores. Anything else goes to the Triton write (`reason` says why). Both write the bytes of the formats'
encode (tests/kernels/test_write_kernel.py runs every case on every backend).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ...errors import KvxError, Status
from ...formats import CacheFormat
from ...formats.rotation import inv_sqrt
from ..checks import WriteArgs
from ..kernel_format import MIXED, ROTATING_ENCODERS, kernel_format
from . import checked_library, cuda_error_name, launch_on_stream

_X_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class WriteSide(ctypes.Structure):
    """ctypes mirror of `kvx_write::Side`."""

    _fields_ = [
        ("x", ctypes.c_void_p), ("x_st", ctypes.c_int64), ("x_sh", ctypes.c_int64),
        ("pd", ctypes.c_void_p), ("pd_sb", ctypes.c_int64), ("pd_sh", ctypes.c_int64), ("pd_st", ctypes.c_int64),
        ("ps", ctypes.c_void_p), ("ps_sb", ctypes.c_int64), ("ps_sh", ctypes.c_int64), ("ps_st", ctypes.c_int64),
        ("g", ctypes.c_void_p),
    ]


class WriteParams(ctypes.Structure):
    """ctypes mirror of `kvx_write::WriteParams` (checked against the library's sizeof at load)."""

    _fields_ = [
        ("side", WriteSide * 2), ("slots", ctypes.c_void_p), ("slots_64", ctypes.c_int32),
        ("tokens", ctypes.c_int32), ("bs", ctypes.c_int32), ("bs_log2", ctypes.c_int32),
        ("lanes_log2", ctypes.c_int32), ("rotate_scale", ctypes.c_float),
    ]


def kernel_library(device) -> ctypes.CDLL:
    """The kernel library with `kvx_paged_write`'s signature set and the WriteParams mirror checked."""
    return checked_library(device, "kvx_paged_write", [ctypes.c_void_p] + [ctypes.c_int] * 4 + [ctypes.c_void_p],
                           "kvx_write_params_size", WriteParams, "paged_write.cu")


def _aligned(t: torch.Tensor, width: int, dims: int) -> bool:
    """Base address and the first `dims` strides, in bytes, are multiples of `width`."""
    size = t.element_size()
    return t.data_ptr() % width == 0 and all((t.stride(i) * size) % width == 0 for i in range(dims))


def reason(key: torch.Tensor, value: torch.Tensor, fmt: CacheFormat, k_data: torch.Tensor,
           v_data: torch.Tensor) -> str | None:
    """None when the CUDA write serves a checked write of this K/V into these pools, else why not."""
    if key.device.type != "cuda":
        return "not a CUDA tensor"
    if torch.cuda.get_device_capability(key.device) < (8, 9):
        return "needs compute capability >= 8.9"
    return layout_reason(key, value, fmt, k_data, v_data)


def layout_reason(key: torch.Tensor, value: torch.Tensor, fmt: CacheFormat, k_data: torch.Tensor,
                  v_data: torch.Tensor) -> str | None:
    """`reason` without the device: the formats, dtypes, shapes and alignments the kernel serves (the CPU suite's
    host build of the kernel, tests/kernels/host_write.cpp, serves what this accepts)."""
    try:
        kk, kv = kernel_format(fmt.k), kernel_format(fmt.v)
    except KvxError:
        return f"format {fmt.name} has no kernel"
    ek, ev = kk.encoder, kv.encoder
    if ek is None or ev is None or (ek != ev and (kk.cuda_code, kv.cuda_code) not in MIXED):  # k8v4
        return f"format {fmt.name}: the CUDA write serves fp8 / int8 / int4 / nvfp4 / mxfp4 / k8v4"
    if fmt.rotate and (ek, ev) not in ROTATING_ENCODERS:
        return f"format {fmt.name}: the CUDA write rotates nvfp4 / mxfp4 / int4 / k8v4 rows"
    if key.dtype != value.dtype:
        return f"K is {key.dtype}, V {value.dtype} (one input dtype per launch)"
    d = int(key.shape[2])
    if d not in (32, 64, 128, 256):
        return f"head_dim {d} (32 / 64 / 128 / 256)"
    if key.shape[0] >= 2**30 or key.shape[1] > 65535:
        return "too many tokens or heads for the grid"
    for kf, data in ((kk, k_data), (kv, v_data)):  # a thread stores 32 elements: two 8- or 16-byte words
        if not _aligned(data, 8 if kf.packed else 16, 3):
            return "pool rows not aligned for word stores"
    return None


def _x_ok(x: torch.Tensor) -> bool:
    """Rows contiguous and 16-byte aligned (a thread loads 16-byte words)."""
    size = x.element_size()
    return x.stride(2) == 1 and x.data_ptr() % 16 == 0 and (x.stride(0) * size) % 16 == 0 \
        and (x.stride(1) * size) % 16 == 0


@dataclass(frozen=True, eq=False)
class LayerWrite:
    """One layer's pools as the CUDA write takes them (`layer_write`, once per bound layer): the parameters with both
    pool sides filled, the encoder codes and the library's entry point."""

    params: WriteParams
    codes: tuple[int, int]
    num_kv_heads: int
    device: torch.device
    entry: object  # the library's kvx_paged_write


def layer_write(fmt: CacheFormat, k_data, k_scales, v_data, v_scales, k_gs, v_gs) -> LayerWrite:
    """The pool sides of checked pools (`check_pool` / `scale_args`) that `reason` accepts, with their FP32 `[H]`
    global scales (read for the sides whose format has one)."""
    _, hkv, bs, _ = (int(n) for n in k_data.shape)
    p = WriteParams()
    codes = []
    for i, (tf, data, scales, gs) in enumerate(((fmt.k, k_data, k_scales, k_gs), (fmt.v, v_data, v_scales, v_gs))):
        kf = kernel_format(tf)
        codes.append(int(kf.encoder))
        side = p.side[i]
        size = data.element_size()
        side.pd = data.data_ptr()
        side.pd_sb, side.pd_sh, side.pd_st = (data.stride(j) * size for j in range(3))
        if kf.has_scales:
            side.ps = scales.data_ptr()
            side.ps_sb, side.ps_sh, side.ps_st = scales.stride(0), scales.stride(1), scales.stride(2)
        if kf.global_scale:  # an FP32 [H] contiguous tensor on the pools' device
            side.g = gs.data_ptr()
    d = int(k_data.shape[3]) * (2 if kernel_format(fmt.k).packed else 1)
    p.bs = bs
    p.bs_log2 = bs.bit_length() - 1 if bs & (bs - 1) == 0 else -1
    p.lanes_log2 = (d // 32).bit_length() - 1  # 32 elements per thread
    p.rotate_scale = inv_sqrt(d) if fmt.rotate else 0.0
    return LayerWrite(p, (codes[0], codes[1]), hkv, k_data.device, kernel_library(k_data.device).kvx_paged_write)


def launch_layer(layer: LayerWrite, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Write `reason`-approved K/V `[T, H, D]` (unrotated: the kernel rotates `_rot` formats' rows) at int32/int64
    `slots [T]` (negative: skipped) into `layer`'s pools."""
    key = key if _x_ok(key) else key.contiguous()
    value = value if _x_ok(value) else value.contiguous()
    slots = slots.contiguous()
    p = WriteParams.from_buffer_copy(layer.params)
    for side, x in zip(p.side, (key, value), strict=True):
        side.x, side.x_st, side.x_sh = x.data_ptr(), x.stride(0), x.stride(1)
    p.slots, p.slots_64, p.tokens = slots.data_ptr(), int(slots.dtype == torch.int64), int(key.shape[0])
    err = launch_on_stream(layer.entry, layer.device.index, ctypes.byref(p), *layer.codes, _X_DTYPES[key.dtype],
                           layer.num_kv_heads)
    if err != 0:
        raise KvxError(Status.INTERNAL_ERROR, f"KVX CUDA write launch failed: {cuda_error_name(err)}")


def launch(key: torch.Tensor, value: torch.Tensor, args: WriteArgs, k_data, k_scales, v_data, v_scales,
           fmt: CacheFormat) -> None:
    """Write `reason`-approved, checked K/V (unrotated) into the pools; the pools were checked by the caller
    (`ops.write.launch_write`)."""
    launch_layer(layer_write(fmt, k_data, k_scales, v_data, v_scales, args.k_gs, args.v_gs), key, value, args.slots)
