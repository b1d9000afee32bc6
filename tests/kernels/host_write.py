"""The CUDA write's own source run on the CPU (backend "cuda_host" of tests/kernels/test_write_kernel.py).

`host_write.cpp` compiles `kvx_core/ops/cuda/paged_write.cu` (the installed copy) for the host with g++ and the CUDA
headers; the write goes through the same Python path as on a GPU (`ops.write.write_pools(backend="cuda")`: the
argument and pool checks, `cuda_write.layer_write`'s parameters and the ctypes mirror; the `_rot` formats' rotation
runs in the kernel), with only the device checks, the library and its stream swapped for the host build. So CI, which
has no GPU, checks the CUDA kernel's logic bit for bit against the formats' encode; its PTX pieces are emulated
(host_write.cpp says how), the GPU tests check them on the hardware.
"""
from __future__ import annotations

from unittest import mock

import kvx_core.ops.cuda as kvx_cuda
from kvx_core.formats import CacheFormat, get_format
from kvx_core.ops import write as ops_write
from kvx_core.ops.cuda import write as cuda_write

from .host_build import host_library


def write_pools(key, value, slots, k_data, k_scales, v_data, v_scales, fmt: CacheFormat, k_gs=None, v_gs=None,
                check: bool = True) -> str:
    """`ops.write.write_pools` with the CUDA write's host build where the CUDA write serves the call (else the
    Triton write, under the interpreter); which of the two ran ("cuda_host" or "triton"). Swapped for the host:
    the device checks of `reason` (its layout checks stay), the library (`kernel_library` still sets the entry's
    signature and checks the ctypes mirror against the host build's struct) and the stream."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    served = cuda_write.layout_reason(key, value, fmt, k_data, v_data) is None
    lib = host_library("host_write.cpp", "paged_write.cu") if served else None
    with mock.patch.object(cuda_write, "reason", cuda_write.layout_reason), \
            mock.patch.object(kvx_cuda, "library", lambda device: lib), \
            mock.patch.object(cuda_write, "launch_on_stream", lambda entry, index, *a: entry(*a, None)):
        ops_write.write_pools(key, value, slots, k_data, k_scales, v_data, v_scales, fmt, k_gs, v_gs, check=check,
                              backend="cuda" if served else "triton")
    return "cuda_host" if served else "triton"
