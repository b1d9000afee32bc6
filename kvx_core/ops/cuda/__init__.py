"""CUDA kernels of KVX: the paged decode on tensor cores (`paged_decode_mma.cu`: NVFP4, MXFP4, INT4, INT8 and FP8
caches) and the fused quantize-and-write (`paged_write.cu`), built with nvcc into one library on first use.

The library is compiled for the current GPU's architecture (SM 8.9+, `sm_90a` on Hopper) into
`$KVX_CUDA_CACHE` (default `~/.cache/kvx/cuda`), keyed by the sources' hash, the architecture and the
nvcc version, then loaded with ctypes; kernels run on torch's current CUDA stream (graph capturable).
`build()` also runs without a GPU (CI compiles the source for `sm_90a`).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from ...errors import KvxError, Status

SOURCE = Path(__file__).with_name("paged_decode_mma.cu")
WRITE_SOURCE = Path(__file__).with_name("paged_write.cu")
_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL] = {}


def nvcc_path() -> str | None:
    """nvcc from `$CUDA_HOME/bin`, `$PATH` or /usr/local/cuda, else None."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for cand in ([os.path.join(home, "bin", "nvcc")] if home else []) + [shutil.which("nvcc") or "",
                                                                         "/usr/local/cuda/bin/nvcc"]:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("KVX_CUDA_CACHE", Path.home() / ".cache" / "kvx" / "cuda"))


def arch_of(capability: tuple[int, int]) -> str:
    """nvcc architecture name for a compute capability (`90a` for Hopper: the arch-specific target)."""
    major, minor = capability
    if (major, minor) < (8, 9):
        raise KvxError(Status.UNSUPPORTED, f"KVX CUDA kernels need compute capability >= 8.9 (FP8 converts), "
                                           f"got {major}.{minor}")
    return f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


def build(arch: str, nvcc: str | None = None, out_dir: Path | None = None) -> Path:
    """Compile `paged_decode_mma.cu` and `paged_write.cu` for `arch` (e.g. '90a') into one shared library; cached
    by content."""
    nvcc = nvcc or nvcc_path()
    if nvcc is None:
        raise KvxError(Status.UNSUPPORTED, "nvcc not found (set CUDA_HOME): KVX builds its CUDA decode kernel "
                                           "on first use; without it the Triton kernels are used")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    sources = (SOURCE, WRITE_SOURCE)
    key = hashlib.sha256(b"".join(s.read_bytes() for s in sources) + arch.encode() + version.encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"kvx_paged_decode_mma-{arch}-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    base = arch.rstrip("a")
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_lib = Path(tmp) / lib.name
        cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo",
               f"-gencode=arch=compute_{arch},code=sm_{arch}", f"-gencode=arch=compute_{base},code=compute_{base}",
               *(str(s) for s in sources), "-o", str(tmp_lib)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise KvxError(Status.INTERNAL_ERROR, f"nvcc failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
        os.replace(tmp_lib, lib)  # atomic: concurrent builders never load a half-written file
    return lib


def library(device) -> ctypes.CDLL:
    """The loaded kernel library for a torch CUDA device (built on first use; `decode.kernel_library` sets the
    kernel's signature and checks its parameter struct)."""
    import torch
    arch = arch_of(torch.cuda.get_device_capability(device))
    with _LOCK:
        if arch not in _LIBS:
            _LIBS[arch] = ctypes.CDLL(str(build(arch)))
        return _LIBS[arch]


def checked_library(device, entry: str, argtypes: list, size_entry: str, params, source: str) -> ctypes.CDLL:
    """The kernel library (`library`) with `entry`'s signature set and the ctypes mirror `params` checked against
    the C struct's size that `size_entry` returns (INTERNAL_ERROR if they differ), once per entry point."""
    lib = library(device)
    done = getattr(lib, "_kvx_checked", set())
    if entry not in done:
        fn = getattr(lib, entry)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
        getattr(lib, size_entry).restype = ctypes.c_int
        if getattr(lib, size_entry)() != ctypes.sizeof(params):
            raise KvxError(Status.INTERNAL_ERROR, f"{params.__name__} ctypes mirror does not match {source}")
        lib._kvx_checked = done | {entry}
    return lib


def choose(why: str | None, backend: str, load: Callable[[], object], what: str) -> str:
    """"cuda" or "triton" for a call the CUDA kernel `what` cannot serve because of `why` (None: it can):
    `backend` "auto" also falls back when the library cannot be built here (no nvcc), "cuda" refuses instead."""
    if why is None and backend == "auto":
        try:
            load()
        except KvxError as e:
            if e.status != Status.UNSUPPORTED:
                raise
            why = str(e)  # no nvcc here: Triton serves the call
    if why is not None and backend == "cuda":
        raise KvxError(Status.UNSUPPORTED, f"CUDA {what} cannot serve this call: {why}")
    return "triton" if why is not None else "cuda"


def cuda_error_name(code: int) -> str:
    try:
        import torch
        return torch.cuda.cudart().cudaGetErrorString(code)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        return f"cudaError {code}"
