"""The CUDA write's own source run on the CPU (backend "cuda_host" of tests/kernels/test_write_kernel.py).

`host_write.cpp` compiles `kvx_core/ops/cuda/paged_write.cu` (the installed copy) for the host with g++ and the CUDA
headers; the write goes through the same Python launcher as on a GPU (`ops.write.launch_chosen("cuda", ...)`:
the pool checks, the rotation, `cuda_write.layer_write`'s parameters and the ctypes mirror), with only the library
and its stream swapped for the host build. So CI, which has no GPU, checks the CUDA kernel's logic bit for bit
against the formats' encode; its PTX pieces are emulated (host_write.cpp says how), the GPU tests check them on the
hardware.
"""
from __future__ import annotations

import ctypes
from unittest import mock

import kvx_core.ops.cuda as kvx_cuda
from kvx_core.formats import CacheFormat, get_format
from kvx_core.ops import write as ops_write
from kvx_core.ops.checks import check_write_args
from kvx_core.ops.cuda import write as cuda_write
from kvx_core.ops.triton.launch import pool_geometry

from .host_build import host_library


def library() -> ctypes.CDLL:
    """The host build with `kvx_paged_write`'s signature set and the ctypes mirror checked against its struct."""
    lib = host_library("host_write.cpp", "paged_write.cu")
    fn = lib.kvx_paged_write
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p] + [ctypes.c_int] * 4 + [ctypes.c_void_p]
    why = kvx_cuda.mirror_mismatch(lib, "kvx_write_params_size", cuda_write.WriteParams)
    assert why is None, why
    return lib


def write_pools(key, value, slots, k_data, k_scales, v_data, v_scales, fmt: CacheFormat, k_gs=None, v_gs=None,
                check: bool = True) -> str:
    """`ops.write.write_pools` with the CUDA write's host build where the CUDA write serves the call (else the
    Triton write, under the interpreter); which of the two ran ("cuda_host" or "triton")."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    if cuda_write.layout_reason(key, value, fmt, k_data, v_data) is not None:
        ops_write.write_pools(key, value, slots, k_data, k_scales, v_data, v_scales, fmt, k_gs, v_gs, check=check,
                              backend="triton")
        return "triton"
    nb, hkv, bs = pool_geometry(k_data, v_data)
    args = check_write_args(fmt, key, value, slots, num_slots=nb * bs, num_kv_heads=hkv, k_gs=k_gs, v_gs=v_gs,
                            check=check)
    lib = library()
    with mock.patch.object(cuda_write, "kernel_library", lambda device: lib), \
            mock.patch.object(cuda_write, "launch_on_stream", lambda entry, index, *a: entry(*a, None)):
        ops_write.launch_chosen("cuda", key, value, args, k_data, k_scales, v_data, v_scales, fmt)
    return "cuda_host"
