"""Independent oracles for the paged-cache tests: float64 textbook attention (GQA, causal positions,
sliding window, softcap), a float64 Sylvester Hadamard matrix, per-token dequantization straight from
a `PagedKVCache`'s pools (format decode only; no gather, no block-table code), and byte snapshots of
every pool storage. Nothing here calls kvx_core.ops or kvx_core.block_tables.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from kvx_core.cache import PagedKVCache


def hadamard_f64(d: int) -> np.ndarray:
    """Orthonormal Sylvester Hadamard matrix of order d (a power of two), float64."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(d)


def attention_f64(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: list[int], *, sm_scale: float,
                  softcap: float | None = None, window: int | None = None, causal: bool = True,
                  sinks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """q [Tq, Hq, D] at positions q_pos; k, v [L, Hkv, D] at positions 0..L-1.
    Query head h reads KV head h // (Hq / Hkv). `window` is FlashInfer's window_left: the query at p
    sees keys p - window .. p (None: all). Scores are scaled, then soft-capped `c * tanh(s / c)`.
    `sinks [Hq]`: head h's denominator gains exp(sinks[h]) (a logit with no value, neither scaled nor capped).
    Returns (out [Tq, Hq, D], lse [Tq, Hq]) in float64, lse the log of the whole denominator; a query with no
    visible key gives 0 and -inf (its sink with sinks)."""
    tq, hq, d = q.shape
    length, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    out = np.zeros((tq, hq, d))
    lse = np.full((tq, hq), -np.inf)
    for t in range(tq):
        visible = [j for j in range(length)
                   if (not causal or j <= q_pos[t]) and (window is None or q_pos[t] - j <= window)]
        for h in range(hq):
            kh = h // group
            s = np.array([float(np.dot(q[t, h], k[j, kh])) * sm_scale for j in visible])
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            sink = -np.inf if sinks is None else float(sinks[h])
            m = max(s.max(initial=-np.inf), sink)
            if m == -np.inf:
                continue
            w = np.exp(s - m)
            denom = w.sum() + math.exp(sink - m)
            lse[t, h] = m + math.log(denom)
            out[t, h] = (w / denom) @ v[visible, kh] if visible else 0.0
    return out, lse


def dequant_sequence(cache: PagedKVCache, layer: int, blocks: list[int], n: int,
                     k_global: torch.Tensor | None, v_global: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray]:
    """Model-domain float64 K, V `[n, H, D]` of a sequence whose tokens 0..n-1 live in `blocks`
    (token p at block blocks[p // block_size], offset p % block_size), decoded row by row from the
    HND pools with the format's own decode and un-rotated with `hadamard_f64`."""
    fmt, p, bs = cache.format, cache.layers[layer], cache.block_size
    blk = [blocks[i // bs] for i in range(n)]
    off = [i % bs for i in range(n)]
    out = []
    for tf, data, scales, g in ((fmt.k, p.k_data, p.k_scales, k_global), (fmt.v, p.v_data, p.v_scales, v_global)):
        payload = data[blk, :, off]  # [n, H, X]
        sc = scales[blk, :, off] if scales is not None else \
            torch.empty(n, cache.num_kv_heads, 0, dtype=torch.uint8)
        x = tf.decode(payload, sc, g).double().numpy()
        if fmt.rotate:
            x = x @ hadamard_f64(cache.head_dim)  # H is symmetric and its own inverse
        out.append(x)
    return out[0], out[1]


def storages(cache: PagedKVCache) -> dict[int, torch.Tensor]:
    """Every distinct storage behind the cache's pools, as a flat uint8 tensor, keyed by base pointer."""
    out = {}
    for p in cache.layers:
        for t in (p.k_data, p.v_data, p.k_scales, p.v_scales):
            if t is not None:
                st = t.untyped_storage()
                out.setdefault(st.data_ptr(), torch.empty(0, dtype=torch.uint8).set_(st))
    return out


def same_view(t: torch.Tensor, flat_bytes: torch.Tensor) -> torch.Tensor:
    """The view `t` has of its storage, laid over another byte buffer of the same size (a snapshot)."""
    return torch.empty(0, dtype=t.dtype).set_(flat_bytes.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a pool (last dim contiguous), for bit-exact comparisons of any payload dtype."""
    return t.view(torch.uint8)
