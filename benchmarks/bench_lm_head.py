"""lm_head GEMV / small GEMM on the GPU: BF16 cuBLAS (`F.linear`, what vLLM runs for an unquantized head) vs KVX's
MXFP4 kernel (`kvx_core.ops.triton.mxfp4_gemv`), same run, same weight, M activation rows in {1 .. 64}.

Shapes: gpt-oss's head 201088 x 2880 and its TP=2 shard 100544 x 2880 (random weights: the kernel's time does not
depend on the values). Reported per (shape, M): median us (L2 flushed before each run), the MXFP4 speed-up over BF16
(the bf16 decode the quantized head takes; the FP32 decode, for any scale, beside it), and each one's bytes read
(weight + activations + logits) as % of the device's copy bandwidth. `--sweep` first times the kernel's tile
configurations at M = 1 / 16 / 64 (the table `config()` is chosen from). vLLM's Marlin MXFP4 GEMM
(`marlin_utils_fp4`, through `kvx_vllm.marlin_head`: the same MXFP4 weight repacked by `prepare_fp4_layer_for_marlin`,
what vLLM's W4A16 MXFP4 linear layers and the KVX head option run on Hopper) is timed too when vLLM is importable (with
plugins/kvx_vllm on the path), after checking that it computes the same logits as KVX's kernel; otherwise a line says
why it was not.

Usage: python benchmarks/bench_lm_head.py [--out F.jsonl] [--sweep]
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from functools import partial

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


def marlin_head(wq, n: int) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, str | None]:
    """vLLM's Marlin MXFP4 GEMM over KVX's quantized weight (`kvx_vllm.marlin_head`, what the vLLM head option runs),
    or None and why not."""
    try:
        from kvx_vllm.marlin_head import marlin_mxfp4
    except Exception as e:  # noqa: BLE001
        return None, f"vLLM not importable here ({type(e).__name__}: {e}); Marlin not timed"
    marlin = marlin_mxfp4(wq, torch.bfloat16)
    return (marlin, None) if marlin is not None else (None, "vLLM has no FP4 Marlin for this GPU")


def run_shape(out: str | None, env: dict, bw: float, name: str, n: int, sweep: bool) -> None:
    w = (torch.randn(n, K, device="cuda") * 0.02).bfloat16()
    wq = quantize_mxfp4(w)
    if sweep:
        for m in (1, 16, 64):
            x = torch.randn(m, K, device="cuda").bfloat16()
            bm = config(m)[0]
            for bn, bk, warps, stages in SWEEP:
                t = bench(partial(mxfp4_linear_triton, x, wq.payload, wq.scales, (bm, bn, bk, warps, stages),
                                  max_scale=wq.max_scale))
                emit(out, {**env, "bench": "lm_head_sweep", "shape": name, "m": m,
                           "tiles": [bm, bn, bk, warps, stages], "us": t["ms"] * 1e3})
    marlin, why = marlin_head(wq, n)
    if why:
        emit(out, {**env, "bench": "lm_head", "shape": name, "marlin": why})
    for m in MS:
        x = torch.randn(m, K, device="cuda").bfloat16()
        t_bf16 = bench(partial(F.linear, x, w))
        t_mx = bench(partial(mxfp4_linear_triton, x, wq.payload, wq.scales, max_scale=wq.max_scale))
        t_gen = bench(partial(mxfp4_linear_triton, x, wq.payload, wq.scales))  # the FP32 decode (any scale)
        io = 2 * m * (K + n)
        row = {**env, "bench": "lm_head", "shape": name, "n": n, "k": K, "m": m,
               "tiles": list(config(m)), "bf16_us": t_bf16["ms"] * 1e3, "mxfp4_us": t_mx["ms"] * 1e3,
               "speedup": t_bf16["ms"] / t_mx["ms"], "mxfp4_fp32_decode_us": t_gen["ms"] * 1e3,
               "bf16_pct_copy_bw": 100 * (2 * n * K + io) / (t_bf16["ms"] * 1e-3) / 1e9 / bw,
               "mxfp4_pct_copy_bw": 100 * (wq.nbytes + io) / (t_mx["ms"] * 1e-3) / 1e9 / bw}
        if marlin is not None:
            ours = mxfp4_linear_triton(x, wq.payload, wq.scales, max_scale=wq.max_scale).float()
            # the same exact products summed in another order: a few bf16 ulps of the logits' scale apart
            row["marlin_max_rel_diff"] = float((marlin(x).float() - ours).abs().max() / ours.abs().max())
            t_marlin = bench(partial(marlin, x))
            row.update(marlin_us=t_marlin["ms"] * 1e3, speedup_vs_marlin=t_marlin["ms"] / t_mx["ms"])
        emit(out, row)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true")
    a = ap.parse_args()
    env = env_info()
    bw = copy_bandwidth()
    emit(a.out, {**env, "bench": "lm_head", "copy_bandwidth_gbps": bw})
    torch.manual_seed(0)
    for name, n in SHAPES.items():
        run_shape(a.out, env, bw, name, n, a.sweep and n == max(SHAPES.values()))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
