"""Test fixtures for the paged-cache tests: a ragged batch written into a `PagedKVCache` through its own
allocator (scattered block ids, a two-step write with interleaved -1 slots), plus the record of what
was written so an oracle can recompute everything independently."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvx_core.cache import PagedKVCache
from kvx_core.descriptors import BlockTable, SeqLens
from kvx_core.formats import get_format

GARBAGE = 1.0e4  # K/V of tokens with slot -1: they must never reach the pools


@dataclass
class Batch:
    cache: PagedKVCache
    layer: int
    lens: list[int]
    blocks: list[list[int]]  # per sequence, block of token p is blocks[p // block_size]
    table: torch.Tensor  # PACKED [S, max_blocks] int32, padded with -1
    k: list[torch.Tensor]  # per sequence, written K [n, H, D] (FP32, model domain)
    v: list[torch.Tensor]
    k_global: torch.Tensor | None  # global scales the test set (None: the format has none)
    v_global: torch.Tensor | None

    @property
    def block_table(self) -> BlockTable:
        return BlockTable.packed(self.table)

    @property
    def seq_lens(self) -> SeqLens:
        return SeqLens(torch.tensor(self.lens, dtype=torch.int32))


def _global(uses: bool, heads: int, per_head: bool, gen: torch.Generator) -> torch.Tensor | None:
    if not uses:
        return None
    return 0.3 + 1.2 * torch.rand(heads if per_head else 1, generator=gen)


def make_batch(fmt_name: str, lens: list[int], *, num_kv_heads: int, head_dim: int, block_size: int,
               page_buffer: bool = False, per_head_global: bool = False, random_global: bool = True,
               seed: int = 0, num_layers: int = 2, layer: int = 1, extra_blocks: int = 3) -> Batch:
    """Write a ragged batch of random-normal K/V (same data for the same seed, whatever the format)."""
    gen = torch.Generator().manual_seed(seed)
    ks = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in lens]
    vs = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in lens]
    gen2 = torch.Generator().manual_seed(seed + 1)
    fmt = get_format(fmt_name)
    needed = [math.ceil(n / block_size) for n in lens]
    cache = PagedKVCache(fmt, num_layers=num_layers, num_blocks=sum(needed) + extra_blocks, block_size=block_size,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, page_buffer=page_buffer,
                         per_head_global_scale=per_head_global)
    kg = vg = None
    if random_global and (fmt.k.uses_global_scale or fmt.v.uses_global_scale):
        kg = _global(fmt.k.uses_global_scale, num_kv_heads, per_head_global, gen2)
        vg = _global(fmt.v.uses_global_scale, num_kv_heads, per_head_global, gen2)
        cache.set_global_scales(layer, kg if kg is not None else 1.0, vg if vg is not None else 1.0)
    ids = cache.allocator.allocate(sum(needed))
    ids = [ids[i] for i in torch.randperm(len(ids), generator=gen2).tolist()]  # scattered block ids
    blocks, start = [], 0
    for n in needed:
        blocks.append(ids[start:start + n])
        start += n
    width = max(max(needed, default=0), 1)
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    for b, row in enumerate(blocks):
        table[b, :len(row)] = torch.tensor(row, dtype=torch.int32)
    # flat token list (sequence order), one -1 garbage token after every third real token
    rows_k, rows_v, slots = [], [], []
    for b, n in enumerate(lens):
        for p in range(n):
            rows_k.append(ks[b][p])
            rows_v.append(vs[b][p])
            slots.append(blocks[b][p // block_size] * block_size + p % block_size)
            if len(slots) % 4 == 3:
                rows_k.append(torch.full((num_kv_heads, head_dim), GARBAGE))
                rows_v.append(torch.full((num_kv_heads, head_dim), -GARBAGE))
                slots.append(-1)
    if slots:
        kk, vv, ss = torch.stack(rows_k), torch.stack(rows_v), torch.tensor(slots, dtype=torch.int64)
        half = len(slots) // 2  # two write calls, like a prefill then an extend
        cache.write(layer, kk[:half], vv[:half], ss[:half])
        cache.write(layer, kk[half:], vv[half:], ss[half:])
    return Batch(cache, layer, list(lens), blocks, table, ks, vs,
                 kg if kg is not None else (torch.ones(1) if fmt.k.uses_global_scale else None),
                 vg if vg is not None else (torch.ones(1) if fmt.v.uses_global_scale else None))
