"""Page geometry: one vLLM page per (layer, block) holds KVX's dual pools as regions of one buffer.

vLLM 0.32 hands each layer a `[num_blocks, H, N, C]` view (H head slots, N tokens, C bytes) of its
KV buffer, shaped by the backend's `customize_spec`. KVX publishes one head slot of
`C = num_kv_heads * bytes_per_token_head` bytes per token, so a block is one contiguous page of
`block_size * C` bytes whatever layout vLLM resolves, laid out as `kvx_core.cache` lays out a page:
K data | V data | K scales | V scales (the data and scale pools share the block id).
"""
from __future__ import annotations

import torch

from kvx_core.cache import page_bytes, page_regions
from kvx_core.codec import quant_desc
from kvx_core.descriptors import CacheDesc
from kvx_core.enums import Layout
from kvx_core.formats import CacheFormat

PAGE_BLOCK_ALIGN = 16
"""Block sizes must be multiples of 16 tokens so every region is 16-byte aligned with no padding
(then a page is exactly `block_size * C` bytes and vLLM may size blocks per token)."""


def token_bytes(fmt: CacheFormat, num_kv_heads: int, head_dim: int) -> int:
    """Bytes one token of one layer occupies in a page (K and V payload plus scales, all heads)."""
    b = fmt.bytes_per_token_head(head_dim) * num_kv_heads
    if b != int(b):
        raise ValueError(f"KVX {fmt.name}: {b} bytes per token is not whole; head_dim {head_dim} is unsupported")
    return int(b)


def check_page(fmt: CacheFormat, block_size: int, num_kv_heads: int, head_dim: int) -> None:
    """Raise ValueError unless a page of `block_size` tokens is exactly `block_size * token_bytes`."""
    want = block_size * token_bytes(fmt, num_kv_heads, head_dim)
    got = page_bytes(fmt, block_size, num_kv_heads, head_dim)
    if block_size % PAGE_BLOCK_ALIGN or got != want:
        raise ValueError(f"KVX {fmt.name}: --block-size {block_size} must be a multiple of {PAGE_BLOCK_ALIGN} "
                         f"(page {got} bytes vs {want} published to vLLM)")


def page_cache_desc(kv_cache: torch.Tensor, fmt: CacheFormat, num_kv_heads: int, head_dim: int,
                    k_global: torch.Tensor | None, v_global: torch.Tensor | None,
                    k_smoothing: torch.Tensor | None = None, k_center: torch.Tensor | None = None) -> CacheDesc:
    """KVX descriptor over a layer's vLLM cache `[num_blocks, 1, block_size, C]` bytes (zero-copy); `k_smoothing`,
    `k_center`: the layer's FP32 `[num_kv_heads, head_dim]` key smoothing and centering (`ops.smoothing`: the pages
    hold `(K - c) / s`), which every KVX path then applies."""
    n, slots, block_size, c = kv_cache.shape
    if slots != 1 or kv_cache.dtype != torch.uint8 or kv_cache.stride(2) != c or kv_cache.stride(3) != 1:
        raise ValueError(f"KVX: expected a uint8 [num_blocks, 1, block_size, C] page view with contiguous pages, "
                         f"got {kv_cache.dtype} {tuple(kv_cache.shape)} strides {tuple(kv_cache.stride())}")
    check_page(fmt, block_size, num_kv_heads, head_dim)
    pages = kv_cache.as_strided((n, block_size * c), (kv_cache.stride(0), 1))
    views: list[torch.Tensor | None] = []
    for (off, size), tf, scales in zip(page_regions(fmt, block_size, num_kv_heads, head_dim),
                                       (fmt.k, fmt.v, fmt.k, fmt.v), (False, False, True, True), strict=True):
        if size == 0:
            views.append(None)
            continue
        dtype = torch.uint8 if scales else tf.torch_data_dtype
        x = tf.scale_dim(head_dim) if scales else tf.payload_dim(head_dim)
        views.append(pages[:, off:off + size].view(dtype).view(n, num_kv_heads, block_size, x))
    kd, vd, ks, vs = views
    q = quant_desc(fmt, head_dim, ks, vs, k_global, v_global)
    if q is not None:
        q.k_smoothing, q.k_center = k_smoothing, k_center
    return CacheDesc.from_torch(kd, vd, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                k_layout=Layout.HND, v_layout=Layout.HND, quant=q)
