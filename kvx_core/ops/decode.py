"""Paged decode on the GPU kernels: the one place that chooses the backend (the CUDA kernel in `ops/cuda` or
the Triton kernel in `ops/triton/decode.py`) and the number of KV splits, then launches the chosen split-KV
kernel and the split merge (`ops/triton/merge.py`).

`ops.dispatch.paged_decode` calls `paged_decode` here for kernel-addressable caches; the benchmarks call it on
raw pools. Pools follow the storage contract of `ops/triton` (HND data `[num_blocks, H_kv, block_size, Dk]`,
uint8 scale pools, FP32 `[H_kv]` global scales, int32 block table `[B, max_blocks]`, int32 seq_lens `[B]`).
"""
from __future__ import annotations

import math
import os

import torch

from ..errors import KvxError, Status
from ..formats import CacheFormat
from .checks import check_max_seq_len
from .cuda import decode as cuda_decode
from .kernel_format import FormatCode, kernel_format
from .triton import decode as triton_decode
from .triton.launch import as_format, check_device, check_pool, global_scale_arg, interpreting, scale_args, sm_count
from .triton.merge import merge_splits

BACKENDS = ("auto", "cuda", "triton")


def triton_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, device) -> int:
    """Splits per (sequence, KV head) of the Triton decode: ~4 programs per SM, but at least 1024 tokens per split.

    H200 (benchmarks/results/decode_triton_splits_blockn_h200.jsonl): B=64 32k nvfp4 2 splits beat 1 by 12%;
    B=1 32k 32 splits beat 16 by 1.4x and 64 by 1.1x.
    `block_n` is kept for the signature; the token floor covers it (1024 >= 4 * block_n).
    """
    target = 4 * sm_count(device)
    base = max(1, batch * num_kv_heads)
    by_len = max(1, math.ceil(max_seq_len / max(1024, 4 * block_n)))
    return int(max(1, min(math.ceil(target / base), by_len, 256)))


def cuda_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, sm_count: int) -> int:
    """Splits per (sequence, KV head) of the CUDA decode: >= 9 CTAs per SM for large batches (4 resident per SM),
    ~4 per SM when there are fewer (sequence, KV head) pairs than SMs; at least 2 tiles per warp.

    H200, GQA 32/8, D=128: B=64 at 32k, 3 splits best (2: +1.5%, 1: +4%, 64: +15%;
    benchmarks/results/decode_cuda_cpasync_splits_h200.jsonl); B=1 at 32k, 64 splits (34 us) beat 32 (39 us) and
    16 (57 us) (benchmarks/results/decode_cuda_splits_warps_h200.jsonl).
    """
    base = max(1, batch * num_kv_heads)
    ctas = 4 * sm_count if base < sm_count else 9 * sm_count
    by_len = max(1, math.ceil(max_seq_len / (32 * cuda_decode.WARPS)))
    return int(max(1, min(math.ceil(ctas / base), by_len, 256)))


def choose_splits(backend: str, batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, device) -> int:
    """Splits per (sequence, KV head) for `backend` ("cuda" or "triton"; `block_n`: the Triton key tile)."""
    if backend == "cuda":
        return cuda_num_splits(batch, num_kv_heads, max_seq_len, sm_count(device))
    return triton_num_splits(batch, num_kv_heads, max_seq_len, block_n, device)


def choose_backend(backend, q, fmt: CacheFormat, k_data, k_scales, v_data, v_scales, num_warps) -> str:
    """"cuda" or "triton": which kernel serves this call (see `paged_decode`'s `backend` argument)."""
    backend = backend or os.environ.get("KVX_DECODE_BACKEND", "auto")
    if backend not in BACKENDS:
        raise KvxError(Status.INVALID_ARGUMENT, f"decode backend must be auto, cuda or triton, got {backend!r}")
    if backend == "triton" or (backend == "auto" and (interpreting() or q.device.type != "cuda")):
        return "triton"
    why = cuda_decode.supports(q, fmt, k_data, k_scales, v_data, v_scales)
    if why is None and backend == "auto" and kernel_format(fmt.k).code == FormatCode.FP8 \
            and q.shape[0] * k_data.shape[1] < sm_count(q.device) // 8:
        # FP8 with very few (sequence, KV head) pairs: Triton measured faster
        # (H200, benchmarks/results/decode_int8_fp8_cuda_vs_triton_h200.jsonl, B=1 32k: 44 us vs 50 us); from B=16
        # (8k) the CUDA kernel is faster (0.106 vs 0.141 ms; B=64: 1.6x).
        why = "tiny-batch FP8 decode runs faster in Triton"
    if why is None and num_warps not in (None, cuda_decode.WARPS):
        why = f"num_warps={num_warps}: the CUDA decode runs {cuda_decode.WARPS} warps per CTA"
    if why is None and backend == "auto":
        try:
            cuda_decode.kernel_library(q.device)
        except KvxError as e:
            if e.status != Status.UNSUPPORTED:
                raise
            why = str(e)  # no nvcc here: Triton serves the call
    if why is not None and backend == "cuda":
        raise KvxError(Status.UNSUPPORTED, f"CUDA decode cannot serve this call: {why}")
    return "triton" if why is not None else "cuda"


def paged_decode(q, k_data, k_scales, v_data, v_scales, k_gs, v_gs, block_table, seq_lens, fmt,
                 sm_scale: float | None = None, softcap: float | None = None, window: int | None = None,
                 num_splits: int | None = None, max_seq_len: int | None = None, out=None, lse=None,
                 block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                 backend: str | None = None):
    """Decode attention: `q [B, Hq, D]` over the paged quantized cache -> (`out [B, Hq, D]` q.dtype, `lse [B, Hq]` fp32).

    `lse` is the natural-log sum-exp of the (scaled, soft-capped) scores; `-inf` and a zero output
    for an empty sequence. `window` = FlashInfer's `window_left`: keys at positions
    `>= seq_len - 1 - window` are attended. Rotated formats take unrotated q and return unrotated out.
    `backend`: "auto" (default, or `$KVX_DECODE_BACKEND`) runs the CUDA kernel (`ops/cuda`: 4-bit, INT8, FP8) where
    it serves the call and Triton elsewhere; "cuda" requires the CUDA kernel; "triton" forces Triton.
    `block_n`, `num_warps`, `num_stages` tune the Triton kernel (defaults: `ops/triton/decode.py`).
    """
    fmt = as_format(fmt)
    check_device(q, k_data, v_data, block_table, seq_lens)
    if q.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or q.stride(2) != 1:
        raise KvxError(Status.INVALID_ARGUMENT, f"q must be [B, Hq, D] float with a contiguous last dim, got {q.dtype} {tuple(q.shape)}")
    bsz, hq, d = q.shape
    kk, kv = kernel_format(fmt.k), kernel_format(fmt.v)
    fmt.check_head_dim(d)
    if d & (d - 1) or d < 32:
        raise KvxError(Status.UNSUPPORTED, f"paged_decode supports power-of-two head_dim >= 32, got {d}")
    check_pool("K", k_data, kk, d)
    check_pool("V", v_data, kv, d)
    nb, hkv, bs, _ = k_data.shape
    if tuple(v_data.shape[:3]) != (nb, hkv, bs):
        raise KvxError(Status.INVALID_ARGUMENT, "K and V pools must share [num_blocks, H_kv, block_size]")
    if hq % hkv:
        raise KvxError(Status.INVALID_ARGUMENT, f"Hq={hq} must be a multiple of H_kv={hkv}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != bsz or block_table.stride(1) != 1:
        raise KvxError(Status.INVALID_ARGUMENT, "block_table must be int32 [B, max_blocks] with a contiguous last dim")
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (bsz,):
        raise KvxError(Status.INVALID_ARGUMENT, "seq_lens must be int32 [B]")
    ks = scale_args("K", k_scales, k_data, kk, fmt.k, d)
    vs = scale_args("V", v_scales, v_data, kv, fmt.v, d)
    kg, vg = global_scale_arg(k_gs, kk, hkv, q.device), global_scale_arg(v_gs, kv, hkv, q.device)
    if block_n is None:
        block_n = triton_decode.default_block_n(kk, kv, d)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if bsz else 0
    max_seq_len = check_max_seq_len(max_seq_len)  # it sizes the splits only: each split reads its own seq_len
    if window is not None and window >= 0:
        max_seq_len = min(max_seq_len, window + 1)
    chosen = choose_backend(backend, q, fmt, k_data, ks[0], v_data, vs[0], num_warps)
    if num_splits is None:
        num_splits = choose_splits(chosen, bsz, hkv, max_seq_len, block_n, q.device)
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    if out is None:
        out = torch.empty_like(q)
    if lse is None:
        lse = torch.empty(bsz, hq, dtype=torch.float32, device=q.device)
    if bsz == 0:
        return out, lse
    mid_o = torch.empty(bsz, hq, num_splits, d, dtype=torch.float32, device=q.device)
    mid_l = torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=q.device)
    if chosen == "cuda":
        cuda_decode.launch(q, k_data, ks[0], v_data, vs[0], kg, vg, block_table, seq_lens, fmt, mid_o, mid_l, sm_scale,
                           softcap, window)
    else:
        triton_decode.launch_decode(q, k_data, ks, v_data, vs, kg, vg, block_table, seq_lens, fmt, mid_o, mid_l,
                                    sm_scale, softcap, window, block_n, num_warps, num_stages)
    merge_splits(mid_o, mid_l, out, lse, fmt.rotate)
    return out, lse
