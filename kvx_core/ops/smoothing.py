"""Static per-channel key transform of a cache: centering (`QuantDesc.k_center`, c) and smoothing
(`QuantDesc.k_smoothing`, s), FP32 `[num_kv_heads, head_dim]` each, either or both.

Keys have a few channels that are large in every token: mostly a constant offset (the slowest RoPE pairs barely
turn over a context) with some spread. A cache with the transform stores `(K - c) / s` (rounded to K's dtype, then
encoded in the cache's format), so a 4-bit group or an FP8 element spends its levels on what varies, not on the
offset and not on the widest channel. Readers of keys (the reference and kernel gathers) return `K' * s + c`.
Attention needs no centering at all: `(q * s) . ((k - c) / s) = q . k - q . c`, and `q . c` is the same for every
key of a query, so the softmax over the keys is unchanged; only the log-sum-exp moves by `sm_scale * q . c`, which
`center_lse` adds back for the kernels (the reference attention reads keys through the gather and needs nothing).
Not with a logit soft cap (tanh is not shift invariant): refused there. The decode kernels multiply queries by `s`
as they load them; rotated formats and the prefill scale the queries in torch first, before the rotation. Every KVX
path applies it here: the reference write / gather, the kernel write / gather / decode / prefill through
`ops.dispatch`. Calibration: `kvx_core.calibration.key_center` / `key_smoothing`.
"""
from __future__ import annotations

import torch

from ..descriptors import CacheDesc


def of(cache: CacheDesc) -> torch.Tensor | None:
    """The cache's smoothing vector `s [H, D]`, or None."""
    return None if cache.quant is None else cache.quant.k_smoothing


def center_of(cache: CacheDesc) -> torch.Tensor | None:
    """The cache's centering vector `c [H, D]`, or None."""
    return None if cache.quant is None else cache.quant.k_center


def transforms_keys(cache: CacheDesc) -> bool:
    """Whether the cache stores keys other than as they are (centered and / or smoothed)."""
    return of(cache) is not None or center_of(cache) is not None


def smooth_keys(cache: CacheDesc, key: torch.Tensor) -> torch.Tensor:
    """Keys `[T, H, D]` as the cache stores them: `(K - c) / s` in FP32, rounded to K's dtype (K itself without a
    transform)."""
    s, c = of(cache), center_of(cache)
    if s is None and c is None:
        return key
    x = key.float()
    if c is not None:
        x = x - c.to(key.device)
    if s is not None:
        x = x / s.to(key.device)
    return x.to(key.dtype)


def unsmooth_keys(cache: CacheDesc, key: torch.Tensor) -> torch.Tensor:
    """Decoded keys `[T, H, D]` (FP32 for exactness) times `s`, plus `c`."""
    return untransform_keys(key, of(cache), center_of(cache))


def untransform_keys(key: torch.Tensor, s: torch.Tensor | None, c: torch.Tensor | None) -> torch.Tensor:
    """`key * s + c` (either optional): what `unsmooth_keys` computes, for vectors that travel without their cache
    (a KV bundle's rows), so both give the same bits."""
    if s is not None:
        key = key * s.to(key.device)
    if c is not None:
        key = key + c.to(key.device)
    return key


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


def center_lse(cache: CacheDesc, query: torch.Tensor, lse: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Add `sm_scale * q . c` (FP32, per query row and head) in place to the natural-log `lse [T, Hq]` of attention
    over a centered cache's stored keys, which the kernels computed from `q . (k - c)`; a no-op without centering.
    `query [T, Hq, D]` as the caller passed it (before any smoothing of its own)."""
    c = center_of(cache)
    if c is not None:  # one FP32 product per (row, KV head, query head of the group): q . c
        t, hq, d = query.shape
        qc = torch.einsum("thgd,hd->thg", query.reshape(t, c.shape[0], hq // c.shape[0], d).float(), c.to(query.device))
        lse.add_(qc.reshape(t, hq), alpha=sm_scale)
    return lse
