"""Decode time of one layer with and without the key transforms (`PagedKVCache.set_key_smoothing` /
`set_key_center`): the same random-filled cache and plan, CUDA-graph replay (`common.bench_graph`), Hq 32 / Hkv 8 /
D 128, per format and (batch, tokens). The decode kernels multiply the queries by s as they load them; centering
adds `sm_scale * q . c` to the LSE after the kernel (`ops.smoothing.center_lse`), skipped with `want_lse=False`
(vLLM's and TGI's decode): the differences are that work.

Usage: python benchmarks/bench_key_transform.py   (GPU machine)
"""
import os
import sys
from functools import partial

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
            s, cen = torch.rand(HKV, D, device="cuda") + 0.5, torch.randn(HKV, D, device="cuda")
            for name, (ss, cc) in (("plain", (None, None)), ("smoothed", (s, None)), ("centered", (None, cen)),
                                   ("both", (s, cen))):
                c.set_key_smoothing(0, ss)
                c.set_key_center(0, cc)
                desc = c.descriptor(0)
                for lse in (True, False):  # an engine's decode reads only the output: no LSE correction
                    r = bench_graph(partial(plan.run, q, desc, want_lse=lse), n=50)
                    out[name + ("" if lse else " no-lse")] = r["ms"] * 1e3
            print(fmt, b, n, {k: round(v, 1) for k, v in out.items()}, "overhead %",
                  {k: round(100 * (v / out["plain"] - 1), 2) for k, v in out.items() if k != "plain"}, flush=True)
            del c
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
