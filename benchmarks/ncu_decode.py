"""One paged-decode launch per format, for Nsight Compute: `ncu --clock-control none -k regex:decode
python benchmarks/ncu_decode.py --formats bf16,nvfp4`. Same pools and shapes as bench_decode.py."""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import random_pool  # noqa: E402

from kvx_core.formats import get_format  # noqa: E402
from kvx_core.ops.decode import decode_pools  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="bf16,nvfp4,int4,fp8_e4m3")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--splits", type=int, default=None)
    a = ap.parse_args()
    dev, hq, hkv, d, bs = "cuda", 32, 8, 128, 16
    pages = a.ctx // bs
    nb = a.batch * pages
    bt = torch.randperm(nb, device=dev, dtype=torch.int32).view(a.batch, pages)
    sl = torch.full((a.batch,), a.ctx, device=dev, dtype=torch.int32)
    q = torch.randn(a.batch, hq, d, device=dev, dtype=torch.bfloat16)
    for name in a.formats.split(","):
        fmt = get_format(name)
        kd, ks = random_pool(fmt.k, nb, hkv, bs, d, dev)
        vd, vs = random_pool(fmt.v, nb, hkv, bs, d, dev)
        kg = torch.full((hkv,), 0.5, device=dev) if fmt.k.uses_global_scale else None
        vg = torch.full((hkv,), 0.5, device=dev) if fmt.v.uses_global_scale else None
        for _ in range(2):  # first call compiles; ncu profiles both, read the second
            decode_pools(q, kd, ks, vd, vs, kg, vg, bt, sl, fmt, max_seq_len=a.ctx, backend=a.backend,
                         num_splits=a.splits)
        torch.cuda.synchronize()
        del kd, ks, vd, vs


if __name__ == "__main__":
    main()
