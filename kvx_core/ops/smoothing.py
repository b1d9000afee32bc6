"""Static per-channel key smoothing (a cache's `QuantDesc.k_smoothing`, FP32 `[num_kv_heads, head_dim]`).

Keys have a few channels with large magnitudes in every token; a 4-bit group or an FP8 head scale sized for them
leaves the other channels few levels. A smoothed cache stores `K / s` (rounded to K's dtype, then encoded in the
cache's format), readers multiply decoded keys by `s`, and the attention kernels take queries times `s`:
`(q * s) . (k / s) = q . k`, so attention is unchanged up to rounding while the quantizer sees flatter channels.
Composable with the Hadamard formats (the rotation applies to the smoothed keys). Every KVX path applies it here:
the reference write / gather, the kernel write / gather / decode / prefill through `ops.dispatch`. Calibration:
`kvx_core.calibration.key_smoothing`.
"""
from __future__ import annotations

import torch

from ..descriptors import CacheDesc


def of(cache: CacheDesc) -> torch.Tensor | None:
    """The cache's smoothing vector `[H, D]`, or None."""
    return None if cache.quant is None else cache.quant.k_smoothing


def smooth_keys(cache: CacheDesc, key: torch.Tensor) -> torch.Tensor:
    """Keys `[T, H, D]` as the cache stores them: `K / s` in K's dtype (K itself without smoothing)."""
    s = of(cache)
    return key if s is None else (key.float() / s.to(key.device)).to(key.dtype)


def unsmooth_keys(cache: CacheDesc, key: torch.Tensor) -> torch.Tensor:
    """Decoded keys `[T, H, D]` (FP32 for exactness) times `s`."""
    s = of(cache)
    return key if s is None else key * s.to(key.device)


def smooth_queries(cache: CacheDesc, query: torch.Tensor) -> torch.Tensor:
    """Queries `[T, Hq, D]` times their KV head's `s`, for kernels that read the stored `K / s` (the CUDA decode
    does this itself as it loads the queries: `ops.decode.DecodePlan.run(k_smoothing=)`)."""
    s = of(cache)
    return query if s is None else scale_queries(query, s)


def scale_queries(query: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """`query [T, Hq, D]` times `s [Hkv, D]` (GQA: query head h reads KV head h // (Hq / Hkv)) in FP32, rounded
    to the queries' dtype."""
    sq = s.to(query.device).repeat_interleave(query.shape[1] // s.shape[0], dim=0)
    return (query.float() * sq).to(query.dtype)
