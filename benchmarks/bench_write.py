"""Fused KV write throughput (quantize + scatter, K and V in one launch) per format, vs copy bandwidth.

GB/s counts the bf16 K/V read, the slot mapping read and the payload + scale bytes written.
Usage: python benchmarks/bench_write.py [--out benchmarks/results/write.jsonl]
"""
from __future__ import annotations

import argparse

import torch

from common import bench, copy_bandwidth, emit, env_info
from kvx_core.formats import get_format
from kvx_core.ops.triton import write_kv

FORMATS = ["bf16", "fp8_e4m3", "int8", "int4", "nvfp4", "mxfp4", "mxfp4_32", "k8v4", "nvfp4_rot"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--formats", nargs="+", default=FORMATS)
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
            fn = lambda: write_kv(k, v, slots, kd, ks, vd, vs, fmt, check=False)  # noqa: E731
            r = bench(fn, n=50)
            nbytes = 2 * k.numel() * 2 + slots.numel() * 8 + t * h * fmt.bytes_per_token_head(d)
            gbps = nbytes / (r["ms"] * 1e-3) / 1e9
            emit(args.out, {**base, "impl": "kvx_triton", "format": name, "tokens": t, **r, "bytes": nbytes,
                            "gbps": gbps, "pct_copy_bw": 100 * gbps / cbw})


if __name__ == "__main__":
    main()
