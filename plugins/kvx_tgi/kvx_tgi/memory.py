"""Warmup sizing: TGI counts KV blocks at its own bytes per block; KVX blocks are smaller.

`FlashCausalLM.warmup` allocates a cache for the warmup batch (`init_kv_cache`), runs it, then sets
`num_blocks = get_free_memory(...) // (layers * BLOCK_SIZE * heads * head_dim * 2 * element_size)
+ warmup_blocks` (TGI's bytes per block, for its cache dtype). The backend wraps two names of
`flash_causal_lm` and leaves the formula alone:
- `init_kv_cache` records the geometry TGI asks for (layers, blocks, heads, head_dim, dtype);
- `get_free_memory` reports free memory in TGI's units: the number of KVX blocks that fit (at the format's
  real bytes per block: payload + scales, `kvx_core.cache.page_regions`) times TGI's bytes per block.
So TGI's own formula yields the KVX block count, and a 4-bit cache holds ~3.5x the blocks of BF16 in the same
memory. `KVX_KV_CACHE_MEMORY` caps the cache at that many bytes in total (warmup blocks included; on CPU
TGI's rule takes 95% of the available RAM).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvx_core.cache import page_regions

from . import config


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    num_blocks: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


_last: Geometry | None = None


def kvx_block_bytes(run: config.RunConfig, g: Geometry) -> int:
    """Bytes one block of all layers takes in the KVX format (data + scale pools)."""
    per_layer = sum(n for _, n in page_regions(run.format, run.block_size, g.num_kv_heads, g.head_dim))
    return g.num_layers * per_layer


def tgi_block_bytes(run: config.RunConfig, g: Geometry) -> int:
    """Bytes TGI assumes one block of all layers takes (K and V at its cache dtype's element size)."""
    es = torch.tensor([], dtype=g.dtype).element_size()
    return g.num_layers * run.block_size * g.num_kv_heads * g.head_dim * 2 * es


def blocks_to_add(run: config.RunConfig, g: Geometry, free_bytes: int) -> int:
    """KVX blocks TGI should add to the warmup cache's `g.num_blocks`."""
    per_block = kvx_block_bytes(run, g)
    blocks = int(free_bytes) // per_block
    if run.cache_memory is not None:
        blocks = min(blocks, run.cache_memory // per_block - g.num_blocks)
    return max(blocks, 0)


def wrap_init_kv_cache(original):
    def init_kv_cache(self, num_blocks, num_layers, num_heads, head_size, dtype, device):
        global _last
        _last = Geometry(int(num_layers), int(num_blocks), int(num_heads), int(head_size), dtype)
        return original(self, num_blocks, num_layers, num_heads, head_size, dtype, device)

    init_kv_cache.__doc__ = original.__doc__
    init_kv_cache.kvx_wrapped = original
    return init_kv_cache


def wrap_get_free_memory(original):
    def get_free_memory(device, memory_fraction):
        free = original(device, memory_fraction)
        if _last is None:
            return free
        run = config.current()
        return blocks_to_add(run, _last, free) * tgi_block_bytes(run, _last)

    get_free_memory.kvx_wrapped = original
    return get_free_memory


def enable() -> None:
    """Wrap `flash_causal_lm`'s names (after `text_generation_server.models` is imported)."""
    from text_generation_server.models import flash_causal_lm

    cls = flash_causal_lm.FlashCausalLM
    if not hasattr(cls.init_kv_cache, "kvx_wrapped"):
        cls.init_kv_cache = wrap_init_kv_cache(cls.init_kv_cache)
    if not hasattr(flash_causal_lm.get_free_memory, "kvx_wrapped"):
        flash_causal_lm.get_free_memory = wrap_get_free_memory(flash_causal_lm.get_free_memory)
