"""How KVX's CUDA library is compiled: the sources, the nvcc command and the manifest of a prebuilt library.

Standard library only, on purpose: `setup.py` loads this file by path to build the library that ships in the wheel
(`prebuilt/`, no torch at build time), and `kvx_core.ops.cuda` uses the same command to build it at first use where
no prebuilt library serves the GPU. One command, so a wheel's library and a locally built one are the same binary
for the same nvcc and architecture.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "paged_decode_mma.cu", HERE / "paged_write.cu")
PREBUILT_DIR = HERE / "prebuilt"
PREBUILT_LIBRARY = "libkvx_cuda.so"
MANIFEST = "manifest.json"

WHEEL_SASS = ("89", "90a")
"""Architectures a wheel carries machine code (SASS) for: Ada (L4, L40S) and Hopper (`sm_90a`, the measured GPUs).
`WHEEL_PTX` is embedded too, so newer GPUs (Blackwell) JIT-compile it once at load (the driver caches the result)."""
WHEEL_PTX = "89"


def nvcc_path() -> str | None:
    """nvcc from `$CUDA_HOME/bin`, `$PATH` or /usr/local/cuda, else None."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for cand in ([os.path.join(home, "bin", "nvcc")] if home else []) + [shutil.which("nvcc") or "",
                                                                         "/usr/local/cuda/bin/nvcc"]:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def nvcc_version(nvcc: str) -> str:
    """`nvcc --version`'s text (part of the local build's cache key)."""
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout


def cuda_release(version_text: str) -> tuple[int, int]:
    """(major, minor) of the CUDA release in `nvcc --version`'s text ("release 13.0," -> (13, 0))."""
    m = re.search(r"release (\d+)\.(\d+)", version_text)
    if not m:
        raise RuntimeError(f"cannot read the CUDA release from nvcc --version: {version_text[-200:]!r}")
    return int(m.group(1)), int(m.group(2))


def sources_digest() -> str:
    """sha256 of the CUDA sources: a prebuilt library serves only the sources it was built from."""
    h = hashlib.sha256()
    for s in SOURCES:
        h.update(s.name.encode() + b"\0" + s.read_bytes())
    return h.hexdigest()


def gencode_flags(sass: tuple[str, ...], ptx: str | None) -> list[str]:
    """nvcc -gencode flags: machine code for each of `sass` ("90a") and PTX for `ptx` (forward compatibility)."""
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in sass]
    if ptx:
        flags.append(f"-gencode=arch=compute_{ptx},code=compute_{ptx}")
    return flags


def compile_library(nvcc: str, out: Path, sass: tuple[str, ...], ptx: str | None) -> None:
    """Compile the sources into the shared library `out` (written atomically: concurrent builders never load a
    half-written file). The CUDA runtime is linked statically (nvcc's default): the library needs a driver that
    supports the CUDA release it was built with, and nothing of the toolkit at run time. RuntimeError with nvcc's
    output when it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_lib = Path(tmp) / out.name
        cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo", "--threads", "0",
               *gencode_flags(sass, ptx), *(str(s) for s in SOURCES), "-o", str(tmp_lib)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
        os.replace(tmp_lib, out)


def build_prebuilt(out_dir: Path, nvcc: str, sass: tuple[str, ...] = WHEEL_SASS, ptx: str | None = WHEEL_PTX) -> Path:
    """The library a wheel ships, with its manifest (what it serves, and the CUDA release a driver must support)."""
    version = nvcc_version(nvcc)
    compile_library(nvcc, out_dir / PREBUILT_LIBRARY, sass, ptx)
    manifest = {"library": PREBUILT_LIBRARY, "sass": list(sass), "ptx": ptx,
                "cuda": ".".join(map(str, cuda_release(version))), "sources_sha256": sources_digest(),
                "nvcc": version.strip().splitlines()[-1] if version.strip() else ""}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return out_dir / PREBUILT_LIBRARY
