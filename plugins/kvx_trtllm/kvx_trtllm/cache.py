"""A whole TensorRT-LLM KV cache as KVX descriptors: every layer over its pool, addressed by TRT-LLM's own tables.

TRT-LLM facts this follows (`cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp`, `thop/attentionOp.cpp`,
`kernels/kvCacheUtils.h`; details and commits in `kvx_adapters/trtllm.py`):
- pools `[num_blocks, layers_in_pool, kv_factor, H*T*D]` (`get_unique_primary_pool()` for one pool), a pinned
  host secondary pool of the same layout; `kv_cache_pool_pointers [num_pools, 2]` = (primary, secondary) bases;
  `kv_cache_pool_mapping [num_layers, 2]` = (pool index, layer within the pool);
- offsets `[num_pools, seqs * beams, 2 (K, V), max_blocks]` int32 `KVCacheIndex` (bit 31 = secondary pool, -1 =
  null) holding `mem_idx * layers_in_pool * kv_factor + kv`; a layer's kernels read from the pool base plus
  `layer_in_pool * kv_factor * bytes_per_block`, so the table is shared by every layer of a pool;
- FP8 caches: one fp32 `kv_scale_quant_orig` per layer (x = fp8 * s, for K and V), `kv_scale_orig_quant = 1/s`.

`describe_trtllm_cache` turns those into one `TrtllmLayer` per model layer: a KVX `CacheDesc` whose K and V are the
layer's `[n, H, T, D]` block array from its pool pointer (zero copy) and the pool's KV_OFFSETS `BlockTable`, the
raw TRT-LLM offsets unchanged. `gather_kv` / `paged_decode` / `paged_prefill` of `kvx_core.ops.dispatch` take them
as they are. `layer_views` gives the same memory as per-layer strided K/V views with PACKED block ids (memory-pool
block indices), where slot-mapped writes and bundle export / import apply.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvx_adapters.trtllm import from_trtllm_layer, from_trtllm_offsets, from_trtllm_pool
from kvx_core.codec import quant_desc
from kvx_core.descriptors import BlockTable, CacheDesc
from kvx_core.errors import KvxError, Status, require
from kvx_core.formats import get_format

_FP8 = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
_PLAIN = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class TrtllmLayer:
    """One model layer of a TRT-LLM cache: its KVX cache over the layer's pool pointer and its pool's table."""

    cache: CacheDesc
    table: BlockTable  # the pool's KV_OFFSETS table (raw TRT-LLM offsets)
    pool: int
    layer_in_pool: int


def _as_list(x) -> list:
    if x is None:
        return []
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _per_pool(value: int | Sequence[int], num_pools: int, what: str) -> list[int]:
    vals = [int(value)] * num_pools if isinstance(value, int) else [int(v) for v in value]
    require(len(vals) == num_pools, Status.INVALID_ARGUMENT, f"{what}: {len(vals)} values for {num_pools} pools")
    return vals


def _mapping(pool_mapping: torch.Tensor | None, pools: list[torch.Tensor]) -> list[tuple[int, int]]:
    """`kv_cache_pool_mapping [num_layers, 2]` as (pool, layer_in_pool) pairs (one pool: layers in order)."""
    if pool_mapping is None:
        require(len(pools) == 1, Status.INVALID_ARGUMENT, "several pools need kv_cache_pool_mapping [num_layers, 2]")
        return [(0, i) for i in range(pools[0].shape[1])]
    m = torch.as_tensor(pool_mapping)
    require(m.dim() == 2 and m.shape[1] == 2 and not m.is_floating_point(), Status.INVALID_ARGUMENT,
            f"kv_cache_pool_mapping must be an integer [num_layers, 2] tensor, got {tuple(m.shape)} {m.dtype}")
    pairs = [(int(p), int(li)) for p, li in m.tolist()]
    for layer, (p, li) in enumerate(pairs):
        require(0 <= p < len(pools) and 0 <= li < pools[p].shape[1], Status.INVALID_ARGUMENT,
                f"kv_cache_pool_mapping[{layer}] = ({p}, {li}) names no layer of the {len(pools)} pools")
    require(len(set(pairs)) == len(pairs), Status.INVALID_ARGUMENT,
            "kv_cache_pool_mapping maps two layers to one (pool, layer_in_pool)")
    return pairs


def _fp8_scales(kv_scale_quant_orig, kv_scale_orig_quant, num_layers: int) -> torch.Tensor:
    """Per-layer `s` (x = fp8 * s) from TRT-LLM's pair of FP8 KV scales; KvxError when missing or inconsistent."""
    require(kv_scale_quant_orig is not None, Status.INVALID_ARGUMENT,
            "an FP8 TRT-LLM cache needs kv_scale_quant_orig (one fp32 scale per layer; 1.0 for unit scales)")
    s = torch.as_tensor(kv_scale_quant_orig, dtype=torch.float32).reshape(-1).cpu()
    require(s.numel() == num_layers, Status.INVALID_ARGUMENT,
            f"kv_scale_quant_orig has {s.numel()} values for {num_layers} layers")
    require(bool(torch.isfinite(s).all() and (s > 0).all()), Status.INVALID_ARGUMENT,
            f"kv_scale_quant_orig must be finite and positive, got {s.tolist()}")
    if kv_scale_orig_quant is not None:
        inv = torch.as_tensor(kv_scale_orig_quant, dtype=torch.float32).reshape(-1).cpu()
        require(inv.numel() == num_layers and torch.allclose(inv * s, torch.ones_like(s), rtol=1e-6, atol=0),
                Status.INVALID_ARGUMENT, "kv_scale_orig_quant must be 1 / kv_scale_quant_orig per layer")
    return s


def _check_pointers(pool_pointers, pools: list[torch.Tensor], secondary: list[torch.Tensor | None]) -> None:
    """`kv_cache_pool_pointers [num_pools, 2]` must be the given pools' base addresses (0: no secondary pool)."""
    if pool_pointers is None:
        return
    ptr = torch.as_tensor(pool_pointers).cpu()
    require(tuple(ptr.shape) == (len(pools), 2), Status.INVALID_ARGUMENT,
            f"kv_cache_pool_pointers must be [num_pools={len(pools)}, 2], got {tuple(ptr.shape)} (NVFP4's "
            "[num_pools, 2, 2] with block-scale pools is not served)")
    for p, (prim, sec) in enumerate(zip(pools, secondary)):
        want = (prim.data_ptr(), 0 if sec is None else sec.data_ptr())
        got = (int(ptr[p, 0]), int(ptr[p, 1]))
        require(got == want, Status.INVALID_ARGUMENT,
                f"kv_cache_pool_pointers[{p}] = {got} are not the given pools' base addresses {want}")


def describe_trtllm_cache(pools: torch.Tensor | Sequence[torch.Tensor], offsets: torch.Tensor, *,
                          tokens_per_block: int, num_kv_heads: int | Sequence[int], head_dim: int,
                          pool_mapping: torch.Tensor | None = None,
                          secondary_pools: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
                          pool_pointers: torch.Tensor | None = None, kv_factor: int = 2, beam_width: int = 1,
                          kv_scale_quant_orig: torch.Tensor | Sequence[float] | None = None,
                          kv_scale_orig_quant: torch.Tensor | Sequence[float] | None = None) -> list[TrtllmLayer]:
    """Every layer of a TRT-LLM KV cache as a KVX cache + KV_OFFSETS table (zero copy), in model layer order.

    `pools[p]`: pool p `[num_blocks, layers_in_pool, kv_factor, H*T*D]` in the cache dtype (bf16 / fp16 / fp32 /
    fp8); `offsets`: `kv_cache_block_offsets [num_pools, seqs * beam_width, 2, max_blocks]` int32 (one pool:
    `[seqs * beam_width, 2, max_blocks]` too); `pool_mapping`: `kv_cache_pool_mapping [num_layers, 2]` (default:
    one pool, its layers in order); `num_kv_heads`: one value or one per pool. FP8 pools need
    `kv_scale_quant_orig` (per layer; `kv_scale_orig_quant`, when given, is checked to be its inverse), which
    becomes the KVX FP8 per-head global scale of K and V. K-only / MLA pools (`kv_factor` 1) and NVFP4 pools are
    refused (UNSUPPORTED) with the reason.
    """
    prim = _as_list(pools)
    require(len(prim) > 0, Status.INVALID_ARGUMENT, "describe_trtllm_cache: no pool given")
    require(kv_factor == 2, Status.UNSUPPORTED,
            f"kv_factor {kv_factor}: K-only / MLA TRT-LLM caches hold one latent tensor per token, not K and V; "
            "KVX describes K/V caches")
    sec = _as_list(secondary_pools) or [None] * len(prim)
    require(len(sec) == len(prim), Status.INVALID_ARGUMENT, f"{len(sec)} secondary pools for {len(prim)} pools")
    for p, t in enumerate(prim):
        require(isinstance(t, torch.Tensor) and t.dim() == 4, Status.INVALID_ARGUMENT,
                f"pool {p} must be [num_blocks, layers_in_pool, kv_factor, H*T*D], got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        require(t.dtype in _PLAIN or t.dtype in _FP8, Status.UNSUPPORTED,
                f"pool {p} dtype {t.dtype}: served are bf16, fp16, fp32 and fp8 TRT-LLM caches (NVFP4 KV with its "
                "block-scale pools is not served yet)")
    require(len({t.dtype for t in prim}) == 1, Status.INVALID_ARGUMENT, "the pools hold different dtypes")
    heads = _per_pool(num_kv_heads, len(prim), "num_kv_heads")
    _check_pointers(pool_pointers, prim, sec)
    mapping = _mapping(pool_mapping, prim)
    o = torch.as_tensor(offsets)
    if o.dim() == 3:
        require(len(prim) == 1, Status.INVALID_ARGUMENT, "offsets of several pools must be [num_pools, rows, 2, M]")
        o = o.unsqueeze(0)
    require(o.dim() == 4 and o.shape[0] == len(prim), Status.INVALID_ARGUMENT,
            f"offsets must be [num_pools={len(prim)}, seqs * beams, 2, max_blocks], got {tuple(o.shape)}")
    tables = [from_trtllm_offsets(o[p], beam_width=beam_width) for p in range(len(prim))]
    fp8 = _FP8.get(prim[0].dtype)
    scales = _fp8_scales(kv_scale_quant_orig, kv_scale_orig_quant, len(mapping)) if fp8 else None
    layers = []
    for layer, (p, li) in enumerate(mapping):
        c = from_trtllm_pool(prim[p], tokens_per_block=tokens_per_block, num_kv_heads=heads[p], head_dim=head_dim,
                             layer=li, kv_factor=kv_factor, secondary_pool=sec[p])
        if fp8:
            g = scales[layer].expand(heads[p]).to(prim[p].device).contiguous()
            q = quant_desc(get_format(fp8), head_dim, None, None, g, g.clone())
            c = CacheDesc.from_torch(c.k.tensor, c.v.tensor, block_size=c.block_size, num_kv_heads=c.num_kv_heads,
                                     head_dim=head_dim, k_layout=c.k.layout, v_layout=c.v.layout, pool=c.pool,
                                     quant=q)
        layers.append(TrtllmLayer(c, tables[p], p, li))
    return layers


def layer_views(pool: torch.Tensor, *, tokens_per_block: int, num_kv_heads: int, head_dim: int) -> list[CacheDesc]:
    """Each layer of one primary pool `[num_blocks, num_layers, 2, H*T*D]` as strided HND K/V views (zero copy):
    block ids are memory-pool block indices and slot = block * tokens_per_block + position, as vLLM's (what the
    bundle handoff reads and writes). bf16 / fp16 / fp32 pools (an FP8 pool's scales are not part of the pool)."""
    require(isinstance(pool, torch.Tensor) and pool.dim() == 4, Status.INVALID_ARGUMENT,
            f"a TRT-LLM primary pool is [num_blocks, num_layers, kv_factor, H*T*D], got "
            f"{tuple(pool.shape) if isinstance(pool, torch.Tensor) else type(pool).__name__}")
    if pool.dtype not in _PLAIN:
        raise KvxError(Status.UNSUPPORTED, f"pool dtype {pool.dtype}: per-layer views serve bf16 / fp16 / fp32 pools")
    require(pool.shape[2] == 2, Status.UNSUPPORTED,
            f"kv_factor {pool.shape[2]}: K-only / MLA TRT-LLM caches hold no separate V")
    return [from_trtllm_layer(pool, i, tokens_per_block=tokens_per_block, num_kv_heads=num_kv_heads,
                              head_dim=head_dim) for i in range(pool.shape[1])]
