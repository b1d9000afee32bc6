"""Dual-pool paged KV cache: per layer a data pool and a scale pool that share block ids.

Pools are HND (`[num_blocks, H, block_size, X]`): payload `X = format.payload_dim(D)` elements,
scales `X = format.scale_dim(D)` bytes. They are either separate allocations or, with
`page_buffer=True`, regions of one byte buffer per layer (each block one page holding
K data | V data | K scales | V scales, as vLLM lays out a page): both are strided views and are
described identically by `descriptor(layer)`. One `BlockAllocator` hands out ids for both pools.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .allocator import BlockAllocator
from .codec import quant_desc
from .descriptors import BlockTable, CacheDesc, GatherDesc, KvIoDesc, SeqLens, SlotMapping, WriteDesc
from .enums import Layout
from .errors import Status, require
from .formats import CacheFormat, TensorFormat, get_format
from .ops import dispatch as reference

_PAGE_ALIGN = 16  # bytes; every region of a page starts 16-byte aligned for vectorized kernels


@dataclass
class LayerPools:
    """One layer's pools (scale pools are None for formats without scales) and FP32 global scales."""

    k_data: torch.Tensor
    v_data: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None
    k_global: torch.Tensor | None
    v_global: torch.Tensor | None


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def bytes_per_token(fmt: CacheFormat, num_kv_heads: int, head_dim: int, num_layers: int = 1) -> float:
    """K+V bytes (payload and scales) one token occupies across `num_layers` layers."""
    return fmt.bytes_per_token_head(head_dim) * num_kv_heads * num_layers


def capacity_ratio_vs_bf16(fmt: CacheFormat, head_dim: int) -> float:
    """How many more tokens than a BF16 cache the same bytes hold (e.g. 3.56 for NVFP4)."""
    return get_format("bf16").bytes_per_token_head(head_dim) / fmt.bytes_per_token_head(head_dim)


def page_regions(fmt: CacheFormat, block_size: int, num_kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """(offset, bytes) of K data, V data, K scales, V scales inside one page."""
    sizes = []
    for tf in (fmt.k, fmt.v):
        sizes.append(num_kv_heads * block_size * tf.payload_dim(head_dim) * tf.torch_data_dtype.itemsize)
    for tf in (fmt.k, fmt.v):
        sizes.append(num_kv_heads * block_size * tf.scale_dim(head_dim))
    out, off = [], 0
    for n in sizes:
        out.append((off, n))
        off = _round_up(off + n, _PAGE_ALIGN)
    return out


def page_bytes(fmt: CacheFormat, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one block (page) of one layer, K and V with their scales, regions 16-byte aligned."""
    off, n = page_regions(fmt, block_size, num_kv_heads, head_dim)[-1]
    return _round_up(off + n, _PAGE_ALIGN)


def blocks_for_budget(fmt: CacheFormat, budget_bytes: int, *, num_layers: int, block_size: int,
                      num_kv_heads: int, head_dim: int) -> int:
    """Blocks (per layer) that fit a byte budget covering all layers."""
    require(num_layers > 0 and budget_bytes >= 0, Status.INVALID_ARGUMENT,
            f"need num_layers > 0 and a non-negative budget, got {num_layers} and {budget_bytes}")
    return budget_bytes // (page_bytes(fmt, block_size, num_kv_heads, head_dim) * num_layers)


class PagedKVCache:
    """A multi-layer paged KV cache in one KVX format, with its block allocator."""

    def __init__(self, fmt: str | CacheFormat, *, num_layers: int, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, device: str | torch.device = "cpu",
                 page_buffer: bool = False, global_scales: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 per_head_global_scale: bool = False) -> None:
        self.format = get_format(fmt) if isinstance(fmt, str) else fmt
        self.format.check_head_dim(head_dim)
        require(num_layers > 0 and block_size > 0 and num_kv_heads > 0, Status.INVALID_ARGUMENT,
                "num_layers, block_size and num_kv_heads must be > 0")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.device = torch.device(device)
        self.allocator = BlockAllocator(num_blocks)
        g_shape = (num_kv_heads,) if per_head_global_scale else (1,)
        self.layers = [self._allocate_layer(page_buffer, g_shape) for _ in range(num_layers)]
        if global_scales is not None:
            require(len(global_scales) == num_layers, Status.INVALID_ARGUMENT,
                    f"global_scales must have one (k, v) pair per layer ({num_layers}), got {len(global_scales)}")
            for layer, (k, v) in enumerate(global_scales):
                self.set_global_scales(layer, k, v)

    # ------------------------------------------------------------ allocation
    def _pool(self, tf: TensorFormat, scales: bool) -> torch.Tensor | None:
        x = tf.scale_dim(self.head_dim) if scales else tf.payload_dim(self.head_dim)
        if scales and x == 0:
            return None
        dtype = torch.uint8 if scales else tf.torch_data_dtype
        return torch.zeros(self.num_blocks, self.num_kv_heads, self.block_size, x, dtype=dtype, device=self.device)

    def _page_views(self) -> list[torch.Tensor | None]:
        f = self.format
        regions = page_regions(f, self.block_size, self.num_kv_heads, self.head_dim)
        buf = torch.zeros(self.num_blocks, page_bytes(f, self.block_size, self.num_kv_heads, self.head_dim),
                          dtype=torch.uint8, device=self.device)
        views: list[torch.Tensor | None] = []
        for (off, n), tf, scales in zip(regions, (f.k, f.v, f.k, f.v), (False, False, True, True)):
            if n == 0:
                views.append(None)
                continue
            dtype = torch.uint8 if scales else tf.torch_data_dtype
            x = tf.scale_dim(self.head_dim) if scales else tf.payload_dim(self.head_dim)
            views.append(buf[:, off:off + n].view(dtype).view(self.num_blocks, self.num_kv_heads, self.block_size, x))
        return views

    def _allocate_layer(self, page_buffer: bool, g_shape: tuple[int, ...]) -> LayerPools:
        f = self.format
        if page_buffer:
            kd, vd, ks, vs = self._page_views()
        else:
            kd, vd, ks, vs = self._pool(f.k, False), self._pool(f.v, False), self._pool(f.k, True), self._pool(f.v, True)
        uses_g = f.k.uses_global_scale or f.v.uses_global_scale
        g = (lambda: torch.ones(g_shape, dtype=torch.float32, device=self.device)) if uses_g else (lambda: None)
        return LayerPools(kd, vd, ks, vs, g(), g())

    def set_global_scales(self, layer: int, k: torch.Tensor | float, v: torch.Tensor | float) -> None:
        """Set a layer's FP32 global K/V scales (per tensor, or per KV head for a per-head cache)."""
        pools = self.layers[layer]
        require(pools.k_global is not None, Status.INVALID_ARGUMENT,
                f"format {self.format.name} takes no global scales")
        for dst, src in ((pools.k_global, k), (pools.v_global, v)):
            t = torch.as_tensor(src, dtype=torch.float32, device=self.device).reshape(-1)
            require(t.numel() in (1, dst.numel()) and bool(torch.isfinite(t).all() and (t > 0).all()),
                    Status.INVALID_ARGUMENT, f"global scales must be finite, > 0, with 1 or {dst.numel()} entries")
            dst.copy_(t.expand_as(dst))

    # ------------------------------------------------------------ KVX view
    def descriptor(self, layer: int) -> CacheDesc:
        """The layer's KVX cache descriptor (data pools + v1.1 quantization descriptor)."""
        p = self.layers[layer]
        q = quant_desc(self.format, self.head_dim, p.k_scales, p.v_scales, p.k_global, p.v_global)
        return CacheDesc.from_torch(p.k_data, p.v_data, block_size=self.block_size, num_kv_heads=self.num_kv_heads,
                                    head_dim=self.head_dim, k_layout=Layout.HND, v_layout=Layout.HND, quant=q)

    # ------------------------------------------------------------ data path
    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize `[T, H, D]` K/V into the layer's pools at `slot_mapping` (negative slots skipped)."""
        reference.write_kv(self.descriptor(layer), WriteDesc(KvIoDesc(key, value), SlotMapping(slot_mapping)))

    def gather(self, layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int | None = None,
               out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized ragged `[T, H, D]` K/V of each sequence (PACKED `block_table [S, M]`)."""
        max_len = int(seq_lens.max()) if max_seq_len is None and seq_lens.numel() else (max_seq_len or 0)
        io = reference.gather_kv(self.descriptor(layer),
                                 GatherDesc(BlockTable.packed(block_table), SeqLens(seq_lens), max_len),
                                 out_dtype=out_dtype)
        return io.key, io.value

    # ------------------------------------------------------------ accounting
    @property
    def bytes_per_token(self) -> float:
        """K+V bytes per token over all layers (payload + scales, no page padding)."""
        return bytes_per_token(self.format, self.num_kv_heads, self.head_dim, self.num_layers)

    @property
    def nbytes(self) -> int:
        """Bytes the pools occupy."""
        total = 0
        for p in self.layers:
            seen = set()
            for t in (p.k_data, p.v_data, p.k_scales, p.v_scales):
                if t is not None and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
        return total
