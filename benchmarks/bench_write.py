"""Fused KV write throughput (quantize + scatter, K and V in one launch) per format and backend (CUDA, Triton),
vs copy bandwidth.

Formats with global scales get calibrated per-head scales (amax rule: not powers of two). GB/s counts the bf16 K/V read,
the slot mapping read and the payload + scale bytes written. Each row has the eager time (`ms`: the Python launcher
included where it outlasts the L2 flush) and the CUDA-graph replay time (`graph_ms`: the kernel alone, as engines run
it), and the GB/s / % of copy bandwidth of the graph time.
Usage: python benchmarks/bench_write.py [--out benchmarks/results/write.jsonl]
Nsight Compute: `ncu -k regex:write python benchmarks/bench_write.py --runs 1 --warmup 1 --no-graph ...`
"""
from __future__ import annotations

import argparse
from functools import partial

import torch
from common import bench, bench_graph, copy_bandwidth, emit, env_info

from kvx_core.calibration import global_scale_for_amax
from kvx_core.errors import KvxError
from kvx_core.formats import get_format
from kvx_core.ops.write import write_pools

FORMATS = ["bf16", "fp8_e4m3", "int8", "int4", "nvfp4", "mxfp4", "mxfp4_32", "k8v4", "nvfp4_rot"]


def _amax_scale(x: torch.Tensor, tf) -> torch.Tensor:
    """Per-head global scales by kvx_core.calibration's amax rule (amax / 448 for FP8, / (6 * 448) for NVFP4)."""
    return global_scale_for_amax(tf, x.float().abs().amax(dim=(0, 2)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--formats", nargs="+", default=FORMATS)
    ap.add_argument("--backends", nargs="+", default=["cuda", "triton"])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-graph", action="store_true", help="eager timing only (for profilers)")
    args = ap.parse_args()
    h, d, bs = 8, 128, 16
    base = {"bench": "write", **env_info(), "H_kv": h, "D": d, "block_size": bs}
    cbw = copy_bandwidth()
    emit(args.out, {**base, "impl": "copy", "gbps": cbw})
    for t in args.tokens:
        nb = 2 * t // bs
        k = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)
        blocks = torch.randperm(nb, device="cuda")[: t // bs]  # scattered pages, contiguous inside a page
        slots = (blocks[:, None] * bs + torch.arange(bs, device="cuda")).reshape(-1)
        for name in args.formats:
            fmt = get_format(name)
            pools = []
            for tf in (fmt.k, fmt.v):
                pools.append(torch.empty(nb, h, bs, tf.payload_dim(d), dtype=tf.torch_data_dtype, device="cuda"))
                sd = tf.scale_dim(d)
                pools.append(torch.empty(nb, h, bs, sd, dtype=torch.uint8, device="cuda") if sd else None)
            kd, ks, vd, vs = pools
            # calibrated per-head global scales (amax rule), not powers of two: the division a deployment pays
            kg = _amax_scale(k, fmt.k) if fmt.k.uses_global_scale else None
            vg = _amax_scale(v, fmt.v) if fmt.v.uses_global_scale else None
            for backend in args.backends:
                fn = partial(write_pools, k, v, slots, kd, ks, vd, vs, fmt, kg, vg, check=False, backend=backend)
                try:
                    fn()
                except KvxError as e:  # e.g. bf16 on the CUDA write: recorded, not timed
                    emit(args.out, {**base, "impl": f"kvx_{backend}", "format": name, "tokens": t, "skipped": str(e)})
                    continue
                r = bench(fn, n=args.runs, warmup=args.warmup)
                g = None if args.no_graph else bench_graph(fn, n=args.runs)
                nbytes = 2 * k.numel() * 2 + slots.numel() * 8 + t * h * fmt.bytes_per_token_head(d)
                ms = g["ms"] if g else r["ms"]
                gbps = nbytes / (ms * 1e-3) / 1e9
                emit(args.out, {**base, "impl": f"kvx_{backend}", "format": name, "tokens": t, **r,
                                "graph_ms": g["ms"] if g else None, "bytes": nbytes,
                                "gbps": gbps, "pct_copy_bw": 100 * gbps / cbw})


if __name__ == "__main__":
    main()
