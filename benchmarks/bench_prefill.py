"""Paged prefill/extend attention: KVX Triton (every format) vs FlashInfer BF16
`BatchPrefillWithPagedKVCacheWrapper` on the same shapes (causal, GQA 32/8, D=128, page 16), L2 flushed.

Usage: python benchmarks/bench_prefill.py [--out benchmarks/results/prefill.jsonl] [--no-flashinfer]
"""
from __future__ import annotations

import argparse

import torch

from common import bench, emit, env_info
from kvx_core.cache import PagedKVCache
from kvx_core.ops.triton import paged_prefill, prefill_plan

FORMATS = ["bf16", "fp8_e4m3", "int8", "int4", "nvfp4", "mxfp4", "k8v4"]


def flops(b: int, chunk: int, prefix: int, hq: int, d: int) -> float:
    """Causal QK + PV flops (4 * Hq * D per attended (query, key) pair)."""
    pairs = b * (chunk * prefix + chunk * (chunk + 1) / 2)
    return 4.0 * hq * d * pairs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--formats", nargs="+", default=FORMATS)
    ap.add_argument("--no-flashinfer", action="store_true")
    args = ap.parse_args()
    hq, hkv, d, bs, b = 32, 8, 128, 16, args.batch
    base = {"bench": "prefill", **env_info(), "Hq": hq, "H_kv": hkv, "D": d, "block_size": bs, "B": b}
    fi = None
    if not args.no_flashinfer:
        try:
            import flashinfer as fi
        except Exception as e:  # noqa: BLE001
            print("flashinfer unavailable:", repr(e)[:200])
    for chunk in (512, 4096):
        for prefix in (0, 8192):
            n = prefix + chunk
            per = (n + bs - 1) // bs
            nb = b * per
            qo = torch.arange(b + 1, dtype=torch.int32, device="cuda") * chunk
            sl = torch.full((b,), n, dtype=torch.int32, device="cuda")
            bt = torch.randperm(nb, device="cuda").to(torch.int32).view(b, per)
            q = torch.randn(b * chunk, hq, d, device="cuda", dtype=torch.bfloat16)
            shape = {"chunk": chunk, "prefix": prefix}
            fl = flops(b, chunk, prefix, hq, d)
            peer_ms = None
            if fi is not None:
                kc = torch.randn(nb, hkv, bs, d, device="cuda", dtype=torch.bfloat16)
                vc = torch.randn_like(kc)
                ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
                w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "HND")
                kv_indptr = torch.arange(b + 1, dtype=torch.int32, device="cuda") * per
                last = torch.full((b,), n - (per - 1) * bs, dtype=torch.int32, device="cuda")
                w.plan(qo, kv_indptr, bt.reshape(-1), last, hq, hkv, d, bs, causal=True,
                       q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                r = bench(lambda: w.run(q, (kc, vc)), n=50)
                peer_ms = r["ms"]
                emit(args.out, {**base, **shape, "impl": "flashinfer", "format": "bf16", **r, "tflops": fl / r["ms"] / 1e9})
                del kc, vc, ws
            for name in args.formats:
                c = PagedKVCache(name, num_layers=1, num_blocks=nb, block_size=bs, num_kv_heads=hkv, head_dim=d,
                                 device="cuda")
                p = c.layers[0]
                for t in (p.k_data, p.v_data):  # random payload bytes / values (never time zeros)
                    t.view(torch.uint8).random_(0, 120) if t.dtype != torch.bfloat16 else t.normal_()
                for t in (p.k_scales, p.v_scales):
                    if t is not None:
                        t.random_(100, 120)
                plan = prefill_plan(qo, hq // hkv, 64)
                fn = lambda: paged_prefill(q, qo, p.k_data, p.k_scales, p.v_data, p.v_scales, p.k_global,  # noqa: E731
                                           p.v_global, bt, sl, c.format, plan=plan)
                r = bench(fn, n=50)
                rec = {**base, **shape, "impl": "kvx_triton", "format": name, **r, "tflops": fl / r["ms"] / 1e9}
                if peer_ms:
                    rec["x_flashinfer_bf16"] = peer_ms / r["ms"]
                emit(args.out, rec)
                del c, p


if __name__ == "__main__":
    main()
