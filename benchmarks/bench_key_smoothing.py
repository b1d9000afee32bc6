"""Decode time of one layer with and without key smoothing (`PagedKVCache.set_key_smoothing`): the same random-filled
cache and plan, CUDA-graph replay (`common.bench_graph`), Hq 32 / Hkv 8 / D 128, per format and (batch, tokens).
The decode kernels multiply the queries by s as they load them, so the difference is that work alone.

Usage: python benchmarks/bench_key_smoothing.py   (GPU machine)
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import bench_graph  # noqa: E402
from kvx_core.cache import PagedKVCache  # noqa: E402
from kvx_core.descriptors import BlockTable, SeqLens  # noqa: E402
from kvx_core.ops import dispatch  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16

def main() -> None:
    for fmt in ("nvfp4", "fp8_e4m3", "int4"):
        for b, n in ((1, 4096), (8, 8192), (64, 32768)):
            blocks = b * n // BS
            c = PagedKVCache(fmt, num_layers=1, num_blocks=blocks, block_size=BS, num_kv_heads=HKV, head_dim=D,
                             device="cuda")
            p = c.layers[0]
            for t in (p.k_data, p.v_data):
                t.view(torch.uint8).random_(0, 120)
            for t in (p.k_scales, p.v_scales):
                if t is not None:
                    t.view(torch.uint8).random_(0x30, 0x40)
            table = BlockTable.packed(torch.arange(blocks, dtype=torch.int32, device="cuda").view(b, -1))
            lens = SeqLens(torch.full((b,), n, dtype=torch.int32, device="cuda"))
            q = torch.randn(b, HQ, D, device="cuda").bfloat16()
            plan = dispatch.plan_decode(table, lens, fmt=fmt, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                        block_size=BS, q_dtype=q.dtype, max_seq_len=n, check=False)
            out = {}
            for name, s in (("plain", None), ("smoothed", torch.rand(HKV, D, device="cuda") + 0.5)):
                c.set_key_smoothing(0, s)
                desc = c.descriptor(0)
                r = bench_graph(lambda: plan.run(q, desc), n=50)
                out[name] = r["ms"] * 1e3
            print(fmt, b, n, {k: round(v, 1) for k, v in out.items()}, "overhead %",
                  round(100 * (out["smoothed"] / out["plain"] - 1), 2), flush=True)
            del c
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
