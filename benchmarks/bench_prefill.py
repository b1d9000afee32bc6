"""Paged prefill/extend attention: KVX Triton (every format) vs FlashInfer BF16
`BatchPrefillWithPagedKVCacheWrapper` on the same shapes (causal, GQA 32/8, D=128, page 16), L2 flushed.

Usage: python benchmarks/bench_prefill.py [--out benchmarks/results/prefill.jsonl] [--no-flashinfer]
       [--chunks 16 --prefixes 32768 --batch 1 --splits 1 auto]  (a few queries over a long cached prefix: the
       plan's split-KV, `splits` in each line, against the unsplit kernel)
       [--dequant-pass]  (also: each format's pages dequantized to a dense BF16 K/V by KVX's gather kernel over the
       bound layer (`gather_bound`: one launch, no host sync), then FlashInfer's ragged BF16 prefill over it: the
       "separate pass" design of issue 35, timed as one step, beside the checked `gather_pools`, whose argument
       checks sync the host ~5 times per call: `gather_checked_ms`)
"""
from __future__ import annotations

import argparse
from functools import partial

import torch
from common import bench, emit, env_info

from kvx_core.cache import PagedKVCache
from kvx_core.ops.bound_gather import gather_bound
from kvx_core.ops.dispatch import bind
from kvx_core.ops.triton import plan_prefill
from kvx_core.ops.triton.gather import gather_pools

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
    ap.add_argument("--chunks", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[0, 8192])
    ap.add_argument("--configs", nargs="+", default=["default"],
                    help="kernel configs BMxBNxWARPSxSTAGES to time (e.g. 128x64x8x2), 'default' = the launcher's")
    ap.add_argument("--splits", nargs="+", default=["auto"],
                    help="key splits to time: 'auto' = the plan's choice from the step's longest sequence, or a count")
    ap.add_argument("--dequant-pass", action="store_true",
                    help="also time KVX's gather to dense BF16 + FlashInfer's ragged BF16 prefill (needs flashinfer)")
    args = ap.parse_args()
    hq, hkv, d, bs, b = 32, 8, 128, 16, args.batch
    base = {"bench": "prefill", **env_info(), "Hq": hq, "H_kv": hkv, "D": d, "block_size": bs, "B": b}
    fi = None
    if not args.no_flashinfer:
        try:
            import flashinfer as fi
        except Exception as e:  # noqa: BLE001
            print("flashinfer unavailable:", repr(e)[:200])
    configs = [None if c == "default" else dict(zip(("block_m", "block_n", "num_warps", "num_stages"),
                                                      map(int, c.split("x")), strict=True)) for c in args.configs]
    for chunk in args.chunks:
        for prefix in args.prefixes:
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
                r = bench(partial(w.run, q, (kc, vc)), n=50)
                peer_ms = r["ms"]
                emit(args.out, {**base, **shape, "impl": "flashinfer", "format": "bf16", **r,
                                "tflops": fl / r["ms"] / 1e9})
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
                for cfg, splits in ((cfg, sp) for cfg in configs for sp in args.splits):
                    kw = cfg or {}
                    plan = plan_prefill(c.format, qo.cpu(), num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                                        block_size=bs, q_dtype=q.dtype, device=q.device, max_seq_len=n,
                                        num_splits=None if splits == "auto" else int(splits),
                                        **kw)  # planned once, as engines do
                    r = bench(partial(plan.run, q, p.k_data, p.k_scales, p.v_data, p.v_scales, p.k_global,
                                      p.v_global, bt, sl), n=50)
                    rec = {**base, **shape, "impl": "kvx_triton", "format": name, "config": kw or "default",
                           "splits": plan.num_splits, "splits_asked": splits, **r, "tflops": fl / r["ms"] / 1e9}
                    if peer_ms:
                        rec["x_flashinfer_bf16"] = peer_ms / r["ms"]
                    emit(args.out, rec)
                if args.dequant_pass and fi is not None:
                    r = _dequant_pass(fi, c, q, qo, bt, sl, n, hq, hkv, d)
                    rec = {**base, **shape, "format": name, **r, "tflops": fl / r["ms"] / 1e9}
                    if peer_ms:
                        rec["x_flashinfer_bf16"] = peer_ms / r["ms"]
                    emit(args.out, rec)
                del c, p


def _dequant_pass(fi, c: PagedKVCache, q, qo, bt, sl, n: int, hq: int, hkv: int, d: int) -> dict:
    """One layer's prefill as two passes: KVX's gather dequantizes each sequence's pages (prefix and chunk) into
    a dense BF16 `[B * n, H_kv, D]` K / V, FlashInfer's ragged prefill (causal, bottom-right aligned: query i of
    a chunk sees the prefix and chunk keys up to its own) attends over it. Times the gather alone, the ragged
    prefill alone and the two in sequence."""
    p, b = c.layers[0], sl.numel()
    layer = bind(c.descriptor(0))  # once per layer, as an engine registers its cache
    cu = torch.arange(b + 1, dtype=torch.int32, device="cuda") * n  # the step's metadata (every sequence n long)
    k = torch.empty(b * n, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.empty_like(k)
    wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD")
    kv_indptr = torch.arange(b + 1, dtype=torch.int32, device="cuda") * n
    wrapper.plan(qo, kv_indptr, hq, hkv, d, causal=True, q_data_type=torch.bfloat16)

    def checked():
        gather_pools(p.k_data, p.k_scales, p.v_data, p.v_scales, bt, sl, c.format, p.k_global, p.v_global,
                     out_dtype=torch.bfloat16, out=(k, v))

    gather = partial(gather_bound, layer, bt, sl, cu, n, (k, v))

    def both():
        gather()
        return wrapper.run(q, k, v)

    g, f, r = bench(gather, n=50), bench(partial(wrapper.run, q, k, v), n=50), bench(both, n=50)
    return {"impl": "kvx_gather_flashinfer_ragged", **r, "gather_ms": g["ms"], "ragged_bf16_ms": f["ms"],
            "gather_checked_ms": bench(checked, n=50)["ms"]}


if __name__ == "__main__":
    main()
