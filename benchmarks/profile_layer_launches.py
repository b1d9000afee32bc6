"""What one layer's decode step and K/V write cost on the host and the GPU, through the descriptor and through a
layer bound once (`dispatch.bind`), as the vLLM backend calls them (`check=False`, `want_lse=False`, page-buffer
cache, a persistent workspace).

    python benchmarks/profile_layer_launches.py --out benchmarks/results/layer_launches_h200.jsonl

Per format, B x ctx and path, one JSON line: CUDA kernels per call (torch.profiler over 20 calls), Python function
calls per call (sys.setprofile), eager microseconds per call (200 calls back to back, one sync: host-bound when the
host is slower than the GPU) and GPU microseconds per call (the call captured in a CUDA graph, 200 replays timed
with CUDA events). GQA 32/8, head_dim 128, block 16, bf16 queries.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, env_info  # noqa: E402

from kvx_core.cache import PagedKVCache  # noqa: E402
from kvx_core.descriptors import BlockTable, KvIoDesc, SeqLens, SlotMapping, WriteDesc  # noqa: E402
from kvx_core.ops import dispatch  # noqa: E402
from kvx_core.ops.decode import workspace_size  # noqa: E402
from kvx_core.ops.graphs import capture  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16


def _python_calls(fn) -> int:
    n = 0

    def prof(frame, event, arg):
        nonlocal n
        n += event == "call"
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def _kernels(fn, reps: int = 20) -> float:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if (getattr(e, "device_time_total", 0) or 0) > 0) / reps


def _eager_us(fn, reps: int = 200) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def _graph_us(fn, reps: int = 200) -> float:
    g, _ = capture(fn)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps * 1e3


def measure(fmt: str, batch: int, ctx: int) -> list[dict]:
    dev = torch.device("cuda")
    blocks = batch * (ctx // BS) + 1
    cache = PagedKVCache(fmt, num_layers=1, num_blocks=blocks, block_size=BS, num_kv_heads=HKV, head_dim=D,
                         device=dev, page_buffer=True)
    desc = cache.descriptor(0)
    g = torch.Generator(device=dev).manual_seed(0)
    kv = torch.randn(BS * 64, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    for start in range(0, blocks * BS, kv.shape[0]):  # every slot holds a token
        n = min(kv.shape[0], blocks * BS - start)
        dispatch.write_kv(desc, WriteDesc(KvIoDesc(kv[:n], kv[:n]), SlotMapping(torch.arange(start, start + n,
                                                                                                device=dev))))
    table = BlockTable.packed(torch.arange(batch * (ctx // BS), device=dev, dtype=torch.int32).view(batch, -1))
    lens = SeqLens(torch.full((batch,), ctx, device=dev, dtype=torch.int32))
    geometry = dict(fmt=fmt, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS, q_dtype=torch.bfloat16,
                    device=dev)
    ws = torch.empty(workspace_size(max_batch=batch, max_seq_len=ctx, **geometry), dtype=torch.float32, device=dev)
    plan = dispatch.plan_decode(table, lens, max_seq_len=ctx, check=False, workspace=ws, **geometry)
    q = torch.randn(batch, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    out = torch.empty_like(q)
    k_new = torch.randn(batch, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    slots = torch.arange(batch, device=dev) * (ctx // BS) * BS + ctx - 1
    slots[-1] = -1  # a padded token, as vLLM's CUDA-graph batches have
    write = WriteDesc(KvIoDesc(k_new, k_new), SlotMapping(slots))
    rows = []
    for path, layer in (("descriptor", desc), ("bound", dispatch.bind(desc))):
        for op, fn in (("decode", partial(plan.run, q, layer, out=out, want_lse=False)),
                       ("write", partial(dispatch.write_kv, layer, write, check=False))):
            fn()
            rows.append({"bench": "layer_launches", "format": fmt, "batch": batch, "ctx": ctx, "path": path, "op": op,
                         "kernels": _kernels(fn), "python_calls": _python_calls(fn),
                         "eager_us": round(_eager_us(fn), 1), "graph_us": round(_graph_us(fn), 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="nvfp4,nvfp4_rot,int8,fp8_e4m3,k8v4,int4")
    ap.add_argument("--shapes", default="1x4096,64x8192")
    ap.add_argument("--out")
    a = ap.parse_args()
    env = env_info()
    for fmt in a.formats.split(","):
        for shape in a.shapes.split(","):
            b, ctx = (int(x) for x in shape.split("x"))
            for r in measure(fmt, b, ctx):
                emit(a.out, {**env, **r})


if __name__ == "__main__":
    main()
