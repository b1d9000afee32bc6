"""Dual-pool paged KV cache: per layer a data pool and a scale pool that share block ids.

Pools are HND (`[num_blocks, H, block_size, X]`): payload `X = format.payload_dim(D)` elements,
scales `X = format.scale_dim(D)` bytes. They are either separate allocations or, with
`page_buffer=True`, regions of one byte buffer per layer (each block one page holding
K data | V data | K scales | V scales, as vLLM lays out a page): both are strided views and are
described identically by `descriptor(layer)`. One `BlockAllocator` hands out ids for both pools.

Every argument is checked before anything is allocated or changed: sizes and layer ids are ints
(layer ids in `[0, num_layers)`, no negative indexing), a cache that cannot fit its device's memory
is refused before allocation, and a rejected call leaves the cache as it was (KvxError).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .allocator import BlockAllocator, as_int
from .codec import quant_desc
from .descriptors import (
    BlockTable,
    CacheDesc,
    GatherDesc,
    KvIoDesc,
    SeqLens,
    SlotMapping,
    WriteDesc,
    check_key_center,
    check_key_smoothing,
)
from .enums import Layout, QuantFormat
from .errors import KvxError, Status, require
from .formats import CacheFormat, TensorFormat, get_format
from .ops import dispatch

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
    k_smoothing: torch.Tensor | None = None  # FP32 [H, D] (ops.smoothing), None: keys stored as they are
    k_center: torch.Tensor | None = None  # FP32 [H, D] (ops.smoothing): keys stored as (K - c) / s


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _cache_format(fmt: str | CacheFormat) -> CacheFormat:
    """A `CacheFormat`, given one or its registry name (KvxError for anything else, None included)."""
    return fmt if isinstance(fmt, CacheFormat) else get_format(fmt)


def _geometry(fmt: str | CacheFormat, block_size: int, num_kv_heads: int,
              head_dim: int) -> tuple[CacheFormat, int, int, int]:
    """Checked (format, block_size, num_kv_heads, head_dim): positive ints the format can store."""
    f = _cache_format(fmt)
    bs, h, d = (as_int(v, name, 1) for v, name in ((block_size, "block_size"), (num_kv_heads, "num_kv_heads"),
                                                    (head_dim, "head_dim")))
    f.check_head_dim(d)
    return f, bs, h, d


def bytes_per_token(fmt: str | CacheFormat, num_kv_heads: int, head_dim: int, num_layers: int = 1) -> float:
    """K+V bytes (payload and scales) one token occupies across `num_layers` layers."""
    f, _, h, d = _geometry(fmt, 1, num_kv_heads, head_dim)
    return f.bytes_per_token_head(d) * h * as_int(num_layers, "num_layers", 1)


def capacity_ratio_vs_bf16(fmt: str | CacheFormat, head_dim: int) -> float:
    """How many more tokens than a BF16 cache the same bytes hold (e.g. 3.56 for NVFP4)."""
    return bytes_per_token("bf16", 1, head_dim) / bytes_per_token(fmt, 1, head_dim)


def page_regions(fmt: str | CacheFormat, block_size: int, num_kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """(offset, bytes) of K data, V data, K scales, V scales inside one page."""
    f, block_size, num_kv_heads, head_dim = _geometry(fmt, block_size, num_kv_heads, head_dim)
    sizes = []
    for tf in (f.k, f.v):
        sizes.append(num_kv_heads * block_size * tf.payload_dim(head_dim) * tf.torch_data_dtype.itemsize)
    for tf in (f.k, f.v):
        sizes.append(num_kv_heads * block_size * tf.scale_dim(head_dim))
    out, off = [], 0
    for n in sizes:
        out.append((off, n))
        off = _round_up(off + n, _PAGE_ALIGN)
    return out


def page_bytes(fmt: str | CacheFormat, block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one block (page) of one layer, K and V with their scales, regions 16-byte aligned."""
    off, n = page_regions(fmt, block_size, num_kv_heads, head_dim)[-1]
    return _round_up(off + n, _PAGE_ALIGN)


def blocks_for_budget(fmt: str | CacheFormat, budget_bytes: int, *, num_layers: int, block_size: int,
                      num_kv_heads: int, head_dim: int) -> int:
    """Blocks (per layer) that fit a byte budget covering all layers."""
    budget = as_int(budget_bytes, "budget_bytes", 0)
    return budget // (page_bytes(fmt, block_size, num_kv_heads, head_dim) * as_int(num_layers, "num_layers", 1))


def _usable_device(device: str | torch.device) -> torch.device:
    """`device` as the concrete device (e.g. cuda:0) this process allocates on; KvxError if it cannot."""
    require(isinstance(device, (str, torch.device)), Status.INVALID_ARGUMENT,
            f"device must be a str or torch.device, got {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise KvxError(Status.INVALID_ARGUMENT, f"device {device!r} is not a torch device: {e}") from None
    require(dev.type != "meta", Status.UNSUPPORTED, "a cache needs a device that holds data, not 'meta'")
    try:
        return torch.empty(0, device=dev).device
    except (RuntimeError, AssertionError) as e:  # AssertionError: torch built without that backend
        raise KvxError(Status.UNSUPPORTED, f"device {device!r} is not available here: {e}") from None


def _device_capacity(device: torch.device) -> int:
    """Most bytes a cache on `device` could occupy: the GPU's or the host's physical memory (elsewhere,
    torch's int64 byte-size limit). Checked before allocating, so an impossible size never reaches torch."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            pass
    return 2 ** 63 - 1


class PagedKVCache:
    """A multi-layer paged KV cache in one KVX format, with its block allocator."""

    def __init__(self, fmt: str | CacheFormat, *, num_layers: int, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, device: str | torch.device = "cpu",
                 page_buffer: bool = False, global_scales: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 per_head_global_scale: bool = False) -> None:
        self.format, self.block_size, self.num_kv_heads, self.head_dim = _geometry(fmt, block_size, num_kv_heads,
                                                                                   head_dim)
        self.num_layers = as_int(num_layers, "num_layers", 1)
        self.num_blocks = as_int(num_blocks, "num_blocks", 1)
        for name, flag in (("page_buffer", page_buffer), ("per_head_global_scale", per_head_global_scale)):
            require(isinstance(flag, bool), Status.INVALID_ARGUMENT, f"{name} must be a bool, got {flag!r}")
        self.device = _usable_device(device)
        self._g_shape = (self.num_kv_heads,) if per_head_global_scale else (1,)
        scales = None if global_scales is None else self._checked_global_scales(global_scales)
        need = self._pool_bytes(page_buffer)
        have = _device_capacity(self.device)
        require(need <= have, Status.OUT_OF_RANGE,
                f"{self.num_layers} layers x {self.num_blocks} blocks of {self.format.name} need {need} bytes, "
                f"more than the {have} bytes of {self.device}; size the cache with blocks_for_budget()")
        self.allocator = BlockAllocator(self.num_blocks)
        try:
            self.layers = [self._allocate_layer(page_buffer) for _ in range(self.num_layers)]
        except (RuntimeError, MemoryError) as e:  # the device had less free memory than it has in total
            raise KvxError(Status.OUT_OF_RANGE, f"could not allocate the {need}-byte cache on {self.device}: "
                                                f"{e}; size the cache with blocks_for_budget()") from None
        if scales is not None:
            for pools, (k, v) in zip(self.layers, scales, strict=True):
                pools.k_global.copy_(k)
                pools.v_global.copy_(v)

    # ------------------------------------------------------------ allocation
    def _pool_bytes(self, page_buffer: bool) -> int:
        """Bytes the pools of all layers occupy (page padding included for a page buffer)."""
        args = (self.format, self.block_size, self.num_kv_heads, self.head_dim)
        per_block = page_bytes(*args) if page_buffer else sum(n for _, n in page_regions(*args))
        return per_block * self.num_blocks * self.num_layers

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
        for (off, n), tf, scales in zip(regions, (f.k, f.v, f.k, f.v), (False, False, True, True), strict=True):
            if n == 0:
                views.append(None)
                continue
            dtype = torch.uint8 if scales else tf.torch_data_dtype
            x = tf.scale_dim(self.head_dim) if scales else tf.payload_dim(self.head_dim)
            views.append(buf[:, off:off + n].view(dtype).view(self.num_blocks, self.num_kv_heads, self.block_size, x))
        return views

    def _allocate_layer(self, page_buffer: bool) -> LayerPools:
        f = self.format
        if page_buffer:
            kd, vd, ks, vs = self._page_views()
        else:
            kd, vd = self._pool(f.k, False), self._pool(f.v, False)
            ks, vs = self._pool(f.k, True), self._pool(f.v, True)
        return LayerPools(kd, vd, ks, vs, self._global_pool(), self._global_pool())

    def _global_pool(self) -> torch.Tensor | None:
        """A layer's FP32 global scales (all ones until set), None for formats without them."""
        if not self.format.uses_global_scale:
            return None
        return torch.ones(self._g_shape, dtype=torch.float32, device=self.device)

    # ------------------------------------------------------------ global scales
    def _checked_scale(self, tf: TensorFormat, src: torch.Tensor | float, which: str) -> torch.Tensor:
        """One FP32 global scale checked (finite, > 0, shape [] / [1] / [H] as this cache holds), on the
        cache's device (a tensor elsewhere is copied) and shaped like the cache's scale tensor."""
        try:
            g = tf._global_scale(src, self.num_kv_heads, self.device).reshape(-1)
        except KvxError as e:
            raise KvxError(e.status, f"{which} global scale: {e.message}") from None
        require(g.numel() in (1, self._g_shape[0]), Status.INVALID_ARGUMENT,
                f"{which} global scale has {g.numel()} entries; this cache holds one per tensor "
                "(create it with per_head_global_scale=True for one per KV head)")
        return g.expand(self._g_shape)

    def _checked_scale_pair(self, k: torch.Tensor | float,
                            v: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
        """Both of a layer's global scales checked, so a bad V scale cannot leave a new K scale behind."""
        f = self.format
        require(f.uses_global_scale, Status.INVALID_ARGUMENT,
                f"format {f.name} takes no global scales")
        return self._checked_scale(f.k, k, "K"), self._checked_scale(f.v, v, "V")

    def _checked_global_scales(self, global_scales: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The constructor's per-layer (k, v) global scales, every layer checked before any is stored."""
        pairs = list(global_scales) if isinstance(global_scales, Sequence) else None
        require(pairs is not None and len(pairs) == self.num_layers, Status.INVALID_ARGUMENT,
                f"global_scales must be a sequence of one (k, v) pair per layer ({self.num_layers}), "
                f"got {global_scales!r}")
        for pair in pairs:
            require(isinstance(pair, Sequence) and len(pair) == 2, Status.INVALID_ARGUMENT,
                    f"each global_scales entry must be a (k, v) pair, got {pair!r}")
        return [self._checked_scale_pair(k, v) for k, v in pairs]

    def set_global_scales(self, layer: int, k: torch.Tensor | float, v: torch.Tensor | float) -> None:
        """Set a layer's FP32 global K/V scales (per tensor, or per KV head for a per-head cache);
        both are checked before either is stored."""
        pools = self._layer(layer)
        gk, gv = self._checked_scale_pair(k, v)
        pools.k_global.copy_(gk)
        pools.v_global.copy_(gv)

    def set_key_smoothing(self, layer: int, s: torch.Tensor | None) -> None:
        """Set (or clear, None) a layer's per-channel key smoothing `[num_kv_heads, head_dim]` (`ops.smoothing`:
        keys are stored divided by it, readers and attention undo it). Set it before the layer holds keys: keys
        written before were stored under the old vector. Quantized formats only."""
        self._layer(layer).k_smoothing = self._key_vector(s, "smoothing", check_key_smoothing)

    def set_key_center(self, layer: int, c: torch.Tensor | None) -> None:
        """Set (or clear, None) a layer's per-channel key centering `[num_kv_heads, head_dim]` (`ops.smoothing`:
        keys are stored as `(K - c) / s`, readers add c back, attention is shift invariant). Set it before the layer
        holds keys. Quantized formats only."""
        self._layer(layer).k_center = self._key_vector(c, "centering", check_key_center)

    def _key_vector(self, v: torch.Tensor | None, what: str, check) -> torch.Tensor | None:
        """A checked FP32 copy of a key smoothing / centering vector on the pools' device (None stays None)."""
        if v is None:
            return None
        require(self.format.quant != QuantFormat.NONE, Status.INVALID_ARGUMENT,
                f"format {self.format.name} is not quantized: key {what} has nothing to flatten")
        require(isinstance(v, torch.Tensor), Status.INVALID_ARGUMENT, f"key {what} must be a tensor")
        v = v.detach().to(device=self.device, dtype=torch.float32).contiguous()
        check(v, self.num_kv_heads, self.head_dim, self.device)
        return v

    # ------------------------------------------------------------ KVX view
    def _layer(self, layer: int) -> LayerPools:
        """The pools of `layer`, an int in `[0, num_layers)` (no negative indexing: -1 is a caller bug)."""
        i = as_int(layer, "layer")
        require(0 <= i < self.num_layers, Status.OUT_OF_RANGE, f"layer {i} out of range [0, {self.num_layers})")
        return self.layers[i]

    def descriptor(self, layer: int) -> CacheDesc:
        """The layer's KVX cache descriptor (data pools + v1.1 quantization descriptor)."""
        p = self._layer(layer)
        q = quant_desc(self.format, self.head_dim, p.k_scales, p.v_scales, p.k_global, p.v_global)
        if q is not None:
            q.k_smoothing, q.k_center = p.k_smoothing, p.k_center
        return CacheDesc.from_torch(p.k_data, p.v_data, block_size=self.block_size, num_kv_heads=self.num_kv_heads,
                                    head_dim=self.head_dim, k_layout=Layout.HND, v_layout=Layout.HND, quant=q)

    # ------------------------------------------------------------ data path
    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize `[T, H, D]` K/V into the layer's pools at `slot_mapping` (negative slots skipped)."""
        cache = self.descriptor(layer)
        _require_tensors(key=key, value=value, slot_mapping=slot_mapping)
        dispatch.write_kv(cache, WriteDesc(KvIoDesc(key, value), SlotMapping(slot_mapping)))

    def gather(self, layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int | None = None,
               out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized ragged `[T, H, D]` K/V of each sequence (PACKED `block_table [S, M]`)."""
        cache = self.descriptor(layer)
        _require_tensors(block_table=block_table, seq_lens=seq_lens)
        require(seq_lens.dtype in (torch.int32, torch.int64), Status.INVALID_ARGUMENT,
                f"seq_lens must be int32 or int64, got {seq_lens.dtype}")  # before seq_lens.max() below
        require(isinstance(out_dtype, torch.dtype), Status.INVALID_ARGUMENT,
                f"out_dtype must be a torch.dtype, got {out_dtype!r}")
        if max_seq_len is None:
            max_len = int(seq_lens.max()) if seq_lens.numel() else 0
        else:
            max_len = as_int(max_seq_len, "max_seq_len", 0)
        io = dispatch.gather_kv(cache, GatherDesc(BlockTable.packed(block_table), SeqLens(seq_lens), max_len),
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


def _require_tensors(**tensors: object) -> None:
    """KvxError naming the first argument that is not a torch.Tensor."""
    for name, t in tensors.items():
        require(isinstance(t, torch.Tensor), Status.INVALID_ARGUMENT,
                f"{name} must be a torch.Tensor, got {type(t).__name__}")
