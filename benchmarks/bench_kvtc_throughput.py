"""KVTC codec throughput on a device: compress / decompress GB/s of BF16 K/V (`kvx_core.kvtc`: torch matmuls, and on
CUDA the Triton range codec; end to end, bytes in and bytes out, host copies included).

SmolLM2-135M's geometry (30 layers, 3 KV heads, head_dim 64) with synthetic K/V of low-rank structure plus noise
(the calibration and the timed sequence come from one generator; no model or network needed, so it runs on the
GPU machine). Reported per (tokens, ratio): the buffer's ratio vs BF16, the relative reconstruction error, compress
and decompress GB/s of BF16 K/V (median of `--runs`, device synchronized), and whether the GPU's buffer decodes on
the CPU to the GPU's values (`cross_device_max_abs`: the codec's matmuls are the device's, so the bytes of the two
devices may differ by rounding; each device decodes any buffer).

Usage: python benchmarks/bench_kvtc_throughput.py --device cuda [--tokens 32768] [--ratios 8,16] [--out F.jsonl]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import emit, env_info  # noqa: E402

from kvx_core.kvtc import calibrate, compress, decompress  # noqa: E402
from kvx_core.kvtc.codec import decode_body, encode_body, open_body, split_raw  # noqa: E402

LAYERS, H, D, RANK = 30, 3, 64, 24


def synthetic_kv(n: int, seed: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) `[n, H, D]` bf16: rank-RANK structure (fixed bases) plus 5% noise."""
    g = torch.Generator().manual_seed(seed)
    bases = torch.randn(LAYERS, 2, RANK, H * D, generator=torch.Generator().manual_seed(7))
    out = []
    for layer in range(LAYERS):
        pair = []
        for s in range(2):
            x = torch.randn(n, RANK, generator=g) @ bases[layer, s] + 0.05 * torch.randn(n, H * D, generator=g)
            pair.append(x.view(n, H, D).to(device=device, dtype=torch.bfloat16))
        out.append(tuple(pair))
    return out


def _timed(fn, runs: int, device: str) -> tuple[float, object]:
    times, out = [], None
    for _ in range(runs):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768])
    ap.add_argument("--ratios", default="8,16")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    env = env_info()
    cal_kv = [synthetic_kv(1024, s, "cpu") for s in range(2)]
    for ratio in (float(r) for r in a.ratios.split(",")):
        cal = calibrate(cal_kv, layers_per_group=6, ratio=ratio, range_size=16, sink_tokens=4, recent_tokens=64)
        for n in a.tokens:
            kv = synthetic_kv(n, 100 + n, a.device)
            raw = sum(k.numel() + v.numel() for k, v in kv) * 2
            compress(kv, cal)  # warm-up
            t_c, buf = _timed(partial(compress, kv, cal), a.runs, a.device)
            t_d, dec = _timed(partial(decompress, buf, cal, device=a.device), a.runs, a.device)
            head, tail = split_raw(n, 0, cal)  # the device halves alone: body in / out of device memory
            t_cd, _ = _timed(partial(encode_body, kv, cal, 0, b"", head, tail), a.runs, a.device)
            hdr, layout, on_dev, _ = open_body(buf, cal, device=a.device)
            t_dd, _ = _timed(partial(decode_body, on_dev, cal, layout, hdr), a.runs, a.device)
            err = sum(float(((x.float() - y.float()) ** 2).sum())
                      for p, q in zip(kv, dec.kv, strict=True) for x, y in zip(p, q, strict=True))
            ref = sum(float((x.float() ** 2).sum()) for p in kv for x in p)
            on_cpu = decompress(buf, cal, device="cpu").kv
            cross = max(float((x.cpu().float() - y.float()).abs().max()) for p, q in zip(dec.kv, on_cpu, strict=True)
                        for x, y in zip(p, q, strict=True))
            emit(a.out, {**env, "bench": "kvtc_throughput", "device": a.device,
                         "codec": "triton" if a.device.startswith("cuda") else "torch", "geometry": [LAYERS, H, D],
                         "tokens": n, "target_ratio": ratio, "ratio_vs_bf16": raw / len(buf),
                         "rel_error": (err / ref) ** 0.5, "compress_s": t_c, "decompress_s": t_d,
                         "compress_gbps": raw / t_c / 1e9, "decompress_gbps": raw / t_d / 1e9,
                         "device_compress_gbps": raw / t_cd / 1e9, "device_decompress_gbps": raw / t_dd / 1e9,
                         "cross_device_max_abs": cross})


if __name__ == "__main__":
    main()
