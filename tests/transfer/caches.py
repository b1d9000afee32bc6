"""Small random KVX paged caches shared by the transfer tests (and the vLLM connector tests, whose environment has no
hypothesis): a cache with tokens written, its descriptors, and a snapshot to assert that a refusal changed nothing."""
from __future__ import annotations

import torch

from kvx_core.cache import PagedKVCache
from kvx_core.transfer import ModelFingerprint

LAYERS, HEADS, DIM = 2, 2, 32
DEVICE = "cpu"
"""Where `_cache` puts its pools: the transfer kernel tests set it to "cuda" on a CUDA machine (their kernels run
there; off CUDA, on the CPU under the Triton interpreter)."""
MODEL = ModelFingerprint("LlamaForCausalLM", LAYERS, HEADS, DIM, {"rope_theta": 10000.0}, "c" * 64, "t" * 64)


def _cache(fmt: str, block_size: int, num_blocks: int, page_buffer: bool = False, seed: int = 0,
           tokens: int = 0) -> tuple[PagedKVCache, torch.Tensor]:
    """A cache with `tokens` random K/V written into randomly chosen blocks, in order -> (cache, slots); the
    sequence's block table is `slots[::block_size] // block_size`."""
    c = PagedKVCache(fmt, num_layers=LAYERS, num_blocks=num_blocks, block_size=block_size, num_kv_heads=HEADS,
                     head_dim=DIM, per_head_global_scale=True, page_buffer=page_buffer, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(num_blocks, generator=g)
    pos = torch.arange(tokens)
    slots = blocks[pos // block_size] * block_size + pos % block_size
    for layer in range(LAYERS):
        if c.layers[layer].k_global is not None:
            c.set_global_scales(layer, (torch.rand(HEADS, generator=g) * 0.01 + 0.002).to(DEVICE),
                                (torch.rand(HEADS, generator=g) * 0.01 + 0.002).to(DEVICE))
        if tokens:
            k = torch.randn(tokens, HEADS, DIM, generator=g) * 0.3
            v = torch.randn(tokens, HEADS, DIM, generator=g) * 0.3
            c.write(layer, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
    return c, slots


def _descs(c: PagedKVCache):
    return [c.descriptor(i) for i in range(LAYERS)]


def _snapshot(c: PagedKVCache) -> list[torch.Tensor]:
    return [t.clone() for p in c.layers for t in (p.k_data, p.v_data, p.k_scales, p.v_scales, p.k_global, p.v_global)
            if t is not None]


def _unchanged(c: PagedKVCache, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(_snapshot(c), before, strict=True))
