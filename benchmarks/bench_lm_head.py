"""lm_head GEMV / small GEMM on the GPU: BF16 cuBLAS (`F.linear`, what vLLM runs for an unquantized head) vs KVX's
MXFP4 kernel (`kvx_core.ops.triton.mxfp4_gemv`), same run, same weight, M activation rows in {1 .. 64}.

Shapes: gpt-oss's head 201088 x 2880 and its TP=2 shard 100544 x 2880 (random weights: the kernel's time does not
depend on the values). Reported per (shape, M): median us (L2 flushed before each run), the MXFP4 speed-up over BF16 (the bf16 decode the quantized head takes; the FP32 decode, for any scale, beside it),
and each one's bytes read (weight + activations + logits) as % of the device's copy bandwidth. `--sweep` first times
the kernel's tile configurations at M = 1 / 16 / 64 (the table `config()` is chosen from). vLLM's Marlin MXFP4 GEMM
is timed too when vLLM is importable (`vllm._custom_ops`); otherwise the line says it was not available.

Usage: python benchmarks/bench_lm_head.py [--out F.jsonl] [--sweep]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import bench, copy_bandwidth, emit, env_info  # noqa: E402

from kvx_core.mxfp4_linear import quantize_mxfp4  # noqa: E402
from kvx_core.ops.triton.mxfp4_gemv import config, mxfp4_linear_triton  # noqa: E402

K = 2880
SHAPES = {"gpt-oss head": 201088, "gpt-oss head TP=2 shard": 100544}
MS = (1, 2, 4, 8, 16, 32, 64)
SWEEP = [(bn, bk, w, 3) for bn in (64, 128, 256) for bk in (64, 128, 256) for w in (4, 8)] + [(128, 256, 4, 5)]


def marlin_available() -> str | None:
    try:
        import vllm._custom_ops  # noqa: F401
        return None
    except Exception as e:  # noqa: BLE001
        return f"vLLM not importable here ({type(e).__name__}); Marlin not timed"


def run_shape(out: str | None, env: dict, bw: float, name: str, n: int, sweep: bool) -> None:
    w = (torch.randn(n, K, device="cuda") * 0.02).bfloat16()
    wq = quantize_mxfp4(w)
    if sweep:
        for m in (1, 16, 64):
            x = torch.randn(m, K, device="cuda").bfloat16()
            bm = config(m)[0]
            for bn, bk, warps, stages in SWEEP:
                t = bench(lambda: mxfp4_linear_triton(x, wq.payload, wq.scales, (bm, bn, bk, warps, stages),
                                                      max_scale=wq.max_scale))
                emit(out, {**env, "bench": "lm_head_sweep", "shape": name, "m": m,
                           "tiles": [bm, bn, bk, warps, stages], "us": t["ms"] * 1e3})
    for m in MS:
        x = torch.randn(m, K, device="cuda").bfloat16()
        t_bf16 = bench(lambda: F.linear(x, w))
        t_mx = bench(lambda: mxfp4_linear_triton(x, wq.payload, wq.scales, max_scale=wq.max_scale))
        t_gen = bench(lambda: mxfp4_linear_triton(x, wq.payload, wq.scales))  # the FP32 decode (any scale)
        io = 2 * m * (K + n)
        emit(out, {**env, "bench": "lm_head", "shape": name, "n": n, "k": K, "m": m,
                   "tiles": list(config(m)), "bf16_us": t_bf16["ms"] * 1e3, "mxfp4_us": t_mx["ms"] * 1e3,
                   "speedup": t_bf16["ms"] / t_mx["ms"], "mxfp4_fp32_decode_us": t_gen["ms"] * 1e3,
                   "bf16_pct_copy_bw": 100 * (2 * n * K + io) / (t_bf16["ms"] * 1e-3) / 1e9 / bw,
                   "mxfp4_pct_copy_bw": 100 * (wq.nbytes + io) / (t_mx["ms"] * 1e-3) / 1e9 / bw})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true")
    a = ap.parse_args()
    env = env_info()
    bw = copy_bandwidth()
    emit(a.out, {**env, "bench": "lm_head", "copy_bandwidth_gbps": bw, "marlin": marlin_available()})
    torch.manual_seed(0)
    for name, n in SHAPES.items():
        run_shape(a.out, env, bw, name, n, a.sweep and n == max(SHAPES.values()))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
