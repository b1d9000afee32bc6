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
import functools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from unittest import mock

import pytest

import kvx_core.ops.cuda as kvx_cuda
from kvx_core.formats import CacheFormat, get_format
from kvx_core.ops import write as ops_write
from kvx_core.ops.checks import check_write_args
from kvx_core.ops.cuda import toolchain, write as cuda_write
from kvx_core.ops.triton.launch import pool_geometry

HERE = Path(__file__).parent


def _cuda_include() -> Path | None:
    """The CUDA headers nvcc itself uses (its `--dryrun` TOP: nvcc may be a wrapper script outside the toolkit)."""
    nvcc = toolchain.nvcc_path()
    if nvcc is None:
        return None
    out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"], capture_output=True,
                         text=True, check=False).stderr
    top = re.search(r"^#\$ TOP=(.+)$", out, re.M)
    inc = Path(top.group(1).strip()) / "include" if top else None
    return inc if inc is not None and (inc / "cuda_fp16.h").is_file() else None


@functools.cache
def library() -> ctypes.CDLL:
    """The host build (once per process); skips without g++ or the CUDA headers (CI has both: it fails there)."""
    inc, gxx = _cuda_include(), shutil.which("g++")
    if inc is None or gxx is None:
        pytest.skip("the host build of the CUDA write needs g++ and the CUDA toolkit's headers")
    source = Path(kvx_cuda.__file__).parent / "paged_write.cu"
    out = Path(tempfile.mkdtemp(prefix="kvx_write_host_")) / "libkvx_write_host.so"
    # -fno-strict-aliasing: the kernel reads words as __half2 through casts, as CUDA code may (nvcc keeps them)
    cmd = [gxx, "-std=c++20", "-O2", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-shared", "-pthread",
           "-DKVX_HOST_EMULATION", f'-DKVX_WRITE_SOURCE="{source}"', f"-I{inc}", str(HERE / "host_write.cpp"), "-o",
           str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr[-4000:]
    lib = ctypes.CDLL(str(out))
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
