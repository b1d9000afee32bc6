"""KV bundle export / import throughput against a raw copy of the same bytes, in the same run.

    python benchmarks/bench_transfer.py [--device cuda] [--tokens 8192] [--layers 8] [--path old|new|both]
                                        [--pairs SRC:DST,...] [--out FILE.jsonl]

A cache of `--layers` x `--tokens` tokens (8 KV heads x 128) on `--device`; export writes the bundle into host
memory, import reads it back into a second cache on the device, by two paths: "stream" (`export_bundle` into an
io.BytesIO, `import_bundle` from one: what files and pipes use) and "host" (`export_to_host` into a reused pinned
buffer, `import_bundle` from that buffer: pipelined copies, checksums in threads). Cases (`--pairs`, source:destination
format): by default each cache format to itself (rows move as stored) and bf16 -> each quantized format (a BF16
prefill instance handing KV to a quantized decode instance: decode + re-encode on import). The baseline is a copy of the
bundle's bytes between the device and pinned host memory: device -> host for export, host -> device for import.
GB/s count the bundle's bytes; `x_copy` = bundle GB/s / copy GB/s; `export_ms` / `import_ms` the per-request
latency. `--path`: "old" moves rows with torch (`kernel_path("torch")`: gathers, index_put, the torch conversion),
"new" with the transfer kernels (`kernel_path("triton")`: one gather / scatter / conversion kernel per layer,
checks batched per bundle), "both" (default) times each against the same copy baseline in one run; on the CPU only
"old" runs (the kernels need CUDA). The issue's shapes: `--tokens 16384 --layers 8` and `--tokens 1024 --layers 32`.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import time
from functools import partial

import torch

from kvx_core.cache import PagedKVCache
from kvx_core.errors import KvxError
from kvx_core.formats import get_format
from kvx_core.transfer import ModelFingerprint, export_bundle, import_bundle
from kvx_core.transfer.host import export_to_host
from kvx_core.transfer.kernels import kernel_path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import emit, env_info  # noqa: E402


def _sync(device: str) -> None:
    """Wait for every GPU (a copy between two devices runs on both)."""
    if device.startswith("cuda"):
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def _best(fn, device: str, runs: int) -> float:
    """Fastest of `runs` wall times (s) of `fn()`, synchronised."""
    best = float("inf")
    for _ in range(runs):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


KERNEL_PATHS = {"old": "torch", "new": "triton"}
FORMATS = ("bf16", "fp8_e4m3", "int8", "k8v4", "int4", "nvfp4", "mxfp4")
"""The cache formats the engines serve (vLLM's kvx dtypes, fp8, bf16); the `_rot` and `_floor` variants move the
same bytes."""
PAIRS = ",".join([f"{f}:{f}" for f in FORMATS] + [f"bf16:{f}" for f in FORMATS[1:]])


def _cache(fmt: str, a) -> PagedKVCache:
    blocks = (a.tokens + 15) // 16
    return PagedKVCache(fmt, num_layers=a.layers, num_blocks=blocks, block_size=16, num_kv_heads=8, head_dim=128,
                        device=a.device)


def _filled(fmt: str, a, g: torch.Generator) -> PagedKVCache:
    """A `_cache` holding random K/V for tokens 0 .. a.tokens - 1 at slots 0 .. a.tokens - 1, every layer."""
    c, slots = _cache(fmt, a), torch.arange(a.tokens, device=a.device)
    for layer in range(a.layers):
        kv = torch.randn(2, a.tokens, 8, 128, generator=g).to(a.device)
        c.write(layer, kv[0], kv[1], slots)
    return c


def _paths(srcs, dsts, slots, model, blob: bytes, pinned: torch.Tensor) -> dict:
    """Per path, its (export, import) calls: through a stream, or through the reused pinned host buffer."""
    return {"stream": (lambda: export_bundle(io.BytesIO(), srcs, slots, model=model),
                       lambda: import_bundle(io.BytesIO(blob), dsts, slots, model=model)),
            "host": (lambda: export_to_host(srcs, slots, model=model, out=pinned),
                     lambda: import_bundle(pinned, dsts, slots, model=model))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stream", action="store_true", help="also time the stream path (slow on GPU caches)")
    ap.add_argument("--path", default="both", choices=("old", "new", "both"),
                    help="torch row moves (old), the transfer kernels (new), or both in one run")
    ap.add_argument("--pairs", default=PAIRS, help="comma-separated SRC:DST cache formats (default: every format to "
                    "itself and bf16 to every quantized one)")
    ap.add_argument("--out")
    a = ap.parse_args()
    try:
        pairs = [tuple(p.split(":")) for p in a.pairs.split(",")]
        for src_fmt, dst_fmt in pairs:
            get_format(src_fmt), get_format(dst_fmt)
    except (ValueError, KvxError) as e:
        ap.error(f"--pairs {a.pairs!r}: {e}")
    model = ModelFingerprint("bench", a.layers, 8, 128, {}, "0" * 64, "0" * 64)
    slots = torch.arange(a.tokens)
    env = {**env_info(), "bench": "transfer", "device": a.device, "layers": a.layers, "tokens": a.tokens}
    kernels = ("old", "new") if a.path == "both" else (a.path,)
    if a.device == "cpu" and "new" in kernels:
        print("bench_transfer: the transfer kernels need CUDA; timing the torch path only", file=sys.stderr)
        kernels = ("old",)
    g = torch.Generator().manual_seed(0)
    for src_fmt, dst_fmt in pairs:
        src, dst = _filled(src_fmt, a, g), _cache(dst_fmt, a)
        srcs = [src.descriptor(i) for i in range(a.layers)]
        dsts = [dst.descriptor(i) for i in range(a.layers)]
        pinned = export_to_host(srcs, slots, model=model)  # reused: a transport's registered buffer
        n = pinned.numel()
        dev = torch.empty(n, dtype=torch.uint8, device=a.device)
        t_d2h = _best(partial(pinned.copy_, dev), a.device, a.runs)
        t_h2d = _best(partial(dev.copy_, pinned), a.device, a.runs)
        with kernel_path("torch"):
            blob = bytes(export_to_host(srcs, slots, model=model, out=pinned).numpy())
        paths = _paths(srcs, dsts, slots, model, blob, pinned)
        if len(kernels) == 2:  # the kernels' bundle is the torch one, byte for byte, before either is timed
            with kernel_path("triton"):
                same = bytes(export_to_host(srcs, slots, model=model).numpy()) == blob
            if not same:
                raise SystemExit(f"bench_transfer: {src_fmt}: the kernel export differs from the torch export")
        for path, (export, import_) in paths.items():
            if path == "stream" and not a.stream:
                continue
            for rows in kernels:
                with kernel_path(KERNEL_PATHS[rows]):
                    t_exp, t_imp = _best(export, a.device, a.runs), _best(import_, a.device, a.runs)
                gb = n / 1e9
                rec = {**env, "src": src_fmt, "dst": dst_fmt, "path": path, "rows": rows, "bundle_bytes": n,
                       "export_gbps": round(gb / t_exp, 3), "import_gbps": round(gb / t_imp, 3),
                       "export_ms": round(t_exp * 1e3, 3), "import_ms": round(t_imp * 1e3, 3),
                       "copy_d2h_gbps": round(gb / t_d2h, 3), "copy_h2d_gbps": round(gb / t_h2d, 3),
                       "export_x_copy": round(t_d2h / t_exp, 3), "import_x_copy": round(t_h2d / t_imp, 3)}
                emit(a.out, rec)


if __name__ == "__main__":
    main()
