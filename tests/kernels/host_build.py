"""Builds of kvx_core/ops/cuda's kernel sources for the host (host_write.cpp, host_decode.cpp; host_cuda.h says how
they run): g++ with the CUDA toolkit's headers, once per content. CI has both (a missing one fails there); elsewhere
the tests that need a build skip without them."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import kvx_core.ops.cuda as kvx_cuda
from kvx_core.ops.cuda import toolchain

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
def host_library(harness: str, source: str) -> ctypes.CDLL:
    """tests/kernels/`harness` compiled with the installed kvx_core/ops/cuda/`source` (the copy the wheels ship)."""
    inc, gxx = _cuda_include(), shutil.which("g++")
    if inc is None or gxx is None:
        why = "the host build of the CUDA kernels needs g++ and the CUDA toolkit's headers"
        if os.environ.get("CI"):
            pytest.fail(f"{why}: CI has both (nothing skips silently there)")
        pytest.skip(why)
    src = Path(kvx_cuda.__file__).parent / source
    # -ffp-contract=off: each FP32 operation rounded once (as __fmaf_rn / __fmul_rn are); -fno-strict-aliasing: the
    # kernels read words through casts, as CUDA code may (nvcc keeps them)
    flags = ["-std=c++20", "-O2", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-shared", "-pthread",
             "-DKVX_HOST_EMULATION", f'-DKVX_SOURCE="{src}"', f"-I{inc}"]
    # one build per content (the test workers of a run share it: the decode takes ~20 s to compile)
    key = hashlib.sha256("\0".join([gxx, *flags] + [p.read_text() for p in (HERE / harness, HERE / "host_cuda.h",
                                                                                src)]).encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / "kvx_host_builds" / f"{Path(harness).stem}-{key}.so"
    if not out.is_file():
        out.parent.mkdir(exist_ok=True)
        part = out.with_suffix(f".{os.getpid()}.part")
        res = subprocess.run([gxx, *flags, str(HERE / harness), "-o", str(part)], capture_output=True, text=True,
                             check=False)
        assert res.returncode == 0, res.stderr[-4000:]
        os.replace(part, out)
    return ctypes.CDLL(str(out))
