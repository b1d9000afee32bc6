"""Triton kernels for KVX paged caches: launchers (torch tensors in, torch tensors out).

- `paged_decode`  split-KV decode attention reading the quantized pools directly (decode.py)
- `write_kv`      fused quantize + scatter of new K/V tokens by slot mapping (write.py)
- `gather_kv`     dequantize through the block table into dense ragged K/V (gather.py)
- `paged_prefill` causal prefill/extend attention over the quantized pools (prefill.py)
Pools follow the storage contract: data `[num_blocks, H_kv, block_size, Dk]` (HND, any strides,
last dim contiguous), scales `uint8 [num_blocks, H_kv, block_size, Sk]`, global scales fp32 `[H_kv]`,
block table int32 `[B, max_blocks]`, seq_lens int32 `[B]`, slot mapping int64 `[T]` (< 0 = skip).
On CPU the kernels run under `TRITON_INTERPRET=1` (set before triton is imported).
"""
from __future__ import annotations

import math
import os

import torch

from ...errors import KvxError, Status
from ...formats import CacheFormat, FP8Format, get_format
from ..checks import check_max_seq_len
from .spec import KernelFormat, kernel_format

__all__ = ["paged_decode", "paged_prefill", "prefill_plan", "write_kv", "gather_kv", "decode_num_splits", "interpreting"]


REDUCE_COLS = 32
"""Output columns per split-merge program (unrotated formats): B=1 decode spreads its merge over D/32 x Hq
programs (the whole-row merge took ~10 us of a 36 us B=1 32k NVFP4 decode on an H200)."""


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if interpreting():
    from ._interp import install as _install_interp_shim
    _install_interp_shim()


def _fmt(fmt: CacheFormat | str) -> CacheFormat:
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    if not isinstance(fmt, CacheFormat):
        raise KvxError(Status.INVALID_ARGUMENT, f"fmt must be a cache format or its name, got {type(fmt).__name__}")
    return fmt


def _pool_geometry(k_data, v_data) -> tuple[int, int, int]:
    """(num_blocks, H_kv, block_size) shared by the K and V pools (4-D tensors)."""
    for name, t in (("K", k_data), ("V", v_data)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise KvxError(Status.INVALID_ARGUMENT, f"{name} pool must be a [num_blocks, H_kv, block_size, Dk] tensor, "
                           f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if tuple(v_data.shape[:3]) != tuple(k_data.shape[:3]):
        raise KvxError(Status.INVALID_ARGUMENT, "K and V pools must share [num_blocks, H_kv, block_size]")
    return tuple(int(n) for n in k_data.shape[:3])


def _check_device(*tensors: torch.Tensor) -> None:
    """Arguments are torch tensors (None for absent ones) on one device the kernels can run on."""
    for t in tensors:
        if t is not None and not isinstance(t, torch.Tensor):
            raise KvxError(Status.INVALID_ARGUMENT, f"the kernels take torch tensors, got a {type(t).__name__}")
    dev = tensors[0].device
    if dev.type != "cuda" and not interpreting():
        raise KvxError(Status.UNSUPPORTED, "Triton KVX kernels need CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    for t in tensors:
        if t is not None and t.device != dev:
            raise KvxError(Status.INVALID_ARGUMENT, f"all tensors must be on {dev}, got one on {t.device}")


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _check_pool(name: str, data: torch.Tensor, kf: KernelFormat, head_dim: int) -> None:
    if data.dim() != 4:
        raise KvxError(Status.INVALID_ARGUMENT, f"{name} pool must be [num_blocks, H_kv, block_size, Dk], got {tuple(data.shape)}")
    if data.dtype != kf.storage:
        raise KvxError(Status.INVALID_ARGUMENT, f"{name} pool dtype must be {kf.storage}, got {data.dtype}")
    dk = head_dim // 2 if kf.packed else head_dim
    if data.shape[3] != dk or data.stride(3) != 1:
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"{name} pool last dim must be {dk} and contiguous, got {data.shape[3]} (stride {data.stride(3)})")


def _scale_args(name, scales, data, kf: KernelFormat, tf, head_dim):
    if not kf.has_scales:
        return (data, 0, 0, 0)
    want = tf.scale_dim(head_dim)
    if scales is None or scales.dim() != 4 or scales.dtype != torch.uint8 or scales.shape[3] != want \
            or tuple(scales.shape[:3]) != tuple(data.shape[:3]) or scales.stride(3) != 1:
        raise KvxError(Status.INVALID_ARGUMENT,
                       f"{name} scale pool must be uint8 {tuple(data.shape[:3]) + (want,)} with a contiguous last dim, "
                       f"got {None if scales is None else (scales.dtype, tuple(scales.shape))}")
    return (scales, scales.stride(0), scales.stride(1), scales.stride(2))


def _gs(gs, kf: KernelFormat, hkv: int, device) -> torch.Tensor:
    if not kf.global_scale:
        return torch.ones(1, dtype=torch.float32, device=device)
    if gs is None:
        return torch.ones(hkv, dtype=torch.float32, device=device)
    if not isinstance(gs, torch.Tensor):
        return torch.full((hkv,), float(gs), dtype=torch.float32, device=device)
    g = gs.to(device=device, dtype=torch.float32).reshape(-1)
    if g.numel() == 1:
        g = g.expand(hkv)
    if g.numel() != hkv:
        raise KvxError(Status.INVALID_ARGUMENT, f"global scale must be [] or [H_kv={hkv}], got {tuple(gs.shape)}")
    return g.contiguous()


def decode_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, device) -> int:
    """Splits per (sequence, KV head): ~4 programs per SM, but at least 1024 tokens per split.

    Run 3 (H200): B=64 32k nvfp4 2 splits beat 1 by 12%; B=1 32k 32 splits beat 16 by 1.4x and 64 by 1.1x.
    `block_n` is kept for the signature; the token floor covers it (1024 >= 4 * block_n).
    """
    target = 4 * _sm_count(device)
    base = max(1, batch * num_kv_heads)
    by_len = max(1, math.ceil(max_seq_len / max(1024, 4 * block_n)))
    return int(max(1, min(math.ceil(target / base), by_len, 256)))


def _default_block_n(kk: KernelFormat, kv: KernelFormat, head_dim: int) -> int:
    if kk.storage == torch.float32 or kv.storage == torch.float32:
        return 16
    if kk.storage in (torch.bfloat16, torch.float16) or kv.storage in (torch.bfloat16, torch.float16):
        return 64 if head_dim <= 128 else 32
    if kk.packed and kv.packed:
        return 64  # run 3 (H200, B=64 32k): 64 beat 128 by 9-10% on int4 and nvfp4
    return 128 if head_dim <= 128 else 64  # 8-bit payloads (run-2 sweep winners on H200)


def paged_decode(q, k_data, k_scales, v_data, v_scales, k_gs, v_gs, block_table, seq_lens, fmt,
                 sm_scale: float | None = None, softcap: float | None = None, window: int | None = None,
                 num_splits: int | None = None, max_seq_len: int | None = None, out=None, lse=None,
                 block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                 backend: str | None = None):
    """Decode attention: `q [B, Hq, D]` over the paged quantized cache -> (`out [B, Hq, D]` q.dtype, `lse [B, Hq]` fp32).

    `lse` is the natural-log sum-exp of the (scaled, soft-capped) scores; `-inf` and a zero output
    for an empty sequence. `window` = FlashInfer's `window_left`: keys at positions
    `>= seq_len - 1 - window` are attended. Rotated formats take unrotated q and return unrotated out.
    `backend`: "auto" (default, or `$KVX_DECODE_BACKEND`) runs the CUDA kernel (`ops/cuda`: 4-bit, FP8) where it
    serves the call and Triton elsewhere; "cuda" requires the CUDA kernel; "triton" forces Triton.
    """
    fmt = _fmt(fmt)
    _check_device(q, k_data, v_data, block_table, seq_lens)
    if q.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or q.stride(2) != 1:
        raise KvxError(Status.INVALID_ARGUMENT, f"q must be [B, Hq, D] float with a contiguous last dim, got {q.dtype} {tuple(q.shape)}")
    bsz, hq, d = q.shape
    kk, kv = kernel_format(fmt.k), kernel_format(fmt.v)
    fmt.check_head_dim(d)
    if d & (d - 1) or d < 32:
        raise KvxError(Status.UNSUPPORTED, f"paged_decode supports power-of-two head_dim >= 32, got {d}")
    _check_pool("K", k_data, kk, d)
    _check_pool("V", v_data, kv, d)
    nb, hkv, bs, _ = k_data.shape
    if tuple(v_data.shape[:3]) != (nb, hkv, bs):
        raise KvxError(Status.INVALID_ARGUMENT, "K and V pools must share [num_blocks, H_kv, block_size]")
    if hq % hkv:
        raise KvxError(Status.INVALID_ARGUMENT, f"Hq={hq} must be a multiple of H_kv={hkv}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != bsz or block_table.stride(1) != 1:
        raise KvxError(Status.INVALID_ARGUMENT, "block_table must be int32 [B, max_blocks] with a contiguous last dim")
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (bsz,):
        raise KvxError(Status.INVALID_ARGUMENT, "seq_lens must be int32 [B]")
    ks = _scale_args("K", k_scales, k_data, kk, fmt.k, d)
    vs = _scale_args("V", v_scales, v_data, kv, fmt.v, d)
    kg, vg = _gs(k_gs, kk, hkv, q.device), _gs(v_gs, kv, hkv, q.device)
    if block_n is None:
        block_n = _default_block_n(kk, kv, d)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if bsz else 0
    max_seq_len = check_max_seq_len(max_seq_len)  # it sizes the splits only: each split reads its own seq_len
    if window is not None and window >= 0:
        max_seq_len = min(max_seq_len, window + 1)
    use_cuda = _use_cuda_decode(backend, q, fmt, k_data, ks[0], v_data, vs[0], num_warps)
    if num_splits is None:
        if use_cuda:
            from ..cuda.decode import num_splits as cuda_splits
            num_splits = cuda_splits(bsz, hkv, max_seq_len, _sm_count(q.device))
        else:
            num_splits = decode_num_splits(bsz, hkv, max_seq_len, block_n, q.device)
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    if out is None:
        out = torch.empty_like(q)
    if lse is None:
        lse = torch.empty(bsz, hq, dtype=torch.float32, device=q.device)
    if bsz == 0:
        return out, lse
    mid_o = torch.empty(bsz, hq, num_splits, d, dtype=torch.float32, device=q.device)
    mid_l = torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=q.device)
    from .decode import _reduce_kernel
    if use_cuda:
        from ..cuda.decode import launch as cuda_launch
        cuda_launch(q, k_data, ks[0], v_data, vs[0], kg, vg, block_table, seq_lens, fmt, mid_o, mid_l, sm_scale,
                    softcap, window)
    else:
        _triton_decode(q, k_data, ks, v_data, vs, kg, vg, block_table, seq_lens, fmt, mid_o, mid_l, sm_scale,
                       softcap, window, block_n, num_warps, num_stages)
    db = d if fmt.rotate else min(d, REDUCE_COLS)
    _reduce_kernel[(bsz, hq, d // db)](
        mid_o, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_l, mid_l.stride(0), mid_l.stride(1),
        out, out.stride(0), out.stride(1),
        lse, lse.stride(0), lse.stride(1),
        num_splits,
        D=d, DB=db, SB=min(64 if db < d else 32, triton_next_pow2(num_splits)), ROTATE=fmt.rotate,
        RSD=1.0 / math.sqrt(d),
        num_warps=4,
    )
    return out, lse


def _use_cuda_decode(backend, q, fmt: CacheFormat, k_data, k_scales, v_data, v_scales, num_warps) -> bool:
    """Whether paged_decode runs the CUDA kernel (see its `backend` argument)."""
    backend = backend or os.environ.get("KVX_DECODE_BACKEND", "auto")
    if backend not in ("auto", "cuda", "triton"):
        raise KvxError(Status.INVALID_ARGUMENT, f"decode backend must be auto, cuda or triton, got {backend!r}")
    if backend == "triton" or (backend == "auto" and (interpreting() or q.device.type != "cuda")):
        return False
    from ..cuda.decode import WARPS, supports
    why = supports(q, fmt, k_data, k_scales, v_data, v_scales)
    if why is None and backend == "auto" and isinstance(fmt.k, FP8Format) \
            and q.shape[0] * k_data.shape[1] < _sm_count(q.device) // 8:
        # FP8 with very few (sequence, KV head) pairs: Triton measured faster (runs 11-12, H200, B=1 32k:
        # 44 us vs 50 us); from B=16 (8k) the CUDA kernel is faster (0.106 vs 0.141 ms; B=64: 1.6x).
        why = "tiny-batch FP8 decode runs faster in Triton"
    if why is None and num_warps not in (None, WARPS):
        why = f"num_warps={num_warps}: the CUDA decode runs {WARPS} warps per CTA"
    if why is None and backend == "auto":
        try:
            from ..cuda import library
            library(q.device)
        except KvxError as e:
            if e.status != Status.UNSUPPORTED:
                raise
            why = str(e)  # no nvcc here: Triton serves the call
    if why is not None and backend == "cuda":
        raise KvxError(Status.UNSUPPORTED, f"CUDA decode cannot serve this call: {why}")
    return why is None


def _triton_decode(q, k_data, ks, v_data, vs, kg, vg, block_table, seq_lens, fmt, mid_o, mid_l, sm_scale,
                   softcap, window, block_n, num_warps, num_stages) -> None:
    """The Triton split-KV decode kernel: per-split partials into mid_o / mid_l."""
    from .decode import _decode_kernel
    bsz, hq, d = q.shape
    _, hkv, bs, _ = k_data.shape
    kk, kv = kernel_format(fmt.k), kernel_format(fmt.v)
    qh = hq // hkv
    bm = max(16, triton_next_pow2(qh))
    num_splits = mid_o.shape[2]
    kdt, vdt = kk.dot_dtype(q.dtype), kv.dot_dtype(q.dtype)
    rsd = 1.0 / math.sqrt(d)
    if num_warps is None:
        num_warps = 4  # run-2 sweep: 8 warps lost 0-45% on every format
    if num_stages is None:
        num_stages = 2 if (kk.packed or kv.packed) else 3
    _decode_kernel[(bsz, hkv, num_splits)](
        q, q.stride(0), q.stride(1),
        _u8(k_data), k_data.stride(0), k_data.stride(1), k_data.stride(2),
        ks[0], ks[1], ks[2], ks[3],
        _u8(v_data), v_data.stride(0), v_data.stride(1), v_data.stride(2),
        vs[0], vs[1], vs[2], vs[3],
        kg, vg,
        block_table, block_table.stride(0), seq_lens,
        mid_o, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_l, mid_l.stride(0), mid_l.stride(1),
        sm_scale, float(softcap) if softcap else 1.0, int(window) if window is not None and window >= 0 else 0,
        BS=bs, QH=qh, BM=bm, D=d, BLOCK_N=block_n,
        KF=kk.code, VF=kv.code, KGRP=kk.group or 16, VGRP=kv.group or 16,
        KDT=kdt, VDT=vdt, KIEEE=kk.storage == torch.float32, VIEEE=kv.storage == torch.float32,
        KGS=kk.global_scale, VGS=kv.global_scale, K8=_f8(k_data.dtype), V8=_f8(v_data.dtype),
        ROTATE=fmt.rotate, SOFTCAP=bool(softcap), WINDOW=window is not None and window >= 0, RSD=rsd,
        ASM=not interpreting(), num_warps=num_warps, num_stages=num_stages,
    )


def _f8(dt: torch.dtype):
    """Bitcast target of an FP8 pool (the kernels load FP8 payload as bytes)."""
    import triton.language as tl
    return tl.float8e5 if dt == torch.float8_e5m2 else tl.float8e4nv


def _u8(t: torch.Tensor) -> torch.Tensor:
    """FP8 pools are passed as uint8 views (same strides)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# Kernel + launcher modules (they use the validation helpers above, so they are imported last).
from .gather import gather_kv  # noqa: E402
from .prefill import paged_prefill, prefill_plan  # noqa: E402
from .write import write_kv  # noqa: E402
