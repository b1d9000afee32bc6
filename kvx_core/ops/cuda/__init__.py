"""CUDA kernels of KVX: the paged decode on tensor cores (`paged_decode_mma.cu`: NVFP4, MXFP4, INT4, INT8 and FP8
caches) and the fused quantize-and-write (`paged_write.cu`), one shared library loaded with ctypes; kernels run on
torch's current CUDA stream (graph capturable).

Where the library comes from (`locate`), in order:
1. **prebuilt**: the library a wheel ships in `prebuilt/` (`toolchain.build_prebuilt`, compiled where the wheel was
   built: SASS for `toolchain.WHEEL_SASS`, PTX for newer GPUs), when it was built from these sources, covers this
   GPU, and the driver supports the CUDA release it was built with (its CUDA runtime is linked statically);
2. **nvcc**: compiled at first use for this GPU's architecture into `$KVX_CUDA_CACHE` (default `~/.cache/kvx/cuda`),
   keyed by the sources' hash, the architecture and the nvcc version (a source checkout, a GPU the wheel does not
   cover, a driver older than the wheel's CUDA);
3. neither: KvxError UNSUPPORTED saying why both failed; `choose` then falls back to Triton and records the reason
   (`kvx doctor` and the engine plugins print it).
`build()` also runs without a GPU (CI compiles the sources for `sm_90a`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ... import config, jsonsafe
from ...errors import KvxError, Status
from . import toolchain
from .toolchain import nvcc_path

SOURCE, WRITE_SOURCE = toolchain.SOURCES
_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL] = {}
_ORIGINS: dict[str, LibrarySource] = {}


def cache_dir() -> Path:
    """Where nvcc builds are kept: the `cuda_cache` setting (`$KVX_CUDA_CACHE`)."""
    return Path(config.value("cuda_cache")).expanduser()


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
        raise KvxError(Status.UNSUPPORTED, "nvcc not found (set CUDA_HOME to a CUDA toolkit)")
    version = toolchain.nvcc_version(nvcc)
    key = hashlib.sha256(toolchain.sources_digest().encode() + arch.encode() + version.encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"kvx_paged_decode_mma-{arch}-{key}.so"
    if lib.exists():
        return lib
    base = arch.rstrip("a")
    try:
        toolchain.compile_library(nvcc, lib, (arch,), base)
    except RuntimeError as e:
        raise KvxError(Status.INTERNAL_ERROR, str(e)) from None
    return lib


def driver_cuda_version() -> tuple[int, int] | None:
    """(major, minor) of the CUDA release the installed NVIDIA driver supports (`cuDriverGetVersion`), None without
    a driver."""
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        fn = ctypes.CDLL(name).cuDriverGetVersion
    except (OSError, AttributeError):
        return None
    v = ctypes.c_int(0)
    if fn(ctypes.byref(v)) != 0:
        return None
    return v.value // 1000, (v.value % 1000) // 10


def prebuilt_manifest(directory: Path = toolchain.PREBUILT_DIR) -> dict | None:
    """The manifest of the library this install ships (None: none ships, e.g. a source checkout or a wheel built
    without nvcc). KvxError INVALID_ARGUMENT for a damaged one (an install to repair: `locate` says so)."""
    try:
        m = jsonsafe.loads_object((directory / toolchain.MANIFEST).read_bytes(), "the prebuilt kernels' manifest")
    except FileNotFoundError:
        return None
    ok = (isinstance(m.get("sass"), list) and all(isinstance(a, str) and re.fullmatch(r"\d{2,3}a?", a)
                                                 for a in m["sass"])
          and (m.get("ptx") is None or (isinstance(m["ptx"], str) and re.fullmatch(r"\d{2,3}", m["ptx"])))
          and isinstance(m.get("cuda"), str) and re.fullmatch(r"\d+\.\d+", m["cuda"])
          and isinstance(m.get("sources_sha256"), str) and isinstance(m.get("library"), str))
    if not ok:
        raise KvxError(Status.INVALID_ARGUMENT, f"{directory / toolchain.MANIFEST} is damaged: reinstall kvx")
    return m


def prebuilt_reason(manifest: dict | None, capability: tuple[int, int],
                    driver: tuple[int, int] | None) -> str | None:
    """None when the prebuilt library described by `manifest` serves a GPU of `capability` under a driver supporting
    CUDA `driver`, else why not."""
    if manifest is None:
        return "this install ships no prebuilt kernels (a source checkout, or a wheel built without nvcc)"
    if manifest.get("sources_sha256") != toolchain.sources_digest():
        return "the prebuilt kernels were built from other CUDA sources than this install's"
    arch = arch_of(capability)
    ptx = manifest.get("ptx")
    if arch not in manifest.get("sass", []) and not (ptx and capability >= (int(ptx[:-1]), int(ptx[-1]))):
        return (f"the prebuilt kernels cover sm_{', sm_'.join(manifest.get('sass', []))}"
                f"{f' and PTX {ptx}+' if ptx else ''}, not sm_{arch}")
    need = tuple(int(x) for x in str(manifest.get("cuda", "0.0")).split(".")[:2])
    if driver is None or driver < need:
        have = "no NVIDIA driver" if driver is None else f"a driver supporting CUDA {driver[0]}.{driver[1]}"
        return (f"the prebuilt kernels need a driver supporting CUDA {need[0]}.{need[1]} (their CUDA runtime is "
                f"linked statically), this machine has {have}: update the driver, or install a CUDA toolkit "
                "(CUDA_HOME) so KVX builds them for this driver")
    return None


@dataclass(frozen=True)
class LibrarySource:
    """Where the kernel library of an architecture comes from: `origin` "prebuilt", "nvcc" or "unavailable";
    `detail` says which file and why (why not the prebuilt one, or why none)."""

    arch: str
    origin: str
    path: Path | None
    detail: str


def locate(capability: tuple[int, int], *, manifest_dir: Path = toolchain.PREBUILT_DIR) -> LibrarySource:
    """The library that serves a GPU of `capability` here (see the module docstring), building it with nvcc when
    no prebuilt one serves; never raises for missing sources, a missing or failing toolchain (origin
    "unavailable", with why)."""
    arch = arch_of(capability)
    missing = [s.name for s in toolchain.SOURCES if not s.is_file()]
    if missing:
        return LibrarySource(arch, "unavailable", None, f"the CUDA sources {', '.join(missing)} are missing from "
                                                        f"this install ({toolchain.HERE}): reinstall kvx")
    try:
        manifest = prebuilt_manifest(manifest_dir)
        why = prebuilt_reason(manifest, capability, driver_cuda_version())
    except KvxError as e:
        manifest, why = None, e.message
    if why is None:
        sass = ", sm_".join(manifest["sass"])
        return LibrarySource(arch, "prebuilt", manifest_dir / toolchain.PREBUILT_LIBRARY,
                             f"prebuilt in this install (CUDA {manifest['cuda']}, SASS sm_{sass})")
    try:
        path = build(arch)
    except KvxError as e:  # no nvcc, or an nvcc that fails on these sources: Triton serves, saying why
        return LibrarySource(arch, "unavailable", None, f"{why}; and {e.message}")
    return LibrarySource(arch, "nvcc", path, f"built by nvcc for sm_{arch} ({why})")


def library(device) -> ctypes.CDLL:
    """The loaded kernel library for a torch CUDA device (`locate`; `decode.kernel_library` sets the kernel's
    signature and checks its parameter struct). KvxError UNSUPPORTED when none can be had here."""
    import torch
    cap = torch.cuda.get_device_capability(device)
    arch = arch_of(cap)
    with _LOCK:
        if arch not in _LIBS:
            src = _ORIGINS.get(arch) or locate(cap)
            _ORIGINS[arch] = src
            if src.path is None:
                raise KvxError(Status.UNSUPPORTED, f"no KVX CUDA kernels for sm_{arch}: {src.detail}")
            try:
                _LIBS[arch] = ctypes.CDLL(str(src.path))
            except OSError as e:
                raise KvxError(Status.UNSUPPORTED, f"cannot load the KVX CUDA kernels {src.path}: {e}") from None
        return _LIBS[arch]


def library_source(device) -> LibrarySource:
    """Where this device's kernel library came from (loading it first if needed; never raises UNSUPPORTED)."""
    import torch
    arch = arch_of(torch.cuda.get_device_capability(device))
    try:
        library(device)
    except KvxError as e:
        if e.status != Status.UNSUPPORTED:
            raise
        if arch not in _ORIGINS:
            return LibrarySource(arch, "unavailable", None, e.message)
    return _ORIGINS[arch]


def mirror_mismatch(lib: ctypes.CDLL, size_entry: str, params, layout_entry: str | None = None) -> str | None:
    """None when the ctypes mirror `params` has the C struct's size (`size_entry`) and, with `layout_entry`
    (`const char* f(void)`: "name@offset ..." of the C fields in declaration order), its fields by name and offset;
    else how they differ."""
    getattr(lib, size_entry).restype = ctypes.c_int
    size = getattr(lib, size_entry)()
    if size != ctypes.sizeof(params):
        return f"size {size} != {ctypes.sizeof(params)}"
    if layout_entry is None:
        return None
    getattr(lib, layout_entry).restype = ctypes.c_char_p
    theirs = getattr(lib, layout_entry)().decode().split()
    mine = [f"{name}@{getattr(params, name).offset}" for name, *_ in params._fields_]
    if theirs != mine:
        diff = ([f"{a} vs {b}" for a, b in zip(theirs, mine, strict=False) if a != b]
                or [f"{len(theirs)} vs {len(mine)} fields"])
        return f"C layout vs the mirror: {', '.join(diff[:4])}"
    return None


def checked_library(device, entry: str, argtypes: list, size_entry: str, params, source: str,
                    layout_entry: str | None = None) -> ctypes.CDLL:
    """The kernel library (`library`) with `entry`'s signature set and the ctypes mirror `params` checked against
    the C struct (`mirror_mismatch`; INTERNAL_ERROR if they differ), once per entry point."""
    lib = library(device)
    done = getattr(lib, "_kvx_checked", set())
    if entry not in done:
        fn = getattr(lib, entry)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
        why = mirror_mismatch(lib, size_entry, params, layout_entry)
        if why is not None:
            raise KvxError(Status.INTERNAL_ERROR, f"{params.__name__} ctypes mirror does not match {source}: {why}")
        lib._kvx_checked = done | {entry}
    return lib


def launch_on_stream(entry, device_index: int, *args) -> int:
    """`entry(*args, stream)`: a library entry point launched on torch's current stream of CUDA device
    `device_index`, with that device current (the kernels launch into the calling thread's current device); its
    cudaError_t. The hot path of bound layers: two C calls when the device is already current."""
    import torch
    if torch._C._cuda_getDevice() == device_index:
        return entry(*args, torch._C._cuda_getCurrentRawStream(device_index))
    with torch.cuda.device(device_index):
        return entry(*args, torch.cuda.current_stream(device_index).cuda_stream)


@functools.cache
class Choice(NamedTuple):
    """The kernel that serves a call ("cuda" or "triton") and, for Triton, why not CUDA (None when asked for)."""

    backend: str
    reason: str | None


def choose(why: str | None, backend: str, load: Callable[[], object], what: str) -> Choice:
    """The kernel for a call the CUDA kernel `what` cannot serve because of `why` (None: it can): `backend` "auto"
    also falls back when no library can be had here (no prebuilt one serves, no nvcc), "cuda" refuses instead."""
    if why is None and backend == "auto":
        try:
            load()
        except KvxError as e:
            if e.status != Status.UNSUPPORTED:
                raise
            why = e.message  # no library here: Triton serves the call
    if why is not None and backend == "cuda":
        raise KvxError(Status.UNSUPPORTED, f"CUDA {what} cannot serve this call: {why}")
    return Choice("triton", why) if why is not None else Choice("cuda", None)


def cuda_error_name(code: int) -> str:
    try:
        import torch
        return torch.cuda.cudart().cudaGetErrorString(code)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        return f"cudaError {code}"
