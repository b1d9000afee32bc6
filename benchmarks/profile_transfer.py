"""Where a KV bundle export / import spends its time, per layer (issue 36: ~1 ms of fixed time per layer on an H200).

    python benchmarks/profile_transfer.py --device cuda [--tokens 1024] [--layers 32] [--pairs nvfp4:nvfp4,...]
                                          [--path new|old] [--runs 3] [--top 15] [--out FILE.jsonl]
                                          [--bundle-memory host|device]

`bench_transfer.py`'s caches (8 KV heads x 128, block size 16, slots 0 .. tokens - 1 given in host memory as an
engine gives them) and its "host" path: `export_to_host` into a reused pinned buffer, `import_bundle` from it
(`--bundle-memory device`: `export_to_device` into a reused buffer in GPU memory and `import_bundle` from it, the path
of a P/D handoff over NIXL with `nixl_memory: device`, less the READ). Each
pair's export and import run once to warm up (kernels compiled, descriptors bound), are timed `--runs` times (best),
then run once more under torch.profiler (CPU and, on CUDA, CUDA activities). One line per (pair, op) is printed and
written as JSON (`--out`), per layer where it says so:

- `host_us_per_layer`: host wall time until the call returns; `wall_us_per_layer`: until the device is done too;
- `gpu_kernel_us_per_layer`, `kernels` (kernels the device ran), `launch_calls` (host launch API calls),
  `top_kernels` (the `--top` kernels by device time, `[name, us, runs]`: a per-layer kernel that is slow whatever
  the bytes, such as a checksum kernel latency-bound on one warp per segment, shows here);
- `memcpy` / `host_alloc` / `syncs`: count and host microseconds of the copy calls (`pageable`: device copies from
  or to pageable memory, each a host sync), of pinned allocations (`cudaHostAlloc`, tens of MB cost milliseconds)
  and of synchronizations (stream / event / device);
- `untraced_host_us_per_layer`: profiled host time outside any traced op (Python work between the ops);
- `top_host_ops`: the `--top` host ops by self CPU time, `[name, self us, calls]`;
- `top_python`: the `--top` Python functions by own time under cProfile (one more call), `[function, own us,
  calls]`: what the untraced host time is spent on (descriptor validation, format lookups, launch arguments).

On the CPU (`--device cpu`, the torch path only: the kernels need CUDA) the CUDA fields are None.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import sys
import time
from functools import partial
from types import SimpleNamespace

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_transfer import KERNEL_PATHS, _cache, _filled  # noqa: E402
from common import emit, env_info, top_functions  # noqa: E402

from kvx_core.transfer import ModelFingerprint, import_bundle  # noqa: E402
from kvx_core.transfer.host import export_to_device, export_to_host  # noqa: E402
from kvx_core.transfer.kernels import kernel_path  # noqa: E402

LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
"""Host API calls that launch a kernel (torch ops go through the runtime, Triton through the driver)."""
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
              "cuEventSynchronize", "cuCtxSynchronize")
HOST_ALLOC_CALLS = ("cudaHostAlloc", "cudaMallocHost", "cuMemHostAlloc", "cudaHostRegister")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str, runs: int) -> tuple[float, float]:
    """Best (host seconds until `fn` returns, seconds until the device is done) over `runs` calls."""
    host = wall = float("inf")
    for _ in range(runs):
        _sync(device)
        t = time.perf_counter()
        fn()
        h = time.perf_counter()
        _sync(device)
        host, wall = min(host, h - t), min(wall, time.perf_counter() - t)
    return host, wall


def _calls(events, names: tuple[str, ...]) -> dict:
    """Count and host microseconds of the traced calls named `names`."""
    hit = [e for e in events if e.device_type == DeviceType.CPU and e.name in names]
    return {"count": len(hit), "us": round(sum(e.time_range.elapsed_us() for e in hit), 1)}


def profile_op(fn, device: str, layers: int, runs: int, top: int) -> dict:
    """The numbers of one warmed-up op (see the module doc)."""
    fn()
    host, wall = _timed(fn, device, runs)
    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        fn()
        traced = time.perf_counter() - t
        _sync(device)
    events = prof.events()
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    roots = [e for e in cpu if e.cpu_parent is None]  # top-level ops: their time is traced host time
    untraced = traced * 1e6 - sum(e.time_range.elapsed_us() for e in roots)
    ops = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)
    python = cProfile.Profile()
    python.runcall(fn)
    _sync(device)
    rec = {"host_us_per_layer": round(host * 1e6 / layers, 1), "wall_us_per_layer": round(wall * 1e6 / layers, 1),
           "untraced_host_us_per_layer": round(max(untraced, 0.0) / layers, 1),
           "top_host_ops": [[a.key, round(a.self_cpu_time_total, 1), a.count] for a in ops
                            if a.device_type == DeviceType.CPU][:top],
           "top_python": top_functions(python, top),
           **dict.fromkeys(("gpu_kernel_us_per_layer", "kernels", "top_kernels", "launch_calls", "launches_per_layer",
                            "memcpy", "host_alloc", "syncs"))}
    if cuda:
        device_events = [e for e in events if e.device_type == DeviceType.CUDA]
        kernels = [e for e in device_events if not e.name.startswith(("Memcpy", "Memset"))]
        copies = [e for e in device_events if e.name.startswith("Memcpy")]
        launches = _calls(events, LAUNCH_CALLS)
        by_kernel: dict[str, list[float]] = {}
        for e in kernels:
            by_kernel.setdefault(e.name[:90], []).append(e.time_range.elapsed_us())
        ranked = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
        rec.update({"gpu_kernel_us_per_layer": round(sum(e.time_range.elapsed_us() for e in kernels) / layers, 1),
                    "kernels": len(kernels), "launch_calls": launches["count"],
                    "top_kernels": [[name, round(sum(ts), 1), len(ts)] for name, ts in ranked],
                    "launches_per_layer": round(launches["count"] / layers, 2),
                    "memcpy": {**_calls(events, ("cudaMemcpyAsync", "cudaMemcpy", "cuMemcpyAsync", "cuMemcpyHtoDAsync",
                                                 "cuMemcpyDtoHAsync")),
                               "device": len(copies), "pageable": sum("Pageable" in e.name for e in copies)},
                    "host_alloc": _calls(events, HOST_ALLOC_CALLS), "syncs": _calls(events, SYNC_CALLS)})
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pairs", default="nvfp4:nvfp4,bf16:bf16,bf16:nvfp4",
                    help="comma-separated SRC:DST cache formats")
    ap.add_argument("--path", choices=tuple(KERNEL_PATHS), help="torch row moves (old) or the transfer kernels "
                    "(new, the default on CUDA; the CPU runs the torch path)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--bundle-memory", choices=("host", "device"), default="host",
                    help="where the bundle is: pinned host memory, or GPU memory (the NIXL device path; CUDA only)")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu)")
    path = a.path or ("new" if a.device == "cuda" else "old")
    if a.device == "cpu" and (path == "new" or a.bundle_memory == "device"):
        ap.error("--path new and --bundle-memory device need CUDA (the transfer kernels)")
    pairs = [tuple(p.split(":")) for p in a.pairs.split(",")]
    if any(len(p) != 2 for p in pairs):
        ap.error(f"--pairs {a.pairs!r}: SRC:DST,...")
    model = ModelFingerprint("bench", a.layers, 8, 128, {}, "0" * 64, "0" * 64)
    slots = torch.arange(a.tokens)  # in host memory, as bench_transfer and the engines' connectors give them
    shape = SimpleNamespace(tokens=a.tokens, layers=a.layers, device=a.device)
    env = {**env_info(), "bench": "profile_transfer", "device": a.device, "layers": a.layers, "tokens": a.tokens,
           "path": path, "bundle_memory": a.bundle_memory}
    for src_fmt, dst_fmt in pairs:
        src, dst = _filled(src_fmt, shape, torch.Generator().manual_seed(0)), _cache(dst_fmt, shape)
        srcs = [src.descriptor(i) for i in range(a.layers)]
        dsts = [dst.descriptor(i) for i in range(a.layers)]
        with kernel_path(KERNEL_PATHS[path]):
            bundle = export_to_host(srcs, slots, model=model)  # reused, as a transport's registered buffer
            export = partial(export_to_host, srcs, slots, model=model, out=bundle)
            if a.bundle_memory == "device":
                bundle = torch.empty(bundle.numel(), dtype=torch.uint8, device="cuda")
                export = partial(export_to_device, srcs, slots, model=model, out=bundle)
                export()
            ops = {"export": export, "import": partial(import_bundle, bundle, dsts, slots, model=model)}
            for op, fn in ops.items():
                rec = {**env, "src": src_fmt, "dst": dst_fmt, "op": op, "bundle_bytes": bundle.numel(),
                       **profile_op(fn, a.device, a.layers, a.runs, a.top)}
                print(f"{src_fmt}->{dst_fmt} {op}: host {rec['host_us_per_layer']} us/layer, wall "
                      f"{rec['wall_us_per_layer']} us/layer, GPU kernels {rec['gpu_kernel_us_per_layer']} us/layer, "
                      f"launches {rec['launch_calls']}, copies {rec['memcpy']}, pinned allocs {rec['host_alloc']}, "
                      f"syncs {rec['syncs']}", file=sys.stderr)
                emit(a.out, rec)


if __name__ == "__main__":
    main()
