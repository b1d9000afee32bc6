"""Paged decode: KVX (Triton, every format; CUDA, 4-bit formats) vs FlashInfer BF16 / FP8 in one process, same
block tables.

Pools hold random *valid* payload and scale bytes (timing does not depend on values; correctness is
tests/kernels). Prints and appends JSON lines to benchmarks/results/decode.jsonl:
ms (median of >= 50 L2-flushed runs), effective GB/s (payload + scale bytes of the attended tokens
/ time), % of the measured copy bandwidth (read + write), ratios to FlashInfer BF16 and FP8.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import bench, bench_graph, copy_bandwidth, emit, env_info  # noqa: E402

from kvx_core.formats import get_format  # noqa: E402
from kvx_core.ops.cuda.decode import supports  # noqa: E402
from kvx_core.ops.decode import cuda_num_splits, decode_pools, triton_num_splits  # noqa: E402
from kvx_core.ops.kernel_format import kernel_format  # noqa: E402


def random_pool(tf, nb, hkv, bs, d, dev):
    """Random payload [nb, hkv, bs, Dk] and scale bytes for one TensorFormat."""
    kf = kernel_format(tf)
    dk = d // 2 if kf.packed else d
    if tf.torch_data_dtype in (torch.bfloat16, torch.float16, torch.float32):
        data = torch.randn(nb, hkv, bs, dk, device=dev, dtype=tf.torch_data_dtype)
    elif tf.torch_data_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        data = torch.randn(nb, hkv, bs, dk, device=dev, dtype=torch.bfloat16).to(tf.torch_data_dtype)
    else:
        data = torch.randint(0, 256, (nb, hkv, bs, dk), device=dev, dtype=torch.uint8)
    sk = tf.scale_dim(d)
    if sk == 0:
        return data, None
    name = type(tf).__name__
    if name == "IntFormat":
        sc = torch.empty(nb, hkv, bs, 2, device=dev, dtype=torch.float16)
        sc[..., 0] = 0.01
        sc[..., 1] = -1.0
        scales = sc.view(torch.uint8)
    elif name == "NVFP4Format":
        scales = torch.randint(0x20, 0x48, (nb, hkv, bs, sk), device=dev, dtype=torch.uint8)
    else:  # MXFP4
        scales = torch.randint(120, 131, (nb, hkv, bs, sk), device=dev, dtype=torch.uint8)
    return data, scales


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="64x8192,64x32768,1x32768")
    ap.add_argument("--formats", default="bf16,fp8_e4m3,int8,int4,nvfp4,mxfp4,mxfp4_32,k8v4,nvfp4_rot")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--tune", default="", help="formats to sweep block_n/warps/stages/splits on")
    ap.add_argument("--tune-configs", default="64x32768,1x32768")
    ap.add_argument("--split-sweep", default="", help="num_splits values to try on B=1 configs, e.g. 16,32,64")
    ap.add_argument("--backends", default="auto", help="paged_decode backends to time, e.g. triton,cuda")
    ap.add_argument("--cuda-splits", default="", help="extra num_splits values for the CUDA backend")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--fi-tc", default="1", help="FlashInfer use_tensor_cores values to try, e.g. 0,1")
    ap.add_argument("--out", default="benchmarks/results/decode.jsonl")
    args = ap.parse_args()
    dev = "cuda"
    info = env_info()
    bw = copy_bandwidth()
    info["copy_gbps"] = bw
    emit(args.out, {"bench": "copy_bandwidth", **info, "gbps": bw})
    fi = None
    if not args.no_flashinfer:
        try:
            import flashinfer
            fi = flashinfer
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    hq, hkv, d, bs = args.hq, args.hkv, args.d, args.bs
    summary = []
    for cfg in args.configs.split(","):
        bsz, ctx = (int(x) for x in cfg.split("x"))
        pages_per = math.ceil(ctx / bs)
        nb = bsz * pages_per
        g = torch.Generator(device="cpu").manual_seed(0)
        perm = torch.randperm(nb, generator=g).to(torch.int32)
        bt = perm.view(bsz, pages_per).to(dev)
        sl = torch.full((bsz,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(bsz, hq, d, device=dev, dtype=torch.bfloat16)
        base = {"bench": "decode", **info, "B": bsz, "ctx": ctx, "hq": hq, "hkv": hkv, "d": d, "block_size": bs,
                "q_dtype": "bf16"}
        tokens = bsz * ctx
        fi_ms = {}
        if fi is not None:
            indptr = torch.arange(0, bsz + 1, device=dev, dtype=torch.int32) * pages_per
            indices = bt.reshape(-1).contiguous()
            last = torch.full((bsz,), ctx - (pages_per - 1) * bs, dtype=torch.int32, device=dev)
            ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
            for kvdt, tag in ((torch.bfloat16, "bf16"), (torch.float8_e4m3fn, "fp8_e4m3")):
                try:
                    kc = torch.randn(nb, hkv, bs, d, device=dev, dtype=torch.bfloat16).to(kvdt)
                    vc = torch.randn(nb, hkv, bs, d, device=dev, dtype=torch.bfloat16).to(kvdt)
                    for tc in [bool(int(x)) for x in args.fi_tc.split(",")]:
                        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=tc)
                        w.plan(indptr, indices, last, hq, hkv, d, bs, q_data_type=torch.bfloat16, kv_data_type=kvdt)
                        scales = {} if kvdt == torch.bfloat16 else {"k_scale": 1.0, "v_scale": 1.0}
                        r = bench(functools.partial(w.run, q, (kc, vc), **scales), n=args.runs)
                        nbytes = tokens * hkv * d * 2 * (2 if kvdt == torch.bfloat16 else 1)
                        gbps = nbytes / (r["ms"] * 1e-3) / 1e9
                        key = tag
                        if key not in fi_ms or r["ms"] < fi_ms[key]:
                            fi_ms[key] = r["ms"]
                        rec = {**base, "impl": "flashinfer", "format": tag, "tensor_cores": tc, **r, "gbps": gbps,
                               "pct_copy_bw": 100 * gbps / bw, "bytes": nbytes}
                        emit(args.out, rec)
                    del kc, vc
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
            torch.cuda.empty_cache()
        for name in args.formats.split(","):
            fmt = get_format(name)
            try:
                kd, ks = random_pool(fmt.k, nb, hkv, bs, d, dev)
                vd, vs = random_pool(fmt.v, nb, hkv, bs, d, dev)
            except torch.OutOfMemoryError:
                emit(args.out, {**base, "impl": "kvx", "format": name, "error": "OOM allocating pools"})
                continue
            kg = torch.full((hkv,), 0.5, device=dev) if fmt.k.uses_global_scale else None
            vg = torch.full((hkv,), 0.5, device=dev) if fmt.v.uses_global_scale else None
            nbytes = tokens * hkv * fmt.bytes_per_token_head(d)
            out = torch.empty_like(q)
            lse = torch.empty(bsz, hq, device=dev, dtype=torch.float32)
            cuda_why = supports(q, fmt, kd, ks if ks is not None else kd, vd, vs if vs is not None else vd)
            variants = []
            for be in args.backends.split(","):
                if be != "cuda":
                    variants.append(dict(backend=be))
                    continue
                if cuda_why:
                    continue  # the CUDA kernel does not serve this format
                variants.append(dict(backend="cuda"))
                variants += [dict(backend="cuda", num_splits=int(x)) for x in args.cuda_splits.split(",") if x]
            if name in args.tune.split(",") and cfg in args.tune_configs.split(","):
                auto = triton_num_splits(bsz, hkv, ctx, torch.device(dev))
                variants = []
                for bn in (64, 128):
                    for nw in (4, 8):
                        variants.append(dict(backend="triton", block_n=bn, num_warps=nw, num_stages=2))
                for sp in (max(1, auto // 2), auto * 2):
                    variants.append(dict(backend="triton", block_n=128, num_warps=4, num_stages=2, num_splits=sp))
            if bsz == 1 and args.split_sweep:
                variants += [dict(num_splits=int(x)) for x in args.split_sweep.split(",")]
            for var in variants:
                try:
                    kw = dict(var)
                    if kw.get("backend") == "cuda":
                        kw.setdefault("num_splits", cuda_num_splits(bsz, hkv, ctx, info["sms"]))
                    elif kw.get("backend") == "triton":
                        kw.setdefault("num_splits", triton_num_splits(bsz, hkv, ctx, torch.device(dev)))
                    # backend "auto" picks its kernel and splits itself, as a user's call does
                    fn = functools.partial(decode_pools, q, kd, ks, vd, vs, kg, vg, bt, sl, fmt, max_seq_len=ctx,
                                           out=out, lse=lse, **kw)
                    r = bench(fn, n=args.runs)
                    gr = bench_graph(fn, n=args.runs) if bsz == 1 else None
                    gbps = nbytes / (r["ms"] * 1e-3) / 1e9
                    rec = {**base, "impl": "kvx", "format": name, **r, "gbps": gbps, "pct_copy_bw": 100 * gbps / bw,
                           "bytes": nbytes, "variant": kw, "bw_bound_ms": nbytes / (bw * 1e9) * 1e3}
                    if gr:
                        rec["graph_ms"] = gr["ms"]
                    for tag in ("bf16", "fp8_e4m3"):
                        if tag in fi_ms:
                            rec[f"ratio_vs_fi_{tag}"] = fi_ms[tag] / r["ms"]
                    emit(args.out, rec)
                    summary.append(rec)
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
            del kd, ks, vd, vs
            torch.cuda.empty_cache()
    # short table last
    print("\nB ctx format variant ms GB/s %copy x_fi_bf16 x_fi_fp8")
    for r in summary:
        print(r["B"], r["ctx"], r["format"], {k: v for k, v in r["variant"].items()}, f"{r['ms']:.4f}",
              f"{r['gbps']:.0f}", f"{r['pct_copy_bw']:.0f}%", f"{r.get('ratio_vs_fi_bf16', float('nan')):.2f}",
              f"{r.get('ratio_vs_fi_fp8_e4m3', float('nan')):.2f}", r.get("graph_ms", ""))


if __name__ == "__main__":
    main()
