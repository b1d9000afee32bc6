"""A transformers `Cache` whose K/V live in a KVX `PagedKVCache` (any format).

Each layer's `update` stores the new post-RoPE K/V with `PagedKVCache.write` (quantize + scatter by
slot mapping into the data and scale pools) and returns what `PagedKVCache.gather` reads back
through the block table for all tokens so far, so attention sees exactly the stored format. Blocks
come from the cache's `BlockAllocator`, one block list per batch row shared by every layer.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvx_core.block_tables import blocks_needed, slot_mapping
from kvx_core.cache import PagedKVCache
from kvx_core.errors import Status, require


class _BlockTable:
    """Per-row block lists of one batch, grown on demand from the paged cache's allocator."""

    def __init__(self, paged: PagedKVCache) -> None:
        self.paged = paged
        self.rows: list[list[int]] = []

    def ensure(self, batch: int, length: int) -> torch.Tensor:
        """Blocks for `length` tokens in each of `batch` rows; returns the PACKED table `[batch, M]`."""
        if not self.rows:
            self.rows = [[] for _ in range(batch)]
        require(len(self.rows) == batch, Status.INVALID_ARGUMENT,
                f"batch size changed from {len(self.rows)} to {batch} inside one cache")
        need = int(blocks_needed(torch.tensor(length), self.paged.block_size))
        for row in self.rows:
            if len(row) < need:
                row.extend(self.paged.allocator.allocate(need - len(row)))
        return torch.tensor(self.rows, dtype=torch.int32, device=self.paged.device)

    def release(self) -> None:
        for row in self.rows:
            self.paged.allocator.free(row)
        self.rows = []


class KvxLayer(CacheLayerMixin):
    """One decoder layer's view of the shared paged cache."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, paged: PagedKVCache, layer: int, table: _BlockTable) -> None:
        super().__init__()
        self.paged, self.layer, self.table = paged, layer, table
        self.num_tokens = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `[B, H, T, D]` K/V and return all stored K/V `[B, H, past + T, D]` read back from KVX."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, t, d = key_states.shape
        start, total = self.num_tokens, self.num_tokens + t
        table = self.table.ensure(b, total)
        seq = torch.arange(b, device=table.device).repeat_interleave(t)
        pos = torch.arange(start, total, device=table.device).repeat(b)
        slots = slot_mapping(table, seq, pos, self.paged.block_size)
        self.paged.write(self.layer, key_states.transpose(1, 2).reshape(b * t, h, d),
                         value_states.transpose(1, 2).reshape(b * t, h, d), slots)
        self.num_tokens = total
        lens = torch.full((b,), total, dtype=torch.int32, device=table.device)
        k, v = self.paged.gather(self.layer, table, lens, out_dtype=key_states.dtype)
        return k.view(b, total, h, d).transpose(1, 2), v.view(b, total, h, d).transpose(1, 2)

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.num_tokens = 0
        self.is_initialized = False


class KvxCache(Cache):
    """`Cache` backed by a `PagedKVCache`; `release()` returns its blocks to the allocator."""

    def __init__(self, paged: PagedKVCache) -> None:
        self.paged = paged
        self._table = _BlockTable(paged)
        super().__init__(layers=[KvxLayer(paged, i, self._table) for i in range(paged.num_layers)])

    def release(self) -> None:
        """Free this cache's blocks (call when the sequence is done)."""
        self._table.release()
        for layer in self.layers:
            layer.reset()
